"""cuBLAS and cuDNN kernels: extents from their parameter structures.

These layouts are NVIDIA's and undocumented; each was read off recorded launches of known
shapes (docs/access-prediction.md). A plan decodes only the pattern it was read from: every
field it relies on is checked against the others (problem sizes against leading dimensions and
strides, tensor descriptors against their element counts, the launch grid), and anything else
falls back to range. Pointers the decoder cannot bound (a split-K workspace, an epilogue buffer
it has not seen used) keep range's behaviour: read and write to the end of the allocation.
"""

from __future__ import annotations

import math
import re
import struct
from typing import Any

from gpuos_tools.access.decoded import Decoded, Plan
from gpuos_tools.access.layouts import args_of, i32, i64, numel, sizeof, u64
from gpuos_tools.access.proto import split_params

VIA = "nvidia"

_TYPE = re.compile(r"tf32|bf16|f16|f32|f64|e4m3|e5m2|s8|i8|s32|i32")
_TYPE_SIZES = {"tf32": 4, "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "e4m3": 1, "e5m2": 1, "s8": 1, "i8": 1,
               "s32": 4, "i32": 4}  # fmt: skip


def beta_is_zero(b: bytes, places: tuple[int, ...], unset: tuple[tuple[int, int], ...]) -> bool:
    """Whether the epilogue's scalars read as (alpha, beta) float pairs at ``places``, the same
    finite non-zero alpha in each and beta's four bytes all zero, with the words in ``unset``
    (where the scalars' device pointers would go) zero: C is then not read. Only the pattern
    every recorded launch shows is trusted; anything else keeps C read."""
    if max(places) + 8 > len(b) or max(e for _, e in unset) > len(b):
        return False
    alpha = {b[o : o + 4] for o in places}
    if len(alpha) != 1:
        return False
    value = struct.unpack("<f", alpha.pop())[0]
    if value == 0 or not math.isfinite(value):
        return False
    return all(b[o + 4 : o + 8] == b"\0" * 4 for o in places) and not any(any(b[s:e]) for s, e in unset)


# -- cuBLAS: sm*_xmma_gemm_* (one 736-byte parameter) ------------------------------------------
# A at 0, B at 8, C at 16, an epilogue vector (bias) at 24, D at 48; the problem at 156 (n, m,
# k as cuBLAS names them: D is n x m here), leading dimensions at 168..192, each operand's
# (row stride, column stride, batch stride) as int64 at 208 + 24 i; batched at 612, the batch
# count at 616, 1 at 620 (0 for pointer-array batches, whose A/B/C point to pointer arrays);
# split-K workspace pointers at 376, 392, 400 (`carved`, `_serial_split_k`). Two copies of the
# (alpha, beta) float pair at 472 and 528, the words after each zero (`beta_is_zero`); no
# recorded launch had beta other than zero, so its place is inferred from alpha's and C is
# written only when it matches.

_GEMM_SCALARS = ((472, 528), ((476, 512), (532, 552)))

_GEMM = re.compile(r"^sm\d+_xmma_gemm_([a-z0-9]+?)_([a-z0-9]+?)_[a-z0-9]+_[nt][nt]_[nt]_")


def plan_xmma_gemm(name: str, sizes: tuple[int, ...]) -> Plan | None:
    m = _GEMM.match(name)
    if m is None or sizes != (736,) or not name.endswith("_cublas"):
        return None
    ab, cd = _TYPE.findall(m.group(1)), _TYPE.findall(m.group(2))
    if len(ab) != 2 or len(cd) != 2:
        return None
    elem = [_TYPE_SIZES[ab[0]], _TYPE_SIZES[ab[1]], _TYPE_SIZES[cd[0]], _TYPE_SIZES[cd[1]]]
    step = "reduce" if "_execute_split_k_kernel_" in name else "gemm" if "_execute_kernel_" in name else None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        b = raw[0]
        n, mm, k = i32(b, 156), i32(b, 160), i32(b, 164)
        batched, batch, single = i32(b, 612), i32(b, 616), i32(b, 620)
        if min(n, mm, k, batch) < 1 or batched not in (0, 1) or single != 1 or (not batched and batch != 1):
            return None
        dims = ((n, k), (k, mm), (n, mm), (n, mm))  # A, B, C, D
        extents = []
        for i, (rows, cols) in enumerate(dims):
            s0, s1, bs = i64(b, 208 + 24 * i), i64(b, 216 + 24 * i), i64(b, 224 + 24 * i)
            if min(s0, s1, bs) < 0 or i32(b, 168 + 8 * i) not in (s0, s1) or (batched and batch > 1 and not bs):
                return None
            extents.append(((rows - 1) * s0 + (cols - 1) * s1 + (batch - 1) * bs + 1) * elem[i])
        dec = Decoded(VIA, regions={0: [(0, 56)]})
        c_read = not beta_is_zero(b, *_GEMM_SCALARS)
        dec.known(0, 368, 408)
        workspace = ((376, 392, 400), [i64(b, 368) * i32(b, 356), i32(b, 384), i32(b, 388)])
        serial = _serial_split_k(b, rec, step, n * mm * elem[3], workspace)
        if serial == "gemm":  # k slices of partial products into the workspace, D untouched
            dec.read(0, 0, extents[0])
            dec.read(0, 8, extents[1])
            dec.write(0, 376, workspace[1][0])
        elif serial == "reduce":  # the slices summed into D
            dec.read(0, 376, workspace[1][0])
            dec.write(0, 48, extents[3])
        else:
            dec.read(0, 0, extents[0])
            dec.read(0, 8, extents[1])
            dec.write(0, 48, extents[3])
            carved(dec, b, *workspace)  # any step may use the split-K workspace
        if c_read:
            dec.read(0, 16, extents[2])  # C
        if u64(b, 24):  # a bias vector along either side of D
            dec.read(0, 24, max(n, mm) * max(elem[2:]))
        for off in (32, 40):  # never seen set: its role unknown
            if u64(b, off):
                dec.read(0, off, None)
                dec.write(0, off, None)
        return dec

    return plan


