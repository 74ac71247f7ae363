"""The online executor (gpuos_tools/sched/executor.py) driving the real residency engine
(gpuos_tools/memory/engine.py) on the engine tests' fake driver: a stencil loop's launches, each
checked to find its records mapped when it is issued, the mapped bytes within the budget, and
every array's contents surviving the evictions and loads. No GPU."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from test_engine import FakeAgent, FakeOps, Rec

from gpuos_tools.memory.engine import ResidencyEngine
from gpuos_tools.memory.settings import EngineSettings
from gpuos_tools.sched.executor import Executor

MIB = 1 << 20


@dataclass
class TableRec:
    base: int
    size: int


class FakeLib:
    """The owned library's table and counts, as the executor reads them."""

    def __init__(self, recs: list[Rec]) -> None:
        self.recs = recs

    def stats(self) -> dict[str, int]:
        return {"mallocs": len(self.recs), "frees": 0, "reserved_bytes": sum(r.size for r in self.recs)}

    def table(self) -> list[TableRec]:
        return [TableRec(r.base, r.size) for r in self.recs]


class TimedOps(FakeOps):
    """The fake driver with timer events whose interval is always ``ms``."""

    ms = 4.0

    def elapsed_ms(self, start, end):
        return self.ms


def setup(n: int, budget: int, policy: str = "belady", lookahead: int = 2, **cfg):
    bases = [0x1000_0000 * (i + 1) for i in range(n)]
    recs = [Rec(b, 64 * MIB) for b in bases]
    ops = TimedOps(recs, auto=True)  # every copy completes at once
    agent = FakeAgent({i + 1: b for i, b in enumerate(bases)})
    agent.streams = {0}
    eng = ResidencyEngine(agent, ops)
    ex = Executor(eng, {"budget": budget, "policy": policy, "lookahead": lookahead, "prepin": False, **cfg},
                  lib=FakeLib(recs))
    return bases, ops, eng, ex


def mapped(ops: FakeOps) -> int:
    return sum(r.size for r in ops.recs.values() if r.resident)


