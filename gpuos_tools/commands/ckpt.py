"""gpu-ckpt: checkpoint the GPU state of any CUDA process through the driver (and CRIU)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from gpuos_tools.ckpt.records import man_sections
from gpuos_tools.commands.cli import error, options_before_subcommand, report_run, run_app, stderr_console, warn
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.trace import run as launcher
from gpuos_tools.units import SIZE_HELP, format_size, parse_size

EXAMPLES = """\
Free the GPU held by one process, then give it back:

    gpu-ckpt --pid 4242 -o ckpt.ndjson
    gpu-restore --pid 4242

Give a busy process at most 30 s to finish its submitted GPU work:

    gpu-ckpt --pid 4242 --timeout 30000

What works on this host (driver, checkpoint API, CRIU, CUPTI, permissions, memory):

    gpu-ckpt check
    gpu-ckpt check --dir /var/lib/gpuos-tools/images --json | jq 'select(.status=="fail")'

What is on the GPUs, and what is checkpointed:

    gpu-ckpt status
    gpu-ckpt status --json | jq -r 'select(.state=="checkpointed") | .pid'

Nightly maintenance from root's crontab: suspend the jobs the profile selects at 02:00, bring
exactly those back at 02:30 (chronic, from moreutils, shows output only when a command fails;
the commands are quiet on success anyway):

    0 2 * * *  chronic gpu-ckpt --profile /etc/gpuos-tools/maintenance.toml
    30 2 * * * chronic gpu-restore --profile /etc/gpuos-tools/maintenance.toml

The profile (gpuos_tools/profiles/maintenance.toml, installed with the package):

    [select]
    users = ["alice", "bob"]
    command = 'python3? .*train'
    exclude_command = 'jupyter'

    [checkpoint]
    timeout_ms = 600000
    on_error = "resume"

    [state]
    file = "/var/lib/gpuos-tools/maintenance.json"

A full-process image with CRIU 4 or later (as root), and back:

    gpu-ckpt --pid 4242 --image /var/tmp/job.img
    gpu-restore --image /var/tmp/job.img

Suspend a program started with `GPUOS_AGENT_OWN=1 gpu-ckpt run` (its GPU memory goes to host
RAM at link speed; it waits), with an image of it, then let it go on:

    gpu-ckpt --agent 4242 --suspend --image /var/tmp/job.suspended
    gpu-restore --agent 4242 --resume

