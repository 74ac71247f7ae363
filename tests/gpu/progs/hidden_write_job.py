"""A job that writes its arrays in a way gpu-predict-access cannot see as a write, for the
residency engine's digest check (tests/gpu/test_digest_gpu.py).

--arrays float32 arrays of --mib MiB, array k filled with k. Step s runs bump(array s mod n):
a C++ template kernel whose parameter is ``const T*`` (its mangled name says so; the
predictor reads it as "read only") but which adds 1 to every element through a cast. After
--periods periods every array k must hold k + periods. Under `gpu-prefetch-sched run` with a
budget below the footprint, each array is evicted and loaded back every period: loaded from
the engine's host copy and "only read" since, it looks clean, and without the digest its
eviction would skip the save and lose the step's write.

Writes {"ok", "wrong_arrays", "values", "arrays", "periods"} as one JSON line to --out.
"""

import argparse
import json

import cupy as cp

SRC = r"""
template <typename T> __global__ void bump(const T* x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) ((T*)x)[i] += (T)1;  /* a write through a pointer to const */
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arrays", type=int, default=8)
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--periods", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    n = args.mib * (1 << 20) // 4
    bump = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=("bump<float>",)).get_function("bump<float>")
    arrays = [cp.full(n, float(k), dtype=cp.float32) for k in range(args.arrays)]
    cp.cuda.Device().synchronize()
    blocks = ((n + 255) // 256,)
    for _ in range(args.periods):
        for a in arrays:
            bump(blocks, (256,), (a, cp.int64(n)))
    cp.cuda.Device().synchronize()
    values = []
    wrong = []
    for k, a in enumerate(arrays):
        h = cp.asnumpy(a)  # checked on the host: no more kernels for the engine to predict
        lo, hi = float(h.min()), float(h.max())
        values.append([lo, hi])
        if lo != hi or lo != k + args.periods:
            wrong.append(k)
    with open(args.out, "w") as f:
        f.write(json.dumps({"ok": not wrong, "wrong_arrays": wrong, "values": values, "arrays": args.arrays,
                            "periods": args.periods}) + "\n")


if __name__ == "__main__":
    main()
