"""`gpu-ckpt run -- PROGRAM` on a real GPU (pytest -m gpu): a job started by the alias of
`gpu-trace run --agent` serves `gpu-ckpt --agent PID --image DIR`, and the image verifies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu_jobs import kill_group

from gpuos_tools.stream import open_input

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "workloads"


def command(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", f"gpuos_tools.commands.{name}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)


def test_gpu_ckpt_run_job_takes_an_agent_image(tmp_path):
    trace = tmp_path / "trace.ndjson.zst"
    env = dict(os.environ, GPU_JOB_GIB="0.5", GPUOS_JOB_STOP=str(tmp_path / "stop"),
               GPUOS_JOB_LOG=str(tmp_path / "log"), GPUOS_JOB_READY=str(tmp_path / "ready"))
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as o, open(err, "w") as e:  # files, not pipes: nothing reads them while it runs
        job = subprocess.Popen(
            [sys.executable, "-m", "gpuos_tools.commands.ckpt", "run", "--no-images", "-o", str(trace),
             "--", sys.executable, str(WORKLOADS / "agent_job.py")],
            cwd=ROOT, env=env, stdout=o, stderr=e, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "ready").exists():
            assert job.poll() is None, f"the job ended early ({job.returncode}): {err.read_text()[-4000:]}"
            assert time.time() < deadline, "the job did not start"
            time.sleep(0.1)
        pid = (tmp_path / "ready").read_text()
        image = tmp_path / "img"
        ckpt = command("ckpt", "--agent", pid, "--image", str(image))
        assert ckpt.returncode == 0, ckpt.stderr
        records = [json.loads(line) for line in ckpt.stdout.splitlines()]
        assert [r["type"] for r in records] == ["header", "agent_snapshot"]
        snap = records[1]
        assert snap["image"]["path"] == str(image) and snap["image"]["incremental"] is False
        assert snap["bytes"] >= 512 << 20, snap  # the job's two 256 MiB arrays at least
        verify = command("restore", "verify", str(image))
        assert verify.returncode == 0, verify.stderr
        ok = json.loads(verify.stdout.splitlines()[-1])
        assert ok["type"] == "image_verify" and ok["ok"] and ok["problems"] == []
        assert (ok["buffers"], ok["bytes"]) == (snap["buffers"], snap["bytes"])
        (tmp_path / "stop").touch()
        assert job.wait(timeout=120) == 0, err.read_text()[-4000:]
        assert out.read_text() == ""  # the trace went to -o, not to stdout
    finally:
        kill_group(job)
    with open_input(str(trace)) as reader:
        stream = list(reader)
    assert stream[0]["type"] == "header" and stream[0]["tool"] == "gpu-trace"
    assert stream[0]["pid"] == int(pid) and "agent" in stream[0]
    assert stream[-1]["type"] == "exit" and stream[-1]["code"] == 0
