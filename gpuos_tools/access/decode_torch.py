"""PyTorch's kernels: exact extents from their arguments. One module over 800 lines: every
decoder here shares the same name parsing and ATen conventions (functors, lambdas, element
types), and the TensorIterator kernels come first:

- ``vectorized_elementwise_kernel<vec, F, std::array<char*, K>>(int N, F, data)``: contiguous
  operands, N elements each; ``data[0]`` is the output (written), the rest inputs (read).
- ``elementwise_kernel<nt, vt, gpu_kernel_impl_nocast<F>(...)::{lambda(int)#1}>(int N, closure)``:
  the closure holds an ``OffsetCalculator<K, uint32_t>`` (sizes and byte strides per operand),
  then ``data[K]``, then F.
- ``unrolled_elementwise_kernel<F, std::array<char*, K>, vt, TrivialOffsetCalculator..., loader,
  storer>(int N, F, data, in_calc, out_calc, loader, storer)``: contiguous operands, N elements
  each; with casts, the loader and storer hold each operand's dtype and element size.
- ``reduce_kernel<nt, vec, ReduceOp<scalar_t, ops_t, unsigned int, out_scalar_t, ...>>(ReduceOp)``:
  ops, ident, a ReduceConfig, the input and output calculators, src, dst[2], acc_buf, cta_buf,
  semaphores.

Element sizes come from the functor's template arguments. A lambda's return type is not in its
name: its output is bounded by the largest PyTorch element (16 bytes, complex<double>), except
for the few functions known to return one of their parameters' types (``_SAME_TYPE``,
``_FIRST_TYPE``, ``_LAST_TYPE``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuos_tools.access.decoded import Decoded, Plan
from gpuos_tools.access.layouts import (
    args_of,
    base_name,
    calculator_size,
    i32,
    i64,
    lambda_params,
    last_offset,
    numel,
    offset_calculator,
    sizeof,
    u32,
    u64,
)
from gpuos_tools.access.proto import split_params

VIA = "pytorch"
#: The largest element of any PyTorch dtype (complex<double>): the bound on an output whose type
#: the kernel's name does not show.
MAX_ELEMENT = 16

# functor -> (positions of its template arguments: output, inputs; a type name where it is fixed)
_FUNCTORS: dict[str, tuple[int | str, tuple[int, ...]]] = {
    "at::native::CUDAFunctor_add": (0, (0, 0)),
    "at::native::CUDAFunctorOnSelf_add": (0, (0,)),
    "at::native::FillFunctor": (0, ()),
    "at::native::BinaryFunctor": (2, (0, 1)),
    "at::native::AUnaryFunctor": (2, (1,)),
    "at::native::BUnaryFunctor": (2, (0,)),
    # comparisons (CompareKernels.cu, CompareEQKernel.cu): two scalar_t in, bool out; they hold an enum
    "at::native::(anonymous namespace)::CompareFunctor": ("bool", (0, 0)),
    "at::native::(anonymous namespace)::CompareEqFunctor": ("bool", (0, 0)),
}


#: Functions whose GPU lambda returns its argument's type (they dispatch on one scalar_t and
#: compute in it): clamp, clamp_min and clamp_max (ReLU's forward is clamp_min); the plain copy
#: (``[] GPU_LAMBDA(scalar_t x) { return x; }`` for every dtype it dispatches without casting);
#: tanh (``[] GPU_LAMBDA(scalar_t a) -> scalar_t`` in its real and its complex branch).
_SAME_TYPE = ("at::native::(anonymous namespace)::launch_clamp_scalar(", "at::native::direct_copy_kernel_cuda(",
              "at::native::tanh_kernel_cuda(")
#: Functions whose GPU lambda returns its first parameter's type (ATen's source: GELU and its
#: gradient, tanh's gradient, pow with a scalar exponent, dropout's masked scale).
_FIRST_TYPE = ("at::native::GeluCUDAKernelImpl(", "at::native::GeluBackwardCUDAKernelImpl(",
               "at::native::tanh_backward_kernel_cuda(",
               "at::native::(anonymous namespace)::pow_tensor_scalar_kernel_impl<",
               "at::native::(anonymous namespace)::masked_scale_kernel<")


#: Functions whose GPU lambda returns its last parameter's type: where, ``(bool cond, scalar_t
#: self, scalar_t other) -> scalar_t``.
_LAST_TYPE = ("at::native::(anonymous namespace)::where_kernel_impl(",)


#: Functions whose GPU lambdas capture no pointer (ATen's source): a closure's bytes past its data
#: pointers hold only the functor's scalars.
_PLAIN_LAMBDAS = _SAME_TYPE + _FIRST_TYPE


#: The functors that wrap another (the operation of gpu_kernel_with_scalars): plain when it is.
_WRAPPERS = ("at::native::BinaryFunctor", "at::native::AUnaryFunctor", "at::native::BUnaryFunctor")


def plain(functor: str) -> bool:
    """Whether an elementwise functor type holds no pointer: the named functors hold scalars
    (an alpha, a fill value), ``binary_internal``'s operations nothing, and of lambdas only
    those of ``_PLAIN_LAMBDAS`` are known."""
    functor = functor.strip()
    if lambda_params(functor) is not None:
        return functor.startswith(_PLAIN_LAMBDAS)
    base = base_name(functor)
    if base.startswith("at::native::binary_internal::"):
        return True
    if base in _WRAPPERS:
        targs = args_of(functor, base)
        return bool(targs) and plain(targs[-1])
    return base in _FUNCTORS


def operands(functor: str) -> tuple[int, list[int]] | None:
    """(output element size, [input element sizes]) of an elementwise functor type, or None."""
    params = lambda_params(functor)
    if params is not None:
        ins = [sizeof(p) for p in params]
        if None in ins:
            return None
        same = len(set(params)) == 1 and functor.startswith(_SAME_TYPE) or functor.startswith(_FIRST_TYPE)
        if functor.startswith(_LAST_TYPE):
            return ins[-1], ins  # type: ignore[return-value]
        return (ins[0] if same else MAX_ELEMENT), ins  # type: ignore[return-value]
    base = base_name(functor)
    shape = _FUNCTORS.get(base)
    targs = args_of(functor, base)
    if shape is None or targs is None:
        return None
    out_at, in_at = shape
    if max((0, *in_at)) >= len(targs) or isinstance(out_at, int) and out_at >= len(targs):
        return None
    out = sizeof(out_at if isinstance(out_at, str) else targs[out_at])
    ins = [sizeof(targs[i]) for i in in_at]
    if out is None or None in ins:
        return None
    return out, ins  # type: ignore[return-value]


def _kernel_args(name: str, kernel: str) -> tuple[str, ...] | None:
    if not name.startswith(f"void {kernel}<"):
        return None
    return args_of(name, kernel)


# -- vectorized_elementwise_kernel ------------------------------------------------------------


def plan_vectorized(name: str, sizes: tuple[int, ...]) -> Plan | None:
    targs = _kernel_args(name, "at::native::vectorized_elementwise_kernel")
    if targs is None or len(targs) != 3 or len(sizes) != 3 or sizes[0] != 4:
        return None
    array = args_of(targs[2], "std::array")
    ops = operands(targs[1])
    if array is None or ops is None or array[0] != "char*":
        return None
    k = int(array[1].rstrip("ul") or 0)
    out, ins = ops
    if k != len(ins) + 1 or sizes[2] != 8 * k:
        return None
    elems = [out, *ins]
    regions = {2: [(0, 8 * k)]}
    if plain(targs[1]):
        regions[1] = [(0, sizes[1])]

    fill = base_name(targs[1]) == "at::native::FillFunctor"

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        dec = _contiguous(regions, i32(raw[0], 0), elems)
        if fill and not any(raw[1]) and i32(raw[0], 0) > 0:  # a fill of zeros (at::zeros)
            dec.zeroes = (2, 0, i32(raw[0], 0) * out)
        return dec

    return plan


def _contiguous(regions: dict[int, list[tuple[int, int]]], n: int, elems: list[int]) -> Decoded:
    """N contiguous elements per operand of ``data`` (parameter 2): ``data[0]`` written, the rest read."""
    dec = Decoded(VIA, regions={i: list(r) for i, r in regions.items()})
    for i, size in enumerate(elems):
        if i == 0:
            dec.write(2, 0, n * size)
        else:
            dec.read(2, 8 * i, n * size)
    return dec


# -- elementwise_kernel with an offset calculator ----------------------------------------------


def plan_legacy(name: str, sizes: tuple[int, ...]) -> Plan | None:
    targs = _kernel_args(name, "at::native::elementwise_kernel")
    if targs is None or len(targs) != 3 or len(sizes) != 2 or sizes[0] != 4:
        return None
    closure = targs[2]
    if not closure.startswith("at::native::gpu_kernel_impl_nocast<") or not closure.endswith("{lambda(int)#1}"):
        return None
    inner = args_of(closure, "at::native::gpu_kernel_impl_nocast")
    ops = operands(inner[0]) if inner and len(inner) == 1 else None
    if ops is None:
        return None
    out, ins = ops
    k = len(ins) + 1
    elems = [out, *ins]
    data_at = (calculator_size(k) + 7) & ~7
    if sizes[1] < data_at + 8 * k:
        return None
    # the closure is the calculator, the data pointers, then the functor (and padding, which
    # holds whatever the host's stack did): all of it is laid out when the functor holds no pointer
    laid = sizes[1] if plain(inner[0]) else data_at + 8 * k

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        n = i32(raw[0], 0)
        calc = offset_calculator(raw[1], 0, k)
        if calc is None or numel(calc[0]) != n:
            return None
        dims, strides = calc
        dec = Decoded(VIA, regions={1: [(0, laid)]})
        for i, size in enumerate(elems):
            extent = last_offset(dims, strides[i]) + size if n > 0 else 0
            if i == 0:
                dec.write(1, data_at, extent)
            else:
                dec.read(1, data_at + 8 * i, extent)
        return dec

    return plan


# -- unrolled_elementwise_kernel (contiguous operands, casts through the loader and storer) ----

_TRIVIAL = "TrivialOffsetCalculator<"
_ELEMENT_SIZES = (1, 2, 4, 8, 16)


def plan_unrolled(name: str, sizes: tuple[int, ...]) -> Plan | None:
    targs = _kernel_args(name, "at::native::unrolled_elementwise_kernel")
    if targs is None or len(targs) != 7 or len(sizes) != 7 or sizes[0] != 4:
        return None
    array = args_of(targs[1], "std::array")
    if array is None or array[0] != "char*" or not all(t.startswith(_TRIVIAL) for t in targs[3:5]):
        return None
    k = int(array[1].rstrip("ul") or 0)
    loader, storer = base_name(targs[5]), base_name(targs[6])
    if k < 1 or sizes[2] != 8 * k or sizes[3] != 1 or sizes[4] != 1:
        return None
    if (loader, storer) == ("at::native::memory::LoadWithCast", "at::native::memory::StoreWithCast"):
        # LoadWithCast<N>: N one-byte dtypes, then N uint32 element sizes (4-aligned)
        counts = [args_of(t, base_name(t)) for t in targs[5:7]]
        if not all(counts):
            return None
        n_in, n_out = (int(c[0]) for c in counts)  # type: ignore[index]
        in_at, out_at = (n_in + 3) & ~3, (n_out + 3) & ~3
        if n_in != k - 1 or n_out != 1 or sizes[5] != in_at + 4 * n_in or sizes[6] != out_at + 4:
            return None
        fixed = None
    elif (loader, storer) == ("at::native::memory::LoadWithoutCast", "at::native::memory::StoreWithoutCast"):
        ops = operands(targs[0])
        if ops is None or len(ops[1]) != k - 1:
            return None
        fixed = [ops[0], *ops[1]]
        in_at = out_at = 0
    else:
        return None
    regions = {2: [(0, 8 * k)], 5: [(0, sizes[5])], 6: [(0, sizes[6])]}
    if plain(targs[0]):
        regions[1] = [(0, sizes[1])]

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        n = i32(raw[0], 0)
        if n < 0:
            return None
        if fixed is None:
            elems = [i32(raw[6], out_at)] + [i32(raw[5], in_at + 4 * i) for i in range(k - 1)]
            if any(e not in _ELEMENT_SIZES for e in elems):
                return None
        else:
            elems = fixed
        return _contiguous(regions, n, elems)

    return plan


# -- reduce_kernel --------------------------------------------------------------------------

_CONFIG = 64  #: bytes of ReduceConfig: 14 ints, a bool, output_vec_size
_IN = calculator_size(1)
_OUT = calculator_size(2)


def plan_reduce(name: str, sizes: tuple[int, ...]) -> Plan | None:
    targs = _kernel_args(name, "at::native::reduce_kernel")
    if targs is None or len(targs) != 3 or len(sizes) != 1:
        return None
    op = args_of(targs[2], "at::native::ReduceOp")
    if op is None or len(op) < 4 or op[2] != "unsigned int":
        return None
    in_size, out_size = sizeof(op[0]), sizeof(op[3])
    if in_size is None or out_size is None:
        return None
    total = sizes[0]

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        b = raw[0]
        block = rec.get("block") or (0, 0, 0)
        # the config follows ops and ident: the first offset where every field checks out
        for c in range(0, 65, 4):
            # src, dst[2], acc_buf, cta_buf, semaphores, base_idx, then two bools and noutputs
            src = (c + _CONFIG + _IN + _OUT + 7) & ~7
            if src + 64 != total:
                continue
            num_inputs, num_outputs = i32(b, c + 4), i32(b, c + 8)
            if i32(b, c + 44) != block[0] or i32(b, c + 48) != block[1] or num_inputs < 1 or num_outputs < 1:
                continue
            incalc = offset_calculator(b, c + _CONFIG, 1)
            outcalc = offset_calculator(b, c + _CONFIG + _IN, 2)
            if incalc is None or outcalc is None:
                continue
            if numel(incalc[0]) != num_inputs or numel(outcalc[0]) != num_outputs:
                continue
            break
        else:
            return None
        if u64(b, src + 16) != 0 or i32(b, src + 60) != 1:
            return None  # a second output (values and indices): its element type is not in the name
        out_last = last_offset(outcalc[0], outcalc[1][0]) + out_size
        in_last = last_offset(outcalc[0], outcalc[1][1]) + last_offset(incalc[0], incalc[1][0]) + in_size
        dec = Decoded(VIA, regions={0: [(c, total)]})
        dec.read(0, src, in_last)
        dec.write(0, src + 8, out_last)
        if b[src + 56]:  # accumulate: the output is read and combined
            dec.read(0, src + 8, out_last)
        for buf in (src + 24, src + 32, src + 40):  # acc_buf, cta_buf, semaphores: sized elsewhere
            if u64(b, buf):
                dec.read(0, buf, None)
                dec.write(0, buf, None)
        return dec

    return plan




# -- kernels with plain scalar arguments -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Simple:
    """A kernel whose pointers' extents follow from its scalar arguments (and its grid). ``params``
    is its parameter list as demangled, ``{T}`` and ``{U}`` standing for its first and second
    template arguments: another version's signature does not match and is left alone. ``spans``
    maps the parameter values (integers; pointers as addresses), the sizes of T and U (None where
    not a type) and the grid to (param, "r" | "w" | "rw", bytes), or None when the launch is
    not one it knows the layout of."""

    kernel: str
    params: str
    spans: Callable[[list[int], tuple, tuple], list[tuple[int, str, int]] | None]


def _max_pool_forward(v: list[int], ts: tuple, g: tuple) -> list[tuple[int, str, int]]:
    t = ts[0]
    # (nthreads, bottom, channels, height, width, pooled_h, pooled_w, ..., top, mask): one
    # thread per output element; each reads a window of its own (n, c) input plane
    planes = -(-v[0] // max(1, v[5] * v[6]))
    return [(1, "r", planes * v[3] * v[4] * t), (15, "w", v[0] * t), (16, "w", v[0] * 8)]


def _max_pool_backward(v: list[int], ts: tuple, g: tuple) -> list[tuple[int, str, int]]:
    t = ts[0]
    # (top_diff, top_mask, num, channels, height, width, pooled_h, pooled_w, ..., bottom_diff)
    planes = v[2] * v[3]
    return [(0, "r", planes * v[6] * v[7] * t), (1, "r", planes * v[6] * v[7] * 8),
            (16, "w", planes * v[4] * v[5] * t)]


def _nll_forward(v: list[int], ts: tuple, g: tuple) -> list[tuple[int, str, int]]:
    t = ts[0]
    # (output, total_weight, input, target, weights, size_average, nframe, ndim, n_classes, ignore)
    return [(0, "w", t), (1, "w", t), (2, "r", v[6] * v[7] * t), (3, "r", v[6] * 8), (4, "r", v[8] * t)]


def _nll_backward(v: list[int], ts: tuple, g: tuple) -> list[tuple[int, str, int]]:
    t = ts[0]
    # (grad_input, grad_output, target, weights, total_weight, size_average, nframe, ndim, ...)
    return [(0, "w", v[6] * v[7] * t), (1, "r", t), (2, "r", v[6] * 8), (3, "r", v[8] * t), (4, "r", t)]


def _softmax_forward(v: list[int], ts: tuple, g: tuple) -> list[tuple[int, str, int]]:
    t = ts[0]
    # (dst, src, batch_size, stride, element_count, mask, ...): rows of `stride` elements
    rows = (v[2] - 1) * v[3] + v[4] if v[2] > 0 else 0
    return [(0, "w", rows * t), (1, "r", rows * t)]


def _softmax_backward(v: list[int], ts: tuple, g: tuple) -> list[tuple[int, str, int]]:
    t = ts[0]
    # (grad_input, grad, output, batch_size, stride, element_count, mask)
    rows = (v[3] - 1) * v[4] + v[5] if v[3] > 0 else 0
    return [(0, "w", rows * t), (1, "r", rows * t), (2, "r", rows * t)]


def _norm_rows(v: list[int], ts: tuple, g: tuple, m: int, n: int, layout) -> list[tuple[int, str, int]] | None:
    """Spans of a row-normalisation kernel: (param, "r" | "w", "MN" | "N" | "M") as M·N elements of
    T, N of T, or M of the accumulation type U; a null pointer (an output not asked for) is
    left out. Only a grid of one block row is the layout read."""
    t, acc = ts[0], ts[1] if len(ts) > 1 else None
    if acc is None or g[1:] != (1, 1):
        return None
    size = {"MN": m * n * t, "N": n * t, "M": m * acc}
    return [(p, how, size[kind]) for p, how, kind in layout if v[p]]


def _layer_norm(v: list[int], ts: tuple, g: tuple) -> list[tuple[int, str, int]] | None:
    # (N, eps, X, gamma, beta, mean, rstd, Y): one block per row, M = grid.x rows of N
    return _norm_rows(v, ts, g, g[0], v[0], ((2, "r", "MN"), (3, "r", "N"), (4, "r", "N"), (5, "w", "M"),
                                             (6, "w", "M"), (7, "w", "MN")))


def _layer_norm_grad_input(v: list[int], ts: tuple, g: tuple) -> list[tuple[int, str, int]] | None:
    # (dY, X, mean, rstd, gamma, dX, N): one block per row
    return _norm_rows(v, ts, g, g[0], v[6], ((0, "r", "MN"), (1, "r", "MN"), (2, "r", "M"), (3, "r", "M"),
                                             (4, "r", "N"), (5, "w", "MN")))


def _gamma_beta_backward(v: list[int], ts: tuple, g: tuple) -> list[tuple[int, str, int]] | None:
    # (M, N, dY, X, mean, rstd, dgamma, dbeta); with more than one block row it writes partial
    # sums elsewhere first: left to the range
    return _norm_rows(v, ts, g, v[0], v[1], ((2, "r", "MN"), (3, "r", "MN"), (4, "r", "M"), (5, "r", "M"),
                                             (6, "w", "N"), (7, "w", "N")))


_NS = "at::native::(anonymous namespace)::"
SIMPLE = (
    Simple(_NS + "max_pool_forward_nchw", "int, {T} const*, long, long, long, " + "int, " * 10 + "{T}*, long*",
           _max_pool_forward),
    Simple(_NS + "max_pool_backward_nchw", "{T} const*, long const*, " + "int, " * 14 + "{T}*", _max_pool_backward),
    Simple(_NS + "nll_loss_forward_reduce_cuda_kernel_2d",
           "{T}*, {T}*, {T} const*, long const*, {T} const*, bool, long, long, long, long", _nll_forward),
    Simple(_NS + "nll_loss_backward_reduce_cuda_kernel_2d",
           "{T}*, {T} const*, long const*, {T} const*, {T} const*, bool, int, int, long, long", _nll_backward),
    Simple("(anonymous namespace)::softmax_warp_forward", "{T}*, {T} const*, int, int, int, bool const*, int, bool",
           _softmax_forward),
    Simple("(anonymous namespace)::softmax_warp_backward", "{T}*, {T} const*, {T} const*, int, int, int, bool const*",
           _softmax_backward),
    Simple(_NS + "vectorized_layer_norm_kernel", "int, {U}, {T} const*, {T} const*, {T} const*, {U}*, {U}*, {T}*",
           _layer_norm),
    Simple(_NS + "layer_norm_grad_input_kernel_vectorized",
           "{T} const*, {T} const*, {U} const*, {U} const*, {T} const*, {T}*, int", _layer_norm_grad_input),
    Simple(_NS + "GammaBetaBackwardCUDAKernelTemplate",
           "long, long, {T} const*, {T} const*, {U} const*, {U} const*, {T}*, {T}*", _gamma_beta_backward),
)  # fmt: skip


def plan_simple(name: str, sizes: tuple[int, ...]) -> Plan | None:
    for spec in SIMPLE:
        if not name.startswith(f"void {spec.kernel}<"):
            continue
        targs = args_of(name, spec.kernel) or ()
        ts = tuple(sizeof(a) for a in targs)
        params = split_params(name)
        expected = spec.params.replace("{T}", targs[0] if targs else "?")
        expected = [p.strip() for p in expected.replace("{U}", targs[1] if len(targs) > 1 else "?").split(",")]
        if not ts or ts[0] is None or params != expected or len(sizes) != len(expected):
            return None
        return _simple_plan(spec, ts, sizes)
    return None


def _simple_plan(spec: Simple, ts: tuple, sizes: tuple[int, ...]) -> Plan:
    pointers = [i for i, p in enumerate(spec.params.split(",")) if p.strip().endswith("*")]

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        values = [int.from_bytes(r, "little", signed=True) for r in raw]
        spans = spec.spans(values, ts, tuple(rec.get("grid") or (0, 0, 0)))
        if spans is None:
            return None
        dec = Decoded(VIA, regions={i: [(0, 8)] for i in pointers})
        for param, how, size in spans:
            if size < 0:
                return None
            if "r" in how:
                dec.read(param, 0, size)
            if "w" in how:
                dec.write(param, 0, size)
        return dec

    return plan


# -- distribution_elementwise_grid_stride_kernel (random fills) ---------------------------------
# (numel, PhiloxCudaState, dist_func, store): the one-dimensional store, lambda #1 of
# distribution_nullary_kernel<scalar_t, ...>, captures the output pointer and its byte stride.

_DIST = "at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel"
_NULLARY = "at::native::(anonymous namespace)::distribution_nullary_kernel"


def plan_distribution(name: str, sizes: tuple[int, ...]) -> Plan | None:
    targs = _kernel_args(name, _DIST)
    if targs is None or len(targs) != 4 or len(sizes) != 4 or sizes[0] != 8 or sizes[3] < 12:
        return None
    store = targs[3]
    nullary = args_of(store, _NULLARY)
    params = lambda_params(store)
    if not store.startswith(_NULLARY + "<") or nullary is None or params is None or len(params) != 2:
        return None
    if not store.endswith("{lambda(" + ", ".join(params) + ")#1}") or params[0] != "int":
        return None  # #2 is the strided store, through an offset calculator
    elem = sizeof(nullary[0])
    if elem is None:
        return None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        n, stride = i64(raw[0], 0), i32(raw[3], 8)
        if n < 0:
            return None
        dec = Decoded(VIA, regions={3: [(0, 12)]})
        if n > 0:
            lo, hi = min(0, (n - 1) * stride), max(0, (n - 1) * stride) + elem
            dec.spans[(3, 0)] = (None, (lo, hi))
        return dec

    return plan


# -- multi_tensor_apply_kernel (the foreach ops of optimizers) ---------------------------------
# TensorListMetadata<n>: addresses[n][max tensors], numel_for_tensor[max tensors],
# block_to_tensor[320] (bytes), block_to_chunk[320], start_tensor_this_launch;
# TensorListScalarListMetadata<T, n> has scalar_vals[max tensors] after the counts and no start.
# Block b works on tensor block_to_tensor[b]. The foreach functors
# (Unary|Binary|Pointwise|Ternary)Op*Functor and ZeroFunctor <T, depth, r_args_depth,
# res_arg_index> read lists 0 .. r_args_depth - 1 and write list res_arg_index.

_NSA = "at::native::(anonymous namespace)::"
_MAX_TENSORS = (110, 64, 48, 36, 30)
_MAX_TENSORS_SCALARLIST = (96, 64, 48, 36, 30)
_MAX_BLOCKS = 320
_FOREACH = re.compile(r"^at::native::\(anonymous namespace\)::(?:(?:Unary|Binary|Pointwise|Ternary)Op\w*|Zero)Functor<")


def _block_tables(to_tensor: int, start_field: bool) -> tuple[int, int]:
    """Where block_to_chunk starts after block_to_tensor, and where the metadata ends (after
    start_tensor_this_launch, where the structure has it)."""
    to_chunk = (to_tensor + _MAX_BLOCKS + 3) & ~3
    return to_chunk, to_chunk + 4 * _MAX_BLOCKS + (4 if start_field else 0)


def _blocks(rec: dict[str, Any]) -> int | None:
    """The launch's blocks, when the metadata can describe that many."""
    blocks = (rec.get("grid") or (0,))[0]
    return blocks if 1 <= blocks <= _MAX_BLOCKS else None


