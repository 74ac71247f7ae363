"""The in-process tracer: CUPTI driver-API and resource callbacks through cupti-python. (Over 800
lines: one handler per kind of driver call, each on the program's launch path, kept beside the
callback's dispatch table that names them.)

Runs inside the traced program (started by the bootstrap in ``boot/sitecustomize.py``). Design
for a short launch path:

- subscribe only to the driver-API callbacks that matter; runtime API calls (PyTorch's
  ``cudaLaunchKernel``, ``cudaMalloc``) reach the driver and are seen there, once;
- read CUPTI's structs and the API parameter structs straight from process memory with
  ``struct.unpack_from`` over one memoryview of the address space (no ctypes object per read);
- learn each function's parameter layout once (``cuFuncGetParamInfo``/``cuKernelGetParamInfo``,
  ``.nv.info`` of the loaded cubin as a fallback) and cache it by handle;
- append a plain tuple to a deque; a drain thread ships batches to ``gpu-trace`` over a pipe,
  which does all decoding, hashing, demangling and JSON off the program's path.

Launches, allocations, copies and memsets are recorded at the callback's exit site, after the
driver returned: the result code is known, allocated addresses exist, and a module loaded lazily
by the launch has already been reported.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import struct
import sys
import threading
import time
from collections import deque

from gpuos_tools.agent import zygote
from gpuos_tools.agent.agent import Agent
from gpuos_tools.injection import intercept, tracelib
from gpuos_tools.image.manifest import load_key
from gpuos_tools.injection.config import AgentConfig, BootConfig
from gpuos_tools.memory import owned, threads
from gpuos_tools.model import binary, wire
from gpuos_tools.sched import executor

# One memoryview over the user address space (x86-64 and aarch64 user space is below 2**47).
_MEM = memoryview((ctypes.c_char * (1 << 47)).from_address(0)).cast("B")

# CUpti_CallbackData: callbackSite u32 @0, functionName @8, functionParams @16,
# functionReturnValue @24 (points at the CUresult)
_CBDATA = struct.Struct("<I4xQQQ").unpack_from
_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from
_ENTER, _EXIT = 0, 1

# Parameter structs of the driver APIs (cupti's generated_cuda_meta.h); see wire.py for tags.
_LAUNCH = struct.Struct("<Q7I4xQQQ").unpack_from  # f, grid, block, smem, stream, params, extra
_LAUNCH_COOP = struct.Struct("<Q7I4xQQ").unpack_from  # no `extra`
_LAUNCH_EX = struct.Struct("<QQQQ").unpack_from  # config*, f, params, extra
_LAUNCH_CONFIG = struct.Struct("<7I4xQ").unpack_from  # grid, block, smem, stream
_Q2 = struct.Struct("<QQ").unpack_from
_Q3 = struct.Struct("<QQQ").unpack_from
_Q4 = struct.Struct("<QQQQ").unpack_from
_Q5 = struct.Struct("<QQQQQ").unpack_from
_Q6 = struct.Struct("<QQQQQQ").unpack_from
# CUDA_MEMCPY2D (v2, size_t fields)
_MEMCPY2D = struct.Struct("<QQI4xQQQQQQI4xQQQQQQ").unpack_from
_MEMTYPE_DIR = {(1, 2): "HtoD", (2, 1): "DtoH", (2, 2): "DtoD", (1, 1): "HtoH"}
# CUpti_ResourceData: context @0, resourceHandle.stream @8, resourceDescriptor @16
# CUpti_ModuleResourceData: moduleId u32 @0, cubinSize @8, pCubin @16
_MODULE = struct.Struct("<I4xQQ").unpack_from

_Q: deque = deque()
_append = _Q.append
_now = time.monotonic_ns
_tid = threading.get_native_id

# func handle -> (n params, struct for the kernelParams array, sizes, offsets) or None. Emptied
# when a module is unloaded: the driver hands a later module's functions the same handles, and a
# stale layout read through a new kernel's parameter array dereferences garbage (seen: SIGSEGV in
# a CuPy FFT program whose cuFFT plans came and went).
_layouts: dict[int, tuple | None] = {}
_cubins: list[bytes] = []  # loaded module images, for the .nv.info fallback
_counters = {"callbacks": 0, "errors": 0, "module_unloads": 0}
_errors_seen: set[str] = set()


def _result(rp: int) -> int:
    return _U32(_MEM, rp)[0] if rp else 0


# ---------------------------------------------------------------- parameter layouts

def _param_info(func: int) -> tuple[tuple | None, str]:
    """(((offset, size), ...), source) from the driver; (None, "none") if it cannot tell."""
    from cuda.bindings import driver as drv

    ok = drv.CUresult.CUDA_SUCCESS
    bad_index = drv.CUresult.CUDA_ERROR_INVALID_VALUE
    for getter, wrap, source in (
        (drv.cuFuncGetParamInfo, drv.CUfunction, "cuFuncGetParamInfo"),
        (drv.cuKernelGetParamInfo, drv.CUkernel, "cuKernelGetParamInfo"),
    ):
        handle = wrap(func)
        out = []
        while True:
            err, offset, size = getter(handle, len(out))
            if err != ok:
                break
            out.append((int(offset), int(size)))
        # past the last parameter the driver answers INVALID_VALUE; other errors: wrong handle kind
        if err == bad_index:
            return tuple(out), source
    return None, "none"


def _module_of(func: int) -> int:
    """The module holding a function, asked of the driver (0 when it cannot tell: a library's
    kernel handle)."""
    try:
        from cuda.bindings import driver as drv

        err, module = drv.cuFuncGetModule(drv.CUfunction(func))
    except Exception:  # noqa: BLE001 - never lose the launch over it
        return 0
    return int(module) if err == drv.CUresult.CUDA_SUCCESS else 0


def _nvinfo_layout(name: str) -> tuple | None:
    from gpuos_tools.cuda import elf  # pyelftools: loaded into the program only when a layout is read

    for image in reversed(_cubins):
        try:
            if name in elf.kernels(image):
                return tuple((off, size) for _, off, size in elf.param_layout(image, name))
        except Exception:  # a malformed image must not break the program
            continue
    return None


_kernel_sets: list[frozenset[str]] = []  # the kernels of _cubins[i], read when first asked
_ptx: list[tuple[frozenset[str], bytes]] = []  # modules CUPTI handed as PTX text: (entries, text)
_PTX_ENTRY = re.compile(rb"\.entry\s+([A-Za-z_$][\w$]*)")


def _image_for(name: str, sizes: tuple | None = None) -> bytes | None:
    """The latest loaded module image (cubin) that defines kernel ``name`` with parameters of
    ``sizes`` (when given), for the validator. CuPy compiles one module per array rank, each
    defining a kernel of the same name whose arrays' structs differ in size: the latest module
    that defines the name may be another rank's."""
    from gpuos_tools.cuda import elf

    for i in range(len(_kernel_sets), len(_cubins)):
        try:
            _kernel_sets.append(frozenset(elf.kernels(_cubins[i])))
        except Exception:  # a malformed image must not break the program
            _kernel_sets.append(frozenset())
    for i in range(len(_kernel_sets) - 1, -1, -1):
        if name in _kernel_sets[i]:
            if sizes is not None:
                try:
                    if tuple(size for _, _, size in elf.param_layout(_cubins[i], name)) != tuple(sizes):
                        continue
                except Exception:  # noqa: BLE001 - no layout to compare: take it as it is
                    pass
            return _cubins[i]
    for entries, text in reversed(_ptx):
        if name in entries:
            return text
    return None


