"""The image format of the agent path (gpuos_tools.image) and its commands.

Format unit tests: every image here is built from bytes generated in the test (random or
patterned), not recorded from a GPU; they check the format's own promises — round trips,
checksums naming the bad chunk, atomic visibility, kill -9 mid-write, incremental chains,
compaction and diff.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import REPO, child_env

from gpuos_tools import image as img
from gpuos_tools.image import ImageError, ImageWriter, compact, diff, open_image, verify
from gpuos_tools.errors import ExitCode

CS = 4096  # a small chunk size, so that small buffers span several chunks


def rand(n: int, seed: int) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


def write(path: Path, buffers: dict[int, bytes], parent: Path | None = None, **kw) -> dict:
    manifest = kw.pop("manifest", {"gpu": {"name": "test", "uuid": "GPU-test"}, "t0": 1.5, "launch_seq": 7})
    with ImageWriter(path, manifest, chunk_size=kw.pop("chunk_size", CS), parent=parent, **kw) as w:
        for buf_id, data in buffers.items():
            w.add(buf_id, 0x7F0000000000 + buf_id * 0x100000, len(data), data, kind="alloc")
        return w.commit()


def temps(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if n.endswith(".tmp")]


@pytest.mark.parametrize("compress", [False, True])
def test_round_trip(tmp_path: Path, compress: bool) -> None:
    bufs = {1: rand(3 * CS + 123, 1), 2: bytes(5 * CS), 3: b"", 9: rand(CS, 2)}
    summary = write(tmp_path / "im", bufs, compress=compress)
    assert summary["bytes"] == sum(map(len, bufs.values())) and summary["chunks"] == 4 + 5 + 0 + 1
    assert summary["path"] == str(tmp_path / "im") and temps(tmp_path) == []
    im = open_image(tmp_path / "im")
    assert im.manifest["gpu"]["uuid"] == "GPU-test" and im.manifest["launch_seq"] == 7 and im.manifest["t0"] == 1.5
    assert [(b["id"], b["size"], b["kind"]) for b in im.buffers] == [(i, len(d), "alloc") for i, d in bufs.items()]
    for buf_id, data in bufs.items():
        assert im.read(buf_id) == data
        out = bytearray(len(data) + 10)
        view = im.read(buf_id, out)
        assert bytes(view) == data and len(view) == len(data)
    zeros = next(b for b in im.buffers if b["id"] == 2)
    randoms = next(b for b in im.buffers if b["id"] == 1)
    if compress:  # zeros shrink; random bytes would grow, so they are stored raw
        assert all(c["zstd"] and c["stored_size"] < c["size"] for c in zeros["chunks"])
        assert summary["stored_bytes"] < summary["bytes"]
    else:
        assert not any(c["zstd"] for c in zeros["chunks"])
    assert not any(c["zstd"] for c in randoms["chunks"])
    assert verify(tmp_path / "im") == []


def test_crc32_checksum_round_trip_and_corruption(tmp_path: Path) -> None:
    write(tmp_path / "im", {1: rand(2 * CS, 3)}, checksum="crc32")
    assert open_image(tmp_path / "im").read(1) == rand(2 * CS, 3)
    chunk = tmp_path / "im" / "chunks" / "1-1"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 1
    chunk.write_bytes(data)
    assert any("1-1" in p and "checksum mismatch" in p for p in verify(tmp_path / "im"))


def test_add_from_many_threads(tmp_path: Path) -> None:
    bufs = {i: rand(CS * (i % 4) + i * 7, 100 + i) for i in range(24)}
    with ImageWriter(tmp_path / "im", {}, chunk_size=CS, threads=4) as w:
        barrier = threading.Barrier(8)
        errors: list[BaseException] = []

        def worker(ids: list[int]) -> None:
            barrier.wait()
            try:
                for i in ids:
                    w.add(i, 0x1000 * (i + 1) * 1000, len(bufs[i]), memoryview(bufs[i]))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(list(range(k, 24, 8)),)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        w.commit()
    im = open_image(tmp_path / "im")
    assert sorted(b["id"] for b in im.buffers) == list(range(24))
    assert all(im.read(i) == d for i, d in bufs.items())


def test_add_chunk_streams_in_order(tmp_path: Path) -> None:
    data = rand(5 * CS + 17, 4)
    with ImageWriter(tmp_path / "im", {"allocations": [{"id": 5, "addr": 0x1000, "size": len(data), "kind": "x"}]},
                     chunk_size=CS) as w:
        w.add_chunk(5, 0, data[: 2 * CS])
        with pytest.raises(ValueError, match="in order"):
            w.add_chunk(5, 3 * CS, data[3 * CS:])
        w.add_chunk(5, 2 * CS, data[2 * CS: 4 * CS])
        w.add_chunk(5, 4 * CS, data[4 * CS:])
        w.commit()
    im = open_image(tmp_path / "im")
    assert im.read(5) == data and im.buffer(5)["kind"] == "x"
    with ImageWriter(tmp_path / "im2", {}, chunk_size=CS) as w:
        w.begin_buffer(1, 0x10, 3 * CS)
        w.add_chunk(1, 0, data[:CS + 5])
        with pytest.raises(ValueError, match="multiple of the chunk size"):
            w.add_chunk(1, CS + 5, data[CS + 5: 3 * CS])
        with pytest.raises(ImageError, match="incomplete"):
            w.commit()
    assert not (tmp_path / "im2").exists() and temps(tmp_path) == []


def test_flipped_byte_is_refused_naming_the_chunk(tmp_path: Path) -> None:
    write(tmp_path / "im", {1: rand(3 * CS, 5), 2: rand(CS, 6)}, compress=True)
    chunk = tmp_path / "im" / "chunks" / "1-2"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x40
    chunk.write_bytes(data)
    problems = verify(tmp_path / "im")
    assert len(problems) == 1
    assert "chunks/1-2" in problems[0] and "buffer 1" in problems[0] and "checksum mismatch" in problems[0]
    im = open_image(tmp_path / "im")
    with pytest.raises(ImageError, match=r"chunks/1-2: chunk 2 of buffer 1 \(bytes 8192\+4096\): checksum mismatch") as e:
        im.read(1)
    assert e.value.code == ExitCode.IMAGE_CORRUPT
    assert im.read(2) == rand(CS, 6)
    done = subprocess.run([sys.executable, "-m", "gpuos_tools.commands.restore", "verify", str(tmp_path / "im")],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == ExitCode.IMAGE_CORRUPT
    assert "gpu-restore: error:" in done.stderr and "chunks/1-2" in done.stderr
    rec = [json.loads(line) for line in done.stdout.splitlines()][-1]
    assert rec["type"] == "image_verify" and rec["ok"] is False and "chunks/1-2" in rec["problems"][0]


def test_missing_extra_truncated_chunks_and_manifest(tmp_path: Path) -> None:
    write(tmp_path / "im", {1: rand(3 * CS, 7)})
    chunks = tmp_path / "im" / "chunks"
    (chunks / "1-0").unlink()
    (chunks / "7-0").write_bytes(b"stray")
    with open(chunks / "1-1", "r+b") as f:
        f.truncate(CS - 1)
    problems = verify(tmp_path / "im")
    assert any("1-0: missing chunk (buffer 1, chunk 0)" in p for p in problems)
    assert any("7-0: extra chunk file" in p for p in problems)
    assert any("1-1: chunk is 4095 bytes, the manifest says 4096" in p for p in problems)
    assert verify(tmp_path / "im", data=False) == problems
    manifest = tmp_path / "im" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:200])
    (problem,) = verify(tmp_path / "im")
    assert "truncated or malformed manifest" in problem
    with pytest.raises(ImageError) as e:
        open_image(tmp_path / "im")
    assert e.value.code == ExitCode.IMAGE_CORRUPT
    assert "no such image" in verify(tmp_path / "none")[0]


def test_nothing_visible_before_commit_and_abort_cleans(tmp_path: Path) -> None:
    w = ImageWriter(tmp_path / "im", {})
    w.add(1, 0x10, 100, rand(100, 8))
    assert not (tmp_path / "im").exists() and len(temps(tmp_path)) == 1
    assert not img.is_image(tmp_path / temps(tmp_path)[0])  # no manifest yet: not loadable either
    w.abort()
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="agent died"), ImageWriter(tmp_path / "im", {}) as w:
        w.add(1, 0x10, 100, rand(100, 8))
        raise RuntimeError("agent died")
    assert os.listdir(tmp_path) == []
    with ImageWriter(tmp_path / "im", {}) as w:
        w.add(1, 0x10, 100, rand(100, 8))  # left without commit: aborted too
    assert os.listdir(tmp_path) == []


def test_refusals(tmp_path: Path) -> None:
    write(tmp_path / "im", {1: b"abc"})
    with pytest.raises(ImageError, match="already exists"):
        ImageWriter(tmp_path / "im", {})
    with pytest.raises(ValueError, match="owned by the image writer"):
        ImageWriter(tmp_path / "x", {"buffers": []})
    with ImageWriter(tmp_path / "x", {}) as w:
        with pytest.raises(ValueError, match="for size"):
            w.add(1, 0x10, 5, b"abc")
        w.add(1, 0x10, 3, b"abc")
        with pytest.raises(ValueError, match="given twice"):
            w.add(1, 0x10, 3, b"abc")
    allocs = {"allocations": [{"id": 1, "addr": 0x10, "size": 3}, {"id": 2, "addr": 0x20, "size": 3}]}
    with ImageWriter(tmp_path / "y", allocs) as w:
        w.add(1, 0x10, 3, b"abc")
        with pytest.raises(ImageError, match="allocation 2 was not given"):
            w.commit()
    assert sorted(os.listdir(tmp_path)) == ["im"]


KILL_CHILD = r"""
import os, sys
from gpuos_tools.image import ImageWriter
path = sys.argv[1]
w = ImageWriter(path, {"process": {"pid": os.getpid()}}, chunk_size=1 << 16, threads=2)
block = os.urandom(1 << 20)
for i in range(100000):
    w.add(i, 0x1000 * i, len(block), block)
    if i == 0:
        print("writing", flush=True)
