"""gpu-trace: run an unmodified Python program and stream its GPU allocations, launches and copies."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from gpuos_tools.commands.cli import MECHANISM_DEFAULT, report_run, run_app, warn, with_progress
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.stream import make_header, open_input, open_output
from gpuos_tools.trace import run as launcher
from gpuos_tools.trace.stats import compute_stats, render_stats, stats_records

PROG = "gpu-trace"


app = typer.Typer(
    name=PROG,
    help=(
        "Trace the GPU work of an unmodified Python program. "
        "`gpu-trace run` starts the program (CuPy, PyTorch, Numba...) with an in-process CUPTI "
        "tracer and streams its allocations, kernel launches with decoded arguments, copies, "
        "memsets, module loads and streams as gpuos NDJSON records; `gpu-trace stats` summarises "
        "a recorded trace."
    ),
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


@app.command(
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    no_args_is_help=True,
)
def run(
    program: list[str] = typer.Argument(..., metavar="-- PROGRAM [ARGS]...", help="The Python program and its arguments."),
    output: str = typer.Option("-", "--output", "-o", metavar="FILE", help="Trace file ('-' = stdout; *.zst is compressed)."),
    images: Optional[Path] = typer.Option(
        None, "--images", metavar="DIR",
        help="Directory for module images (cubin/PTX, by content hash). Default: FILE's name with "
        ".images, ./gpu-trace-images when writing to stdout or a pipe, none with -o /dev/null; "
        "$GPUOS_IMAGES overrides.",
    ),
    no_images: bool = typer.Option(False, "--no-images", help="Record module hashes but do not store the images."),
    flush_ms: float = typer.Option(20.0, "--flush-ms", min=1.0, metavar="MS", help="How often the tracer ships records (milliseconds)."),
    unbuffered: bool = typer.Option(False, "--unbuffered", "-u", help="Flush every record even to a regular file."),
    backend: str = typer.Option(
        "auto", "--backend", metavar="auto|native|python",
        help="Callback path: native (C, built once with the system compiler; fastest), python "
        "(cupti-python callbacks), or auto (native when it builds).",
    ),
    check_pointers: bool = typer.Option(
        False, "--check-pointers",
        help="Ask the driver which argument words are device pointers and record them as 'dptrs' "
        "(exact, slow: for validating traces and predictions).",
    ),
    validate: bool = typer.Option(
        False, "--validate",
        help="Check gpu-predict-access's predictions on the GPU for sampled launches and add "
        "'validation' records (slow; uses the python backend).",
    ),
    validate_samples: int = typer.Option(
        3, "--validate-samples", min=1, metavar="N",
        help="With --validate: check the first N launches of each kernel, then its 2^k-th ones.",
    ),
    validate_max: str = typer.Option(
        "8GiB", "--validate-max", metavar="SIZE",
        help="With --validate: skip launches while more device memory than this is live (the "
        "snapshot needs as much again); with --validate-in validator, launches whose prediction names more "
        "than this.",
    ),
    agent: bool = typer.Option(
        False, "--agent",
        help="Also run the agent: a control socket through which `gpu-ckpt --agent PID` takes "
        "consistent snapshots while the program runs (on the native core unless --backend python "
        "or GPUOS_AGENT_BACKEND=python).",
    ),
    cow_budget: Optional[str] = typer.Option(
        None, "--cow-budget", metavar="SIZE",
        help="With --agent: device memory for copy-on-write slots during a snapshot (default: a "
        "quarter of the free memory, at most the snapshot's size).",
    ),
    stage_ahead: bool = typer.Option(
        False, "--stage-ahead",
        help="With --agent: pin host staging for snapshots in the background as the program "
        "allocates, so that no snapshot waits for it (costs as much pinned host memory as the "
        "program has on the GPU).",
    ),
    mechanism: Optional[str] = typer.Option(
        None, "--mechanism", metavar="cupti|intercept",
        help="With --agent: how the agent sees the program's driver calls: cupti (CUPTI callbacks; "
        "the driver's checkpoint API and CRIU refuse such a process) or intercept (a library "
        "preloaded between the program and libcuda; CUPTI is never loaded; it needs the agent's native core, "
        "built with the system's C compiler, so not --backend python). Without it: "
        f"$GPUOS_AGENT_MECHANISM; without that, {MECHANISM_DEFAULT}.",
    ),
    validate_in: Optional[str] = typer.Option(
        None, "--validate-in", metavar="validator|process",
        help="With --validate: where a sampled launch is replayed. validator (the default): in a separate "
        "validator process on the same GPU, fed with copies of the launch's predicted inputs, so nothing it "
        "does can reach the program; process: again in the program's own context (a fault or a device-side "
        "assert there ends the program).",
    ),
    validate_extents: bool = typer.Option(
        True, "--validate-extents/--no-validate-extents",
        help="With --validate: also measure how far past each pointer a kernel reads (bisection; "
        "the data for size templates).",
    ),
) -> None:
    """Run PROGRAM with the tracer injected; exit with the program's own exit status.

    Only the started process is traced (not programs it starts). Module images go to a side
    directory by content hash, never inline.
    """
    summary = launcher.run_program(
        program, output=output, images=images, no_images=no_images, flush_ms=flush_ms, unbuffered=unbuffered,
        backend=backend, check_pointers=check_pointers, validate=validate, validate_samples=validate_samples,
        validate_max=validate_max, validate_extents=validate_extents, validate_in=validate_in, agent=agent,
        cow_budget=cow_budget,
        stage_ahead=stage_ahead, mechanism=mechanism, warn=lambda m: warn(PROG, m),
    )
    raise typer.Exit(report_run(PROG, summary))


@app.command()
def stats(
    trace: str = typer.Argument("-", metavar="[TRACE]", help="A gpu-trace stream ('-' = stdin, *.zst ok)."),
    json_out: bool = typer.Option(False, "--json", help="JSON records even on a terminal."),
    top: int = typer.Option(20, "--top", min=1, metavar="N", help="How many kernels to list."),
) -> None:
    """Per-kernel launch counts, copies, allocation peak and timeline, unknown pointer arguments.

    Draws tables when stdout is a terminal, writes stats_* JSON records otherwise. Needs no GPU.
    """
    from rich.console import Console

    with open_input(trace) as reader:
        result = compute_stats(with_progress(reader, f"reading {trace}"))
    if not result.records:
        raise GpuosError(f"{trace}: empty: no records (not a gpu-trace stream?)", ExitCode.BAD_INPUT)
    if not (result.launches or result.graph_launches or result.allocs or result.copies or result.memsets.count):
        warn(PROG, f"{trace}: no allocation, launch, copy or memset records: the program did no GPU "
             "work that was traced")
    if json_out or not sys.stdout.isatty():
        with open_output("-") as writer:
            writer.write(make_header("gpu-trace stats", source=trace))
            kernels = 0
            for rec in stats_records(result):
                if rec["type"] == "stats_kernel":
                    kernels += 1
                    if kernels > top:
                        continue
                writer.write(rec)
    else:
        render_stats(result, Console(), top=top)


def main() -> None:
    run_app(app, prog=PROG)


if __name__ == "__main__":
    main()
