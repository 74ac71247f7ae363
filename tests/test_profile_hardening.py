"""TOML profiles (maintenance and periodic) and the maintenance state file: every wrong input is a
clean error naming the file and the key, never an internal error; nothing blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, child_env

from gpuos_tools.ckpt import periodic as per
from gpuos_tools.ckpt import profile as prof
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.tomlfile import load_toml

MAINTENANCE = REPO / "gpuos_tools" / "profiles" / "maintenance.toml"
PERIODIC = REPO / "gpuos_tools" / "profiles" / "ckpt-periodic.toml"


def cli(command: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "cmd" / command), *args], env=child_env(),
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("argv", [
    ("gpu-ckpt", "--profile"), ("gpu-restore", "--profile"), ("gpu-ckpt", "periodic", "--plan", "--profile"),
])
def test_invalid_utf8_is_a_clean_error_in_every_command_reading_a_profile(tmp_path: Path, argv: tuple) -> None:
    path = tmp_path / "p.toml"
    path.write_bytes(b'[select]\ncommand = "train\xff"\n')
    done = cli(*argv, str(path))
    assert done.returncode == ExitCode.BAD_INPUT, done.stderr
    assert f"{path}: not valid UTF-8 (line 2" in done.stderr and "internal error" not in done.stderr


@pytest.mark.parametrize("load", [prof.load_profile, per.load_periodic_profile])
def test_a_fifo_or_a_directory_is_refused_without_blocking(tmp_path: Path, load) -> None:
    fifo = tmp_path / "p.toml"
    os.mkfifo(fifo)
    with pytest.raises(GpuosError, match="not a regular file") as caught:
        load(fifo)
    assert caught.value.code == ExitCode.BAD_INPUT
    with pytest.raises(GpuosError, match="is a directory") as caught:
        load(tmp_path)
    assert caught.value.code == ExitCode.NO_INPUT


def test_a_huge_profile_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_bytes(b"# x\n" * (1 << 19))
    with pytest.raises(GpuosError, match="too large"):
        load_toml(path)


@pytest.mark.parametrize("text, message", [
    ("[select]\nusers = [1, 2.5]\n[state]\nfile='s'\n", "select.users[1]: must be"),
    ("[select]\nusers = {a = 1}\n[state]\nfile='s'\n", "select.users: must be"),
    ("[select]\ncommand = 5\n[state]\nfile='s'\n", "select.command: must be a string"),
    ("[select]\ncommand = 'x'\n[checkpoint]\ntimeout_ms = 1.5\n[state]\nfile='s'\n", "checkpoint.timeout_ms"),
    ("[select]\ncommand = 'x'\n[checkpoint]\ntimeout_ms = -3\n[state]\nfile='s'\n", "checkpoint.timeout_ms"),
    ("[select]\ncommand = 'x'\n[checkpoint]\ntimeout_ms = 1979-05-27\n[state]\nfile='s'\n",
     "checkpoint.timeout_ms: must be an integer"),
    ("[select]\ncommand = 'x'\n[checkpoint]\non_error = 'retry'\n[state]\nfile='s'\n", "checkpoint.on_error"),
    ("[select]\ncommand = 'x'\n[state]\nfile = ['s']\n", "state.file: must be a string"),
    ("select = 3\n", "select must be a table"),
    ("[select]\n" + "a = [" * 2000 + "\n", "not valid TOML"),
])
def test_maintenance_profile_values_are_typed_and_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(GpuosError, match=message.replace("[", r"\[")) as caught:
        prof.load_profile(path)
    assert caught.value.code == ExitCode.BAD_INPUT and str(path) in str(caught.value)


@pytest.mark.parametrize("table, line, message", [
    ("images", "compress = 'yes'", "images.compress: must be true or false"),
    ("images", "chunk_size = [1]", "images.chunk_size: must be"),
    ("images", "chunk_size = '1e400'", "images.chunk_size"),
    ("images", "chunk_size = 8589934592", "images.chunk_size"),
    ("images", "checksum = 'md5'", "images.checksum"),
    ("images", "name = 7", "images.name: must be a string"),
    ("chain", "length = 100000", "chain.length"),
    ("retention", "keep = -1", "retention.keep"),
    ("retention", "max_age = nan", "retention.max_age"),
    ("retention", "max_age = inf", "retention.max_age"),
    ("retention", "max_age = true", "retention.max_age"),
])
def test_periodic_profile_values_are_typed_and_named(tmp_path: Path, table: str, line: str, message: str) -> None:
    base = {"images": ["directory = 'd'"], "chain": [], "retention": [], "agent": ["pid = 1"]}
    base[table].append(line)
    text = "".join(f"[{t}]\n" + "".join(k + "\n" for k in keys) for t, keys in base.items())
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(GpuosError, match=message) as caught:
        per.load_periodic_profile(path)
    assert caught.value.code == ExitCode.BAD_INPUT


@pytest.mark.parametrize("processes, message", [
    ([{"pid": "12"}], r"processes\[0\].pid: must be an integer"),
    ([{"pid": 1.5}], r"processes\[0\].pid"),
    ([{"pid": 0}], r"processes\[0\].pid"),
    ([{"command": "x"}], r"processes\[0\].pid' is missing|processes\[0\]pid"),
    (["x"], r"processes\[0\]: must be an object"),
])
def test_a_damaged_state_file_is_refused_naming_the_entry(tmp_path: Path, processes: list, message: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[select]\ncommand = 'x'\n[state]\nfile = 'state.json'\n")
    profile = prof.load_profile(path)
    profile.state_file.write_text(json.dumps({"schema": prof.STATE_SCHEMA, "processes": processes}))
    with pytest.raises(GpuosError, match="damaged state file") as caught:
        prof.read_state(profile)
    assert caught.value.code == ExitCode.BAD_INPUT


def test_a_deeply_nested_state_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[select]\ncommand = 'x'\n[state]\nfile = 'state.json'\n")
    profile = prof.load_profile(path)
    profile.state_file.write_text("[" * 100000)
    with pytest.raises(GpuosError, match="not a readable JSON state file"):
        prof.read_state(profile)


def test_the_shipped_profiles_still_load() -> None:
    assert load_toml(MAINTENANCE)["checkpoint"]["on_error"] == "resume"
    assert per.load_periodic_profile(PERIODIC).keep == 14
