"""The scheduler's fast path on the native core (docs/native-core.md, "The fast path"): the core
lets an operation go by without entering Python when every allocation it touches is marked ready
and the policy allows, and Python replays what went by into the policy's books.

The workload is the PyTorch training step recorded on the GPU (tests/data/recorded/torch.ndjson.zst),
its launches, copies and memsets fed to the core again and again as the loop's steps (the recorded
arguments, predicted by the agent's predictor through the core's memo), its device allocations the
owned records of the engine's fake driver (tests/test_engine.py), under a budget below the
footprint. The same run with the fast path off is the reference."""

from __future__ import annotations

import ctypes
import shutil
import sys
from pathlib import Path

import pytest
from test_engine import FakeOps, Rec
from test_native_core import KIND_CODE, OP_LAUNCH, OP_WRITE, launch_args, records
from test_sched_executor import FakeLib, settle

from gpuos_tools.agent import agent as agent_mod
from gpuos_tools.agent.agent import Agent
from gpuos_tools.injection import core as core_mod
from gpuos_tools.injection.core import F_FAST, NativeCore
from gpuos_tools.injection.start import AgentUpcalls
from gpuos_tools.memory.engine import ResidencyEngine
from gpuos_tools.sched import executor as executor_mod

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")

TRACE = Path(__file__).parent / "data" / "recorded" / "torch.ndjson.zst"  #: the workload (a test may set another)
NAMES = {1: "cuMemcpyAsync", 2: "cuMemsetD32Async", 3: "cuMemcpy3DAsync_v2"}


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    return core_mod.build(tmp_path_factory.mktemp("build"))


def fresh(library: Path, tmp: Path) -> NativeCore:
    """A core of its own (the library copied to its own path: its state is its own)."""
    path = tmp / "libcore.so"
    shutil.copy(library, path)
    return NativeCore(path)


class Job:
    """The recorded step on the core, the agent, the executor and the engine on the fake driver."""

    def __init__(self, library: Path, tmp: Path, monkeypatch, fast: bool, fraction: float = 0.66,
                 lookahead: int = 2, unseen: list[Rec] = (), budget: int | None = None, plan: str = "count",
                 batch: int = 1) -> None:
        self.trace = records(TRACE)
        self.core = fresh(library, tmp)
        self.recs = [Rec(r["addr"], r["size"]) for r in self.trace if r["type"] == "alloc" and r.get("kind") == "device"]
        self.recs += unseen  # owned records whose maps the core does not see
        self.ops = FakeOps(self.recs, auto=True)  # copies complete at once
        self.ops.lib = FakeLib(self.recs)
        monkeypatch.setattr(agent_mod, "ResidencyEngine", lambda agent: ResidencyEngine(agent, self.ops))
        monkeypatch.setattr(executor_mod, "_current", None)
        self.agent = agent = Agent(0)
        share = {"fraction": fraction} if budget is None else {"budget": budget}  # budget: bytes instead
        executor_mod.attach(agent, {**share, "prepin": False, "fast": fast, "lookahead": lookahead, "plan": plan,
                                    "batch": batch})
        self.upcalls = AgentUpcalls(self.core, agent, dict(NAMES))
        lib = self.core.lib
        for r in self.trace:  # the program's allocations first (the core sees the owned records' maps)
            if r["type"] == "alloc":
                lib.core_lock_program()
                lib.core_after_alloc(r["addr"], r["size"], KIND_CODE.get(r.get("kind"), 0))
                lib.core_unlock()
        agent.start_engine()
        self.upcalls.engine_started()
        self.ex: executor_mod.Executor = executor_mod._current
        self.eng: ResidencyEngine = agent.engine
        #: every decision of the policy, in order: (kernel, bases, its actions but the require)
        self.decisions: list[tuple] = []
        before = self.ex.policy.before

        def logged(kernel, bases, recs, key=None, version=None):
            actions = before(kernel, bases, recs, key, version)
            self.decisions.append((kernel, None if bases is None else tuple(sorted(set(bases))),
                                   tuple(a for a in actions if a[0] != "require")))
            return actions

        self.ex.policy.before = logged
        self.ops_fast: list[bool] = []  #: per operation: it went by without a call

    def base_of(self, addr: int) -> int | None:
        for r in self.recs:
            if r.base <= addr < r.base + r.size:
                return r.base
        return None

    def touched(self, rec: dict) -> list[int]:
        """The records a launch touches, by the agent's predictor (the core's memo holds the same)."""
        sizes, args = launch_args(rec)
        unknown, touched, _ = self.agent.launch_touches(rec.get("kernel") or "", sizes, args)
        assert not unknown
        by_id = self.agent.by_id
        return sorted({b for b in (self.base_of(by_id[i].addr) for i in touched if i in by_id) if b is not None})

    def operation(self, op: int, cbid: int, func: int, name: bytes | None, sizes, args, dst: int, src: int) -> bool:
        """One operation through the core's enter and exit; whether it went by without a call."""
        before = self.core.counters()["fast"]
        if sizes is None:
            arr, n, buf, args_len = None, 0, None, core_mod.NO_ARGS
        else:
            arr = (ctypes.c_uint32 * max(1, len(sizes)))(*sizes)
            n, buf, args_len = len(sizes), args, len(args)
        self.core.lib.core_enter(op, cbid, 0, 0, 0, func, name, arr, n, buf, args_len, dst, src, 0)
        self.core.lib.core_issued()
        went = self.core.counters()["fast"] > before
        self.ops_fast.append(went)
        return went

    def launch(self, rec: dict) -> bool:
        sizes, args = launch_args(rec)
        went = self.operation(OP_LAUNCH, 0, rec["func"], (rec.get("kernel") or "").encode(), sizes, args, 0, 0)
        with self.agent.lock:
            for b in self.touched(rec):  # issued now: each record mapped, nothing on its way out
                state = self.eng.state(b)
                assert self.ops.recs[b].resident and state in ("resident", "loading"), (hex(b), state)
                # one that went by finds it loaded, or its stream (0) already waiting for the load
                assert not went or state == "resident" or 0 in self.eng.pending[b].ordered, \
                    "a launch went by on a record whose load it is not ordered after"
        return went

    def write(self, rec: dict) -> bool:
        cbid = 2 if rec["type"] == "memset" else 1
        src = 0 if rec["type"] == "memset" else rec.get("src", 0)
        went = self.operation(OP_WRITE, cbid, 0, None, None, None, rec["dst"], src)
        lib = self.core.lib
        data = bytes.fromhex(rec["data"]) if rec.get("data") else None
        lib.core_lock_program()
        lib.core_after_write(rec["dst"], data, len(data) if data else rec["bytes"], 0, int(rec["type"] == "memset"))
        lib.core_unlock()
        return went

    def step(self) -> None:
        for r in self.trace:
            if r["type"] == "launch":
                self.launch(r)
            elif r["type"] in ("memcpy", "memset"):
                self.write(r)
            else:
                continue
            settle(self.eng, self.ex)

    def run(self, steps: int) -> tuple[dict, list[list[bool]]]:
        """``steps`` steps, then the end: (the summary, per step whether each operation went by)."""
        per_step = []
        for _ in range(steps):
            n = len(self.ops_fast)
            self.step()
            per_step.append(self.ops_fast[n:])
        return self.end(), per_step

    def end(self) -> dict:
        self.ex.fast_drain()
        out = self.ex.summary()
        self.ex.close()
        self.eng.close()
        return out

    def hook_upcalls(self) -> int:
        """Upcalls for the hooks (predictions of launches not memoised left out)."""
        c = self.core.counters()
        return c["upcalls"] - c["memo_misses"]


