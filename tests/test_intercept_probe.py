"""scripts/probe_interception.py on the CPU: what it reads from a CUPTI trace and a count file,
how it compares them, its runs under the interposer with a stand-in workload on the fake driver
(tests/fake_libcuda_entry.c), its bounds (timeouts, the time budget), the checkpoint cases'
bookkeeping with a stand-in job, and the whole probe without workloads (the CPU cost of a wrapped
call). The GPU parts themselves run only on the device."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from gpuos_tools import cbuild
from gpuos_tools.injection import intercept
from gpuos_tools.stream import open_output

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("probe_interception", ROOT / "scripts" / "probe_interception.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("driver")
    fake = cbuild.build_library(d / "cache", source=TESTS / "fake_libcuda_entry.c", stem="libfake-entry",
                                flags=("-O2", "-Wl,-Bsymbolic", "-Wl,-soname,libcuda.so.1"), libs=("-lpthread",))
    shutil.copy(fake, d / "libcuda.so.1")
    return d


def make_ctx(probe, tmp_path: Path, driver: Path, budget: float = 300, **kw):
    lib = intercept.build(driver / "cache")
    (tmp_path / "logs").mkdir(exist_ok=True)
    return probe.Context(work=tmp_path, logs=tmp_path / "logs", library=lib, deadline=time.monotonic() + budget,
                         call_names=intercept.call_names(lib), extra_env={"LD_LIBRARY_PATH": str(driver)}, **kw)


# a stand-in workload: 3 launches of 3 kernels and a copy per step on the fake driver, and a helper
# process that makes a launch of its own (its count file must not be taken for the worker's)
WORKER = textwrap.dedent("""
    import ctypes, json, os, subprocess, sys, time
    from gpuos_tools.injection.intercept import InProcess, delta
    result, steps = sys.argv[1], int(sys.argv[2])
    cuda = ctypes.CDLL("libcuda.so.1")
    launch = lambda f: cuda.cuLaunchKernel(ctypes.c_void_p(f), 1, 1, 1, 1, 1, 1, 0, None, None, None)
    subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libcuda.so.1').cuLaunchKernel("
                    "ctypes.c_void_p(0x9990), 1, 1, 1, 1, 1, 1, 0, None, None, None)"], check=True)
    view = InProcess.attach()
    launch(0x7000)  # warm-up, outside the window
    before = view.totals() if view else None
    times, buf = [], ctypes.create_string_buffer(64)
    t0 = time.monotonic_ns()
    for _ in range(steps):
        a = time.perf_counter()
        for k in range(3):
            launch(0x7000 + 16 * k)
        cuda.cuMemcpyHtoD_v2(ctypes.c_uint64(0x10000), buf, ctypes.c_size_t(64))
        times.append(time.perf_counter() - a + 0.001)
    t1 = time.monotonic_ns()
    json.dump({"workload": "fake", "pid": os.getpid(), "steps": steps, "warmup": 1, "times_s": times,
               "t0_ns": t0, "t1_ns": t1, "setup_s": 0.0, "window": delta(before, view.totals()) if view else None,
               "versions": {}}, open(result, "w"))
