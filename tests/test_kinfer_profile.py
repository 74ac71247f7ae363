"""The gpu-kinfer-bridge profile as untrusted input: every key typed and bounded, the key named in
the message, bad bytes and odd files refused cleanly, and a seeded fuzzer over mutated profiles
(no exception but a BAD_INPUT error, and every profile that loads gives a usable policy)."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, child_env

from gpuos_tools.tomlfile import MAX_PROFILE
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.kinfer import policy as P
from gpuos_tools.kinfer import ring as R
from gpuos_tools.kinfer import server as S

BRIDGE = [sys.executable, str(REPO / "cmd" / "gpu-kinfer-bridge")]
SHIPPED = (REPO / "gpuos_tools" / "profiles" / "linnos.toml").read_text()


def _load(tmp_path: Path, text: str | bytes) -> P.Profile:
    path = tmp_path / "p.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return P.load_profile(str(path))


@pytest.mark.parametrize(("text", "message"), [
    ("[batch]\nmax = -3\n", "[batch] max must be at least 1, not -3"),
    ("[batch]\nmax = 0\n", "[batch] max must be at least 1"),
    ("[batch]\nwindow_us = -5.0\n", "[batch] window_us must be at least 0, not -5.0"),
    ("[batch]\nwindow_us = inf\n", "[batch] window_us must be a finite number"),
    ("[policy]\nwindow_ms = -1\n", "[policy] window_ms must be at least"),
    ("[policy]\nwindow_samples = 0\n", "[policy] window_samples must be at least 1"),
    ("[policy]\nbusy_util = 150\n", "[policy] busy_util must be at most 100"),
    ("[policy]\nprobe_idle_ms = nan\n", "[policy] probe_idle_ms must be a finite number"),
    ("[ring]\nlanes = \"64\"\n", "[ring] lanes must be an integer, not a string"),
    ("[ring]\nlanes = 1.5\n", "[ring] lanes must be an integer, not a number"),
    ("[ring]\nslots_per_lane = 100000\n", "[ring] slots_per_lane must be at most 4096"),
    ("[ring]\nname = 3\n", "[ring] name must be a string, not an integer"),
    ("[ring]\nmode = \"0644x\"\n", "[ring] mode '0644x' is not an octal mode"),
    ("[ring]\nmode = \"0066\"\n", "[ring] mode mode 0066 leaves the owner without read and write"),
    ("[model]\ninputs = true\n", "[model] inputs must be an integer, not a boolean"),
    ("[model]\nhidden = [1]\n", "[model] hidden must be an integer, not a list"),
    ("[native]\nmode = \"fast\"\n", "[native] mode must be one of auto, on, off"),
    ("[native]\nmax_batch = -1\n", "[native] max_batch must be at least 0"),
    ("[calibration]\nbatches = [1, 2]\ncpu_us = [1.0]\ngpu_us = [1.0, 2.0]\n", "one value per batch size"),
    ("[calibration]\nbatches = [4, 2]\ncpu_us = [1.0, 1.0]\ngpu_us = [1.0, 2.0]\n", "batches must be increasing"),
    ("[calibration]\nbatches = [1, \"x\"]\n", "[calibration] batches item 1 must be an integer"),
    ("[calibration]\ncpu_us = [-1.0]\n", "[calibration] cpu_us item 0 must be at least 0"),
    ("[calibration]\nbogus = 1\n", "unknown keys in [calibration]: bogus"),
    ("[bogus]\nx = 1\n", "unknown table [bogus]"),
    ("batch = 3\n", "batch must be a table, not an integer"),
    ("[batch\n", "not valid TOML"),
])
def test_bad_values_are_refused_with_the_key_named(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(GpuosError) as err:
        _load(tmp_path, text)
    assert err.value.code == ExitCode.BAD_INPUT
    assert message in str(err.value)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(GpuosError) as err:
        _load(tmp_path, "[batch]\nmax = -3\nwindow_us = -1\n")
    assert "[batch] max" in str(err.value) and "[batch] window_us" in str(err.value)


def test_good_values_load(tmp_path: Path) -> None:
    prof = _load(tmp_path, "[batch]\nmax = 1\nwindow_us = 0\n[ring]\nmode = 0o660\n[policy]\nwindow_ms = 2\n")
    assert prof.section("batch") == {"window_us": 0, "max": 1}
    assert P.parse_mode(prof.section("ring")["mode"]) == 0o660
    assert prof.policy().window_ms == 2.0
    assert P.parse_mode("0640") == 0o640 and P.parse_mode("0o600") == 0o600


def test_invalid_utf8_is_a_clean_error_naming_the_line(tmp_path: Path) -> None:
    with pytest.raises(GpuosError, match=r"not valid UTF-8 \(line 2") as err:
        _load(tmp_path, b"[batch]\nmax = \xff\n")
    assert err.value.code == ExitCode.BAD_INPUT


def test_a_fifo_or_a_directory_is_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(GpuosError, match="not a regular file"):
        P.load_profile(str(fifo))
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(GpuosError, match="is a directory, not a profile"):
        P.load_profile(str(tmp_path / "dir.toml"))
    with pytest.raises(GpuosError, match="no such profile") as err:
        P.load_profile(str(tmp_path / "missing.toml"))
    assert err.value.code == ExitCode.NO_INPUT


def test_a_huge_profile_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.toml"
    path.write_bytes(b"#" * (MAX_PROFILE + 1))
    with pytest.raises(GpuosError, match="too large for a profile"):
        P.load_profile(str(path))


@pytest.mark.parametrize("text", ["[batch]\nmax = -3\n", b"[model]\nname = \"\xc3\x28\"\n"])
def test_every_command_exits_64_on_a_bad_profile(tmp_path: Path, text: str | bytes) -> None:
    path = tmp_path / "p.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    for args in (["serve", "--random-model", "1", "--gpu", "off"], ["status"], ["infer"], ["calibrate", "--dry-run"]):
        done = subprocess.run([*BRIDGE, *args, "--profile", str(path)], env=child_env(), capture_output=True, text=True,
                              timeout=60, input="")
        assert done.returncode == 64, (args, done.stderr)
        assert str(path) in done.stderr and "Traceback" not in done.stderr


def test_command_line_overrides_are_bounded_too() -> None:
    for args in (["--max-batch", "-3"], ["--max-batch", "0"], ["--window-us", "-1"], ["--spin-us", "-1"]):
        done = subprocess.run([*BRIDGE, "serve", "--random-model", "1", "--gpu", "off", "--ring", "kinfer-never", *args],
                              env=child_env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (args, done.stderr)
    assert not R.ring_path("kinfer-never").exists()


def test_serve_options_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        S.ServeOptions(max_batch=-3)
    with pytest.raises(ValueError, match="window_us"):
        S.ServeOptions(window_us=-1.0)
    with pytest.raises(ValueError, match="window_us"):
        S.ServeOptions(window_us=math.nan)


# -- the fuzzer ---------------------------------------------------------------------------------

FUZZ_CASES = 3000
_VALUES: list[Any] = [
    -(1 << 63), -3, -1, 0, 1, 2, 7, 4096, 1 << 40, 1 << 63, -0.0, 0.5, -2.5, 1e300, math.inf, -math.inf, math.nan,
    True, False, "", "auto", "x" * 300, "0600", "0660", "0777", "\u00e9", [], [1, 2], [1.5, -1.0], ["a"], [[1]], {},
    {"a": 1}, "\x01",
]


def _toml(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < (1 << 63):
        return "9223372036854775807"  # TOML integers are 64-bit
    return P._toml_value(value)


def _mutant(rng: random.Random) -> bytes:
    """A profile: the shipped one with keys replaced, added or removed, or its bytes damaged."""
    tables = {t: dict(keys) for t, keys in P.DEFAULTS.items()}
    tables["calibration"] = {"batches": [1, 2, 4], "cpu_us": [1.0, 2.0, 3.0], "gpu_us": [5.0, 5.0, 5.0], "crossover": -1}
    for _ in range(rng.randint(1, 4)):
        table = rng.choice([*tables, "bogus"])
        keys = tables.setdefault(table, {})
        roll = rng.random()
        if roll < 0.75 and keys:
            keys[rng.choice(list(keys))] = rng.choice(_VALUES)
        elif roll < 0.85:
            keys[rng.choice(["x", "max", "mode", "file"])] = rng.choice(_VALUES)
        elif keys:
            keys.pop(rng.choice(list(keys)))
    text = "".join(f"[{t}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in keys.items()) for t, keys in tables.items())
    data = bytearray(text.encode())
    if rng.random() < 0.15:  # damaged bytes: truncation, a stray byte, a bad UTF-8 sequence
        at = rng.randrange(len(data))
        choice = rng.randrange(3)
        if choice == 0:
            del data[at:]
        elif choice == 1:
            data[at] = rng.randrange(256)
        else:
            data[at:at] = rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\0"])
    return bytes(data)


def test_fuzzed_profiles_load_cleanly_or_are_refused_cleanly(tmp_path: Path) -> None:
    """Seeded: a failure names its case, which then joins the regression cases above."""
    rng = random.Random(20261125)
    path = tmp_path / "fuzz.toml"
    loaded = refused = 0
    for case in range(FUZZ_CASES):
        data = _mutant(rng)
        path.write_bytes(data)
        try:
            prof = P.load_profile(str(path))
        except GpuosError as e:
            assert e.code == ExitCode.BAD_INPUT, (case, data, e)
            refused += 1
            continue
        # what serve builds from a profile that loaded must build
        try:
            prof.policy()
            ring, model, batch, native = (prof.section(t) for t in ("ring", "model", "batch", "native"))
            R.Geometry(int(ring["lanes"]), int(ring["slots_per_lane"]), max(32, int(model["inputs"])), max(4, int(model["outputs"])))
            P.parse_mode(ring["mode"])
            S.ServeOptions(window_us=float(batch["window_us"]), max_batch=int(batch["max"]), native=str(native["mode"]),
                           native_max=int(native["max_batch"]))
        except Exception as e:  # noqa: BLE001 - any exception here is the bug the fuzzer looks for
            raise AssertionError(f"case {case}: a profile that loads breaks serve: {e!r}\n{data!r}") from e
        loaded += 1
    assert loaded > 100 and refused > 1000  # both sides are exercised
