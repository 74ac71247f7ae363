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

import errno
import json
import os
import secrets
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from gpuos_tools.image import chunkio
from gpuos_tools.image import manifest as mf
from gpuos_tools.image.manifest import load_key, seal
from gpuos_tools.errors import ExitCode, GpuosError

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


def clean_stale_temps(directory: str | os.PathLike[str]) -> list[str]:
    """Remove the temp directories of image writers that died (``.NAME.PID.X.tmp`` whose PID
    is not running). Returns the paths removed."""
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
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not _pid_alive(int(parts[1])):
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


# -- writing ----------------------------------------------------------------------------------


@dataclass
class _Pending:
    """A buffer being written: its chunk records arrive from worker threads."""

    id: int
    addr: int
    size: int
    meta: dict[str, Any]
    chunks: dict[int, dict[str, Any]] = field(default_factory=dict)
    received: int = 0  # bytes handed in so far (add_chunk)


class ImageWriter:
    """Write one image. ``add`` (whole buffers) may be called from several threads at once for
    different buffers; ``add_chunk`` streams one buffer in order. Nothing is visible at ``path``
    until ``commit`` returns; ``abort`` (or an exception inside ``with``) removes everything.

    ``add(..., wait=False)`` returns once the buffer's chunks are queued: its bytes are then read
    by the writer's threads until ``commit`` or ``abort`` returns, so that the chunks of many
    buffers are written at once. ``checksum`` "auto" takes the fastest measured here
    (chunkio.pick_checksum); ``direct`` "auto" writes with O_DIRECT where the filesystem takes it
    and is not memory ("on": wherever it takes it, "off": never). ``progress()`` says how far it is.

    ``manifest`` carries the caller's fields (gpu, driver, cuda, process, t0, launch_seq, ...);
    with an ``allocations`` list ({id, addr, size, kind}) it is the allocation table at T0: a
    full image must then hold every one of them, and an incremental image inherits from the
    parent every one it was not given. ``parent`` makes an incremental image.
    """

    def __init__(self, path: str | os.PathLike[str], manifest: dict[str, Any], *, compress: bool = False,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, parent: str | os.PathLike[str] | None = None,
                 checksum: str = "auto", level: int = 1, threads: int | None = None, fsync: bool = True,
                 direct: str = "auto"):
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        if direct not in ("auto", "on", "off"):
            raise ValueError(f"direct must be auto, on or off, not {direct!r}")
        checksum = chunkio.pick_checksum(checksum)  # ValueError for an unknown or unavailable one
        clash = RESERVED & set(manifest)
        if clash:
            raise ValueError(f"manifest keys owned by the image writer: {', '.join(sorted(clash))}")
        self.path = os.path.abspath(os.fspath(path))
        self.manifest = dict(manifest)
        self.compress = compress
        self.chunk_size = chunk_size
        self.checksum = checksum
        self.level = level
        self.sync = fsync
        self.parent = open_image(parent) if parent is not None else None
        if os.path.lexists(self.path):
            raise ImageError(f"{self.path}: already exists (an image is never overwritten)", ExitCode.IO_ERROR,
                             self.path)
        self.temp = temp_name(self.path)
        try:  # 0700 and 0600: an image holds a process's memory
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            os.mkdir(self.temp, 0o700)
            os.mkdir(os.path.join(self.temp, CHUNKS), 0o700)
        except OSError as e:
            raise _io_error("cannot create", self.temp, e) from e
        self.fs = chunkio.fs_info(os.path.dirname(self.path), direct)
        self._direct = self.fs.direct
        self._lock = threading.Lock()
        self._buffers: dict[int, _Pending] = {}
        self._local = threading.local()
        self.threads = threads or min(16, os.cpu_count() or 1)
        self._pool = chunkio.Workers(self.threads)
        self._futures: list[Future[dict[str, Any]]] = []
        self._failed: BaseException | None = None  # the first chunk that failed
        self._queued = 0  # bytes handed to the threads
        self._written = 0  # bytes whose chunk file is written
        self._started = time.perf_counter()
        self._done = False

    # context manager: abort on exception, never commit implicitly
    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None or not self._done:
            self.abort()

    def _compressor(self) -> Any:
        c = getattr(self._local, "zstd", None)
        if c is None:
            import zstandard

            c = self._local.zstd = zstandard.ZstdCompressor(level=self.level)
        return c

    def _write_chunk(self, buf_id: int, n: int, data: memoryview) -> dict[str, Any]:
        """Hash, maybe compress, and write chunk ``n`` of a buffer (runs on a worker thread)."""
        total = checksum(self.checksum, data)
        stored: Buffer = data
        zstd = False
        if self.compress:
            packed = self._compressor().compress(data)
            if len(packed) < len(data):
                stored, zstd = packed, True
        name = f"{buf_id}-{n}" + (".zst" if zstd else "")
        path = os.path.join(self.temp, CHUNKS, name)
        direct = self._direct and not zstd  # compressed bytes are a fresh, unaligned buffer
        try:
            if not chunkio.write_chunk_file(path, stored, sync=self.sync, direct=direct) and direct:
                self._direct = False  # the filesystem refused O_DIRECT: buffered from now on
        except OSError as e:
            raise _io_error("cannot write chunk", path, e) from e
        with self._lock:
            self._written += len(data)
        return {"n": n, "file": name, "size": len(data), "stored_size": len(stored), "zstd": zstd, "sum": total}

    def wait_written(self, timeout: float | None = None) -> bool:
        """Whether every chunk queued so far is written (or failed), waiting up to ``timeout`` s."""
        from concurrent.futures import wait

        return not wait(list(self._futures), timeout)[1]

    def progress(self) -> dict[str, Any]:
        """Bytes queued and written so far, seconds since the writer started."""
        with self._lock:
            return {"queued": self._queued, "written": self._written,
                    "seconds": round(time.perf_counter() - self._started, 6)}

    def _check_open(self) -> None:
        if self._done:
            raise ImageError(f"{self.path}: writer already committed or aborted", ExitCode.SOFTWARE, self.path)

    def begin_buffer(self, buffer_id: int, addr: int, size: int, **meta: Any) -> None:
        """Declare a buffer that ``add_chunk`` will stream (not needed when the manifest's
        allocations list has it)."""
        self._check_open()
        if size < 0:
            raise ValueError("size must be >= 0")
        with self._lock:
            if buffer_id in self._buffers:
                raise ValueError(f"buffer {buffer_id} given twice")
            self._buffers[buffer_id] = _Pending(int(buffer_id), int(addr), int(size), meta)

    def add(self, buffer_id: int, addr: int, size: int, data: Buffer, *, wait: bool = True, **meta: Any) -> None:
        """Store a whole buffer. ``data`` (``size`` bytes, any buffer-protocol object) is only
        read, never copied, and must stay valid until ``add`` returns (with ``wait=False``: until
        ``commit`` or ``abort`` returns); its chunks are hashed and written on the writer's
        threads. ``meta`` (kind=..., ...) goes into the manifest entry."""
        view = memoryview(data).cast("B")
        if len(view) != size:
            raise ValueError(f"buffer {buffer_id}: {len(view)} bytes of data for size {size}")
        self.begin_buffer(buffer_id, addr, size, **meta)
        with self._lock:
            self._buffers[buffer_id].received = size
        self._store(buffer_id, 0, view, wait)

    def add_chunk(self, buffer_id: int, offset: int, data: Buffer) -> None:
        """Store the next piece of a buffer, in order: ``offset`` must be where the previous
        piece ended, and every piece but the last a multiple of the chunk size long."""
        self._check_open()
        view = memoryview(data).cast("B")
        with self._lock:
            pend = self._buffers.get(buffer_id)
            if pend is None:
                alloc = self._allocation(buffer_id)
                if alloc is None:
                    raise ValueError(f"buffer {buffer_id}: begin_buffer first (it is not in manifest allocations)")
                pend = self._buffers[buffer_id] = _Pending(
                    buffer_id, int(alloc["addr"]), int(alloc["size"]),
                    {k: v for k, v in alloc.items() if k not in ("id", "addr", "size")})
            if offset != pend.received:
                raise ValueError(f"buffer {buffer_id}: piece at {offset}, expected {pend.received} (in order)")
            if offset % self.chunk_size:
                raise ValueError(f"buffer {buffer_id}: the previous piece was not a multiple of the chunk size")
            if offset + len(view) > pend.size:
                raise ValueError(f"buffer {buffer_id}: piece ends at {offset + len(view)}, past size {pend.size}")
            pend.received += len(view)
        self._store(buffer_id, offset, view)

    def _allocation(self, buffer_id: int) -> dict[str, Any] | None:
        for a in self.manifest.get("allocations") or []:
            if int(a["id"]) == buffer_id:
                return a
        return None

    def _chunk_job(self, buffer_id: int, n: int, data: memoryview) -> dict[str, Any]:
        try:
            rec = self._write_chunk(buffer_id, n, data)
        except BaseException as e:
            self._failed = e
            raise
        with self._lock:
            self._buffers[buffer_id].chunks[n] = rec
        return rec

    def _store(self, buffer_id: int, offset: int, view: memoryview, wait: bool = True) -> None:
        if self._failed is not None:  # fail early: a chunk that failed already ends the image
            raise self._failed
        first = offset // self.chunk_size
        futures: list[Future[dict[str, Any]]] = []
        for i, start in enumerate(range(0, len(view), self.chunk_size)):
            futures.append(self._pool.submit(self._chunk_job, buffer_id, first + i,
                                             view[start:start + self.chunk_size]))
        with self._lock:
            self._queued += len(view)
        self._futures += futures
        if wait:
            for f in futures:
                f.result()  # the first failure is raised here

    def _table(self) -> list[dict[str, Any]]:
        """The buffer list of the manifest: stored buffers and, when incremental, inherited ones."""
        entries: dict[int, dict[str, Any]] = {}
        for pend in self._buffers.values():
            if pend.received != pend.size:
                raise ImageError(f"{self.path}: buffer {pend.id} incomplete: {pend.received} of {pend.size} bytes",
                                 ExitCode.SOFTWARE, self.path)
            entries[pend.id] = {"id": pend.id, "addr": pend.addr, "size": pend.size, "kind": None, **pend.meta,
                                "stored": True, "chunks": [pend.chunks[n] for n in sorted(pend.chunks)]}
        allocations = self.manifest.get("allocations")
        if allocations is not None:
            wanted = [(int(a["id"]), a) for a in allocations]
        elif self.parent is not None:
            wanted = [(b["id"], b) for b in self.parent.buffers]
        else:
            wanted = []
        for buf_id, alloc in wanted:
            if buf_id in entries:
                continue
            if self.parent is None:
                raise ImageError(f"{self.path}: allocation {buf_id} was not given (a full image holds every one)",
                                 ExitCode.SOFTWARE, self.path)
            old = self.parent.buffer(buf_id)
            if old is None or old["addr"] != int(alloc["addr"]) or old["size"] != int(alloc["size"]):
                raise ImageError(f"{self.path}: allocation {buf_id} was not given and the parent "
                                 f"{self.parent.path} does not hold it at the same address and size",
                                 ExitCode.SOFTWARE, self.path)
            entries[buf_id] = {k: v for k, v in old.items() if k != "chunks"} | {"stored": False}
        return [entries[k] for k in sorted(entries)]

    def commit(self) -> dict[str, Any]:
        """Write the manifest and make the image visible at ``path`` atomically.
        Returns {path, image_id, bytes, stored_bytes, chunks, buffers, seconds}."""
        self._check_open()
        try:
            for f in self._futures:
                f.result()  # every chunk written; the first failure is raised here
            self._pool.shutdown()
            buffers = self._table()
            raw = sum(c["size"] for b in buffers for c in b.get("chunks", []))
            stored = sum(c["stored_size"] for b in buffers for c in b.get("chunks", []))
            manifest = dict(self.manifest)
            manifest.update({
                "schema": SCHEMA,
                "image_id": uuid.uuid4().hex,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "chunk_size": self.chunk_size,
                "checksum": self.checksum,
                "compression": {"codec": "zstd", "level": self.level} if self.compress else None,
                "parent": None if self.parent is None else {
                    "path": os.path.relpath(self.parent.path, os.path.dirname(self.path)),
                    "image_id": self.parent.manifest["image_id"], "manifest_sum": self.parent.sum},
                "buffers": buffers,
                "bytes": raw,
                "stored_bytes": stored,
            })
            manifest["write_s"] = round(time.perf_counter() - self._started, 6)
            try:  # never commit an image that its readers would refuse
                mf.check(manifest, frozenset(CHECKSUMS))
            except GpuosError as e:
                raise ImageError(f"{self.path}: {e}", ExitCode.SOFTWARE, self.path) from None
            seal(manifest, load_key())  # its own sum, and a MAC when a key is configured
            text = json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n"
            manifest_path = os.path.join(self.temp, MANIFEST)
            _write_file(manifest_path, text, self.sync)
            if self.sync:
                fsync_dir(os.path.join(self.temp, CHUNKS))
                fsync_dir(self.temp)
            if os.path.lexists(self.path):
                raise ImageError(f"{self.path}: appeared while the image was written; not replaced",
                                 ExitCode.IO_ERROR, self.path)
            os.rename(self.temp, self.path)
            if self.sync:
                fsync_dir(os.path.dirname(self.path))
        except OSError as e:
            self.abort()
            raise _io_error("cannot write image", self.path, e) from e
        except BaseException:
            self.abort()
            raise
        self._done = True
        seconds = time.perf_counter() - self._started
        return {"path": self.path, "image_id": manifest["image_id"], "bytes": raw, "stored_bytes": stored,
                "chunks": sum(len(b.get("chunks", [])) for b in buffers), "buffers": len(buffers),
                "seconds": round(seconds, 6), "incremental": self.parent is not None}

    def abort(self) -> None:
        """Forget everything written so far (idempotent)."""
        if self._done:
            return
        self._done = True
        self._pool.shutdown(cancel=True)  # chunks being written finish; their bytes are no longer read after
        shutil.rmtree(self.temp, ignore_errors=True)


