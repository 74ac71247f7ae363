#!/usr/bin/env python3
"""Benchmarks of gpu-kinfer-bridge; JSON to --json.

- round_trip (CPU; the round-trip target, <= 5 / <= 20 us from Python): a daemon (`gpu-kinfer-bridge
  serve --gpu off`, its own process, with the native C loop, at its default waiting unless
  --spin-us) and one Python producer here (`RingClient` at its defaults: one C call per request
  where a compiler is found); sequential requests of batch 1; p50/p99/p99.9 of the producer's wall
  time from submit to answer, and of the daemon's part (submit_ns to done_ns); then the client's
  two request paths side by side (client_paths: --path-reps alternating runs of `native="on"` and
  `native="off"`, the CPython path); then the same with examples/kinfer_producer.c as the producer. Then the Python producer again with a
  pause before each request (--gaps, in µs: a sleep from 1 ms up, a busy wait below, as a producer
  waiting for work would), with the daemon's CPU use over each run, and the daemon's CPU use while
  idle (--idle-s after the traffic stops, once its spin window has passed). round_trip_python: the
  same with `--native off` (the CPython loop), for comparison.
- sweep: median latency of one batch on the CPU (numpy, and the native loop's C forward) and
  the GPU (copy in, run, copy out, synchronise) across batch sizes, and the crossover.
- gpu_throughput (the throughput target, >= 20 M/s): inferences/s of the LinnOS model at batch >=
  1024, end to end (host arrays in and out) and on device arrays only (CUDA events), fused kernel
  and cuBLAS.
- policy: for each GPU load (none, and a second process running matrix products at a duty
  cycle) and each batch size, the side the policy picks against the side faster on average
  under that load: the mean latency of --truth-n batches per side spread evenly over
  --truth-span-s seconds, i.e. over many periods of the load's duty cycle (the median of the
  same batches is reported, and judged against, beside it). The pick is the daemon's: the
  profile calibrated from the idle sweep, the GPU's curve plus its measured mean delay
  (policy.GpuSpeed: probes on the jittered schedule NVML's view of other processes sets, and
  the batches it picked the GPU for), the CPU's curve as a + b times it (policy.CpuSpeed.fit:
  the batches it picked the CPU for). Beside it, on the same rows: the same GPU samples as a
  ratio of means scaling the GPU's curve, the previous CPU form (its curve times the ratio of
  the means, "cpu_ratio_pick"), and the first session's fixed-factor rule (x4 while NVML says
  busy, the CPU as calibrated).

GPU parts are skipped, with the reason in the JSON and on stderr, where CuPy or a GPU is
missing. BLAS runs on one thread, as in the daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

ROOT = Path(__file__).resolve().parent.parent

import numpy as np  # noqa: E402

from gpuos_tools.kinfer import ring as R  # noqa: E402
from gpuos_tools.kinfer.model import Mlp  # noqa: E402
from gpuos_tools.kinfer.policy import (  # noqa: E402
    CpuSpeed,
    GpuLoad,
    GpuSpeed,
    Policy,
    crossover,
    steady_curve,
    time_us,
)

LOAD_CHILD = r"""
import sys, time, cupy as cp
duty = float(sys.argv[1])
a = cp.random.random((8192, 8192), dtype=cp.float32)
b = cp.random.random((8192, 8192), dtype=cp.float32)
c = a @ b
cp.cuda.Device().synchronize()
print("ready", flush=True)
n, period, busy = 0, 0.0, 0.0
while True:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.05 * duty:
        cp.matmul(a, b, out=c)
        cp.cuda.Device().synchronize()
    t1 = time.perf_counter()
    time.sleep(0.05 * (1 - duty))
    n, period, busy = n + 1, period + time.perf_counter() - t0, busy + t1 - t0
    if n % 10 == 0:
        print(f"cycle {n} {period / n * 1e3:.3f} {busy / n * 1e3:.3f}", flush=True)
