"""The fault-driven managed-memory (UM) baseline for PyTorch programs: what
`gpu-prefetch-sched run --budget N%` is compared with in scripts/bench_online_torch.py (um rows).

An EMULATION of the CUDA driver's eviction of managed memory under pressure, done explicitly,
because the baseline must never allocate more managed memory than the GPU has free (the
driver's own eviction would need the GPU's memory really full, and the device is shared):

- Memory: torch allocates through a small C library (csrc/gpuos_um.c, built once with the
  system compiler by cbuild.build_library, libcuda dlopened at run time) put in place with
  `torch.cuda.memory.CUDAPluggableAllocator`: every block is its own `cuMemAllocManaged`
  allocation, cached per size class and stream like the owned allocator's PyTorch cache (same
  classes), never given back during the job. The managed bytes may never exceed the GPU's free
  memory at the first allocation less a reserve (1 GiB by default) for what is not managed:
  a request past that ends the process with a clear message (exit status 81, ExitCode.BAD_GPU)
  before anything is allocated.
- The software budget: a fraction of the job's managed bytes (every block allocated so far, the
  cached ones included: the share `gpu-prefetch-sched run --budget N%` takes of its owned
  records), or bytes. A `torch.utils._python_dispatch.TorchDispatchMode` sees every aten
  operation (the backward's too: autograd's threads carry the mode). Before an operation, the
  blocks of its tensor arguments (a tensor's storage `data_ptr` is its block's base) are
  marked used, and whole blocks are pushed to host memory, least recently used first and never
  one of the operation's, until the resident blocks plus the operation's fit the budget
  (`cuMemPrefetchAsync` to the host on the current stream: ordered after the kernels that used
  them). After it, the blocks the allocator handed out meanwhile (its outputs, temporaries,
  workspaces taken from the allocator: the C library logs every block it hands out) are
  marked used in the same way; an operation's new outputs are therefore counted only once it
  is enqueued (their size is not known before), so the resident set can exceed the budget by
  one operation's new blocks while its kernels run. Nothing is ever prefetched back: a kernel
  that touches an evicted block faults its pages in on demand. The budget is the resident set
  as the emulation counts it, not memory the driver measures.
- Not managed: cuBLAS's and cuBLASLt's workspaces (32 MiB each at CUBLAS_WORKSPACE_CONFIG
  :4096:8) and cuDNN's few bytes, which torch 2.11 allocates with cudaMalloc past any pluggable
  allocator (scripts/probe_torch_not_owned.py, measured on an H100): they stay on the GPU,
  outside the budget, as they stay outside `gpu-prefetch-sched run`'s owned records.
- Fraction 1 ("um100") evicts nothing: managed memory resident on the GPU with the hook's own
  cost, so that cost is visible apart from the faults.

Counts (`ManagedLRU.counts`): operations seen, evictions and their bytes, blocks an operation
touched while evicted (faulted_in: the faults bring back at most their bytes), decisions
(before or after an operation) that found its own blocks above the budget (over_budget: it
runs above it), the peak resident bytes, and the hook's own time.

    session = managed.install_torch(0.5)   # before torch's first CUDA allocation
    with session.mode():
        ...  # the program
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpuos_tools import cbuild
from gpuos_tools.errors import ExitCode

SOURCE = Path(__file__).resolve().parent / "csrc" / "gpuos_um.c"
INCLUDE = Path(__file__).resolve().parent / "include"  #: gpuos_sizeclass.h, shared by both caches
LOGN = 65536  #: the C library's ring of blocks handed out (LOGN there)
RESERVE = 1 << 30  #: bytes of the GPU's free memory left to what is not managed
COUNTERS = ("ops", "evictions", "evicted_bytes", "faulted_in", "faulted_bytes", "over_budget")
STATS = ("blocks", "managed_bytes", "cache_hits", "cache_misses", "cached_bytes", "refused", "refused_bytes",
         "limit", "driver_errors", "last_error")


class ManagedError(Exception):
    pass


# ---------------------------------------------------------------- the budget (pure Python)

class ManagedLRU:
    """The software budget over managed blocks (module docstring): which blocks to push to the
    host before an operation. No CUDA here: the caller evicts what `touch` returns."""

    def __init__(self, fraction: float | None = None, budget: int | None = None) -> None:
        if (fraction is None) == (budget is None):
            raise ValueError("a fraction or a budget in bytes")
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"fraction {fraction}: expected 0 < fraction <= 1")
        self.fraction, self.fixed = fraction, budget
        self.sizes: dict[int, int] = {}  #: every block seen: base -> bytes
        self.total = 0  #: their bytes (the job's managed bytes)
        self.resident: OrderedDict[int, int] = OrderedDict()  #: base -> bytes, least recently used first
        self.resident_bytes = 0
        self.evicted: set[int] = set()  #: pushed to the host and not touched since
        self.counts = {"ops": 0, "evictions": 0, "evicted_bytes": 0, "faulted_in": 0, "faulted_bytes": 0,
                       "over_budget": 0, "peak_resident": 0}

    def budget(self) -> int:
        return int(self.total * self.fraction) if self.fraction is not None else int(self.fixed or 0)

    def add(self, base: int, size: int) -> None:
        """A block the allocator handed out (again: nothing changes)."""
        old = self.sizes.get(base)
        if old is None:
            self.sizes[base] = size
            self.total += size
        elif old != size:  # blocks are never given back, so a base keeps its size
            raise ManagedError(f"block {base:#x} seen with {old} and {size} bytes")

    def touch(self, bases: Iterable[int]) -> list[tuple[int, int]]:
        """An operation uses the blocks at ``bases`` (others are not managed: ignored). Returns the
        blocks to push to the host before it, in order (least recently used first, none of its
        own), so that the resident blocks and its own fit the budget; its blocks are then the
        most recently used, resident."""
        sizes, resident = self.sizes, self.resident
        ws = [b for b in dict.fromkeys(bases) if b in sizes]
        need = sum(sizes[b] for b in ws if b not in resident)
        budget = self.budget()
        victims: list[tuple[int, int]] = []
        if self.resident_bytes + need > budget:
            own = set(ws)
            left = self.resident_bytes + need
            for b, size in resident.items():
                if left <= budget:
                    break
                if b not in own:
                    victims.append((b, size))
                    left -= size
            c = self.counts
            for b, size in victims:
                del resident[b]
                self.evicted.add(b)
                self.resident_bytes -= size
                c["evictions"] += 1
                c["evicted_bytes"] += size
        for b in ws:
            if b in resident:
                resident.move_to_end(b)
                continue
            size = sizes[b]
            resident[b] = size
            self.resident_bytes += size
            if b in self.evicted:
                self.evicted.discard(b)
                self.counts["faulted_in"] += 1
                self.counts["faulted_bytes"] += size
        if self.resident_bytes > budget and ws:
            self.counts["over_budget"] += 1
        if self.resident_bytes > self.counts["peak_resident"]:
            self.counts["peak_resident"] = self.resident_bytes
        return victims


# ---------------------------------------------------------------- the C library

def build(cache: Path | None = None) -> Path:
    """The library's path, compiled once per version of its source and headers (cbuild.build_library)."""
    return cbuild.build_library(cache, source=SOURCE, stem="libgpuos_um", includes=(INCLUDE,))


