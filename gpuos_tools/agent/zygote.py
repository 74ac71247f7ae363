"""The validator's zygote: a process forked from the program just before its driver starts, which
forks each validator the program asks for (`gpu-trace run --validate --validate-in validator`).

Why: a validator replays a launch at the program's own device addresses, and the driver grants
an address only where its own bookkeeping puts it. A fresh process has another address-space
layout, so its driver's areas fall elsewhere and many of the program's addresses stay out of
reach. A process forked from the program after its framework loaded and before its first
``cuInit`` has the program's layout, and its driver, started there, hands out addresses as the
program's did (docs/benchmarks/gpu-predict-access.md has the measurements).

How: the interposer (injection/csrc/gpuos_intercept.c, preloaded for such runs) calls a hook
once, in the program's first ``cuInit``, before the real one: ``arm`` registers it, and the hook
forks the zygote there. The zygote leaves the program's session, drops every inherited file but
its socket, and waits; for each validator asked of it (its argv, the files its stdin and stdout
are to be, the file its stderr goes to) it forks a child that runs the validator's module as
``python -m`` would (or a script, as ``python script`` would) and answers with a pidfd of that
child. It reaps its children and tells a child's exit status when asked. It ends when the program's end of the socket closes, whatever
the program's fate. Nothing of the program's runs in it: no atexit handler, no buffered output
flushed twice (every exit is ``os._exit``), and the program's tracer gives up its CUPTI
subscription in the child (``on_child``), so the validators' driver calls are not traced.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
from pathlib import Path
from typing import Any, Callable

#: GPUOS_VALIDATOR_ZYGOTE=0 in the traced program's environment: no zygote (every validator fresh)
ENV = "GPUOS_VALIDATOR_ZYGOTE"
#: the hook's C type: void (*)(void)
HOOK = ctypes.CFUNCTYPE(None)
#: the interposer's registration of the hook
REGISTER = "gpuos_intercept_before_init"
MAX_MESSAGE = 1 << 16

_hooks: list[Any] = []  # the ctypes callbacks handed to C: they must outlive the process's use of them
_current: Zygote | None = None
_why_not: str | None = None  #: why no zygote was forked, when the hook ran and failed


def current() -> Zygote | None:
    """The zygote this process forked, if any and still there."""
    return _current if _current is not None and not _current.closed else None


def why_not() -> str | None:
    return _why_not


def arm(on_child: Callable[[], None] | None = None, library: Any = None) -> bool:
    """Have the zygote forked in the program's first ``cuInit`` (``on_child`` then runs in it
    first); False when the interposer is not loaded in this process (nothing happens then)."""
    lib = library if library is not None else ctypes.CDLL(None)  # the preloaded interposer's symbols
    try:
        register = getattr(lib, REGISTER)
    except AttributeError:
        return False
    register.argtypes, register.restype = [HOOK], None

    def hook() -> None:
        global _current, _why_not
        try:
            _current = Zygote.fork(on_child)
        except Exception as exc:  # noqa: BLE001 - the program's cuInit goes on either way
            _why_not = f"{type(exc).__name__}: {exc}"

    cb = HOOK(hook)
    _hooks.append(cb)
    register(cb)
    # a child the program forks before its first cuInit is not the program: no zygote of its own
    os.register_at_fork(after_in_child=lambda: register(HOOK()))
    return True


class Zygote:
    """The program's end: ``spawn`` a validator, ``close``."""

    def __init__(self, sock: socket.socket, pid: int, frameworks: list[str]) -> None:
        self.sock, self.pid = sock, pid
        self.frameworks = frameworks  #: the frameworks imported when it was forked (what its layout holds)
        self.closed = False

    @classmethod
    def fork(cls, on_child: Callable[[], None] | None = None) -> Zygote:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        frameworks = sorted(m for m in ("torch", "cupy", "jax", "numba", "tensorflow", "cuda.bindings")
                            if m in sys.modules)
        pid = os.fork()
        if pid == 0:  # the zygote: never returns
            code = 70
            try:
                parent.close()
                if on_child is not None:
                    on_child()
                code = _serve(child)
            except BaseException:  # noqa: BLE001 - nothing may unwind into the program's code
                pass
            os._exit(code)
        child.close()
        return cls(parent, pid, frameworks)

    def _ask(self, message: dict[str, Any], fds: list[int] = ()) -> tuple[dict[str, Any], list[int]]:
        if self.closed:
            raise OSError("the zygote is closed")
        data = json.dumps(message).encode()
        try:
            if fds:
                socket.send_fds(self.sock, [data], list(fds))
            else:
                self.sock.send(data)
            reply, got, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 1)
        except OSError as exc:
            self.close()
            raise OSError(f"the zygote is gone ({exc})") from None
        if not reply:
            self.close()
            raise OSError("the zygote is gone")
        return json.loads(reply), got

    def spawn(self, argv: list[str], stderr: Path | None = None) -> ZygoteProcess:
        """A validator running ``argv`` (``[python, "-m", module, args...]`` or ``[python,
        script, args...]``; the first is ignored: it is this interpreter), forked from the zygote;
        a Popen-like handle to it. OSError when the zygote cannot; ValueError for another argv."""
        if len(argv) >= 3 and argv[1] == "-m":
            what = {"module": argv[2], "args": argv[3:]}
        elif len(argv) >= 2 and not argv[1].startswith("-"):
            what = {"script": argv[1], "args": argv[2:]}
        else:
            raise ValueError("the zygote runs [python, '-m', module, args...] or [python, script, args...]")
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            reply, fds = self._ask({"op": "spawn", **what, "stderr": str(stderr) if stderr is not None else None},
                                   [in_r, out_w])
        except BaseException:
            for fd in (in_r, in_w, out_r, out_w):
                os.close(fd)
            raise
        os.close(in_r)
        os.close(out_w)
        if "pid" not in reply or not fds:
            for fd in (in_w, out_r, *fds):
                os.close(fd)
            raise OSError(f"the zygote could not start a validator: {reply.get('error', 'no reason given')}")
        return ZygoteProcess(self, int(reply["pid"]), fds[0], os.fdopen(in_w, "wb"), os.fdopen(out_r, "rb"))

    def status(self, pid: int) -> int | None:
        """An exited child's status (as Popen.returncode), None when unknown."""
        try:
            reply, fds = self._ask({"op": "status", "pid": pid})
        except (OSError, ValueError):
            return None
        for fd in fds:
            os.close(fd)
        return reply.get("status")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()  # the zygote ends at the end of its socket


