"""The loader of the block-layer program (loader.c), built once with the system C compiler and
libbpf's headers (Debian: libbpf-dev), driven through ctypes.

``Loader(disks)`` loads the shipped CO-RE object; ``attach_ring`` makes it a producer on a
gpu-kinfer-bridge ring (each read's kernel-side inputs are then sent to the daemon at issue);
``start`` attaches the tracepoints; ``take`` returns the joined records as a numpy structured
array (``RECORD_DTYPE``, checked field by field against the C struct when the library loads).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Self

import numpy as np

from gpuos_tools.cbuild import BuildError, build_library
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.kinfer.bpf import HERE, LOADER_SOURCE, OBJECT, unavailable_reason
from gpuos_tools.kinfer.ring import HEADER_FILE

__all__ = ["BpfError", "Loader", "RECORD_DTYPE", "PREDICTED", "library"]

# struct gk_record of loader.c, field by field in declaration order (offsets checked by gk_layout)
_FIELDS = [
    ("issue_ns", "<u8"), ("done_ns", "<u8"), ("sector", "<u8"), ("seen_ns", "<u8"), ("submit_ns", "<u8"),
    ("answer_ns", "<u8"), ("decided_ns", "<u8"), ("dev", "<u4"), ("bytes", "<u4"), ("pending", "<u4"), ("pid", "<u4"), ("hwq", "<u4"),
    ("error", "<i4"), ("decision", "<i4"), ("batch", "<u4"), ("where", "<u4"), ("status", "<u4"), ("comm", "S16"),
    ("op", "u1"), ("predicted", "u1"), ("features", "u1", (31,)),
]

#: enum gk_predicted: what became of a read's prediction
PREDICTED = {0: "none", 1: "answered", 2: "no_slot", 3: "timeout", 4: "no_issue_event", 5: "refused"}

LOADER_COUNTERS = ["events", "issue_events", "completion_events", "predicted", "no_slot", "answer_timeouts",
                   "records_lost", "expired", "sleeps", "refused"]
NLOADER = 12
PROGRAM_COUNTERS = ["issued", "completed", "untracked", "table_full", "events_lost", "requeued"]
NPROGRAM = 8


class BpfError(GpuosError):
    """The program cannot be built, loaded or attached here; the message says why."""


_LIB: ctypes.CDLL | None = None
RECORD_DTYPE: np.dtype | None = None


#: A folder where libbpf's Debian packages were unpacked (``dpkg -x libbpf1*.deb libbpf-dev*.deb
#: DIR``, and libelf1's where the machine lacks libelf.so.1), for a machine that has neither
#: libbpf-dev nor network: its headers and libraries are used, and found again at run time
#: through the rpath.
PREFIX_ENV = "GPUOS_LIBBPF_PREFIX"


def _libbpf_flags() -> tuple[tuple[Path, ...], tuple[str, ...]]:
    prefix = os.environ.get(PREFIX_ENV)
    if not prefix:
        return (), ("-lbpf",)
    root = Path(prefix)
    libdirs = sorted({p.parent for p in root.glob("usr/lib*/**/libbpf.so*")})
    if not (root / "usr/include/bpf/libbpf.h").exists() or not libdirs:
        raise BuildError(f"{PREFIX_ENV}={prefix}: no usr/include/bpf/libbpf.h or libbpf.so under it")
    # DT_RPATH (not RUNPATH): it is searched for libbpf's own dependencies too (libelf unpacked there)
    libs = ["-Wl,--disable-new-dtags", *(arg for d in libdirs for arg in (f"-L{d}", f"-Wl,-rpath,{d}"))]
    if not any(d.glob("libbpf.so") for d in libdirs):  # only the runtime's libbpf.so.1: link it by name
        return (root / "usr/include",), (*libs, f"-l:{next(libdirs[0].glob('libbpf.so.*')).name}")
    return (root / "usr/include",), (*libs, "-lbpf")


def library(cache: Path | None = None) -> ctypes.CDLL:
    """The loader library, built on first use (BuildError says why it cannot be)."""
    global _LIB, RECORD_DTYPE
    if _LIB is not None and cache is None:
        return _LIB
    extra_includes, bpf_libs = _libbpf_flags()
    path = build_library(cache, source=LOADER_SOURCE, stem="libgpuos_kinfer_bpf", flags=("-O2", "-std=gnu11"),
                         libs=(*bpf_libs, "-lpthread"), includes=(HERE, HEADER_FILE.parent, *extra_includes))
    lib = ctypes.CDLL(str(path))
    vp, u32, u64, i32 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int
    for name, res, args in [
        ("gk_open", vp, [ctypes.c_char_p, i32, vp, i32]),
        ("gk_error", ctypes.c_char_p, []),
        ("gk_layout", i32, [vp, i32]),
        ("gk_attach_ring", i32, [vp, ctypes.c_char_p, u32, u32]),
        ("gk_set_wait", None, [vp, u64, u64, u64]),
        ("gk_start", i32, [vp]),
        ("gk_stop", None, [vp]),
        ("gk_take", u32, [vp, vp, u32, u64]),
        ("gk_stats", i32, [vp, vp, i32]),
        ("gk_ring_info", None, [vp, vp]),
        ("gk_close", None, [vp]),
    ]:
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    dtype = _record_dtype(lib)
    if cache is None:
        _LIB, RECORD_DTYPE = lib, dtype
    return lib


def _record_dtype(lib: ctypes.CDLL) -> np.dtype:
    out = (ctypes.c_uint32 * 64)()
    n = lib.gk_layout(out, 64)
    size, offsets = out[0], list(out[1:n])
    if len(offsets) != len(_FIELDS):
        raise BuildError(f"loader.c's record has {len(offsets)} fields, loader.py knows {len(_FIELDS)}")
    dtype = np.dtype({"names": [f[0] for f in _FIELDS], "formats": [f[1] if len(f) == 2 else (f[1], f[2]) for f in _FIELDS],
                      "offsets": offsets, "itemsize": size})
    packed = np.dtype([(f[0], f[1]) if len(f) == 2 else (f[0], f[1], f[2]) for f in _FIELDS])
    # the natural layout of these fields must be what C made of them (no field of another width)
    for name in dtype.names:
        if dtype.fields[name][0] != packed.fields[name][0]:
            raise BuildError(f"record field {name}: C and Python disagree")
    return dtype


def record_dtype() -> np.dtype:
    library()
    assert RECORD_DTYPE is not None
    return RECORD_DTYPE


class Loader:
    """The block-layer program of one process, loaded (``start`` attaches it)."""

    def __init__(self, disks: list[int] | None = None, *, predict: bool = False, obj: Path = OBJECT):
        reason = unavailable_reason()
        if reason is not None:
            raise BpfError(reason, ExitCode.PERMISSION if "root" in reason or "CAP_" in reason else ExitCode.FAILURE)
        try:
            self.lib = library()
        except BuildError as e:
            raise BpfError(f"the eBPF loader cannot be built (it needs cc and libbpf's headers: Debian libbpf-dev): {e}",
                           ExitCode.FAILURE) from None
        self.dtype = record_dtype()
        listed = (ctypes.c_uint32 * max(1, len(disks or [])))(*(disks or []))
        self.handle = self.lib.gk_open(str(obj).encode(), 1 if predict else 0, listed, len(disks or []))
        if not self.handle:
            raise BpfError(self.lib.gk_error().decode(errors="replace"), ExitCode.FAILURE)
        self.started = False
        self.ring_info: dict[str, int] = {}
        self._buf = np.zeros(4096, dtype=self.dtype)

    def attach_ring(self, ring_path: str | Path, model_id: int = 0, lanes: int = 4) -> int:
        """Send each read's inputs to the daemon of this ring (as a producer on up to ``lanes``
        lanes); returns the lanes claimed."""
        n = self.lib.gk_attach_ring(self.handle, str(ring_path).encode(), model_id, lanes)
        if n <= 0:
            raise BpfError(self.lib.gk_error().decode(errors="replace"), ExitCode.FAILURE)
        info = (ctypes.c_uint32 * 3)()
        self.lib.gk_ring_info(self.handle, info)
        self.ring_info = {"lanes": info[0], "slots": info[1]}
        return n

    def set_wait(self, spin_min_us: float, spin_max_us: float, answer_timeout_s: float = 1.0) -> None:
        self.lib.gk_set_wait(self.handle, int(spin_min_us * 1e3), int(spin_max_us * 1e3), int(answer_timeout_s * 1e9))

    def start(self) -> None:
        if self.lib.gk_start(self.handle) != 0:
            raise BpfError(self.lib.gk_error().decode(errors="replace"), ExitCode.FAILURE)
        self.started = True

    def take(self, timeout_s: float) -> np.ndarray:
        """The records completed since the last call (a copy), waiting up to ``timeout_s`` for one."""
        buf = self._buf
        n = self.lib.gk_take(self.handle, buf.ctypes.data, len(buf), int(max(0.0, timeout_s) * 1e9))
        return buf[:n].copy()

    def stats(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * (NLOADER + NPROGRAM))()
        self.lib.gk_stats(self.handle, out, NLOADER + NPROGRAM)
        values = {name: int(out[i]) for i, name in enumerate(LOADER_COUNTERS)}
        values.update({f"kernel_{name}": int(out[NLOADER + i]) for i, name in enumerate(PROGRAM_COUNTERS)})
        return values

    def stop(self) -> None:
        """Detach the tracepoints; records already joined stay for ``take``."""
        if self.started:
            self.lib.gk_stop(self.handle)
            self.started = False

    def close(self) -> None:
        if self.handle:
            self.lib.gk_close(self.handle)
            self.handle = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
