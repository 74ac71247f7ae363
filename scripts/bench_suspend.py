#!/usr/bin/env python3
"""Suspend and resume of a >= 8 GiB CuPy job through the agent against the driver checkpoint
path on a CUPTI-free copy of the same job, side by side in one run.

The job is workloads/suspend_job.py (--gib GiB in 256 MiB arrays, then a launch about
every millisecond).

1. agent path: the job under `gpu-trace run --agent` with GPUOS_AGENT_OWN=1; --reps times
   each, in one job: suspend through the control socket (--partial: the job has no cuBLAS, but
   the context-side remainder is reported either way), hold --hold s, resume -- eager (every
   buffer back before the program goes on), then lazy (`--lazy`: the program goes on at once,
   the residency engine loads behind it). The first suspend pins the agent's host staging
   (`staging_s`, reported apart); the later ones reuse it. Resume-to-first-kernel: while
   suspended the bench creates D/stamp; the job, after its next launch has run, writes
   time.monotonic() (one clock for both processes); minus the time of the resume request. It
   includes a synchronisation of the job's stream and the file's round trip (~0.1 ms), so it is
   an upper bound. (Until 2026-11-24 the job synchronised the whole device, which also waits for
   the lazy resume's background loads: those figures are the full reload, not the first kernel.) Lazy full reload: the engine's background loader from its start (in the resume
   request) until every buffer is back, bytes / that time (ping's `residency`).
2. driver path: the same job run alone (no agent, no CUPTI, CuPy's own allocator);
   gpuos_tools.ckpt.driver's Checkpointer.suspend (lock + checkpoint), hold, resume (restore +
   unlock), --reps times.

For each: the suspend call's wall time, the time until NVML shows the job's memory given back
(sampled every ~2 ms from here: the first sample at which the process holds less than its
usage before minus 90% of --gib; the driver path's process disappears from NVML's list, which
counts as 0), the resume call's wall time, GB/s each way over the job's bytes, and whether the
job's checksum is unchanged afterwards. JSON to --json; a table on stderr.

    python3 scripts/bench_suspend.py [--gib 8] [--reps 2] [--hold 0.5] [--no-lazy] [--no-driver] [--json FILE]
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
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "workloads" / "suspend_job.py"
GIB = 1 << 30


class Sampler:
    """NVML's view of one process's GPU memory, sampled on a thread."""

    def __init__(self, nv: Any, pid: int) -> None:
        self.nv, self.pid = nv, pid
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def used(self) -> int:
        return sum(g["memory"] or 0 for g in self.nv.processes().get(self.pid, []))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), self.used()))
            time.sleep(0.002)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def first_below(self, limit: int, since: float) -> float | None:
        for t, used in self.samples:
            if t >= since and used <= limit:
                return t - since
        return None


def wait_file(path: Path, proc: subprocess.Popen, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise SystemExit(f"the job ended (status {proc.returncode}) before {path.name}")
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path.name} after {timeout} s")
        time.sleep(0.02)
    return json.loads(path.read_text())


def check(d: Path, proc: subprocess.Popen) -> int:
    out = d / "check.json"
    if out.exists():
        out.unlink()
    (d / "check").write_text("")
    return wait_file(out, proc)["checksum"]


def start(d: Path, gib: float, agent: bool) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("GPUOS_AGENT_OWN", None)
    cmd = [sys.executable, str(JOB), "--gib", str(gib), "--dir", str(d)]
    if agent:
        env["GPUOS_AGENT_OWN"] = "1"
        cmd = [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o",
               str(d / "trace.ndjson.zst"), "--", *cmd]
    return subprocess.Popen(cmd, env=env, cwd=ROOT)


def stop(d: Path, proc: subprocess.Popen) -> None:
    (d / "exit").write_text("")
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def first_kernel(d: Path, proc: subprocess.Popen, t_request: float) -> float:
    """Seconds from ``t_request`` (time.monotonic) to the job's stamp after its next launch."""
    return wait_file(d / "stamp.json", proc, timeout=120)["t"] - t_request


