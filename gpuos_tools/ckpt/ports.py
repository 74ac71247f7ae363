"""The TCP ports a CRIU image's listening sockets need again at restore, and waiting for them.

CRIU restores a listening socket by binding its old address and port, with the SO_REUSEADDR the
process had set. Without SO_REUSEADDR that bind fails while any other socket holds the port, a
closed connection in TIME_WAIT included, and the whole restore fails ("Address already in use").
The process's own connections are such sockets: one it accepted on its listener and closed
first lingers in TIME_WAIT for 60 s after the dump ended the process (Linux's fixed
TCP_TIMEWAIT_LEN). So the dump records the tree's listeners in the image's manifest
(``listeners``), and the restore, before CRIU runs, waits (bounded) for the closing sockets that
hold one of those ports to go, and refuses untouched when a live socket (a process's) holds one.

Whether a listener had SO_REUSEADDR is not in /proc, so every recorded port is waited for: at
worst a restore waits for what a socket with SO_REUSEADDR would not have needed.

Everything here reads /proc only: ``/proc/PID/fd`` (socket inodes) and ``/proc/PID/net/tcp``,
``tcp6`` (the sockets of the process's own network namespace).
"""

from __future__ import annotations

import ipaddress
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpuos_tools import procs
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.stream.schema import Field, Int, List, Obj, Str

PROC = "/proc"
#: The states of /proc/net/tcp's ``st`` column (include/net/tcp_states.h).
STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT",
          7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING", 12: "NEW_SYN_RECV"}
#: States of a connection on its way out that outlives its process: no descriptor holds it (inode
#: 0), the kernel ends it on a timer. A port one of these holds frees itself; waited for.
CLOSING = frozenset({"TIME_WAIT", "FIN_WAIT1", "FIN_WAIT2", "CLOSING", "LAST_ACK", "CLOSE"})
#: How long Linux keeps a connection in TIME_WAIT (TCP_TIMEWAIT_LEN, not tunable), in seconds.
TIME_WAIT_S = 60.0
#: How long a restore waits by default for the ports its listeners need: TIME_WAIT's 60 s, and
#: room for an orphaned FIN_WAIT2 (net.ipv4.tcp_fin_timeout, 60 s by default) that enters it late.
WAIT_S = 90.0
#: How often the host's sockets are read again while waiting.
POLL_S = 0.25
FAMILIES = ("ipv4", "ipv6")

#: One listening socket of a dumped tree, as the image's manifest records it.
LISTENER = Obj((
    Field("family", Str(FAMILIES), required=True),
    Field("address", Str(max_len=64), "the local address as the kernel shows it (0.0.0.0 or :: for any)",
          required=True),
    Field("port", Int(1, 65535), required=True),
    Field("pid", Int(1, (1 << 31) - 1, "pid"), "a process of the tree that held it"),
), text="{family, address, port, pid}")
LISTENERS = List(LISTENER, max_len=1 << 16)


@dataclass(frozen=True)
class TcpSocket:
    """One row of /proc/net/tcp or tcp6."""

    family: str
    address: str
    port: int
    remote: str
    remote_port: int
    state: str
    #: 0 when no process holds it (TIME_WAIT, an orphan on its way out)
    inode: int
    #: seconds until its kernel timer fires (for TIME_WAIT: until it goes), None when none runs
    timer_s: float | None

    def describe(self) -> str:
        if self.state == "LISTEN":
            return f"{_endpoint(self.address, self.port)} LISTEN"
        return f"{_endpoint(self.address, self.port)} -> {_endpoint(self.remote, self.remote_port)} {self.state}"


