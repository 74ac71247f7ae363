#!/usr/bin/env python3
"""The agent's concurrent snapshot against the driver's stop-the-world checkpoint, on the same job:
program-visible stall, bandwidth to host RAM and the job's throughput meanwhile (the stall and
checkpoint-bandwidth targets in DESIGN.md).

Starts a job (--job; workloads/) under `gpu-trace run --agent`:

    cupy       agent_job.py            CuPy, --gib GiB in 256 MiB arrays updated on two streams
    torch_cnn  agent_job_torch_cnn.py  a ResNet-18-like CNN training loop, topped up to --gib
    llm        agent_job_llm.py        a transformers Llama with random weights, forward loop, --gib

Each job writes its iterations/s per >= 100 ms window to a log. Then:

1. the agent path: --snapshots snapshots through the control socket (no digests), 1 s apart.
   The first one's wall time includes allocating the agent's pinned host staging, which the
   later ones reuse: it is reported apart ("first") from the others ("steady").
2. the driver path (--driver, the default; --no-driver skips it), on the same process (the pid
   in the job's ready file, which holds the CUDA context): gpuos_tools.ckpt.driver's
   Checkpointer.suspend (lock + checkpoint) then resume (restore + unlock). The job cannot run
   from the start of the lock to the end of the unlock: that whole interval is the driver path's
   program-visible stall. Then the job must go on logging iterations (checked for --after s),
   and one more agent snapshot is taken, to see that the agent survived the driver's restore.

Stall: the agent's is its own `stall_s` (time the program spent in the agent's callbacks; GPU
waits of its streams behind copies show in the throughput, not there); the driver's is the lock
to unlock interval timed around the driver calls. Throughput during = the job's logged rates
averaged over the snapshots' (or the lock-unlock) wall intervals, each window weighted by its
overlap with them; `longest_window_s` is the job's own view of a stall, at window resolution.
JSON to --json (both paths side by side, ratio driver stall / agent stall); a summary on stdout
as JSON and for people on stderr. Exit status 1 when a step failed (the JSON says which).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ROOT / "workloads"

#: job name -> (program, the modules it needs)
JOBS = {
    "cupy": ("agent_job.py", ("cupy",)),
    "torch_cnn": ("agent_job_torch_cnn.py", ("torch",)),
    "llm": ("agent_job_llm.py", ("torch", "transformers")),
}
DRIVER_STEPS = ("lock", "checkpoint", "restore", "unlock")


# -- the job's log ----------------------------------------------------------------------------


def read_rates(path: Path) -> list[tuple[float, float]]:
    """(unix time at the end of the window, iterations/s in it), complete lines only."""
    return [(ts, r) for ts, r, _ in read_log(path)]


def read_log(path: Path) -> list[tuple[float, float, float | None]]:
    """(end of the window, iterations/s, the longest iteration in it or None), complete lines."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines(keepends=True):
        parts = line.split()
        if line.endswith("\n") and len(parts) in (2, 3):
            out.append((float(parts[0]), float(parts[1]), float(parts[2]) if len(parts) == 3 else None))
    return out


def longest_gap(log: list[tuple[float, float, float | None]], intervals: list[tuple[float, float]]) -> float | None:
    """The job's longest iteration (between two synchronisations) in the windows that overlap
    ``intervals``: its own view of how long it was stopped, at iteration resolution."""
    gaps = [g for (s, _, _), (e, _, g) in itertools.pairwise(log)
            if g is not None and any(min(e, b) > max(s, a) for a, b in intervals)]
    return round(max(gaps), 4) if gaps else None


def windows(rates: list[tuple[float, float]]) -> list[tuple[float, float, float]]:
    """(start, end, iterations/s) of each window after the first (whose start is not logged)."""
    return [(a[0], b[0], b[1]) for a, b in itertools.pairwise(rates)]


