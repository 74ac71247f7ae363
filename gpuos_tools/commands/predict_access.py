"""gpu-predict-access: each launch's, copy's and memset's read and write buffers, from a trace."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from gpuos_tools.access import __doc__ as _access_doc
from gpuos_tools.cli import OutputOpt, UnbufferedOpt, run_app

_RECORD, _REST = _access_doc.split("\n\n", 2)[1:]

MAN_SECTIONS = {
    "RECORDS": (
        "After each `launch`, `memcpy`, `memset` and `graph_launch` record (which pass through "
        "unchanged, as every other record does) comes one `access` record:\n\n"
        + "\n".join("    " + line for line in _RECORD.splitlines())
        + "\n\n"
        + _REST.strip("\n")
    ),
    "REPORT": (
        "`--report` reads the whole trace and writes, instead of the stream, one `access_report` "
        "record per kernel (then one each for all memcpys, memsets and graph launches): `of`, "
        "`kernel` (mangled), `name` (demangled), `granularity`, `launches`, `captured`, "
        "`reads_per_launch` and `writes_per_launch` (buffers, mean), `bytes_read` and "
        "`bytes_written` (summed over launches at the chosen granularity), `unknown` (launches) "
        "and `why` ({reason: launches}). On a terminal it draws a table instead.\n\n"
        "`--explain SEQ` writes one `access_explain` record for the launch with that `seq`: each "
        "parameter's offset, size, type and basis; each pointer word with its parameter, offset, "
        "value, how it was found, the allocation and offset it lies in and the decision; and the "
        "`access` record. On a terminal it prints the same as text."
    ),
    "NOTES": (
        "What is predicted here is speculation (as PhOS does it), not yet checked on a GPU: "
        "directions come from the demangled prototype (const pointer: read; anything else: read "
        "and write), not from the kernels' code, and launch ranges run to the end of the "
        "allocation. Tighter ranges need per-kernel size templates, and validation needs the "
        "agent on the GPU; neither is built yet.\n\n"
        "Pointers inside by-value structs are found, but pointers stored in device memory "
        "(arrays of pointers) are not followed. PyTorch's caching allocator places many tensors "
        "in one allocation, so at `alloc` granularity a PyTorch kernel usually reads and writes "
        "the whole segment."
    ),
    "EXAMPLES": (
        "Annotate a trace as it is recorded and keep the launches that may write allocation 3:\n\n"
        "    gpu-trace run -- python3 train.py | gpu-predict-access | \\\n"
        "      jq -c 'select(.type==\"access\" and any(.writes[]; .alloc==3))'\n\n"
        "Per-kernel summary of a recorded trace:\n\n"
        "    gpu-predict-access --report trace.ndjson.zst\n\n"
        "Why launch 14 was predicted as it was:\n\n"
        "    gpu-predict-access --explain 14 trace.ndjson.zst"
    ),
    "SEE ALSO": "gpu-trace(1)",
}

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
    granularity: str = typer.Option(
        "alloc", "--granularity", metavar="alloc|range",
        help="alloc: whole allocations; range: from each pointer to the end of its allocation "
        "(copies and memsets: exactly their bytes).",
    ),
    explain_seq: Optional[int] = typer.Option(
        None, "--explain", metavar="SEQ", help="Explain the launch with this seq instead of writing the stream."
    ),
    report: bool = typer.Option(False, "--report", help="Per-kernel summary instead of the stream."),
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

    from gpuos_tools.access.predict import GRANULARITIES, Predictor
    from gpuos_tools.errors import ExitCode, GpuosError
    from gpuos_tools.stream import make_header, open_input, open_output

    if granularity not in GRANULARITIES:
        raise typer.BadParameter("must be alloc or range", param_hint="--granularity")
    if report and explain_seq is not None:
        raise typer.BadParameter("--report and --explain exclude each other", param_hint="--report")
    table = output == "-" and sys.stdout.isatty()
    if explain_seq is not None:
        from gpuos_tools.access.report import explain, render_explain

        with open_input(trace) as reader:
            ex = explain(reader, explain_seq, granularity)
        if ex is None:
            raise GpuosError(f"{trace}: no launch with seq {explain_seq}", ExitCode.FAILURE)
        if table:
            render_explain(ex, Console(highlight=False))
            return
        with open_output(output, unbuffered=unbuffered or None) as writer:
            writer.write(make_header("gpu-predict-access", source=trace, explain=explain_seq))
            writer.write(ex)
        return
    if report:
        from gpuos_tools.access.report import compute_report, render_report, report_records

        with open_input(trace) as reader:
            rows = compute_report(reader, granularity)
        if table:
            render_report(rows, Console(), granularity)
            return
        with open_output(output, unbuffered=unbuffered or None) as writer:
            writer.write(make_header("gpu-predict-access", source=trace, granularity=granularity))
            writer.write_many(report_records(rows, granularity))
        return
    with open_input(trace) as reader, open_output(output, unbuffered=unbuffered or None) as writer:
        if reader.header is None:
            writer.write(make_header("gpu-predict-access", source=trace))
        writer.write_many(Predictor(granularity).annotate(reader))


def main() -> None:
    run_app(app, prog="gpu-predict-access")


if __name__ == "__main__":
    main()
