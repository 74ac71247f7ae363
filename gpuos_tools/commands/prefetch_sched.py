"""gpu-prefetch-sched: which memory to prefetch and evict before each kernel, under a budget."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import IO

import click
import typer
from typer.core import TyperGroup

from gpuos_tools import figures
from gpuos_tools.commands.cli import OutputOpt, UnbufferedOpt, report_run, run_app, warn, with_progress
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.injection.config import OnlineConfig, ServeConfig
from gpuos_tools.memory import owned
from gpuos_tools.sched import __doc__ as _sched_doc
from gpuos_tools.sched.online import POLICIES
from gpuos_tools.sched.online import __doc__ as _online_doc
from gpuos_tools.sched.plot import load_timeline, plot_timeline
from gpuos_tools.sched.serve import serve_jobs
from gpuos_tools.stream import make_header, open_output
from gpuos_tools.trace import run as launcher
from gpuos_tools.units import parse_budget_spec, parse_duration
from gpuos_tools.sched.planner import __doc__ as _planner_doc
from gpuos_tools.sched.simulate import __doc__ as _simulate_doc
from gpuos_tools.sched.workload import __doc__ as _workload_doc

_RECORDS, _FIELDS = _sched_doc.split("\n\n", 2)[1:]


MAN_SECTIONS = {
    "BUDGET": (
        "`--budget` is the most device memory the job(s) may hold at once. Units: a plain number "
        "is bytes; `B`; binary `KiB`, `MiB`, `GiB`, `TiB` (the bare letters `K`, `M`, `G`, `T` "
        "mean the same); decimal `KB`, `MB`, `GB`, `TB`; `N%` is a percentage of the footprint: "
        "the most memory resident at once with no budget (every chunk from its first use until "
        "its allocation is freed). The footprint is not the total allocated: memory that is "
        "allocated but never used (workspaces, pools) needs no room. `--budget 66%` is 150% "
        "oversubscription.\n\n"
        "Bandwidths (`--bw`, `--um-evict-bw`) are sizes per second (`50.5GB/s`); durations take "
        "`ns`, `us`, `ms` or `s`."
    ),
    "MEMORY AND STEPS": _workload_doc.split("\n\n", 1)[1].strip("\n"),
    "POLICIES": _planner_doc.split("\n\n", 1)[1].strip("\n"),
    "TIME MODEL": _simulate_doc.split("\n\n", 1)[1].strip("\n"),
    "SAFETY": (
        "- An `unknown` access (a launch whose buffers could not be bounded, every graph launch) "
        "needs every live device allocation of its job resident while it runs. These steps are "
        "counted (`unknown`).\n"
        "- When a working set is larger than the budget (an unknown step of a job bigger than the "
        "budget, or one huge kernel), it cannot be resident at once: the step is counted in "
        "`over_budget` and what did not fit is charged as demand paging. `peak_resident` never "
        "exceeds the budget.\n"
        "- Dirty chunks are written back before eviction; only chunks whose host copy is current "
        "(or whose allocation was freed) are dropped. In `simulate`, dirtiness comes from the "
        "predicted writes, which count every non-const pointer as written; `run` compares GPU "
        "digests of the record instead (ONLINE EXECUTION).\n"
        "- `simulate` runs nothing on a GPU, and validates nothing: the schedule is as good as "
        "the predictions and the time model.\n"
        "- `run`: a launch runs only once every record it is predicted to touch is mapped and "
        "loaded (its stream waits on the GPU); an unknown launch or a graph launch gets every "
        "owned record, over the budget if need be. A kernel that reaches memory by a pointer the "
        "prediction does not see (a pointer stored in device memory, an address computed from "
        "another buffer's) would fault on a released record: such launches must come out "
        "unknown, which is the predictor's rule. A write the prediction did not show is caught at run "
        "time when it is not lost: a record loaded from the engine's host copy and not predicted "
        "written since whose digest changed by its eviction is a `mismatch` (counted, and named in "
        "the summary); the kernels predicted to read it since its load (else every kernel launched "
        "since) become `conservative`: from then on each of their launches is unknown (every owned "
        "record resident, over the budget if need be) and counts as writing every resident record, "
        "so the evictions after it save without consulting a digest. Reads outside a prediction "
        "cannot be caught that way (on a released record they fault). The rule needs the digest to "
        "find the first write: with `GPUOS_ENGINE_NO_DIGEST=1` (or no NVRTC) nothing is found and the "
        "predictions are trusted (such a write to a record under 256 KiB, or with the check off, is "
        "lost); while a record's check is backed off its evictions save anyway and a write is found "
        "at its next check; a kernel made conservative stays so if the check is backed off or turned "
        "off later. Memory the program did not allocate through CuPy or PyTorch "
        "(cuBLAS or cuFFT workspaces) is not owned and never moved. The budget is our own, below "
        "the GPU's memory: no managed memory is used."
    ),
    "ONLINE EXECUTION": (
        "`gpu-prefetch-sched run --budget SIZE|N% -- PROGRAM` starts PROGRAM under the agent "
        "(`gpu-trace run --agent`, python callback path) with its CuPy and PyTorch allocations owned "
        "(`GPUOS_AGENT_OWN=1`: every buffer, or segment of small ones, is a record at a fixed "
        "address whose physical memory can be saved, released and mapped again). The unit of "
        "residency is the record. A percentage budget is that share of the program's owned memory "
        "at each decision.\n\n"
        + _online_doc.split("\n\n", 1)[1].split("\n\nWhy not", 1)[0].strip("\n")
        + "\n\nThe moves go through the agent's residency engine: an eviction's save is ordered "
        "on the GPU after everything the program has enqueued and runs on the engine's evict "
        "stream, its release follows once the save is done; prefetches run on "
        "another stream from a mover thread, each once there is room for it; an operation's stream "
        "waits on the GPU for the loads of its records. The budget holds mapped memory: a record "
        "counts until its release, so a load that needs room waits on the host for evictions in "
        "flight (a stall, counted). The program's own allocations are mapped at once and can take "
        "the memory above the budget until its next launch evicts.\n\n"
        "Write-backs of unchanged records are skipped by a GPU digest: when a record is loaded "
        "from the engine's own host copy, a small kernel (NVRTC, compiled once per run) takes a "
        "128-bit digest of its device bytes before the program can touch it; at its next "
        "eviction the digest is taken again, after the program's last use, and compared: equal, "
        "the record is released without a save; different, it is saved. The predictor cannot "
        "tell reads from writes in CuPy's kernels (extern \"C\", no parameter types: every "
        "array argument counts as written), and a kernel may write through a `const` pointer; the "
        "digest sees the bytes. The risk: a change that leaves both 64-bit lanes of the digest "
        "equal (each lane a sum of a 64-bit finaliser of every 8-byte word mixed with its index) "
        "would keep the stale host copy, about 2^-64 per lane and eviction for changes not made "
        "to collide. Records under 256 KiB are saved without a digest. A changed record's save waits "
        "for the comparison (a host round trip), so after a check finds a record changed its "
        "next 4 evictions save at once without digests, then it is checked again (each further "
        "change doubles the run, up to 32; an unchanged check ends it). `GPUOS_ENGINE_NO_DIGEST=1` "
        "turns the check off (then a record loaded from the host copy and not predicted written "
        "since is released without a save, and all others are saved); without NVRTC the engine "
        "says so once on standard error and goes on the same way. The summary counts `digests` "
        "(kernels run), `digest_skips`, `bytes_not_written_back` (every eviction without a save), "
        "and `digest` (on, off, or why unavailable).\n\n"
        "A record found changed although no launch since its load was predicted to write it is a "
        "mismatch (SAFETY): the summary counts `mismatches` and lists the `conservative` kernels "
        "(unknown since; their `kernels` row says why), `engine.mismatch` logs the first 64 (record, "
        "bytes, kernels, found: predicted to read it / launched since its load, evictions and "
        "launches so far), and standard error says it once per new kernel. "
        "`GPUOS_ENGINE_NO_CONSERVE=1` reports mismatches without acting on them, and "
        "`GPUOS_ENGINE_DIGEST_OFF_AFTER=N` turns the check off after the Nth (both for tests: what "
        "the rule alone keeps).\n\n"
        "Parked memory: creating and releasing physical memory makes the driver clear it on a copy "
        "engine, which halves host-to-device copies meanwhile. So an evicted record's physical "
        "memory stays parked (unmapped, kept) and the next load of a record of the same size maps "
        "it again. Parked bytes count against the budget. When a load needs room that only "
        "parked memory of other sizes holds, all of it goes back to the driver first. The summary's "
        "`park` gives parked bytes, reuses and releases. `GPUOS_ENGINE_NO_PARK=1` turns it off; "
        "serve's jobs do not park.\n\n"
        "The record on standard output at the end, `sched_summary` with `mode` online: policy, "
        "lookahead, budget (the largest a decision used), fraction, footprint (owned bytes at the "
        "end), launches (operations decided: launches, copies, memsets), unknown, bytes_in, "
        "bytes_out (copied host to device and device to host), loads, prefetches, demand_loads, "
        "evictions, evict_saves, stream_waits (operations made to wait on the GPU for a load), "
        "stalls (operations that found a record of theirs not resident), over_budget, "
        "over_budget_bytes, peak_resident (most mapped bytes after a decision), peak_settled (the "
        "same, counted from the first decision within the budget after the last allocation or "
        "over-budget launch), "
        "over_physical (decisions after that found the mapped bytes above the budget), "
        "peak_planned (the policy's own books), periods (the last 8 launch periods learned, in "
        "order), period_use ([period, operations decided with it known], the 8 most used: the "
        "period that governed the run), predicted "
        "(operations decided with a period known), wall_s, exit (the program's status), and "
        "`executor`, `policy_stats`, `engine` with the parts' own counters; `kernels`, what the "
        "predictions looked like (operations, unknown ones and unknown_share, no_owned: operations "
        "that touch no owned record, and per kernel or API name, the most frequent 40 and every "
        "unknown one: ops, unknown, mean_bytes of the records predicted, why it was unknown); "
        "`agent`, where the launch path's time went (launch_hooks, launch_hook_s, memo_misses, "
        "executor_s). A program can read the executor's counts so far with "
        "gpuos_tools.sched.executor.current_counts() (taken from sys.modules: None when it does not "
        "run under `run`), to know what moved inside a timed region.\n\n"
        "PyTorch: its allocations go through the owned allocator's stream-ordered cache "
        "(GPUOS_AGENT_OWN=1); blocks it caches stay owned records and are moved like live ones; "
        "small tensors share segments, and a segment is the unit of residency. cuBLAS's and "
        "cuDNN's workspaces are cudaMalloc'd past the allocator: not owned, never moved. The "
        "launch period is learned on each launch's kernel and its large records (segments of small "
        "blocks are left out of the key: their order need not repeat). Launches captured into a "
        "CUDA graph are not decided (they do not run then); a graph launch is an unknown operation "
        "(every record required); graph replay over owned PyTorch memory is not supported (the "
        "allocator has no private pool for captures). Measured on an H100: a transformers Llama "
        "decode and a CNN's training steps ran bit-identical to the job alone at 66%, 50% and 33% "
        "budgets with no unknown launch; both were bound by the python callback path (~0.1-0.2 ms "
        "per operation), not by the link (BENCHMARKS.md).\n\n"
        "Several programs at once: `serve` (SERVING). Not built yet: the native callback path (each "
        "operation pays the python agent's callback, ~0.1-0.3 ms). The fault-driven managed-memory "
        "baseline is in scripts/bench_online.py, not in this command."
    ),
    "SERVING": (
        "`gpu-prefetch-sched serve --budget SIZE [--slice 50ms] [--policy belady|lru] [--lookahead N] "
        "[--switch serial|overlap] [--json FILE] --job 'PROGRAM ARGS' --job ...` starts each job as "
        "`run` would (the agent, its "
        "CuPy memory owned, the online policy) and time-slices them on the GPU. `--budget` is bytes "
        "with a unit (see BUDGET; a percentage is refused, the jobs' footprint is not known before "
        "they run): the most owned memory ALL the jobs may hold mapped together. `--slice` is a "
        "duration (`ns`, `us`, `ms`, `s`). Each `--job` is one string split as a shell would "
        "(quotes, no expansion); its program must exist.\n\n"
        "The turn. One job holds it at a time; the others' program threads wait on the host at "
        "their next launch, copy or memset (not at frees) until granted, in the order they asked. "
        "Once the holder has held it for a slice and another job waits, it is asked to yield; at "
        "its next operation it evicts its records down to what the incoming job leaves room for "
        "(the incoming job's want: what it had mapped when it last ran), in its own Belady order "
        "(the record its learned period uses furthest ahead first, so what its next launches "
        "need goes last; LRU with `--policy lru`), waits until the releases have completed, and "
        "reports the bytes it keeps. If the jobs that wait hold too much for the incoming "
        "one, they are trimmed the same way, the one whose turn is furthest first. The incoming "
        "job is granted a budget of the total minus what the others keep, and before its "
        "operation goes on it prefetches its predicted next working sets (one period ahead, at "
        "least `--lookahead` launches) as far as that budget allows: the loads that fit are "
        "enqueued at once on the engine's prefetch stream, the rest follow as room comes. While "
        "it runs, its budget follows what the others keep (a job that starts, is trimmed or "
        "ends). A launch whose working set is larger than the holder's budget asks the "
        "coordinator to trim the waiting jobs for it. A job that ends, crashes or is killed "
        "leaves the rotation at once (its connection closes); a job alone never waits and is "
        "never asked to yield.\n\n"
        "`--switch overlap` (EXPERIMENTAL, MSched's switch): the outgoing job reports as soon as "
        "its evictions are issued and the incoming job is granted at once; its loads wait in the "
        "ledger (below) until the outgoing releases have completed, so saves and loads use both "
        "directions of the link at once. It is not the default. On an H200 (2026-11-24) its GPU "
        "test failed in 2 of 3 runs (a load waited 10 s and went over the budget; the serial "
        "switch failed once too, after evictions failed on a job's evict thread). Two fixes "
        "followed: the evict thread makes the program's context current, and a waiting job "
        "reports its in-flight bytes again. After them the serve test (overlap and serial) passed "
        "in 5 of 6 runs. The overlap was also not faster overall.\n\n"
        "Safety. Everything of SAFETY for `run` holds for each job. The jobs share one byte ledger "
        "(a small file, locked for every change): each job's owned bytes mapped, or about to be, "
        "are booked in it; a load is booked BEFORE its memory is mapped and only if all the jobs' "
        "bytes and it fit in the budget (else it waits while some job has evictions in flight or "
        "is exiting; when nothing is, the holder asks the coordinator for room, then evicts its "
        "own records outside the launch's working set, and only then, or after 10 s, loads over "
        "the budget, counted as forced); a release is taken off AFTER the unmap; a job that ended "
        "keeps its bytes booked until its process has been reaped. Memory a job allocates is "
        "mapped at once: it is booked when the job next looks at its records, and may take the "
        "sum above the budget (allocations are the program's) until the job's evictions bring "
        "it back. A job never waits for the turn holding the agent's lock (it waits before "
        "taking it), so the engine's threads and its own evictions go on. The preemption is "
        "cooperative: a job yields at its next operation after the request, so one that computes "
        "on the host for long keeps the turn meanwhile. The budget is our own, below the "
        "GPU's memory; nothing is oversubscribed in the driver.\n\n"
        "Output: a header, one `serve_job` record per job (job, argv, exit, ok, wall_s, turn_s "
        "(time holding the turn), grants, turn_waits and turn_wait_s (waits for the turn, "
        "seconds), switches (yields), trims, early_grants (grants made while another job's "
        "evictions were still in flight: 0 with the serial switch), budget_min and budget_max "
        "(budgets granted), bytes_in, bytes_out, evictions, prefetches, demand_loads, footprint, "
        "peak_settled, over_physical, turn_peak (the job's own largest mapped bytes while it held "
        "the turn), ledger_waits, forced_loads, evict_errors and evict_error (the engine's), "
        "throughput and throughput_unit (the job's own: a `throughput` field of the last JSON "
        "object line it printed, or its `steps` / `loop_s`), output (that line), summary (the "
        "job's `sched_summary` as `run` gives it, with `serve`: the job's turn counters)), then "
        "`serve_summary` (budget, slice_s, policy, lookahead, switch, switches, early_grants, "
        "wall_s, combined_peak (the ledger's largest sum of every job's booked bytes, taken under "
        "its lock at every increase: a bound of the jobs' true combined owned memory at any "
        "instant, allocations included), combined_peak_loads (the same over the increases made "
        "by loads: within the budget unless a load was forced), forced_loads, forced_over_max, "
        "unreserved_maps (maps the executor had not booked first), alloc_charges, errors). "
        "`--json FILE` writes the same as one object. A table goes to standard error. "
        "The exit status is 1 when any job failed (non-zero exit, or no summary)."
    ),
    "TIMELINE": (
        "`run --timeline FILE.json` writes the executor's event log at the end: a JSON object, "
        "`type` sched_timeline, with policy, lookahead, fraction, footprint, `summary` (the "
        "summary's scalar fields), `events` and `dropped`. Each event is `[t_s, kind, value]`, "
        "t_s in seconds from the executor's start: `mapped` (owned bytes mapped, measured after "
        "each decision and each prefetch), `budget` (the budget a decision used, when it "
        "changes), `evict` (a record's bytes, when its eviction was issued), `load` (bytes a "
        "launch's require loaded, at its issue), `prefetch` (a record's bytes, at the mover's "
        "issue), `wait` (a host wait for room: value in seconds, t_s its start). At most "
        "200000 events are kept; the rest are counted in `dropped`. Times are when moves were "
        "issued on the host, not when the copies ran on the GPU.\n\n"
        "`run --plot FILE.png` draws it at the end; `gpu-prefetch-sched plot FILE.json --plot "
        "FILE.png` draws a recorded one (on a machine without a GPU, too); `simulate --plot "
        "FILE.png` draws the `--schedule` policy's simulation the same way (simulated seconds, "
        "the moves of each step at their simulated start, its stall as a wait, the bytes "
        "resident in the planner's books after each step). Three panels on one "
        "time axis: mapped bytes against the budget and the footprint; bytes issued per time "
        "bin as bandwidth, host to device above zero (prefetches, loads at a launch) and device "
        "to host below (evictions); the host waits for room (the stalls, simulated). All three need matplotlib "
        "(`pip install 'gpuos-tools[plot]'`)."
    ),
    "NOTES": (
        "Every input of `simulate` is read to its end before anything is written: Belady needs "
        "the whole future of the sequence, and the round-robin order needs every job. Memory use "
        "grows with the number of steps and of chunks they use.\n\n"
        "`simulate` is the command when none is named, so `gpu-prefetch-sched --simulate ...` "
        "and `gpu-prefetch-sched simulate ...` are the same; without a command name `--simulate` "
        "is required, so that a mistyped command is not taken for a plan."
    ),
    "RECORDS": (
        "The output is a new stream (the input records are not repeated): a header, then the "
        "schedule of `--schedule`'s policy in step order, then one `sched_summary` per policy "
        "of `--compare`.\n\n"
        + "\n".join("    " + line for line in _RECORDS.splitlines())
        + "\n\n"
        + _FIELDS.strip("\n")
        + "\n\nOn a terminal the summaries are drawn as a table instead of the stream; when "
        "standard output is not a terminal and standard error is, the table also goes to "
        "standard error."
    ),
    "EXAMPLES": (
        "The main pipeline: trace, predict, plan under an 8 GiB budget:\n\n"
        "    gpu-trace run -- python3 train.py | gpu-predict-access | \\\n"
        "      gpu-prefetch-sched --simulate --budget 8GiB\n\n"
        "A recorded trace at 150% oversubscription, byte ranges, 64 KiB chunks, summaries only:\n\n"
        "    gpu-predict-access --granularity range train.ndjson.zst | \\\n"
        "      gpu-prefetch-sched --simulate --budget 66% --chunk 64KiB --schedule none\n\n"
        "Two jobs time-sliced on one GPU, 5 ms slices, H100 link figures:\n\n"
        "    gpu-prefetch-sched --simulate --budget 4GiB --slice 5ms --bw 40GB/s a.acc b.acc\n\n"
        "A CuPy job at 150% oversubscription, online, its trace kept:\n\n"
        "    gpu-prefetch-sched run --budget 66% -o job.ndjson.zst -- python3 solver.py | jq .\n\n"
        "The same, its timeline recorded on the GPU's machine and drawn elsewhere:\n\n"
        "    gpu-prefetch-sched run --budget 66% --timeline run.json -- python3 solver.py\n"
        "    gpu-prefetch-sched plot run.json --plot run.png\n\n"
        "Three CuPy jobs served together on one GPU under 4 GiB, 100 ms slices:\n\n"
        "    gpu-prefetch-sched serve --budget 4GiB --slice 100ms --json serve.json \\\n"
        "      --job 'python3 solver.py --n 1' --job 'python3 solver.py --n 2' --job 'python3 train.py'\n\n"
        "The evictions that are not write-backs:\n\n"
        "    gpu-prefetch-sched --simulate --budget 50% a.acc | jq -c 'select(.type==\"evict\" and (.writeback|not))'"
    ),
    "SEE ALSO": "gpu-predict-access(1), gpu-trace(1)",
}

class _DefaultSimulate(TyperGroup):
    """`simulate` is the command when none is named: `gpu-prefetch-sched --simulate --budget
    8GiB A.acc` keeps working beside `gpu-prefetch-sched run ...`. Named, `simulate` needs no
    `--simulate` (the flag only tells the default command from a mistyped one)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = ["simulate", *args]
        elif args and args[0] == "simulate":
            ctx.meta[_SIMULATE_NAMED] = True
        return super().parse_args(ctx, args)


