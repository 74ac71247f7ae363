"""A CNN training loop for `gpu-prefetch-sched run`: a small ResNet-like network
(torch.nn: convolutions, batch norm, residual blocks, a linear head) trained with SGD +
momentum on synthetic data for a fixed number of steps.

--width (channels of the first stage; the stages have width, 2x, 4x, 8x), --blocks (residual
blocks per stage), --batch, --image (square side), --steps, --batches (distinct synthetic
batches, cycled: the data is on the GPU like a preloaded data set, and is part of the
memory). Each step: forward, cross-entropy loss, backward, optimizer step (no synchronize).

Deterministic: torch.manual_seed(0), CUBLAS_WORKSPACE_CONFIG=:4096:8 (set before torch is
imported, unless already set), cuDNN deterministic and benchmark off,
torch.use_deterministic_algorithms(True, warn_only=True) (the network is meant to use only ops
with deterministic CUDA kernels: no max pooling, global pooling by a mean; the output lists the
ops torch warned about, ``nondeterministic``). One JSON line to --out (stdout
without it): the sha256 of the final parameters and buffers (the batch-norm statistics) in
order, the training loop's wall time (synchronised before and after; 2 warm-up steps before
it, in the digest too) and its/s, the bytes of parameters, data and optimizer state.

--managed FRACTION: the fault-driven managed-memory baseline, an EMULATION of the driver's
eviction under pressure (gpuos_tools/memory/managed.py; torch_decode_job.py's docstring says
the same): managed memory, a software budget of FRACTION of it kept before each aten
operation (the backward's and the optimizer's too) from the model's creation to the end of
the training loop by pushing least recently used blocks to the host, nothing prefetched back.
The output adds `um` and `um_loop`.
"""

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
import warnings

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402 (after CUBLAS_WORKSPACE_CONFIG)
from torch import nn  # noqa: E402


def sched_counts():
    """The counts of `gpu-prefetch-sched run`'s executor when this runs under it, else None
    (gpuos_tools.sched.executor.current_counts; the module is loaded only under the agent)."""
    mod = sys.modules.get("gpuos_tools.sched.executor")
    return mod.current_counts() if mod is not None else None


def delta(before, after):
    """What the executor did between two sched_counts() (None when not under it)."""
    if before is None or after is None:
        return None
    return {k: round(after[k] - before[k], 6) for k in before if k != "t"}


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        return torch.relu(y + (x if self.short is None else self.short(x)))


class Net(nn.Module):
    def __init__(self, width: int, blocks: int, classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
            for j in range(blocks):
                layers.append(Block(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.body(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--managed", type=float, default=0.0, metavar="FRACTION",
                    help="managed memory under a software budget of FRACTION of it (docstring)")
    ap.add_argument("--managed-reserve", type=int, default=1 << 30, metavar="BYTES",
                    help="--managed: GPU memory left free of managed memory (for what is not managed)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    um = None
    hooked = contextlib.ExitStack()
    if args.managed:  # before torch's first CUDA allocation
        from gpuos_tools.memory import managed

        um = managed.install_torch(args.managed, reserve=args.managed_reserve)
        hooked.enter_context(um.mode())
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = Net(args.width, args.blocks, args.classes).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator(device="cpu").manual_seed(1)
    data = [(torch.randn(args.batch, 3, args.image, args.image, generator=gen).to(dev),
             torch.randint(0, args.classes, (args.batch,), generator=gen).to(dev)) for _ in range(args.batches)]

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    for i in range(2):
        step(i)
    torch.cuda.synchronize()
    c0 = sched_counts()
    u0 = um.counts() if um else None
    t0 = time.perf_counter()
    for i in range(2, 2 + args.steps):
        step(i)
    torch.cuda.synchronize()
    loop_s = time.perf_counter() - t0
    region = delta(c0, sched_counts())
    um_loop = delta(u0, um.counts() if um else None)
    hooked.close()
    caught.__exit__(None, None, None)
    nondet = sorted({str(w.message)[:200] for w in seen if "deterministic" in str(w.message)})
    h = hashlib.sha256()
    for name, t in list(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    data_bytes = sum(x.numel() * x.element_size() + y.numel() * y.element_size() for x, y in data)
    res = {"workload": "cnn_train", "digest": h.hexdigest(), "loop_s": round(loop_s, 6), "sched_loop": region, "steps": args.steps,
           "its_per_s": round(args.steps / loop_s, 3) if loop_s > 0 else None, "param_bytes": params,
           "data_bytes": data_bytes, "momentum_bytes": params, "width": args.width, "blocks": args.blocks,
           "batch": args.batch, "image": args.image, "torch": torch.__version__, "nondeterministic": nondet}
    if um is not None:
        res.update(um=um.summary(), um_loop=um_loop)
    print(f"torch_cnn_job: {params / 2**20:.1f} MiB of parameters, {data_bytes / 2**20:.1f} MiB of data, "
          f"{args.steps} steps in {loop_s:.3f} s", file=sys.stderr)
    text = json.dumps(res)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
