#!/usr/bin/env python3
"""The per-operation cost of `gpu-prefetch-sched run`'s Python path, on the CPU: the
agent's launch hook -- prediction (memoised), the executor (gpuos_tools/sched/executor.py), the
online policy (gpuos_tools/sched/online.py) and the residency engine's own hook -- replayed over
launches, with a fake driver whose copies and events complete at once (no GPU, no CUPTI; the
CUPTI callback's own cost is not in it). The engine's evict thread and the executor's mover run
as they would, so they take their share of the GIL.

Workloads:
- torch: the launches of a recorded PyTorch training step (tests/data/recorded/torch.ndjson.zst,
  92 launches, 13 allocations), repeated --steps times, their real arguments predicted by the
  agent's predictor;
- decode: one token of an LLM decode recorded under the owned allocator
  (tests/data/recorded/decode-owned.ndjson.zst, 3,057 launches, 249 records), the same way;
- cnn: a synthetic loop shaped like the CNN job's (--ops launches a step over --params parameter
  records and --acts activation records, each launch touching one parameter and two
  activations). With --shuffle the activations are handed to the step's tensors in a new order
  every step, as the owned torch cache's LIFO reuse did (no period can be learned); without, in
  the same order (the period is one step). --fills N adds N launches of one kernel on one
  activation record spread over the step, whose key comes back N times a step.

With --core the native core is in front, as under `run` (gpuos_tools/injection/csrc, built
here with the C compiler): each operation enters it through its C entry point, its memo answers
the predictions, its fast path lets an operation go by while everything it touches is in place,
and the executor replays those into its books in batches; the figures add the Python time per
operation (decisions, replays, marks for the fast path) and per replayed operation. On the
decode's token that replay cost 20 us an operation on the development VM and 24 on an H100 host.

Per run: microseconds per operation of the hook (mean over the timed steps, after --warmup
steps), the period learned, loads and evictions. JSON on stdout; --profile prints cProfile's top
functions (by own time) on stderr.

    python3 scripts/bench_oppath.py [--workload cnn|torch|decode] [--fraction 0.66] [--policy belady]
                                    [--prefetch-batch 1] [--plan count|time|fixed]
                                    [--steps 30] [--shuffle] [--core] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import struct
import sys
import tempfile
import threading
import time
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuos_tools.agent.agent import Agent
from gpuos_tools.memory.engine import ResidencyEngine
from gpuos_tools.sched.executor import Executor

ROOT = Path(__file__).resolve().parents[1]

MIB = 1 << 20


@dataclass
class Rec:
    base: int
    size: int
    resident: bool = True
    block: int = 0


class FastOps:
    """The engine's driver operations, faked: events complete at once, lookups by bisect (the
    cost of the real DriverOps' calls is not measured here)."""

    def __init__(self, recs: list[Rec]) -> None:
        self.recs = {r.base: r for r in recs}
        self.bases = sorted(self.recs)
        self._n = 0
        self.lock = threading.Lock()

    def lookup(self, addr: int):
        i = bisect_right(self.bases, addr) - 1
        if i >= 0:
            r = self.recs[self.bases[i]]
            if addr < r.base + r.size:
                return r
        return None

    def make_resident(self, base: int) -> None:
        self.recs[base].resident = True

    def release(self, base: int) -> None:
        self.recs[base].resident = False

    def copy_in(self, base, pieces, stream) -> None:
        pass

    def copy_out(self, base, pieces, stream) -> None:
        pass

    def host(self, base: int, size: int):
        return [(0x9000_0000_0000 + base, size)]

    def _next(self) -> int:
        with self.lock:
            self._n += 1
            return self._n

    def stream(self):
        return f"s{self._next()}"

    def event(self):
        return self._next()

    timer = event

    def record(self, ev, stream) -> None:
        pass

    def wait(self, stream, ev) -> None:
        pass

    def done(self, ev) -> bool:
        return True

    def synchronize(self, ev) -> None:
        pass

    def finish(self, *events) -> None:
        pass

    def destroy(self, ev) -> None:
        pass

    def elapsed_ms(self, start, end) -> float:
        return 0.0

    def sync_all(self) -> None:
        pass

    def enter(self) -> None:
        pass


class FakeLib:
    """The owned library's table and counts, as the executor reads them."""

    def __init__(self, recs: list[Rec]) -> None:
        self.recs = recs
        self.counts = {"mallocs": len(recs), "frees": 0, "reserved_bytes": sum(r.size for r in recs)}

    def stats(self) -> dict[str, int]:
        return dict(self.counts)  # the real one is one C call

    def table(self) -> list[Rec]:
        return self.recs


Launch = tuple[str, tuple[int, ...], bytes, int]  # kernel, parameter sizes, argument bytes, function handle