def policy_state(ex: executor_mod.Executor) -> dict:
    pol = ex.policy
    # where the decisions came from differs by design: the fast path decides fewer launches
    stats = {k: v for k, v in pol.stats.as_dict().items() if k not in ("fixed_acting_decisions", "fixed_other_decisions")}
    return {"stats": stats, "resident": list(pol.resident.items()), "used": pol.used,
            "period": (pol.period.known, pol.period.n, pol.period.broken, pol.period.learned),
            "keys": dict(pol._ids), "kernels": {k: list(v) for k, v in ex.kernels.items()}}


STEPS = 8
RECORDED = Path(__file__).parent / "data" / "recorded"


def allocated(share: float) -> int:
    """``share`` of the device bytes the workload allocates, as bytes: a budget that holds its
    steady step whole (a percentage is of the steady working set, which then moves every step)."""
    return int(share * sum(r["size"] for r in records(TRACE) if r["type"] == "alloc" and r.get("kind") == "device"))


@pytest.mark.parametrize("trace", ["torch.ndjson.zst", "suite-cupy_suite.s1.ndjson.zst"])
def test_the_fast_path_leaves_the_policy_where_every_upcall_would(library, tmp_path, monkeypatch, trace):
    """The same recorded steps with the fast path off and on: the same decisions in the same order
    (evictions and prefetches), the same books at the end, the same moves by the engine. The
    PyTorch step's working set fits the budget once its start-up buffers are out: its steady steps
    go by with a few calls each under two thirds of the bytes it allocates; the CuPy suite's
    does not at 66% of its steady working set: evictions and prefetches every step,
    and a call for each decision that has one and for the first touch of what it loaded."""
    runs = {}
    for fast in (False, True):
        d = tmp_path / f"fast{int(fast)}"
        d.mkdir()
        monkeypatch.setattr(sys.modules[__name__], "TRACE", RECORDED / trace)
        # the PyTorch step at two thirds of every byte it allocates: its steady working set fits
        # (a percentage would be of that working set, and move records every step)
        job = Job(library, d, monkeypatch, fast, budget=allocated(0.66) if trace.startswith("torch") else None)
        assert bool(job.core.flags() & F_FAST) == fast
        runs[fast] = (job, *job.run(STEPS))
    (slow, s0, _), (fast, s1, steps) = runs[False], runs[True]
    assert s1["fast"]["on"] and not s0["fast"]["on"]
    assert fast.decisions == slow.decisions
    assert policy_state(fast.ex) == policy_state(slow.ex)
    for k in ("evictions", "loads", "prefetches", "demand_loads", "bytes_in", "bytes_out", "launches", "unknown"):
        assert s1[k] == s0[k], k
    assert s0["evictions"] > 0
    assert s1["fast"]["late"] == 0  # every action was taken at its own operation
    assert s1["fast"]["after_s"] > 0 and s0["fast"]["after_s"] == 0 == s0["fast"]["replay_s"]
    went = sum(fast.ops_fast)
    assert s1["fast"]["operations"] == went == s1["fast"]["replayed"] > 0
    assert not any(slow.ops_fast)
    assert fast.hook_upcalls() == len(fast.ops_fast) - went < slow.hook_upcalls() == len(slow.ops_fast)
    ops = len(steps[0])
    acting = [sum(1 for d in fast.decisions[i * ops:(i + 1) * ops] if d[2]) for i in range(STEPS)]
    if trace.startswith("torch"):  # the period learned, what it uses resident: a call or two a step
        assert sum(acting[3:]) == 0
        assert all(step.count(False) <= 2 for step in steps[3:]), [s.count(False) for s in steps]
    else:  # moves every step: about one call per action, and one per first touch of a load
        assert s0["prefetches"] > 0 and min(acting[3:]) > 0
        assert all(step.count(False) <= 3 * a for step, a in zip(steps[3:], acting[3:]))
        assert sum(s.count(True) for s in steps[3:]) > 0


