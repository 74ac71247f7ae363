"""A small Numba CUDA program for the gpu-trace GPU tests. Writes its arrays' pointers to $GPUOS_TEST_REPORT."""

import json
import os

import numpy as np
from numba import cuda


@cuda.jit
def saxpy(out, a, x, y):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a * x[i] + y[i]


n = 1 << 16
x = cuda.to_device(np.arange(n, dtype=np.float32))
y = cuda.to_device(np.ones(n, dtype=np.float32))
out = cuda.device_array(n, dtype=np.float32)
saxpy[(n + 255) // 256, 256](out, np.float32(2.0), x, y)
result = out.copy_to_host()
assert np.allclose(result, 2.0 * np.arange(n) + 1.0)
report = {"pointers": {name: int(arr.device_ctypes_pointer.value) for name, arr in
                       (("out", out), ("x", x), ("y", y))}}
with open(os.environ["GPUOS_TEST_REPORT"], "w") as f:
    json.dump(report, f)
