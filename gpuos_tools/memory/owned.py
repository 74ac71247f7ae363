"""Owned allocations: the agent as the allocator of the traced program, on the CUDA virtual
memory API, so that a buffer's physical memory can be released and later made resident again at
the same address. The paragraphs after this one are gpu-trace(1)'s OWNED ALLOCATIONS section
(commands/trace.py); the design, for a reader of the code: docs/owned-memory-and-residency.md.

The allocator is a small C library (csrc/gpuos_alloc.c), built once with the system compiler
into the user's cache like the native tracer, and loaded with ctypes. Every buffer gets its own
reserved address range, rounded up to the allocation granularity (2 MiB on Hopper) and backed by
one physical allocation; requests of up to 1 MiB are carved out of granule-sized segments by
power-of-two size class, and such a segment is then the unit of residency. The library's table
(address, size, physical handle, resident) is read here through ctypes.

CuPy: `GPUOS_AGENT_OWN=1` in the environment of `gpu-trace run` (any backend, with or without
`--agent`) makes the tracer's bootstrap route CuPy's allocations through the library, before
the program's first line: a `cupy.cuda.MemoryPool` over a `CFunctionAllocator` of the library,
so CuPy's own caching stays in front and allocation-heavy programs keep their speed
(scripts/bench_alloc.py). `install_cupy()` does the same from any program.

Residency: the library releases a record's physical memory keeping its addresses, and makes it
resident again at the same addresses; the agent's residency engine saves the contents before
and loads them back after (a suspend, a lazy resume, `gpu-prefetch-sched run`): the same bytes
at the same addresses (tested on the GPU, tests/gpu/test_owned_gpu.py).

PyTorch: the same `GPUOS_AGENT_OWN=1` makes torch allocate through the library's
`gpuos_torch_malloc` / `gpuos_torch_free` (`torch.cuda.memory.CUDAPluggableAllocator`), put in
place by `install_torch()` before the first CUDA allocation: at boot when torch is already
imported, else by an import hook the moment `import torch` finishes (programs that never import
torch never load it). A pluggable allocator replaces torch's caching allocator, so the library
caches itself, stream-ordered (csrc/gpuos_alloc.c, "PyTorch"): a freed block is reused at once
on its stream (the class's lowest address first, so that a repeated step gets the same blocks:
gpu-prefetch-sched learns its period on them), on another stream only after an event recorded
on its stream has completed; no free synchronises the device; sizes are rounded to classes (at
most 25 % over, or the power of two up to 1 MiB). Cached blocks stay in the table and are saved
and released by a suspend like live ones. `torch.cuda.empty_cache()` is wrapped to give the
cache back (`torch_trim`). Not owned in a PyTorch program (torch 2.11; scripts/probe_torch_not_owned.py
lists them): cuBLAS's and cuBLASLt's workspaces (one each, sized by
CUBLAS_WORKSPACE_CONFIG: 32 MiB at :4096:8, 8 MiB at :4096:2) plus 1 KiB each, and cuDNN's
2 x 24.75 KiB + 2 x 4 B: torch allocates these with cudaMalloc past its allocator, so a suspend
needs --partial and they stay on the GPU. torch's memory statistics (`memory_stats`,
`memory_allocated`, `max_memory_allocated`, `memory_reserved`, `reset_peak_memory_stats`), which
raise for any pluggable allocator, are answered from the library's own counters, blocks counted
at their size class. Limits (torch's, for any pluggable allocator): `Tensor.record_stream` is not
seen (a block is freed on its allocation stream: a program that frees a tensor still used on
another stream must make that stream wait first); CUDA graph capture and replay run (tested),
but there is no private pool: a block freed during capture goes back to the shared cache, so
memory the graph still writes on replay can be handed to another tensor; keep owning off for
programs that replay graphs.
"""

from __future__ import annotations

import ctypes
import errno
import importlib.abc
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuos_tools import cbuild

SOURCE = Path(__file__).resolve().parent / "csrc" / "gpuos_alloc.c"
INCLUDE = Path(__file__).resolve().parent / "include"  #: gpuos_sizeclass.h, shared by both caches
ENV = "GPUOS_AGENT_OWN"

