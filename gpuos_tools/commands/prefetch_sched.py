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
from gpuos_tools.commands.cli import MECHANISM_DEFAULT, OutputOpt, UnbufferedOpt, doc_format, report_run, run_app, stderr_console, warn, with_progress
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.injection.config import OnlineConfig, ServeConfig
from gpuos_tools.memory import owned
from gpuos_tools.sched.online import PLANS, SLACK_MAX
from gpuos_tools.sched.online import POLICIES as ONLINE_POLICIES
from gpuos_tools.sched.planner import PLANNERS
from gpuos_tools.sched import records as _schemas  # noqa: F401 -- registers the schemas of what it writes
from gpuos_tools.sched.plot import load_timeline, plot_timeline, simulated_timeline
from gpuos_tools.sched.report import render_summaries
from gpuos_tools.sched.schedule import write_schedule
from gpuos_tools.sched.serve import serve_jobs
from gpuos_tools.sched.simulate import POLICIES, Config, simulate as run_policy
from gpuos_tools.sched.workload import Chunks, interleave, load_job
from gpuos_tools.stream import make_header, open_input, open_output
from gpuos_tools.trace import run as launcher
from gpuos_tools.units import parse_bandwidth, parse_budget, parse_budget_spec, parse_duration, parse_size


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


def _slack(text: str) -> float:
    """``--slack``'s share of the budget, from ``N%``."""
    try:
        _, percent = parse_budget_spec(text)
    except ValueError:
        percent = None
    if percent is None or not 0 <= percent <= SLACK_MAX * 100:
        raise typer.BadParameter(f"{text!r}: a percentage from 0% to {SLACK_MAX * 100:g}%", param_hint="--slack")
    return percent / 100


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
        drawn = plot_timeline(simulated_timeline(work, schedule, cfg), plot_file)
        print(f"gpu-prefetch-sched: wrote {plot_file}: {drawn['events']} events over {drawn['seconds']:.6g} simulated s",
              file=sys.stderr)


