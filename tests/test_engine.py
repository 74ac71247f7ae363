"""The residency engine (gpuos_tools/memory/engine.py) on a fake driver: what each operation
waits for, what loads when and in which order, eviction after the last use, and what an
operation touching an evicting record does. No GPU: the owned library's records and the
driver's streams and events are simulated, events completing when the test says so."""

from __future__ import annotations

import struct
import threading
import time
from dataclasses import dataclass

import pytest

from gpuos_tools.agent.agent import Agent
from gpuos_tools.memory.engine import SAMPLE, ResidencyEngine
from gpuos_tools.memory.settings import EngineSettings
from gpuos_tools.memory.states import EVICTING, LOADING, RELEASED, RESIDENT

MIB = 1 << 20


@dataclass
class Rec:
    base: int
    size: int
    resident: bool = True


class FakeOps:
    """The owned library's table and the driver's streams/events, as a log of calls. Events
    complete when ``finish`` says so (or at once with ``auto``)."""

    def __init__(self, records: list[Rec], auto: bool = False) -> None:
        self.recs = {r.base: r for r in records}
        self.log: list[tuple] = []
        self.done_events: set[int] = set()
        self.auto = auto
        self._n = 0
        self.device: dict[int, bytes] = {r.base: b"dev%x" % r.base for r in records}
        self.hostmem: dict[int, bytes] = {}
        self.cv = threading.Condition()
        self.gone_streams: set = set()

    def lookup(self, addr):
        for r in self.recs.values():
            if r.base <= addr < r.base + r.size:
                return r
        return None

    def make_resident(self, base):
        assert not self.recs[base].resident
        self.recs[base].resident = True
        self.log.append(("make_resident", base))

    def release(self, base):
        assert self.recs[base].resident
        self.recs[base].resident = False
        self.log.append(("release", base))

    def copy_in(self, base, pieces, stream):
        assert self.recs[base].resident, "a load into unmapped memory"
        assert sum(n for _, n in pieces) == self.recs[base].size
        self.device[base] = self.hostmem.get(pieces[0][0], b"")
        self.log.append(("copy_in", base, stream))

    def copy_out(self, base, pieces, stream):
        self.hostmem[pieces[0][0]] = self.device[base]
        self.log.append(("copy_out", base, stream))

    def host(self, base, size):
        return [(0x9000_0000 + base, size)]

    def stream(self):
        self._n += 1
        return f"s{self._n}"

    def event(self):
        self._n += 1
        return self._n

    def record(self, ev, stream):
        if stream in self.gone_streams:
            raise RuntimeError("cuEventRecord: CUDA_ERROR_INVALID_HANDLE")
        self.log.append(("record", ev, stream))
        if self.auto:
            self.done_events.add(ev)

    def wait(self, stream, ev):
        self.log.append(("wait", stream, ev))

    def done(self, ev):
        return ev in self.done_events

    def synchronize(self, ev):
        with self.cv:
            self.cv.wait_for(lambda: ev in self.done_events or self.auto, timeout=10)
        assert ev in self.done_events or self.auto, f"event {ev} never completed"
        self.log.append(("synchronize", ev))

    def finish(self, *events):
        with self.cv:
            self.done_events.update(events)
            self.cv.notify_all()

    def destroy(self, ev):
        pass

    def timer(self):
        self._n += 1
        return self._n

    def elapsed_ms(self, start, end):
        return float(end - start)  # the fake's clock: creation order

    def sync_all(self):
        self.log.append(("sync_all",))

    def enter(self):
        pass

    def calls(self, name):
        return [c for c in self.log if c[0] == name]


class FakeAgent:
    """What the engine reads of the agent: lock, own threads, streams, allocations by id,
    and a launch's touched allocations."""

    def __init__(self, allocs: dict[int, int]) -> None:
        self.lock = threading.RLock()
        self.own: set[int] = set()
        self.streams = {0, 7}
        self.by_id = {i: type("A", (), {"addr": a, "id": i})() for i, a in allocs.items()}
        self.launches: dict[str, tuple] = {}
        self.settled = 0
        self.issuing = 0  # the real Agent's count of operations being issued, and its waits on it
        self._issued = threading.Condition(threading.Lock())

    def launch_touches(self, kernel, sizes, args):
        return self.launches[kernel]

    issue_begin = Agent.issue_begin
    issue_end = Agent.issue_end

    def settle(self, timeout=2.0, own=0):
        self.settled += 1
        return Agent.settle(self, timeout, own)


BASES = [0x1000_0000, 0x2000_0000, 0x3000_0000, 0x4000_0000]


def setup(auto=False, ahead=1 << 40):
    recs = [Rec(b, 256 * MIB, resident=False) for b in BASES]
    ops = FakeOps(recs, auto=auto)
    agent = FakeAgent({i + 1: b for i, b in enumerate(BASES)})
    eng = ResidencyEngine(agent, ops, ahead=ahead)
    for b in BASES:
        ops.hostmem[0x5000_0000 + b] = b"saved%x" % b
        eng.adopt(b, 256 * MIB, [(0x5000_0000 + b, 128 * MIB), (0x5000_0000 + b + 128 * MIB, 128 * MIB)])
    return eng, ops, agent