def plan_foreach(name: str, sizes: tuple[int, ...]) -> Plan | None:
    targs = _kernel_args(name, _NSA + "multi_tensor_apply_kernel")
    if targs is None or len(targs) < 2 or not sizes:
        return None
    meta, functor = targs[0], targs[1]
    plain, scalars = args_of(meta, _NSA + "TensorListMetadata"), args_of(meta, _NSA + "TensorListScalarListMetadata")
    if plain is not None and meta.startswith(_NSA + "TensorListMetadata<") and len(plain) == 1:
        depth, scalar, limits = int(plain[0]), 0, _MAX_TENSORS
    elif scalars is not None and meta.startswith(_NSA + "TensorListScalarListMetadata<") and len(scalars) == 2:
        depth, scalar, limits = int(scalars[1]), sizeof(scalars[0]) or -1, _MAX_TENSORS_SCALARLIST
    else:
        return None
    if not 1 <= depth <= 5 or scalar < 0:
        return None
    max_t = limits[depth - 1]
    fargs = args_of(functor, base_name(functor)) if _FOREACH.match(functor) else None
    if fargs is None or len(fargs) != 4 or int(fargs[1]) != depth:
        return None
    elem, r_depth, res = sizeof(fargs[0]), int(fargs[2]), int(fargs[3])
    if elem is None or not 0 <= r_depth <= depth or not 0 <= res < depth:
        return None
    numels = 8 * depth * max_t
    to_tensor = numels + 8 * max_t + scalar * max_t
    _, end = _block_tables(to_tensor, limits is _MAX_TENSORS)
    if sizes[0] != (end + 7) & ~7:
        return None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        b = raw[0]
        blocks = _blocks(rec)
        if blocks is None:
            return None
        tensors = set(b[to_tensor : to_tensor + blocks])
        dec = Decoded(VIA, regions={0: [(0, end)]})
        for t in tensors:
            n = i64(b, numels + 8 * t) if t < max_t else -1
            if n < 0:
                return None
            for d in range(depth):
                if d < r_depth:
                    dec.read(0, 8 * (d * max_t + t), n * elem)
                if d == res:
                    dec.write(0, 8 * (d * max_t + t), n * elem)
        return dec

    return plan


