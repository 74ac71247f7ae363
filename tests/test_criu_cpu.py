"""Full-process dump and restore with the real CRIU on a CPU-only process (the GPU side faked: a
Checkpointer whose driver steps do nothing): the image appears whole under its name, the process
comes back with its pid and goes on; and SIGKILL of the dumping tool at random moments leaves the
process running or a complete image that restores. Skipped where no CRIU >= 4 passes `criu check`
(it needs root); the bundle in ../shared/criu is used when it is there.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, child_env

from gpuos_tools.ckpt import criu, driver, ports
from gpuos_tools import procs

BUNDLE = REPO.parent / "shared" / "criu" / "path"

JOB = """import os, time
d = os.environ["JOB_DIR"]
i = 0
while True:
    i += 1
    with open(d + "/.p", "w") as f:
        f.write(str(i))
    os.replace(d + "/.p", d + "/progress")
    time.sleep(0.005)
"""

FAKE = '''
class Fake(driver.Checkpointer):
    """The GPU side of a CPU-only process: nothing to lock or copy."""
    api = property(lambda self: None)
    def suspend(self, pid, timeout_ms=0):
        return {"bytes": 0, "checkpoint_s": 0.0}
    def resume(self, pid, device=None, device_map=None, source_gpus=None, result_fields=None):
        return {"type": "ckpt_result", "action": "restore", "pid": pid, "state": "running", **(result_fields or {})}
    def bring_back(self, pid, restore=True):
        return "running"
    def _state(self, pid):
        return "running"
    def header_fields(self):
        return {}
'''
exec(FAKE)  # the same fake here and in the tools started below  # noqa: S102

TOOL = "import sys; from pathlib import Path; from gpuos_tools.ckpt import criu, driver\n" + FAKE + \
    "criu.dump(Fake(), int(sys.argv[1]), Path(sys.argv[2]))\n"


@pytest.fixture(scope="module")
def criu_env(tmp_path_factory) -> dict[str, str]:
    env = child_env(CRIU_BUNDLE_NO_PLUGINS="1")
    if (BUNDLE / "criu").exists():
        env["PATH"] = f"{BUNDLE}:{env['PATH']}"
    saved = os.environ.copy()
    os.environ.update({k: env[k] for k in ("PATH", "CRIU_BUNDLE_NO_PLUGINS")})
    try:
        criu.find_criu(timeout=60)
    except Exception as e:  # noqa: BLE001
        os.environ.clear()
        os.environ.update(saved)
        pytest.skip(f"no usable CRIU here: {e}")
    reason = criu_cannot_dump(tmp_path_factory.mktemp("probe"), env)
    if reason:
        os.environ.clear()
        os.environ.update(saved)
        pytest.skip(f"CRIU passes `criu check` but cannot dump a plain process here: {reason}")
    yield env
    os.environ.clear()
    os.environ.update(saved)


def criu_cannot_dump(directory: Path, env: dict[str, str]) -> str | None:
    """Dump the test's job with CRIU alone, as the tool would: some sandboxes pass `criu check` and still
    refuse every dump. None when it works, else CRIU's error lines; the tool under test is not involved."""
    job = start_job(directory / "job", env)
    try:
        images = directory / "images"
        images.mkdir()
        done = subprocess.run(
            [criu.find_criu().path, "dump", "--tree", str(job.pid), "--images-dir", str(images), "--log-file",
             "dump.log", "--shell-job"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, env=env,
            check=False)
        return None if done.returncode == 0 else criu.log_errors(images / "dump.log")
    finally:
        kill(job.pid)
        job.wait()


def start_job(directory: Path, env: dict[str, str]) -> subprocess.Popen:
    directory.mkdir(parents=True, exist_ok=True)
    job = subprocess.Popen([sys.executable, "-c", JOB], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env={**env, "JOB_DIR": str(directory)}, cwd=directory)
    deadline = time.monotonic() + 30
    while not (directory / "progress").exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return job


def progress(directory: Path) -> int:
    return int((directory / "progress").read_text())


def goes_on(directory: Path) -> bool:
    n = progress(directory)
    deadline = time.monotonic() + 10
    while progress(directory) <= n + 5:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class OnAMachine(Fake):  # noqa: F821 (defined by exec above)
    """The driver probed: the header names the machine's GPUs, which are not the process's."""
    def header_fields(self):
        return {"driver": {"cuda": "13.0", "release": "580.159.04"},
                "gpus": [{"index": i, "uuid": f"GPU-{i}", "name": "H200", "memory": 1} for i in range(2)]}


def test_dump_and_restore_a_process_with_criu(tmp_path: Path, criu_env, monkeypatch) -> None:
    monkeypatch.setenv("GPUOS_CKPT_STATE_DIR", str(tmp_path / "state"))
    job = start_job(tmp_path / "job", criu_env)
    image = tmp_path / "image"
    try:
        result = criu.dump(OnAMachine(), job.pid, image)
        assert result["state"] == "dumped" and criu.image_state(image) == "complete"
        meta = json.loads((image / criu.METADATA).read_text())
        # the process's GPUs (none here), which the restore maps from, not the machine's
        assert meta["gpus"] == [] and meta["driver"]["release"] == "580.159.04"
        assert job.wait(timeout=30) == -signal.SIGKILL  # CRIU ended it
        assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []
        with pytest.raises(driver.CkptError, match="not empty"):
            criu.dump(Fake(), os.getpid(), image)  # an image is never written over
        back = criu.restore(Fake(), image)
        assert back["pid"] == job.pid and procs.exists(job.pid)
        assert goes_on(tmp_path / "job")
    finally:
        kill(job.pid)


def test_sigkill_of_the_dumping_tool_leaves_the_job_or_a_whole_image(tmp_path: Path, criu_env, monkeypatch) -> None:
    monkeypatch.setenv("GPUOS_CKPT_STATE_DIR", str(tmp_path / "state"))
    rng = random.Random(int(os.environ.get("GPUOS_KILL_SEED", "7")))
    env = {**criu_env, "GPUOS_CKPT_STATE_DIR": str(tmp_path / "state")}
    seen = set()
    for i in range(8):
        d = tmp_path / f"job{i}"
        job = start_job(d, env)
        image = tmp_path / f"image{i}"
        tool = subprocess.Popen([sys.executable, "-c", TOOL, str(job.pid), str(image)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(rng.uniform(0.0, 0.8))
            tool.send_signal(signal.SIGKILL)
            tool.wait()
            deadline = time.monotonic() + 60
            while any(b"gpuos_tools.ckpt.guard" in Path(f"/proc/{p}/cmdline").read_bytes() and
                      str(tool.pid).encode() in Path(f"/proc/{p}/cmdline").read_bytes()
                      for p in procs.all_pids() if procs.exists(p) and os.path.exists(f"/proc/{p}/cmdline")):
                assert time.monotonic() < deadline, "the guard did not finish"
                time.sleep(0.05)
            assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == [], "a temp directory was left"
            if job.poll() is None:
                assert goes_on(d), f"kill {i}: the job is there but stopped"
                seen.add("running")
            else:
                state = tmp_path / "state"
                said = {p.name: p.read_text() for p in state.iterdir()} if state.exists() else {}
                assert criu.image_state(image) == "complete", f"kill {i}: the job is gone and no image: {said}"
                back = criu.restore(Fake(), image)
                assert back["pid"] == job.pid and goes_on(d)
                seen.add("image")
        finally:
            kill(job.pid)
            job.wait()
    print("outcomes:", sorted(seen))
    assert seen  # both outcomes are fine; which ones came depends on the moments drawn


#: A server that listens without SO_REUSEADDR (as NCCL's bootstrap listener) and closes each
#: connection it accepts first, so the connection lingers in TIME_WAIT on the listener's port.
SERVER = """import os, socket
d = os.environ["JOB_DIR"]
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen()
with open(d + "/.p", "w") as f:
    f.write(str(srv.getsockname()[1]))
os.replace(d + "/.p", d + "/port")
while True:
    conn, _ = srv.accept()
    conn.sendall(b"ok")
    conn.close()
"""


def talk(port: int) -> bytes:
    """What the server says to one connection, read until it closes (it closes first)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        said = b""
        while chunk := c.recv(16):
            said += chunk
    return said


def test_a_server_restored_at_once_waits_for_its_own_closed_connection_in_time_wait(
        tmp_path: Path, criu_env, monkeypatch) -> None:
    """Dumped just after it closed a connection, the server's image cannot be restored by CRIU
    alone (its listener's bind fails on the TIME_WAIT the connection left); the restore waits for
    it to go, says so once, and the server accepts again."""
    monkeypatch.setenv("GPUOS_CKPT_STATE_DIR", str(tmp_path / "state"))
    d = tmp_path / "server"
    d.mkdir()
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**criu_env, "JOB_DIR": str(d)}, cwd=d)
    image = tmp_path / "image"
    try:
        deadline = time.monotonic() + 30
        while not (d / "port").exists():
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(0.01)
        port = int((d / "port").read_text())
        assert talk(port) == b"ok"
        deadline = time.monotonic() + 10
        while not [s for s in ports.read_sockets() if s.port == port and s.state == "TIME_WAIT"]:
            assert time.monotonic() < deadline, "no TIME_WAIT on the server's port"
            time.sleep(0.01)
        criu.dump(Fake(), server.pid, image)
        assert server.wait(timeout=30) == -signal.SIGKILL
        # CRIU alone, on a copy of the image, fails as it does on a job's image
        plain = tmp_path / "plain"
        shutil.copytree(image, plain)
        done = subprocess.run([criu.find_criu().path, "restore", "--images-dir", str(plain), "--log-file",
                               "restore.log", "--shell-job", "--restore-detached"], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=120, env=criu_env, check=False)
        assert done.returncode != 0 and "Address already in use" in (plain / "restore.log").read_text(), \
            criu.log_errors(plain / "restore.log")
        deadline = time.monotonic() + 30  # CRIU killed what it brought back; its pid is free once reaped
        while os.path.exists(f"/proc/{server.pid}"):
            assert time.monotonic() < deadline, f"CRIU failed and left PID {server.pid}"
            time.sleep(0.05)
        said: list[str] = []
        t = time.monotonic()
        back = criu.restore(Fake(), image, warn=said.append)
        assert back["pid"] == server.pid and procs.exists(server.pid)
        assert 0 < back["port_wait_s"] <= ports.TIME_WAIT_S + 5 and time.monotonic() - t >= back["port_wait_s"]
        assert len(said) == 1 and f"port {port}" in said[0] and "TIME_WAIT" in said[0]
        assert talk(port) == b"ok"  # its listener is back
        meta = json.loads((image / criu.METADATA).read_text())
        assert meta["listeners"] == [{"family": "ipv4", "address": "127.0.0.1", "port": port, "pid": server.pid}]
    finally:
        kill(server.pid)
