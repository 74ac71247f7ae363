"""CuPy's kernels: exact extents from their arguments.

- Elementwise and reduction kernels (``extern "C" cupy_NAME__TYPES``, types in parameter order):
  each array is a ``CArray<T, ndim>`` passed by value (data pointer, size, shape[ndim] and byte
  strides[ndim], 8 bytes each); the last parameter is a ``CIndexer`` (size, shape, index). An
  array is only ever indexed inside its own shape, so its extent is the span of its strides;
  negative strides reach below the pointer. The kernels are extern "C", so the names say
  which arrays are written only through CuPy's conventions: a kernel's parameters are its
  inputs, then its outputs (cupy/_core/_kernel.pyx), and an output is always an array, so an
  array before a scalar parameter is an input (read only). A ufunc (``cupy_add``,
  ``cupy_sin``: NumPy's ufunc of the same name, with as many parameters as its inputs and
  outputs) assigns its outputs without reading them: its last ``nout`` arrays are written
  only. Any other array may be an output that the kernel's code also reads (``z += x``): it
  is read and written.
- Random numbers (``execute_dist<F, State, R>(state, states, out, size)`` and
  ``init_curand<State>(state, seed, size)``, cupy/random/cupy_distributions.cu): thread ``id <
  size`` uses generator state ``id`` and writes ``out[id]``.
"""

from __future__ import annotations

from typing import Any

import numpy

from gpuos_tools.access.decoded import Decoded, Plan
from gpuos_tools.access.layouts import NUMPY_SIZES, args_of, i64, numel, sizeof
from gpuos_tools.access.proto import split_params

VIA = "cupy"


def carray(raw: bytes, itemsize: int) -> tuple[int, int] | None:
    """[lo, hi) bytes relative to the data pointer of the CArray in ``raw``, or None when the
    bytes are not one (its size is not the product of its shape)."""
    ndim, rest = divmod(len(raw) - 16, 16)
    if ndim < 0 or rest:
        return None
    size = i64(raw, 8)
    shape = [i64(raw, 16 + 8 * d) for d in range(ndim)]
    strides = [i64(raw, 16 + 8 * ndim + 8 * d) for d in range(ndim)]
    if size < 0 or min(shape, default=1) < 0 or numel(shape) != size:
        return None
    if size == 0:
        return 0, 0
    lo = sum((s - 1) * st for s, st in zip(shape, strides) if st < 0)
    hi = sum((s - 1) * st for s, st in zip(shape, strides) if st > 0)
    return lo, hi + itemsize


def _ufunc_outputs(base: str, nparams: int) -> int:
    """How many trailing parameters of the kernel ``cupy_NAME`` are a ufunc's outputs, written
    and never read: NumPy's ufunc ``NAME``'s ``nout`` when its arity matches, else 0."""
    ufunc = getattr(numpy, base.removeprefix("cupy_"), None)
    if isinstance(ufunc, numpy.ufunc) and ufunc.nin + ufunc.nout == nparams:
        return ufunc.nout
    return 0


def plan_elementwise(name: str, sizes: tuple[int, ...]) -> Plan | None:
    base, sep, types = name.rpartition("__")
    if not sep or not base.startswith("cupy_") or len(sizes) < 2:
        return None
    tokens = types.split("_")
    if len(tokens) != len(sizes) - 1 or (sizes[-1] - 8) % 16 or sizes[-1] < 8:
        return None
    arrays = []  # (param, itemsize)
    last_scalar = -1
    for i, (token, size) in enumerate(zip(tokens, sizes)):
        if size >= 16 and (size - 16) % 16 == 0 and token in NUMPY_SIZES:
            arrays.append((i, NUMPY_SIZES[token]))
        elif size > 8:
            return None  # a struct that is not an array of a known type
        else:
            last_scalar = i
    if not arrays:
        return None
    nout = _ufunc_outputs(base, len(tokens))
    if nout:  # param -> (read, written): a ufunc's inputs are read, its outputs written
        directions = {i: (i < len(tokens) - nout, i >= len(tokens) - nout) for i, _ in arrays}
    else:  # an array before a scalar is an input; any other may be an output read too
        directions = {i: (True, i > last_scalar) for i, _ in arrays}

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        index = raw[-1]
        ndim = (len(index) - 8) // 16
        if i64(index, 0) != numel([i64(index, 8 + 8 * d) for d in range(ndim)]):
            return None  # not a CIndexer
        dec = Decoded(VIA, regions={i: [(0, 8)] for i, _ in arrays})
        for i, itemsize in arrays:
            span = carray(raw[i], itemsize)
            if span is None:
                return None
            if span[1] > span[0]:
                reads, writes = directions[i]
                dec.spans[(i, 0)] = (span if reads else None, span if writes else None)
        return dec

    return plan


#: sizeof the curand generator states CuPy's random kernels take
_STATES = {"curandStateXORWOW": 48, "curandStatePhilox4_32_10": 64, "curandStateMRG32k3a": 48}


def _state_size(arg: str) -> int | None:
    inner = args_of(arg, "curand_pseudo_state")
    return _STATES.get(inner[0]) if inner and len(inner) == 1 else None


def plan_random(name: str, sizes: tuple[int, ...]) -> Plan | None:
    if name.startswith("void execute_dist<"):
        targs = args_of(name, "execute_dist")
        if not targs or len(targs) != 3 or split_params(name) != ["long"] * 4 or sizes != (8, 8, 8, 8):
            return None
        state, out = _state_size(targs[1]), sizeof(targs[2])
        if state is None or out is None:
            return None

        def dist(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
            states, n = i64(raw[1], 0), i64(raw[3], 0)
            if states < 1 or n < 0:
                return None
            dec = Decoded(VIA, regions={0: [(0, 8)], 2: [(0, 8)]})
            dec.read(0, 0, min(n, states) * state)
            dec.write(0, 0, min(n, states) * state)
            dec.write(2, 0, n * out)
            return dec

        return dist
    if name.startswith("void init_curand<"):
        targs = args_of(name, "init_curand")
        state = _state_size(targs[0]) if targs and len(targs) == 1 else None
        if state is None or split_params(name) != ["long", "unsigned long", "long"] or sizes != (8, 8, 8):
            return None

        def init(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
            dec = Decoded(VIA, regions={0: [(0, 8)]})
            dec.write(0, 0, max(0, i64(raw[2], 0)) * state)
            return dec

        return init
    return None


PLANNERS = (plan_elementwise, plan_random)
