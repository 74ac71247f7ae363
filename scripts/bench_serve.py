#!/usr/bin/env python3
"""`gpu-prefetch-sched serve` against the same jobs run one after another (several jobs
under one budget).

The jobs are workloads/stencil_job.py loops of different sizes (--jobs: ARRAYSxMIB each,
--work FMAs per element, --periods repetitions). Side by side:

- alone: each job by itself, untraced, CuPy's own allocator, everything in device memory, one
  after another (the ceiling: no sharing, no movement, no agent);
- served: the jobs started together under `gpu-prefetch-sched serve --budget B --slice S` for
  each --budgets share B of their combined footprint (66% = 150% oversubscription, 50% = 200%)
  and each --slices S.

Per job: its loop's time and throughput (steps/s) against alone, its latency (process start to
exit, and from the first job's start to its loop's end), its turn waits and switches, bytes in
and out, and whether its arrays are bit-identical to alone. Aggregate: all jobs' steps over the
makespan of their loops (the first loop's start to the last one's end, wall clock) against the
sum of their loop times alone, and the serve's wall time against the alone processes' sum.
JSON to --json; a table on stderr.

    python3 scripts/bench_serve.py [--jobs 12x64,8x96,16x32] [--budgets 66%,50%] [--slices 50ms,200ms] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuos_tools.cuda.nvml import gpu_summary

ROOT = Path(__file__).resolve().parents[1]

JOB = ROOT / "workloads" / "stencil_job.py"


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    e.pop("GPUOS_AGENT_OWN", None)
    return e


def job_args(spec: str, periods: int, work: int) -> list[str]:
    arrays, mib = spec.lower().split("x")
    return ["--arrays", arrays, "--mib", mib, "--periods", str(periods), "--work", str(work)]


def alone(args: list[str], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "job.json"
        t = time.perf_counter()
        p = subprocess.run([sys.executable, str(JOB), *args, "--out", str(out)], cwd=ROOT, env=env(),
                           capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t
        if p.returncode != 0 or not out.exists():
            return {"ok": False, "rc": p.returncode, "stderr": p.stderr[-3000:], "process_s": round(wall, 3)}
        res = json.loads(out.read_text())
        return {"ok": True, "process_s": round(wall, 3), **res}


def served(jobs: list[list[str]], budget: int, slice_: str, policy: str, timeout: float,
           switch: str = "serial") -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "serve.json"
        cmd = [sys.executable, "-m", "gpuos_tools.commands.prefetch_sched", "serve", "--budget", f"{budget}B",
               "--slice", slice_, "--policy", policy, "--switch", switch, "--json", str(report)]
        for a in jobs:
            cmd += ["--job", " ".join([sys.executable, str(JOB), *a])]
        t = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t
        if not report.exists():
            return {"ok": False, "rc": p.returncode, "stderr": p.stderr[-3000:], "process_s": round(wall, 3)}
        res = json.loads(report.read_text())
        res["ok"] = p.returncode == 0
        res["rc"] = p.returncode
        res["process_s"] = round(wall, 3)
        if p.returncode != 0:
            res["stderr"] = p.stderr[-3000:]
        return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default="12x64,8x96,16x32", help="ARRAYSxMIB per job")
    ap.add_argument("--work", type=int, default=4096)
    ap.add_argument("--periods", type=int, default=20)
    ap.add_argument("--budgets", default="66%,50%")
    ap.add_argument("--slices", default="50ms,200ms", help="time slices to serve with (each budget with each)")
    ap.add_argument("--switches", default="serial,overlap", help="switch modes (each budget and slice with each)")
    ap.add_argument("--policy", default="belady")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    jobs = [job_args(s, args.periods, args.work) for s in args.jobs.split(",") if s]
    out: dict[str, Any] = {"bench": "serve", "date": time.strftime("%Y-%m-%d", time.gmtime()),
                           "host": platform.node(), "gpu": gpu_summary(), "args": vars(args), "alone": [], "served": []}
    for a in jobs:
        r = alone(a, args.timeout)
        out["alone"].append(r)
        if not r["ok"]:
            print(f"alone {a} failed: {r.get('stderr', '')}", file=sys.stderr)
            save(args, out)
            return 1
    base = out["alone"]
    footprint = sum(r["total_bytes"] for r in base)
    steps = sum(r["steps"] for r in base)
    alone_loop = sum(r["loop_s"] for r in base)
    out["footprint"] = footprint
    out["alone_agg"] = {"loop_s": round(alone_loop, 4), "steps_per_s": round(steps / alone_loop, 2),
                        "process_s": round(sum(r["process_s"] for r in base), 3)}
    save(args, out)
    rows = [(b, s, w) for b in args.budgets.split(",") if b for s in args.slices.split(",") if s
            for w in args.switches.split(",") if w]
    for spec, slice_, switch in rows:
        budget = int(footprint * float(spec.rstrip("%")) / 100)
        r = served(jobs, budget, slice_, args.policy, args.timeout, switch)
        row: dict[str, Any] = {"budget_spec": spec, "slice": slice_, "switch": switch, "budget": budget,
                               "ok": r.get("ok", False), "rc": r.get("rc"), "switches": r.get("switches"),
                               "early_grants": r.get("early_grants"), "wall_s": r.get("wall_s"),
                               "combined_peak": r.get("combined_peak"), "combined_peak_loads": r.get("combined_peak_loads"),
                               "forced_loads": r.get("forced_loads"), "jobs": []}
        if "stderr" in r:
            row["stderr"] = r["stderr"]
        t_first = min((j["output"] or {}).get("t0_unix", float("inf")) for j in r.get("jobs", [{"output": None}]))
        ends = []
        for j, ref in zip(r.get("jobs", []), base):
            o = j.get("output") or {}
            jr = {k: j.get(k) for k in ("job", "exit", "ok", "wall_s", "turn_s", "turn_waits", "turn_wait_s",
                                         "switches", "trims", "bytes_in", "bytes_out", "throughput",
                                         "evictions", "prefetches", "demand_loads", "early_grants",
                                         "ledger_waits", "forced_loads")}
            if o:
                jr["loop_s"] = o.get("loop_s")
                jr["identical"] = o.get("digests") == ref["digests"]
                jr["speed_vs_alone"] = round(ref["loop_s"] / o["loop_s"], 4)
                jr["latency_from_first_s"] = round(o["t1_unix"] - t_first, 4)
                ends.append((o["t0_unix"], o["t1_unix"], o["steps"]))
            row["jobs"].append(jr)
        if len(ends) == len(base):
            span = max(e[1] for e in ends) - min(e[0] for e in ends)
            row["agg"] = {"makespan_s": round(span, 4), "steps_per_s": round(steps / span, 2),
                          "vs_alone": round(alone_loop / span, 4)}
        out["served"].append(row)
        save(args, out)
    print(f"alone: {len(base)} jobs, footprint {footprint / 2**20:.0f} MiB, loops {alone_loop:.3f} s "
          f"({steps / alone_loop:.1f} steps/s), processes {out['alone_agg']['process_s']:.1f} s", file=sys.stderr)
    print(f"{'budget':>7} {'slice':>6} {'switch':>7} {'job':>3} {'loop_s':>7} {'alone_s':>7} {'speed':>6} {'same':>5} {'turn_s':>6} {'waits':>5} "
          f"{'wait_s':>6} {'sw':>3} {'in MiB':>7} {'out MiB':>7} {'lat_s':>6}", file=sys.stderr)
    for row in out["served"]:
        for j, ref in zip(row["jobs"], base):
            print(f"{row['budget_spec']:>7} {row['slice']:>6} {row['switch']:>7} {j['job']:>3} {j.get('loop_s') or float('nan'):>7.3f} {ref['loop_s']:>7.3f} "
                  f"{j.get('speed_vs_alone') or float('nan'):>6.3f} {str(j.get('identical', '-')):>5} "
                  f"{j.get('turn_s') or 0:>6.2f} {j.get('turn_waits') or 0:>5} {j.get('turn_wait_s') or 0:>6.2f} "
                  f"{j.get('switches') or 0:>3} {(j.get('bytes_in') or 0) / 2**20:>7.0f} "
                  f"{(j.get('bytes_out') or 0) / 2**20:>7.0f} {j.get('latency_from_first_s') or float('nan'):>6.2f}",
                  file=sys.stderr)
        agg = row.get("agg") or {}
        print(f"{row['budget_spec']:>7} {row['slice']:>6} {row['switch']:>7} all makespan {agg.get('makespan_s', float('nan')):.3f} s, "
              f"{agg.get('steps_per_s', float('nan'))} steps/s, {agg.get('vs_alone', float('nan'))} of alone; "
              f"{row['switches']} switches ({row['early_grants']} early), combined peak "
              f"{(row['combined_peak'] or 0) / 2**20:.0f} MiB (at loads {(row['combined_peak_loads'] or 0) / 2**20:.0f}, "
              f"{row['forced_loads']} forced) of {row['budget'] / 2**20:.0f}", file=sys.stderr)
    ok = all(r["ok"] and all(j.get("identical") for j in r["jobs"]) for r in out["served"])
    return 0 if ok else 1


def save(args: argparse.Namespace, out: dict[str, Any]) -> None:
    if not args.json:
        return
    slim = json.loads(json.dumps(out))
    for r in slim["alone"]:
        r.pop("digests", None)
    Path(args.json).write_text(json.dumps(slim, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
