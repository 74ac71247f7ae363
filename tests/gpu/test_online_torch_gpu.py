"""`gpu-prefetch-sched run` on PyTorch programs on a real GPU (pytest -m gpu): a transformers
Llama's greedy decode with a KV cache (random weights) and a CNN's training steps, each at a
budget of 66% of its owned memory (150% oversubscription), produce the same output as the same
program run alone with torch's own allocator -- the same token ids, the same final parameters
bit for bit -- while records are evicted and loaded again (workloads/torch_decode_job.py,
torch_cnn_job.py; gpuos_tools/sched/executor.py); so does the CNN with the agent on CUPTI callbacks
(GPUOS_AGENT_MECHANISM=cupti) instead of the default, driver-API interception."""

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
WORKLOADS = ROOT / "workloads"
JOBS = {
    "llm": (WORKLOADS / "torch_decode_job.py",
            ["--hidden", "1024", "--layers", "6", "--mlp", "2816", "--heads", "8", "--vocab", "8000",
             "--prompt", "16", "--tokens", "8"]),
    "cnn": (WORKLOADS / "torch_cnn_job.py",
            ["--width", "16", "--blocks", "1", "--batch", "16", "--image", "32", "--batches", "2", "--steps", "4"]),
}


def env(**extra: str) -> dict:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **extra)
    e.pop("GPUOS_AGENT_OWN", None)
    return e


def plain_run(name: str, tmp: Path, args: list[str] | None = None) -> dict:
    job, default = JOBS[name]
    args = default if args is None else args
    out = tmp / "plain.json"
    p = subprocess.run([sys.executable, str(job), *args, "--out", str(out)], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out.read_text())


def sched_run(name: str, tmp: Path, *opts: str, mechanism: str | None = None, fast: bool | None = None,
              args: list[str] | None = None, variables: dict[str, str] | None = None) -> tuple[dict, dict]:
    """The job under `gpu-prefetch-sched run OPTS`; ``mechanism``: GPUOS_AGENT_MECHANISM for it
    (None: as this process's environment says), checked against the header; ``fast``: with
    GPUOS_SCHED_FAST=1 or 0 (None: unset, the default, whatever this process's environment says);
    ``args``: the job's arguments instead of its defaults; ``variables``: more of the
    environment (the engine's switches)."""
    job, default = JOBS[name]
    args = default if args is None else args
    out = tmp / "job.json"
    cmd = [sys.executable, "-m", "gpuos_tools.commands.prefetch_sched", "run", *opts, "--",
           sys.executable, str(job), *args, "--out", str(out)]
    extra = dict(variables or {})
    if mechanism is not None:
        extra["GPUOS_AGENT_MECHANISM"] = mechanism
    if fast is not None:
        extra["GPUOS_SCHED_FAST"] = "1" if fast else "0"
    environ = env(**extra)
    if fast is None:
        environ.pop("GPUOS_SCHED_FAST", None)
    p = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-6000:]
    recs = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    assert recs[0]["type"] == "header" and recs[-1]["type"] == "sched_summary", recs
    assert mechanism is None or recs[0]["mechanism"] == mechanism, recs[0]
    s = recs[-1]
    k = s["kernels"]
    print(f"{name}: {s['launches']} operations, {k['names']} kernels, unknown {k['unknown']} "
          f"({k['unknown_share']:.2%}), {s['evictions']} evictions, {s['bytes_in']} B in, "
          f"{s['bytes_out']} B out, over budget {s['over_budget']}", file=sys.stderr)
    return json.loads(out.read_text()), s


@pytest.mark.parametrize("name", ["llm", "cnn"])
def test_torch_job_over_budget_is_bit_identical_to_the_job_alone(tmp_path, name):
    """Every operation through the executor (GPUOS_SCHED_FAST=0; the fast path, the default, is
    the test below): the job over budget ends as it does alone."""
    plain = plain_run(name, tmp_path)
    job, s = sched_run(name, tmp_path, "--budget", "66%", fast=False)
    assert job["digest"] == plain["digest"], (job, plain)
    if name == "llm":
        assert job["tokens"] == plain["tokens"]
    assert s["footprint"] > 0 and s["budget"] < s["footprint"], s
    assert s["evictions"] > 0 and s["bytes_in"] > 0 and s["bytes_out"] > 0, s
    assert "error" not in s and s["executor"]["mover_errors"] == 0, s
    assert s["engine"].get("evict_errors", 0) == 0, s["engine"]
    assert s["kernels"]["operations"] == s["launches"], s["kernels"]
    assert not s["fast"]["on"] and s["fast"].get("operations", 0) == 0, s["fast"]
    loop = job["sched_loop"]  # the executor's counts inside the job's timed loop
    assert loop is not None and loop["launches"] > 0, job
    assert plain["sched_loop"] is None


