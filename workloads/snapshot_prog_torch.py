"""Random PyTorch work on several streams while snapshots are taken, for the agent's trials.

The PyTorch twin of snapshot_prog.py, with the same protocol: GPUOS_TRIAL_SEED picks the work;
GPUOS_TRIAL_OPS how many operations (PyTorch ops here; each is one or more launches, copies or
memsets for the agent); GPUOS_TRIAL_SNAPSHOTS how many snapshots a thread of this program
requests from its own agent (over $GPUOS_AGENT_SOCKET) at random moments while the work runs (0
in the twin run that takes the references). Writes the snapshots' answers to $GPUOS_TEST_REPORT.

The snapshots are compared with the twin run's stop-the-world references per allocation, and an
allocation here is a caching-allocator segment: the tensors in it, and the freed blocks that
still hold what PyTorch's temporaries left there. So every byte of every segment must be the
same in both runs after the same number of operations:

- each stream owns its tensors; work that reads another stream's tensor waits for an event of
  that stream first, and that stream's later work waits for the read (no write-after-read
  race); nothing is freed or allocated by the program during the work;
- the ops are deterministic (torch.use_deterministic_algorithms, deterministic cuDNN, cuBLAS
  with a fixed workspace config), so the temporaries they leave in freed blocks are too;
- every op kind runs once on every stream, with every tensor, before the work (the warm-up):
  the caching allocator then already holds every segment the temporaries need and allocates no
  new one during the work (checked at the end, against PyTorch's segment count and the agent's
  allocations: a fresh segment's unwritten bytes are whatever the driver hands out, which may
  differ between the runs);
- after the warm-up every segment is zeroed and the tensors are loaded anew from the host, so
  the work starts from the same bytes in both runs.

GPUOS_TRIAL_CONV=0 leaves the convolution (cuDNN) out; GPUOS_TRIAL_DEVICE=cpu runs the op mix on
the CPU without streams or snapshots (a dry run of the program's own logic).
"""

import os

# before torch: cuBLAS deterministic across streams (a fixed workspace per stream); :16:8 of the two
# documented settings, the smaller (128 KiB a stream rather than 32 MiB), so snapshots stay small
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":16:8")

import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

seed = int(os.environ.get("GPUOS_TRIAL_SEED", "1"))
ops = int(os.environ.get("GPUOS_TRIAL_OPS", "600"))
wanted = int(os.environ.get("GPUOS_TRIAL_SNAPSHOTS", "0"))
with_conv = os.environ.get("GPUOS_TRIAL_CONV", "1") != "0"
device = os.environ.get("GPUOS_TRIAL_DEVICE", "cuda")
cuda = device == "cuda"
rng = random.Random(seed)

torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False
torch.use_deterministic_algorithms(True)

NSTREAMS = 3
L = 1024  # elements moved by the index ops (every vector has at least 4096)

streams = [torch.cuda.Stream() for _ in range(NSTREAMS)] if cuda else [None] * NSTREAMS


def on(k: int):
    return torch.cuda.stream(streams[k]) if cuda else contextlib.nullcontext()


class Owned:
    """The tensors of one stream, allocated on that stream (its caching-allocator pool)."""

    def __init__(self, k: int) -> None:
        self.n = rng.choice([64, 128, 256])  # square matrices
        self.vec_sizes = [rng.choice([1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20]) for _ in range(4)]
        shortest = min(self.vec_sizes)
        g = torch.Generator().manual_seed(seed * 1000 + k)
        # what the tensors start from, on the host (loaded before and after the warm-up)
        self.init = {
            "vec": [torch.arange(s, dtype=torch.float32) * (k + 1) / s for s in self.vec_sizes],
            "mat": [torch.rand(self.n, self.n, generator=g) * 2 - 1 for _ in range(3)],
            "idx_add": torch.randint(0, shortest, (L,), generator=g),  # repeats: accumulation order matters
            "idx_perm": torch.randperm(shortest, generator=g)[:L].clone(),  # unique
            "x4": torch.rand(1, 4, 32, 32, generator=g) * 2 - 1,
            "w4": (torch.rand(8, 4, 3, 3, generator=g) * 2 - 1) / 6,
        }
        with on(k):
            self.vec = [torch.empty(s, dtype=torch.float32, device=device) for s in self.vec_sizes]
            self.mat = [torch.empty(self.n, self.n, device=device) for _ in range(3)]
            self.half = [torch.empty(self.n, self.n, dtype=torch.float16, device=device) for _ in range(3)]
            self.red = [torch.empty(self.n, device=device) for _ in range(2)]
            self.idx_add = torch.empty(L, dtype=torch.int64, device=device)
            self.idx_perm = torch.empty(L, dtype=torch.int64, device=device)
            self.x4 = torch.empty(1, 4, 32, 32, device=device)
            self.w4 = torch.empty(8, 4, 3, 3, device=device)
            self.y4 = torch.empty(1, 8, 30, 30, device=device)

    def load(self, k: int) -> None:
        """(Re)load the starting values from the host (plain host-to-device copies, on stream k)."""
        with on(k):
            for t, h in zip(self.vec, self.init["vec"]):
                t.copy_(h)
            for t, h in zip(self.mat, self.init["mat"]):
                t.copy_(h)
            for t in self.half + self.red + [self.y4]:
                t.zero_()
            self.idx_add.copy_(self.init["idx_add"])
            self.idx_perm.copy_(self.init["idx_perm"])
            self.x4.copy_(self.init["x4"])
            self.w4.copy_(self.init["w4"])