def _learn(func: int, cbdata) -> tuple | None:
    name = cbdata.symbol_name or ""
    layout, source = _param_info(func)
    if layout is None and name:
        layout = _nvinfo_layout(name)
        source = "nv.info" if layout is not None else "none"
    _append((wire.FUNC, func, name, source, layout))
    module = _module_of(func)
    if module:  # which module's variables the function reads (libraries hand out functions unseen)
        _append((wire.SYMBOL, _now(), _tid(), wire.ASKED, "function", func, module, 0, -1, name))
    if layout is None:
        entry = None
    else:
        n = len(layout)
        entry = (
            n,
            struct.Struct(f"<{n}Q").unpack_from,
            tuple(s for _, s in layout),
            tuple(o for o, _ in layout),
        )
    _layouts[func] = entry
    return entry


def _args(entry: tuple | None, kp: int, extra: int) -> bytes | None:
    if entry is None:
        return None
    n, unpack_ptrs, sizes, offsets = entry
    if n == 0:
        return b""
    mem = _MEM
    if kp:
        ptrs = unpack_ptrs(mem, kp)
        return b"".join([mem[a : a + s] for a, s in zip(ptrs, sizes)])
    if extra:  # CU_LAUNCH_PARAM_BUFFER_POINTER (1) / _SIZE (2) ... _END (0)
        buf = 0
        i = extra
        while True:
            key, val = _Q2(mem, i)
            if key == 0:
                break
            if key == 1:
                buf = val
            i += 16
        if buf:
            return b"".join([mem[buf + o : buf + o + s] for o, s in zip(offsets, sizes)])
    return None


# ---------------------------------------------------------------- launches

def _emit_launch(item: tuple, entry: tuple | None) -> None:
    _append(item)


def _emit_launch_checked(item: tuple, entry: tuple | None) -> None:
    """--check-pointers: ask the driver which argument words are device pointers (slow, exact).

    Appends ((param index, byte offset, CUmemorytype), ...) to the launch tuple: the ground
    truth that tests and gpu-predict-access validate the allocation table against.
    """
    from cuda.bindings import driver as drv

    args = item[13]
    found = []
    if entry is not None and args:
        attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE
        ok = drv.CUresult.CUDA_SUCCESS
        pos = 0
        for index, size in enumerate(entry[2]):
            for off in range(0, size - 7, 8):
                word = int.from_bytes(args[pos + off : pos + off + 8], "little")
                if 0x10000 <= word < (1 << 57):
                    err, memtype = drv.cuPointerGetAttribute(attr, word)
                    if err == ok and int(memtype) in (2, 4):  # CU_MEMORYTYPE_DEVICE / _UNIFIED
                        found.append((index, off, int(memtype)))
            pos += size
    _append(item + (tuple(found),))


# ---------------------------------------------------------------- handlers (cbid, cbdata)

#: a stream capture has begun in this process (set at cuStreamBeginCapture's enter, never
#: cleared): until then no stream can be capturing, and ``_capturing`` needs no driver call
_capture_begun = False


def _capturing(stream: int) -> bool:
    """A launch into a stream being captured only adds a node to a graph; it does not run.

    Asked for every launch (and the agent's copies and memsets); the driver query through
    cuda-python costs microseconds, so it is skipped while no capture has ever begun (a stream
    joins a capture only through one that began it, by cuStreamBeginCapture, traced here)."""
    if not _capture_begun:
        return False
    from cuda.bindings import driver as drv

    err, status = drv.cuStreamIsCapturing(drv.CUstream(stream))
    return err == drv.CUresult.CUDA_SUCCESS and int(status) != 0


def _launch_record(cbid, cbdata, rp, f, gx, gy, gz, bx, by, bz, smem, stream, kp, extra) -> None:
    entry = _layouts.get(f, False)
    if entry is False:
        entry = _learn(f, cbdata)
    _emit_launch((wire.LAUNCH, _now(), _tid(), cbid, f, gx, gy, gz, bx, by, bz, smem, stream,
                  _args(entry, kp, extra), _result(rp), _capturing(stream)), entry)


def _launch(cbid: int, cbdata) -> None:
    site, _, pp, rp = _CBDATA(_MEM, cbdata.ptr)
    if site != _ENTER:
        _launch_record(cbid, cbdata, rp, *_LAUNCH(_MEM, pp))


def _launch_coop(cbid: int, cbdata) -> None:
    site, _, pp, rp = _CBDATA(_MEM, cbdata.ptr)
    if site != _ENTER:
        _launch_record(cbid, cbdata, rp, *_LAUNCH_COOP(_MEM, pp), 0)