def torch_workload(args) -> tuple[list[tuple[int, int]], list[list[Launch]]]:
    """(allocations, launches of each step) of a recorded trace: the PyTorch step (torch), or
    one token of an LLM decode under the owned allocator (decode)."""
    from gpuos_tools.stream import open_input

    allocs: list[tuple[int, int, str]] = []
    launches: list[Launch] = []
    name, kinds = {"torch": ("torch.ndjson.zst", ("device",)),
                   "decode": ("decode-owned.ndjson.zst", ("device", "vmm"))}[args.workload]
    with open_input(ROOT / "tests" / "data" / "recorded" / name) as reader:
        for rec in reader:
            if rec.get("type") == "alloc" and rec.get("kind") in kinds:
                allocs.append((rec["addr"], rec["size"], rec["kind"]))
            elif rec.get("type") == "launch" and rec.get("params"):
                ps = rec["params"]
                launches.append((rec["kernel"], tuple(p["size"] for p in ps), bytes.fromhex("".join(p["hex"] for p in ps)),
                                 int(rec.get("func") or 0)))
    return allocs, [launches] * args.steps


def cnn_workload(args) -> tuple[list[tuple[int, int]], list[list[Launch]]]:
    """A CNN-shaped loop: parameters first, then activations; launch j of a step touches one
    parameter and two activation tensors; tensor t of step s lives in record order_s[t]."""
    rnd = random.Random(args.seed)
    base = 0x7000_0000_0000
    allocs = []
    for i in range(args.params):
        allocs.append((base, 2 * MIB, "device"))
        base += 2 * MIB
    for i in range(args.acts):
        allocs.append((base, args.act_mib * MIB, "device"))
        base += args.act_mib * MIB
    params, acts = allocs[: args.params], allocs[args.params:]
    template = [(f"k{j % 37}", j * 7 % args.params, j % args.acts, (j * 3 + 1) % args.acts) for j in range(args.ops)]
    for j in range(args.fills):  # one kernel on one block, many times a step (torch's fills of a cached block)
        template.insert(j * len(template) // args.fills, ("fill", 0, 0, 0))
    steps = []
    order = list(range(args.acts))
    for _ in range(args.steps):
        if args.shuffle:
            rnd.shuffle(order)
        step = []
        for kernel, p, a, b in template:
            ptrs = (params[p][0], acts[order[a]][0], acts[order[b]][0])
            step.append((kernel, (8, 8, 8, 4), struct.pack("<QQQi", *ptrs, 1024), 0x100 + hash(kernel) % 4096))
        steps.append(step)
    return allocs, steps


def _python_path(allocs, recs: list[Rec], ops: FastOps, cfg: dict[str, Any]):
    """The agent's launch hook itself (every operation through Python): (the agent, the
    executor, one operation)."""
    agent = Agent()
    agent.ctx = object()  # no driver: on_alloc must not look for the program's context
    for a, s, _ in allocs:
        agent.on_alloc(a, s, "device")
    agent.engine = ResidencyEngine(agent, ops)
    ex = Executor(agent.engine, cfg, lib=FakeLib(recs))
    ex.attach(agent)  # as gpuos_tools.sched.executor.attach does when the engine starts
    hook = agent.before_launch

    def op(kernel: str, sizes, argbytes: bytes, func: int) -> None:
        hook("cuLaunchKernel", 0, kernel, sizes, argbytes)

    return agent, ex, op, None


def _core_path(allocs, recs: list[Rec], ops: FastOps, cfg: dict[str, Any], build_dir: Path):
    """The native core in front, as under `run` (built here with the C compiler): each
    operation enters the core (its memo, its fast path), which calls up into the agent only when
    it must; the operations it lets go by are replayed into the scheduler's books in batches."""
    import ctypes

    from gpuos_tools.agent import agent as agent_mod
    from gpuos_tools.injection import core as core_mod
    from gpuos_tools.injection.start import AgentUpcalls
    from gpuos_tools.model import binary
    from gpuos_tools.sched import executor as executor_mod

    core = core_mod.NativeCore(core_mod.build(build_dir))
    ops.lib = FakeLib(recs)
    agent_mod.ResidencyEngine = lambda agent: ResidencyEngine(agent, ops)  # the fake driver's engine
    agent = Agent(0)
    executor_mod.attach(agent, {**cfg, "fast": True})
    upcalls = AgentUpcalls(core, agent, {1: "cuMemcpyAsync", 2: "cuMemsetD32Async"})
    lib = core.lib
    kinds = {k: i for i, k in enumerate(binary.ALLOC_KINDS)}
    for a, s, kind in allocs:  # the program's allocations, as the tracer's callback reports them
        lib.core_lock_program()
        lib.core_after_alloc(a, s, kinds.get(kind, 0))
        lib.core_unlock()
    agent.start_engine()
    upcalls.engine_started()
    ex = executor_mod._current
    enter, issued = lib.core_enter, lib.core_issued
    memo: dict[tuple, tuple] = {}

    def op(kernel: str, sizes, argbytes: bytes, func: int) -> None:
        c = memo.get((kernel, sizes, argbytes))
        if c is None:
            c = memo[(kernel, sizes, argbytes)] = ((ctypes.c_uint32 * max(1, len(sizes)))(*sizes), len(sizes),
                                                   kernel.encode(), argbytes)
        enter(1, 0, 0, 0, 0, func, c[2], c[0], c[1], c[3], len(argbytes), 0, 0, 0)
        issued()

    return agent, ex, op, core


def run(args) -> dict[str, Any]:
    allocs, steps = (cnn_workload if args.workload == "cnn" else torch_workload)(args)
    recs = [Rec(a, s) for a, s, _ in allocs]
    total = sum(s for _, s, _ in allocs)
    ops = FastOps(recs)
    cfg = {"fraction": args.fraction, "policy": args.policy, "lookahead": args.lookahead, "prepin": False,
           "batch": args.prefetch_batch, "plan": args.plan}
    if args.core:
        with tempfile.TemporaryDirectory() as build:
            agent, ex, hook, core = _core_path(allocs, recs, ops, cfg, Path(build))
    else:
        agent, ex, hook, core = _python_path(allocs, recs, ops, cfg)
    prof = cProfile.Profile() if args.profile else None
    n_timed = 0
    elapsed = 0.0
    for s, step in enumerate(steps):
        timed = s >= args.warmup
        if timed and prof is not None:
            prof.enable()
        t = time.perf_counter()
        for kernel, sizes, argbytes, func in step:
            hook(kernel, sizes, argbytes, func)
        dt = time.perf_counter() - t
        if timed:
            if prof is not None:
                prof.disable()
            elapsed += dt
            n_timed += len(step)
    if core is not None:
        ex.fast_drain()
    agent.stop_background()
    agent.engine.close()
    summ = ex.summary()
    out = {
        "workload": args.workload, "shuffle": args.shuffle, "policy": args.policy, "fraction": args.fraction,
        "records": len(allocs), "footprint": total, "ops_per_step": len(steps[0]), "steps": len(steps),
        "timed_ops": n_timed, "us_per_op": round(elapsed / max(1, n_timed) * 1e6, 2),
        "executor_us_per_op": round(summ["executor"]["before_s"] / max(1, summ["launches"]) * 1e6, 2),
        "periods": summ["periods"], "predicted": summ["predicted"], "launches": summ["launches"],
        "loads": summ["loads"], "demand_loads": summ["demand_loads"], "evictions": summ["evictions"],
        "period_breaks": summ["policy_stats"]["period_breaks"], "plan": args.plan,
    }
    if args.plan == "fixed":
        st = summ["policy_stats"]
        out.update(fixed_plans=st["fixed_plans"], fixed_launches=st["fixed_launches"], fixed_ends=st["fixed_ends"],
                   fixed_end=st["fixed_end"], fixed=st["fixed"], fixed_acting_decisions=st["fixed_acting_decisions"],
                   fixed_other_decisions=st["fixed_other_decisions"])
    if core is not None:
        fast = summ["fast"]
        py = summ["executor"]["before_s"] + fast["replay_s"] + fast["after_s"]
        out.update(core=True, fast_on=fast["on"], fast_off=fast.get("off"), fast_operations=fast.get("operations", 0), upcalls=core.counters()["upcalls"],
                   python_us_per_op=round(py / max(1, summ["launches"]) * 1e6, 2),
                   replay_us_per_op=round(fast["replay_s"] / max(1, fast["replayed"]) * 1e6, 2),
                   calls_why=fast.get("calls_why"), fast_allowances=summ["executor"]["fast_allowances"],
                   fast_allowed_none=summ["executor"]["fast_allowed_none"])
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.profile_top)
        print(buf.getvalue(), file=sys.stderr)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("cnn", "torch", "decode"), default="cnn")
    ap.add_argument("--fraction", type=float, default=0.66, help="budget: share of the owned bytes")
    ap.add_argument("--policy", choices=("belady", "lru"), default="belady")
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--prefetch-batch", type=int, default=1, help="run --prefetch-batch")
    ap.add_argument("--plan", choices=("count", "time", "fixed"), default="count", help="run --plan")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="steps not timed")
    ap.add_argument("--ops", type=int, default=540, help="cnn: launches a step")
    ap.add_argument("--params", type=int, default=62, help="cnn: parameter records (2 MiB)")
    ap.add_argument("--acts", type=int, default=120, help="cnn: activation records")
    ap.add_argument("--act-mib", type=int, default=16, help="cnn: MiB of an activation record")
    ap.add_argument("--shuffle", action="store_true", help="cnn: activations in a new order every step")
    ap.add_argument("--fills", type=int, default=0,
                    help="cnn: launches of one kernel on one record spread over the step (its key repeats)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--core", action="store_true",
                    help="the native core in front (built with the C compiler), with its fast path, as under run")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps (stderr)")
    ap.add_argument("--profile-top", type=int, default=30)
    args = ap.parse_args()
    if args.steps <= args.warmup:
        print("bench_oppath: --steps must exceed --warmup", file=sys.stderr)
        return 2
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