@app.command(
    "run",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    no_args_is_help=True,
)
@doc_format(mechanism_default=MECHANISM_DEFAULT)
def run(
    program: list[str] = typer.Argument(..., metavar="-- PROGRAM [ARGS]...", help="The Python program (CuPy or PyTorch) and its arguments."),
    budget: str = typer.Option(
        ..., "--budget", metavar="SIZE|N%",
        help="Most owned device memory mapped at once: bytes with a unit (8GiB, 500MB), or N% of the program's "
        "steady working set (66% = 150% oversubscription): the bytes of the records its repeating launch "
        "sequence touches, once that sequence is learned (until then, N% of all its owned memory). Start-up "
        "buffers and cached blocks the loop does not touch do not count. The summary's budget_of, steady_bytes "
        "and budget say what it was of and the bytes it became; 100% or more moves nothing.",
    ),
    policy: str = typer.Option("belady", "--policy", metavar="belady|lru", help="Victim choice: the record used furthest ahead in the learned period (LRU until one is learned), or always the least recently used."),
    lookahead: int = typer.Option(
        2, "--lookahead", min=0, metavar="N",
        help="Launches ahead whose working sets are prefetched (0: load at the launch only). With 1, a load "
        "waits for its victim's save within one launch; from 2 on, saves and loads of different launches "
        "overlap, at the cost of more bytes moved (prefetching evicts earlier than Belady would). With --plan "
        "fixed: the fewest launches before its use a record the plan dropped is loaded again (more where "
        "the launches' measured durations are shorter than its copy).",
    ),
    prefetch_batch: int = typer.Option(
        1, "--prefetch-batch", min=1, metavar="B",
        help="With --plan count: a decision that finds the next --lookahead launches' records resident "
        "moves nothing, and one that does not prefetches the next lookahead x B launches' records, so "
        "that the moves come in fewer decisions and the launches between them take the fast path "
        "(experimental: in the CPU simulation B = 4 halved the decisions of an LLM decode that move "
        "something, for 1.6 % more bytes; on an H100 the decode ran no faster, 2.22 against 2.25 "
        "tokens/s, so 1 stays the default).",
    ),
    plan: str = typer.Option(
        "count", "--plan", metavar="count|time|fixed",
        help="How far ahead to prefetch. count: the next --lookahead launches. time (experimental: on an H100 "
        "it helped an out-of-core GEMM only at 300 % oversubscription, so count stays the default): as far ahead as the launches' GPU times "
        "(sampled with events) need for the copies to complete before their use, and a record is evicted "
        "right after its last use when the next loads will need its room; --lookahead applies until "
        "durations are measured. fixed (experimental): once the loop's launch sequence is learned, one plan "
        "made for it and repeated every period (each record resident throughout, or dropped after a use and "
        "loaded again as many launches before the next as their sampled GPU times take to copy it, at least "
        "--lookahead), so that only the launches where it acts are decided; "
        "the count plan until then and again after a launch leaves the sequence.",
    ),
    slack: str = typer.Option(
        "0%", "--slack", metavar="N%",
        help="With --plan fixed (experimental): make the plan at N% of the budget less (at most 50%), so that "
        "its loads go ahead while evictions still in flight (a save the GPU has not finished, a release "
        "waiting for the victim's last use) hold up to that much; the budget itself still holds. More bytes "
        "move; the program's thread waits less for room.",
    ),
    proactive: bool = typer.Option(
        False, "--proactive",
        help="With --plan time: evict the records the next loads will need the room of right after their last "
        "use, Belady's victims, instead of when the room is needed (experimental: in the CPU simulation it "
        "moved more bytes).",
    ),
    plan_bw: str = typer.Option(
        "50.5GB/s", "--plan-bw", metavar="H2D[,D2H]",
        help="The link bandwidths the time plan assumes per direction while both are busy (one value: both).",
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

    The agent sees the driver calls through CUPTI callbacks (GPUOS_AGENT_MECHANISM=cupti) or through its
    preloaded interposer (GPUOS_AGENT_MECHANISM=intercept; no CUPTI in the program); without the
    variable, {mechanism_default}.

    The fast path (on the agent's native core; on by default, GPUOS_SCHED_FAST=0 turns it off): an
    operation whose records are all resident and settled, at a point where the policy's plan has no
    action, goes on without entering Python; its bookkeeping is replayed at the next call. Decisions
    and results are the same; the summary's `fast` says how many operations went by.
    """
    if policy not in POLICIES:
        raise typer.BadParameter(f"must be one of {', '.join(POLICIES)}", param_hint="--policy")
    if plan not in PLANS:
        raise typer.BadParameter(f"must be one of {', '.join(PLANS)}", param_hint="--plan")
    bws = [_opt(parse_bandwidth, part, "--plan-bw") for part in plan_bw.split(",")]
    if len(bws) not in (1, 2) or min(bws) <= 0:
        raise typer.BadParameter("one bandwidth above 0, or two: H2D,D2H", param_hint="--plan-bw")
    if proactive and plan != "time":
        raise typer.BadParameter("only with --plan time", param_hint="--proactive")
    if prefetch_batch > 1 and plan != "count":
        raise typer.BadParameter("only with --plan count", param_hint="--prefetch-batch")
    if plan == "fixed" and policy != "belady":
        raise typer.BadParameter("a fixed plan is made with --policy belady only", param_hint="--plan")
    slack_share = _slack(slack)
    if slack_share and plan != "fixed":
        raise typer.BadParameter("only with --plan fixed", param_hint="--slack")
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
    # a value the agent cannot run on is refused before the program starts (the option is gpu-trace
    # run's only); the launcher reads the variable itself and says what the agent ran on
    launcher.agent_mechanism(None, True, "auto")
    with tempfile.TemporaryDirectory(prefix="gpu-prefetch-sched-") as tmp:
        timeline_path = None
        if timeline or plot_file:
            timeline_path = os.path.abspath(timeline) if timeline else os.path.join(tmp, "timeline.json")
        online = OnlineConfig(policy=policy, lookahead=lookahead, budget=size, fraction=fraction,
                              summary=os.path.join(tmp, "summary.json"), timeline=timeline_path, serve=served,
                              plan=plan, bw=(float(bws[0]), float(bws[-1])) if plan == "time" else None,
                              proactive=proactive, batch=prefetch_batch, slack=slack_share)
        traced = launcher.run_program(program, output=output or os.devnull, no_images=True, agent=True,
                                      online=online, own=owned.FRAMEWORKS,
                                      warn=lambda m: warn(PROG, m))
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
        writer.write(make_header(PROG, mode="run", argv=list(program), budget_spec=budget,
                                 mechanism=traced.mechanism))
        writer.write({"type": "sched_summary", "mode": "online", "exit": code, **summary})
    if events is not None:  # after the summary: a picture that fails loses no figures
        drawn = plot_timeline(events, plot_file)
        print(f"{PROG}: wrote {plot_file}: {drawn['events']} events over {drawn['seconds']:.3f} s",
              file=sys.stderr)
    raise typer.Exit(code)


def job_command(serve: dict, argv: list[str], budget: int, policy: str, lookahead: int,
                plan: str = "count", plan_bw: str | None = None) -> list[str]:
    """A job of `serve`: `gpu-prefetch-sched run` with ``serve`` (the coordinator's address and
    the job's number, sched/serve.py `serve_jobs`) as its hidden --serve option."""
    planning = ["--plan", plan, *(["--plan-bw", plan_bw] if plan == "time" and plan_bw else [])]
    return [sys.executable, "-m", "gpuos_tools.commands.prefetch_sched", "run", "--budget", str(budget),
            "--policy", policy, "--lookahead", str(lookahead), *planning, "--serve", json.dumps(serve), "--", *argv]


def job_starter(budget: int, policy: str, lookahead: int, env: dict[str, str], plan: str = "count",
                plan_bw: str | None = None) -> Callable[..., subprocess.Popen]:
    """What `serve_jobs` starts each job with: its `job_command` in ``env``."""
    def start(serve: dict, argv: list[str], stdout: IO[bytes], stderr: IO[bytes]) -> subprocess.Popen:
        return subprocess.Popen(job_command(serve, argv, budget, policy, lookahead, plan, plan_bw), stdout=stdout,
                                stderr=stderr, stdin=subprocess.DEVNULL, env=env)

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
    plan: str = typer.Option("count", "--plan", metavar="count|time",
                             help="How far ahead each job prefetches, as `run --plan` (time: experimental)."),
    plan_bw: str = typer.Option("50.5GB/s", "--plan-bw", metavar="H2D[,D2H]",
                                help="With --plan time: the link bandwidths each job's plan assumes, as `run --plan-bw`."),
    switch: str = typer.Option("serial", "--switch", metavar="serial|overlap",
                               help="serial (the default): the incoming job is granted once the outgoing job's evictions "
                               "have completed; overlap (experimental): granted "
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
    if policy not in ONLINE_POLICIES:
        raise typer.BadParameter(f"must be one of {', '.join(ONLINE_POLICIES)}", param_hint="--policy")
    if switch not in ("overlap", "serial"):
        raise typer.BadParameter("must be overlap or serial", param_hint="--switch")
    if plan not in PLANS:
        raise typer.BadParameter(f"must be one of {', '.join(PLANS)}", param_hint="--plan")
    bws = [_opt(parse_bandwidth, part, "--plan-bw") for part in plan_bw.split(",")]
    if len(bws) not in (1, 2) or min(bws) <= 0:  # here, not by each job once the others have started
        raise typer.BadParameter("one bandwidth above 0, or two: H2D,D2H", param_hint="--plan-bw")
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
    if env["GPUOS_AGENT_BACKEND"] == "python":
        env["GPUOS_AGENT_MECHANISM"] = "cupti"  # the Python agent sees the calls through CUPTI only
    start = job_starter(size, policy, lookahead, env, plan, plan_bw)
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
                                 budget=size, slice_s=slice_s, policy=policy, lookahead=lookahead, switch=switch,
                                 plan=plan))
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
