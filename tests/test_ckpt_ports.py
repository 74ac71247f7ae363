"""The listening sockets a CRIU image records and the ports its restore waits for
(gpuos_tools/ckpt/ports.py): /proc read against real sockets made here (a listener without
SO_REUSEADDR; a connection it accepted and closed first, which leaves TIME_WAIT on its port and
makes a bind there fail), the waiting and refusing on fake socket tables, and the manifest field
checked at restore."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from gpuos_tools.ckpt import criu, driver, ports
from gpuos_tools.errors import ExitCode, GpuosError


def listener(family: int = socket.AF_INET, host: str = "127.0.0.1") -> socket.socket:
    """A listening socket on a free port, without SO_REUSEADDR (as NCCL's bootstrap listener)."""
    s = socket.socket(family, socket.SOCK_STREAM)
    assert s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 0
    s.bind((host, 0))
    s.listen()
    return s


def closed_server_first(srv: socket.socket) -> None:
    """One connection to ``srv``, accepted and closed by the server first: the server's end goes to
    TIME_WAIT once the client closes too."""
    host, port = srv.getsockname()[:2]
    client = socket.create_connection((host, port))
    accepted, _ = srv.accept()
    accepted.close()
    assert client.recv(1) == b""  # the server's FIN
    client.close()


def wait_state(port: int, state: str) -> list[ports.TcpSocket]:
    deadline = time.monotonic() + 5
    while True:
        found = [s for s in ports.read_sockets() if s.port == port and s.state == state]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_a_listener_is_read_from_proc_with_its_address_port_and_family() -> None:
    with listener() as srv:
        port = srv.getsockname()[1]
        found = [x for x in ports.listeners([os.getpid()]) if x["port"] == port]
        assert found == [{"family": "ipv4", "address": "127.0.0.1", "port": port, "pid": os.getpid()}]
        # and the same row in /proc/net/tcp, held by our descriptor's inode
        row = [s for s in ports.read_sockets() if s.port == port and s.state == "LISTEN"]
        inode = os.fstat(srv.fileno()).st_ino
        assert len(row) == 1 and row[0].inode == inode and row[0].address == "127.0.0.1"


@pytest.mark.skipif(not has_ipv6(), reason="no IPv6 here")
def test_ipv6_listeners_specific_and_wildcard_are_read_from_tcp6() -> None:
    with listener(socket.AF_INET6, "::1") as one, listener(socket.AF_INET6, "::") as anyone:
        mine = {x["port"]: x for x in ports.listeners([os.getpid()])}
        assert mine[one.getsockname()[1]]["family"] == "ipv6" and mine[one.getsockname()[1]]["address"] == "::1"
        assert mine[anyone.getsockname()[1]]["address"] == "::"


def test_a_connection_closed_server_side_first_leaves_time_wait_on_the_listeners_port() -> None:
    srv = listener()
    port = srv.getsockname()[1]
    closed_server_first(srv)
    lingering = wait_state(port, "TIME_WAIT")
    assert len(lingering) == 1, [s for s in ports.read_sockets() if s.port == port]
    tw = lingering[0]
    assert tw.address == "127.0.0.1" and tw.inode == 0  # no process holds it
    assert tw.timer_s is not None and 0 < tw.timer_s <= ports.TIME_WAIT_S
    srv.close()
    # what CRIU meets: a bind without SO_REUSEADDR fails on that port while TIME_WAIT holds it
    with socket.socket() as again, pytest.raises(OSError) as e:
        again.bind(("127.0.0.1", port))
    assert e.value.errno == 98  # EADDRINUSE
    wanted = [{"family": "ipv4", "address": "127.0.0.1", "port": port}]
    found = ports.blocking(wanted, ports.read_sockets())
    assert [(s.remote_port, s.state) for _, s in found.closing] == [(tw.remote_port, "TIME_WAIT")]
    assert found.live == []
    # and the restore refuses after its bound, saying which port, nothing else done
    with pytest.raises(GpuosError) as e:
        ports.wait_for_ports(wanted, 0.3)
    assert e.value.code == ExitCode.WRONG_STATE and f"port {port}" in str(e.value) and "TIME_WAIT" in str(e.value)


def test_a_port_a_live_socket_holds_is_refused_at_once_naming_the_process() -> None:
    with listener() as srv:
        port = srv.getsockname()[1]
        said: list[str] = []
        t = time.monotonic()
        with pytest.raises(GpuosError) as e:
            ports.wait_for_ports([{"family": "ipv4", "address": "0.0.0.0", "port": port}], 30, said.append)
        assert time.monotonic() - t < 5 and said == []
        assert e.value.code == ExitCode.WRONG_STATE
        assert f"port {port}" in str(e.value) and f"PID {os.getpid()}" in str(e.value) and "LISTEN" in str(e.value)


def sock(address: str, port: int, state: str = "TIME_WAIT", inode: int = 0) -> ports.TcpSocket:
    return ports.TcpSocket("ipv6" if ":" in address else "ipv4", address, port, "192.0.2.9", 40000, state, inode,
                           42.0 if state == "TIME_WAIT" else None)


def test_which_sockets_hold_a_listeners_port() -> None:
    lst = {"family": "ipv4", "address": "192.0.2.2", "port": 50327}
    assert ports.holds(lst, sock("192.0.2.2", 50327))
    assert not ports.holds(lst, sock("192.0.2.2", 50328))
    assert not ports.holds(lst, sock("127.0.0.1", 50327))  # another address: its own bind
    assert ports.holds(lst, sock("::ffff:192.0.2.2", 50327))  # the same address, mapped
    assert ports.holds(lst, sock("0.0.0.0", 50327, "LISTEN", 7))  # a wildcard takes every address
    for wildcard in ("0.0.0.0", "::"):
        assert ports.holds({**lst, "address": wildcard}, sock("127.0.0.1", 50327))
    found = ports.blocking([lst], [sock("192.0.2.2", 50327), sock("192.0.2.2", 50327, "FIN_WAIT2"),
                                   sock("192.0.2.2", 50327, "ESTABLISHED", 99), sock("10.0.0.1", 50327)])
    assert [s.state for _, s in found.closing] == ["TIME_WAIT", "FIN_WAIT2"]
    assert [s.state for _, s in found.live] == ["ESTABLISHED"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_the_wait_ends_when_time_wait_goes_and_is_said_once() -> None:
    clock = Clock()
    lst = {"family": "ipv4", "address": "192.0.2.2", "port": 50327}
    tables = iter([[sock("192.0.2.2", 50327)]] * 8 + [[sock("10.0.0.1", 50327)]])
    said: list[str] = []
    seen: list[float | None] = []
    waited = ports.wait_for_ports([lst], 90, said.append, read=lambda: next(tables), clock=clock,
                                  sleep=clock.sleep, waiting=seen.append)
    assert waited == pytest.approx(8 * ports.POLL_S)
    assert len(said) == 1 and "\n" not in said[0]  # one line, when the wait starts
    assert said[0].startswith("waiting up to 90 s for port 50327, held in TIME_WAIT by a closed connection "
                              "(192.0.2.2:50327 -> 192.0.2.9:40000 TIME_WAIT)")
    assert "free in about 42 s" in said[0] and "a restore started 60 s or more after the dump does not wait" in said[0]
    # the seconds so far at each look, then None: the wait is over
    assert seen[:-1] == pytest.approx([i * ports.POLL_S for i in range(8)]) and seen[-1] is None


def test_no_wait_no_message_when_nothing_holds_the_ports_and_none_for_no_listeners() -> None:
    said: list[str] = []
    read_calls = []
    assert ports.wait_for_ports([{"family": "ipv4", "address": "0.0.0.0", "port": 1}], 90, said.append,
                                read=lambda: read_calls.append(1) or [sock("10.0.0.1", 2)]) == 0.0
    assert said == [] and len(read_calls) == 1
    assert ports.wait_for_ports([], 90, said.append, read=lambda: pytest.fail("read")) == 0.0


def test_a_live_socket_appearing_during_the_wait_is_refused() -> None:
    clock = Clock()
    lst = {"family": "ipv4", "address": "0.0.0.0", "port": 8080}
    tables = iter([[sock("127.0.0.1", 8080)], [sock("127.0.0.1", 8080), sock("0.0.0.0", 8080, "LISTEN", 5)]])
    with pytest.raises(GpuosError, match="port 8080 .* LISTEN"):
        ports.wait_for_ports([lst], 90, None, read=lambda: next(tables), clock=clock, sleep=clock.sleep)


def test_the_wait_is_bounded() -> None:
    clock = Clock()
    with pytest.raises(GpuosError, match=r"port 8080 is still held after 5 s .*--timeout") as e:
        ports.wait_for_ports([{"family": "ipv4", "address": "127.0.0.1", "port": 8080}], 5, None,
                             read=lambda: [sock("127.0.0.1", 8080)], clock=clock, sleep=clock.sleep)
    assert e.value.code == ExitCode.WRONG_STATE and clock.now == pytest.approx(105.0)


def test_a_wait_that_gives_up_still_ends_its_display_and_two_connections_are_counted() -> None:
    clock = Clock()
    said: list[str] = []
    seen: list[float | None] = []
    with pytest.raises(GpuosError):
        ports.wait_for_ports([{"family": "ipv4", "address": "0.0.0.0", "port": 8080}], 2, said.append,
                             read=lambda: [sock("127.0.0.1", 8080), sock("127.0.0.2", 8080, "FIN_WAIT2")],
                             clock=clock, sleep=clock.sleep, waiting=seen.append)
    assert seen[-1] is None and all(x is not None for x in seen[:-1]) and len(seen) > 2
    assert len(said) == 1 and said[0].startswith("waiting up to 2 s for port 8080, held in FIN_WAIT2/TIME_WAIT by "
                                                 "2 closed connections")


def test_gpu_restore_counts_the_wait_on_a_terminal_only(monkeypatch, capsys) -> None:
    """gpu-restore's display of the wait: on a terminal a line counting the seconds, removed when the
    wait ends; otherwise nothing beyond the one line ``warn`` printed."""
    import io

    from rich.console import Console

    from gpuos_tools.commands import restore

    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    quiet = restore.PortWait()
    quiet(0.0)
    quiet(3.0)
    quiet(None)
    assert capsys.readouterr().err == ""

    screen = io.StringIO()
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    monkeypatch.setattr(restore, "stderr_console",
                        lambda: Console(file=screen, force_terminal=True, width=100, no_color=True))
    shown = restore.PortWait()
    shown(0.0)
    shown(12.4)
    assert shown._status is not None
    shown(None)
    assert shown._status is None
    assert "gpu-restore: waiting for the ports:" in screen.getvalue()


def test_the_manifest_field_is_checked_and_an_older_image_is_not_waited_for(tmp_path: Path) -> None:
    ckpt = driver.Checkpointer()
    meta = {"pid": 4242, "listeners": [{"family": "ipv4", "address": "127.0.0.1", "port": 70000}]}
    with pytest.raises(driver.CkptError) as e:
        criu.checked_meta(ckpt, tmp_path, meta)
    assert e.value.code == ExitCode.IMAGE_CORRUPT and "listeners[0].port" in str(e.value)
    assert e.value.touched is False
    good = {"pid": 4242, "kind": "job", "listeners": [{"family": "ipv6", "address": "::", "port": 29500, "pid": 7}]}
    assert criu.checked_meta(ckpt, tmp_path, good) is good
    assert criu.wait_for_listeners(ckpt, 4242, {"pid": 4242}, 90, None) is None
