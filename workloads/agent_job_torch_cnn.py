"""A PyTorch job for scripts/bench_agent.py: a ResNet-18-like CNN (torch.nn, BasicBlocks, batch
norm) trained with SGD + momentum under bf16 autocast on fixed random 224x224 images, until
$GPUOS_JOB_STOP exists. Writes "unix_time iters_per_s longest_iteration_s" per >= 100 ms window to $GPUOS_JOB_LOG
and, after warm-up, its pid to $GPUOS_JOB_READY (atomically): the protocol of agent_job.py.

One iteration = forward + backward + optimizer step of one batch, then a synchronize (as a
training loop that reads its loss each step). GPU_JOB_BATCH (default 128) sets the batch; what
the model, its activations and the caching allocator hold after warm-up is topped up to
GPU_JOB_GIB (default 8) GiB with a ballast of 256 MiB tensors, one of which each iteration
updates in place (like optimizer state: the ballast is written, not only held). No managed
memory; stderr says what it holds.
"""

import os
import sys
import time

import torch
from torch import nn

CHUNK = 256 << 20


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
    def __init__(self, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
            cin = cout
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(512, classes)

    def forward(self, x):
        x = self.body(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def main() -> None:
    gib = float(os.environ.get("GPU_JOB_GIB", "8"))
    batch = int(os.environ.get("GPU_JOB_BATCH", "128"))
    stop = os.environ["GPUOS_JOB_STOP"]
    log = open(os.environ["GPUOS_JOB_LOG"], "w", buffering=1)
    ready = os.environ["GPUOS_JOB_READY"]
    if not torch.cuda.is_available():
        sys.exit("agent_job_torch_cnn: torch sees no CUDA device")
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = Net().to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randn(batch, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(5):  # cuDNN autotuning, the caching allocator's pools
        step()
    torch.cuda.synchronize()
    held = torch.cuda.memory_reserved()
    n = max(0, int((gib * (1 << 30) - held) // CHUNK))
    ballast = [torch.ones(CHUNK // 4, dtype=torch.float32, device=dev) for _ in range(n)]
    step()
    torch.cuda.synchronize()
    params = sum(p.numel() for p in model.parameters())
    print(f"agent_job_torch_cnn: {params / 1e6:.1f} M parameters, batch {batch}; the model and its "
          f"activations hold {held / (1 << 30):.2f} GiB, ballast {n} x 256 MiB; reserved "
          f"{torch.cuda.memory_reserved() / (1 << 30):.2f} GiB", file=sys.stderr, flush=True)
    with open(ready + ".tmp", "w") as f:
        f.write(str(os.getpid()))  # the agent's socket is named after this process
    os.rename(ready + ".tmp", ready)
    i = 0
    window = last = time.perf_counter()
    count = 0
    gap = 0.0
    while not os.path.exists(stop):
        step()
        if ballast:
            ballast[i % len(ballast)].mul_(1.0001)
        torch.cuda.synchronize()
        i += 1
        count += 1
        now = time.perf_counter()
        gap, last = max(gap, now - last), now  # the longest iteration of the window
        if now - window >= 0.1:
            log.write(f"{time.time():.6f} {count / (now - window):.1f} {gap:.6f}\n")
            window, count, gap = now, 0, 0.0
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
