"""Running test code as a second, unprivileged user.

The tests that try to crash, take over or mislead a daemon or agent of another user need a user
that is neither the daemon's nor root. They run as root (CI does) and skip otherwise. The other
user is a uid and gid in no account database (no useradd, nothing left behind); its code runs in
a forked child that drops to that uid before it runs, so it needs no interpreter or checkout it
could read: the modules it uses are the ones this process imported before the fork.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import select
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as a second user (CI runs the tests as root)")


def unused_id(start: int = 61000, skip: tuple[int, ...] = ()) -> int:
    """A number that is neither a uid nor a gid of this system (nor in ``skip``)."""
    for n in range(start, start + 4000):
        if n in skip:
            continue
        try:
            pwd.getpwuid(n)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(n)
            continue
        except KeyError:
            return n
    raise RuntimeError("no unused uid/gid")


@contextlib.contextmanager
def shared_directory() -> Iterator[Path]:
    """A directory every user may write, sticky like /tmp (pytest's own tmp_path is private to
    root, so a second user could not even reach a file in it); removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="gpuos-shared-", dir="/tmp"))  # not $TMPDIR: it may sit in a private directory
    d.chmod(0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Stranger:
    """A second user: ``run(fn, *args)`` calls ``fn`` in a child running as this uid and gid
    (and ``groups``, supplementary), and returns what it returned (JSON), or raises
    ``StrangerFailed`` with the exception it raised (``in_child``)."""

    def __init__(self, uid: int | None = None, gid: int | None = None, groups: tuple[int, ...] = ()):
        need_root()
        self.uid = unused_id() if uid is None else uid
        self.gid = self.uid if gid is None else gid
        self.groups = groups

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 30.0) -> Any:
        return in_child(fn, *args, timeout=timeout, user=(self.uid, self.gid, self.groups))


def in_child(fn: Callable[..., Any], *args: Any, timeout: float = 60.0,
             user: tuple[int, int, tuple[int, ...]] | None = None) -> Any:
    """``fn(*args)`` in a forked child (as ``user``: uid, gid and supplementary groups, when
    given), its JSON result returned here; ``StrangerFailed`` carries what it raised, and a child
    killed by a signal (a SIGBUS, say) is reported as such instead of taking the test run down."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, report, leave without cleanup handlers
        try:
            os.close(r)
            if user is not None:
                uid, gid, groups = user
                os.setgroups(list(groups))
                os.setgid(gid)
                os.setuid(uid)
            out = {"ok": True, "value": fn(*args)}
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = {"ok": False, "error": f"{type(e).__name__}: {e}", "type": type(e).__name__}
        try:
            os.write(w, json.dumps(out, default=str).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                raise TimeoutError(f"the child did not finish within {timeout} s")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        raise StrangerFailed(f"the child was killed by {signal.Signals(os.WTERMSIG(status)).name}", "signal")
    out = json.loads(data)
    if not out["ok"]:
        raise StrangerFailed(out["error"], out["type"])
    return out["value"]


class StrangerFailed(Exception):
    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind
