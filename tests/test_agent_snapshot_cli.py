"""`gpu-ckpt --agent` and gpuos_tools/agent/snapshot.py against a stand-in agent: a real control
socket whose handler answers as the agent does (the agent itself needs a GPU: see
tests/gpu/test_agent_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuos_tools.agent import control, snapshot
from gpuos_tools.errors import GpuosError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def agent(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    requests = []

    def handler(req):
        requests.append(req)
        return {"ok": True, "t0_ns": 1, "ops_before": 5, "buffers": 2, "bytes": 3 << 20, "seconds": 0.001,
                "gbps": 3.1, "cow": 1, "cow_bytes": 4096, "host_saves": 0, "stream_waits": 2, "stall_s": 0.0002,
                "allocations": [[1, 4096, 1 << 20, "device"]],
                "image": {"path": req.get("image"), "incremental": False, "bytes": 3 << 20}}

    srv = control.ControlServer(handler, control.socket_path(os.getpid()))
    srv.start()
    yield srv, requests
    srv.close()


def test_snapshot_to_image_sends_absolute_paths_and_options(agent, tmp_path):
    srv, requests = agent
    out = snapshot.snapshot_to_image(srv.path, "rel/img", "rel/parent", compress=True, checksum="sha256")
    req = requests[-1]
    assert req["op"] == "snapshot" and req["digest"] is False and req["compress"] is True
    assert Path(req["image"]).is_absolute() and req["image"].endswith("rel/img")
    assert Path(req["parent"]).is_absolute() and req["checksum"] == "sha256"
    assert "ok" not in out and out["cow"] == 1


def test_find_agent_by_pid_socket_or_command(agent):
    srv, _ = agent
    assert snapshot.find_agent(pid=os.getpid()) == srv.path
    assert snapshot.find_agent(socket=str(srv.path)) == srv.path
    assert snapshot.agents() == [(os.getpid(), srv.path)]
    assert snapshot.find_agent(command="pytest|python") == srv.path
    with pytest.raises(GpuosError, match="exactly one agent process, not 0"):
        snapshot.find_agent(command="no-such-program-xyz")
    with pytest.raises(GpuosError, match="exactly one of"):
        snapshot.find_agent(pid=1, command="x")


def test_periodic_hook_takes_images_through_the_agent(agent, tmp_path):
    srv, requests = agent
    snap = snapshot.periodic_snapshot({"pid": os.getpid()}, {"compress": False, "chunk_size": 1 << 20,
                                                             "checksum": "crc32"})
    snap(str(tmp_path / "a"), None)
    assert requests[-1]["image"] == str(tmp_path / "a") and requests[-1]["chunk_size"] == 1 << 20


def test_gpu_ckpt_agent_writes_a_record(agent, tmp_path):
    srv, requests = agent
    proc = subprocess.run([sys.executable, "-m", "gpuos_tools.commands.ckpt", "--agent", str(srv.path), "--image",
                           str(tmp_path / "img")], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert lines[0]["type"] == "header" and lines[1]["type"] == "agent_snapshot"
    assert lines[1]["image"]["path"] == str(tmp_path / "img") and "allocations" not in lines[1]


def test_gpu_ckpt_agent_usage_errors(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "gpuos_tools.commands.ckpt", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)

    assert "needs --image" in run("--agent", "123").stderr
    assert "--agent goes with" in run("--agent", "123", "--pid", "5", "--image", str(tmp_path / "x")).stderr
    missing = run("--agent", "999999", "--image", str(tmp_path / "x"))
    assert missing.returncode != 0 and "gpu-trace run --agent" in missing.stderr


def test_kill9_of_gpu_ckpt_mid_snapshot_leaves_sound_images_and_a_serving_agent(tmp_path, monkeypatch):
    """kill -9 of `gpu-ckpt --agent` at random moments, against a stand-in agent that writes real
    images (ImageWriter, fsync and all) as the agent does: the images that appear verify, the
    agent answers the next request, and the job (here: this process) lives on. The same on a
    GPU: tests/gpu/test_agent_gpu.py::test_kill9_of_gpu_ckpt_leaves_the_agent_serving_and_no_corrupt_image."""
    import random
    import signal
    import threading
    import time

    from helpers import image_dir_problems

    from gpuos_tools.image import ImageWriter, verify

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    data = random.Random(1).randbytes(24 << 20)
    arrived = threading.Event()

    def handler(req):
        if req["op"] == "ping":
            return {"ok": True}
        arrived.set()
        time.sleep(0.2)  # the snapshot's copies
        with ImageWriter(req["image"], {"allocations": [{"id": 1, "addr": 4096, "size": len(data), "kind": "device"}]},
                         chunk_size=1 << 20) as w:
            w.add(1, 4096, len(data), data)
            summary = w.commit()
        return {"ok": True, "t0_ns": 1, "ops_before": 5, "buffers": 1, "bytes": len(data), "seconds": 0.1,
                "gbps": 1.0, "cow": 0, "cow_bytes": 0, "host_saves": 0, "stream_waits": 0, "stall_s": 0.0,
                "allocations": [[1, 4096, len(data), "device"]], "image": summary}

    srv = control.ControlServer(handler, control.socket_path(os.getpid()))
    srv.start()
    try:
        rng = random.Random(2)
        images = tmp_path / "images"
        images.mkdir()
        outcomes = []
        for k in range(4):
            arrived.clear()
            ckpt = subprocess.Popen([sys.executable, "-m", "gpuos_tools.commands.ckpt", "--agent", str(os.getpid()),
                                     "--image", str(images / f"img{k}"), "-o", os.devnull], cwd=ROOT,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if k % 2:  # anywhere in the command's life, its start-up included
                time.sleep(rng.uniform(0.0, 1.0))
            else:  # while the agent works on its request
                assert arrived.wait(60), "the request never reached the agent"
                time.sleep(rng.uniform(0.0, 0.15))
            ckpt.send_signal(signal.SIGKILL)
            outcomes.append((k, ckpt.wait(timeout=60)))
        assert control.request(srv.path, "ping", timeout=60)["ok"]  # after the stand-in's last image
        assert image_dir_problems(images) == [], outcomes
        # the requests whose client was killed mid-way still made their images
        made = sorted(p.name for p in images.iterdir())
        assert all(f"img{k}" in made for k, _ in outcomes if k % 2 == 0), (outcomes, made)
        answer = snapshot.snapshot_to_image(srv.path, str(images / "good"))
        assert verify(answer["image"]["path"]) == []
        assert image_dir_problems(images) == []
    finally:
        srv.close()