F_RESIDENT, F_BUSY, F_SMALL, F_FREE_PENDING = 1, 2, 4, 8


class RECORD(ctypes.Structure):
    """gpuos_alloc_record_t."""

    _fields_ = [("base", ctypes.c_uint64), ("size", ctypes.c_uint64), ("handle", ctypes.c_uint64),
                ("requested", ctypes.c_uint64), ("device", ctypes.c_int32), ("flags", ctypes.c_uint32),
                ("block", ctypes.c_uint32), ("live", ctypes.c_uint32)]


@dataclass(frozen=True)
class Record:
    """One reserved range of the library: a large buffer, or a segment of small blocks."""

    base: int
    size: int  #: bytes reserved (and mapped while resident)
    handle: int  #: the physical allocation; 0 while released
    requested: int  #: large: bytes asked for; segment: live blocks x block size
    device: int
    flags: int
    block: int  #: segment: its block size; 0 for a large buffer
    live: int  #: segment: live blocks; large: 1

    @property
    def resident(self) -> bool:
        return bool(self.flags & F_RESIDENT)

    @property
    def small(self) -> bool:
        return bool(self.flags & F_SMALL)

    @classmethod
    def of(cls, r: RECORD) -> Record:
        return cls(r.base, r.size, r.handle, r.requested, r.device, r.flags, r.block, r.live)


class OwnedError(RuntimeError):
    pass


#: the library's own refusals (negative errno values; a positive code is the driver's CUresult)
_CODES = {-errno.ENOENT: "not an owned allocation", -errno.EBUSY: "another residency operation is running on it",
          -errno.EALREADY: "already in that state", -errno.EINVAL: "not an address the library handed out"}


FRAMEWORKS = ("cupy", "torch")


def parse_option(value: str | None) -> tuple[str, ...] | None:
    """GPUOS_AGENT_OWN's value -> the frameworks to own, or None (off): 1 (both, whichever
    the program uses), or a comma-separated list of cupy, torch."""
    v = (value or "").strip().lower()
    if v in ("", "0", "off", "no", "false"):
        return None
    if v in ("1", "on", "yes", "true", "all"):
        return FRAMEWORKS
    names = [x.strip() for x in v.split(",") if x.strip()]
    if names and all(n in FRAMEWORKS for n in names):
        return tuple(n for n in FRAMEWORKS if n in names)
    raise ValueError(f"{ENV}={value!r}: expected 1 (own CuPy's and PyTorch's allocations), cupy, torch, or 0")


def build(cache: Path | None = None) -> Path:
    """The library's path, compiled once per version of its source and headers (cbuild.build_library)."""
    return cbuild.build_library(cache, source=SOURCE, stem="libgpuos_alloc", includes=(INCLUDE,))


