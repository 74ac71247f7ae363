"""A scientific loop for `gpu-prefetch-sched run`: --arrays float32 arrays of --mib MiB each;
step s reads arrays s, s+1, s+2 (mod n) and writes array s+3 with a 3-point stencil whose
per-element work is --work fused multiply-adds (the arithmetic intensity of the job). Every
--arrays steps the same launches repeat on the same memory, as an iterative solver's do.

Each array is allocated and filled by a kernel before the next one is allocated, so a memory
manager acting at launches sees the memory grow one array at a time. No temporaries inside
the loop (every kernel writes a preallocated array), so the arrays are the job's memory.

Writes one JSON line to --out (stdout without it): the loop's wall time (synchronised before and after)
and its start and end on the wall clock (t0_unix, t1_unix: jobs served together), steps, bytes, and per array the sha256 of its final contents, which a run under any memory
manager must reproduce bit for bit.

--managed FRACTION: the fault-driven managed-memory baseline (scripts/bench_online.py). The
arrays are CUDA managed memory (cudaMallocManaged, refused unless the GPU has that much free:
the job never oversubscribes the GPU itself), and the budget is a software one, FRACTION of
the arrays' bytes, as `gpu-prefetch-sched run --budget N%` has. Before each kernel (fill or
step), whole arrays are pushed back to host memory, least recently used first, until the
arrays resident plus those the kernel touches fit the budget -- what the UM driver would
evict under that much memory pressure, done explicitly -- with cuMemPrefetchAsync to the
host on the kernel's stream. Nothing is ever prefetched to the GPU: the kernel that touches
an evicted array faults its pages back on demand. An emulation of managed memory under
pressure, not the driver's own eviction (which would need the GPU's memory really full).
--managed 1 (nothing evicted) is the same job in managed memory resident on the GPU.

--coeffs K: K more arrays of the same size, coefficients that the loop only reads: step s
also reads coefficient s mod K (a read-mostly job, as an LLM's weights are: each is read once
a period and never written). They are allocated and filled after the state arrays.
"""

import argparse
import ctypes
import hashlib
import json
import time

import cupy as cp

FILL = cp.ElementwiseKernel(
    "uint64 seed", "float32 x",
    """
    unsigned long long z = (unsigned long long)i + seed + 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    x = (float)((z ^ (z >> 31)) & 0xffffff) * (1.0f / 16777216.0f);
    """,
    "gpuos_stencil_fill",
)

STEP = cp.ElementwiseKernel(
    "raw float32 a, raw float32 b, raw float32 c, int64 n, int32 work", "float32 out",
    """
    long long l = i > 0 ? i - 1 : n - 1, r = i + 1 < n ? i + 1 : 0;
    float x = 0.25f * a[l] + 0.5f * b[i] + 0.25f * c[r];
    float y = x;
    for (int k = 0; k < work; ++k) y = fmaf(y, 0.999f, 0.001f * x);
    out = y;
    """,
    "gpuos_stencil_step",
)

STEPC = cp.ElementwiseKernel(
    "raw float32 a, raw float32 b, raw float32 c, raw float32 w, int64 n, int32 work", "float32 out",
    """
    long long l = i > 0 ? i - 1 : n - 1, r = i + 1 < n ? i + 1 : 0;
    float x = 0.25f * a[l] + 0.5f * b[i] * (0.5f + 0.5f * w[i]) + 0.25f * c[r];
    float y = x;
    for (int k = 0; k < work; ++k) y = fmaf(y, 0.999f, 0.001f * x);
    out = y;
    """,
    "gpuos_stencil_step_coeff",
)