def _launch_ex(cbid: int, cbdata) -> None:
    site, _, pp, rp = _CBDATA(_MEM, cbdata.ptr)
    if site != _ENTER:
        cfg, f, kp, extra = _LAUNCH_EX(_MEM, pp)
        _launch_record(cbid, cbdata, rp, f, *_LAUNCH_CONFIG(_MEM, cfg), kp, extra)


def _graph_launch(cbid: int, cbdata) -> None:
    site, _, pp, rp = _CBDATA(_MEM, cbdata.ptr)
    if site == _EXIT and _result(rp) == 0:
        graph, stream = _Q2(_MEM, pp)
        _append((wire.GRAPH, _now(), _tid(), cbid, graph, stream))


def _graphop_handler(op: str):
    def handler(cbid: int, cbdata) -> None:
        site, _, pp, rp = _CBDATA(_MEM, cbdata.ptr)
        if op == "capture_begin":  # from its enter on, launches may be captured (``_capturing``)
            global _capture_begun
            _capture_begun = True
        if site == _ENTER or _result(rp):
            return
        a, b = _Q2(_MEM, pp)
        if op == "capture_begin":
            a, b = a, 0
        elif op == "capture_end":
            b = _U64(_MEM, b)[0] if b else 0
        else:  # instantiate: (CUgraphExec*, CUgraph, ...)
            a, b = b, (_U64(_MEM, a)[0] if a else 0)
        _append((wire.GRAPHOP, _now(), _tid(), cbid, op, a, b))

    return handler


def _alloc_handler(kind: str, unpack, size_of, stream_of):
    def handler(cbid: int, cbdata) -> None:
        site, _, pp, rp = _CBDATA(_MEM, cbdata.ptr)
        if site == _ENTER or _result(rp):
            return
        fields = unpack(_MEM, pp)
        addr = _U64(_MEM, fields[0])[0]
        _append((wire.ALLOC, _now(), _tid(), cbid, addr, size_of(fields), kind, stream_of(fields)))

    return handler


def _map_handler(cbid: int, cbdata) -> None:
    site, _, pp, rp = _CBDATA(_MEM, cbdata.ptr)
    if site == _EXIT and not _result(rp):
        ptr, size, _off, _handle, _flags = _Q5(_MEM, pp)
        _append((wire.ALLOC, _now(), _tid(), cbid, ptr, size, "vmm", 0))


def _free_handler(unpack, size_of, stream_of):
    def handler(cbid: int, cbdata) -> None:
        site, _, pp, rp = _CBDATA(_MEM, cbdata.ptr)
        if site == _ENTER or _result(rp):
            return
        fields = unpack(_MEM, pp)
        _append((wire.FREE, _now(), _tid(), cbid, fields[0], size_of(fields), stream_of(fields)))

    return handler


SMALL_COPY = 4096  #: bytes of a host-to-device copy kept in its record (as in gpuos_record.c)


def _host(addr: int) -> bool:
    """True when the driver does not know ``addr`` as device memory (so it is host memory)."""
    from cuda.bindings import driver as drv

    err, memtype = drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr)
    return err != drv.CUresult.CUDA_SUCCESS or int(memtype) == 1


def _copy_handler(direction: str, order: str, with_stream: bool):
    """order "ds": params start (dst, src, n); "peer": (dst, dctx, src, sctx, n)."""
    unpack = {("ds", False): _Q3, ("ds", True): _Q4, ("peer", False): _Q5, ("peer", True): _Q6}[
        (order, with_stream)
    ]

    def handler(cbid: int, cbdata) -> None:
        site, _, pp, rp = _CBDATA(_MEM, cbdata.ptr)
        if site == _ENTER or _result(rp):
            return
        f = unpack(_MEM, pp)
        if order == "ds":
            dst, src, n = f[0], f[1], f[2]
        else:
            dst, src, n = f[0], f[2], f[4]
        stream = f[-1] if with_stream else 0
        data = None
        if 0 < n <= SMALL_COPY and src and (direction == "HtoD" or (direction == "default" and _host(src))):
            data = bytes(_MEM[src : src + n])  # pointer arrays reach the GPU this way
        _append((wire.COPY, _now(), _tid(), cbid, direction, dst, src, n, stream, with_stream, None, data))

    return handler


def _copy2d_handler(with_stream: bool):
    def handler(cbid: int, cbdata) -> None:
        site, _, pp, rp = _CBDATA(_MEM, cbdata.ptr)
        if site == _ENTER or _result(rp):
            return
        pcopy, stream = _Q2(_MEM, pp) if with_stream else (_U64(_MEM, pp)[0], 0)
        (sx, sy, stype, shost, sdev, _sarr, spitch,
         dx, dy, dtype, dhost, ddev, _darr, dpitch, width, height) = _MEMCPY2D(_MEM, pcopy)
        src = (shost if stype == 1 else sdev) + sy * spitch + sx
        dst = (dhost if dtype == 1 else ddev) + dy * dpitch + dx
        direction = _MEMTYPE_DIR.get((stype, dtype), "default")
        _append((wire.COPY, _now(), _tid(), cbid, direction, dst, src, width * height, stream,
                 with_stream, (width, height, spitch, dpitch), None))

    return handler


def _memset_handler(elem: int, two_d: bool, with_stream: bool):
    mask = (1 << (8 * elem)) - 1

    def handler(cbid: int, cbdata) -> None:
        site, _, pp, rp = _CBDATA(_MEM, cbdata.ptr)
        if site == _ENTER or _result(rp):
            return
        if two_d:  # dst, pitch, value, width, height[, stream]
            f = _Q6(_MEM, pp) if with_stream else _Q5(_MEM, pp)
            dst, value, nbytes = f[0], f[2] & mask, f[3] * f[4] * elem
            stream = f[5] if with_stream else 0
        else:  # dst, value, n[, stream]
            f = _Q4(_MEM, pp) if with_stream else _Q3(_MEM, pp)
            dst, value, nbytes = f[0], f[1] & mask, f[2] * elem
            stream = f[3] if with_stream else 0
        _append((wire.SET, _now(), _tid(), cbid, dst, nbytes, value, elem, stream, with_stream))

    return handler


