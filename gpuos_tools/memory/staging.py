"""Pinned host staging for the agent's snapshots and rollbacks, pinned in pieces.

Pinning host memory is slow (the kernel faults in and locks every page: ~2 GB/s) and, done in
one call, it holds the process's address-space lock and the driver's for the whole of it: a
single 8 GiB `cuMemHostAlloc` stopped the traced job for 3.6-4.8 s on an H100 (BENCHMARKS.md).
So the staging is one anonymous mapping, reserved at the GPU's size without backing
(MAP_NORESERVE) so that it never moves, and registered with `cuMemHostRegister` a piece at a
time, growing as the program's allocations grow; between pieces the program's own calls get
through. A copy must stay inside one registered piece to be a DMA copy from pinned memory, so
every copy through the staging is cut at piece boundaries by ``spans``.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator

PIECE = 64 << 20  #: bytes registered per call (~30 ms of pinning)


class StagingError(RuntimeError):
    pass


class Staging:
    """Host memory at ``base`` of which the first ``capacity`` bytes are pinned for the device.

    ``register`` and ``unregister`` are the driver's calls (``cuMemHostRegister(addr, n, 0)``,
    ``cuMemHostUnregister(addr)``) returning a CUresult-like status, 0 for success; they are
    parameters so that the piece logic is testable without a GPU.
    """

    def __init__(self, reserve: int, register: Callable[[int, int], int], unregister: Callable[[int], int],
                 piece: int = PIECE) -> None:
        if reserve <= 0 or piece <= 0 or piece % mmap.PAGESIZE:
            raise ValueError("reserve must be positive and piece a positive multiple of the page size")
        self.reserve = -(-reserve // piece) * piece
        self.piece = piece
        self._register, self._unregister = register, unregister
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        self._map = mmap.mmap(-1, self.reserve, flags=flags)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer pages to fault in and pin, where THP allows
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.base = ctypes.addressof(self._anchor)
        self.ends: list[int] = []  #: end offset of each registered piece, increasing
        self.pin_s = 0.0  #: seconds spent registering, in all
        self.lock = threading.Lock()  #: one piece registered at a time

    @property
    def capacity(self) -> int:
        return self.ends[-1] if self.ends else 0

    def grow(self, total: int, pause: Callable[[float], float] | None = None,
             stop: threading.Event | None = None) -> float:
        """Pin pieces until at least ``total`` bytes are pinned; return the seconds it took.
        After each piece, ``pause(seconds the piece took)`` may return how long to sleep before
        the next one (to leave the program time between pieces); ``stop`` ends it early."""
        if total > self.reserve:
            raise StagingError(f"{total} bytes of staging asked, {self.reserve} reserved")
        spent = 0.0
        while True:
            if stop is not None and stop.is_set():
                break
            with self.lock:  # per piece: another grower (a snapshot) may go on between pieces
                start = self.capacity
                if start >= total:
                    break
                n = min(self.piece, self.reserve - start)
                t = time.perf_counter()
                status = int(self._register(self.base + start, n))
                took = time.perf_counter() - t
                if status != 0:
                    raise StagingError(f"cuMemHostRegister of {n} bytes of staging at offset {start} failed "
                                       f"(CUresult {status}); {start} bytes are pinned")
                self.ends.append(start + n)
                self.pin_s += took
            spent += took
            if pause is not None and self.capacity < total:
                wait = pause(took)
                if wait > 0:
                    time.sleep(wait)
        return spent

    def spans(self, offset: int, n: int) -> Iterator[tuple[int, int]]:
        """(address, length) pieces of [offset, offset + n) of the staging, none crossing a
        registration boundary or longer than ``self.piece``; all must lie in pinned memory."""
        if offset < 0 or n < 0 or offset + n > self.capacity:
            raise StagingError(f"bytes {offset}..{offset + n} are outside the {self.capacity} pinned bytes")
        end = offset + n
        while offset < end:
            i = bisect_right(self.ends, offset)
            stop = min(end, self.ends[i])
            yield self.base + offset, stop - offset
            offset = stop

    def view(self, n: int) -> memoryview:
        """The first ``n`` bytes, for the host side (hashing, writing an image, reading one)."""
        return memoryview(self._map)[:n]

    def close(self) -> None:
        """Unregister every piece and unmap (the device must no longer be copying to it)."""
        with self.lock:
            start = 0
            for end in self.ends:
                self._unregister(self.base + start)
                start = end
            self.ends = []
            del self._anchor
            self._map.close()


def driver_staging(reserve: int, piece: int = PIECE) -> Staging:
    """A Staging on the CUDA driver of the current context (cuda-python)."""
    from cuda.bindings import driver as drv

    def register(addr: int, n: int) -> int:
        (err,) = drv.cuMemHostRegister(addr, n, 0)
        return int(err)

    def unregister(addr: int) -> int:
        (err,) = drv.cuMemHostUnregister(addr)
        return int(err)

    return Staging(reserve, register, unregister, piece)