class HostEvictor:
    """cuMemPrefetchAsync of managed memory to the host (CU_MEM_LOCATION_TYPE_HOST) on a stream:
    cuda.bindings (13.x: location, flags) when it takes that form, else libcuda's
    cuMemPrefetchAsync_v2 through ctypes (the same entry point)."""

    def __init__(self) -> None:
        self.path = ""
        self._cu = None
        try:
            from cuda.bindings import driver as cu

            loc = cu.CUmemLocation()
            loc.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
            loc.id = 0
            self._cu, self._loc, self.path = cu, loc, "cuda.bindings cuMemPrefetchAsync(location=HOST)"
        except Exception:  # noqa: BLE001 (older bindings: ctypes below)
            self._cu = None
        self._lib = None

    def __call__(self, ptr: int, size: int, stream: int) -> None:
        if self._cu is not None:
            try:
                (err,) = self._cu.cuMemPrefetchAsync(ptr, size, self._loc, 0, stream)
            except TypeError:  # a 12.x-style signature (destination device): use the _v2 symbol
                self._cu = None
            else:
                if int(err) != 0:
                    raise RuntimeError(f"cuMemPrefetchAsync to the host: {err}")
                return
        if self._lib is None:
            class Loc(ctypes.Structure):
                _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuMemPrefetchAsync_v2
            fn.argtypes = [ctypes.c_uint64, ctypes.c_size_t, Loc, ctypes.c_uint, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            self._lib, self._host = fn, Loc(2, 0)  # 2: CU_MEM_LOCATION_TYPE_HOST
            self.path = "libcuda cuMemPrefetchAsync_v2(location=HOST)"
        err = self._lib(ptr, size, self._host, 0, stream or None)
        if err != 0:
            raise RuntimeError(f"cuMemPrefetchAsync_v2 to the host: CUresult {err}")


class ManagedLRU:
    """The software budget over managed arrays (module docstring, --managed)."""

    def __init__(self, budget: int, size: int) -> None:
        self.budget, self.size = budget, size
        self.order: list[int] = []  # resident arrays, least recently used first
        self.evict = HostEvictor()
        self.evictions = 0
        self.faulted_in = 0  # arrays a kernel found on the host (brought back by its faults)
        self.peak = 0
        self.seen: set[int] = set()

    def before(self, touched: list[int], arrays: list, stream: int) -> None:
        need = [k for k in touched if k not in self.order]
        while (len(self.order) + len(need)) * self.size > self.budget:
            victims = [k for k in self.order if k not in touched]
            if not victims:
                break  # the kernel's own arrays exceed the budget: it runs over it
            v = victims[0]
            self.order.remove(v)
            self.evict(arrays[v].data.ptr, self.size, stream)
            self.evictions += 1
        self.faulted_in += sum(1 for k in need if k in self.seen)
        for k in touched:
            if k in self.order:
                self.order.remove(k)
            self.order.append(k)
            self.seen.add(k)
        self.peak = max(self.peak, len(self.order) * self.size)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arrays", type=int, default=12)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--periods", type=int, default=10)
    ap.add_argument("--work", type=int, default=64)
    ap.add_argument("--managed", type=float, default=0.0, metavar="FRACTION",
                    help="managed arrays under a software budget of FRACTION of their bytes (docstring)")
    ap.add_argument("--coeffs", type=int, default=0, help="read-only coefficient arrays (docstring)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    n = args.mib * (1 << 20) // 4
    m = args.arrays
    kc = args.coeffs
    lru = None
    extra: dict = {}
    if args.managed:
        free, total = cp.cuda.runtime.memGetInfo()  # cuMemGetInfo of the current context
        need = (m + kc) * n * 4
        if need > free:
            raise SystemExit(f"stencil_job: refusing {need} bytes of managed memory: only {free} free on the GPU")
        lru = ManagedLRU(int(args.managed * need), n * 4)
        extra = {"managed": args.managed, "um_budget": lru.budget, "gpu_free_before": free}
    stream = cp.cuda.get_current_stream().ptr
    arrays = []
    for k in range(m + kc):
        if lru is not None:
            a = cp.ndarray(n, dtype=cp.float32, memptr=cp.cuda.malloc_managed(n * 4))
            lru.before([k], arrays + [a], stream)
        else:
            a = cp.empty(n, dtype=cp.float32)
        FILL(cp.uint64(k * n), a)
        arrays.append(a)
    dev = cp.cuda.Device()
    dev.synchronize()
    steps = args.periods * m
    if lru is not None:
        lru.faulted_in = 0
        ev0 = lru.evictions
    t0 = time.perf_counter()
    t0_unix = time.time()
    for s in range(steps):
        if kc:
            if lru is not None:
                lru.before([s % m, (s + 1) % m, (s + 2) % m, m + s % kc, (s + 3) % m], arrays, stream)
            STEPC(arrays[s % m], arrays[(s + 1) % m], arrays[(s + 2) % m], arrays[m + s % kc], n, args.work,
                  arrays[(s + 3) % m])
            continue
        if lru is not None:
            lru.before([s % m, (s + 1) % m, (s + 2) % m, (s + 3) % m], arrays, stream)
        STEP(arrays[s % m], arrays[(s + 1) % m], arrays[(s + 2) % m], n, args.work, arrays[(s + 3) % m])
    dev.synchronize()
    loop_s = time.perf_counter() - t0
    t1_unix = time.time()
    if lru is not None:
        extra.update(um_evictions=lru.evictions - ev0, um_evicted_bytes=(lru.evictions - ev0) * n * 4,
                     um_faulted_in=lru.faulted_in, um_faulted_bytes=lru.faulted_in * n * 4,
                     um_peak_resident=lru.peak, um_evict_path=lru.evict.path)
    digests = [hashlib.sha256(cp.asnumpy(a).tobytes()).hexdigest() for a in arrays]
    out = {"loop_s": loop_s, "steps": steps, "arrays": m, "coeffs": kc, "array_bytes": n * 4,
           "total_bytes": (m + kc) * n * 4, "work": args.work, "t0_unix": t0_unix, "t1_unix": t1_unix,
           "digests": digests, **extra}
    write_result(out, args.out)


def write_result(out: dict, path: str) -> None:
    """The result as one JSON line to ``path`` (not stdout: under gpu-prefetch-sched run, stdout
    carries its summary), or to stdout without one."""
    line = json.dumps(out)
    if path:
        with open(path, "w") as f:
            f.write(line + "\n")
    else:
        print(line, flush=True)


if __name__ == "__main__":
    main()
