"""Golden fixtures (tests/golden_cases.py): the commands on recorded traces give the recorded
outputs, and on each broken trace they stop cleanly with the recorded status and message.

Regenerate the expected files with scripts/make-golden after a deliberate change of output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from golden_cases import (
    BAD,
    BAD_DIR,
    FOREIGN,
    GOOD,
    REPO,
    bad_expected,
    bad_input,
    call,
    expected_good,
    in_repo,
    normal,
    records,
    run_bad,
)
from helpers import child_env

from gpuos_tools.errors import ExitCode
from gpuos_tools.stream.records import INPUT


@pytest.mark.parametrize("name", sorted(GOOD))
def test_good_output_matches_the_fixture(name: str) -> None:
    with in_repo():
        got = normal(GOOD[name]())
    want = records((REPO / expected_good(name)).read_bytes())
    assert got == want, f"{name}: output differs from {expected_good(name)} (scripts/make-golden rewrites it)"
    for n, rec in enumerate(got, 1):
        assert INPUT.check(rec) is None, (name, n, INPUT.check(rec))


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_stops_every_command_cleanly(name: str) -> None:
    with in_repo():
        got = run_bad(bad_input(name))
    want = json.loads((REPO / bad_expected(name)).read_text())
    assert got == want
    for status, message, _ in got.values():
        assert status in (ExitCode.BAD_INPUT, ExitCode.TRUNCATED), message
        assert "internal error" not in message


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_fixtures_are_the_recorded_traces_with_one_thing_broken(name: str) -> None:
    with in_repo():
        assert BAD[name]() == bad_input(name).read_text()


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_a_json_file_that_is_not_a_stream(name: str) -> None:
    """A JSON file without a final newline is "not a gpuos record", not "truncated after line 0"."""
    with in_repo():
        got = run_bad(FOREIGN[name])
    assert got == json.loads((REPO / BAD_DIR / f"{name}.expected.json").read_text())
    assert all(v[0] == ExitCode.BAD_INPUT and "not a gpuos record" in v[1] for v in got.values())


def test_a_truncated_input_keeps_its_records_when_stdout_is_a_regular_file(tmp_path: Path) -> None:
    """Through a pipe the complete records always came out; into a file (`> out`) none did."""
    path = REPO / bad_input("truncated-mid-record")
    out = tmp_path / "out.ndjson"
    with open(out, "wb") as f:
        done = subprocess.run([sys.executable, str(REPO / "cmd" / "gpu-predict-access"), str(path)], stdout=f,
                              stderr=subprocess.PIPE, env=child_env(), text=False, timeout=60, check=False)
    assert done.returncode == ExitCode.TRUNCATED, done.stderr
    written = records(out.read_bytes())
    piped = subprocess.run([sys.executable, str(REPO / "cmd" / "gpu-predict-access"), str(path)],
                           capture_output=True, env=child_env(), timeout=60, check=False)
    assert piped.returncode == ExitCode.TRUNCATED
    assert written == records(piped.stdout)
    assert [r for r in written if r["type"] != "access"] == records(path.read_bytes().rsplit(b"\n", 1)[0] + b"\n")


RECORDED_CUPY = Path("tests/data/recorded/cupy.ndjson.zst")


def test_a_record_without_its_newline_at_the_end_is_read(tmp_path: Path) -> None:
    """A file saved without a final newline (an editor, `jq -j`) is whole: its last record is read."""
    import zstandard

    with zstandard.open(REPO / RECORDED_CUPY, "rt") as f:
        text = f.read()
    path = tmp_path / "t.ndjson"
    path.write_text(text.rstrip("\n"))
    with in_repo():
        code, out, err = call("gpu-trace", ["stats", str(path)])
    assert code == 0, err
    summary = next(r for r in records(out) if r["type"] == "stats_summary")
    assert summary["records"] == len(text.splitlines())


def test_the_largest_allocation_a_stream_may_give_simulates_in_bounded_time(tmp_path: Path) -> None:
    """An alloc of 10^15 bytes is refused by the reader (256 TiB is the most a size may say);
    one of 256 TiB is cut into at most 65,536 chunks, not 134 million of 2 MiB."""
    with in_repo():
        code, acc, err = call("gpu-predict-access", [str(RECORDED_CUPY)])
    assert code == 0, err
    recs = records(acc)
    first = next(r for r in recs if r["type"] == "alloc")
    first["size"] = 1 << 48
    path = tmp_path / "big.acc"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    start = time.perf_counter()
    code, out, err = call("gpu-prefetch-sched", ["--simulate", "--budget", "50%", "--chunk", "2MiB", str(path)])
    assert code == 0, err
    assert time.perf_counter() - start < 20
    summaries = [r for r in records(out) if r["type"] == "sched_summary"]
    assert summaries and all(s["policy"] for s in summaries)


def test_a_stream_without_a_header_is_read_as_gpuos_1(tmp_path: Path) -> None:
    """gpuos-stream(7): a stream without a header is accepted; a filter then writes its own."""
    import zstandard

    with zstandard.open(REPO / RECORDED_CUPY, "rt") as f:
        lines = f.read().splitlines()[1:]
    path = tmp_path / "headless.ndjson"
    path.write_text("\n".join(lines) + "\n")
    code, out, err = call("gpu-predict-access", [str(path)])
    assert code == 0, err
    recs = records(out)
    assert recs[0]["type"] == "header" and recs[0]["tool"] == "gpu-predict-access"
    assert [r for r in recs[1:] if r["type"] != "access"] == [json.loads(line) for line in lines]