def test_a_launch_waits_on_the_gpu_for_exactly_the_records_it_touches():
    eng, ops, agent = setup()
    agent.launches["k"] = (False, (2,), ())  # reads allocation 2 only
    eng.launch(5, "k", None, None)
    assert ops.calls("make_resident") == [("make_resident", BASES[1])]
    loads = ops.calls("copy_in")
    assert len(loads) == 1 and loads[0][1] == BASES[1]
    demand = loads[0][2]
    ev = [c for c in ops.log if c[0] == "record" and c[2] == demand][0][1]
    assert ops.calls("wait") == [("wait", 5, ev)]  # the launch's stream waits; the host never did
    assert not ops.calls("synchronize")
    assert eng.state(BASES[1]) == LOADING and eng.state(BASES[0]) == RELEASED
    # the same stream again: no second wait; another stream: one wait
    eng.launch(5, "k", None, None)
    eng.launch(6, "k", None, None)
    assert ops.calls("wait") == [("wait", 5, ev), ("wait", 6, ev)]
    ops.finish(ev)
    eng.launch(8, "k", None, None)  # completed: resident, nothing to wait for
    assert eng.state(BASES[1]) == RESIDENT and len(ops.calls("wait")) == 2
    assert eng.counts["demand_loads"] == 1 and eng.counts["stream_waits"] == 2


def test_an_unknown_launch_waits_for_every_record():
    eng, ops, agent = setup()
    agent.launches["u"] = (True, (), ())
    eng.launch(3, "u", None, None)
    assert {c[1] for c in ops.calls("copy_in")} == set(BASES)
    assert len([c for c in ops.calls("wait") if c[1] == 3]) == 4
    assert eng.counts["unknown_requires"] == 1


def test_copies_wait_for_source_and_destination_and_memsets_for_their_target():
    eng, ops, agent = setup()
    eng.access("cuMemcpyDtoHAsync_v2", 4, 0x7777, BASES[2] + 100)  # host destination, owned source
    assert [c[1] for c in ops.calls("copy_in")] == [BASES[2]]
    eng.access("cuMemsetD8Async", 4, BASES[3] + 8)
    assert [c[1] for c in ops.calls("copy_in")] == [BASES[2], BASES[3]]
    eng.access("cuMemcpyHtoD_v2", 0, 0x1234, 0x5678)  # neither owned: nothing
    assert len(ops.calls("copy_in")) == 2


def test_background_load_follows_first_touch_order_then_addresses_and_completes():
    eng, ops, agent = setup(auto=True)
    eng.first_touch.update({3: None, 1: None})  # allocation 3 first, then 1
    assert eng.order() == [BASES[2], BASES[0], BASES[1], BASES[3]]
    t = eng.load_rest()
    t.join(10)
    assert [c[1] for c in ops.calls("copy_in")] == [BASES[2], BASES[0], BASES[1], BASES[3]]
    assert eng.settled
    st = eng.stats()
    assert st["lazy"]["done"] and st["lazy"]["bytes"] == 4 * 256 * MIB and st["lazy"]["order_predicted"] == 2
    assert st["lazy"]["background_loads"] == 4 and st["lazy"]["demand_loads"] == 0
    assert st["background_loads"] == 4 and st["pending"] == {}
    # the device holds what was saved, at the same addresses
    assert all(ops.device[b] == b"saved%x" % b for b in BASES)


def test_background_loader_keeps_a_bounded_amount_ahead():
    eng, ops, agent = setup(ahead=600 * MIB)  # two 256 MiB records fit, a third would not
    t = eng.load_rest()
    assert _until(lambda: len(ops.calls("copy_in")) >= 2)
    threading.Event().wait(0.1)
    assert len(ops.calls("copy_in")) == 2  # a third would pass 600 MiB: it waits on the first
    first = _load_events(ops)[0]
    ops.finish(first)
    assert _until(lambda: len(ops.calls("copy_in")) >= 3)
    threading.Event().wait(0.1)
    assert len(ops.calls("copy_in")) == 3
    ops.auto = True
    ops.finish(*range(100))
    t.join(10)
    assert eng.settled


def test_the_most_recently_touched_come_first_and_recency_is_sampled_once_all_is_learnt():
    recs = [Rec(b, 256 * MIB) for b in BASES]
    ops = FakeOps(recs, auto=True)
    agent = FakeAgent({i + 1: b for i, b in enumerate(BASES)})
    eng = ResidencyEngine(agent, ops)
    for k, touched in (("a", (1,)), ("b", (2,)), ("c", (3,)), ("d", (4,))):
        agent.launches[k] = (False, touched, ())
    for k in "abcd":  # first touches: 1, 2, 3, 4
        assert eng.watching
        eng.launch(0, k, None, None)
    assert list(eng.first_touch) == [1, 2, 3, 4]
    # all learnt: one operation in SAMPLE is looked at; a loop on allocation 3 shows up there
    looked = 0
    for _ in range(3 * SAMPLE):
        if eng.watching:
            looked += 1
            eng.launch(0, "c", None, None)
    assert looked == 3
    assert list(eng.recent)[-1] == 3
    for r in recs:
        r.resident = False
    for b in BASES:
        eng.adopt(b, 256 * MIB, [(0x5000_0000 + b, 256 * MIB)])
    # newest first: 3 (the loop), then 4, 2, 1 by their last touches
    assert eng.order() == [BASES[2], BASES[3], BASES[1], BASES[0]]
    eng.load_rest().join(10)
    assert [c[1] for c in ops.calls("copy_in")] == [BASES[2], BASES[3], BASES[1], BASES[0]]
    assert eng.stats()["lazy"]["order_predicted"] == 4