def settle(eng: ResidencyEngine, ex: Executor) -> None:
    """Let the evict and mover threads catch up (the fake's copies complete at once)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        busy = any(e.state == "evicting" for e in eng.pending.values()) or not ex._moves.empty()
        if not busy:
            time.sleep(0.01)
            return
        time.sleep(0.002)


@pytest.mark.parametrize("policy,plan", [("belady", "count"), ("lru", "count"), ("belady", "time")])
@pytest.mark.parametrize("frac", [2 / 3, 1 / 2])
def test_stencil_under_budget_keeps_data_and_memory_in_bounds(policy, plan, frac):
    n = 9
    budget = int(n * 64 * MIB * frac)
    bases, ops, eng, ex = setup(n, budget, policy, plan=plan, bw=[40e9, 40e9])
    expect = {b: ops.device[b] for b in bases}
    peak, under = 0, False
    for s in range(8 * n):
        ws = [bases[(s + k) % n] for k in range(4)]
        out = ws[-1]
        ex.before("stencil", ws, stream=0)
        # then the agent's own hook, as it calls it after the executor's: the engine learns the write
        ids = tuple(bases.index(b) + 1 for b in ws)
        eng.agent.launches["stencil"] = (False, ids, ids[-1:])
        eng.launch(0, "stencil", None, None)
        # the launch is issued now: each of its records mapped, its contents the latest
        for b in ws:
            assert ops.recs[b].resident, f"step {s}: {b:#x} not mapped at its launch"
            assert ops.device[b] == expect[b], f"step {s}: {b:#x} lost its contents"
        ops.device[out] = expect[out] = b"step%d" % s  # the kernel writes its output
        settle(eng, ex)
        # the program allocated everything before its first launch (over the budget); once
        # the evictions brought the mapped memory under the budget, it stays there
        if under or mapped(ops) <= budget:
            under = True
            peak = max(peak, mapped(ops))
    ex.close()
    eng.close()
    assert under and peak <= budget, (peak, budget)
    st = ex.summary()
    assert st["over_budget"] == 0 and st["evictions"] > 0 and st["loads"] > 0
    assert st["plan"] == plan
    if plan == "time":  # one operation in 31 timed: the policy has their durations
        assert st["executor"]["samples"] >= 8 * n // 31 - 1 > 0 and st["executor"]["sample_errors"] == 0
        assert ex.policy.duration(ex.policy.last_key) == pytest.approx(4e-3)
        assert ex.policy.h2d_bw == 40e9
    elif policy == "belady":
        assert st["periods"] and st["periods"][0] == n
        # at 2/3 there is room for the next launch's array beside the current four; at 1/2 none
        assert (st["prefetches"] > 0) == (frac > 0.6)
    else:
        assert st["executor"]["samples"] == 0
    for b in bases:  # every array: on the device, or in the engine's host copy
        held = ops.device[b] if ops.recs[b].resident else ops.hostmem[ops.host(b, 64 * MIB)[0][0]]
        assert held == expect[b]


def test_the_writes_are_saved_and_clean_records_are_dropped_without_a_copy():
    n = 6
    bases, ops, eng, ex = setup(n, 4 * 64 * MIB)
    agent = eng.agent
    # a read-only record (allocation 1) and written ones: the engine learns writes from launches
    for s in range(6 * n):
        ws = [bases[(s + k) % n] for k in range(2)]
        ex.before("k", ws, stream=0)
        ids = tuple(bases.index(b) + 1 for b in ws)
        agent.launches["k"] = (False, ids, ids[-1:])
        eng.launch(0, "k", None, None)
        ops.device[ws[-1]] = b"s%d" % s
        settle(eng, ex)
    ex.close()
    eng.close()
    saves = len(ops.calls("copy_out"))
    st = eng.stats()
    assert st["evictions"] > 0 and st["evict_saves"] == saves
    assert st["saved_bytes"] == saves * 64 * MIB


def test_an_unknown_operation_requires_everything_and_is_over_budget():
    bases, ops, eng, ex = setup(4, 2 * 64 * MIB)
    ex.before("k", [bases[0]], stream=0)
    settle(eng, ex)
    ex.before("mystery", None, stream=0)
    assert all(ops.recs[b].resident for b in bases)
    assert ex.summary()["over_budget"] == 1 and ex.policy.stats.unknown == 1
    ex.close()
    eng.close()


def test_evict_from_operation_orders_the_save_after_the_program_streams():
    bases, ops, eng, ex = setup(2, 10 * 64 * MIB)
    eng.agent.streams = {0, 7}
    assert eng.evict_from_operation(bases[0])
    settle(eng, ex)
    log = ops.log
    save = next(i for i, c in enumerate(log) if c[0] == "copy_out")
    side = log[save][2]
    recorded = {c[1]: c[2] for c in log[:save] if c[0] == "record"}
    waited = {c[2] for c in log[:save] if c[0] == "wait" and c[1] == side}
    assert {recorded[e] for e in waited} == {0, 7}  # the evict stream waited for both
    assert not ops.recs[bases[0]].resident and eng.state(bases[0]) == "released"
    assert not eng.evict_from_operation(bases[0])  # released already
    eng.close()


def test_evict_from_operation_waits_for_another_threads_operation_to_reach_the_driver():
    """Another thread of the program past its enter callback may launch on the record: the
    eviction waits until that operation is enqueued (its exit), and is refused (the record stays
    resident) if it does not get there in time; the caller's own operation is not waited for."""
    import threading

    bases, ops, eng, ex = setup(2, 10 * 64 * MIB)
    agent = eng.agent
    agent.issue_begin()  # the caller's own operation, at its enter callback
    agent.issue_begin()  # another thread's, not yet enqueued
    assert not eng.evict_from_operation(bases[0])  # it never reaches the driver: refused
    assert ops.recs[bases[0]].resident and eng.state(bases[0]) == "resident"
    assert eng.counts["evict_unsettled"] == 1 and not any(c[0] == "copy_out" for c in ops.log)
    threading.Timer(0.01, agent.issue_end).start()  # now it reaches the driver shortly
    assert eng.evict_from_operation(bases[0])
    settle(eng, ex)
    assert not ops.recs[bases[0]].resident and eng.counts["evict_unsettled"] == 1
    agent.issue_end()
    eng.close()


def attached(monkeypatch, cfg: dict, recs: list[Rec], ops: FakeOps):
    """A plain agent with the executor attached as the in-process start-up does (``attach``),
    its engine started on the fake driver: (agent, the executor made at the engine's start)."""
    from gpuos_tools.agent import agent as agent_mod
    from gpuos_tools.agent.agent import Agent
    from gpuos_tools.sched import executor as executor_mod

    monkeypatch.setattr(agent_mod, "ResidencyEngine", lambda agent: ResidencyEngine(agent, ops))
    monkeypatch.setattr(executor_mod, "_current", None)
    ops.lib = FakeLib(recs)  # the owned library the executor reads (engine.ops.lib)
    agent = Agent()
    agent.ctx = object()  # as if the program's context were known (no driver here)
    for r in recs:
        agent.on_alloc(r.base, r.size, "vmm")
    executor_mod.attach(agent, cfg)
    assert agent.skip_captured and agent.gate is None and not agent.hooks_see_every_operation
    agent.start_engine()
    ex = executor_mod.current_counts() and executor_mod._current
    assert isinstance(ex, Executor) and ex.engine is agent.engine and ex.why is agent.unknown_why
    assert agent.hooks_see_every_operation and agent.gate is None  # not serving: no gate
    return agent, ex


