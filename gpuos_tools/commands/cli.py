"""Plumbing shared by every command: exit codes, stderr messages, progress, common options.

A command module ends with::

    def main() -> None:
        run_app(app, "gpu-xxx")

and then behaves like the rest of the toolkit: ``GpuosError`` becomes ``gpu-xxx: error: ...``
on stderr and its exit code; a closed pipe (``| head``) ends it quietly with status 0; Ctrl-C
gives 130; SIGTERM and SIGHUP unwind like Ctrl-C (so a half-written output file is removed)
and give 128+N; any other exception is a bug, reported in one line with status 75 (the
traceback too when ``GPUOS_DEBUG=1``). A command may return an int to choose its exit status
(for instance a traced program's own). ``command(app, prog)`` is the click command as users
see it: ``-h`` beside ``--help``, ``--version``, and usage lines that show each argument's
metavar as written.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Annotated, Any, NoReturn, Self, TypeVar

import click
import typer
from rich.console import Console
from rich.progress import Progress

import gpuos_tools
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.injection.config import DEFAULT_MECHANISM

T = TypeVar("T")

#: what every help text and man page says of the agent's default mechanism, from the constant
#: that decides it
MECHANISM_DEFAULT = (
    f"the default is {DEFAULT_MECHANISM}. A default of intercept that cannot run here (no C compiler, the "
    "interposer not built or not loadable, the Python agent asked for) gives way to cupti with a warning; "
    "intercept asked for is refused instead. The trace's header names the mechanism the agent ran on"
)

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


def warn(prog: str, message: str) -> None:
    """Print ``prog: warning: message`` on stderr."""
    print(f"{prog}: warning: {message}", file=sys.stderr, flush=True)


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


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread so that ``with`` blocks and ``finally``
    clauses run (an output written atomically discards its temp file) before the command exits.
    A BaseException, like KeyboardInterrupt, so that ``except Exception`` does not swallow it."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signal.Signals(signum).name}")
        self.signum = signum


@contextmanager
def _terminate_raises() -> Iterator[None]:
    """While the command runs, SIGTERM and SIGHUP raise Terminated (where nothing else handles
    them). Commands that need their own handling (a daemon, a process left locked) install their
    own handlers inside and restore this one after. A second signal during the clean-up ends the
    process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old: dict[int, Any] = {}

    def handler(signum: int, _frame: Any) -> None:
        for sig in old:
            signal.signal(sig, signal.SIG_DFL)
        raise Terminated(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(sig) is signal.SIG_DFL:
                old[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):
            pass
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def run(command: Any, prog: str, args: Sequence[str] | None = None) -> int:
    """Run a click command or ``typer.main.get_command(app)``; return the exit status."""
    with _terminate_raises():
        return _run(command, prog, args)


def _run(command: Any, prog: str, args: Sequence[str] | None) -> int:
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
    except Terminated as e:
        return 128 + e.signum
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


def doc_format(**values: str) -> Callable[[T], T]:
    """Fill ``{name}`` fields of a command's docstring (its help and man page) from code, so that
    what it states (a default) is what the code does."""

    def fill(fn: T) -> T:
        fn.__doc__ = (fn.__doc__ or "").format(**values)
        return fn

    return fill


def option_given(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave the option ``name`` (its parameter's name), on the command line or
    through its environment variable, rather than its default holding."""
    # by name: typer >= 0.26 carries its own copy of click, with its own ParameterSource enum
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


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


HELP_OPTIONS = ["-h", "--help"]


def command(app: typer.Typer, prog: str) -> Any:
    """The click command of ``app`` as every gpuos command presents it: ``-h`` as well as
    ``--help`` (subcommands inherit it through their contexts), ``--version``, and usage lines
    and argument lists that show each argument's metavar as written (typer's own wrapping gives
    ``[[TRACE]]`` for a metavar that already says it is optional, and braces around required
    ones, differently from one typer release to the next)."""
    cmd = typer.main.get_command(app)
    cmd.context_settings = {**(cmd.context_settings or {}), "help_option_names": HELP_OPTIONS}
    if not any("--version" in getattr(p, "opts", ()) for p in cmd.params):
        cmd.params.append(_version_option(prog))
    _literal_metavars(cmd)
    return cmd


def _version_option(prog: str) -> Any:
    """A ``--version`` option of the same click as typer's commands (typer vendors click since
    0.26 and its parameter classes change between releases): made by typer itself, for a
    throwaway command, and taken from it."""

    def show(ctx: typer.Context, value: bool) -> None:
        if value and not ctx.resilient_parsing:
            print(f"{prog} {gpuos_tools.__version__}")
            raise typer.Exit(0)

    probe = typer.Typer(add_completion=False)

    @probe.command()
    def version(
        version: bool = typer.Option(False, "--version", is_eager=True, callback=show, help="Print the version and exit."),
    ) -> None:
        pass

    param = next(p for p in typer.main.get_command(probe).params if p.name == "version")
    param.expose_value = False
    return param


def _literal_metavars(cmd: Any) -> None:
    for param in cmd.params:
        if getattr(param, "param_type_name", None) == "argument" and param.metavar:
            _show_as_written(param)
    for sub in (getattr(cmd, "commands", None) or {}).values():
        _literal_metavars(sub)


def _show_as_written(param: Any) -> None:
    metavar = param.metavar
    record = param.get_help_record

    def help_record(ctx: Any) -> tuple[str, str] | None:
        found = record(ctx)
        return None if found is None else (metavar, found[1])

    param.get_usage_pieces = lambda ctx: [metavar]
    param.get_help_record = help_record


def run_app(app: typer.Typer, prog: str | None = None) -> NoReturn:
    """Entry point of a command: run ``app`` on sys.argv and exit with its status."""
    name = prog or os.path.basename(sys.argv[0])
    sys.exit(int(run(command(app, name), name)))


def stderr_console() -> Console:
    """A rich Console for people: on stderr, no colour under NO_COLOR, plain when not a terminal."""
    return Console(stderr=True, no_color=os.environ.get("NO_COLOR", "") != "", highlight=False)


def report_run(prog: str, summary: Any) -> int:
    """After a traced program (gpu-trace run and the commands built on it; ``summary`` is the
    launcher's RunSummary): one line about it on a terminal, the stream's problems as warnings.
    Returns the program's own exit status."""
    if sys.stderr.isatty():
        stderr_console().print(f"{prog}: {summary.describe()}", highlight=False)
    for message in summary.errors[:10]:
        warn(prog, message)
    return summary.code


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


def with_progress(records: Iterable[T], label: str, every: int = 1 << 16) -> Iterator[T]:
    """``records`` unchanged; while stderr is a terminal, a line on it counts them (every
    ``every`` records, a power of two: short inputs show nothing), so a long run shows that it
    is moving."""
    with progress() as bar:
        if isinstance(bar, NullProgress):
            yield from records
            return
        task = None
        mask = every - 1
        n = 0
        for n, rec in enumerate(records, 1):
            if not n & mask:
                if task is None:
                    task = bar.add_task(label, total=None)
                bar.update(task, description=f"{label}: {n:,} records", refresh=True)  # seen at once
            yield rec
