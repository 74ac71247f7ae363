"""PyTorch allocations owned by the agent on a real GPU (pytest -m gpu): a training run under
`gpu-trace run --agent` with GPUOS_AGENT_OWN=1 ends bit-identical to the same run untraced;
suspended and resumed half way through the agent it ends the same too, with NVML showing the
memory given back meanwhile. What stays outside the allocator is reported (printed)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="no PyTorch")]

ROOT = Path(__file__).resolve().parents[2]
PROG = Path(__file__).resolve().parent / "progs" / "owned_torch_train.py"
NOT_OWNED = 93


def env_for(own: bool, **extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               **extra)
    env.pop("GPUOS_AGENT_OWN", None)
    if own:
        env["GPUOS_AGENT_OWN"] = "1"
    return env


def traced(tmp: Path, name: str, prog: list[str]) -> list[str]:
    return [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o",
            str(tmp / f"{name}.ndjson.zst"), "--", *prog]


def run_prog(tmp: Path, name: str, trace: bool, own: bool, probes: bool = False) -> dict:
    out = tmp / f"{name}.json"
    cmd = [sys.executable, str(PROG)]
    if trace:
        cmd = traced(tmp, name, cmd)
    p = subprocess.run(cmd, cwd=ROOT, env=env_for(own, GPUOS_TORCH_OUT=str(out), GPUOS_TORCH_PROBES="1" if probes else "0"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-8000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("plain")
    first = run_prog(tmp, "plain1", trace=False, own=False, probes=True)
    second = run_prog(tmp, "plain2", trace=False, own=False)
    assert first["digest"] == second["digest"], "the program itself is not deterministic"
    print(json.dumps({"plain_probes": first.get("probes")}))
    return first


def test_owned_torch_training_is_bit_identical_to_the_untraced_run(tmp_path, plain):
    assert plain["owned"] is False
    run = run_prog(tmp_path, "owned", trace=True, own=True, probes=True)
    from gpuos_tools.stream import open_input

    with open_input(str(tmp_path / "owned.ndjson.zst")) as reader:
        allocs = [r for r in reader if r.get("type") == "alloc"]
    others = [{"size": r.get("size"), "kind": r.get("kind")} for r in allocs if r.get("kind") not in ("vmm", "host")]
    print(json.dumps({"torch_stats": run.get("torch_stats"), "stats": run.get("stats"), "records": run.get("records"),
                      "record_bytes": run.get("record_bytes"), "probes": run.get("probes"),
                      "empty_cache": run.get("empty_cache"), "not_owned_allocs": others}))
    assert run["owned"] is True and run["tensors_owned"]
    assert run["stats"]["driver_errors"] == 0, run["stats"]
    ts = run["torch_stats"]
    assert ts["hits"] > 10 * ts["misses"], ts  # the cache serves a training loop
    assert run["losses"] == plain["losses"]
    assert run["digest"] == plain["digest"]
    assert run["empty_cache"]["cached_before"] > 0 and run["empty_cache"]["cached_after"] == 0
    # stream order across streams: not while the freeing stream still works, then yes
    # torch's memory statistics answer from the owned allocator's counters, as they do untraced
    for probes in (run["probes"], plain["probes"]):
        assert probes["memory_stats"]["ok"] and probes["memory_allocated"]["ok"], probes
        peak = probes["peak"]
        assert peak["ok"] and peak["peak"] >= peak["before"] + (64 << 20) and peak["after"] == peak["before"], peak
        assert peak["max_reserved"] >= peak["reserved"] > 0, peak
    cross = run["probes"]["cross_stream"]
    assert cross["main_was_busy"] and cross["other_while_busy"] and cross["reused_after"], cross
    assert plain["probes"]["cross_stream"]["other_while_busy"]


def gpu_memory_of(pid: int) -> int | None:
    from gpuos_tools.cuda.nvml import nvml_session

    with nvml_session() as nv:
        if nv is None:
            return None
        return sum(g["memory"] or 0 for g in nv.processes().get(pid, []))


def cli(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"gpuos_tools.commands.{tool}", *args], cwd=ROOT,
                          env=env_for(False), capture_output=True, text=True, timeout=300)


def test_owned_torch_suspend_resume_frees_the_gpu_and_ends_bit_identical(tmp_path, plain):
    d = tmp_path / "ctl"
    d.mkdir()
    out = tmp_path / "report.json"
    proc = subprocess.Popen(traced(tmp_path, "susp", [sys.executable, str(PROG)]), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=env_for(True, GPUOS_TORCH_OUT=str(out), GPUOS_SUSPEND_DIR=str(d)))
    try:
        deadline = time.monotonic() + 180
        while not (d / "pid").exists():
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "the program never reached its spin loop"
            time.sleep(0.05)
        pid = int((d / "pid").read_text())
        before = gpu_memory_of(pid)
        full = cli("ckpt", "--agent", str(pid), "--suspend")
        s = full
        if full.returncode == NOT_OWNED:  # something outside the allocator: suspend what is owned
            s = cli("ckpt", "--agent", str(pid), "--suspend", "--partial")
        assert s.returncode == 0, s.stderr
        rec = json.loads(s.stdout.strip().splitlines()[-1])
        during = gpu_memory_of(pid)
        r = cli("restore", "--agent", str(pid), "--resume")
        assert r.returncode == 0, r.stderr
        back = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        (d / "go").write_text("")
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-8000:]
    report = json.loads(out.read_text())
    print(json.dumps({"full_suspend_rc": full.returncode, "full_suspend_err": full.stderr[-600:], "suspend": rec,
                      "resume": back, "nvml_before": before, "nvml_during": during}))
    assert rec["state"] == "suspended" and rec["buffers"] > 0 and rec["released_bytes"] > 0
    assert back["buffers"] == rec["buffers"] and back["bytes"] == rec["released_bytes"]
    if before is not None and during is not None:
        assert before - during >= 0.9 * rec["released_bytes"], (before, during, rec["released_bytes"])
    assert report["scratch_ok"] and report["owned"]
    assert report["losses"] == plain["losses"]
    assert report["digest"] == plain["digest"]
