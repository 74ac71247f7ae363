"""Accuracy suite, CuPy part: elementwise, reductions, a RawKernel with a struct argument,
cuBLAS GEMM, strided batched GEMM and pointer-array batched GEMM."""

import os

import cupy as cp
import numpy as np
from cupy_backends.cuda.libs import cublas

SCALE = int(os.environ.get("GPUOS_SUITE_SCALE", "1"))  # sizes for learning (1) and scoring (2)
rng = cp.random.default_rng(0)
N = 100_003 * SCALE
x = rng.standard_normal(N, dtype=cp.float32)
y = rng.standard_normal(N, dtype=cp.float32)
z = x * y + 1.5  # elementwise
w = cp.sin(z)
s = cp.sum(w)  # reduction
m = cp.max(z[: N // 6 * 6].reshape(-1, 6), axis=1)  # reduction along an axis

# RawKernel taking a struct by value that holds two pointers and a length
raw = cp.RawKernel(r"""
struct Pair { const float* a; float* b; long long n; float scale; };
extern "C" __global__ void scale_pair(Pair p) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < p.n) p.b[i] = p.scale * p.a[i];
}
""", "scale_pair")
out = cp.empty_like(x)
n = N // 2  # half of the arrays
pair = np.zeros(1, dtype=[("a", "<u8"), ("b", "<u8"), ("n", "<i8"), ("scale", "<f4"), ("pad", "<u4")])
pair["a"], pair["b"], pair["n"], pair["scale"] = x.data.ptr, out.data.ptr, n, 3.0
# CuPy passes a NumPy structured scalar as a struct by value
raw(((n + 255) // 256,), (256,), (pair[0],))

# GEMM, strided batched GEMM
a = rng.standard_normal((256 * SCALE, 384), dtype=cp.float32)
b = rng.standard_normal((384, 128 * SCALE), dtype=cp.float32)
c = a @ b
ab = rng.standard_normal((8 * SCALE, 64, 96), dtype=cp.float32)
bb = rng.standard_normal((8 * SCALE, 96, 32), dtype=cp.float32)
cb = cp.matmul(ab, bb)

# pointer-array batched GEMM: the matrices' addresses live in device memory
batch, mm, nn, kk = 4 * SCALE, 64, 48 * SCALE, 32
As = [rng.standard_normal((kk, mm), dtype=cp.float32) for _ in range(batch)]  # column-major m x k
Bs = [rng.standard_normal((nn, kk), dtype=cp.float32) for _ in range(batch)]
Cs = [cp.zeros((nn, mm), dtype=cp.float32) for _ in range(batch)]
parr = {k: cp.array([t.data.ptr for t in v], dtype=cp.uint64) for k, v in (("A", As), ("B", Bs), ("C", Cs))}
alpha, beta = np.array(1.0, np.float32), np.array(0.0, np.float32)
handle = cp.cuda.device.get_cublas_handle()
cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
cublas.sgemmBatched(handle, cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N, mm, nn, kk, alpha.ctypes.data,
                    parr["A"].data.ptr, mm, parr["B"].data.ptr, kk, beta.ctypes.data, parr["C"].data.ptr, mm, batch)
cp.cuda.Device().synchronize()
# column-major C = A B is, in these row-major arrays, Cs = Bs @ As
assert cp.allclose(Cs[1], Bs[1] @ As[1], atol=1e-3), "batched GEMM result"
assert cp.allclose(out[:n], 3 * x[:n])
print(float(s), float(c.sum()), float(cb.sum()), float(m.sum()))
