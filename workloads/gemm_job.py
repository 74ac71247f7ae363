"""An out-of-core blocked GEMM for `gpu-prefetch-sched run`: C += A B over square float32 blocks
of --mib MiB. A is --rows x --inner blocks, B --inner x --cols, C --rows x --cols, plus one
temporary block. Per C block (i, j) and k: ``matmul(A[i, k], B[k, j], out=tmp)`` (cuBLAS) and
``C[i, j] += tmp``. A step is one row of C; --periods repeats the whole product, as an iterative
job repeats its loop, on the same memory. The defaults: 4 x 3 and 3 x 4 input blocks of 64 MiB
(24), 41 blocks (2.56 GiB) in all, 48 GEMMs of 4096^3 a period: compute-bound under a budget
below it (a step moves well under a GB while its 12 GEMMs compute for tens of ms).

Every block is allocated and filled by a kernel (a hash of its index: no RNG) before the next
is allocated, so a memory manager acting at launches sees the memory grow one block at a time.
cuBLAS runs in full float32 (no TF32), so every mode below gives the same bits.

Writes one JSON line to --out (stdout without it): the loop's wall time (synchronised before
and after), steps, bytes, and the sha256 of every block's final contents (A, B, C in order),
which a run under any memory manager must reproduce bit for bit.

--manual: the hand-written out-of-core loop a user would write instead, the upper bound to
compare a memory manager with. B stays on the GPU; A's and C's blocks live in pinned host
memory and stream through two slots of a row each (A[i, :] and C[i, :]): while row i
computes, row i+1's blocks load on a copy stream, and row i's C goes back on another once its
last update is done; a slot is reloaded only after its previous row's C has been saved. Its
device memory is B + 2 rows of A and C + the temporary (27 of the default 41 blocks, 66 %);
the output says how much (``device_bytes``).

--managed FRACTION: the fault-driven managed-memory baseline, as stencil_job.py's: the blocks
are CUDA managed memory (refused unless the GPU has that much free), and before each kernel the
least recently used whole blocks are pushed to the host (cuMemPrefetchAsync, stream-ordered)
until the kernel's blocks fit FRACTION of the blocks' bytes; kernels fault the rest back.
"""

import argparse
import hashlib
import os
import time

os.environ.setdefault("CUPY_TF32", "0")  # full float32 GEMMs, before cupy reads it

import cupy as cp  # noqa: E402

# the stencil's hash fill, managed-memory budget and output (the repository root is on PYTHONPATH)
from workloads.stencil_job import FILL, ManagedLRU, write_result  # noqa: E402


