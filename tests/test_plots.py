"""--plot FILE and `gpu-prefetch-sched plot`: checked before any work, the same mistake the same
exit status in every command, and the picture written whole or not at all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, child_env

from gpuos_tools import figures
from gpuos_tools.errors import ExitCode, GpuosError

pytest.importorskip("matplotlib")

TRACE = REPO / "examples" / "torch-train-step.ndjson.zst"
PREDICT = [sys.executable, str(REPO / "cmd" / "gpu-predict-access")]
SCHED = [sys.executable, str(REPO / "cmd" / "gpu-prefetch-sched")]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, env=child_env(), cwd=cwd, timeout=300, check=False)


@pytest.fixture(scope="module")
def acc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("acc") / "step.acc"
    done = subprocess.run([*PREDICT, str(TRACE), "-o", str(path)], capture_output=True, env=child_env(), timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    return path


def _picture_commands(acc: Path, picture: str) -> dict[str, list[str]]:
    return {
        "predict": [*PREDICT, "--plot", picture, str(TRACE)],
        "simulate": [*SCHED, "--simulate", "--budget", "66%", "--plot", picture, str(acc)],
        "plot": [*SCHED, "plot", str(REPO / "benchmarks" / "results" / "2026-11-24-h100-timeline66.json"),
                 "--plot", picture],
    }


@pytest.mark.parametrize("which", ["predict", "simulate", "plot"])
def test_missing_directory_is_an_output_error(acc: Path, tmp_path: Path, which: str) -> None:
    done = _run(_picture_commands(acc, str(tmp_path / "no" / "such" / "map.png"))[which], tmp_path)
    assert done.returncode == ExitCode.IO_ERROR, done.stderr
    assert "cannot write: no directory" in done.stderr and "internal error" not in done.stderr
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("which", ["predict", "simulate", "plot"])
@pytest.mark.parametrize("name", ["map.txt", "map"])
def test_unknown_suffix_is_a_usage_error(acc: Path, tmp_path: Path, which: str, name: str) -> None:
    done = _run(_picture_commands(acc, str(tmp_path / name))[which], tmp_path)
    assert done.returncode == ExitCode.USAGE, done.stderr
    assert "a picture is written as one of" in done.stderr and ".png" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("which", ["predict", "simulate", "plot"])
def test_pictures_are_written_and_nothing_else(acc: Path, tmp_path: Path, which: str) -> None:
    done = _run(_picture_commands(acc, "out.svg")[which], tmp_path)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["out.svg"]
    assert (tmp_path / "out.svg").read_text().lstrip().startswith("<?xml")


def test_plot_of_a_missing_timeline(tmp_path: Path) -> None:
    done = _run([*SCHED, "plot", "missing.json", "--plot", "x.png"], tmp_path)
    assert done.returncode == ExitCode.NO_INPUT and "missing.json: no such file" in done.stderr
    assert "Errno" not in done.stderr
    (tmp_path / "bad.json").write_bytes(b"\xff\xfe not json")
    done = _run([*SCHED, "plot", "bad.json", "--plot", "x.png"], tmp_path)
    assert done.returncode == ExitCode.BAD_INPUT and "not a timeline" in done.stderr
    (tmp_path / "other.json").write_text(json.dumps({"type": "other"}))
    done = _run([*SCHED, "plot", "other.json", "--plot", "x.png"], tmp_path)
    assert done.returncode == ExitCode.BAD_INPUT
    assert not (tmp_path / "x.png").exists()


def test_no_matplotlib_is_the_same_usage_error_everywhere(acc: Path, tmp_path: Path) -> None:
    """Without matplotlib every command that draws refuses the same way, before reading."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    env = child_env(PYTHONPATH=f"{blocker}:{REPO}")
    for which, args in _picture_commands(acc, "x.png").items():
        done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False)
        assert done.returncode == ExitCode.USAGE, (which, done.stderr)
        assert "--plot needs matplotlib: pip install 'gpuos-tools[plot]'" in done.stderr, which
    assert not (tmp_path / "x.png").exists()


def test_save_is_atomic(tmp_path: Path) -> None:
    plt = figures.pyplot()
    fig = plt.figure()

    class Boom(Exception):
        pass

    def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise Boom

    fig.savefig = failing
    with pytest.raises(Boom):
        figures.save(fig, tmp_path / "a.png", dpi=50)
    plt.close(fig)
    assert list(tmp_path.iterdir()) == []
    fig = plt.figure()
    figures.save(fig, tmp_path / "a.png", dpi=50)
    plt.close(fig)
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]


def test_check_path_refuses_a_directory(tmp_path: Path) -> None:
    (tmp_path / "d.png").mkdir()
    with pytest.raises(GpuosError) as e:
        figures.check_path(tmp_path / "d.png")
    assert e.value.code == ExitCode.IO_ERROR and "is a directory" in str(e.value)
