"""A tiny command built on gpuos_tools.commands.cli, for tests/test_cli.py (run as a script there)."""

from __future__ import annotations

from typing import Annotated

import typer

from gpuos_tools.commands.cli import OutputOpt, run_app
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.stream import open_output
from gpuos_tools.stream.records import register_output
from gpuos_tools.stream.schema import RecordType

register_output(RecordType("n", "flood --records: one line"))

app = typer.Typer(add_completion=False, help="Commands that misbehave on purpose.")


@app.command()
def flood(
    output: OutputOpt = "-",
    lines: int = 100_000,
    records: Annotated[bool, typer.Option(help="Write stream records instead of print()ing.")] = False,
) -> None:
    """Write many lines to stdout."""
    if records:
        with open_output(output) as writer:
            writer.write_many({"type": "n", "seq": i} for i in range(lines))
    else:
        for i in range(lines):
            print(i)


@app.command()
def fail() -> None:
    """Fail the documented way."""
    raise GpuosError("no such thing", ExitCode.NO_INPUT)


@app.command()
def crash() -> None:
    """Fail with a bug."""
    raise RuntimeError("boom")


@app.command()
def interrupt() -> None:
    """Act as if Ctrl-C was pressed."""
    raise KeyboardInterrupt


@app.command()
def status(code: int) -> int:
    """Exit with CODE, as a wrapped program's status would be passed on."""
    return code


if __name__ == "__main__":
    run_app(app, "gpu-test")
