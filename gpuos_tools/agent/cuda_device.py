"""The validator's own CUDA context on the program's GPU (replay.py's Device), through
cuda-python's driver bindings: reservations at given addresses, mappings, read-only protection,
copies, modules and their variables, launches (with a cluster's shape or a cooperative launch
through cuLaunchKernelEx)."""

from __future__ import annotations

import ctypes
import struct
import time
from typing import Any

import numpy as np

#: what a launch waited for past its timeout answers; the context still runs the kernel
TIMED_OUT = "timed out"


class ReplayError(Exception):
    """A driver call failed; ``code`` is the CUresult's name."""

    def __init__(self, what: str, code: str):
        super().__init__(f"{what}: {code}")
        self.code = code


class CudaDevice:
    """The validator's own context on the program's GPU, through cuda-python's driver bindings."""

    def __init__(self, bus_id: str):
        from cuda.bindings import driver as drv

        self.drv = drv
        self._ok(drv.cuInit(0), "cuInit")
        self.dev = self._ok(drv.cuDeviceGetByPCIBusId(bus_id.encode()), "cuDeviceGetByPCIBusId")
        self.ctx = self._ok(drv.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        self._ok(drv.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = int(self.dev)
        self.prop = prop
        self.granularity = int(self._ok(drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity"))
        self.handles: dict[int, Any] = {}

    def _ok(self, result: tuple, what: str) -> Any:
        err = result[0]
        if err != self.drv.CUresult.CUDA_SUCCESS:
            raise ReplayError(what, getattr(err, "name", str(err)))
        return result[1] if len(result) == 2 else None

    def reserve(self, addr: int, size: int) -> int:
        return int(self._ok(self.drv.cuMemAddressReserve(size, self.granularity, addr, 0), "cuMemAddressReserve"))

    def free_address(self, addr: int, size: int) -> None:
        self.drv.cuMemAddressFree(addr, size)

    def map(self, addr: int, size: int) -> None:
        drv = self.drv
        handle = self._ok(drv.cuMemCreate(size, self.prop, 0), "cuMemCreate")
        err = drv.cuMemMap(addr, size, 0, handle, 0)[0]
        if err != drv.CUresult.CUDA_SUCCESS:
            drv.cuMemRelease(handle)
            raise ReplayError("cuMemMap", getattr(err, "name", str(err)))
        self.handles[addr] = handle
        self._access(addr, size, drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)

    def _access(self, addr: int, size: int, flags) -> None:
        desc = self.drv.CUmemAccessDesc()
        desc.location.type = self.drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = int(self.dev)
        desc.flags = flags
        self._ok(self.drv.cuMemSetAccess(addr, size, [desc], 1), "cuMemSetAccess")

    def unmap(self, addr: int, size: int) -> None:
        self.drv.cuMemUnmap(addr, size)
        handle = self.handles.pop(addr, None)
        if handle is not None:
            self.drv.cuMemRelease(handle)

    def protect(self, addr: int, size: int, read_only: bool) -> bool:
        flags = self.drv.CUmemAccess_flags
        try:
            self._access(addr, size, flags.CU_MEM_ACCESS_FLAGS_PROT_READ if read_only
                         else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        except ReplayError:
            return False
        return True

    def upload(self, addr: int, data: np.ndarray) -> None:
        self._ok(self.drv.cuMemcpyHtoD(addr, data.ctypes.data, data.nbytes), "cuMemcpyHtoD")

    def download(self, addr: int, size: int) -> np.ndarray:
        out = np.empty(size, dtype=np.uint8)
        self._ok(self.drv.cuMemcpyDtoH(out.ctypes.data, addr, size), "cuMemcpyDtoH")
        return out

    def load(self, image: bytes, name: str) -> tuple[Any, Any]:
        """(module, function). Loaded per replay, after the reservations, and unloaded after it:
        a module's own device memory must not sit where a later launch's buffers need to go."""
        if image[:4] != b"\x7fELF" and b".version" in image[:4096] and not image.endswith(b"\0"):
            image += b"\0"  # PTX text: the driver reads it up to a NUL
        mod = self._ok(self.drv.cuModuleLoadData(image), "cuModuleLoadData")
        err, fn = self.drv.cuModuleGetFunction(mod, name.encode())
        if err != self.drv.CUresult.CUDA_SUCCESS:
            self.drv.cuModuleUnload(mod)
            raise ReplayError("cuModuleGetFunction", getattr(err, "name", str(err)))
        return mod, fn

    def unload(self, module: Any) -> None:
        self.drv.cuModuleUnload(module)

    def set_variable(self, module: Any, name: str, data: bytes) -> None:
        """Write the program's bytes of a module variable into this module's copy of it."""
        err, addr, size = self.drv.cuModuleGetGlobal(module, name.encode())
        self._ok((err,), f"cuModuleGetGlobal {name}")
        n = min(int(size), len(data))
        if n:
            self._ok(self.drv.cuMemcpyHtoD(addr, data, n), f"cuMemcpyHtoD {name}")

    def launch(self, fn: Any, grid: list[int], block: list[int], shared: int, params: list[bytes],
               attributes: list[tuple[int, bytes]] = (), timeout: float | None = None) -> str | None:
        """Launch and synchronise: None, or the error's name (the launch's or the kernel's).
        ``attributes``: (CUlaunchAttributeID, the value's bytes) of REPLAYED_ATTRIBUTES.
        ``timeout``: seconds to wait for the kernel, polling; past them TIMED_OUT (the
        kernel still runs: the context is of no further use)."""
        drv = self.drv
        if shared > 48 << 10:
            drv.cuFuncSetAttribute(fn, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                   shared)
        bufs = [ctypes.create_string_buffer(p, max(len(p), 8)) for p in params]
        ptrs = (ctypes.c_void_p * max(1, len(bufs)))(*[ctypes.addressof(b) for b in bufs])
        if attributes:
            launched = drv.cuLaunchKernelEx(self._config(grid, block, shared, attributes), fn,
                                            ctypes.addressof(ptrs), 0)[0]
        else:
            launched = drv.cuLaunchKernel(fn, *grid, *block, shared, 0, ctypes.addressof(ptrs), 0)[0]
        if timeout is not None and launched == drv.CUresult.CUDA_SUCCESS:
            deadline, pause = time.monotonic() + timeout, 1e-5
            while (state := drv.cuStreamQuery(0)[0]) == drv.CUresult.CUDA_ERROR_NOT_READY:
                if time.monotonic() > deadline:
                    return TIMED_OUT
                time.sleep(pause)
                pause = min(2 * pause, 0.01)
            if state != drv.CUresult.CUDA_SUCCESS:
                return getattr(state, "name", str(state))
        for err in (launched, drv.cuCtxSynchronize()[0]):
            if err != drv.CUresult.CUDA_SUCCESS:
                return getattr(err, "name", str(err))
        return None


    def _config(self, grid: list[int], block: list[int], shared: int, attributes: list[tuple[int, bytes]]) -> Any:
        drv = self.drv
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
        cfg.sharedMemBytes = shared
        attrs = []
        for ident, value in attributes:
            a = drv.CUlaunchAttribute()
            a.id = drv.CUlaunchAttributeID(ident)
            if ident == 4:
                a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = struct.unpack_from("<3I", value)
            elif ident == 5:
                policy = struct.unpack_from("<I", value)[0]
                a.value.clusterSchedulingPolicyPreference = drv.CUclusterSchedulingPolicy(policy)
            elif ident == 2:
                a.value.cooperative = struct.unpack_from("<i", value)[0]
            attrs.append(a)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        return cfg
