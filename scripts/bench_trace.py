#!/usr/bin/env python3
"""Per-launch overhead of gpu-trace, traced vs untraced, side by side in one run (GPU machine).

For each workload, runs alternate untraced and traced (`gpu-trace run`, native and python
callback paths) processes; each reports
its timed window (CLOCK_MONOTONIC, the trace's clock). Launches per iteration come from the trace
(launch records inside the window). Overhead per launch = (traced - untraced) time per iteration
/ launches per iteration; medians over repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuos_tools.stream import open_input

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "scripts" / "bench_trace_workload.py"
CPUS: set[int] = set()  # every run on the same cores (--cpus), so runs differ by the tracer only


def run_workload(mode: str, iters: int, trace: Path | None, backend: str = "native") -> tuple[dict, int | None]:
    cmd = [sys.executable, str(WORKLOAD), mode, str(iters)]
    if trace is not None:
        cmd = [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--backend", backend,
               "--no-images", "-o", str(trace), "--", *cmd]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          preexec_fn=(lambda: os.sched_setaffinity(0, CPUS)) if CPUS else None)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    launches = None
    if trace is not None:
        launches = 0
        with open_input(str(trace)) as reader:
            for r in reader:
                if r["type"] == "launch" and result["t0"] <= r["ts"] <= result["t1"]:
                    launches += 1
                elif r["type"] == "exit":
                    tracer = r.get("tracer") or {}
                    if tracer.get("callback_ns") is not None and tracer.get("callbacks"):
                        # the native tracer's own time per recorded call (whole run)
                        result["callback_ns_mean"] = tracer["callback_ns"] / tracer["callbacks"]
    return result, launches


def per_iter_us(result: dict) -> float:
    return (result["t1"] - result["t0"]) / result["iters"] / 1000.0


def bench(mode: str, iters: int, reps: int, tmp: Path) -> list[dict]:
    """Untraced, native-traced and python-traced runs of one workload, interleaved per repetition."""
    variants = ["native", "python"] if mode != "cupy-floor" else ["floor"]
    untraced: list[float] = []
    traced: dict[str, list[float]] = {v: [] for v in variants}
    in_callback: dict[str, list[float]] = {v: [] for v in variants}
    lpi: list[float] = []
    for rep in range(reps):
        base, _ = run_workload("cupy" if mode == "cupy-floor" else mode, iters, None)
        untraced.append(per_iter_us(base))
        line = f"  {mode} rep {rep}: untraced {untraced[-1]:.2f}"
        for v in variants:
            if v == "floor":
                res, _ = run_workload("cupy-floor", iters, None)
                lpi.append(1.0)
            else:
                res, launches = run_workload(mode, iters, tmp / f"{mode}-{v}-{rep}.ndjson", backend=v)
                lpi.append(launches / iters)
            traced[v].append(per_iter_us(res))
            if "callback_ns_mean" in res:
                in_callback[v].append(res["callback_ns_mean"] / 1000.0)
            line += f", {v} {traced[v][-1]:.2f}"
        print(line + f" us/iter, {lpi[-1]:.1f} launches/iter", file=sys.stderr, flush=True)
    launches_per_iter = statistics.median(lpi)
    out = []
    for v in variants:
        overheads = [(t - u) / launches_per_iter for t, u in zip(traced[v], untraced)]
        out.append({
            "workload": mode,
            "tracer": v,
            "iters": iters,
            "reps": reps,
            "launches_per_iter": launches_per_iter,
            "untraced_us_per_iter": statistics.median(untraced),
            "traced_us_per_iter": statistics.median(traced[v]),
            "untraced_us_per_launch": statistics.median(untraced) / launches_per_iter,
            "overhead_us_per_launch_median": statistics.median(overheads),
            "overhead_us_per_launch_all": overheads,
            # the native callback's own time per recorded call, timed inside the program
            "in_callback_us_mean": statistics.median(in_callback[v]) if in_callback[v] else None,
        })
    return out


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cupy-iters", type=int, default=20000)
    ap.add_argument("--torch-iters", type=int, default=300)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--cpus", default="2-5", help="cores for every run, e.g. 2-5 ('' = no pinning)")
    args = ap.parse_args()
    if args.cpus:
        lo, _, hi = args.cpus.partition("-")
        CPUS.update(range(int(lo), int(hi or lo) + 1))
    with tempfile.TemporaryDirectory() as d:
        results = [
            *bench("cupy", args.cupy_iters, args.reps, Path(d)),
            *bench("cupy-floor", args.cupy_iters, args.reps, Path(d)),
            *bench("torch", args.torch_iters, args.reps, Path(d)),
        ]
    doc = {"benchmark": "bench_trace", "date": time.strftime("%Y-%m-%d"), "gpu": gpu_name(),
           "host": platform.node(), "python": platform.python_version(), "cpus": sorted(CPUS),
           "command": " ".join(sys.argv), "results": results}
    print(f"{'workload':<12} {'tracer':<8} {'launch/it':>9} {'untraced us/launch':>19} "
          f"{'overhead us/launch':>19} {'in callback us':>15}")
    for r in results:
        inside = "-" if r["in_callback_us_mean"] is None else f"{r['in_callback_us_mean']:.3f}"
        print(f"{r['workload']:<12} {r['tracer']:<8} {r['launches_per_iter']:>9.1f} "
              f"{r['untraced_us_per_launch']:>19.2f} {r['overhead_us_per_launch_median']:>19.2f} {inside:>15}")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