def _load_events(ops):
    """The events recorded right after each copy_in, in order (the loads' own, not timers)."""
    return [b[1] for a, b in zip(ops.log, ops.log[1:]) if a[0] == "copy_in" and b[0] == "record"]


def _until(cond):
    for _ in range(200):
        if cond():
            return True
        threading.Event().wait(0.01)
    return cond()


def test_the_loader_issues_nothing_more_while_a_demand_load_is_in_flight_and_times_it():
    eng, ops, agent = setup(ahead=600 * MIB)
    t = eng.load_rest()
    assert _until(lambda: len(ops.calls("copy_in")) == 2)  # BASES[0], [1]; it waits on the first
    agent.launches["k"] = (False, (4,), ())
    eng.launch(9, "k", None, None)  # the program touches the last: loaded on demand
    loads = ops.calls("copy_in")
    assert len(loads) == 3 and loads[2][1] == BASES[3] and loads[2][2] != loads[0][2]
    ev0, ev1, demand = _load_events(ops)
    ops.finish(ev0)  # room ahead again: without the demand load it would issue BASES[2] now
    assert _until(lambda: ("synchronize", ev0) in ops.log)
    threading.Event().wait(0.1)
    assert len(ops.calls("copy_in")) == 3, "a background copy was queued while the demand load was in flight"
    ops.finish(demand)
    assert _until(lambda: len(ops.calls("copy_in")) == 4)
    assert ops.calls("copy_in")[3][1] == BASES[2]
    ops.auto = True
    ops.finish(*range(100))
    t.join(10)
    lazy = eng.stats()["lazy"]
    assert lazy["done"] and lazy["yields"] == 1 and lazy["demand_loads"] == 1
    # the demand load's copy between two timers on its stream, against the background's start
    (d,) = lazy["demand"]
    assert d["bytes"] == 256 * MIB and 0 < d["gpu_start_ms"] < d["gpu_end_ms"] and d["issued_ms"] >= 0
    assert lazy["background_gpu_ms"] > 0 and "timing_error" not in lazy


def test_without_yield_the_loader_feeds_on_past_a_demand_load(monkeypatch):
    # the measurement switch of bench_rollback's -noyield modes (GPUOS_ENGINE_NO_YIELD=1)
    monkeypatch.setattr(FakeAgent, "engine_settings", EngineSettings(yield_to_demand=False), raising=False)
    eng, ops, agent = setup(ahead=600 * MIB)
    t = eng.load_rest()
    assert _until(lambda: len(ops.calls("copy_in")) == 2)
    agent.launches["k"] = (False, (4,), ())
    eng.launch(9, "k", None, None)
    ev0 = _load_events(ops)[0]
    ops.finish(ev0)
    assert _until(lambda: len(ops.calls("copy_in")) == 4)  # BASES[2] queued behind nothing but room
    ops.auto = True
    ops.finish(*range(100))
    t.join(10)
    lazy = eng.stats()["lazy"]
    assert lazy["yield_to_demand"] is False and "yields" not in lazy and len(lazy["demand"]) == 1


def test_a_demand_load_meanwhile_is_not_loaded_twice():
    eng, ops, agent = setup(auto=True)
    agent.launches["k"] = (False, (4,), ())
    eng.launch(1, "k", None, None)  # the last in address order, loaded on demand first
    eng.load_rest().join(10)
    assert sorted(c[1] for c in ops.calls("copy_in")) == sorted(BASES)
    assert eng.counts["demand_loads"] == 1 and eng.counts["background_loads"] == 3


def test_a_record_freed_while_pending_is_forgotten_and_a_load_in_flight_completes_first():
    eng, ops, agent = setup()
    eng.prefetch(BASES[0])
    ev = [c for c in ops.log if c[0] == "record"][-1][1]
    ops.finish(ev)
    eng.access("cuMemUnmap", 0, BASES[0])
    assert ("synchronize", ev) in ops.log and eng.state(BASES[0]) == RESIDENT
    del ops.recs[BASES[1]]  # freed by the library without a driver call (it was released)
    agent.launches["k"] = (False, (2,), ())
    eng.launch(1, "k", None, None)
    assert eng.state(BASES[1]) == RESIDENT and eng.counts["freed_while_pending"] == 2


