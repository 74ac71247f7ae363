"""Planning and simulating which memory is on the GPU when, under a budget below a job's needs.

prefetch     policy, step (0-based position in the run), for {job, of, seq|index} (the step it
             prepares), job, alloc, offset, size, copy (true: copied from host memory; false:
             memory never written, made resident with nothing to copy), start_s, end_s
evict        policy, step, for {job, of, seq|index} (the step that needed the room), job,
             alloc, offset, size, writeback (true: copied to host memory first; false: the
             host copy is current, so it is dropped), start_s, end_s
stall        policy, step, for {job, of, seq|index}, wait_s (how long the GPU waited before
             the step for its memory, over-budget fault time included), at_s
switch       policy, step (the first step of the incoming job), from, to (job numbers), at_s
sched_summary  policy (belady|lru|demand), budget, footprint, chunk, jobs, steps, launches,
             switches, unknown, bytes_in, bytes_out, bytes_dropped, first_touch_bytes, loads,
             evictions, faults, stalls, stall_s, over_budget, over_budget_bytes, peak_resident,
             lookahead, compute_s, est_s, floor_s, in_memory_s, speed_vs_in_memory,
             est_vs_floor, per_job [{job, source, steps, compute_s, stall_s}]

Times (`*_s`) are simulated seconds from the start of the run. `alloc` is the allocation id of
the input stream of job `job` (jobs are numbered from 0 in the order the inputs are given);
`offset` and `size` are bytes inside it, whole chunks merged into ranges. `for` names a step
the way gpu-predict-access's `access` records do: a launch by `seq`, a memcpy, memset or
graph_launch by `index`.

In the summary, `bytes_in` and `bytes_out` are bytes copied host to device and device to host
(over-budget fault traffic included), `bytes_dropped` clean chunks evicted without a copy,
`first_touch_bytes` memory made resident with nothing to copy, `faults` page faults (demand
paging and over-budget steps), `stalls` the steps that waited, `over_budget` the steps whose
working set did not fit in the budget, `peak_resident` the most bytes resident at once (never
above the budget), `footprint` the most memory resident at once with no budget (what a
percentage budget is of), `floor_s` the transfer-bound floor and `in_memory_s` the time with
all memory resident.
"""

from gpuos_tools.sched.planner import (
    NEVER,
    PLANNERS,
    BeladyPlanner,
    Decision,
    LRUPlanner,
    Planner,
)
from gpuos_tools.sched.simulate import POLICIES, Config, simulate
from gpuos_tools.sched.workload import Chunks, Job, Step, Workload, interleave, load_job

__all__ = [
    "NEVER",
    "PLANNERS",
    "POLICIES",
    "BeladyPlanner",
    "Chunks",
    "Config",
    "Decision",
    "Job",
    "LRUPlanner",
    "Planner",
    "Step",
    "Workload",
    "interleave",
    "load_job",
    "simulate",
]