""")


def worker_factory(tmp_path: Path, body: str = WORKER):
    script = tmp_path / "worker.py"
    script.write_text(body)
    return lambda name, spec, result: [sys.executable, str(script), str(result), str(spec.steps)]


def test_runs_under_the_interposer_give_window_counts_and_the_workers_own_count_file(probe, tmp_path, driver):
    ctx = make_ctx(probe, tmp_path, driver, worker_cmd=worker_factory(tmp_path))
    spec = probe.Workload("stand-in", steps=5, warmup=1, timeout=60)
    plain = probe.run_mode(ctx, "fake", spec, "untraced")
    assert plain["ok"] and plain["steps"] == 5 and plain["window"] is None and "counts" not in plain, plain
    icpt = probe.run_mode(ctx, "fake", spec, "intercept")
    assert icpt["ok"], icpt
    assert icpt["window"] == {"cuLaunchKernel": 15, "cuMemcpyHtoD_v2": 5}
    c = icpt["counts"]
    assert c["pid"] == icpt["pid"] and c["launches"] == 16 and c["kernels"] == 3  # not the helper's 0x9990
    assert c["launch_routes"] == {"direct": 0, "dlsym": 16, "getproc": 0}
    summary = probe.summarize(spec, {"untraced": plain, "intercept": icpt})
    assert summary["launches_per_step"] == 3 and summary["calls_per_step"] == 4
    assert set(summary["median_ms"]) == {"untraced", "intercept"} and "intercept_us_per_launch" in summary
    assert "seen_fraction" not in summary  # no run with both tools


def test_a_traced_run_that_cannot_trace_is_recorded_not_raised(probe, tmp_path, driver):
    ctx = make_ctx(probe, tmp_path, driver, worker_cmd=worker_factory(tmp_path))
    spec = probe.Workload("stand-in", steps=2, warmup=1, timeout=60)
    env_ok = importlib.util.find_spec("cupti") is not None and shutil.which("nvidia-smi")
    if env_ok:
        pytest.skip("this machine can trace: the failure path is not reachable")
    rec = probe.run_mode(ctx, "fake", spec, "cupti")
    assert rec["ok"] is False and rec["rc"] != 0 and rec["log_tail"]


def test_a_run_past_its_timeout_is_ended_with_its_children(probe, tmp_path, driver):
    pidfile = tmp_path / "pids"
    body = textwrap.dedent(f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        open({str(pidfile)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(300)
    """)
    ctx = make_ctx(probe, tmp_path, driver, worker_cmd=worker_factory(tmp_path, body))
    spec = probe.Workload("sleeps", steps=1, warmup=0, timeout=3)
    t = time.monotonic()
    rec = probe.run_mode(ctx, "sleeper", spec, "untraced")
    assert rec["timed_out"] and not rec["ok"] and time.monotonic() - t < 30
    for pid in map(int, pidfile.read_text().split()):
        assert probe.wait_for(lambda p=pid: not probe._alive(p), 10)


def test_no_run_starts_that_would_not_fit_in_the_budget(probe, tmp_path, driver):
    ctx = make_ctx(probe, tmp_path, driver, budget=10, worker_cmd=worker_factory(tmp_path))
    spec = probe.Workload("stand-in", steps=2, warmup=1, timeout=60)
    assert probe.run_mode(ctx, "fake", spec, "intercept") == {"mode": "intercept", "skipped": "out of time"}
    assert probe.probe_driver_path(ctx, "intercept") == {"mode": "intercept", "skipped": "out of time"}


def write_trace(path: Path, launches: list[tuple[int, str, str, int]], others: list[tuple[str, str, int]]) -> None:
    with open_output(str(path)) as w:
        w.write({"type": "header", "schema": "gpuos/1", "tool": "gpu-trace", "version": "0", "backend": "native"})
        for seq, (func, kernel, api, ts) in enumerate(launches, 1):
            w.write({"type": "launch", "ts": ts, "seq": seq, "api": api, "func": func, "kernel": kernel, "name": kernel})
        for kind, api, ts in others:  # the fields a reader requires, as the tracer writes them
            extra = {"memcpy": {"dir": "HtoD", "dst": 1 << 40, "src": 4096, "bytes": 8},
                     "memset": {"dst": 1 << 40, "bytes": 8},
                     "graph": {"event": "instantiate", "graph": 7, "exec": 9},
                     "alloc": {"id": ts, "addr": (1 << 40) + (ts << 20), "size": 4096}}.get(kind, {})
            w.write({"type": kind, "ts": ts, "api": api, **extra})
        w.write({"type": "exit", "code": 0, "complete": True})


