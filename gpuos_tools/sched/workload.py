"""Access streams as the simulator sees them: jobs made of steps, memory made of chunks.

A step is one operation that ran on the GPU: a kernel launch, a memcpy, a memset or a graph
launch, in trace order, with the chunks it needs resident (its working set), the chunks it may
write, the chunks freed just before it, and an estimate of how long it computes.

A chunk is the unit of residency: an allocation of S bytes is cut into ceil(S / `--chunk`)
chunks (the last one shorter; an allocation smaller than a chunk is one chunk of its own size),
at most 65,536 of them: a larger allocation gets chunks of a multiple of `--chunk`.
An access entry (allocation, offset, size) needs every chunk its byte range overlaps, so both
`--granularity alloc` and `--granularity range` predictions work, and a range inside a large
allocation needs only its part. `--chunk alloc` makes every allocation one chunk.

Only device memory counts: allocations of kind `host` (pinned host memory) never occupy the
GPU, and access entries naming them, or naming no live allocation, are left out. Launches
captured into a CUDA graph (`captured`) did not run when they were recorded and are not steps;
the graph launch that runs them is.

An `unknown` access (the launch may touch any memory) is made safe here, the same for every
policy: its working set, and its writes, are every chunk of every live device allocation of
its job at that moment.

Compute time per step (`--kernel-time`): `gaps` (the default) takes the time from the step's
record to the job's next step record (the trace's `ts`: the access record's own, else that of
the launch, memcpy or memset record before it), capped at `--gap-cap` (1 ms), because
a longer gap is the host doing something else (start-up, library initialisation, Python) while
the GPU idles; the last step gets the median of the others. A duration instead gives every step
that time. Neither is measured kernel time: a trace records when work was submitted, not how
long it ran, so the estimates are relative (the same compute under every policy).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpuos_tools.access import Predictor
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.stream import open_input

#: The record types that become steps.
STEP_OPS = ("launch", "memcpy", "memset", "graph_launch")
#: The most chunks one allocation is cut into: a larger allocation gets larger chunks (a multiple
#: of `--chunk`), so that one huge allocation cannot make the simulator work or allocate per
#: 2 MiB of it (a 256 TiB allocation is 65,536 chunks of 4 GiB, not 134 million of 2 MiB).
MAX_CHUNKS_PER_ALLOC = 1 << 16


@dataclass(slots=True)
class Step:
    """One operation of one job, in the order it ran."""

    job: int
    of: str  #: launch | memcpy | memset | graph_launch
    ref: int | None  #: the launch's seq, or the 1-based index of the memcpy/memset/graph_launch
    ws: tuple[int, ...]  #: chunks that must be resident while it runs
    writes: tuple[int, ...]  #: chunks it may write (a subset of ws)
    frees: tuple[int, ...] = ()  #: chunks whose allocation was freed before this step
    compute: float = 0.0  #: estimated run time in seconds
    unknown: bool = False  #: the access was unknown: ws is all of the job's live memory
    kernel: str | None = None
    #: chunks it overwrites whole without reading them: every byte inside an exact write (a
    #: copy's or memset's) and no predicted read range touching it (what it finds there is dead)
    covers: tuple[int, ...] = ()

    def label(self) -> dict[str, Any]:
        """How a schedule record names this step: job, of, seq or index."""
        key = "seq" if self.of == "launch" else "index"
        return {"job": self.job, "of": self.of, key: self.ref}


@dataclass(slots=True)
class Chunks:
    """Every chunk of every job: its size and where it lies, indexed by chunk id."""

    chunk: int | None  #: bytes per chunk; None: whole allocations
    sizes: list[int] = field(default_factory=list)
    job: list[int] = field(default_factory=list)
    alloc: list[int] = field(default_factory=list)
    offset: list[int] = field(default_factory=list)

    def step_for(self, size: int) -> int:
        """Bytes per chunk of an allocation of ``size`` bytes: ``chunk``, or more (a multiple of
        it) where that would cut the allocation into more than MAX_CHUNKS_PER_ALLOC chunks."""
        step = self.chunk if self.chunk else max(size, 1)
        if size > step * MAX_CHUNKS_PER_ALLOC:
            step *= -(-size // (step * MAX_CHUNKS_PER_ALLOC))
        return step

    def add_allocation(self, job: int, alloc_id: int, size: int) -> tuple[int, int]:
        """Cut an allocation into chunks; return (first chunk id, count)."""
        base = len(self.sizes)
        step = self.step_for(size)
        n = max(1, -(-size // step))
        for k in range(n):
            self.sizes.append(max(1, min(step, size - k * step)))
            self.job.append(job)
            self.alloc.append(alloc_id)
            self.offset.append(k * step)
        return base, n

    def __len__(self) -> int:
        return len(self.sizes)


@dataclass(slots=True)
class Job:
    """The steps of one access stream, with what was left out of them."""

    index: int
    source: str
    steps: list[Step] = field(default_factory=list)
    peak_bytes: int = 0  #: the most device memory its live allocations held at once
    skipped_entries: int = 0  #: access entries naming host memory or no live allocation
    captured: int = 0  #: captured launches (not steps)


class _Live:
    """One job's live device allocations while its stream is read."""

    def __init__(self, chunks: Chunks, job: int) -> None:
        self.chunks = chunks
        self.job = job
        self.by_id: dict[int, tuple[int, int, int]] = {}  # alloc id -> (first chunk, count, size)
        self.addr_of: dict[int, int | None] = {}  # alloc id -> start address
        self.by_addr: dict[int, int] = {}  # start address -> alloc id
        self.bytes = 0
        self.peak = 0
        self._all: tuple[int, ...] | None = None  # all_chunks, until the next alloc or free

    def alloc(self, rec: dict[str, Any], pending_frees: list[int]) -> None:
        if rec.get("kind") == "host":
            return
        addr = rec.get("addr")
        old = self.by_addr.get(addr) if addr is not None else None
        if old is not None:  # the trace missed its free: the address is reused
            self._free(old, pending_frees)
        size = int(rec.get("size") or 0)
        first, n = self.chunks.add_allocation(self.job, rec["id"], size)
        self.by_id[rec["id"]] = (first, n, size)
        self._all = None
        self.addr_of[rec["id"]] = addr
        if addr is not None:
            self.by_addr[addr] = rec["id"]
        self.bytes += size
        self.peak = max(self.peak, self.bytes)

    def free(self, rec: dict[str, Any], pending_frees: list[int]) -> None:
        alloc_id = rec.get("id")
        if alloc_id is None and rec.get("addr") is not None:
            alloc_id = self.by_addr.get(rec["addr"])
        if alloc_id is not None and alloc_id in self.by_id:
            self._free(alloc_id, pending_frees)

    def _free(self, alloc_id: int, pending_frees: list[int]) -> None:
        first, n, size = self.by_id.pop(alloc_id)
        self._all = None
        addr = self.addr_of.pop(alloc_id, None)
        if addr is not None and self.by_addr.get(addr) == alloc_id:
            del self.by_addr[addr]
        self.bytes -= size
        pending_frees.extend(range(first, first + n))

    def all_chunks(self) -> tuple[int, ...]:
        """Every chunk of every live allocation: one tuple shared by the unknown steps between
        two allocation changes, not one copy per step."""
        if self._all is None:
            out: list[int] = []
            for first, n, _ in self.by_id.values():
                out.extend(range(first, first + n))
            self._all = tuple(out)
        return self._all