def demand_text(lz: dict[str, Any]) -> str:
    """The engine's GPU timing of its demand loads (ms from the background loader's start)."""
    out = "".join(f"; demand copy of {x['bytes'] >> 20} MiB issued at {x['issued_ms']:.2f} ms, on the GPU "
                  f"{x['gpu_start_ms']:.2f}-{x['gpu_end_ms']:.2f} ms" for x in lz.get("demand") or [])
    if lz.get("background_gpu_ms") is not None:
        out += f"; background copies ended on the GPU at {lz['background_gpu_ms']:.1f} ms"
    if lz.get("yields"):
        out += f"; loader paused {lz['yields']}x ({lz.get('yield_s', 0) * 1000:.2f} ms)"
    return out


def wait_lazy_done(sock: Any, timeout: float = 120.0) -> dict[str, Any]:
    """The residency engine's stats once its lazy reload has finished."""
    from gpuos_tools.agent import control

    deadline = time.monotonic() + timeout
    while True:
        res = control.request(sock, "ping", timeout=30).get("residency") or {}
        lazy = res.get("lazy") or {}
        if lazy.get("done") or lazy.get("error") or time.monotonic() > deadline:
            return res
        time.sleep(0.01)


def agent_path(nv: Any, gib: float, reps: int, hold: float, lazy: bool = True) -> dict[str, Any]:
    from gpuos_tools.agent import control
    from gpuos_tools.agent.suspend import request_resume, request_suspend

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        proc = start(d, gib, agent=True)
        rows: list[dict[str, Any]] = []
        try:
            ready = wait_file(d / "ready", proc)
            pid = ready["pid"]
            sock = control.resolve(str(pid))
            for mode in ["eager"] * reps + (["lazy"] * reps if lazy else []):
                with Sampler(nv, pid) as smp:
                    base = smp.used()
                    t0 = time.perf_counter()
                    s = request_suspend(sock, partial=True)
                    t1 = time.perf_counter()
                    time.sleep(hold)
                    ping = control.request(sock, "ping", timeout=30)
                    (d / "stamp.json").unlink(missing_ok=True)  # the last rep's
                    (d / "stamp").write_text("")
                    t2 = time.perf_counter()
                    m2 = time.monotonic()
                    r = request_resume(sock, lazy=mode == "lazy")
                    t3 = time.perf_counter()
                    to_kernel = first_kernel(d, proc, m2)
                    res = wait_lazy_done(sock) if mode == "lazy" else None
                    time.sleep(0.05)
                freed = smp.first_below(base - int(0.9 * gib * GIB), t0)
                back = smp.first_below(10 ** 18, t3)  # a sample after resume exists
                low = min((u for t, u in smp.samples if t1 <= t <= t2), default=None)
                same = check(d, proc) == ready["checksum"]
                row = {
                    "mode": mode, "suspend_wall_s": t1 - t0, "resume_wall_s": t3 - t2, "gpu_freed_s": freed,
                    "resume_to_first_kernel_s": to_kernel, "nvml_before": base, "nvml_suspended": low,
                    "ping_state": ping.get("state"), "suspend": s, "resume": r, "residency": res,
                    "sampled_after_resume": back is not None, "checksum_same": same,
                }
                if res is not None:
                    lz = res.get("lazy") or {}
                    row["reload_s"], row["reload_gbps"] = lz.get("load_s"), lz.get("load_gbps")
                rows.append(row)
                lz = (res or {}).get("lazy") or {}
                more = (f", reload {row['reload_s']} s @ {row['reload_gbps']} GB/s (demand {lz.get('demand_loads')}, "
                        f"background {lz.get('background_loads')}, in order {lz.get('order_predicted')})"
                        f"{demand_text(lz)}" if res is not None else
                        f" @ {r['load_gbps']} GB/s")
                print(f"  agent {mode}: suspend {t1 - t0:.3f} s (staging {s['staging_s']:.3f}, lock+settle+sync "
                      f"{s['lock_s'] + s['settle_s'] + s['sync_s']:.4f}, save {s['save_s']:.3f} s @ {s['save_gbps']} GB/s), "
                      f"freed after {freed}, resume call {t3 - t2:.4f} s{more}, to first kernel "
                      f"{to_kernel * 1000:.2f} ms, data same {same}", file=sys.stderr, flush=True)
        finally:
            stop(d, proc)
    return {"rows": rows, "checksum_same": all(r["checksum_same"] for r in rows),
            "bytes": rows[0]["suspend"]["released_bytes"] if rows else None}