def _image_at(ptr: int) -> tuple[str, bytes | None, int]:
    """(format, bytes for PTX, size) of a module image handed to a load call."""
    mem = _MEM
    magic = _U32(mem, ptr)[0]
    if magic == 0x464C457F:  # ELF: section headers end the file
        shoff = _U64(mem, ptr + 0x28)[0]
        shentsize, shnum = struct.unpack_from("<HH", mem, ptr + 0x3A)
        return "cubin", None, shoff + shentsize * shnum
    if magic == 0xBA55ED50:
        (hsize,) = struct.unpack_from("<H", mem, ptr + 6)  # u32 magic, u16 version, u16 header size
        return "fatbin", None, hsize + _U64(mem, ptr + 8)[0]  # u64 payload size
    if magic == 0x466243B1:  # __fatBinC_Wrapper_t {magic, version, data*, ...}
        return _image_at(_U64(mem, ptr + 8)[0])
    text = ctypes.string_at(ptr)
    if text.lstrip()[:1] in (b"/", b".") and b".version" in text[:4096]:
        return "ptx", text, len(text)
    return "unknown", None, 0


def _library_load(cbid: int, cbdata) -> None:
    site, _, pp, rp = _CBDATA(_MEM, cbdata.ptr)
    if site == _ENTER or _result(rp):
        return
    image = _Q2(_MEM, pp)[1]  # (CUmodule*/CUlibrary*, image, ...)
    fmt, ptx, size = _image_at(image) if image else ("unknown", None, 0)
    _append((wire.LIBRARY, _now(), _tid(), cbid, fmt, size, ptx))


def _symbol_handler(variable: bool):
    """cuModuleGetGlobal/cuLibraryGetGlobal (variable: dptr*, bytes*, parent, name) and
    cuModuleGetFunction/cuLibraryGetKernel (handle*, parent, name), at their exit."""
    def handler(cbid: int, cbdata) -> None:
        site, _, pp, rp = _CBDATA(_MEM, cbdata.ptr)
        if site == _ENTER or _result(rp):
            return
        if variable:
            dptr_p, size_p, parent, name_p = _Q4(_MEM, pp)
            addr = _U64(_MEM, dptr_p)[0] if dptr_p else 0
            size = _U64(_MEM, size_p)[0] if size_p else -1
            _append((wire.SYMBOL, _now(), _tid(), cbid, "variable", 0, parent, addr, size, _cstring(name_p)))
        else:
            handle_p, parent, name_p = _Q3(_MEM, pp)
            handle = _U64(_MEM, handle_p)[0] if handle_p else 0
            _append((wire.SYMBOL, _now(), _tid(), cbid, "function", handle, parent, 0, -1, _cstring(name_p)))

    return handler


def _cstring(addr: int) -> str:
    return ctypes.string_at(addr).decode(errors="replace") if addr else ""


def _resource(cbid: int, cbdata) -> None:
    ptr = cbdata.ptr
    if cbid == 6:  # MODULE_LOADED
        desc = _U64(_MEM, ptr + 16)[0]
        module_id, size, image = _MODULE(_MEM, desc)
        data = bytes(_MEM[image : image + size]) if image and size else b""
        if data[:4] == b"\x7fELF":
            _cubins.append(data)
        elif b".version" in data[:4096]:  # a module JIT-compiled from PTX, handed as its text
            _ptx.append((frozenset(m.decode() for m in _PTX_ENTRY.findall(data)), data))
        _append((wire.MODULE, _now(), _tid(), module_id, data))
    elif cbid == 7:  # MODULE_UNLOAD_STARTING: its functions' handles may come back for others
        _layouts.clear()
        _counters["module_unloads"] += 1
    elif cbid in (3, 4):  # STREAM_CREATED / STREAM_DESTROY_STARTING
        stream = _U64(_MEM, ptr + 8)[0]
        _append((wire.STREAM, _now(), _tid(), stream, "create" if cbid == 3 else "destroy"))


# ---------------------------------------------------------------- the API table

_Z = lambda f: 0  # noqa: E731 - a field that the API does not have
_F = lambda f: f[1]  # noqa: E731 - size is the second field
_FREE1 = lambda m, p: (_U64(m, p)[0],)  # noqa: E731
_NOSIZE = lambda f: -1  # noqa: E731


def _copy(direction: str, peer: bool, with_stream: bool):
    return (_copy_handler(direction, "peer" if peer else "ds", with_stream),
            binary.copy_kind(direction, peer, with_stream))


def _set(elem: int, two_d: bool, with_stream: bool):
    return _memset_handler(elem, two_d, with_stream), binary.set_kind(elem, two_d, with_stream)


