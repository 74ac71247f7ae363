#!/usr/bin/env python3
"""The online policy's plans, `count` (the working sets of the next --lookahead launches), `time`
(as far ahead as the launches' durations need), `time+proactive` (with proactive eviction),
`fixed` (one plan for the learned period, each load as far ahead as the durations take to copy
it) and `fixed-lead` (the same with every load --lookahead launches ahead: no durations known),
side by side in the simulator's time model, on the CPU: SIMULATED, not measured on a GPU.

gpuos_tools/sched/online_sim.py drives OnlinePolicy launch by launch against simulate.py's two
copy engines (bandwidths --bw), the host at most --host-ahead launches ahead of the GPU.
Workloads:

- gemm: the synthetic out-of-core blocked GEMM (online_sim.blocked_gemm: 24 input blocks of
  64 MiB, 65 ms of compute per row of C, two short launches after each GEMM), repeated;
- torch: the PyTorch training step recorded on an H200 (tests/data/recorded/torch.ndjson.zst,
  predicted at range granularity, 2 MiB records: --chunk-mib), repeated --copies times as a
  training loop repeats it;
- suite-*: the validation suite's recorded CuPy and CNN traces, each repeated --copies times;
- training: a synthetic training loop (online_sim.training_step: 16 layers, activation records
  of 192 MiB, 30 launches of 33 µs a layer forward and backward), short launches over large
  records: two launches of lead are 66 µs, a record's copy 3.8 ms.

A recorded trace's compute per step is the gap to the next record (capped at 1 ms, workload.py):
an estimate, the same for both plans. Per workload, budget and plan: simulated stall (all, and
on launches decided with a period known), speed against all in memory, bytes in/out against
offline Belady's (simulate.py, the whole future known, unbounded lookahead), demand loads
against prefetches, proactive evictions, the most mapped against the budget.

    scripts/bench_sched_plan.py [--workloads gemm,torch,suite] [--budgets 66%,50%,33%] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from gpuos_tools.sched.online_sim import blocked_gemm, simulate_online, training_step
from gpuos_tools.sched.simulate import DEFAULT_BW, Config
from gpuos_tools.sched.workload import Workload, trace_workload

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "tests" / "data" / "recorded"
SUITE = ("suite-cupy_suite.s2", "suite-torch_cnn.s2")


def recorded(name: str, copies: int, chunk: int) -> Workload:
    """A recorded trace, predicted at range granularity and cut into ``chunk``-byte records (as
    `gpu-prefetch-sched --simulate` does by default: its allocations are a framework's cached
    segments, whole ones would make every working set most of the memory), its steps repeated
    ``copies`` times (a loop repeating its step; a trace that frees memory repeats its frees)."""
    return trace_workload(RECORDED / f"{name}.ndjson.zst", name, copies, chunk)


def workloads(names: list[str], copies: int, chunk: int) -> list[tuple[str, Workload]]:
    out = []
    for n in names:
        if n == "gemm":
            out.append(("gemm", blocked_gemm()))
        elif n == "torch":
            out.append(("torch", recorded("torch", copies, chunk)))
        elif n == "suite":
            out.extend((s, recorded(s, copies, chunk)) for s in SUITE)
        elif n == "training":
            out.append(("training", training_step()))
        else:
            raise SystemExit(f"unknown workload {n!r}: gemm, torch, suite or training")
    return out


def compare(w: Workload, fraction: float, bw: tuple[float, float], lookahead: int, host_ahead: int) -> list[dict[str, Any]]:
    """The plans on ``w`` at ``fraction`` of its footprint."""
    cfg = Config(int(w.footprint * fraction), bw[0], bw[1])
    rows = []
    for plan, proactive, feed in (("count", False, True), ("time", False, True), ("time", True, True),
                                  ("fixed", False, True), ("fixed", False, False)):
        t = time.perf_counter()
        r = simulate_online(w, cfg, plan=plan, lookahead=lookahead, host_ahead=host_ahead, proactive=proactive,
                            feed=feed)
        if not feed:
            r["plan"] += "-lead"
        r["cpu_s"] = round(time.perf_counter() - t, 3)
        r["fraction"] = fraction
        rows.append(r)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="gemm,torch,suite,training")
    ap.add_argument("--budgets", default="66%,50%,33%")
    ap.add_argument("--copies", type=int, default=20, help="repetitions of a recorded trace")
    ap.add_argument("--chunk-mib", type=int, default=2, help="a recorded trace's records, MiB")
    ap.add_argument("--bw", default=f"{DEFAULT_BW:.4g},{DEFAULT_BW:.4g}", help="H2D,D2H bytes/s")
    ap.add_argument("--lookahead", type=int, default=2, help="the count plan's (and the time plan's before durations)")
    ap.add_argument("--host-ahead", type=int, default=1, help="launches the host runs ahead of the GPU")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    h2d, d2h = (float(x) for x in args.bw.split(","))
    fractions = [float(b.rstrip("%")) / 100 for b in args.budgets.split(",") if b]
    rows: list[dict[str, Any]] = []
    print(f"{'workload':<22} {'budget':>6} {'plan':<14} {'stall_s':>8} {'pred_st':>8} {'speed':>6} {'in GB':>7} "
          f"{'Bel in':>7} {'out GB':>7} {'Bel out':>7} {'demand':>6} {'pref':>6} {'proact':>6} {'peak/bud':>8}",
          file=sys.stderr)
    for name, w in workloads([x for x in args.workloads.split(",") if x], args.copies, args.chunk_mib << 20):
        for frac in fractions:
            for r in compare(w, frac, (h2d, d2h), args.lookahead, args.host_ahead):
                r["workload"] = name
                rows.append(r)
                print(f"{name:<22} {frac:>6.0%} {r['plan']:<14} {r['stall_s']:>8.4f} {r['stall_predicted_s']:>8.4f} "
                      f"{r['speed_vs_in_memory']:>6.3f} {r['bytes_in'] / 1e9:>7.2f} {r['belady_bytes_in'] / 1e9:>7.2f} "
                      f"{r['bytes_out'] / 1e9:>7.2f} {r['belady_bytes_out'] / 1e9:>7.2f} {r['demand_loads']:>6} "
                      f"{r['prefetches']:>6} {r['proactive']:>6} {r['peak_mapped'] / max(r['budget'], 1):>8.3f}",
                      file=sys.stderr)
    if args.json:
        out = {"bench": "sched_plan", "simulated": True, "date": time.strftime("%Y-%m-%d", time.gmtime()),
               "host": platform.node(), "args": vars(args), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