_SIMULATE_NAMED = "gpuos_tools.prefetch_sched.simulate_named"


PROG = "gpu-prefetch-sched"

app = typer.Typer(
    name=PROG,
    cls=_DefaultSimulate,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    help="Plan, simulate or run the movement of a GPU job's memory under a budget below its needs.\n\n"
    "`simulate` (the default command) plans offline from predicted access streams, with no GPU; `run` "
    "starts a program under the agent and keeps its owned memory within the budget while it runs; `serve` "
    "runs several such programs time-sliced on one GPU within one budget.",
)


def _opt(parse, text: str, name: str):  # type: ignore[no-untyped-def]
    try:
        return parse(text)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=name) from e


@app.command("simulate")
def sched(
    ctx: typer.Context,
    streams: list[str] | None = typer.Argument(
        None, metavar="[ACCESS-STREAM]...",
        help="gpu-predict-access output, one per job ('-' = stdin, the default; *.zst ok).",
    ),
    simulate: bool = typer.Option(
        False, "--simulate", help="Plan and simulate offline (needs no GPU). Required unless the command is named "
        "(`gpu-prefetch-sched simulate`); online execution is `gpu-prefetch-sched run`."
    ),
    budget: str = typer.Option(..., "--budget", metavar="SIZE", help="Device memory budget: bytes with a unit (8GiB, 500MB) or N% of the footprint."),
    bw: str = typer.Option(
        "50.5GB/s", "--bw", metavar="H2D[,D2H]",
        help="Copy bandwidth per link direction while both are busy (one value: both). Default: half of 101 GB/s, H200.",
    ),
    chunk: str = typer.Option("2MiB", "--chunk", metavar="SIZE|alloc", help="Residency unit: chunks of SIZE, or whole allocations."),
    schedule: str = typer.Option("belady", "--schedule", metavar="belady|lru|none", help="Whose schedule records to write."),
    compare: str = typer.Option(
        "belady,lru,demand", "--compare", metavar="POLICY,...", help="Policies to summarise side by side (belady, lru, demand)."
    ),
    lookahead: str = typer.Option(
        "all", "--lookahead", metavar="N|all",
        help="Copies for a step may start once the step N before it has started; 0: reactive (when the step is reached); all: as early as room allows.",
    ),
    kernel_time: str = typer.Option(
        "gaps", "--kernel-time", metavar="gaps|DURATION",
        help="Compute time per step: the gap to the job's next step in the trace (capped by --gap-cap), or a fixed duration.",
    ),
    gap_cap: str = typer.Option("1ms", "--gap-cap", metavar="DURATION", help="Longest gap counted as compute (longer: the host was busy)."),
    time_slice: str = typer.Option("10ms", "--slice", metavar="DURATION", help="Round-robin time slice between jobs, in estimated compute time."),
    fault_cost: str = typer.Option("30us", "--fault-cost", metavar="DURATION", help="Cost of one page fault (demand paging, over-budget steps)."),
    fault_size: str = typer.Option("256KiB", "--fault-size", metavar="SIZE", help="Bytes brought in per fault."),
    um_evict_bw: str = typer.Option("12GB/s", "--um-evict-bw", metavar="BW", help="Managed-memory eviction bandwidth, device to host."),
    plot_file: str | None = typer.Option(
        None, "--plot", metavar="FILE.png",
        help="Also draw the --schedule policy's simulated timeline (resident bytes against the budget, moves, stalls) into FILE.png (needs matplotlib).",
    ),
    output: OutputOpt = "-",
    unbuffered: UnbufferedOpt = False,
) -> None:
    """Plan which memory to prefetch and evict before each kernel, and estimate the cost.

    Reads the access streams of one or more jobs (gpu-predict-access output: alloc, free and
    launch records with an `access` record after each launch, copy and memset), runs them
    time-sliced round-robin on one simulated GPU whose memory is limited to `--budget`, and
    writes the schedule of one policy (prefetch, evict, stall and switch records) and a
    summary per policy: Belady (evict what is used furthest in the future, from the known
    sequence), LRU, and demand paging as CUDA managed memory does it (faults, no
    prediction). Each summary gives the bytes moved each way, stalls, and the estimated time
    against the transfer-bound floor and against all memory resident. Needs no GPU.
    """
    from gpuos_tools.commands.cli import stderr_console
    from gpuos_tools.errors import ExitCode, GpuosError
    from gpuos_tools.sched.planner import PLANNERS
    from gpuos_tools.sched.report import render_summaries
    from gpuos_tools.sched.schedule import write_schedule
    from gpuos_tools.sched.simulate import POLICIES, Config
    from gpuos_tools.sched.simulate import simulate as run_policy
    from gpuos_tools.units import (
        parse_bandwidth,
        parse_budget,
        parse_duration,
        parse_size,
    )
    from gpuos_tools.sched.workload import Chunks, interleave, load_job
    from gpuos_tools.stream import make_header, open_input, open_output

    if not simulate and not ctx.meta.get(_SIMULATE_NAMED):
        raise typer.BadParameter(
            "this command plans offline and needs --simulate (online execution: gpu-prefetch-sched run -- PROGRAM)",
            param_hint="--simulate"
        )
    sources = list(streams or ["-"])
    if sources.count("-") > 1:
        raise typer.BadParameter("standard input ('-') can be read only once", param_hint="ACCESS-STREAM")
    bws = [_opt(parse_bandwidth, part, "--bw") for part in bw.split(",")]
    if len(bws) not in (1, 2):
        raise typer.BadParameter("one bandwidth, or two: H2D,D2H", param_hint="--bw")
    chunk_size = None if chunk == "alloc" else _opt(parse_size, chunk, "--chunk")
    if chunk_size is not None and chunk_size <= 0:
        raise typer.BadParameter("must be positive, or alloc", param_hint="--chunk")
    if schedule != "none" and schedule not in PLANNERS:
        raise typer.BadParameter("must be belady, lru or none", param_hint="--schedule")
    if plot_file is not None:
        if schedule not in PLANNERS:
            raise typer.BadParameter("--plot draws the --schedule policy's timeline: belady or lru", param_hint="--plot")
        figures.check_path(plot_file)  # before the inputs are read, not after
    policies = [p.strip() for p in compare.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise typer.BadParameter(f"policies are {', '.join(POLICIES)}", param_hint="--compare")
    if lookahead == "all":
        look: int | None = None
    else:
        try:
            look = int(lookahead)
        except ValueError:
            look = -1
        if look < 0:
            raise typer.BadParameter("a number of steps (0 or more) or all", param_hint="--lookahead")
    ktime: str | float = "gaps" if kernel_time == "gaps" else _opt(parse_duration, kernel_time, "--kernel-time")
    cap = _opt(parse_duration, gap_cap, "--gap-cap")
    slice_s = _opt(parse_duration, time_slice, "--slice")
    fault_s = _opt(parse_duration, fault_cost, "--fault-cost")
    fault_bytes = _opt(parse_size, fault_size, "--fault-size")
    if fault_bytes <= 0:
        raise typer.BadParameter("must be positive", param_hint="--fault-size")
    evict_bw = _opt(parse_bandwidth, um_evict_bw, "--um-evict-bw")

    try:  # the syntax now, before reading anything; a percentage resolves once the footprint is known
        if parse_budget(budget, 1 << 60) <= 0:
            raise ValueError("must be more than 0 bytes")
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--budget") from e

    chunks = Chunks(chunk_size)
    jobs = []
    for index, source in enumerate(sources):
        with open_input(source) as reader:
            jobs.append(load_job(with_progress(reader, f"reading {source}"), chunks, index, source, ktime, cap))
    empty = [j.source for j in jobs if not j.steps]
    if empty:
        raise GpuosError(
            f"{', '.join(empty)}: no access records (pipe the trace through gpu-predict-access first)",
            ExitCode.BAD_INPUT,
        )
    if ktime == "gaps" and any(len(j.steps) > 1 and not any(st.compute for st in j.steps) for j in jobs):
        stderr_console().print(
            "gpu-prefetch-sched: warning: no time between steps (the launch, memcpy and memset "
            "records with their `ts` are missing?): compute time is 0; --kernel-time sets one",
            highlight=False,
        )
    work = interleave(chunks, jobs, slice_s)
    try:
        budget_bytes = parse_budget(budget, work.footprint)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--budget") from e
    if budget_bytes <= 0:
        raise typer.BadParameter("must be more than 0 bytes", param_hint="--budget")
    cfg = Config(budget_bytes, bws[0], bws[-1], fault_s, fault_bytes, evict_bw, look)

    table_only = output == "-" and sys.stdout.isatty()
    summaries = []
    if table_only:
        summaries = [run_policy(work, p, cfg) for p in policies]
    else:
        with open_output(output, unbuffered=unbuffered or None) as writer:
            writer.write(make_header(
                "gpu-prefetch-sched", sources=sources, budget=budget_bytes, footprint=work.footprint,
                chunk=chunk_size, h2d_bw=cfg.h2d_bw, d2h_bw=cfg.d2h_bw, fault_s=fault_s, fault_size=fault_bytes,
                um_evict_bw=evict_bw, lookahead=lookahead, kernel_time=kernel_time, gap_cap_s=cap, slice_s=slice_s,
            ))  # fmt: skip
            done: dict[str, dict] = {}
            if schedule != "none":
                done[schedule] = write_schedule(work, schedule, cfg, writer.write)
            for p in policies:
                summaries.append(done.get(p) or run_policy(work, p, cfg))
                writer.write(summaries[-1])
    if table_only:
        from rich.console import Console

        render_summaries(summaries, Console())
    elif _isatty(sys.stderr):
        render_summaries(summaries, stderr_console())
    if plot_file is not None:
        from gpuos_tools.sched.plot import plot_timeline, simulated_timeline

        drawn = plot_timeline(simulated_timeline(work, schedule, cfg), plot_file)
        print(f"gpu-prefetch-sched: wrote {plot_file}: {drawn['events']} events over {drawn['seconds']:.6g} simulated s",
              file=sys.stderr)


@app.command(
    "run",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    no_args_is_help=True,
)
def run(
    program: list[str] = typer.Argument(..., metavar="-- PROGRAM [ARGS]...", help="The Python program (CuPy or PyTorch) and its arguments."),
    budget: str = typer.Option(
        ..., "--budget", metavar="SIZE|N%",
        help="Most owned device memory mapped at once: bytes with a unit (8GiB, 500MB), or N% of the program's "
        "owned memory at each decision (66% = 150% oversubscription).",
    ),
    policy: str = typer.Option("belady", "--policy", metavar="belady|lru", help="Victim choice: the record used furthest ahead in the learned period (LRU until one is learned), or always the least recently used."),
    lookahead: int = typer.Option(
        2, "--lookahead", min=0, metavar="N",
        help="Launches ahead whose working sets are prefetched (0: load at the launch only). With 1, a load "
        "waits for its victim's save within one launch; from 2 on, saves and loads of different launches "
        "overlap, at the cost of more bytes moved (prefetching evicts earlier than Belady would).",
    ),
    output: str | None = typer.Option(
        None, "--output", "-o", metavar="TRACE",
        help="Also write the program's trace stream to TRACE (*.zst compressed); default: none.",
    ),
    timeline: str | None = typer.Option(
        None, "--timeline", metavar="FILE.json",
        help="Write the executor's event log (mapped bytes, budget, evictions, loads, prefetches, waits) "
        "to FILE.json, for `gpu-prefetch-sched plot`; see TIMELINE.",
    ),
    plot_file: str | None = typer.Option(
        None, "--plot", metavar="FILE.png",
        help="Draw the timeline (residency against the budget, moves, waits) into FILE.png at the end (needs matplotlib).",
    ),
    serve_spec: str | None = typer.Option(
        None, "--serve", hidden=True,
        help="Internal, for `gpu-prefetch-sched serve`: the coordinator's socket and the job's number (JSON).",
    ),
) -> None:
    """Run PROGRAM with its device memory kept within a budget, moving memory ahead of its kernels.

    PROGRAM runs under the agent (`gpu-trace run --agent`) with its CuPy and PyTorch allocations owned
    (GPUOS_AGENT_OWN=1). Before each launch, copy and memset, the online policy makes the
    operation's predicted working set resident (every owned record when the prediction is
    unknown), evicts (saving to pinned host memory) what the learned launch sequence uses
    furthest ahead, and prefetches the next launches' sets on a separate stream; see ONLINE
    EXECUTION. At the end, one `sched_summary` record (after a header) on standard output; the
    program's own output is its own. Exits with the program's status.
    """
    if policy not in POLICIES:
        raise typer.BadParameter(f"must be one of {', '.join(POLICIES)}", param_hint="--policy")
    if plot_file is not None:
        figures.check_path(plot_file)  # before the program runs, not after
    size = fraction = None
    try:
        size, percent = parse_budget_spec(budget)
        if percent is not None:
            if not 0 < percent:
                raise ValueError("must be more than 0%")
            fraction, size = percent / 100, None
        elif size <= 0:
            raise ValueError("must be more than 0 bytes")
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--budget") from e
    served = None
    if serve_spec is not None:  # a job of `gpu-prefetch-sched serve`: its budget comes with each grant
        try:
            spec = json.loads(serve_spec)
            served = ServeConfig(socket=str(spec["socket"]), job=int(spec["job"]),
                                 overlap=bool(spec.get("overlap", False)), ledger=spec.get("ledger"))
        except (ValueError, KeyError, TypeError, GpuosError) as e:
            raise typer.BadParameter(f"not a serve spec: {e}", param_hint="--serve") from e
        if fraction is not None:
            raise typer.BadParameter("a job served takes a budget in bytes", param_hint="--budget")
    with tempfile.TemporaryDirectory(prefix="gpu-prefetch-sched-") as tmp:
        timeline_path = None
        if timeline or plot_file:
            timeline_path = os.path.abspath(timeline) if timeline else os.path.join(tmp, "timeline.json")
        online = OnlineConfig(policy=policy, lookahead=lookahead, budget=size, fraction=fraction,
                              summary=os.path.join(tmp, "summary.json"), timeline=timeline_path, serve=served)
        traced = launcher.run_program(program, output=output or os.devnull, no_images=True, agent=True,
                                      online=online, own=owned.FRAMEWORKS, warn=lambda m: warn(PROG, m))
        code = report_run(PROG, traced)
        try:
            with open(online.summary) as f:
                summary = json.load(f)
        except (OSError, ValueError):
            summary = None
        events = None
        if plot_file is not None and summary is not None:
            events = load_timeline(timeline_path)
    if summary is None:
        raise GpuosError(
            f"the program (exit {code}) ended without the policy's summary: it made no owned allocation "
            "(neither CuPy nor PyTorch allocated device memory?), or it was killed", ExitCode.FAILURE)
    with open_output("-") as writer:
        writer.write(make_header(PROG, mode="run", argv=list(program), budget_spec=budget))
        writer.write({"type": "sched_summary", "mode": "online", "exit": code, **summary})
    if events is not None:  # after the summary: a picture that fails loses no figures
        drawn = plot_timeline(events, plot_file)
        print(f"{PROG}: wrote {plot_file}: {drawn['events']} events over {drawn['seconds']:.3f} s",
              file=sys.stderr)
    raise typer.Exit(code)


def job_command(serve: dict, argv: list[str], budget: int, policy: str, lookahead: int) -> list[str]:
    """A job of `serve`: `gpu-prefetch-sched run` with ``serve`` (the coordinator's address and
    the job's number, sched/serve.py `serve_jobs`) as its hidden --serve option."""
    return [sys.executable, "-m", "gpuos_tools.commands.prefetch_sched", "run", "--budget", str(budget),
            "--policy", policy, "--lookahead", str(lookahead), "--serve", json.dumps(serve), "--", *argv]


def job_starter(budget: int, policy: str, lookahead: int, env: dict[str, str]) -> Callable[..., subprocess.Popen]:
    """What `serve_jobs` starts each job with: its `job_command` in ``env``."""
    def start(serve: dict, argv: list[str], stdout: IO[bytes], stderr: IO[bytes]) -> subprocess.Popen:
        return subprocess.Popen(job_command(serve, argv, budget, policy, lookahead), stdout=stdout, stderr=stderr,
                                stdin=subprocess.DEVNULL, env=env)

    return start


@app.command("serve")
def serve_cmd(
    jobs: list[str] | None = typer.Option(
        None, "--job", metavar="'PROGRAM ARGS'",
        help="A job: a Python program (CuPy) and its arguments, one shell-quoted string (split as a shell "
        "would, nothing expanded). Repeat for each job.",
    ),
    budget: str = typer.Option(
        ..., "--budget", metavar="SIZE",
        help="Most owned device memory ALL the jobs may hold mapped together: bytes with a unit (8GiB, 500MB). "
        "A percentage is refused: the jobs' footprint is not known before they run.",
    ),
    time_slice: str = typer.Option("50ms", "--slice", metavar="DURATION",
                                   help="How long a job holds the GPU turn while another waits (ns, us, ms, s)."),
    policy: str = typer.Option("belady", "--policy", metavar="belady|lru",
                               help="Each job's victim choice, in its own launches and at its switches."),
    lookahead: int = typer.Option(2, "--lookahead", min=0, metavar="N",
                                  help="Launches ahead whose working sets each job prefetches while it runs."),
    switch: str = typer.Option("serial", "--switch", metavar="serial|overlap",
                               help="serial (the default): the incoming job is granted once the outgoing job's evictions "
                               "have completed; overlap (EXPERIMENTAL, not proven over many runs): granted "
                               "once they are issued, its loads wait in the ledger for their releases. See SERVING."),
    json_file: str | None = typer.Option(None, "--json", metavar="FILE", help="Also write the whole result (one JSON object) to FILE."),
) -> None:
    """Run several jobs on one GPU, time-sliced, their memory together within one budget.

    Each job runs as under `gpu-prefetch-sched run` (the agent, owned memory, the online
    policy). One job holds the GPU turn at a time: the others' program threads wait on the host
    at their next launch, copy or memset until granted. When the holder's slice is over and
    another job waits, the holder, at its next operation, evicts what its own predicted future
    needs last (Belady) down to what the incoming job leaves room for, waits until the releases
    have completed and reports what it keeps; the incoming job is granted a budget of the total
    minus what the others keep, and prefetches its predicted next working sets before it goes
    on (MSched's context switch with working-set preparation). Every load of every job is
    booked first in one shared ledger and waits there until all the jobs' mapped bytes and it
    fit in the budget. --switch overlap (experimental) grants the incoming job once the
    evictions are issued: its loads wait in the ledger for the releases, so saves and loads
    overlap. A job that ends
    leaves the rotation; a job alone never waits. See SERVING.

    Standard output: a header, one `serve_job` record per job, then `serve_summary`; a table on
    standard error. Exits 1 when a job failed (its own status is in its record).
    """
    if not jobs:
        raise typer.BadParameter("no jobs: give each with --job 'PROGRAM ARGS'", param_hint="--job")
    if policy not in POLICIES:
        raise typer.BadParameter(f"must be one of {', '.join(POLICIES)}", param_hint="--policy")
    if switch not in ("overlap", "serial"):
        raise typer.BadParameter("must be overlap or serial", param_hint="--switch")
    try:
        size, percent = parse_budget_spec(budget)
        if percent is not None:
            raise ValueError("a size in bytes (the jobs' footprint is not known before they run)")
        if size is None or size <= 0:
            raise ValueError("must be more than 0 bytes")
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--budget") from e
    slice_s = _opt(parse_duration, time_slice, "--slice")
    if slice_s <= 0:
        raise typer.BadParameter("must be more than 0", param_hint="--slice")
    argvs = []
    for text in jobs:
        try:
            argv = shlex.split(text)
        except ValueError as e:
            raise typer.BadParameter(f"{text!r}: {e}", param_hint="--job") from e
        if not argv:
            raise typer.BadParameter("an empty job", param_hint="--job")
        if shutil.which(argv[0]) is None:
            raise GpuosError(f"job {text!r}: {argv[0]}: not found or not executable", ExitCode.PROGRAM_NOT_FOUND)
        argvs.append(argv)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    # serve's jobs run the Python agent: the native core's gate (the GPU turn) has not run on a
    # GPU yet, and the executor's hooks see every operation of a served job anyway
    env.setdefault("GPUOS_AGENT_BACKEND", "python")
    start = job_starter(size, policy, lookahead, env)
    with tempfile.TemporaryDirectory(prefix="gpu-prefetch-sched-serve-") as tmp:
        result = serve_jobs(argvs, size, slice_s, policy, lookahead, tmp, start, overlap=switch == "overlap")
    if json_file:
        try:
            with open(json_file, "w") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
        except OSError as e:
            raise GpuosError(f"{json_file}: {e}", ExitCode.IO_ERROR) from e
    with open_output("-") as writer:
        writer.write(make_header(PROG, mode="serve", jobs=[r["argv"] for r in result["jobs"]],
                                 budget=size, slice_s=slice_s, policy=policy, lookahead=lookahead, switch=switch))
        for r in result["jobs"]:
            writer.write({"type": "serve_job", **{k: v for k, v in r.items() if k not in ("summary", "stderr_tail")},
                          "summary": r["summary"]})
        writer.write({k: v for k, v in result.items() if k != "jobs"})
    _serve_table(result)
    failed = [r for r in result["jobs"] if not r["ok"]]
    for r in failed:
        tail = r["stderr_tail"].strip().splitlines()[-8:]
        print(f"gpu-prefetch-sched: job {r['job']} ({' '.join(r['argv'])}) failed, exit {r['exit']}"
              + ("" if r["summary"] else ", no summary") + (":\n  " + "\n  ".join(tail) if tail else ""),
              file=sys.stderr)
    if failed:
        raise typer.Exit(int(ExitCode.FAILURE))


def _serve_table(result: dict) -> None:
    """Per job, on standard error (plain columns: it is read in logs as often as on a terminal)."""
    print(f"gpu-prefetch-sched serve: budget {result['budget'] / 2**20:.0f} MiB, slice {result['slice_s'] * 1e3:g} ms, "
          f"switch {result['switch']}, {result['switches']} switches ({result['early_grants']} early), "
          f"{result['wall_s']:.2f} s, combined peak {(result['combined_peak'] or 0) / 2**20:.0f} MiB "
          f"(at loads {(result['combined_peak_loads'] or 0) / 2**20:.0f}, {result['forced_loads']} loads forced over)",
          file=sys.stderr)
    print(f"{'job':>3} {'exit':>4} {'wall_s':>7} {'turn_s':>7} {'waits':>5} {'wait_s':>7} {'switches':>8} "
          f"{'in_MiB':>7} {'out_MiB':>7}  throughput", file=sys.stderr)
    for r in result["jobs"]:
        tp = "-" if r["throughput"] is None else f"{r['throughput']:.4g} {r['throughput_unit']}"
        print(f"{r['job']:>3} {str(r['exit']):>4} {r['wall_s']:>7.2f} {r['turn_s']:>7.2f} {r['turn_waits']:>5} "
              f"{r['turn_wait_s']:>7.2f} {r['switches']:>8} {(r['bytes_in'] or 0) / 2**20:>7.0f} "
              f"{(r['bytes_out'] or 0) / 2**20:>7.0f}  {tp}", file=sys.stderr)


@app.command("plot")
def plot_cmd(
    timeline: str = typer.Argument(..., metavar="TIMELINE.json", help="A timeline from `gpu-prefetch-sched run --timeline`."),
    plot_file: str = typer.Option(..., "--plot", metavar="FILE.png", help="The picture to write (format from the suffix)."),
    title: str = typer.Option("", "--title", help="Title instead of the run's policy, budget and moves."),
) -> None:
    """Draw a recorded online run's timeline: mapped memory against the budget, moves, waits.

    Reads the JSON that `gpu-prefetch-sched run --timeline FILE.json` wrote (on the GPU's
    machine or anywhere) and draws it into FILE.png, as `run --plot` does at the end of a run;
    see TIMELINE. Needs matplotlib, no GPU.
    """
    from gpuos_tools.sched.plot import load_timeline, plot_timeline

    figures.check_path(plot_file)
    drawn = plot_timeline(load_timeline(timeline), plot_file, title)
    print(f"gpu-prefetch-sched: wrote {plot_file}: {drawn['events']} events over {drawn['seconds']:.3f} s",
          file=sys.stderr)


def _isatty(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        return False


def main() -> None:
    run_app(app, prog=PROG)


if __name__ == "__main__":
    main()
