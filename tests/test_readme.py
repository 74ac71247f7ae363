"""The README's tour runs as written: every ```sh block, in order, in one directory, against the
checkout's commands and against a wheel installed (not editable) into a fresh virtual environment
outside the checkout, where `--profile linnos` must still work and `man gpu-trace` find its page.
Blocks marked ```bash (installing, the GPU recipes) are not run here."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers import REPO

from gpuos_tools.commands.registry import COMMANDS as REGISTERED

COMMANDS = [command.prog for command in REGISTERED]
RING = Path("/dev/shm/tour")  # the README's ring name


def blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of ``text`` in ``language``, in order."""
    return [m.group(1) for m in re.finditer(rf"^```{language}\n(.*?)^```$", text, flags=re.M | re.S)]


def test_the_readme_is_a_guide_not_a_notebook() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert not re.search(r"\bissue \d|\bP[1-9][a-z]?\b|\bitems? \d", text, flags=re.I), "issue or target numbers"
    assert blocks(text, "sh"), "no tour blocks"
    for name in COMMANDS:
        assert f"`{name}`" in text, name


def _workdir(tmp: Path) -> Path:
    work = tmp / "work"
    work.mkdir()
    for name in ("examples", "benchmarks", "tests"):  # the repository's data, as the tour reads it
        (work / name).symlink_to(REPO / name)
    return work


def _run_tour(work: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # a block that fails ends the script; the trap ends a daemon it started too, which would
    # otherwise hold the output pipes open until the timeout
    script = "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + "\n".join(
        blocks((REPO / "README.md").read_text(), "sh"))
    # the ring's name is the README's, one per machine: tours of several checkouts (or of the
    # checkout and the wheel) run one at a time
    lock = open("/tmp/gpuos-readme-tour.lock", "a")  # noqa: SIM115 (held until the tour ends)
    fcntl.flock(lock, fcntl.LOCK_EX)
    ring_was_there = RING.exists()
    proc = subprocess.Popen(["bash", "-c", script], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a daemon a failed block left behind
        except ProcessLookupError:
            pass
        if not ring_was_there:
            RING.unlink(missing_ok=True)
        lock.close()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _check_tour(work: Path, done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    for picture in ("access-map.png", "plan.png", "timeline.png"):
        assert (work / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", picture
    assert (work / "folded-image" / "manifest.json").is_file()
    assert (work / "linnos.npz").is_file()
    assert '"type":"kinfer_stats"' in (work / "daemon.ndjson").read_text()
    assert '"type":"kinfer_replay"' in done.stdout
    assert '"type":"sched_summary"' in done.stdout
    assert not list(work.glob(".*.tmp")), "a temp file was left behind"


def _environment(tmp: Path, bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUOS_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", HOME=str(tmp / "home"),
               XDG_CONFIG_HOME=str(tmp / "config"), XDG_CACHE_HOME=str(tmp / "cache"), NO_COLOR="1")
    return env


def test_the_tour_runs_against_the_checkout(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in COMMANDS:  # what an editable install puts on PATH: this checkout's code
        wrapper = bin_dir / name
        wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {REPO / 'cmd' / name} \"$@\"\n")
        wrapper.chmod(0o755)
    work = _workdir(tmp_path)
    _check_tour(work, _run_tour(work, _environment(tmp_path, bin_dir)))


# -- installed from a wheel, outside the checkout -------------------------------------------


def _sources(dest: Path) -> Path:
    """What a wheel is built from, copied out of the checkout (so the build leaves nothing in it)."""
    src = dest / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.npz", "*.egg-info")
    shutil.copytree(REPO / "gpuos_tools", src / "gpuos_tools", ignore=ignore)
    shutil.copytree(REPO / "man", src / "man")
    return src


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the package installed from its wheel (no editable link to
    the checkout); the dependencies are this interpreter's, reached through a .pth file, so that
    the test needs no download beyond the build backend."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = _sources(tmp)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"), str(src)],
                           capture_output=True, text=True, timeout=600, check=False)
    if built.returncode != 0:
        text = built.stdout + built.stderr
        if re.search(r"No matching distribution|Could not find a version|NewConnectionError|Network is unreachable"
                     r"|Temporary failure in name resolution|ProxyError", text):
            pytest.skip(f"no package index reachable to fetch the build backend: {text.strip().splitlines()[-1]}")
        raise AssertionError(text)
    wheel = next((tmp / "dist").glob("gpuos_tools-*.whl"))
    venv = tmp / "venv"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, env=clean)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, env=clean).stdout.strip()
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=300, env=clean, cwd=tmp)
    assert (venv / "bin" / "gpu-trace").is_file(), "the wheel did not install its commands"
    # after the install: pip would take a gpuos-tools installed here for the one asked for; the
    # venv's own site-packages come first on sys.path, these after
    deps = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    Path(site, "gpuos-test-deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    return venv


def test_the_wheel_carries_profiles_and_man_pages(installed: Path, tmp_path: Path) -> None:
    py = installed / "bin" / "python"
    env = _environment(tmp_path, installed / "bin")
    where = subprocess.run([str(py), "-c", "import gpuos_tools, pathlib; print(pathlib.Path(gpuos_tools.__file__).parent)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, check=True).stdout.strip()
    assert Path(where).is_relative_to(installed), where  # not the checkout
    for name in COMMANDS:
        assert Path(shutil.which(name, path=env["PATH"]) or "").parent == installed / "bin", name
    for name in ("linnos", "maintenance", "ckpt-periodic"):
        assert (Path(where) / "profiles" / f"{name}.toml").is_file(), name
    for page in ("man1/gpu-trace.1", "man1/gpu-kinfer-bridge.1", "man7/gpuos-stream.7"):
        assert (installed / "share" / "man" / page).is_file(), page
    done = subprocess.run(["gpu-kinfer-bridge", "status", "--profile", "linnos", "--ring", "gpuos-test-none"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60, check=False)
    assert done.returncode == 66 and "no such ring" in done.stderr, done.stderr  # the profile was found and read
    if shutil.which("man") is None:
        pytest.skip("man is not installed here")
    found = subprocess.run(["man", "-w", "gpu-trace"], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert found.stdout.strip() == str(installed / "share" / "man" / "man1" / "gpu-trace.1"), found.stderr


def test_the_tour_runs_against_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    work = _workdir(tmp_path)
    _check_tour(work, _run_tour(work, _environment(tmp_path, installed / "bin")))


def test_the_demo_shows_the_pipeline(tmp_path: Path) -> None:
    """scripts/demo, as the README runs it: without a GPU it takes the recorded trace and says
    so; either way it ends with the plan's summaries (JSON lines, stdout being a pipe here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUOS_", "PYTHONPATH"))}
    env.update(PYTHON=sys.executable, TMPDIR=str(tmp_path))
    done = subprocess.run([str(REPO / "scripts" / "demo")], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    policies = [json_line["policy"] for json_line in map(json.loads, done.stdout.splitlines())
                if json_line.get("type") == "sched_summary"]
    assert policies == ["belady", "lru", "demand"]
    assert "demo: 2+3." in done.stderr
    if shutil.which("nvidia-smi") is None:
        assert "no GPU here: using the training step recorded" in done.stderr
