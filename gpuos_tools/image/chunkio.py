"""Putting image chunks on storage at the storage's speed: the checksums (and which one is
fastest here), the filesystem a directory is on and whether it takes O_DIRECT, one chunk file
written with large aligned writes, and the writer's worker threads.

Why each piece:

- Checksums run on the writer's threads; zlib's crc32, xxhash's xxh3 and hashlib's sha256 all
  release the GIL on large buffers, so N threads hash N chunks at once. ``pick_checksum("auto")``
  times each fast candidate on this CPU once per process (a few milliseconds) and takes the
  fastest: xxh3 runs at memory speed where the ``xxhash`` binding is installed (~25 GB/s a core
  against crc32's 3-4), so the checksum no longer bounds the image. sha256 (content identity) is
  only ever taken on request.
- A chunk is one file written from its source buffer (the agent's pinned staging) without a
  copy: one ``write`` of the whole chunk when buffered, pieces of ``DIRECT_PIECE`` with O_DIRECT.
  O_DIRECT moves the bytes from the source pages to the device without the page cache's copy; it
  is used where the filesystem takes it and it helps (not tmpfs, which is the page cache), for the
  part of the chunk whose address and length are aligned. The unaligned tail is written through
  the page cache on the same descriptor, and an unaligned source through a per-thread aligned
  bounce buffer. A filesystem that refuses O_DIRECT (EINVAL) gets buffered writes from then on.
- The workers are daemon threads of the writer's own, not a ``concurrent.futures`` pool: that
  pool refuses new work once the interpreter starts to exit, which is exactly when the agent must
  still finish an image in flight (gpuos_tools/agent/durable.py).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

Buffer = Any

#: Filesystems that are memory already: O_DIRECT gains nothing there.
MEMORY_FS = frozenset({"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"})
DIRECT_ALIGN = 4096  #: address, length and offset alignment used with O_DIRECT
DIRECT_PIECE = 16 << 20  #: bytes per O_DIRECT write (several in flight per chunk would not help)
BOUNCE = 8 << 20  #: per-thread bounce buffer for unaligned sources


# -- checksums --------------------------------------------------------------------------------


def _sha256(data: Buffer) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _crc32(data: Buffer) -> str:
    return f"crc32:{zlib.crc32(data):08x}"


def _xxh3(data: Buffer) -> str:
    import xxhash

    return "xxh3:" + xxhash.xxh3_128_hexdigest(data)


def _have_xxhash() -> bool:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return False
    return True


#: Every checksum an image may name; "xxh3" is the 128-bit XXH3 (needs the xxhash package).
CHECKSUMS: dict[str, Callable[[Buffer], str]] = {"sha256": _sha256, "crc32": _crc32, "xxh3": _xxh3}
#: What "auto" chooses among (sha256 is asked for by name, never chosen for speed).
FAST = ("xxh3", "crc32")
CHOICES = ("auto", *CHECKSUMS)


def available(name: str) -> bool:
    return name in CHECKSUMS and (name != "xxh3" or _have_xxhash())


def missing_reason(name: str) -> str | None:
    """Why checksum ``name`` cannot be computed here (None: it can)."""
    if name not in CHECKSUMS:
        return f"unknown checksum {name!r} (known: {', '.join(CHECKSUMS)})"
    if not available(name):
        return f"checksum {name!r} needs the xxhash package (pip install xxhash)"
    return None


_speeds: dict[str, float] = {}
_speeds_lock = threading.Lock()


def measure(names: tuple[str, ...] = FAST, nbytes: int = 4 << 20, repeat: int = 3) -> dict[str, float]:
    """GB/s of each available checksum on one core here (best of ``repeat``), measured once per
    process and remembered."""
    with _speeds_lock:
        todo = [n for n in names if n not in _speeds and available(n)]
        if todo:
            data = memoryview(os.urandom(nbytes))
            for name in todo:
                fn = CHECKSUMS[name]
                fn(data[:4096])  # import and warm up
                best = float("inf")
                for _ in range(repeat):
                    t = time.perf_counter()
                    fn(data)
                    best = min(best, time.perf_counter() - t)
                _speeds[name] = nbytes / max(best, 1e-9) / 1e9
        return {n: _speeds[n] for n in names if n in _speeds}


def pick_checksum(choice: str) -> str:
    """The checksum to write with: ``choice`` itself, or for "auto" the fastest measured here.
    Raises ValueError for an unknown or unavailable one."""
    if choice == "auto":
        speeds = measure()
        return max(speeds, key=speeds.__getitem__) if speeds else "crc32"
    why = missing_reason(choice)
    if why:
        raise ValueError(why)
    return choice


# -- the filesystem of a directory ------------------------------------------------------------


@dataclass
class FsInfo:
    fstype: str  #: as /proc/self/mountinfo names it ("?" when not found)
    mount: str  #: the mount point
    direct: bool  #: O_DIRECT is used for chunk files there
    why: str  #: why (not)


def _mount_of(path: str) -> tuple[str, str]:
    """(fstype, mount point) of the filesystem holding ``path``: of the mounts of its device
    number, the deepest whose mount point is a prefix of the path (the first one otherwise)."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return "?", "?"
    want = f"{os.major(dev)}:{os.minor(dev)}"
    real = os.path.realpath(path)
    found: list[tuple[str, str]] = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                parts, rparts = left.split(), right.split()
                if len(parts) >= 5 and rparts and parts[2] == want:
                    found.append((rparts[0], parts[4].replace("\\040", " ")))
    except OSError:
        pass
    inside = [m for m in found if real == m[1] or real.startswith(m[1].rstrip("/") + "/")]
    if inside:
        return max(inside, key=lambda m: len(m[1]))
    return found[0] if found else ("?", "?")