# API base name -> (Python handler, native handler kind)
_DRIVER_APIS: dict[str, tuple[object, int]] = {
    "cuLaunchKernel": (_launch, binary.KIND_LAUNCH),
    "cuLaunchKernelEx": (_launch_ex, binary.KIND_LAUNCH_EX),
    "cuLaunchCooperativeKernel": (_launch_coop, binary.KIND_LAUNCH_COOP),
    "cuGraphLaunch": (_graph_launch, binary.KIND_GRAPH),
    "cuMemAlloc_v2": (_alloc_handler("device", _Q2, _F, _Z), binary.KIND_ALLOC + 0),
    "cuMemAllocPitch_v2": (_alloc_handler("pitch", _Q4, lambda f: _U64(_MEM, f[1])[0] * f[3], _Z),
                           binary.KIND_ALLOC + 1),
    "cuMemAllocManaged": (_alloc_handler("managed", _Q2, _F, _Z), binary.KIND_ALLOC + 2),
    "cuMemAllocAsync": (_alloc_handler("async", _Q3, _F, lambda f: f[2]), binary.KIND_ALLOC + 3),
    "cuMemAllocFromPoolAsync": (_alloc_handler("pool", _Q4, _F, lambda f: f[3]), binary.KIND_ALLOC + 4),
    "cuMemAllocHost_v2": (_alloc_handler("host", _Q2, _F, _Z), binary.KIND_ALLOC + 5),
    "cuMemHostAlloc": (_alloc_handler("host", _Q2, _F, _Z), binary.KIND_ALLOC + 5),
    "cuMemMap": (_map_handler, binary.KIND_MAP),
    "cuMemFree_v2": (_free_handler(_FREE1, _NOSIZE, _Z), binary.KIND_FREE),
    "cuMemFreeAsync": (_free_handler(_Q2, _NOSIZE, lambda f: f[1]), binary.KIND_FREE_ASYNC),
    "cuMemFreeHost": (_free_handler(_FREE1, _NOSIZE, _Z), binary.KIND_FREE_HOST),
    "cuMemUnmap": (_free_handler(_Q2, _F, _Z), binary.KIND_UNMAP),
    "cuMemcpy": _copy("default", False, False),
    "cuMemcpyAsync": _copy("default", False, True),
    "cuMemcpyHtoD_v2": _copy("HtoD", False, False),
    "cuMemcpyDtoH_v2": _copy("DtoH", False, False),
    "cuMemcpyDtoD_v2": _copy("DtoD", False, False),
    "cuMemcpyHtoDAsync_v2": _copy("HtoD", False, True),
    "cuMemcpyDtoHAsync_v2": _copy("DtoH", False, True),
    "cuMemcpyDtoDAsync_v2": _copy("DtoD", False, True),
    "cuMemcpyPeer": _copy("peer", True, False),
    "cuMemcpyPeerAsync": _copy("peer", True, True),
    "cuMemcpy2D_v2": (_copy2d_handler(False), binary.KIND_COPY2D),
    "cuMemcpy2DUnaligned_v2": (_copy2d_handler(False), binary.KIND_COPY2D),
    "cuMemcpy2DAsync_v2": (_copy2d_handler(True), binary.KIND_COPY2D_ASYNC),
    "cuMemsetD8_v2": _set(1, False, False),
    "cuMemsetD16_v2": _set(2, False, False),
    "cuMemsetD32_v2": _set(4, False, False),
    "cuMemsetD8Async": _set(1, False, True),
    "cuMemsetD16Async": _set(2, False, True),
    "cuMemsetD32Async": _set(4, False, True),
    "cuMemsetD2D8_v2": _set(1, True, False),
    "cuMemsetD2D16_v2": _set(2, True, False),
    "cuMemsetD2D32_v2": _set(4, True, False),
    "cuMemsetD2D8Async": _set(1, True, True),
    "cuMemsetD2D16Async": _set(2, True, True),
    "cuMemsetD2D32Async": _set(4, True, True),
    "cuStreamBeginCapture": (_graphop_handler("capture_begin"), binary.KIND_CAPTURE_BEGIN),
    "cuStreamBeginCapture_v2": (_graphop_handler("capture_begin"), binary.KIND_CAPTURE_BEGIN),
    "cuStreamBeginCaptureToGraph": (_graphop_handler("capture_begin"), binary.KIND_CAPTURE_BEGIN),
    "cuStreamEndCapture": (_graphop_handler("capture_end"), binary.KIND_CAPTURE_END),
    "cuGraphInstantiate": (_graphop_handler("instantiate"), binary.KIND_INSTANTIATE),
    "cuGraphInstantiate_v2": (_graphop_handler("instantiate"), binary.KIND_INSTANTIATE),
    "cuGraphInstantiateWithFlags": (_graphop_handler("instantiate"), binary.KIND_INSTANTIATE),
    "cuGraphInstantiateWithParams": (_graphop_handler("instantiate"), binary.KIND_INSTANTIATE),
    "cuModuleLoadData": (_library_load, binary.KIND_LIBRARY),
    "cuModuleLoadDataEx": (_library_load, binary.KIND_LIBRARY),
    "cuLibraryLoadData": (_library_load, binary.KIND_LIBRARY),
    "cuModuleGetGlobal_v2": (_symbol_handler(True), binary.KIND_VARIABLE),
    "cuLibraryGetGlobal": (_symbol_handler(True), binary.KIND_VARIABLE),
    "cuModuleGetFunction": (_symbol_handler(False), binary.KIND_FUNCTION),
    "cuLibraryGetKernel": (_symbol_handler(False), binary.KIND_FUNCTION),
}
_VARIANTS = ("", "_ptsz", "_ptds")


def driver_table(cbid_enum) -> dict[int, tuple[str, object, int]]:
    """cbid -> (API name, Python handler, native kind) for every traced API this CUPTI knows."""
    table = {}
    for base, (handler, kind) in _DRIVER_APIS.items():
        for suffix in _VARIANTS:
            member = getattr(cbid_enum, base + suffix, None)
            if member is not None:
                table[int(member)] = (base + suffix, handler, kind)
    return table


def named_table(names: list[str]) -> dict[int, tuple[str, object, int]]:
    """The same table for a front end whose call ids are positions in ``names`` (the interposer's
    entries, csrc/gpuos_intercept.c): the traced APIs among them."""
    table = {}
    for cbid, name in enumerate(names):
        base = name.removesuffix("_ptsz").removesuffix("_ptds")
        if base in _DRIVER_APIS:
            handler, kind = _DRIVER_APIS[base]
            table[cbid] = (name, handler, kind)
    return table


# ---------------------------------------------------------------- lifecycle

# ---------------------------------------------------------------- --validate

