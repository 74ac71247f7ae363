"""The agent's control socket: how `gpu-ckpt --agent` and `gpu-restore --agent` reach a program
started with `gpu-trace run --agent`.

A Unix stream socket per agent process, `agent-PID.sock` in `$XDG_RUNTIME_DIR/gpuos` (else
`/run/gpuos` when writable, else `/tmp/gpuos-UID`); the directory is created mode 0700 and the
socket is mode 0600, and every connection's peer uid (SO_PEERCRED) must be the agent's own uid
or root. One request per line, a JSON object with an `op`; one JSON answer per line, with `ok`
and, when false, `error`. `ping` answers the pid, the operations seen, the live allocations
and bytes, and the streams; `snapshot` (with `digest`: a sha256 per allocation; `cow_budget`:
bytes of copy-on-write slots) answers T0, `ops_before`, bytes, seconds, GB/s, `cow`,
`cow_bytes`, `host_saves`, `stream_waits`, `stall_s` and the allocations snapshotted;
`rollback` (with `image`; `lazy`: written back behind the program) writes an image back into
the program's memory, stop-the-world;
`suspend` (with `partial`, `image`, `max_hold_s`) releases the program's owned device memory and
keeps it waiting, `resume` lets it go (gpuos_tools/agent/suspend.py; while suspended `ping`
answers `state` without the agent's lock). A refusal the user should see (a GpuosError in the
agent) answers its exit status as `code`. An answer may carry file descriptors (SCM_RIGHTS): an
exiting agent hands an image in flight over as a memfd (gpuos_tools/agent/durable.py).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuos_tools.errors import ExitCode, GpuosError

_PEERCRED = struct.Struct("3i")  # pid, uid, gid
MAX_REQUEST = 1 << 20
MAX_ANSWER = 64 << 20  #: a handover answer carries the image's manifest
MAX_FDS = 8

_local = threading.local()  #: per serving thread: the connection, the descriptors to send


def attach_fds(fds: list[int]) -> None:
    """Send ``fds`` with the answer of the request being handled on this thread (the server
    closes them once sent)."""
    _local.fds = list(getattr(_local, "fds", [])) + list(fds)


def peer_connected() -> bool:
    """Whether the requester of the request being handled on this thread is still connected."""
    import select

    conn = getattr(_local, "conn", None)
    if conn is None:
        return False
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return not poller.poll(0)


def socket_dir() -> Path:
    """Where agent sockets live for this user (created on demand by the agent)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "gpuos"
    if os.geteuid() == 0 or os.access("/run/gpuos", os.W_OK):
        return Path("/run/gpuos")
    return Path(f"/tmp/gpuos-{os.getuid()}")


def socket_path(pid: int) -> Path:
    return socket_dir() / f"agent-{pid}.sock"


def resolve(target: str) -> Path:
    """A PID or a socket path, as given on a command line, to the socket's path."""
    if target.isdigit():
        path = socket_path(int(target))
        if not path.exists():
            raise GpuosError(
                f"no agent socket for PID {target} at {path}: was the program started with "
                "`gpu-trace run --agent` (or `gpu-ckpt run`), by this user?", ExitCode.NO_SUCH_PROCESS,
            )
        return path
    path = Path(target)
    if not path.exists():
        raise GpuosError(f"{target}: no such agent socket", ExitCode.NO_SUCH_PROCESS)
    return path


