"""Command plumbing: exit codes, messages, broken pipes, consoles and progress on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer
from cli_app import app
from helpers import child_env
from rich.progress import Progress

from gpuos_tools.commands.cli import NullProgress, progress, run, stderr_console
from gpuos_tools.errors import ExitCode

APP = str(Path(__file__).with_name("cli_app.py"))
COMMAND = typer.main.get_command(app)


@pytest.mark.parametrize("records", [False, True], ids=["print", "stream"])
def test_broken_pipe_is_quiet_and_successful(records: bool) -> None:
    args = [sys.executable, APP, "flood"] + (["--records"] if records else [])
    writer = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env())
    head = subprocess.Popen(["head", "-1"], stdin=writer.stdout, stdout=subprocess.PIPE)
    writer.stdout.close()
    first, _ = head.communicate(timeout=60)
    stderr = writer.stderr.read()
    assert writer.wait(timeout=60) == 0
    assert stderr == b""
    assert first == (b'{"type":"n","seq":0}\n' if records else b"0\n")


def test_gpuos_error_gives_message_and_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(COMMAND, "gpu-test", ["fail"]) == ExitCode.NO_INPUT
    captured = capsys.readouterr()
    assert captured.err == "gpu-test: error: no such thing\n"
    assert captured.out == ""


def test_gpuos_error_exit_status_of_the_process() -> None:
    done = subprocess.run([sys.executable, APP, "fail"], capture_output=True, env=child_env(), timeout=60, check=False)
    assert done.returncode == ExitCode.NO_INPUT
    assert done.stderr == b"gpu-test: error: no such thing\n"


def test_bug_is_one_line_without_debug(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(COMMAND, "gpu-test", ["crash"]) == ExitCode.SOFTWARE
    err = capsys.readouterr().err
    assert err.startswith("gpu-test: error: internal error: RuntimeError: boom\n")
    assert "Traceback" not in err
    assert "GPUOS_DEBUG=1" in err


def test_bug_shows_traceback_with_debug(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUOS_DEBUG", "1")
    assert run(COMMAND, "gpu-test", ["crash"]) == ExitCode.SOFTWARE
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert 'raise RuntimeError("boom")' in err


def test_interrupt_is_130(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(COMMAND, "gpu-test", ["interrupt"]) == ExitCode.INTERRUPTED == 130


def test_returned_int_is_the_exit_status() -> None:
    assert run(COMMAND, "gpu-test", ["status", "3"]) == 3
    done = subprocess.run([sys.executable, APP, "status", "7"], env=child_env(), timeout=60, check=False)
    assert done.returncode == 7


def test_usage_error_is_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(COMMAND, "gpu-test", ["status", "not-a-number"]) == ExitCode.USAGE
    assert "Invalid value for 'code'" in capsys.readouterr().err
    assert run(COMMAND, "gpu-test", ["no-such-command"]) == ExitCode.USAGE


def test_plain_click_commands_work_too(capsys: pytest.CaptureFixture[str]) -> None:
    @click.command()
    @click.argument("n", type=int)
    def cmd(n: int) -> int:
        return n

    assert run(cmd, "gpu-click", ["4"]) == 4
    assert run(cmd, "gpu-click", ["x"]) == ExitCode.USAGE
    assert "Invalid value" in capsys.readouterr().err


def test_help_is_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(COMMAND, "gpu-test", ["--help"]) == 0
    assert "flood" in capsys.readouterr().out


def test_stderr_console_honours_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    assert stderr_console().no_color
    monkeypatch.setenv("NO_COLOR", "")
    assert not stderr_console().no_color
    assert stderr_console().stderr


def test_progress_is_silent_when_stderr_is_not_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open(tmp_path / "err", "w") as err:
        monkeypatch.setattr(sys, "stderr", err)
        assert not stderr_console().is_terminal
        with progress() as bar:
            assert isinstance(bar, NullProgress)
            task = bar.add_task("copying", total=10)
            bar.advance(task, 3)
            bar.update(task, completed=10)
    assert (tmp_path / "err").read_text() == ""


def test_progress_is_shown_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=True) as tty:
            monkeypatch.setattr(sys, "stderr", tty)
            bar = progress()
            assert isinstance(bar, Progress)
            assert bar.console.file is tty
    finally:
        os.close(master)
