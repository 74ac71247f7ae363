"""The agent's control socket: how `gpu-ckpt --agent` and `gpu-restore --agent` reach a program
started with `gpu-trace run --agent`.

A Unix stream socket per agent process, `agent-PID.sock` in `$XDG_RUNTIME_DIR/gpuos` (else
`/run/gpuos` when writable, else `/tmp/gpuos-UID`); the directory is created mode 0700, and the
agent refuses to start in one that is a symbolic link, belongs to another user or is open to
others (group or other permission bits). The socket is mode 0600, every connection's peer uid
(SO_PEERCRED) must be the agent's own uid or root, and each client checks the agent's uid the
same way before it sends anything. One request per line, a JSON object with an `op`, at most 1 MiB;
one JSON answer per line, with `ok` and, when false, `error`. Several clients may be connected
at once; requests are answered one at a time, in the order they arrive, on one thread of the
agent. A connection may stay idle 60 s between requests, and a request must arrive whole within
30 s of its first byte: a client that stalls is disconnected and never delays another's request.
A request too large, nested too deeply or not JSON is answered with an error.
`ping` answers the pid, the operations seen, the live allocations
and bytes, and the streams; `snapshot` (with `digest`: a sha256 per allocation; `cow_budget`:
bytes of copy-on-write slots) answers T0, `ops_before`, bytes, seconds, GB/s, `cow`,
`cow_bytes`, `host_saves`, `stream_waits`, `stall_s` and the allocations snapshotted;
`rollback` (with `image`; `lazy`: written back behind the program) writes an image back into
the program's memory, stop-the-world;
`suspend` (with `partial`, `image`, `max_hold_s`) releases the program's owned device memory and
keeps it waiting, `resume` lets it go (gpuos_tools/agent/suspend.py; while suspended `ping`
answers `state` without the agent's lock). A job's cut (gpuos_tools/agent/cut.py): `collectives`
answers the program's collective launches and whether that count is known, `arm` (with `k` and
`image`) arms a snapshot at the enter of collective k, `cut` (with `wait_s`) answers its state,
`disarm` takes it back. A refusal the user should see (a GpuosError in the
agent) answers its exit status as `code`. An answer may carry file descriptors (SCM_RIGHTS): an
exiting agent hands an image in flight over as a memfd (gpuos_tools/agent/durable.py).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuos_tools.cuda.driver import relax_capture
from gpuos_tools.errors import ExitCode, GpuosError

_PEERCRED = struct.Struct("3i")  # pid, uid, gid
#: Largest request line (bytes, newline included); a longer one is answered with an error.
MAX_REQUEST = 1 << 20
#: Largest answer line a client reads (a snapshot's answer lists every allocation).
MAX_ANSWER = 64 << 20
#: How long a connection may sit between two requests before the agent closes it.
IDLE_TIMEOUT_S = 60.0
#: How long a request may take to arrive whole, from its first byte.
REQUEST_TIMEOUT_S = 30.0
#: How long the agent waits for a client to take its answer.
SEND_TIMEOUT_S = 30.0
#: Connections served at once; one more is answered "busy" and closed.
MAX_CONNECTIONS = 32
MAX_FDS = 8  #: descriptors an answer may carry

_local = threading.local()  #: on the dispatcher thread: the requester's connection, the descriptors to send


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


def private_dir(d: Path, uid: int | None = None) -> None:
    """Create ``d`` mode 0700 if missing, then make sure it is a real directory (not a symbolic
    link: checked with lstat, never followed) of ``uid`` that no one else may enter or write.
    GpuosError (PERMISSION) says what is wrong and how to fix it."""
    uid = os.getuid() if uid is None else uid
    d.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode):
        raise GpuosError(f"{d} is a symbolic link: refusing to put the agent socket there (remove it)", ExitCode.PERMISSION)
    if not stat.S_ISDIR(st.st_mode):
        raise GpuosError(f"{d} is not a directory: refusing to put the agent socket there", ExitCode.PERMISSION)
    if st.st_uid != uid:
        raise GpuosError(f"{d} belongs to uid {st.st_uid}, not {uid}: refusing to put the agent socket there "
                         "(another user may have made it; remove it, or set XDG_RUNTIME_DIR)", ExitCode.PERMISSION)
    if st.st_mode & 0o077:
        raise GpuosError(f"{d} is mode {stat.S_IMODE(st.st_mode):04o}: the agent socket directory must be private "
                         f"(chmod 700 {d})", ExitCode.PERMISSION)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket."""
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid, gid


class _TooLarge(Exception):
    pass


