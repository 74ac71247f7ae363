"""The native tracer inside the traced program: the library built from csrc/gpuos_trace.c, started
on the CUPTI instance that cupti-python loaded, its records written to the trace pipe.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from gpuos_tools.cbuild import build_library, loaded_library_path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "csrc" / "gpuos_trace.c"  #: the CUPTI front end
RECORDER = HERE / "csrc" / "gpuos_record.c"  #: the records and their shipping, shared with the interposer
INCLUDE = HERE / "include"


def tracer_library(cache: Path | None = None) -> Path:
    """The tracer's library (built on first use)."""
    return build_library(cache, source=SOURCE, stem="libgpuos_trace", includes=(INCLUDE,), sources=(RECORDER,))


class NativeSession:
    """The native callback inside the traced program (used by tracer.start)."""

    def __init__(self, library: str, fd: int, kinds: dict[int, int], flush_ms: float, check: bool):
        from cupti import cupti

        cupti.get_timestamp()  # makes cupti-python load libcupti (lazily, the way it finds it)
        path = loaded_library_path("libcupti.so")
        if path is None:
            raise RuntimeError("cupti-python is imported but no libcupti.so is mapped")
        self.lib = ctypes.CDLL(library)
        self.lib.gpuos_trace_start.argtypes = [
            ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ]
        self.lib.gpuos_trace_stop.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        pairs = [v for cbid, kind in sorted(kinds.items()) for v in (cbid, kind)]
        self.kinds = (ctypes.c_uint32 * len(pairs))(*pairs)
        self.args = (fd, path.encode(), self.kinds, len(kinds), max(1, int(flush_ms)), int(check))

    def start(self) -> None:
        rc = self.lib.gpuos_trace_start(*self.args)
        if rc != 0:
            steps = {-1: "dlopen libcupti", -2: "dlopen libcuda.so.1", -3: "find CUPTI functions",
                     -4: "cuptiSubscribe (is another CUPTI tool attached?)", -5: "enable driver callbacks",
                     -6: "enable resource callbacks", -7: "start the writer thread"}
            raise RuntimeError(f"native tracer: {steps.get(rc, rc)} failed")

    def stop(self) -> dict[str, int]:
        counters = (ctypes.c_uint64 * 4)()
        self.lib.gpuos_trace_stop(counters)
        return {"callbacks": counters[0], "errors": counters[1], "functions": counters[2],
                "callback_ns": counters[3]}