"""


@pytest.mark.parametrize("delay", [0.0, 0.03, 0.15])
def test_kill_9_mid_write_leaves_no_loadable_image(tmp_path: Path, delay: float) -> None:
    child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(tmp_path / "im")], cwd=REPO, env=child_env(),
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "writing\n"
        time.sleep(delay)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not (tmp_path / "im").exists() and not img.is_image(tmp_path / "im")
    (temp,) = temps(tmp_path)
    assert temp.startswith(f".im.{child.pid}.") and os.listdir(tmp_path / temp / "chunks")
    assert not img.is_image(tmp_path / temp)
    assert img.clean_stale_temps(tmp_path) == [str(tmp_path / temp)]
    assert os.listdir(tmp_path) == []


LOOP_CHILD = r"""
import os, sys
from gpuos_tools.image import ImageWriter
block = os.urandom(1 << 18)
for n in range(100000):
    with ImageWriter(os.path.join(sys.argv[1], f"im-{n}"), {}, chunk_size=1 << 16, compress=n % 2 == 1) as w:
        for i in range(4):
            w.add(i, 0x100000 * i, len(block), block)
        w.commit()
    if n == 0:
        print("writing", flush=True)
"""


@pytest.mark.parametrize("seed", range(6))
def test_kill_9_at_random_points_leaves_only_sound_images(tmp_path: Path, seed: int) -> None:
    """Images written back to back, commit and rename included, killed at a random moment:
    every image that is visible verifies, and what is left besides is a dot-named temp."""
    import random

    child = subprocess.Popen([sys.executable, "-c", LOOP_CHILD, str(tmp_path)], cwd=REPO, env=child_env(),
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "writing\n"
        time.sleep(random.Random(seed).uniform(0, 0.3))
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    names = os.listdir(tmp_path)
    visible = [n for n in names if not n.startswith(".")]
    assert visible and all(n.startswith("im-") for n in visible)
    for n in visible:
        assert verify(tmp_path / n) == [], n
        assert open_image(tmp_path / n).read(3) == open_image(tmp_path / "im-0").read(3)
    leftovers = [n for n in names if n.startswith(".")]
    assert len(leftovers) <= 1 and all(n.endswith(".tmp") for n in leftovers)
    img.clean_stale_temps(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(visible)


def test_clean_stale_temps_keeps_live_writers(tmp_path: Path) -> None:
    w = ImageWriter(tmp_path / "im", {})
    assert img.clean_stale_temps(tmp_path) == []
    assert len(temps(tmp_path)) == 1
    w.abort()


def chain3(tmp_path: Path) -> tuple[Path, Path, Path, dict[int, bytes]]:
    """full (buffers 1, 2, 3) <- inc1 (2 rewritten; 3 freed; 4 new) <- inc2 (4 rewritten)."""
    base = {1: rand(3 * CS, 10), 2: rand(2 * CS + 1, 11), 3: rand(CS, 12)}
    write(tmp_path / "full", base, compress=True)
    two = bytearray(base[2])
    two[CS + 3] ^= 0xFF
    allocs1 = [{"id": 1, "addr": 0x7F0000000000 + 0x100000, "size": 3 * CS},
               {"id": 2, "addr": 0x7F0000000000 + 0x200000, "size": len(two)},
               {"id": 4, "addr": 0x7F0000000000 + 0x400000, "size": 100}]
    with ImageWriter(tmp_path / "inc1", {"allocations": allocs1, "t0": 2.0}, chunk_size=CS,
                     parent=tmp_path / "full") as w:
        w.add(2, allocs1[1]["addr"], len(two), two, kind="alloc")
        w.add(4, allocs1[2]["addr"], 100, rand(100, 13), kind="alloc")
        w.commit()
    four = rand(100, 14)
    write(tmp_path / "inc2", {4: four}, parent=tmp_path / "inc1", manifest={"t0": 3.0})
    return tmp_path / "full", tmp_path / "inc1", tmp_path / "inc2", {1: base[1], 2: bytes(two), 4: four}


def test_incremental_chain_reads_through_and_compacts(tmp_path: Path) -> None:
    full, inc1, inc2, want = chain3(tmp_path)
    head = open_image(inc2)
    assert [i.path for i in head.chain()] == [str(inc2), str(inc1), str(full)]
    parent = open_image(inc1)
    assert head.manifest["parent"] == {"path": "inc1", "image_id": parent.image_id, "manifest_sum": parent.sum}
    assert {b["id"]: b["stored"] for b in head.buffers} == {1: False, 2: False, 4: True}
    assert {i: head.read(i) for i in want} == want
    assert open_image(inc1).read(4) == rand(100, 13) and open_image(full).read(3) == rand(CS, 12)
    assert verify(inc2) == []
    summary = compact(inc2, tmp_path / "flat")
    flat = open_image(tmp_path / "flat")
    assert not flat.incremental and summary["bytes"] == sum(map(len, want.values()))
    assert flat.manifest["compacted_from"] == [i.image_id for i in head.chain()] and flat.manifest["t0"] == 3.0
    assert [(b["id"], b["addr"], b["size"]) for b in flat.buffers] == [(b["id"], b["addr"], b["size"])
                                                                       for b in head.buffers]
    assert {i: flat.read(i) for i in want} == want
    assert diff(tmp_path / "flat", inc2) == [] and verify(tmp_path / "flat") == []


def test_broken_chain(tmp_path: Path) -> None:
    full, _, inc2, _ = chain3(tmp_path)
    os.rename(full, tmp_path / "away")
    write(full, {1: b"other image, same name"})
    problems = verify(inc2)
    assert any("broken parent chain" in p and str(full) in p for p in problems)
    with pytest.raises(ImageError, match="broken parent chain") as caught:
        open_image(inc2)  # refused whole: nothing of an image with a broken chain is read
    assert caught.value.code == ExitCode.IMAGE_CORRUPT
    img.remove_image(full)
    assert any("broken parent chain" in p for p in verify(inc2))


def test_diff(tmp_path: Path) -> None:
    full, inc1, _, _ = chain3(tmp_path)
    records = diff(full, inc1)
    by = {r["buffer"]: r for r in records}
    assert set(by) == {2, 3, 4}
    assert by[2]["change"] == "changed" and by[2]["ranges"] == [[CS, 2 * CS]] and by[2]["bytes"] == CS
    assert by[3]["change"] == "removed" and by[4]["change"] == "added"
    assert diff(inc1, inc1) == [] and diff(full, full) == []
    a = {1: rand(4 * CS, 20)}
    b = bytearray(a[1])
    b[0] ^= 1
    b[CS] ^= 1
    b[3 * CS + 5] ^= 1
    write(tmp_path / "a", a)
    write(tmp_path / "b", {1: bytes(b)}, chunk_size=2 * CS)  # other chunk size: bytes are compared
    assert diff(tmp_path / "a", tmp_path / "b")[0]["ranges"] == [[0, 2 * CS], [3 * CS, 4 * CS]]
    write(tmp_path / "a256", a, checksum="sha256")
    write(tmp_path / "b256", {1: bytes(b)}, checksum="sha256")  # sha256 sums alone decide
    assert diff(tmp_path / "a256", tmp_path / "b256")[0]["ranges"] == [[0, 2 * CS], [3 * CS, 4 * CS]]
    with ImageWriter(tmp_path / "c", {}) as w:
        w.add(1, 0x1, 4 * CS, a[1])
        w.commit()
    assert diff(tmp_path / "a", tmp_path / "c")[0]["change"] == "resized"


def run_restore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuos_tools.commands.restore", *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=60, check=False)


def test_commands_verify_diff_compact(tmp_path: Path) -> None:
    full, inc1, inc2, _ = chain3(tmp_path)
    done = run_restore("verify", str(inc2))
    assert done.returncode == 0 and done.stderr == ""
    header, rec = [json.loads(line) for line in done.stdout.splitlines()]
    assert header["type"] == "header" and header["tool"] == "gpu-restore verify"
    assert rec["ok"] and rec["chain"] == [str(inc2), str(inc1), str(full)] and rec["buffers"] == 3
    done = run_restore("diff", str(full), str(inc1))
    assert done.returncode == ExitCode.FAILURE
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["type"] for r in records] == ["header"] + ["image_diff"] * 3 + ["image_diff_summary"]
    assert records[-1]["changed"] == 1 and records[-1]["added"] == 1 and records[-1]["removed"] == 1
    out = tmp_path / "flat"
    done = subprocess.run([sys.executable, "-m", "gpuos_tools.commands.ckpt", "compact", str(inc2), str(out)],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    rec = [json.loads(line) for line in done.stdout.splitlines()][-1]
    assert rec["type"] == "image_compact" and rec["image"] == str(out) and len(rec["chain"]) == 3
    done = run_restore("diff", str(out), str(inc2))
    assert done.returncode == 0 and json.loads(done.stdout.splitlines()[-1])["identical"] is True
    assert run_restore("verify", str(tmp_path / "nope")).returncode == ExitCode.NO_INPUT
    assert run_restore("--pid", "1", "verify", str(inc2)).returncode == ExitCode.USAGE


def test_checked_in_format_fixture() -> None:
    """tests/data/image-format: written once from fixed patterns (see its README), read now."""
    def pattern(n: int, k: int) -> bytes:
        return bytes((i * k + 7) % 251 for i in range(n))

    base = REPO / "tests" / "data" / "image-format"
    inc = open_image(base / "inc")
    assert inc.manifest["schema"] == "gpuos-image/1" and inc.manifest["launch_seq"] == 42
    assert [i.path for i in inc.chain()] == [str(base / "inc"), str(base / "full")]
    assert inc.read(1) == pattern(10000, 3) and inc.read(3) == pattern(8192, 11)
    assert inc.buffer(2) is None and open_image(base / "full").read(2) == pattern(4096, 5)
    assert open_image(base / "full").read(3) == bytes(8192)
    assert verify(base / "inc") == [] and verify(base / "full") == []
    assert [(r["buffer"], r["change"], r.get("ranges")) for r in diff(base / "full", base / "inc")] == [
        (2, "removed", None), (3, "changed", [[0, 8192]])]