_GATHER = "at::native::vectorized_gather_kernel"
_GATHER_PARAMS = ["char*", "char*", "{I}*", "int", "long", "long", "long", "long", "bool"]


def plan_gather(name: str, sizes: tuple[int, ...]) -> Plan | None:
    """``vectorized_gather_kernel<alignment, index_t>(out, inp, idx, num_ind, slice_size,
    ind_dim_size, inp_stride, out_stride, allow_neg)`` (index_select, embedding lookups): one
    block per index copies a slice of ``slice_size`` bytes from row ``idx[i]`` of ``inp`` to row
    i of ``out``, strides in bytes. Which rows it reads is in device memory: the whole table is
    read."""
    targs = _kernel_args(name, _GATHER)
    index = sizeof(targs[1]) if targs and len(targs) == 2 else None
    if index is None or split_params(name) != [p.replace("{I}", targs[1]) for p in _GATHER_PARAMS] or len(sizes) != 9:
        return None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        n, size, rows = i32(raw[3], 0), i64(raw[4], 0), i64(raw[5], 0)
        in_stride, out_stride = i64(raw[6], 0), i64(raw[7], 0)
        grid = rec.get("grid") or (0, 0, 0)
        if min(n, size, rows) < 1 or min(in_stride, out_stride) < size or grid[0] != n:
            return None
        dec = Decoded(VIA, regions={i: [(0, 8)] for i in range(3)})
        dec.write(0, 0, (n - 1) * out_stride + size)
        dec.read(1, 0, (rows - 1) * in_stride + size)
        dec.read(2, 0, n * index)
        return dec

    return plan