def test_evict_saves_after_the_last_use_then_releases_and_a_later_use_loads_it_back():
    recs = [Rec(b, 64 * MIB) for b in BASES[:2]]
    ops = FakeOps(recs, auto=True)
    agent = FakeAgent({1: BASES[0], 2: BASES[1]})
    eng = ResidencyEngine(agent, ops)
    assert eng.evict(BASES[0])
    for _ in range(200):
        if eng.state(BASES[0]) == RELEASED:
            break
        threading.Event().wait(0.01)
    assert eng.state(BASES[0]) == RELEASED and not ops.recs[BASES[0]].resident
    assert agent.settled == 1
    # events recorded on every program stream, the evict stream waiting on them, before the save
    i_save = ops.log.index(next(c for c in ops.log if c[0] == "copy_out"))
    waits = [c for c in ops.log[:i_save] if c[0] == "wait"]
    recorded = {c[2] for c in ops.log[:i_save] if c[0] == "record"}
    assert recorded == {0, 7} and len(waits) == 2 and {w[1] for w in waits} == {ops.log[i_save][2]}
    assert ops.log.index(("release", BASES[0])) > i_save
    assert eng.counts["evictions"] == 1 and eng.counts["evict_saves"] == 1
    # a launch touching it: made resident, loaded from the engine's own copy, now clean
    agent.launches["k"] = (False, (1,), ())
    eng.launch(3, "k", None, None)
    assert ops.recs[BASES[0]].resident and ops.device[BASES[0]] == b"dev%x" % BASES[0]
    assert BASES[0] in eng.clean
    # evicting a clean record skips the save
    eng.evict(BASES[0])
    for _ in range(200):
        if eng.state(BASES[0]) == RELEASED:
            break
        threading.Event().wait(0.01)
    assert eng.counts["evictions"] == 2 and eng.counts["evict_saves"] == 1
    eng.close()


def _released(eng, base):
    for _ in range(200):
        if eng.state(base) == RELEASED:
            return True
        threading.Event().wait(0.01)
    return False


@pytest.mark.parametrize("drop_dead", [True, False])
def test_a_record_whose_torch_blocks_are_all_freed_goes_without_a_save_and_comes_back_without_a_copy(drop_dead):
    recs = [Rec(b, 64 * MIB) for b in BASES[:2]]
    ops = FakeOps(recs, auto=True)
    dead = {BASES[0]}
    ops.dead = lambda base: base in dead
    agent = FakeAgent({1: BASES[0], 2: BASES[1]})
    eng = ResidencyEngine(agent, ops, settings=EngineSettings(drop_dead=drop_dead))
    assert eng.evict(BASES[0]) and _released(eng, BASES[0])
    assert eng.evict(BASES[1]) and _released(eng, BASES[1])
    saved = {c[1] for c in ops.calls("copy_out")}
    if not drop_dead:  # the switch off: saved and loaded like any other
        assert saved == {BASES[0], BASES[1]} and eng.counts["dead_evictions"] == 0
        eng.close()
        return
    assert saved == {BASES[1]}
    assert eng.counts["dead_evictions"] == 1 and eng.counts["dead_bytes"] == 64 * MIB
    assert eng.counts["evict_saves"] == 1 and eng.counts["unsaved_bytes"] == 0
    # the release still waits for the program's last use: the event recorded after the evict
    # stream's waits on the program's streams, synchronised before it
    i_release = ops.log.index(("release", BASES[0]))
    sync = [c for c in ops.log[:i_release] if c[0] == "synchronize"]
    rec = next(c for c in ops.log if c[0] == "record" and c[1] == sync[0][1])
    assert ops.log.index(rec) > max(i for i, c in enumerate(ops.log[:i_release]) if c[0] == "wait")
    # a launch touching it: mapped, nothing copied, nothing to wait for, not clean (its device
    # bytes are not the host copy's)
    agent.launches["k"] = (False, (1, 2), ())
    before = len(ops.calls("wait"))
    ops.auto = False  # the live one's load still in flight: the launch's stream waits for it
    eng.launch(3, "k", None, None)
    ops.auto = True
    ops.finish(*range(100))
    assert ops.recs[BASES[0]].resident and eng.state(BASES[0]) == RESIDENT
    assert [c[1] for c in ops.calls("copy_in")] == [BASES[1]]
    assert len(ops.calls("wait")) == before + 1  # on the live one's load alone
    assert eng.counts["dead_loads"] == 1 and eng.counts["demand_loads"] == 1
    assert eng.counts["loaded_bytes"] == 64 * MIB and BASES[0] not in eng.clean
    # a prefetch of a dead record maps it and has nothing in flight to return
    assert eng.evict(BASES[0]) and _released(eng, BASES[0])
    assert eng.prefetch(BASES[0]) is None and eng.state(BASES[0]) == RESIDENT
    assert eng.counts["dead_loads"] == 2 and eng.counts["prefetches"] == 0
    # live again (a block handed out and written): saved as usual
    dead.clear()
    assert eng.evict(BASES[0]) and _released(eng, BASES[0])
    assert [c[1] for c in ops.calls("copy_out")] == [BASES[1], BASES[0]]
    # freed while it was out: its load copies nothing back either
    dead.add(BASES[0])
    eng.launch(3, "k", None, None)
    assert eng.state(BASES[0]) == RESIDENT and [c[1] for c in ops.calls("copy_in")] == [BASES[1]]
    assert eng.counts["dead_loads"] == 3 and eng.counts["dead_evictions"] == 2
    eng.close()


