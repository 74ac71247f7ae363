"""The agent's own threads as memory sees them (gpuos_tools/memory/threads.py): the agent side
registers its set of thread ids, and memory's driver calls mark the calling thread through it
while inside -- the residency engine's through the agent it was given, code without an agent
through the registered set. No GPU."""

from __future__ import annotations

import threading

import pytest

from gpuos_tools.memory import threads
from gpuos_tools.memory.driver_ops import DriverOps
from gpuos_tools.memory.engine import ResidencyEngine
from tests.test_engine import MIB, FakeAgent, FakeOps, Rec


class Marks:
    """A set of thread ids that keeps what was done to it."""

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.log: list[tuple[str, int]] = []

    def add(self, tid: int) -> None:
        self.ids.add(tid)
        self.log.append(("add", tid))

    def discard(self, tid: int) -> None:
        self.ids.discard(tid)
        self.log.append(("discard", tid))

    def __contains__(self, tid: object) -> bool:
        return tid in self.ids


@pytest.fixture
def registered():
    marks = Marks()
    before = threads.own_threads()
    threads.set_own_threads(marks)
    yield marks
    threads.set_own_threads(before)


def test_the_registered_set_marks_this_thread_while_inside(registered):
    me = threading.get_native_id()
    assert threads.own_threads() is registered
    with threads.agents_thread():
        assert me in registered
    assert me not in registered
    assert registered.log == [("add", me), ("discard", me)]


def test_a_thread_marked_already_stays_marked(registered):
    me = threading.get_native_id()
    with threads.agents_thread():
        with threads.agents_thread():
            assert me in registered
        assert me in registered  # the inner block did not take the outer one's mark
    assert me not in registered
    assert registered.log == [("add", me), ("discard", me)]


def test_the_mark_is_cleared_when_the_block_raises(registered):
    me = threading.get_native_id()
    with pytest.raises(RuntimeError):
        with threads.agents_thread():
            raise RuntimeError("a driver call failed")
    assert me not in registered


def test_without_a_registered_agent_nothing_is_marked():
    before = threads.own_threads()
    threads.set_own_threads(None)
    try:
        with threads.agents_thread():
            assert threads.own_threads() is None
    finally:
        threads.set_own_threads(before)


def test_the_engine_marks_the_set_of_the_agent_it_was_given(registered):
    """Its driver calls (a demand load here) run marked in its agent's set, not the registered one."""
    base = 0x1000_0000
    ops = FakeOps([Rec(base, 4 * MIB, resident=False)])
    agent = FakeAgent({1: base})
    eng = ResidencyEngine(agent, ops)
    me = threading.get_native_id()
    seen = []
    make_resident = ops.make_resident

    def spy(b):
        seen.append(me in agent.own)
        make_resident(b)

    ops.make_resident = spy
    ops.hostmem[0x5000_0000] = b"saved"
    eng.adopt(base, 4 * MIB, [(0x5000_0000, 4 * MIB)])
    eng.require([base], 5)
    assert seen == [True] and me not in agent.own
    assert registered.log == []
    eng.close()


def test_driver_ops_without_an_agent_mark_their_threads_in_the_registered_set(registered):
    """The digest kernel's build thread (its driver calls are the agent's) when DriverOps was
    made without an agent: marked through the registration, and unmarked when it ends (whether
    the build succeeded or not: here there may be no cuda-python at all)."""
    ops = DriverOps(owned=False)
    ops.digest_prepare()
    ops._builder.join(60)
    assert not ops._builder.is_alive()
    tid = ops._builder.native_id
    assert registered.log == [("add", tid), ("discard", tid)]
    assert not registered.ids


def test_the_engines_lock_counts_who_waited_for_it_and_how_long():
    lock = threads.WaitCountingLock()
    with lock, lock:  # re-entrant, and nobody waited
        pass
    assert lock.waits() == {}
    held, go = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            go.wait(5)

    t = threading.Thread(target=holder, name="gpuos-evict")
    t.start()
    held.wait(5)
    assert not lock.acquire(blocking=False) and lock.waits() == {}  # a try is no wait
    threading.Timer(0.05, go.set).start()
    with lock:
        pass
    t.join()
    waits = lock.waits()
    assert list(waits) == [threading.current_thread().name] and waits[threading.current_thread().name]["waits"] == 1
    assert waits[threading.current_thread().name]["wait_s"] >= 0.04