"""


def log(message: str) -> None:
    print(f"bench_kinfer: {message}", file=sys.stderr, flush=True)


def pct(values: list[float] | np.ndarray) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"n": int(a.size), "p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3),
            "p99.9": round(float(np.percentile(a, 99.9)), 3), "mean": round(float(a.mean()), 3)}


def pin_process(pid: int, cores: set[int]) -> None:
    """Every thread of ``pid`` (the native loop is a thread of its own) on ``cores``."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except ProcessLookupError:
            pass


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def paced(client: R.RingClient, x: np.ndarray, gap_us: float, n: int, daemon: int) -> dict:
    """n round trips, each after a pause of gap_us; the daemon's CPU share over the run."""
    gap = gap_us / 1e6
    rts = []
    sleeps0 = client.ring.counter_values()["sleeps"]
    cpu0, t0 = cpu_seconds(daemon), time.monotonic()
    for _ in range(n):
        if gap >= 0.001:
            time.sleep(gap)
        elif gap > 0:
            due = time.perf_counter() + gap
            while time.perf_counter() < due:
                pass
        ta = time.perf_counter_ns()
        client.infer(x)
        rts.append((time.perf_counter_ns() - ta) / 1e3)
    span = time.monotonic() - t0
    return {"gap_us": gap_us, **pct(rts), "daemon_sleeps": client.ring.counter_values()["sleeps"] - sleeps0,
            "daemon_cpu": round((cpu_seconds(daemon) - cpu0) / span, 3), "seconds": round(span, 3)}


def client_paths(name: str, x: np.ndarray, requests: int, reps: int) -> dict:
    """The Python producer's two request paths side by side on the same daemon, alternating, reps
    runs each: ``RingClient(native="on")`` (one C call per request, the default where a compiler
    is found) and ``native="off"`` (the CPython path, the fallback)."""
    runs: dict[str, list[dict]] = {"c_path": [], "python_path": []}
    for _ in range(reps):
        for key, native in (("c_path", "on"), ("python_path", "off")):
            try:
                client = R.RingClient(name, native=native)
            except R.RingError as e:
                runs[key].append({"skipped": str(e)})
                continue
            with client:
                for _ in range(2000):
                    client.infer(x)
                wall = []
                for _ in range(requests):
                    t0 = time.perf_counter_ns()
                    client.infer(x)
                    wall.append((time.perf_counter_ns() - t0) / 1e3)
            runs[key].append(pct(wall))
    for key, rows in runs.items():
        p50s = [r["p50"] for r in rows if "p50" in r]
        if p50s:
            log(f"  {key}: p50 {min(p50s)}-{max(p50s)} us, p99 {min(r['p99'] for r in rows if 'p99' in r)}-"
                f"{max(r['p99'] for r in rows if 'p99' in r)} us over {len(p50s)} runs")
    return runs


