"""scripts/bench_native_agent.py without a GPU: the commands each configuration runs, and the
summary of interleaved rounds (the GPU run itself is the device's)."""

from __future__ import annotations

import importlib.util
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
    cmd, env = bench.command("agent_intercept", workload, trace)
    assert cmd[1].endswith("gpu-ckpt") and env["GPUOS_AGENT_MECHANISM"] == "intercept"
    assert env.get("GPUOS_AGENT_BACKEND") != "python"
    assert bench.command("agent", workload, trace)[1]["GPUOS_AGENT_MECHANISM"] == "cupti"
    assert "agent_intercept" in bench.CONFIGS
    assert "100%" in bench.command("sched_100", workload, trace)[0]


def test_rounds_are_summarised_per_configuration_with_the_untraced_runs_pooled():
    runs = [{"model": "m", "config": "plain", "median_s": 1.0}, {"model": "m", "config": "plain_again", "median_s": 1.2},
            {"model": "m", "config": "agent", "median_s": 1.05}, {"model": "m", "config": "agent", "median_s": 1.3},
            {"model": "m", "config": "agent", "median_s": 1.1}, {"model": "m", "config": "agent", "rc": 1}]
    s = bench.summarize(runs)
    assert s[("m", "plain")] == {"median_s": 1.1, "min_s": 1.0, "max_s": 1.2, "runs": 2}
    assert s[("m", "agent")] == {"median_s": 1.1, "min_s": 1.05, "max_s": 1.3, "runs": 3}