def _endpoint(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _address(hexed: str) -> str:
    """An address of /proc/net/tcp{,6}: 32-bit words, each printed in the host's byte order."""
    raw = b"".join(int(hexed[i:i + 8], 16).to_bytes(4, sys.byteorder)
                   for i in range(0, len(hexed), 8))
    return str(ipaddress.ip_address(raw))


#: the unit of /proc/net/tcp's timer column (USER_HZ)
_TICKS = os.sysconf("SC_CLK_TCK")


def parse_net_tcp(text: str, family: str) -> list[TcpSocket]:
    """The sockets of one /proc/net/tcp (``family`` "ipv4") or tcp6 ("ipv6") text; rows that do not
    parse (none should) are left out."""
    out = []
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10:
            continue
        try:
            local, remote = cols[1].split(":"), cols[2].split(":")
            timer, when = cols[5].split(":")
            state = int(cols[3], 16)
            out.append(TcpSocket(family, _address(local[0]), int(local[1], 16), _address(remote[0]),
                                 int(remote[1], 16), STATES.get(state, f"state {state}"), int(cols[9]),
                                 int(when, 16) / _TICKS if int(timer, 16) else None))
        except (ValueError, IndexError):
            continue
    return out


def read_sockets(net: str = f"{PROC}/net") -> list[TcpSocket]:
    """Every TCP socket of the network namespace ``net`` is the view of (default: this process's),
    IPv4 and IPv6. A kernel without IPv6 has no tcp6: none of that family."""
    out = []
    for name, family in (("tcp", "ipv4"), ("tcp6", "ipv6")):
        try:
            with open(f"{net}/{name}", encoding="ascii", errors="replace") as f:
                out.extend(parse_net_tcp(f.read(), family))
        except FileNotFoundError:
            continue
    return out


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets ``pid`` holds descriptors of (empty when it is gone or not ours)."""
    return {int(t[8:-1]) for t in procs.fd_targets(pid).values() if t.startswith("socket:[") and t.endswith("]")}


def listeners(pids: Iterable[int]) -> list[dict[str, Any]]:
    """The listening TCP sockets the processes ``pids`` hold, each read from its own network
    namespace: ``[{family, address, port, pid}]`` (LISTENER), one per socket, sorted. Processes
    gone or not ours to read hold none; never raises (a dump calls it with the GPUs checkpointed)."""
    by_net: dict[str, list[TcpSocket]] = {}
    found: dict[tuple[str, str, int], dict[str, Any]] = {}
    for pid in pids:
        inodes = socket_inodes(pid)
        if not inodes:
            continue
        try:
            net = os.readlink(f"{PROC}/{pid}/ns/net")
        except OSError:
            net = f"pid {pid}"
        if net not in by_net:
            try:
                by_net[net] = read_sockets(f"{PROC}/{pid}/net")
            except OSError:  # gone meanwhile, or not ours: it holds none we can see
                by_net[net] = []
        for s in by_net[net]:
            if s.state == "LISTEN" and s.inode in inodes:
                found.setdefault((s.family, s.address, s.port),
                                 {"family": s.family, "address": s.address, "port": s.port, "pid": pid})
    return [found[k] for k in sorted(found, key=lambda k: (k[2], k[0], k[1]))]


def _plain(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address, an IPv4-mapped IPv6 one as its IPv4 address (it binds the same port)."""
    a = ipaddress.ip_address(address)
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


def holds(listener: dict[str, Any], s: TcpSocket) -> bool:
    """Whether the socket ``s`` holds the port the listener must bind: the same port and the same
    address, or either of them the wildcard (0.0.0.0 or ::)."""
    if s.port != listener["port"]:
        return False
    mine, theirs = _plain(listener["address"]), _plain(s.address)
    return mine.is_unspecified or theirs.is_unspecified or mine == theirs


def owners(inodes: set[int]) -> dict[int, int]:
    """Which process holds each socket inode (as far as /proc shows: another user's process is
    unreadable without root), found by walking every process's descriptors."""
    out: dict[int, int] = {}
    if not inodes:
        return out
    for pid in procs.all_pids():
        for inode in socket_inodes(pid) & inodes:
            out.setdefault(inode, pid)
        if len(out) == len(inodes):
            break
    return out


def _command(pid: int) -> str:
    try:
        with open(f"{PROC}/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return ""
    return " ".join(args)[:80]


@dataclass
class Blocking:
    """What holds the ports of an image's listeners now: closing sockets (waited for) and live ones."""

    closing: list[tuple[dict[str, Any], TcpSocket]]
    live: list[tuple[dict[str, Any], TcpSocket]]


def blocking(wanted: list[dict[str, Any]], sockets: list[TcpSocket]) -> Blocking:
    """The sockets of ``sockets`` that hold a port one of ``wanted`` must bind, split into closing
    ones no process holds (they go on their own) and live ones."""
    closing, live = [], []
    for s in sockets:
        for lst in wanted:
            if holds(lst, s):
                (closing if s.inode == 0 and s.state in CLOSING else live).append((lst, s))
                break
    return Blocking(closing, live)


def _ports(pairs: list[tuple[dict[str, Any], TcpSocket]]) -> str:
    return ", ".join(str(p) for p in sorted({lst["port"] for lst, _ in pairs}))


def live_message(live: list[tuple[dict[str, Any], TcpSocket]]) -> str:
    """Which port is taken by what (and by which process, where /proc says), for a refusal."""
    who = owners({s.inode for _, s in live if s.inode})
    parts = []
    for lst, s in live[:5]:
        text = f"port {lst['port']} ({_endpoint(lst['address'], lst['port'])} in the image) is held by {s.describe()}"
        pid = who.get(s.inode)
        if pid is not None:
            command = _command(pid)
            text += f", a socket of PID {pid}" + (f" ({command})" if command else "")
        elif s.inode:
            text += " (a socket of a process /proc does not show us)"
        parts.append(text)
    more = f"; and {len(live) - 5} more" if len(live) > 5 else ""
    return "; ".join(parts) + more


def wait_for_ports(wanted: list[dict[str, Any]], bound_s: float, warn: Callable[[str], None] | None = None,
                   read: Callable[[], list[TcpSocket]] = read_sockets,
                   clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep,
                   waiting: Callable[[float | None], None] | None = None) -> float:
    """Wait until no socket of this network namespace holds a port the listeners ``wanted`` must
    bind, at most ``bound_s`` seconds; the seconds waited. While only closing sockets hold them it
    waits, saying so once through ``warn`` (``wait_message``) and telling ``waiting`` the seconds
    waited at each look (None once the wait is over, however it ended); raises WRONG_STATE when a
    live socket holds one, or when the closing ones are still there after ``bound_s``."""
    if not wanted:
        return 0.0
    start = clock()
    waited_once = False
    try:
        while True:
            found = blocking(wanted, read())
            if found.live:
                raise GpuosError("a port the image's listening sockets must bind again is taken: "
                                 + live_message(found.live), ExitCode.WRONG_STATE)
            if not found.closing:
                return round(clock() - start, 3) if waited_once else 0.0
            waited = clock() - start
            if waited >= bound_s:
                raise GpuosError(
                    f"port {_ports(found.closing)} is still held after {waited:.0f} s by closing connections "
                    f"({', '.join(s.describe() for _, s in found.closing[:3])}), which the image's listening "
                    f"sockets must bind again; they go on their own within {TIME_WAIT_S:.0f} s of closing: try "
                    "again later, or allow a longer wait (--timeout)", ExitCode.WRONG_STATE)
            if not waited_once and warn is not None:
                warn(wait_message(found.closing, bound_s))
            waited_once = True
            if waiting is not None:
                waiting(waited)
            sleep(min(POLL_S, max(0.0, bound_s - waited)))
    finally:
        if waited_once and waiting is not None:
            waiting(None)


def wait_message(closing: list[tuple[dict[str, Any], TcpSocket]], bound_s: float) -> str:
    """What a restore says once when it starts waiting for ports that closing connections hold."""
    left = max((s.timer_s for _, s in closing if s.timer_s is not None), default=TIME_WAIT_S)
    n = len(closing)
    states = "/".join(sorted({s.state for _, s in closing}))
    shown = ", ".join(s.describe() for _, s in closing[:2]) + (", ..." if n > 2 else "")
    return (f"waiting up to {bound_s:.0f} s for port {_ports(closing)}, held in {states} by "
            f"{'a closed connection' if n == 1 else f'{n} closed connections'} ({shown}): the image's listening "
            f"sockets must bind it again before CRIU restores, and the kernel keeps a closed connection "
            f"{TIME_WAIT_S:.0f} s, so it is free in about {min(left, bound_s):.0f} s (a restore started "
            f"{TIME_WAIT_S:.0f} s or more after the dump does not wait)")
