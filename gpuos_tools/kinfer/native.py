"""The native fast path of the daemon: csrc/kinfer_native.c, built once with the system C compiler
(by the tracer's build helper, into ~/.cache/gpuos-tools) and driven through ctypes.

``NativeLoop`` owns the C serve thread of one ring. The thread takes every READY batch; it answers
those the policy gives to the CPU (``set_cpu_batches``) when their entries are well-formed, and
hands every other batch to the Python daemon (``take``). Models are installed with ``set_model``;
the weights' arrays stay referenced here until the thread can no longer be using them.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

from gpuos_tools.cbuild import BuildError, build_library
from gpuos_tools.kinfer.model import Mlp

SOURCE = Path(__file__).resolve().parent / "csrc" / "kinfer_native.c"
INCLUDE = Path(__file__).resolve().parent / "include"

__all__ = ["BuildError", "Forward", "NativeLoop", "library", "native_forward"]


class _Model(ctypes.Structure):
    _fields_ = [
        ("n_inputs", ctypes.c_uint32), ("hidden", ctypes.c_uint32), ("n_outputs", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
        ("w1", ctypes.c_void_p), ("b1", ctypes.c_void_p), ("w2t", ctypes.c_void_p), ("b2", ctypes.c_void_p),
    ]


_LIB: ctypes.CDLL | None = None


def library(cache: Path | None = None) -> ctypes.CDLL:
    """The native library, built on first use (BuildError says why it cannot be)."""
    global _LIB
    if _LIB is not None and cache is None:
        return _LIB
    path = build_library(cache, source=SOURCE, stem="libgpuos_kinfer", flags=("-O3", "-std=gnu11"), libs=("-lpthread", "-lm"),
                         includes=(INCLUDE,))
    lib = ctypes.CDLL(str(path))
    vp, u32, u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64
    for name, res, args in [
        ("kn_create", vp, [vp, u64, u64, u64, u32]),
        ("kn_set_model", vp, [vp, u32, vp]),
        ("kn_in_use", ctypes.c_int, [vp, vp]),
        ("kn_set_cpu_ok", None, [vp, vp, u32]),
        ("kn_count", None, [vp, u32, u64]),
        ("kn_start", ctypes.c_int, [vp]),
        ("kn_stop", None, [vp]),
        ("kn_take", u32, [vp, vp, u32, u64]),
        ("kn_stats", None, [vp, vp]),
        ("kn_destroy", None, [vp]),
        ("kn_max_models", ctypes.c_int, []),
        ("kn_max_batch", ctypes.c_int, []),
        ("kn_max_hidden", ctypes.c_int, []),
        ("kn_forward_kind", ctypes.c_int, []),
        ("kn_use_forward", ctypes.c_int, [ctypes.c_int]),
        ("kn_forward_rows", ctypes.c_int, [vp, vp, u32, u32, vp, u32]),
        ("kn_set_wait", None, [vp, u64, u64]),
        ("kn_wait_state", None, [vp, vp]),
        ("kn_wait_replay", u64, [u64, u64, vp, u32]),
    ]:
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    if cache is None:
        _LIB = lib
    return lib


class _Weights:
    """One model as the C side sees it, and the arrays that must outlive its use there."""

    def __init__(self, model: Mlp):
        self.model = model
        self.arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in (model.w1, model.b1, model.w2.T, model.b2)]
        w1, b1, w2t, b2 = self.arrays
        self.struct = _Model(model.n_inputs, int(w1.shape[1]), model.n_outputs, 0,
                             w1.ctypes.data, b1.ctypes.data, w2t.ctypes.data, b2.ctypes.data)
        self.addr = ctypes.addressof(self.struct)


def fits(lib: ctypes.CDLL, model: Mlp, max_inputs: int, max_outputs: int) -> bool:
    return model.w1.shape[1] <= lib.kn_max_hidden() and model.n_inputs <= max_inputs and model.n_outputs <= min(max_outputs, 16)


class Forward:
    """The C path's forward, callable on rows like ``Mlp.forward`` (weights prepared once)."""

    def __init__(self, model: Mlp, lib: ctypes.CDLL | None = None):
        self.lib = lib or library()
        self.weights = _Weights(model)
        self.model = model

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty((x.shape[0], self.model.n_outputs), dtype=np.float32)
        rc = self.lib.kn_forward_rows(self.weights.addr, x.ctypes.data, x.shape[0], x.shape[1], y.ctypes.data, self.model.n_outputs)
        if rc != 0:
            raise ValueError(f"the native forward refused a {x.shape} batch for this model")
        return y


