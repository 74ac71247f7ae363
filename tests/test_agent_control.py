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

    srv = control.Server(handler, tmp_path / "sock" / "agent-1.sock")
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
    srv = control.Server(lambda r: {"ok": True}, tmp_path / "d" / "agent-2.sock")
    srv.start()
    assert srv.path.exists()
    srv.close()
    assert not srv.path.exists()
