"""Durable checkpoints on a real GPU (pytest -m gpu): a program under the agent ends while
`gpu-ckpt --agent PID --image DIR` is writing its image, and the image is there, complete and
equal to the program's data (the exit waiting for it, or handing it over to gpu-ckpt); and
`gpu-ckpt check` says the driver path and CRIU are usable on this host.

The image write is slowed on purpose (one writer thread, sha256) so that the program's end falls
inside it; the answer's `during_exit` proves it did.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu_jobs import kill_group

from gpuos_tools.image import open_image, verify

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROGS = Path(__file__).resolve().parent / "progs"
FIGURES = os.environ.get("GPUOS_TEST_FIGURES")


def record(**fields) -> None:
    if FIGURES:
        with open(FIGURES, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": "durable", **fields}) + "\n")


def start(tmp: Path, gib: float, **env: str) -> tuple[subprocess.Popen, dict]:
    job_env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
    err = open(tmp / "job.stderr", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o", os.devnull,
         "--", sys.executable, str(PROGS / "durable_job.py"), "--dir", str(tmp), "--gib", str(gib)],
        cwd=ROOT, env=job_env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err, text=True,
        start_new_session=True)
    err.close()
    deadline = time.monotonic() + 300
    while not (tmp / "ready.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_group(proc)
            pytest.fail("the job did not start:\n" + (tmp / "job.stderr").read_text()[-3000:])
        time.sleep(0.1)
    return proc, json.loads((tmp / "ready.json").read_text())


def image_holds(image: Path, arrays: list) -> None:
    """Every array of the program, found in the image's buffers by address, has its bytes."""
    im = open_image(image)
    for ptr, nbytes, digest in arrays:
        holder = [b for b in im.buffers if b["addr"] <= ptr and ptr + nbytes <= b["addr"] + b["size"]]
        assert len(holder) == 1, f"array at {ptr:#x} is in {len(holder)} buffers of the image"
        data = im.read(holder[0]["id"])
        start = ptr - holder[0]["addr"]
        assert hashlib.sha256(data[start:start + nbytes]).hexdigest() == digest, f"array at {ptr:#x} differs"


@pytest.mark.parametrize("mode", ["wait", "handover"])
def test_the_program_ends_during_the_write_and_the_image_is_whole(tmp_path: Path, mode: str) -> None:
    env = {"GPUOS_AGENT_EXIT_WAIT": "0"} if mode == "handover" else {}
    proc, ready = start(tmp_path, 4.0, **env)
    images = tmp_path / "images"
    images.mkdir()
    image = images / "img"
    try:
        t0 = time.monotonic()
        tool = subprocess.Popen(
            [sys.executable, "-m", "gpuos_tools.commands.ckpt", "--agent", str(ready["pid"]), "--image", str(image),
             "--threads", "1", "--checksum", "sha256"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        deadline = time.monotonic() + 120
        while not any(n.endswith(".tmp") for n in os.listdir(images)):  # T0 passed, copies done, writing
            assert tool.poll() is None, tool.communicate()
            assert time.monotonic() < deadline, "the image write never started"
            time.sleep(0.005)
        writing_at = time.monotonic() - t0
        proc.stdin.write("end\n")  # the program returns from main now
        proc.stdin.flush()
        out, err = tool.communicate(timeout=300)
        assert tool.returncode == 0, err
        assert proc.wait(timeout=300) == 0
        job_err = (tmp_path / "job.stderr").read_text()
        records = [json.loads(x) for x in out.splitlines()]
        snap = [r for r in records if r["type"] == "agent_snapshot"][-1]
        summary = snap["image"]
        assert summary["during_exit"] is True, (summary, job_err[-2000:])  # the program's end fell in the write
        assert "exiting during a checkpoint request" in job_err
        if mode == "handover":
            assert summary["handover"] is True and "over to gpu-ckpt" in job_err
        else:
            assert not summary.get("handover") and "finished after" in job_err
        assert os.listdir(images) == ["img"]
        assert verify(image) == []
        image_holds(image, ready["arrays"])
        record(mode=mode, bytes=snap["bytes"], writing_at_s=round(writing_at, 3),
               total_s=round(time.monotonic() - t0, 3), handover=bool(summary.get("handover")),
               copy_s=summary.get("copy_s"))
    finally:
        kill_group(proc)


def test_gpu_ckpt_check_reports_the_driver_and_criu_usable(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "gpuos_tools.commands.ckpt", "check", "--dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    records = [json.loads(x) for x in done.stdout.splitlines()]
    checks = {r["check"]: r for r in records if r["type"] == "ckpt_check"}
    summary = records[-1]
    record(check={k: v["status"] for k, v in checks.items()}, summary=summary)
    assert checks["driver"]["status"] == "ok" and checks["checkpoint_api"]["status"] == "ok", checks
    assert checks["vmm"]["status"] == "ok", checks["vmm"]
    assert checks["cupti"]["status"] == "ok", checks["cupti"]
    assert checks["criu"]["status"] == "ok" and checks["criu"]["version"].startswith("4"), checks["criu"]
    assert checks["criu_check"]["status"] == "ok", checks["criu_check"]
    assert summary["driver"] and summary["process_images"] and summary["agent"], summary
    assert done.returncode == (1 if summary["failed"] else 0), done.stderr