def test_prefetch_batches_keep_the_fast_path_exact_and_call_less(library, tmp_path, monkeypatch):
    """The CuPy suite's recorded step with --prefetch-batch 4: the same decisions with the fast
    path off and on, none late; and in steady state fewer operations call than with batch 1,
    for no more demand loads."""
    monkeypatch.setattr(sys.modules[__name__], "TRACE", RECORDED / "suite-cupy_suite.s1.ndjson.zst")
    runs = {}
    for batch, fast in ((4, False), (4, True), (1, True)):
        d = tmp_path / f"b{batch}f{int(fast)}"
        d.mkdir()
        job = Job(library, d, monkeypatch, fast, batch=batch)
        runs[(batch, fast)] = (job, *job.run(STEPS))
    slow, (fast, s1, steps4), (_, s_one, steps1) = runs[(4, False)][0], runs[(4, True)], runs[(1, True)]
    assert fast.decisions == slow.decisions and policy_state(fast.ex) == policy_state(slow.ex)
    assert s1["fast"]["late"] == 0 and s1["prefetch_batch"] == 4 and s_one["prefetch_batch"] == 1
    calls4 = sum(step.count(False) for step in steps4[3:])
    calls1 = sum(step.count(False) for step in steps1[3:])
    assert calls4 < calls1, (calls4, calls1)
    assert s1["demand_loads"] <= s_one["demand_loads"]


