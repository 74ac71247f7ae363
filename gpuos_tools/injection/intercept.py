"""Driver-API interception without CUPTI (csrc/gpuos_intercept.c): build it, start a program
under it, read what it counted.

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

SOURCE = Path(__file__).resolve().parent / "csrc" / "gpuos_intercept.c"
STEM = "libgpuos_intercept"
ROUTES = ("direct", "dlsym", "getproc")
#: the calls that launch a kernel (each counted per CUfunction too)
LAUNCHES = ("cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel")


def build(cache: Path | None = None) -> Path:
    """The library, compiled once per version of its source (cbuild.BuildError says why not)."""
    return cbuild.build_library(cache, source=SOURCE, stem=STEM)


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
