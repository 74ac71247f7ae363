"""The scenario of tests/intercept_agent_scenario.py through the agent's CUPTI front end, on the
stand-in driver and the stand-in libcupti: each call's driver-API callbacks (enter, exit) and
resource callbacks are delivered as CUPTI delivers them, around the same call of the driver.
Writes {"state": ..., "records": [...]} as JSON (the records decoded as gpu-trace decodes them).

    python intercept_cupti_replay.py AGENT_LIB INTERPOSER_LIB FAKE_CUPTI OUT.json
"""

import ctypes
import json
import os
import sys
import tempfile

from intercept_agent_scenario import prototype, scenario

from gpuos_tools.agent.agent import Agent
from gpuos_tools.injection import intercept, tracer
from gpuos_tools.injection.core import PTSZ, NativeCore
from gpuos_tools.injection.start import AgentUpcalls
from gpuos_tools.model import wire
from gpuos_tools.model.binary import parse_records
from gpuos_tools.model.decode import Decoder

C = ctypes
U64, U32 = C.c_uint64, C.c_uint
DRIVER, RESOURCE = 1, 3
CONTEXT = 0xC0C0000  # the stand-in driver's one context


class CbData(C.Structure):  # CUpti_CallbackData
    _fields_ = [("site", U32), ("function_name", C.c_char_p), ("params", C.c_void_p), ("ret", C.c_void_p),
                ("symbol", C.c_char_p), ("context", C.c_void_p), ("context_uid", U32),
                ("correlation_data", C.c_void_p), ("correlation_id", U32)]


class ResData(C.Structure):  # CUpti_ResourceData
    _fields_ = [("context", C.c_void_p), ("stream", C.c_void_p), ("descriptor", C.c_void_p)]


class ModuleData(C.Structure):  # CUpti_ModuleResourceData
    _fields_ = [("module_id", U32), ("size", C.c_size_t), ("image", C.c_void_p)]


def params(*fields):
    return type("Params", (C.Structure,), {"_fields_": [(f"f{i}", t) for i, t in enumerate(fields)]})


# the parameter structs of generated_cuda_meta.h (pointers and handles as 64-bit integers)
PARAMS = {
    "cuStreamCreate": params(U64, U32),
    "cuModuleLoadData": params(U64, U64),
    "cuModuleGetFunction": params(U64, U64, U64),
    "cuModuleGetGlobal_v2": params(U64, U64, U64, U64),
    "cuMemAlloc_v2": params(U64, C.c_size_t),
    "cuMemcpyHtoD_v2": params(U64, U64, C.c_size_t),
    "cuLaunchKernel": params(U64, U32, U32, U32, U32, U32, U32, U32, U64, U64, U64),
    "cuMemsetD32Async": params(U64, U32, C.c_size_t, U64),
    "cuMemFree_v2": params(U64),
    "cuModuleUnload": params(U64),
    "cuStreamDestroy_v2": params(U64),
}
PARAMS["cuLaunchKernel_ptsz"] = PARAMS["cuLaunchKernel"]


def word(arg) -> int:
    if arg is None:
        return 0
    if isinstance(arg, int):
        return arg
    if isinstance(arg, C.Array):
        return C.addressof(arg)
    if isinstance(arg, C._Pointer):
        return C.cast(arg, C.c_void_p).value or 0
    return int(arg.value or 0)


class Replay:
    def __init__(self, cupti, cuda, ids: dict[str, int]) -> None:
        self.cupti, self.cuda, self.ids = cupti, cuda, ids
        self.cuda.cuFuncGetName.argtypes = [C.POINTER(C.c_char_p), C.c_void_p]
        self.next_module = 0

    def deliver(self, domain: int, cbid: int, data) -> None:
        assert self.cupti.fake_cupti_deliver(domain, cbid, C.byref(data)) == 1

    def fn(self, name: str, route: str):
        real = prototype(name)(C.cast(getattr(self.cuda, name), C.c_void_p).value)

        def call(*args):
            p = PARAMS[name](*[word(x) for x in args])
            rc = C.c_int(0)
            symbol = None
            if name.startswith("cuLaunchKernel"):
                out = C.c_char_p()
                assert self.cuda.cuFuncGetName(C.byref(out), args[0]) == 0
                symbol = out.value
            cb = CbData(0, name.encode(), C.addressof(p), C.addressof(rc), symbol, CONTEXT)
            cbid = self.ids[name]
            if name == "cuStreamDestroy_v2":
                self.deliver(RESOURCE, 4, ResData(CONTEXT, args[0].value, None))
            if name == "cuModuleUnload":
                self.deliver(RESOURCE, 7, ResData(CONTEXT, None, None))
            self.deliver(DRIVER, cbid, cb)
            rc.value = real(*args)
            if rc.value == 0 and name == "cuStreamCreate":
                self.deliver(RESOURCE, 3, ResData(CONTEXT, args[0].contents.value, None))
            if rc.value == 0 and name == "cuModuleLoadData":
                self.next_module += 1
                image = args[1]
                module = ModuleData(self.next_module, len(image.value), C.addressof(image))
                self.deliver(RESOURCE, 6, ResData(CONTEXT, None, C.addressof(module)))
            cb.site = 1
            self.deliver(DRIVER, cbid, cb)
            return rc.value

        return call


def main() -> None:
    agent_lib, interposer, fake_cupti, out = sys.argv[1:5]
    names = intercept.entry_names(interposer)  # the same call ids as the interposer's
    table = tracer.named_table(names)
    kinds = {cbid: kind | (PTSZ if name.endswith(("_ptsz", "_ptds")) else 0) for cbid, (name, _, kind) in table.items()}
    core = NativeCore(agent_lib)
    agent = Agent(0)
    AgentUpcalls(core, agent, {cbid: name for cbid, (name, _, _) in table.items()})
    trace = tempfile.TemporaryFile()
    pairs = [v for cbid, kind in sorted(kinds.items()) for v in (cbid, kind)]
    lib = core.lib
    lib.gpuos_trace_start.argtypes = [C.c_int, C.c_char_p, C.POINTER(C.c_uint32), C.c_int, C.c_int, C.c_int]
    rc = lib.gpuos_trace_start(trace.fileno(), fake_cupti.encode(), (C.c_uint32 * len(pairs))(*pairs), len(kinds), 5, 0)
    assert rc == 0, rc
    replay = Replay(C.CDLL(fake_cupti), C.CDLL("libcuda.so.1"), {name: cbid for cbid, name in enumerate(names)})
    state = scenario(replay, agent, core)
    counters = (C.c_uint64 * 4)()
    lib.gpuos_trace_stop(counters)
    trace.seek(0)
    decoder = Decoder(None)
    hello = (wire.HELLO, os.getpid(), "", None, {cbid: name for cbid, (name, _, _) in table.items()}, {}, "native-agent",
             "cupti")
    records = list(decoder.feed([hello]))
    for frame in wire.read_frames(trace.fileno(), native=lambda data: parse_records(data, False)):
        records.extend(decoder.feed(frame))
    with open(out, "w") as f:
        json.dump({"state": state, "records": records}, f)


main()