def test_completeness_compares_launches_by_handle_and_every_traced_api(probe, tmp_path):
    trace = tmp_path / "t.ndjson"
    launches = [(16, "k_a", "cuLaunchKernel_ptsz", 100 + i) for i in range(5)]
    launches += [(32, "k_b", "cuLaunchKernelEx", 200 + i) for i in range(3)]
    launches += [(48, "k_c", "cuLaunchKernel", 300)]
    others = [("memcpy", "cuMemcpyHtoDAsync_v2_ptsz", 150), ("memcpy", "cuMemcpyHtoDAsync_v2", 400),
              ("graph", "cuGraphInstantiate_v2", 160), ("alloc", "cuMemAlloc_v2", 10)]
    write_trace(trace, launches, others)
    s = probe.trace_summary(trace, window=(100, 250))
    assert s["funcs"] == Counter({16: 5, 32: 3, 48: 1}) and s["names"][32] == "k_b"
    assert s["apis"] == {"cuLaunchKernel": 6, "cuLaunchKernelEx": 3, "cuMemcpyHtoDAsync_v2": 2,
                         "cuGraphInstantiate_v2": 1, "cuMemAlloc_v2": 1}
    assert s["window"] == {"cuLaunchKernel": 5, "cuLaunchKernelEx": 3, "cuMemcpyHtoDAsync_v2": 1,
                           "cuGraphInstantiate_v2": 1}
    assert s["complete"] is True and s["backend"] == "native" and s["problem"] is None
    counts = intercept.parse_counts({
        "tool": "gpuos_intercept", "pid": 1, "libcuda": None,
        "calls": {"cuLaunchKernel": [0, 0, 5], "cuLaunchKernelEx": [0, 1, 2], "cuMemcpyHtoDAsync_v2": [0, 0, 3],
                  "cuMemAlloc_v2": [0, 0, 1]},
        "kernels": [{"func": 16, "launches": 5, "name": "k_a"}, {"func": 32, "launches": 3, "name": "k_b"}]})
    wrapped = ["cuLaunchKernel", "cuLaunchKernelEx", "cuMemcpyHtoDAsync_v2", "cuMemAlloc_v2"]
    c = probe.completeness(counts, s, wrapped)
    assert (c["cupti_launches"], c["intercept_launches"], c["seen_launches"], c["missing_launches"]) == (9, 8, 8, 1)
    assert c["seen_fraction"] == pytest.approx(8 / 9, abs=1e-6)
    assert c["missing_kernels"] == [{"launches": 1, "name": "k_c"}]
    assert c["apis"]["cuLaunchKernel"] == {"cupti": 6, "intercept": 5, "missing": 1}
    assert c["apis"]["cuMemcpyHtoDAsync_v2"] == {"cupti": 2, "intercept": 3, "missing": 0}
    assert c["not_wrapped"] == ["cuGraphInstantiate_v2"] and c["missing_calls"] == 1


def test_a_truncated_trace_is_read_as_far_as_it_goes(probe, tmp_path):
    trace = tmp_path / "t.ndjson"
    write_trace(trace, [(16, "k", "cuLaunchKernel", 1)] * 3, [])
    data = trace.read_bytes()
    trace.write_bytes(data[: data.rindex(b'"exit"') + 3])  # cut inside the last record
    s = probe.trace_summary(trace)
    assert s["funcs"] == Counter({16: 3}) and s["complete"] is None and s["problem"]


