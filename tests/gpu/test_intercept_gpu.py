"""Driver-API interception on a real GPU (pytest -m gpu), through scripts/probe_interception.py's
pieces: in one process under both the interposer and the native CUPTI tracer, every kernel launch
and every wrapped driver call CUPTI records is seen by the interposer (CuPy, and PyTorch with
cuBLAS and a foreach optimizer); and a PyTorch job under the interposer can be checkpointed and
restored by the driver (`gpu-ckpt --pid`, `gpu-restore --pid`) and ends with its numbers intact."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

from gpuos_tools.injection import intercept

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("probe_interception", ROOT / "scripts" / "probe_interception.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture
def ctx(probe, tmp_path):
    lib = intercept.build(tmp_path / "cache")
    (tmp_path / "logs").mkdir()
    return probe.Context(work=tmp_path, logs=tmp_path / "logs", library=lib, deadline=time.monotonic() + 600,
                         call_names=intercept.call_names(lib))


@pytest.mark.parametrize("workload,module", [("floor_cupy", "cupy"), ("mlp_adam", "torch")])
def test_interception_sees_every_launch_and_call_cupti_records(probe, ctx, workload, module):
    if importlib.util.find_spec(module) is None or importlib.util.find_spec("cupti") is None:
        pytest.skip(f"needs {module} and cupti-python")
    spec = probe.Workload("short", steps=3, warmup=1, timeout=180,
                          launches_per_step=probe.WORKLOADS[workload].launches_per_step)
    run = probe.run_mode(ctx, workload, spec, "both")
    assert run["ok"], run.get("log_tail")
    c = run["completeness"]
    assert c["cupti_launches"] > 0 and c["seen_fraction"] == 1.0, c["missing_kernels"]
    assert c["missing_calls"] == 0, {a: v for a, v in c["apis"].items() if v.get("missing")}
    assert c["window_launches"]["intercept"] == c["window_launches"]["cupti"] > 0
    assert run["counts"]["slots_full"] == 0 and run["counts"]["kernels_dropped"] == 0


def test_the_driver_checkpoints_and_restores_a_job_under_interception(probe, ctx):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    out = probe.probe_driver_path(ctx, "intercept")
    assert out.get("ok"), out
    assert out["stopped_while_checkpointed"] and out["runs_after"]
    assert out["job"]["recurrence_ok"] and out["job"]["buffer_ok"]
    assert out["counting_after"]  # the interposer still counts after the restore