def test_a_write_makes_a_clean_record_dirty_again():
    recs = [Rec(BASES[0], 64 * MIB)]
    ops = FakeOps(recs, auto=True)
    agent = FakeAgent({1: BASES[0]})
    eng = ResidencyEngine(agent, ops)
    eng.clean.add(BASES[0])
    agent.launches["w"] = (False, (1,), (1,))
    eng.launch(0, "w", None, None)
    assert not eng.clean
    eng.clean.add(BASES[0])
    eng.access("cuMemsetD32Async", 0, BASES[0] + 64)
    assert not eng.clean


def test_an_operation_on_an_evicting_record_cancels_the_eviction():
    recs = [Rec(BASES[0], 64 * MIB)]
    ops = FakeOps(recs)
    agent = FakeAgent({1: BASES[0]})
    eng = ResidencyEngine(agent, ops)
    assert eng.evict(BASES[0])
    for _ in range(200):
        if eng.state(BASES[0]) == EVICTING and ops.calls("copy_out"):
            break
        threading.Event().wait(0.01)
    assert eng.state(BASES[0]) == EVICTING
    eng.access("cuMemcpyHtoDAsync_v2", 0, BASES[0], 0x42)  # the program writes it: it stays
    assert eng.state(BASES[0]) == RESIDENT and eng.counts["evictions_cancelled"] == 1
    ops.auto = True
    ops.finish(*range(100))
    eng.close()
    assert ops.recs[BASES[0]].resident and not ops.calls("release")


def test_evict_refuses_what_is_not_a_resident_record():
    eng, ops, agent = setup()
    assert not eng.evict(BASES[0])  # released
    assert not eng.evict(0x1234)  # not owned


def test_prefetch_loads_once_and_returns_the_event():
    eng, ops, agent = setup()
    ev = eng.prefetch(BASES[3])
    assert ev is not None and eng.state(BASES[3]) == LOADING
    assert eng.prefetch(BASES[3]) == ev and len(ops.calls("copy_in")) == 1
    ops.finish(ev)
    assert eng.require([BASES[3]], 0) == 0 and eng.state(BASES[3]) == RESIDENT
    assert eng.prefetch(BASES[3]) is None


# -- through the agent's hooks ---------------------------------------------------------------------

KERNEL = "_Z5scalePffx"  # scale(float*, float, long long)


def test_the_agents_launch_hook_learns_first_touches_and_requires_what_the_prediction_touches():
    a = Agent()
    a.ctx = object()
    a.on_alloc(BASES[0], 256 * MIB, "vmm")
    a.on_alloc(BASES[1], 256 * MIB, "vmm")
    ops = FakeOps([Rec(BASES[0], 256 * MIB), Rec(BASES[1], 256 * MIB)])
    a.engine = ResidencyEngine(a, ops)
    args = struct.pack("<Qfq", BASES[1], 2.0, 1024)
    a.before_launch("cuLaunchKernel", 0, KERNEL, (8, 4, 8), args)
    assert list(a.engine.first_touch) == [2]
    ops.recs[BASES[1]].resident = False
    ops.hostmem[0x77] = b"x"
    a.engine.adopt(BASES[1], 256 * MIB, [(0x77, 256 * MIB)])
    a.before_launch("cuLaunchKernel", 9, KERNEL, (8, 4, 8), args)
    assert [c[1] for c in ops.calls("copy_in")] == [BASES[1]] and ops.calls("wait")[0][1] == 9
    a.before_write("cuMemcpyDtoH_v2", 0x1000, 0, BASES[0])  # not pending: nothing
    assert len(ops.calls("copy_in")) == 1
    a.before_graph(11)  # a graph launch: every pending record
    assert ops.calls("wait")[-1][1] == 11


def test_the_agent_refuses_snapshot_suspend_rollback_while_records_are_pending():
    from gpuos_tools.errors import ExitCode, GpuosError

    a = Agent()
    ops = FakeOps([Rec(BASES[0], MIB, resident=False)])
    a.engine = ResidencyEngine(a, ops)
    a.engine.adopt(BASES[0], MIB, [(0x77, MIB)])
    for op in ("snapshot", "suspend", "rollback"):
        with pytest.raises(GpuosError) as e:
            a.handle({"op": op, "image": "/nope"})
        assert e.value.code == ExitCode.WRONG_STATE and "1 released" in str(e.value)
    assert a.handle({"op": "ping"})["residency"]["pending"]["released"]["records"] == 1