def _probe_direct(directory: str) -> str | None:
    """Write one aligned block with O_DIRECT in ``directory``; None when that works, else why not.

    The block goes to an unnamed file (O_TMPFILE), which the kernel drops when it is closed or
    the process dies, so a probe killed half-way leaves nothing in the directory. A filesystem
    without O_TMPFILE gets a named file inside a writer's temp directory (``.NAME.PID.X.tmp``),
    which ``clean_stale_temps`` removes once this process is gone."""
    if not hasattr(os, "O_DIRECT"):
        return "no O_DIRECT on this system"
    holder, fd = None, -1
    if hasattr(os, "O_TMPFILE"):
        try:
            fd = os.open(directory, os.O_WRONLY | os.O_TMPFILE | os.O_EXCL, 0o600)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                return f"open a file to probe O_DIRECT: {e.strerror}"
    if fd < 0:  # no unnamed files here: a named one inside a temp directory of its own
        holder = os.path.join(directory, f".gpuos-direct-probe.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        try:
            os.mkdir(holder, 0o700)
            fd = os.open(os.path.join(holder, "probe"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            _remove_probe(holder)
            return f"open a file to probe O_DIRECT: {e.strerror}"
    block = mmap.mmap(-1, DIRECT_ALIGN)
    try:
        try:  # Linux lets an open descriptor switch O_DIRECT on
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError as e:
            return f"open with O_DIRECT: {e.strerror}"
        try:
            os.write(fd, block)
        except OSError as e:
            return f"an aligned O_DIRECT write: {e.strerror}"
    finally:
        os.close(fd)
        if holder is not None:
            _remove_probe(holder)
        block.close()
    return None


def _remove_probe(holder: str) -> None:
    for path in (os.path.join(holder, "probe"), holder):
        try:
            os.unlink(path) if path != holder else os.rmdir(path)
        except OSError:
            pass


_fs_cache: dict[tuple[str, str], FsInfo] = {}


def fs_info(directory: str, direct: str = "auto") -> FsInfo:
    """What ``directory``'s filesystem is and whether chunk files there are written with
    O_DIRECT: ``direct`` "auto" (where it works and the filesystem is not memory), "on"
    (wherever it works) or "off"."""
    directory = os.path.abspath(directory)
    key = (directory, direct)
    if key in _fs_cache:
        return _fs_cache[key]
    fstype, mount = _mount_of(directory)
    if direct == "off":
        info = FsInfo(fstype, mount, False, "O_DIRECT off")
    elif direct == "auto" and fstype in MEMORY_FS:
        info = FsInfo(fstype, mount, False, f"{fstype} is memory: buffered writes are the fastest")
    else:
        why = _probe_direct(directory)
        info = FsInfo(fstype, mount, why is None, why or "O_DIRECT")
    _fs_cache[key] = info
    return info


# -- one chunk file ---------------------------------------------------------------------------


_local = threading.local()


def _bounce() -> mmap.mmap:
    b = getattr(_local, "bounce", None)
    if b is None:
        b = _local.bounce = mmap.mmap(-1, BOUNCE)  # page-aligned
    return b


def _addr(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


def write_chunk_file(path: str, data: Buffer, *, sync: bool, direct: bool) -> bool:
    """Create ``path`` (O_EXCL, mode 0600) holding ``data``; fsync it when ``sync``. With
    ``direct``, the aligned body goes through O_DIRECT. Returns whether O_DIRECT was used (False
    when the filesystem refused it: the caller stops asking)."""
    view = memoryview(data).cast("B")
    n = len(view)
    body = n - n % DIRECT_ALIGN if direct else 0
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    used = False
    fd = os.open(path, flags | (os.O_DIRECT if body else 0), 0o600)
    try:
        done = 0
        if body:
            try:
                done = _write_direct(fd, view[:body])
                used = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                os.lseek(fd, 0, os.SEEK_SET)
                os.ftruncate(fd, 0)
                done = 0
            os.set_blocking(fd, True)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            os.lseek(fd, done, os.SEEK_SET)
        _write_all(fd, view[done:])
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    os.close(fd)
    return used


def _write_direct(fd: int, view: memoryview) -> int:
    """Write ``view`` (a multiple of DIRECT_ALIGN long) with O_DIRECT: straight from its pages
    when its address is aligned, through the bounce buffer when not. Returns the bytes written."""
    done = 0
    aligned = _addr(view) % DIRECT_ALIGN == 0
    bounce = None if aligned else memoryview(_bounce())
    while done < len(view):
        if aligned:
            n = os.write(fd, view[done:done + DIRECT_PIECE])
        else:
            assert bounce is not None
            m = min(BOUNCE, len(view) - done)
            bounce[:m] = view[done:done + m]
            n = os.write(fd, bounce[:m])
        if n <= 0 or n % DIRECT_ALIGN:
            raise OSError(errno.EINVAL, "short O_DIRECT write")
        done += n
    return done


# -- the writer's threads ---------------------------------------------------------------------


class Workers:
    """A fixed set of daemon threads running submitted calls in order; ``Future`` results.

    Unlike concurrent.futures' pool it keeps taking work while the interpreter exits (its threads
    are daemons, and nothing refuses a submit at shutdown), so an image being written when the
    program ends can still be finished from an exit handler."""

    def __init__(self, threads: int, name: str = "gpuos-image"):
        self._q: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(max(1, threads))]
        self._closed = False
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 (handed to the waiter)
                fut.set_exception(e)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._closed:
            raise RuntimeError("the writer's threads were shut down")
        fut: Future = Future()
        self._q.put((fut, fn, args))
        return fut

    def shutdown(self, cancel: bool = False) -> None:
        """Stop the threads after the work queued (``cancel``: drop what has not started) and
        wait for them."""
        if self._closed:
            return
        self._closed = True
        if cancel:
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in self._threads:
            self._q.put(None)
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join()