def load_job(
    records: Iterable[dict[str, Any]],
    chunks: Chunks,
    index: int = 0,
    source: str = "-",
    kernel_time: str | float = "gaps",
    gap_cap: float = 1e-3,
) -> Job:
    """Read one access stream (gpu-predict-access output) into a Job whose chunks go in ``chunks``."""
    job = Job(index, source)
    live = _Live(chunks, index)
    chunk = chunks.chunk
    pending_frees: list[int] = []
    stamps: list[int | None] = []
    last_ts: int | None = None
    last_ref: tuple[str, Any] | None = None
    for rec in records:
        kind = rec["type"]
        if kind in STEP_OPS:
            last_ts = rec.get("ts")
        elif kind == "alloc":
            live.alloc(rec, pending_frees)
        elif kind == "free":
            live.free(rec, pending_frees)
        elif kind == "access":
            if rec.get("captured"):
                job.captured += 1
                continue
            of = rec.get("of", "launch")
            ref = rec.get("seq") if of == "launch" else rec.get("index")
            if ref is not None and (of, ref) == last_ref:
                raise GpuosError(
                    f"{source}: two access records in a row for {of} {ref} (was the stream predicted "
                    "twice? gpu-predict-access replaces the access records of its input)", ExitCode.BAD_INPUT)
            last_ref = (of, ref)
            if rec.get("unknown"):
                ws = writes = live.all_chunks()
                unknown = True
            else:
                ws_list: dict[int, None] = {}
                wr_list: dict[int, None] = {}
                spans: dict[int, list[tuple[int, int]]] = {}  # chunk -> the write ranges in it
                for target, entries in ((ws_list, rec.get("reads") or ()), (wr_list, rec.get("writes") or ())):
                    for e in entries:
                        got = live.by_id.get(e.get("alloc"))
                        if got is None:
                            job.skipped_entries += 1
                            continue
                        first, n, whole = got
                        off = int(e.get("offset") or 0)
                        size = int(e.get("size") or 0)
                        if size <= 0:
                            continue
                        if chunk:
                            step = chunks.step_for(whole)
                            lo = min(off // step, n - 1)
                            hi = min((off + size - 1) // step, n - 1)
                        else:
                            lo = hi = 0
                        for c in range(first + lo, first + hi + 1):
                            target[c] = None
                            if target is wr_list:
                                spans.setdefault(c, []).append((off, off + size))
                # only a copy's or memset's write is exact; a launch's (from its pointer to the end
                # of the allocation, in the decoded direction) bounds it from above and proves nothing
                covers = () if of not in ("memcpy", "memset") else tuple(
                    c for c in wr_list if c not in ws_list and _covered(chunks, c, spans[c]))
                for c in wr_list:
                    ws_list[c] = None
                ws = tuple(ws_list)
                writes = tuple(wr_list)
                unknown = False
            job.steps.append(
                Step(index, of, ref, ws, writes, tuple(pending_frees), 0.0, unknown, rec.get("kernel"),
                     () if unknown else covers)
            )
            pending_frees = []
            stamps.append(rec.get("ts", last_ts))  # access records carry their own ts
    job.peak_bytes = live.peak
    _estimate_compute(job.steps, stamps, kernel_time, gap_cap)
    return job


def _covered(chunks: Chunks, c: int, spans: list[tuple[int, int]]) -> bool:
    """Whether the byte ranges ``spans`` (offsets in the allocation) cover chunk ``c`` whole."""
    at, end = chunks.offset[c], chunks.offset[c] + chunks.sizes[c]
    for a, b in sorted(spans):
        if a > at:
            return False
        at = max(at, b)
        if at >= end:
            return True
    return False


def _estimate_compute(steps: list[Step], stamps: list[int | None], kernel_time: str | float, gap_cap: float) -> None:
    if not steps:
        return
    if kernel_time != "gaps":
        for st in steps:
            st.compute = float(kernel_time)
        return
    gaps: list[float] = []
    for k in range(len(steps) - 1):
        a, b = stamps[k], stamps[k + 1]
        gap = 0.0 if a is None or b is None else max(0.0, (b - a) * 1e-9)
        gaps.append(min(gap, gap_cap))
    gaps.append(statistics.median(gaps) if gaps else 0.0)
    for st, gap in zip(steps, gaps, strict=True):
        st.compute = gap


@dataclass(slots=True)
class Workload:
    """Every job's steps interleaved into the one order the GPU runs them in."""

    chunks: Chunks
    jobs: list[Job]
    steps: list[Step]
    switches: list[int]  #: indices into steps where the GPU switches to another job
    footprint: int = 0  #: peak bytes resident with no budget (see `working_footprint`)


def working_footprint(steps: list[Step], sizes: list[int]) -> int:
    """The most memory resident at once with an unlimited budget: every chunk from its first
    use until its allocation is freed. This, not the allocations' total, is what a percentage
    budget is of: memory that is allocated but never touched (cuBLAS workspaces, pools) needs
    no room, so oversubscription is measured against memory that is used."""
    seen = bytearray(len(sizes))
    now = peak = 0
    for st in steps:
        for c in st.frees:
            if seen[c] == 1:
                seen[c] = 2
                now -= sizes[c]
        for c in st.ws:
            if seen[c] != 1:
                seen[c] = 1
                now += sizes[c]
        peak = max(peak, now)
    return peak


def interleave(chunks: Chunks, jobs: list[Job], time_slice: float) -> Workload:
    """Round-robin time slicing: each job runs steps until its slice of estimated compute time
    is used up (at least one step), then the next job with steps left runs. One job: no switches.
    """
    if len(jobs) <= 1:
        only = list(jobs[0].steps) if jobs else []
        return Workload(chunks, jobs, only, [], working_footprint(only, chunks.sizes))
    pos = [0] * len(jobs)
    steps: list[Step] = []
    switches: list[int] = []
    current = -1
    remaining = sum(len(j.steps) for j in jobs)
    turn = 0
    while remaining:
        j = jobs[turn % len(jobs)]
        turn += 1
        if pos[j.index] >= len(j.steps):
            continue
        if current != -1 and current != j.index:
            switches.append(len(steps))
        current = j.index
        used = 0.0
        while pos[j.index] < len(j.steps):
            st = j.steps[pos[j.index]]
            steps.append(st)
            pos[j.index] += 1
            remaining -= 1
            used += st.compute
            if used >= time_slice:
                break
    return Workload(chunks, jobs, steps, switches, working_footprint(steps, chunks.sizes))


def trace_workload(path: Any, name: str, copies: int = 1, chunk: int | None = None) -> Workload:
    """A recorded trace as one job: predicted at range granularity, cut into ``chunk``-byte records
    (None: whole allocations), its steps repeated ``copies`` times (a loop repeating its step; a
    trace that frees memory repeats its frees)."""
    with open_input(path) as reader:
        access = list(Predictor("range").annotate(list(reader)))
    chunks = Chunks(chunk)
    job = load_job(access, chunks, 0, name)
    job.steps = job.steps * copies
    return Workload(chunks, [job], job.steps, [], working_footprint(job.steps, chunks.sizes))
