"""One sequence of driver calls and agent steps, run two ways by tests/test_intercept_agent.py:
by a program under the interposer agent (tests/intercept_agent_prog.py, the calls made through
the direct, dlsym and cuGetProcAddress routes) and by the test itself through the CUPTI front
end (each call's callbacks delivered through tests/fake_libcupti.c around the same call of the
stand-in driver). `scenario` returns the agent's state at the end; both must be the same.

Not a test module: both sides import it.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

PTX = b"//\n.version 8.0\n.target sm_90\n.address_size 64\n"
F1, F2 = 0x100010, 0x100020  #: CUfunction handles (the stand-in driver names them fake_kernel_<hex>)

C = ctypes
PROTOS = {
    "cuStreamCreate": (C.POINTER(C.c_void_p), C.c_uint),
    "cuModuleLoadData": (C.POINTER(C.c_void_p), C.c_void_p),
    "cuModuleGetFunction": (C.POINTER(C.c_void_p), C.c_void_p, C.c_char_p),
    "cuModuleGetGlobal_v2": (C.POINTER(C.c_uint64), C.c_void_p, C.c_void_p, C.c_char_p),
    "cuMemAlloc_v2": (C.POINTER(C.c_uint64), C.c_size_t),
    "cuMemcpyHtoD_v2": (C.c_uint64, C.c_void_p, C.c_size_t),
    "cuLaunchKernel": (C.c_void_p, C.c_uint, C.c_uint, C.c_uint, C.c_uint, C.c_uint, C.c_uint, C.c_uint,
                       C.c_void_p, C.POINTER(C.c_void_p), C.c_void_p),
    "cuMemsetD32Async": (C.c_uint64, C.c_uint, C.c_size_t, C.c_void_p),
    "cuMemFree_v2": (C.c_uint64,),
    "cuModuleUnload": (C.c_void_p,),
    "cuStreamDestroy_v2": (C.c_void_p,),
}
PROTOS["cuLaunchKernel_ptsz"] = PROTOS["cuLaunchKernel"]


def prototype(name: str) -> Any:
    return C.CFUNCTYPE(C.c_int, *PROTOS[name])


class Api(Protocol):
    def fn(self, name: str, route: str) -> Any:
        """The callable for one driver function by one route (a ctypes function)."""


def _ok(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: CUresult {rc}")


def launch(api: Api, name: str, route: str, f: int, stream: int, words: list[int]) -> None:
    """A launch of two 8-byte parameters (the stand-in driver's layout for every kernel)."""
    vals = [C.c_uint64(w) for w in words]
    kp = (C.c_void_p * len(vals))(*[C.addressof(v) for v in vals])
    _ok(api.fn(name, route)(f, 4, 1, 1, 128, 1, 1, 0, stream, kp, None), f"{name} by {route}")


def scenario(api: Api, agent: Any, core: Any) -> dict[str, Any]:
    """The calls and the agent's steps; the agent's and the core's state at the end."""
    stream = C.c_void_p()
    _ok(api.fn("cuStreamCreate", "dlsym")(C.pointer(stream), 0), "cuStreamCreate")
    module = C.c_void_p()
    image = C.create_string_buffer(PTX)
    _ok(api.fn("cuModuleLoadData", "direct")(C.pointer(module), image), "cuModuleLoadData")
    # where one of the module's kernels and its variable are (the variable's size not asked, as
    # cuFFT does); the other kernel the tracer finds the module of by asking the driver
    func = C.c_void_p()
    _ok(api.fn("cuModuleGetFunction", "direct")(C.pointer(func), module, C.create_string_buffer(b"fake_kernel_100020")),
        "cuModuleGetFunction")
    assert func.value == F2
    variable = C.c_uint64()
    _ok(api.fn("cuModuleGetGlobal_v2", "getproc")(C.pointer(variable), None, module, C.create_string_buffer(b"table")),
        "cuModuleGetGlobal_v2")
    before_alloc = core.context()  # owned memory makes no allocation the core sees
    a, b = C.c_uint64(), C.c_uint64()
    _ok(api.fn("cuMemAlloc_v2", "dlsym")(C.pointer(a), 1 << 20), "cuMemAlloc_v2")
    _ok(api.fn("cuMemAlloc_v2", "direct")(C.pointer(b), 4096), "cuMemAlloc_v2")
    with agent.lock:  # a period of write tracking starts (as a first snapshot's T0 does)
        agent._take_dirty()
    table = C.create_string_buffer(a.value.to_bytes(8, "little") + (a.value + 4096).to_bytes(8, "little"), 16)
    _ok(api.fn("cuMemcpyHtoD_v2", "getproc")(b.value, table, 16), "cuMemcpyHtoD_v2")  # a pointer array
    stored = C.create_string_buffer(a.value.to_bytes(8, "little"), 8)
    _ok(api.fn("cuMemcpyHtoD_v2", "dlsym")(variable.value, stored, 8), "cuMemcpyHtoD_v2")  # a's address, into it
    s = stream.value
    launch(api, "cuLaunchKernel", "direct", F1, s, [a.value, b.value])
    launch(api, "cuLaunchKernel", "getproc", F2, 0, [b.value, 7])
    launch(api, "cuLaunchKernel_ptsz", "dlsym", F1, 0, [a.value + 64, 3])
    first = core.last_access()
    _ok(api.fn("cuMemsetD32Async", "getproc")(a.value + 256, 0, 16, s), "cuMemsetD32Async")
    with agent.lock:
        dirty = core.take_dirty()

    # a snapshot of both buffers in progress: a write into one of them is protected first
    protects: list[tuple[list[int], int]] = []

    class Snap:  # what protect_native reads of the agent's snapshot
        buffers = [0, 1]
        state = [0, 0]
        safe: list = [None, None]

    snap = Snap()

    def protect(snap_: Any, targets: list[int], on: int) -> None:
        protects.append((list(targets), on))
        for i in targets:
            snap.state[i] = 3
            snap.safe[i] = (snap.safe[i] or set()) | {on}

    ids = {x.addr: x.id for x in agent.buffers()}
    agent.snap, agent._protect = snap, protect
    with agent.lock:
        core.snap_begin([ids[a.value], ids[b.value]])
    _ok(api.fn("cuMemsetD32Async", "direct")(b.value, 1, 4, s), "cuMemsetD32Async")  # b, stream s
    _ok(api.fn("cuMemsetD32Async", "dlsym")(b.value + 8, 1, 2, s), "cuMemsetD32Async")  # again: safe
    launch(api, "cuLaunchKernel", "dlsym", F1, 0, [a.value, b.value])  # stream 0: both not safe there
    with agent.lock:
        core.snap_end()
    agent.snap = None

    _ok(api.fn("cuMemFree_v2", "direct")(b.value), "cuMemFree_v2")
    _ok(api.fn("cuModuleUnload", "dlsym")(module), "cuModuleUnload")
    _ok(api.fn("cuStreamDestroy_v2", "getproc")(stream), "cuStreamDestroy_v2")
    with agent.lock:
        live = sorted((x.id, x.addr, x.size) for x in agent.buffers())
    counters = core.counters()
    for timing in ("enter_ns", "upcall_ns", "gil_aware"):
        counters.pop(timing)
    return {"addresses": [a.value, b.value, s], "variable": variable.value, "first_launch_access": first, "dirty": sorted(dirty or []),
            "dirty_known": dirty is not None, "protects": protects, "live": live, "counters": counters,
            "context": core.context(), "context_before_alloc": before_alloc, "streams": sorted(core.streams())}
