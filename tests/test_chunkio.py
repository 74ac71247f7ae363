"""The image writer's storage side (gpuos_tools/image/chunkio.py and ImageWriter's use of it):
checksums chosen by speed, O_DIRECT chunk files from aligned and unaligned sources, the writer's
own threads, and queued (wait=False) buffers."""

from __future__ import annotations

import errno
import mmap
import os
import random
import threading
from pathlib import Path

import pytest

from gpuos_tools.image import chunkio
from gpuos_tools.image import ImageError, ImageWriter, open_image, verify

CS = 64 << 10


def rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def test_checksums_known_values() -> None:
    assert chunkio.CHECKSUMS["crc32"](b"abc") == "crc32:352441c2"
    assert chunkio.CHECKSUMS["sha256"](b"abc").startswith("sha256:ba7816bf")
    if chunkio.available("xxh3"):
        import xxhash

        assert chunkio.CHECKSUMS["xxh3"](b"abc") == "xxh3:" + xxhash.xxh3_128_hexdigest(b"abc")


def test_auto_picks_the_fastest_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunkio, "_speeds", {"xxh3": 20.0, "crc32": 4.0})
    monkeypatch.setattr(chunkio, "available", lambda name: name in ("xxh3", "crc32", "sha256"))
    assert chunkio.pick_checksum("auto") == "xxh3"
    monkeypatch.setattr(chunkio, "_speeds", {"xxh3": 2.0, "crc32": 4.0})
    assert chunkio.pick_checksum("auto") == "crc32"
    assert chunkio.pick_checksum("sha256") == "sha256"  # only ever by name
    with pytest.raises(ValueError, match="unknown checksum"):
        chunkio.pick_checksum("md5")


def test_auto_without_xxhash_is_crc32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunkio, "_speeds", {})
    monkeypatch.setattr(chunkio, "_have_xxhash", lambda: False)
    assert chunkio.pick_checksum("auto") == "crc32"
    with pytest.raises(ValueError, match="needs the xxhash package"):
        chunkio.pick_checksum("xxh3")


def test_measure_really_times(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunkio, "_speeds", {})
    speeds = chunkio.measure(("crc32",), nbytes=1 << 20, repeat=1)
    assert set(speeds) == {"crc32"} and speeds["crc32"] > 0.01


def test_tmpfs_is_not_written_with_o_direct() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    info = chunkio.fs_info("/dev/shm")
    assert info.fstype == "tmpfs" and not info.direct and "memory" in info.why
    assert not chunkio.fs_info("/dev/shm", "off").direct


@pytest.mark.parametrize("offset,length", [(0, 5 * 4096), (0, 5 * 4096 + 77), (512, 3 * 4096 + 1),
                                            (3, 2 * 4096), (0, 100), (0, 0)])
def test_direct_chunk_files_hold_the_bytes(tmp_path: Path, offset: int, length: int) -> None:
    src = mmap.mmap(-1, 1 << 20)  # page-aligned: offsets make aligned and unaligned sources
    src[:] = rand(1 << 20, offset + length)
    view = memoryview(src)[offset:offset + length]
    path = tmp_path / "c"
    used = chunkio.write_chunk_file(str(path), view, sync=True, direct=chunkio.fs_info(str(tmp_path)).direct)
    assert path.read_bytes() == bytes(view)
    assert (path.stat().st_mode & 0o777) == 0o600
    if length < chunkio.DIRECT_ALIGN:
        assert not used  # nothing aligned to write directly
    with pytest.raises(FileExistsError):  # never overwrites
        chunkio.write_chunk_file(str(path), view, sync=False, direct=False)


def test_a_refused_o_direct_falls_back_to_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(fd: int, view: memoryview) -> int:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(chunkio, "_write_direct", refuse)
    data = rand(3 * 4096 + 5, 9)
    assert chunkio.write_chunk_file(str(tmp_path / "c"), data, sync=True, direct=True) is False
    assert (tmp_path / "c").read_bytes() == data


def test_a_failed_chunk_file_is_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fd: int, view: memoryview) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(chunkio, "_write_all", broken)
    with pytest.raises(OSError, match="No space"):
        chunkio.write_chunk_file(str(tmp_path / "c"), b"x" * 10, sync=False, direct=False)
    assert not (tmp_path / "c").exists()


