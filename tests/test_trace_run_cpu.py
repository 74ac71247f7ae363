"""gpu-trace run on a machine without a GPU: what it refuses, and how it says so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuos_tools.errors import ExitCode
from gpuos_tools.trace.run import default_images_dir, is_python_program

ROOT = Path(__file__).resolve().parents[1]


def gpu_trace(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cmd" / "gpu-trace"), *args],
                          capture_output=True, text=True, timeout=120, **kw)


def test_missing_program(tmp_path):
    proc = gpu_trace("run", "-o", str(tmp_path / "t.ndjson"), "--", "no-such-program-xyz")
    assert proc.returncode == ExitCode.PROGRAM_NOT_FOUND
    assert "no-such-program-xyz: program not found" in proc.stderr
    assert not (tmp_path / "t.ndjson").exists()


def test_not_python(tmp_path):
    proc = gpu_trace("run", "-o", str(tmp_path / "t.ndjson"), "--", "/bin/true")
    assert proc.returncode == ExitCode.NOT_PYTHON
    assert "is not a Python program" in proc.stderr
    assert not (tmp_path / "t.ndjson").exists()


def test_no_program_given():
    proc = gpu_trace("run")
    assert proc.returncode == ExitCode.USAGE


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this machine has an NVIDIA driver")
def test_no_driver(tmp_path):
    proc = gpu_trace("run", "-o", str(tmp_path / "t.ndjson"), "--", sys.executable, "-c", "pass")
    assert proc.returncode == ExitCode.NO_DRIVER, proc.stderr
    assert "driver" in proc.stderr or "cuda-python" in proc.stderr
    assert not (tmp_path / "t.ndjson").exists()


def test_python_detection(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("#!/usr/bin/env python3\nprint(1)\n")
    shell = tmp_path / "s.sh"
    shell.write_text("#!/bin/sh\necho 1\n")
    assert is_python_program(sys.executable)
    assert is_python_program(str(script))
    assert not is_python_program(str(shell))


def test_default_images_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("GPUOS_IMAGES", raising=False)
    assert default_images_dir("runs/train.ndjson.zst") == Path("runs/train.images")
    assert default_images_dir("-") == Path("gpu-trace-images")
    # `-o /dev/null` (each rank of a torchrun job under `gpu-ckpt run`): no /dev/null.images
    assert default_images_dir("/dev/null") is None
    fifo = tmp_path / "trace.ndjson"
    os.mkfifo(fifo)
    assert default_images_dir(str(fifo)) == Path("gpu-trace-images")  # a pipe, like standard output
    monkeypatch.setenv("GPUOS_IMAGES", "/x")
    assert default_images_dir("a.ndjson") == Path("/x")
    assert default_images_dir("/dev/null") == Path("/x")  # asked for


def test_help_lists_both_commands():
    proc = gpu_trace("--help")
    assert proc.returncode == 0
    assert "run" in proc.stdout and "stats" in proc.stdout
