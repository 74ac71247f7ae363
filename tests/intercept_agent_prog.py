"""The program of tests/test_intercept_agent.py, run under `gpu-trace run --agent --mechanism
intercept` on the stand-in driver: it makes the scenario's calls (tests/intercept_agent_scenario.py)
through the direct route (a library linked against libcuda.so.1), dlsym on a libcuda handle
(ctypes) and cuGetProcAddress, and writes the agent's state and what it finds loaded as JSON.

    python intercept_agent_prog.py SHIM.so OUT.json
"""

import ctypes
import json
import sys

from intercept_agent_scenario import prototype, scenario

from gpuos_tools.injection import tracer


class Routes:
    def __init__(self, shim: str) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")  # dlsym on a handle of the driver
        self.shim = ctypes.CDLL(shim)
        self.shim.shim_direct.restype = ctypes.c_void_p
        self.shim.shim_direct.argtypes = [ctypes.c_char_p]
        self.getproc = self.cuda.cuGetProcAddress_v2
        self.getproc.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                                 ctypes.POINTER(ctypes.c_int)]

    def fn(self, name: str, route: str):
        if route == "direct":
            addr = self.shim.shim_direct(name.encode())
        elif route == "dlsym":
            addr = ctypes.cast(getattr(self.cuda, name), ctypes.c_void_p).value
        else:
            base = name.removesuffix("_ptsz").removesuffix("_v2")
            ptr, status = ctypes.c_void_p(), ctypes.c_int()
            flags = 2 if name.endswith("_ptsz") else 0  # CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
            rc = self.getproc(base.encode(), ctypes.byref(ptr), 12000, flags, ctypes.byref(status))
            assert rc == 0 and status.value == 0, (name, rc, status.value)
            addr = ptr.value
        assert addr, (name, route)
        return prototype(name)(addr)


def main() -> None:
    t = tracer._tracer
    assert t is not None and t.mechanism == "intercept", "not started under the interposer agent"
    state = scenario(Routes(sys.argv[1]), t.agent, t.core)
    with open("/proc/self/maps") as f:
        state["cupti_mapped"] = sorted({line.split()[-1] for line in f if "cupti" in line.lower()})
    state["cupti_imported"] = sorted(m for m in sys.modules if "cupti" in m.lower())
    state["agent_mechanism"] = t.agent.mechanism
    with open(sys.argv[2], "w") as f:
        json.dump(state, f)


main()
