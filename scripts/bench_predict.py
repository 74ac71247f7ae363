#!/usr/bin/env python3
"""Offline speed of gpu-predict-access: launches per second on one core, on the recorded traces.

Each trace is replicated N times: copy k has its launches' seq shifted by k * (launches per
copy) and its allocation ids by k * (max id + 1), and every allocation still live at the end of
a copy is freed before the next copy allocates the same addresses again, so the allocation
table stays consistent. Measured: prediction alone (records already parsed, as a filter inside
a Python pipeline would see them), the same without `dptrs` (the argument scan), at extent
granularity (argument decoders), and the whole command path (parse the NDJSON, predict,
encode the output), all in this one process. Then the steady state of a training loop: one
recorded step's launches repeated (`steady_state`), at range and extent granularity.

    scripts/bench_predict.py [--copies N] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import platform
import sys
import time
from pathlib import Path

from gpuos_tools.access import Predictor
from gpuos_tools.stream import open_input
from gpuos_tools.stream.reader import Reader
from gpuos_tools.stream.writer import Writer

ROOT = Path(__file__).resolve().parent.parent

TRACES = ["torch", "cupy", "apis"]


def replicate(records: list[dict], copies: int) -> list[dict]:
    launches = sum(r["type"] == "launch" for r in records)
    max_id = max((r["id"] for r in records if r["type"] == "alloc"), default=0) + 1
    body = [r for r in records if r["type"] not in ("header", "exit")]
    out = [records[0]]
    for k in range(copies):
        live: dict[int, dict] = {}
        for rec in body:
            r = dict(rec)
            if r["type"] == "launch":
                r["seq"] = rec["seq"] + k * launches
            elif r["type"] == "alloc":
                r["id"] = rec["id"] + k * max_id
                live[r["addr"]] = r
            elif r["type"] == "free":
                if r.get("id") is not None:
                    r["id"] = rec["id"] + k * max_id
                live.pop(r["addr"], None)
            out.append(r)
        for a in live.values():
            out.append({"type": "free", "id": a["id"], "api": "bench", "addr": a["addr"]})
    return out


def steady_state(copies: int) -> dict:
    """A training loop after its first steps: the same launches again and again, with no
    allocation in between (the caching allocator reuses its segments). The launches of the last
    of the three training steps in a recorded PyTorch CNN trace are predicted ``copies`` times,
    with and without the predictor's memo."""
    with open_input(ROOT / "tests" / "data" / "recorded" / "suite-torch_cnn.s2.ndjson.zst") as reader:
        records = [r for r in reader if r["type"] != "validation"]
    launches = [r for r in records if r["type"] == "launch"]
    step = launches[len(launches) * 2 // 3 :]
    out = {"step_launches": len(step)}
    for label, granularity, memo in (("memo", "range", True), ("no_memo", "range", False),
                                     ("extent_memo", "extent", True), ("extent_no_memo", "extent", False)):
        pred = Predictor(granularity)
        for r in records:
            pred.feed(r)
        if not memo:
            pred._launch_memo = lambda rec, pred=pred: pred.launch(rec)[0]  # type: ignore[method-assign]

        def run(pred=pred):
            feed = pred.feed
            for _ in range(copies):
                for r in step:
                    feed(r)

        out[label] = round(timed(run, copies * len(step)))
    return out


def timed(fn, launches: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return launches / best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=200)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    results = []
    for name in TRACES:
        with open_input(ROOT / "tests" / "data" / "recorded" / f"{name}.ndjson.zst") as reader:
            records = replicate(list(reader), args.copies)
        launches = sum(r["type"] == "launch" for r in records)
        stripped = copy.deepcopy(records)
        for r in stripped:
            r.pop("dptrs", None)
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()

        def predict(recs=records, granularity="alloc"):
            feed = Predictor(granularity).feed
            for r in recs:
                feed(r)

        def pipeline(data=text):
            buf = io.BytesIO(data)
            reader = Reader("bench", buf.read, None, compressed_by_name=False, on_error="raise")
            writer = Writer("bench", io.BytesIO(), per_record=False, compress=False, owns_file=True)
            writer.write_many(Predictor().annotate(reader))
            writer.close()

        row = {
            "trace": name,
            "launches": launches,
            "records": len(records),
            "predict_launches_per_s": round(timed(predict, launches)),
            "predict_scan_launches_per_s": round(timed(lambda: predict(stripped), launches)),
            "predict_extent_launches_per_s": round(timed(lambda: predict(granularity="extent"), launches)),
            "pipeline_launches_per_s": round(timed(pipeline, launches)),
            "input_mb": round(len(text) / 1e6, 1),
        }
        results.append(row)
        print(
            f"{name:6s} {launches:7d} launches: predict {row['predict_launches_per_s']:>9,}/s, "
            f"scan (no dptrs) {row['predict_scan_launches_per_s']:>9,}/s, "
            f"extent {row['predict_extent_launches_per_s']:>9,}/s, "
            f"parse+predict+write {row['pipeline_launches_per_s']:>9,}/s ({row['input_mb']} MB)",
            flush=True,
        )
    steady = steady_state(args.copies)
    print(f"steady state (torch_cnn's last training step repeated {args.copies}x): "
          f"range {steady['memo']:,}/s, without the memo {steady['no_memo']:,}/s; "
          f"extent {steady['extent_memo']:,}/s, without the memo {steady['extent_no_memo']:,}/s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"python": platform.python_version(), "cpu": platform.processor(),
                                               "copies": args.copies, "results": results,
                                               "steady_state": steady}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