def test_evict_after_a_stream_vanished_waits_for_the_whole_context_instead():
    recs = [Rec(BASES[0], 64 * MIB)]
    ops = FakeOps(recs, auto=True)
    ops.gone_streams.add(7)
    agent = FakeAgent({1: BASES[0]})
    eng = ResidencyEngine(agent, ops)
    assert eng.evict(BASES[0])
    for _ in range(200):
        if eng.state(BASES[0]) == RELEASED:
            break
        threading.Event().wait(0.01)
    assert eng.state(BASES[0]) == RELEASED
    assert ops.log.index(("sync_all",)) < ops.log.index(next(c for c in ops.log if c[0] == "copy_out"))
    eng.close()


def test_evict_is_refused_while_a_snapshot_is_in_progress():
    recs = [Rec(BASES[0], 64 * MIB)]
    ops = FakeOps(recs, auto=True)
    agent = FakeAgent({1: BASES[0]})
    agent.snap = object()
    eng = ResidencyEngine(agent, ops)
    assert not eng.evict(BASES[0]) and not ops.log
    agent.snap = None
    assert eng.evict(BASES[0])
    eng.close()


def test_a_failing_engine_does_not_skip_the_snapshot_side_of_the_launch_hook(monkeypatch):
    a = Agent()
    a.ctx = object()
    a.on_alloc(BASES[0], MIB, "vmm")
    ops = FakeOps([Rec(BASES[0], MIB, resident=False)])
    a.engine = ResidencyEngine(a, ops)
    a.engine.adopt(BASES[0], MIB, [(0x77, MIB)])
    monkeypatch.setattr(ops, "make_resident", lambda base: (_ for _ in ()).throw(RuntimeError("out of memory")))
    seen = []
    monkeypatch.setattr(a, "_before_launch_snap", lambda *x: seen.append(x))
    with pytest.raises(RuntimeError):
        a.before_launch("cuLaunchKernel", 0, KERNEL, (8, 4, 8), struct.pack("<Qfq", BASES[0], 2.0, 1))
    assert len(seen) == 1


@pytest.mark.parametrize("api,opaque", [("cuMemcpy3D_v2", True), ("cuMemcpy3DAsync_v2", True), ("cuMemcpyDtoA_v2", True),
                                        ("cuMemcpyAtoD_v2", True), ("cuMemcpyHtoAAsync_v2", True),
                                        ("cuMemcpyHtoDAsync_v2", False), ("cuMemcpyDtoDAsync_v2", False),
                                        ("cuMemcpyAsync", False), ("cuMemcpy2DAsync_v2", False), ("cuMemsetD8_v2", False)])
def test_copies_whose_addresses_are_not_known_wait_for_every_record(api, opaque):
    eng, ops, agent = setup()
    eng.access(api, 2, 0x1234, 0x5678)  # addresses outside every record
    assert len(ops.calls("copy_in")) == (4 if opaque else 0)


# -- lazy rollback: records that stay mapped and only need their write-back ---------------------


class PlainOps(FakeOps):
    """Plain allocations (memory not owned): the library knows none of them; a load may go
    into any mapped address."""

    def __init__(self, bases, auto=False):
        super().__init__([], auto=auto)
        self.device = {b: b"new%x" % b for b in bases}

    def lookup(self, addr):
        return None

    def make_resident(self, base):
        raise AssertionError("a lazy rollback never maps")

    def copy_in(self, base, pieces, stream):
        assert base in self.device, "a load into memory the program freed"
        self.device[base] = self.hostmem.get(pieces[0][0], b"")
        self.log.append(("copy_in", base, stream))


def rollback_setup(owned=True, auto=False):
    if owned:
        ops = FakeOps([Rec(b, 256 * MIB, resident=True) for b in BASES], auto=auto)
    else:
        ops = PlainOps(BASES, auto=auto)
    agent = FakeAgent({i + 1: b for i, b in enumerate(BASES)})
    eng = ResidencyEngine(agent, ops, owned=owned)
    for b in BASES:
        ops.hostmem[0x5000_0000 + b] = b"image%x" % b
        eng.adopt(b, 256 * MIB, [(0x5000_0000 + b, 256 * MIB)], mapped=True)
    return eng, ops, agent


@pytest.mark.parametrize("owned", [True, False])
def test_lazy_rollback_writes_back_what_a_launch_touches_first_without_mapping(owned):
    eng, ops, agent = rollback_setup(owned)
    agent.launches["k"] = (False, (3,), (3,))
    eng.launch(5, "k", None, None)
    assert not ops.calls("make_resident") and [c[1] for c in ops.calls("copy_in")] == [BASES[2]]
    ev = [c for c in ops.log if c[0] == "record"][0][1]
    assert ops.calls("wait") == [("wait", 5, ev)] and not ops.calls("synchronize")
    assert ops.device[BASES[2]] == b"image%x" % BASES[2] and eng.state(BASES[0]) == RELEASED
    # a synchronous copy out of a pending buffer: the legacy stream waits for its write-back
    eng.access("cuMemcpyDtoH_v2", 0, 0x7777, BASES[0] + 64)
    assert [c[1] for c in ops.calls("copy_in")] == [BASES[2], BASES[0]] and ops.calls("wait")[-1][1] == 0
    # an unknown launch and a graph launch: every buffer not yet back
    agent.launches["u"] = (True, (), ())
    eng.launch(6, "u", None, None)
    assert sorted(c[1] for c in ops.calls("copy_in")) == sorted(BASES)
    assert len([c for c in ops.calls("wait") if c[1] == 6]) == 4
    eng.graph(7)
    assert len([c for c in ops.calls("wait") if c[1] == 7]) == 4


