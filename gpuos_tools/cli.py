"""Plumbing shared by every command: exit codes, stderr messages, progress, common options.

A command module ends with::

    def main() -> None:
        run_app(app, "gpu-xxx")

and then behaves like the rest of the toolkit: ``GpuosError`` becomes ``gpu-xxx: error: ...``
on stderr and its exit code; a closed pipe (``| head``) ends it quietly with status 0; Ctrl-C
gives 130; any other exception is a bug, reported in one line with status 75 (the traceback
too when ``GPUOS_DEBUG=1``). A command may return an int to choose its exit status (for
instance a traced program's own).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from types import TracebackType
from typing import Annotated, Any, NoReturn, Self

import click
import typer
from rich.console import Console
from rich.progress import Progress

from gpuos_tools.errors import ExitCode, GpuosError

#: Environment variables every command honours; each man page lists them.
ENVIRONMENT = {
    "GPUOS_DEBUG": "Set to 1 to print a traceback when a command fails with an internal error.",
    "NO_COLOR": "When set and not empty, messages on standard error are not coloured.",
}

# Options that mean the same in every command (sqlite-utils style: one definition, many users).
InputArg = Annotated[str, typer.Argument(metavar="INPUT", help="Input stream; - for stdin; .zst is decompressed.")]
OutputOpt = Annotated[
    str, typer.Option("--output", "-o", metavar="FILE", help="Output stream; - for stdout; .zst compresses.")
]
UnbufferedOpt = Annotated[
    bool,
    typer.Option("--unbuffered", "-u", help="Flush every record, even to a file (which is then written in place)."),
]


def error(prog: str, message: str) -> None:
    """Print ``prog: error: message`` on stderr."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null so the interpreter's final flush of stdout cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


# Since 0.26 typer raises the exceptions of its own copy of click (typer._click); a command
# built with click raises click's. Both kinds are handled.
_EXIT = (click.exceptions.Exit, typer.Exit)
_ABORT = (click.exceptions.Abort, typer.Abort)
_SHOWN = (click.ClickException, getattr(typer, "TyperException", click.ClickException))


def run(command: Any, prog: str, args: Sequence[str] | None = None) -> int:
    """Run a click command or ``typer.main.get_command(app)``; return the exit status."""
    try:
        command._main_shell_completion({}, prog)
        with command.make_context(prog, list(sys.argv[1:] if args is None else args)) as ctx:
            result = command.invoke(ctx)
        sys.stdout.flush()
    except _EXIT as e:
        return e.exit_code
    except _SHOWN as e:
        if hasattr(e, "show"):
            e.show()
        else:
            print(f"Error: {e.format_message()}", file=sys.stderr)
        return e.exit_code
    except _ABORT as e:
        if isinstance(e.__context__, KeyboardInterrupt):
            return ExitCode.INTERRUPTED
        print("Aborted!", file=sys.stderr)
        return ExitCode.FAILURE
    except GpuosError as e:
        error(prog, str(e))
        return e.code
    except BrokenPipeError:
        _silence_stdout()
        return ExitCode.OK
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except Exception as e:  # noqa: BLE001 (anything else is a bug: report it, exit SOFTWARE)
        error(prog, f"internal error: {type(e).__name__}: {e}")
        if os.environ.get("GPUOS_DEBUG") == "1":
            traceback.print_exc()
        else:
            print(f"{prog}: set GPUOS_DEBUG=1 for a traceback", file=sys.stderr)
        return ExitCode.SOFTWARE
    if isinstance(result, int) and not isinstance(result, bool):
        return result
    return ExitCode.OK


def options_before_subcommand(ctx: typer.Context) -> list[str]:
    """The group options the user gave before a subcommand, which the subcommand would ignore.

    Asks click where each value came from, so options added later are covered without a list to
    keep in step.
    """
    given = []
    for param in ctx.command.params:
        # by name: typer >= 0.26 carries its own copy of click, with its own ParameterSource enum
        source = ctx.get_parameter_source(param.name) if param.name else None
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            given.append(param.opts[0] if param.opts else param.name)
    return given


def run_app(app: typer.Typer, prog: str | None = None) -> NoReturn:
    """Entry point of a command: run ``app`` on sys.argv and exit with its status."""
    name = prog or os.path.basename(sys.argv[0])
    sys.exit(int(run(typer.main.get_command(app), name)))


def stderr_console() -> Console:
    """A rich Console for people: on stderr, no colour under NO_COLOR, plain when not a terminal."""
    return Console(stderr=True, no_color=os.environ.get("NO_COLOR", "") != "", highlight=False)


class NullProgress:
    """What ``progress()`` gives when stderr is not a terminal: the same calls, no output."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def add_task(self, description: str, *args: Any, **kwargs: Any) -> int:
        return 0

    def advance(self, task_id: int, advance: float = 1) -> None:
        return None

    def update(self, task_id: int, **kwargs: Any) -> None:
        return None

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None


def progress(transient: bool = True) -> Progress | NullProgress:
    """A progress display on stderr, only when stderr is a terminal (never in pipes or logs)."""
    try:
        live = sys.stderr.isatty()
    except (AttributeError, ValueError):
        live = False
    return Progress(console=stderr_console(), transient=transient) if live else NullProgress()

