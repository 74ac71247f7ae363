"""A data-parallel training job for `gpu-ckpt --job`: one process per GPU, started by torchrun
(`python -m torch.distributed.run --nproc-per-node 2 workloads/ddp_job.py --steps 300`), an MLP
trained with SGD under DistributedDataParallel (NCCL; `--backend gloo` for a CPU-only check),
every rank on its own synthetic data.

Deterministic for a given world size and backend: seeded model and data, and the gradients'
all-reduce in a fixed order. Rank 0 writes the step it reached to --progress (atomically,
every step), so a test knows when to checkpoint, and at the end one JSON line to --out: the
sha256 of the final parameters, the steps, the world size and the mean step time. Every rank
sleeps --sleep-ms after each step, so that a checkpoint falls in the middle of the job.

Under the agent, with --sync-dir DIR, the job can be cut, rolled back and run on
(`gpu-ckpt --job PID --cut`, `gpu-restore --job PID --cut`; docs/multi-gpu-jobs.md). At the start
of each step every rank notes its agent's count of collective launches and its generator's
state; then the ranks agree (an all-reduce) whether DIR/pause exists, and if so each writes
DIR/paused.RANK and waits for DIR/resume. A resume that names a collective K means the ranks'
device memory was rolled back to just before their K-th collective: each rank goes back to the
start of the step whose collectives include K (the last step that began with fewer than K),
restores that step's generator state and runs on from there. Nothing a step writes that lasts
(parameters, momentum) is written before its last collective, so the device state just before
any collective of the step is the state at its start.

The twin of such a run, stopped and resumed at the same step: --save-at STEP --state-dir DIR
saves every rank's model, optimizer and generator at the start of STEP and ends; --resume-from
DIR --start-step STEP loads them and runs from STEP.
"""

import argparse
import hashlib
import json
import os
import sys
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
    ap.add_argument("--sync-dir", default=None, help="pause and rollback handshakes (under the agent)")
    ap.add_argument("--save-at", type=int, default=None, help="save the state at the start of this step and end")
    ap.add_argument("--state-dir", default=None, help="where --save-at saves (one file per rank)")
    ap.add_argument("--resume-from", default=None, help="a --state-dir to load before --start-step")
    ap.add_argument("--start-step", type=int, default=1)
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
    if args.resume_from:
        # on the CPU: the generator's state must stay there; the model and the optimizer copy theirs over
        state = torch.load(os.path.join(args.resume_from, f"rank-{rank}.pt"), map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
    times: dict[int, float] = {}  # step -> seconds (a step run again after a rollback counts once)
    at_start: dict[int, tuple[int, torch.Tensor]] = {}  # step -> (collectives before it, generator state)
    rewound = []
    flag = torch.zeros(1, device=device)
    step = args.start_step
    while step <= args.steps:
        if args.save_at == step:
            os.makedirs(args.state_dir, exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state()},
                       os.path.join(args.state_dir, f"rank-{rank}.pt"))
            dist.barrier()
            dist.destroy_process_group()
            return
        if args.sync_dir:
            at_start[step] = (agent_collectives(), gen.get_state())
            flag.fill_(float(rank == 0 and os.path.exists(os.path.join(args.sync_dir, "pause"))))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                k = pause(args.sync_dir, rank, step)
                if k is not None:
                    back = max((s for s, (c, _) in at_start.items() if c < k), default=None)
                    if back is None:
                        sys.exit(f"ddp_job: rank {rank}: no step began before collective {k}")
                    gen.set_state(at_start[back][1])
                    rewound.append({"collective": k, "from_step": step, "step": back})
                    step = back
                    continue
        t = time.perf_counter()
        x = torch.randn(args.batch, args.width, device=device, generator=gen)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times[step] = time.perf_counter() - t
        if rank == 0 and args.progress:
            tmp = f"{args.progress}.tmp"
            with open(tmp, "w") as f:
                f.write(str(step))
            os.replace(tmp, args.progress)
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
        step += 1
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    # every rank's parameters are the same after each all-reduced step: rank 0 says so for all
    digests = [None] * world
    dist.all_gather_object(digests, digest.hexdigest())
    if rank == 0:
        result = {"digest": digests[0], "ranks_agree": len(set(digests)) == 1, "steps": args.steps, "world": world,
                  "step_s": round(sum(times.values()) / max(1, len(times)), 6), "rewound": rewound}
        line = json.dumps(result)
        if args.out:
            with open(args.out, "w") as f:
                f.write(line + "\n")
        else:
            print(line, flush=True)
    dist.destroy_process_group()


def agent_collectives() -> int:
    """This rank's collective launches as its agent counted them (the agent runs in this process)."""
    tracer = sys.modules.get("gpuos_tools.injection.tracer")
    agent = getattr(getattr(tracer, "_tracer", None), "agent", None)
    if agent is None:
        sys.exit("ddp_job: --sync-dir needs the agent (start each rank with `gpu-ckpt run`)")
    return int(sys.modules["gpuos_tools.agent.cut"].counts(agent)["collectives"])


def pause(where: str, rank: int, step: int) -> int | None:
    """Say this rank is paused (at the start of ``step``, every collective before it complete) and
    wait for DIR/resume: the collective the ranks were rolled back to, or None."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    tmp = os.path.join(where, f"paused.{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump({"step": step, "collectives": agent_collectives()}, f)
    os.replace(tmp, os.path.join(where, f"paused.{rank}"))
    path = os.path.join(where, "resume")
    deadline = time.time() + 600
    while not os.path.exists(path):
        if time.time() > deadline:
            sys.exit(f"ddp_job: rank {rank}: no resume after 600 s")
        time.sleep(0.01)
    with open(path) as f:
        return json.load(f).get("collective")


if __name__ == "__main__":
    main()
