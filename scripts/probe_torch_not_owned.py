#!/usr/bin/env python3
"""Which device allocations of a PyTorch program stay outside the owned allocator, and which
library makes them. One JSON report on stdout (and --json FILE).

It runs itself (--child) under `gpu-trace run --agent` with GPUOS_AGENT_OWN=1, once for each
CUBLAS_WORKSPACE_CONFIG given (a size that follows the setting is cuBLAS's workspace). The
child works in phases, each opened by a marker: an owned allocation of a size nothing else
has (its VMM mapping appears in the trace). Every allocation the trace shows that is not a VMM
mapping (not owned) is attributed to the phase it appears in:

  init    torch's start, a first tensor and a random fill
  conv    a Conv2d forward + backward (cuDNN)
  mm      a plain matmul (cuBLAS)
  addmm   nn.Linear with bias, forward + backward (cuBLASLt for the bias epilogue)
  sdpa    scaled_dot_product_attention (flash / memory-efficient kernels)

Usage: scripts/probe_torch_not_owned.py [--json FILE] [--config :4096:8 --config :4096:2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
#: marker sizes: size classes of the owned cache (so the mapping is exactly this), unlike the program's
MARKERS = {"conv": 40 * MIB, "mm": 56 * MIB, "addmm": 112 * MIB, "sdpa": 224 * MIB, "end": 448 * MIB}


def child() -> None:
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    keep = []

    def mark(phase: str) -> None:
        torch.cuda.synchronize()
        keep.append(torch.empty(MARKERS[phase], dtype=torch.uint8, device=dev))
        torch.cuda.synchronize()

    x = torch.randn(64, 3, 32, 32, device=dev)
    mark("conv")
    conv = torch.nn.Conv2d(3, 32, 3, padding=1).to(dev)
    conv(x).square().sum().backward()
    mark("mm")
    a = torch.randn(1024, 1024, device=dev)
    (a @ a).sum().item()
    mark("addmm")
    lin = torch.nn.Linear(1024, 512).to(dev)
    lin(a).sum().backward()
    mark("sdpa")
    q = torch.randn(4, 8, 256, 64, device=dev, dtype=torch.float16)
    F.scaled_dot_product_attention(q, q, q).sum().item()
    mark("end")
    from gpuos_tools.memory import owned

    print(json.dumps({"owned": owned.torch_allocator() is not None}))


def run(config: str, tmp: str) -> dict:
    from gpuos_tools.stream import open_input

    trace = os.path.join(tmp, f"probe{config.replace(':', '_')}.ndjson.zst")
    env = dict(os.environ, GPUOS_AGENT_OWN="1", CUBLAS_WORKSPACE_CONFIG=config,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o",
                        trace, "--", sys.executable, __file__, "--child"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    if p.returncode:
        raise SystemExit(f"probe child failed:\n{p.stderr[-4000:]}")
    sizes = {v: k for k, v in MARKERS.items()}
    phase = "init"
    phases: dict[str, list[dict]] = {k: [] for k in ("init", *MARKERS)}
    owned_bytes = 0
    with open_input(trace) as reader:
        for r in reader:
            if r.get("type") != "alloc":
                continue
            if r.get("kind") == "vmm":
                phase = sizes.get(r.get("size"), phase)
                owned_bytes += r.get("size") or 0
            elif r.get("kind") != "host":
                phases[phase].append({"size": r.get("size"), "kind": r.get("kind")})
    return {"config": config, "child": json.loads(p.stdout.strip().splitlines()[-1]),
            "owned_vmm_bytes": owned_bytes, "not_owned_by_phase": {k: v for k, v in phases.items() if v}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--config", action="append", help="CUBLAS_WORKSPACE_CONFIG values (default :4096:8 and :4096:2)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child()
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = {"runs": [run(c, tmp) for c in (args.config or [":4096:8", ":4096:2"])]}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
