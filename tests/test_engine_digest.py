"""The residency engine's digest check (gpuos_tools/memory/digests.py; docs/residency-engine.md)
on a fake driver: when a record evicted again may skip its save, when it must be saved, where the digests
are ordered, and how the engine goes on without them. The GPU kernel is mocked by a hash of the
fake device bytes; tests/gpu/test_digest_gpu.py runs the real one."""

from __future__ import annotations

import hashlib
import threading

import pytest

from gpuos_tools.memory.digest_kernel import digest_reference
from gpuos_tools.memory.digests import BACKOFF
from gpuos_tools.memory.engine import ResidencyEngine
from gpuos_tools.memory.settings import EngineSettings
from gpuos_tools.memory.states import RELEASED, RESIDENT
from tests.test_engine import MIB, FakeAgent, FakeOps, Rec

BASE = 0x1000_0000


class DigestOps(FakeOps):
    """FakeOps with the digest ops: a digest is a hash of the fake device bytes, put in its
    slot when enqueued (the fake's streams run at once, like ``auto`` events)."""

    def __init__(self, records, init_error: str | None = None) -> None:
        super().__init__(records, auto=True)
        self.slots: dict[int, bytes] = {}
        self.init_error = init_error
        self.prepared = 0
        self.inits = 0

    def digest_prepare(self):
        self.prepared += 1

    def digest_init(self):
        self.inits += 1
        return self.init_error

    def digest(self, base, size, slot, stream):
        self.slots[slot] = hashlib.blake2b(self.device[base], digest_size=16).digest()
        self.log.append(("digest", base, slot, stream))

    def digest_value(self, slot):
        return self.slots[slot]


def wait_state(eng, base, state):
    for _ in range(300):
        if eng.state(base) == state:
            return True
        threading.Event().wait(0.01)
    return False


def cycle(init_error=None, size=64 * MIB, monkeypatch=None):
    """A record evicted once (saved: nothing to compare with yet), then loaded back by a
    launch: from the engine's own host copy, so its digest is taken."""
    ops = DigestOps([Rec(BASE, size)], init_error=init_error)
    agent = FakeAgent({1: BASE})
    eng = ResidencyEngine(agent, ops)
    assert eng.evict_from_operation(BASE)
    assert wait_state(eng, BASE, RELEASED)
    assert eng.counts["evict_saves"] == 1
    agent.launches["r"] = (False, (1,), (1,))  # as CuPy's kernels look: every argument written
    eng.launch(0, "r", None, None)
    return eng, ops, agent


def test_the_host_copys_digest_is_taken_after_the_load_and_before_its_event():
    eng, ops, _ = cycle()
    i_in = ops.log.index(next(c for c in ops.log if c[0] == "copy_in"))
    dig = ops.log[i_in + 1]
    assert dig[0] == "digest" and dig[1] == BASE and dig[3] == ops.log[i_in][2]
    rec = ops.log[i_in + 2]
    assert rec[0] == "record" and rec[2] == ops.log[i_in][2]  # the load's event comes after it
    assert eng.digests == {BASE: 64 * MIB} and eng.counts["digests"] == 1 and ops.inits == 1
    assert BASE not in eng.clean  # written, as predicted
    eng.close()


def test_an_unchanged_record_predicted_written_is_released_without_a_save():
    eng, ops, _ = cycle()
    n_out = len(ops.calls("copy_out"))
    assert eng.evict_from_operation(BASE)
    assert wait_state(eng, BASE, RELEASED)
    assert len(ops.calls("copy_out")) == n_out  # no save
    # the second digest: on the evict stream, after the program's streams' events
    digs = ops.calls("digest")
    assert len(digs) == 2 and digs[1][2] == digs[0][2] + 1
    i = ops.log.index(digs[1])
    side = digs[1][3]
    assert [c for c in ops.log[:i] if c[0] == "wait" and c[1] == side]
    c = eng.counts
    assert c["evictions"] == 2 and c["evict_saves"] == 1 and c["digest_skips"] == 1
    assert c["digest_skipped_bytes"] == 64 * MIB == c["unsaved_bytes"] and c["digest_changed"] == 0
    assert eng.digests == {BASE: 64 * MIB}  # the host copy did not change: still valid
    # loaded again: the bytes are the host copy's
    eng.launch(0, "r", None, None)
    assert ops.device[BASE] == b"dev%x" % BASE
    st = eng.stats()
    assert st["digest"] == "on" and st["digest_skips"] == 1
    eng.close()