class OwnedLibrary:
    """The loaded C library (one per process: its table is process-wide)."""

    def __init__(self, path: str | os.PathLike, libcuda: str | None = None) -> None:
        self.path = str(path)
        lib = ctypes.CDLL(self.path)
        lib.gpuos_alloc_init.argtypes = [ctypes.c_char_p]
        lib.gpuos_alloc_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int]
        lib.gpuos_alloc_malloc.restype = ctypes.c_uint64
        for name in ("gpuos_alloc_free", "gpuos_alloc_release", "gpuos_alloc_make_resident"):
            getattr(lib, name).argtypes = [ctypes.c_uint64]
        lib.gpuos_alloc_table.argtypes = [ctypes.POINTER(RECORD), ctypes.c_size_t]
        lib.gpuos_alloc_table.restype = ctypes.c_size_t
        lib.gpuos_alloc_lookup.argtypes = [ctypes.c_uint64, ctypes.POINTER(RECORD)]
        lib.gpuos_alloc_record_size.restype = ctypes.c_size_t
        lib.gpuos_alloc_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        lib.gpuos_torch_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        lib.gpuos_torch_memory.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
        lib.gpuos_torch_reset_peaks.argtypes = [ctypes.c_int]
        for name in ("gpuos_alloc_set_park_limit", "gpuos_alloc_trim_parked"):
            getattr(lib, name).argtypes = [ctypes.c_uint64]
            getattr(lib, name).restype = ctypes.c_uint64
        lib.gpuos_alloc_parked.argtypes = [ctypes.c_uint64, ctypes.c_int]
        lib.gpuos_alloc_parked.restype = ctypes.c_uint64
        lib.gpuos_alloc_park_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        lib.gpuos_alloc_parked_total.argtypes = []
        lib.gpuos_alloc_parked_total.restype = ctypes.c_uint64
        lib.gpuos_torch_round.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        lib.gpuos_torch_round.restype = ctypes.c_size_t
        lib.gpuos_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.gpuos_torch_malloc.restype = ctypes.c_uint64
        lib.gpuos_torch_free.argtypes = [ctypes.c_uint64, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.gpuos_torch_dead.argtypes = [ctypes.c_uint64]
        if lib.gpuos_alloc_record_size() != ctypes.sizeof(RECORD):
            raise OwnedError(f"{self.path}: record layout differs from owned.RECORD")
        rc = lib.gpuos_alloc_init(libcuda.encode() if libcuda else None)
        if rc:
            what = {-1: f"cannot load {libcuda or 'libcuda.so.1'}", -2: "the driver lacks the virtual memory API"}
            raise OwnedError(f"owned allocations: {what.get(rc, rc)}")
        self.lib = lib

    @classmethod
    def load(cls) -> OwnedLibrary:
        """The process's library, built and loaded on first use."""
        global _library
        with _load_lock:
            if _library is None:
                _library = cls(build())
            return _library

    # -- allocation (what the framework hooks call, here for tests and benchmarks) ------------

    def malloc(self, size: int, device: int = 0) -> int:
        """Device memory of ``size`` bytes; 0 when the driver refuses."""
        return self.lib.gpuos_alloc_malloc(size, device)

    def free(self, ptr: int) -> None:
        rc = self.lib.gpuos_alloc_free(ptr)
        if rc:
            raise OwnedError(f"free {ptr:#x}: {_CODES.get(rc, rc)}")

    def trim(self) -> int:
        """Give empty small segments back to the driver; how many."""
        return self.lib.gpuos_alloc_trim()

    # -- the PyTorch cache (what torch calls through CUDAPluggableAllocator) -------------------

    def torch_malloc(self, size: int, device: int = 0, stream: int = 0) -> int:
        return self.lib.gpuos_torch_malloc(size, device, stream)

    def torch_free(self, ptr: int, size: int, device: int = 0, stream: int = 0) -> None:
        self.lib.gpuos_torch_free(ptr, size, device, stream)

    def torch_trim(self) -> int:
        """Wait for the device once and give every cached block back; how many."""
        return self.lib.gpuos_torch_trim()

    def torch_dead(self, base: int) -> bool:
        """Whether the record at ``base`` holds only blocks torch has freed into the library's
        cache: its contents are dead, an eviction need not save them nor a load copy them back
        (False for a live block, for CuPy's records, and for an address no record starts at)."""
        return self.lib.gpuos_torch_dead(base) == 1

    def torch_round(self, size: int, granule: int = 2 << 20) -> int:
        """The size class a request of ``size`` bytes is served from."""
        return self.lib.gpuos_torch_round(size, granule)

    def torch_stats(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * 8)()
        self.lib.gpuos_torch_stats(out)
        keys = ("hits", "cross_stream_hits", "misses", "cached_bytes", "cached_blocks", "trimmed",
                "oom_retries", "events")
        return dict(zip(keys, (int(x) for x in out)))

    def torch_memory(self, device: int = 0) -> dict[str, int]:
        """torch's memory statistics for ``device``, as the library keeps them: bytes of live
        blocks (by their size class) and of blocks held from the driver (live and cached), their
        peaks, the allocations and frees, and the bytes allocated and freed in all."""
        out = (ctypes.c_uint64 * 8)()
        self.lib.gpuos_torch_memory(device, out)
        keys = ("allocated", "allocated_peak", "reserved", "reserved_peak", "allocs", "frees", "bytes_allocated",
                "bytes_freed")
        return dict(zip(keys, (int(x) for x in out)))

    def torch_reset_peaks(self, device: int = 0) -> None:
        self.lib.gpuos_torch_reset_peaks(device)

    # -- residency ----------------------------------------------------------------------------

    def release(self, addr: int) -> None:
        """Unmap and release the physical memory of the record holding ``addr`` (its range stays)."""
        self._check(self.lib.gpuos_alloc_release(addr), "release", addr)

    def make_resident(self, addr: int) -> None:
        """Physical memory for the record holding ``addr`` again, mapped at the same address."""
        self._check(self.lib.gpuos_alloc_make_resident(addr), "make_resident", addr)

    # -- parked physical memory (the C file's "parked physical memory": a released record's
    # physical allocation kept for the next make-resident of the same size, because creating and
    # releasing physical memory halves host-to-device copies for a while) ---------------------

    def set_park_limit(self, limit: int) -> int:
        """Park up to ``limit`` bytes of released records' physical memory (0: off, the default).
        Whoever turns it on counts parked bytes as used memory. Returns the bytes parked now."""
        return self.lib.gpuos_alloc_set_park_limit(max(0, int(limit)))

    def trim_parked(self, keep: int = 0) -> int:
        """Release parked memory down to ``keep`` bytes; the bytes still parked."""
        return self.lib.gpuos_alloc_trim_parked(max(0, int(keep)))

    def parked(self, size: int, device: int = 0) -> int:
        """Bytes parked in allocations of exactly ``size`` on ``device`` (what a make-resident of
        a record of that size would reuse instead of creating memory)."""
        return self.lib.gpuos_alloc_parked(size, device)

    def parked_bytes(self) -> int:
        """Bytes parked now (park_stats' first field in one call: the executor asks at every
        decision)."""
        return int(self.lib.gpuos_alloc_parked_total())

    def park_stats(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * 6)()
        self.lib.gpuos_alloc_park_stats(out)
        keys = ("parked_bytes", "park_limit", "parks", "park_reuses", "parked_released", "physical_creates")
        return dict(zip(keys, (int(x) for x in out)))

    def _check(self, rc: int, what: str, addr: int) -> None:
        if rc:
            reason = _CODES.get(rc) if rc < 0 else f"CUDA error {rc} ({_cu_name(rc)})"
            raise OwnedError(f"{what} {addr:#x}: {reason}")

    # -- the table ----------------------------------------------------------------------------

    def table(self) -> list[Record]:
        """Every record, by address."""
        while True:
            n = self.lib.gpuos_alloc_table(None, 0)
            buf = (RECORD * max(n, 1))()
            total = self.lib.gpuos_alloc_table(buf, n)
            if total <= n:
                return [Record.of(buf[i]) for i in range(total)]

    def lookup(self, addr: int) -> Record | None:
        r = RECORD()
        return Record.of(r) if self.lib.gpuos_alloc_lookup(addr, ctypes.byref(r)) == 0 else None

    def stats(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * 8)()
        self.lib.gpuos_alloc_stats(out)
        keys = ("mallocs", "frees", "reserved_bytes", "mapped_bytes", "releases", "make_residents",
                "driver_errors", "last_error")
        return dict(zip(keys, (int(x) for x in out)))

    def function(self, name: str) -> int:
        """Address of an exported C function (for CFunctionAllocator / CUDAPluggableAllocator)."""
        return ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value or 0


_library: OwnedLibrary | None = None
_load_lock = threading.Lock()
_pool: Any = None


def _cu_name(code: int) -> str:
    try:
        from cuda.bindings import driver as drv

        return drv.CUresult(code).name
    except Exception:
        return "?"


# ---------------------------------------------------------------- CuPy

def install_cupy() -> Any:
    """Make CuPy allocate through the library, with a MemoryPool in front; returns the pool.

    A failed allocation raises CuPy's out-of-memory runtime error, so that the pool frees its
    cached blocks and retries as it does over cudaMalloc."""
    global _pool
    import cupy
    from cupy.cuda import memory

    try:
        from cupy_backends.cuda.api.runtime import CUDARuntimeError
    except ImportError:  # pragma: no cover - older layouts
        from cupy.cuda.runtime import CUDARuntimeError

    lib = OwnedLibrary.load()
    raw = memory.CFunctionAllocator(0, lib.function("gpuos_cupy_malloc"), lib.function("gpuos_cupy_free"), lib)
    raw_malloc = raw.malloc

    def allocate(size: int):
        ptr = raw_malloc(size)
        if size and not ptr.ptr:
            raise CUDARuntimeError(2)  # cudaErrorMemoryAllocation: the pool frees and retries
        return ptr

    pool = cupy.cuda.MemoryPool(allocator=allocate)
    cupy.cuda.set_allocator(pool.malloc)
    _pool = pool
    return pool


# ---------------------------------------------------------------- PyTorch

_torch_allocator: Any = None


def install_torch() -> Any:
    """Make torch allocate through the library (CUDAPluggableAllocator over gpuos_torch_malloc /
    gpuos_torch_free); returns the allocator. It must run before torch's first CUDA allocation
    (torch refuses to swap an allocator in use). torch.cuda.empty_cache() then trims the
    library's cache."""
    global _torch_allocator
    import torch

    if _torch_allocator is not None:
        return _torch_allocator
    lib = OwnedLibrary.load()  # initialised before torch dlopens the same file
    alloc = torch.cuda.memory.CUDAPluggableAllocator(lib.path, "gpuos_torch_malloc", "gpuos_torch_free")
    torch.cuda.memory.change_current_allocator(alloc)
    original = torch.cuda.memory.empty_cache

    def empty_cache() -> None:
        """Give the owned allocator's cached blocks back to the driver (gpuos agent)."""
        if torch.cuda.is_initialized():
            lib.torch_trim()
        original()

    empty_cache.__wrapped__ = original  # type: ignore[attr-defined]
    torch.cuda.memory.empty_cache = empty_cache
    torch.cuda.empty_cache = empty_cache
    answer_torch_memory_stats(torch, lib)
    _torch_allocator = alloc
    return alloc


def torch_memory_stats(lib: OwnedLibrary, device: int) -> dict[str, Any]:
    """``torch.cuda.memory_stats_as_nested_dict(device)`` from the library's counters: what a
    pluggable allocator leaves unanswered ("CUDAPluggableAllocator does not yet support
    getDeviceStats"), and what training loops and libraries read (memory_allocated,
    max_memory_allocated, memory_reserved, memory_stats). Blocks are counted at their size class
    (torch's own allocator counts at 512-byte rounding), so "requested" equals "allocated"."""
    m, counters = lib.torch_memory(device), lib.torch_stats()

    def stat(current: int, peak: int, allocated: int, freed: int) -> dict[str, dict[str, int]]:
        one = {"current": current, "peak": peak, "allocated": allocated, "freed": freed}
        return {"all": dict(one), "large_pool": dict(one),
                "small_pool": {"current": 0, "peak": 0, "allocated": 0, "freed": 0}}

    allocated = stat(m["allocated"], m["allocated_peak"], m["bytes_allocated"], m["bytes_freed"])
    # bytes held from the driver: current and peak only (what comes and goes is not counted)
    reserved = {pool: {"current": m["reserved"] if pool != "small_pool" else 0,
                       "peak": m["reserved_peak"] if pool != "small_pool" else 0}
                for pool in ("all", "large_pool", "small_pool")}
    live = {"current": m["allocs"] - m["frees"], "allocated": m["allocs"], "freed": m["frees"]}  # no peak kept
    counts = {"all": dict(live), "large_pool": dict(live), "small_pool": {"current": 0, "allocated": 0, "freed": 0}}
    return {
        "allocated_bytes": allocated, "active_bytes": allocated, "requested_bytes": allocated,
        "reserved_bytes": reserved, "allocation": counts, "active": counts,
        "num_alloc_retries": counters["oom_retries"], "num_ooms": 0, "num_sync_all_streams": 0,
        "num_device_alloc": counters["misses"], "num_device_free": counters["trimmed"],
    }


def answer_torch_memory_stats(torch: Any, lib: OwnedLibrary) -> None:
    """torch.cuda's memory statistics answered from the library (they raise for a pluggable
    allocator): ``memory_stats_as_nested_dict`` is what memory_stats, memory_allocated,
    max_memory_allocated, memory_reserved and max_memory_reserved read; the resets start the
    peaks again."""
    memory = torch.cuda.memory

    def index(device: Any) -> int:
        return int(torch.cuda._utils._get_device_index(device, optional=True))

    def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
        """(gpuos agent) torch's memory statistics, from the owned allocator's counters."""
        return torch_memory_stats(lib, index(device))

    def reset_peak_memory_stats(device: Any = None) -> None:
        """(gpuos agent) the peaks start again from what is allocated and reserved now."""
        lib.torch_reset_peaks(index(device))

    def reset_accumulated_memory_stats(device: Any = None) -> None:
        """(gpuos agent) the owned allocator keeps no separate accumulated counters to reset."""

    for name, fn in (("memory_stats_as_nested_dict", memory_stats_as_nested_dict),
                     ("reset_peak_memory_stats", reset_peak_memory_stats),
                     ("reset_accumulated_memory_stats", reset_accumulated_memory_stats)):
        fn.__wrapped__ = getattr(memory, name, None)  # type: ignore[attr-defined]
        setattr(memory, name, fn)
        if hasattr(torch.cuda, name):
            setattr(torch.cuda, name, fn)


def torch_allocator() -> Any:
    """The pluggable allocator install_torch put in place, or None."""
    return _torch_allocator


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Runs install_torch the moment `import torch` has finished executing torch/__init__.py
    (before the program can allocate anything), then takes itself off sys.meta_path."""

    def __init__(self) -> None:
        self.busy = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch" or self.busy:
            return None
        self.busy = True
        try:  # whichever finder after this one would have found it (the path, an editable install)
            spec = None
            for finder in [f for f in sys.meta_path if f is not self]:
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find else None
                if spec is not None:
                    break
        finally:
            self.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _InstallAfter(spec.loader, self)
        return spec


class _InstallAfter(importlib.abc.Loader):
    def __init__(self, loader: Any, hook: _TorchImportHook) -> None:
        self.loader, self.hook = loader, hook

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        if self.hook in sys.meta_path:
            sys.meta_path.remove(self.hook)
        _install_torch_or_warn()

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self.loader, name)


def _install_torch_or_warn() -> bool:
    try:
        import torch

        if not hasattr(torch._C, "_cuda_customAllocator"):
            sys.stderr.write(f"gpu-trace: warning: {ENV}: this PyTorch has no CUDA: nothing of it is owned\n")
            return False
        install_torch()
        return True
    except Exception as exc:  # noqa: BLE001 (the program runs on; a suspend will say what is not owned)
        sys.stderr.write(f"gpu-trace: warning: {ENV}: PyTorch's allocations are not owned: "
                         f"{type(exc).__name__}: {exc}\n")
        return False


def watch_torch() -> str:
    """Own torch's allocations: now if torch is imported, else when it is ("now", "hooked")."""
    if "torch" in sys.modules:
        _install_torch_or_warn()
        return "now"
    if not any(isinstance(f, _TorchImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportHook())
    return "hooked"


def loaded() -> OwnedLibrary | None:
    """The process's library if something loaded it (install_cupy, install_torch, the residency
    engine), else None."""
    return _library


def pool() -> Any:
    """The CuPy pool install_cupy put in place, or None."""
    return _pool


def boot(what: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """Own the allocations of the frameworks in ``what`` (`parse_option`'s answer to
    GPUOS_AGENT_OWN, through the boot config) that are importable; returns those owned (torch:
    also when only hooked, to be installed on import), None when none is. Called by the tracer's
    start."""
    if not what:
        return None
    done = []
    if "cupy" in what and importlib.util.find_spec("cupy") is not None:
        install_cupy()
        done.append("cupy")
    if "torch" in what and importlib.util.find_spec("torch") is not None:
        watch_torch()
        done.append("torch")
    if not done:
        sys.stderr.write(f"gpu-trace: warning: {ENV}: neither {' nor '.join(what)} is importable: nothing is owned\n")
        return None
    return tuple(done)
