"""Owned allocations on a real GPU (pytest -m gpu): CuPy programs under the agent with
GPUOS_AGENT_OWN=1 compute what they compute without it; every buffer survives an eviction by the
residency engine (save -> release) and its load back (make_resident -> copy) bit for bit at the
same address, and the release frees device memory."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workloads.snapshot_trials import trials

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROGS = Path(__file__).resolve().parent / "progs"


def run_prog(tmp: Path, name: str, traced: bool, own: bool, cycle: bool = False) -> dict:
    out = tmp / f"{name}.json"
    env = dict(os.environ, GPUOS_OWNED_OUT=str(out), GPUOS_OWNED_CYCLE="1" if cycle else "0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("GPUOS_AGENT_OWN", None)
    if own:
        env["GPUOS_AGENT_OWN"] = "1"
    cmd = [sys.executable, str(PROGS / "owned_prog.py")]
    if traced:
        cmd = [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o",
               str(tmp / f"{name}.ndjson.zst"), "--"] + cmd
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-8000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict:
    return run_prog(tmp_path_factory.mktemp("plain"), "plain", traced=False, own=False)


def test_owned_cupy_program_computes_the_same(tmp_path, plain):
    assert plain["owned"] is False
    owned_run = run_prog(tmp_path, "owned", traced=True, own=True)
    assert owned_run["owned"] is True
    assert owned_run["records"] > 0 and owned_run["small_segments"] > 0
    assert owned_run["stats"]["driver_errors"] == 0, owned_run["stats"]
    assert owned_run["digests"] == plain["digests"]


def test_the_trace_sees_owned_buffers_as_vmm_allocations(tmp_path):
    from gpuos_tools.stream import open_input

    run = run_prog(tmp_path, "t", traced=True, own=True)
    assert run["arrays_owned"]
    with open_input(str(tmp_path / "t.ndjson.zst")) as reader:
        allocs = [r for r in reader if r.get("type") == "alloc"]
    vmm = [r for r in allocs if r.get("kind") == "vmm"]
    assert len(vmm) >= run["records"], (len(vmm), run["records"])
    # not ours (issue 7 item 5 will report them): what the CUDA libraries allocate themselves
    # with cudaMalloc, past CuPy's allocator (cuBLAS's workspace, cuFFT's plans)
    others = [r.get("size") for r in allocs if r.get("kind") not in ("vmm", "host")]
    print(f"owned: {len(vmm)} ranges, {sum(r['size'] for r in vmm)} B; not owned: {others}")


def test_evict_and_load_back_is_bit_identical_and_frees_memory(tmp_path, plain):
    run = run_prog(tmp_path, "cycle", traced=True, own=True, cycle=True)
    c = run["cycle"]
    assert c["records"] > 0 and c["small_segments"] > 0
    assert c["all_released"] and c["resident_after"]
    assert c["identical"], c["differ"]
    assert c["same_addresses"]
    # the physical memory went back to the driver: cuMemGetInfo and NVML see it free
    assert c["meminfo_freed"] >= 0.9 * c["bytes"], c
    if c["nvml_freed"] is not None:
        assert c["nvml_freed"] >= 0.9 * c["bytes"], c
    # ... and the program, continuing on the restored memory, ends as the uninterrupted one
    assert run["digests"] == plain["digests"]
    assert c["evictions_accepted"] == c["records"] and c["warm_up_evictions"] == 1
    assert run["stats"]["releases"] == c["records"] + 1 and run["stats"]["driver_errors"] == 0


def test_torch_pluggable_allocator_entry_points(tmp_path):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("no PyTorch")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, str(PROGS / "owned_torch_prog.py")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-8000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["matmul"] and out["sum"] and out["owned"], out
    assert out["records_with_tensors"] >= 2


def test_agent_snapshots_of_owned_memory_equal_the_state_at_t0(tmp_path, monkeypatch):
    """The agent's concurrent snapshots work unchanged over owned (VMM) memory: the snapshot
    trials (workloads/snapshot_trials.py) with GPUOS_AGENT_OWN=1 in both runs."""
    monkeypatch.setenv("GPUOS_AGENT_OWN", "1")
    compared, bad = trials(tmp_path, 11, snapshots=15, ops=1500)
    assert not bad, bad
    assert compared >= 5