def test_a_changed_record_is_saved_and_its_old_digest_dropped():
    eng, ops, _ = cycle()
    ops.device[BASE] = b"written on the GPU"
    assert eng.evict_from_operation(BASE)
    assert wait_state(eng, BASE, RELEASED)
    outs = ops.calls("copy_out")
    assert len(outs) == 2
    # the save after the digest, on the same (evict) stream
    last = {c[0]: i for i, c in enumerate(ops.log)}
    assert last["copy_out"] > last["digest"] and outs[-1][2] == ops.calls("digest")[-1][3]
    c = eng.counts
    assert c["evict_saves"] == 2 and c["digest_changed"] == 1 and c["digest_skips"] == 0
    assert BASE not in eng.digests
    eng.launch(0, "r", None, None)  # back, with the new bytes, and their digest: a first change is checked again
    assert ops.device[BASE] == b"written on the GPU" and BASE in eng.digests and eng._backoff[BASE] == [0, 0]
    eng.close()


def test_a_record_written_once_is_not_saved_again():
    """A weight initialised after its first save changes once: its evictions after that skip
    the save (no back-off from a single change)."""
    eng, ops, _ = cycle()
    ops.device[BASE] = b"initialised"
    assert eng.evict_from_operation(BASE)
    assert wait_state(eng, BASE, RELEASED)
    eng.launch(0, "r", None, None)
    saves = eng.counts["evict_saves"]
    for _ in range(3):
        assert eng.evict_from_operation(BASE)
        assert wait_state(eng, BASE, RELEASED)
        eng.launch(0, "r", None, None)
    c = eng.counts
    assert c["evict_saves"] == saves and c["digest_skips"] == 3 and c["digest_backoff_saves"] == 0
    assert BASE not in eng._backoff and ops.device[BASE] == b"initialised"
    eng.close()


def test_a_write_the_predictor_did_not_see_is_caught_by_the_digest():
    """A clean record (loaded, only read as predicted) that a kernel wrote anyway: without a
    digest the save would be skipped and the write lost; with one it is saved."""
    eng, ops, agent = cycle()
    eng.launch(0, "r", None, None)
    assert wait_state(eng, BASE, RESIDENT)
    eng.clean.add(BASE)  # as after a load and reads only
    ops.device[BASE] = b"written through a const pointer"
    assert eng.evict_from_operation(BASE)
    assert wait_state(eng, BASE, RELEASED)
    assert eng.counts["evict_saves"] == 2 and eng.counts["digest_changed"] == 1
    eng.launch(0, "r", None, None)
    assert ops.device[BASE] == b"written through a const pointer"
    eng.close()


def test_an_operation_during_the_check_cancels_the_eviction_and_keeps_the_digest():
    eng, ops, _ = cycle()
    ops.auto = False
    assert eng.evict_from_operation(BASE)
    for _ in range(300):
        if ops.calls("digest")[1:] and ops.calls("record"):
            break
        threading.Event().wait(0.01)
    eng.access("cuMemsetD8Async", 0, BASE + 64)  # the program writes it: it stays
    ops.auto = True
    ops.finish(*range(1000))
    eng.close()
    assert eng.state(BASE) == RESIDENT and not ops.calls("release")[1:]
    assert eng.counts["evictions_cancelled"] == 1 and eng.counts["digest_skips"] == 0


def test_no_digest_switch_keeps_the_predictions_rules(monkeypatch):
    monkeypatch.setattr(FakeAgent, "engine_settings", EngineSettings(digest=False), raising=False)
    eng, ops, _ = cycle()
    assert ops.prepared == 0 and ops.inits == 0 and not ops.calls("digest")
    assert eng.evict_from_operation(BASE)
    assert wait_state(eng, BASE, RELEASED)
    assert eng.counts["evict_saves"] == 2 and eng.stats()["digest"].startswith("off")
    eng.close()


def test_without_nvrtc_the_engine_says_so_once_and_saves(capsys):
    eng, ops, _ = cycle(init_error="no NVRTC: libnvrtc.so.13 not found")
    for _ in range(2):
        eng.launch(0, "r", None, None)
        assert eng.evict_from_operation(BASE)
        assert wait_state(eng, BASE, RELEASED)
    err = capsys.readouterr().err
    assert err.count("no GPU digests") == 1 and "libnvrtc" in err
    assert ops.inits == 1 and not ops.calls("digest") and eng.counts["evict_saves"] == 3
    assert eng.stats()["digest"].startswith("unavailable: no NVRTC")
    eng.close()


@pytest.mark.parametrize("size", [64 * 1024, 64 * MIB])
def test_small_records_get_no_digest(size):
    eng, ops, _ = cycle(size=size)
    assert bool(ops.calls("digest")) == (size >= (256 << 10))
    eng.close()


