"""A PyTorch program that captures CUDA graphs while `gpu-prefetch-sched run` moves its memory
(tests/gpu/test_graph_gpu.py). Arrays of --mib MiB; a step adds two arrays into a third (out=,
no allocation). Eager steps over every array (with a budget below the footprint: evictions and
loads, releases still in flight), then, --graphs times: a CUDA graph of --graph-steps steps is
captured with torch.cuda.graph (its default capture mode, global: while it captures, other
threads' unsafe CUDA calls are errors), replayed --replays times between eager bursts. Writes
the sha256 of every array's final bytes, so a run can be compared with the program alone."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arrays", type=int, default=12)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--graphs", type=int, default=3)
    ap.add_argument("--graph-steps", type=int, default=4)
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    m, n = args.arrays, (args.mib << 20) // 4
    xs = [torch.empty(n, device="cuda") for _ in range(m)]
    ramp = torch.arange(n, device="cuda", dtype=torch.float32) / n
    for i, x in enumerate(xs):
        torch.mul(ramp, float(i + 1), out=x)
    del ramp

    def step(s: int) -> None:
        torch.add(xs[s % m], xs[(s + 2) % m], alpha=0.5, out=xs[(s + 1) % m])
        xs[(s + 1) % m].mul_(0.75)

    for s in range(2 * m):
        step(s)
    graphs = []
    for k in range(args.graphs):
        for s in range(m):  # an eager burst right before: evictions still in flight at the capture
            step(s + k)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up on a side stream, as torch's documentation asks
            for s in range(args.graph_steps):
                step(s + 3 * k)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for s in range(args.graph_steps):
                step(s + 3 * k)
        graphs.append(g)
        for r in range(args.replays):
            g.replay()
            for s in range(m // 2):
                step(s + r)
    for g in graphs:  # every graph again, after the others moved memory
        g.replay()
    torch.cuda.synchronize()
    h = hashlib.sha256()
    for x in xs:
        h.update(x.cpu().numpy().tobytes())
    res = {"digest": h.hexdigest(), "graphs": len(graphs), "arrays": m, "bytes": m * n * 4}
    with open(args.out, "w") as f:
        json.dump(res, f)
    print(json.dumps(res), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