def _serial_split_k(b: bytes, rec: dict[str, Any], step: str | None, slice_bytes: int,
                    workspace: tuple[tuple[int, ...], list[int]]) -> str | None:
    """The step of a serial split-K GEMM, or None where the launch is not one as recorded.

    cuBLAS splits k into S slices (S at 352 and 356, 2 at 360): ``execute_kernel`` on a grid
    S deep writes each slice's n x m partial product (the slice stride at 368) into the
    workspace's first region and nothing else; ``execute_split_k_kernel``, on a grid one deep,
    reads them and writes D. A, B and the workspace's counters are left alone by the step that
    does not name them."""
    slices, grid = i32(b, 356), rec.get("grid") or (0, 0, 0)
    if step is None or slices < 2 or i32(b, 352) != slices or i32(b, 360) != 2 or i64(b, 368) != slice_bytes:
        return None
    pointers, sizes = workspace
    ws = [u64(b, off) for off in pointers]
    if not all(ws) or any(ws[i + 1] != ws[i] + sizes[i] for i in range(len(ws) - 1)):
        return None
    if len(grid) != 3 or grid[2] != (slices if step == "gemm" else 1):
        return None
    return step


def carved(dec: Decoded, b: bytes, pointers: tuple[int, ...], sizes: list[int], partials_read: bool = True) -> None:
    """A library workspace in consecutive regions (split-K partial results, then counters):
    ``pointers`` are where the regions' addresses are, ``sizes`` the sizes the parameters give.
    Bounded only when each region starts exactly where the one before ends (the sizes are then
    what the library carved); otherwise each pointer is read and written to the end. Every size
    zero and one address for all (cuBLAS's GEMMs without split-K): nothing is carved, nothing
    touched.
    ``partials_read`` False: the kernel reads a partial result only after writing it itself (its
    last slice sums them), so the first region's earlier contents are not read."""
    ws = [u64(b, off) for off in pointers]
    if not any(ws):
        return
    if not any(sizes) and len(set(ws)) == 1:
        for off in pointers:  # a workspace handed over with nothing carved from it: not touched
            dec.read(0, off, 0)
        return
    ok = all(ws) and min(sizes) > 0 and all(ws[i + 1] == ws[i] + sizes[i] for i in range(len(ws) - 1))
    for i, (off, ptr, size) in enumerate(zip(pointers, ws, sizes)):
        if ptr:
            if i or partials_read or not ok:
                dec.read(0, off, size if ok else None)
            dec.write(0, off, size if ok else None)


# -- cuDNN: cudnnTensorStruct (104 bytes) ------------------------------------------------------
# data type at 0, nbDims at 8, the element count at 16 and 24, dims[8] at 32, strides[8] at 64.

_CUDNN_TYPES = {0: 4, 1: 8, 2: 2, 9: 2}  # float, double, half, bfloat16
TENSOR = 104


def tensor(b: bytes, off: int, elem: int) -> tuple[int, list[int]] | None:
    """(bytes spanned, dims) of the cudnnTensorStruct at ``off``, or None when it is not one or
    its element type is not ``elem`` bytes wide."""
    if off + TENSOR > len(b) or _CUDNN_TYPES.get(i32(b, off)) != elem:
        return None
    nb = i32(b, off + 8)
    if not 1 <= nb <= 8:
        return None
    dims = [i32(b, off + 32 + 4 * d) for d in range(nb)]
    strides = [i32(b, off + 64 + 4 * d) for d in range(nb)]
    if min(dims) < 1 or min(strides) < 0 or i64(b, off + 16) != numel(dims):
        return None
    return (sum((d - 1) * s for d, s in zip(dims, strides)) + 1) * elem, dims


def _bn_forward(dec: Decoded, xdesc: bytes, ydesc: bytes, ptr: list[tuple[int, int]], elem: int) -> bool:
    """Batch norm forward (training) on (xDesc, x, yDesc, y, scale, bias, f, f, running mean, running
    var, save mean, save inv var): ``ptr`` gives (param, offset) of x, y and the six vectors."""
    x = tensor(xdesc, 0, elem)
    y = tensor(ydesc, 0, elem)
    if x is None or y is None or len(x[1]) < 2 or x[1] != y[1]:
        return False
    c = x[1][1] * max(4, elem)  # per-channel vectors (1 x C x 1 x 1): float, or double for double
    dec.read(*ptr[0], x[0])
    dec.write(*ptr[1], y[0])
    for p in ptr[2:4]:
        dec.read(*p, c)
    for p in ptr[4:6]:  # running statistics: updated
        dec.read(*p, c)
        dec.write(*p, c)
    for p in ptr[6:8]:
        dec.write(*p, c)
    return True


_BN_FW = ("cudnnTensorStruct, {T} const*, cudnnTensorStruct, {T}*, {T} const*, {T} const*, {T}, {T}, {T}*, {T}*, "
          "{T}*, {T}*, {T}, {T}")
_BN_BW = ("{T}, {T}, {T}, {T}, cudnnTensorStruct, {T} const*, cudnnTensorStruct, {T} const*, cudnnTensorStruct, "
          "{T}*, {T} const*, {T}*, {T}*, {T} const*, {T} const*, {T}")


def _signature(name: str, kernel: str, params: str, sizes: tuple[int, ...], prefix: bool = False) -> int | None:
    """sizeof(T) when ``name`` is ``kernel<T, ...>`` with exactly these parameters (``prefix``:
    opening with them), one size recorded per parameter, else None."""
    if not name.startswith(f"void {kernel}<"):
        return None
    targs = args_of(name, kernel)
    t = targs[0] if targs else None
    if t is None or sizeof(t) is None:
        return None
    expected = [p.strip() for p in params.replace("{T}", t).split(",")]
    got = split_params(name)
    opens = got[: len(expected)] == expected if prefix else got == expected
    return sizeof(t) if opens and len(sizes) == len(got) else None