def test_the_cnn_over_budget_on_cupti_is_bit_identical_to_the_job_alone(tmp_path):
    """The same, with the agent fed by CUPTI callbacks (GPUOS_AGENT_MECHANISM=cupti) instead of
    the default driver-API interposer: the policy sees every operation, records are evicted and
    loaded again, and the parameters end as the job's alone."""
    plain = plain_run("cnn", tmp_path)
    trace = tmp_path / "trace.ndjson"
    job, s = sched_run("cnn", tmp_path, "--budget", "66%", "-o", str(trace), mechanism="cupti")
    with open_input(str(trace)) as r:
        header = next(iter(r))
    assert header["mechanism"] == "cupti" and header["cupti"], header
    assert job["digest"] == plain["digest"], (job, plain)
    assert s["footprint"] > 0 and s["budget"] < s["footprint"], s
    assert s["evictions"] > 0 and s["bytes_in"] > 0 and s["bytes_out"] > 0, s
    assert "error" not in s and s["executor"]["mover_errors"] == 0, s
    assert s["engine"].get("evict_errors", 0) == 0, s["engine"]
    assert s["kernels"]["operations"] == s["launches"], s["kernels"]


def test_the_cnn_learns_its_step_period_and_belady_moves_less_than_lru(tmp_path):
    """The owned torch cache hands the same blocks to the same tensors every step (lowest
    address first), so the CNN's launch keys repeat and the period of its training step is
    learned (online.Period, by the keys' windows where single keys recur too often); with it,
    Belady moves fewer bytes than LRU at the same budget. Before: periods of 1 only, Belady as
    LRU (BENCHMARKS.md, the PyTorch section of 2026-11-24)."""
    job, args = JOBS["cnn"]
    args = [*args[:-2], "--steps", "10"]
    runs = {}
    for policy in ("belady", "lru"):
        out = tmp_path / f"{policy}.json"
        cmd = [sys.executable, "-m", "gpuos_tools.commands.prefetch_sched", "run", "--budget", "66%",
               "--policy", policy, "--", sys.executable, str(job), *args, "--out", str(out)]
        p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-6000:]
        s = json.loads(p.stdout.splitlines()[-1])
        runs[policy] = (json.loads(out.read_text()), s)
        print(f"cnn {policy}: periods {s['periods']}, breaks {s['policy_stats']['period_breaks']}, "
              f"keys {s['policy_stats'].get('keys')}, predicted {s['predicted']} of {s['launches']}, "
              f"{s['bytes_in']} B in, {s['evictions']} evictions", file=sys.stderr)
    (bjob, b), (ljob, lru) = runs["belady"], runs["lru"]
    assert bjob["digest"] == ljob["digest"]
    steps = b["launches"] // 12  # 2 warm-up + 10 timed steps: about one step's operations
    assert max(b["periods"]) >= steps // 2, b["periods"]  # a step (or two: the data cycles), not a local repeat
    assert b["predicted"] >= b["launches"] // 2, (b["predicted"], b["launches"])
    assert b["bytes_in"] < lru["bytes_in"], (b["bytes_in"], lru["bytes_in"])


@pytest.mark.parametrize("name", ["cnn", "llm"])
def test_torch_job_over_budget_on_the_fast_path_is_bit_identical_to_the_job_alone(tmp_path, name):
    """The fast path, the default (no GPUOS_SCHED_FAST): the native core lets the operations go by
    whose records are resident and settled while the policy's plan has no action, and an operation on a record being evicted
    or loaded still goes through the executor. The job over budget ends as it does alone, records
    are evicted and loaded again, and the summary says how many operations went by without Python."""
    job_path, args = JOBS[name]
    if name == "cnn":  # steps enough for the period to be learned and then used
        args = [*args[:-2], "--steps", "10"]
    plain = plain_run(name, tmp_path, args)
    job, s = sched_run(name, tmp_path, "--budget", "66%", args=args)
    assert job["digest"] == plain["digest"], (job, plain)
    if name == "llm":
        assert job["tokens"] == plain["tokens"]
    assert s["footprint"] > 0 and s["budget"] < s["footprint"], s
    assert s["evictions"] > 0 and s["loads"] > 0 and s["bytes_in"] > 0 and s["bytes_out"] > 0, s
    assert "error" not in s and s["executor"]["mover_errors"] == 0, s
    assert s["engine"].get("evict_errors", 0) == 0, s["engine"]
    fast = s["fast"]
    assert fast["on"] and "off" not in fast, fast  # the core saw every owned record mapped
    assert fast["replayed"] <= fast["operations"] and s["kernels"]["operations"] == s["launches"], (fast, s["kernels"])
    print(f"{name} fast path: {fast['operations']} of {s['launches']} operations went by without Python "
          f"({fast['operations'] / max(1, s['launches']):.1%}), {fast['late']} replayed late, replay "
          f"{fast['replay_s']} s, marks and allowances {fast.get('after_s')} s; {s['evictions']} evictions, {s['loads']} loads, periods {s['periods']}",
          file=sys.stderr)


