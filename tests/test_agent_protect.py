"""What the agent does in the program's callback before a write during a snapshot
(Agent._protect), with the driver replaced by a recorder: the first write of a buffer copies it
on the writing stream; later writes on a stream already ordered after the copy cost no driver
call; another stream waits once for the copy's event, or not at all once it completed."""

import types

import pytest

from fake_cuda import install_driver
from gpuos_tools.agent import agent as agent_mod
from gpuos_tools.agent.agent import COW, ENQUEUED, HOST, UNSAVED, Agent, Snap
from gpuos_tools.model.allocs import Allocation

NOT_READY = 600


class FakeDriver(types.SimpleNamespace):
    def __init__(self):
        super().__init__(CUresult=types.SimpleNamespace(CUDA_SUCCESS=0),
                         CUevent_flags=types.SimpleNamespace(CU_EVENT_DISABLE_TIMING=2))
        self.calls: list[tuple] = []
        self.complete: set[int] = set()
        self.next_event = 1000

    def cuEventCreate(self, flags):
        self.calls.append(("create",))
        self.next_event += 1
        return (0, self.next_event)

    def cuStreamWaitEvent(self, stream, ev, flags):
        self.calls.append(("wait", stream, ev))
        return (0,)

    def cuMemcpyDtoDAsync(self, dst, src, n, stream):
        self.calls.append(("dtod", dst, src, n, stream))
        return (0,)

    def cuMemcpyDtoHAsync(self, dst, src, n, stream):
        self.calls.append(("dtoh", dst, src, n, stream))
        return (0,)

    def cuEventRecord(self, ev, stream):
        self.calls.append(("record", ev, stream))
        return (0,)

    def cuEventQuery(self, ev):
        self.calls.append(("query", ev))
        return (0,) if ev in self.complete else (NOT_READY,)


class Staging:
    base = 0x10_0000

    def spans(self, off, n):
        yield self.base + off, n


@pytest.fixture
def drv(monkeypatch):
    return install_driver(monkeypatch, FakeDriver())


def make_snap(n=2, budget=1 << 20, spare=(1, 2)):
    bufs = [Allocation(id=i + 1, addr=0x7000_0000 + i * 4096, size=4096, kind="device") for i in range(n)]
    return Snap(bufs, [i * 4096 for i in range(n)], Staging(), 4096 * n, side=99, t0_events=[7], t0_ns=0,
                ops_before=0, budget=budget, pool=0x9000_0000, state=[UNSAVED] * n, event=[None] * n,
                slot=[0] * n, index={b.id: i for i, b in enumerate(bufs)}, safe=[None] * n,
                spare=list(spare), created=[])


def test_first_write_copies_on_its_stream_and_later_writes_there_are_free(drv):
    a, snap = Agent(), make_snap()
    a._protect(snap, [0], 5)
    kinds = [c[0] for c in drv.calls]
    assert kinds == ["wait", "dtod", "record"]  # ordered after T0, slot copy, event; no create (spare)
    assert snap.state[0] == COW and snap.safe[0] == {5}
    drv.calls.clear()
    for _ in range(3):
        a._protect(snap, [0], 5)
    assert drv.calls == []


def test_another_stream_waits_once_for_the_copy(drv):
    a, snap = Agent(), make_snap()
    a._protect(snap, [0], 5)
    ev = snap.event[0]
    drv.calls.clear()
    a._protect(snap, [0], 6)
    assert drv.calls == [("query", ev), ("wait", 6, ev)] and snap.waits == 1
    drv.calls.clear()
    a._protect(snap, [0], 6)
    assert drv.calls == []


def test_a_completed_copy_frees_every_stream(drv):
    a, snap = Agent(), make_snap()
    a._protect(snap, [0], 5)
    drv.complete.add(snap.event[0])
    drv.calls.clear()
    a._protect(snap, [0], 6)
    assert drv.calls == [("query", snap.event[0])] and snap.safe[0] is None
    drv.calls.clear()
    a._protect(snap, [0], 8)
    assert drv.calls == []


def test_in_flight_copy_makes_each_stream_wait_once(drv):
    a, snap = Agent(), make_snap()
    snap.state[1], snap.event[1], snap.safe[1] = ENQUEUED, 42, set()  # the copier's copy
    a._protect(snap, [1], 5)
    a._protect(snap, [1], 5)
    a._protect(snap, [1], 6)
    assert [c for c in drv.calls if c[0] == "wait"] == [("wait", 5, 42), ("wait", 6, 42)]


def test_past_the_budget_it_saves_to_host_on_the_stream(drv):
    a, snap = Agent(), make_snap(budget=0, spare=())
    a._protect(snap, [0], 5)
    kinds = [c[0] for c in drv.calls]
    assert kinds == ["wait", "create", "dtoh", "record"]
    assert snap.state[0] == HOST and snap.host_saves == 1 and len(snap.created) == 1


def test_stall_parts_add_up_to_at_most_the_stall(drv):
    a, snap = Agent(), make_snap()
    a._protect(snap, [0, 1], 5)
    a._protect(snap, [0, 1], 6)
    assert sum(snap.parts_ns.values()) <= snap.stall_ns
    assert agent_mod.UNSAVED not in snap.state