def plan_bn_forward(name: str, sizes: tuple[int, ...]) -> Plan | None:
    elem = _signature(name, "cudnn::bn_fw_tr_1C11_kernel_NCHW", _BN_FW, sizes)
    if elem is None:
        return None
    ptr = [(1, 0), (3, 0), (4, 0), (5, 0), (8, 0), (9, 0), (10, 0), (11, 0)]

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        dec = Decoded(VIA, regions={p: [(0, 8)] for p, _ in ptr} | {0: [(0, TENSOR)], 2: [(0, TENSOR)]})
        return dec if _bn_forward(dec, raw[0], raw[2], ptr, elem) else None

    return plan


def plan_bn_forward_args(name: str, sizes: tuple[int, ...]) -> Plan | None:
    # the same fields in one struct (x at 104, y at 216, the vectors at 224.. 272), then more
    if not name.startswith("void cudnn::bn_fw_tr_1C11_singleread<") or len(sizes) != 1 or sizes[0] < 280:
        return None
    targs = args_of(name, "cudnn::bn_fw_tr_1C11_singleread")
    elem = sizeof(targs[0]) if targs else None
    if elem is None or split_params(name) != [f"cudnn::bn_fw_tr_1C11_args<{targs[0]}>"]:
        return None
    ptr = [(0, 104), (0, 216), (0, 224), (0, 232), (0, 248), (0, 256), (0, 264), (0, 272)]

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        dec = Decoded(VIA, regions={0: [(0, 280)]})
        return dec if _bn_forward(dec, raw[0][:TENSOR], raw[0][112 : 112 + TENSOR], ptr, elem) else None

    return plan


def plan_bn_backward(name: str, sizes: tuple[int, ...]) -> Plan | None:
    elem = _signature(name, "cudnn::bn_bw_1C11_kernel_new", _BN_BW, sizes)
    if elem is None:
        return None
    pointers = (5, 7, 9, 10, 11, 12, 13, 14)

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        x, dy, dx = tensor(raw[4], 0, elem), tensor(raw[6], 0, elem), tensor(raw[8], 0, elem)
        if x is None or dy is None or dx is None or len(x[1]) < 2 or not x[1] == dy[1] == dx[1]:
            return None
        c = x[1][1] * max(4, elem)
        dec = Decoded(VIA, regions={p: [(0, 8)] for p in pointers} | {d: [(0, TENSOR)] for d in (4, 6, 8)})
        dec.read(5, 0, x[0])
        dec.read(7, 0, dy[0])
        dec.write(9, 0, dx[0])
        if raw[1] != b"\0" * len(raw[1]):  # beta of the data gradient: dx is accumulated into
            dec.read(9, 0, dx[0])
        dec.read(10, 0, c)  # scale
        for p in (11, 12):  # the scale and bias gradients
            dec.write(p, 0, c)
            if raw[3] != b"\0" * len(raw[3]):
                dec.read(p, 0, c)
        dec.read(13, 0, c)  # saved mean, saved inverse variance
        dec.read(14, 0, c)
        return dec

    return plan


# -- cuDNN: layout transforms between NCHW and NHWC ------------------------------------------
# nchw2nhwc_params_t: (n, c, c, n stride, hw, hw, c, n stride, c) for a packed tensor;
# nhwc2nchw_params_t: (n, c, c, c, n stride, n stride, 1, hw). Only that packed pattern is decoded.


def plan_layout_transform(name: str, sizes: tuple[int, ...]) -> Plan | None:
    for kernel, to_nhwc in (("cudnn::engines_precompiled::nchwToNhwcKernel", True),
                            ("cudnn::engines_precompiled::nhwcToNchwKernel", False)):  # fmt: skip
        if name.startswith(f"void {kernel}<"):
            break
    else:
        return None
    targs = args_of(name, kernel)
    params = split_params(name)
    if not targs or not params or len(params) != 3 or sizes[1:] != (8, 8) or sizes[0] < 36:
        return None
    elem = max(sizeof(targs[0]) or 0, sizeof(targs[1]) or 0)
    if not elem or params[1] != f"{targs[0]} const*" or params[2] != f"{targs[1]}*":
        return None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        f = [i32(raw[0], 4 * i) for i in range(9)]
        n, c = f[0], f[1]
        if to_nhwc:
            hw = f[4]
            ok = f[2] == f[6] == f[8] == c and f[5] == hw and f[3] == f[7] == c * hw
        else:
            hw = f[7]
            ok = f[2] == f[3] == c and f[4] == f[5] == c * hw and f[6] == 1
        grid = rec.get("grid") or (0, 0, 0)
        if not ok or min(n, c, hw) < 1 or grid[2] != n:
            return None
        size = n * c * hw * elem
        dec = Decoded(VIA, regions={1: [(0, 8)], 2: [(0, 8)]})
        dec.read(1, 0, size)
        dec.write(2, 0, size)
        return dec

    return plan


# -- cuDNN: implicit_convolve_sgemm ----------------------------------------------------------
# (N*P*Q, K, C*R*S, filter, filter ld, y, x, kernel_conv_params, ...): the params give x's
# (n, c, h, w) and strides at 0..28, k, r, s at 32..40, y's p, q at 56, 60 and strides at 64..76.

_CONV = "int, int, int, {T} const*, int, {T}*, {T} const*, kernel_conv_params"
# then (unsigned long long, int, float, float, ...): alpha and beta are the two floats, in
# cuDNN's order (alpha first), matched on the exact prototype recorded
_CONV_SCALARS = ["unsigned long long", "int", "float", "float"]


