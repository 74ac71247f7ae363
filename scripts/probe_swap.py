#!/usr/bin/env python3
"""Probe (the swap-pipeline target in DESIGN.md): why the engine's load direction is slower than
bare copies when both directions run. Bare D2H of set A (one stream) and H2D of set B (another),
records of --record-mib MiB, while a second thread works the CUDA virtual-memory API on a third set
C of its own allocations, in one of these ways:

- none:       nothing (the ceiling);
- recreate:   per record cuMemUnmap + cuMemRelease, then cuMemCreate + cuMemMap + cuMemSetAccess
              (what the owned library's release / make_resident do);
- remap:      cuMemUnmap, then cuMemMap + cuMemSetAccess of the same physical handle (no new
              physical memory);
- create:     cuMemCreate + cuMemRelease of unmapped physical memory only;
- map:        cuMemMap + cuMemSetAccess + cuMemUnmap only, on a kept handle, to a second range.
Each: median GB/s of each direction over --trials. Also the calls' own costs. JSON to --json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from gpuos_tools.cuda.driver import ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--record-mib", type=int, default=256)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", default="")
    ap.add_argument("--modes", default="none,recreate,remap,create,map,none")
    args = ap.parse_args()
    from cuda.bindings import driver as drv

    ok(drv.cuInit(0), "cuInit")
    dev = ok(drv.cuDeviceGet(0), "cuDeviceGet")
    ctx = ok(drv.cuDevicePrimaryCtxRetain(dev), "retain")
    ok(drv.cuCtxSetCurrent(ctx), "set")
    rec = args.record_mib << 20
    n = max(1, int(args.gib * (1 << 30)) // rec)

    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    acc = drv.CUmemAccessDesc()
    acc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = 0
    acc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    def create() -> object:
        return ok(drv.cuMemCreate(rec, prop, 0), "cuMemCreate")

    def mapped(h: object, va: int) -> None:
        ok(drv.cuMemMap(va, rec, 0, h, 0), "cuMemMap")
        ok(drv.cuMemSetAccess(va, rec, [acc], 1), "cuMemSetAccess")

    def reserve() -> int:
        return int(ok(drv.cuMemAddressReserve(rec, 0, 0, 0), "reserve"))

    def new_set() -> list[list]:
        out = []
        for _ in range(n):
            va, h = reserve(), create()
            mapped(h, va)
            out.append([va, h, reserve()])  # third: a spare range for "map"
        return out

    a, b, c = new_set(), new_set(), new_set()
    hosts = {x[0]: int(ok(drv.cuMemHostAlloc(rec, 0), "hostalloc")) for x in a + b}
    res: dict = {"record_mib": args.record_mib, "n": n}

    def churn_once(mode: str, r: list) -> None:
        va, h, spare = r
        if mode == "recreate":
            ok(drv.cuMemUnmap(va, rec), "unmap"); ok(drv.cuMemRelease(h), "release")
            r[1] = h = create(); mapped(h, va)
        elif mode == "remap":
            ok(drv.cuMemUnmap(va, rec), "unmap"); mapped(h, va)
        elif mode == "create":
            ok(drv.cuMemRelease(create()), "release")
        elif mode == "map":
            mapped(h, spare); ok(drv.cuMemUnmap(spare, rec), "unmap")

    costs = {}
    for mode in ("recreate", "remap", "create", "map"):
        ts = []
        for r in c:
            t = time.perf_counter(); churn_once(mode, r); ts.append(time.perf_counter() - t)
        costs[mode] = round(statistics.median(ts) * 1e3, 3)
    res["call_ms"] = costs
    print(f"per-record call cost, ms (median): {costs}", file=sys.stderr)
    s_out = ok(drv.cuStreamCreate(1), "stream")
    s_in = ok(drv.cuStreamCreate(1), "stream")

    def both(mode: str) -> tuple[float, float, int]:
        stop = threading.Event()
        churned = [0]

        def churner() -> None:
            ok(drv.cuCtxSetCurrent(ctx), "set")
            while not stop.is_set():
                for r in c:
                    churn_once(mode, r)
                    churned[0] += 1
                    if stop.is_set():
                        break
                time.sleep(0.001)

        th = threading.Thread(target=churner)
        ok(drv.cuCtxSynchronize(), "sync")
        if mode != "none":
            th.start()
            time.sleep(0.005)
        t = time.perf_counter()
        for x, y in zip(a, b):
            ok(drv.cuMemcpyDtoHAsync(hosts[x[0]], x[0], rec, s_out), "d2h")
            ok(drv.cuMemcpyHtoDAsync(y[0], hosts[y[0]], rec, s_in), "h2d")
        e1 = ok(drv.cuEventCreate(2), "ev"); ok(drv.cuEventRecord(e1, s_out), "rec")
        e2 = ok(drv.cuEventCreate(2), "ev"); ok(drv.cuEventRecord(e2, s_in), "rec")
        t_out = t_in = None
        while t_out is None or t_in is None:
            now = time.perf_counter() - t
            if t_out is None and drv.cuEventQuery(e1)[0] == drv.CUresult.CUDA_SUCCESS:
                t_out = now
            if t_in is None and drv.cuEventQuery(e2)[0] == drv.CUresult.CUDA_SUCCESS:
                t_in = now
            time.sleep(20e-6)
        stop.set()
        if mode != "none":
            th.join()
        total = n * rec
        return round(total / t_out / 1e9, 2), round(total / t_in / 1e9, 2), churned[0]

    rows = {}
    for i, mode in enumerate(args.modes.split(",")):
        vals = [both(mode) for _ in range(args.trials)]
        rows[f"{i}-{mode}"] = {"out": statistics.median(v[0] for v in vals), "in": statistics.median(v[1] for v in vals),
                      "calls": statistics.median(v[2] for v in vals)}
        row = rows[f"{i}-{mode}"]
        print(f"{mode:<10} out {row['out']:>6} in {row['in']:>6} GB/s  ({row['calls']} records churned) {[v[:2] for v in vals]}",
              file=sys.stderr)
    res["rows"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