def driver_path(nv: Any, gib: float, reps: int, hold: float) -> dict[str, Any]:
    from gpuos_tools.ckpt.driver import Checkpointer

    ckpt = Checkpointer()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        proc = start(d, gib, agent=False)
        rows: list[dict[str, Any]] = []
        try:
            ready = wait_file(d / "ready", proc)
            pid = ready["pid"]
            for _ in range(reps):
                with Sampler(nv, pid) as smp:
                    base = smp.used()
                    t0 = time.perf_counter()
                    s = ckpt.suspend(pid)
                    t1 = time.perf_counter()
                    time.sleep(hold)
                    t2 = time.perf_counter()
                    r = ckpt.resume(pid)
                    t3 = time.perf_counter()
                freed = smp.first_below(base - int(0.9 * gib * GIB), t0)
                rows.append({"suspend_wall_s": t1 - t0, "resume_wall_s": t3 - t2, "gpu_freed_s": freed,
                             "nvml_before": base, "lock_s": s["lock_s"], "checkpoint_s": s["checkpoint_s"],
                             "restore_s": r["restore_s"], "unlock_s": r["unlock_s"], "bytes": s.get("bytes")})
                print(f"  driver: suspend {t1 - t0:.3f} s (checkpoint {s['checkpoint_s']:.3f}), freed after {freed}, "
                      f"resume {t3 - t2:.3f} s (restore {r['restore_s']:.3f})", file=sys.stderr, flush=True)
            same = check(d, proc) == ready["checksum"]
        finally:
            if proc.poll() is None:
                try:
                    if ckpt.state(pid) in ("checkpointed", "locked"):
                        ckpt.resume(pid)
                except Exception as e:  # noqa: BLE001 (report; the job ends next anyway)
                    print(f"bench_suspend: could not resume the driver-path job: {e}", file=sys.stderr)
            stop(d, proc)
    return {"rows": rows, "checksum_same": same}


def med(rows: list[dict[str, Any]], get: Any) -> float | None:
    vals = [v for v in (get(r) for r in rows) if v is not None]
    return round(statistics.median(vals), 6) if vals else None


