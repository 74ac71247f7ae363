"""gpu-restore: bring a process checkpointed by gpu-ckpt back onto a GPU and let it run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from gpuos_tools import image as img
from gpuos_tools.agent import control
from gpuos_tools.agent.suspend import request_resume
from gpuos_tools.ckpt import agent_criu, agent_job, criu_job, ports
from gpuos_tools.ckpt.driver import Checkpointer
from gpuos_tools.ckpt.job import resume_job
from gpuos_tools.ckpt.move import check_movable, check_target, move_suspended
from gpuos_tools.ckpt.profile import load_profile, resume_profile
from gpuos_tools.ckpt.records import run_recorded
from gpuos_tools.commands.cli import error, option_given, options_before_subcommand, run_app, stderr_console, warn
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.stream import make_header, open_output
from gpuos_tools.units import format_size

PROG = "gpu-restore"


app = typer.Typer(name=PROG, add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)


@app.callback(invoke_without_command=True)
def restore(
    ctx: typer.Context,
    pid: Optional[int] = typer.Option(None, "--pid", "-p", metavar="PID", help="The checkpointed process."),
    job: Optional[int] = typer.Option(
        None, "--job", metavar="PID",
        help="Restore every CUDA process in the tree of PID that `gpu-ckpt --job PID` checkpointed: all "
        "their memory back first, then every one unlocked (each on the GPU it was checkpointed on, or "
        "moved by --device-map).",
    ),
    device: Optional[str] = typer.Option(
        None, "--device", "-d", metavar="INDEX|UUID",
        help="Restore onto this GPU (nvidia-smi index, or UUID or a unique prefix of it) instead of "
        "the one it was checkpointed on. With --agent PID --resume: move the suspended program there first.",
    ),
    device_map: Optional[str] = typer.Option(
        None, "--device-map", metavar="OLD=NEW,...",
        help="Restore each GPU OLD onto NEW (indexes or UUIDs), for processes on several GPUs; with "
        "--job, every process of the job moves the same way (e.g. 0=1,1=0 swaps a two-GPU job).",
    ),
    image: Optional[Path] = typer.Option(
        None, "--image", metavar="DIR",
        help="Restore the CRIU image gpu-ckpt --image wrote into DIR, then, when the dump had the program's agent "
        "suspend it, have the agent resume it (an image of a job, from gpu-ckpt --job PID "
        "--image: the whole tree, then every rank's GPU state before any is unlocked; --device-map moves every "
        "rank the same way). With --agent: the agent-path "
        "image (gpu-ckpt --agent) to roll the program back to.",
    ),
    agent: Optional[str] = typer.Option(
        None, "--agent", metavar="PID|SOCKET",
        help="Roll a program started with `gpu-trace run --agent` back to the image --image DIR: its "
        "device memory is written back at the same addresses (stop-the-world, while it waits).",
    ),
    timeout: float = typer.Option(
        3600.0, "--timeout", metavar="S", min=1.0, show_default=False,
        help="With --agent, or --job --cut: how long to wait for the answer of the agent (of each rank's), a "
        "rollback's writing included, in seconds (default 3600). With a CRIU image (--image DIR): how long to "
        "wait before CRIU runs for closed connections (TIME_WAIT) to free the ports of the image's listening "
        f"sockets (default {ports.WAIT_S:.0f}).",
    ),
    resume: bool = typer.Option(
        False, "--resume",
        help="With --agent: let a program suspended by `gpu-ckpt --agent PID --suspend` go on (its memory is "
        "mapped again at the same addresses and reloaded). With --device or --device-map it moves first, through "
        "the driver's checkpoint: only a job whose agent runs on interception (--mechanism intercept; the driver "
        "refuses a process with CUPTI loaded).",
    ),
    lazy: bool = typer.Option(
        False, "--lazy",
        help="With --agent --resume or --agent --image: let the program go on at once; each launch, copy or memset "
        "waits on the GPU for the buffers it touches (unknown: all), the rest load behind it, the most recently "
        "touched first. With --image DIR of a program whose agent the dump suspended: its agent's resume, after "
        "the restore, is lazy so.",
    ),
    criu_arg: Optional[list[str]] = typer.Option(
        None, "--criu-arg", metavar="ARG",
        help="With --image: pass ARG to `criu restore` (repeatable; a job's image is restored with the options "
        "it was dumped with).",
    ),
    cut: bool = typer.Option(
        False, "--cut",
        help="With --job PID --image DIR: roll every rank of the running job back to the job image `gpu-ckpt --job "
        "PID --cut` wrote (every rank's image checked against its process before any is written; NCCL's own "
        "memory is left as it is). The ranks must then go on from the point of the cut (see the manual).",
    ),
    profile: Optional[Path] = typer.Option(
        None, "--profile", metavar="FILE", help="Resume the processes that gpu-ckpt --profile FILE suspended.",
    ),
    output_to: Optional[Path] = typer.Option(
        None, "--output-to", metavar="FILE",
        help="With --image DIR: append to FILE what the restored program writes to a pipe whose reader was outside "
        "the image (`prog | tee log`), even where that reader is still alive (/dev/null: discard it). Default: the "
        "pipe itself while its reader is alive, else DIR.restored-PID-fdN.log beside the image; said on stderr "
        "and in the record's `outside`.",
    ),
    output: Optional[str] = typer.Option(
        None, "--output", "-o", metavar="FILE",
        help="Records to FILE ('-': stdout; *.zst compressed). Default: stdout, none with --profile.",
    ),
) -> None:
    """Restore a process checkpointed by gpu-ckpt, onto its GPU or another, and unlock it.

    Restores the device memory of a process checkpointed through the NVIDIA driver checkpoint
    API (by gpu-ckpt or any other tool), onto the GPUs it was on or onto another GPU of the same
    kind, and unlocks its CUDA calls. Each step is written as a gpuos stream record.
    `gpu-restore verify IMAGE` and `gpu-restore diff A B` check and compare images of the
    agent path.
    """
    if ctx.invoked_subcommand is not None:
        given = options_before_subcommand(ctx)
        if given:
            raise GpuosError(f"{', '.join(given)}: options go after the command: "
                             f"{PROG} {ctx.invoked_subcommand} [OPTIONS]", ExitCode.USAGE)
        return
    if option_given(ctx, "timeout") and agent is None and not cut and (image is None or job is not None):
        raise GpuosError("--timeout goes with --agent PID, --job PID --cut or --image DIR (the driver path waits for "
                         "the driver)", ExitCode.USAGE)
    port_wait_s = timeout if option_given(ctx, "timeout") else ports.WAIT_S
    if output_to is not None and (image is None or agent is not None or cut or job is not None or pid is not None):
        raise GpuosError("--output-to goes with --image DIR (a CRIU image of gpu-ckpt --image) only", ExitCode.USAGE)
    to = None if output_to is None else str(output_to.absolute())  # the record names the file wherever read
    if cut:
        if job is None or image is None:
            raise GpuosError("--cut goes with --job PID --image DIR (the job image gpu-ckpt --job PID --cut wrote)",
                             ExitCode.USAGE)
        if any(x is not None for x in (pid, agent, device, device_map, profile)) or criu_arg or resume or lazy:
            raise GpuosError("--job --cut goes with --image, --timeout and -o only (the ranks are rolled back on "
                             "their own GPUs)", ExitCode.USAGE)
        # the output opened first: one that cannot be written refuses the rollback before any rank is written
        with open_output("-" if output is None else output) as writer:
            record = agent_job.rollback_job(job, image, timeout=timeout)
            writer.write(make_header(PROG))
            writer.write(record)
        if sys.stderr.isatty():
            stderr_console().print(f"{PROG}: {record['message']}", highlight=False)
        return
    if resume and agent is None:
        raise GpuosError("--resume goes with --agent PID (the driver path: --pid PID)", ExitCode.USAGE)
    if lazy and agent is None and (image is None or any(x is not None for x in (pid, job, profile))):
        raise GpuosError("--lazy goes with --agent PID --resume, --agent PID --image DIR, or --image DIR (a "
                         "full-process image whose dump suspended the program's agent)", ExitCode.USAGE)
    if agent is not None and resume:
        if any(x is not None for x in (pid, job, profile, image)) or criu_arg:
            raise GpuosError("--agent --resume goes with --device, --device-map, --lazy, --timeout and -o only",
                             ExitCode.USAGE)
        if device is not None and device_map is not None:
            raise GpuosError("give --device or --device-map, not both", ExitCode.USAGE)
        if device is not None or device_map is not None:
            _move(agent, device, device_map, output, timeout, lazy)
        else:
            _resume(agent, output, timeout, lazy)
        return
    if agent is not None:
        if any(x is not None for x in (pid, job, device, device_map, profile)) or criu_arg:
            raise GpuosError("--agent goes with --image, --timeout and -o only", ExitCode.USAGE)
        if image is None:
            raise GpuosError("--agent needs --image DIR: the image to roll back to", ExitCode.USAGE)
        _rollback(agent, image, output, timeout, lazy)
        return
    if job is not None:
        if image is not None and pid is None and profile is None:
            kind = agent_job.image_kind(image)
            if kind == "cut":
                raise GpuosError(f"{image} is a job's cut: add --cut to roll the job back to it "
                                 f"(`{PROG} --job {job} --cut --image {image}`)", ExitCode.USAGE)
            if kind == "criu-job":
                raise GpuosError(f"{image} is a CRIU image of a job: `{PROG} --image {image}` restores it (the job's "
                                 "processes come back under their old PIDs): no --job", ExitCode.USAGE)
        if any(x is not None for x in (pid, image, profile, device)) or criu_arg:
            raise GpuosError("--job goes with --device-map and -o only (--device moves one process; a job "
                             "moves by a map of its GPUs)", ExitCode.USAGE)
        ckpt = Checkpointer()
        result = run_recorded("-" if output is None else output, PROG, ckpt,
                              lambda: resume_job(ckpt, job, device_map=device_map), action="restore", pid=job)
        if sys.stderr.isatty():
            stderr_console().print(f"{PROG}: {result['message']}", highlight=False)
        return
    if sum(x is not None for x in (pid, image, profile)) != 1:
        raise GpuosError(f"give one of --pid PID, --job PID, --image DIR, --profile FILE; see `{PROG} --help`",
                         ExitCode.USAGE)
    if device is not None and device_map:
        raise GpuosError("give --device or --device-map, not both", ExitCode.USAGE)
    if profile is not None and (device is not None or device_map):
        raise GpuosError("--profile restores every process where it was: no --device", ExitCode.USAGE)
    if criu_arg and image is None:
        raise GpuosError("--criu-arg goes with --image", ExitCode.USAGE)

    if image is not None and agent_job.image_kind(image) in ("cut", "agent"):
        raise agent_job.wrong_image(image, agent_job.image_kind(image), "a CRIU image (gpu-ckpt --image)")
    ckpt = Checkpointer()
    if profile is not None:
        prof = load_profile(profile)
        summary, failures = run_recorded(output, PROG, ckpt, lambda: resume_profile(ckpt, prof),
                                         action="restore", profile=str(profile))
        for e in failures:
            error(PROG, str(e))
        if failures:
            error(PROG, f"{summary['resumed']} resumed, {len(failures)} failed; "
                  f"{summary['still_suspended']} still listed in {prof.state_file}")
            raise typer.Exit(int(failures[0].code))
        return
    if image is not None and criu_job.is_job_image(image):
        if lazy:
            raise GpuosError(f"{image} is the image of a job: --lazy goes with the image of one program whose "
                             "agent the dump suspended", ExitCode.USAGE)
        if device is not None:
            raise GpuosError(f"{image} is the image of a job: it moves by --device-map (every process the same "
                             "way), not --device", ExitCode.USAGE)
        result = run_recorded("-" if output is None else output, PROG, ckpt,
                              lambda: criu_job.restore_job(ckpt, image, device_map, criu_arg or [],
                                                           port_wait_s=port_wait_s, warn=lambda m: warn(PROG, m),
                                                           output_to=to, waiting=PortWait()),
                              action="restore", image=str(image))
    elif image is not None:
        result = run_recorded("-" if output is None else output, PROG, ckpt,
                              lambda: agent_criu.restore(ckpt, image, device, device_map, criu_arg or [], lazy=lazy,
                                                         port_wait_s=port_wait_s, output_to=to,
                                                         warn=lambda m: warn(PROG, m), waiting=PortWait()),
                              action="restore", image=str(image))
    else:
        assert pid is not None
        result = run_recorded("-" if output is None else output, PROG, ckpt,
                              lambda: ckpt.resume(pid, device, device_map), action="restore", pid=pid)
    if sys.stderr.isatty():
        text = result["message"]
        if result.get("restore_s") is not None:
            text += f" (restore {result['restore_s']:.2f} s)"
        if result.get("port_wait_s"):
            text += f"; first waited {result['port_wait_s']:.1f} s for the ports of its listening sockets"
        stderr_console().print(f"{PROG}: {text}", highlight=False)


class PortWait:
    """While a CRIU restore waits for ports that closed connections hold (``ports.wait_for_ports``
    said why, once, on stderr): on a terminal, a line below that counts the seconds, gone when the
    wait ends; elsewhere nothing more (that one line is the message)."""

    def __init__(self) -> None:
        self._status: Any = None

    def __call__(self, waited: float | None) -> None:
        if waited is None:
            if self._status is not None:
                self._status.stop()
                self._status = None
            return
        if not sys.stderr.isatty():
            return
        text = f"{PROG}: waiting for the ports: {waited:.0f} s"
        if self._status is None:
            self._status = stderr_console().status(text)
            self._status.start()
        else:
            self._status.update(text)


def _resume(agent: str, output: Optional[str], timeout: float, lazy: bool = False) -> None:
    """`gpu-restore --agent PID --resume [--lazy]`: one agent_resume record (gpuos_tools/agent/suspend.py)."""
    answer = request_resume(control.resolve(agent), timeout=timeout, lazy=lazy)
    _records("-" if output is None else output, PROG, [{"type": "agent_resume", "agent": agent, **answer}])
    if sys.stderr.isatty() and answer.get("lazy"):
        stderr_console().print(
            f"{PROG}: going on after {answer['resume_s'] * 1000:.1f} ms; {format_size(answer['bytes'])} in "
            f"{answer['buffers']} buffers load behind it (ping shows when they are back)", highlight=False)
    elif sys.stderr.isatty():
        stderr_console().print(
            f"{PROG}: resumed: {format_size(answer['bytes'])} in {answer['buffers']} buffers back in "
            f"{answer['resume_s']:.3f} s ({answer['load_gbps']} GB/s); the program waited {answer['held_s']:.2f} s",
            highlight=False)


def _move(agent: str, device: Optional[str], device_map: Optional[str], output: Optional[str], timeout: float,
          lazy: bool) -> None:
    """`gpu-restore --agent PID --resume --device N`: the suspended job moved through the driver's
    checkpoint, then resumed by its agent (gpuos_tools/ckpt/move.py); only a job on interception."""
    target = control.resolve(agent)
    status = control.request(target, "ping", timeout=timeout)
    check_movable(status)  # before any record: a job on CUPTI is refused untouched
    ckpt = Checkpointer()
    check_target(ckpt, int(status["pid"]), device, device_map)  # and a GPU that is not there
    result = run_recorded("-" if output is None else output, PROG, ckpt,
                          lambda: move_suspended(ckpt, status, device, device_map,
                                                 lambda: request_resume(target, timeout=timeout, lazy=lazy)),
                          action="restore", pid=int(status["pid"]))
    if sys.stderr.isatty():
        stderr_console().print(f"{PROG}: {result['message']}; resumed by its agent", highlight=False)


def _rollback(agent: str, image: Path, output: Optional[str], timeout: float, lazy: bool = False) -> None:
    """`gpu-restore --agent`: ask the agent to write the image back; one agent_rollback record."""
    kind = agent_job.image_kind(image)
    if kind in ("cut", "criu-job", "criu"):
        raise agent_job.wrong_image(image, kind, "an agent-path image of one program")
    img.open_image(image).chain()  # a missing or broken image is refused here, before the agent is asked
    answer = control.request(control.resolve(agent), "rollback", timeout=timeout, image=str(image.absolute()),
                             **({"lazy": True} if lazy else {}))
    answer.pop("ok", None)
    _records("-" if output is None else output, PROG, [{"type": "agent_rollback", "agent": agent, **answer}])
    if sys.stderr.isatty() and answer.get("lazy"):
        stderr_console().print(
            f"{PROG}: {answer['image']}: going on after {answer['stall_s'] * 1e3:.1f} ms; {format_size(answer['bytes'])} "
            f"in {answer['buffers']} allocations written back behind the program", highlight=False)
    elif sys.stderr.isatty():
        stderr_console().print(
            f"{PROG}: {answer['image']}: {format_size(answer['bytes'])} in {answer['buffers']} allocations written "
            f"back; the program waited {answer['stall_s'] * 1e3:.1f} ms", highlight=False)


def _records(output: str, tool: str, records: list[dict[str, Any]]) -> None:
    with open_output(output) as writer:
        writer.write(make_header(tool))
        for rec in records:
            writer.write(rec)


def _to_terminal(json_out: bool, output: str) -> bool:
    return not json_out and output == "-" and sys.stdout.isatty()


@app.command()
def verify(
    image: Path = typer.Argument(..., metavar="IMAGE", help="An image directory of the agent path."),
    quick: bool = typer.Option(False, "--quick", help="Check files and sizes only; do not read the chunks."),
    json_out: bool = typer.Option(False, "--json", help="The record even on a terminal."),
    output: str = typer.Option("-", "--output", "-o", metavar="FILE", help="Records to FILE ('-': stdout)."),
) -> None:
    """Check an image and its parent chain: manifest, every chunk's presence, size and checksum.

    Each problem is reported on standard error naming the file (and the buffer and chunk); the
    status is then IMAGE_CORRUPT (90). Writes one image_verify record (a line on standard
    error instead when standard output is a terminal).
    """
    if not image.exists():
        raise GpuosError(f"{image}: no such image", ExitCode.NO_INPUT)
    problems = img.verify(image, data=not quick)
    rec: dict[str, Any] = {"type": "image_verify", "image": str(image), "ok": not problems, "problems": problems,
                           "quick": quick}
    if not problems:
        opened = img.open_image(image)
        rec.update(chain=[i.path for i in opened.chain()], buffers=len(opened.buffers),
                   bytes=sum(int(b["size"]) for b in opened.buffers))
    if _to_terminal(json_out, output):
        if not problems:
            stderr_console().print(f"{PROG}: {image}: ok ({rec['buffers']} buffers, {format_size(rec['bytes'])}, "
                                   f"chain of {len(rec['chain'])})", highlight=False)
    else:
        _records(output, f"{PROG} verify", [rec])
    for problem in problems:
        error(PROG, problem)
    if problems:
        raise typer.Exit(int(ExitCode.IMAGE_CORRUPT))


@app.command()
def diff(
    a: Path = typer.Argument(..., metavar="A", help="An image directory of the agent path."),
    b: Path = typer.Argument(..., metavar="B", help="Another one (each is read through its parent chain)."),
    json_out: bool = typer.Option(False, "--json", help="Records even on a terminal."),
    output: str = typer.Option("-", "--output", "-o", metavar="FILE", help="Records to FILE ('-': stdout)."),
) -> None:
    """Which buffers differ between two images, and where (ad-hoc debugging).

    Compares buffer by buffer, by the chunk checksums where both images use the same chunk size
    (chunks with equal crc32 sums are read and compared; by their bytes otherwise): buffers added, removed, moved or resized, and the
    changed byte ranges at chunk granularity. Draws a table on a terminal, writes image_diff
    records and an image_diff_summary otherwise. Exits 0 when they hold the same contents, 1
    when they differ (as diff(1) does).
    """
    for p in (a, b):
        if not p.exists():
            raise GpuosError(f"{p}: no such image", ExitCode.NO_INPUT)
    ia, ib = img.open_image(a), img.open_image(b)
    rows = img.diff(ia, ib)
    count = {c: sum(r["change"] == c for r in rows) for c in ("added", "removed", "resized", "changed")}
    summary = {"type": "image_diff_summary", "a": str(a), "b": str(b), "buffers_a": len(ia.buffers),
               "buffers_b": len(ib.buffers), **count,
               "bytes_changed": sum(r.get("bytes", 0) for r in rows), "identical": not rows}
    if _to_terminal(json_out, output):
        from rich.console import Console
        from rich.table import Table


        table = Table(box=None, header_style="bold")
        for column, justify in (("BUFFER", "right"), ("CHANGE", "left"), ("ADDRESS", "right"), ("SIZE", "right"),
                                ("CHANGED", "right"), ("RANGES", "left")):
            table.add_column(column, justify=justify)
        for r in rows:
            ranges = ", ".join(f"{s:#x}-{e:#x}" for s, e in r.get("ranges", [])[:4])
            if len(r.get("ranges", [])) > 4:
                ranges += f", ... ({len(r['ranges'])} ranges)"
            table.add_row(str(r["buffer"]), r["change"], f"{r['addr']:#x}", format_size(r["size"]),
                          format_size(r["bytes"]) if "bytes" in r else "", ranges)
        if rows:
            Console().print(table)
        stderr_console().print(
            f"{PROG}: {'identical' if not rows else 'differ'}: {count['changed']} changed "
            f"({summary['bytes_changed'] / 2**20:.1f} MiB), {count['added']} added, {count['removed']} removed, "
            f"{count['resized']} resized", highlight=False)
    else:
        _records(output, f"{PROG} diff", [*rows, summary])
    if rows:
        raise typer.Exit(int(ExitCode.FAILURE))


def main() -> None:
    run_app(app, prog=PROG)


if __name__ == "__main__":
    main()