def test_workers_run_everything_and_report_failures() -> None:
    w = chunkio.Workers(3)
    seen: list[int] = []
    lock = threading.Lock()

    def job(i: int) -> int:
        with lock:
            seen.append(i)
        if i == 7:
            raise ValueError("seven")
        return i * i

    futures = [w.submit(job, i) for i in range(20)]
    assert [f.result() for f in futures if f is not futures[7]] == [i * i for i in range(20) if i != 7]
    with pytest.raises(ValueError, match="seven"):
        futures[7].result()
    w.shutdown()
    assert sorted(seen) == list(range(20))
    with pytest.raises(RuntimeError):
        w.submit(job, 1)


@pytest.mark.parametrize("checksum", ["auto", "crc32", "sha256", "xxh3"])
def test_queued_buffers_make_a_sound_image(tmp_path: Path, checksum: str) -> None:
    if checksum == "xxh3" and not chunkio.available("xxh3"):
        pytest.skip("xxhash not installed")
    bufs = {i: rand(CS * i + 4096 * i + 3 * i, i) for i in range(1, 6)}
    with ImageWriter(tmp_path / "im", {"t": 1}, chunk_size=CS, checksum=checksum, threads=3) as w:
        for i, data in bufs.items():
            w.add(i, (1 << 32) * i, len(data), data, wait=False, kind="alloc")  # apart: buffers never overlap
        summary = w.commit()
        progress = w.progress()
    assert progress["written"] == progress["queued"] == sum(map(len, bufs.values()))
    im = open_image(tmp_path / "im")
    assert im.manifest["checksum"] == (chunkio.pick_checksum("auto") if checksum == "auto" else checksum)
    assert summary["bytes"] == sum(map(len, bufs.values()))
    for i, data in bufs.items():
        assert im.read(i) == data
    assert verify(tmp_path / "im") == []


def test_a_failing_chunk_aborts_a_queued_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = chunkio.write_chunk_file

    def flaky(path: str, data, *, sync: bool, direct: bool) -> bool:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(5, "Input/output error")
        return real(path, data, sync=sync, direct=direct)

    monkeypatch.setattr(chunkio, "write_chunk_file", flaky)
    w = ImageWriter(tmp_path / "im", {}, chunk_size=CS, threads=2)
    with pytest.raises(ImageError, match="Input/output error"):
        with w:
            w.add(1, 0, 4 * CS, rand(4 * CS, 1), wait=False)
            w.commit()
    assert os.listdir(tmp_path) == []  # nothing visible, no temp left


def _probe_watching(monkeypatch: pytest.MonkeyPatch, directory: Path) -> tuple[str | None, list[list[str]]]:
    """Run the O_DIRECT probe in ``directory``, listing the directory at the moment it writes."""
    seen: list[list[str]] = []
    write = os.write

    def spy(fd: int, data) -> int:  # noqa: ANN001
        seen.append(sorted(os.listdir(directory)))
        return write(fd, data)

    monkeypatch.setattr(chunkio.os, "write", spy)
    try:
        return chunkio._probe_direct(str(directory)), seen
    finally:
        monkeypatch.setattr(chunkio.os, "write", write)


def test_the_direct_probe_leaves_no_name_a_kill_could_strand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's file has no name while it writes (a SIGKILL then leaves nothing behind), and
    nothing after it."""
    why, seen = _probe_watching(monkeypatch, tmp_path)
    assert seen == [[]], seen
    assert os.listdir(tmp_path) == []
    if why is not None:  # a filesystem that refuses O_DIRECT says why, in words
        assert "O_DIRECT" in why


def test_without_unnamed_files_the_probe_writes_inside_a_temp_directory_the_cleaner_knows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuos_tools.image.layout import clean_stale_temps

    opened = os.open

    def no_tmpfile(path, flags, *args):  # noqa: ANN001, ANN002
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return opened(path, flags, *args)

    monkeypatch.setattr(chunkio.os, "open", no_tmpfile)
    why, seen = _probe_watching(monkeypatch, tmp_path)
    monkeypatch.setattr(chunkio.os, "open", opened)
    assert len(seen) == 1 and len(seen[0]) == 1, seen
    holder = seen[0][0]
    assert holder.startswith(f".gpuos-direct-probe.{os.getpid()}.") and holder.endswith(".tmp")
    assert os.listdir(tmp_path) == []  # removed after the probe
    # had the prober died there, the next writer's clean-up would have removed it
    dead = tmp_path / holder.replace(f".{os.getpid()}.", ".999999999.")
    dead.mkdir()
    (dead / "probe").write_bytes(b"x")
    assert clean_stale_temps(tmp_path) == [str(dead)]
    if why is not None:
        assert "O_DIRECT" in why