_WITH_INDEX = "(anonymous namespace)::elementwise_kernel_with_index"
#: arange_cuda_out dispatches on AT_DISPATCH_ALL_TYPES_AND2(Half, BFloat16): no complex, so its
#: element is at most 8 bytes (double, int64)
_ARANGE_ELEMENT = 8


def plan_with_index(name: str, sizes: tuple[int, ...]) -> Plan | None:
    """``elementwise_kernel_with_index<index_t, F>(N, f, result_type* data)`` (arange, linspace):
    data[i] = f(i) for i < N. The result type is not in the name: bounded by the largest
    element of the dtypes the caller dispatches on (arange: all but complex, at most 8 bytes;
    otherwise, as linspace and logspace take complex, the largest PyTorch element)."""
    targs = _kernel_args(name, _WITH_INDEX)
    params = split_params(name)
    if (targs is None or len(targs) != 2 or targs[0] not in ("int", "long") or len(params) != 3
            or not params[2].endswith("::result_type*") or len(sizes) != 3 or sizes[2] != 8):
        return None
    index = sizeof(targs[0])
    if sizes[0] != index:
        return None
    largest = _ARANGE_ELEMENT if targs[1].startswith("at::native::arange_cuda_out(") else MAX_ELEMENT

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        n = int.from_bytes(raw[0], "little", signed=True)
        if n < 0:
            return None
        dec = Decoded(VIA, regions={2: [(0, 8)]})
        dec.write(2, 0, n * largest)
        return dec

    return plan


