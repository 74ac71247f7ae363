"""gpu-predict-access: each launch's, copy's and memset's read and write buffers, from a trace."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Optional

import typer

from gpuos_tools import figures
from gpuos_tools.access.predict import GRANULARITIES, Predictor
from gpuos_tools.access.report import compute_report, explain, render_explain, render_report, report_records
from gpuos_tools.access.templates import Templates, learn
from gpuos_tools.commands.cli import OutputOpt, UnbufferedOpt, run_app, warn, with_progress
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.stream import make_header, open_input, open_output


PROG = "gpu-predict-access"

app = typer.Typer(
    name="gpu-predict-access",
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


@app.command()
def predict(
    trace: str = typer.Argument("-", metavar="[TRACE]", help="A gpu-trace stream ('-' = stdin, *.zst ok)."),
    output: OutputOpt = "-",
    granularity: Optional[str] = typer.Option(
        None, "--granularity", metavar="alloc|range|extent",
        help="alloc (default): whole allocations; range (default with --templates): from each "
        "pointer to the end of its allocation, or as far as its size template says (copies and "
        "memsets: exactly their bytes), in the direction the launch's argument structures say "
        "where they are decoded; extent: the bytes each pointer reaches as those structures say "
        "(PyTorch, CuPy, cuBLAS, cuDNN, CUB kernels), range elsewhere.",
    ),
    explain_seq: Optional[int] = typer.Option(
        None, "--explain", metavar="SEQ", help="Explain the launch with this seq instead of writing the stream."
    ),
    report: bool = typer.Option(False, "--report", help="Per-kernel summary instead of the stream."),
    templates_file: Optional[str] = typer.Option(
        None, "--templates", metavar="FILE",
        help="Size templates (from --learn) for launch ranges; implies --granularity range.",
    ),
    learn_out: bool = typer.Option(
        False, "--learn",
        help="Write size templates learned from the validation records of TRACE (a trace made "
        "with `gpu-trace run --validate`) instead of the stream.",
    ),
    plot_file: Optional[str] = typer.Option(
        None, "--plot", metavar="FILE.png",
        help="Draw an access map (launches x allocations, read/written/unknown) into FILE "
        "instead of the stream (needs matplotlib).",
    ),
    unbuffered: UnbufferedOpt = False,
) -> None:
    """Speculate which buffers each kernel launch, copy and memset reads and writes.

    Reads a gpu-trace stream, replays its allocations, and after each launch, memcpy, memset
    and graph_launch writes an `access` record: the allocations (and byte ranges) read and
    written, and how each was inferred. Every input record passes through unchanged and in
    order. A launch whose accesses cannot be bounded is marked `unknown`, never dropped.
    Needs no GPU.
    """
    from rich.console import Console

    if granularity is None:
        granularity = "range" if templates_file else "alloc"
    if granularity not in GRANULARITIES:
        raise typer.BadParameter("must be alloc, range or extent", param_hint="--granularity")
    if sum((report, explain_seq is not None, learn_out, plot_file is not None)) > 1:
        raise typer.BadParameter("--report, --explain, --learn and --plot exclude each other", param_hint="--report")
    if plot_file is not None:
        figures.check_path(plot_file)  # before the trace is read, not after
    table = output == "-" and sys.stdout.isatty()
    seen = _Seen()

    def records(reader):  # type: ignore[no-untyped-def]
        return seen.count(with_progress(reader, f"reading {trace}"))

    if learn_out:
        with open_input(trace) as reader:
            learned = learn(records(reader))
        seen.check(trace)
        if not learned:
            raise GpuosError(f"{trace}: no validation records with extents (record it with "
                             "`gpu-trace run --validate`)", ExitCode.FAILURE)
        with open_output(output, unbuffered=unbuffered or None) as writer:
            writer.write(make_header("gpu-predict-access", source=trace, learned=len(learned)))
            writer.write_many(t.record() for t in learned)
        return
    templates = None
    if templates_file is not None:
        if granularity == "alloc":
            raise typer.BadParameter("templates give ranges: use --granularity range or extent",
                                     param_hint="--templates")
        with open_input(templates_file) as reader:
            templates = Templates(reader)
        if not templates:
            raise GpuosError(f"{templates_file}: no access_template records", ExitCode.BAD_INPUT)
    if plot_file is not None:
        from gpuos_tools.access.plot import plot  # numpy: only --plot needs it

        with open_input(trace) as reader:
            try:
                dims = plot(records(reader), Path(plot_file), granularity, templates,
                            title=f"{trace}: predicted accesses")
            except GpuosError:
                seen.check(trace)
                raise
        if sys.stderr.isatty():
            Console(stderr=True).print(f"wrote {plot_file}: {dims['launches']} launches x "
                                       f"{dims['allocations']} allocations", highlight=False)
        return
    if explain_seq is not None:
        with open_input(trace) as reader:
            ex = explain(records(reader), explain_seq, granularity, templates)
        if ex is None:
            seen.check(trace)
            raise GpuosError(f"{trace}: no launch with seq {explain_seq}", ExitCode.FAILURE)
        if table:
            render_explain(ex, Console(highlight=False))
            return
        with open_output(output, unbuffered=unbuffered or None) as writer:
            writer.write(make_header("gpu-predict-access", source=trace, explain=explain_seq))
            writer.write(ex)
        return
    if report:
        with open_input(trace) as reader:
            rows = compute_report(records(reader), granularity, templates)
        seen.check(trace)
        if table:
            render_report(rows, Console(), granularity)
            return
        with open_output(output, unbuffered=unbuffered or None) as writer:
            writer.write(make_header("gpu-predict-access", source=trace, granularity=granularity))
            writer.write_many(report_records(rows, granularity))
        return
    predictor = Predictor(granularity, templates)
    with open_input(trace) as reader:
        stream = records(reader)
        first = next(stream, None)
        if first is None:
            seen.check(trace)  # empty: an error, before anything is written
        with open_output(output, unbuffered=unbuffered or None) as writer:
            if reader.header is None:
                writer.write(make_header("gpu-predict-access", source=trace))
            validated = bool(reader.header and reader.header.get("validate"))
            writer.write_many(predictor.annotate(itertools.chain((first,), stream), validated))
    seen.check(trace)
    if predictor.replaced:
        warn(PROG, f"{trace} already had {predictor.replaced:,} access records (predicted before?): "
             "replaced by this run's, one per operation")


class _Seen:
    """What the input held, for a word when there was nothing to predict: an empty input is an
    error (nothing upstream wrote a stream), a trace without a launch, copy or memset a warning
    (a program that did no GPU work is a result, but a surprising one)."""

    OPS = frozenset(("launch", "memcpy", "memset", "graph_launch"))

    def __init__(self) -> None:
        self.records = 0
        self.ops = 0

    def count(self, records):  # type: ignore[no-untyped-def]
        ops = self.OPS
        for rec in records:
            self.records += 1
            if rec["type"] in ops:
                self.ops += 1
            yield rec

    def check(self, trace: str) -> None:
        if not self.records:
            raise GpuosError(f"{trace}: empty: no records (not a gpu-trace stream?)", ExitCode.BAD_INPUT)
        if not self.ops:
            held = f"{self.records:,} record" + ("s" if self.records != 1 else "")
            warn(PROG, f"{trace}: no launch, copy or memset records (it holds {held}): nothing to predict")


def main() -> None:
    run_app(app, prog=PROG)


if __name__ == "__main__":
    main()