def test_the_executor_acts_before_the_engine_hook_and_writes_its_summary(tmp_path, monkeypatch):
    """The executor's hooks on the agent: allocation ids from the predictor -> records -> the
    executor, then the agent's own hook; copies count as operations; the summary file at the end."""
    import json

    n = 6
    bases = [0x1000_0000 * (i + 1) for i in range(n)]
    recs = [Rec(b, 64 * MIB) for b in bases]
    ops = FakeOps(recs, auto=True)
    summary = tmp_path / "summary.json"
    cfg = {"budget": 3 * 64 * MIB, "policy": "belady", "lookahead": 1, "summary": str(summary), "prepin": False}
    agent, ex = attached(monkeypatch, cfg, recs, ops)
    ids = {b: i for i, b in ((a.id, a.addr) for a in agent.by_id.values())}
    launches = {}
    agent.launch_touches = lambda kernel, sizes, args: launches[kernel]
    for s in range(5 * n):
        ws = [bases[(s + k) % n] for k in range(2)]
        launches["k"] = (False, tuple(ids[b] for b in ws), (ids[ws[-1]],))
        agent.before_launch("cuLaunchKernel", 0, "k", None, None)
        assert all(ops.recs[b].resident for b in ws), s
        ops.device[ws[-1]] = b"s%d" % s
        settle(agent.engine, ex)
    assert agent.ops == 5 * n and agent.hook_calls == 5 * n  # the agent's own part ran each time
    agent.before_write("cuMemcpyDtoH_v2", 0x7000, 0, bases[0] + 64)  # a copy out of an owned record
    assert ops.recs[bases[0]].resident
    agent.before_write("cuMemFree_v2", bases[1], 0)  # a free: no decision, the agent counts it
    assert agent.ops == 5 * n + 2
    agent.stop_background()
    out = json.loads(summary.read_text())
    assert out["launches"] == 5 * n + 1 and out["evictions"] > 0 and out["periods"][0] == n
    assert out["policy"] == "belady" and out["budget"] == 3 * 64 * MIB


class AsyncOps(FakeOps):
    """Copies and events that complete on their own, 0.2-2 ms after they are recorded, as on
    a GPU: the evict thread, the mover and the program's thread race for real."""

    def __init__(self, records, seed: int) -> None:
        super().__init__(records)
        import random

        self.rnd = random.Random(seed)

    def record(self, ev, stream):
        import threading

        self.log.append(("record", ev, stream))
        delay = self.rnd.uniform(0.0002, 0.002)

        def finish() -> None:
            time.sleep(delay)
            self.finish(ev)

        threading.Thread(target=finish, daemon=True).start()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("frac", "lookahead"), [(2 / 3, 2), (2 / 3, 1), (1 / 2, 2)])
def test_with_copies_completing_on_their_own_nothing_stalls_for_good(monkeypatch, seed, frac, lookahead):
    """The mover, the evict thread and the program's thread, with completions arriving late:
    every launch finds its records mapped, the room always comes (no wait runs into the
    timeout: memory the policy's books do not count but is still mapped would make one), and
    the mapped bytes stay within the budget once under it."""
    import gpuos_tools.sched.executor as executor_mod

    monkeypatch.setattr(executor_mod, "ROOM_TIMEOUT_S", 2.0)
    n = 12
    bases = [0x1000_0000 * (i + 1) for i in range(n)]
    recs = [Rec(b, 64 * MIB) for b in bases]
    ops = AsyncOps(recs, seed)
    agent = FakeAgent({i + 1: b for i, b in enumerate(bases)})
    agent.streams = {0}
    eng = ResidencyEngine(agent, ops)
    budget = int(n * 64 * MIB * frac)
    ex = Executor(eng, {"budget": budget, "lookahead": lookahead, "prepin": False}, lib=FakeLib(recs))
    for s in range(10 * n):
        ws = [bases[(s + k) % n] for k in range(4)]
        with agent.lock:
            ex.before("k", ws, 0)
            ids = tuple(bases.index(b) + 1 for b in ws)
            agent.launches["k"] = (False, ids, ids[-1:])
            eng.launch(0, "k", None, None)
        assert all(ops.recs[b].resident for b in ws), s
    ex.close()
    eng.close()
    st = ex.summary()
    assert st["executor"]["room_timeouts"] == 0 and st["over_physical"] == 0, st["executor"]
    assert st["executor"]["settled"] == 1 and st["peak_settled"] <= budget
    assert st["evictions"] > 0 and st["engine"].get("evict_errors", 0) == 0