class ManagedLibrary:
    """csrc/gpuos_um.c loaded (one per process: its cache and log are process-wide)."""

    def __init__(self, path: str | os.PathLike, libcuda: str | None = None, reserve: int = RESERVE,
                 refuse_exit: int = int(ExitCode.BAD_GPU)) -> None:
        self.path = str(path)
        lib = ctypes.CDLL(self.path)
        lib.gpuos_um_init.argtypes = [ctypes.c_char_p, ctypes.c_uint64, ctypes.c_int]
        lib.gpuos_um_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.gpuos_um_malloc.restype = ctypes.c_uint64
        lib.gpuos_um_free.argtypes = [ctypes.c_uint64, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.gpuos_um_evict.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p]
        lib.gpuos_um_round.argtypes = [ctypes.c_size_t]
        lib.gpuos_um_round.restype = ctypes.c_size_t
        lib.gpuos_um_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        rc = lib.gpuos_um_init(libcuda.encode() if libcuda else None, reserve, refuse_exit)
        if rc:
            what = {-1: f"cannot load {libcuda or 'libcuda.so.1'}", -2: "the driver lacks managed memory entry points"}
            raise ManagedError(f"managed allocator: {what.get(rc, rc)}")
        self.lib = lib
        self.reserve = reserve
        self.nlog = ctypes.c_uint64.in_dll(lib, "gpuos_um_nlog")
        self.log_ptr = (ctypes.c_uint64 * LOGN).in_dll(lib, "gpuos_um_log_ptr")
        self.log_size = (ctypes.c_uint64 * LOGN).in_dll(lib, "gpuos_um_log_size")
        self.seen = 0  #: log entries read

    def malloc(self, size: int, stream: int = 0) -> int:
        return self.lib.gpuos_um_malloc(size, 0, stream or None)

    def free(self, ptr: int, size: int, stream: int = 0) -> None:
        self.lib.gpuos_um_free(ptr, size, 0, stream or None)

    def round(self, size: int) -> int:
        return self.lib.gpuos_um_round(size)

    def evict(self, ptr: int, size: int, stream: int) -> None:
        """Push a block to host memory, ordered on ``stream``."""
        rc = self.lib.gpuos_um_evict(ptr, size, stream or None)
        if rc:
            raise ManagedError(f"cuMemPrefetchAsync of {size} bytes at {ptr:#x} to the host: CUresult {rc}")

    def drain(self) -> list[tuple[int, int]]:
        """The blocks handed out since the last drain: (base, bytes), in order."""
        n = self.nlog.value
        if n == self.seen:
            return []
        if n - self.seen > LOGN:
            raise ManagedError(f"managed allocator: {n - self.seen} blocks handed out between two reads (log of {LOGN})")
        ptrs, sizes = self.log_ptr, self.log_size
        out = [(ptrs[i % LOGN], sizes[i % LOGN]) for i in range(self.seen, n)]
        self.seen = n
        return out

    def stats(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * len(STATS))()
        self.lib.gpuos_um_stats(out)
        return dict(zip(STATS, (int(x) for x in out)))


