"""Driver-API interception without CUPTI (csrc/gpuos_intercept.c): build it, start a program
under it, read what it counted; and the same interposer as the agent's front end (`build_agent`,
`AgentSession`), which records and feeds the native core as the CUPTI callback does.

The library is preloaded (LD_PRELOAD) into the program; it wraps the driver entry points the
program reaches directly, through dlsym on a libcuda handle, or through cuGetProcAddress, and
counts each kind of call by route and each kernel by CUfunction. It is the evidence for choosing
between interception and CUPTI callbacks for the native per-operation core (docs/interception.md);
scripts/probe_interception.py measures it on the GPU.
"""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuos_tools import cbuild
from gpuos_tools.injection import core, tracelib

SOURCE = Path(__file__).resolve().parent / "csrc" / "gpuos_intercept.c"
STEM = "libgpuos_intercept"
AGENT_STEM = "libgpuos_icagent"
PRELOAD = "LD_PRELOAD"
ROUTES = ("direct", "dlsym", "getproc")
#: the calls that launch a kernel (each counted per CUfunction too)
LAUNCHES = ("cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel")


def build(cache: Path | None = None) -> Path:
    """The library, compiled once per version of its source (cbuild.BuildError says why not)."""
    return cbuild.build_library(cache, source=SOURCE, stem=STEM)


def build_agent(cache: Path | None = None) -> Path:
    """The interposer as the agent's front end: the recorder and the native core linked in
    (-DGPUOS_AGENT), one library that the launcher preloads into the program."""
    return cbuild.build_library(cache, source=SOURCE, stem=AGENT_STEM, flags=("-O2", "-DGPUOS_AGENT"),
                                includes=(tracelib.INCLUDE,), sources=core.SOURCES)


def preload(env: Mapping[str, str], library: Path | str) -> str:
    """LD_PRELOAD with ``library`` first, the user's own entries after it."""
    return " ".join(filter(None, [str(library), env.get(PRELOAD, "")]))


def unpreload(value: str | None, library: str) -> str | None:
    """LD_PRELOAD without ``library`` (programs the traced one starts run plain); None when
    nothing is left."""
    parts = [p for p in (value or "").replace(":", " ").split() if p != library]
    return " ".join(parts) or None


def entry_names(library: Path | str) -> list[str]:
    """The agent build's entries by index: the id of a call in the records is its entry's index."""
    lib = ctypes.CDLL(str(library))
    lib.gpuos_intercept_entry_name.restype = ctypes.c_char_p
    lib.gpuos_intercept_entry_name.argtypes = [ctypes.c_int]
    return [lib.gpuos_intercept_entry_name(i).decode() for i in range(lib.gpuos_intercept_nentries())]


class AgentSession:
    """The preloaded interposer inside the program, started as the agent's front end (the
    counterpart of tracelib.NativeSession, which starts the CUPTI callback)."""

    def __init__(self, library: str, fd: int, kinds: dict[int, int], flush_ms: float, check: bool):
        if cbuild.loaded_library_path(Path(library).name) is None:
            raise RuntimeError(f"the interposer {library} is not preloaded in this process "
                               f"({PRELOAD} was dropped on the way, or the program is not the one started)")
        self.lib = ctypes.CDLL(library)  # the preloaded copy: the loader hands back the loaded object
        self.lib.gpuos_intercept_start.argtypes = [
            ctypes.c_int, ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ]
        self.lib.gpuos_intercept_stop.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        pairs = [v for cbid, kind in sorted(kinds.items()) for v in (cbid, kind)]
        self.kinds = (ctypes.c_uint32 * max(1, len(pairs)))(*pairs)
        self.args = (fd, self.kinds, len(kinds), max(1, int(flush_ms)), int(check))

    def start(self) -> None:
        rc = self.lib.gpuos_intercept_start(*self.args)
        if rc != 0:
            steps = {-2: "load the driver (libcuda.so.1)", -7: "start the writer thread"}
            raise RuntimeError(f"interposer: {steps.get(rc, rc)} failed")

    def stop(self) -> dict[str, int]:
        counters = (ctypes.c_uint64 * 4)()
        self.lib.gpuos_intercept_stop(counters)
        return {"callbacks": counters[0], "errors": counters[1], "functions": counters[2],
                "callback_ns": counters[3]}


