"""A write no prediction showed, detected at run time (gpuos_tools/memory/conservative.py;
docs/residency-engine.md, "Mismatches"): a clean record whose digest changed names the kernels
that may have written it, those kernels are unknown from then on and their launches count as
writing everything resident, so the evictions after them save without a digest. On the digest
tests' fake driver; the end-to-end test drives the real agent, predictor and executor and loses
a write without the rule. tests/gpu/test_digest_gpu.py runs it on a GPU."""

from __future__ import annotations

import struct

import pytest

from gpuos_tools.memory.engine import ResidencyEngine
from gpuos_tools.memory.settings import EngineSettings
from gpuos_tools.memory.states import RELEASED
from tests.test_engine import MIB, FakeAgent, Rec
from tests.test_engine_digest import DigestOps, wait_state

A, B, C = 0x1000_0000, 0x2000_0000, 0x3000_0000


def engine(monkeypatch, conserve: bool = True, off_after: int = 0):
    ops = DigestOps([Rec(b, 64 * MIB) for b in (A, B, C)])
    agent = FakeAgent({1: A, 2: B, 3: C})
    agent.unknown_why = {}
    eng = ResidencyEngine(agent, ops, settings=EngineSettings(conserve=conserve, digest_off_after=off_after))
    # bump: predicted to read A only (a const pointer), but writes it; other: reads and writes B
    agent.launches.update({"bump": (False, (1,), ()), "other": (False, (2,), (2,)), "peek": (False, (3,), ())})
    return eng, ops, agent


def evict(eng, base):
    assert eng.evict_from_operation(base)
    assert wait_state(eng, base, RELEASED)


def test_a_hidden_write_is_a_mismatch_that_names_the_kernels_predicted_to_read_the_record(monkeypatch, capsys):
    eng, ops, agent = engine(monkeypatch)
    evict(eng, A)  # saved (nothing to compare with yet)
    eng.launch(0, "bump", None, None)  # loads A from the engine's copy: digest taken, clean
    assert A in eng.clean and A in eng.digests
    ops.device[A] = b"bumped"  # the kernel writes it through its const pointer
    eng.launch(0, "other", None, None)
    eng.launch(0, "peek", None, None)  # reads C: not a reader of A
    evict(eng, A)
    c = eng.counts
    assert c["mismatches"] == 1 and c["digest_changed"] == 1 and c["evict_saves"] == 2
    assert eng.conservative == {"bump"}
    st = eng.stats()
    assert st["conservative"] == ["bump"]
    m = st["mismatch"][0]
    assert m["base"] == hex(A) and m["kernels"] == ["bump"] and m["found"] == "predicted to read it" and m["new"] == 1
    assert agent.unknown_why["bump"].startswith("conservative")
    assert "conservative from now on" in capsys.readouterr().err
    eng.launch(0, "bump", None, None)
    assert ops.device[A] == b"bumped"  # saved: the write kept
    eng.close()


def test_without_readers_the_suspects_are_the_kernels_launched_since_the_load(monkeypatch):
    eng, ops, agent = engine(monkeypatch)
    evict(eng, A)
    agent.launches["early"] = (False, (2,), ())
    eng.launch(0, "early", None, None)
    eng.launch(0, "other", None, None)
    eng.prefetch(A)  # loaded by no launch: nothing predicted to read it
    eng.launch(0, "peek", None, None)
    ops.device[A] = b"reached by a pointer the predictor did not see"
    evict(eng, A)
    m = eng.stats()["mismatch"][0]
    assert m["found"] == "launched since its load"
    # peek ran after the load; other was the last launch before it (counted: a launch being
    # issued as the load comes may run after it); early, before that, is not suspected
    assert m["kernels"] == ["other", "peek"] and eng.conservative == {"other", "peek"}
    eng.close()


def test_a_clean_record_that_changed_is_not_a_mismatch_when_a_write_was_predicted(monkeypatch):
    eng, ops, agent = engine(monkeypatch)
    evict(eng, B)
    eng.launch(0, "other", None, None)  # predicted to write B
    ops.device[B] = b"written as predicted"
    evict(eng, B)
    assert eng.counts["digest_changed"] == 1 and eng.counts["mismatches"] == 0 and not eng.conservative
    eng.close()


@pytest.mark.parametrize("conserve", [True, False])
def test_after_the_check_is_turned_off_only_the_rule_keeps_the_hidden_writes(monkeypatch, conserve):
    """The digest check goes off at the first mismatch (GPUOS_ENGINE_DIGEST_OFF_AFTER=1). With
    the rule, bump is unknown from then on (it loads every record) and its launches make the
    evictions after them save; A and C, bumped before the detection, lose their clean mark at
    it. Without it (GPUOS_ENGINE_NO_CONSERVE=1), the engine trusts bump's prediction: a clean
    record it wrote is released without a save, and the write is lost."""
    eng, ops, agent = engine(monkeypatch, conserve=conserve, off_after=1)
    agent.launches["bump"] = (False, (1, 3), ())  # reads A and C (both const pointers), writes them
    for b in (A, C):
        evict(eng, b)
    eng.launch(0, "bump", None, None)  # loads A and C: clean, digests taken
    ops.device[A], ops.device[C] = b"A1", b"C1"
    evict(eng, A)  # found: the check goes off
    assert eng.counts["mismatches"] == 1 and eng.stats()["digest"].startswith("off (GPUOS_ENGINE_DIGEST_OFF_AFTER")
    assert (C in eng.clean) is not conserve  # bumped before the detection: not clean any more
    evict(eng, C)  # no digest now: saved with the rule, released as clean without
    lost = []
    for k in range(3):
        eng.launch(0, "bump", None, None)
        for b in (A, C):
            want = b"%s%d" % (b"A" if b == A else b"C", k + 1)
            if ops.device[b] != want:
                lost.append((k, hex(b)))
            ops.device[b] = b"%s%d" % (b"A" if b == A else b"C", k + 2)
        eng.launch(0, "other", None, None)
        for b in (A, C):
            evict(eng, b)
    eng.close()
    assert eng.counts["digests"] == 3  # two at the first load, one at A's check: none since
    if conserve:
        assert not lost, lost
        assert eng.conservative == {"bump"} and eng.counts["conservative_launches"] == 3
        assert eng.counts["unknown_requires"] >= 3  # it loads every record
    else:
        assert lost and not eng.conservative and eng.counts["conservative_launches"] == 0


