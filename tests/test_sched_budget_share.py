"""What a percentage budget of `gpu-prefetch-sched run` is of: the steady working set.

The recorded PyTorch training step (tests/data/recorded/torch.ndjson.zst) run again and again
through the native core, the agent, the executor and the residency engine on the fake driver
(tests/test_sched_fast.py's harness), each launch writing its predicted outputs: at 66% of the
steady working set, records move in every steady step, and every record ends with the contents
the program last wrote.
"""

from __future__ import annotations

import sys
from pathlib import Path

from test_sched_executor import settle
from test_sched_fast import Job, library  # noqa: F401 -- the fixture: the native core's library, built once

RECORDED = Path(__file__).parent / "data" / "recorded"
STEPS = 8


class WritingJob(Job):
    """The harness's job whose launches, copies and memsets write: each record an operation writes
    gets new contents in the fake driver's device memory once the operation is issued, as the GPU
    would write it; ``expect`` is what each record must hold."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.expect = {r.base: self.ops.device[r.base] for r in self.recs}
        self.n = 0

    def _wrote(self, bases) -> None:
        self.n += 1
        for b in bases:
            assert self.ops.recs[b].resident, f"{b:#x} written while not mapped"
            self.ops.device[b] = self.expect[b] = b"w%d" % self.n

    def launch(self, rec: dict) -> bool:
        went = super().launch(rec)
        sizes, args = self.launch_args(rec)
        _, _, writes = self.agent.launch_touches(rec.get("kernel") or "", sizes, args)
        by_id = self.agent.by_id
        self._wrote({b for b in (self.base_of(by_id[i].addr) for i in writes if i in by_id) if b is not None})
        return went

    def write(self, rec: dict) -> bool:
        went = super().write(rec)
        b = self.base_of(rec["dst"])
        if b is not None:
            self._wrote([b])
        return went

    @staticmethod
    def launch_args(rec: dict):
        from test_native_core import launch_args

        return launch_args(rec)

    def held(self, b: int) -> bytes:
        """A record's contents: on the device, or in the engine's host copy."""
        r = self.ops.recs[b]
        return self.ops.device[b] if r.resident else self.ops.hostmem[self.ops.host(b, r.size)[0][0]]


def _run(library, tmp_path, monkeypatch, **kw) -> tuple[WritingJob, dict, list[int]]:
    monkeypatch.setattr(sys.modules["test_sched_fast"], "TRACE", RECORDED / "torch.ndjson.zst")
    job = WritingJob(library, tmp_path, monkeypatch, False, **kw)
    moves = []
    for _ in range(STEPS):
        n = job.ex.policy.stats.evictions + job.ex.policy.stats.prefetches + job.ex.policy.stats.demand_loads
        job.step()
        st = job.ex.policy.stats
        moves.append(st.evictions + st.prefetches + st.demand_loads - n)
    settle(job.eng, job.ex)
    return job, job.end(), moves


def test_a_percentage_budget_is_of_the_steady_working_set_and_moves_keep_the_contents(library, tmp_path, monkeypatch):
    job, s, moves = _run(library, tmp_path, monkeypatch, fraction=0.66)
    live = sum(r.size for r in job.recs)
    assert s["budget_of"] == "steady working set"
    assert 0 < s["steady_bytes"] < live  # start-up buffers and blocks the step does not touch left out
    assert s["budget"] == int(0.66 * s["steady_bytes"])
    assert min(moves[3:]) > 0, moves  # every steady step moves records
    assert s["evictions"] > 0 and s["loads"] > 0 and s["bytes_in"] > 0
    # the budget shrank when the period was learned: once the evictions brought the mapped
    # memory under it, it stayed there
    assert s["executor"]["settled"] >= 1 and s["peak_settled"] <= s["budget"] and s["over_physical"] == 0, s
    for r in job.recs:
        assert job.held(r.base) == job.expect[r.base], f"{r.base:#x} lost a write"


def test_the_same_share_of_every_live_byte_moves_nothing_in_steady_state(library, tmp_path, monkeypatch):
    """The former meaning, as bytes: 66% of all the live owned bytes holds the whole step."""
    from test_native_core import records

    live = sum(r["size"] for r in records(RECORDED / "torch.ndjson.zst")
               if r["type"] == "alloc" and r.get("kind") == "device")
    job, s, moves = _run(library, tmp_path, monkeypatch, budget=int(0.66 * live))
    assert s["budget_of"] == "bytes" and s["budget"] == int(0.66 * live)
    assert sum(moves[3:]) == 0, moves
    for r in job.recs:
        assert job.held(r.base) == job.expect[r.base]
