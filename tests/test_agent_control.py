"""The agent's control socket (gpuos_tools/agent/control.py), without a GPU: a real Unix socket
served by a thread, with a plain handler standing in for the agent."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from gpuos_tools.agent import control
from gpuos_tools.errors import GpuosError


@pytest.fixture
def server(tmp_path):
    seen = []

    def handler(req):
        seen.append(req)
        if req["op"] == "boom":
            raise RuntimeError("it broke")
        return {"ok": True, "echo": req}

    srv = control.ControlServer(handler, tmp_path / "sock" / "agent-1.sock")
    srv.start()
    yield srv, seen
    srv.close()


def test_request_and_answer(server):
    srv, seen = server
    answer = control.request(srv.path, "ping", extra=3)
    assert answer == {"ok": True, "echo": {"op": "ping", "extra": 3}}
    assert seen == [{"op": "ping", "extra": 3}]


def test_socket_and_directory_are_private(server):
    srv, _ = server
    assert stat.S_IMODE(os.stat(srv.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(srv.path.parent).st_mode) == 0o700


def test_handler_failure_is_an_answer_not_a_dead_agent(server):
    srv, _ = server
    with pytest.raises(GpuosError, match="RuntimeError: it broke"):
        control.request(srv.path, "boom")
    assert control.request(srv.path, "ping")["ok"]


def test_bad_requests_are_refused_and_the_connection_stays_usable(server):
    srv, _ = server
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(srv.path))
        f = s.makefile("rwb")
        for line in (b"not json\n", b"[1, 2]\n", b'{"no": "op"}\n', b'{"op": "ping"}\n'):
            f.write(line)
            f.flush()
        answers = [json.loads(f.readline()) for _ in range(4)]
    assert [a["ok"] for a in answers] == [False, False, False, True]
    assert "bad request" in answers[0]["error"]


def test_resolve_by_pid_says_how_to_start_an_agent(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(GpuosError, match="gpu-trace run --agent"):
        control.resolve("999999")
    assert control.socket_path(42) == tmp_path / "gpuos" / "agent-42.sock"


def test_unreachable_socket_is_a_clear_error(tmp_path):
    dead = tmp_path / "agent-7.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(dead))
    s.close()  # the file stays, nobody listens
    with pytest.raises(GpuosError, match="cannot reach the agent"):
        control.request(Path(dead), "ping", timeout=2)


def test_closing_removes_the_socket(tmp_path):
    srv = control.ControlServer(lambda r: {"ok": True}, tmp_path / "d" / "agent-2.sock")
    srv.start()
    assert srv.path.exists()
    srv.close()
    assert not srv.path.exists()


def test_a_client_killed_mid_request_leaves_the_agent_serving(tmp_path):
    """kill -9 of `gpu-ckpt --agent` while the agent works on its snapshot: the answer has nowhere
    to go, and the next client is served all the same."""
    import signal
    import subprocess
    import sys
    import threading

    entered, release = threading.Event(), threading.Event()

    def handler(req):
        if req["op"] == "slow":
            entered.set()
            release.wait(30)
        return {"ok": True, "op": req["op"]}

    srv = control.ControlServer(handler, tmp_path / "s" / "agent-3.sock")
    srv.start()
    try:
        client = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; "
                                   "from gpuos_tools.agent.control import request; request(Path(sys.argv[1]), 'slow')",
                                   str(srv.path)], cwd=Path(__file__).resolve().parents[1])
        assert entered.wait(30), "the request never reached the handler"
        client.send_signal(signal.SIGKILL)
        assert client.wait(30) == -signal.SIGKILL
        release.set()  # the handler finishes; its answer goes to a dead peer
        assert control.request(srv.path, "ping", timeout=10) == {"ok": True, "op": "ping"}
        assert control.request(srv.path, "ping", timeout=10)["ok"]
    finally:
        release.set()
        srv.close()


CHILD_WITH_DEFAULT_SIGPIPE = r"""
import signal, socket, sys, time
from pathlib import Path
from gpuos_tools.agent import control

signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as many command-line programs do
def handler(req):
    if req["op"] == "slow":
        time.sleep(0.3)  # the client is gone by now
    return {"ok": True}
srv = control.ControlServer(handler, Path(sys.argv[1]))
srv.start()
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
c.connect(str(srv.path))
c.sendall(b'{"op": "slow"}\n')
c.close()
time.sleep(0.6)
print("alive", control.request(srv.path, "ping", timeout=10)["ok"])
"""


def test_a_vanished_client_is_no_sigpipe_for_the_program(tmp_path):
    """The agent lives inside someone's program, which may have set SIGPIPE back to its default:
    answering a client that went away must not kill that program."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", CHILD_WITH_DEFAULT_SIGPIPE, str(tmp_path / "agent-4.sock")],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.strip() == "alive True"


def test_an_answer_that_cannot_be_encoded_is_an_error_not_a_dead_agent(tmp_path):
    srv = control.ControlServer(lambda r: {"ok": True, "odd": {1, 2}} if r["op"] == "odd" else {"ok": True},
                         tmp_path / "s" / "agent-5.sock")
    srv.start()
    try:
        with pytest.raises(GpuosError, match="could not be encoded"):
            control.request(srv.path, "odd", timeout=10)
        assert control.request(srv.path, "ping", timeout=10)["ok"]
    finally:
        srv.close()