@pytest.mark.parametrize("owned", [True, False])
def test_lazy_rollback_background_write_back_in_first_touch_order_gives_the_image(owned):
    eng, ops, agent = rollback_setup(owned, auto=True)
    eng.first_touch.update({4: None, 2: None})
    eng.load_rest(kind="rollback").join(10)
    assert [c[1] for c in ops.calls("copy_in")] == [BASES[3], BASES[1], BASES[0], BASES[2]]
    assert not ops.calls("make_resident") and eng.settled
    assert all(ops.device[b] == b"image%x" % b for b in BASES)
    lazy = eng.stats()["lazy"]
    assert lazy["kind"] == "rollback" and lazy["done"] and lazy["order_predicted"] == 2


def test_lazy_rollback_a_freed_buffer_is_forgotten_and_a_write_back_in_flight_completes_first():
    eng, ops, agent = rollback_setup(owned=False)
    eng.access("cuMemFree_v2", 0, BASES[1])  # not started: never written back
    del ops.device[BASES[1]]
    agent.launches["k"] = (False, (1,), ())
    eng.launch(3, "k", None, None)  # BASES[0] loading
    ev = [c for c in ops.log if c[0] == "record"][0][1]
    ops.finish(ev)
    eng.access("cuMemFreeAsync", 3, BASES[0])
    assert ("synchronize", ev) in ops.log and eng.state(BASES[0]) == RESIDENT
    del ops.device[BASES[0]]
    assert eng.counts["freed_while_pending"] == 2
    ops.auto = True
    eng.load_rest(kind="rollback").join(10)  # the rest; the freed ones are not touched (PlainOps asserts)
    assert sorted(c[1] for c in ops.calls("copy_in")) == [BASES[0], BASES[2], BASES[3]] and eng.settled


def test_an_engine_for_plain_allocations_neither_evicts_nor_maps():
    eng, ops, agent = rollback_setup(owned=False, auto=True)
    eng.load_rest(kind="rollback").join(10)
    assert not eng.evict(BASES[0]) and eng.prefetch(BASES[0]) is None
    eng.close()


def test_the_agent_refuses_snapshot_suspend_rollback_during_a_lazy_rollback():
    from gpuos_tools.errors import ExitCode, GpuosError

    a = Agent()
    eng = ResidencyEngine(a, PlainOps([BASES[0]]), owned=False)
    a.engine = eng
    eng.adopt(BASES[0], MIB, [(0x77, MIB)], mapped=True)
    for op in ("snapshot", "suspend", "rollback"):
        with pytest.raises(GpuosError) as e:
            a.handle({"op": op, "image": "/nope", "lazy": True})
        assert e.value.code == ExitCode.WRONG_STATE and "lazy resume or rollback" in str(e.value)


def test_the_evict_thread_makes_the_context_current_once_the_agent_knows_it():
    """An evict thread started before the program's context was known (serve's gate can evict
    before any operation's callback) enters it at its next eviction, not never."""
    eng, ops, agent = setup(auto=True)
    entered = []
    ops.enter = lambda: entered.append(getattr(agent, "ctx", None))
    agent.ctx = None
    for b in BASES[:2]:
        ops.recs[b].resident = True
        eng.pending.pop(b, None)
    def released(b: int) -> bool:
        deadline = time.time() + 5
        while eng.state(b) != "released" and time.time() < deadline:
            time.sleep(0.005)
        return eng.state(b) == "released"

    assert eng.evict_from_operation(BASES[0], own=0) and released(BASES[0])
    assert entered == [None]
    agent.ctx = "ctx"
    assert eng.evict_from_operation(BASES[1], own=0) and released(BASES[1])
    assert entered == [None, "ctx"], entered
    eng.close()


class CountingOps(FakeOps):
    """FakeOps that, at every call, checks what a reader of ``counts`` without the engine's lock
    would see then: every record released so far counted as an eviction, with its save."""

    engine: ResidencyEngine | None = None

    def __init__(self, records: list[Rec], auto: bool = False) -> None:
        super().__init__(records, auto)
        self.problems: list[str] = []  # kept, not raised: the evict thread would swallow an assertion

    def check(self, where: str) -> None:
        eng = self.engine
        if eng is None:
            return
        released = sum(1 for e in list(eng.pending.values()) if e.state == RELEASED)
        c = dict(eng.counts)
        if released > c["evictions"] or released > c["evict_saves"]:
            self.problems.append(f"at {where}: {released} records released, {c['evictions']} evictions and "
                                 f"{c['evict_saves']} saves counted")

    def release(self, base):
        self.check("release")
        super().release(base)

    def destroy(self, ev):
        self.check("destroy")

    def record(self, ev, stream):
        self.check("record")
        super().record(ev, stream)

    def synchronize(self, ev):
        self.check("synchronize")
        super().synchronize(ev)


