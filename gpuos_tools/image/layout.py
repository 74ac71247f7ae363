"""Checkpoint images: a directory with a JSON manifest and checksummed, optionally compressed,
fixed-size chunks of every buffer's contents. What the agent path writes, and what verify, diff,
compaction and rollback read.

IMAGE = '''
IMAGE/manifest.json       written last; its presence makes the directory an image
IMAGE/chunks/B-N          chunk N (0, 1, ...) of buffer B (decimal id), raw bytes
IMAGE/chunks/B-N.zst      the same, one zstd frame (stored compressed only where it helps)

manifest.json:
  schema         "gpuos-image/1"
  image_id       32 hex digits, new for every image
  created        UTC time the image was committed (ISO 8601)
  chunk_size     bytes per chunk (the last chunk of a buffer may be shorter)
  checksum       "crc32", "xxh3" (128-bit XXH3) or "sha256": of each chunk's raw
                 (uncompressed) bytes
  compression    "zstd" or null; level
  parent         null, or {path (relative to this image's directory), image_id,
                 manifest_sum (the parent's own)}
  manifest_sum   sha256 of this manifest's canonical form; mac: with a key
                 (gpuos_tools/image/manifest.py has every field's type and range)
  buffers        [{id, addr, size, kind, stored: true, chunks: [{n, file,
                 size, stored_size, zstd, sum}]}] or, in an incremental image,
                 {id, addr, size, kind, stored: false} for a buffer unchanged
                 since the parent (its bytes are read from the chain)
  bytes          raw bytes stored in this image; stored_bytes: on disk
  ...            every other key is the writer's (gpu, driver, cuda, process
                 {pid, argv, host}, t0, launch_seq, ...), kept as given
'''

Writing: everything goes into ``.NAME.PID.RANDOM.tmp`` beside the final path; every chunk file is
fsynced when written, the manifest last, then the temp directory is fsynced, renamed to NAME and
the parent directory fsynced. A reader therefore sees a complete image or none; a writer killed
midway leaves only a dot-named temp directory, which ``clean_stale_temps`` removes once its
writer is dead. There is no single-file form: a directory can be written by many threads at
once without a shared file offset, and ``tar`` carries one anywhere.

Checksums: "auto" by default, the fastest of xxh3 (where the xxhash package is installed) and
crc32 measured on this CPU (gpuos_tools/image/chunkio.py), sha256 on request, all computed on the
writer's threads (they release the GIL on large buffers). Chunk files are written by the
writer's own threads with large writes from the caller's memory, O_DIRECT where the filesystem
takes it (chunkio.py says when and why). Measured on the development VM
(BENCHMARKS.md, scripts/bench_image.py): crc32 2.7–3.3 GB/s on one core and 4.4–4.6 GB/s on two,
sha256 (OpenSSL, SHA-NI) 1.3 and 2.5–2.7, blake2b 0.6. The image must keep up with the agent's
copies at link speed (45 GB/s target), so the default is the cheapest per byte; crc32 catches
any burst error up to 32 bits and other damage with odds of 2^-32 per chunk. sha256 gives
content identity: ``diff`` trusts equal sha256 sums, and reads and compares the bytes of
chunks whose crc32 sums are equal.
"""


from __future__ import annotations

import os
import secrets
import shutil
import stat
from collections.abc import Callable
from typing import Any

from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.image import chunkio

SCHEMA = "gpuos-image/1"
MANIFEST = "manifest.json"
CHUNKS = "chunks"
DEFAULT_CHUNK_SIZE = 64 << 20
IMAGE_DOC = __doc__.split("IMAGE = '''\n", 1)[1].split("'''", 1)[0]

#: Keys of the manifest that the writer owns; the caller's manifest may not set them.
RESERVED = frozenset({"schema", "image_id", "created", "chunk_size", "checksum", "compression", "parent",
                      "buffers", "bytes", "stored_bytes", "write_s", "manifest_sum", "mac"})

Buffer = Any  # bytes, bytearray, memoryview, numpy array: anything with the buffer protocol


class ImageError(GpuosError):
    """An image could not be written or read; ``path`` names the file at fault."""

    def __init__(self, message: str, code: ExitCode = ExitCode.IMAGE_CORRUPT, path: str | None = None):
        super().__init__(message, code)
        self.path = path


# -- checksums --------------------------------------------------------------------------------


CHECKSUMS: dict[str, Callable[[Buffer], str]] = chunkio.CHECKSUMS


def checksum(algorithm: str, data: Buffer) -> str:
    why = chunkio.missing_reason(algorithm)
    if why:
        raise ImageError(why, ExitCode.BAD_INPUT)
    return CHECKSUMS[algorithm](data)


# -- small file-system helpers ----------------------------------------------------------------


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, data: Buffer, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _io_error(what: str, path: str, e: OSError) -> ImageError:
    code = ExitCode.PERMISSION if isinstance(e, PermissionError) else ExitCode.IO_ERROR
    return ImageError(f"{path}: {what}: {e.strerror or e}", code, path)


def temp_name(final: str) -> str:
    parent, base = os.path.split(os.path.abspath(final))
    return os.path.join(parent, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def clean_stale_temps(directory: str | os.PathLike[str], final: str | None = None, *,
                      uid: int | None = None) -> list[str]:
    """Remove the temp directories of writers that died (``.NAME.PID.X.tmp``, ``temp_name``'s
    form, whose PID is not running). Returns the paths removed.

    ``final``: only the temps of that final name (NAME), for a directory others use too ($TMPDIR);
    ``uid``: only directories that user owns. A link is never followed."""
    removed = []
    directory = os.fspath(directory)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        if not (name.startswith(".") and name.endswith(".tmp")):
            continue
        parts = name[1:-4].rsplit(".", 2)
        if len(parts) != 3 or not parts[1].isdigit() or final is not None and parts[0] != final:
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or uid is not None and st.st_uid != uid:
            continue
        if not _pid_alive(int(parts[1])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def remove_image(path: str | os.PathLike[str]) -> None:
    """Delete an image so that no partial image is ever visible: rename it to a temp name
    first (one atomic step), then remove the files."""
    path = os.fspath(path)
    temp = temp_name(path)
    try:
        os.rename(path, temp)
    except OSError as e:
        raise _io_error("cannot remove", path, e) from e
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    shutil.rmtree(temp, ignore_errors=True)
