"""What every command shows a person: -h and --help, --version, usage lines that read as
written, and a clean end on SIGTERM (no hidden temp file left behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from helpers import REPO, child_env

import gpuos_tools
from gpuos_tools.commands.cli import command, run
from gpuos_tools.commands.registry import BY_PROG

COMMANDS = list(BY_PROG)


def _command(name: str):  # type: ignore[no-untyped-def]
    return command(BY_PROG[name].app, name)


def _walk(cmd, words):  # type: ignore[no-untyped-def]
    """Every (words, subcommand) of a command tree, the command itself first."""
    yield words, cmd
    for sub_name, sub in (getattr(cmd, "commands", None) or {}).items():
        if not getattr(sub, "hidden", False):
            yield from _walk(sub, [*words, sub_name])


@pytest.mark.parametrize("name", COMMANDS)
def test_version_on_every_command(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_command(name), name, ["--version"]) == 0
    assert capsys.readouterr().out == f"{name} {gpuos_tools.__version__}\n"


def test_version_of_the_installed_script() -> None:
    done = subprocess.run([sys.executable, str(REPO / "cmd" / "gpu-prefetch-sched"), "--version"],
                          capture_output=True, text=True, env=child_env(), timeout=60, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"gpu-prefetch-sched {gpuos_tools.__version__}\n", "")


@pytest.mark.parametrize("name", COMMANDS)
def test_h_and_usage_lines_on_every_subcommand(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    for words, _ in _walk(_command(name), []):
        assert run(_command(name), name, [*words, "-h"]) == 0, words
        out = capsys.readouterr().out
        usage = out.splitlines()[0]
        assert usage.startswith(f"Usage: {' '.join([name, *words])} "), usage
        # no doubled brackets around a metavar that says it is optional, no braces around required
        # ones, no "...}..." from variadic arguments
        assert "[[" not in usage and "{" not in usage and "]]..." not in usage, usage
        assert "-h, --help" in out
        assert run(_command(name), name, [*words, "--help"]) == 0
        assert capsys.readouterr().out == out


def test_usage_lines_read_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    expected = {
        ("gpu-trace", "run"): "Usage: gpu-trace run [OPTIONS] -- PROGRAM [ARGS]...",
        ("gpu-trace", "stats"): "Usage: gpu-trace stats [OPTIONS] [TRACE]",
        ("gpu-predict-access",): "Usage: gpu-predict-access [OPTIONS] [TRACE]",
        ("gpu-prefetch-sched", "simulate"): "Usage: gpu-prefetch-sched simulate [OPTIONS] [ACCESS-STREAM]...",
        ("gpu-prefetch-sched", "run"): "Usage: gpu-prefetch-sched run [OPTIONS] -- PROGRAM [ARGS]...",
    }
    for (name, *words), line in expected.items():
        assert run(_command(name), name, [*words, "-h"]) == 0
        assert capsys.readouterr().out.splitlines()[0] == line


def test_argument_list_shows_metavars_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_command("gpu-predict-access"), "gpu-predict-access", ["-h"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "A gpu-trace stream" in line)
    assert row.split()[0] == "[TRACE]" and "<str>" not in row


def test_a_typer_app_without_options_gets_them_too(capsys: pytest.CaptureFixture[str]) -> None:
    app = typer.Typer(add_completion=False)

    @app.command()
    def one(x: int) -> int:
        return x

    cmd = command(app, "gpu-one")
    assert run(cmd, "gpu-one", ["5"]) == 5
    assert run(cmd, "gpu-one", ["--version"]) == 0
    assert capsys.readouterr().out == f"gpu-one {gpuos_tools.__version__}\n"
    assert run(cmd, "gpu-one", ["-h"]) == 0


def test_man_pages_list_version() -> None:
    for name in COMMANDS:
        assert "\\fB\\-\\-version\\fR" in (REPO / "man" / f"{name}.1").read_text(), name


# -- SIGTERM ------------------------------------------------------------------------------


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_leaves_no_temp_file(tmp_path: Path, sig: signal.Signals) -> None:
    """A filter writing a file atomically and killed mid-stream removes its temp file, as it
    does on Ctrl-C, and exits 128+N (130 for SIGINT)."""
    out = tmp_path / "out.acc"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "cmd" / "gpu-predict-access"), "-", "-o", str(out)],
        stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(), cwd=tmp_path,
    )
    assert proc.stdin is not None
    proc.stdin.write(b'{"type":"header","schema":"gpuos/1","tool":"gpu-trace","version":"0.1.0"}\n')
    proc.stdin.flush()  # the input stays open: the command waits for more, its temp file open
    deadline = time.monotonic() + 60
    while not _temps(tmp_path) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.02)
    assert _temps(tmp_path), "the output's temp file never appeared"
    # let it get from creating the temp file to waiting for input inside the writer's block
    # (a signal in between is a window of open_output's own)
    time.sleep(0.5)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == (130 if sig == signal.SIGINT else 128 + sig)
    proc.stdin.close()
    assert _temps(tmp_path) == [] and not out.exists()
    assert b"internal error" not in (proc.stderr.read() if proc.stderr else b"")


def test_terminated_restores_the_handlers() -> None:
    before = signal.getsignal(signal.SIGTERM)
    app = typer.Typer(add_completion=False)

    @app.command()
    def term() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends

    @app.command()
    def other() -> None:
        pass

    cmd = command(app, "gpu-term")
    started = time.monotonic()
    assert run(cmd, "gpu-term", ["term"]) == 128 + signal.SIGTERM
    assert time.monotonic() - started < 5
    assert signal.getsignal(signal.SIGTERM) is before


# -- an option the command does not have, before `--` ---------------------------------------


@pytest.mark.parametrize("args,says", [
    (["gpu-ckpt", "run", "--mechanism", "intercept", "--", "python3", "x.py"],
     "no such option: --mechanism; this command has none: set GPUOS_AGENT_MECHANISM"),
    (["gpu-ckpt", "run", "--mechanism=intercept", "--", "python3", "x.py"], "no such option: --mechanism;"),
    (["gpu-prefetch-sched", "run", "--budget", "66%", "--mechanism", "intercept", "--", "python3", "x.py"],
     "no such option: --mechanism; this command has none: set GPUOS_AGENT_MECHANISM"),
    (["gpu-trace", "run", "--no-such", "--", "python3", "x.py"], "no such option: --no-such: -h lists"),
    (["gpu-trace", "run", "--mechanism", "cupti", "--", "python3", "x.py"], "--mechanism goes with --agent"),
])
def test_an_option_out_of_place_before_the_program_is_refused(tmp_path: Path, args: list[str], says: str) -> None:
    """Such an option was taken for the program to run ('--mechanism: program not found')."""
    done = subprocess.run([sys.executable, str(REPO / "cmd" / args[0]), *args[1:]], capture_output=True, text=True,
                          env=child_env(), cwd=tmp_path, timeout=60, check=False)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1 and list(tmp_path.iterdir()) == []
