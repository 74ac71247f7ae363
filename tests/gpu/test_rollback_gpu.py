"""Rollback into a live agent process on a real GPU (pytest -m gpu): `gpu-restore --agent`
writes an image back, the job continues, and its result equals an uninterrupted run; damaged or
mismatched images are refused and write nothing. The same with `--lazy` (the job goes on at
once, each buffer written back before its first use), for plain and owned CuPy memory."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu_jobs import kill_group

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROG = Path(__file__).resolve().parent / "progs" / "rollback_prog.py"


def start(tmp: Path, twin: bool, owned: bool = False) -> subprocess.Popen:
    env = dict(os.environ, GPUOS_RB_DIR=str(tmp), GPUOS_RB_TWIN="1" if twin else "0")
    env.pop("GPUOS_AGENT_OWN", None)
    if owned:
        env["GPUOS_AGENT_OWN"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o", os.devnull,
         "--", sys.executable, str(PROG)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
        start_new_session=True)


def wait_for(proc: subprocess.Popen, path: Path, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the job exited ({proc.returncode}) before {path.name}"
        assert time.time() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.02)
    return path.read_text()


def tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def records(out: str, kind: str) -> list[dict]:
    return [r for r in map(json.loads, out.splitlines()) if r.get("type") == kind]


def test_rollback_then_continue_equals_an_uninterrupted_run(tmp_path):
    from gpuos_tools.agent.control import request, socket_path
    from gpuos_tools.image import open_image
    from gpuos_tools.image.manifest import manifest_sum

    (tmp_path / "twin").mkdir()
    twin = start(tmp_path / "twin", twin=True)
    out, _ = twin.communicate(timeout=300)
    assert twin.returncode == 0
    want = json.loads(out.splitlines()[-1])["digest"]

    job_dir = tmp_path / "job"
    job_dir.mkdir()
    proc = start(job_dir, twin=False)
    try:
        pid = wait_for(proc, job_dir / "ready")
        full, inc = tmp_path / "full.img", tmp_path / "inc.img"
        r = tool("gpuos_tools.commands.ckpt", "--agent", pid, "--image", str(full))
        assert r.returncode == 0, r.stderr
        r = tool("gpuos_tools.commands.ckpt", "--agent", pid, "--image", str(inc), "--parent", str(full))
        assert r.returncode == 0, r.stderr
        assert records(r.stdout, "agent_snapshot")[0]["image"]["incremental"] is True
        (job_dir / "go").touch()
        wait_for(proc, job_dir / "damaged")
        sock = socket_path(int(pid))
        before = request(sock, "snapshot", digest=True)["digests"]

        # refusals first: each must leave the job's memory as it was
        bad = tmp_path / "flipped.img"
        shutil.copytree(full, bad)
        chunk = sorted((bad / "chunks").iterdir())[0]
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0x01
        chunk.write_bytes(bytes(data))
        r = tool("gpuos_tools.commands.restore", "--agent", pid, "--image", str(bad))
        assert r.returncode == 90, r.stderr
        assert chunk.name in r.stderr and "checksum" in r.stderr, r.stderr

        moved = tmp_path / "moved.img"
        shutil.copytree(full, moved)
        manifest = json.loads((moved / "manifest.json").read_text())
        # the highest buffer moved far up (no overlap), the manifest sealed again: a sound image
        # that does not fit the process
        max(manifest["buffers"], key=lambda b: b["addr"])["addr"] += 1 << 40
        manifest["manifest_sum"] = manifest_sum(manifest)
        (moved / "manifest.json").write_text(json.dumps(manifest))
        r = tool("gpuos_tools.commands.restore", "--agent", pid, "--image", str(moved))
        assert r.returncode == 92, r.stderr
        assert "no allocation of that address and size" in r.stderr, r.stderr
        assert request(sock, "snapshot", digest=True)["digests"] == before, "a refused rollback wrote something"

        # the incremental image holds nothing of its own: every buffer comes through the chain
        r = tool("gpuos_tools.commands.restore", "--agent", pid, "--image", str(inc))
        assert r.returncode == 0, r.stderr
        rec = records(r.stdout, "agent_rollback")[0]
        assert rec["chain"] == 2 and rec["bytes"] > 0 and rec["stall_s"] > 0, rec
        now = request(sock, "snapshot", digest=True)
        after = now["digests"]
        assert after != before, "the rollback changed nothing"
        image = open_image(full)
        for (buffer_id, *_), digest in zip(now["allocations"], after):
            assert hashlib.sha256(image.read(buffer_id)).hexdigest() == digest, f"buffer {buffer_id} is not the image's"
        (job_dir / "go2").touch()
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0
        got = json.loads(out.splitlines()[-1])["digest"]
        assert got == want, "the rolled-back job did not end where the uninterrupted one did"
    finally:
        kill_group(proc)


def twin_digest(tmp_path: Path) -> str:
    (tmp_path / "twin").mkdir()
    twin = start(tmp_path / "twin", twin=True)
    out, _ = twin.communicate(timeout=300)
    assert twin.returncode == 0
    return json.loads(out.splitlines()[-1])["digest"]


@pytest.mark.parametrize("owned", [False, True], ids=["plain", "owned"])
def test_lazy_rollback_then_continue_equals_an_uninterrupted_run(tmp_path, owned):
    """`gpu-restore --agent PID --image DIR --lazy`: refusals write nothing; then the job is let
    go at once (it goes on the moment the answer comes) and ends where an uninterrupted run from
    the image point does; the engine says it wrote every buffer back."""
    from gpuos_tools.agent.control import request, socket_path

    want = twin_digest(tmp_path)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    proc = start(job_dir, twin=False, owned=owned)
    try:
        pid = wait_for(proc, job_dir / "ready")
        full = tmp_path / "full.img"
        r = tool("gpuos_tools.commands.ckpt", "--agent", pid, "--image", str(full))
        assert r.returncode == 0, r.stderr
        (job_dir / "go").touch()
        wait_for(proc, job_dir / "damaged")
        sock = socket_path(int(pid))
        before = request(sock, "snapshot", digest=True)["digests"]
        bad = tmp_path / "flipped.img"
        shutil.copytree(full, bad)
        chunk = sorted((bad / "chunks").iterdir())[-1]
        data = bytearray(chunk.read_bytes())
        data[len(data) // 3] ^= 0x10
        chunk.write_bytes(bytes(data))
        r = tool("gpuos_tools.commands.restore", "--agent", pid, "--image", str(bad), "--lazy")
        assert r.returncode == 90, r.stderr
        assert request(sock, "snapshot", digest=True)["digests"] == before, "a refused lazy rollback wrote something"

        r = tool("gpuos_tools.commands.restore", "--agent", pid, "--image", str(full), "--lazy")
        assert r.returncode == 0, r.stderr
        (job_dir / "go2").touch()  # the job goes on now, whatever is still being written back
        rec = records(r.stdout, "agent_rollback")[0]
        assert rec["lazy"] is True and rec["owned"] is owned and rec["bytes"] > 0 and rec["go_at"] >= rec["hold_at"], rec
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0
        got = json.loads(out.splitlines()[-1])["digest"]
        assert got == want, "the lazily rolled-back job did not end where the uninterrupted one did"
    finally:
        kill_group(proc)


def test_lazy_rollback_refuses_snapshots_until_written_back_and_then_holds_the_image(tmp_path):
    """While a lazy rollback is pending, snapshot and rollback are refused (79); once the engine
    is done (ping's residency.lazy), every buffer holds the image's bytes."""
    from gpuos_tools.agent.control import request, socket_path
    from gpuos_tools.image import open_image
    from gpuos_tools.errors import ExitCode, GpuosError

    job_dir = tmp_path / "job"
    job_dir.mkdir()
    proc = start(job_dir, twin=False)
    try:
        pid = wait_for(proc, job_dir / "ready")
        full = tmp_path / "full.img"
        assert tool("gpuos_tools.commands.ckpt", "--agent", pid, "--image", str(full)).returncode == 0
        (job_dir / "go").touch()
        wait_for(proc, job_dir / "damaged")
        sock = socket_path(int(pid))
        ans = request(sock, "rollback", image=str(full), lazy=True)
        assert ans["lazy"] is True
        try:  # may already be written back (tens of MiB); if not, refused
            request(sock, "snapshot", digest=False)
        except GpuosError as e:
            assert e.code == ExitCode.WRONG_STATE and "lazy resume or rollback" in str(e)
        deadline = time.time() + 60
        while True:
            lazy = (request(sock, "ping").get("residency") or {}).get("lazy") or {}
            if lazy.get("done") or time.time() > deadline:
                break
            time.sleep(0.01)
        assert lazy.get("done") and lazy["kind"] == "rollback" and "error" not in lazy, lazy
        now = request(sock, "snapshot", digest=True)
        image = open_image(full)
        for (buffer_id, *_), digest in zip(now["allocations"], now["digests"]):
            assert hashlib.sha256(image.read(buffer_id)).hexdigest() == digest, f"buffer {buffer_id} is not the image's"
        (job_dir / "go2").touch()
        proc.communicate(timeout=300)
        assert proc.returncode == 0
    finally:
        kill_group(proc)
