"""A program under the agent dumped and restored by the real CRIU on the CPU
(gpuos_tools/ckpt/agent_criu.py; the GPU side faked): its agent suspends it before the dump, the
restored program's control socket answers at the same path and its agent resumes it, and the
pipe its tracer writes to the gone launcher is /dev/null after the restore, so that the tracer,
and the agent with it, go on. Skipped where no CRIU >= 4 passes `criu check` (it needs root).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from helpers import child_env
from test_criu_cpu import Fake, criu_env  # noqa: F401 -- the fixture: a usable CRIU, else skip

from gpuos_tools import procs
from gpuos_tools.agent import control
from gpuos_tools.ckpt import agent_criu, criu

FAKE_AGENT = Path(__file__).resolve().parent / "agent_criu_fake.py"


def alive(d: Path) -> float:
    try:
        return float((d / "agent-alive").read_text())
    except (OSError, ValueError):
        return 0.0


def goes_on(d: Path) -> bool:
    """The program's tracer keeps writing (its heartbeat file moves on)."""
    t = alive(d)
    deadline = time.monotonic() + 10
    while alive(d) <= t:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_program_under_the_agent_through_real_criu(tmp_path: Path, criu_env, monkeypatch) -> None:  # noqa: F811
    run = Path(tempfile.mkdtemp(prefix="gac", dir="/tmp"))  # a socket path has at most 107 bytes
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    monkeypatch.setenv("GPUOS_CKPT_STATE_DIR", str(tmp_path / "state"))
    d = tmp_path / "prog"
    d.mkdir()
    read, write = os.pipe()  # the launcher's end stays here, outside the dumped tree
    env = child_env(**criu_env, XDG_RUNTIME_DIR=str(run), FAKE_AGENT_TRACE_FD=str(write),
                    GPUOS_BOOT=f'{{"trace": {{"fd": {write}}}}}')
    p = subprocess.Popen([sys.executable, str(FAKE_AGENT), str(d)], pass_fds=(write,), stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=d, env=env)
    os.close(write)
    pid = p.pid
    try:
        deadline = time.monotonic() + 30
        while not alive(d):
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        image = tmp_path / "image"
        result = agent_criu.dump(Fake(), pid, image)
        assert result["state"] == "dumped" and result["agent_suspended"] is True
        assert p.wait(timeout=30) == -signal.SIGKILL  # CRIU ended it
        assert agent_criu.image_agent(image)["suspended_by_dump"] is True
        os.close(read)  # the launcher is gone too
        read = -1
        back = agent_criu.restore(Fake(), image)
        assert back["pid"] == pid and procs.exists(pid) and "its agent resumed it" in back["message"]
        # the restored agent answers on its socket, runs its program, and its tracer still writes
        assert control.request(str(pid), "ping", timeout=10)["state"] == "running"
        assert goes_on(d) and not (d / "trace-error").exists()
        assert os.readlink(f"/proc/{pid}/fd/{criu_trace_fd(image)}") == os.devnull
        # the trace pipe is the agent's to replace, not also an outside pipe of the plain path
        assert json.loads((image / criu.METADATA).read_text())["outside_pipes"] == [] and "outside" not in back
        assert (d / "calls").read_text().split() == ["agent_suspend", str(pid), "agent_resume", str(pid)]
    finally:
        if read >= 0:
            os.close(read)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if p.returncode is None:
            p.wait()
        shutil.rmtree(run, ignore_errors=True)


def criu_trace_fd(image: Path) -> int:
    import json

    return int(json.loads((image / criu.METADATA).read_text())["trace_pipe"]["fd"])