def native_forward(model: Mlp, x: np.ndarray, lib: ctypes.CDLL | None = None) -> np.ndarray:
    """The C path's forward on rows of ``x`` (for tests and the bench: the same code the thread runs)."""
    return Forward(model, lib)(x)


class NativeLoop:
    """The C serve thread of one mapped ring (``base``: the address of its first byte; ``size``:
    how many bytes are mapped there, which the header's layout must fit)."""

    def __init__(self, base: int, size: int, spin_us: float, window_us: float, max_batch: int, max_inputs: int,
                 max_outputs: int):
        self.lib = library()
        self.handle = self.lib.kn_create(base, size, int(spin_us * 1e3), int(window_us * 1e3), max_batch)
        if not self.handle:
            raise BuildError("the native serve loop refused this ring (layout or output count)")
        self.max_inputs, self.max_outputs = max_inputs, max_outputs
        self.max_models = int(self.lib.kn_max_models())
        self.table_size = int(self.lib.kn_max_batch()) + 1
        self.installed: dict[int, _Weights] = {}
        self.retired: list[_Weights] = []
        self._table = np.zeros(self.table_size, dtype=np.uint8)
        self.cpu_max = 0
        self.running = False

    def set_model(self, model_id: int, model: Mlp | None) -> bool:
        """Install ``model`` for ``model_id`` (None: remove). False when the C path cannot serve it
        (its requests then go to the Python daemon). The old weights are kept until released."""
        weights = None
        if model is not None and 0 <= model_id < self.max_models and fits(self.lib, model, self.max_inputs, self.max_outputs):
            weights = _Weights(model)
        if not 0 <= model_id < self.max_models:
            return False
        self.lib.kn_set_model(self.handle, model_id, weights.addr if weights else None)
        old = self.installed.pop(model_id, None)
        if old is not None:
            self.retired.append(old)
        if weights is not None:
            self.installed[model_id] = weights
        self.release()
        return weights is not None

    def release(self) -> int:
        """Drop retired weights the thread no longer holds; returns how many are still held."""
        self.retired = [w for w in self.retired if self.lib.kn_in_use(self.handle, w.addr)]
        return len(self.retired)

    def set_cpu_batches(self, cpu_ok: np.ndarray) -> None:
        """cpu_ok[b] true: a batch of b requests is answered by the C thread (b up to ``table_size - 1``)."""
        table = np.zeros(self.table_size, dtype=np.uint8)
        n = min(len(cpu_ok), self.table_size)
        table[:n] = np.asarray(cpu_ok[:n], dtype=bool)
        if not np.array_equal(table, self._table):
            self._table = table
            self.lib.kn_set_cpu_ok(self.handle, table.ctypes.data, self.table_size)

    def set_wait(self, spin_min_us: float, spin_max_us: float) -> None:
        """Adaptive waiting between these bounds (wait.py) instead of the fixed spin (before ``start``)."""
        self.lib.kn_set_wait(self.handle, int(spin_min_us * 1e3), int(spin_max_us * 1e3))

    def wait_state(self) -> dict[str, float]:
        """The spin window now (µs) and the gap estimate behind it."""
        out = (ctypes.c_uint64 * 2)()
        self.lib.kn_wait_state(self.handle, out)
        return {"hold_us": out[0] / 1e3, "gap_us": out[1] / 1e3}

    def count(self, index: int, n: int) -> None:
        self.lib.kn_count(self.handle, index, n)

    def start(self) -> None:
        rc = self.lib.kn_start(self.handle)
        if rc != 0:
            raise OSError(rc, "pthread_create failed for the native serve loop")
        self.running = True

    def take(self, out: Any, timeout_s: float) -> int:
        """Slots of batches handed over (written into the ctypes uint32 array ``out``)."""
        return int(self.lib.kn_take(self.handle, out, len(out), int(max(0.0, timeout_s) * 1e9)))

    def stats(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * 4)()
        self.lib.kn_stats(self.handle, out)
        return {"native_batches": out[0], "native_served": out[1], "handed_batches": out[2]}

    def stop(self) -> None:
        if self.running:
            self.lib.kn_stop(self.handle)
            self.running = False

    def close(self) -> None:
        if self.handle:
            self.lib.kn_destroy(self.handle)  # joins the thread first
            self.handle = None
            self.running = False
            self.installed.clear()
            self.retired.clear()
