"""Damaged and hostile images: every one is refused cleanly (IMAGE_CORRUPT naming the file and
the field), nothing outside an image is read, nothing hangs, and no image verifies or compacts
with content other than what was written.

The images are copies of the ones recorded on the GPU machine (tests/data/recorded/agent-image)
and of the format fixture (tests/data/image-format), changed the way an attacker or a damaged
disk would change them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import typer
from helpers import REPO, child_env

from gpuos_tools import image as img
from gpuos_tools.image import manifest as mf
from gpuos_tools.image import ImageError, compact, diff, open_image, verify
from gpuos_tools.commands.cli import run
from gpuos_tools.errors import ExitCode

RECORDED = REPO / "tests" / "data" / "recorded" / "agent-image"
FORMAT = REPO / "tests" / "data" / "image-format"


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def edit(image: Path, change: Any) -> None:
    """Rewrite an image's manifest through ``change(manifest)`` (dropping its own sum, which any
    edit would break: these tests are about what the structure allows)."""
    path = image / "manifest.json"
    m = json.loads(path.read_text())
    m.pop("manifest_sum", None)
    change(m)
    path.write_text(json.dumps(m, indent=1))


def command(app_module: str, *args: str) -> tuple[int, str, str]:
    """Run gpu-restore or gpu-ckpt in this process; (status, stdout, stderr)."""
    import contextlib
    import io

    from gpuos_tools.commands import ckpt, restore

    app = {"restore": restore.app, "ckpt": ckpt.app}[app_module]
    out, err = io.StringIO(), io.StringIO()

    class Buffered(io.StringIO):
        @property
        def buffer(self) -> Any:
            return _Bytes(out)

    with contextlib.redirect_stdout(Buffered()), contextlib.redirect_stderr(err):
        code = run(typer.main.get_command(app), f"gpu-{app_module}", list(args))
    return int(code), out.getvalue(), err.getvalue()


class _Bytes:
    def __init__(self, text: Any):
        self.text = text

    def write(self, data: bytes) -> int:
        self.text.write(data.decode())
        return len(data)

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        raise OSError("no fd")

    def isatty(self) -> bool:
        return False


def restore_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "cmd" / "gpu-restore"), *args], env=child_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def ckpt_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "cmd" / "gpu-ckpt"), *args], env=child_env(),
                          capture_output=True, text=True, timeout=60, check=False)


# -- the recorded images still read, and new images carry their sums ----------------------------


def test_recorded_images_pass_the_strict_checks() -> None:
    for path in (RECORDED / "inc", FORMAT / "inc"):
        image = open_image(path)
        assert verify(path) == [] and len(image.chain()) == 2
        assert "manifest_sum" not in image.manifest  # written before the field existed: read as before


def test_a_new_image_seals_its_manifest_and_names_its_parent_by_sum(tmp_path: Path) -> None:
    out = tmp_path / "flat"
    compact(RECORDED / "inc", out)
    m = open_image(out).manifest
    assert m["manifest_sum"] == mf.manifest_sum(m) and "mac" not in m
    with img.ImageWriter(tmp_path / "inc", {}, parent=out, chunk_size=m["chunk_size"]) as w:
        w.add(2, m["buffers"][1]["addr"], m["buffers"][1]["size"], bytes(m["buffers"][1]["size"]))
        w.commit()
    assert open_image(tmp_path / "inc").manifest["parent"]["manifest_sum"] == m["manifest_sum"]
    assert verify(tmp_path / "inc") == []


def test_a_manifest_edited_after_it_was_written_is_refused(tmp_path: Path) -> None:
    compact(RECORDED / "inc", tmp_path / "flat")
    path = tmp_path / "flat" / "manifest.json"
    m = json.loads(path.read_text())
    m["buffers"][0]["kind"] = "edited"
    path.write_text(json.dumps(m))
    (problem,) = verify(tmp_path / "flat")
    assert "manifest.json" in problem and "manifest_sum does not match" in problem


def test_a_parent_swapped_for_another_image_with_its_id_is_refused(tmp_path: Path) -> None:
    compact(RECORDED / "inc", tmp_path / "base")
    base = open_image(tmp_path / "base")
    with img.ImageWriter(tmp_path / "inc", {}, parent=tmp_path / "base", chunk_size=base.manifest["chunk_size"]) as w:
        w.add(1, base.buffers[0]["addr"], base.buffers[0]["size"], bytes(base.buffers[0]["size"]))
        w.commit()
    # another image made to carry the parent's random id, put where the parent was
    shutil.move(tmp_path / "base", tmp_path / "away")
    compact(RECORDED / "full", tmp_path / "base")
    edit(tmp_path / "base", lambda m: m.update(image_id=base.image_id))
    with pytest.raises(ImageError, match="not the image it was taken on") as caught:
        open_image(tmp_path / "inc")
    assert caught.value.code == ExitCode.IMAGE_CORRUPT


# -- the cases an attacker tried ------------------------------------------------------------------


def test_a_parent_chain_pointing_at_itself_ends_at_once(tmp_path: Path) -> None:
    image = copy(RECORDED / "inc", tmp_path)
    edit(image, lambda m: m["parent"].update(path="inc", image_id=m["image_id"]))
    problems = verify(image)
    assert problems and "loops" in problems[0]
    for action in (lambda: open_image(image), lambda: diff(image, image)):
        with pytest.raises(ImageError, match="loops"):
            action()
    code, _, err = command("restore", "diff", str(image), str(RECORDED / "full"))
    assert code == ExitCode.IMAGE_CORRUPT and "loops" in err


def test_two_images_pointing_at_each_other_end_at_once(tmp_path: Path) -> None:
    a = copy(RECORDED / "inc", tmp_path)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    a_id = json.loads((a / "manifest.json").read_text())["image_id"]
    edit(b, lambda m: m.update(image_id="b" * 32) or m["parent"].update(path="inc", image_id=a_id))
    edit(a, lambda m: m["parent"].update(path="b", image_id="b" * 32))
    assert any("loops" in p for p in verify(a))


def test_a_chunk_that_is_a_fifo_does_not_hang_verify(tmp_path: Path) -> None:
    image = copy(RECORDED / "full", tmp_path)
    chunk = image / "chunks" / "1-0.zst"
    chunk.unlink()
    os.mkfifo(chunk)
    done = restore_cli("verify", str(image), timeout=30)
    assert done.returncode == ExitCode.IMAGE_CORRUPT, done.stderr
    assert "1-0.zst: not a regular file" in done.stderr
    with pytest.raises(ImageError, match="not a regular file"):
        open_image(image).read(1)
    with pytest.raises(ImageError, match="not a regular file"):
        open_image(image).read(1, memoryview(bytearray(65536)))  # opened without blocking, refused


@pytest.mark.parametrize("target", ["/dev/zero", "/etc/hostname"])
def test_a_chunk_that_is_a_symlink_out_of_the_image_is_not_read(tmp_path: Path, target: str) -> None:
    image = copy(RECORDED / "full", tmp_path)
    chunk = image / "chunks" / "1-0.zst"
    chunk.unlink()
    os.symlink(target, chunk)
    assert any("1-0.zst: not a regular file" in p for p in verify(image))
    with pytest.raises(ImageError, match="1-0.zst: not a regular file"):
        open_image(image).read(1)
    view = memoryview(bytearray(65536))
    with pytest.raises(ImageError, match="symbolic link"):  # read into memory of one's own: opened, refused
        open_image(image).read(1, view)
    with pytest.raises(ImageError):
        compact(image, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["/dev/zero", "/etc/hostname", "../../../../etc/hostname", "1-0", "2-0.zst"])
def test_chunk_file_names_outside_the_writers_pattern_are_refused(tmp_path: Path, name: str) -> None:
    image = copy(RECORDED / "full", tmp_path)
    edit(image, lambda m: m["buffers"][0]["chunks"][0].update(file=name))
    (problem,) = verify(image)
    assert "field 'buffers[0].chunks[0].file'" in problem and "'1-0.zst'" in problem
    with pytest.raises(ImageError):
        compact(image, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_symlinked_chunks_directory_is_refused(tmp_path: Path) -> None:
    image = copy(RECORDED / "full", tmp_path)
    shutil.move(image / "chunks", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", image / "chunks")
    assert any("chunks: is not a directory" in p for p in verify(image))
    with pytest.raises(ImageError, match="chunk directory"):
        open_image(image).read(1)
    with pytest.raises(ImageError, match="not a directory"):
        open_image(image).read(1, memoryview(bytearray(65536)))


@pytest.mark.parametrize("path", ["/etc", "/tmp/x/../../etc", ""])
def test_an_absolute_or_empty_parent_path_is_refused(tmp_path: Path, path: str) -> None:
    image = copy(RECORDED / "inc", tmp_path)
    edit(image, lambda m: m["parent"].update(path=path))
    with pytest.raises(ImageError, match="parent.path"):
        open_image(image)


def test_a_symlinked_parent_is_refused(tmp_path: Path) -> None:
    shutil.copytree(RECORDED, tmp_path / "rec")
    shutil.move(tmp_path / "rec" / "full", tmp_path / "real-full")
    os.symlink(tmp_path / "real-full", tmp_path / "rec" / "full")
    with pytest.raises(ImageError, match="symbolic link"):
        open_image(tmp_path / "rec" / "inc")


def _recut(image: Path, sizes: list[int]) -> None:
    """Cut buffer 1 into chunks of ``sizes`` bytes with correct crc32 sums: the same bytes, a
    different geometry."""
    m = json.loads((image / "manifest.json").read_text())
    b = next(b for b in m["buffers"] if b["id"] == 1)
    data = open_image(image).read(1)
    for c in b["chunks"]:
        (image / "chunks" / c["file"]).unlink()
    chunks, at = [], 0
    for n, size in enumerate(sizes):
        piece = data[at:at + size]
        (image / "chunks" / f"1-{n}").write_bytes(piece)
        chunks.append({"n": n, "file": f"1-{n}", "size": size, "stored_size": size, "zstd": False,
                       "sum": f"crc32:{zlib.crc32(piece):08x}"})
        at += size
    b["chunks"] = chunks
    m.pop("manifest_sum", None)
    (image / "manifest.json").write_text(json.dumps(m))


def test_chunks_re_cut_to_other_sizes_are_refused(tmp_path: Path) -> None:
    """Buffer 1 (10000 bytes, chunks of 4096) re-cut into 4106 + 4086 + 1808 bytes with correct
    crcs once verified, compacted, and gave a compacted image with bytes 4096-8191 wrong."""
    image = copy(FORMAT / "full", tmp_path)
    _recut(image, [4106, 4086, 1808])
    (problem,) = verify(image)
    assert "field 'buffers[0].chunks[0].size': is 4106" in problem
    code, _, err = command("ckpt", "compact", str(image), str(tmp_path / "out"))
    assert code == ExitCode.IMAGE_CORRUPT and "chunks[0].size" in err
    assert not (tmp_path / "out").exists()


def test_an_edited_chunk_size_is_refused(tmp_path: Path) -> None:
    """chunk_size edited to 4095: verify said 90, but compact exited 0 writing wrong content."""
    image = copy(FORMAT / "full", tmp_path)
    edit(image, lambda m: m.update(chunk_size=4095))
    code, _, err = command("restore", "verify", str(image))
    assert code == ExitCode.IMAGE_CORRUPT and "in chunks of 4095" in err
    code, _, err = command("ckpt", "compact", str(image), str(tmp_path / "out"))
    assert code == ExitCode.IMAGE_CORRUPT and not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, field", [
    (lambda m: m["buffers"][0].pop("id"), "buffers[0].id' is missing"),
    (lambda m: m["buffers"][0].update(id="1"), "buffers[0].id"),
    (lambda m: m["buffers"][0].update(size=-1), "buffers[0].size"),
    (lambda m: m["buffers"][0].update(size=1 << 60), "buffers[0].size"),
    (lambda m: m["buffers"][1].update(id=m["buffers"][0]["id"]), "listed twice"),
    (lambda m: m["buffers"][1].update(addr=m["buffers"][0]["addr"] + 8), "overlap"),
    (lambda m: m.update(chunk_size="64MiB"), "chunk_size"),
    (lambda m: m.update(chunk_size=0), "chunk_size"),
    (lambda m: m.update(buffers={}), "buffers"),
    (lambda m: m.update(checksum="md5"), "checksum"),
    (lambda m: m["buffers"][0]["chunks"][0].update(stored_size=1 << 31), "stored_size"),
    (lambda m: m["buffers"][0]["chunks"][0].update(n=None), "chunks[0].n"),
    (lambda m: m["buffers"][0]["chunks"][0].update(sum="sha256:" + "0" * 64), "not a crc32 sum"),
    (lambda m: m.update(bytes=1), "field 'bytes'"),
    (lambda m: m.update(parent=[]), "parent"),
])
def test_wrong_field_types_and_values_are_image_corrupt(tmp_path: Path, change: Any, field: str) -> None:
    image = copy(RECORDED / "full", tmp_path)
    edit(image, change)
    with pytest.raises(ImageError, match="manifest.json") as caught:
        open_image(image)
    assert caught.value.code == ExitCode.IMAGE_CORRUPT and field in str(caught.value)
    code, _, err = command("restore", "verify", str(image))
    assert code == ExitCode.IMAGE_CORRUPT and field in err


@pytest.mark.parametrize("text", ['{"schema": "gpuos-image/1", "schema": "gpuos-image/1"}', "[1]",
                                  '{"schema": "gpuos-image/1", "chunk_size": NaN}', "\xff\xfe", "{" * 100000])
def test_malformed_manifests_are_image_corrupt(tmp_path: Path, text: str) -> None:
    image = copy(RECORDED / "full", tmp_path)
    (image / "manifest.json").write_text(text, encoding="utf-8", errors="surrogateescape")
    code, _, err = command("restore", "verify", str(image))
    assert code == ExitCode.IMAGE_CORRUPT, err


def test_an_inherited_buffer_the_parent_does_not_hold_at_that_place_is_refused(tmp_path: Path) -> None:
    shutil.copytree(RECORDED, tmp_path / "rec")
    edit(tmp_path / "rec" / "inc", lambda m: m["buffers"][0].update(addr=m["buffers"][0]["addr"] - 65536))
    with pytest.raises(ImageError, match="broken parent chain: buffer 1"):
        open_image(tmp_path / "rec" / "inc")


# -- compact into a directory that does not exist ---------------------------------------------


def test_compact_does_not_create_missing_directories(tmp_path: Path) -> None:
    done = ckpt_cli("compact", str(RECORDED / "inc"), str(tmp_path / "nonexistdir" / "img"))
    assert done.returncode == ExitCode.IO_ERROR and "no such directory" in done.stderr
    assert not (tmp_path / "nonexistdir").exists()


# -- the keyed MAC ---------------------------------------------------------------------------------


@pytest.fixture
def key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "image.key"
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    monkeypatch.setenv(mf.KEY_ENV, str(path))
    return path


def _signed(tmp_path: Path) -> Path:
    with img.ImageWriter(tmp_path / "signed", {"gpu": "test"}, checksum="sha256", chunk_size=4096) as w:
        w.add(1, 0x10000, 10000, os.urandom(10000))
        w.commit()
    return tmp_path / "signed"


def test_with_a_key_images_are_signed_and_checked(tmp_path: Path, key: Path) -> None:
    image = _signed(tmp_path)
    assert open_image(image).manifest["mac"].startswith("hmac-sha256:") and verify(image) == []
    # unsigned images (the recorded ones) are not trusted under a key
    with pytest.raises(ImageError, match="no MAC"):
        open_image(RECORDED / "full")
    # a change with the sum recomputed still fails the MAC
    m = json.loads((image / "manifest.json").read_text())
    m["gpu"] = "other"
    m["manifest_sum"] = mf.manifest_sum(m)
    (image / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ImageError, match="MAC mismatch"):
        open_image(image)


def test_another_key_does_not_verify(tmp_path: Path, key: Path) -> None:
    image = _signed(tmp_path)
    key.write_bytes(os.urandom(32))
    assert any("MAC mismatch" in p for p in verify(image))


def test_a_key_needs_cryptographic_chunk_sums(tmp_path: Path, key: Path) -> None:
    with pytest.raises(Exception, match="sha256"), img.ImageWriter(tmp_path / "im", {}, chunk_size=4096) as w:
        w.add(1, 0x10000, 100, bytes(100))
        w.commit()
    assert not (tmp_path / "im").exists()


def test_a_key_readable_by_others_is_refused(tmp_path: Path, key: Path) -> None:
    key.chmod(0o644)
    with pytest.raises(Exception, match="readable or writable by others") as caught:
        open_image(RECORDED / "full")
    assert caught.value.code == ExitCode.PERMISSION


def test_a_key_given_to_the_writer_wins_over_the_environment(tmp_path: Path, key: Path) -> None:
    """The agent hands its writer the key of its boot config (None: unsigned), whatever the
    program's environment names: the image is sealed with that key and read back with it."""
    other = os.urandom(32)
    with img.ImageWriter(tmp_path / "given", {}, checksum="sha256", chunk_size=4096, key=other) as w:
        w.add(1, 0x10000, 100, bytes(100))
        w.commit()
    with pytest.raises(ImageError, match="MAC mismatch"):
        open_image(tmp_path / "given")  # the environment's key is another
    assert open_image(tmp_path / "given", key=other).manifest["mac"].startswith("hmac-sha256:")
    with img.ImageWriter(tmp_path / "plain", {}, chunk_size=4096, key=None) as w:  # crc32 is fine unsigned
        w.add(1, 0x10000, 100, bytes(100))
        w.commit()
    assert "mac" not in open_image(tmp_path / "plain", key=None).manifest
