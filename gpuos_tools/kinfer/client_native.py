"""The Python producer's native request path: csrc/kinfer_client.c, built once with the system C
compiler (cbuild, into ~/.cache/gpuos-tools) and called through ctypes by ``ring.RingClient``.

One request is one call into C (write, publish, spin or sleep by the client's adaptive rule, read
the answer back), instead of a few µs of interpreter work per request. The functions that run per
request are called without ctypes argument types, which is what costs least: the handle is a
prebuilt ``c_void_p``, the inputs a ``bytes``, the counts small ints and the timeout a float.
Without a compiler ``library`` raises BuildError and the client keeps its Python path.
"""

from __future__ import annotations

import ctypes
import errno
import threading
from pathlib import Path

from gpuos_tools.cbuild import BuildError, build_library

SOURCE = Path(__file__).resolve().parent / "csrc" / "kinfer_client.c"
INCLUDE = Path(__file__).resolve().parent / "include"

#: What the C functions return besides a slot or an output count.
AGAIN, TIMEOUT, TOO_BIG, LANE_FULL, BAD_MODEL_ID, BAD_SLOT = (
    -errno.EAGAIN, -errno.ETIMEDOUT, -errno.E2BIG, -errno.EBUSY, -errno.ERANGE, -errno.EINVAL)
#: struct kc_answer before its outputs: status, decision, batch, where, latency_ns.
ANSWER_HEAD = "<IiIIq"

__all__ = ["AGAIN", "ANSWER_HEAD", "BAD_MODEL_ID", "BAD_SLOT", "BuildError", "LANE_FULL", "TIMEOUT", "TOO_BIG", "library"]

_LIB: ctypes.CDLL | None = None
_WHY: str | None = None
_LOCK = threading.Lock()


def library() -> ctypes.CDLL:
    """The client library, built on first use (BuildError says why it cannot be, then and after)."""
    global _LIB, _WHY
    with _LOCK:
        if _LIB is not None:
            return _LIB
        if _WHY is not None:
            raise BuildError(_WHY)
        try:
            path = build_library(source=SOURCE, stem="libgpuos_kinfer_client", flags=("-O2", "-std=gnu11"), libs=(),
                                 includes=(INCLUDE,))
            lib = ctypes.CDLL(str(path))
        except (BuildError, OSError) as e:
            _WHY = str(e)
            raise BuildError(_WHY) from None
        vp, u32, u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64
        lib.kc_create.restype = vp
        lib.kc_create.argtypes = [vp, u64, u64, u64, u64, u64, u32, u32, u32, u32, u32, u32, ctypes.c_int64, u64, u64]
        lib.kc_destroy.restype = None
        lib.kc_destroy.argtypes = [vp]
        lib.kc_out.restype = vp
        lib.kc_out.argtypes = [vp]
        lib.kc_learn.restype = None
        lib.kc_learn.argtypes = [vp, u64]
        lib.kc_state.restype = None
        lib.kc_state.argtypes = [vp, vp]
        # kc_submit, kc_wait, kc_infer: per request, called without argtypes (see the module's text)
        _LIB = lib
        return lib
