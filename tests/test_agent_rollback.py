"""Rollback into a live agent process, the parts a CPU can check: which images fit a process
(``fit_problems``), refusals carried over the control socket with their exit status, and
`gpu-restore --agent` against a stand-in agent (a real control socket; the rollback itself
needs a GPU: tests/gpu/test_rollback_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuos_tools.agent import control
from gpuos_tools.agent.agent import fit_problems
from gpuos_tools.image import ImageWriter
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.model.allocs import Allocation

ROOT = Path(__file__).resolve().parents[1]
FACTS = {"gpu": "NVIDIA H100 80GB HBM3", "cuda": 13000}


def alloc(id_: int, addr: int, size: int) -> Allocation:
    return Allocation(id=id_, addr=addr, size=size, kind="device")


def manifest(*pairs: tuple[int, int], **facts) -> dict:
    return {**FACTS, **facts, "buffers": [{"id": i, "addr": a, "size": s} for i, (a, s) in enumerate(pairs)]}


def test_an_image_fits_the_same_table_on_the_same_gpu_and_driver():
    live = [alloc(7, 0x7000_0000, 1 << 20), alloc(9, 0x7020_0000, 4096)]
    # buffer ids need not match: a fresh run of the same program numbers them anew
    assert fit_problems(manifest((0x7020_0000, 4096), (0x7000_0000, 1 << 20)), live, FACTS) == []


def test_misfits_are_each_named():
    live = [alloc(1, 0x1000, 4096), alloc(2, 0x3000, 8192)]
    problems = fit_problems(manifest((0x1000, 4096), (0x3000, 4096), (0x9000, 16)), live, FACTS)
    assert any("2 of its buffers have no allocation" in p and "0x9000" in p for p in problems), problems
    assert any("1 allocations of this process are not in the image" in p and "8192 B at 0x3000" in p
               for p in problems), problems
    other = fit_problems(manifest((0x1000, 4096), (0x3000, 8192), gpu="NVIDIA H200", cuda=12080), live, FACTS)
    assert other == ["the image was taken on GPU NVIDIA H200, this process has NVIDIA H100 80GB HBM3",
                     "the image was taken on CUDA driver version 12080, this process has 13000"]
    silent = fit_problems({"buffers": [{"addr": 0x1000, "size": 4096}, {"addr": 0x3000, "size": 8192}]}, live, FACTS)
    assert silent == ["the image does not say its GPU", "the image does not say its CUDA driver version"]


def test_many_misfits_are_summed_up():
    live = [alloc(i, 0x10000 * (i + 1), 256) for i in range(10)]
    (p,) = fit_problems(manifest(), live, FACTS)
    assert p.startswith("10 allocations of this process are not in the image") and "and 7 more" in p


@pytest.fixture
def agent(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    requests = []
    refuse: list[GpuosError] = []

    def handler(req):
        requests.append(req)
        if refuse:
            raise refuse[0]
        return {"ok": True, "image": req["image"], "image_id": "ab" * 16, "chain": 1, "buffers": 1, "bytes": 4096,
                "read_s": 0.001, "stall_s": 0.0005, "gbps": 8.2, "ops_before": 12}

    srv = control.ControlServer(handler, control.socket_path(os.getpid()))
    srv.start()
    yield srv, requests, refuse
    srv.close()


def write_image(path: Path) -> Path:
    with ImageWriter(path, {**FACTS, "allocations": [{"id": 1, "addr": 0x1000, "size": 4096, "kind": "device"}]}) as w:
        w.add(1, 0x1000, 4096, bytes(range(256)) * 16)
        w.commit()
    return path


def restore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuos_tools.commands.restore", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=dict(os.environ))


def test_a_refusal_keeps_its_exit_status_across_the_socket(agent):
    srv, _, refuse = agent
    refuse.append(GpuosError("img does not fit process 1: reasons", ExitCode.IMAGE_MISMATCH))
    with pytest.raises(GpuosError) as e:
        control.request(srv.path, "rollback", image="/x")
    assert e.value.code == ExitCode.IMAGE_MISMATCH and "does not fit" in str(e.value)


def test_gpu_restore_agent_rolls_back_and_writes_a_record(agent, tmp_path):
    srv, requests, _ = agent
    img = write_image(tmp_path / "img")
    r = restore("--agent", str(srv.path), "--image", str(img))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines[0]["type"] == "header" and lines[1]["type"] == "agent_rollback"
    assert lines[1]["stall_s"] == 0.0005 and lines[1]["agent"] == str(srv.path)
    assert requests[-1] == {"op": "rollback", "image": str(img)}


def test_gpu_restore_agent_refusals(agent, tmp_path):
    srv, requests, refuse = agent
    missing = restore("--agent", str(srv.path), "--image", str(tmp_path / "nothing"))
    assert missing.returncode == ExitCode.NO_INPUT and "no such image" in missing.stderr and not requests
    img = write_image(tmp_path / "img")
    refuse.append(GpuosError(f"{img} does not fit process 5: 1 of its buffers have no allocation", ExitCode.IMAGE_MISMATCH))
    r = restore("--agent", str(srv.path), "--image", str(img))
    assert r.returncode == ExitCode.IMAGE_MISMATCH and "have no allocation" in r.stderr, r.stderr
    assert "needs --image" in restore("--agent", "123").stderr
    assert "--agent goes with" in restore("--agent", "123", "--pid", "5", "--image", str(img)).stderr
    gone = restore("--agent", "999999", "--image", str(img))
    assert gone.returncode == ExitCode.NO_SUCH_PROCESS and "gpu-trace run --agent" in gone.stderr


def test_gpu_restore_agent_image_lazy_asks_for_a_lazy_rollback(agent, tmp_path):
    srv, requests, _ = agent
    img = write_image(tmp_path / "img")
    r = restore("--agent", str(srv.path), "--image", str(img), "--lazy")
    assert r.returncode == 0, r.stderr
    assert requests[-1] == {"op": "rollback", "image": str(img), "lazy": True}
    assert [json.loads(x) for x in r.stdout.splitlines()][1]["type"] == "agent_rollback"
