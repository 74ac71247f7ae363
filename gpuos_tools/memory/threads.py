"""The agent's own threads: a thread whose driver calls are the agent's, not the program's, so
that the tracer skips them (releasing a buffer is not the program freeing it).

The set of such threads belongs to the agent (a set of native thread ids, or the native core's
table: anything with ``add``, ``discard`` and ``in``). Code here is handed the agent's set where
it has the agent (the residency engine), and otherwise uses the one the agent side registered
when it started (``set_own_threads``): memory never looks the agent up, it is a layer above.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_registered: Any = None


def set_own_threads(marks: Any) -> None:
    """Register the running agent's set of own thread ids (None: no agent any more)."""
    global _registered
    _registered = marks


def own_threads() -> Any:
    """The registered set of the agent's own thread ids, or None."""
    return _registered


@contextmanager
def agents_thread(marks: Any = None) -> Iterator[None]:
    """While inside, this thread's driver calls are the agent's. ``marks``: the agent's set
    (default: the registered one; with none, nothing is marked). A thread already marked stays
    marked when it leaves."""
    own = marks if marks is not None else _registered
    me = threading.get_native_id()
    mine = own is not None and me not in own
    if mine:
        own.add(me)
    try:
        yield
    finally:
        if mine:
            own.discard(me)


class WaitCountingLock:
    """A re-entrant lock that counts, per thread name, how often and how long a thread had to
    wait for it (the uncontended path is one try). The residency engine's threads issue driver
    calls under its lock, and the program's thread takes it at every decision: where the
    program's time goes on a GPU host is in these figures."""

    __slots__ = ("_lock", "waited")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.waited: dict[str, list[float]] = {}  #: thread name -> [waits, seconds]

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        lock = self._lock
        if lock.acquire(False):
            return True
        if not blocking:
            return False
        t = time.perf_counter()
        got = lock.acquire(True, timeout)
        w = self.waited.setdefault(threading.current_thread().name, [0, 0.0])
        w[0] += 1
        w[1] += time.perf_counter() - t
        return got

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def waits(self) -> dict[str, dict[str, float]]:
        """Per thread name: the waits and their seconds (a copy first: a thread waiting for the
        first time adds its name meanwhile)."""
        return {name: {"waits": int(n), "wait_s": round(s, 6)} for name, (n, s) in sorted(dict(self.waited).items())}