def over(wins: list[tuple[float, float, float]], intervals: list[tuple[float, float]]) -> dict[str, Any] | None:
    """The job's throughput over ``intervals`` (unix times): each window's rate weighted by how much
    of it lies inside them (the log cannot say where in a window the iterations fell)."""
    iters = span = 0.0
    sel = []
    for s, e, r in wins:
        inside = sum(max(0.0, min(e, b) - max(s, a)) for a, b in intervals)
        if inside > 0:
            iters += r * inside
            span += inside
            sel.append(e - s)
    if not sel:
        return None
    return {"iters_per_s": round(iters / span, 1), "windows": len(sel), "span_s": round(span, 3),
            "longest_window_s": round(max(sel), 3)}


def median_rate(wins: list[tuple[float, float, float]], a: float, b: float) -> float | None:
    """Median iterations/s of the windows lying within [a, b]."""
    sel = [r for s, e, r in wins if s >= a and e <= b]
    return round(statistics.median(sel), 1) if sel else None


def loss(before: float | None, during: float | None) -> float | None:
    return round(1 - during / before, 4) if before and during is not None else None


# -- the two paths ----------------------------------------------------------------------------


def snapshot(pid: int, timeout: float) -> dict[str, Any]:
    from gpuos_tools.agent.control import request, socket_path

    start = time.time()
    a = request(socket_path(pid), "snapshot", timeout=timeout, digest=False)
    end = time.time()
    a.pop("allocations", None)
    a["wall_start"], a["wall_end"], a["wall_s"] = start, end, round(end - start, 6)
    return a


def ping_hooks(pid: int) -> dict[str, Any] | None:
    """The agent's counters of its own time in the program's launch callbacks."""
    from gpuos_tools.agent.control import request, socket_path

    try:
        return request(socket_path(pid), "ping", timeout=30).get("launch_hooks")
    except Exception:  # noqa: BLE001 (an older agent, or none: the figure is missing, not the run)
        return None