def blocks_of(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """Every block's (matrix, row, column), in allocation (and digest) order."""
    out = []
    for name, n, m in (("A", args.rows, args.inner), ("B", args.inner, args.cols), ("C", args.rows, args.cols)):
        out += [(name, a, b) for a in range(n) for b in range(m)]
    return out


def fill(a, index: int) -> None:
    FILL(cp.uint64(index * a.size), a)


def run_in_memory(args: argparse.Namespace, side: int, lru: ManagedLRU | None) -> tuple[float, dict, list]:
    """The product with every block on the GPU (or in managed memory under ``lru``): loop
    seconds, the blocks by name, and the allocation order."""
    names = blocks_of(args)
    stream = cp.cuda.get_current_stream().ptr
    blocks: dict[tuple[str, int, int], cp.ndarray] = {}
    order: list = []
    for idx, key in enumerate([*names, ("T", 0, 0)]):
        if lru is not None:
            a = cp.ndarray((side, side), dtype=cp.float32, memptr=cp.cuda.malloc_managed(side * side * 4))
            lru.before([idx], order + [a], stream)
        else:
            a = cp.empty((side, side), dtype=cp.float32)
        if key[0] == "C":
            a.fill(0)
        else:
            fill(a, idx)
        blocks[key] = a
        order.append(a)
    index = {key: i for i, key in enumerate([*names, ("T", 0, 0)])}
    tmp = blocks[("T", 0, 0)]
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(args.periods):
        for i in range(args.rows):
            for j in range(args.cols):
                c = blocks[("C", i, j)]
                for k in range(args.inner):
                    a, b = blocks[("A", i, k)], blocks[("B", k, j)]
                    if lru is not None:
                        lru.before([index[("A", i, k)], index[("B", k, j)], index[("T", 0, 0)]], order, stream)
                    cp.matmul(a, b, out=tmp)
                    if lru is not None:
                        lru.before([index[("C", i, j)], index[("T", 0, 0)]], order, stream)
                    c += tmp
    cp.cuda.Device().synchronize()
    return time.perf_counter() - t0, blocks, names


def run_manual(args: argparse.Namespace, side: int) -> tuple[float, dict, int]:
    """The hand-written double-buffered loop (module docstring): loop seconds, every block's
    final contents (host arrays for A and C, device arrays for B) and its device bytes."""
    import cupyx

    names = blocks_of(args)
    nbytes = side * side * 4
    host: dict = {}
    dev: dict = {}
    scratch = cp.empty((side, side), dtype=cp.float32)
    for idx, key in enumerate(names):
        if key[0] == "B":
            dev[key] = cp.empty((side, side), dtype=cp.float32)
            fill(dev[key], idx)
            continue
        h = cupyx.empty_pinned((side, side), dtype=cp.float32)
        if key[0] == "C":
            h[...] = 0
        else:
            fill(scratch, idx)
            scratch.get(out=h)
        host[key] = h
    del scratch
    slots = [{"A": [cp.empty((side, side), dtype=cp.float32) for _ in range(args.inner)],
              "C": [cp.empty((side, side), dtype=cp.float32) for _ in range(args.cols)]} for _ in range(2)]
    tmp = cp.empty((side, side), dtype=cp.float32)
    device_bytes = nbytes * (args.inner * args.cols + 2 * (args.inner + args.cols) + 1)
    compute = cp.cuda.Stream(non_blocking=True)
    load = cp.cuda.Stream(non_blocking=True)
    save = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    rows = [i for _ in range(args.periods) for i in range(args.rows)]
    loaded: list = [None, None]  # per slot: the event after its row's loads
    saved: list = [None, None]  # per slot: the event after its previous row's C went back

    def start_load(step: int) -> None:
        slot, i = step % 2, rows[step]
        with load:
            if saved[slot] is not None:
                load.wait_event(saved[slot])  # the slot's previous C is on the host first
            for k in range(args.inner):
                slots[slot]["A"][k].set(host[("A", i, k)], stream=load)
            for j in range(args.cols):
                slots[slot]["C"][j].set(host[("C", i, j)], stream=load)
            loaded[slot] = load.record()

    t0 = time.perf_counter()
    start_load(0)
    for step, i in enumerate(rows):
        slot = step % 2
        if step + 1 < len(rows):
            start_load(step + 1)
        with compute:
            compute.wait_event(loaded[slot])
            for j in range(args.cols):
                c = slots[slot]["C"][j]
                for k in range(args.inner):
                    cp.matmul(slots[slot]["A"][k], dev[("B", k, j)], out=tmp)
                    c += tmp
            done = compute.record()
        with save:
            save.wait_event(done)
            for j in range(args.cols):
                slots[slot]["C"][j].get(stream=save, out=host[("C", i, j)], blocking=False)
            saved[slot] = save.record()
    cp.cuda.Device().synchronize()
    loop_s = time.perf_counter() - t0
    final = {key: (dev[key] if key[0] == "B" else host[key]) for key in names}
    return loop_s, final, device_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--cols", type=int, default=4)
    ap.add_argument("--mib", type=int, default=64, help="one block's MiB (a square float32 matrix)")
    ap.add_argument("--periods", type=int, default=8)
    ap.add_argument("--manual", action="store_true", help="the hand-written double-buffered loop (docstring)")
    ap.add_argument("--managed", type=float, default=0.0, metavar="FRACTION",
                    help="managed blocks under a software budget of FRACTION of their bytes (docstring)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    side = int(round((args.mib * (1 << 20) / 4) ** 0.5))
    if side * side * 4 != args.mib * (1 << 20):
        ap.error(f"--mib {args.mib}: not a square float32 matrix (try 4, 16, 64, 256)")
    if min(args.rows, args.inner, args.cols, args.periods) < 1:
        ap.error("--rows, --inner, --cols and --periods must be at least 1")
    if args.manual and args.managed:
        ap.error("--manual and --managed are two different baselines: one at a time")
    if args.manual and args.rows < 2:
        ap.error("--manual needs --rows of 2 or more (two row slots)")
    nbytes = side * side * 4
    total = (len(blocks_of(args)) + 1) * nbytes
    extra: dict = {}
    if args.manual:
        loop_s, final, device_bytes = run_manual(args, side)
        extra = {"manual": True, "device_bytes": device_bytes}
        digests = [hashlib.sha256((cp.asnumpy(a) if isinstance(a, cp.ndarray) else a).tobytes()).hexdigest()
                   for a in final.values()]
    else:
        lru = None
        if args.managed:
            free, _ = cp.cuda.runtime.memGetInfo()
            if total > free:
                raise SystemExit(f"gemm_job: refusing {total} bytes of managed memory: only {free} free on the GPU")
            lru = ManagedLRU(int(args.managed * total), nbytes)
            extra = {"managed": args.managed, "um_budget": lru.budget, "gpu_free_before": free}
        loop_s, blocks, names = run_in_memory(args, side, lru)
        if lru is not None:
            extra.update(um_evictions=lru.evictions, um_evicted_bytes=lru.evictions * nbytes,
                         um_faulted_in=lru.faulted_in, um_faulted_bytes=lru.faulted_in * nbytes)
        digests = [hashlib.sha256(cp.asnumpy(blocks[key]).tobytes()).hexdigest() for key in names]
    steps = args.periods * args.rows
    out = {"workload": "gemm", "loop_s": loop_s, "steps": steps, "step_s": loop_s / steps,
           "gemms": steps * args.cols * args.inner, "block_bytes": nbytes, "total_bytes": total,
           "rows": args.rows, "inner": args.inner, "cols": args.cols, "periods": args.periods,
           "digests": digests, **extra}
    write_result(out, args.out)


if __name__ == "__main__":
    main()