def side_by_side(agent: dict[str, Any], driver: dict[str, Any] | None, gib: float) -> dict[str, Any]:
    rows = agent["rows"]
    a = [r for r in rows if r["mode"] == "eager"]
    lz = [r for r in rows if r["mode"] == "lazy"]
    steady = rows[1:] or rows  # the first suspend pins the staging
    nbytes = agent.get("bytes") or gib * GIB
    out: dict[str, Any] = {
        "agent": {
            "suspend_s_first": a[0]["suspend_wall_s"] if a else None,
            "staging_s_first": a[0]["suspend"]["staging_s"] if a else None,
            "suspend_s": med(steady, lambda r: r["suspend_wall_s"]),
            "stall_to_stop_s": med(steady, lambda r: r["suspend"]["lock_s"] + r["suspend"]["settle_s"] + r["suspend"]["sync_s"]),
            "gpu_freed_s": med(steady, lambda r: r["gpu_freed_s"]),
            "save_gbps": med(steady, lambda r: r["suspend"]["save_gbps"]),
            "resume_s": med(a, lambda r: r["resume_wall_s"]),
            "load_gbps": med(a, lambda r: r["resume"]["load_gbps"]),
            "resume_to_first_kernel_s": med(a, lambda r: r["resume_to_first_kernel_s"]),
            "not_owned": a[0]["suspend"]["not_owned"] if a else None,
            "nvml_suspended": med(a, lambda r: r["nvml_suspended"]),
            "checksum_same": agent["checksum_same"],
        },
    }
    if lz:
        out["agent_lazy"] = {
            "resume_s": med(lz, lambda r: r["resume_wall_s"]),
            "resume_to_first_kernel_s": med(lz, lambda r: r["resume_to_first_kernel_s"]),
            "resume_to_first_kernel_s_each": [round(r["resume_to_first_kernel_s"], 6) for r in lz],
            "reload_s": med(lz, lambda r: r["reload_s"]),
            "reload_gbps": med(lz, lambda r: r["reload_gbps"]),
            "reload_gbps_each": [r["reload_gbps"] for r in lz],
            "demand_loads": [(r["residency"].get("lazy") or {}).get("demand_loads") for r in lz],
            "stream_waits": [(r["residency"].get("lazy") or {}).get("stream_waits") for r in lz],
            "order_predicted": [(r["residency"].get("lazy") or {}).get("order_predicted") for r in lz],
            "demand_gpu": [(r["residency"].get("lazy") or {}).get("demand") for r in lz],
            "background_gpu_ms": [(r["residency"].get("lazy") or {}).get("background_gpu_ms") for r in lz],
            "checksum_same": all(r["checksum_same"] for r in lz),
        }
    if driver is not None:
        d = driver["rows"]
        out["driver"] = {
            "suspend_s": med(d, lambda r: r["suspend_wall_s"]),
            "gpu_freed_s": med(d, lambda r: r["gpu_freed_s"]),
            "checkpoint_gbps": med(d, lambda r: nbytes / r["checkpoint_s"] / 1e9),
            "resume_s": med(d, lambda r: r["resume_wall_s"]),
            "restore_gbps": med(d, lambda r: nbytes / r["restore_s"] / 1e9),
            "checksum_same": driver["checksum_same"],
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hold", type=float, default=0.5, help="seconds suspended")
    ap.add_argument("--no-driver", action="store_true", help="skip the driver path")
    ap.add_argument("--no-lazy", action="store_true", help="skip the lazy resumes")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    from gpuos_tools.cuda.nvml import open_nvml

    nv = open_nvml()
    if nv is None:
        raise SystemExit("bench_suspend needs NVML (nvidia-ml-py)")
    gpu = nv.gpus()[0]
    if gpu["memory_free"] < (args.gib + 2) * GIB:
        raise SystemExit(f"GPU 0 has {gpu['memory_free'] / GIB:.1f} GiB free; {args.gib + 2} GiB needed")
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
                           "gpu": gpu["name"], "driver_version": nv.driver_release(), "gib": args.gib,
                           "reps": args.reps, "hold_s": args.hold}
    rc = 0
    print("bench_suspend: agent path", file=sys.stderr, flush=True)
    out["agent_path"] = agent_path(nv, args.gib, args.reps, args.hold, lazy=not args.no_lazy)
    out["driver_path"] = None
    if not args.no_driver:
        print("bench_suspend: driver path (the same job without the agent)", file=sys.stderr, flush=True)
        try:
            out["driver_path"] = driver_path(nv, args.gib, args.reps, args.hold)
        except Exception as e:  # noqa: BLE001 (the agent's figures still stand)
            out["driver_path_error"] = f"{type(e).__name__}: {e}"
            rc = 1
    out["summary"] = side_by_side(out["agent_path"], out["driver_path"], args.gib)
    if not out["agent_path"]["checksum_same"] or (out["driver_path"] and not out["driver_path"]["checksum_same"]):
        rc = 1
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"]))
    nv.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