def call_names(library: Path | str) -> list[str]:
    """The kinds of call the library wraps (the names its count files use), asked of the library."""
    lib = ctypes.CDLL(str(library))  # RTLD_LOCAL: loaded, not interposed, in this process
    lib.gpuos_intercept_call_name.restype = ctypes.c_char_p
    lib.gpuos_intercept_call_name.argtypes = [ctypes.c_int]
    return [lib.gpuos_intercept_call_name(i).decode() for i in range(lib.gpuos_intercept_ncalls())]


def environment(library: Path | str, out: str | None, base: Mapping[str, str] | None = None,
                libcuda: str | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the library preloaded first.

    ``out``: GPUOS_INTERCEPT_OUT, where each process writes its counts at exit (``%p`` becomes
    its pid, so that children started with the same environment do not overwrite each other).
    ``libcuda``: the driver library to forward to, when it is not libcuda.so.1.
    """
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = " ".join(filter(None, [str(library), env.get("LD_PRELOAD", "")]))
    if out is not None:
        env["GPUOS_INTERCEPT_OUT"] = out
    if libcuda is not None:
        env["GPUOS_INTERCEPT_LIBCUDA"] = libcuda
    return env


@dataclass
class Counts:
    """What one process counted: calls[name][route], kernels (func handle -> launches, name)."""

    pid: int
    libcuda: str | None
    calls: dict[str, dict[str, int]]
    kernels: dict[int, tuple[int, str | None]]
    getproc: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    def total(self, name: str) -> int:
        return sum(self.calls.get(name, {}).values())

    def launches(self) -> int:
        return sum(self.total(name) for name in LAUNCHES)

    def by_route(self, names: tuple[str, ...] = LAUNCHES) -> dict[str, int]:
        return {r: sum(self.calls.get(n, {}).get(r, 0) for n in names) for r in ROUTES}


def parse_counts(data: dict[str, Any]) -> Counts:
    """The library's JSON (gpuos_intercept_dump) as Counts."""
    if data.get("tool") != "gpuos_intercept":
        raise ValueError("not a gpuos_intercept count file")
    routes = data.get("routes", list(ROUTES))
    calls = {name: dict(zip(routes, values)) for name, values in data.get("calls", {}).items()}
    kernels = {int(k["func"]): (int(k["launches"]), k.get("name")) for k in data.get("kernels", [])}
    return Counts(int(data["pid"]), data.get("libcuda"), calls, kernels, data.get("getproc", {}), data)


def read_counts(path: Path | str) -> Counts:
    return parse_counts(json.loads(Path(path).read_text()))


class InProcess:
    """The counters of the library preloaded into this very process (ctypes), or None from
    ``attach()`` when it is not there: a program reads them around the part it measures."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.gpuos_intercept_call_name.restype = ctypes.c_char_p
        lib.gpuos_intercept_call_name.argtypes = [ctypes.c_int]
        lib.gpuos_intercept_dump.argtypes = [ctypes.c_char_p]
        n = lib.gpuos_intercept_ncalls()
        self.names = [lib.gpuos_intercept_call_name(i).decode() for i in range(n)]
        self._buf = (ctypes.c_uint64 * n)()

    @classmethod
    def attach(cls) -> InProcess | None:
        lib = ctypes.CDLL(None)
        try:
            lib.gpuos_intercept_ncalls
        except AttributeError:
            return None
        return cls(lib)

    def totals(self) -> dict[str, int]:
        """Calls of each kind so far, every route together."""
        self.lib.gpuos_intercept_totals(self._buf)
        return dict(zip(self.names, self._buf))

    def dump(self, path: Path | str) -> None:
        if self.lib.gpuos_intercept_dump(str(path).encode()) != 0:
            raise OSError(f"gpuos_intercept_dump({path}) failed")


def delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """Calls made between two totals(), kinds with none left out."""
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