def plan_implicit_conv(name: str, sizes: tuple[int, ...]) -> Plan | None:
    elem = _signature(name, "implicit_convolve_sgemm", _CONV, sizes, prefix=True)
    if elem is None:
        return None
    params, n_conv = split_params(name), _CONV.count(",") + 1
    beta = n_conv + 3 if params[n_conv : n_conv + 4] == _CONV_SCALARS else None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        npq, kk, crs, ld = i32(raw[0], 0), i32(raw[1], 0), i32(raw[2], 0), i32(raw[4], 0)
        p = raw[7]
        n, c, h, w = (i32(p, o) for o in (0, 4, 8, 12))
        k, r, s, pp, q = i32(p, 32), i32(p, 36), i32(p, 40), i32(p, 56), i32(p, 60)
        xs = [i32(p, o) for o in (16, 20, 24, 28)]
        ys = [i32(p, o) for o in (64, 68, 72, 76)]
        if min(n, c, h, w, k, r, s, pp, q) < 1 or min(xs + ys) < 0:
            return None
        if npq != n * pp * q or kk != k or crs != c * r * s or ld < crs:
            return None
        x = sum((d - 1) * st for d, st in zip((n, c, h, w), xs)) + 1
        y = sum((d - 1) * st for d, st in zip((n, k, pp, q), ys)) + 1
        dec = Decoded(VIA, regions={3: [(0, 8)], 5: [(0, 8)], 6: [(0, 8)]})
        dec.read(3, 0, ((k - 1) * ld + crs) * elem)
        if beta is None or any(raw[beta]):  # y read unless beta is zero
            dec.read(5, 0, y * elem)
        dec.write(5, 0, y * elem)
        dec.read(6, 0, x * elem)
        return dec

    return plan


# wgrad_alg0_engine<T, ...>(C·R·S, K, P·Q, dy, dy's leading dimension, dw, x,
# kernel_grad_params, ...): the parameters open like kernel_conv_params ((n, c, h, w), x's
# strides, k, r, s). dw is K x C·R·S packed; the engine may accumulate into it, so it is read
# and written. dy's layout in the parameters was not pinned down: it keeps range.

_WGRAD0 = "int, int, int, {T} const*, int, {T}*, {T} const*, kernel_grad_params"


def plan_wgrad_alg0(name: str, sizes: tuple[int, ...]) -> Plan | None:
    elem = _signature(name, "wgrad_alg0_engine", _WGRAD0, sizes, prefix=True)
    if elem is None:
        return None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        crs, kk, pq, ld = i32(raw[0], 0), i32(raw[1], 0), i32(raw[2], 0), i32(raw[4], 0)
        p = raw[7]
        n, c, h, w = (i32(p, o) for o in (0, 4, 8, 12))
        k, r, s = i32(p, 32), i32(p, 36), i32(p, 40)
        xs = [i32(p, o) for o in (16, 20, 24, 28)]
        if min(n, c, h, w, k, r, s, pq) < 1 or min(xs) < 0 or kk != k or crs != c * r * s or ld < pq:
            return None
        x = sum((d - 1) * st for d, st in zip((n, c, h, w), xs)) + 1
        dec = Decoded(VIA, regions={3: [(0, 8)], 5: [(0, 8)], 6: [(0, 8)]})
        dec.read(3, 0, None)  # dy
        dec.read(5, 0, k * crs * elem)
        dec.write(5, 0, k * crs * elem)
        dec.read(6, 0, x * elem)
        return dec

    return plan


# -- cuDNN: sm*_xmma_{fprop,dgrad,wgrad}_implicit_gemm_* ----------------------------------------
# x-side tensor at 0 (fprop, wgrad: read) or written through C at 16 and D at 24 (dgrad), the
# filter at 8 (wgrad: dy at 8, the filter through C and D); the problem at 56: n, d, h, w, c,
# t, p, q, k, 1, r, s; five strides per activation at 208 (x) and 228 (y), in memory order
# (n, c, h, w, d) for nchw and (n, d, h, w, c) for nhwc. Filters are packed (k, c, r, s).
# The (alpha, beta) pair twice, at 128 and 500, as in the GEMMs (all three kinds show it).

_CONV_SCALARS_XMMA = ((128, 500), ((132, 176), (504, 544)))

_CONV_KIND = re.compile(r"^sm\d+_xmma_(fprop|dgrad|wgrad)_implicit_gemm_(?:indexed_wo_smem_)?([a-z0-9]+?)_"
                        r"([a-z0-9]+?)_[a-z0-9]+_(nchw|nhwc)(kcrs|krsc)_(nchw|nhwc)_")


def plan_xmma_conv(name: str, sizes: tuple[int, ...]) -> Plan | None:
    m = _CONV_KIND.match(name)
    if m is None or len(sizes) != 1 or sizes[0] < 320 or not name.endswith("_cudnn") or m.group(4) != m.group(6):
        return None
    kind, nhwc = m.group(1), m.group(4) == "nhwc"
    ab, cd = _TYPE.findall(m.group(2)), _TYPE.findall(m.group(3))
    if len(ab) != 2 or len(cd) != 2:
        return None
    elem = max(_TYPE_SIZES[t] for t in ab + cd)
    order = (0, 4, 2, 3, 1) if nhwc else (0, 1, 2, 3, 4)  # stride slot of (n, c, h, w, d)

    def extent(b: bytes, at: int, dims: tuple[int, ...]) -> int | None:
        strides = [i32(b, at + 4 * i) for i in range(5)]
        if min(strides) < 0 or strides[0] < 1:
            return None
        return (sum((d - 1) * strides[order[i]] for i, d in enumerate(dims)) + 1) * elem

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        b = raw[0]
        n, d, h, w, c, t, p, q, k, _, r, s_ = (i32(b, 56 + 4 * i) for i in range(12))
        if min(n, h, w, c, p, q, k, r, s_) < 1 or d != 1 or t != 1:
            return None
        x = extent(b, 208, (n, c, h, w, 1))
        y = extent(b, 228, (n, k, p, q, 1))
        if x is None or y is None:
            return None
        filt = k * c * r * s_ * elem
        src, other, out = {"fprop": (x, filt, y), "dgrad": (y, filt, x), "wgrad": (x, y, filt)}[kind]
        dec = Decoded(VIA, regions={0: [(0, 32)]})
        dec.read(0, 0, src)
        dec.read(0, 8, other)
        if not beta_is_zero(b, *_CONV_SCALARS_XMMA):
            dec.read(0, 16, out)  # C
        dec.write(0, 24, out)
        if kind == "wgrad" and len(b) >= 360:  # split-K slices (@308 of @320 bytes), then two regions
            dec.known(0, 308, 360)
            # the slices' partial products are written and then summed by the same launch
            carved(dec, b, (328, 344, 352), [i32(b, 308) * i64(b, 320), i32(b, 336), i32(b, 340)], False)
        return dec

    return plan


