"""The agent on its native per-operation core, on a real GPU (pytest -m gpu): a PyTorch training
loop under `gpu-ckpt run` runs on the core (the trace says so, the core's counters are in its exit
record), ends with the same weights as untraced, and a snapshot taken while it trains matches a
stop-the-world reference taken at the same operation, as on the Python path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu_jobs import TORCH_MLP

from gpuos_tools.stream import open_input

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = ROOT / "workloads" / "train_steps.py"


def records(path: Path) -> list[dict]:
    with open_input(str(path)) as r:
        return list(r)


def test_a_training_loop_under_gpu_ckpt_run_uses_the_native_core_and_ends_bit_identical(tmp_path):
    prog = tmp_path / "train.py"
    prog.write_text(TORCH_MLP)
    plain = subprocess.run([sys.executable, str(prog), "50"], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    trace = tmp_path / "t.ndjson"
    run = subprocess.run([sys.executable, str(ROOT / "cmd" / "gpu-ckpt"), "run", "--no-images", "-o", str(trace),
                          "--", sys.executable, str(prog), "50"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["digest"] == json.loads(plain.stdout)["digest"]  # the same weights, bit for bit
    recs = records(trace)
    assert recs[0]["backend"] == "native-agent", recs[0]
    launches = [r for r in recs if r["type"] == "launch"]
    assert len(launches) > 50 * 10  # every step's launches are in the trace
    core = recs[-1]["tracer"]["core"]
    assert core["ops"] >= len(launches) and core["enters"] >= core["ops"]
    # no snapshot was taken and no engine runs: nothing had to go to Python
    assert core["upcalls"] == 0, core
    assert not [r for r in recs if r["type"] == "error"]


def test_a_snapshot_during_training_on_the_native_core(tmp_path):
    """After a snapshot every launch's writes are tracked (the memo); the next image is
    incremental and holds what the steps since wrote; the job goes on to the end."""
    from gpuos_tools.agent.control import socket_path

    out = tmp_path / "steps.json"
    pause = tmp_path / "p"
    err = tmp_path / "stderr"
    with open(tmp_path / "stdout", "w") as o, open(err, "w") as e:  # files: nothing reads them meanwhile
        job = subprocess.Popen(
            [sys.executable, str(ROOT / "cmd" / "gpu-ckpt"), "run", "--no-images", "-o", str(tmp_path / "t.ndjson"),
             "--", sys.executable, str(WORKLOAD), "--model", "mlp", "--steps", "4000", "--warmup", "5",
             "--json", str(out), "--pause", str(pause)],
            cwd=ROOT, stdout=o, stderr=e, start_new_session=True)
    try:
        deadline = time.time() + 180
        ready = Path(f"{pause}.ready")
        while not ready.exists():
            assert job.poll() is None, err.read_text()[-4000:]
            assert time.time() < deadline
            time.sleep(0.05)
        pid = ready.read_text()
        while not socket_path(int(pid)).exists():  # (it is made before the program's first line)
            assert job.poll() is None and time.time() < deadline, (
                f"no socket {socket_path(int(pid))}; there: {sorted(p.name for p in socket_path(0).parent.glob('*'))}; "
                + err.read_text()[-4000:])
            time.sleep(0.05)
        first = subprocess.run([sys.executable, str(ROOT / "cmd" / "gpu-ckpt"), "--agent", pid, "--image",
                                str(tmp_path / "img0")], capture_output=True, text=True, timeout=300)
        assert first.returncode == 0, first.stderr
        Path(f"{pause}.go").write_text("go")
        time.sleep(0.5)  # steps run (a few seconds of them): their writes are tracked by the core
        assert job.poll() is None, "the job ended before the second snapshot: give it more steps"
        second = subprocess.run([sys.executable, str(ROOT / "cmd" / "gpu-ckpt"), "--agent", pid, "--image",
                                 str(tmp_path / "img1"), "--parent", str(tmp_path / "img0")],
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stderr
        snap = json.loads(second.stdout.splitlines()[-1])
        assert snap["image"]["incremental"] is True, snap["image"]
        ping = subprocess.run([sys.executable, "-c", "import json,sys; from gpuos_tools.agent.control import "
                               "request, socket_path; print(json.dumps(request(socket_path(int(sys.argv[1])), 'ping')))",
                               pid], capture_output=True, text=True, timeout=60, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
        if ping.returncode == 0:  # (the job may have finished meanwhile)
            hooks = json.loads(ping.stdout)["launch_hooks"]
            assert hooks["native"] is True and hooks["memo_hits"] > hooks["predicted"], hooks
        verify = subprocess.run([sys.executable, str(ROOT / "cmd" / "gpu-restore"), "verify", str(tmp_path / "img1")],
                                capture_output=True, text=True, timeout=300)
        assert verify.returncode == 0, verify.stderr
        assert job.wait(timeout=300) == 0, err.read_text()[-4000:]
        assert len(json.loads(out.read_text())["steps"]) == 4000
    finally:
        if job.poll() is None:
            job.kill()
