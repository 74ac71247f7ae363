"""A data-parallel training job for `gpu-ckpt --job`: one process per GPU, started by torchrun
(`python -m torch.distributed.run --nproc-per-node 2 workloads/ddp_job.py --steps 300`), an MLP
trained with SGD under DistributedDataParallel (NCCL; `--backend gloo` for a CPU-only check),
every rank on its own synthetic data.

Deterministic for a given world size and backend: seeded model and data, and the gradients'
all-reduce in a fixed order. Rank 0 writes the step it reached to --progress (atomically,
every step), so a test knows when to checkpoint, and at the end one JSON line to --out: the
sha256 of the final parameters, the steps, the world size and the mean step time. Every rank
sleeps --sleep-ms after each step, so that a checkpoint falls in the middle of the job.
"""

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--sleep-ms", type=float, default=5.0)
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--progress", default=None, help="file where rank 0 writes the step it reached")
    ap.add_argument("--out", default=None, help="rank 0's result (stdout without it)")
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = args.backend == "nccl"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.width)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    times = []
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        x = torch.randn(args.batch, args.width, device=device, generator=gen)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if rank == 0 and args.progress:
            tmp = f"{args.progress}.tmp"
            with open(tmp, "w") as f:
                f.write(str(step))
            os.replace(tmp, args.progress)
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    # every rank's parameters are the same after each all-reduced step: rank 0 says so for all
    digests = [None] * world
    dist.all_gather_object(digests, digest.hexdigest())
    if rank == 0:
        result = {"digest": digests[0], "ranks_agree": len(set(digests)) == 1, "steps": args.steps, "world": world,
                  "step_s": round(sum(times) / len(times), 6)}
        line = json.dumps(result)
        if args.out:
            with open(args.out, "w") as f:
                f.write(line + "\n")
        else:
            print(line, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
