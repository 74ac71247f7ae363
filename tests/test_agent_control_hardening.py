"""The agent's control socket against clients that stall, flood, send garbage, and against a
second user: concurrent connections with timeouts and a size limit, the socket directory
checked without following links, each side checking the other's uid, and a seeded fuzzer."""

from __future__ import annotations

import json
import os
import random
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from other_user import Stranger, StrangerFailed, need_root, shared_directory, unused_id

from gpuos_tools.agent import control
from gpuos_tools.errors import ExitCode, GpuosError


class _Agent:
    """A control server with a plain handler standing in for the agent: it records which thread
    ran each request and can be told to answer big."""

    def __init__(self, path: Path):
        self.threads: set[int] = set()
        self.seen: list[dict[str, Any]] = []
        self.srv = control.ControlServer(self.handle, path)

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        self.threads.add(threading.get_native_id())
        self.seen.append(req)
        if req["op"] == "big":
            return {"ok": True, "blob": "x" * int(req.get("n", 1 << 23))}
        return {"ok": True, "op": req["op"]}


@pytest.fixture
def agent(tmp_path: Path):
    a = _Agent(tmp_path / "run" / "agent-1.sock")
    a.srv.start()
    yield a
    a.srv.close()


def _raw(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))  # blocking: a full backlog waits instead of failing
    s.settimeout(10)
    return s


def _readline(s: socket.socket, limit: int = 1 << 26) -> bytes:
    out = bytearray()
    while not out.endswith(b"\n") and len(out) < limit:
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _ping(path: Path) -> float:
    t0 = time.monotonic()
    assert control.request(path, "ping", timeout=5)["ok"]
    return time.monotonic() - t0


# -- concurrency and timeouts ---------------------------------------------------------------------


def test_an_idle_client_blocks_no_one(agent: _Agent) -> None:
    idle = [_raw(agent.srv.path) for _ in range(3)]
    half = _raw(agent.srv.path)
    half.sendall(b'{"op": "snap')  # a request started and never finished
    try:
        for op in ("snapshot", "suspend", "rollback", "ping"):
            assert control.request(agent.srv.path, op, timeout=5)["op"] == op
    finally:
        for s in (*idle, half):
            s.close()