def test_executor_summary_reports_the_digests():
    from gpuos_tools.sched.executor import Executor

    eng, ops, _ = cycle()
    assert eng.evict_from_operation(BASE)
    assert wait_state(eng, BASE, RELEASED)

    class Lib:
        def stats(self):
            return {"mallocs": 1, "frees": 0, "reserved_bytes": 64 * MIB}

        def table(self):
            return [Rec(BASE, 64 * MIB)]

    s = Executor(eng, {"budget": 1 << 30}, lib=Lib()).summary()
    assert s["digest"] == "on" and s["digest_skips"] == 1 and s["digests"] == 2
    assert s["bytes_not_written_back"] == 64 * MIB
    eng.close()


def test_the_digests_definition_sees_order_shifts_tails_and_lengths():
    import numpy as np

    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 4099, dtype=np.uint8).tobytes()
    d = digest_reference(data)
    assert len(d) == 16 and d == digest_reference(bytes(data))
    swapped = data[8:16] + data[:8] + data[16:]
    shifted = data[-8:] + data[:-8]
    tail = data[:-1] + bytes([data[-1] ^ 0x80])
    variants = [swapped, shifted, tail, data + b"\0", data[:-1], data[:4096]]
    digests = {digest_reference(v) for v in variants} | {d}
    assert len(digests) == len(variants) + 1
    # zeros of different lengths differ (the length is mixed in), a word's lanes independent
    assert digest_reference(b"\0" * 8) != digest_reference(b"\0" * 16)
    assert digest_reference(b"") != digest_reference(b"\0")


def test_after_a_change_the_next_evictions_save_without_digests_then_it_is_checked_again():
    """Back-off: a record found changed twice in a row saves its next BACKOFF[0] evictions at
    once (no digest at their loads or evictions), then is checked again; each further change
    doubles the run; an unchanged check ends it."""

    eng, ops, _ = cycle()

    def evict_and_load(change: bytes | None):
        if change is not None:
            ops.device[BASE] = change
        assert eng.evict_from_operation(BASE)
        assert wait_state(eng, BASE, RELEASED)
        eng.launch(0, "r", None, None)

    evict_and_load(b"v0")  # checked: changed once -> marked, checked again
    assert eng.counts["digest_changed"] == 1 and eng._backoff[BASE] == [0, 0] and BASE in eng.digests
    evict_and_load(b"v1")  # checked: changed again -> a run of BACKOFF[0] direct saves
    assert eng.counts["digest_changed"] == 2 and eng._backoff[BASE] == [BACKOFF[0], BACKOFF[0]]
    n_dig = len(ops.calls("digest"))
    for i in range(BACKOFF[0]):
        evict_and_load(b"v%d" % (i + 2))
        # none at the evictions, nor at the loads but the last (the next eviction is checked)
        assert len(ops.calls("digest")) == n_dig + (i == BACKOFF[0] - 1)
    assert eng.counts["digest_backoff_saves"] == BACKOFF[0]
    # the last load of the run took the host copy's digest again: this eviction is checked
    assert BASE in eng.digests and eng._backoff[BASE][0] == 0
    evict_and_load(b"changed again")
    assert eng.counts["digest_changed"] == 3 and eng._backoff[BASE] == [2 * BACKOFF[0]] * 2
    for _ in range(2 * BACKOFF[0]):
        evict_and_load(None)  # unchanged, but saved without a check during the run
    assert eng.counts["digest_skips"] == 0
    evict_and_load(None)  # checked: unchanged -> skipped, the back-off ends
    assert eng.counts["digest_skips"] == 1 and BASE not in eng._backoff
    saves = eng.counts["evict_saves"]
    evict_and_load(None)
    assert eng.counts["digest_skips"] == 2 and eng.counts["evict_saves"] == saves
    # every save kept the device's bytes: the host copy is what was last written
    assert ops.device[BASE] == b"changed again"
    eng.close()


def test_the_back_off_run_is_capped():

    eng, ops, _ = cycle()
    k = 0
    while True:
        k += 1
        ops.device[BASE] = b"w%d" % k
        assert eng.evict_from_operation(BASE)
        assert wait_state(eng, BASE, RELEASED)
        eng.launch(0, "r", None, None)
        if eng._backoff.get(BASE, [0, 0])[1] == BACKOFF[1] or k > 500:
            break
    assert eng._backoff[BASE][1] == BACKOFF[1] and eng.counts["digest_skips"] == 0
    changed = eng.counts["digest_changed"]
    for _ in range(BACKOFF[1] + 1):
        k += 1
        ops.device[BASE] = b"w%d" % k
        assert eng.evict_from_operation(BASE)
        assert wait_state(eng, BASE, RELEASED)
        eng.launch(0, "r", None, None)
    assert eng.counts["digest_changed"] == changed + 1 and eng._backoff[BASE][1] == BACKOFF[1]
    eng.close()