def round_trip(requests: int, spin_us: float | None, cores: list[int] | None, native: str = "on",
               gaps: list[float] = (), gap_s: float = 3.0, idle_s: float = 3.0, path_reps: int = 3) -> dict:
    name = f"kinfer-bench-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    spin = [] if spin_us is None else ["--spin-us", str(spin_us)]
    proc = subprocess.Popen([sys.executable, str(ROOT / "cmd" / "gpu-kinfer-bridge"), "serve", "--ring", name, "--gpu", "off",
                             "--random-model", "0", *spin, "--native", native, "-o", os.devnull], env=env)
    mask = os.sched_getaffinity(0)
    try:
        deadline = time.monotonic() + 60
        while True:
            if R.served_by(name, proc.pid):
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("daemon did not start")
            time.sleep(0.02)
        if cores:  # daemon and producer each on a core of its own, as a kernel helper and a daemon would be
            pin_process(proc.pid, {cores[0]})
            os.sched_setaffinity(0, {cores[1]})
        with R.RingClient(name) as client:
            client_native = client.native
            x = np.random.default_rng(0).integers(0, 10, 31).astype(np.float32)
            for _ in range(2000):
                client.infer(x)
            wall, daemon, batches = [], [], []
            for _ in range(requests):
                t0 = time.perf_counter_ns()
                a = client.infer(x)
                wall.append((time.perf_counter_ns() - t0) / 1e3)
                daemon.append(a.latency_ns / 1e3)
                batches.append(a.batch)
            counters = client.ring.counter_values()
            paths = client_paths(name, x, requests, path_reps)
            c_rt = c_round_trip(name, requests)
            gap_runs = []
            for g in gaps:
                n = max(50, min(requests, int(gap_s / max(g / 1e6, 20e-6))))
                gap_runs.append(paced(client, x, g, n, proc.pid))
                log(f"  gap {g:g} us: p50 {gap_runs[-1]['p50']} us, p99 {gap_runs[-1]['p99']} us, "
                    f"daemon CPU {gap_runs[-1]['daemon_cpu']:.0%}, {gap_runs[-1]['daemon_sleeps']} daemon sleeps")
            time.sleep(0.5)  # past any spin window (5 ms by default)
            cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
            time.sleep(idle_s)
            idle = {"seconds": idle_s, "daemon_cpu": round((cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0), 4)}
            log(f"  idle: daemon CPU {idle['daemon_cpu']:.1%} over {idle_s:g} s")
    finally:
        os.sched_setaffinity(0, mask)
        proc.terminate()
        proc.wait(timeout=30)
        R.ring_path(name).unlink(missing_ok=True)
    return {"producer_us": pct(wall), "client_native": client_native, "client_paths": paths, "daemon_us": pct(daemon),
            "batch_max": int(max(batches)),
            "daemon_sleeps": counters["sleeps"], "requests": requests, "cores": cores, "native": native, "c_producer": c_rt,
            "spin_us": spin_us if spin_us is not None else "adaptive (default)", "gaps": gap_runs, "idle": idle,
            "target": {"p50_us": 5, "p99_us": 20}}


def c_round_trip(name: str, requests: int) -> dict:
    """The same with examples/kinfer_producer.c as the producer (no Python on that side)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return {"skipped": "no C compiler"}
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "kinfer_producer"
        subprocess.run([cc, "-O2", "-I", str(R.HEADER_FILE.parent), str(ROOT / "examples" / "kinfer_producer.c"), "-o", str(exe)],
                       check=True)
        done = subprocess.run([str(exe), name, str(requests + 2000)], capture_output=True, text=True, check=True, timeout=600)
    rt = [int(line.split()[7]) / 1e3 for line in done.stdout.splitlines()[2000:]]
    return {"producer_us": pct(rt)}


def inputs(b: int) -> np.ndarray:
    return np.random.default_rng(b).integers(0, 10, (b, 31)).astype(np.float32)


def sweep(batches: list[int], reps: int, gpu: object | None) -> dict:
    model = Mlp.random(seed=0)
    cpu = steady_curve(lambda b: (lambda x=inputs(b): model.forward(x)), batches, reps)
    out = {"batches": batches, "cpu_us": cpu, "gpu_us": [], "crossover": None}
    try:
        from gpuos_tools.kinfer import native

        fwd = native.Forward(model)
        out["cpu_native_us"] = [round(time_us(lambda x=inputs(b): fwd(x), reps), 3) for b in batches if b <= 4096]
    except native.BuildError as e:
        out["cpu_native_us"] = f"skipped: {e}"
    if gpu is not None:
        out["gpu_us"] = steady_curve(lambda b: (lambda x=inputs(b): gpu.forward(x)), batches, reps, warmup=10)
        out["crossover"] = crossover(batches, cpu, out["gpu_us"])
        out["gpu_mode"] = gpu.mode
    return out


def gpu_throughput(batches: list[int], reps: int) -> dict:
    import cupy as cp

    from gpuos_tools.kinfer.gpu import GpuMlp

    model = Mlp.random(seed=0)
    out: dict = {}
    for mode in ("fused", "matmul"):
        g = GpuMlp(model, mode=mode)
        rows = []
        for b in batches:
            x = inputs(b)
            e2e = time_us(lambda: g.forward(x), reps, warmup=10)
            dx = cp.asarray(x)
            dy = cp.empty((b, 2), dtype=cp.float32)
            for _ in range(10):
                g.run_device(dx, dy, b)
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(g.stream)
            for _ in range(reps):
                g.run_device(dx, dy, b)
            stop.record(g.stream)
            stop.synchronize()
            dev_us = cp.cuda.get_elapsed_time(start, stop) * 1e3 / reps
            rows.append({"batch": b, "end_to_end_us": round(e2e, 3), "end_to_end_per_s": round(b / e2e * 1e6),
                         "device_us": round(dev_us, 3), "device_per_s": round(b / dev_us * 1e6)})
        out[mode] = rows
    out["target_per_s"] = 20_000_000
    return out


def _load_cycles(child: subprocess.Popen) -> dict:
    """The load process's own account of its duty cycle (its last 'cycle' line)."""
    try:
        out = child.stdout.read() if child.stdout is not None else ""
    except (OSError, ValueError):
        out = ""
    lines = [line.split() for line in out.splitlines() if line.startswith("cycle ")]
    if not lines:
        return {}
    n, period_ms, busy_ms = int(lines[-1][1]), float(lines[-1][2]), float(lines[-1][3])
    return {"cycles": n, "period_ms": round(period_ms, 2), "busy_ms": round(busy_ms, 2),
            "busy_fraction": round(busy_ms / period_ms, 3) if period_ms > 0 else None}


