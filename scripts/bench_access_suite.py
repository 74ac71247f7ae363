#!/usr/bin/env python3
"""Accuracy of gpu-predict-access, validated on the GPU: the suite of programs in workloads/suite.

Runs each program of workloads/suite under `gpu-trace run --validate` at two sizes
(GPUOS_SUITE_SCALE), learns size templates from the first run, and scores the second run's
predictions — range granularity with those templates, range without, extent, alloc — against
what the GPU showed (gpuos_tools/access/score.py). Prints a markdown table for BENCHMARKS.md;
--json writes the raw figures. Needs a GPU, CuPy, PyTorch and transformers (--score-only does
not: it scores the traces already in --keep, named PREFIX + NAME.sSCALE.ndjson.zst, e.g. the
checked-in ones with `--keep tests/data/recorded --prefix suite-`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gpuos_tools.access.report import compute_report
from gpuos_tools.access.templates import Templates, learn
from gpuos_tools.stream import open_input

ROOT = Path(__file__).resolve().parents[1]

SUITE = ROOT / "workloads" / "suite"
PROGRAMS = ("cupy_suite", "torch_cnn", "torch_optim", "transformer_block")


def run_one(name: str, outdir: Path, samples: int, scale: int, prefix: str = "", where: str = "validator") -> dict:
    """Trace one suite program with --validate at one size; the run's facts (not yet scored)."""
    trace = outdir / f"{prefix}{name}.s{scale}.ndjson.zst"
    env = dict(os.environ, GPUOS_SUITE_SCALE=str(scale))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--validate", "--validate-samples",
         str(samples), "--validate-in", where, "--no-images", "-o", str(trace), "--", sys.executable,
         str(SUITE / f"{name}.py")],
        cwd=ROOT, capture_output=True, text=True, env=env,
    )
    result = {"program": name, "scale": scale, "validate_in": where, "exit": proc.returncode,
              "wall_s": round(time.perf_counter() - t0, 2)}
    if proc.returncode != 0:
        result["stderr"] = proc.stderr[-3000:]
    return result


def load(path: Path) -> list[dict]:
    with open_input(str(path)) as reader:
        return list(reader)


def score_one(name: str, outdir: Path, learn_scale: int, score_scale: int, prefix: str = "") -> dict:
    """Templates learned at one size, scored on the run at another (range+templates, range,
    extent, alloc)."""
    records = load(outdir / f"{prefix}{name}.s{score_scale}.ndjson.zst")
    result: dict = {"program": name, "scored_on_scale": score_scale}
    result["errors"] = [r["message"] for r in records if r["type"] == "error"][:10]
    vals = [r for r in records if r["type"] == "validation"]
    result["validations"] = len(vals)
    result["checked"] = sum(1 for v in vals if v["checked"])
    result["skipped_why"] = sorted({v.get("why", "") for v in vals if not v["checked"]})[:5]
    result["validate_ms"] = round(sum(v.get("ms", 0) for v in vals), 1)
    result["stored_pointer_launches"] = sum(1 for v in vals if v.get("stored_pointers"))
    learn_path = outdir / f"{prefix}{name}.s{learn_scale}.ndjson.zst"
    templates = None
    if learn_path.exists() and learn_scale != score_scale:
        learned = learn(load(learn_path))
        templates = Templates(t.record() for t in learned)
        result["templates"] = len(learned)
        result["templates_learned_on_scale"] = learn_scale
    for label, gran, tpl in (("templates", "range", templates), ("range", "range", None), ("extent", "extent", None),
                             ("alloc", "alloc", None)):
        if label == "templates" and tpl is None:
            continue
        rows = compute_report(iter(records), gran, tpl)
        agg = {k: 0 for k in ("launches", "unknown", "validated", "missed_write_launches", "missed_write_bytes",
                              "extra_write_bytes", "written_bytes", "missed_read_launches", "missed_read_bytes",
                              "extra_read_bytes", "extra_read_written_bytes", "read_bytes", "read_measured")}
        unjudged: dict[str, int] = {}
        misses = []
        for r in rows:
            agg["launches"] += r.launches
            agg["unknown"] += r.unknown
            for k in list(agg)[2:]:
                agg[k] += getattr(r, k)
            for k, n in r.reads_unchecked.items():
                unjudged[k] = unjudged.get(k, 0) + n
            if r.missed_write_launches or r.missed_read_launches:
                misses.append({"kernel": r.name[:160], "missed_write_launches": r.missed_write_launches,
                               "missed_read_launches": r.missed_read_launches,
                               "missed_write_bytes": r.missed_write_bytes, "missed_read_bytes": r.missed_read_bytes})
        agg["reads_unjudged"] = unjudged
        agg["misses"] = misses
        result[label] = agg
    return result


def pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


def table(results: list[dict]) -> str:
    lines = [
        "| program | launches | validated | unknown | missed writes | missed reads | reads not judged "
        "| extra write bytes: templates / range / extent / alloc "
        "| extra read bytes: templates / range / extent / alloc |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "range" not in r:
            lines.append(f"| {r['program']} | failed | | | | | | | |")
            continue
        g, e, a = r["range"], r["extent"], r["alloc"]
        t = r.get("templates", g)
        unj = ", ".join(f"{k} {n}" for k, n in g["reads_unjudged"].items()) or "0"
        miss_w = " / ".join(str(x["missed_write_launches"]) for x in (t, g, e, a))
        miss_r = " / ".join(str(x["missed_read_launches"]) for x in (t, g, e, a))
        ew = " / ".join(pct(x["extra_write_bytes"], x["written_bytes"]) for x in (t, g, e, a))
        er = " / ".join(pct(x["extra_read_bytes"], x["read_bytes"]) for x in (t, g, e, a))
        if e["read_bytes"]:  # extent's extra reads on bytes the launch wrote: not judged by the bisection
            er += f" (extent: {pct(e['extra_read_written_bytes'], e['read_bytes'])} on bytes written)"
        lines.append(f"| {r['program']} | {g['launches']} | {g['validated']} | {g['unknown']} | {miss_w} | {miss_r} "
                     f"| {unj} | {ew} | {er} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--samples", type=int, default=2, help="validated launches per kernel (then 2^k-th)")
    ap.add_argument("--keep", type=Path, help="directory for the validated traces (default: a temporary one)")
    ap.add_argument("--learn-scale", type=int, default=1, help="program size whose run the templates are learned on")
    ap.add_argument("--score-scale", type=int, default=2, help="program size whose run is scored")
    ap.add_argument("--score-only", action="store_true", help="score the traces already in --keep; run nothing")
    ap.add_argument("--prefix", default="", help="the traces' file names start with this (e.g. suite-)")
    ap.add_argument("--validate-in", choices=("validator", "process"), default="validator",
                    help="where gpu-trace replays the sampled launches (see gpu-trace run --validate-in)")
    ap.add_argument("programs", nargs="*", default=list(PROGRAMS))
    args = ap.parse_args()
    outdir = args.keep or Path(os.environ.get("TMPDIR", "/tmp")) / "gpuos-access-suite"
    outdir.mkdir(parents=True, exist_ok=True)
    runs = []
    if not args.score_only:
        for name in args.programs:
            for scale in dict.fromkeys((args.learn_scale, args.score_scale)):
                r = run_one(name, outdir, args.samples, scale, args.prefix, args.validate_in)
                runs.append(r)
                print(json.dumps(r)[:2000], file=sys.stderr)
    results = []
    for name in args.programs:
        if not (outdir / f"{args.prefix}{name}.s{args.score_scale}.ndjson.zst").exists():
            results.append({"program": name})
            continue
        r = score_one(name, outdir, args.learn_scale, args.score_scale, args.prefix)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("range", "extent", "alloc", "templates")})[:2000],
              file=sys.stderr)
        for label in ("templates", "range", "extent", "alloc"):
            if label in r and r[label]["misses"]:
                print(f"  {label} misses: {json.dumps(r[label]['misses'])[:3000]}", file=sys.stderr)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "results": results, "samples": args.samples}, indent=1))
    return 0 if all(r.get("exit") == 0 for r in runs) and all("range" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