owned = [Owned(k) for k in range(NSTREAMS)]


def memset(t: torch.Tensor, value: int, nbytes: int, k: int) -> None:
    """A driver memset (cuMemsetD8Async) into ``t`` on stream k: the agent sees memsets too."""
    if not cuda:
        t.view(torch.uint8)[:nbytes].fill_(value)
        return
    from cuda.bindings import driver as drv

    err, = drv.cuMemsetD8Async(t.data_ptr(), value, nbytes, streams[k].cuda_stream)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemsetD8Async: {err}")


KINDS = ["axpy", "scale", "addcmul", "tanh", "fill", "memset", "copy_same", "copy_cross", "copy_strided",
         "add_cross", "mm", "mm_half", "mv", "index_add", "index_copy", "scatter", "scatter_add",
         "index_select", "reduce_rows", "reduce_cols", "reduce_vec", "fold", "conv"]
WEIGHTS = [8, 5, 4, 3, 3, 2, 2, 3, 2, 2, 4, 2, 2, 3, 2, 2, 2, 2, 2, 2, 2, 2, 2]
if not with_conv:
    WEIGHTS[KINDS.index("conv")] = 0


def apply(kind: str, k: int, yi: int, xi: int, a: float, b: int) -> None:
    """One op of ``kind`` on stream k: y = vector yi (or matrix yi % 3), x = xi; ``a`` a float
    operand in [-1, 1), ``b`` an integer operand (offsets, byte values)."""
    o = owned[k]
    y, x = o.vec[yi], o.vec[xi]
    with on(k):
        if kind == "axpy":
            n = min(x.numel(), y.numel())
            y[:n].mul_(0.5).add_(x[:n], alpha=a)
        elif kind == "scale":
            y.mul_(0.6 + 0.3 * a).add_(1.0)
        elif kind == "addcmul":
            z = o.vec[(xi + 1) % 4]
            n = min(x.numel(), y.numel(), z.numel())
            y[:n].addcmul_(x[:n], z[:n], value=a)
        elif kind == "tanh":
            y.tanh_()
        elif kind == "fill":
            lo = b % y.numel()
            hi = lo + (b // 7) % (y.numel() - lo) + 1
            if b % 3 == 0:
                y[lo:hi].zero_()
            else:
                y[lo:hi].fill_(a)
        elif kind == "memset":
            # byte values whose float32 patterns are finite and moderate (0x3f3f3f3f is 0.75):
            # the rest of the work should not drown in NaN
            memset(y, (0x00, 0x3C, 0x3E, 0x3F, 0x40, 0xBE, 0xBF)[b % 7], 1 + b % (y.numel() * 4), k)
        elif kind == "copy_same":  # a device-to-device cudaMemcpyAsync
            n = min(x.numel(), y.numel())
            if xi != yi:
                y[:n].copy_(x[:n])
        elif kind in ("copy_cross", "copy_strided", "add_cross"):
            j = (k + 1 + b % (NSTREAMS - 1)) % NSTREAMS
            if cuda:  # after the other stream's work so far
                streams[k].wait_event(streams[j].record_event())
            src = owned[j].vec[xi]
            n = min(src.numel(), y.numel())
            if kind == "copy_cross":
                y[:n].copy_(src[:n])
            elif kind == "copy_strided":  # a copy kernel, not a memcpy
                m = min(src.numel() // 2, y.numel())
                y[:m].copy_(src[::2][:m])
            else:
                y[:n].add_(src[:n], alpha=a)
            if cuda:  # and the other stream's later writes to src wait for this read
                streams[j].wait_event(streams[k].record_event())
        elif kind in ("mm", "mm_half"):
            i = yi % 3
            p, q = o.mat[(i + 1) % 3], o.mat[(i + 2) % 3]
            if kind == "mm":
                torch.mm(p, q, out=o.mat[i])
            else:
                o.half[0].copy_(p)
                o.half[1].copy_(q)
                torch.mm(o.half[0], o.half[1], out=o.half[2])
                o.mat[i].copy_(o.half[2])
            o.mat[i].mul_(1.0 / o.n ** 0.5).tanh_()
        elif kind == "mv":
            torch.mv(o.mat[yi % 3], x[: o.n], out=o.red[xi % 2])
            y[: o.n].add_(o.red[xi % 2], alpha=a)
        elif kind == "index_add":
            if xi != yi:
                y.index_add_(0, o.idx_add, x[:L], alpha=a)
        elif kind == "index_copy":
            if xi != yi:
                y.index_copy_(0, o.idx_perm, x[:L])
        elif kind == "scatter":
            if xi != yi:
                y.scatter_(0, o.idx_perm, x[:L])
        elif kind == "scatter_add":
            if xi != yi:
                y.scatter_add_(0, o.idx_add, x[:L])
        elif kind == "index_select":
            if xi != yi:
                torch.index_select(x, 0, o.idx_add, out=y[:L])
        elif kind == "reduce_rows":
            torch.sum(o.mat[yi % 3], dim=1, out=o.red[xi % 2])
        elif kind == "reduce_cols":
            if b % 2:
                torch.amax(o.mat[yi % 3], dim=0, out=o.red[xi % 2])
            else:
                torch.mean(o.mat[yi % 3], dim=0, out=o.red[xi % 2])
        elif kind == "reduce_vec":  # a whole vector into one element: a multi-block reduction
            torch.sum(x, dim=0, keepdim=True, out=o.red[b % 2][:1])
        elif kind == "fold":
            y[: o.n].add_(o.red[xi % 2], alpha=a)
            y[: o.n].clamp_(-100.0, 100.0)
        elif kind == "conv":
            o.y4.copy_(F.conv2d(o.x4, o.w4))  # the output is a temporary (no out= for convolutions)
            o.x4[:, :, 1:31, 1:31].copy_(torch.tanh(o.y4[:, 4:]))
        else:
            raise AssertionError(kind)


def segments() -> list[tuple[int, int]]:
    return [(s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot()]


def ping() -> dict | None:
    sock = os.environ.get("GPUOS_AGENT_SOCKET")
    if not (cuda and sock):
        return None
    from gpuos_tools.agent.control import request

    return request(sock, "ping")


# warm-up: every op kind on every stream with every tensor, so that every temporary finds its
# segment already there
for k in range(NSTREAMS):
    owned[k].load(k)
if cuda:
    torch.cuda.synchronize()
for k in range(NSTREAMS):
    for kind, w in zip(KINDS, WEIGHTS):
        if not w:
            continue
        for yi in range(4):
            for xi in range(4):
                apply(kind, k, yi, xi, 0.25, 1 + 13 * yi + xi)
if cuda:
    torch.cuda.synchronize()
    from cuda.bindings import driver as drv

    for addr, size in segments():  # tensors, temporaries' leftovers and slack alike: from zero
        err, = drv.cuMemsetD8(addr, 0, size)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemsetD8: {err}")
    torch.cuda.synchronize()
for k in range(NSTREAMS):
    owned[k].load(k)
if cuda:
    torch.cuda.synchronize()
    segments_before = torch.cuda.memory_stats()["segment.all.allocated"]
agent_before = ping()

answers = []
done = threading.Event()


def snapshotter():
    from gpuos_tools.agent.control import request

    sock = os.environ["GPUOS_AGENT_SOCKET"]
    r = random.Random(seed * 7919)
    for _ in range(wanted):
        time.sleep(r.uniform(0.0, 0.004))
        if done.is_set():
            break
        answers.append(request(sock, "snapshot", digest=True, cow_budget=r.choice([0, 1 << 20, 64 << 20])))


t = threading.Thread(target=snapshotter) if wanted and cuda else None
# no cyclic garbage collection during the work: the snapshotter's allocations would move its
# moments between the runs, and with them any free of a tensor caught in a cycle
gc.collect()
gc.disable()
if t:
    t.start()
for i in range(ops):
    k = rng.randrange(NSTREAMS)
    kind = rng.choices(KINDS, WEIGHTS)[0]
    apply(kind, k, rng.randrange(4), rng.randrange(4), rng.uniform(-1, 1), rng.randrange(1 << 30))
    if t and i % 5 == 0:
        time.sleep(0.001)  # let snapshots land at different points, with work in flight
done.set()
if t:
    t.join()
gc.enable()
problems = []
if cuda:
    torch.cuda.synchronize()
    grown = torch.cuda.memory_stats()["segment.all.allocated"] - segments_before
    if grown:
        problems.append(f"the caching allocator made {grown} new segment(s) during the work")
agent_after = ping()
if agent_before is not None and (agent_before["buffers"], agent_before["bytes"]) != (agent_after["buffers"],
                                                                                   agent_after["bytes"]):
    problems.append(f"device allocations changed during the work: {agent_before['buffers']} allocations, "
                    f"{agent_before['bytes']} bytes before; {agent_after['buffers']}, {agent_after['bytes']} after")
if problems:  # the twin-run comparison would not be sound: say why, rather than report mismatches
    print("snapshot_prog_torch: " + "; ".join(problems), file=sys.stderr)
    sys.exit(3)
report = os.environ.get("GPUOS_TEST_REPORT")
if report:
    with open(report, "w") as f:
        json.dump({"answers": answers, "torch": torch.__version__,
                   "finite": [[round(float(t.isfinite().float().mean()), 4) for t in o.vec + o.mat] for o in owned],
                   "checksum": float(sum(float(t.double().sum()) for o in owned for t in o.vec + o.mat))
                   if device == "cpu" else None}, f)
