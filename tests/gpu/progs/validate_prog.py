"""Kernels whose true accesses are known, for checking `gpu-trace run --validate` itself.

- copy(x, y, n): reads n floats of x, writes n floats of y (prototype says x is const);
- set_table(table, p): stores pointer p into device memory, on the GPU;
- hidden_write(table, n): writes through that pointer (a write no prediction can see);
- hidden_read(table, out, n): reads through it (a read no prediction can see);
- follow_write(table, n): the same as hidden_write, through a table copied from the host,
  which gpu-predict-access follows (the memcpy record carries the bytes);
- stamp(out): writes clock64() (nondeterministic).

Writes {"bufs": {name: [addr, size]}, "n": n} to $GPUOS_TEST_REPORT.
"""

import json
import os

import cupy as cp

SRC = r"""
extern "C" __global__ void set_table(unsigned long long* table, unsigned long long p) { table[0] = p; }
extern "C" __global__ void hidden_write(unsigned long long* table, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) ((float*)table[0])[i] = 2.0f * i;
}
extern "C" __global__ void follow_write(unsigned long long* table, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) ((float*)table[0])[i] = 3.0f * i;
}
extern "C" __global__ void hidden_read(const unsigned long long* table, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = ((const float*)table[0])[i] + 1.0f;
}
extern "C" __global__ void stamp(long long* out) {
    out[threadIdx.x] = clock64();
}
template <typename T> __global__ void copy(const T* x, T* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}
"""
mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=("copy<float>",))
n = 10000  # 40000 bytes: not a multiple of the 128-byte chunk
x = cp.arange(3 * n, dtype=cp.float32)  # the kernel reads only the first n
y = cp.zeros(3 * n, dtype=cp.float32)
hidden = cp.arange(n, dtype=cp.float32) + 7
followed = cp.zeros(n, dtype=cp.float32)
table = cp.zeros(1, dtype=cp.uint64)  # filled on the GPU
host_table = cp.array([followed.data.ptr], dtype=cp.uint64)  # copied from the host
out = cp.zeros(n, dtype=cp.float32)
stamps = cp.zeros(32, dtype=cp.int64)
cp.cuda.Device().synchronize()

blocks = ((n + 255) // 256,)
mod.get_function("copy<float>")(blocks, (256,), (x, y, cp.int32(n)))
mod.get_function("set_table")((1,), (1,), (table, cp.uint64(hidden.data.ptr)))
mod.get_function("hidden_write")(blocks, (256,), (table, cp.int32(n)))
mod.get_function("hidden_read")(blocks, (256,), (table, out, cp.int32(n)))
mod.get_function("follow_write")(blocks, (256,), (host_table, cp.int32(n)))
mod.get_function("stamp")((1,), (32,), (stamps,))
cp.cuda.Device().synchronize()
assert float(y[n - 1]) == n - 1 and float(y[n]) == 0
assert float(hidden[3]) == 6.0 and float(out[3]) == 7.0 and float(followed[3]) == 9.0

bufs = {k: [v.data.ptr, v.nbytes] for k, v in
        {"x": x, "y": y, "hidden": hidden, "followed": followed, "table": table, "host_table": host_table,
         "out": out, "stamps": stamps}.items()}
report = os.environ.get("GPUOS_TEST_REPORT")
if report:
    with open(report, "w") as f:
        json.dump({"bufs": bufs, "n": n}, f)