class ZygoteProcess:
    """What offload.Link needs of a subprocess.Popen, for a validator the zygote forked (not this
    process's child: watched and signalled through its pidfd)."""

    def __init__(self, zygote: Zygote, pid: int, pidfd: int, stdin, stdout) -> None:
        self.zygote, self.pid, self.pidfd = zygote, pid, pidfd
        self.stdin, self.stdout = stdin, stdout
        self.returncode: int | None = None

    def _exited(self, timeout: float) -> bool:
        if self.pidfd < 0:
            return True
        return bool(select.select([self.pidfd], [], [], timeout)[0])

    def poll(self) -> int | None:
        if self.returncode is None and self._exited(0):
            self._reap()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        import subprocess

        if self.returncode is None:
            if not self._exited(timeout if timeout is not None else None):
                raise subprocess.TimeoutExpired(["validator"], timeout)
            self._reap()
        return self.returncode

    def _reap(self) -> None:
        status = self.zygote.status(self.pid)
        self.returncode = status if status is not None else -1
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def kill(self) -> None:
        if self.pidfd >= 0:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ------------------------------------------------------------------ the zygote's side

def _serve(sock: socket.socket) -> int:
    os.setsid()  # out of the program's session: its terminal's signals are the program's
    keep = sock.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 20)
    statuses: dict[int, int] = {}
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
        except OSError:
            return 0
        if not msg:
            return 0  # the program's end closed
        _reap(statuses)
        try:
            req = json.loads(msg)
            if req.get("op") == "status":
                pid = int(req["pid"])
                if pid not in statuses:
                    try:
                        _, st = os.waitpid(pid, 0)
                        statuses[pid] = os.waitstatus_to_exitcode(st)
                    except ChildProcessError:
                        pass
                sock.send(json.dumps({"status": statuses.pop(pid, None)}).encode())
            elif req.get("op") == "spawn" and len(fds) == 2:
                pid = os.fork()
                if pid == 0:
                    sock.close()
                    os._exit(_validator(req, fds))
                pidfd = os.pidfd_open(pid)
                try:
                    socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [pidfd])
                finally:
                    os.close(pidfd)
            else:
                sock.send(json.dumps({"error": f"bad request {req!r}"[:300]}).encode())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            try:
                sock.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
            except OSError:
                return 0
        finally:
            for fd in fds:
                os.close(fd)


def _reap(statuses: dict[int, int]) -> None:
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        statuses[pid] = os.waitstatus_to_exitcode(st)


def _validator(req: dict[str, Any], fds: list[int]) -> int:
    """In the zygote's child: stdin, stdout and stderr as asked, then the module as __main__."""
    try:
        os.setsid()
        os.dup2(fds[0], 0)
        os.dup2(fds[1], 1)
        if req.get("stderr"):
            err = os.open(req["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.dup2(err, 2)
            os.close(err)
        os.closerange(3, 1 << 20)
        # new file objects on 0, 1, 2, also as sys.__stdin__ and the like: those keep them alive
        # when the module rebinds sys.stdout (a collected wrapper closes its buffer)
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                                       write_through=True)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                                       write_through=True)
        sys.argv = [req.get("module") or req["script"], *req.get("args", [])]
    except BaseException:  # noqa: BLE001
        return 70
    try:
        if req.get("module"):
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(req["script"])))  # as `python script` does
            runpy.run_path(req["script"], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:  # noqa: BLE001 - say why on its stderr, like an interpreter would
        try:
            print(f"gpuos-validator: {type(exc).__name__}: {exc}", file=sys.stderr)
        except Exception:  # noqa: BLE001
            pass
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    return code