A checkpoint image of a job every 15 minutes through its agent, from cron (full, then up to
`chain.length` incremental images, old ones retired by the profile's retention):

    */15 * * * * chronic gpu-ckpt periodic --profile /etc/gpuos-tools/ckpt-periodic.toml
    gpu-ckpt periodic --profile /etc/gpuos-tools/ckpt-periodic.toml --plan | jq .

Fold an incremental image and its chain into one full image, and check it:

    gpu-ckpt compact /var/lib/gpuos-tools/images/train/train-20261122T031500.000Z /var/tmp/train.full
    gpu-restore verify /var/tmp/train.full"""

NOTES = """\
A checkpoint is stop-the-world: the lock waits for the process's CUDA calls in flight and its
submitted GPU work, then the driver copies its device memory to host memory (about 1 GB/s on
an H100 or H200) and releases its GPUs. The CPU side keeps running; its next CUDA call blocks
until the process is restored. `gpu-restore --pid PID` copies the memory back (onto another GPU
of the same kind with `--device`) and unlocks it.

The driver cannot checkpoint processes that use managed (unified) memory, CUDA IPC memory, MPS,
MIG or NCCL; it needs release 570 or later (580 to move onto another GPU).

Never stranded: if the lock times out, the process keeps running; if the checkpoint fails after
the lock, the process is unlocked (or restored and unlocked) before gpu-ckpt exits; SIGINT,
SIGTERM and SIGHUP during a checkpoint do the same. The error message and the `state` of the
last `ckpt_result` record say what the process was left in: `running`, `checkpointed`
(restorable with `gpu-restore --pid PID`), `locked` (`gpu-restore --pid PID` unlocks it), or
`failed` (the driver gave up on its CUDA state).

gpu-ckpt remembers, per checkpointed process, which GPUs it used and how much memory it had
there, in the state directory (`$GPUOS_CKPT_STATE_DIR`, or `/run/gpuos-tools/ckpt` for root,
`$XDG_RUNTIME_DIR/gpuos-tools/ckpt` otherwise); gpu-restore needs it to move the process with
`--device`, and `gpu-ckpt status` lists the processes it names.

With `--profile`, gpu-ckpt suspends every running CUDA process that the profile selects (by
user and/or command line) and writes the list of those it suspended to the profile's state
file, atomically, after each one; `gpu-restore --profile` resumes exactly those. Records are
written only where `-o` says, so both commands are silent on success and exit 0; a failure is
reported on standard error with a non-zero status. With `on_error = "resume"` (the default)
the first failure stops the run and the processes suspended so far are resumed; with `"keep"`
the run goes on and the failed processes stay running.

`--image DIR` needs CRIU 4 or later on PATH and a passing `criu check` (so root); both are
checked before the process is touched (`gpu-ckpt check` says whether they pass here). The GPU
state is checkpointed first, then `criu dump` writes the image (by default CRIU ends the
process; `--leave-running` resumes it on the GPU afterwards). If `criu dump` fails, the process
is restored and unlocked. DIR must be new or empty: the dump goes into a dot-named temp
directory beside it and is renamed to DIR once complete, so DIR holds a whole image or nothing.
A guard process started before anything is touched finishes or undoes the dump if gpu-ckpt is
killed, even with SIGKILL (and likewise the restore if gpu-restore is): it waits for CRIU, makes
a complete dump the image, and brings a process it finds locked or checkpointed back to
running; what it did is in STATE_DIR/guard.log and STATE_DIR/guard-PID.json (a ckpt_guard
record). CRIU restores an open regular file only if its size is what it was at the dump: a job
that keeps a growing log open cannot be restored from a --leave-running image after it wrote
more."""

PERIODIC = """\
`gpu-ckpt periodic --profile FILE` takes one image of an agent process per run, for cron. The
profile (gpuos_tools/profiles/ckpt-periodic.toml, installed with the package) says where the
images go and what they are called, whether chunks are compressed, how many incremental images
may follow a full one, and how many images to keep and for how long:

    [images]
    directory = "/var/lib/gpuos-tools/images/train"
    name = "train"
    compress = false
    chunk_size = "64MiB"
    checksum = "crc32"

    [chain]
    length = 6

    [retention]
    keep = 14
    max_age = "7d"

    [agent]
    command = 'python3? .*train'

Each run removes the temp directories of image writers that died, then takes the next image:
incremental on the newest image while that image's chain has fewer than `chain.length`
increments and reads, full otherwise (or when `chain.length` is 0). Images are named
`NAME-YYYYmmddTHHMMSS.mmmZ` (UTC). The image appears only once complete; if the snapshot fails,
nothing is left and nothing is deleted. Then retention keeps the newest `keep` images no older
than `max_age`, the newest image always, and every image a kept image chains to; the rest are
deleted newest first (a child before its parent), each by one rename. Files in the directory
that are not this profile's images are never touched, and a lock file keeps two runs of the
same profile apart. Records go only where `-o` says: a run is silent on success, and a failure
is a message on standard error with a non-zero status. `--plan` writes what the next run would
do and changes nothing.

A damaged image in the directory (a manifest or parent chain that does not pass the checks of
`gpu-restore verify`) does not stop a run: the run still takes its image and applies retention
to the others, but the damaged image is never chained to, not counted by `keep` and never
deleted; the record lists it under `damaged`, and the run ends with a message per damaged image
and status 1, so that cron shows it until someone looks.

The snapshot is the agent's (the concurrent checkpoint path): the profile's [agent] names a
program started with `gpu-ckpt run` or `gpu-trace run --agent` (pid, socket, or a command-line
pattern that must match exactly one agent process), and each run asks it, over its control socket, for a
consistent snapshot written as the next image (incremental when the agent knows what was
written since the previous one). With no such agent the run fails (status 76) and writes
nothing.

`gpu-ckpt --agent PID|SOCKET --image DIR [--parent IMAGE]` takes one such image by hand and
writes an `agent_snapshot` record: T0, the operations before it, bytes, seconds and GB/s, the
copy-on-write count and bytes, stream waits, and `stall_s`, the time spent on the program's
path (`stall_parts_s` splits it: ordering streams after T0, enqueueing copy-on-writes, stream
waits). `staging_s` is the time spent before T0 pinning host staging (the first snapshot of a
process, unless it was started with `--stage-ahead`), `pool_s` the time allocating the
copy-on-write slots."""

SUSPEND = """\
`gpu-ckpt --agent PID --suspend` frees the GPU memory of a program started under the agent with
its allocations owned (`GPUOS_AGENT_OWN=1 gpu-trace run --agent`, or `gpu-ckpt run`; CuPy
and PyTorch programs), at link speed, and keeps the program waiting until `gpu-restore --agent PID
--resume`:

    GPUOS_AGENT_OWN=1 gpu-ckpt run -o run.ndjson.zst -- python3 job.py &
    gpu-ckpt --agent PID --suspend --partial -o suspend.ndjson
    gpu-restore --agent PID --resume          # or --resume --lazy

The agent takes its lock (the program's next launch, copy, memset, free or other driver call
waits in its callback), waits until the operations already issued are enqueued and the GPU has
done them, copies every owned buffer to its pinned host staging on a side stream and gives each
buffer's physical memory back to the driver as soon as its copy completed; the addresses stay
reserved. Resume maps new physical memory at the same addresses, copies the contents back, waits
for the copies and lets the program go on. The program's memory lives in host RAM (pinned) in
between; the first suspend of a process pins that staging first, while the program still runs
(about 2.4 s for 8 GiB on an H100), later ones reuse it.

With `--image DIR` the saved memory is also written as an image of the agent path (full; the
program's other device allocations are copied for it too), readable by `gpu-restore verify`,
`diff` and `--agent PID --image DIR`. `--max-hold S` resumes by itself after S seconds.

Guarantees: the program's state after resume is what it was at the suspend, at the same device
addresses (tested bit for bit against an uninterrupted run). While suspended, the agent's
control socket keeps serving: `ping` answers `state` `suspended`; `snapshot`, `rollback` and a
second suspend are refused (79, WRONG_STATE); a resume without a suspend is refused (79). A
resume that cannot get the memory back (another process took the GPU) is refused with the
program still suspended and its memory still in host RAM: free the GPU and resume again. The
agent's shutdown resumes a suspended program first.

Not owned: the CUDA context and module images, and device memory allocated outside CuPy's and
PyTorch's allocators (cuBLAS's workspace, cuFFT's plans, cuDNN's small buffers, cudaMalloc in
extensions) stay on the GPU; a PyTorch training job keeps about 64 MiB there with the default
cuBLAS workspace on an H100 (gpu-trace(1), OWNED ALLOCATIONS). A
program with such allocations is refused (93, NOT_OWNED, naming the largest) unless `--partial`
is given; a program started without GPUOS_AGENT_OWN=1 is refused with or without it; nothing is
changed then. The `agent_suspend` record lists what stayed (`not_owned`: count, bytes, the
largest), the bytes released, `staging_s`, `lock_s`, `settle_s`, `sync_s`, `save_s` and
`save_gbps`, `suspend_s` (from the request to the last buffer released) and NVML's view of the
process before and after (`process_gpu_memory_before`, `_after`); the `agent_resume` record
`resume_s`, `load_gbps` and `held_s`.

Lazy resume and the residency engine: `gpu-restore --agent PID --resume --lazy` lets the program
go on at once. The agent's residency engine then stands before each of its launches, copies,
memsets, graph launches and frees: every owned buffer the operation touches that is not back
yet is mapped and its load enqueued on a stream of the agent's, and the operation's stream
waits for the load on the GPU (the program's thread does not wait). What a launch touches is
the agent's prediction of its reads and writes; a launch it cannot predict ("unknown") and a
graph launch wait for every buffer not yet back, i.e. for the rest of the reload. The rest loads
in the background, the buffers the program touched most recently before the suspend first. So a
kernel may touch exactly what its arguments (and the pointer arrays the program copied to the
GPU) say it touches; a kernel that reaches a buffer some other way, and is not marked unknown
by the predictor, could run before that buffer is back. A device-wide synchronisation by the
program waits for the whole reload. Until every buffer is back, snapshots,
suspends and rollbacks are refused (79); ping's `residency` shows what is pending and, when
done, the reload's time and GB/s. The same engine evicts (saves after the buffer's last use,
then releases) and prefetches single buffers for gpu-prefetch-sched.

The residency API (gpuos_tools/memory/engine.py's ResidencyEngine, inside the program under the
agent; what gpu-prefetch-sched run and lazy resume use) guarantees, per owned buffer (a large
buffer, or a segment of small ones): `require` before an operation maps every buffer the
operation touches and makes the operation's stream wait on the GPU for each load in flight, so an
operation never runs on a buffer that is released or half loaded (unknown: every buffer);
`evict` saves the buffer on the engine's evict stream after an event on every stream the program
has used, once operations other threads are issuing have reached the driver (else the eviction
is refused and the buffer stays), and releases its physical memory only after the save has
completed; an operation that touches a buffer being evicted cancels the eviction; a buffer loaded
from the engine's host copy and not written since (as predicted) is released without a save
(with the GPU digest on, only once its digest says it is unchanged; changed, it is saved and the
kernels that may have written it are unknown from then on: gpu-prefetch-sched(1), SAFETY);
`prefetch` maps and loads on a stream of its own, never making the program's thread wait; no
eviction runs while a snapshot copies the buffers. What it does not guarantee: a kernel reaching
a buffer by a pointer its launch's prediction does not show (see above).

The remainder through the driver: the driver checkpoint API refuses to lock a process under
the agent (CUDA_ERROR_NOT_SUPPORTED), measured on an H100 with driver 580.159 also after the
agent unsubscribed its CUPTI callbacks and called cuptiFinalize, idle or parked; the same program
without CUPTI, its memory owned (virtual memory API), locks, checkpoints and restores
(scripts/probe_driver_remainder.py). So a suspend does not free the remainder: it stays on the
GPU (about 0.5 GiB for a CuPy job on an H100), and a process that needs it all freed has to be
run without the agent and checkpointed with `gpu-ckpt --pid`."""

DURABLE = """\
Images at the storage's speed: the agent queues every buffer's chunks at once on the image
writer's threads (`--threads`, default the CPUs up to 16), each chunk one file written in large
writes straight from the pinned staging, with O_DIRECT where the filesystem takes it and it is
not memory (tmpfs), checksummed on the same threads with the fastest checksum measured on this
CPU (`--checksum auto`: xxh3 where the xxhash package is installed, else crc32; sha256 on
request).

No snapshot lost after T0: if the program ends while its image is being written, its exit
waits for the image, up to GPUOS_AGENT_EXIT_WAIT seconds (default 30), saying so on its
standard error; then it hands the image over: its bytes go into a memfd passed to the waiting
gpu-ckpt over the control socket, and gpu-ckpt writes the image after the program is gone (the
record's image says `handover`; `during_exit` says the program ended during the write). Without
a gpu-ckpt still connected, or without the host memory for the copy, the exit waits for the
image in place, up to GPUOS_AGENT_EXIT_MAX seconds in all (default 600), and says so if it gives
up. The same holds for `gpu-ckpt periodic`. A program killed by a signal, or ending through
os._exit, runs no exit handler: its image in flight is lost (no partial image is ever visible).

`gpu-ckpt periodic` takes full-process images too: with `kind = "process"` in [images] and a
[process] table (pid or command, timeout_ms) each run is a `gpu-ckpt --pid PID --image DIR
--leave-running`, named and retired like the agent's images (chain.length must be 0: every
full-process image is full)."""

MAN_SECTIONS = man_sections(NOTES, EXAMPLES, "gpu-restore(1), criu(8), chronic(1)",
                            {"PERIODIC CHECKPOINTS": PERIODIC, "SUSPEND THROUGH THE AGENT": SUSPEND,
                             "DURABLE IMAGES": DURABLE})

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
    timeout: int = typer.Option(
        0, "--timeout", "-t", min=0, metavar="MS",
        help="How long the lock may wait for the process's CUDA calls and submitted GPU work, in "
        "milliseconds (0: as long as it takes). On timeout the process is left running.",
    ),
    image: Optional[Path] = typer.Option(
        None, "--image", metavar="DIR",
        help="Also dump the whole process with CRIU (>= 4) into DIR, an empty directory. With "
        "--agent: the checkpoint image to write (it must not exist; it appears only when complete).",
    ),
    leave_running: bool = typer.Option(
        False, "--leave-running", help="With --image: resume the process after the dump instead of letting CRIU end it.",
    ),
    criu_arg: Optional[list[str]] = typer.Option(
        None, "--criu-arg", metavar="ARG", help="With --image: pass ARG to `criu dump` (repeatable).",
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
    from gpuos_tools.image import chunkio

    if checksum not in chunkio.CHOICES:
        raise GpuosError(f"--checksum must be one of {', '.join(chunkio.CHOICES)}, not {checksum!r}", ExitCode.USAGE)
    if threads is not None and agent is None:
        raise GpuosError("--threads goes with --agent PID --image DIR", ExitCode.USAGE)
    if (suspend or partial or max_hold is not None) and agent is None:
        raise GpuosError("--suspend, --partial and --max-hold go with --agent PID (the driver path: --pid PID)",
                         ExitCode.USAGE)
    if agent is not None and suspend:
        if pid is not None or profile is not None or leave_running or criu_arg or timeout or parent is not None \
                or threads is not None:
            raise GpuosError("--agent --suspend goes with --image, --partial, --max-hold, --compress, --checksum "
                             "and -o only (a suspend's image is full: no --parent)", ExitCode.USAGE)
        _suspend(agent, image, partial, max_hold, compress, checksum, output)
        return
    if agent is not None:
        if pid is not None or profile is not None or leave_running or criu_arg or timeout or partial:
            raise GpuosError("--agent goes with --image, --parent, --compress, --checksum, --threads and -o only",
                             ExitCode.USAGE)
        if image is None:
            raise GpuosError("--agent needs --image DIR: where the image goes", ExitCode.USAGE)
        from gpuos_tools.agent import control
        from gpuos_tools.agent.snapshot import snapshot_to_image

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
    if (pid is None) == (profile is None):
        raise GpuosError(
            f"give --pid PID or --profile FILE, or a command (`{PROG} status`); see `{PROG} --help`", ExitCode.USAGE)
    if profile is not None and (image is not None or timeout):
        raise GpuosError("--profile takes its timeout from the profile and cannot make images", ExitCode.USAGE)
    if image is None and (leave_running or criu_arg):
        raise GpuosError("--leave-running and --criu-arg go with --image", ExitCode.USAGE)

    from gpuos_tools.ckpt import criu
    from gpuos_tools.ckpt.driver import Checkpointer
    from gpuos_tools.ckpt.records import run_recorded

    ckpt = Checkpointer()
    if profile is not None:
        from gpuos_tools.ckpt.profile import load_profile, suspend_profile

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
                              lambda: criu.dump(ckpt, pid, image, timeout, leave_running, criu_arg or []),
                              action="dump", pid=pid)
    else:
        result = run_recorded("-" if output is None else output, PROG, ckpt, lambda: ckpt.suspend(pid, timeout),
                              action="checkpoint", pid=pid)
    _say(_describe(result))


def _suspend(agent: str, image: Optional[Path], partial: bool, max_hold: Optional[float], compress: bool,
             checksum: str, output: Optional[str]) -> None:
    """`gpu-ckpt --agent PID --suspend`: one agent_suspend record (gpuos_tools/agent/suspend.py)."""
    from gpuos_tools.agent import control
    from gpuos_tools.agent.suspend import request_suspend

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
    from gpuos_tools.ckpt.driver import Checkpointer

    ckpt = Checkpointer()
    rows = ckpt.list_processes(pid or [])
    if ckpt.nvml_missing:
        print(f"{PROG}: warning: {ckpt.nvml_missing}: GPU memory per process is unknown", file=sys.stderr)
    if ckpt.unreadable and sys.stderr.isatty():
        _say(f"{ckpt.unreadable} process(es) could not be inspected (another user's: run as root to see them)")
    if json_out or output != "-" or not sys.stdout.isatty():
        from gpuos_tools.stream import make_header, open_output

        with open_output(output) as writer:
            writer.write(make_header(f"{PROG} status", **ckpt.header_fields()))
            for rec in rows:
                writer.write(rec)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for column, justify in (("PID", "right"), ("USER", "left"), ("STATE", "left"), ("GPU MEMORY", "right"),
                            ("GPUS", "left"), ("COMMAND", "left")):
        table.add_column(column, justify=justify, no_wrap=column != "COMMAND")
    for rec in rows:
        mem = rec.get("memory")
        gpus = ",".join(str(g["index"]) for g in rec.get("gpus") or [])
        if not gpus and rec.get("checkpointed"):
            gpus = "(" + ",".join(str(g.get("index")) for g in rec["checkpointed"].get("gpus") or []) + ")"
        table.add_row(str(rec["pid"]), rec.get("user", "?"), rec.get("state") or rec.get("error", "?"),
                      "?" if mem is None else f"{format_size(mem)}", gpus, " ".join(rec.get("command", "").split()))
    Console().print(table)


def _records(output: str, tool: str, records: list[dict[str, Any]], **fields: Any) -> None:
    from gpuos_tools.stream import make_header, open_output

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
    from gpuos_tools.ckpt.check import run_checks, table_rows

    records = run_checks(image_dir=str(directory) if directory is not None else None)
    summary = records[-1]
    if json_out or output != "-" or not sys.stdout.isatty():
        from gpuos_tools.stream import make_header, open_output

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
    from gpuos_tools import image as img

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

    from gpuos_tools.ckpt import periodic as per

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
    header names it and the agent's socket). Exits with the program's own status.
    """
    summary = launcher.run_program(program, output=output, no_images=no_images, agent=True, cow_budget=cow_budget,
                                   stage_ahead=stage_ahead, warn=lambda m: warn(PROG, m))
    raise typer.Exit(report_run(PROG, summary))


def main() -> None:
    run_app(app, prog=PROG)


if __name__ == "__main__":
    main()
