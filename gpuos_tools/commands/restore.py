"""gpu-restore: bring a process checkpointed by gpu-ckpt back onto a GPU and let it run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from gpuos_tools.ckpt.records import man_sections
from gpuos_tools.cli import error, run_app, stderr_console
from gpuos_tools.errors import ExitCode, GpuosError

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

    gpu-restore --image /var/tmp/job.img"""

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
that failed, so that running it again retries them. It is silent on success."""

MAN_SECTIONS = man_sections(NOTES, EXAMPLES, "gpu-ckpt(1), criu(8), chronic(1)")

app = typer.Typer(name=PROG, add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)


@app.command()
def restore(
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
        None, "--image", metavar="DIR", help="Restore the CRIU image gpu-ckpt --image wrote into DIR.",
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
    """
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


def main() -> None:
    run_app(app, prog=PROG)


if __name__ == "__main__":
    main()