def _summary(values: list[float]) -> dict:
    a = np.asarray(values, dtype=np.float64)
    return {"mean": round(float(a.mean()), 3), "median": round(float(np.median(a)), 3),
            "se": round(float(a.std(ddof=1) / np.sqrt(a.size)), 3), "p90": round(float(np.percentile(a, 90)), 3),
            "max": round(float(a.max()), 3)}


def policy_accuracy(batches: list[int], gpu: object, idle: dict, duties: list[float], settle_s: float,
                    truth_n: int, truth_span_s: float, seed: int = 0) -> dict:
    """For each load and batch size: the daemon's pick, then the truth, the expected latency of
    one batch on each side under that load.

    The truth is the mean of ``truth_n`` batches on each side, one of each per time slot, the
    slots evenly covering ``truth_span_s`` and each batch started at a random point of its
    slot, so that the samples cover the load process's duty cycle (~65 ms at half load) evenly
    and lock onto no phase of it. The median of the same samples is reported beside it, and
    the picks are judged against both. While the truth is measured the daemon's estimates are
    kept as a daemon keeps them: probes when due, in the gaps between the slots, and the
    batches of the side it picked fed to that side's estimate."""
    model = Mlp.random(seed=0)
    pol = Policy(batches=idle["batches"], cpu_us=idle["cpu_us"], gpu_us=idle["gpu_us"])
    load = GpuLoad(pol)
    if not load.start():
        return {"skipped": load.error}
    rng = random.Random(seed)
    rows = []
    loads: dict[str, dict] = {}
    probing: dict[str, dict] = {}
    # the CPU's estimate lives through the GPU load changes, as a running daemon's would (its
    # samples age out on their own); it is fed by the batches picked for the CPU
    cpu_speed = CpuSpeed(pol)
    try:
        for duty in duties:
            child = None
            if duty > 0:
                child = subprocess.Popen([sys.executable, "-c", LOAD_CHILD, str(duty)], stdout=subprocess.PIPE, text=True)
                if child.stdout.readline().strip() != "ready":
                    raise RuntimeError("load process did not start")
                time.sleep(0.5)
            # a daemon that was running through the load change: its estimate starts from scratch
            # and is kept fresh on its schedule for settle_s before the first pick
            speed = GpuSpeed(pol, rng=random.Random(rng.random()))
            probe_ns = [0]

            def forward_probe(x: np.ndarray) -> object:
                t0 = time.perf_counter_ns()
                try:
                    return gpu.forward(x)
                finally:
                    probe_ns[0] += time.perf_counter_ns() - t0

            others = lambda: load.others >= max(1, pol.busy_procs)  # noqa: E731

            def tick() -> None:
                if speed.probe_due(others()):
                    speed.probe(forward_probe)

            t_duty = time.perf_counter()
            end = time.monotonic() + settle_s
            while time.monotonic() < end:
                tick()
                time.sleep(0.001)
            try:
                for b in batches:
                    x = inputs(b)
                    for _ in range(5):  # untimed: buffers of this size, code paths
                        gpu.forward(x)
                        model.forward(x)
                    tick()
                    busy = load.busy
                    delay, ratio, cpu_slowdown = speed.delay_us(), speed.slowdown(), cpu_speed.slowdown()
                    cpu_fit = cpu_speed.fit()
                    n_est, n_cpu = len(speed.fresh()), len(cpu_speed.samples)
                    pick = pol.choose(b, True, busy, delay, cpu_fit)
                    cpu_pred = cpu_fit[0] + cpu_fit[1] * pol.estimate("cpu", b)
                    # the same samples summarised as a ratio of the means (the GPU curve scaled)
                    gpu_ratio = pol.estimate("gpu", b) * ratio
                    ratio_pick = "gpu" if gpu_ratio < cpu_pred else "cpu"
                    # the previous CPU form: its curve times the ratio of the means (run 2)
                    cpu_ratio_pick = pol.choose(b, True, busy, delay, (0.0, cpu_slowdown))
                    # the first session's rule: the GPU's curve x4 while NVML says busy, the CPU's as calibrated
                    old_pick = "gpu" if pol.estimate("gpu", b) * (4.0 if busy else 1.0) < pol.estimate("cpu", b) else "cpu"
                    g_us, c_us = [], []
                    slot = truth_span_s / truth_n
                    t0 = time.perf_counter()
                    for i in range(truth_n):
                        target = t0 + (i + rng.random()) * slot
                        while True:
                            now = time.perf_counter()
                            if now >= target:
                                break
                            tick()
                            if target - now > 0.0015:
                                time.sleep(0.0005)
                        for side in (("gpu", "cpu") if i % 2 == 0 else ("cpu", "gpu")):
                            ta = time.perf_counter_ns()
                            if side == "gpu":
                                gpu.forward(x)
                                us = (time.perf_counter_ns() - ta) / 1e3
                                g_us.append(us)
                                if pick == "gpu":  # the daemon learns from the batches it runs, on their side
                                    speed.observe(b, us)
                            else:
                                model.forward(x)
                                us = (time.perf_counter_ns() - ta) / 1e3
                                c_us.append(us)
                                if pick == "cpu":
                                    cpu_speed.observe(b, us)
                    took = time.perf_counter() - t0
                    g, c = _summary(g_us), _summary(c_us)
                    faster = "gpu" if g["mean"] < c["mean"] else "cpu"
                    faster_median = "gpu" if g["median"] < c["median"] else "cpu"
                    margin = abs(g["mean"] - c["mean"]) / max(1e-9, float(np.hypot(g["se"], c["se"])))
                    rows.append({"duty": duty, "batch": b, "busy": busy, "util": load.util, "others": load.others,
                                 "gpu_delay_used_us": round(delay, 3), "gpu_ratio_used": round(ratio, 3),
                                 "cpu_slowdown_used": round(cpu_slowdown, 3), "gpu_samples_in_window": n_est,
                                 "cpu_fit_used": [round(cpu_fit[0], 3), round(cpu_fit[1], 4)], "cpu_samples_in_window": n_cpu,
                                 "gpu_predicted_us": round(pol.estimate("gpu", b) + delay, 3),
                                 "cpu_predicted_us": round(cpu_pred, 3),
                                 "cpu_ratio_predicted_us": round(pol.estimate("cpu", b) * cpu_slowdown, 3),
                                 "pick": pick, "ratio_of_means_pick": ratio_pick, "cpu_ratio_pick": cpu_ratio_pick,
                                 "busy_factor_4_pick": old_pick,
                                 "gpu_us": g, "cpu_us": c, "faster": faster, "faster_by_median": faster_median,
                                 "margin_se": round(margin, 2), "truth_s": round(took, 3),
                                 "right": pick == faster, "right_by_median": pick == faster_median})
                    log(f"duty {duty} batch {b}: pick {pick} (GPU {pol.estimate('gpu', b) + delay:.0f} vs CPU "
                        f"{cpu_pred:.0f} us predicted), mean GPU {g['mean']:.0f} CPU "
                        f"{c['mean']:.0f} us (median {g['median']:.0f} / {c['median']:.0f}), {'right' if pick == faster else 'WRONG'}")
            finally:
                span = time.perf_counter() - t_duty
                probing[str(duty)] = {"probes": speed.probes, "seconds": round(span, 2),
                                      "probes_per_s": round(speed.probes / span, 1),
                                      "probe_time_fraction": round(probe_ns[0] / 1e9 / span, 5),
                                      "probe_mean_us": round(probe_ns[0] / 1e3 / max(1, speed.probes), 1)}
                if child is not None:
                    child.kill()
                    child.wait()
                    loads[str(duty)] = _load_cycles(child)
    finally:
        load.stop()
    n = len(rows)

    def score(key: str, truth: str) -> float:
        return round(sum(r[key] == r[truth] for r in rows) / n, 4)

    decided = [r for r in rows if r["margin_se"] >= 2]
    return {"rows": rows, "target": 0.95, "truth": {"n": truth_n, "span_s": truth_span_s},
            "accuracy": score("pick", "faster"), "accuracy_by_median": score("pick", "faster_by_median"),
            "ratio_of_means_accuracy": score("ratio_of_means_pick", "faster"),
            "ratio_of_means_accuracy_by_median": score("ratio_of_means_pick", "faster_by_median"),
            "cpu_ratio_accuracy": score("cpu_ratio_pick", "faster"),
            "cpu_ratio_accuracy_by_median": score("cpu_ratio_pick", "faster_by_median"),
            "busy_factor_4_accuracy": score("busy_factor_4_pick", "faster"),
            "busy_factor_4_accuracy_by_median": score("busy_factor_4_pick", "faster_by_median"),
            "cases": n, "right": sum(r["right"] for r in rows), "right_by_median": sum(r["right_by_median"] for r in rows),
            "decided_cases": len(decided), "right_of_decided": sum(r["right"] for r in decided),
            "load": loads, "probing": probing}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--requests", type=int, default=20000, help="round trips measured (batch 1)")
    ap.add_argument("--spin-us", type=float, default=None, help="a fixed spin for the daemon; default: its adaptive default")
    ap.add_argument("--gaps", default="0,100,1000,4000,20000",
                    help="round trip: pauses before each request (µs) for the paced runs; empty: none")
    ap.add_argument("--gap-s", type=float, default=3.0, help="round trip: about this long per paced run")
    ap.add_argument("--idle-s", type=float, default=3.0, help="round trip: measure the idle daemon's CPU this long")
    ap.add_argument("--path-reps", type=int, default=3,
                    help="round trip: runs of each Python request path (C call, CPython), alternating, on the same daemon")
    ap.add_argument("--cores", default="auto",
                    help="DAEMON,PRODUCER cores for the round trip; auto: the last two this process may use; none: no pinning")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096,16384,65536")
    ap.add_argument("--throughput-batches", default="1024,4096,16384,65536,262144")
    ap.add_argument("--policy-batches", default="1,4,8,16,32,64,128,256,1024,4096")
    ap.add_argument("--duties", default="0,0.5,1", help="GPU load duty cycles of the second process")
    ap.add_argument("--settle-s", type=float, default=1.0, help="policy: probe on the daemon's schedule this long before picking")
    ap.add_argument("--skip-python-loop", action="store_true", help="round trip: skip the --native off comparison")
    ap.add_argument("--skip-round-trip", action="store_true", help="skip the CPU round trip altogether")
    ap.add_argument("--round-trip-only", action="store_true", help="only the CPU round trip: no sweep, no GPU parts")
    ap.add_argument("--truth-n", type=int, default=500, help="policy: batches per side and case for the mean")
    ap.add_argument("--truth-span-s", type=float, default=3.5, help="policy: seconds those batches are spread over")
    args = ap.parse_args()
    batches = [int(v) for v in args.batches.split(",")]
    result: dict = {
        "host": socket.gethostname(), "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "numpy": np.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv[1:],
    }
    allowed = sorted(os.sched_getaffinity(0))
    if args.cores == "none" or len(allowed) < 2:
        cores = None
    elif args.cores == "auto":
        cores = allowed[-2:]
    else:
        cores = [int(v) for v in args.cores.split(",")]
    runs = [("round_trip", "on")] + ([] if args.skip_python_loop else [("round_trip_python", "off")])
    if args.skip_round_trip:
        runs = []
    for key, native in runs:
        log(f"round trip, batch 1, CPU path, --native {native}")
        gaps = [float(v) for v in args.gaps.split(",") if v.strip()] if key == "round_trip" else []
        result[key] = round_trip(args.requests, args.spin_us, cores, native, gaps, args.gap_s, args.idle_s, args.path_reps)
        rt = result[key]["producer_us"]
        log(f"{key} (--native {native}): p50 {rt['p50']} us, p99 {rt['p99']} us (target 5 / 20), "
            f"the client's {'C' if result[key]['client_native'] else 'CPython'} path")
        crt = result[key]["c_producer"].get("producer_us")
        if crt:
            log(f"  with the C producer: p50 {crt['p50']} us, p99 {crt['p99']} us")
    if args.round_trip_only:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    gpu = None
    reason = None
    try:
        from gpuos_tools.kinfer.gpu import GpuMlp, gpu_unavailable_reason

        reason = gpu_unavailable_reason()
        if reason is None:
            gpu = GpuMlp(Mlp.random(seed=0))
            result["gpu"] = gpu.cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception as e:
        reason = f"{type(e).__name__}: {e}"
    if gpu is None:
        log(f"GPU parts skipped: {reason}")
        result["gpu_skipped"] = reason
    log("latency sweep")
    result["sweep"] = sweep(batches, args.reps, gpu)
    log(f"crossover: {result['sweep']['crossover']}")
    if gpu is not None:
        log("GPU throughput")
        result["gpu_throughput"] = gpu_throughput([int(v) for v in args.throughput_batches.split(",")], args.reps)
        for mode in ("fused", "matmul"):
            for row in result["gpu_throughput"][mode]:
                log(f"{mode} batch {row['batch']}: {row['end_to_end_per_s'] / 1e6:.1f} M/s end to end, "
                    f"{row['device_per_s'] / 1e6:.1f} M/s on device")
        log("policy accuracy under GPU load")
        result["policy"] = pa = policy_accuracy([int(v) for v in args.policy_batches.split(",")], gpu, result["sweep"],
                                                [float(v) for v in args.duties.split(",")], args.settle_s, args.truth_n,
                                                args.truth_span_s)
        log(f"policy accuracy against the mean: {pa.get('accuracy')} ({pa.get('right')}/{pa.get('cases')}); "
            f"against the median: {pa.get('accuracy_by_median')}; CPU as a ratio (run 2's form): "
            f"{pa.get('cpu_ratio_accuracy')}; ratio-of-means rule: {pa.get('ratio_of_means_accuracy')}; "
            f"the old x4-while-busy rule: {pa.get('busy_factor_4_accuracy')}")
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    rows = result.get("policy", {}).get("rows", [])
    if rows:  # the short table, last
        print(f"{'duty':>5} {'batch':>6} {'pick':>4} {'ratio':>5} {'cpuR':>4} {'x4':>4} {'GPU mean':>9} {'CPU mean':>9} "
              f"{'GPU med':>8} {'CPU med':>8} {'delay':>7} {'margin':>6} right", file=sys.stderr)
        for r in rows:
            print(f"{r['duty']:>5} {r['batch']:>6} {r['pick']:>4} {r['ratio_of_means_pick']:>5} {r['cpu_ratio_pick']:>4} {r['busy_factor_4_pick']:>4} "
                  f"{r['gpu_us']['mean']:>9.1f} {r['cpu_us']['mean']:>9.1f} {r['gpu_us']['median']:>8.1f} "
                  f"{r['cpu_us']['median']:>8.1f} {r['gpu_delay_used_us']:>7.1f} {r['margin_se']:>6.1f} "
                  f"{'yes' if r['right'] else 'NO'}{'' if r['right_by_median'] else ' (median: no)'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