_DROPOUT = _NSA + "fused_dropout_kernel_vec"
_TENSOR_INFO = 8 + 4 * 25 + 4 * 25 + 4  #: TensorInfo<T, unsigned int>: data, sizes[25], strides[25], dims


def plan_dropout(name: str, sizes: tuple[int, ...]) -> Plan | None:
    """``fused_dropout_kernel_vec<T, acc, unsigned int, 1, vec, mask_t>(TensorInfo a,
    TensorInfo b, TensorInfo mask, total, p, philox)``: with ADims 1 every tensor is one
    contiguous dimension of ``total`` elements (checked in each TensorInfo); a is read, b and
    the mask written. Other ADims index through the TensorInfo's strides: not decoded."""
    targs = _kernel_args(name, _DROPOUT)
    if targs is None or len(targs) != 6 or targs[2] != "unsigned int" or targs[3] != "1":
        return None
    elems = (sizeof(targs[0]), sizeof(targs[0]), sizeof(targs[5]))
    if None in elems or len(sizes) != 6 or sizes[:3] != ((_TENSOR_INFO + 7) & ~7,) * 3 or sizes[3] != 4:
        return None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        total = int.from_bytes(raw[3][:4], "little")
        for info in raw[:3]:  # one dimension of `total` elements, stride 1
            if i32(info, 208) != 1 or int.from_bytes(info[8:12], "little") != total or i32(info, 108) != 1:
                return None
        dec = Decoded(VIA, regions={i: [(0, 8)] for i in range(3)})
        dec.read(0, 0, total * elems[0])
        dec.write(1, 0, total * elems[1])
        dec.write(2, 0, total * elems[2])
        return dec

    return plan


