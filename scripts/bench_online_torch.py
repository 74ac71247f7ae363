#!/usr/bin/env python3
"""`gpu-prefetch-sched run` on PyTorch programs against all-in-HBM (the LLM-decode and CNN
workloads of the oversubscription target in DESIGN.md).

Workloads (workloads/):
- llm: torch_decode_job.py, a transformers Llama with random bf16 weights (default 16 layers of
  hidden 2048, MLP 5632: 1.9 GB of weights; 8 timed tokens), greedy decode with a static KV cache; timed: the
  decode loop (--llm-args);
- cnn: torch_cnn_job.py, a ResNet-like network's SGD training steps on synthetic data on the
  GPU; timed: the training loop (--cnn-args).

Per workload, side by side (--configs):
- hbm:    the job alone, untraced, torch's own caching allocator (the ceiling);
- run100: under `gpu-prefetch-sched run --budget 100%` (agent, owned memory, policy on, nothing
          to move: the cost of the python-callback agent and the policy on the launch path);
- 66%, 50%, 33% (150%, 200%, 300% oversubscription) with Belady, and 66%-lru; a suffix -bN
  (66%-b4) runs with `--prefetch-batch N`, -fixed with `--plan fixed` and -lN (66%-fixed-l64)
  with `--lookahead N`;
- with --dynamic, llm only: hbm-dyn and 66%-dyn, the same decode with transformers'
  DynamicCache (new memory per token and layer);
- llm only, what a user would pick instead (torch_decode_job.py --accelerate): acc-offload,
  Hugging Face accelerate's cpu_offload (every weight on the host, copied in per module), and
  acc-map, dispatch_model over a device map with the GPU memory of our run named by
  --acc-same-as (its summary's budget, all of it for weights: accelerate then holds more on
  the GPU than that run, its cache and activations beside; --acc-gpu-bytes gives a number
  instead); both report torch's peak allocated bytes in the decode loop (gpu_peak_bytes), and
  per row ours_vs_acc = this row's loop time / the --acc-same-as run's (of the same round),
  and ours_vs_acc_late the same over the loops' second halves (late_tokens_per_s: the rate
  once the token is learned);
- um<B>, one per --um budget (e.g. --um 100%,66%,50%,33%; none by default): the fault-driven
  managed-memory baseline, the job's --managed B/100 (gpuos_tools/memory/managed.py): torch
  allocates CUDA managed memory, and before each aten operation the least recently used whole
  blocks are pushed to the host (cuMemPrefetchAsync, stream-ordered) until the operation's
  blocks fit a software budget of B of the managed bytes; nothing is prefetched back, kernels
  fault blocks in. An EMULATION of the driver's eviction under that much pressure (the job
  never holds more managed memory than the GPU has free). um100 evicts nothing: managed memory
  with the hook's own cost. Per row also: ours_vs_um = this row's loop time / the Belady run's
  at the same budget (the config named B, run100 for 100%, when it ran), vs_um100 = this row's loop time /
  um100's, and what the emulation did inside the loop (um_loop: evictions, evicted bytes,
  blocks faulted back and their bytes, the hook's time).

A discarded hbm job of the first workload runs first (--no-warmup skips it): the first job on
a freshly started GPU machine runs slower, and hbm is every ratio's anchor. With --rounds N every
config runs N times, interleaved (all configs, then all again: a machine's drift falls on all of
them alike); each row says its round, its ratios pair it with runs of that round, and the JSON's
`medians` gives each config's median loop time, rate and ratios.

Per run: the timed loop's wall time, speed = hbm loop time / run loop time, whether the output
(token ids; final parameters' sha256) is bit-identical to hbm's, the whole run's summary (bytes
in/out, evictions, loads, stalls, unknown launches, peak mapped bytes, period learned), and what
the executor did inside the timed loop (the job reads gpuos_tools.sched.executor.current_counts
at its start and end): bytes in and out, and the transfer floor = max(bytes in, bytes out) /
--link-gbps (one direction's pinned copy bandwidth; the two directions overlap), against the
loop's time: floor_share near 1 means the loop is transfer-bound. JSON to --json (after every
run); a table on stderr. The kernels' prediction profile (share of unknown launches, the most
launched kernels and their mean predicted bytes) of each workload's 66% run is kept in the JSON.

    python3 scripts/bench_online_torch.py [--workloads llm,cnn] [--configs hbm,run100,66%,50%,33%,66%-lru]
                                          [--um 100%,66%,50%,33%] [--dynamic] [--rounds N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuos_tools.cuda.nvml import gpu_summary

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS = ROOT / "workloads"
JOBS = {"llm": WORKLOADS / "torch_decode_job.py", "cnn": WORKLOADS / "torch_cnn_job.py"}
LLM_ARGS = "--hidden 2048 --layers 16 --mlp 5632 --heads 16 --vocab 32000 --prompt 32 --tokens 9"
CNN_ARGS = "--width 64 --blocks 2 --batch 64 --image 64 --batches 4 --steps 12"
SUMMARY_KEYS = ("budget", "footprint", "launches", "unknown", "bytes_in", "bytes_out", "loads", "prefetches",
                "demand_loads", "evictions", "evict_saves", "stalls", "over_budget", "peak_settled",
                "peak_resident", "over_physical", "periods", "predicted", "error", "period_use", "period_breaks",
                "breaks", "breaks_last", "park", "engine_lock_waits", "mover_lock_waits")


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    e.pop("GPUOS_AGENT_OWN", None)
    return e


def run_job(job: Path, job_args: list[str], sched: list[str] | None, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "job.json"
        cmd = [sys.executable, str(job), *job_args, "--out", str(out)]
        if sched is not None:
            cmd = [sys.executable, "-m", "gpuos_tools.commands.prefetch_sched", "run", *sched, "--", *cmd]
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            return {"ok": False, "rc": "timeout", "stderr": err[-3000:], "process_s": round(time.perf_counter() - t, 3)}
        wall = time.perf_counter() - t
        if p.returncode != 0 or not out.exists():
            return {"ok": False, "rc": p.returncode, "stderr": p.stderr[-3000:], "process_s": round(wall, 3)}
        res = json.loads(out.read_text())
        res["ok"] = True
        res["process_s"] = round(wall, 3)
        if sched is not None:
            recs = [json.loads(x) for x in p.stdout.splitlines() if x.strip()]
            res["summary"] = recs[-1] if recs and recs[-1].get("type") == "sched_summary" else None
        return res


def configs(args: argparse.Namespace, workload: str) -> list[tuple[str, str | None, str, list[str], list[str]]]:
    """(name, budget or None for untraced, policy, extra job args, extra `run` options)."""
    out = []
    for c in [c for c in args.configs.split(",") if c]:
        if c == "hbm":
            out.append(("hbm", None, "", [], []))
        elif c == "run100":
            out.append(("run100", "100%", "belady", [], []))
        elif c in ("acc-offload", "acc-map"):
            if workload == "llm":
                out.append((c, None, "accelerate", ["--accelerate", c[4:]], []))
        else:
            budget, *rest = c.split("-")
            batch = [r for r in rest if re.fullmatch(r"b[0-9]+", r)]
            lead = [r for r in rest if re.fullmatch(r"l[0-9]+", r)]
            fixed = "fixed" in rest
            policy = [r for r in rest if r not in batch and r not in lead and r != "fixed"]
            opts = ["--prefetch-batch", batch[-1][1:]] if batch else []
            opts += ["--plan", "fixed"] if fixed else []
            opts += ["--lookahead", lead[-1][1:]] if lead else []
            out.append((c, budget, policy[0] if policy else "belady", [], opts))
    if args.dynamic and workload == "llm":
        out += [("hbm-dyn", None, "", ["--cache", "dynamic"], []),
                ("66%-dyn", "66%", "belady", ["--cache", "dynamic"], [])]
    for b in [b for b in args.um.split(",") if b]:
        out.append((f"um{b.rstrip('%')}", b, "managed", ["--managed", str(float(b.rstrip("%")) / 100)], []))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="llm,cnn")
    ap.add_argument("--configs", default="hbm,run100,66%,50%,33%,66%-lru")
    ap.add_argument("--dynamic", action="store_true", help="llm: also the DynamicCache decode, alone and at 66%%")
    ap.add_argument("--um", default="", help="budgets of the fault-driven managed-memory baseline, e.g. 100%%,66%%,50%%,33%%")
    ap.add_argument("--llm-args", default=LLM_ARGS)
    ap.add_argument("--cnn-args", default=CNN_ARGS)
    ap.add_argument("--acc-same-as", default="66%", help="acc-map: the GPU memory of this config's run (its budget)")
    ap.add_argument("--acc-gpu-bytes", type=int, default=0, help="acc-map: this many bytes instead")
    ap.add_argument("--plan", default="", help="run --plan for every scheduler run (empty: the command's default)")
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--link-gbps", type=float, default=50.0, help="one direction's pinned copy bandwidth, for the floor")
    ap.add_argument("--timeout", type=float, default=90)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the discarded first hbm job (a fresh GPU machine's first job runs slower)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every config this many times, interleaved (all configs, then all again); ratios "
                    "pair runs of one round, and the JSON's `medians` (and a table) give each config's median")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be 1 or more")

    rows: list[dict[str, Any]] = []
    workloads = [w for w in args.workloads.split(",") if w]
    if args.warmup and workloads:
        # discarded: the first job on a freshly started GPU machine runs slower (the stencil's
        # hbm loop: 1.5x on an H200), and hbm, every ratio's anchor, comes first
        wl = workloads[0]
        run_job(JOBS[wl], shlex.split(args.llm_args if wl == "llm" else args.cnn_args), None, args.timeout)
    for rnd, wl in ((r, w) for r in range(args.rounds) for w in workloads):
        base_args = shlex.split(args.llm_args if wl == "llm" else args.cnn_args)
        refs: dict[str, dict[str, Any]] = {}
        # rows of this round and workload: the runs a row's ratios pair it with
        mine_so_far = [x for x in rows if x["workload"] == wl and x["round"] == rnd]
        for name, budget, policy, extra, run_opts in configs(args, wl):
            managed = policy == "managed"  # the UM baseline: untraced, the job's own --managed
            sched = None if budget is None or managed else ["--budget", budget, "--policy", policy,
                                                            "--lookahead", str(args.lookahead), *run_opts]
            if sched is not None and args.plan:
                sched += ["--plan", args.plan]
            if extra[:2] == ["--accelerate", "map"]:
                same = next((x for x in mine_so_far if x["config"] == args.acc_same_as
                             and (x.get("summary") or {}).get("budget")), None)
                gpu = args.acc_gpu_bytes or (same["summary"]["budget"] if same is not None else 0)
                if not gpu:
                    print(f"{wl} {name}: skipped (no --acc-gpu-bytes and no {args.acc_same_as} run to match)",
                          file=sys.stderr)
                    continue
                extra = [*extra, "--gpu-bytes", str(gpu)]
            r = run_job(JOBS[wl], [*base_args, *extra], sched, args.timeout)
            row: dict[str, Any] = {"workload": wl, "config": name, "round": rnd, "budget_spec": budget,
                                   "policy": policy or None, "job_args": [*base_args, *extra]}
            ref_name = "hbm-dyn" if "--cache" in extra else "hbm"
            if r.get("ok"):
                row.update({k: r.get(k) for k in ("loop_s", "tokens_per_s", "late_tokens_per_s", "its_per_s", "cache",
                                                   "weights_bytes", "param_bytes", "data_bytes", "process_s", "nondeterministic",
                                                   "gpu_peak_bytes", "gpu_weight_bytes", "accelerate_version")
                            if k in r})
                row["digest"] = r["digest"]
                if budget is None or managed:
                    refs[name] = r
                ref = refs.get(ref_name)
                if ref is not None:
                    row["identical"] = r["digest"] == ref["digest"]
                    row["speed_vs_hbm"] = round(ref["loop_s"] / r["loop_s"], 4)
                s = r.get("summary")
                if s is not None:
                    row["summary"] = {k: s.get(k) for k in SUMMARY_KEYS if k in s}
                    row["executor"] = s.get("executor")
                    row["streams"] = s.get("streams")
                    row["agent"] = s.get("agent")
                    row["period_breaks"] = (s.get("policy_stats") or {}).get("period_breaks")
                    row["distinct_keys"] = (s.get("policy_stats") or {}).get("keys")
                    row["jitter"] = (s.get("policy_stats") or {}).get("jitter")
                    pst = s.get("policy_stats") or {}
                    if pst.get("fixed_plans"):
                        row["fixed"] = {k: pst.get(k) for k in ("fixed_plans", "fixed_launches", "fixed_ends",
                                                                 "fixed_end", "fixed")}
                    row["fast"] = s.get("fast")
                    if name.startswith("66%") and "kernels" in s:
                        row["kernels"] = s["kernels"]
                if policy == "accelerate":
                    ours = next((x for x in mine_so_far if x["config"] == args.acc_same_as and x.get("loop_s")), None)
                    if ours is not None:
                        row["ours_config"] = ours["config"]
                        row["ours_vs_acc"] = round(r["loop_s"] / ours["loop_s"], 3)
                        if r.get("late_tokens_per_s") and ours.get("late_tokens_per_s"):
                            row["ours_vs_acc_late"] = round(ours["late_tokens_per_s"] / r["late_tokens_per_s"], 3)
                        row["ours_peak_bytes"] = (ours.get("summary") or {}).get("peak_settled")
                if managed:
                    row["um"] = r.get("um")
                    row["um_loop"] = r.get("um_loop")
                    ours = "run100" if budget == "100%" else budget
                    mine = next((x for x in mine_so_far if x["config"] == ours and x.get("loop_s")), None)
                    if mine is not None:
                        row["ours_config"] = ours
                        row["ours_vs_um"] = round(r["loop_s"] / mine["loop_s"], 3)
                    if "um100" in refs and name != "um100":
                        row["vs_um100"] = round(r["loop_s"] / refs["um100"]["loop_s"], 3)
                loop = r.get("sched_loop")
                if loop is not None:
                    row["loop"] = loop
                    floor = max(loop["bytes_in"], loop["bytes_out"]) / (args.link_gbps * 1e9)
                    row["floor_s"] = round(floor, 6)
                    row["floor_share"] = round(floor / r["loop_s"], 4) if r["loop_s"] else None
            else:
                row.update(ok=False, rc=r.get("rc"), stderr=r.get("stderr"))
                print(f"{wl} {name} failed: {r.get('stderr', '')[-2000:]}", file=sys.stderr)
            rows.append(row)
            mine_so_far.append(row)
            save(args, rows)
            print(f"{wl} {name}{f' (round {rnd + 1})' if args.rounds > 1 else ''}: {_line(row)}", file=sys.stderr,
                  flush=True)

    save(args, rows)
    print(f"{'wl':<4} {'config':<8} {'loop_s':>8} {'rate':>8} {'speed':>6} {'same':>5} {'loop in GB':>10} "
          f"{'out GB':>7} {'evict':>6} {'stall':>6} {'unk':>5} {'floor_s':>8} {'floor%':>6}", file=sys.stderr)
    for r in rows:
        lp = r.get("loop") or {}
        rate = r.get("tokens_per_s") or r.get("its_per_s") or float("nan")
        print(f"{r['workload']:<4} {r['config']:<8} {r.get('loop_s', float('nan')):>8.3f} {rate:>8.2f} "
              f"{r.get('speed_vs_hbm', float('nan')):>6.3f} {str(r.get('identical', '-')):>5} "
              f"{lp.get('bytes_in', 0) / 1e9:>10.2f} {lp.get('bytes_out', 0) / 1e9:>7.2f} {lp.get('evictions', 0):>6} "
              f"{lp.get('stalls', 0):>6} {lp.get('unknown', 0):>5} {r.get('floor_s', 0):>8.3f} "
              f"{100 * (r.get('floor_share') or 0):>6.1f}", file=sys.stderr)
    acc = [r for r in rows if r.get("policy") == "accelerate"]
    if acc:
        print(f"{'wl':<4} {'config':<12} {'tok/s':>7} {'same':>5} {'GPU peak GB':>11} {'ours':>6} {'ours peak GB':>12} "
              f"{'ours/acc':>8} {'late':>6}", file=sys.stderr)
        for r in acc:
            ours = next((x for x in rows if x["workload"] == r["workload"] and x["config"] == r.get("ours_config")), {})
            print(f"{r['workload']:<4} {r['config']:<12} {r.get('tokens_per_s') or float('nan'):>7.2f} "
                  f"{str(r.get('identical', '-')):>5} {(r.get('gpu_peak_bytes') or 0) / 1e9:>11.2f} "
                  f"{ours.get('tokens_per_s') or float('nan'):>6.2f} {(r.get('ours_peak_bytes') or 0) / 1e9:>12.2f} "
                  f"{r.get('ours_vs_acc', float('nan')):>8.2f} {r.get('ours_vs_acc_late') or float('nan'):>6.2f}",
                  file=sys.stderr)
    um = [r for r in rows if r.get("policy") == "managed"]
    if um:
        print(f"{'wl':<4} {'config':<6} {'loop_s':>8} {'speed':>6} {'same':>5} {'evict':>6} {'out GB':>7} "
              f"{'fault GB':>8} {'hook_s':>7} {'/um100':>7} {'ours':>6} {'ours/um':>8}", file=sys.stderr)
        for r in um:
            lp = r.get("um_loop") or {}
            ours = next((x for x in rows if x["workload"] == r["workload"] and x["config"] == r.get("ours_config")), {})
            print(f"{r['workload']:<4} {r['config']:<6} {r.get('loop_s', float('nan')):>8.3f} "
                  f"{r.get('speed_vs_hbm', float('nan')):>6.3f} {str(r.get('identical', '-')):>5} "
                  f"{lp.get('evictions', 0):>6} {lp.get('evicted_bytes', 0) / 1e9:>7.2f} "
                  f"{lp.get('faulted_bytes', 0) / 1e9:>8.2f} {lp.get('hook_s', 0):>7.3f} "
                  f"{r.get('vs_um100', float('nan')):>7.2f} {ours.get('speed_vs_hbm', float('nan')):>6.3f} "
                  f"{r.get('ours_vs_um', float('nan')):>8.2f}", file=sys.stderr)
    if args.rounds > 1:
        print(f"{'wl':<4} {'config':<12} {'rounds':>6} {'loop_s':>8} {'rate':>8} {'speed':>6} {'ours/acc':>8} "
              f"{'ours/um':>8}  (medians)", file=sys.stderr)
        for m in medians(rows):
            def cell(key: str, width: int, prec: int) -> str:
                v = m.get(key)
                return f"{v:>{width}.{prec}f}" if v is not None else f"{'-':>{width}}"
            print(f"{m['workload']:<4} {m['config']:<12} {m['rounds']:>6} {cell('loop_s', 8, 3)} "
                  f"{cell('tokens_per_s' if m.get('tokens_per_s') is not None else 'its_per_s', 8, 2)} "
                  f"{cell('speed_vs_hbm', 6, 3)} {cell('ours_vs_acc', 8, 2)} {cell('ours_vs_um', 8, 2)}",
                  file=sys.stderr)
    return 0 if all(r.get("ok", True) and r.get("identical", True) for r in rows) else 1


#: the figures of a row whose median over rounds `medians` gives
MEDIAN_KEYS = ("loop_s", "tokens_per_s", "late_tokens_per_s", "its_per_s", "speed_vs_hbm", "ours_vs_acc",
               "ours_vs_acc_late", "ours_vs_um", "vs_um100")


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload and config (in the order first run), the median of each figure over the
    rounds that gave it, and how many rounds ran it well."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["config"]), []).append(r)
    out = []
    for (wl, config), rs in groups.items():
        good = [r for r in rs if r.get("ok", True) and r.get("loop_s")]
        m: dict[str, Any] = {"workload": wl, "config": config, "rounds": len(good)}
        for key in MEDIAN_KEYS:
            values = [r[key] for r in good if r.get(key) is not None]
            m[key] = round(statistics.median(values), 4) if values else None
        out.append(m)
    return out


def _line(row: dict[str, Any]) -> str:
    if row.get("ok") is False:
        return f"FAILED rc={row.get('rc')}"
    lp = row.get("loop") or {}
    late = f", late {row['late_tokens_per_s']} tok/s" if row.get("late_tokens_per_s") else ""
    return (f"loop {row.get('loop_s')} s{late}, speed {row.get('speed_vs_hbm')}, identical {row.get('identical')}, "
            f"loop in {lp.get('bytes_in', 0) / 1e9:.2f} GB out {lp.get('bytes_out', 0) / 1e9:.2f} GB, "
            f"floor share {row.get('floor_share')}, periods {(row.get('summary') or {}).get('periods')}, "
            f"breaks {row.get('period_breaks')}, keys {row.get('distinct_keys')}")


def save(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The JSON so far (after every run: a call cut short keeps what it measured)."""
    if not args.json:
        return
    out = {"bench": "online_torch", "date": time.strftime("%Y-%m-%d", time.gmtime()), "host": platform.node(),
           "gpu": gpu_summary(), "args": vars(args), "rows": rows}
    if args.rounds > 1:
        out["medians"] = medians(rows)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