# ---------------------------------------------------------------- PyTorch

class Session:
    """The allocator in place and the budget; `mode()` is the dispatch mode that applies it."""

    def __init__(self, lib: ManagedLibrary, lru: ManagedLRU) -> None:
        self.lib, self.lru = lib, lru
        self.hook_s = 0.0
        self.evict_path = "libcuda cuMemPrefetchAsync_v2(location=HOST) via gpuos_um.c"

    def counts(self) -> dict[str, Any]:
        """The counters so far, the hook's time included (for a timed region: the difference of two)."""
        c = self.lru.counts
        return {**{k: c[k] for k in COUNTERS}, "hook_s": round(self.hook_s, 6)}

    def summary(self) -> dict[str, Any]:
        """The whole run: the counters, the peak resident bytes, the managed bytes, the budget at
        the end (blocks handed out since the last operation are added first)."""
        for base, size in self.lib.drain():
            self.lru.add(base, size)
        lru = self.lru
        return {**self.counts(), "peak_resident": lru.counts["peak_resident"], "total": lru.total,
                "budget": lru.budget(), "resident": lru.resident_bytes, "fraction": lru.fraction,
                "fixed_budget": lru.fixed, "reserve": self.lib.reserve, "allocator": self.lib.stats(),
                "evict_path": self.evict_path}

    def _apply(self, victims: list[tuple[int, int]]) -> None:
        import torch

        stream = torch.cuda.current_stream().cuda_stream
        for base, size in victims:
            self.lib.evict(base, size, stream)

    def mode(self) -> Any:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        tensor = torch.Tensor
        session, lru, lib = self, self.lru, self.lib
        add, touch, drain = lru.add, lru.touch, lib.drain
        clock = time.perf_counter

        def bases_of(args: tuple, kwargs: dict) -> list[int]:
            out = []
            for a in (*args, *kwargs.values()):
                if isinstance(a, tensor):
                    if a.is_cuda:
                        out.append(a.untyped_storage().data_ptr())
                elif isinstance(a, (list, tuple)):
                    out.extend(x.untyped_storage().data_ptr() for x in a if isinstance(x, tensor) and x.is_cuda)
            return out

        class BudgetMode(TorchDispatchMode):
            """Before each operation: its blocks used, least recently used blocks to the host
            (gpuos_tools.memory.managed)."""

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                kwargs = kwargs or {}
                t = clock()
                lru.counts["ops"] += 1
                bases = bases_of(args, kwargs)
                for base, size in drain():  # allocated between operations
                    add(base, size)
                    bases.append(base)
                victims = touch(bases)
                if victims:
                    session._apply(victims)
                t1 = clock()
                out = func(*args, **kwargs)
                t2 = clock()
                new = drain()
                if new:
                    for base, size in new:
                        add(base, size)
                    victims = touch([*bases, *(b for b, _ in new)])
                    if victims:
                        session._apply(victims)
                session.hook_s += (t1 - t) + (clock() - t2)
                return out

        return BudgetMode()


_session: Session | None = None


def install_torch(fraction: float | None = None, budget: int | None = None, reserve: int = RESERVE,
                  cache: Path | None = None) -> Session:
    """Make torch allocate managed memory through csrc/gpuos_um.c and return the session whose
    `mode()` applies the budget. Before torch's first CUDA allocation (torch refuses to swap an
    allocator in use); once per process."""
    global _session
    import torch

    if _session is not None:
        raise ManagedError("the managed allocator is already installed in this process")
    lib = ManagedLibrary(build(cache), reserve=reserve)  # initialised before torch dlopens the same file
    alloc = torch.cuda.memory.CUDAPluggableAllocator(lib.path, "gpuos_um_malloc", "gpuos_um_free")
    torch.cuda.memory.change_current_allocator(alloc)
    _session = Session(lib, ManagedLRU(fraction, budget))
    _session.allocator = alloc  # type: ignore[attr-defined]  (kept alive with the session)
    return _session
