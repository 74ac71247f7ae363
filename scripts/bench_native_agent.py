#!/usr/bin/env python3
"""What the agent costs a real training loop: the same loop untraced, under the native tracer,
under the agent on its native core (before and after a first snapshot, when every launch's write
set is tracked), under `gpu-prefetch-sched run --budget 100%`, and under the Python agent.

    bench_native_agent.py [--models resnet50,mlp] [--configs A,B,...] [--steps N] [--repeat R] [--json OUT]

A configuration's name says what differs from the tools' defaults, and nothing else: `agent` and
`sched_100` run as a user's `gpu-ckpt run` and `gpu-prefetch-sched run --budget 100%` do (the
agent on driver-API interception, the scheduler's fast path on); `_cupti` puts the agent on CUPTI
callbacks instead, `_intercept` on interception whatever the default, `_slow` turns the scheduler's
fast path off (GPUOS_SCHED_FAST=0). The caller's GPUOS_AGENT_MECHANISM and GPUOS_SCHED_FAST never
leak in. --configs picks from the default list and more, asked for by name so that the default keeps
its running time: `agent_cupti_after_snapshot`, `sched_100_cupti`, `sched_100_slow`, and the
scheduler below the footprint, at --budget 66% (`sched_66`, `sched_66_slow`, `sched_66_cupti`,
`sched_66_slow_cupti`; `sched_66_time` plans by time, --plan time, and `sched_66_fixed` with a fixed plan,
--plan fixed, `sched_66_fixed_keepdead` the same saving and loading records whose torch blocks are
all freed like the others, GPUOS_ENGINE_KEEP_DEAD=1, `sched_66_fixed_deadplan` with a plan that asks
where records are dead and drops them there, GPUOS_SCHED_DEAD_PLAN=1, `sched_66_fixed_slackN` with
the plan made at N % of the budget less, --slack N% (5, 10, 20), `sched_66_fixed_lateleads` with a
plan that makes loads later than their copies take before it drops more, GPUOS_SCHED_KEEP_LEADS=0
(and with `_slack10`); `sched_66_nolastuse` orders
each eviction's save after everything enqueued, GPUOS_SCHED_LAST_USE=0; `sched_66_b4` prefetches in
batches, --prefetch-batch 4). Two more take `--budget 100%` apart, where the scheduler does nothing but
the program's memory is owned (torch through the owned allocator's pluggable allocator and its
cache): `plain_owned`, the untraced loop with only that allocator installed (no agent: what owned
memory alone costs the loop), and `agent_owned`, `gpu-ckpt run` with GPUOS_AGENT_OWN=torch (the
agent and the residency engine on owned memory, no scheduler). `plain_owned` keeps the cache's
counts (`owned`: hits, misses, cached blocks, events, ...).
The scheduler's runs keep their `sched_summary` (evictions, loads, the fast path's counts): a 66%
run that evicted nothing measured no oversubscription, and the table says so.

Runs workloads/train_steps.py (timm ResNet-50 bf16 batch 64, ~900 launches a step; a
small MLP with Adam(foreach=True), ~35) once per configuration, one after another on the same
GPU; each run reports its own median step (after its warm-up). Successive processes of the same
loop differ by up to ~10 % on an H100 (a host-bound loop by more), so --repeat R runs the whole list
of configurations R times, interleaved (config order rotated each round), and reports per
configuration the median of its runs' medians and their spread; ratios are against the untraced
runs of the same model in the same call. --cpus LIST pins every run to those CPUs (taskset's
list syntax): a host-bound loop's step depends on which core the scheduler put it on. The agent's
own time per operation comes from the core's counters in the trace's exit record; the host's time
to issue a step (`enqueue_median_s`, the table's "issue ms") says whether the loop waited for the
GPU (well below the step) or the GPU for the host (near it). JSON to --json, a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuos_tools.injection.config import DEFAULT_MECHANISM

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "workloads" / "train_steps.py"
CMD = {"trace": ["gpu-trace", "run"], "ckpt": ["gpu-ckpt", "run"], "sched": ["gpu-prefetch-sched", "run"]}
CONFIGS = ("plain", "trace", "agent", "agent_cupti", "agent_after_snapshot", "sched_100", "agent_python",
           "plain_again")
OPTIONAL = ("agent_intercept", "agent_cupti_after_snapshot", "sched_100_cupti", "sched_100_slow", "sched_66",
            "sched_66_slow", "sched_66_cupti", "sched_66_slow_cupti", "sched_66_time", "sched_66_nolastuse", "sched_66_b4",
            "sched_66_fixed", "sched_66_fixed_keepdead", "sched_66_fixed_deadplan", "sched_66_fixed_slack5",
            "sched_66_fixed_slack10", "sched_66_fixed_slack20", "sched_66_fixed_lateleads",
            "sched_66_fixed_lateleads_slack10", "plain_owned", "agent_owned")
AGENT = ("agent", "agent_cupti", "agent_intercept", "agent_after_snapshot", "agent_cupti_after_snapshot",
         "agent_python", "agent_owned")
#: the configurations whose program allocates through the owned allocator without the scheduler
OWNED = ("plain_owned", "agent_owned")
#: stderr line prefix of the owned cache's counts (``OWNED_WRAPPER``, gpuos_tools/memory/owned.py torch_stats)
OWNED_STATS = "gpuos-bench-owned-stats: "
#: `plain_owned`: the loop untraced, torch's allocations through the owned allocator (installed
#: before the loop's first CUDA allocation, as the agent's boot does), the cache's counts at exit
OWNED_WRAPPER = (
    "import atexit, json, runpy, sys\n"
    "from gpuos_tools.memory import owned\n"
    "owned.install_torch()\n"
    "atexit.register(lambda: print('" + OWNED_STATS + "' + json.dumps(owned.OwnedLibrary.load().torch_stats()),"
    " file=sys.stderr, flush=True))\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
AFTER_SNAPSHOT = ("agent_after_snapshot", "agent_cupti_after_snapshot")
SCHED = ("sched_100", "sched_100_cupti", "sched_100_slow", "sched_66", "sched_66_slow", "sched_66_cupti",
         "sched_66_slow_cupti", "sched_66_time", "sched_66_nolastuse", "sched_66_b4", "sched_66_fixed",
         "sched_66_fixed_keepdead", "sched_66_fixed_deadplan", "sched_66_fixed_slack5", "sched_66_fixed_slack10",
         "sched_66_fixed_slack20", "sched_66_fixed_lateleads", "sched_66_fixed_lateleads_slack10")
#: what a scheduler run's summary says, kept in its result
SUMMARY_KEYS = ("budget", "budget_of", "steady_bytes", "footprint", "launches", "unknown", "evictions", "loads",
                "prefetches", "demand_loads", "stalls", "bytes_in", "bytes_out", "over_budget", "periods", "period_use",
                "period_breaks", "breaks", "fast", "dormant", "agent", "evict_saves", "dead_evictions", "dead_bytes",
                "dead_loads", "engine_lock_waits", "mover_lock_waits")


def mechanism(config: str) -> str:
    """How the agent of ``config`` sees the driver calls: as its name says, else the tools'
    default (set either way: the caller's GPUOS_AGENT_MECHANISM does not leak in)."""
    parts = config.split("_")
    return "cupti" if "cupti" in parts else "intercept" if "intercept" in parts else DEFAULT_MECHANISM


def tool(name: str) -> list[str]:
    return [sys.executable, str(ROOT / "cmd" / name)]


def command(config: str, workload: list[str], trace: Path) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if config in ("plain", "plain_again"):  # the second run, last, shows the run-to-run noise
        return [sys.executable, *workload], env
    if config == "plain_owned":
        env.pop("GPUOS_AGENT_OWN", None)
        return [sys.executable, "-c", OWNED_WRAPPER, *workload], env
    if config == "trace":
        return [*tool("gpu-trace"), "run", "-o", str(trace), "--no-images", "--", sys.executable, *workload], env
    if config in AGENT:
        if config == "agent_python":
            env["GPUOS_AGENT_BACKEND"] = "python"
        if config == "agent_owned":
            env["GPUOS_AGENT_OWN"] = "torch"
        else:
            env.pop("GPUOS_AGENT_OWN", None)
        env["GPUOS_AGENT_MECHANISM"] = mechanism(config)
        return [*tool("gpu-ckpt"), "run", "-o", str(trace), "--no-images", "--", sys.executable, *workload], env
    if config in SCHED:
        env["GPUOS_AGENT_MECHANISM"] = mechanism(config)
        parts = config.split("_")
        # the fast path is on by default: only the runs with "slow" in their name turn it off
        env["GPUOS_SCHED_FAST"] = "0" if "slow" in parts else "1"
        # saves wait for each victim's last use by default: "nolastuse" waits for everything enqueued
        env["GPUOS_SCHED_LAST_USE"] = "0" if "nolastuse" in parts else "1"
        # freed torch memory moves no bytes by default: "keepdead" saves and loads it too
        env["GPUOS_ENGINE_KEEP_DEAD"] = "1" if "keepdead" in parts else "0"
        # a fixed plan is blind to dead records by default: "deadplan" asks where they are
        env["GPUOS_SCHED_DEAD_PLAN"] = "1" if "deadplan" in parts else "0"
        # a fixed plan drops more rather than make a load later than its copy takes, by default:
        # "lateleads" makes loads later first
        env["GPUOS_SCHED_KEEP_LEADS"] = "0" if "lateleads" in parts else "1"
        plan = ["--plan", "time"] if "time" in parts else ["--plan", "fixed"] if "fixed" in parts else []
        plan += [x for b in parts if b[:1] == "b" and b[1:].isdigit() for x in ("--prefetch-batch", b[1:])]
        # "slackN": the fixed plan made at N % of the budget less
        plan += [x for b in parts if b.startswith("slack") for x in ("--slack", b[5:] + "%")]
        return [*tool("gpu-prefetch-sched"), "run", "--budget", f"{parts[1]}%", *plan, "-o", str(trace), "--",
                sys.executable, *workload], env
    raise ValueError(config)


def exit_record(trace: Path) -> dict[str, Any] | None:
    from gpuos_tools.stream import open_input

    last = None
    launches = 0
    try:
        with open_input(str(trace)) as reader:
            for rec in reader:
                if rec.get("type") == "launch":
                    launches += 1
                elif rec.get("type") == "exit":
                    last = rec
    except Exception as exc:  # noqa: BLE001 (the figure is missing, not the run)
        return {"error": f"{type(exc).__name__}: {exc}"}
    if last is not None:
        last["launch_records"] = launches
    return last


def run_one(config: str, model: str, steps: int, warmup: int, timeout: float, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{model}-{config}.json"
    trace = tmp / f"{model}-{config}.ndjson"
    pause = tmp / f"{model}-{config}.pause"
    n = steps if config != "agent_python" else max(5, steps // 3)
    workload = [str(WORKLOAD), "--model", model, "--steps", str(n), "--warmup", str(warmup), "--json", str(out)]
    if config in AFTER_SNAPSHOT:
        workload += ["--pause", str(pause)]
    cmd, env = command(config, workload, trace)
    started = time.monotonic()
    res: dict[str, Any] = {"config": config, "model": model}
    stdout = subprocess.PIPE if config in SCHED else subprocess.DEVNULL  # the scheduler's summary
    proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True)
    out_text = ""
    try:
        if config in AFTER_SNAPSHOT:
            ready = Path(f"{pause}.ready")
            while not ready.exists() and proc.poll() is None and time.monotonic() - started < timeout:
                time.sleep(0.05)
            if ready.exists():
                from gpuos_tools.agent.control import request, socket_path

                pid = int(ready.read_text())
                try:
                    a = request(socket_path(pid), "snapshot", timeout=120, digest=False)
                    res["snapshot"] = {k: a.get(k) for k in ("bytes", "seconds", "gbps", "stall_s", "cow", "stream_waits")}
                except Exception as exc:  # noqa: BLE001
                    res["snapshot_error"] = f"{type(exc).__name__}: {exc}"
                Path(f"{pause}.go").write_text("go")
        out_text, err = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        proc.kill()
        out_text, err = proc.communicate()
        res["error"] = f"timed out after {timeout} s"
    for line in (out_text or "").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("type") == "sched_summary":
            res["sched"] = {k: rec.get(k) for k in SUMMARY_KEYS if k in rec}
            ex = rec.get("executor") or {}  # where the program's thread waited for room
            res["sched"]["executor"] = {k: ex.get(k) for k in ("room_waits", "room_wait_s", "prefetch_skipped",
                                                               "ready_on_stream", "ready_now", "samples", "dead_asked",
                                                               "dead_ask_s", "before_s", "require_s", "evict_s",
                                                               "measure_s", "policy_s", "fast_replay_s",
                                                               "fast_after_s") if k in ex}
            st = rec.get("policy_stats") or {}
            if st.get("fixed_plans"):  # how much of the run a fixed plan decided, and why it ended
                res["sched"]["fixed"] = {k: st.get(k) for k in ("fixed_plans", "fixed_launches", "fixed_ends", "fixed_end",
                                                                 "fixed_acting_decisions", "fixed_other_decisions", "fixed")}
                res["sched"]["breaks_last"] = st.get("breaks_last")
    for line in (err or "").splitlines():  # plain_owned: the owned cache's counts at the program's exit
        if line.startswith(OWNED_STATS):
            try:
                res["owned"] = json.loads(line[len(OWNED_STATS):])
            except ValueError:
                pass
    res["rc"] = proc.returncode
    res["wall_s"] = round(time.monotonic() - started, 3)
    if proc.returncode != 0:
        res["stderr"] = (err or "")[-2000:]
    if out.exists():
        data = json.loads(out.read_text())
        times = data["steps"]
        res["steps"] = len(times)
        res["median_s"] = statistics.median(times)
        if data.get("enqueue"):  # the host's time to issue a step: near median_s, host-bound
            res["enqueue_median_s"] = statistics.median(data["enqueue"])
    if trace.exists():
        ex = exit_record(trace)
        if ex:
            tracer = ex.get("tracer") or {}
            res["tracer"] = tracer
            res["launch_records"] = ex.get("launch_records")
            core = tracer.get("core") if isinstance(tracer, dict) else None
            if core:
                res["agent_us_per_op"] = round(core["enter_ns"] / 1e3 / max(1, core["enters"]), 3)
                res["upcalls"] = core["upcalls"]
                res["memo"] = {"misses": core["memo_misses"], "hits": core["memo_hits"]}
                res["epoch_moves"] = {k[6:]: v for k, v in core.items() if k.startswith("epoch_")}
            if tracer.get("callback_ns") is not None and tracer.get("callbacks"):
                res["tracer_us_per_callback"] = round(tracer["callback_ns"] / 1e3 / tracer["callbacks"], 3)
        trace.unlink()
    return res


def cpu_list(text: str) -> set[int]:
    """taskset's list syntax ("2-5,8") as a set of CPUs; ValueError for anything else."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if first < 0 or last < first:
            raise ValueError(f"{part!r} is not a CPU or a range of CPUs")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError("no CPU named")
    return cpus


def summarize(results: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (model, configuration): the median of its runs' medians, their min and max, and how many
    runs; where the runs said it, the median of their host times to issue a step
    (``enqueue_median_s``). The untraced runs ("plain" and "plain_again") are pooled as "plain"."""
    by: dict[tuple[str, str], list[float]] = {}
    enq: dict[tuple[str, str], list[float]] = {}
    for r in results:
        if r.get("median_s"):
            config = "plain" if r["config"] == "plain_again" else r["config"]
            by.setdefault((r["model"], config), []).append(r["median_s"])
            if r.get("enqueue_median_s"):
                enq.setdefault((r["model"], config), []).append(r["enqueue_median_s"])
    out = {key: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "runs": len(v)}
           for key, v in by.items()}
    for key, v in enq.items():
        out[key]["enqueue_median_s"] = statistics.median(v)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,mlp")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, from {', '.join(CONFIGS + OPTIONAL)} (default: {', '.join(CONFIGS)})")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every configuration, interleaved (default 1)")
    ap.add_argument("--cpus", help="pin every run to these CPUs (taskset's list syntax, e.g. 2-5)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.cpus:
        try:
            os.sched_setaffinity(0, cpu_list(args.cpus))  # the runs inherit it
        except (ValueError, OSError) as exc:
            ap.error(f"--cpus {args.cpus}: {exc}")
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS + OPTIONAL]
    if unknown or not configs:
        ap.error(f"--configs: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(CONFIGS + OPTIONAL)}")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        for model in args.models.split(","):
            for round_ in range(args.repeat):
                k = round_ % len(configs)  # rotated: no configuration always runs first or last
                for config in configs[k:] + configs[:k]:
                    r = run_one(config, model, args.steps, args.warmup, args.timeout, Path(d))
                    r["round"] = round_
                    results.append(r)
                    print(json.dumps({k: v for k, v in r.items() if k != "stderr"}), file=sys.stderr, flush=True)
                    if args.json:
                        args.json.write_text(json.dumps({"results": results}, indent=1))
    summary = summarize(results)
    base = {m: s["median_s"] for (m, c), s in summary.items() if c in ("plain", "plain_again")}
    for r in results:
        b = base.get(r["model"])
        if b and r.get("median_s"):
            r["ratio"] = round(r["median_s"] / b, 4)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    out = {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "steps": args.steps, "warmup": args.warmup,
           "repeat": args.repeat, "cpus": args.cpus, "results": results,
           "summary": [{"model": m, "config": c, **v, "ratio": round(v["median_s"] / base[m], 4) if base.get(m) else None}
                       for (m, c), v in summary.items()]}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print(f"{'model':10} {'config':30} {'median ms':>10} {'issue ms':>9} {'ratio':>7} {'agent us/op':>12} "
          f"{'upcalls':>8} {'evictions':>9} {'loads':>7} {'fast ops':>9}", file=sys.stderr)
    for r in results:
        med = r.get("median_s")
        sched = r.get("sched") or {}
        fast = sched.get("fast") or {}
        note = ""
        if r["config"] in SCHED and "100" not in r["config"] and sched and not sched.get("evictions"):
            note = "  (nothing evicted: the budget did not bind)"
        issue = r.get("enqueue_median_s")
        print(f"{r['model']:10} {r['config']:30} {med * 1e3 if med else float('nan'):10.2f} "
              f"{issue * 1e3 if issue else float('nan'):9.2f} {r.get('ratio', float('nan')):7.3f} {r.get('agent_us_per_op', float('nan')):12.2f} "
              f"{r.get('upcalls', ''):>8} {sched.get('evictions', ''):>9} {sched.get('loads', ''):>7} "
              f"{fast.get('operations', ''):>9}{note}", file=sys.stderr)
    if args.repeat > 1:
        print(f"{'model':10} {'config':30} {'median of medians ms':>21} {'min..max ms':>16} {'ratio':>7}", file=sys.stderr)
        for row in out["summary"]:
            print(f"{row['model']:10} {row['config']:30} {row['median_s'] * 1e3:21.2f} "
                  f"{row['min_s'] * 1e3:7.2f}..{row['max_s'] * 1e3:<7.2f} {row['ratio'] or float('nan'):7.3f}",
                  file=sys.stderr)
    return 0 if all(r.get("rc") == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
