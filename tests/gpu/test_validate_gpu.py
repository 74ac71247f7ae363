"""`gpu-trace run --validate --validate-in process` (replays in the program's own context) on
kernels whose true accesses are known (pytest -m gpu); the validator process, the default, is
tests/gpu/test_validator_gpu.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuos_tools.stream import open_input

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROGS = Path(__file__).resolve().parent / "progs"


def covers(ranges, start, size):
    """True when [start, start + size) lies inside the union of [addr, size] ranges."""
    pos = start
    for a, n in sorted(ranges):
        if a <= pos < a + n:
            pos = a + n
    return pos >= start + size


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validate")
    out = tmp / "validate.ndjson"
    report = tmp / "report.json"
    env = dict(os.environ, GPUOS_TEST_REPORT=str(report))
    proc = subprocess.run(
        [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--validate", "--validate-in", "process",
         "--no-images", "-o", str(out), "--", sys.executable, str(PROGS / "validate_prog.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    keep = os.environ.get("GPUOS_KEEP_TRACES")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / "validate.ndjson").write_bytes(out.read_bytes())
    with open_input(str(out)) as reader:
        records = list(reader)
    errors = [r for r in records if r["type"] == "error"]
    assert not errors, errors
    by_kernel = {}
    for r in records:
        if r["type"] == "validation":
            by_kernel.setdefault(r["kernel"], []).append(r)
    return by_kernel, json.loads(report.read_text())


def one(by_kernel, name):
    recs = [v for k, vs in by_kernel.items() if name in k for v in vs]
    assert len(recs) == 1, (name, list(by_kernel))
    assert recs[0]["checked"], recs[0]
    return recs[0]


def test_correct_prediction_validates_with_exact_extents(validated):
    by_kernel, rep = validated
    v = one(by_kernel, "copy")
    x, y = rep["bufs"]["x"], rep["bufs"]["y"]
    nbytes = rep["n"] * 4
    assert v["missed_writes"] == [] and v["reads"] == "ok", v
    # what changed is y's first n floats, rounded out to whole 128-byte chunks
    assert covers(v["written"], y[0], nbytes)
    assert sum(n for _, n in v["written"]) < nbytes + 128
    ext = {e["param"]: e for e in v["extents"]}
    assert nbytes <= ext[0]["read"] < nbytes + 128, ext[0]  # x: read exactly n floats
    assert nbytes <= ext[1]["written"] < nbytes + 128, ext[1]
    assert ext[0]["limit"] >= x[1]  # to the end of x's allocation (pool-rounded)


def test_write_through_a_pointer_stored_on_the_gpu_is_a_missed_write(validated):
    by_kernel, rep = validated
    v = one(by_kernel, "hidden_write")
    hidden, table = rep["bufs"]["hidden"], rep["bufs"]["table"]
    assert covers(v["missed_writes"], hidden[0], 4 * rep["n"] - 128), v
    # the pointer stored in the table is found, and was not poisoned (the trials did not fault)
    assert [table[0], hidden[0]] in v["stored_pointers"], v
    assert "trial stopped" not in v.get("why", ""), v


def test_read_through_a_pointer_stored_on_the_gpu_is_a_missed_read(validated):
    by_kernel, _ = validated
    v = one(by_kernel, "hidden_read")
    assert v["reads"] == "missed", v
    assert v["missed_writes"] == []


def test_pointer_array_copied_from_the_host_is_followed(validated):
    by_kernel, rep = validated
    v = one(by_kernel, "follow_write")
    followed = rep["bufs"]["followed"]
    assert v["missed_writes"] == [] and v["reads"] == "ok", v
    assert covers(v["written"], followed[0], 4 * rep["n"] - 128)
    assert covers(v["predicted"]["writes"], followed[0], 4 * rep["n"])


def test_nondeterministic_kernel_is_reported_so(validated):
    by_kernel, _ = validated
    v = one(by_kernel, "stamp")
    assert v["reads"] == "nondeterministic", v


@pytest.mark.parametrize("backend", ["native", "python"])
def test_small_host_copies_carry_their_bytes_and_pointer_arrays_are_followed(tmp_path, backend):
    from gpuos_tools.access.predict import Predictor

    out = tmp_path / "t.ndjson"
    report = tmp_path / "report.json"
    env = dict(os.environ, GPUOS_TEST_REPORT=str(report))
    proc = subprocess.run(
        [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--backend", backend, "--no-images",
         "-o", str(out), "--", sys.executable, str(PROGS / "validate_prog.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(report.read_text())
    followed, host_table = rep["bufs"]["followed"], rep["bufs"]["host_table"]
    with open_input(str(out)) as reader:
        records = list(reader)
    copies = [r for r in records if r["type"] == "memcpy" and r["dst"] == host_table[0]]
    assert copies and copies[0]["data"] == followed[0].to_bytes(8, "little").hex(), copies
    pred = Predictor("alloc")
    for rec in records:
        acc = pred.feed(rec)
        if rec["type"] == "launch" and rec["kernel"] == "follow_write":
            assert any(e["how"] == "stored" for e in acc["writes"]), acc
            assert not acc["unknown"]
            break
    else:
        pytest.fail("no follow_write launch")
