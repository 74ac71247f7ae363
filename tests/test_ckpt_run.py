"""`gpu-ckpt run -- PROGRAM`, the alias of `gpu-trace run --agent`, without a GPU: its parsing, that
it goes through the same launcher as gpu-trace run with the same arguments, and that it leaves the other
forms of gpu-ckpt (`--pid`, `--agent`, subcommands) as they were. On a GPU:
tests/gpu/test_ckpt_run_gpu.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from helpers import REPO, child_env

from gpuos_tools.commands import cli
from gpuos_tools.commands import ckpt, trace
from gpuos_tools.errors import ExitCode
from gpuos_tools.trace import run as launcher


def invoke(app: typer.Typer, prog: str, *args: str) -> int:
    """Run a command in this process, as its console script would; its exit status."""
    return int(cli.run(typer.main.get_command(app), prog, list(args)))


def gpu_ckpt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "cmd" / "gpu-ckpt"), *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def traced(monkeypatch):
    """Stand in for gpuos_tools.trace.run.trace_program (what starts the program): record each
    call and answer as a program that exited with status 7."""
    calls: list[dict] = []

    def fake(program, writer, images_dir, **kw):
        kw.pop("warn")  # a closure, different for each caller; checked separately
        calls.append({"program": program, "images_dir": images_dir, **kw})
        return SimpleNamespace(code=7, errors=[])

    monkeypatch.setattr("gpuos_tools.trace.run.trace_program", fake)
    return calls


@pytest.mark.parametrize("options", [
    [],
    ["--cow-budget", "2GiB"],
    ["-o", "{tmp}/t.ndjson"],
    ["--output", "{tmp}/t.ndjson.zst", "--no-images", "--cow-budget", "512M"],
    ["--stage-ahead", "--cow-budget", "2GiB"],
])
def test_run_is_gpu_trace_run_agent(traced, tmp_path, monkeypatch, options):
    monkeypatch.chdir(tmp_path)  # the default module image directory is relative
    options = [o.format(tmp=tmp_path) for o in options]
    program = ["--", "python3", "train.py", "--epochs", "1", "-o", "x"]
    assert invoke(trace.app, "gpu-trace", "run", "--agent", *options, *program) == 7
    assert invoke(ckpt.app, "gpu-ckpt", "run", *options, *program) == 7
    assert len(traced) == 2
    assert traced[0] == traced[1]
    assert traced[1]["agent"] is True and traced[1]["backend"] == "auto"  # the native core where it builds
    assert traced[1]["program"] == ["python3", "train.py", "--epochs", "1", "-o", "x"]
    if "--cow-budget" in options:
        assert traced[1]["cow_budget"] == {"2GiB": 2 << 30, "512M": 512 << 20}[options[options.index("--cow-budget") + 1]]
    assert traced[1]["stage_ahead"] is ("--stage-ahead" in options)


def test_run_calls_the_library_launcher(monkeypatch):
    """No second implementation: gpu-ckpt run hands its options to the launcher gpu-trace run uses."""
    seen = {}

    def fake(program, **kw):
        kw.pop("warn")
        seen.update(program=program, **kw)
        return SimpleNamespace(code=3, errors=[])

    monkeypatch.setattr(launcher, "run_program", fake)
    assert invoke(ckpt.app, "gpu-ckpt", "run", "--cow-budget", "1G", "-o", "f.ndjson", "--", "python3", "p.py") == 3
    assert seen == {"program": ["python3", "p.py"], "output": "f.ndjson", "no_images": False, "agent": True,
                    "cow_budget": "1G", "stage_ahead": False}


def test_run_messages_are_gpu_ckpts(monkeypatch, capsys, tmp_path):
    def fake(program, writer, images_dir, warn, **kw):
        warn("no C compiler")
        return SimpleNamespace(code=0, errors=["lost 3 records"])

    monkeypatch.setattr("gpuos_tools.trace.run.trace_program", fake)
    assert invoke(ckpt.app, "gpu-ckpt", "run", "--no-images", "-o", str(tmp_path / "t"), "--", "python3", "p") == 0
    err = capsys.readouterr().err
    assert "gpu-ckpt: warning: no C compiler" in err and "gpu-ckpt: warning: lost 3 records" in err


@pytest.mark.parametrize("args", [
    ["run"],  # no program
    ["run", "--cow-budget", "lots", "--", "python3", "p.py"],
    ["-o", "x", "run", "--", "python3", "p.py"],  # gpu-ckpt's options before the command
    ["--agent", "5", "run", "--", "python3", "p.py"],
    ["--pid", "5", "run", "--", "python3", "p.py"],
])
def test_run_usage_errors(traced, args):
    assert invoke(ckpt.app, "gpu-ckpt", *args) == ExitCode.USAGE
    assert traced == []


def test_run_help_names_the_alias_and_the_agent_commands():
    done = gpu_ckpt("run", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "gpu-trace run --agent" in text
    assert "gpu-ckpt --agent PID" in text and "gpu-restore --agent PID" in text
    top = gpu_ckpt("--help")
    assert top.returncode == 0 and " run " in top.stdout


def test_run_missing_program_as_gpu_trace_says(tmp_path):
    done = gpu_ckpt("run", "-o", str(tmp_path / "t.ndjson"), "--", "no-such-program-xyz")
    assert done.returncode == ExitCode.PROGRAM_NOT_FOUND, done.stderr
    assert "gpu-ckpt: error: no-such-program-xyz: program not found" in done.stderr
    assert done.stdout == "" and not (tmp_path / "t.ndjson").exists()


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this machine has an NVIDIA driver")
def test_run_without_a_driver(tmp_path):
    done = gpu_ckpt("run", "-o", str(tmp_path / "t.ndjson"), "--", sys.executable, "-c", "pass")
    assert done.returncode == ExitCode.NO_DRIVER, done.stderr


# -- the other forms of gpu-ckpt, with `run` beside them ---------------------------------------------


def reaped_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_pid_form_still_parses():
    done = gpu_ckpt("--pid", str(reaped_pid()))
    assert done.returncode == ExitCode.NO_SUCH_PROCESS, done.stderr


def test_a_bare_pid_is_no_command():
    done = gpu_ckpt("4242")
    assert done.returncode == ExitCode.USAGE and "No such command" in done.stderr


def test_agent_form_still_parses(monkeypatch, tmp_path, capfd):
    from gpuos_tools.agent import control

    asked = {}

    def snap(sock, image, parent, compress, checksum, threads):
        asked.update(sock=sock, image=image, parent=parent, compress=compress, checksum=checksum, threads=threads)
        return {"t0_ns": 1, "buffers": 1, "bytes": 1 << 20, "stall_s": 0.0, "cow": 0,
                "image": {"path": image, "incremental": False}}

    monkeypatch.setattr(control, "resolve", lambda target: Path(f"/sock/{target}"))
    monkeypatch.setattr(ckpt, "snapshot_to_image", snap)  # where gpu-ckpt calls it
    assert invoke(ckpt.app, "gpu-ckpt", "--agent", "4242", "--image", str(tmp_path / "img")) == 0
    assert asked == {"sock": Path("/sock/4242"), "image": str(tmp_path / "img"), "parent": None, "compress": False,
                     "checksum": "auto", "threads": None}
    assert '"type": "agent_snapshot"' in capfd.readouterr().out.replace('":"', '": "')
    # `run` as --agent's value is a target, not the command
    assert invoke(ckpt.app, "gpu-ckpt", "--agent", "run", "--image", str(tmp_path / "img2")) == 0
    assert asked["sock"] == Path("/sock/run")