def _validating_handlers(validator, table: dict) -> dict:
    """Launch handlers that check sampled launches on the GPU around the program's own launch."""
    from gpuos_tools.agent.replay import LAUNCH_ATTRIBUTE_SIZE, REPLAYED_ATTRIBUTES, attributes_refusal
    from gpuos_tools.agent.validate import CudaFailure  # numpy: imported under --validate only

    handlers = {}
    reported_off: list[str] = []

    def make(name: str, base):
        def handler(cbid: int, cbdata) -> None:
            site, _, pp, rp = _CBDATA(_MEM, cbdata.ptr)
            tid = _tid()
            if site == _ENTER:
                not_replayed = None  # why the launch cannot be recreated elsewhere
                attributes: list = []  # (id, value hex) of the launch attributes the replay sets too
                if name.startswith("cuLaunchKernelEx"):
                    cfg, f, kp, extra = _LAUNCH_EX(_MEM, pp)
                    shape = _LAUNCH_CONFIG(_MEM, cfg)
                    stream = shape[7]
                    raw = (cfg, f, kp, extra)
                    n_attrs = _U32(_MEM, cfg + 48)[0]  # CUlaunchConfig.numAttrs (after hStream and attrs)
                    if n_attrs:
                        attrs = _U64(_MEM, cfg + 40)[0]
                        at = [attrs + i * LAUNCH_ATTRIBUTE_SIZE for i in range(n_attrs)] if attrs else []
                        ids = [_U32(_MEM, a)[0] for a in at] if attrs else [-1]
                        not_replayed = attributes_refusal(ids)
                        attributes = [[i, bytes(_MEM[a + 8 : a + LAUNCH_ATTRIBUTE_SIZE]).hex()]
                                      for i, a in zip(ids, at) if i in REPLAYED_ATTRIBUTES]
                elif name.startswith("cuLaunchCooperativeKernel"):
                    raw = _LAUNCH_COOP(_MEM, pp)
                    f, stream, kp, extra = raw[0], raw[8], raw[9], 0
                    shape = raw[1:9]
                    not_replayed = "cooperative launches are not replayed"
                else:
                    raw = _LAUNCH(_MEM, pp)
                    f, stream, kp, extra = raw[0], raw[8], raw[9], raw[10]
                    shape = raw[1:9]
                if not validator.wants(f) or _capturing(stream):
                    return
                if not stream and name.endswith("_ptsz"):
                    stream = 2  # CU_STREAM_PER_THREAD: the handle the default stream stands for here
                geometry = (shape[0:3], shape[3:6], shape[6], not_replayed, stream, attributes)
                entry = _layouts.get(f, False)
                if entry is False:
                    entry = _learn(f, cbdata)
                sizes = entry[2] if entry is not None else None
                validator.busy_tid = tid
                try:
                    validator.enter(tid, name, (name, raw), f, cbdata.symbol_name or "", sizes,
                                    _args(entry, kp, extra), geometry)
                except CudaFailure as exc:
                    _append((wire.ERROR, _now(), f"validation of {cbdata.symbol_name}: {exc}"))
                finally:
                    validator.busy_tid = 0
            else:
                base(cbid, cbdata)
                if tid in validator.pending:
                    validator.busy_tid = tid
                    try:
                        body = validator.exit(tid, _result(rp))
                    finally:
                        validator.busy_tid = 0
                    if body is not None:
                        _append((wire.VALID, _now(), tid, body))
                    off = getattr(validator, "switched_off", None)
                    if off and not reported_off:
                        reported_off.append(off)
                        _append((wire.ERROR, _now(), off))

        return handler

    for cbid, (name, handler, _) in table.items():
        if name.startswith(("cuLaunchKernel", "cuLaunchCooperativeKernel")):
            handlers[cbid] = make(name, handler)
    return handlers


# ---------------------------------------------------------------- --agent

def _agent_enter(name: str, pp: int):
    """(device address written, address read (0: none), stream) of a copy, memset or free
    about to be issued."""
    if name.startswith(("cuMemcpy2D",)):
        if "Async" in name:
            pcopy, stream = _Q2(_MEM, pp)
        else:
            pcopy, stream = _U64(_MEM, pp)[0], 0
        m = _MEMCPY2D(_MEM, pcopy)
        dtype, dhost, ddev, dpitch, dx, dy = m[9], m[10], m[11], m[13], m[7], m[8]
        sx, sy, stype, shost, sdev, spitch = m[0], m[1], m[2], m[3], m[4], m[6]
        return ((dhost if dtype == 1 else ddev) + dy * dpitch + dx,
                (shost if stype == 1 else sdev) + sy * spitch + sx, stream)
    if name.startswith("cuMemcpyPeer"):
        f = _Q6(_MEM, pp)
        return f[0], f[2], (f[5] if "Async" in name else 0)
    if name.startswith("cuMemcpy"):
        f = _Q4(_MEM, pp)
        return f[0], f[1], (f[3] if "Async" in name else 0)
    if name.startswith("cuMemsetD2D"):
        f = _Q6(_MEM, pp)
        return f[0], 0, (f[5] if "Async" in name else 0)
    if name.startswith("cuMemset"):
        f = _Q4(_MEM, pp)
        return f[0], 0, (f[3] if "Async" in name else 0)
    if name.startswith("cuMemFreeAsync"):
        ptr, stream = _Q2(_MEM, pp)
        return ptr, 0, stream
    # cuMemFree, cuMemUnmap: the first parameter; cuMemFreeHost frees host memory
    return (0 if name.startswith("cuMemFreeHost") else _U64(_MEM, pp)[0]), 0, 0


#: the operations that wait for the GPU turn under gpu-prefetch-sched serve (Agent.gate)
_GATED = ("cuLaunchKernel", "cuLaunchCooperativeKernel", "cuMemcpy", "cuMemset", "cuGraphLaunch")


def _agent_handlers(agent, table: dict) -> dict:
    """Handlers that let the agent act before launches, copies, memsets and frees are issued."""
    handlers = {}

    def launch(name: str, base):
        def handler(cbid: int, cbdata) -> None:
            site, _, pp, _ = _CBDATA(_MEM, cbdata.ptr)
            if site != _ENTER:
                base(cbid, cbdata)
                return
            if name.startswith("cuLaunchKernelEx"):
                cfg, f, kp, extra = _LAUNCH_EX(_MEM, pp)
                stream = _LAUNCH_CONFIG(_MEM, cfg)[7]
            elif name.startswith("cuLaunchCooperativeKernel"):
                raw = _LAUNCH_COOP(_MEM, pp)
                f, stream, kp, extra = raw[0], raw[8], raw[9], 0
            else:
                raw = _LAUNCH(_MEM, pp)
                f, stream, kp, extra = raw[0], raw[8], raw[9], raw[10]
            if (agent.snap is not None or agent.skip_captured) and _capturing(stream):
                agent.ops += 1  # only recorded into a graph: it writes nothing now
                return
            entry = _layouts.get(f, False)
            if entry is False:
                entry = _learn(f, cbdata)
            agent.before_launch(name, stream, cbdata.symbol_name or "", entry[2] if entry else None,
                                _args(entry, kp, extra))

        return handler

    def write(name: str, base):
        def handler(cbid: int, cbdata) -> None:
            site, _, pp, _ = _CBDATA(_MEM, cbdata.ptr)
            if site != _ENTER:
                base(cbid, cbdata)
                return
            dst, src, stream = _agent_enter(name, pp)
            if (agent.snap is not None or agent.skip_captured) and stream and _capturing(stream):
                agent.ops += 1
                return
            agent.before_write(name, dst, stream, src)

        return handler

    def graph(name: str, base):
        def handler(cbid: int, cbdata) -> None:
            site, _, pp, _ = _CBDATA(_MEM, cbdata.ptr)
            if site != _ENTER:
                base(cbid, cbdata)
                return
            agent.before_graph(_Q2(_MEM, pp)[1])  # (hGraphExec, hStream)

        return handler

    for cbid, (name, handler, _) in table.items():
        if name.startswith(("cuLaunchKernel", "cuLaunchCooperativeKernel")):
            handlers[cbid] = launch(name, handler)
        elif name.startswith(("cuMemcpy", "cuMemset", "cuMemFree", "cuMemUnmap")):
            handlers[cbid] = write(name, handler)
        elif name.startswith("cuGraphLaunch"):
            handlers[cbid] = graph(name, handler)
    return handlers