def test_a_conservative_kernel_drops_every_digest_so_the_evictions_save(monkeypatch):
    """Check on: a record whose digest would say unchanged is saved after a conservative
    launch (its write counts as a write to everything resident, whatever the digest says)."""
    eng, ops, agent = engine(monkeypatch)
    eng.conservative.add("bump")
    evict(eng, B)
    eng.launch(0, "peek", None, None)
    eng.prefetch(B)  # B back from the engine's copy: clean, with a digest
    assert B in eng.digests and B in eng.clean
    saves = eng.counts["evict_saves"]
    eng.launch(0, "bump", None, None)
    assert not eng.digests and not eng.clean and eng.counts["unknown_requires"] == 1
    evict(eng, B)
    assert eng.counts["evict_saves"] == saves + 1 and eng.counts["digest_skips"] == 0
    # a graph launch may run a conservative kernel: the same
    eng.prefetch(B)
    assert B in eng.digests
    eng.graph(0)
    assert not eng.digests
    eng.close()


def test_the_agents_prediction_of_a_conservative_kernel_is_unknown():
    from gpuos_tools.agent.agent import Agent

    a = Agent()
    a.ctx = object()
    a.on_alloc(0x7000_0000, 4096, "device")
    kernel = "_Z4bumpPKfx"  # bump(const float*, long long): predicted to read only
    args = struct.pack("<Qq", 0x7000_0000, 1024)
    unknown, touched, writes = a.launch_touches(kernel, (8, 8), args)
    assert not unknown and touched == (1,) and writes == ()

    class Eng:
        conservative = {kernel}

    a.engine = Eng()
    assert a.launch_touches(kernel, (8, 8), args) == (True, (1,), ())
    assert a.launch_writes(kernel, (8, 8), args) == (True, ())
    assert a.launch_touches("_Z5otherPKfx", (8, 8), args)[0] is False


@pytest.mark.parametrize("conserve", [True, False])
def test_the_executor_on_the_agent_keeps_a_hidden_write_only_with_the_rule(monkeypatch, conserve):
    """The real agent (predictor and memo), executor and engine on the fake driver: bump(const
    float*) writes its array anyway, peek(const float*, float*) only reads its coefficients.
    The check goes off at the first mismatch; from then on the rule alone keeps the bumps: with
    it every launch finds the latest bytes, and the summary names bump (not peek); without it
    an array comes back stale."""
    from gpuos_tools.agent.agent import Agent
    from gpuos_tools.sched.executor import Executor
    from tests.test_sched_executor import FakeLib, settle

    arrays = [0x1000_0000 * (i + 1) for i in range(4)]
    coeffs = [0x1000_0000 * (i + 5) for i in range(2)]
    out = 0x7000_0000
    sizes = {**{b: 64 * MIB for b in arrays + coeffs}, out: 1 * MIB}
    recs = [Rec(b, n) for b, n in sizes.items()]
    ops = DigestOps(recs)
    agent = Agent()
    agent.engine_settings = EngineSettings(conserve=conserve, digest_off_after=1)  # as the boot config says
    agent.ctx = object()
    for b, n in sizes.items():
        agent.on_alloc(b, n, "vmm")
    agent.engine = ResidencyEngine(agent, ops)
    ex = Executor(agent.engine, {"budget": 5 * 64 * MIB // 2, "policy": "lru", "lookahead": 1, "prepin": False},
                  lib=FakeLib(recs))
    ex.attach(agent)
    bump, peek = "_Z4bumpIfEvPKT_x", "_Z4peekPKfPfi"  # bump<float>(const float*, long long); peek(const float*, float*, int)
    expect = {b: ops.device[b] for b in sizes}
    stale = []
    for step in range(6 * len(arrays)):
        a, c = arrays[step % len(arrays)], coeffs[step % len(coeffs)]
        agent.before_launch("cuLaunchKernel", 0, bump, (8, 8), struct.pack("<Qq", a, 1 << 24))
        if ops.device[a] != expect[a]:
            stale.append(step)
        ops.device[a] = expect[a] = b"bump%d" % step  # the write no prediction shows
        settle(agent.engine, ex)
        agent.before_launch("cuLaunchKernel", 0, peek, (8, 8, 4), struct.pack("<QQi", c, out, 0))
        assert ops.device[c] == expect[c], step  # only read: never changes
        ops.device[out] = expect[out] = b"peek%d" % step
        settle(agent.engine, ex)
    ex.close()
    agent.engine.close()
    s = ex.summary()
    assert s["mismatches"] >= 1 and s["evictions"] > 20, s
    assert s["engine"]["digest"].startswith("off"), s["engine"]["digest"]
    if conserve:
        assert not stale, stale
        assert s["conservative"] == [bump] and s["unknown"] > 0, s
        top = {k["kernel"]: k for k in s["kernels"]["top"]}
        assert top[bump]["why"].startswith("conservative") and top[peek]["unknown"] == 0
    else:
        assert stale and s["conservative"] == [] and s["unknown"] == 0
