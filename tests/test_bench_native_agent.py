"""scripts/bench_native_agent.py without a GPU: the commands each configuration runs, and the
summary of interleaved rounds (the GPU run itself is the device's)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_native_agent", ROOT / "scripts" / "bench_native_agent.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_each_configuration_runs_the_same_loop_under_its_tool(tmp_path):
    workload = ["loop.py", "--model", "mlp"]
    trace = tmp_path / "t.ndjson"
    plain, _ = bench.command("plain", workload, trace)
    assert plain == [sys.executable, *workload]
    for config, tool in (("trace", "gpu-trace"), ("agent", "gpu-ckpt"), ("sched_100", "gpu-prefetch-sched")):
        cmd, env = bench.command(config, workload, trace)
        assert cmd[1].endswith(tool) and cmd[-len(workload):] == workload and str(trace) in cmd
        assert env.get("GPUOS_AGENT_BACKEND") != "python"
    _, env = bench.command("agent_python", workload, trace)
    assert env["GPUOS_AGENT_BACKEND"] == "python"
    cmd, env = bench.command("agent_cupti", workload, trace)
    assert cmd[1].endswith("gpu-ckpt") and env["GPUOS_AGENT_MECHANISM"] == "cupti"
    assert env.get("GPUOS_AGENT_BACKEND") != "python"
    assert bench.command("agent", workload, trace)[1]["GPUOS_AGENT_MECHANISM"] == bench.DEFAULT_MECHANISM
    assert "agent_cupti" in bench.CONFIGS
    assert "100%" in bench.command("sched_100", workload, trace)[0]


def test_rounds_are_summarised_per_configuration_with_the_untraced_runs_pooled():
    runs = [{"model": "m", "config": "plain", "median_s": 1.0}, {"model": "m", "config": "plain_again", "median_s": 1.2},
            {"model": "m", "config": "agent", "median_s": 1.05}, {"model": "m", "config": "agent", "median_s": 1.3},
            {"model": "m", "config": "agent", "median_s": 1.1}, {"model": "m", "config": "agent", "rc": 1}]
    s = bench.summarize(runs)
    assert s[("m", "plain")] == {"median_s": 1.1, "min_s": 1.0, "max_s": 1.2, "runs": 2}
    assert s[("m", "agent")] == {"median_s": 1.1, "min_s": 1.05, "max_s": 1.3, "runs": 3}
    runs = [{"model": "m", "config": "plain_owned", "median_s": 1.0, "enqueue_median_s": 0.4},
            {"model": "m", "config": "plain_owned", "median_s": 1.2, "enqueue_median_s": 0.9},
            {"model": "m", "config": "plain_owned", "median_s": 1.1, "enqueue_median_s": 0.6}]
    assert bench.summarize(runs)[("m", "plain_owned")]["enqueue_median_s"] == 0.6


def test_unqualified_configurations_run_the_tools_defaults_and_a_suffix_says_what_differs(tmp_path, monkeypatch):
    """`agent` and `sched_100` are what a user gets (the default mechanism, the fast path on);
    _cupti, _intercept and _slow change one thing each, whatever the caller's environment says;
    the after-snapshot variants pause for the snapshot."""
    from gpuos_tools.injection.config import DEFAULT_MECHANISM

    workload = ["loop.py", "--model", "mlp"]
    trace = tmp_path / "t.ndjson"
    want = {"agent": ("gpu-ckpt", DEFAULT_MECHANISM, None), "agent_after_snapshot": ("gpu-ckpt", DEFAULT_MECHANISM, None),
            "agent_cupti": ("gpu-ckpt", "cupti", None), "agent_intercept": ("gpu-ckpt", "intercept", None),
            "agent_cupti_after_snapshot": ("gpu-ckpt", "cupti", None),
            "sched_100": ("gpu-prefetch-sched", DEFAULT_MECHANISM, "1"),
            "sched_100_cupti": ("gpu-prefetch-sched", "cupti", "1"),
            "sched_100_slow": ("gpu-prefetch-sched", DEFAULT_MECHANISM, "0")}
    for caller_mechanism, caller_fast in (("cupti", "0"), ("intercept", "1")):
        monkeypatch.setenv("GPUOS_AGENT_MECHANISM", caller_mechanism)
        monkeypatch.setenv("GPUOS_SCHED_FAST", caller_fast)
        for config, (tool, mechanism, fast) in want.items():
            cmd, env = bench.command(config, workload, trace)
            assert cmd[1].endswith(tool) and cmd[-len(workload):] == workload, (config, cmd)
            assert env["GPUOS_AGENT_MECHANISM"] == mechanism, config
            assert env.get("GPUOS_AGENT_BACKEND") != "python"
            if fast is not None:
                assert env["GPUOS_SCHED_FAST"] == fast, config
    assert "100%" in bench.command("sched_100_cupti", workload, trace)[0]
    assert set(bench.AFTER_SNAPSHOT) == {"agent_after_snapshot", "agent_cupti_after_snapshot"}
    assert set(bench.OPTIONAL).isdisjoint(bench.CONFIGS) and set(want) <= set(bench.CONFIGS + bench.OPTIONAL)


def test_cpus_are_read_in_tasksets_list_syntax():
    assert bench.cpu_list("2-5,8") == {2, 3, 4, 5, 8}
    assert bench.cpu_list("3") == {3}
    for bad in ("", "5-2", "a", "-1"):
        try:
            bench.cpu_list(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was taken")


def test_an_unknown_configuration_is_refused_before_anything_runs(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_native_agent.py"),
                           "--configs", "plain,agent_cuda", "--json", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "unknown agent_cuda" in done.stderr and "sched_100_cupti" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_the_scheduler_below_the_footprint_runs_with_and_without_the_fast_path(tmp_path, monkeypatch):
    """sched_66 and sched_66_slow (and their CUPTI variants) run the scheduler at 66%, the slow
    ones with GPUOS_SCHED_FAST=0 and the others with it 1 (the default), whatever the caller's
    environment."""
    from gpuos_tools.injection.config import DEFAULT_MECHANISM

    workload = ["loop.py", "--model", "mlp"]
    trace = tmp_path / "t.ndjson"
    for caller in ("1", "0"):
        monkeypatch.setenv("GPUOS_SCHED_FAST", caller)
        for config in ("sched_66", "sched_66_slow", "sched_66_cupti", "sched_66_slow_cupti"):
            cmd, env = bench.command(config, workload, trace)
            assert cmd[1].endswith("gpu-prefetch-sched") and cmd[cmd.index("--budget") + 1] == "66%", config
            assert env["GPUOS_SCHED_FAST"] == ("0" if "slow" in config else "1"), config
            assert env["GPUOS_AGENT_MECHANISM"] == ("cupti" if "cupti" in config else DEFAULT_MECHANISM), config
    assert {"sched_66", "sched_66_slow"} <= set(bench.OPTIONAL)


def test_owned_memory_without_the_scheduler_has_its_own_configurations(tmp_path, monkeypatch):
    """plain_owned runs the loop itself, untraced, with torch allocating through the owned
    allocator (a wrapper that installs it, then runs the loop as __main__, and prints the cache's
    counts at exit); agent_owned runs it under gpu-ckpt run with GPUOS_AGENT_OWN=torch. The other
    agent runs own nothing, whatever the caller's environment says."""
    workload = ["loop.py", "--model", "mlp"]
    trace = tmp_path / "t.ndjson"
    monkeypatch.setenv("GPUOS_AGENT_OWN", "1")
    cmd, env = bench.command("plain_owned", workload, trace)
    assert cmd[:2] == [sys.executable, "-c"] and cmd[3:] == workload and "GPUOS_AGENT_OWN" not in env
    code = compile(cmd[2], "<wrapper>", "exec")
    assert "install_torch" in code.co_names and "run_path" in code.co_names and bench.OWNED_STATS in cmd[2]
    cmd, env = bench.command("agent_owned", workload, trace)
    assert cmd[1].endswith("gpu-ckpt") and cmd[-len(workload):] == workload and env["GPUOS_AGENT_OWN"] == "torch"
    for config in ("agent", "agent_cupti"):
        assert "GPUOS_AGENT_OWN" not in bench.command(config, workload, trace)[1], config
    assert {"plain_owned", "agent_owned"} <= set(bench.OPTIONAL)


def test_the_batched_scheduler_config_passes_its_prefetch_batch(tmp_path):
    workload = ["loop.py", "--model", "resnet50"]
    cmd, _ = bench.command("sched_66_b4", workload, tmp_path / "t.ndjson")
    i = cmd.index("--prefetch-batch")
    assert cmd[i + 1] == "4" and cmd[cmd.index("--budget") + 1] == "66%" and "--plan" not in cmd
    assert "--prefetch-batch" not in bench.command("sched_66", workload, tmp_path / "t.ndjson")[0]


def test_the_slack_and_late_leads_configs_pass_their_option_and_switch(tmp_path):
    workload = ["loop.py", "--model", "resnet50"]
    cmd, env = bench.command("sched_66_fixed_lateleads_slack10", workload, tmp_path / "t.ndjson")
    assert cmd[cmd.index("--slack") + 1] == "10%" and cmd[cmd.index("--plan") + 1] == "fixed"
    assert env["GPUOS_SCHED_KEEP_LEADS"] == "0"
    cmd, env = bench.command("sched_66_fixed", workload, tmp_path / "t.ndjson")
    assert "--slack" not in cmd and env["GPUOS_SCHED_KEEP_LEADS"] == "1"
