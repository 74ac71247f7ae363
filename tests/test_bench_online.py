"""scripts/bench_online.py without a GPU: the `run` options each configuration's name asks for
(run_job stubbed), and the --plans values it takes."""

from __future__ import annotations

import argparse

import pytest
from helpers import load_script, usage_error


def load():
    return load_script("bench_online")


@pytest.mark.parametrize("name, want", [
    ("66%-belady", ["--plan", "count"]),
    ("66%-belady-time", ["--plan", "time"]),
    ("66%-belady-b4", ["--plan", "count", "--prefetch-batch", "4"]),
    ("66%-belady-fixed", ["--plan", "fixed"]),
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


def test_plans_take_batches_and_refuse_the_rest():
    assert usage_error(load().main, ["--plans", "count,b0"]) == 2