def test_summary_of_a_workload(probe):
    spec = probe.Workload("w", steps=4, warmup=1, timeout=10)
    runs = {
        "untraced": {"median_s": 0.010, "steps": 4},
        "untraced.2": {"median_s": 0.012, "steps": 4},
        "intercept": {"median_s": 0.0105, "steps": 4, "window": {"cuLaunchKernel": 380, "cuLaunchKernelEx": 20,
                                                                  "cuMemcpyAsync": 8}},
        "cupti": {"median_s": 0.013, "steps": 4, "trace": {"window": {"cuLaunchKernel": 400}}},
        "both": {"skipped": "out of time"},
    }
    s = probe.summarize(spec, runs)
    assert s["median_ms"] == {"untraced": 11.0, "intercept": 10.5, "cupti": 13.0}
    assert s["launches_per_step"] == 100 and s["calls_per_step"] == 102
    assert s["intercept_us_per_launch"] == pytest.approx(-5.0) and s["cupti_us_per_launch"] == pytest.approx(20.0)
    assert s["cupti_overhead_pct"] == pytest.approx(18.18, abs=0.01) and s["cupti_launches_per_step"] == 100
    floor = probe.Workload("f", steps=2, warmup=0, timeout=10, launches_per_step=2000)
    s = probe.summarize(floor, {"untraced": {"median_s": 0.02, "steps": 2}, "intercept": {"median_s": 0.021, "steps": 2}})
    assert s["untraced_us_per_launch"] == 10.0 and s["intercept_us_per_launch"] == pytest.approx(0.5)


def test_checkpoint_records_are_read_into_steps_and_a_result(probe):
    out = "\n".join(json.dumps(r) for r in [
        {"type": "header", "tool": "gpu-ckpt"},
        {"type": "ckpt_step", "pid": 5, "step": "lock", "ok": False, "state_before": "running",
         "state_after": "running", "duration_s": 0.0, "error": "CUDA_ERROR_NOT_SUPPORTED"},
        {"type": "ckpt_result", "action": "checkpoint", "pid": 5, "ok": False, "state": "running",
         "error": "NOT_CHECKPOINTABLE", "message": "cannot lock PID 5"},
    ]) + "\nnot json\n"
    s = probe.summarize_ckpt_records(["--pid", "5"], 84, out, "gpu-ckpt: cannot lock", 0.5)
    assert s["rc"] == 84 and s["steps"][0]["error"] == "CUDA_ERROR_NOT_SUPPORTED"
    assert s["result"]["ok"] is False and s["result"]["error"] == "NOT_CHECKPOINTABLE" and s["stderr"]


# a stand-in checkpoint job: the files the real one writes, no GPU
JOB = textwrap.dedent("""
    import json, os, sys, time
    state = sys.argv[1]
    def put(name, data):
        open(os.path.join(state, name + ".tmp"), "w").write(json.dumps(data))
        os.replace(os.path.join(state, name + ".tmp"), os.path.join(state, name))
    put("ready.json", {"pid": os.getpid()})
    it = 0
    while not os.path.exists(os.path.join(state, "stop")) and it < 20000:
        it += 1
        if it % 10 == 0:
            put("progress.json", {"it": it})
        time.sleep(0.002)
    put("result.json", {"pid": os.getpid(), "iterations": it, "stopped": True, "recurrence_ok": True,
                        "buffer_ok": True, "intercept_calls": None})
""")


def test_the_driver_case_runs_the_job_to_its_end_whatever_the_driver_answers(probe, tmp_path, driver):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    ctx = make_ctx(probe, tmp_path, driver, job_cmd=lambda state, max_s: [sys.executable, str(script), str(state)])
    out = probe.probe_driver_path(ctx, "plain")
    assert out["pid"] > 0 and out["checkpoint"]["rc"] != 0  # no GPU driver here: refused
    assert out["refused"] and out["runs_after"] and out["ok"] is False
    assert out["job"]["stopped"] and out["job"]["iterations"] >= 20
    assert not probe._alive(out["pid"])


