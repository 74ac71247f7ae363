#!/usr/bin/env python3
"""`gpu-prefetch-sched run` against all-in-HBM on a CuPy stencil loop (the 150%-oversubscription
target in DESIGN.md).

The job is workloads/stencil_job.py: --arrays float32 arrays of --mib MiB; step s reads
arrays s..s+2 and writes s+3 (mod n), --work fused multiply-adds per element (the arithmetic
intensity); --periods repetitions of the n steps. For each --work value, side by side:

- hbm:    the job alone, untraced, CuPy's own allocator, everything in device memory (ceiling);
- run100: under `gpu-prefetch-sched run --budget 100%` (agent, owned memory, policy on, nothing
          to move: the cost of the python-callback agent and the policy on the launch path);
- each --budgets value (default 66% = 150% oversubscription, 50% = 200%, 33.34% = 300%: the
          default job's 12 arrays make 33% hold 3.96 arrays, less than a step's 4) with each
          --policies and each --plans (`run --plan`: count, the default, named <B>-<policy>;
          time, named <B>-<policy>-time; proactive, `--plan time --proactive`, named
          <B>-<policy>-proactive; bN, the count plan with --prefetch-batch N, named
          <B>-<policy>-bN; fixed, `--plan fixed`, named <B>-<policy>-fixed; side by side;
          --plan-bw gives the time plan's link);
- <B>-nodigest: at each --nodigest-work intensity, each budget again with the engine's digest
          check off (GPUOS_ENGINE_NO_DIGEST=1: every eviction of a record the predictor counts
          as written is saved), side by side with the same budget's run with it on;
- <B>-nolastuse: at each --nolastuse-work intensity (--nolastuse for the GEMM), each budget
          again with every eviction's save after everything the program enqueued
          (GPUOS_SCHED_LAST_USE=0), not after the record's last use;
- <B>-nopark: at each --nopark-work intensity, each budget again with parking off
          (GPUOS_ENGINE_NO_PARK=1: released physical memory goes back to the driver, and each
          load creates new memory, whose clearing by the driver halves host-to-device copies;
          gpuos_tools/sched/executor.py, "Parking"), side by side with the run with it on;
- c-*:    the read-mostly variant (stencil_job.py --coeffs N: N more arrays that every period
          reads once and never writes, as an LLM's weights) at --coeffs-work, at each
          --coeffs-budgets budget with the digest check on and off, against its own hbm run.

- um<B>:  the fault-driven managed-memory baseline at each --um budget, at each --um-work
          intensity: the same job with its arrays in CUDA managed memory under the same software
          budget (B of the arrays' bytes); before each kernel the least recently used whole
          arrays are pushed to the host (cuMemPrefetchAsync to the host, stream-ordered) until
          the kernel's arrays fit, and nothing is prefetched back: the kernel faults them in.
          An emulation of the driver's eviction under pressure, done explicitly (the job never
          allocates more managed memory than the GPU has free; stencil_job.py --managed).
          um100 evicts nothing (managed memory resident on the GPU). Per row: speed vs hbm, and
          ours_vs_um = this UM row's loop time / the Belady run's at the same budget.

--job gemm runs workloads/gemm_job.py instead (an out-of-core blocked GEMM, C += A B in 64 MiB
float32 blocks, compute-bound: --gemm-args passes its options), with no intensity sweep: hbm,
run100, each budget x policy x plan, `manual` (the hand-written double-buffered loop a user
would write instead: B on the GPU, rows of A and C streamed through two slots; the upper bound
to quote, at the share of the job's bytes it keeps on the GPU, `device_share`; --no-manual skips
it) and the managed-memory baseline at each --um budget.

A discarded hbm job runs first (--no-warmup skips it): the first job on a freshly started GPU
machine ran its loop 1.5x slower than the same job next, which would skew every ratio.

Per run: the loop's wall time (the job synchronises before and after), speed relative to hbm
(hbm_s / run_s), whether the final arrays are bit-identical to hbm's, and the summary record
(bytes in/out, loads, prefetches, demand loads, evictions, stalls, peak mapped bytes). Also the
transfer floor: bytes moved / --link-gbps (one direction's pinned bandwidth), against the
loop's time. JSON to --json; a table on stderr.

    python3 scripts/bench_online.py [--work 1024,4096] [--budgets 66%,50%,33.34%]
                                    [--um 100%,66%,50%,33.34%] [--um-work 1024,4096]
                                    [--nodigest-work 1024] [--coeffs 12] [--json FILE]

The defaults take ~170 s on an H100 (26 runs; 2026-11-24: --work was 1024,2048,4096,16384 before 300%
and the digest rows were added; 2048 and 16384 are in BENCHMARKS.md from then).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuos_tools.cuda.nvml import gpu_summary

ROOT = Path(__file__).resolve().parents[1]

JOBS = {"stencil": ROOT / "workloads" / "stencil_job.py", "gemm": ROOT / "workloads" / "gemm_job.py"}


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    e.pop("GPUOS_AGENT_OWN", None)
    return e


def run_job(job_args: list[str], sched: list[str] | None, timeout: float,
            extra_env: dict[str, str] | None = None, job: str = "stencil") -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "job.json"
        cmd = [sys.executable, str(JOBS[job]), *job_args, "--out", str(out)]
        if sched is not None:
            cmd = [sys.executable, "-m", "gpuos_tools.commands.prefetch_sched", "run", *sched, "--", *cmd]
        t = time.perf_counter()
        e = env()
        e.pop("GPUOS_ENGINE_NO_DIGEST", None)
        e.pop("GPUOS_ENGINE_NO_PARK", None)
        e.update(extra_env or {})
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"ok": False, "rc": "timeout", "stderr": "", "process_s": round(time.perf_counter() - t, 3)}
        wall = time.perf_counter() - t
        if p.returncode != 0 or not out.exists():
            return {"ok": False, "rc": p.returncode, "stderr": p.stderr[-3000:], "process_s": wall}
        res = json.loads(out.read_text())
        res["ok"] = True
        res["process_s"] = round(wall, 3)
        if sched is not None:
            recs = [json.loads(x) for x in p.stdout.splitlines() if x.strip()]
            res["summary"] = recs[-1] if recs and recs[-1].get("type") == "sched_summary" else None
        return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=sorted(JOBS), default="stencil",
                    help="stencil (default) or gemm: the out-of-core blocked GEMM (its own options in --gemm-args)")
    ap.add_argument("--gemm-args", default="", help="--job gemm: workloads/gemm_job.py's options (default: its own)")
    ap.add_argument("--arrays", type=int, default=12)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--periods", type=int, default=40)
    ap.add_argument("--work", default="1024,4096")
    ap.add_argument("--budgets", default="66%,50%,33.34%")
    ap.add_argument("--policies", default="belady")
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--plans", default="count",
                    help="run --plan values, each at every budget and policy (count,time,proactive,fixed; bN: the "
                    "count plan with --prefetch-batch N)")
    ap.add_argument("--plan-bw", default="", help="run --plan-bw for the time plan (empty: the command's default)")
    ap.add_argument("--extra-work", type=int, default=1024,
                    help="at this --work also run 66%% with lru and with lookahead 1 (0: no extra runs)")
    ap.add_argument("--um", default="100%,66%,50%,33.34%",
                    help="budgets of the fault-driven managed-memory baseline (empty: none)")
    ap.add_argument("--um-work", default="1024,4096", help="the --work values that get the managed-memory runs")
    ap.add_argument("--nopark-work", default="1024",
                    help="intensities whose budgets also run with parking off (empty: none)")
    ap.add_argument("--nolastuse-work", default="",
                    help="intensities whose budgets also run with saves after everything enqueued, "
                         "not after the record's last use (GPUOS_SCHED_LAST_USE=0; empty: none)")
    ap.add_argument("--nolastuse", action="store_true", help="--job gemm: each budget also with GPUOS_SCHED_LAST_USE=0")
    ap.add_argument("--nodigest-work", default="1024",
                    help="the --work values whose budgets also run with the digest check off (empty: none)")
    ap.add_argument("--coeffs", type=int, default=12, help="read-only arrays of the read-mostly variant (0: none)")
    ap.add_argument("--coeffs-work", type=int, default=1024)
    ap.add_argument("--coeffs-budgets", default="66%")
    ap.add_argument("--link-gbps", type=float, default=50.0, help="one direction's pinned copy bandwidth, for the floor")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the discarded first hbm job (a fresh GPU machine's first job runs slower)")
    ap.add_argument("--no-manual", dest="manual", action="store_false",
                    help="--job gemm: skip the hand-written double-buffered loop (gemm_job.py --manual)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.job == "gemm":
        args.nodigest_work = args.nopark_work = ""  # the stencil's intensity sweeps
    if any(x not in ("count", "time", "proactive", "fixed") and not re.fullmatch(r"b[1-9][0-9]*", x)
           for x in args.plans.split(",") if x):
        ap.error("--plans: count, time, proactive, fixed and/or bN (N 1 or more)")

    rows: list[dict[str, Any]] = []
    gemm = args.job == "gemm"
    works = [0] if gemm else [int(w) for w in args.work.split(",") if w]

    def job_of(work: int) -> list[str]:
        if gemm:
            return shlex.split(args.gemm_args)
        return ["--arrays", str(args.arrays), "--mib", str(args.mib), "--periods", str(args.periods), "--work", str(work)]

    if args.warmup and works:
        # discarded: the first job on a freshly started GPU machine ran its loop 1.5x slower
        # (H200: 0.471 s against 0.318 s for the same hbm loop run next), which skews every ratio
        run_job(job_of(works[0]), None, args.timeout, job=args.job)
    for work in works:
        job = job_of(work)
        hbm = run_job(job, None, args.timeout, job=args.job)
        rows.append({"work": work, "config": "hbm", **hbm})
        if not hbm.get("ok"):
            print(f"hbm run failed (work {work}): {hbm.get('stderr', '')}", file=sys.stderr)
            continue
        look = args.lookahead
        plans = [x for x in args.plans.split(",") if x]
        configs = [("run100", "100%", "belady", look)] + [
            (f"{b}-{p}" + ("" if plan == "count" else f"-{plan}"), b, p, look)
            for b in args.budgets.split(",") if b for p in args.policies.split(",") if p for plan in plans]
        if work == args.extra_work and not gemm:
            configs += [("66%-lru", "66%", "lru", look), ("66%-look1", "66%", "belady", 1)]
        if str(work) in args.nodigest_work.split(","):
            configs += [(f"{b}-nodigest", b, "belady", look) for b in args.budgets.split(",") if b]
        if str(work) in args.nopark_work.split(","):
            configs += [(f"{b}-nopark", b, "belady", look) for b in args.budgets.split(",") if b]
        if gemm and args.nolastuse or str(work) in args.nolastuse_work.split(","):
            configs += [(f"{b}-nolastuse", b, "belady", look) for b in args.budgets.split(",") if b]
        for name, budget, policy, la in configs:
            rows.append(run_ours(args, job, hbm, work, name, budget, policy, la))
            save(args, rows)
        if gemm and args.manual:
            r = run_job([*job, "--manual"], None, args.timeout, job="gemm")
            row = {"work": work, "config": "manual", **r}
            if r.get("ok"):
                row["identical"] = r["digests"] == hbm["digests"]
                row["speed_vs_hbm"] = round(hbm["loop_s"] / r["loop_s"], 4)
                row["device_share"] = round(r["device_bytes"] / r["total_bytes"], 4)
            else:
                print(f"manual failed: {r.get('stderr', '')}", file=sys.stderr)
            rows.append(row)
            save(args, rows)
        if args.coeffs and work == args.coeffs_work and not gemm:
            cjob = [*job, "--coeffs", str(args.coeffs)]
            chbm = run_job(cjob, None, args.timeout)
            rows.append({"work": work, "config": "c-hbm", **chbm})
            if chbm.get("ok"):
                for b in [b for b in args.coeffs_budgets.split(",") if b]:
                    for suffix in ("", "-nodigest"):
                        rows.append(run_ours(args, cjob, chbm, work, f"c-{b}{suffix}", b, "belady", look))
                        save(args, rows)
        if gemm or str(work) in args.um_work.split(","):
            for budget in [b for b in args.um.split(",") if b]:
                frac = float(budget.rstrip("%")) / 100
                r = run_job([*job, "--managed", str(frac)], None, args.timeout, job=args.job)
                row = {"work": work, "config": f"um{budget.rstrip('%')}", "budget_spec": budget, **r}
                if r.get("ok"):
                    row["identical"] = r["digests"] == hbm["digests"]
                    row["speed_vs_hbm"] = round(hbm["loop_s"] / r["loop_s"], 4)
                    row["step_ms"] = round(1e3 * r["loop_s"] / r["steps"], 4)
                    for key, name in (("ours", f"{budget}-belady"), ("ours_nodigest", f"{budget}-nodigest")):
                        mine = next((x for x in rows if x["work"] == work and x["config"] == name and x.get("ok")), None)
                        if mine is not None and budget != "100%":
                            row[f"{key}_config"] = mine["config"]
                            row[f"{key}_vs_um"] = round(r["loop_s"] / mine["loop_s"], 3)
                else:
                    print(f"um {budget} failed (work {work}): {r.get('stderr', '')}", file=sys.stderr)
                rows.append(row)
                save(args, rows)

    save(args, rows)
    print(f"{'work':>5} {'config':<22} {'loop_s':>8} {'speed':>6} {'same':>5} {'in MB':>7} {'out MB':>7} "
          f"{'pref':>5} {'dem':>4} {'evict':>5} {'skip':>5} {'stall':>5} {'peak MB':>8} {'budget MB':>9} {'floor_s':>7}",
          file=sys.stderr)
    for r in rows:
        if r["config"].startswith("um"):
            continue
        s = r.get("summary") or {}
        print(f"{r['work']:>5} {r['config']:<22} {r.get('loop_s', float('nan')):>8.4f} {r.get('speed_vs_hbm', 1.0):>6.3f} "
              f"{str(r.get('identical', '-')):>5} {s.get('bytes_in', 0) / 1e6:>7.0f} {s.get('bytes_out', 0) / 1e6:>7.0f} "
              f"{s.get('prefetches', 0):>5} {s.get('demand_loads', 0):>4} {s.get('evictions', 0):>5} "
              f"{s.get('digest_skips', 0):>5} "
              f"{s.get('stalls', 0):>5} {s.get('peak_settled', 0) / 1e6:>8.0f} {s.get('budget', 0) / 1e6:>9.0f} "
              f"{r.get('floor_s', 0):>7.4f}", file=sys.stderr)
    um = [r for r in rows if r["config"].startswith("um")]
    if um:
        print(f"{'work':>5} {'config':<6} {'loop_s':>8} {'step ms':>8} {'vs hbm':>7} {'same':>5} {'out GB':>7} "
              f"{'fault GB':>8} {'ours':>6} {'ours/um':>8} {'nodig/um':>8}", file=sys.stderr)
        for r in um:
            ours = next((x for x in rows if x["config"] == r.get("ours_config") and x["work"] == r["work"]), {})
            print(f"{r['work']:>5} {r['config']:<6} {r.get('loop_s', float('nan')):>8.3f} {r.get('step_ms', 0):>8.3f} "
                  f"{r.get('speed_vs_hbm', 0):>7.4f} {str(r.get('identical', '-')):>5} "
                  f"{r.get('um_evicted_bytes', 0) / 1e9:>7.2f} {r.get('um_faulted_bytes', 0) / 1e9:>8.2f} "
                  f"{ours.get('speed_vs_hbm', float('nan')):>6.3f} {r.get('ours_vs_um', float('nan')):>8.2f} "
                  f"{r.get('ours_nodigest_vs_um', float('nan')):>8.2f}", file=sys.stderr)
    return 0 if all(r.get("ok") and r.get("identical", True) for r in rows) else 1


def run_ours(args: argparse.Namespace, job: list[str], hbm: dict[str, Any], work: int, name: str, budget: str,
         policy: str, la: int) -> dict[str, Any]:
    """One run under `gpu-prefetch-sched run` (a name ending in -nodigest: with the digest
    check off; in -nopark: with parking off; in -nolastuse: with saves after everything enqueued; in -time: with the time plan; in -proactive: and its proactive evictions; in -bN: with --prefetch-batch N; in -fixed: with the fixed plan), compared with ``hbm``."""
    extra = ({"GPUOS_ENGINE_NO_DIGEST": "1"} if name.endswith("-nodigest")
             else {"GPUOS_ENGINE_NO_PARK": "1"} if name.endswith("-nopark")
             else {"GPUOS_SCHED_LAST_USE": "0"} if name.endswith("-nolastuse") else None)
    proactive = name.endswith("-proactive")
    plan = "time" if name.endswith("-time") or proactive else "fixed" if name.endswith("-fixed") else "count"
    opts = ["--budget", budget, "--policy", policy, "--lookahead", str(la), "--plan", plan]
    if proactive:
        opts.append("--proactive")
    batch = re.search(r"-b([0-9]+)$", name)
    if batch:
        opts += ["--prefetch-batch", batch.group(1)]
    if plan == "time" and args.plan_bw:
        opts += ["--plan-bw", args.plan_bw]
    r = run_job(job, opts, args.timeout, extra, job=args.job)
    row: dict[str, Any] = {"work": work, "config": name, "budget_spec": budget, "policy": policy, "lookahead": la,
                           "plan": plan, "proactive": proactive,
                           "digest_check": not name.endswith("-nodigest"), "park": not name.endswith("-nopark"), **r}
    if r.get("ok"):
        row["identical"] = r["digests"] == hbm["digests"]
        row["speed_vs_hbm"] = round(hbm["loop_s"] / r["loop_s"], 4)
        s = r.get("summary") or {}
        moved = max(s.get("bytes_in", 0), s.get("bytes_out", 0))
        row["floor_s"] = round(moved / (args.link_gbps * 1e9), 6)
        row["within_budget"] = (s.get("over_physical") == 0 and s.get("peak_settled", 0) <= s.get("budget", 0))
    else:
        print(f"{name} failed (work {work}): {r.get('stderr', '')}", file=sys.stderr)
    return row


def save(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The JSON so far (after every run: a call cut short keeps what it measured)."""
    if not args.json:
        return
    out = {"bench": "online", "date": time.strftime("%Y-%m-%d", time.gmtime()), "host": platform.node(),
           "gpu": gpu_summary(), "args": vars(args), "rows": [{k: v for k, v in r.items() if k != "digests"} for r in rows]}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