class Server:
    """Accepts connections on a thread; ``handler(request) -> answer`` runs on that thread."""

    def __init__(self, handler: Callable[[dict[str, Any]], dict[str, Any]], path: Path | None = None):
        self.handler = handler
        self.path = path or socket_path(os.getpid())
        self.sock: socket.socket | None = None
        self.thread: threading.Thread | None = None
        self.uid = os.getuid()
        self.busy = 0  #: requests between their arrival and their answer sent
        self._idle = threading.Condition()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is being handled (an answer in progress is sent); whether so."""
        with self._idle:
            return self._idle.wait_for(lambda: self.busy == 0, timeout)

    def start(self) -> None:
        d = self.path.parent
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        if d.stat().st_uid != self.uid:
            raise GpuosError(f"{d} belongs to another user: refusing to put the agent socket there")
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file is created 0600
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        sock.listen(4)
        self.sock = sock
        self.thread = threading.Thread(target=self._serve, name="gpuos-agent-control", daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None
                try:
                    self.path.unlink()
                except OSError:
                    pass

    def _serve(self) -> None:
        while True:
            sock = self.sock
            if sock is None:
                return
            try:
                conn, _ = sock.accept()
            except OSError:
                if self.sock is None or sock.fileno() < 0:
                    return  # closed
                time.sleep(0.05)  # a transient failure (out of descriptors, ...): go on serving
                continue
            with conn:
                try:
                    self._one(conn)
                except Exception:  # noqa: BLE001 - a client that went away mid-request must not end the agent
                    pass

    def _one(self, conn: socket.socket) -> None:
        _, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        with conn.makefile("rb") as f:
            if uid not in (self.uid, 0):
                _answer(conn, {"ok": False, "error": f"uid {uid} may not control this agent"})
                return
            while True:
                line = f.readline(MAX_REQUEST)
                if not line:
                    return
                try:
                    request = json.loads(line)
                    if not isinstance(request, dict) or "op" not in request:
                        raise ValueError("a request is a JSON object with an 'op'")
                except ValueError as exc:
                    _answer(conn, {"ok": False, "error": f"bad request: {exc}"})
                    continue
                with self._idle:
                    self.busy += 1
                _local.conn, _local.fds = conn, []
                try:
                    try:
                        answer = self.handler(request)
                    except GpuosError as exc:  # a refusal meant for the user: its message and exit code
                        answer = {"ok": False, "error": str(exc), "code": int(exc.code)}
                    except Exception as exc:  # the agent must outlive a failed request
                        answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                    fds, _local.fds = _local.fds, []
                    try:
                        _answer(conn, answer, fds)
                    finally:
                        for fd in fds:
                            os.close(fd)
                finally:
                    _local.conn = None
                    with self._idle:
                        self.busy -= 1
                        self._idle.notify_all()


def _answer(conn: socket.socket, answer: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send one answer line (with ``fds`` on its first bytes). MSG_NOSIGNAL: a client that died
    (kill -9 of `gpu-ckpt --agent`) is an EPIPE here, never a SIGPIPE, which would end a program
    that set SIGPIPE to its default."""
    try:
        data = json.dumps(answer).encode() + b"\n"
    except (TypeError, ValueError) as exc:
        data = json.dumps({"ok": False, "error": f"the answer could not be encoded: {exc}"}).encode() + b"\n"
    if fds:
        sent = socket.send_fds(conn, [data[:4096]], fds, socket.MSG_NOSIGNAL)
        data = data[sent:]
    if data:
        conn.sendall(data, socket.MSG_NOSIGNAL)


def request(target: str | Path, op: str, timeout: float | None = 600.0, **fields: Any) -> dict[str, Any]:
    """Send one request to an agent and return its answer (raises GpuosError when not ok)."""
    path = target if isinstance(target, Path) else resolve(target)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError as exc:
        raise GpuosError(f"cannot reach the agent at {path}: {exc}", ExitCode.NO_SUCH_PROCESS) from exc
    fds: list[int] = []
    with sock:
        sock.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
        line = b""
        try:
            while not line.endswith(b"\n") and len(line) < MAX_ANSWER:
                data, got, _, _ = socket.recv_fds(sock, 1 << 16, MAX_FDS)
                fds += got
                if not data:
                    break
                line += data
        except TimeoutError as exc:
            _close(fds)
            raise GpuosError(f"the agent at {path} did not answer within {timeout} s", ExitCode.FAILURE) from exc
    if not line.endswith(b"\n"):
        _close(fds)
        raise GpuosError(f"the agent at {path} closed the connection (did the program exit?)", ExitCode.FAILURE)
    answer = json.loads(line)
    if fds:
        answer["_fds"] = fds  # the caller owns them now
    if not answer.get("ok"):
        try:
            code = ExitCode(answer.get("code", ExitCode.FAILURE))
        except ValueError:
            code = ExitCode.FAILURE
        _close(fds)
        raise GpuosError(f"agent: {answer.get('error', 'failed')}", code)
    return answer


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
