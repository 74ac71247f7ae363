"""A small CuPy program for the gpu-trace GPU tests: elementwise, reduction, RawKernel with a
pointer argument and a by-value struct holding pointers. Writes what it knows to $GPUOS_TEST_REPORT."""

import json
import os

import cupy as cp
import numpy as np

n = 1 << 16
x = cp.arange(n, dtype=cp.float32)
y = x * 2.0 + 1.0  # elementwise kernels: CuPy passes each array as a by-value struct
total = float(y.sum())  # reduction

src = r"""
struct Affine { float* out; const float* in; int n; float scale; double bias; };
extern "C" __global__ void affine(Affine p, const float* __restrict__ extra, int m) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.n) p.out[i] = p.in[i] * p.scale + (float)p.bias + extra[i % m];
}
extern "C" __global__ void gpuos_marker(int* flag) { *flag = 1; }
"""
module = cp.RawModule(code=src)
affine = module.get_function("affine")
marker = module.get_function("gpuos_marker")
out = cp.empty(n, dtype=cp.float32)
extra = cp.ones(7, dtype=cp.float32)
struct_dtype = np.dtype(
    [("out", np.uint64), ("inp", np.uint64), ("n", np.int32), ("scale", np.float32), ("bias", np.float64)],
    align=True,
)
params = np.array([(out.data.ptr, y.data.ptr, n, 0.5, 3.0)], dtype=struct_dtype)[0]
affine(((n + 255) // 256,), (256,), (params, extra, np.int32(7)))
expected = (cp.asnumpy(y) * 0.5 + 3.0 + 1.0)
assert np.allclose(cp.asnumpy(out), expected)
host = cp.asnumpy(out[:4])  # a device-to-host copy
out[:16] = 0  # a memset or fill kernel
cp.cuda.runtime.deviceSynchronize()

pool = cp.get_default_memory_pool()
flag = cp.zeros(1, dtype=cp.int32)
report = {
    "pointers": {"x": x.data.ptr, "y": y.data.ptr, "out": out.data.ptr, "extra": extra.data.ptr},
    "n": n,
    "total": total,
    "pool_total_bytes": pool.total_bytes(),
    "flag": flag.data.ptr,
}
marker((1,), (1,), (flag,))  # the trace's live bytes at this launch must match pool_total_bytes
cp.cuda.runtime.deviceSynchronize()
with open(os.environ["GPUOS_TEST_REPORT"], "w") as f:
    json.dump(report, f)