# -- cuDNN's CUTLASS convolutions: cutlass__5x_cudnn::Kernel<..._dgrad_..._nhwc_...>(Params) ---
# Params open with CUTLASS's Conv2dProblemSize (N, H, W, C, P, Q, K, R, S, pad, stride,
# dilation, mode, split_k_slices, groups), the grid's tile shape (m, n, k) at 72; A (dy), B (the
# filter), C and D (dx) at 184, 240, 312, 384, each after its iterator's parameters, A's packed
# NHWC strides at 112..120; the split-K semaphore at 448, used only when k > 1.

_CUTLASS_DGRAD = re.compile(r"^void cutlass__5x_cudnn::Kernel<cutlass_tensorop_s\d+dgrad_optimized_tf32_\w+_nhwc_\w+>\(")


def plan_cutlass_dgrad(name: str, sizes: tuple[int, ...]) -> Plan | None:
    if not _CUTLASS_DGRAD.match(name) or sizes != (464,):
        return None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        b = raw[0]
        n, h, w, c, p, q, k, r, s_, ph, pw, sh, sw, dh, dw, _, splits, groups = (i32(b, 4 * i) for i in range(18))
        if min(n, h, w, c, p, q, k, r, s_, sh, sw, dh, dw) < 1 or min(ph, pw) < 0 or splits != 1 or groups != 1:
            return None
        if p != (h + 2 * ph - dh * (r - 1) - 1) // sh + 1 or q != (w + 2 * pw - dw * (s_ - 1) - 1) // sw + 1:
            return None
        if (i32(b, 112), i32(b, 116), i32(b, 120)) != (k, q * k, p * q * k):
            return None  # dy is not a packed NHWC tensor
        grid = rec.get("grid") or (0, 0, 0)
        if (i32(b, 72), i32(b, 76)) != (grid[0], grid[1]):
            return None  # grid_tiled_shape is not where it was read
        dec = Decoded(VIA, regions={0: [(0, 80), (184, 192), (240, 248), (312, 320), (384, 456)]})
        if i32(b, 80) != 1 and u64(b, 448):  # the semaphore serialises split-K tiles only
            dec.read(0, 448, None)
            dec.write(0, 448, None)
        dec.read(0, 184, n * p * q * k * 4)
        dec.read(0, 240, k * r * s_ * c * 4)
        if i32(b, 396) or u64(b, 408):  # LinearCombination (alpha, beta, alpha_ptr, beta_ptr) at 392
            dec.read(0, 312, n * h * w * c * 4)  # beta is not zero: C is read
        dec.write(0, 384, n * h * w * c * 4)
        return dec

    return plan


# -- CUB device reductions -------------------------------------------------------------------
# DeviceReduceKernel(d_in, d_out, num_items, even_share, op, ...): block b writes d_out[b];
# DeviceReduceSingleTileKernel(d_in, d_out, num_items, op, init, ...): writes d_out[0];
# DeviceFixedSizeSegmentedReduceKernel(d_in, d_out, segment_size, num_segments, op, init).

_CUB = re.compile(r"^void cub::(?:CUB_\w+::)?(?:detail::reduce::)?(DeviceReduceKernel|DeviceReduceSingleTileKernel|"
                  r"DeviceFixedSizeSegmentedReduceKernel)<")


def plan_cub_reduce(name: str, sizes: tuple[int, ...]) -> Plan | None:
    m = _CUB.match(name)
    params = split_params(name) if m else None
    if m is None or not params or len(params) != len(sizes) or len(params) < 4:
        return None
    kind = m.group(1)
    ins, outs = params[0], params[1]
    elem_in = sizeof(ins[:-1]) if ins.endswith("*") else None
    elem_out = sizeof(outs[:-1]) if outs.endswith("*") else None
    counts = {"int": 4, "unsigned int": 4, "long": 8, "unsigned long": 8}
    if elem_in is None or elem_out is None or sizes[:2] != (8, 8) or counts.get(params[2]) != sizes[2]:
        return None
    if kind == "DeviceFixedSizeSegmentedReduceKernel" and counts.get(params[3]) != sizes[3]:
        return None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        count = int.from_bytes(raw[2], "little", signed=params[2] in ("int", "long"))
        if kind == "DeviceReduceKernel":
            n_in, n_out = count, (rec.get("grid") or (0,))[0]
        elif kind == "DeviceReduceSingleTileKernel":
            n_in, n_out = count, 1
        else:
            segments = int.from_bytes(raw[3], "little", signed=True)
            n_in, n_out = count * segments, segments
        if n_in < 0 or n_out < 1:
            return None
        dec = Decoded(VIA, regions={0: [(0, 8)], 1: [(0, 8)]})
        dec.read(0, 0, n_in * elem_in)
        dec.write(1, 0, n_out * elem_out)
        return dec

    return plan