@pytest.mark.parametrize("variant", ["", "slack"])
@pytest.mark.parametrize("name", ["cnn", "llm"])
def test_torch_job_under_a_fixed_plan_is_bit_identical_to_the_job_alone(tmp_path, name, variant):
    """`run --plan fixed`: once the loop is learned, one plan made for it decides only where it
    drops or loads, the operations between go by on the fast path, and the job ends as it does
    alone, with the plan in force for most of the loop. ``slack``: the plan made at 10 % of the
    budget less, so that its loads go ahead while evictions are in flight."""
    job_path, args = JOBS[name]
    if name == "cnn":
        args = [*args[:-2], "--steps", "10"]
    else:  # tokens enough for the plan to be made (one token learns the period, one more holds it)
        args = [*args[:-2], "--tokens", "14"]
    plain = plain_run(name, tmp_path, args)
    opts = ["--slack", "10%"] if variant else []
    job, s = sched_run(name, tmp_path, "--budget", "66%", "--plan", "fixed", *opts, args=args)
    assert job["digest"] == plain["digest"], (job, plain)
    if name == "llm":
        assert job["tokens"] == plain["tokens"]
    assert s["plan"] == "fixed" and s["evictions"] > 0 and s["loads"] > 0, s
    assert "error" not in s and s["executor"]["mover_errors"] == 0, s
    assert s["engine"].get("evict_errors", 0) == 0, s["engine"]
    st = s["policy_stats"]
    assert st["fixed_plans"] >= 1 and st["fixed"]["moves"] > 0, st
    assert st["fixed_launches"] > s["launches"] // 3, (st["fixed_launches"], s["launches"])
    if variant:
        assert st["fixed"]["slack"] == int(st["fixed"]["budget"] * 0.1), st["fixed"]
    print(f"{name} fixed plan: {st['fixed']}, {st['fixed_launches']} of {s['launches']} operations under it, "
          f"{st['fixed_ends']} ended ({st['fixed_end']!r}); fast path {s['fast']}", file=sys.stderr)


def test_freed_torch_memory_is_evicted_without_a_save_and_mapped_back_without_a_copy(tmp_path):
    """A training step frees its activations and gradients after their last use: a record whose
    blocks are all freed goes without a save and comes back without a copy, and the job ends
    as it does alone -- and as it does when such records are saved and loaded like the others
    (GPUOS_ENGINE_KEEP_DEAD=1), which moves more bytes for the same decisions."""
    args = ["--width", "32", "--blocks", "1", "--batch", "32", "--image", "64", "--batches", "2", "--steps", "6"]
    plain = plain_run("cnn", tmp_path, args)
    job, s = sched_run("cnn", tmp_path, "--budget", "50%", args=args)
    kept_job, kept = sched_run("cnn", tmp_path, "--budget", "50%", args=args,
                               variables={"GPUOS_ENGINE_KEEP_DEAD": "1"})
    assert job["digest"] == plain["digest"] == kept_job["digest"], (job, kept_job, plain)
    for run in (s, kept):
        assert "error" not in run and run["engine"].get("evict_errors", 0) == 0, run
    assert s["dead_evictions"] > 0 and s["dead_loads"] > 0 and s["dead_bytes"] > 0, s
    assert kept["dead_evictions"] == 0 and kept["dead_loads"] == 0, kept
    assert s["bytes_out"] < kept["bytes_out"] and s["bytes_in"] < kept["bytes_in"], (s, kept)
    print(f"dead: {s['dead_evictions']} of {s['evictions']} evictions, {s['dead_bytes']} B, "
          f"{s['dead_loads']} maps; in/out {s['bytes_in']}/{s['bytes_out']} B against "
          f"{kept['bytes_in']}/{kept['bytes_out']} B kept", file=sys.stderr)