def test_a_released_record_is_already_counted_with_its_save_when_its_state_says_so():
    """The evict thread counts an eviction and its save before the record's state says RELEASED,
    so ``state`` (no lock) and ``counts`` read together never disagree; every driver call the
    thread makes around the change checks it."""
    recs = [Rec(b, 64 * MIB) for b in BASES[:3]]
    ops = CountingOps(recs, auto=True)
    agent = FakeAgent({i + 1: b for i, b in enumerate(BASES[:3])})
    eng = ResidencyEngine(agent, ops)
    ops.engine = eng
    for b in BASES[:3]:
        assert eng.evict(b)
    deadline = time.monotonic() + 10
    while any(eng.state(b) != RELEASED for b in BASES[:3]) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert all(eng.state(b) == RELEASED for b in BASES[:3])
    assert ops.problems == []
    assert eng.counts["evictions"] == eng.counts["evict_saves"] == 3  # the lock-free read the bench made
    assert eng.stats()["saved_bytes"] == 3 * 64 * MIB and len(ops.calls("release")) == 3
    eng.close()


def test_no_eviction_starts_while_a_stream_of_the_program_captures_a_graph():
    """An event recorded on a capturing stream would be a node of the graph, and the evict
    stream's wait on it would invalidate the program's capture: the record stays resident, and
    the eviction goes ahead once the capture has ended."""
    recs = [Rec(BASES[0], 64 * MIB), Rec(BASES[1], 64 * MIB)]
    ops = FakeOps(recs, auto=True)
    capturing = {7}
    ops.capturing = lambda s: s in capturing
    agent = FakeAgent({1: BASES[0], 2: BASES[1]})
    eng = ResidencyEngine(agent, ops)
    assert not eng.evict_from_operation(BASES[0], own=0)
    assert eng.evict(BASES[1])  # handed to the evict thread, which finds the capture
    deadline = time.time() + 5
    while eng.counts.get("evict_capturing", 0) < 2 and time.time() < deadline:
        time.sleep(0.005)
    assert eng.counts["evict_capturing"] == 2
    assert not ops.calls("copy_out") and not any(c[0] == "record" and c[2] == 7 for c in ops.log)
    assert eng.state(BASES[0]) == eng.state(BASES[1]) == "resident"
    capturing.clear()
    assert eng.evict_from_operation(BASES[0], own=0)
    while eng.state(BASES[0]) != RELEASED and time.time() < deadline:
        time.sleep(0.005)
    assert eng.state(BASES[0]) == RELEASED
    eng.close()


def _released_sum(eng) -> int:
    with eng.lock:
        return sum(e.size for e in eng.pending.values() if e.state == RELEASED)


def test_released_bytes_follow_every_change_of_state():
    """The engine's count of released bytes (read by the scheduler after every decision) equals
    the sum over its pending records through adoption, prefetch, demand load, eviction, a
    cancelled eviction and a free."""
    eng, ops, agent = setup()
    assert eng.released_bytes == _released_sum(eng) == 4 * 256 * MIB  # adopted: released
    ev = eng.prefetch(BASES[0])
    assert eng.state(BASES[0]) == LOADING and eng.released_bytes == _released_sum(eng) == 3 * 256 * MIB
    ops.finish(ev)
    agent.launches["k"] = (False, (2,), ())
    eng.launch(1, "k", None, None)  # a demand load of the second
    assert eng.released_bytes == _released_sum(eng) == 2 * 256 * MIB
    ops.auto = True
    ops.finish(*range(ops._n + 1))
    eng.require(None, 0)  # an unknown launch: everything loaded, then done
    ops.finish(*range(ops._n + 1))
    eng.require(None, 0)
    assert all(eng.state(b) == RESIDENT for b in BASES) and eng.released_bytes == _released_sum(eng) == 0
    for b in (BASES[0], BASES[2]):
        assert eng.evict(b)
        for _ in range(200):
            if eng.state(b) == RELEASED:
                break
            threading.Event().wait(0.01)
    assert eng.state(BASES[2]) == RELEASED and eng.released_bytes == _released_sum(eng) == 2 * 256 * MIB
    eng.access("cuMemUnmap", 0, BASES[2])  # freed while released
    assert eng.released_bytes == _released_sum(eng) == 256 * MIB
    ops.auto = False
    eng.clean.discard(BASES[1])  # written since its load: the eviction saves it
    saves = len(ops.calls("copy_out"))
    assert eng.evict(BASES[1])
    for _ in range(200):
        if eng.state(BASES[1]) == EVICTING and len(ops.calls("copy_out")) > saves:
            break
        threading.Event().wait(0.01)
    assert eng.released_bytes == _released_sum(eng) == 256 * MIB  # evicting counts as mapped
    eng.access("cuMemcpyHtoDAsync_v2", 0, BASES[1], 0x42)  # cancelled: it stays
    ops.auto = True
    ops.finish(*range(ops._n + 1))
    eng.close()
    assert eng.state(BASES[1]) == RESIDENT and eng.released_bytes == _released_sum(eng) == 256 * MIB
