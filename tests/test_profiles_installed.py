"""Profiles found by name wherever the package is installed: the user's own first, then the ones
installed with the package, which `calibrate` never rewrites; and what `serve` and `status` say
to someone following the README."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import REPO, child_env

from gpuos_tools.commands.cli import command, run
from gpuos_tools.errors import ExitCode
from gpuos_tools.kinfer import policy as P

BRIDGE = [sys.executable, str(REPO / "cmd" / "gpu-kinfer-bridge")]


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config" / "gpuos-tools" / "profiles"


def test_shipped_profiles_are_package_data() -> None:
    assert P.PROFILE_DIR == REPO / "gpuos_tools" / "profiles"
    for name in ("linnos", "maintenance", "ckpt-periodic"):
        assert (P.PROFILE_DIR / f"{name}.toml").is_file()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"gpuos_tools" = ["profiles/*.toml"]' in pyproject
    assert '"share/man/man1" = ["man/*.1"]' in pyproject and '"share/man/man7" = ["man/*.7"]' in pyproject


def test_a_name_finds_the_users_profile_first(config: Path, tmp_path: Path) -> None:
    assert P.find_profile("linnos") == P.PROFILE_DIR / "linnos.toml"
    assert P.is_shipped(P.find_profile("linnos"))
    config.mkdir(parents=True)
    (config / "linnos.toml").write_text('[ring]\nname = "mine"\n')
    assert P.find_profile("linnos") == config / "linnos.toml"
    assert P.load_profile("linnos").section("ring")["name"] == "mine"
    assert not P.is_shipped(config / "linnos.toml")
    assert P.find_profile("./x.toml") == Path("./x.toml") and P.find_profile("dir/x") == Path("dir/x")


def test_calibrating_a_shipped_profile_writes_the_users_copy(config: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from gpuos_tools.commands import kinfer
    from gpuos_tools.kinfer import calibrate as C

    shipped = (P.PROFILE_DIR / "linnos.toml").read_bytes()
    batches = [1, 64, 1024]
    fake = {"batches": batches, "cpu_us": [5.0, 20.0, 300.0], "gpu_us": [30.0, 31.0, 40.0], "crossover": 64,
            "gpu": "a fake GPU", "gpu_mode": "fused", "gpu_error": None, "host": "h", "date": "2026-11-25T00:00:00Z",
            "reps": 3}
    monkeypatch.setattr(C, "measure", lambda *a, **k: fake)  # a unit test of where the result goes
    assert run(command(kinfer.app, "gpu-kinfer-bridge"), "gpu-kinfer-bridge", ["calibrate", "--profile", "linnos"]) == 0
    err = capsys.readouterr().err
    assert (P.PROFILE_DIR / "linnos.toml").read_bytes() == shipped  # the installed file is untouched
    copy = config / "linnos.toml"
    assert str(copy) in err and "unchanged" in err
    prof = P.load_profile("linnos")
    assert prof.path == copy and prof.policy().cpu_below == 64 and prof.policy().gpu_us == fake["gpu_us"]
    assert prof.model_file() == P.PROFILE_DIR / "linnos.npz"  # still the model the shipped profile names


def test_serve_says_how_to_get_a_model(config: Path) -> None:
    done = subprocess.run([*BRIDGE, "serve", "--profile", "linnos", "--ring", f"t-{uuid.uuid4().hex[:8]}", "--gpu", "off"],
                          capture_output=True, text=True, env=child_env(XDG_CONFIG_HOME=str(config.parent.parent)),
                          timeout=60, check=False)
    assert done.returncode == ExitCode.NO_INPUT
    assert "does not exist: train one" in done.stderr and "--model FILE" in done.stderr


def test_status_waits_for_a_daemon(tmp_path: Path) -> None:
    from gpuos_tools.kinfer import ring as R

    name = f"kinfer-wait-{uuid.uuid4().hex[:8]}"
    waiting = subprocess.Popen([*BRIDGE, "status", "--ring", name, "--wait", "60s"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=child_env())
    daemon = None
    try:
        time.sleep(0.5)
        assert waiting.poll() is None  # still waiting: no ring yet
        daemon = subprocess.Popen([*BRIDGE, "serve", "--ring", name, "--gpu", "off", "--random-model", "1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
        out, err = waiting.communicate(timeout=60)
        assert waiting.returncode == 0, err
        rec = json.loads(out.splitlines()[-1])
        assert rec["type"] == "kinfer_status" and rec["daemon_alive"] and rec["daemon_pid"] == daemon.pid
    finally:
        waiting.kill()
        if daemon is not None:
            daemon.terminate()
            daemon.wait(timeout=30)
        R.ring_path(name).unlink(missing_ok=True)
    gone = subprocess.run([*BRIDGE, "status", "--ring", name, "--wait", "200ms"], capture_output=True, text=True,
                          env=child_env(), timeout=60, check=False)
    assert gone.returncode == ExitCode.NO_INPUT
    bad = subprocess.run([*BRIDGE, "status", "--ring", name, "--wait", "soon"], capture_output=True, text=True,
                         env=child_env(), timeout=60, check=False)
    assert bad.returncode == ExitCode.USAGE and "not a duration" in bad.stderr


def test_status_waits_out_a_ring_whose_daemon_has_not_written_its_header() -> None:
    """`serve &` then `status --wait`: the daemon's ring file can exist before its header does
    (zeros, the magic written last). A waiting status waits that out, up to its limit; a status
    that does not wait says what it found."""
    from gpuos_tools.kinfer import ring as R

    name = f"kinfer-unready-{uuid.uuid4().hex[:8]}"
    path = R.ring_path(name)
    path.write_bytes(bytes(2 * R.HEADER_SIZE))  # a file being made: no magic yet
    try:
        now = subprocess.run([*BRIDGE, "status", "--ring", name], capture_output=True, text=True,
                             env=child_env(), timeout=60, check=False)
        assert now.returncode == ExitCode.BAD_INPUT and "not a gpu-kinfer-bridge ring" in now.stderr
        t = time.monotonic()
        waited = subprocess.run([*BRIDGE, "status", "--ring", name, "--wait", "4s"], capture_output=True,
                                text=True, env=child_env(), timeout=60, check=False)
        # its deadline starts after its own start-up: it cannot have answered before 4 s
        assert waited.returncode == ExitCode.BAD_INPUT and time.monotonic() - t >= 4, waited.stderr
        path.write_bytes(bytes(10))  # shorter than a header: being made
        waiting = subprocess.Popen([*BRIDGE, "status", "--ring", name, "--wait", "60s"], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=child_env())
        daemon = None
        try:
            time.sleep(3)  # its start-up, then polls of the unready file
            assert waiting.poll() is None, waiting.communicate()
            path.unlink()
            daemon = subprocess.Popen([*BRIDGE, "serve", "--ring", name, "--gpu", "off", "--random-model", "1"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
            out, err = waiting.communicate(timeout=60)
            assert waiting.returncode == 0, err
            assert json.loads(out.splitlines()[-1])["daemon_pid"] == daemon.pid
        finally:
            waiting.kill()
            if daemon is not None:
                daemon.terminate()
                daemon.wait(timeout=30)
    finally:
        path.unlink(missing_ok=True)


def test_every_file_the_package_reads_at_run_time_is_package_data() -> None:
    """C sources, headers and the bootstrap are not modules: setuptools installs them only where
    pyproject's package-data names them (a non-editable install would lack them otherwise)."""
    import fnmatch
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    root = REPO / "gpuos_tools"
    missing = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".c", ".h", ".toml", ".o", ".json") and not (
                path.suffix == ".py" and not (path.parent / "__init__.py").exists()):
            continue
        if "__pycache__" in path.parts or not path.is_file():
            continue
        covered = False
        for package, patterns in data.items():
            base = REPO.joinpath(*package.split("."))
            if base in path.parents:
                rel = path.relative_to(base).as_posix()
                covered |= any(fnmatch.fnmatch(rel, p) for p in patterns)
        if not covered:
            missing.append(str(path.relative_to(REPO)))
    assert not missing, f"not package data (add them to pyproject's [tool.setuptools.package-data]): {missing}"