@pytest.mark.parametrize("trace", ["torch.ndjson.zst", "suite-cupy_suite.s1.ndjson.zst"])
def test_under_a_fixed_plan_the_fast_path_acts_where_every_upcall_would(library, tmp_path, monkeypatch, trace):
    """The recorded steps under a fixed plan, the fast path off and on: the same actions in the
    same order, the same books and moves. The operations between the plan's actions go by, and
    their replay decides nothing: the policy decides where the plan acts, at the first touch of
    what it loaded, and at its first launch."""
    monkeypatch.setattr(sys.modules[__name__], "TRACE", RECORDED / trace)
    budget = allocated(0.66) if trace.startswith("torch") else None
    runs = {}
    for plan, fast in (("fixed", False), ("fixed", True), ("count", True)):
        d = tmp_path / f"{plan}{int(fast)}"
        d.mkdir()
        job = Job(library, d, monkeypatch, fast, plan=plan, lookahead=4, budget=budget)
        runs[(plan, fast)] = (job, *job.run(STEPS))
    (slow, s0, _), (fast, s1, steps), (_, sc, _) = runs[("fixed", False)], runs[("fixed", True)], runs[("count", True)]
    acting = [d for d in fast.decisions if d[2]]
    assert acting == [d for d in slow.decisions if d[2]]
    assert policy_state(fast.ex) == policy_state(slow.ex)
    for k in ("evictions", "loads", "prefetches", "demand_loads", "bytes_in", "bytes_out", "launches", "unknown"):
        assert s1[k] == s0[k], k
    st = s1["policy_stats"]
    assert st["fixed_plans"] >= 1 and st["fixed_ends"] == 0 and s1["plan"] == "fixed"
    assert st["fixed_launches"] > (STEPS - 3) * len(steps[-1])  # the steady steps, every operation
    # late only where a plan was made in a replay: its first decision clears what it has no use for
    assert s1["fast"]["late"] <= st["fixed_plans"]
    # the replay decided only what the plan acts on: fewer decisions than operations replayed
    assert len(fast.decisions) < len(slow.decisions) - s1["fast"]["replayed"] // 2
    calls = sum(step.count(False) for step in steps[3:])
    # a steady step calls where the plan acts and at the first touch of each record it loaded
    fx = st["fixed"]
    assert all(step.count(False) <= fx["acting_phases"] + fx["moves"] // 2 for step in steps[3:])
    if trace.startswith("torch"):  # the steady step fits: a plan with nothing to do
        assert st["fixed"]["moves"] == 0 and calls == 0
    else:
        assert st["fixed"]["moves"] > 0 and s1["prefetches"] > 0
        assert s1["bytes_in"] <= 1.05 * sc["bytes_in"]  # about the count plan's bytes


def test_under_the_time_plan_the_fast_path_leaves_the_policy_where_every_upcall_would(library, tmp_path, monkeypatch):
    """The CuPy suite's recorded step under the time plan, every sampled operation taking the same
    GPU time (so that which operations are sampled changes no duration): the same decisions with
    the fast path off and on, none of them late, and far fewer calls; every duration sample
    closed at the operation after it (none spans operations that went by)."""
    from test_engine import FakeOps

    monkeypatch.setattr(FakeOps, "elapsed_ms", lambda self, start, end: 1e-4)  # 0.1 µs: no copy hides behind it
    monkeypatch.setattr(sys.modules[__name__], "TRACE", RECORDED / "suite-cupy_suite.s1.ndjson.zst")
    runs = {}
    for fast in (False, True):
        d = tmp_path / f"fast{int(fast)}"
        d.mkdir()
        job = Job(library, d, monkeypatch, fast, plan="time")
        ex = job.ex
        sample_end = ex._sample_end
        spans: list[int] = []

        def closing(stream, ex=ex, job=job, spans=spans, sample_end=sample_end):
            if ex._open is not None:
                spans.append(len(job.ops_fast))  # the operation that closes it
            sample_end(stream)

        monkeypatch.setattr(ex, "_sample_end", closing)
        opened: list[int] = []
        sample_start = ex._sample_start

        def opening(stream, ex=ex, job=job, opened=opened, sample_start=sample_start):
            sample_start(stream)
            if ex._open is not None:
                opened.append(len(job.ops_fast))

        monkeypatch.setattr(ex, "_sample_start", opening)
        for _ in range(STEPS):
            job.step()
        runs[fast] = (job, job.end(), opened, spans)
    (slow, s0, _, _), (fast, s1, opened, closed) = runs[False], runs[True]
    assert s0["plan"] == s1["plan"] == "time" and s1["fast"]["on"]
    assert fast.ex.policy._dur_n > 0 and fast.ex.counts["samples"] > 0  # the walk ran on measured durations
    assert fast.decisions == slow.decisions
    assert policy_state(fast.ex) == policy_state(slow.ex)
    assert s1["fast"]["late"] == 0
    assert s1["prefetches"] > 0 and s0["prefetches"] == s1["prefetches"]
    assert 0 < sum(fast.ops_fast) and fast.hook_upcalls() < slow.hook_upcalls()
    # a sample opened at operation i (counted before it ran) is closed by the next operation
    assert all(c == o + 1 for o, c in zip(opened, closed)), list(zip(opened, closed))[:10]


def test_under_a_fixed_plan_the_fast_path_samples_one_operation_at_a_time(library, tmp_path, monkeypatch):
    """Under the fixed plan the executor samples durations too (its leads are by time): with the
    fast path on, each sample is closed by the operation right after the one it opened at (the
    core lets none go by meanwhile), and the policy has the durations when it makes its plan."""
    from test_engine import FakeOps

    monkeypatch.setattr(FakeOps, "elapsed_ms", lambda self, start, end: 1e-4)
    monkeypatch.setattr(sys.modules[__name__], "TRACE", RECORDED / "suite-cupy_suite.s1.ndjson.zst")
    job = Job(library, tmp_path, monkeypatch, True, plan="fixed")
    ex = job.ex
    opened: list[int] = []
    closed: list[int] = []
    sample_start, sample_end = ex._sample_start, ex._sample_end

    def opening(stream):
        sample_start(stream)
        if ex._open is not None:
            opened.append(len(job.ops_fast))

    def closing(stream):
        if ex._open is not None:
            closed.append(len(job.ops_fast))
        sample_end(stream)

    monkeypatch.setattr(ex, "_sample_start", opening)
    monkeypatch.setattr(ex, "_sample_end", closing)
    for _ in range(STEPS):
        job.step()
    s = job.end()
    assert ex.policy.stats.fixed_plans >= 1 and ex.policy.stats.fixed["fits"] and s["fast"]["on"]
    assert ex.policy._dur_n > 0 and ex.counts["samples"] > 0 and ex.counts["sample_errors"] == 0
    assert opened and all(c == o + 1 for o, c in zip(opened, closed)), list(zip(opened, closed))[:10]
    fx = ex.policy._fixed
    # a copy of these records takes longer than two operations of 0.1 µs: leads past --lookahead
    # where the room allows them (the greedy makes a load later where it does not)
    assert fx is not None and fx.gaps and max(g.lead for g in fx.gaps) > 2


def test_an_operation_on_a_record_being_evicted_always_calls(library, tmp_path, monkeypatch):
    """Once the loop runs fast, a record the policy evicts (and one the engine's own eviction
    takes) loses its mark before its save is enqueued: the next launch that touches it calls,
    finds it mapped again, and the eviction is cancelled or the record loaded."""
    job = Job(library, tmp_path, monkeypatch, fast=True, budget=allocated(0.95))  # the step fits
    for _ in range(4):
        job.step()
    launches = [r for r in job.trace if r["type"] == "launch"]
    rec = next(r for r in launches if job.touched(r))
    victim = job.touched(rec)[0]
    assert job.launch(rec)  # everything settled: it goes by
    settle(job.eng, job.ex)
    with job.agent.lock:  # as a decision's eviction does (the program's thread, the lock held)
        job.ex.policy.forget(victim)
        job.ex._evict(victim)
    settle(job.eng, job.ex)
    assert job.eng.state(victim) == "released"
    assert not job.launch(rec)  # it calls, and the require loads it
    settle(job.eng, job.ex)
    assert job.ops.recs[victim].resident
    # the engine's own eviction (its evict thread, under the agent's lock): the mark goes with it
    assert job.launch(rec) or job.launch(rec)  # marked ready again after a call
    with job.agent.lock:
        assert job.eng.evict_from_operation(victim, 1)
        assert job.eng.state(victim) in ("evicting", "released")
        assert not job.launch(rec)
    job.end()


def test_a_launch_upcall_predicts_its_records_once_for_the_decision_and_the_marks(library, tmp_path, monkeypatch):
    """On the fast path, a launch's upcall decides (the executor's hook) and then marks what it
    touched (``fast_after``): both use one prediction, the hook's, not one each. The engine's own
    hook (it predicts for its loads) is left out of the count."""
    job = Job(library, tmp_path, monkeypatch, fast=True)
    agent, ex = job.agent, job.ex
    calls = {"predict": 0, "hook": 0, "marks": 0}
    in_engine = [False]
    predict, hook, marks, launch = agent.launch_touches, ex.before_launch, ex.fast_after, job.eng.launch

    def counted_predict(*a):
        calls["predict"] += not in_engine[0]
        return predict(*a)

    def counted_hook(*a):
        calls["hook"] += 1
        return hook(*a)

    def counted_marks(addrs, stream=None):
        calls["marks"] += 1
        return marks(addrs, stream)

    def engine_launch(*a):
        in_engine[0] = True
        try:
            return launch(*a)
        finally:
            in_engine[0] = False

    monkeypatch.setattr(agent, "launch_touches", counted_predict)
    monkeypatch.setattr(ex, "before_launch", counted_hook)
    monkeypatch.setattr(ex, "fast_after", counted_marks)
    monkeypatch.setattr(job.eng, "launch", engine_launch)
    agent._launch_hooks = tuple(counted_hook if h == hook else h for h in agent._launch_hooks)
    for _ in range(3):
        for r in job.trace:
            if r["type"] == "launch":
                sizes, args = launch_args(r)
                job.operation(OP_LAUNCH, 0, r["func"], (r.get("kernel") or "").encode(), sizes, args, 0, 0)
                settle(job.eng, job.ex)
    assert calls["hook"] > 0 and calls["marks"] >= calls["hook"]
    assert calls["predict"] == calls["hook"], calls
    job.end()


@pytest.mark.parametrize("trace", ["torch.ndjson.zst", "suite-cupy_suite.s1.ndjson.zst"])
def test_the_allowance_is_the_walk_over_the_predicted_launches(library, tmp_path, monkeypatch, trace):
    """``_fast_horizon`` keeps one period's keys and rotates them instead of predicting at every
    call: at every call of the recorded steps it gives what the plain walk over ``predict`` gives
    (the first predicted launch with a record not resident, less the lookahead)."""
    monkeypatch.setattr(sys.modules[__name__], "TRACE", RECORDED / trace)
    job = Job(library, tmp_path, monkeypatch, fast=True)
    ex = job.ex
    horizon = ex._fast_horizon
    seen = []

    def reference() -> int:
        pol = ex.policy
        p = pol.period.known
        if p is None or pol.used > pol.last_budget or pol.plan != "count":
            return 0
        kids = pol.period.predict(min(p, executor_mod.FAST_MAX) + pol.lookahead)
        d = len(kids) + 1
        for j, kid in enumerate(kids, 1):
            ws = pol._sets[kid]
            if ws is None or any(b not in pol.resident for b in ws):
                d = j
                break
        return max(0, min(executor_mod.FAST_MAX, d - 1 - pol.lookahead))

    def checked() -> int:
        got = horizon()
        seen.append((got, reference()))
        return got

    monkeypatch.setattr(ex, "_fast_horizon", checked)
    for _ in range(STEPS):
        job.step()
    job.end()
    assert seen and all(got == want for got, want in seen), [x for x in seen if x[0] != x[1]][:5]
    assert any(got > 0 for got, _ in seen) and any(got == 0 for got, _ in seen)


def test_an_owned_record_the_core_did_not_see_mapped_turns_the_fast_path_off(library, tmp_path, monkeypatch):
    """The core marks its own allocations: a record of the owned allocator it has none for could
    not lose a mark, and an operation on it would pass for one on host memory; the executor sees it
    at its first decision and every operation calls from then on."""
    job = Job(library, tmp_path, monkeypatch, fast=True, unseen=[Rec(0x7F00_0000_0000, 2 << 20)])
    for _ in range(3):
        job.step()
    out = job.end()
    assert not any(job.ops_fast) and not out["fast"]["on"]
    assert out["fast"]["off"] == "1 owned records not seen by the native core"
    assert not job.core.flags() & F_FAST


def two_allocation_core(library, tmp_path, calls: list[int]):
    """A fresh core on the fast path with two 4 KiB allocations (0x10000, 0x20000) and an upcall
    that notes each call in ``calls`` and predicts a launch writing the first and reading both;
    (core, its library, the launch's argument sizes, its arguments: a pointer into each)."""
    core = fresh(library, tmp_path)

    def up(ptr):
        u = ptr.contents
        calls.append(u.what)
        if u.what == core_mod.UP_PREDICT:
            u.nw, u.nt, u.unknown = 1, 2, 0
            u.ids[0], u.ids[1], u.ids[2] = 1, 1, 2
        return 0

    core.set_upcall(up)
    lib = core.lib
    for addr in (0x10000, 0x20000):
        lib.core_lock_program()
        lib.core_after_alloc(addr, 0x1000, 0)
        lib.core_unlock()
    core.set_flag(core_mod.F_EXEC | F_FAST, True)
    sizes = (ctypes.c_uint32 * 2)(8, 8)
    args = (0x10000).to_bytes(8, "little") + (0x20010).to_bytes(8, "little")
    return core, lib, sizes, args


def test_the_core_alone_calls_for_an_unmarked_allocation_and_queues_the_rest(library, tmp_path):
    """The core's rule without the executor: no mark, no allowance, an allocation since the last
    allowance, a write to an allocation marked only readable, or a copy of an API always sent to
    Python: a call. Marked, allowed: queued, with the launch's ids and name, and the allowance
    counted down; dropping every mark at once (an unmark from a thread that cannot take the lock)
    makes the next operation call."""
    calls: list[int] = []
    core, lib, sizes, args = two_allocation_core(library, tmp_path, calls)

    def launch() -> None:
        lib.core_enter(OP_LAUNCH, 0, 0, 0, 5, 0xF00, b"k", sizes, 2, args, 16, 0, 0, 0)
        lib.core_issued()

    def write(cbid: int) -> None:
        lib.core_enter(OP_WRITE, cbid, 0, 0, 5, 0, None, None, 0, None, core_mod.NO_ARGS, 0x20000, 0x90000, 0)
        lib.core_issued()

    launch()
    # nothing allowed yet; the access set looked up (predicted) first, for the hook
    assert calls == [core_mod.UP_PREDICT, core_mod.UP_LAUNCH]
    core.fast_allow(3)
    launch()
    assert calls[2:] == [core_mod.UP_LAUNCH]  # allowed, but nothing marked
    core.fast_mark([0x10000], 2)
    core.fast_allow(3)
    launch()
    assert calls[-1] == core_mod.UP_LAUNCH  # one of its two allocations marked
    core.fast_mark([0x20000], 1)  # readable only (a record whose host copy is current)
    n = len(calls)
    launch()  # writes the first, reads the second
    assert len(calls) == n
    write(1)  # writes the second: the engine must see it
    assert calls[-1] == core_mod.UP_WRITE and len(calls) == n + 1
    assert core.fast_last_unready() == 0x20000 and core.fast_last_unready() == 0  # the one it called for, once
    core.fast_mark([0x20000], 2)
    write(1)
    counts = core.fast_counts()
    assert len(calls) == n + 1 and {k: counts[k] for k in ("fast", "left", "queued")} == {"fast": 2, "left": 1, "queued": 2}
    # why each call came: no allowance; a written record not ready (twice: the launch with nothing
    # marked, the write to a readable-only record); a read one not readable
    assert {k: v for k, v in counts.items() if v and k not in ("fast", "left", "queued")} == {
        "why_left": 1, "why_unready_write": 2, "why_unready_read": 1}
    n = len(calls)
    core.fast_slow_cbid(3)
    write(3)  # an API whose addresses the core does not read
    assert calls[-1] == core_mod.UP_WRITE and len(calls) == n + 1
    launch()
    assert core.fast_counts()["left"] == 0
    launch()  # the allowance is spent
    assert calls[-1] == core_mod.UP_LAUNCH and len(calls) == n + 2
    counts = core.fast_counts()
    assert counts["why_left"] == 2 and counts["why_slow_write"] == 1 and counts["marks_dropped"] == 0
    assert core.fast_take() == [("launch", 4, 0, 5, "k", (1,), (1, 2)), ("write", 6, 1, 5, 0x20000, 0x90000),
                                ("launch", 8, 0, 5, "k", (1,), (1, 2))]
    assert core.fast_take() == []
    core.fast_allow(5)
    lib.core_lock_program()
    lib.core_after_alloc(0x30000, 0x1000, 0)  # an allocation: the policy must see the records first
    lib.core_unlock()
    write(1)
    assert calls[-1] == core_mod.UP_WRITE
    core.fast_allow(5)
    core.fast_unready(0x20000, 0x1000)  # a record's state changes: its allocation loses its mark
    write(1)
    assert calls[-1] == core_mod.UP_WRITE
    core.fast_mark([0x20000], 2)
    n = len(calls)
    write(1)
    assert len(calls) == n
    core.fast_unready_all()
    write(1)
    assert len(calls) == n + 1
    assert core.counters()["fast"] == 4
    counts = core.fast_counts()
    assert counts["marks_dropped"] == 1 and counts["why_moved"] == 1 and counts["why_unready_write"] == 4


def test_a_launch_hook_is_handed_the_access_set_the_memo_holds(library, tmp_path):
    """The hook's upcall carries the launch's access set (writes, then every touched id), so
    that Python does not predict it again; predicted once, on the first launch."""
    calls: list[int] = []
    core, lib, sizes, args = two_allocation_core(library, tmp_path, calls)
    plain = core._upcall
    handed: list[tuple] = []

    def up(ptr):
        u = ptr.contents
        if u.what == core_mod.UP_LAUNCH:
            n = u.nw + u.nt
            handed.append((bool(u.ids), u.unknown, u.ids[:u.nw] if u.ids else [], u.ids[u.nw:n] if u.ids else []))
        return plain(ptr)

    core.set_upcall(up)
    for _ in range(3):
        lib.core_enter(OP_LAUNCH, 0, 0, 0, 5, 0xF00, b"k", sizes, 2, args, 16, 0, 0, 0)
        lib.core_issued()
    assert calls == [core_mod.UP_PREDICT] + [core_mod.UP_LAUNCH] * 3
    assert handed == [(True, 0, [1], [1, 2])] * 3
    lib.core_enter(OP_LAUNCH, 0, 0, 0, 5, 0xF00, b"k", None, 0, None, core_mod.NO_ARGS, 0, 0, 0)
    lib.core_issued()
    assert calls[-2:] == [core_mod.UP_PREDICT, core_mod.UP_LAUNCH]  # no arguments: what Python says of it


def test_the_queue_parser_decodes_a_repeated_launch_once(library, tmp_path):
    """The queue the core hands over, taken twice with the same launch queued in it: the entries
    are the ones a parse without the memo gives, and every entry of the launch shares its name
    and id tuples with the first (decoded once; the replay keys on them)."""
    core, lib, sizes, args = two_allocation_core(library, tmp_path, [])
    core.fast_mark([0x10000, 0x20000], 2)
    taken = []
    for _ in range(2):
        core.fast_allow(3)
        for _ in range(3):
            lib.core_enter(OP_LAUNCH, 0, 0, 0, 5, 0xF00, b"k", sizes, 2, args, 16, 0, 0, 0)
            lib.core_issued()
        n, k = ctypes.c_size_t(), ctypes.c_uint32()
        data = core._taken(lib.core_fast_take(ctypes.byref(n), ctypes.byref(k)), n)
        got = core_mod.parse_fast(data, core._fast_memo)
        assert got == core_mod.parse_fast(data), got
        assert [e[0] for e in got] == ["launch"] * 3 and got[0][4:] == ("k", (1,), (1, 2)), got
        assert len(core._fast_memo) == 1
        taken += got
    assert len(taken) == 6 and len({e[1] for e in taken}) == 6  # each its own operation number
    first = taken[0]
    assert all(e[4] is first[4] and e[5] is first[5] and e[6] is first[6] for e in taken)
    with pytest.raises(ValueError, match="runs past its buffer"):
        core_mod.parse_fast(data[:-1], {})


def evicted_under_a_fixed_plan(library, tmp_path, monkeypatch, stream: int | None = None) -> tuple[Job, int]:
    """The CuPy suite's step twice under a fixed plan, then one of its resident records evicted
    as the policy's eviction leaves books and engine; ``stream``: the stream of its uses before
    (the one a load of it is ordered on). (the job, the record)."""
    monkeypatch.setattr(sys.modules[__name__], "TRACE", RECORDED / "suite-cupy_suite.s1.ndjson.zst")
    job = Job(library, tmp_path, monkeypatch, True, plan="fixed")
    for _ in range(2):
        job.step()
    ex, eng = job.ex, job.eng
    b = next(r.base for r in job.recs if r.base in ex.policy.resident and r.base not in eng.pending)
    with job.agent.lock:
        ex.policy.resident.pop(b)
        ex.policy.used -= ex._records[b]
        if stream is not None:
            ex._used_on[b] = stream
        ex._evict(b)
    settle(eng, ex)
    assert eng.state(b) == "released"
    return job, b


def test_a_record_the_mover_loads_is_ready_for_its_own_stream_once_that_stream_waits(library, tmp_path, monkeypatch):
    """The mover's load of a record used on one stream before its eviction: that stream waits
    for the load at once, and the core lets an operation on it read the record without a call;
    on any other stream an operation still calls (the core counts it), and nothing is marked
    for a record used on several streams."""
    job, b = evicted_under_a_fixed_plan(library, tmp_path, monkeypatch, stream=0)
    ex, eng, ops, core = job.ex, job.eng, job.ops, job.core
    assert ex._stream_before[b] == 0
    ops.auto = False  # the load stays in flight
    with job.agent.lock:
        ex.policy.resident[b] = ex._records[b]
        ex.policy.used += ex._records[b]
        ev = eng.prefetch(b)
    assert eng.state(b) == "loading" and ev is not None
    ex._ready_on_stream(b, ev)
    assert ("wait", 0, ev) in ops.log and 0 in eng.pending[b].ordered
    assert ex.counts["ready_on_stream"] == 1

    def read_from(stream: int) -> bool:  # a copy out of the record to memory no allocation holds
        before = core.counters()["fast"]
        core.fast_allow(4)
        core.lib.core_enter(OP_WRITE, 1, 0, 0, stream, 0, None, None, 0, None, core_mod.NO_ARGS, 0x10, b, 0)
        core.lib.core_issued()
        return core.counters()["fast"] > before

    job.upcalls.fast = None  # the calls themselves are not under test: count them only
    assert read_from(0)
    assert not read_from(7) and core.fast_counts()["why_other_stream"] == 1
    ex._stream_before[b] = executor_mod.MIXED
    ex._ready_on_stream(b, ev)
    assert ex.counts["ready_on_stream"] == 1 and ex.counts["ready_on_stream_skipped"] == 1
    ops.finish(ev)
    job.end()


def test_a_record_loaded_on_demand_is_ready_for_the_stream_that_waits_for_it(library, tmp_path, monkeypatch):
    """A decision that loads a record on demand makes its operation's stream wait for the load;
    the marks after it let the next operations on that stream touch the record without a call
    while it is still loading, and an operation on another stream still calls."""
    job, b = evicted_under_a_fixed_plan(library, tmp_path, monkeypatch)
    ex, eng, ops, core = job.ex, job.eng, job.ops, job.core
    ops.auto = False  # the load stays in flight
    with job.agent.lock:
        ex.before("k", [b], 0)  # its require loads it on demand, stream 0 waits
        assert eng.state(b) == "loading" and 0 in eng.pending[b].ordered
        ex.fast_after([b], 0)
    assert ex.counts["ready_loading"] == 1
    job.upcalls.fast = None  # the calls themselves are not under test: count them only

    def read_from(stream: int) -> bool:
        before = core.counters()["fast"]
        core.fast_allow(4)
        core.lib.core_enter(OP_WRITE, 1, 0, 0, stream, 0, None, None, 0, None, core_mod.NO_ARGS, 0x10, b, 0)
        core.lib.core_issued()
        return core.counters()["fast"] > before

    assert read_from(0)
    assert not read_from(7) and core.fast_counts()["why_other_stream"] == 1
    ops.finish(*[c[1] for c in ops.calls("record")])
    job.end()


def test_a_call_for_an_unmarked_record_is_counted_by_why_it_was_not_marked(library, tmp_path, monkeypatch):
    """The upcall asks the core which allocation's missing mark made the operation call, and the
    executor counts why, as things stood: the recorded steps' first touches through the upcalls,
    then here a record evicted (outside the policy's books), loading on demand for another
    stream, and resident again with its mark gone."""
    job, b = evicted_under_a_fixed_plan(library, tmp_path, monkeypatch)
    ex, eng, ops, core = job.ex, job.eng, job.ops, job.core
    steps = dict(ex.unready_why)
    assert sum(steps.values()) > 0  # counted through the upcalls
    ex.note_unready(b)
    ex.note_unready(0x10)  # no allocation of the program's owned memory
    ops.auto = False
    with job.agent.lock:
        ex.before("k", [b], 7)  # loaded on demand, for stream 7
    ex.note_unready(b)
    ops.finish(*[c[1] for c in ops.calls("record")])
    with job.agent.lock:
        ex.before("k", [b], 7)  # the load complete: resident, and nobody marked it since
    ex.note_unready(b)
    out = job.end()
    got = {k: v - steps.get(k, 0) for k, v in out["fast"]["unready_why"].items()}
    assert {k: v for k, v in got.items() if v} == {"not_in_books": 1, "not_owned": 1, "loading": 1,
                                                   "resident_unmarked": 1}


def test_the_upcalls_profile_shows_where_the_agents_time_went(library, tmp_path, monkeypatch):
    """GPUOS_AGENT_PROFILE_OUT's profile: every upcall under cProfile, written as text."""
    job = Job(library, tmp_path, monkeypatch, fast=True, plan="fixed")
    job.upcalls.profile_to(str(tmp_path / "profile.txt"))
    job.run(3)
    job.upcalls.write_profile()
    text = (tmp_path / "profile.txt").read_text()
    assert "Ordered by: internal time" in text and "Ordered by: cumulative time" in text
    upcalls = job.core.counters()["upcalls"]
    dispatch = [line.split() for line in text.splitlines() if line.endswith("(dispatch)")]
    assert upcalls > 0 and dispatch and all(int(row[0]) == upcalls for row in dispatch), (upcalls, dispatch)
    assert "(fast_replay)" in text


def test_a_write_to_a_clean_record_goes_by_and_reaches_the_engine_in_the_replay(library, tmp_path, monkeypatch):
    """A record the mover loaded from the engine's host copy is clean (the copy is current) and
    ready for its stream: a memset into it goes by without a call, the replay takes it off the
    clean set before anything else, and its next eviction saves it instead of trusting the stale
    host copy."""
    job, b = evicted_under_a_fixed_plan(library, tmp_path, monkeypatch, stream=0)
    ex, eng, ops, core = job.ex, job.eng, job.ops, job.core
    with job.agent.lock:
        ex.policy.resident[b] = ex._records[b]
        ex.policy.used += ex._records[b]
        ev = eng.prefetch(b)
    ex._ready_on_stream(b, ev)
    settle(eng, ex)
    assert b in eng.clean and ex.counts["ready_on_stream"] == 1
    job.upcalls.fast = None  # the replay is driven here, not by an upcall
    before = core.counters()["fast"]
    core.fast_allow(4)
    core.lib.core_enter(OP_WRITE, 2, 0, 0, 0, 0, None, None, 0, None, core_mod.NO_ARGS, b + 64, 0, 0)
    core.lib.core_issued()
    assert core.counters()["fast"] == before + 1  # went by: no call
    assert b in eng.clean  # not replayed yet
    with job.agent.lock:
        ex.fast_replay(core.fast_take())
        assert b not in eng.clean
        saves = len([c for c in ops.calls("copy_out") if c[1] == b])
        ex.policy.resident.pop(b)
        ex.policy.used -= ex._records[b]
        ex._evict(b)
    settle(eng, ex)
    assert len([c for c in ops.calls("copy_out") if c[1] == b]) == saves + 1
    job.end()


def test_a_fixed_plan_asks_where_records_are_dead_and_drops_them_there_for_nothing(library, tmp_path, monkeypatch):
    """The CuPy suite's recorded step under a fixed plan on the fast path, the driver saying that
    half of the records are dead (every torch block freed), GPUOS_SCHED_DEAD_PLAN=1 (off by
    default; a driver that knows of nothing dead makes it moot): the plan's first period is decided at
    one phase in DEAD_EVERY, each asking which records are dead; the plan is then made again with
    dead gaps, whose records the engine evicts without a save and maps back without a copy. The
    same steps with a driver that knows of nothing dead move more bytes."""
    from test_engine import FakeOps

    from gpuos_tools.sched.online import DEAD_EVERY

    from gpuos_tools.memory.settings import EngineSettings

    monkeypatch.setattr(sys.modules[__name__], "TRACE", RECORDED / "suite-cupy_suite.s1.ndjson.zst")
    init = Agent.__init__

    def with_dead_plan(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.engine_settings = EngineSettings(dead_plan=True)

    monkeypatch.setattr(Agent, "__init__", with_dead_plan)
    runs = {}
    for knows in (False, True):
        d = tmp_path / f"dead{int(knows)}"
        d.mkdir()
        if knows:
            bases = sorted(r["addr"] for r in records(TRACE) if r["type"] == "alloc" and r.get("kind") == "device")
            dead = set(bases[::2])
            monkeypatch.setattr(FakeOps, "dead", lambda self, base: base in dead, raising=False)
        job = Job(library, d, monkeypatch, True, plan="fixed", lookahead=4)
        for _ in range(STEPS):
            job.step()
        runs[knows] = (job, job.end())
    (blind, s0), (job, s1) = runs[False], runs[True]
    st0, st1 = s0["policy_stats"], s1["policy_stats"]
    assert not blind.ex.policy.sees_dead and st0["fixed_dead_samples"] == 0 and s0["dead_evictions"] == 0
    assert job.ex.policy.sees_dead and st1["fixed_plans"] == 1 and st1["fixed_dead_replans"] == 1
    p = st1["fixed"]["period"]
    assert st1["fixed_dead_samples"] == len(range(0, p, DEAD_EVERY))
    assert job.ex.counts["dead_asked"] > 0 and "error" not in s1
    assert st1["fixed"]["dead_gaps"] > 0 and st1["fixed"]["bytes_in"] < st0["fixed"]["bytes_in"]
    assert s1["dead_evictions"] > 0 and s1["dead_loads"] > 0
    assert s1["bytes_in"] < s0["bytes_in"] and s1["bytes_out"] < s0["bytes_out"]
    # what the mover mapped with nothing to copy is marked ready for the core at once
    assert s1["executor"]["ready_now"] > 0