class ControlServer:
    """Serves the control socket: one thread accepts, one thread per connection reads requests
    and writes answers, and one thread runs ``handler(request) -> answer`` for all of them, in
    the order requests arrive (the agent's handler is written for one caller at a time, and
    the agent tells its own driver calls by that thread's id)."""

    def __init__(self, handler: Callable[[dict[str, Any]], dict[str, Any]], path: Path | None = None):
        self.handler = handler
        self.path = path or socket_path(os.getpid())
        self.sock: socket.socket | None = None
        self.thread: threading.Thread | None = None
        self.uid = os.getuid()
        self._work: queue.Queue[tuple[dict[str, Any], list[Any], threading.Event] | None] = queue.Queue()
        self._dispatcher: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self.busy = 0  #: requests between their arrival and their answer sent
        self._idle = threading.Condition()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is being handled (an answer in progress is sent); whether so."""
        with self._idle:
            return self._idle.wait_for(lambda: self.busy == 0, timeout)

    def start(self) -> None:
        private_dir(self.path.parent, self.uid)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self.path))
        os.chmod(self.path, 0o600)  # the directory is private already: no one else could reach it meanwhile
        sock.listen(64)
        self.sock = sock
        self._dispatcher = threading.Thread(target=self._dispatch, name="gpuos-agent-control", daemon=True)
        self._dispatcher.start()
        self.thread = threading.Thread(target=self._serve, name="gpuos-agent-accept", daemon=True)
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
                with self._conns_lock:
                    conns = list(self._conns)
                for conn in conns:  # wakes their threads, which close them
                    try:
                        conn.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                self._work.put(None)

    # -- the threads --

    def _dispatch(self) -> None:
        """Run the handler for each request, one at a time, on this one thread."""
        relax_capture()  # a handler's driver calls must not break a graph the program captures meanwhile
        while True:
            item = self._work.get()
            if item is None:
                return
            request, result, done, conn = item
            _local.conn, _local.fds = conn, []
            try:
                result.append(self.handler(request))
            except GpuosError as exc:  # a refusal meant for the user: its message and exit code
                result.append({"ok": False, "error": str(exc), "code": int(exc.code)})
            except Exception as exc:  # noqa: BLE001 - the agent must outlive a failed request
                result.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            finally:
                result.append(_local.fds)
                _local.conn, _local.fds = None, []
                done.set()

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
            try:
                _, uid, _ = peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            refusal = None
            if uid not in (self.uid, 0):
                refusal = f"uid {uid} may not control this agent"
            else:
                with self._conns_lock:
                    if len(self._conns) >= MAX_CONNECTIONS:
                        refusal = f"busy: {MAX_CONNECTIONS} connections are open already; try again"
                    else:
                        self._conns.add(conn)
            if refusal is not None:  # said without waiting: this thread never blocks on a client
                try:
                    conn.send(_encode({"ok": False, "error": refusal}), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                except OSError:
                    pass
                conn.close()
                continue
            try:
                threading.Thread(target=self._connection, args=(conn,), name="gpuos-agent-conn", daemon=True).start()
            except RuntimeError:  # no thread to be had: this client is turned away, the agent goes on
                with self._conns_lock:
                    self._conns.discard(conn)
                conn.close()

    def _connection(self, conn: socket.socket) -> None:
        try:
            with conn:
                for line in _request_lines(conn):
                    if isinstance(line, _TooLarge):
                        _answer(conn, {"ok": False, "error": f"bad request: longer than {MAX_REQUEST} bytes"})
                        return  # the rest of it cannot be told from the next request
                    with self._idle:
                        self.busy += 1
                    fds: list[int] = []
                    try:
                        answer, fds = self._one(line, conn)
                        _answer(conn, answer, fds)
                    finally:
                        for fd in fds:
                            os.close(fd)
                        with self._idle:
                            self.busy -= 1
                            self._idle.notify_all()
        except Exception:  # noqa: BLE001 - a client that went away or stalled must not end the agent
            pass
        finally:
            with self._conns_lock:
                self._conns.discard(conn)

    def _one(self, line: bytes, conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
        """The answer to one request line (parsed here, run on the dispatcher thread), and the
        descriptors it carries."""
        try:
            request = json.loads(line)
            if not isinstance(request, dict) or "op" not in request:
                raise ValueError("a request is a JSON object with an 'op'")
        except RecursionError:
            return {"ok": False, "error": "bad request: nested too deeply"}, []
        except ValueError as exc:
            return {"ok": False, "error": f"bad request: {exc}"}, []
        result: list[Any] = []
        done = threading.Event()
        self._work.put((request, result, done, conn))
        while not done.wait(1.0):
            if self.sock is None:
                return {"ok": False, "error": "the agent is shutting down"}, []
        return result[0], result[1]


def _request_lines(conn: socket.socket) -> Any:
    """Request lines as they arrive (the last one may lack its newline), or a _TooLarge in
    place of one over MAX_REQUEST bytes. TimeoutError when the client stays idle longer than
    IDLE_TIMEOUT_S or takes longer than REQUEST_TIMEOUT_S to send one request."""
    buf = bytearray()
    started = 0.0
    while True:
        nl = buf.find(b"\n")
        if 0 <= nl < MAX_REQUEST:
            yield bytes(buf[: nl + 1])
            del buf[: nl + 1]
            started = time.monotonic() if buf else 0.0
            continue
        if len(buf) >= MAX_REQUEST:
            yield _TooLarge()
            return
        if buf:
            left = started + REQUEST_TIMEOUT_S - time.monotonic()
            if left <= 0:
                raise TimeoutError("request not received in time")
            conn.settimeout(left)
        else:
            conn.settimeout(IDLE_TIMEOUT_S)
        chunk = conn.recv(min(1 << 16, MAX_REQUEST - len(buf)))
        if not chunk:
            if buf.strip():
                yield bytes(buf)
            return
        if not buf:
            started = time.monotonic()
        buf += chunk


def _encode(answer: dict[str, Any]) -> bytes:
    try:
        return json.dumps(answer).encode() + b"\n"
    except (TypeError, ValueError) as exc:
        return json.dumps({"ok": False, "error": f"the answer could not be encoded: {exc}"}).encode() + b"\n"


def _answer(conn: socket.socket, answer: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send one answer line (with ``fds`` on its first bytes), waiting at most SEND_TIMEOUT_S for
    the client to take it. MSG_NOSIGNAL: a client that died (kill -9 of `gpu-ckpt --agent`) is an
    EPIPE here, never a SIGPIPE, which would end a program that set SIGPIPE to its default."""
    conn.settimeout(SEND_TIMEOUT_S)
    data = _encode(answer)
    if fds:
        sent = socket.send_fds(conn, [data[:4096]], fds, socket.MSG_NOSIGNAL)
        data = data[sent:]
    if data:
        conn.sendall(data, socket.MSG_NOSIGNAL)


