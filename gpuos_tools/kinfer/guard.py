"""The truncation guard: a process that maps a ring survives another process cutting the ring
file short (csrc/kinfer_guard.c says how and why: a SIGBUS handler that gives the file its length
back, or maps zero pages over the region when it cannot).

Built once with the system C compiler, like the native serve loop. Without a compiler there is
no guard: ``protect`` returns None and ``unavailable()`` says why.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from gpuos_tools.cbuild import BuildError, build_library

SOURCE = Path(__file__).resolve().parent / "csrc" / "kinfer_guard.c"

_LIB: ctypes.CDLL | None = None
_WHY: str | None = None
_LOCK = threading.Lock()


def library() -> ctypes.CDLL | None:
    """The guard library (built on first use), or None when it cannot be built (``unavailable``)."""
    global _LIB, _WHY
    with _LOCK:
        if _LIB is not None or _WHY is not None:
            return _LIB
        try:
            lib = ctypes.CDLL(str(build_library(source=SOURCE, stem="libgpuos_kinfer_guard", flags=("-O2", "-std=gnu11"),
                                                libs=())))
        except (BuildError, OSError) as e:
            _WHY = str(e)
            return None
        lib.kg_install.restype = ctypes.c_int
        lib.kg_install.argtypes = []
        lib.kg_protect.restype = ctypes.c_int
        lib.kg_protect.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int64]
        lib.kg_release.restype = None
        lib.kg_release.argtypes = [ctypes.c_int]
        lib.kg_faults.restype = ctypes.c_uint64
        lib.kg_faults.argtypes = [ctypes.c_int]
        lib.kg_lost.restype = ctypes.c_int
        lib.kg_lost.argtypes = [ctypes.c_int]
        _LIB = lib
        return lib


def unavailable() -> str | None:
    """Why there is no guard in this process (None when there is one)."""
    library()
    return _WHY


class Region:
    """One guarded mapping: ``faults`` repaired so far, ``lost`` once zero pages replaced it."""

    def __init__(self, lib: ctypes.CDLL, index: int):
        self._lib = lib
        self.index = index

    @property
    def faults(self) -> int:
        return int(self._lib.kg_faults(self.index)) if self.index >= 0 else 0

    @property
    def lost(self) -> bool:
        return self.index >= 0 and bool(self._lib.kg_lost(self.index))

    def release(self) -> None:
        """Stop guarding (call before the mapping goes away)."""
        if self.index >= 0:
            self._lib.kg_release(self.index)
            self.index = -1


def protect(base: int, length: int, fd: int, size: int) -> Region | None:
    """Guard the mapping at ``base`` (``length`` bytes of the file open as ``fd``, which must be
    ``size`` bytes long); None without a guard library or a free slot."""
    lib = library()
    if lib is None or lib.kg_install() != 0:
        return None
    index = lib.kg_protect(base, length, fd, size)
    return Region(lib, index) if index >= 0 else None