def test_the_probe_without_workloads_measures_a_wrapped_call_on_this_cpu(probe, tmp_path):
    out = tmp_path / "probe.json"
    rc = probe.main(["--json", str(out), "--work", str(tmp_path / "w"), "--workloads", "", "--skip-ckpt",
                     "--skip-criu"])
    data = json.loads(out.read_text())
    assert rc == 0 and data["errors"] == [] and data["workloads"] == {}
    for route in ("direct", "dlsym", "getproc"):
        row = data["cpu_call_cost"][route]
        assert row["plain_ns"] > 0 and row["intercept_ns"] > 0
    with pytest.raises(SystemExit):
        probe.main(["--json", str(out), "--workloads", "nonesuch"])
    assert os.path.exists(data["library"])


def test_the_worker_times_its_steps_and_writes_the_result_file(probe, tmp_path, monkeypatch):
    done = []

    def setup():
        return (lambda: done.append(1)), (lambda: None), {"lib": "1.0"}

    monkeypatch.setitem(probe.SETUPS, "stand-in", setup)
    result = tmp_path / "r.json"
    probe.worker_main("stand-in", 4, 2, result)
    r = json.loads(result.read_text())
    assert len(done) == 6 and len(r["times_s"]) == 4 and r["window"] is None  # not preloaded here
    assert r["t0_ns"] <= r["t1_ns"] and r["pid"] == os.getpid() and r["versions"] == {"lib": "1.0"}


def test_the_table_for_people_takes_partial_results(probe):
    results = {"workloads": {"a": {"summary": {"median_ms": {"untraced": 1.0}, "launches_per_step": 3}},
                             "b": {"runs": {}}},
               "checkpoint": {"intercept": {"ok": True}, "cupti": {"refused": True}}, "criu": {"skipped": "no criu"}}
    text = probe.table(results)
    assert "a " in text and "checkpoint cupti: refused=True" in text and "criu: skipped=no criu" in text


def test_the_criu_case_is_skipped_without_criu_and_keeps_the_job_running_when_the_dump_fails(probe, tmp_path, driver,
                                                                                             monkeypatch):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    ctx = make_ctx(probe, tmp_path, driver, job_cmd=lambda state, max_s: [sys.executable, str(script), str(state)])
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert probe.probe_criu(ctx)["skipped"] == "no criu on PATH"
    # a criu that says it works: gpu-ckpt then refuses the job itself (no CUDA in it), before any dump
    (empty / "criu").write_text("#!/bin/sh\ncase \"$1\" in --version) echo 'Version: 4.2';; esac\nexit 0\n")
    (empty / "criu").chmod(0o755)
    monkeypatch.setenv("PATH", f"{empty}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}/usr/bin:/bin")
    saved = []
    out = {}
    probe.probe_criu(ctx, out, lambda: saved.append(dict(out)))
    assert out["dump"]["rc"] not in (0, None) and out["ended_by_criu"] is False and "restore" not in out
    assert "not a CUDA process" in out["dump"]["result"]["message"], out["dump"]
    assert saved and saved[0]["dump"] == out["dump"]  # saved as soon as the dump answered
    assert not probe._alive(out["pid"])


def test_a_workload_that_fails_on_its_own_is_not_run_under_the_tools(probe, tmp_path, driver):
    import argparse

    fails = tmp_path / "fails.py"
    fails.write_text("raise SystemExit('no such library')\n")
    ctx = make_ctx(probe, tmp_path, driver, worker_cmd=lambda name, spec, result: [sys.executable, str(fails)])
    args = argparse.Namespace(json=tmp_path / "p.json", work=tmp_path / "w", logs=None, budget=120,
                              skip_cpu_cost=True, skip_ckpt=True, skip_criu=True, keep_traces=False)
    assert probe.probe(args, ["mlp_adam"], ctx=ctx) == 0
    runs = json.loads((tmp_path / "p.json").read_text())["workloads"]["mlp_adam"]["runs"]
    assert runs["untraced"]["ok"] is False and "no such library" in runs["untraced"]["log_tail"]
    assert runs["both"]["ok"] is False  # run before the untraced one
    for key in ("intercept", "cupti", "untraced.2", "intercept.2"):
        assert runs[key]["skipped"].startswith("the program fails on its own"), key
