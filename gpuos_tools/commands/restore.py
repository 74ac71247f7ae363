"""gpu-restore: bring a process checkpointed by gpu-ckpt back onto a GPU and let it run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from gpuos_tools.ckpt.records import man_sections
from gpuos_tools.commands.cli import error, options_before_subcommand, run_app, stderr_console
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.units import format_size

PROG = "gpu-restore"

EXAMPLES = """\
Resume a process where it was:

    gpu-restore --pid 4242

Move it onto GPU 1 (the same kind of GPU; by nvidia-smi index or UUID):

    gpu-restore --pid 4242 --device 1
    gpu-restore --pid 4242 --device GPU-5b2c1f9e

A process on GPUs 0 and 1, moved onto 2 and 3 of a four-GPU machine:

    gpu-restore --pid 4242 --device-map 0=2,1=3,2=0,3=1

Nightly maintenance from root's crontab: gpu-ckpt suspends the jobs the profile selects at
02:00, gpu-restore brings exactly those back at 02:30 (chronic, from moreutils, shows output
only when a command fails; both are quiet on success anyway):

    0 2 * * *  chronic gpu-ckpt --profile /etc/gpuos-tools/maintenance.toml
    30 2 * * * chronic gpu-restore --profile /etc/gpuos-tools/maintenance.toml

A full-process image written by `gpu-ckpt --pid 4242 --image /var/tmp/job.img` (as root):

    gpu-restore --image /var/tmp/job.img

Roll a program started with `gpu-trace run --agent` back to an image `gpu-ckpt --agent` took
of it (say, the last one before its loss went NaN), then let it go on:

    gpu-restore --agent 4242 --image /var/lib/gpuos-tools/images/train/train-20261122T031500.000Z

The same, letting the program go on at once, each buffer written back before its first use:

    gpu-restore --agent 4242 --image /var/lib/gpuos-tools/images/train/train-20261122T031500.000Z --lazy

Let a program suspended by `gpu-ckpt --agent 4242 --suspend` go on, after all its memory is
back, or at once, each launch waiting only for the buffers it touches:

    gpu-restore --agent 4242 --resume
    gpu-restore --agent 4242 --resume --lazy

Check an image of the agent path (and its parent chain), and compare two:

    gpu-restore verify /var/lib/gpuos-tools/images/train/train-20261122T031500.000Z
    gpu-restore diff before.img after.img
    gpu-restore diff before.img after.img | jq -c 'select(.type=="image_diff") | [.buffer, .change, .bytes]'"""

NOTES = """\
A process checkpointed by `gpu-ckpt --pid` is restored in place by default: its memory goes
back to the GPUs it was on, at the same addresses, and its CUDA calls unblock. A process that
is merely locked (by an interrupted tool, say) is unlocked.

`--device` moves a one-GPU process onto another GPU of the same kind with enough free memory;
gpu-ckpt recorded which GPU it used. The driver wants a map of every GPU of the machine, so
gpu-restore swaps the process's GPU and the target and maps every other GPU onto itself; a
process that used several GPUs needs `--device-map OLD=NEW,...` (pairs not given map a GPU
onto itself; the result must be a permutation). Moving needs driver release 580 or later, and
the NVIDIA driver refuses it on some systems: the process then stays checkpointed, and
`gpu-restore --pid PID` restores it in place.

If the restore fails, the process is left checkpointed (restorable) and the message says so;
if the unlock fails after a restore, it is left locked and `gpu-restore --pid PID` unlocks it.

`--image DIR` runs `criu restore` (CRIU 4 or later, checked first) on an image written by
`gpu-ckpt --image`, then restores the GPU state and unlocks. CRIU restores the process under
its old PID, which must be free.

`--profile FILE` resumes exactly the processes listed in the profile's state file by
`gpu-ckpt --profile`, removes them from it (the file goes when it is empty), and keeps those
that failed, so that running it again retries them. It is silent on success.

