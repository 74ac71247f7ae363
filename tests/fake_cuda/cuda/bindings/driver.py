"""A stand-in for cuda-python's ``cuda.bindings.driver`` in unit tests of how a second process gets a
program's device addresses (tests/test_probe_validator_va.py puts tests/fake_cuda first on
PYTHONPATH): only the calls scripts/probe_validator_va.py and the validator make before a launch,
with the address-space behaviour under test real.

At cuInit it reserves an area of its own with mmap (no access, no hint: the kernel chooses where,
as for any mapping), ``FAKE_CUDA_AREA`` bytes (4 GiB); device allocations are handed out from the
top of the area down. ``cuMemAddressReserve`` honours the hint according to ``FAKE_CUDA_HINTS``:
``own`` (default) only inside its area (the hypothesis about the real driver), ``any`` also at any
address free in the process (taken with MAP_FIXED_NOREPLACE, as a driver that grows its areas
there would). No memory is ever backed."""

from __future__ import annotations

import ctypes
import enum
import os
from types import SimpleNamespace


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAllocationGranularity_flags(enum.IntEnum):  # noqa: N801 - the driver's name
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class CUmemAccess_flags(enum.IntEnum):  # noqa: N801 - the driver's name
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAllocationProp:
    def __init__(self) -> None:
        self.type = 0
        self.location = SimpleNamespace(type=0, id=0)


class CUmemAccessDesc:
    def __init__(self) -> None:
        self.location = SimpleNamespace(type=0, id=0)
        self.flags = 0


GRANULARITY = 2 << 20
_OK = CUresult.CUDA_SUCCESS
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_FAILED = ctypes.c_void_p(-1).value
_PRIVATE_ANON_NORESERVE = 0x02 | 0x20 | 0x4000
_FIXED_NOREPLACE = 0x100000

_state: dict = {"area": None, "used": {}, "outside": {}, "handles": 0}


def _mmap(addr: int, size: int, flags: int) -> int | None:
    got = _libc.mmap(addr, size, 0, flags, -1, 0)
    return None if got in (None, _FAILED) else got


def cuDriverGetVersion():
    return _OK, 13000


def cuInit(flags):
    if _state["area"] is None:
        size = int(os.environ.get("FAKE_CUDA_AREA", 4 << 30))
        got = _mmap(0, size, _PRIVATE_ANON_NORESERVE)
        if got is None:
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY,)
        _state["area"] = (got, got + size)
    return (_OK,)


def _need_init():
    return _state["area"] is None


def cuDeviceGet(ordinal):
    return (CUresult.CUDA_ERROR_NOT_INITIALIZED, None) if _need_init() else (_OK, 0)


def cuDeviceGetByPCIBusId(bus_id):
    return cuDeviceGet(0)


def cuDevicePrimaryCtxRetain(dev):
    return _OK, 1


def cuCtxSetCurrent(ctx):
    return (_OK,)


def cuMemGetInfo():
    return _OK, 79 << 30, 80 << 30


def cuMemGetAllocationGranularity(prop, flags):
    return _OK, GRANULARITY


def _free_in_area(addr: int, size: int) -> bool:
    lo, hi = _state["area"]
    return lo <= addr and addr + size <= hi and not any(
        s < addr + size and addr < s + n for s, n in _state["used"].items())


def _top_down(size: int, align: int) -> int | None:
    lo, hi = _state["area"]
    pos = (hi - size) // align * align
    while pos >= lo:
        clash = [s for s, n in _state["used"].items() if s < pos + size and pos < s + n]
        if not clash:
            return pos
        pos = (min(clash) - size) // align * align
    return None


def cuMemAddressReserve(size, alignment, addr, flags):
    if _need_init():
        return CUresult.CUDA_ERROR_NOT_INITIALIZED, None
    align = max(GRANULARITY, int(alignment))
    addr = int(addr)
    if addr and addr % align == 0:
        if _free_in_area(addr, size):
            _state["used"][addr] = size
            return _OK, addr
        lo, hi = _state["area"]
        outside = addr + size <= lo or hi <= addr
        if os.environ.get("FAKE_CUDA_HINTS", "own") == "any" and outside:
            if _mmap(addr, size, _PRIVATE_ANON_NORESERVE | _FIXED_NOREPLACE) == addr:
                _state["outside"][addr] = size
                return _OK, addr
    got = _top_down(size, align)
    if got is None:
        return CUresult.CUDA_ERROR_OUT_OF_MEMORY, None
    _state["used"][got] = size
    return _OK, got


def cuMemAddressFree(addr, size):
    addr = int(addr)
    if _state["outside"].pop(addr, None) is not None:
        _libc.munmap(addr, size)
        return (_OK,)
    return (_OK,) if _state["used"].pop(addr, None) is not None else (CUresult.CUDA_ERROR_INVALID_VALUE,)


def cuMemAlloc(size):
    return cuMemAddressReserve(-(-size // GRANULARITY) * GRANULARITY, GRANULARITY, 0, 0)


def cuMemCreate(size, prop, flags):
    _state["handles"] += 1
    return _OK, _state["handles"]


def cuMemRelease(handle):
    return (_OK,)


def cuMemMap(addr, size, offset, handle, flags):
    inside = any(s <= addr and addr + size <= s + n for s, n in {**_state["used"], **_state["outside"]}.items())
    return (_OK,) if inside else (CUresult.CUDA_ERROR_INVALID_VALUE,)


def cuMemUnmap(addr, size):
    return (_OK,)


def cuMemSetAccess(addr, size, descs, count):
    return (_OK,)
