"""A CuPy program for the gpu-ckpt GPU tests: GIB GiB of deterministic data transformed in a loop
(an integer xorshift, bit-exact on any GPU), progress on stdout, a digest of the data at the end.

    ckpt_cupy.py [--gib N] [--iters N] [--pause S]   the loop
    ckpt_cupy.py --spin S                             one kernel that runs S seconds, then exit

stdout, one line each: "ready {json}" once the data is on the GPU, "iter N" every 50 iterations,
"spinning" after the spin kernel is launched, "done {json}" at the end with the SHA-256 of the
data and the UUID of the GPU the context is on (it changes when gpu-restore moves the process).
No managed memory.
"""

import argparse
import hashlib
import json
import os
import time

import cupy as cp


def device_uuid() -> str:
    from cuda.bindings import driver as drv

    err, dev = drv.cuCtxGetDevice()
    assert err == drv.CUresult.CUDA_SUCCESS, err
    err, uuid = drv.cuDeviceGetUuid(dev)
    assert err == drv.CUresult.CUDA_SUCCESS, err
    h = bytes(uuid.bytes).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


XORSHIFT = cp.ElementwiseKernel(
    "uint32 k", "uint32 x",
    """
    unsigned int v = x ^ k;
    v ^= v << 13;
    v ^= v >> 17;
    v ^= v << 5;
    x = v;
    """,
    "gpuos_ckpt_xorshift",
)

SPIN = r"""
extern "C" __global__ void gpuos_ckpt_spin(unsigned long long ns, unsigned int* out) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
    *out = 1;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--pause", type=float, default=0.02, help="host sleep every 10 iterations (s)")
    ap.add_argument("--spin", type=float, default=0.0, help="run one kernel for this many seconds instead")
    args = ap.parse_args()

    n = int(args.gib * (1 << 30)) // 4
    data = cp.arange(n, dtype=cp.uint32)
    data *= cp.uint32(2654435761)  # in place: the process holds GIB GiB, not twice that
    cp.cuda.Device().synchronize()
    ready = {"pid": os.getpid(), "bytes": int(data.nbytes), "uuid": device_uuid()}
    print("ready " + json.dumps(ready), flush=True)

    if args.spin:
        flag = cp.zeros(1, dtype=cp.uint32)
        kernel = cp.RawKernel(SPIN, "gpuos_ckpt_spin")
        kernel((1,), (1,), (cp.uint64(int(args.spin * 1e9)), flag))
        print("spinning", flush=True)
        cp.cuda.Device().synchronize()  # the process sits in a CUDA call until the kernel ends
        print("done " + json.dumps({"spun": int(flag.get()[0])}), flush=True)
        return

    for i in range(args.iters):
        XORSHIFT(cp.uint32(i), data)
        if i % 10 == 9:
            cp.cuda.Device().synchronize()
            time.sleep(args.pause)
        if i % 50 == 49:
            print(f"iter {i + 1}", flush=True)
    digest = hashlib.sha256(cp.asnumpy(data).tobytes()).hexdigest()
    print("done " + json.dumps({"digest": digest, "iters": args.iters, "uuid": device_uuid()}), flush=True)


if __name__ == "__main__":
    main()
