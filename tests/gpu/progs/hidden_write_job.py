"""A job that writes its arrays in a way gpu-predict-access cannot see as a write, for the
residency engine's digest check (tests/gpu/test_digest_gpu.py).

--arrays float32 arrays of --mib MiB, array k filled with k. Step s runs bump(array s mod n):
a C++ template kernel whose parameter is ``const T*`` (its mangled name says so; the
predictor reads it as "read only") but which adds 1 to every element through a cast. After
--periods periods every array k must hold k + periods. Under `gpu-prefetch-sched run` with a
budget below the footprint, each array is evicted and loaded back every period: loaded from
the engine's host copy and "only read" since, it looks clean, and without the digest its
eviction would skip the save and lose the step's write.

With --coeffs M (issue 8's mismatch rule, tests/gpu/test_digest_gpu.py) each bump is followed
by peek(coefficient array s mod M, out, s mod M): an honest kernel (``const float*`` it only
reads, ``float*`` it writes) that copies the coefficient array's first element (100 + its index)
into out. The bumped array is then loaded back and evicted again between bumps under a budget,
and once a mismatch has made bump conservative (every record required at its launches) the peeks
still evict: what bump wrote must be saved by the rule, not by a digest. out is checked too.

Writes {"ok", "wrong_arrays", "values", "arrays", "periods", "coeffs", "out_ok"} as one JSON line
to --out.
"""

import argparse
import json

import cupy as cp

SRC = r"""
template <typename T> __global__ void bump(const T* x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) ((T*)x)[i] += (T)1;  /* a write through a pointer to const */
}
__global__ void peek(const float* c, float* out, int k) {
    if (blockIdx.x == 0 && threadIdx.x == 0) out[k] = c[0];
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arrays", type=int, default=8)
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--periods", type=int, default=4)
    ap.add_argument("--coeffs", type=int, default=0, help="coefficient arrays an honest kernel reads after each bump")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    n = args.mib * (1 << 20) // 4
    mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=("bump<float>", "peek"))
    bump = mod.get_function("bump<float>")
    peek = mod.get_function("peek")
    arrays = [cp.full(n, float(k), dtype=cp.float32) for k in range(args.arrays)]
    coeffs = [cp.full(n, 100.0 + j, dtype=cp.float32) for j in range(args.coeffs)]
    out = cp.zeros(max(1, args.coeffs), dtype=cp.float32)
    cp.cuda.Device().synchronize()
    blocks = ((n + 255) // 256,)
    step = 0
    for _ in range(args.periods):
        for a in arrays:
            bump(blocks, (256,), (a, cp.int64(n)))
            if coeffs:
                j = step % len(coeffs)
                peek((1,), (32,), (coeffs[j], out, cp.int32(j)))
            step += 1
    cp.cuda.Device().synchronize()
    values = []
    wrong = []
    for k, a in enumerate(arrays):
        h = cp.asnumpy(a)  # checked on the host: no more kernels for the engine to predict
        lo, hi = float(h.min()), float(h.max())
        values.append([lo, hi])
        if lo != hi or lo != k + args.periods:
            wrong.append(k)
    got = cp.asnumpy(out).tolist()
    out_ok = not coeffs or got == [100.0 + j for j in range(len(coeffs))]
    with open(args.out, "w") as f:
        f.write(json.dumps({"ok": not wrong and out_ok, "wrong_arrays": wrong, "values": values, "arrays": args.arrays,
                            "periods": args.periods, "coeffs": args.coeffs, "out_ok": out_ok}) + "\n")


if __name__ == "__main__":
    main()