`--agent PID|SOCKET --image DIR` rolls a program started with `gpu-trace run --agent` back to an
image of the agent path (full, or incremental and read down its chain): its device memory is
written back at the same addresses. The image is read and every chunk's checksum checked into
pinned host memory first, while the program runs; then the agent stops the world (the program's
next launch, copy, memset or free waits), waits for the GPU work already submitted, copies every
buffer back and lets the program go on. Only device memory goes back: the program's host state
(its Python objects, a step counter) is its own, so roll back at a point the program knows
about. Refused, with nothing written: a damaged image or broken chain (90, IMAGE_CORRUPT, naming
the chunk); an image taken on another GPU model or CUDA driver version, or whose allocations
(address and size) are not exactly the program's live device allocations (92,
IMAGE_MISMATCH: allocations made or freed since the image was taken). A fresh run of the same
deterministic program often gets the same addresses, so an image can restart a job that
crashed. One `agent_rollback` record: the image, buffers, bytes, read_s, stall_s (how long
the program was held), GB/s, and hold_at and go_at (CLOCK_MONOTONIC seconds: when the program
was stopped and let go).

`--agent PID|SOCKET --resume` lets a program suspended by `gpu-ckpt --agent PID --suspend` go
on: its owned buffers get new physical memory at the same addresses, their contents are copied
back from the agent's pinned host memory, and the program's waiting call proceeds. One
`agent_resume` record: buffers, bytes, resume_s, load_gbps and held_s (how long the program
waited). Refused with 79 (WRONG_STATE) when the program is not suspended. When the GPU has not
enough free memory for it any more, the resume fails (71, CUDA_ERROR) and the program stays
suspended, its memory in host RAM: free the GPU and resume again. Onto another GPU: not
through the agent (the program's context stays on its GPU, and the driver's checkpoint, which
could move it, refuses a process with CUPTI loaded); `--device` is refused with `--resume`.