# -- cuBLAS's split-K through CUTLASS: Kernel2 (partial products) and splitKreduce -------------
# cutlass::Kernel2<cutlass_80_simt_sgemm_TMxTN_TKxS_LL_align1>(Params) is CUTLASS's
# GemmUniversal: UniversalParamsBase (problem M, N, K at 0, the tile grid at 12, the swizzle's
# log at 24, the mode at 28 (1: split-K parallel), the batch count at 32, gemm_k_size at 36,
# D's batch stride in elements at 40, the semaphore at 48), the A and B tile iterators'
# parameters (stride in elements, inc_strided, inc_next, inc_advance in bytes: 4 int64 each) at
# 56 and 88, the C and D output iterators' (stride in bytes, ...: 8 int64 each) at 120 and 184,
# LinearCombination's (alpha, beta, ...) at 248, A, B, C, D at 280..304, the batch strides of A,
# B, C and the gather/scatter index pointers at 312..360. In split-K parallel mode slice z
# reads K range [z * gemm_k_size, ...) of A and B and writes its M x N partial product to D +
# z * batch stride. cuBLAS hands CUTLASS its column-major problem transposed: A, B and the
# partial products are row-major M x N views.
# splitKreduce_kernel(cublasSplitKParams<T>, workspace, C, D, D2, ...): m, n at 8, the
# workspace pitch at 16, C's and D's at 20..28, the slice stride at 36, the slices at 40, the
# epilogue at 56 (cublasLtEpilogue_t: 1 in every launch of the kernels whose name has no bias
# flag, 4, CUBLASLT_EPILOGUE_BIAS, in every launch of those that have it). With the bias
# epilogue the bias pointer comes twice, as the 7th pointer (``float const*``) and the 9th
# (``float*``): cuBLASLt's one bias pointer is an input under CUBLASLT_EPILOGUE_BIAS and an
# output (a bias gradient) only under the BGRAD epilogues (DRELU_BGRAD 152, DGELU_BGRAD 208,
# BGRADA 256, BGRADB 512), so under 4 both copies are m floats read; the launches validated
# with it (the GPT-2 block at two sizes, a torch.compile'd MLP) wrote only D.

_KERNEL2 = re.compile(r"^void cutlass::Kernel2<cutlass_80_simt_sgemm_(\d+)x(\d+)_(\d+)x\d+_[nt][nt]_align1>"
                      r"\(cutlass_80_simt_sgemm_\w+::Params\)$")


def _tile_operand(b: bytes, at: int, tile_k: int, rows: int, k: int) -> int | None:
    """Bytes a GEMM operand of ``rows`` x K floats spans, from its tile iterator's parameters at
    ``at`` (CUTLASS's PredicatedTileAccessIteratorParams: the stride in elements, then byte
    increments): K is the contiguous dimension when a k step advances ``tile_k`` elements
    (``inc_advance`` = tile_k * 4), the strided one when it advances ``tile_k`` strides. None when
    neither (or both) holds, or the stride cannot hold the contiguous dimension."""
    stride, inc_strided, advance = i64(b, at), i64(b, at + 8), i64(b, at + 24)
    if stride < 2 or inc_strided <= 0 or inc_strided % (stride * 4):
        return None
    if advance == tile_k * 4 and stride >= k:  # K contiguous: rows of K, `stride` apart
        return ((rows - 1) * stride + k) * 4
    if advance == tile_k * stride * 4 and stride >= rows:  # K strided: K rows of `rows`
        return ((k - 1) * stride + rows) * 4
    return None


#: LinearCombination's parameters as every recorded launch shows them when C is not read:
#: alpha (any finite non-zero float), beta 0.0, the float word 0x7fc00000, zeros to the pointers
_KERNEL2_NO_C = (bytes(4), bytes.fromhex("0000c07f") + bytes(20))


