"""The schedule as stream records: prefetch, evict, stall and switch records of one policy.

Chunks are merged back into byte ranges of allocations (consecutive chunks of one allocation
with the same kind of move become one record), so a record is something an executor can act on
with one copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from gpuos_tools.sched.planner import Decision
from gpuos_tools.sched.simulate import Config, Timing, simulate
from gpuos_tools.sched.workload import Chunks, Workload


def chunk_ranges(ids: list[int], chunks: Chunks) -> Iterator[tuple[int, int, int, int, int, int]]:
    """(job, alloc, offset, size, first index, last index + 1) for runs of consecutive chunks."""
    i = 0
    n = len(ids)
    while i < n:
        c = ids[i]
        j = i + 1
        while j < n and ids[j] == ids[j - 1] + 1 and chunks.alloc[ids[j]] == chunks.alloc[c] and chunks.job[ids[j]] == chunks.job[c]:
            j += 1
        size = sum(chunks.sizes[k] for k in ids[i:j])
        yield chunks.job[c], chunks.alloc[c], chunks.offset[c], size, i, j
        i = j


def write_schedule(
    w: Workload, policy: str, cfg: Config, write: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Simulate ``policy``, passing each schedule record to ``write``; return the summary."""
    chunks = w.chunks
    steps = w.steps
    switches = set(w.switches)

    def observe(i: int, d: Decision, t: Timing) -> None:
        st = steps[i]
        label = st.label()
        if i in switches:
            write({"type": "switch", "policy": policy, "step": i, "from": steps[i - 1].job, "to": st.job,
                   "at_s": t.start - t.stall})  # fmt: skip
        if d.evicts:
            wb = d.writeback
            k = 0
            while k < len(d.evicts):
                # split the victims where the write-back flag changes, then into ranges
                m = k + 1
                while m < len(d.evicts) and wb[m] == wb[k]:
                    m += 1
                part = d.evicts[k:m]
                for job, alloc, offset, size, a, b in chunk_ranges(part, chunks):
                    times = t.evict_times[k + a : k + b]
                    write({"type": "evict", "policy": policy, "step": i, "for": label, "job": job,
                           "alloc": alloc, "offset": offset, "size": size, "writeback": wb[k],
                           "start_s": min(x[0] for x in times), "end_s": max(x[1] for x in times)})  # fmt: skip
                k = m
        if d.loads:
            total = sum(chunks.sizes[c] for c in d.loads)
            span = t.load_end - t.load_start
            done = 0
            for job, alloc, offset, size, _, _ in chunk_ranges(d.loads, chunks):
                start = t.load_start + span * done / total
                done += size
                write({"type": "prefetch", "policy": policy, "step": i, "for": label, "job": job,
                       "alloc": alloc, "offset": offset, "size": size, "copy": True,
                       "start_s": start, "end_s": t.load_start + span * done / total})  # fmt: skip
        if d.first:
            for job, alloc, offset, size, _, _ in chunk_ranges(d.first, chunks):
                write({"type": "prefetch", "policy": policy, "step": i, "for": label, "job": job,
                       "alloc": alloc, "offset": offset, "size": size, "copy": False,
                       "start_s": t.room, "end_s": t.room})  # fmt: skip
        if t.stall > 0:
            write({"type": "stall", "policy": policy, "step": i, "for": label, "wait_s": t.stall,
                   "at_s": t.start - t.stall})  # fmt: skip

    return simulate(w, policy, cfg, observe)
