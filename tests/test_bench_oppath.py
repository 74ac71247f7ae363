"""scripts/bench_oppath.py on the CPU: the Python path's cost per operation over a recorded
trace, here the decode's token (a smoke test of the workload; the figures are the script's)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import child_env

ROOT = Path(__file__).resolve().parents[1]


def test_the_decode_token_runs_through_the_executor():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_oppath.py"), "--workload", "decode",
                        "--steps", "3", "--warmup", "1", "--prefetch-batch", "4"],
                       capture_output=True, text=True, env=child_env(), timeout=300, check=True)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["workload"] == "decode" and out["ops_per_step"] == 3057 and out["records"] > 200
    assert out["timed_ops"] == 2 * 3057 and out["us_per_op"] > 0 and out["launches"] == 3 * 3057


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_with_the_native_core_in_front_most_operations_go_by_and_are_replayed():
    """--core: the decode's steady token goes by the core's fast path but for the decisions that
    must enter Python; what went by is replayed into the same books (the same launches counted)."""
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_oppath.py"), "--workload", "decode",
                        "--steps", "4", "--warmup", "1", "--core"],
                       capture_output=True, text=True, env=child_env(), timeout=300, check=True)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["core"] and out["fast_on"] and out["launches"] == 4 * 3057
    assert out["fast_operations"] > 3057  # more than a token's worth went by without an upcall
    assert out["upcalls"] < out["launches"] - out["fast_operations"] + 3057  # the rest, and the memo's misses
    assert out["replay_us_per_op"] > 0 and out["python_us_per_op"] > 0