def plan_cutlass_split_k(name: str, sizes: tuple[int, ...]) -> Plan | None:
    m = _KERNEL2.match(name)
    if m is None or sizes != (360,):
        return None
    tile_m, tile_n, tile_k = (int(g) for g in m.groups())

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        b = raw[0]
        mm, n, k = i32(b, 0), i32(b, 4), i32(b, 8)
        tiled = (i32(b, 12), i32(b, 16), i32(b, 20))
        log, mode, k_size, stride = i32(b, 24), i32(b, 28), i32(b, 36), i64(b, 40)
        pitch = i64(b, 184)
        grid = tuple(rec.get("grid") or (0, 0, 0))
        if min(mm, n, k, k_size) < 1 or mode != 1 or not 0 <= log < 8 or u64(b, 48) or any(b[312:360]):
            return None
        slices = tiled[2]
        if tiled[:2] != (-(-mm // tile_m), -(-n // tile_n)) or k_size * (slices - 1) >= k or k_size * slices < k:
            return None  # the tiles do not cover the problem as CUTLASS splits it
        if grid != (tiled[0] << log, (tiled[1] + (1 << log) - 1) >> log, slices):
            return None  # not the identity swizzle's grid
        if pitch != i64(b, 216) or pitch < n * 4 or i64(b, 120) != i64(b, 152):
            return None
        if slices > 1 and stride < (mm - 1) * pitch // 4 + n:
            return None  # slices would overlap: not the layout read
        a = _tile_operand(b, 56, tile_k, mm, k)
        bb = _tile_operand(b, 88, tile_k, n, k)
        dec = Decoded(VIA, regions={0: [(0, 360)]})
        if a is None or bb is None:  # the operands keep range: read and written to the end
            for off in (280, 288):
                dec.read(0, off, None)
                dec.write(0, off, None)
        else:
            dec.read(0, 280, a)
            dec.read(0, 288, bb)
        alpha = struct.unpack("<f", b[248:252])[0]
        if not (math.isfinite(alpha) and alpha != 0 and (b[252:256], b[256:280]) == _KERNEL2_NO_C):
            dec.read(0, 296, None)  # C may be read: how far is not decoded
        dec.write(0, 304, (slices - 1) * stride * 4 + (mm - 1) * pitch + n * 4)
        return dec

    return plan


def plan_split_k_reduce(name: str, sizes: tuple[int, ...]) -> Plan | None:
    if not name.startswith("void cublasLt::splitKreduce_kernel<"):
        return None
    params = split_params(name)
    if not params or len(params) != len(sizes) or sizes[0] != 60 or params[0] != "cublasLt::cublasSplitKParams<float>":
        return None
    if params[1:5] != ["float const*", "float const*", "float*", "float*"]:
        return None
    others = [i for i in range(5, len(params)) if params[i].endswith("*") and sizes[i] == 8]
    targs = args_of(name, "cublasLt::splitKreduce_kernel")
    with_bias = bool(targs) and len(targs) == 15 and targs[12] == "true"  # the bias flag, as recorded

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        b = raw[0]
        mm, n, ws_pitch, stride, slices = i32(b, 8), i32(b, 12), i32(b, 16), i32(b, 36), i32(b, 40)
        pitch = max(i32(b, 20), i32(b, 24), i32(b, 28))
        if min(mm, n, slices) < 1 or min(ws_pitch, i32(b, 20), i32(b, 24), i32(b, 28)) < mm:
            return None
        if slices > 1 and stride < (n - 1) * ws_pitch + mm:
            return None
        out = ((n - 1) * pitch + mm) * 4
        dec = Decoded(VIA, regions={i: [(0, 8)] for i in range(1, 5)})
        dec.read(1, 0, ((slices - 1) * stride + (n - 1) * ws_pitch + mm) * 4)
        dec.read(2, 0, out)  # C, read when beta is not zero
        dec.write(3, 0, out)
        dec.write(4, 0, out)
        bias = _bias_epilogue(b, raw, others) if with_bias else None
        if bias is not None:  # the bias, m floats, read through both of its copies
            for i in bias:
                dec.read(i, 0, mm * 4)
        for i in others:  # other epilogue inputs and outputs: never seen set
            if u64(raw[i], 0) and (bias is None or i not in bias):
                dec.read(i, 0, None)
                dec.write(i, 0, None)
        return dec

    return plan


#: cublasLtEpilogue_t's CUBLASLT_EPILOGUE_BIAS: the bias is an input, m floats
_EPILOGUE_BIAS = 4


def _bias_epilogue(b: bytes, raw: list[bytes], others: list[int]) -> tuple[int, int] | None:
    """The two parameters holding the bias of a splitKreduce launch with the bias epilogue, as
    recorded: the epilogue word 4, the 7th and 9th pointers equal and not null, every other
    pointer after the 6th null. None for any other pattern (those pointers keep range)."""
    if i32(b, 56) != _EPILOGUE_BIAS or 7 not in others or 9 not in others:
        return None
    bias = u64(raw[7], 0)
    if not bias or u64(raw[9], 0) != bias or any(u64(raw[i], 0) for i in others if i > 6 and i not in (7, 9)):
        return None
    return 7, 9


# -- cuBLAS: gemmSN_TN_kernel (small-n GEMM) -------------------------------------------------
# cublasGemmSmallNParams<A, B, C, T>: alpha and beta pointers (host), A, B, C, D each as
# (pointer, batch stride) at 16..72, alpha and beta at 80, m, n, k at 92, lda, ldb, ldc, ldd at
# 104, the batch count at 128, a bias vector at 136. A is transposed (TN): k x m with lda.

_GEMM_SN = re.compile(r"^void gemmSN_TN_kernel<(\w[\w ]*), [^(]*\(cublasGemmSmallNParams<cublasGemvTensorStridedBatched<")


def plan_gemm_small_n(name: str, sizes: tuple[int, ...]) -> Plan | None:
    m = _GEMM_SN.match(name)
    elem = sizeof(m.group(1)) if m else None
    if elem is None or sizes != (152,):
        return None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        b = raw[0]
        mm, n, k = i32(b, 92), i32(b, 96), i32(b, 100)
        lda, ldb, ldc, ldd, batch = i32(b, 104), i32(b, 108), i32(b, 112), i32(b, 116), i32(b, 128)
        strides = [i64(b, 24 + 16 * i) for i in range(4)]
        if min(mm, n, k, batch) < 1 or lda < k or ldb < k or min(ldc, ldd) < mm or min(strides) < 0:
            return None
        if batch > 1 and not all(strides):
            return None
        last = [(mm - 1) * lda + k, (n - 1) * ldb + k, (n - 1) * ldc + mm, (n - 1) * ldd + mm]
        dec = Decoded(VIA, regions={0: [(16, 80), (136, 144)]})
        for i, (off, size) in enumerate(zip((16, 32, 48, 64), last)):
            extent = ((batch - 1) * strides[i] + size) * elem
            if i < 3:  # C: beta's place is not certain, so C is taken as read
                dec.read(0, off, extent)
            else:
                dec.write(0, off, extent)
        if u64(b, 136):
            dec.read(0, 136, max(mm, n) * elem)  # a bias along either side of D
        return dec

    return plan


# -- cuBLAS's split-K SGEMM and cuBLASLt's epilogue kernel ---------------------------------------
# Read off launches of the optimizer suite measured by the validator (H100, 2026-11-27), at two
# problem sizes each, with transposed and plain A: every operand's extent is (columns - 1) *
# leading dimension + rows, in floats.

_LARGEK = ("float*, float const*, float const*, int, int, int, int, int, int, float const*, float const*, "
           "float, float, int, int, int*, int*")
_LARGEK_NAME = re.compile(r"^void sgemm_largek_lds64<(true|false), (true|false), ")


def plan_sgemm_largek(name: str, sizes: tuple[int, ...]) -> Plan | None:
    """``sgemm_largek_lds64<transA, transB, ...>(C, A, B, m, n, k, lda, ldb, ldc, alpha*, beta*,
    alpha, beta, ?, ?, int* a, int* b)``: C is m x n (ldc), A is m x k or, transposed, k x m
    (lda), B is k x n or, transposed, n x k (ldb); the two int arrays (split-K semaphores) hold
    one int per tile of the grid's first two dimensions. C is taken as read (beta's place is not
    certain)."""
    m = _LARGEK_NAME.match(name)
    if m is None or split_params(name) != [p.strip() for p in _LARGEK.split(",")] or len(sizes) != 17:
        return None
    ta, tb = m.group(1) == "true", m.group(2) == "true"

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        mm, n, k, lda, ldb, ldc = (i32(raw[i], 0) for i in range(3, 9))
        grid = rec.get("grid") or (0, 0, 0)
        a_rows, a_cols = (k, mm) if ta else (mm, k)
        b_rows, b_cols = (n, k) if tb else (k, n)
        if min(mm, n, k) < 1 or lda < a_rows or ldb < b_rows or ldc < mm or min(grid[0], grid[1]) < 1:
            return None
        dec = Decoded(VIA, regions={i: [(0, 8)] for i in (0, 1, 2, 15, 16)})
        dec.read(0, 0, ((n - 1) * ldc + mm) * 4)
        dec.write(0, 0, ((n - 1) * ldc + mm) * 4)
        dec.read(1, 0, ((a_cols - 1) * lda + a_rows) * 4)
        dec.read(2, 0, ((b_cols - 1) * ldb + b_rows) * 4)
        for i in (15, 16):
            if u64(raw[i], 0):
                dec.read(i, 0, grid[0] * grid[1] * 4)
                dec.write(i, 0, grid[0] * grid[1] * 4)
        return dec

    return plan


_EPILOGUE = ("int, int, long, float*, cublasLtEpilogue_t, int, float*, long, void*, long, long, long, float*, "
             "long, int*")


def plan_lt_epilogue(name: str, sizes: tuple[int, ...]) -> Plan | None:
    """cuBLASLt's ``epilogue::impl::globalKernel<..., float, float, float, ...>(m, n, ldc, C,
    epilogue, ?, bias, ...)`` with epilogue 4 (bias) and nothing past the bias: C (m x n, ldc)
    is updated in place, the bias is m floats."""
    if not name.startswith("void cublasLt::epilogue::impl::globalKernel<") or len(sizes) != 15:
        return None
    targs = args_of(name, "cublasLt::epilogue::impl::globalKernel")
    if not targs or targs[2:5] != ("float", "float", "float") or split_params(name) != [
            p.strip() for p in _EPILOGUE.split(",")]:
        return None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        mm, n, ldc, kind = i32(raw[0], 0), i32(raw[1], 0), i64(raw[2], 0), i32(raw[4], 0)
        if min(mm, n) < 1 or ldc < mm or kind != 4 or not u64(raw[6], 0) or any(u64(raw[i], 0) for i in (8, 12, 14)):
            return None
        dec = Decoded(VIA, regions={3: [(0, 8)], 6: [(0, 8)]})
        dec.read(3, 0, ((n - 1) * ldc + mm) * 4)
        dec.write(3, 0, ((n - 1) * ldc + mm) * 4)
        dec.read(6, 0, mm * 4)
        return dec

    return plan


# -- cuBLAS: scal_kernel, the scaling of C that precedes a split-K SGEMM ------------------------
# scal_kernel<T, T, 1, true, R, C, ...>(cublasTransposeParams<T>, x, y, alpha): m and n at 8
# and 12, two leading dimensions at 16 and 20; one block per 2^R x 2^C tile of the m x n
# column-major matrix. Recorded only in place (x == y, one leading dimension), scaling the C of
# the sgemm_largek_lds64 launch after it (its m, n and ldc), so only that pattern is decoded.

_SCAL = "cublasTransposeParams<{T}>, {T} const*, {T}*, {T} const*"


def plan_scal(name: str, sizes: tuple[int, ...]) -> Plan | None:
    elem = _signature(name, "scal_kernel", _SCAL, sizes)
    targs = args_of(name, "scal_kernel")
    if elem is None or not targs or len(targs) < 6 or targs[1] != targs[0] or sizes != (48, 8, 8, 8):
        return None
    try:
        rows, cols = 1 << int(targs[4]), 1 << int(targs[5])
    except ValueError:
        return None

    def plan(raw: list[bytes], rec: dict[str, Any]) -> Decoded | None:
        b = raw[0]
        mm, n, lda, ldb = i32(b, 8), i32(b, 12), i32(b, 16), i32(b, 20)
        grid = tuple(rec.get("grid") or (0, 0, 0))
        if min(mm, n) < 1 or lda != ldb or lda < mm or raw[1] != raw[2] or any(b[24:48]):
            return None
        if grid[:2] != (-(-mm // rows), -(-n // cols)):
            return None
        size = ((n - 1) * lda + mm) * elem
        dec = Decoded(VIA, regions={1: [(0, 8)], 2: [(0, 8)], 3: [(0, 8)]})
        dec.read(1, 0, size)  # in place: the bisection cannot see this read
        dec.write(2, 0, size)
        dec.read(3, 0, elem)  # alpha, where it is in device memory
        return dec

    return plan


PLANNERS = (
    plan_scal,
    plan_sgemm_largek,
    plan_lt_epilogue,
    plan_cub_reduce,
    plan_gemm_small_n,
    plan_xmma_gemm,
    plan_cutlass_split_k,
    plan_split_k_reduce,
    plan_xmma_conv,
    plan_cutlass_dgrad,
    plan_bn_forward,
    plan_bn_forward_args,
    plan_bn_backward,
    plan_layout_transform,
    plan_implicit_conv,
    plan_wgrad_alg0,
)