def hook_costs(h0: dict[str, Any] | None, h1: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per launch, the agent's time on the launch path before the first snapshot (h0: from the
    start) and from it to after the last (h1 - h0: write sets predicted for every launch), and
    how many launches the predictor saw (the rest hit the memo)."""
    if not h0 or not h1:
        return None

    def per(calls: int, seconds: float, predicted: int) -> dict[str, Any]:
        return {"launches": calls, "us_per_launch": round(1e6 * seconds / calls, 2) if calls else None,
                "predicted": predicted}

    return {"before": per(h0["calls"], h0["seconds"], h0["predicted"]),
            "after_first": per(h1["calls"] - h0["calls"], h1["seconds"] - h0["seconds"],
                               h1["predicted"] - h0["predicted"]),
            "epochs_after_first": h1["epoch"] - h0["epoch"]}


def driver_path(pid: int, lock_timeout_ms: int, fallback_bytes: int | None) -> dict[str, Any]:
    """Suspend then resume ``pid`` through the driver, timing each driver call from outside."""
    from gpuos_tools.ckpt.driver import Checkpointer, CkptError
    from gpuos_tools.errors import GpuosError

    records: list[dict[str, Any]] = []
    ckpt = Checkpointer(emit=records.append)
    out: dict[str, Any] = {"ok": False, "pid": pid}
    try:
        api = ckpt.api
    except GpuosError as e:
        out["error"] = f"the driver checkpoint API is unavailable: {e}"
        return out
    marks: dict[str, list[tuple[float, float, float, float]]] = {}

    def timed(name: str, call: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            m0, w0 = time.monotonic(), time.time()
            try:
                return call(*args, **kwargs)
            finally:
                marks.setdefault(name, []).append((m0, time.monotonic(), w0, time.time()))
        return wrapper

    for name in DRIVER_STEPS:  # instance attributes shadow the methods Checkpointer calls
        setattr(api, name, timed(name, getattr(api, name)))
    try:
        s = ckpt.suspend(pid, lock_timeout_ms)
        r = ckpt.resume(pid)
        out["ok"] = True
    except CkptError as e:
        out.update(error=str(e), state=e.state, touched=e.touched)
    except Exception as e:  # noqa: BLE001 (a bug here or in the driver module; the caller resumes the job)
        out.update(error=f"{type(e).__name__}: {e}")
    out["records"] = records
    out["calls"] = {k: [round(b - a, 6) for a, b, _, _ in v] for k, v in marks.items()}
    if not out["ok"]:
        return out
    if len(marks.get("lock", [])) != 1 or len(marks.get("unlock", [])) != 1:
        out.update(ok=False, error=f"expected one lock and one unlock call, saw {out['calls']}")
        return out
    lock, unlock = marks["lock"][0], marks["unlock"][0]
    steps = {"lock_s": s["lock_s"], "checkpoint_s": s["checkpoint_s"], "restore_s": r["restore_s"],
             "unlock_s": r["unlock_s"]}
    stall = unlock[1] - lock[0]
    nbytes, source = s.get("bytes"), "nvml"
    if not nbytes:
        nbytes, source = fallback_bytes, "agent"
    out.update(
        steps,
        stall_s=round(stall, 6),
        steps_s=round(sum(steps.values()), 6),
        between_steps_s=round(stall - sum(steps.values()), 6),
        wall_lock_start=lock[2], wall_unlock_end=unlock[3],
        bytes=nbytes, bytes_source=source,
        checkpoint_gbps=round(nbytes / s["checkpoint_s"] / 1e9, 3) if nbytes and s["checkpoint_s"] else None,
        restore_gbps=round(nbytes / r["restore_s"] / 1e9, 3) if nbytes and r["restore_s"] else None,
    )
    if fallback_bytes and source == "nvml":
        out["checkpoint_gbps_of_agent_bytes"] = round(fallback_bytes / s["checkpoint_s"] / 1e9, 3)
    return out


def leave_running(pid: int) -> None:
    """Never leave the job checkpointed or locked (DESIGN.md §6), whatever failed."""
    try:
        from gpuos_tools.ckpt.driver import Checkpointer

        ckpt = Checkpointer()
        state = ckpt.state(pid)
        if state in ("checkpointed", "locked"):
            print(f"bench_agent: PID {pid} was left {state}: resuming it", file=sys.stderr, flush=True)
            ckpt.resume(pid)
    except Exception as e:  # noqa: BLE001 (report; the job is killed next anyway)
        print(f"bench_agent: could not check or resume PID {pid}: {e}", file=sys.stderr, flush=True)


# -- the run ----------------------------------------------------------------------------------


def gpu_info() -> dict[str, Any]:
    try:
        from gpuos_tools.cuda.nvml import nvml_session

        with nvml_session() as nv:
            if nv is None:
                return {}
            g = nv.gpus()[0]
            # not "driver": that key is the driver checkpoint path's results
            return {"gpu": g["name"], "gpu_memory": g["memory"], "driver_version": nv.driver_release()}
    except Exception as e:  # noqa: BLE001 (the benchmark does not need it)
        return {"gpu_info_error": str(e)}


def _sigterm(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")  # so that every finally runs


def missing_modules(names: tuple[str, ...]) -> list[str]:
    return [m for m in names if importlib.util.find_spec(m) is None]


def job_command(program: Path, stage_ahead: bool = False) -> list[str]:
    """The job under the agent; its own process is the one to snapshot and checkpoint."""
    return [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent",
            *(["--stage-ahead"] if stage_ahead else []), "--no-images", "-o", os.devnull,
            "--", sys.executable, str(program)]


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The benchmark; returns (results, failures)."""
    program, needs = JOBS[args.job]
    missing = missing_modules(needs + (("cuda.bindings",) if args.driver else ()))
    if missing:
        raise SystemExit(f"bench_agent: --job {args.job} needs {', '.join(missing)}, which {sys.executable} "
                         "cannot import")
    failures: list[str] = []
    out: dict[str, Any] = {"benchmark": "bench_agent", "job": args.job, "program": f"workloads/{program}",
                           "gib": args.gib, "stage_ahead": args.stage_ahead, **gpu_info(), "host": platform.node(),
                           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "command": " ".join([Path(sys.executable).name, *sys.argv])}
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        log = t / "log"
        env = dict(os.environ, GPU_JOB_GIB=str(args.gib), GPUOS_JOB_STOP=str(t / "stop"),
                   GPUOS_JOB_LOG=str(log), GPUOS_JOB_READY=str(t / "ready"))
        started = time.time()
        proc = subprocess.Popen(job_command(WORKLOADS / program, args.stage_ahead), cwd=ROOT, env=env,
                                start_new_session=True)  # so that a failure here kills the job too, not only gpu-trace
        pid = None
        driver: dict[str, Any] | None = None
        try:
            while not (t / "ready").exists():
                if proc.poll() is not None:
                    raise SystemExit(f"bench_agent: the job ended (gpu-trace exit {proc.returncode}) before it was "
                                     "ready; its stderr is above")
                if time.time() - started > args.start_timeout:
                    raise SystemExit(f"bench_agent: the job was not ready after {args.start_timeout} s")
                time.sleep(0.1)
            pid = int((t / "ready").read_text())
            ready = time.time()
            out["job_start_s"] = round(ready - started, 1)
            print(f"bench_agent: {args.job} job ready (PID {pid}) after {ready - started:.1f} s",
                  file=sys.stderr, flush=True)
            time.sleep(args.settle)  # steady state

            hooks0 = ping_hooks(pid)
            answers = []
            for k in range(args.snapshots):
                try:
                    a = snapshot(pid, args.snapshot_timeout)
                except Exception as e:  # noqa: BLE001 (recorded; the driver path can still be measured)
                    failures.append(f"agent snapshot {k}: {type(e).__name__}: {e}")
                    print(f"bench_agent: agent snapshot {k} FAILED: {e}", file=sys.stderr, flush=True)
                    break
                answers.append(a)
                print(f"bench_agent: agent snapshot {k}: {a['wall_s']:.3f} s wall, {a['seconds']:.3f} s copying, "
                      f"{a['gbps']} GB/s, stall {1e3 * a['stall_s']:.3f} ms, cow {a.get('cow')}",
                      file=sys.stderr, flush=True)
                time.sleep(1.0)

            out["launch_hooks"] = hook_costs(hooks0, ping_hooks(pid))
            if args.driver:
                time.sleep(args.settle - 1.0 if args.settle > 1.0 else 0)
                driver = driver_path(pid, args.lock_timeout_ms, answers[-1]["bytes"] if answers else None)
                if not driver["ok"]:
                    failures.append(f"driver path: {driver.get('error')}")
                    leave_running(pid)
                else:
                    print(f"bench_agent: driver path: lock {driver['lock_s']:.4f} s, checkpoint "
                          f"{driver['checkpoint_s']:.3f} s, restore {driver['restore_s']:.3f} s, unlock "
                          f"{driver['unlock_s']:.4f} s; stall {driver['stall_s']:.3f} s", file=sys.stderr, flush=True)
                    time.sleep(args.after)  # the job must be running again
                    after = [w for w in windows(read_rates(log)) if w[0] >= driver["wall_unlock_end"]]
                    alive = proc.poll() is None and Path(f"/proc/{pid}").exists()
                    driver["healthy_after"] = alive and len(after) >= 3 and all(r > 0 for _, _, r in after)
                    driver["job_windows_after"] = len(after)
                    driver["job_iters_per_s_after"] = (round(statistics.median(r for _, _, r in after), 1)
                                                       if after else None)
                    if not driver["healthy_after"]:
                        failures.append(f"the job is not running normally after the driver's restore (alive: "
                                        f"{alive}, {len(after)} windows logged in {args.after} s)")
                    else:
                        try:
                            a = snapshot(pid, args.snapshot_timeout_after)
                            out["agent_after_driver"] = {k: a[k] for k in ("ok", "bytes", "seconds", "gbps", "stall_s",
                                                                           "cow", "wall_s") if k in a}
                        except Exception as e:  # noqa: BLE001 (a finding, reported; the benchmark goes on)
                            out["agent_after_driver"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                            print(f"bench_agent: the agent could not snapshot after the driver's restore: {e}",
                                  file=sys.stderr, flush=True)
            (t / "stop").touch()
            try:  # a job that stopped logging may be hung: do not wait as long for it
                out["job_exit"] = proc.wait(timeout=120 if not failures else 20)
            except subprocess.TimeoutExpired:
                out["job_exit"] = None
            if out["job_exit"] != 0:
                failures.append(f"the job (under gpu-trace) did not end cleanly: exit {out['job_exit']}")
        finally:
            if pid is not None and args.driver and proc.poll() is None:
                leave_running(pid)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        job_log = read_log(log)
        rates = [(ts, r) for ts, r, _ in job_log]

    wins = windows(rates)
    first_action = answers[0]["wall_start"] if answers else (driver or {}).get("wall_lock_start", time.time())
    before = median_rate(wins, ready + 0.3, first_action)
    out["job_iters_per_s_before"] = before
    out["job_longest_iteration_s_before"] = longest_gap(job_log, [(ready + 0.3, first_action)])
    out["agent"] = summarize_agent(answers, wins, before, job_log)
    if driver is not None:
        if driver.get("ok"):
            interval = [(driver["wall_lock_start"], driver["wall_unlock_end"])]
            during = over(wins, interval)
            last_agent = answers[-1]["wall_end"] if answers else ready
            driver["job_iters_per_s_just_before"] = median_rate(wins, last_agent + 0.3, driver["wall_lock_start"])
            driver["job_during"] = during
            driver["job_iters_per_s_during"] = during["iters_per_s"] if during else None
            driver["job_throughput_loss"] = loss(before, driver["job_iters_per_s_during"])
        out["driver"] = driver
    out["side_by_side"] = side_by_side(out["agent"], driver)
    out["job_log"] = [[round(ts, 3), r] for ts, r in rates]
    return out, failures


def summarize_agent(answers: list[dict[str, Any]], wins: list, before: float | None,
                    job_log: list | None = None) -> dict[str, Any]:
    """The agent's snapshots: the first (which may pin the staging) apart from the steady ones,
    each with the job's throughput and longest iteration while they ran."""
    if not answers:
        return {"snapshots": []}
    job_log = job_log or []
    agent: dict[str, Any] = {"snapshots": answers}
    a = answers[0]
    first_iv = [(a["wall_start"], a["wall_end"])]
    first_during = over(wins, first_iv)
    agent["first"] = {"wall_s": a["wall_s"], "seconds": a["seconds"], "gbps": a["gbps"],
                      "stall_ms": round(1e3 * a["stall_s"], 3), "cow": a.get("cow"), "bytes": a["bytes"],
                      "staging_and_request_s": round(a["wall_s"] - a["seconds"], 3),
                      "staging_s": a.get("staging_s"), "pool_s": a.get("pool_s"),
                      "job_iters_per_s_during": first_during["iters_per_s"] if first_during else None,
                      "job_throughput_loss": loss(before, first_during["iters_per_s"] if first_during else None),
                      "job_longest_iteration_s": longest_gap(job_log, first_iv)}
    rest = answers[1:]
    if rest:
        steady_iv = [(x["wall_start"], x["wall_end"]) for x in rest]
        steady_during = over(wins, steady_iv)
        agent["steady"] = {
            "n": len(rest),
            "wall_s_median": round(statistics.median(x["wall_s"] for x in rest), 6),
            "seconds_median": round(statistics.median(x["seconds"] for x in rest), 6),
            "gbps_median": round(statistics.median(x["gbps"] for x in rest), 3),
            "gbps_min": min(x["gbps"] for x in rest),
            "stall_ms_median": round(1e3 * statistics.median(x["stall_s"] for x in rest), 3),
            "stall_ms_max": round(1e3 * max(x["stall_s"] for x in rest), 3),
            "pool_s_median": (round(statistics.median(x["pool_s"] for x in rest), 6)
                              if all("pool_s" in x for x in rest) else None),
            "job_iters_per_s_during": steady_during["iters_per_s"] if steady_during else None,
            "job_throughput_loss": loss(before, steady_during["iters_per_s"] if steady_during else None),
            "job_longest_iteration_s": longest_gap(job_log, steady_iv),
        }
    agent["stall_ms"] = [round(1e3 * x["stall_s"], 3) for x in answers]
    agent["gbps"] = [x["gbps"] for x in answers]
    intervals = [(x["wall_start"], x["wall_end"]) for x in answers]
    during = over(wins, intervals)
    agent["job_during"] = during
    agent["job_iters_per_s_during"] = during["iters_per_s"] if during else None
    # the measure of the first device runs: median of the windows ending within a snapshot (+0.1 s)
    old = [r for s, e, r in wins if any(a0 <= e <= a1 + 0.1 for a0, a1 in intervals)]
    agent["job_iters_per_s_during_windows_median"] = round(statistics.median(old), 1) if old else None
    agent["job_throughput_loss"] = loss(before, agent["job_iters_per_s_during"])
    return agent


def side_by_side(agent: dict[str, Any], driver: dict[str, Any] | None) -> dict[str, Any]:
    stalls = agent.get("stall_ms") or []
    agent_stall = statistics.median(stalls) if stalls else None
    steady = agent.get("steady") or {}
    first = agent.get("first") or {}
    d = driver if driver and driver.get("ok") else {}
    driver_stall = 1e3 * d["stall_s"] if d else None
    out = {
        "stall_ms": {"agent_median": agent_stall, "agent_max": max(stalls) if stalls else None,
                     "driver": round(driver_stall, 3) if driver_stall is not None else None},
        "stall_ratio_driver_over_agent": (round(driver_stall / agent_stall, 1)
                                          if driver_stall is not None and agent_stall else None),
        "seconds": {"agent_first_wall": first.get("wall_s"), "agent_steady_wall": steady.get("wall_s_median"),
                    "agent_steady_copying": steady.get("seconds_median"),
                    "driver_checkpoint": d.get("checkpoint_s"), "driver_restore": d.get("restore_s")},
        "gbps": {"agent_first": first.get("gbps"), "agent_steady": steady.get("gbps_median"),
                 "driver_checkpoint": d.get("checkpoint_gbps"), "driver_restore": d.get("restore_gbps")},
        "bytes": {"agent": first.get("bytes"), "driver": d.get("bytes"), "driver_source": d.get("bytes_source")},
        "job_iters_per_s_during": {"agent": agent.get("job_iters_per_s_during"),
                                   "driver": d.get("job_iters_per_s_during")},
        "job_throughput_loss": {"agent": agent.get("job_throughput_loss"), "driver": d.get("job_throughput_loss")},
    }
    out["targets"] = {
        "P1_agent_stall_le_10ms": agent_stall <= 10.0 if agent_stall is not None else None,
        "P2_agent_ge_45gbps": (steady.get("gbps_median") or first.get("gbps") or 0) >= 45 if first else None,
    }
    return out


def human(out: dict[str, Any]) -> str:
    sbs = out["side_by_side"]
    a, d = out["agent"], out.get("driver") or {}
    if not isinstance(d, dict):  # results written before the key "driver_version" existed
        d = {}
    lines = [(f"bench_agent: {out['job']} job, {out['gib']} GiB asked, on {out.get('gpu', '?')}; job "
              f"{out['job_iters_per_s_before']} iters/s before, longest iteration "
              f"{out.get('job_longest_iteration_s_before')} s")]
    if a.get("first"):
        f = a["first"]
        lines.append(f"  agent first snapshot: {f['wall_s']:.3f} s wall ({f['staging_and_request_s']:.3f} s pinned "
                     f"staging + request), {f['seconds']:.3f} s copying, {f['gbps']} GB/s, stall {f['stall_ms']} ms; "
                     f"job {f['job_iters_per_s_during']} iters/s, longest iteration {f['job_longest_iteration_s']} s")
    if a.get("steady"):
        s = a["steady"]
        lines.append(f"  agent steady ({s['n']}): {s['wall_s_median']:.3f} s wall, {s['gbps_median']} GB/s, stall "
                     f"{s['stall_ms_median']} ms median / {s['stall_ms_max']} ms max; job "
                     f"{s['job_iters_per_s_during']} iters/s (loss {s['job_throughput_loss']}), longest iteration "
                     f"{s['job_longest_iteration_s']} s")
    h = out.get("launch_hooks")
    if h:
        lines.append(f"  agent on the launch path: {h['before']['us_per_launch']} us/launch before the first snapshot, "
                     f"{h['after_first']['us_per_launch']} after ({h['after_first']['predicted']} of "
                     f"{h['after_first']['launches']} launches predicted, {h['epochs_after_first']} epochs)")
    if a.get("snapshots"):
        lines.append(f"  agent: job {a['job_iters_per_s_during']} iters/s during snapshots "
                     f"(loss {a['job_throughput_loss']})")
    if d and d.get("ok"):
        lines.append(f"  driver: stall {d['stall_s']:.3f} s (lock {d['lock_s']:.4f} + checkpoint {d['checkpoint_s']:.3f}"
                     f" + restore {d['restore_s']:.3f} + unlock {d['unlock_s']:.4f} + {d['between_steps_s']:.4f} "
                     f"between), checkpoint {d['checkpoint_gbps']} GB/s ({d['bytes_source']} bytes), restore "
                     f"{d['restore_gbps']} GB/s; job {d.get('job_iters_per_s_during')} iters/s during, "
                     f"{d.get('job_iters_per_s_after')} after (healthy: {d.get('healthy_after')})")
        lines.append(f"  stall ratio driver / agent: {sbs['stall_ratio_driver_over_agent']}; agent snapshot after "
                     f"the driver's restore: {(out.get('agent_after_driver') or {}).get('ok')}")
    elif d:
        lines.append(f"  driver path FAILED: {d.get('error')}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=sorted(JOBS), default="cupy", help="the job to run (default cupy)")
    ap.add_argument("--stage-ahead", action="store_true",
                    help="run the job with `gpu-trace run --agent --stage-ahead` (staging pinned in the background; "
                    "give it --settle time: ~4 s per 8 GiB of pinning at a quarter duty)")
    ap.add_argument("--gib", type=float, default=8.0, help="GiB the job holds on the GPU (GPU_JOB_GIB; default 8)")
    ap.add_argument("--snapshots", type=int, default=6, help="agent snapshots, 1 s apart (default 6)")
    ap.add_argument("--driver", action=argparse.BooleanOptionalAction, default=True,
                    help="then time the driver path (suspend + resume) on the same job (default on)")
    ap.add_argument("--lock-timeout-ms", type=int, default=10_000, help="the driver lock's timeout (default 10000)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of steady state before each path (default 2)")
    ap.add_argument("--after", type=float, default=3.0,
                    help="seconds the job must go on logging after the driver's restore (default 3)")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds for the job to be ready (default 300)")
    ap.add_argument("--snapshot-timeout", type=float, default=300.0)
    ap.add_argument("--snapshot-timeout-after", type=float, default=60.0,
                    help="timeout of the agent snapshot after the driver's restore (default 60)")
    ap.add_argument("--json", type=Path, help="write the full results here")
    args = ap.parse_args(argv)
    if args.snapshots < 0:
        ap.error("--snapshots must be >= 0")
    if args.snapshots == 0 and not args.driver:
        ap.error("nothing to measure: --snapshots 0 and --no-driver")
    return args


def main() -> int:
    args = parse()
    signal.signal(signal.SIGTERM, _sigterm)
    out, failures = run(args)
    out["failures"] = failures
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out.get(k) for k in ("job", "gib", "job_iters_per_s_before", "side_by_side", "failures")},
                     indent=1))
    print(human(out), file=sys.stderr)
    for f in failures:
        print(f"bench_agent: FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
