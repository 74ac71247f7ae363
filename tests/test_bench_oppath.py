"""scripts/bench_oppath.py on the CPU: the Python path's cost per operation over a recorded
trace, here the decode's token (a smoke test of the workload; the figures are the script's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import child_env

ROOT = Path(__file__).resolve().parents[1]


def test_the_decode_token_runs_through_the_executor():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_oppath.py"), "--workload", "decode",
                        "--steps", "3", "--warmup", "1", "--prefetch-batch", "4"],
                       capture_output=True, text=True, env=child_env(), timeout=300, check=True)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["workload"] == "decode" and out["ops_per_step"] == 3057 and out["records"] > 200
    assert out["timed_ops"] == 2 * 3057 and out["us_per_op"] > 0 and out["launches"] == 3 * 3057
