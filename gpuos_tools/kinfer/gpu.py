"""The GPU path: the perceptron on CuPy, imported only when a GPU is asked for.

Two ways to run it:

- ``fused``: one kernel per batch. A block of ``hidden`` threads takes ``ROWS`` rows; thread j
  keeps column j of w1 in registers, computes hidden unit j for each row, and the block sums
  the units' contributions to each output with warp shuffles. One launch, no intermediate
  array, which is what a small model at batch 1..4096 is bound by.
- ``matmul``: cuBLAS through CuPy (x@w1, bias+ReLU, @w2), for shapes the fused kernel does not
  take (hidden not a multiple of 32 or above 1024, inputs above 64, outputs above 8).

``GpuMlp`` checks the fused kernel against numpy on a random batch when it is built and uses
``matmul`` if they disagree, saying so in ``note``. Host buffers are pinned and device buffers
kept between batches, so a batch costs one copy in, one launch (or four), one copy out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuos_tools.kinfer.model import Mlp

ROWS = 8

_FUSED = r"""
extern "C" __global__ void __launch_bounds__(HIDDEN)
kinfer_mlp(const float* __restrict__ x, int n,
           const float* __restrict__ w1, const float* __restrict__ b1,
           const float* __restrict__ w2, const float* __restrict__ b2,
           float* __restrict__ y)
{
    __shared__ float xs[ROWS][NIN];
    __shared__ float part[ROWS][NOUT][HIDDEN / 32];
    const int j = threadIdx.x;
    const int lane = j & 31, warp = j >> 5;
    const long row0 = (long)blockIdx.x * ROWS;
    float w[NIN];
#pragma unroll
    for (int k = 0; k < NIN; ++k) w[k] = w1[k * HIDDEN + j];
    const float bj = b1[j];
    float v[NOUT];
#pragma unroll
    for (int o = 0; o < NOUT; ++o) v[o] = w2[j * NOUT + o];
    for (int t = j; t < ROWS * NIN; t += HIDDEN) {
        const int r = t / NIN, k = t - r * NIN;
        xs[r][k] = (row0 + r < n) ? x[(row0 + r) * NIN + k] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        float acc = bj;
#pragma unroll
        for (int k = 0; k < NIN; ++k) acc = fmaf(xs[r][k], w[k], acc);
        acc = fmaxf(acc, 0.0f);
#pragma unroll
        for (int o = 0; o < NOUT; ++o) {
            float s = acc * v[o];
#pragma unroll
            for (int d = 16; d > 0; d >>= 1) s += __shfl_down_sync(0xffffffffu, s, d);
            if (lane == 0) part[r][o][warp] = s;
        }
    }
    __syncthreads();
    if (j < ROWS * NOUT) {
        const int r = j / NOUT, o = j - r * NOUT;
        if (row0 + r < n) {
            float s = b2[o];
#pragma unroll
            for (int q = 0; q < HIDDEN / 32; ++q) s += part[r][o][q];
            y[(row0 + r) * NOUT + o] = s;
        }
    }
}
"""


def import_cupy() -> Any:
    """CuPy, or ImportError with the reason (no CuPy, no driver, no GPU)."""
    import cupy  # noqa: PLC0415 (lazily: the CPU path must work without it)

    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise ImportError("CUDA reports no GPU")
    return cupy


def gpu_unavailable_reason() -> str | None:
    """None when the GPU path can run here, else why not."""
    try:
        import_cupy()
    except Exception as e:  # ImportError, CUDARuntimeError...
        return f"{type(e).__name__}: {e}"
    return None


def fused_fits(model: Mlp) -> bool:
    h = model.w1.shape[1]
    return h % 32 == 0 and 32 <= h <= 1024 and model.n_inputs <= 64 and model.n_outputs <= 8 and ROWS * model.n_outputs <= h


class GpuMlp:
    """The model's weights on one GPU and a ``forward`` that takes and gives host arrays."""

    def __init__(self, model: Mlp, device: int = 0, mode: str = "auto"):
        cp = import_cupy()
        self.cp = cp
        self.model = model
        self.device = cp.cuda.Device(device)
        self.note = ""
        with self.device:
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.w1 = cp.asarray(model.w1)
            self.b1 = cp.asarray(model.b1)
            self.w2 = cp.asarray(model.w2)
            self.b2 = cp.asarray(model.b2)
            self._cap = 0
            self._grow(1024)
            self.kernel = None
            self.mode = "matmul"
            if mode in ("auto", "fused") and fused_fits(model):
                try:
                    self.kernel = self._compile()
                    self.mode = "fused"
                    self._self_check()
                except Exception as e:  # a compile failure or a wrong answer
                    if mode == "fused":
                        raise
                    self.kernel = None
                    self.mode = "matmul"
                    self.note = f"fused kernel not used ({e}); cuBLAS matmul instead"
            elif mode == "fused":
                raise ValueError("the model's shape does not fit the fused kernel")

    def _compile(self) -> Any:
        m = self.model
        options = (
            f"-DNIN={m.n_inputs}", f"-DHIDDEN={m.w1.shape[1]}", f"-DNOUT={m.n_outputs}", f"-DROWS={ROWS}",
        )
        module = self.cp.RawModule(code=_FUSED, options=options)
        return module.get_function("kinfer_mlp")

    def _self_check(self) -> None:
        x = np.random.default_rng(1).integers(0, 10, (257, self.model.n_inputs)).astype(np.float32)
        want = self.model.forward(x)
        got = self.forward(x)
        scale = max(1.0, float(np.abs(want).max()))
        if not np.allclose(got, want, rtol=1e-3, atol=1e-4 * scale):
            raise ValueError(f"fused kernel disagrees with numpy (max error {float(np.abs(got - want).max()):.3g})")

    def _grow(self, n: int) -> None:
        cp = self.cp
        cap = max(n, 2 * self._cap)
        ni, no = self.model.n_inputs, self.model.n_outputs
        self.dx = cp.empty((cap, ni), dtype=cp.float32)
        self.dy = cp.empty((cap, no), dtype=cp.float32)
        self.hx = cp.cuda.alloc_pinned_memory(cap * ni * 4)
        self.hy = cp.cuda.alloc_pinned_memory(cap * no * 4)
        self.px = np.frombuffer(self.hx, dtype=np.float32, count=cap * ni).reshape(cap, ni)
        self.py = np.frombuffer(self.hy, dtype=np.float32, count=cap * no).reshape(cap, no)
        self._cap = cap

    def run_device(self, dx: Any, dy: Any, n: int) -> None:
        """The model on device arrays (n rows), queued on ``self.stream``; no copy, no wait."""
        cp = self.cp
        with self.stream:  # RawKernel launches on the current stream
            if self.kernel is not None:
                grid = ((n + ROWS - 1) // ROWS,)
                self.kernel(grid, (self.w1.shape[1],), (dx, np.int32(n), self.w1, self.b1, self.w2, self.b2, dy))
            else:
                h = dx[:n] @ self.w1
                h += self.b1
                cp.maximum(h, 0, out=h)
                y = dy[:n]
                y[...] = h @ self.w2
                y += self.b2

    def forward(self, x: np.ndarray) -> np.ndarray:
        n = x.shape[0]
        if n == 0:
            return np.empty((0, self.model.n_outputs), dtype=np.float32)
        with self.device:
            if n > self._cap:
                self._grow(n)
            np.copyto(self.px[:n], x, casting="same_kind")
            self.dx[:n].set(self.px[:n], stream=self.stream)
            self.run_device(self.dx, self.dy, n)
            self.dy[:n].get(stream=self.stream, out=self.py[:n])
            self.stream.synchronize()
            return self.py[:n].copy()
