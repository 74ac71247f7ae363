"""The residency engine's digest check on a real GPU (pytest -m gpu; docs/residency-engine.md,
"Digests"): the kernel computes digest_reference's value at any address and size; under
`gpu-prefetch-sched run` at 150% the stencil ends bit-identical with write-backs skipped; a
read-mostly job skips most of them; a write the predictor cannot see is still saved, found as a
mismatch, and its kernel is conservative from then on ("Mismatches"): with the check turned off
after the first mismatch, the rule alone keeps its writes (and without the rule they are lost).

With GPUOS_TEST_FIGURES=PATH the mismatch test's runs (summaries, the job's results) are
appended there as JSON lines (BENCHMARKS.md's figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROGS = Path(__file__).resolve().parent / "progs"
STENCIL_JOB = ROOT / "workloads" / "stencil_job.py"
HIDDEN_WRITE_JOB = PROGS / "hidden_write_job.py"
STENCIL = ["--arrays", "8", "--mib", "32", "--periods", "8", "--work", "32"]


def env(**extra: str) -> dict:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for k in ("GPUOS_AGENT_OWN", "GPUOS_ENGINE_NO_DIGEST", "GPUOS_ENGINE_NO_CONSERVE", "GPUOS_ENGINE_DIGEST_OFF_AFTER"):
        e.pop(k, None)
    e.update(extra)
    return e


def plain(tmp: Path, prog: Path, args: list[str]) -> dict:
    out = tmp / "plain.json"
    p = subprocess.run([sys.executable, str(prog), *args, "--out", str(out)], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out.read_text())


def sched(tmp: Path, prog: Path, args: list[str], budget: str, **extra: str) -> tuple[dict, dict, str]:
    out = tmp / "job.json"
    cmd = [sys.executable, "-m", "gpuos_tools.commands.prefetch_sched", "run", "--budget", budget, "--",
           sys.executable, str(prog), *args, "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env(**extra), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-6000:]
    recs = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    assert recs[-1]["type"] == "sched_summary", recs
    return json.loads(out.read_text()), recs[-1], p.stderr


def test_the_kernel_computes_the_reference_digest_at_any_address_and_size():
    p = subprocess.run([sys.executable, str(PROGS / "digest_prog.py")], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    cases = res["cases"]
    for name, c in cases.items():
        assert c["digest"] == c["again"] == c["reference"], (name, c)
    big = cases[f"rand{64 << 20}"]["digest"]
    assert len({big, cases["swapped"]["digest"], cases["shifted"]["digest"], cases["flipped"]["digest"]}) == 4
    assert cases["zeros1M"]["digest"] != cases["zeros1M+1"]["digest"]
    print("digest kernel GB/s:", res["gbps"])
    assert res["gbps"][str(1 << 30)] > 200, res["gbps"]  # far above a PCIe copy: it costs little


def test_stencil_at_150_percent_skips_write_backs_and_stays_bit_identical(tmp_path):
    ref = plain(tmp_path, STENCIL_JOB, STENCIL)
    job, s, err = sched(tmp_path, STENCIL_JOB, STENCIL, "66%")
    assert job["digests"] == ref["digests"]
    assert s["digest"] == "on" and "no GPU digests" not in err, (s["digest"], err[-2000:])
    eng = s["engine"]
    assert s["digest_skips"] > 0 and s["bytes_not_written_back"] >= s["digest_skips"] * ref["array_bytes"], s
    assert eng["digest_changed"] > 0 and eng.get("evict_errors", 0) == 0, eng
    # the same run without digests saves more
    job2, s2, _ = sched(tmp_path, STENCIL_JOB, STENCIL, "66%", GPUOS_ENGINE_NO_DIGEST="1")
    assert job2["digests"] == ref["digests"]
    assert s2["digest"].startswith("off") and s2["digests"] == 0 and s2["digest_skips"] == 0, s2
    print("stencil 66%: evictions", s["evictions"], "saves", s["evict_saves"], "digest skips", s["digest_skips"],
          "| without digests: evictions", s2["evictions"], "saves", s2["evict_saves"])


def test_a_read_mostly_job_skips_most_write_backs(tmp_path):
    args = [*STENCIL, "--coeffs", "8"]
    ref = plain(tmp_path, STENCIL_JOB, args)
    job, s, _ = sched(tmp_path, STENCIL_JOB, args, "66%")
    assert job["digests"] == ref["digests"]
    assert s["unknown"] == 0 and s["evictions"] > 0, s
    # the coefficients are only read: most evictions are theirs, and need no save
    assert s["digest_skips"] >= 8 and s["digest_skips"] * 3 > s["evictions"], s
    print("read-mostly 66%: evictions", s["evictions"], "saves", s["evict_saves"], "digest skips", s["digest_skips"])


def test_a_write_the_predictor_cannot_see_is_still_saved(tmp_path):
    args = ["--arrays", "8", "--mib", "32", "--periods", "4"]
    job, s, err = sched(tmp_path, HIDDEN_WRITE_JOB, args, "50%")
    assert job["ok"], job
    assert s["evictions"] >= 8, s  # evicted
    eng = s["engine"]
    assert eng["digest_changed"] > 0 and eng.get("evict_errors", 0) == 0, eng
    # found as a mismatch: bump (predicted as read only) is unknown from then on
    assert s["mismatches"] >= 1 and len(s["conservative"]) == 1 and "bump" in s["conservative"][0], s
    # (the engine sees a launch only while something is pending, clean or digested: at most as many)
    assert s["unknown"] >= eng["conservative_launches"] > 0 and "conservative from now on" in err, s
    # without the digest the engine trusts the prediction: the writes are lost (which is why
    # the check matters; if this ends right, the job no longer hides its writes)
    job2, s2, _ = sched(tmp_path, HIDDEN_WRITE_JOB, args, "50%", GPUOS_ENGINE_NO_DIGEST="1")
    assert not job2["ok"] and s2["unknown"] == 0 and s2["mismatches"] == 0, (job2, s2)


def _figures(name: str, job: dict, s: dict) -> None:
    path = os.environ.get("GPUOS_TEST_FIGURES")
    if not path:
        return
    keep = ("policy", "budget", "footprint", "launches", "unknown", "bytes_in", "bytes_out", "loads", "evictions",
            "evict_saves", "digest", "digest_skips", "mismatches", "conservative", "over_budget", "wall_s")
    eng = s["engine"]
    rec = {"run": name, "job": job, **{k: s.get(k) for k in keep},
           "engine": {k: eng.get(k) for k in ("digest_changed", "digest_backoff_saves", "conservative_launches",
                                              "unknown_requires", "mismatch")}}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def test_after_a_mismatch_the_kernel_is_conservative_and_its_writes_are_kept_with_the_check_off(tmp_path):
    """bump<float> hides its writes, peek only reads its coefficients (and writes out). The
    digest check is turned off right after the first mismatch (GPUOS_ENGINE_DIGEST_OFF_AFTER=1):
    from then on only the rule keeps bump's writes -- its launches require every record and
    count as writing everything resident, and peek's launches keep evicting. The same run
    without the rule (GPUOS_ENGINE_NO_CONSERVE=1) must lose them, else the test proves nothing."""
    args = ["--arrays", "8", "--mib", "32", "--periods", "6", "--coeffs", "4"]
    ref = plain(tmp_path, HIDDEN_WRITE_JOB, args)
    assert ref["ok"], ref
    runs = {}
    for name, extra in (("rule, check on", {}),
                        ("rule, check off after the 1st mismatch", {"GPUOS_ENGINE_DIGEST_OFF_AFTER": "1"}),
                        ("no rule, check off after the 1st mismatch",
                         {"GPUOS_ENGINE_DIGEST_OFF_AFTER": "1", "GPUOS_ENGINE_NO_CONSERVE": "1"})):
        job, s, err = sched(tmp_path, HIDDEN_WRITE_JOB, args, "50%", **extra)
        _figures(name, job, s)
        runs[name] = (job, s, err)
        assert s["engine"].get("evict_errors", 0) == 0 and "error" not in s, s
        assert s["mismatches"] >= 1, (name, s)
        first = s["engine"]["mismatch"][0]
        assert len(first["kernels"]) == 1 and "bump" in first["kernels"][0], first  # not peek
        assert first["found"] == "predicted to read it", first
        print(name, "| ok", job["ok"], "evictions", s["evictions"], "saves", s["evict_saves"], "mismatch at eviction",
              first["evictions"], "conservative launches", s["engine"]["conservative_launches"], "wall", s["wall_s"])
    for name in ("rule, check on", "rule, check off after the 1st mismatch"):
        job, s, _ = runs[name]
        assert job == ref, (name, job, ref)  # bit-identical: every array k holds k + periods, out right
        assert len(s["conservative"]) == 1 and "bump" in s["conservative"][0], s
        assert s["unknown"] >= s["engine"]["conservative_launches"] > 0, s
        # after the detection the peeks kept evicting: saves that no digest decided
        assert s["evictions"] - s["engine"]["mismatch"][0]["evictions"] >= 8, s
    s = runs["rule, check off after the 1st mismatch"][1]
    assert s["digest"].startswith("off (GPUOS_ENGINE_DIGEST_OFF_AFTER=1"), s["digest"]
    job, s, _ = runs["no rule, check off after the 1st mismatch"]
    assert not job["ok"] and s["conservative"] == [] and s["unknown"] == 0, (job, s)