# -- reading ----------------------------------------------------------------------------------
#
# Nothing a manifest says is trusted before gpuos_tools.image.manifest.check has passed it: field
# types, unique ids, bounded sizes, buffers that do not overlap, and the chunk geometry (every
# chunk but the last exactly chunk_size, in order, named as the writer names them). Files are
# then opened only inside the image's chunks/ directory, never through a symlink, only when they
# are regular files of the size the manifest says, and without blocking (a FIFO is refused, not
# waited on).

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_SENTINEL: Any = object()


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """object_pairs_hook: a key given twice makes a manifest ambiguous; refuse it."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _open_regular(path: str, limit: int, what: str, *, dir_fd: int | None = None) -> tuple[int, int]:
    """(fd, size) of a regular file, opened without following a symlink and without blocking;
    IMAGE_CORRUPT when it is something else or larger than ``limit``."""
    try:
        fd = os.open(path, _OPEN, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ImageError(f"{what}: is a symbolic link (refused)", ExitCode.IMAGE_CORRUPT, path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageError(f"{what}: not a regular file (refused)", ExitCode.IMAGE_CORRUPT, path)
        if st.st_size > limit:
            raise ImageError(f"{what}: {st.st_size} bytes, more than the {limit} expected", ExitCode.IMAGE_CORRUPT,
                             path)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _read_exactly(fd: int, out: memoryview) -> int:
    got = 0
    while got < len(out):
        n = os.readv(fd, [out[got:]])
        if not n:
            break
        got += n
    return got


def _read_manifest(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise ImageError(f"{path}: no such image", ExitCode.NO_INPUT, path)
    mpath = os.path.join(path, MANIFEST)
    try:
        fd, size = _open_regular(mpath, mf.MAX_MANIFEST, mpath)
    except FileNotFoundError:
        raise ImageError(f"{path}: not an image (no {MANIFEST}; a write that never finished?)",
                         ExitCode.IMAGE_CORRUPT, mpath) from None
    except OSError as e:
        raise _io_error("cannot read", mpath, e) from e
    try:
        raw = bytearray(size)
        got = _read_exactly(fd, memoryview(raw))
    except OSError as e:
        raise _io_error("cannot read", mpath, e) from e
    finally:
        os.close(fd)
    try:
        m = json.loads(bytes(raw[:got]), object_pairs_hook=_pairs, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ImageError(f"{mpath}: truncated or malformed manifest ({e})", ExitCode.IMAGE_CORRUPT, mpath) from None
    if not isinstance(m, dict) or m.get("schema") != SCHEMA:
        raise ImageError(f"{mpath}: not a {SCHEMA} manifest", ExitCode.IMAGE_CORRUPT, mpath)
    return m


class Image:
    """A committed image, opened read-only and checked (its manifest only: ``open_image`` also
    follows and checks the parent chain). ``buffers`` is the manifest's buffer list. ``key``: the
    MAC key (default: from GPUOS_IMAGE_KEY)."""

    def __init__(self, path: str | os.PathLike[str], key: bytes | None = _SENTINEL):
        self.path = os.path.abspath(os.fspath(path))
        self.key = mf.load_key() if key is _SENTINEL else key
        m = _read_manifest(self.path)
        mpath = os.path.join(self.path, MANIFEST)
        try:
            mf.check(m, frozenset(CHECKSUMS))
            #: sha256 of the manifest's canonical form: what a child image names its parent by
            self.sum = mf.check_seal(m, self.key)
        except GpuosError as e:
            raise ImageError(f"{mpath}: {e}", ExitCode.IMAGE_CORRUPT, mpath) from None
        self.manifest = m
        self.buffers: list[dict[str, Any]] = m["buffers"]
        self._by_id = {b["id"]: b for b in self.buffers}
        self._chain: list[Image] | None = None
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"Image({self.path!r})"

    @property
    def image_id(self) -> str:
        return self.manifest["image_id"]

    @property
    def incremental(self) -> bool:
        return self.manifest.get("parent") is not None

    def buffer(self, buffer_id: int) -> dict[str, Any] | None:
        return self._by_id.get(buffer_id)

    def _open_parent(self) -> Image | None:
        """The parent this manifest names, checked to be the one recorded (by its manifest's sum
        where the image records it, by its id otherwise)."""
        ref = self.manifest.get("parent")
        if ref is None:
            return None
        where = os.path.normpath(os.path.join(os.path.dirname(self.path), ref["path"]))
        try:
            st = os.lstat(where)
        except OSError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise ImageError(f"{self.path}: broken parent chain: {where} is a symbolic link (refused)",
                             ExitCode.IMAGE_CORRUPT, where)
        try:
            parent = Image(where, self.key)
        except ImageError as e:
            raise ImageError(f"{self.path}: broken parent chain: {e}", ExitCode.IMAGE_CORRUPT, where) from None
        want = ref.get("manifest_sum")
        if want is not None and parent.sum != want:
            raise ImageError(f"{self.path}: broken parent chain: {where} is not the image it was taken on (its "
                             f"manifest's sum is {parent.sum}, not {want})", ExitCode.IMAGE_CORRUPT, where)
        if parent.image_id != ref["image_id"]:
            raise ImageError(f"{self.path}: broken parent chain: {where} is image {parent.image_id}, "
                             f"not the parent {ref['image_id']}", ExitCode.IMAGE_CORRUPT, where)
        return parent

    def walk(self) -> tuple[list[Image], ImageError | None]:
        """This image and the ancestors that open, newest first, and the error that ended the walk
        early (None when it reached a full image). Bounded, and stops at a loop."""
        out: list[Image] = [self]
        seen = {os.path.realpath(self.path), self.sum}
        while True:
            try:
                parent = out[-1]._open_parent()
            except ImageError as e:
                return out, e
            if parent is None:
                return out, None
            real = os.path.realpath(parent.path)
            if real in seen or parent.sum in seen:
                return out, ImageError(f"{self.path}: parent chain loops at {parent.path}", ExitCode.IMAGE_CORRUPT,
                                       parent.path)
            if len(out) > mf.MAX_CHAIN:
                return out, ImageError(f"{self.path}: parent chain longer than {mf.MAX_CHAIN} images",
                                       ExitCode.IMAGE_CORRUPT, parent.path)
            seen |= {real, parent.sum}
            out.append(parent)

    def chain(self) -> list[Image]:
        """This image and its ancestors, newest first, down to the full image; every inherited
        buffer is found in it at the same address and size (IMAGE_CORRUPT otherwise)."""
        if self._chain is None:
            images, error = self.walk()
            if error is not None:
                raise error
            for image, older in zip(images, images[1:], strict=False):
                for b in image.buffers:
                    if not b.get("stored", True):
                        old = older.buffer(b["id"])
                        if old is None:
                            raise ImageError(f"{older.path}: broken parent chain: buffer {b['id']} is not there",
                                             ExitCode.IMAGE_CORRUPT, older.path)
                        if (old["addr"], old["size"]) != (b["addr"], b["size"]):
                            raise ImageError(
                                f"{image.path}: broken parent chain: buffer {b['id']} is {b['addr']:#x}+{b['size']} "
                                f"here but {old['addr']:#x}+{old['size']} in {older.path}", ExitCode.IMAGE_CORRUPT,
                                image.path)
            self._chain = images
        return self._chain

    def parent(self) -> Image | None:
        """The parent image (incremental images), checked to be the one recorded."""
        chain = self.chain()
        return chain[1] if len(chain) > 1 else None

    def holder(self, buffer_id: int) -> tuple[Image, dict[str, Any]]:
        """The image of the chain that stores this buffer's bytes, and its entry there."""
        for image in self.chain():
            entry = image.buffer(buffer_id)
            if entry is None:
                break
            if entry.get("stored", True):
                return image, entry
        if self.buffer(buffer_id) is None:
            raise ImageError(f"{self.path}: no buffer {buffer_id}", ExitCode.BAD_INPUT, self.path)
        raise ImageError(f"{self.path}: broken parent chain: buffer {buffer_id} is stored in none of its images",
                         ExitCode.IMAGE_CORRUPT, self.path)

    def chunk_problems(self) -> list[str]:
        """Every chunk file that is missing, extra, not a regular file or of the wrong size,
        from the directory alone (no file is opened)."""
        return self._chunk_check()[0]

    def _chunk_check(self) -> tuple[list[str], set[str] | None]:
        """(problems, names of the chunk files that cannot be read; None: none can)."""
        problems: list[str] = []
        unreadable: set[str] = set()
        chunks = os.path.join(self.path, CHUNKS)
        expected = {c["file"]: (b, c) for b in self.buffers if b.get("stored", True) for c in b["chunks"]}
        try:
            dfd = os.open(chunks, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if expected or e.errno not in (errno.ENOENT,):
                why = "is not a directory" if e.errno in (errno.ENOTDIR, errno.ELOOP) else (e.strerror or str(e))
                problems.append(f"{chunks}: {why}" if e.errno != errno.ENOENT
                                else f"{self.path}: no {CHUNKS}/ directory")
            return problems, None
        try:
            present = set(os.listdir(dfd))
            for name, (b, c) in expected.items():
                path = os.path.join(chunks, name)
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    problems.append(f"{path}: missing chunk (buffer {b['id']}, chunk {c['n']})")
                    unreadable.add(name)
                    continue
                if not stat.S_ISREG(st.st_mode):
                    problems.append(f"{path}: not a regular file (buffer {b['id']}, chunk {c['n']})")
                    unreadable.add(name)
                elif st.st_size != c["stored_size"]:
                    problems.append(f"{path}: chunk is {st.st_size} bytes, the manifest says {c['stored_size']} "
                                    f"(buffer {b['id']}, chunk {c['n']})")
                    unreadable.add(name)
        finally:
            os.close(dfd)
        for name in sorted(present - set(expected)):
            problems.append(f"{os.path.join(chunks, name)}: extra chunk file, not in the manifest")
        return problems, unreadable

    def _check_files(self, entry: dict[str, Any]) -> None:
        """IMAGE_CORRUPT unless every chunk file of a buffer of this image is there, a regular file
        of its recorded size (looked at, not opened)."""
        chunks = os.path.join(self.path, CHUNKS)
        try:
            dfd = os.open(chunks, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise ImageError(f"{chunks}: cannot be read as the image's chunk directory ({e.strerror})",
                             ExitCode.IMAGE_CORRUPT, chunks) from None
        try:
            for c in entry["chunks"]:
                path = os.path.join(chunks, c["file"])
                try:
                    st = os.stat(c["file"], dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    raise ImageError(f"{path}: missing chunk (buffer {entry['id']}, chunk {c['n']})",
                                     ExitCode.IMAGE_CORRUPT, path) from None
                if not stat.S_ISREG(st.st_mode) or st.st_size != c["stored_size"]:
                    raise ImageError(f"{path}: not a regular file of {c['stored_size']} bytes (buffer {entry['id']}, "
                                     f"chunk {c['n']})", ExitCode.IMAGE_CORRUPT, path)
        finally:
            os.close(dfd)

    def _decompressor(self) -> Any:
        d = getattr(self._local, "zstd", None)
        if d is None:
            import zstandard

            # a damaged frame header may ask for a window of up to 2 GiB; the writer's levels use at most 128 MiB
            d = self._local.zstd = zstandard.ZstdDecompressor(max_window_size=1 << 27)
        return d

    def read_chunk(self, entry: dict[str, Any], chunk: dict[str, Any], out: memoryview, verify: bool = True) -> None:
        """Read one chunk of ``entry`` (a buffer of this image) into ``out`` (its size)."""
        path = os.path.join(self.path, CHUNKS, chunk["file"])
        start = chunk["n"] * self.manifest["chunk_size"]
        where = f"{path}: chunk {chunk['n']} of buffer {entry['id']} (bytes {start}+{chunk['size']})"
        if len(out) != chunk["size"]:
            raise ValueError(f"out holds {len(out)} bytes, the chunk {chunk['size']}")
        try:
            dfd = os.open(os.path.join(self.path, CHUNKS), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ImageError(f"{where}: missing (no {CHUNKS}/ directory)", ExitCode.IMAGE_CORRUPT, path) from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ImageError(f"{where}: {CHUNKS}/ is not a directory (refused)", ExitCode.IMAGE_CORRUPT,
                                 path) from None
            raise _io_error("cannot read", path, e) from e
        try:
            fd, size = _open_regular(chunk["file"], chunk["stored_size"], where, dir_fd=dfd)
        except FileNotFoundError:
            raise ImageError(f"{where}: missing", ExitCode.IMAGE_CORRUPT, path) from None
        except OSError as e:
            raise _io_error("cannot read", path, e) from e
        finally:
            os.close(dfd)
        try:
            if size != chunk["stored_size"]:
                raise ImageError(f"{where}: file is {size} bytes, the manifest says {chunk['stored_size']}",
                                 ExitCode.IMAGE_CORRUPT, path)
            if chunk.get("zstd"):
                packed = bytearray(size)
                got = _read_exactly(fd, memoryview(packed))
                import zstandard

                try:
                    # what the frame says it holds, before anything is allocated for it
                    declared = zstandard.frame_content_size(bytes(packed[:18]))
                    if declared not in (-1, chunk["size"]):
                        raise ImageError(f"{where}: the zstd frame says it holds {declared} bytes",
                                         ExitCode.IMAGE_CORRUPT, path)
                    data = self._decompressor().decompress(bytes(packed[:got]), max_output_size=chunk["size"])
                except zstandard.ZstdError as e:
                    raise ImageError(f"{where}: does not decompress ({e})", ExitCode.IMAGE_CORRUPT, path) from None
                if len(data) != chunk["size"]:
                    raise ImageError(f"{where}: decompresses to {len(data)} bytes", ExitCode.IMAGE_CORRUPT, path)
                out[:] = data
            else:
                got = _read_exactly(fd, out)
            if got != size or os.read(fd, 1):
                raise ImageError(f"{where}: file changed size while it was read", ExitCode.IMAGE_CORRUPT, path)
        except OSError as e:
            raise _io_error("cannot read", path, e) from e
        finally:
            os.close(fd)
        if verify and checksum(self.manifest["checksum"], out) != chunk["sum"]:
            raise ImageError(f"{where}: checksum mismatch", ExitCode.IMAGE_CORRUPT, path)

    def read(self, buffer_id: int, out: Buffer | None = None, *, verify: bool = True,
             threads: int | None = None) -> bytes | memoryview:
        """A buffer's bytes, from this image or its chain; checked against the chunk checksums.
        With ``out`` (a writable buffer of at least its size, e.g. pinned host memory) the bytes
        are read into it and a memoryview of that part is returned; otherwise new bytes."""
        image, entry = self.holder(buffer_id)
        size = entry["size"]
        if out is None:
            image._check_files(entry)  # before memory is taken for what the manifest says they hold
            target = memoryview(bytearray(size))
        else:
            target = memoryview(out).cast("B")
            if target.readonly or len(target) < size:
                raise ValueError(f"out must be writable and hold {size} bytes")
            target = target[:size]
        cs = image.manifest["chunk_size"]
        jobs = [(c, target[c["n"] * cs:c["n"] * cs + c["size"]]) for c in entry["chunks"]]
        workers = threads or min(16, os.cpu_count() or 1)
        if workers > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
                for f in [pool.submit(image.read_chunk, entry, c, part, verify) for c, part in jobs]:
                    f.result()
        else:
            for c, part in jobs:
                image.read_chunk(entry, c, part, verify)
        return bytes(target) if out is None else target

    def resolved(self) -> Iterator[tuple[dict[str, Any], Image, dict[str, Any]]]:
        """Every buffer of this image with the image and entry that hold its bytes."""
        for b in self.buffers:
            image, entry = self.holder(b["id"])
            yield b, image, entry


def open_image(path: str | os.PathLike[str], key: bytes | None = _SENTINEL) -> Image:
    """Open a committed image and check it and its parent chain: every manifest strictly (see
    gpuos_tools.image.manifest), the chain bounded, loop-free and made of the images recorded.
    NO_INPUT when there is no such directory, IMAGE_CORRUPT naming the file and field otherwise.
    Chunk files are checked as they are read (``verify`` checks them all)."""
    image = Image(path, key)
    image.chain()
    return image


# -- verify, diff, compact --------------------------------------------------------------------


def verify(path: str | os.PathLike[str], *, data: bool = True, key: bytes | None = _SENTINEL) -> list[str]:
    """Every problem of an image and its parent chain, as sentences naming the file at fault:
    unreadable, truncated or inconsistent manifest, missing, extra or wrong-sized chunk files,
    checksum mismatches, a broken parent chain. [] when it is sound. ``data=False`` skips reading
    the chunks (sizes only)."""
    problems: list[str] = []
    try:
        image = Image(path, key)
    except ImageError as e:
        return [str(e)]
    images, error = image.walk()
    if error is not None:
        problems.append(str(error))
    else:
        try:
            image.chain()
        except ImageError as e:
            problems.append(str(e))
    for img in images:
        problems += _verify_one(img, data)
    return problems


def _verify_one(image: Image, data: bool, threads: int | None = None) -> list[str]:
    problems, unreadable = image._chunk_check()
    if not data or unreadable is None:
        return problems
    to_read = [(b, c) for b in image.buffers if b.get("stored", True) for c in b["chunks"]
               if c["file"] not in unreadable]
    local = threading.local()

    def check(job: tuple[dict[str, Any], dict[str, Any]]) -> str | None:
        b, c = job
        scratch = getattr(local, "buf", None)  # one chunk-sized buffer per thread, reused
        if scratch is None or len(scratch) < c["size"]:
            scratch = local.buf = bytearray(c["size"])
        try:
            image.read_chunk(b, c, memoryview(scratch)[:c["size"]])
        except ImageError as e:
            return str(e)
        return None

    if to_read:
        with ThreadPoolExecutor(max_workers=min(threads or min(16, os.cpu_count() or 1), len(to_read))) as pool:
            problems += [p for p in pool.map(check, to_read) if p is not None]
    return problems


def diff(a: str | os.PathLike[str] | Image, b: str | os.PathLike[str] | Image) -> list[dict[str, Any]]:
    """Which buffers differ between two images (each resolved through its chain): one
    ``image_diff`` record per buffer that was added, removed, moved/resized or changed, with
    the changed byte ranges at chunk granularity ([start, end) pairs, merged when adjacent)."""
    ia = a if isinstance(a, Image) else open_image(a)
    ib = b if isinstance(b, Image) else open_image(b)
    out: list[dict[str, Any]] = []
    ids = sorted({x["id"] for x in ia.buffers} | {x["id"] for x in ib.buffers})
    for buf_id in ids:
        ea, eb = ia.buffer(buf_id), ib.buffer(buf_id)
        if ea is None or eb is None:
            e = eb if ea is None else ea
            out.append({"type": "image_diff", "buffer": buf_id, "change": "added" if ea is None else "removed",
                        "addr": e["addr"], "size": e["size"], "kind": e.get("kind")})
            continue
        if (ea["addr"], ea["size"]) != (eb["addr"], eb["size"]):
            out.append({"type": "image_diff", "buffer": buf_id, "change": "resized", "addr": ea["addr"],
                        "size": ea["size"], "new_addr": eb["addr"], "new_size": eb["size"], "kind": eb.get("kind")})
            continue
        ranges = _changed_ranges(ia, ib, buf_id)
        if ranges:
            out.append({"type": "image_diff", "buffer": buf_id, "change": "changed", "addr": ea["addr"],
                        "size": ea["size"], "kind": eb.get("kind"), "ranges": ranges,
                        "bytes": sum(e - s for s, e in ranges)})
    return out


def _changed_ranges(ia: Image, ib: Image, buf_id: int) -> list[list[int]]:
    ha, ea = ia.holder(buf_id)
    hb, eb = ib.holder(buf_id)
    size = int(ea["size"])
    if ha.image_id == hb.image_id:
        return []  # the very same stored bytes
    cs_a, cs_b = int(ha.manifest["chunk_size"]), int(hb.manifest["chunk_size"])
    ranges: list[list[int]] = []
    if cs_a == cs_b and ha.manifest["checksum"] == hb.manifest["checksum"]:
        trusted = ha.manifest["checksum"] == "sha256"  # equal sums mean equal bytes
        chunks_b = {c["n"]: c for c in eb["chunks"]}
        for c in ea["chunks"]:
            cb = chunks_b.get(c["n"])
            same = cb is not None and cb["sum"] == c["sum"] and cb["size"] == c["size"]
            if same and not trusted:  # a short checksum: equal sums are checked byte by byte
                pa, pb = memoryview(bytearray(c["size"])), memoryview(bytearray(c["size"]))
                ha.read_chunk(ea, c, pa)
                hb.read_chunk(eb, cb, pb)
                same = pa == pb
            if not same:
                _merge(ranges, c["n"] * cs_a, c["n"] * cs_a + c["size"])
        return ranges
    da, db = ia.read(buf_id), ib.read(buf_id)  # different layouts or short checksums: compare bytes
    step = min(cs_a, cs_b)
    for start in range(0, size, step):
        if da[start:start + step] != db[start:start + step]:
            _merge(ranges, start, min(size, start + step))
    return ranges


def _merge(ranges: list[list[int]], start: int, end: int) -> None:
    if ranges and ranges[-1][1] == start:
        ranges[-1][1] = end
    else:
        ranges.append([start, end])


def compact(chain_head: str | os.PathLike[str], out: str | os.PathLike[str], *, compress: bool | None = None,
            chunk_size: int | None = None, threads: int | None = None) -> dict[str, Any]:
    """Fold an image and its parent chain into one full image at ``out`` (every buffer's bytes
    read through the chain and checked, written anew). The manifest keeps the head's fields and
    records the images folded in ``compacted_from``. Returns the writer's summary."""
    head = open_image(chain_head)
    chain = head.chain()
    m = head.manifest
    parent_dir = os.path.dirname(os.path.abspath(os.fspath(out)))
    if not os.path.isdir(parent_dir):  # an image goes into a directory that exists, never a new tree
        raise ImageError(f"{out}: no such directory: {parent_dir}", ExitCode.IO_ERROR, parent_dir)
    fields = {k: v for k, v in m.items() if k not in RESERVED}
    fields["compacted_from"] = [img.image_id for img in chain]
    writer = ImageWriter(out, fields, compress=(m.get("compression") is not None) if compress is None else compress,
                         chunk_size=chunk_size or int(m["chunk_size"]), checksum=m["checksum"],
                         level=(m.get("compression") or {}).get("level", 1), threads=threads)
    with writer:
        for b in head.buffers:
            meta = {k: v for k, v in b.items() if k not in ("id", "addr", "size", "stored", "chunks")}
            writer.add(b["id"], b["addr"], b["size"], head.read(b["id"], threads=threads), **meta)
        return writer.commit()


def is_image(path: str | os.PathLike[str]) -> bool:
    """Does ``path`` hold a committed image (a directory with a sound manifest of our schema)?"""
    try:
        Image(path)
    except ImageError:
        return False
    return True