@pytest.mark.parametrize("seed", range(8))
def test_random_jobs_with_unknown_launches_keep_every_rule(monkeypatch, seed):
    """Random record sizes, budgets, policies, lookaheads and an occasional unknown launch, on
    the asynchronous fake: every launch runs mapped, no room wait runs out, and the budget holds
    whenever no over-budget launch is being served."""
    import random

    import gpuos_tools.sched.executor as executor_mod

    monkeypatch.setattr(executor_mod, "ROOM_TIMEOUT_S", 2.0)
    rnd = random.Random(seed)
    n = rnd.choice([6, 9, 12])
    sizes = [rnd.choice([32, 64, 96]) * MIB for _ in range(n)]
    bases = [0x1000_0000 * (i + 1) for i in range(n)]
    recs = [Rec(b, sz) for b, sz in zip(bases, sizes)]
    ops = AsyncOps(recs, seed)
    agent = FakeAgent({i + 1: b for i, b in enumerate(bases)})
    agent.streams = {0}
    eng = ResidencyEngine(agent, ops)
    budget = int(sum(sizes) * rnd.choice([0.5, 0.66, 0.8]))
    ex = Executor(eng, {"budget": budget, "lookahead": rnd.choice([0, 1, 2, 3]),
                        "policy": rnd.choice(["belady", "lru"]), "prepin": False}, lib=FakeLib(recs))
    reads = rnd.choice([1, 2, 3])
    for s in range(8 * n):
        ws = None if rnd.random() < 0.02 else [bases[(s + k) % n] for k in range(reads + 1)]
        with agent.lock:
            ex.before("k", ws, 0)
            if ws is None:
                agent.launches["k"] = (True, (), ())
            else:
                ids = tuple(bases.index(b) + 1 for b in ws)
                agent.launches["k"] = (False, ids, ids[-1:])
            eng.launch(0, "k", None, None)
        assert all(ops.recs[b].resident for b in (bases if ws is None else ws)), s
    ex.close()
    eng.close()
    st = ex.summary()
    assert st["executor"]["room_timeouts"] == 0 and st["over_physical"] == 0, st["executor"]
    assert st["engine"].get("evict_errors", 0) == 0, st["engine"]


def test_host_copies_are_pinned_ahead_once_the_programs_context_is_known():
    bases = [0x1000_0000 * (i + 1) for i in range(4)]
    recs = [Rec(b, 64 * MIB) for b in bases]
    ops = FakeOps(recs, auto=True)
    agent = FakeAgent({i + 1: b for i, b in enumerate(bases)})
    eng = ResidencyEngine(agent, ops)
    ex = Executor(eng, {"budget": 1 << 40}, lib=FakeLib(recs))
    ex.before("k", [bases[0]], 0)  # no context yet (the program has not made one current)
    assert ex.counts["pins"] == 0 and ex._unpinned
    agent.ctx = object()
    ex.before("k", [bases[0]], 0)
    settle(eng, ex)
    ex.close()
    assert ex.counts["pins"] == 4 and ex.counts["pin_errors"] == 0 and not ex._unpinned
    eng.close()


def test_nothing_is_pinned_ahead_under_a_budget_of_everything():
    """At 100% of the owned bytes nothing is ever evicted: pinning (which holds the driver's
    lock against the program's launches) would be for nothing. Below it, records are pinned."""
    bases = [0x1000_0000 * (i + 1) for i in range(4)]
    for fraction, pins in ((1.0, 0), (1.5, 0), (0.66, 4)):
        recs = [Rec(b, 64 * MIB) for b in bases]
        ops = FakeOps(recs, auto=True)
        agent = FakeAgent({i + 1: b for i, b in enumerate(bases)})
        agent.ctx = object()
        eng = ResidencyEngine(agent, ops)
        ex = Executor(eng, {"fraction": fraction}, lib=FakeLib(recs))
        ex.before("k", [bases[0]], 0)
        settle(eng, ex)
        ex.close()
        eng.close()
        assert ex.counts["pins"] == pins, (fraction, ex.counts)