_CHUNK_ELEMENTS = 65536  #: multi_tensor_apply's kChunkSize: the elements one block works on
_FUSED_ADAM = _NSA + "FusedAdamMathFunctor"


def plan_fused_adam(name: str, sizes: tuple[int, ...]) -> Plan | None:
    """The fused Adam and AdamW step: ``multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<n>,
    FusedAdamMathFunctor<T, n, mode, amsgrad>, ...>``. The metadata holds addresses[n][max
    tensors] (params, grads, exp_avg, exp_avg_sq, and max_exp_avg_sq with amsgrad), the element
    counts, one step-count tensor address per tensor, then which tensor and chunk each block
    works on. Every tensor a block of the launch works on is read whole; each list but the
    gradients is written; its step count (one float) is read."""
    targs = _kernel_args(name, _NSA + "multi_tensor_apply_kernel")
    if targs is None or len(targs) < 2 or not sizes:
        return None
    meta = args_of(targs[0], _NSA + "FusedOptimizerTensorListMetadata")
    fargs = args_of(targs[1], _FUSED_ADAM) if targs[1].startswith(_FUSED_ADAM + "<") else None
    if meta is None or fargs is None or len(meta) != 1 or len(fargs) != 4:
        return None
    depth, elem = int(meta[0]), sizeof(fargs[0])
    if depth not in (4, 5) or int(fargs[1]) != depth or elem is None:
        return None
    max_t, max_s = _MAX_TENSORS[depth - 1], _MAX_TENSORS_SCALARLIST[depth - 1]
    numels = 8 * depth * max_t
    steps = numels + 8 * max_t
    to_tensor = steps + 8 * max_s
    to_chunk, end = _block_tables(to_tensor, True)
    if sizes[0] != (end + 7) & ~7:
        return None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        b = raw[0]
        blocks = _blocks(rec)
        if blocks is None:
            return None
        dec = Decoded(VIA, regions={0: [(0, end)]})
        done = set()
        for blk in range(blocks):
            t, chunk = b[to_tensor + blk], i32(b, to_chunk + 4 * blk)
            n = i64(b, numels + 8 * t) if t < max_t else -1
            if n < 1 or not 0 <= chunk * _CHUNK_ELEMENTS < n:
                return None  # not the layout read
            if t in done:
                continue
            done.add(t)
            for d in range(depth):
                dec.read(0, 8 * (d * max_t + t), n * elem)
                if d != 1:  # the gradients are only read
                    dec.write(0, 8 * (d * max_t + t), n * elem)
            dec.read(0, steps + 8 * t, 4)
        return dec

    return plan