`--resume --lazy` lets the program go on at once and brings its memory back behind it, through
the agent's residency engine. The engine stands before each of the program's launches, copies,
memsets, graph launches and frees: a buffer the operation touches that is not back yet gets its
physical memory and its load (on a stream of the agent's) there and then, and the operation's
stream is made to wait on the GPU for that load; the program's thread never waits for a load.
What a launch touches is the agent's prediction of its reads and writes (gpu-predict-access's
rules, from the kernel's arguments and the pointer arrays the program copied to the GPU); a
launch whose footprint is unknown (no parameter layout, a pointer the prediction cannot
follow), and every graph launch, waits for every buffer not yet back, so "unknown" costs the
whole reload at that point, no more than an eager resume. A copy waits for its source and
destination (a 3D copy or one through a CUDA array: for every buffer), a memset for its
destination, a free for a load into what it frees. Meanwhile a
thread of the agent's loads the rest, the buffers the program touched most recently first (a
loop's working set), then in the order it first touched them, then by address, at most 512 MiB
ahead of the GPU; while a load on demand is in flight it queues nothing more, so that load waits
at most for those 512 MiB (~10 ms at link speed). The guarantee: every operation of the program runs
after the buffers it touches (as predicted, or all) hold their suspended contents at their
addresses. Until every buffer is back, `gpu-ckpt --agent` snapshots and suspends and rollbacks
are refused (79). A device-wide synchronisation by the program (cudaDeviceSynchronize,
cuCtxSynchronize) waits for the whole reload, the engine's streams being in its context; a
stream's or an event's synchronisation waits only for what that stream's work touches. The
agent's ping answer (`residency`) shows what is pending and, once done,
the reload's time and GB/s. The `agent_resume` record has `lazy: true`; its resume_s is the time
to let the program go.

`--agent PID|SOCKET --image DIR --lazy` rolls back the same way up to the write-back: the same
checks and the same staging (the whole image read and checked into pinned host memory while the
program runs; every refusal above leaves the program's memory as it was), then, under the lock,
the GPU work already submitted completes and the program goes on at once, without its buffers
written back. The residency engine stands before its operations as for `--resume --lazy`: an
operation that touches a buffer not yet written back makes its stream wait on the GPU for that
buffer's write-back (issued there on demand if it has not started); an unknown launch and every
graph launch wait for all of them; a copy (synchronous or not) waits for its source and
destination; a free waits for a write-back in flight into what it frees and the buffer is then
forgotten. A thread of the agent's writes the rest back, the most recently touched buffers
first, then in first-touch order, then by address, at link speed, pausing while a write-back on
demand is in flight. It works whether or not the program's memory is owned: for plain allocations the
agent starts its engine at the first lazy rollback, so that one writes back in address order
(demand first) and later ones in the order learned since. The costs: the guarantee rests on the
prediction, and a kernel that reaches a buffer by a pointer the prediction does not see reads
its old contents (an owned buffer of a lazy resume would fault instead); once the engine runs,
launches are predicted until every allocation has been touched; until every buffer is back,
snapshots, suspends and rollbacks are refused (79) and the image's pinned staging stays in use.
Measured on an H100 (8 GiB): the program is held under 1 ms instead of ~160 ms; its first kernel
ran 2.4-2.8 ms after the hold when its buffer was written back first (recency order), 11.1 ms
when that buffer needed a write-back on demand (159.8 ms, the whole write-back, with the
background not pausing: the copy engine served the background stream's queue first).
The `agent_rollback` record has `lazy: true`; its stall_s is the time the program was held (the
synchronisation included), gbps is null; the write-back's time and GB/s are in the agent's
ping answer (`residency.lazy`, kind rollback) once done.

`gpu-restore verify IMAGE` checks an image of the agent path and its parent chain: the manifest
parses and is complete, every chunk file the manifest lists is there with its size, its bytes
(decompressed) match its checksum, no chunk file is extra, and every parent is there with the
image id recorded, holding each inherited buffer at the same address and size. Each problem is a
line on standard error naming the file, the buffer and the chunk; the status is then 90
(IMAGE_CORRUPT). `--quick` skips reading the chunks.

`gpu-restore diff A B` compares the contents two images describe, each read through its chain:
buffers (by id) added, removed, moved or resized, and for the others the byte ranges that differ,
at chunk granularity: by the chunks' checksums when both images use the same chunk size (equal
sha256 sums are trusted; chunks with equal crc32 sums are read and compared), by reading and
comparing the bytes otherwise. Like diff(1) it exits 0 when the contents are the
same and 1 when they differ."""

MAN_SECTIONS = man_sections(NOTES, EXAMPLES, "gpu-ckpt(1), criu(8), chronic(1)")

app = typer.Typer(name=PROG, add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)


@app.callback(invoke_without_command=True)
def restore(
    ctx: typer.Context,
    pid: Optional[int] = typer.Option(None, "--pid", "-p", metavar="PID", help="The checkpointed process."),
    device: Optional[str] = typer.Option(
        None, "--device", "-d", metavar="INDEX|UUID",
        help="Restore onto this GPU (nvidia-smi index, or UUID or a unique prefix of it) instead of "
        "the one it was checkpointed on.",
    ),
    device_map: Optional[str] = typer.Option(
        None, "--device-map", metavar="OLD=NEW,...",
        help="Restore each GPU OLD onto NEW (indexes or UUIDs), for processes on several GPUs.",
    ),
    image: Optional[Path] = typer.Option(
        None, "--image", metavar="DIR",
        help="Restore the CRIU image gpu-ckpt --image wrote into DIR. With --agent: the agent-path "
        "image (gpu-ckpt --agent) to roll the program back to.",
    ),
    agent: Optional[str] = typer.Option(
        None, "--agent", metavar="PID|SOCKET",
        help="Roll a program started with `gpu-trace run --agent` back to the image --image DIR: its "
        "device memory is written back at the same addresses (stop-the-world, while it waits).",
    ),
    timeout: float = typer.Option(
        3600.0, "--timeout", metavar="S", min=1.0,
        help="With --agent: how long to wait for the agent's answer, in seconds.",
    ),
    resume: bool = typer.Option(
        False, "--resume",
        help="With --agent: let a program suspended by `gpu-ckpt --agent PID --suspend` go on (its memory is "
        "mapped again at the same addresses and reloaded).",
    ),
    lazy: bool = typer.Option(
        False, "--lazy",
        help="With --agent --resume or --agent --image: let the program go on at once; each launch, copy or memset "
        "waits on the GPU for the buffers it touches (unknown: all), the rest load behind it, the most recently touched first.",
    ),
    criu_arg: Optional[list[str]] = typer.Option(
        None, "--criu-arg", metavar="ARG", help="With --image: pass ARG to `criu restore` (repeatable).",
    ),
    profile: Optional[Path] = typer.Option(
        None, "--profile", metavar="FILE", help="Resume the processes that gpu-ckpt --profile FILE suspended.",
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
    if resume and agent is None:
        raise GpuosError("--resume goes with --agent PID (the driver path: --pid PID)", ExitCode.USAGE)
    if lazy and agent is None:
        raise GpuosError("--lazy goes with --agent PID --resume or --agent PID --image DIR", ExitCode.USAGE)
    if agent is not None and resume:
        if device is not None or device_map is not None:
            raise GpuosError("--agent --resume cannot move a program to another GPU: its CUDA context stays on its own, "
                             "and the driver's checkpoint, which could move it, refuses a process with CUPTI loaded",
                             ExitCode.USAGE)
        if any(x is not None for x in (pid, profile, image)) or criu_arg:
            raise GpuosError("--agent --resume goes with --lazy, --timeout and -o only", ExitCode.USAGE)
        _resume(agent, output, timeout, lazy)
        return
    if agent is not None:
        if any(x is not None for x in (pid, device, device_map, profile)) or criu_arg:
            raise GpuosError("--agent goes with --image, --timeout and -o only", ExitCode.USAGE)
        if image is None:
            raise GpuosError("--agent needs --image DIR: the image to roll back to", ExitCode.USAGE)
        _rollback(agent, image, output, timeout, lazy)
        return
    if sum(x is not None for x in (pid, image, profile)) != 1:
        raise GpuosError(f"give one of --pid PID, --image DIR, --profile FILE; see `{PROG} --help`", ExitCode.USAGE)
    if device is not None and device_map:
        raise GpuosError("give --device or --device-map, not both", ExitCode.USAGE)
    if profile is not None and (device is not None or device_map):
        raise GpuosError("--profile restores every process where it was: no --device", ExitCode.USAGE)
    if criu_arg and image is None:
        raise GpuosError("--criu-arg goes with --image", ExitCode.USAGE)

    from gpuos_tools.ckpt import criu
    from gpuos_tools.ckpt.driver import Checkpointer
    from gpuos_tools.ckpt.records import run_recorded

    ckpt = Checkpointer()
    if profile is not None:
        from gpuos_tools.ckpt.profile import load_profile, resume_profile

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
    if image is not None:
        result = run_recorded("-" if output is None else output, PROG, ckpt,
                              lambda: criu.restore(ckpt, image, device, device_map, criu_arg or []),
                              action="restore", image=str(image))
    else:
        assert pid is not None
        result = run_recorded("-" if output is None else output, PROG, ckpt,
                              lambda: ckpt.resume(pid, device, device_map), action="restore", pid=pid)
    if sys.stderr.isatty():
        text = result["message"]
        if result.get("restore_s") is not None:
            text += f" (restore {result['restore_s']:.2f} s)"
        stderr_console().print(f"{PROG}: {text}", highlight=False)


def _resume(agent: str, output: Optional[str], timeout: float, lazy: bool = False) -> None:
    """`gpu-restore --agent PID --resume [--lazy]`: one agent_resume record (gpuos_tools/agent/suspend.py)."""
    from gpuos_tools.agent import control
    from gpuos_tools.agent.suspend import request_resume

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


def _rollback(agent: str, image: Path, output: Optional[str], timeout: float, lazy: bool = False) -> None:
    """`gpu-restore --agent`: ask the agent to write the image back; one agent_rollback record."""
    from gpuos_tools.agent import control
    from gpuos_tools.image import open_image

    open_image(image).chain()  # a missing or broken image is refused here, before the agent is asked
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
    from gpuos_tools.stream import make_header, open_output

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
    from gpuos_tools import image as img

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
    from gpuos_tools import image as img

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
