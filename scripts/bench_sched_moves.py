#!/usr/bin/env python3
"""Where the online policy's bytes go, on the traces recorded on the device: SIMULATED on the CPU.

Each recorded trace (tests/data/recorded, predicted at range granularity) is repeated --copies
times as a training loop repeats its step, and driven launch by launch through the online
policy as the executor drives it (gpuos_tools/sched/online_sim.py, the count plan by default),
at each budget (a share of the trace's working footprint: the most it keeps resident with no
budget). Records are the trace's allocations (``alloc``: what the executor moves, an owned
record each) or 2 MiB pieces of them (``2MiB``). Per period in steady state (the mean over the
periods after the first two) and in all:

- bytes in and out, demand loads and prefetches of the online policy;
- Belady's MIN on the same access sequence (demand loads only, the whole future known), and
  MIN that also copies nothing the next access overwrites whole and saves nothing dead;
- each byte of the online policy put in a class (gpuos_tools/sched/moves.py): loads ``unused``
  / ``overwritten`` / ``learning`` / ``early_victim`` / ``capacity``, saves ``dead`` / ``learning``
  / ``early_victim`` / ``capacity``;
- what a percentage budget became (`run --budget N%`: a share of the steady working set once a
  period is learned) against the same share of the footprint;
- the decisions per period that move something (``acting``: under `run` on the native core the
  operations of the others take the fast path), with --prefetch-batch as `run` takes it;
- a fixed plan, the same every period (moves.py ``fixed_plan``: each record pinned, or dropped
  over gaps between its uses and loaded two steps before the next use where the room allows):
  bytes in and moves per period, ``*`` where it cannot fit the budget.


A workload that names a file (``gpu-trace run -o FILE`` of a training loop) is read from it; with
``--copies 1`` and ``--period N`` (the launches, copies and memsets of one step) its own steps are
the periods.

    scripts/bench_sched_moves.py [--workloads torch,suite-torch_cnn.s2,...|FILE] [--budgets 66%,50%] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from gpuos_tools.sched.moves import belady_min, classify, fixed_plan
from gpuos_tools.sched.online_sim import simulate_online
from gpuos_tools.sched.simulate import DEFAULT_BW, Config
from gpuos_tools.sched.workload import Workload, trace_workload

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "tests" / "data" / "recorded"
DEFAULT = "torch,suite-torch_cnn.s1,suite-torch_cnn.s2,suite-cupy_suite.s1,suite-cupy_suite.s2"


def recorded(name: str, copies: int, chunk: int | None) -> Workload:
    path = Path(name) if "/" in name or name.endswith((".ndjson", ".zst")) else RECORDED / f"{name}.ndjson.zst"
    return trace_workload(path, name, copies, chunk)


def measure(w: Workload, period: int, fraction: float, plan: str, lookahead: int, batch: int = 1) -> dict[str, Any]:
    budget = int(w.footprint * fraction)
    events: list[tuple] = []
    cfg = Config(budget, DEFAULT_BW, DEFAULT_BW)
    r = simulate_online(w, cfg, plan=plan, lookahead=lookahead, events=events, batch=batch)
    c = classify(w, events, period)
    pct = simulate_online(w, cfg, plan=plan, lookahead=lookahead, fraction=fraction, batch=batch)
    steady = c["steady"] or c["total"]
    return {
        "fraction": fraction, "budget": budget, "footprint": w.footprint, "period_steps": period,
        "online": {k: steady[k] for k in ("bytes_in", "bytes_out", "demand_loads", "prefetches")},
        "online_total": {k: c["total"][k] for k in ("bytes_in", "bytes_out", "demand_loads", "prefetches")},
        "classes_in": steady["in"], "classes_out": steady["out"],
        "classes_in_total": c["total"]["in"], "classes_out_total": c["total"]["out"],
        "belady_min": belady_min(w, budget, period)["steady"],
        "belady_min_skip": belady_min(w, budget, period, skip_dead=True)["steady"],
        "planner_belady_total": {"bytes_in": r["belady_bytes_in"], "bytes_out": r["belady_bytes_out"]},
        "stall_s": r["stall_s"], "periods": r["periods"],
        # decisions that moved something, per period (on the native core the others take the fast path)
        "acting_per_period": round(r["acting"] * period / max(len(w.steps), 1), 2),
        "percentage": {"budget": pct["budget"], "bytes_in": pct["bytes_in"], "bytes_out": pct["bytes_out"]},
        "fixed": fixed_plan(w, budget, period) if len(w.steps) >= 3 * period else None,
    }


def _fixed(fx: dict[str, Any] | None) -> str:
    """The fixed plan's bytes in (MB; * where it cannot fit the budget) and moves, per period."""
    if fx is None:
        return f"{'-':>8} {'-':>5}"
    return f"{fx['bytes_in'] / 1e6:>7.1f}{' ' if fx['fits'] else '*'} {fx['moves']:>5}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=DEFAULT, help="recorded traces (names in tests/data/recorded)")
    ap.add_argument("--budgets", default="66%,50%")
    ap.add_argument("--records", default="alloc,2MiB", help="alloc (whole allocations) and/or 2MiB pieces")
    ap.add_argument("--copies", type=int, default=20, help="repetitions of a trace (periods)")
    ap.add_argument("--period", type=int, default=0, help="steps of one period (default: the trace's, repeated)")
    ap.add_argument("--plan", default="count", choices=("count", "time", "fixed"))
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--prefetch-batch", type=int, default=1, help="run --prefetch-batch (the count plan)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.prefetch_batch < 1:
        raise SystemExit("--prefetch-batch: 1 or more")
    if args.copies < 1 or (args.copies < 3 and not args.period):
        raise SystemExit("--copies: at least 3 (the steady state is the periods after the first two), or --period")
    fractions = [float(b.rstrip("%")) / 100 for b in args.budgets.split(",") if b]
    rows: list[dict[str, Any]] = []
    mb = 1e6
    print(f"{'workload':<20} {'rec':<5} {'bud':>4} | {'in MB':>7} {'out MB':>7} {'dem':>5} {'pref':>5} | "
          f"{'MIN in':>7} {'out':>7} | {'skip in':>7} {'out':>7} | in: {'unus':>5} {'over':>5} {'learn':>5} {'early':>5} {'cap':>7}"
          f" | out: {'dead':>5} {'learn':>5} {'early':>5} {'cap':>7} | {'N% of steady':>12} | {'acting':>6}"
          f" | {'fixed in':>8} {'moves':>5}", file=sys.stderr)
    for name in [x for x in args.workloads.split(",") if x]:
        for rec in [x for x in args.records.split(",") if x]:
            if rec not in ("alloc", "2MiB"):
                raise SystemExit(f"--records: alloc or 2MiB, not {rec!r}")
            w = recorded(name, args.copies, None if rec == "alloc" else 2 << 20)
            period = args.period or len(w.steps) // args.copies
            for frac in fractions:
                r = measure(w, period, frac, args.plan, args.lookahead, args.prefetch_batch)
                r.update(workload=name, records=rec, plan=args.plan)
                rows.append(r)
                o, m, s, ci, co = r["online"], r["belady_min"], r["belady_min_skip"], r["classes_in"], r["classes_out"]
                print(f"{name:<20} {rec:<5} {frac:>4.0%} | {o['bytes_in'] / mb:>7.1f} {o['bytes_out'] / mb:>7.1f} "
                      f"{o['demand_loads']:>5.1f} {o['prefetches']:>5.1f} | {m['bytes_in'] / mb:>7.1f} {m['bytes_out'] / mb:>7.1f} | "
                      f"{s['bytes_in'] / mb:>7.1f} {s['bytes_out'] / mb:>7.1f} | in: {ci['unused'] / mb:>5.1f} {ci['overwritten'] / mb:>5.1f} "
                      f"{ci['learning'] / mb:>5.1f} {ci['early_victim'] / mb:>5.1f} {ci['capacity'] / mb:>7.1f} | out: "
                      f"{co['dead'] / mb:>5.1f} {co['learning'] / mb:>5.1f} {co['early_victim'] / mb:>5.1f} "
                      f"{co['capacity'] / mb:>7.1f} | {r['percentage']['budget'] / mb:>9.1f} MB | "
                      f"{r['acting_per_period']:>6.1f} | {_fixed(r['fixed'])}", file=sys.stderr)
    if args.json:
        out = {"bench": "sched_moves", "simulated": True, "date": time.strftime("%Y-%m-%d", time.gmtime()),
               "host": platform.node(), "args": vars(args), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