def check_server(sock: socket.socket, path: Path) -> None:
    """Refuse an agent socket served by another user: the peer must run as this user or root
    (root, as a client, also accepts the user who owns the socket file it named). Another user
    could otherwise answer in an agent's place, from a socket planted where the agent's would be."""
    _, uid, _ = peer_credentials(sock)
    me = os.getuid()
    if uid in (me, 0):
        return
    if me == 0:
        try:
            if os.lstat(path).st_uid == uid:
                return
        except OSError:
            pass
    raise GpuosError(f"{path} is served by uid {uid}, not by this user (uid {me}) or root: refusing to talk to it",
                     ExitCode.PERMISSION)


def request(target: str | Path, op: str, timeout: float | None = 600.0, **fields: Any) -> dict[str, Any]:
    """Send one request to an agent and return its answer (raises GpuosError when not ok)."""
    path = target if isinstance(target, Path) else resolve(target)
    data = json.dumps({"op": op, **fields}).encode() + b"\n"
    if len(data) > MAX_REQUEST:
        raise GpuosError(f"the {op} request is larger than the agent takes ({len(data)} > {MAX_REQUEST} bytes)", ExitCode.USAGE)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    deadline = time.monotonic() + (timeout if timeout is not None else 600.0)
    while True:
        try:
            sock.connect(str(path))
            break
        except BlockingIOError:  # the agent's backlog is full for now (a Unix socket does not wait)
            if time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            sock.close()
            raise GpuosError(f"the agent at {path} accepted no connection within {timeout} s", ExitCode.FAILURE) from None
        except OSError as exc:
            sock.close()
            raise GpuosError(f"cannot reach the agent at {path}: {exc}", ExitCode.NO_SUCH_PROCESS) from exc
    fds: list[int] = []
    with sock:
        check_server(sock, path)
        line = b""
        try:
            sock.sendall(data)
            while not line.endswith(b"\n") and len(line) < MAX_ANSWER:
                got, new, _, _ = socket.recv_fds(sock, 1 << 16, MAX_FDS)
                fds += new
                if not got:
                    break
                line += got
        except TimeoutError as exc:
            _close(fds)
            raise GpuosError(f"the agent at {path} did not answer within {timeout} s", ExitCode.FAILURE) from exc
        except OSError as exc:
            _close(fds)
            raise GpuosError(f"the agent at {path} closed the connection: {exc}", ExitCode.FAILURE) from exc
    if not line:
        _close(fds)
        raise GpuosError(f"the agent at {path} closed the connection (did the program exit?)", ExitCode.FAILURE)
    if not line.endswith(b"\n"):
        _close(fds)
        raise GpuosError(f"the agent at {path} sent an answer cut short or over {MAX_ANSWER} bytes", ExitCode.FAILURE)
    try:
        answer = json.loads(line)
    except (ValueError, RecursionError) as exc:
        _close(fds)
        raise GpuosError(f"the agent at {path} answered something that is not JSON: {exc}", ExitCode.FAILURE) from None
    if not isinstance(answer, dict):
        _close(fds)
        raise GpuosError(f"the agent at {path} answered a JSON {type(answer).__name__}, not an object", ExitCode.FAILURE)
    if fds:
        answer["_fds"] = fds  # the caller owns them now
    if not answer.get("ok"):
        _close(fds)
        try:
            code = ExitCode(answer.get("code", ExitCode.FAILURE))
        except (ValueError, TypeError):
            code = ExitCode.FAILURE
        raise GpuosError(f"agent: {answer.get('error', 'failed')}", code)
    return answer


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