def test_stalled_clients_are_disconnected(agent: _Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "IDLE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(control, "REQUEST_TIMEOUT_S", 0.3)
    idle = _raw(agent.srv.path)
    slow = _raw(agent.srv.path)
    for piece in (b'{"op"', b': "pi'):  # one byte now and then is no way to hold a connection
        slow.sendall(piece)
        time.sleep(0.2)
    assert idle.recv(1) == b"" and _readline(slow) == b""  # both closed by the agent
    idle.close()
    slow.close()
    _ping(agent.srv.path)


def test_a_client_that_never_reads_its_answer_blocks_no_one(agent: _Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "SEND_TIMEOUT_S", 0.5)
    hog = _raw(agent.srv.path)
    hog.sendall(b'{"op": "big", "n": 33554432}\n' * 2)  # 64 MB of answers nobody reads
    time.sleep(0.2)
    assert _ping(agent.srv.path) < 3
    time.sleep(1.0)
    hog.close()
    assert _ping(agent.srv.path) < 3


def test_requests_of_many_clients_run_on_one_thread(agent: _Agent) -> None:
    errors: list[BaseException] = []

    def client(k: int) -> None:
        try:
            for i in range(10):
                assert control.request(agent.srv.path, f"op{k}-{i}", timeout=10)["op"] == f"op{k}-{i}"
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert len(agent.seen) == 80 and len(agent.threads) == 1


def test_too_many_connections_are_told_busy(agent: _Agent) -> None:
    held = [_raw(agent.srv.path) for _ in range(control.MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        extra = _raw(agent.srv.path)
        answer = json.loads(_readline(extra))
        assert not answer["ok"] and "busy" in answer["error"]
        extra.close()
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while True:  # the held ones are let go; the next client is served
        try:
            _ping(agent.srv.path)
            break
        except GpuosError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


# -- bad requests -------------------------------------------------------------------------------------


def test_deep_json_is_answered_and_the_connection_stays(agent: _Agent) -> None:
    s = _raw(agent.srv.path)
    try:
        s.sendall(b"[" * 100_000 + b"\n")
        answer = json.loads(_readline(s))
        assert answer == {"ok": False, "error": "bad request: nested too deeply"}
        s.sendall(b'{"op": "ping", "x": ' + b"{\"a\": " * 100_000 + b"\n")
        assert "nested too deeply" in json.loads(_readline(s))["error"]
        s.sendall(b'{"op": "ping"}\n')
        assert json.loads(_readline(s)) == {"ok": True, "op": "ping"}
    finally:
        s.close()


def test_an_oversized_request_is_answered_then_closed(agent: _Agent) -> None:
    s = _raw(agent.srv.path)
    try:
        s.sendall(b'{"op": "ping", "pad": "' + b"x" * control.MAX_REQUEST)
        answer = json.loads(_readline(s))
        assert not answer["ok"] and f"longer than {control.MAX_REQUEST} bytes" in answer["error"]
        try:
            assert _readline(s) == b""  # closed: the rest of it cannot be told from a next request
        except ConnectionResetError:  # closed with some of it unread
            pass
    finally:
        s.close()
    assert agent.seen == []
    _ping(agent.srv.path)


@pytest.mark.parametrize("line", [b"\xff\xfe\n", b'{"op": 1e999999}\n', b"1" * 5000 + b"\n", b"{}\n", b"null\n",
                                  b'{"op": "ping"', b"\n", b'"op"\n'])
def test_garbage_is_answered_not_dropped(agent: _Agent, line: bytes) -> None:
    s = _raw(agent.srv.path)
    try:
        s.sendall(line)
        if not line.endswith(b"\n"):
            s.shutdown(socket.SHUT_WR)  # a last request without its newline still counts
        answer = json.loads(_readline(s))
        assert isinstance(answer, dict) and "ok" in answer
    finally:
        s.close()
    _ping(agent.srv.path)


def test_client_refuses_an_answer_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "fake.sock"
    lsn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsn.bind(str(path))
    lsn.listen(4)
    replies = [b"[1, 2]\n", b"{not json\n", b'{"ok": false, "code": "x"}\n', b'{"ok": true']

    def serve() -> None:
        for reply in replies:
            conn, _ = lsn.accept()
            with conn:
                conn.recv(1 << 16)
                conn.sendall(reply)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    for want in ("a JSON list, not an object", "not JSON", "agent: failed", "cut short"):
        with pytest.raises(GpuosError, match=want):
            control.request(path, "ping", timeout=5)
    t.join(5)
    lsn.close()


# -- the socket directory -------------------------------------------------------------------------


def test_a_symlinked_socket_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(GpuosError, match="is a symbolic link") as err:
        control.ControlServer(lambda r: {"ok": True}, tmp_path / "link" / "agent-1.sock").start()
    assert err.value.code == ExitCode.PERMISSION
    assert list(real.iterdir()) == []


def test_an_open_socket_directory_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o755)
    with pytest.raises(GpuosError, match=r"mode 0755: the agent socket directory must be private \(chmod 700"):
        control.ControlServer(lambda r: {"ok": True}, d / "agent-1.sock").start()
    d.chmod(0o700)
    srv = control.ControlServer(lambda r: {"ok": True}, d / "agent-1.sock")
    srv.start()
    try:
        assert stat.S_IMODE(os.stat(srv.path).st_mode) == 0o600
    finally:
        srv.close()


def test_a_file_in_place_of_the_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(GpuosError, match="not a directory"):
        control.ControlServer(lambda r: {"ok": True}, tmp_path / "f" / "agent-1.sock").start()


def test_the_client_refuses_an_oversized_request_before_sending(agent: _Agent) -> None:
    with pytest.raises(GpuosError, match="request is larger than") as err:
        control.request(agent.srv.path, "snapshot", image="x" * control.MAX_REQUEST)
    assert err.value.code == ExitCode.USAGE
    assert agent.seen == []


# -- a second user ------------------------------------------------------------------------------------


def test_a_directory_made_by_another_user_is_refused(tmp_path: Path) -> None:
    other = Stranger()
    d = tmp_path / "gpuos-victim"
    d.mkdir(mode=0o700)
    os.chown(d, other.uid, other.gid)  # as if the other user had pre-created /tmp/gpuos-UID
    with pytest.raises(GpuosError, match=f"belongs to uid {other.uid}"):
        control.ControlServer(lambda r: {"ok": True}, d / "agent-1.sock").start()


def _connect_and_ask(path: str, lines: list[bytes]) -> list[str]:
    """As the second user: connect, send each line, collect what comes back (first, what the
    agent says before any request)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    out = [s.recv(1 << 16).decode()]
    for line in lines:
        try:
            s.sendall(line)
            out.append(s.recv(1 << 16).decode())
        except OSError as e:
            out.append(f"{type(e).__name__}")
    s.close()
    return out


def _hold_connections(path: str, n: int) -> int:
    held = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        held.append(s)
    return len(held)


@pytest.fixture
def shared_agent():
    need_root()
    with shared_directory() as base:
        a = _Agent(base / "gpuos" / "agent-1.sock")
        a.srv.start()
        yield a
        a.srv.close()


def test_another_user_cannot_reach_or_use_the_agent(shared_agent: _Agent) -> None:
    agent = shared_agent
    other = Stranger()
    with pytest.raises(StrangerFailed, match="PermissionError"):  # the private directory keeps it out
        other.run(_connect_and_ask, str(agent.srv.path), [b'{"op": "ping"}\n'])
    # were the directory and socket opened by mistake, the peer check still refuses every request
    agent.srv.path.parent.chmod(0o777)
    agent.srv.path.chmod(0o777)
    answers = other.run(_connect_and_ask, str(agent.srv.path), [b'{"op": "rollback", "image": "/x"}\n', b'{"op": "ping"}\n'])
    assert f"uid {other.uid} may not control this agent" in answers[0]
    assert all(a in ("", "BrokenPipeError", "ConnectionResetError") for a in answers[1:])  # closed on it
    assert agent.seen == []
    # nor can it take every connection: its own are closed at once, uncounted
    other.run(_hold_connections, str(agent.srv.path), 2 * control.MAX_CONNECTIONS)
    assert _ping(agent.srv.path) < 3


def _fake_agent(directory: str, ready: str) -> str:
    """As the second user: serve a socket that answers every request ok, as if it were the agent."""
    os.makedirs(directory, exist_ok=True)
    os.chmod(directory, 0o755)
    path = os.path.join(directory, "agent-1.sock")
    lsn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsn.bind(path)
    os.chmod(path, 0o777)
    lsn.listen(4)
    with open(ready, "w") as f:
        f.write("ready")
    lsn.settimeout(20)
    conn, _ = lsn.accept()
    conn.recv(1 << 16)
    try:
        conn.sendall(b'{"ok": true, "bytes": 0, "planted": true}\n')
    except OSError:
        pass
    time.sleep(0.5)
    return "served"


def test_a_client_refuses_an_agent_socket_planted_by_another_user() -> None:
    with shared_directory() as base:  # like /tmp
        _planted(base)


def _planted(base: Path) -> None:
    planter = Stranger()
    victim = Stranger(uid=unused_id(planter.uid + 1))
    ready = base / "ready"
    t = threading.Thread(target=lambda: planter.run(_fake_agent, str(base / f"gpuos-{victim.uid}"), str(ready), timeout=30),
                         daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)

    def ask(path: str) -> Any:
        return control.request(Path(path), "snapshot", timeout=5)

    with pytest.raises(StrangerFailed, match=f"served by uid {planter.uid}, not by this user") as err:
        victim.run(ask, str(base / f"gpuos-{victim.uid}" / "agent-1.sock"))
    assert err.value.kind == "GpuosError"
    t.join(30)


# -- the fuzzer -----------------------------------------------------------------------------------------

FUZZ_CASES = 2500


def _fuzz_line(rng: random.Random) -> bytes:
    """One request line: JSON of random shape, damaged JSON, random bytes or deep nesting."""
    roll = rng.random()
    if roll < 0.35:
        def value(depth: int) -> Any:
            makers = [lambda: None, lambda: True, lambda: rng.randint(-(1 << 70), 1 << 70),
                      lambda: rng.uniform(-1e308, 1e308),
                      lambda: "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(12))),
                      lambda: rng.choice(["ping", "snapshot", "rollback", "suspend", "resume", ""]),
                      lambda: [value(depth + 1) for _ in range(rng.randrange(4))],
                      lambda: {f"k{i}": value(depth + 1) for i in range(rng.randrange(4))}]
            return makers[rng.randrange(8 if depth < 4 else 6)]()
        obj = {"op": value(0)} if rng.random() < 0.7 else value(0)
        if isinstance(obj, dict) and rng.random() < 0.5:
            obj.update({f"f{i}": value(1) for i in range(rng.randrange(4))})
        return json.dumps(obj).encode() + b"\n"
    if roll < 0.55:
        good = json.dumps({"op": "ping", "image": "/x" * rng.randrange(5)}).encode()
        at = rng.randrange(len(good))
        return (good[:at] + bytes([rng.randrange(256)]) + good[at + 1:]).replace(b"\n", b" ") + b"\n"
    if roll < 0.75:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64))).replace(b"\n", b"") + b"\n"
    if roll < 0.9:
        depth = rng.choice([10, 999, 1001, 5000, 100_000])
        return b'{"op": "ping", "x": ' + rng.choice([b"[", b'{"a":']) * depth + b"\n"
    return b'{"op": "ping", "pad": "' + b"x" * rng.randrange(1000, 200_000) + b'"}\n'


def test_fuzzed_requests_each_get_one_answer_and_the_agent_lives(agent: _Agent) -> None:
    """Seeded: lines sent in random pieces over a few connections; every line gets exactly one
    JSON object back, with `ok`; the handler sees only objects with an `op`."""
    rng = random.Random(20261125)
    conns = [_raw(agent.srv.path) for _ in range(4)]
    try:
        for case in range(FUZZ_CASES):
            s = rng.choice(conns)
            line = _fuzz_line(rng)
            pieces, at = [], 0
            while at < len(line):
                step = rng.randint(1, max(1, len(line) // rng.choice([1, 2, 7])))
                pieces.append(line[at : at + step])
                at += step
            for piece in pieces:
                s.sendall(piece)
            raw = _readline(s)
            try:
                answer = json.loads(raw)
            except ValueError:
                raise AssertionError(f"case {case}: no answer line for {line[:200]!r}: {raw[:200]!r}") from None
            assert isinstance(answer, dict) and isinstance(answer.get("ok"), bool), (case, line[:200], raw[:200])
    finally:
        for s in conns:
            s.close()
    assert all(isinstance(r, dict) and "op" in r for r in agent.seen)
    assert len(agent.threads) <= 1
    _ping(agent.srv.path)