def test_the_timeline_logs_every_move_and_the_plot_draws_it(tmp_path, monkeypatch):
    """The bounded event log (executor's Timeline): as many evictions as the engine made, the
    bytes of loads and prefetches adding up to the engine's loaded bytes, mapped bytes
    measured at each decision; written at the program's end (the executor's at_exit hook) and
    drawn by `gpu-prefetch-sched plot` when matplotlib is there."""
    import subprocess
    import sys

    from helpers import REPO, child_env

    from gpuos_tools.sched.plot import load_timeline, series

    n = 9
    bases = [0x1000_0000 * (i + 1) for i in range(n)]
    recs = [Rec(b, 64 * MIB) for b in bases]
    ops = FakeOps(recs, auto=True)
    path = tmp_path / "timeline.json"
    budget = 6 * 64 * MIB
    agent, ex = attached(monkeypatch, {"budget": budget, "policy": "belady", "lookahead": 2, "timeline": str(path),
                                       "prepin": False}, recs, ops)
    ids = {b: i for i, b in ((a.id, a.addr) for a in agent.by_id.values())}
    launches = {}
    agent.launch_touches = lambda kernel, sizes, args: launches[kernel]
    for s in range(6 * n):
        ws = [bases[(s + k) % n] for k in range(4)]
        launches["k"] = (False, tuple(ids[b] for b in ws), (ids[ws[-1]],))
        agent.before_launch("cuLaunchKernel", 0, "k", None, None)
        ops.device[ws[-1]] = b"s%d" % s
        settle(agent.engine, ex)
    agent.stop_background()
    data = load_timeline(path)
    st = agent.engine.stats()
    s = series(data)
    assert data["dropped"] == 0 and data["footprint"] == n * 64 * MIB
    assert len(s["evict"]) == st["evictions"] > 0
    assert all(b == 64 * MIB for _, b in s["evict"])
    moved_in = sum(b for _, b in s["load"]) + sum(b for _, b in s["prefetch"])
    assert moved_in == st["loaded_bytes"] > 0
    assert len(s["mapped"]) >= 6 * n and s["budget"] and s["budget"][0][1] == budget
    times = [e[0] for e in data["events"]]
    assert all(t >= 0 for t in times) and s["end"] >= max(times)
    assert data["summary"]["evictions"] == st["evictions"]

    # bounded: past timeline_max events, counted, not kept
    small = Executor(ResidencyEngine(agent, FakeOps(recs, auto=True)), {"budget": budget, "timeline": "x",
                                                                       "timeline_max": 3, "prepin": False},
                     lib=FakeLib(recs))
    for _ in range(5):
        small._event("mapped", 1)
    assert len(small.timeline()["events"]) == 3 and small.timeline()["dropped"] == 2

    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    p = subprocess.run([sys.executable, str(REPO / "cmd" / "gpu-prefetch-sched"), "plot", str(path), "--plot", str(png)],
                       env=child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"{len(data['events'])} events" in p.stderr


def test_plot_refuses_what_is_not_a_timeline(tmp_path):
    import subprocess
    import sys

    from helpers import REPO, child_env

    from gpuos_tools.errors import ExitCode

    bad = tmp_path / "x.json"
    bad.write_text('{"type": "sched_summary"}')
    p = subprocess.run([sys.executable, str(REPO / "cmd" / "gpu-prefetch-sched"), "plot", str(bad), "--plot",
                        str(tmp_path / "x.png")], env=child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == ExitCode.BAD_INPUT and "not a sched_timeline" in p.stderr


def test_the_kernel_profile_counts_unknown_launches_and_predicted_bytes():
    """What `run` says about the predictions per kernel (the summary's `kernels`), and the
    counts a program reads around its timed loop (current_counts)."""
    from gpuos_tools.sched import executor as mod

    bases, ops, eng, ex = setup(4, 4 * 64 * MIB)
    ex.why = {"mystery": "a pointer in no traced allocation"}
    for _ in range(3):
        ex.before("k", [bases[0], bases[0] + 8, bases[1]], stream=0)
    ex.before("mystery", None, stream=0)
    ex.before("scalar", [0x42], stream=0)  # no owned record touched
    prof = ex.summary()["kernels"]
    assert prof["operations"] == 5 and prof["unknown"] == 1 and prof["names"] == 3 and prof["no_owned"] == 1
    rows = {r["kernel"]: r for r in prof["top"]}
    assert rows["k"]["ops"] == 3 and rows["k"]["mean_bytes"] == 2 * 64 * MIB and "why" not in rows["k"]
    assert rows["mystery"]["why"] == "a pointer in no traced allocation" and rows["mystery"]["mean_bytes"] is None
    assert mod.current_counts() is None or mod._current is not ex  # only the executor attach made is current
    mod._current = ex
    try:
        c = mod.current_counts()
        assert c["launches"] == 5 and c["unknown"] == 1 and c["bytes_in"] == eng.counts["loaded_bytes"]
    finally:
        mod._current = None
    ex.close()
    eng.close()


class ParkingLib(FakeLib):
    """FakeLib with the owned library's parked physical memory: a release parks the record's
    memory up to the limit, a make-resident maps parked memory of its size again, else creates."""

    def __init__(self, recs: list[Rec]) -> None:
        super().__init__(recs)
        self.limit, self.pool, self.reuses, self.creates, self.trims = 0, [], 0, 0, 0

    def set_park_limit(self, n: int) -> int:
        self.limit = n
        return self.trim_parked(n)

    def trim_parked(self, keep: int = 0) -> int:
        while self.pool and sum(self.pool) > keep:
            self.pool.pop(0)
            self.trims += 1
        return sum(self.pool)

    def parked(self, size: int, device: int = 0) -> int:
        return size * self.pool.count(size)

    def park_stats(self) -> dict[str, int]:
        return {"parked_bytes": sum(self.pool), "park_limit": self.limit, "park_reuses": self.reuses}

    def parked_bytes(self) -> int:
        return sum(self.pool)


class ParkingOps(FakeOps):
    def __init__(self, recs: list[Rec], lib: ParkingLib) -> None:
        super().__init__(recs, auto=True)
        self.lib = lib
        self.peak = 0  #: mapped + parked, the physical memory held, once under the budget

    def release(self, base):
        super().release(base)
        size = self.recs[base].size
        if sum(self.lib.pool) + size <= self.lib.limit:
            self.lib.pool.append(size)

    def make_resident(self, base):
        super().make_resident(base)
        size = self.recs[base].size
        if size in self.lib.pool:
            self.lib.pool.remove(size)
            self.lib.reuses += 1
        else:
            self.lib.creates += 1

    def held(self) -> int:
        return mapped(self) + sum(self.lib.pool)


def test_a_shortfall_sends_back_only_what_the_room_lacks_of_the_parked_memory():
    """Parked memory counts against the budget; when a load is short of room by part of it, that
    part goes back to the driver (the oldest first), not all of it: on a job of many record
    sizes most loads would otherwise create memory anew."""
    bases = [0x1000_0000 * (i + 1) for i in range(3)]
    recs = [Rec(b, 64 * MIB) for b in bases]
    lib = ParkingLib(recs)
    ops = ParkingOps(recs, lib)
    agent = FakeAgent({i + 1: b for i, b in enumerate(bases)})
    agent.streams = {0}
    eng = ResidencyEngine(agent, ops)
    ex = Executor(eng, {"budget": 1 << 40, "policy": "belady", "lookahead": 2, "prepin": False}, lib=lib)
    lib.pool = [32 * MIB, 64 * MIB, 96 * MIB]  # parked, the oldest first
    ex.physical = lambda: 808 * MIB + sum(lib.pool)  # mapped + parked
    assert ex._fits([], 64 * MIB, 1032 * MIB)  # short by 32 MiB of the 192 parked
    assert lib.pool == [64 * MIB, 96 * MIB] and ex.counts["park_trims"] == 1
    assert not ex._fits([], 64 * MIB, 700 * MIB)  # short by more than is parked: all goes, still short
    assert lib.pool == []
    ex.close()
    eng.close()


@pytest.mark.parametrize("sizes", [[64], [64, 32, 96]], ids=["one-size", "mixed"])
def test_parked_memory_counts_against_the_budget_and_is_mapped_again(sizes, monkeypatch):
    n = 9
    bases = [0x1000_0000 * (i + 1) for i in range(n)]
    recs = [Rec(b, sizes[i % len(sizes)] * MIB) for i, b in enumerate(bases)]
    lib = ParkingLib(recs)
    ops = ParkingOps(recs, lib)
    agent = FakeAgent({i + 1: b for i, b in enumerate(bases)})
    agent.streams = {0}
    eng = ResidencyEngine(agent, ops)
    budget = sum(r.size for r in recs) * 2 // 3
    ex = Executor(eng, {"budget": budget, "policy": "belady", "lookahead": 2, "prepin": False}, lib=lib)
    assert lib.limit > 0  # `run` parks
    expect = {b: ops.device[b] for b in bases}
    peak, under = 0, False
    for s in range(8 * n):
        ws = [bases[(s + k) % n] for k in range(4)]
        ex.before("stencil", ws, stream=0)
        ids = tuple(bases.index(b) + 1 for b in ws)
        eng.agent.launches["stencil"] = (False, ids, ids[-1:])
        eng.launch(0, "stencil", None, None)
        for b in ws:
            assert ops.recs[b].resident and ops.device[b] == expect[b], (s, hex(b))
        ops.device[ws[-1]] = expect[ws[-1]] = b"step%d" % s
        settle(eng, ex)
        if under or ops.held() <= budget:  # mapped + parked: the physical memory held
            under = True
            peak = max(peak, ops.held())
    st = ex.summary()
    ex.close()
    eng.close()
    assert under and peak <= budget, (peak / MIB, budget / MIB)
    assert st["over_budget"] == 0 and st["evictions"] > 0 and st["park"]["park_reuses"] == lib.reuses
    assert lib.reuses > 0  # loads mapped parked memory instead of creating it
    if len(sizes) > 1:  # a load whose size is not parked: the parked memory went back first
        assert st["executor"]["park_trims"] > 0 and lib.trims > 0
    else:  # every load mapped parked memory; at most the program's first over-budget memory went back
        assert lib.creates == 0 and st["executor"]["park_trims"] <= 1


def test_parking_is_off_under_the_switch():
    recs = [Rec(0x1000_0000, 64 * MIB)]
    lib = ParkingLib(recs)
    # GPUOS_ENGINE_NO_PARK=1, as the launcher puts it into the boot config
    settings = EngineSettings.from_environment({"GPUOS_ENGINE_NO_PARK": "1"})
    eng = ResidencyEngine(FakeAgent({1: recs[0].base}), ParkingOps(recs, lib), settings=settings)
    ex = Executor(eng, {"budget": 64 * MIB, "prepin": False}, lib=lib)
    assert lib.limit == 0 and "park" not in ex.summary()
    ex.close()
    eng.close()



def _save_waits_on(ops: FakeOps, base: int):
    """The event the last eviction's save of ``base`` waited on (the wait just before its copy
    out) and the log's index of that event's last record before the wait."""
    log = ops.log
    i = max(k for k, e in enumerate(log) if e[0] == "copy_out" and e[1] == base)
    ev = [e for e in log[:i] if e[0] == "wait" and e[1] == log[i][2]][-1][2]
    return ev, max(k for k, e in enumerate(log[:i]) if e[0] == "record" and e[1] == ev)


def _three_then_a_fourth(**cfg):
    """Four records, room for three; operations touch the first three in turn, then the fourth:
    with no period yet the victim is the least recently used, the first (last used by operation
    0). The program allocated all four before its first launch, so the first operations evict
    to get under the budget; the last operation's eviction is the one looked at."""
    bases, ops, eng, ex = setup(4, 3 * 64 * MIB, "lru", lookahead=0, **cfg)
    for b in bases[:3]:
        ex.before("k", [b], stream=0)
    marks, issued = {st: list(m[1]) for st, m in ex._marks.items()}, len(ops.log)
    ex.before("k", [bases[3]], stream=0)
    settle(eng, ex)
    ex.close()
    eng.close()
    return bases, ops, ex, marks, issued


@pytest.mark.parametrize("last_use", [True, False])
def test_an_evictions_save_waits_for_its_records_last_use_not_for_everything(last_use):
    """With last-use marks the save of the first record waits on the mark recorded before
    operation 1 -- the GPU has passed the record there -- not on an event recorded at the
    eviction, after everything the program has enqueued since."""
    bases, ops, ex, marks, issued = _three_then_a_fourth(last_use=last_use)
    marks = marks.get(0, [])
    waited, at = _save_waits_on(ops, bases[0])
    if last_use:
        assert len(marks) == 3 and waited is marks[1] and at < issued
        assert ex.counts["last_use_saves"] >= 1 and ex.counts["marks"] == 4
    else:
        assert marks == [] and at >= issued  # recorded at the eviction, behind everything enqueued
        assert ex.counts["marks"] == 0 and ex.counts["last_use_saves"] == 0


def _first_on(streams: list, other: int | None = None, program_streams=None):
    """Four records, room for three: operations touch the first three, the first on each of
    ``streams`` in turn, the others on ``other`` (default: the first record's last stream); then
    the fourth, whose decision evicts the first. (ops, the first record, the log's length before
    the eviction, the marks by stream, the executor)."""
    bases, ops, eng, ex = setup(4, 3 * 64 * MIB, "lru", lookahead=0)
    if program_streams is not None:
        eng.agent.streams = program_streams
    for s in streams:
        ex.before("k", [bases[0]], stream=s)
    other = streams[-1] if other is None else other
    for b in bases[1:3]:
        ex.before("k", [b], stream=other)
    marks = {s: list(m[1]) for s, m in ex._marks.items()}
    issued = len(ops.log)
    ex.before("k", [bases[3]], stream=other)
    settle(eng, ex)
    ex.close()
    eng.close()
    return ops, bases[0], issued, marks, ex


def test_a_record_used_on_one_stream_waits_for_the_mark_on_that_stream_whatever_the_others():
    """The program has a second stream, and the first record's operations all came on stream 7:
    its save waits on the mark recorded on stream 7 after its last use (the operation after it
    there), not for everything enqueued; the operations of stream 0 do not touch it."""
    ops, first, issued, marks, ex = _first_on([7, 7], other=7, program_streams={0, 7})
    waited, at = _save_waits_on(ops, first)
    assert waited is marks[7][2] and at < issued and ex.counts["last_use_saves"] >= 1
    ops, first, issued, marks, ex = _first_on([0], other=0, program_streams={0, 7})  # and on stream 0
    assert _save_waits_on(ops, first)[0] is marks[0][1] and ex.counts["last_use_saves"] >= 1


@pytest.mark.parametrize("streams", [[0, 7], [2]], ids=["two streams", "per-thread default"])
def test_a_record_used_on_two_streams_waits_for_everything(streams):
    """A mark orders one stream: a record whose operations came on two streams since its load
    (or on the per-thread default stream, one stream per thread of the program) is saved after
    everything the program has enqueued."""
    ops, first, issued, _, ex = _first_on(streams, other=0, program_streams={0, 2, 7})
    assert _save_waits_on(ops, first)[1] >= issued
    assert ex.counts["last_use_mixed"] >= 1


def test_last_use_marks_are_recycled_beyond_their_bound():
    """The marks list stays bounded: older events are recorded again, and a record whose last use
    is older than every kept mark waits on the oldest kept one (the GPU has passed that too)."""
    from gpuos_tools.sched import executor as mod

    bases, ops, eng, ex = setup(2, 2 * 64 * MIB, "lru", lookahead=0)
    for _ in range(3 * mod.MARKS):
        ex.before("k", [bases[0]], stream=0)
    assert ex.counts["marks"] == 3 * mod.MARKS
    seqs, evs = ex._marks[0]
    assert len(seqs) <= 2 * mod.MARKS and seqs == sorted(seqs) and list(ex._marks) == [0]
    recorded = {e[1] for e in ops.log if e[0] == "record" and e[2] == 0}
    assert len(recorded) <= 2 * mod.MARKS + 2  # events reused, not made per operation
    assert ex._after_last_use(bases[1]) is evs[0]
    ex.close()
    eng.close()


def test_a_freed_records_uses_are_forgotten():
    """A record freed leaves no last use, no stream of its uses and no stream from before its
    eviction behind: a new record at its address starts with none (the mover would otherwise
    order a stranger's stream after its load)."""
    bases, ops, eng, ex = setup(3, 10 * 64 * MIB)
    ex.records()
    b, keep = bases[1], bases[0]
    ex._used_at[b], ex._used_on[b], ex._stream_before[b] = 7, 0, 5
    ex._used_at[keep] = 3
    ex.lib.recs = [r for r in ex.lib.recs if r.base != b]
    assert b not in ex.records()
    assert b not in ex._used_at and b not in ex._used_on and b not in ex._stream_before
    assert ex._used_at[keep] == 3


class LateOps(TimedOps):
    """Every event completes ``delay`` seconds after it is recorded (a save, or the GPU passing a
    victim's last use, takes that long), on its own."""

    delay = 0.002

    def record(self, ev, stream):
        import threading

        super().record(ev, stream)
        threading.Timer(self.delay, self.finish, (ev,)).start()


@pytest.mark.parametrize(("keep_leads", "slack"), [(False, 0.0), (False, 0.25), (True, 0.0)])
def test_a_fixed_plan_keeping_its_leads_or_with_slack_goes_ahead_while_its_evictions_are_in_flight(keep_leads, slack):
    """Twelve records of 64 MiB, one launch each in turn (a period of 36 launches), room for
    eight; the program's thread takes 1 ms a launch and every save and last use completes 2 ms
    after it is issued (a loop bound by the host). A plan that makes its loads later to spare
    bytes loads at the use, waiting for the room of the drops just issued; made at a quarter of
    the budget less, its loads find that room while those are in flight; keeping its leads (the
    default), it loads ahead and nothing waits. The mapped bytes never pass the budget."""
    n, p = 12, 36
    bases = [0x1000_0000 * (i + 1) for i in range(n)]
    recs = [Rec(b, 64 * MIB) for b in bases]
    ops = LateOps(recs)
    agent = FakeAgent({i + 1: b for i, b in enumerate(bases)})
    agent.streams = {0}
    eng = ResidencyEngine(agent, ops, settings=EngineSettings(keep_leads=keep_leads))
    budget = 8 * 64 * MIB
    ex = Executor(eng, {"budget": budget, "lookahead": 2, "plan": "fixed", "slack": slack, "prepin": False},
                  lib=FakeLib(recs))
    waits_at = demand_at = 0
    peak = 0
    for t in range(6 * p):
        if t == 3 * p:
            waits_at, demand_at = ex.counts["room_waits"], eng.counts["demand_loads"]
        b = bases[t % n]
        with agent.lock:
            ex.before(f"k{t % p}", [b], 0)
            agent.launches["k"] = (False, (t % n + 1,), (t % n + 1,))
            eng.launch(0, "k", None, None)
        assert ops.recs[b].resident, t
        time.sleep(0.001)
        if t >= 3 * p:
            peak = max(peak, mapped(ops))
    ex.close()
    eng.close()
    st = ex.summary()
    fixed = st["policy_stats"]["fixed"]
    assert st["policy_stats"]["fixed_plans"] == 1 and fixed["slack"] == int(budget * slack)
    assert peak <= budget and st["executor"]["room_timeouts"] == 0
    # over the last three periods, under the plan
    waits, demand = ex.counts["room_waits"] - waits_at, eng.counts["demand_loads"] - demand_at
    if keep_leads:
        assert fixed["late_loads"] == 0 and demand == 0 and waits == 0, (fixed, demand, waits)
    elif slack:
        assert waits <= p // 6, waits
    else:
        assert fixed["demand_loads"] > 0 and demand > 0 and waits >= p // 3, (fixed, demand, waits)
