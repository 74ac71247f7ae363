"""scripts/bench_online.py without a GPU: the `run` options each configuration's name asks for
(run_job stubbed), and the --plans values it takes."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("bench_online", ROOT / "scripts" / "bench_online.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name, want", [
    ("66%-belady", ["--plan", "count"]),
    ("66%-belady-time", ["--plan", "time"]),
    ("66%-belady-b4", ["--plan", "count", "--prefetch-batch", "4"]),
])
def test_a_configs_name_gives_its_run_options(name, want, monkeypatch):
    mod = load()
    seen = []

    def fake_run(job_args, opts, timeout, extra_env=None, job="stencil"):
        seen.append(opts)
        return {"ok": False, "rc": 1, "stderr": "stub"}

    monkeypatch.setattr(mod, "run_job", fake_run)
    args = argparse.Namespace(timeout=1, job="stencil", plan_bw="")
    mod.run_ours(args, ["job.py"], {"digests": []}, 1024, name, "66%", "belady", 2)
    opts = seen[0]
    assert opts[:6] == ["--budget", "66%", "--policy", "belady", "--lookahead", "2"] and opts[6:] == want


def test_plans_take_batches_and_refuse_the_rest(monkeypatch):
    mod = load()
    monkeypatch.setattr(sys, "argv", ["b", "--plans", "count,b0"])
    with pytest.raises(SystemExit) as exc:
        mod.main()
    assert exc.value.code == 2
