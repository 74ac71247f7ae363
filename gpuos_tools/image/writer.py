"""Writing one checkpoint image (the layout: gpuos_tools/image/layout.py): buffers from several
threads, chunks checksummed and compressed in parallel, the manifest written last, the directory
renamed into place, so a failure leaves nothing that looks like an image; and compaction of a
parent chain into one image."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.image import chunkio, manifest as mf
from gpuos_tools.image.layout import (
    CHECKSUMS,
    CHUNKS,
    DEFAULT_CHUNK_SIZE,
    MANIFEST,
    RESERVED,
    SCHEMA,
    Buffer,
    ImageError,
    _io_error,
    _write_file,
    checksum,
    fsync_dir,
    temp_name,
)
from gpuos_tools.image.manifest import KEY_FROM_ENVIRONMENT, load_key, seal
from gpuos_tools.image.reader import open_image

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
                 direct: str = "auto", key: bytes | None = KEY_FROM_ENVIRONMENT):
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
        #: the MAC key: the caller's (the agent's, from its boot config), else GPUOS_IMAGE_KEY's
        self.key = load_key() if key is KEY_FROM_ENVIRONMENT else key
        self.parent = open_image(parent, key=self.key) if parent is not None else None
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
            seal(manifest, self.key)  # its own sum, and a MAC when a key is configured
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
