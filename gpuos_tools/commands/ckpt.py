"""gpu-ckpt: checkpoint the GPU state of any CUDA process through the driver (and CRIU)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from gpuos_tools import image as img
from gpuos_tools.agent import control
from gpuos_tools.agent.snapshot import snapshot_to_image
from gpuos_tools.agent.suspend import request_suspend
from gpuos_tools.ckpt import agent_criu, agent_job, criu_job, periodic as per
from gpuos_tools.ckpt.check import run_checks, table_rows
from gpuos_tools.ckpt.driver import Checkpointer
from gpuos_tools.ckpt.job import suspend_job
from gpuos_tools.ckpt.profile import load_profile, suspend_profile
from gpuos_tools.ckpt.records import run_recorded
from gpuos_tools.commands.cli import (MECHANISM_DEFAULT, doc_format, error, option_given, options_before_subcommand, report_run, run_app,
                                      stderr_console, warn)
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.image import chunkio
from gpuos_tools.stream import make_header, open_output
from gpuos_tools.trace import run as launcher
from gpuos_tools.units import SIZE_HELP, format_size, parse_size


app = typer.Typer(
    name="gpu-ckpt",
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)

PROG = "gpu-ckpt"


def _say(message: str) -> None:
    """A line for people, on a terminal only."""
    if sys.stderr.isatty():
        stderr_console().print(f"{PROG}: {message}", highlight=False)


@app.callback(invoke_without_command=True)
def checkpoint(
    ctx: typer.Context,
    pid: Optional[int] = typer.Option(None, "--pid", "-p", metavar="PID", help="The CUDA process to checkpoint."),
    job: Optional[int] = typer.Option(
        None, "--job", metavar="PID",
        help="Checkpoint every CUDA process in the tree of PID (a launcher such as torchrun, or any parent) "
        "together: every rank locked at once (retried in rounds while a collective holds one), then each "
        "checkpointed. `gpu-restore --job PID` restores them all before unlocking any. With --image DIR, "
        "then one CRIU dump of the whole tree (launcher, ranks, helpers, their localhost TCP connections).",
    ),
    force: bool = typer.Option(
        False, "--force",
        help="With --job: checkpoint even a job whose ranks use NCCL transports the driver cannot restore "
        "(peer memory, shared memory, cuMem: refused otherwise, since such a job never runs again; start it "
        "with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_CUMEM_ENABLE=0 instead), or the ranks of a tree "
        "holding fewer than the job's WORLD_SIZE (a rank's PID instead of the launcher's) alone.",
    ),
    timeout: int = typer.Option(
        0, "--timeout", "-t", min=0, metavar="MS",
        help="How long the lock may wait for the process's CUDA calls and submitted GPU work, in "
        "milliseconds (0: as long as it takes; with --job, each rank's lock in each round, 0: 10000). On timeout "
        "the process is left running. With --job --cut: how long every rank may take to reach the collective and "
        "write its image (0: 120000).",
    ),
    image: Optional[Path] = typer.Option(
        None, "--image", metavar="DIR",
        help="Also dump the whole process (with --job: the launcher's whole tree) with CRIU (>= 4) into DIR, "
        "an empty directory; a program under the agent on interception with owned memory is suspended by its "
        "agent first (see --no-agent-suspend). With --agent, or --job --cut: the checkpoint image to write (it must not exist; it "
        "appears only when complete).",
    ),
    leave_running: bool = typer.Option(
        False, "--leave-running",
        help="With --image: resume the process (with --job: every rank) after the dump instead of letting CRIU end it.",
    ),
    no_agent_suspend: bool = typer.Option(
        False, "--no-agent-suspend",
        help="With --pid PID --image DIR: dump a program under the agent on interception with owned memory "
        "(GPUOS_AGENT_OWN=1) the plain way, all its device memory through the driver's checkpoint (~2 GB/s), "
        "instead of having its agent suspend it first (owned memory off the GPU at link speed; the default).",
    ),
    criu_arg: Optional[list[str]] = typer.Option(
        None, "--criu-arg", metavar="ARG",
        help="With --image: pass ARG to `criu dump` (repeatable). With --job the dump has --tcp-established and "
        "--network-lock skip (every peer is in the frozen tree) unless ARG names a network lock, e.g. "
        "--criu-arg=--network-lock=iptables. CRIU's --ghost-limit (1 MiB) is raised to the largest deleted file "
        "the tree still maps (NCCL's shared-memory segment), unless ARG sets one.",
    ),
    profile: Optional[Path] = typer.Option(
        None, "--profile", metavar="FILE",
        help="Suspend every CUDA process the TOML profile selects and list them in its state file.",
    ),
    output: Optional[str] = typer.Option(
        None, "--output", "-o", metavar="FILE",
        help="Records to FILE ('-': stdout; *.zst compressed). Default: stdout, none with --profile.",
    ),
    agent: Optional[str] = typer.Option(
        None, "--agent", metavar="PID|SOCKET",
        help="Snapshot a program started with `gpu-ckpt run` (`gpu-trace run --agent`) while it runs, into the image "
        "--image DIR (the agent path: no stop, no lock).",
    ),
    parent: Optional[Path] = typer.Option(
        None, "--parent", metavar="IMAGE",
        help="With --agent: write an incremental image of what was written since IMAGE (this agent's "
        "last image; otherwise the image is full and the record says why).",
    ),
    compress: bool = typer.Option(False, "--compress", help="With --agent: zstd per chunk."),
    checksum: str = typer.Option(
        "auto", "--checksum", metavar="auto|xxh3|crc32|sha256",
        help="With --agent: chunk checksum (auto: the fastest measured on this CPU, xxh3 where the xxhash "
        "package is installed, else crc32; sha256 for content identity)."),
    threads: Optional[int] = typer.Option(
        None, "--threads", min=1, max=256, metavar="N",
        help="With --agent: image writer threads (default: the CPUs, at most 16)."),
    suspend: bool = typer.Option(
        False, "--suspend",
        help="With --agent: suspend the program (started with GPUOS_AGENT_OWN=1): its owned device memory goes to "
        "pinned host memory and back to the driver, and it waits until `gpu-restore --agent PID --resume`. With "
        "--image DIR, also write that memory as an image.",
    ),
    partial: bool = typer.Option(
        False, "--partial",
        help="With --suspend: go on when some device memory is not owned (it stays on the GPU; the record lists it).",
    ),
    max_hold: Optional[float] = typer.Option(
        None, "--max-hold", metavar="S", min=0.0,
        help="With --suspend: resume by itself after S seconds if no resume came (default: wait for one).",
    ),
    cut: bool = typer.Option(
        False, "--cut",
        help="With --job PID --image DIR (DIR must not exist; PID: the launcher, e.g. torchrun, or any parent of "
        "the ranks): the agent path, without stopping the job. Every rank (each started with `gpu-ckpt run`, "
        "NCCL on its default cuMem allocator) is snapshotted just before the same collective launch K (the "
        "largest count of any rank plus --margin), into one job image: each rank's image and job.json, written "
        "last. --timeout bounds "
        "the wait for every image (default 120000 ms); on failure every rank is disarmed and nothing is kept. "
        "`gpu-restore --job PID --cut --image DIR` rolls the job back.",
    ),
    margin: int = typer.Option(
        agent_job.MARGIN, "--margin", min=1, max=agent_job.MAX_MARGIN, metavar="N",
        help="With --cut: collectives beyond the largest count of any rank at the first attempt (fourfold at "
        f"each retry, when a rank was past K before it was armed; {agent_job.ATTEMPTS} attempts). The larger, the "
        "longer the job runs before the cut.",
    ),
) -> None:
    """Checkpoint the GPU state of a CUDA process, or of every process a profile selects.

    `gpu-ckpt --pid PID` locks the process's CUDA driver API (waiting for its submitted work),
    copies its device memory into host memory and releases its GPUs, through the NVIDIA driver
    checkpoint API: any CUDA program, no preparation. `gpu-restore --pid PID` brings it back.
    A program started with `gpu-ckpt run` (the agent) is checkpointed while it runs instead,
    with `gpu-ckpt --agent PID --image DIR`, or suspended with `gpu-ckpt --agent PID --suspend`.
    `gpu-ckpt status` lists every CUDA process with its checkpoint state. Each step is written
    as a gpuos stream record.
    """
    if ctx.invoked_subcommand is not None:
        given = options_before_subcommand(ctx)
        if given:
            raise GpuosError(f"{', '.join(given)}: options go after the command: "
                             f"{PROG} {ctx.invoked_subcommand} [OPTIONS]", ExitCode.USAGE)
        return

    if no_agent_suspend and (pid is None or image is None):
        raise GpuosError("--no-agent-suspend goes with --pid PID --image DIR", ExitCode.USAGE)
    if checksum not in chunkio.CHOICES:
        raise GpuosError(f"--checksum must be one of {', '.join(chunkio.CHOICES)}, not {checksum!r}", ExitCode.USAGE)
    if force and job is None:
        raise GpuosError("--force goes with --job PID", ExitCode.USAGE)
    margin_given = option_given(ctx, "margin")
    if (cut or margin_given) and job is None:
        raise GpuosError("--cut and --margin go with --job PID --image DIR", ExitCode.USAGE)
    if cut:
        if image is None:
            raise GpuosError("--job --cut needs --image DIR: where the job image goes", ExitCode.USAGE)
        if pid is not None or agent is not None or profile is not None or leave_running or criu_arg or force \
                or parent is not None or suspend or partial or max_hold is not None:
            raise GpuosError("--job --cut goes with --image, --margin, --timeout, --compress, --checksum, --threads "
                             "and -o only", ExitCode.USAGE)
        _cut(job, image, margin, timeout, compress, checksum, threads, output)
        return
    if margin_given:
        raise GpuosError("--margin goes with --job PID --cut", ExitCode.USAGE)
    if threads is not None and agent is None:
        raise GpuosError("--threads goes with --agent PID --image DIR or --job PID --cut --image DIR", ExitCode.USAGE)
    if (suspend or partial or max_hold is not None) and agent is None:
        raise GpuosError("--suspend, --partial and --max-hold go with --agent PID (the driver path: --pid PID)",
                         ExitCode.USAGE)
    if agent is not None and suspend:
        if pid is not None or job is not None or profile is not None or leave_running or criu_arg or timeout \
                or parent is not None or threads is not None:
            raise GpuosError("--agent --suspend goes with --image, --partial, --max-hold, --compress, --checksum "
                             "and -o only (a suspend's image is full: no --parent)", ExitCode.USAGE)
        _suspend(agent, image, partial, max_hold, compress, checksum, output)
        return
    if agent is not None:
        if pid is not None or job is not None or profile is not None or leave_running or criu_arg or timeout \
                or partial:
            raise GpuosError("--agent goes with --image, --parent, --compress, --checksum, --threads and -o only",
                             ExitCode.USAGE)
        if image is None:
            raise GpuosError("--agent needs --image DIR: where the image goes", ExitCode.USAGE)

        answer = snapshot_to_image(control.resolve(agent), str(image), str(parent) if parent else None,
                                   compress=compress, checksum=checksum, threads=threads)
        answer.pop("allocations", None)
        _records("-" if output is None else output, PROG, [{"type": "agent_snapshot", **answer}], agent=agent)
        img = answer.get("image", {})
        _say(f"{img.get('path', image)}: {format_size(answer['bytes'])} of {answer['buffers']} allocations as of "
             f"T0, {'incremental' if img.get('incremental') else 'full'}; {answer['stall_s'] * 1e3:.2f} ms on the "
             f"program's path, {answer['cow']} copy-on-write"
             + ("; the program exited meanwhile and handed the image over" if img.get("handover") else ""))
        return
    if compress or option_given(ctx, "checksum"):
        raise GpuosError("--compress and --checksum go with --agent PID or --job PID --cut (the agent path's images; "
                         "a CRIU image is CRIU's)", ExitCode.USAGE)
    if job is not None:
        if pid is not None or profile is not None:
            raise GpuosError("--job goes with --image, --leave-running, --criu-arg, --timeout, --force and -o only",
                             ExitCode.USAGE)
        if image is None and (leave_running or criu_arg):
            raise GpuosError("--leave-running and --criu-arg go with --image", ExitCode.USAGE)
        ckpt = Checkpointer()
        if image is not None:
            result = run_recorded("-" if output is None else output, PROG, ckpt,
                                  lambda: criu_job.dump_job(ckpt, job, image, timeout, leave_running,
                                                            criu_arg or [], force=force),
                                  action="dump", pid=job)
            _say(_describe(result))
            return
        result = run_recorded("-" if output is None else output, PROG, ckpt,
                              lambda: suspend_job(ckpt, job, timeout, force=force), action="checkpoint", pid=job)
        _say(result["message"])
        return
    if (pid is None) == (profile is None):
        raise GpuosError(
            f"give --pid PID, --job PID or --profile FILE, or a command (`{PROG} status`); see `{PROG} --help`",
            ExitCode.USAGE)
    if profile is not None and (image is not None or timeout):
        raise GpuosError("--profile takes its timeout from the profile and cannot make images", ExitCode.USAGE)
    if image is None and (leave_running or criu_arg):
        raise GpuosError("--leave-running and --criu-arg go with --image", ExitCode.USAGE)

    ckpt = Checkpointer()
    if profile is not None:
        prof = load_profile(profile)
        summary, failures = run_recorded(output, PROG, ckpt, lambda: suspend_profile(ckpt, prof),
                                         action="checkpoint", profile=str(profile))
        for e in failures:
            error(PROG, str(e))
        if failures:
            held = summary["suspended"] + summary["already_suspended"]
            where = f"the suspended are listed in {prof.state_file}" if held else "nothing is left suspended"
            error(PROG, f"{summary['suspended']} suspended, {summary['resumed_after_failure']} resumed after the "
                  f"failure, {len(failures)} failed; {where}")
            raise typer.Exit(int(failures[0].code))
        return
    assert pid is not None
    if image is not None:
        result = run_recorded("-" if output is None else output, PROG, ckpt,
                              lambda: agent_criu.dump(ckpt, pid, image, timeout, leave_running, criu_arg or [],
                                                      agent_suspend=not no_agent_suspend),
                              action="dump", pid=pid)
    else:
        result = run_recorded("-" if output is None else output, PROG, ckpt, lambda: ckpt.suspend(pid, timeout),
                              action="checkpoint", pid=pid)
    _say(_describe(result))


def _cut(job: int, image: Path, margin: int, timeout_ms: int, compress: bool, checksum: str,
         threads: Optional[int], output: Optional[str]) -> None:
    """`gpu-ckpt --job PID --cut --image DIR`: one ckpt_job_cut record (gpuos_tools/ckpt/agent_job.py)."""
    # the output opened first: one that cannot be written refuses the cut before any rank is armed
    with open_output("-" if output is None else output) as writer:
        record = agent_job.cut_job(job, image, margin=margin,
                                   wait_s=timeout_ms / 1000 if timeout_ms else agent_job.WAIT_S,
                                   compress=compress, checksum=checksum, threads=threads)
        writer.write(make_header(PROG, pid=job))
        writer.write(record)
    _say(record["message"])


def _suspend(agent: str, image: Optional[Path], partial: bool, max_hold: Optional[float], compress: bool,
             checksum: str, output: Optional[str]) -> None:
    """`gpu-ckpt --agent PID --suspend`: one agent_suspend record (gpuos_tools/agent/suspend.py)."""
    answer = request_suspend(control.resolve(agent), partial=partial, image=str(image) if image else None,
                             compress=compress, checksum=checksum, max_hold_s=max_hold)
    _records("-" if output is None else output, PROG, [{"type": "agent_suspend", "agent": agent, **answer}],
             agent=agent)
    rest = answer["not_owned"]
    text = (f"suspended: {format_size(answer['released_bytes'])} of {answer['buffers']} owned buffers released "
            f"in {answer['suspend_s']:.3f} s ({answer['save_gbps']} GB/s to host)")
    if rest["count"]:
        text += f"; {rest['count']} allocations not owned stay on the GPU ({rest['bytes'] / 2**20:.1f} MiB)"
    if answer.get("image"):
        text += f"; image {answer['image']['path']}"
    _say(text + f"; `gpu-restore --agent {agent} --resume` lets it go on")


def _describe(result: dict[str, Any]) -> str:
    text = result["message"]
    if result.get("bytes"):
        text += f" ({format_size(result['bytes'])}"
        if result.get("checkpoint_s"):
            text += f" in {result['checkpoint_s']:.2f} s"
        text += ")"
    return text


@app.command()
def status(
    pid: Optional[list[int]] = typer.Option(
        None, "--pid", "-p", metavar="PID",
        help="Also report this process (repeatable), e.g. one checkpointed by another tool.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Records even on a terminal."),
    output: str = typer.Option("-", "--output", "-o", metavar="FILE", help="Records to FILE ('-': stdout)."),
) -> None:
    """Every CUDA process with its checkpoint state and GPU memory.

    Lists the processes NVML shows on the GPUs, the processes that map libcuda (checkpointed
    ones hold no GPU, so NVML no longer shows them; without root, only your own are readable),
    those gpu-ckpt checkpointed, and each --pid. Draws a table when stdout is a terminal, writes
    ckpt_status records otherwise.
    """
    ckpt = Checkpointer()
    rows = ckpt.list_processes(pid or [])
    if ckpt.nvml_missing:
        print(f"{PROG}: warning: {ckpt.nvml_missing}: GPU memory per process is unknown", file=sys.stderr)
    if ckpt.unreadable and sys.stderr.isatty():
        _say(f"{ckpt.unreadable} process(es) could not be inspected (another user's: run as root to see them)")
    if json_out or output != "-" or not sys.stdout.isatty():
        with open_output(output) as writer:
            writer.write(make_header(f"{PROG} status", **ckpt.header_fields()))
            for rec in rows:
                writer.write(rec)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for column, justify in (("PID", "right"), ("JOB/RANK", "left"), ("USER", "left"), ("STATE", "left"),
                            ("GPU MEMORY", "right"), ("GPUS", "left"), ("COMMAND", "left")):
        table.add_column(column, justify=justify, no_wrap=column != "COMMAND")
    # the ranks of a job together, in rank order
    rows = sorted(rows, key=lambda r: (r.get("job") or r["pid"], r.get("rank", -1), r["pid"]))
    for rec in rows:
        mem = rec.get("memory")
        gpus = ",".join(str(g["index"]) for g in rec.get("gpus") or [])
        if not gpus and rec.get("checkpointed"):
            gpus = "(" + ",".join(str(g.get("index")) for g in rec["checkpointed"].get("gpus") or []) + ")"
        job = f"{rec['job']}/{rec['rank']}" if rec.get("job") else ""
        table.add_row(str(rec["pid"]), job, rec.get("user", "?"), rec.get("state") or rec.get("error", "?"),
                      "?" if mem is None else f"{format_size(mem)}", gpus, " ".join(rec.get("command", "").split()))
    Console().print(table)


def _records(output: str, tool: str, records: list[dict[str, Any]], **fields: Any) -> None:
    with open_output(output) as writer:
        writer.write(make_header(tool, **fields))
        for rec in records:
            writer.write(rec)


@app.command()
def check(
    directory: Optional[Path] = typer.Option(
        None, "--dir", metavar="DIR", help="Also check DIR as a place for images (filesystem, O_DIRECT, free space)."),
    json_out: bool = typer.Option(False, "--json", help="Records even on a terminal."),
    output: str = typer.Option("-", "--output", "-o", metavar="FILE", help="Records to FILE ('-': stdout)."),
) -> None:
    """Say what works on this host for checkpointing, and why not, touching no process.

    Checks the NVIDIA driver and its checkpoint API, the virtual memory management API, CRIU
    (version 4 or later, and `criu check`), CUPTI, permissions (root or CAP_SYS_ADMIN /
    CAP_CHECKPOINT_RESTORE for CRIU, the state directory), host memory available for staging
    snapshots, and with --dir the image directory. Then which paths are usable: the driver path
    (`--pid`), full-process images (`--pid --image`) and the agent path (`run`, `--agent`).
    Draws a table on a terminal, writes ckpt_check records otherwise. Exits 1 when a check
    failed (warnings do not count), like `criu check`.
    """
    records = run_checks(image_dir=str(directory) if directory is not None else None)
    summary = records[-1]
    if json_out or output != "-" or not sys.stdout.isatty():
        with open_output(output) as writer:
            writer.write(make_header(f"{PROG} check"))
            for rec in records:
                writer.write(rec)
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(box=None, header_style="bold")
        for column in ("CHECK", "STATUS", "DETAIL"):
            table.add_column(column, no_wrap=column != "DETAIL")
        colour = {"ok": "green", "warn": "yellow", "fail": "red", "skip": "dim"}
        for name, status_, detail in table_rows(records):
            table.add_row(name, f"[{colour[status_]}]{status_}[/]", detail)
        console = Console()
        console.print(table)
        paths = {"driver": "driver path (--pid)", "process_images": "full-process images (--pid --image)",
                 "agent": "agent path (run, --agent)"}
        console.print("usable: " + ", ".join(f"{text} {'yes' if summary[key] else 'no'}" for key, text in paths.items()),
                      highlight=False)
    if summary["failed"]:
        raise typer.Exit(int(ExitCode.FAILURE))


@app.command()
def compact(
    head: Path = typer.Argument(..., metavar="HEAD", help="The newest image of a chain (an agent-path image directory)."),
    out: Path = typer.Argument(..., metavar="OUT", help="The full image to write (must not exist)."),
    compress: Optional[bool] = typer.Option(
        None, "--compress/--no-compress", help="zstd per chunk (default: as HEAD was written)."),
    chunk_size: Optional[str] = typer.Option(
        None, "--chunk-size", metavar="SIZE", help="Bytes per chunk (default: HEAD's); " + SIZE_HELP + "."),
    output: str = typer.Option("-", "--output", "-o", metavar="FILE", help="Records to FILE ('-': stdout)."),
) -> None:
    """Fold an incremental image and its parent chain into one full image.

    Reads every buffer of HEAD through its chain (checking each chunk's checksum) and writes
    them into OUT, which appears only when complete. The images of the chain are left as they
    are. Writes one image_compact record.
    """
    size = None
    if chunk_size is not None:
        try:
            size = parse_size(chunk_size)
        except ValueError as e:
            raise GpuosError(f"--chunk-size: {e}", ExitCode.USAGE) from None
        if size <= 0:
            raise GpuosError("--chunk-size must be positive", ExitCode.USAGE)
    chain = [i.image_id for i in img.open_image(head).chain()]
    summary = img.compact(head, out, compress=compress, chunk_size=size)
    _records(output, f"{PROG} compact", [{"type": "image_compact", "head": str(head), "chain": chain,
                                          "image": summary["path"], **{k: v for k, v in summary.items()
                                                                       if k != "path"}}])
    _say(f"{out}: {len(chain)} image(s) folded, {format_size(summary['bytes'])} in {summary['seconds']:.2f} s")


@app.command()
def periodic(
    profile: Path = typer.Option(..., "--profile", metavar="FILE", help="The periodic-checkpoint profile (TOML)."),
    plan: bool = typer.Option(
        False, "--plan", help="Only say what the run would do (next image, full or incremental, what retention "
        "would delete); take nothing, delete nothing."),
    output: Optional[str] = typer.Option(
        None, "--output", "-o", metavar="FILE",
        help="Records to FILE ('-': stdout). Default: none (quiet on success, for cron); stdout with --plan."),
) -> None:
    """Take the next periodic checkpoint image of an agent process, and apply retention.

    For cron: one consistent snapshot through the process's agent into the profile's directory,
    full or incremental on the newest image (chain.length), visible only once complete; then the
    images retention no longer wants are deleted (never one a kept image chains to). Silent on
    success; a message on stderr and a non-zero status on failure.
    """
    import time

    prof = per.load_periodic_profile(profile)
    if plan:
        now = time.time()
        images = per.list_images(prof)
        step = per.plan_next(prof, images, now)
        parent_id = None if step.parent is None else next(e.image_id for e in images if e.path == step.parent)
        future = [per.Entry(step.name, step.path, now, "(new)", parent_id), *images]
        kept, doomed = per.retention(prof, future, now)
        _records("-" if output is None else output, f"{PROG} periodic", [{
            "type": "ckpt_periodic_plan", "profile": str(profile), "directory": str(prof.directory),
            "image": step.name, "kind": "full" if step.parent is None else "incremental",
            "parent": None if step.parent is None else step.parent.name, "why": step.why,
            "would_keep": [e.name for e in kept], "would_delete": [e.name for e in doomed],
            "damaged": per.damaged(images)}], profile=str(profile))
        _damaged(per.damaged(images))
        return
    snapshot = per.snapshot_function(prof)
    record = per.run_periodic(prof, snapshot)
    if output is not None:
        _records(output, f"{PROG} periodic", [record], profile=str(profile))
    _damaged(record["damaged"])


def _damaged(damaged: list[dict[str, str]]) -> None:
    """Damaged images never stop a periodic run, but the run ends with FAILURE naming each one,
    so that cron (through chronic) shows them until someone looks."""
    for d in damaged:
        error(PROG, f"damaged image left as it is (not chained to, not counted, not deleted): {d['problem']}")
    if damaged:
        raise typer.Exit(int(ExitCode.FAILURE))



@app.command(
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    no_args_is_help=True,
)
@doc_format(mechanism_default=MECHANISM_DEFAULT)
def run(
    program: list[str] = typer.Argument(..., metavar="-- PROGRAM [ARGS]...", help="The Python program and its arguments."),
    output: str = typer.Option(
        "-", "--output", "-o", metavar="FILE", help="The trace stream to FILE ('-': stdout; *.zst compressed)."),
    cow_budget: Optional[str] = typer.Option(
        None, "--cow-budget", metavar="SIZE",
        help="Device memory for copy-on-write slots during a snapshot (default: a quarter of the free "
        "memory, at most the snapshot's size); " + SIZE_HELP + ".",
    ),
    no_images: bool = typer.Option(False, "--no-images", help="Record module hashes but do not store the images."),
    stage_ahead: bool = typer.Option(
        False, "--stage-ahead",
        help="Pin host staging for snapshots in the background as the program allocates, so that no "
        "snapshot waits for it (costs as much pinned host memory as the program has on the GPU).",
    ),
) -> None:
    """Start PROGRAM under the agent, so that it can be checkpointed while it runs.

    The same as `gpu-trace run --agent`, through the same code: the trace stream goes to
    standard output, or to FILE with -o; gpu-trace(1) has the options not repeated here. Then
    `gpu-ckpt --agent PID --image DIR` takes images of the running program and
    `gpu-restore --agent PID --image DIR` rolls it back, PID being the program's (the stream's
    header names it and the agent's socket). Exits with the program's own status. How the agent
    sees the driver calls is GPUOS_AGENT_MECHANISM's to say (cupti or intercept; gpu-trace run
    --agent --mechanism); without it, {mechanism_default}.
    """
    summary = launcher.run_program(program, output=output, no_images=no_images, agent=True, cow_budget=cow_budget,
                                   stage_ahead=stage_ahead, warn=lambda m: warn(PROG, m))
    raise typer.Exit(report_run(PROG, summary))


def main() -> None:
    run_app(app, prog=PROG)


if __name__ == "__main__":
    main()
