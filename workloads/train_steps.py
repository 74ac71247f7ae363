#!/usr/bin/env python3
"""A real training loop that times its own steps, for the benchmarks that run it under the tools.

    train_steps.py --model resnet50|mlp --steps N [--warmup W] --json OUT [--pause FILE]

resnet50: timm's ResNet-50 (random weights), bf16 autocast, batch 64 of 224x224, SGD with
momentum (~900 launches a step). mlp: a 4-layer MLP, batch 256, torch.optim.Adam(foreach=True)
(~35 launches a step). Each step ends with a synchronize; OUT gets the step times in seconds
(after the warm-up) and the launches per step are not counted here (the tools count them).
OUT's `enqueue` holds, per step, the host's time to issue it (until the step function returns,
before the synchronize): near the step time, the loop is bound by the host (the framework, the
allocator, the agent), well below it, by the GPU.
With --pause FILE, after the warm-up it writes FILE.ready and waits (at most 120 s) for FILE.go,
so that a benchmark can act (take a snapshot) before the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def resnet50():
    import timm

    model = timm.create_model("resnet50", pretrained=False, num_classes=1000).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(64, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (64,), device="cuda")
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    return step


def mlp():
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10),
    ).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(256, 512, device="cuda")
    y = torch.randint(0, 10, (256,), device="cuda")
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("resnet50", "mlp"), required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--pause", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    step = {"resnet50": resnet50, "mlp": mlp}[args.model]()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    if args.pause is not None:
        Path(f"{args.pause}.ready").write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not Path(f"{args.pause}.go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    times, enqueue = [], []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        enqueue.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    args.json.write_text(json.dumps({"model": args.model, "steps": times, "enqueue": enqueue}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