def _observing_append(view):
    """The queue's append, also showing each tuple to the validator's or the agent's view of the
    program (gpuos_tools/agent/view.py)."""
    append = _Q.append
    observe = view.observe

    def tee(item: tuple) -> None:
        observe(item)
        append(item)

    return tee


class Tracer:
    """The Python path: cupti-python calls ``callback`` for every enabled API, enter and exit."""

    backend = "python"
    #: how the driver calls are seen (HELLO, the trace's header): the Python tracer and agent only
    #: through CUPTI; the agent on the native core says its own (start.py)
    mechanism = "cupti"

    def __init__(self, fd: int, flush_interval: float = 0.02, validator=None, agent=None, table=None):
        """``table``: cbid -> (API name, handler, kind) of a front end that is not CUPTI (then
        cupti-python is not imported)."""
        self.validator = validator
        self.agent = agent
        self.fd = fd
        self.flush_interval = flush_interval
        self.lock = threading.Lock()
        self.stop = threading.Event()
        if table is None:
            from cupti import cupti

            self.cupti = cupti
            self.table = driver_table(cupti.driver_api_trace_cbid)
        else:
            self.cupti = None
            self.table = table
        self.subscriber = None
        self.thread = None

    def hello(self) -> tuple:
        return (
            wire.HELLO, os.getpid(), sys.version.split()[0], _cupti_version() if self.cupti is not None else None,
            {cbid: name for cbid, (name, _, _) in self.table.items()},
            {3: "stream_created", 4: "stream_destroy", 6: "module_loaded", 7: "module_unload"},
            self.backend, self.mechanism,
        )

    def start(self) -> None:
        cupti = self.cupti
        driver = {cbid: handler for cbid, (_, handler, _) in self.table.items()}
        driver_domain = int(cupti.CallbackDomain.DRIVER_API)
        resource_domain = int(cupti.CallbackDomain.RESOURCE)
        counters = _counters
        validator = self.validator
        agent = self.agent
        global _append
        acting_ids: frozenset[int] = frozenset()  # the agent's acting callbacks (launches, writes)
        gated_ids: frozenset[int] = frozenset()  # those that wait for the GPU turn when serving
        if validator is not None:
            _append = _observing_append(validator)
            driver.update(_validating_handlers(validator, self.table))
        elif agent is not None:
            _append = _observing_append(agent)
            acting = _agent_handlers(agent, self.table)
            driver.update(acting)
            acting_ids = frozenset(acting)
            gated_ids = frozenset(c for c in acting if self.table[c][0].startswith(_GATED))

        def callback(userdata, domain, cbid, cbdata):
            if agent is not None:
                if _tid() in agent.own:
                    return  # the agent's own driver calls
                if domain == resource_domain:
                    # The driver calls these (module loaded, stream created) holding its own
                    # locks; the agent makes driver calls under its lock: taking it here could
                    # deadlock (seen: a module load against the snapshot's copies).
                    return checked(domain, cbid, cbdata)
                if domain == driver_domain and cbid in acting_ids:
                    # A launch, copy, memset or free counts as issuing from its enter (where the
                    # agent acts on it) to its exit (the driver has enqueued it): a snapshot's T0
                    # or a rollback waits, under the lock, until none is between the two.
                    if _CBDATA(_MEM, cbdata.ptr)[0] == _ENTER:
                        gate = agent.gate
                        if gate is not None and cbid in gated_ids:
                            # gpu-prefetch-sched serve: wait for the GPU turn before the lock
                            # (never frees or unmaps: the owned library may hold its own lock there)
                            gate()
                        with agent.lock:
                            agent.issue_begin()
                            return checked(domain, cbid, cbdata)
                    agent.issue_end()  # before the lock: the agent may hold it, waiting for this
                with agent.lock:
                    return checked(domain, cbid, cbdata)
            if validator is not None:
                if validator.busy_tid == _tid():
                    return  # the validator's own driver calls
                with validator.lock:
                    return checked(domain, cbid, cbdata)
            return checked(domain, cbid, cbdata)

        def checked(domain, cbid, cbdata):
            try:
                if domain == driver_domain:
                    driver[cbid](cbid, cbdata)
                elif domain == resource_domain:
                    _resource(cbid, cbdata)
            except Exception as exc:  # never let the tracer break the program
                counters["errors"] += 1
                key = f"{type(exc).__name__}: {exc}"
                if key not in _errors_seen:
                    _errors_seen.add(key)
                    _append((wire.ERROR, _now(), f"callback {domain}/{cbid}: {key}"))

        _append(self.hello())
        self.subscriber = cupti.subscribe(callback, None)
        for cbid in driver:
            cupti.enable_callback(1, self.subscriber, cupti.CallbackDomain.DRIVER_API, cbid)
        for cbid in (3, 4, 6, 7):
            cupti.enable_callback(1, self.subscriber, cupti.CallbackDomain.RESOURCE, cbid)
        self.thread = threading.Thread(target=self._drain_loop, name="gpuos-trace-drain", daemon=True)
        self.thread.start()
        if agent is not None:
            # an output: child tools of the program find its agent there
            os.environ["GPUOS_AGENT_SOCKET"] = agent.start_server()
        atexit.register(self.shutdown)
        os.register_at_fork(after_in_child=self._forked)

    def flush(self) -> None:
        with self.lock:
            items = []
            pop = _Q.popleft
            try:
                while True:
                    items.append(pop())
            except IndexError:
                pass
            if items and self.fd >= 0:
                wire.write_all(self.fd, wire.encode_frame(items))

    def _drain_loop(self) -> None:
        while not self.stop.wait(self.flush_interval):
            try:
                self.flush()
            except OSError:  # gpu-trace went away: stop tracing, keep the program running
                self._disable()
                return

    def shutdown(self) -> None:
        """At interpreter exit (our atexit handler runs after the frameworks' own)."""
        self.stop.set()
        if self.validator is not None and hasattr(self.validator, "close"):
            self.validator.close()  # the validator process and its staging directory
        if self.agent is not None:
            self.agent.stop_background()
            if self.agent.server is not None:
                self.agent.server.close()
        try:
            self.cupti.unsubscribe(self.subscriber)
        except Exception:
            pass
        _append((wire.END, _now(), dict(_counters, functions=len(_layouts))))
        try:
            self.flush()
        except OSError:
            pass
        self._close()

    def _disable(self) -> None:
        try:
            self.cupti.unsubscribe(self.subscriber)
        except Exception:
            pass
        self._close()

    def _close(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1

    def _forked(self) -> None:
        # A forked child must not write into the parent's trace, nor keep its pipe open.
        _Q.clear()
        self._close()


class NativeTracer(Tracer):
    """The native path: csrc/gpuos_trace.c is the CUPTI subscriber and ships binary records itself.

    cupti-python still loads libcupti and names the callback ids; Python writes HELLO and END.
    """

    backend = "native"

    def __init__(self, fd: int, flush_interval: float, library: str, check_pointers: bool):
        super().__init__(fd, flush_interval)
        kinds = {cbid: kind for cbid, (_, _, kind) in self.table.items()}
        self.session = tracelib.NativeSession(library, fd, kinds, flush_interval * 1000, check_pointers)

    def start(self) -> None:
        wire.write_all(self.fd, wire.encode_frame([self.hello()]))
        self.session.start()
        atexit.register(self.shutdown)
        os.register_at_fork(after_in_child=self._close)

    def shutdown(self) -> None:
        counters = self.session.stop()
        try:
            wire.write_all(self.fd, wire.encode_frame([(wire.END, _now(), counters)]))
        except OSError:
            pass
        self._close()


def _cupti_version() -> str:
    try:
        from importlib.metadata import version

        return version("cupti-python")
    except Exception:
        return "unknown"


_tracer: Tracer | None = None


def make_agent(cfg: AgentConfig) -> Agent:
    """The agent ``cfg`` asks for: with the online scheduler in front under gpu-prefetch-sched run."""
    agent = Agent(cfg.cow_budget)
    agent.engine_settings = cfg.engine
    agent.image_key = load_key(cfg.image_key) if cfg.image_key is not None else None
    if cfg.online is not None:
        executor.attach(agent, cfg.online.executor_config())
    agent.exit_wait_s, agent.exit_max_s = cfg.exit_wait_s, cfg.exit_max_s
    agent.dump_references(cfg.reference_at, cfg.reference_out)
    return agent


def _arm_zygote(library: str) -> None:
    """Have the validators' zygote forked in the program's first cuInit (agent/zygote.py); the
    interposer that does it leaves LD_PRELOAD here, so the programs this one starts run plain."""
    rest = intercept.unpreload(os.environ.get(intercept.PRELOAD), library)
    os.environ.pop(intercept.PRELOAD, None)
    if rest:
        os.environ[intercept.PRELOAD] = rest
    try:
        lib = ctypes.CDLL(library)
    except OSError:
        return  # not loaded: validators start fresh

    def in_zygote() -> None:  # its validators' driver calls are not the program's
        if _tracer is not None and _tracer.subscriber is not None:
            _tracer.cupti.unsubscribe(_tracer.subscriber)

    zygote.arm(in_zygote, lib)


def start(cfg: BootConfig) -> Tracer:
    """Start tracing as the launcher's config says: the Python tracer alone, with the validator or
    the Python agent, or the native tracer (the agent on the native core: injection/start.py)."""
    global _tracer, _emit_launch
    trace, flush_s = cfg.trace, cfg.trace.flush_ms / 1000.0
    native = trace.native and cfg.agent is None and cfg.validate is None
    if trace.check_pointers and not native:  # (the native tracer checks them itself)
        _emit_launch = _emit_launch_checked
    agent = None
    if cfg.agent is not None:
        agent = make_agent(cfg.agent)
        threads.set_own_threads(agent.own)  # memory's own-thread marks
        _tracer = Tracer(trace.fd, flush_s, agent=agent)
    elif cfg.validate is not None:
        from gpuos_tools.agent.validate import Validator  # numpy: imported under --validate only

        v = cfg.validate
        if v.where == "validator":
            from gpuos_tools.agent.offload import RELOCATE_ENV, OffloadValidator

            checker = OffloadValidator(v.samples, v.max_bytes, _image_for, v.timeout_s,
                                       relocate=os.environ.get(RELOCATE_ENV) != "0", extents=v.extents)
            if v.zygote is not None and os.environ.get(zygote.ENV) != "0":
                _arm_zygote(v.zygote)
        else:
            checker = Validator(v.samples, v.max_bytes, v.extents)
        _tracer = Tracer(trace.fd, flush_s, checker)
    elif native:
        _tracer = NativeTracer(trace.fd, flush_s, trace.native, trace.check_pointers)
    else:
        _tracer = Tracer(trace.fd, flush_s)
    _tracer.start()
    if agent is not None and cfg.agent.stage_ahead:
        agent.stage_ahead()
    # the program's CuPy and PyTorch allocations through the owned allocator (memory/owned.py),
    # installed after the tracer so that its mappings are traced
    if owned.boot(cfg.own) and agent is not None:
        agent.start_engine()  # lazy resume, and the residency API gpu-prefetch-sched drives
    return _tracer