# -- cat: CatArrayBatchedCopy (Shape.cu) -------------------------------------------------------
# CatArrayBatchedCopy<T, unsigned int, Dims, n, stride_size>(T* output,
# CatArrInputTensorMetadata<T, unsigned int, n, stride_size>, TensorSizeStride<unsigned int, 4>
# os, int concatDim, unsigned int dimStride). The metadata: input[n], offset[n], dimSize[n],
# nElements[n], isContiguous[n], then stride_size TensorSizeStride (sizes[4], strides[4]). Block
# row y copies input y's nElements elements, read contiguously or through its own sizes and
# strides, to output + offset * dimStride + the element's offset in os (its size along
# concatDim being dimSize). Rows past the grid's are the host's uninitialised stack.

_CAT = "at::native::(anonymous namespace)::CatArrayBatchedCopy"
_OPAQUE = re.compile(r"^at::native::\(anonymous namespace\)::OpaqueType<(\d+)u>$")
_CAT_DIMS = 4  #: CAT_ARRAY_MAX_INPUT_DIMS


def _strided_extent(sizes: list[int], strides: list[int]) -> int:
    """Elements from the first to one past the last of a strided tensor (sizes all positive)."""
    return sum((n - 1) * st for n, st in zip(sizes, strides)) + 1


def plan_cat(name: str, sizes: tuple[int, ...]) -> Plan | None:
    targs = _kernel_args(name, _CAT)
    if targs is None or len(targs) != 5 or targs[1] != "unsigned int" or len(sizes) != 5:
        return None
    opaque = _OPAQUE.match(targs[0])
    elem = int(opaque.group(1)) if opaque else sizeof(targs[0])
    try:
        dims, n, stride_size = int(targs[2]), int(targs[3]), int(targs[4])
    except ValueError:
        return None
    meta = f"at::native::(anonymous namespace)::CatArrInputTensorMetadata<{targs[0]}, unsigned int, {n}, {stride_size}>"
    expected = [f"{targs[0]}*", meta, f"at::native::(anonymous namespace)::TensorSizeStride<unsigned int, {_CAT_DIMS}u>",
                "int", "unsigned int"]
    strides_at = (21 * n + 3) & ~3
    total = (strides_at + 32 * stride_size + 7) & ~7
    if not elem or not 1 <= dims <= _CAT_DIMS or min(n, stride_size) < 1 or split_params(name) != expected:
        return None
    if sizes != (8, total, 32, 4, 4):
        return None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        b, os_ = raw[1], raw[2]
        concat, dim_stride = i32(raw[3], 0), u32(raw[4], 0)
        out_sizes = [u32(os_, 4 * i) for i in range(dims)]
        out_strides = [u32(os_, 16 + 4 * i) for i in range(dims)]
        rows = (rec.get("grid") or (0, 0))[1]
        if not 0 <= concat < dims or not 1 <= rows <= n or min(out_sizes) < 1:
            return None
        dec = Decoded(VIA, regions={0: [(0, 8)], 1: [(0, total)]})
        for y in range(rows):
            offset, dim, count = u32(b, 8 * n + 4 * y), u32(b, 12 * n + 4 * y), u32(b, 16 * n + 4 * y)
            contiguous = b[20 * n + y]
            if count == 0:  # the block returns at once: its pointer is not used
                dec.read(1, 8 * y, 0)
                continue
            shape = [dim if i == concat else out_sizes[i] for i in range(dims)]
            if contiguous > 1 or numel(shape) != count or offset + dim > out_sizes[concat]:
                return None
            if contiguous:
                read = count
            else:
                at = strides_at + 32 * (y if stride_size > 1 else 0)
                in_sizes = [u32(b, at + 4 * i) for i in range(dims)]
                if [s for i, s in enumerate(in_sizes) if i != concat] != [s for i, s in enumerate(shape) if i != concat]:
                    return None
                read = _strided_extent(shape, [u32(b, at + 16 + 4 * i) for i in range(dims)])
            start = offset * dim_stride
            written = _strided_extent(shape, out_strides)
            if start + written > 1 << 32 or read > 1 << 32:
                return None  # unsigned int index arithmetic would wrap
            dec.read(1, 8 * y, read * elem)
            dec.write(0, 0, written * elem, start * elem)
        return dec

    return plan


_EMBEDDING_BACKWARD = _NSA + "embedding_backward_feature_kernel"


def plan_embedding_backward(name: str, sizes: tuple[int, ...]) -> Plan | None:
    """``embedding_backward_feature_kernel<scalar_t, accscalar_t, index_t>(indices, grad,
    grad_weight, int n, long stride, int padding_idx)`` (Embedding.cu: blocks of 32 x 32
    threads, one column of 32 features per block, shared memory of 1024 accumulators and 1024
    ints): reads the n indices and the n rows of ``stride`` elements of grad, and adds each
    row into row ``indices[i]`` of grad_weight. Which rows is in device memory, and the table's
    size is not an argument: grad_weight is read and written to the end of its allocation,
    unless the operation just before zeroed whole rows from it (its only caller,
    ``embedding_dense_backward_cuda``, launches it right after ``at::zeros({num_weights,
    stride})`` makes grad_weight; the indices are below num_weights, as the forward's lookup
    asserted), see ``Decoded.fresh``."""
    targs = _kernel_args(name, _EMBEDDING_BACKWARD)
    if targs is None or len(targs) != 3 or sizes != (8, 8, 8, 4, 8, 4):
        return None
    elem, acc, index = sizeof(targs[0]), sizeof(targs[1]), sizeof(targs[2])
    expected = [f"{targs[2]} const*", f"{targs[0]} const*", f"{targs[0]}*", "int", "long", "int"]
    if None in (elem, acc, index) or split_params(name) != expected:
        return None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        n, stride = i32(raw[3], 0), i64(raw[4], 0)
        grid, block = tuple(rec.get("grid") or ()), tuple(rec.get("block") or ())
        if min(n, stride) < 1 or stride >= 1 << 31 or block != (32, 32, 1) or grid != (-(-stride // 32), 1, 1):
            return None
        if rec.get("smem") != 1024 * (acc + 4):
            return None
        dec = Decoded(VIA, regions={i: [(0, 8)] for i in range(3)})
        dec.read(0, 0, n * index)
        dec.read(1, 0, n * stride * elem)
        dec.read(2, 0, None)
        dec.write(2, 0, None)
        dec.fresh[(2, 0)] = stride * elem
        return dec

    return plan


PLANNERS = (plan_cat, plan_vectorized, plan_legacy, plan_unrolled, plan_reduce, plan_simple, plan_distribution, plan_foreach,
            plan_fused_adam, plan_gather, plan_dropout, plan_with_index, plan_embedding_backward)
