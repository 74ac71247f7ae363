"""A job for the full-process (CRIU) GPU tests: deterministic work on the GPU (CuPy: an integer
xorshift over GIB GiB; PyTorch: a small MLP trained on fixed data beside GIB GiB of integers
stepped by a 64-bit LCG), its progress in small files it opens and closes each time.

    criu_job.py --dir DIR [--framework cupy|torch] [--gib N] [--iters N] [--pause S]

DIR/ready.json once the data is on the GPU, DIR/progress ("iter N", every 50 iterations), and
DIR/done.json at the end: the SHA-256 of the data (and weights) and the iterations. Each is
written to a temp file and renamed. The job keeps no file open that grows: CRIU restores an open
regular file only if its size is what it was at the dump, and an image taken with
--leave-running is restored after the job went on (and ended). No managed memory.
"""

import argparse
import hashlib
import json
import os
import time


def put(directory: str, name: str, text: str) -> None:
    temp = os.path.join(directory, f".{name}.{os.getpid()}")
    with open(temp, "w") as f:
        f.write(text)
    os.replace(temp, os.path.join(directory, name))


def cupy_job(args):
    import cupy as cp

    xorshift = cp.ElementwiseKernel(
        "uint32 k", "uint32 x",
        "unsigned int v = x ^ k; v ^= v << 13; v ^= v >> 17; v ^= v << 5; x = v;",
        "gpuos_criu_xorshift")
    data = cp.arange(int(args.gib * (1 << 30)) // 4, dtype=cp.uint32)
    data *= cp.uint32(2654435761)
    cp.cuda.Device().synchronize()

    def step(i: int) -> None:
        xorshift(cp.uint32(i), data)

    def sync() -> None:
        cp.cuda.Device().synchronize()

    def digest() -> str:
        return hashlib.sha256(cp.asnumpy(data).tobytes()).hexdigest()

    return step, sync, digest


def torch_job(args):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    torch.manual_seed(1234)
    big = torch.randint(0, 2**62, (int(args.gib * (1 << 30)) // 8,), dtype=torch.int64, device=dev, generator=gen)
    x = torch.randn(4096, 512, device=dev, generator=gen)
    y = torch.tanh(x @ torch.randn(512, 16, device=dev, generator=gen))
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.cuda.synchronize()

    def step(i: int) -> None:
        rows = slice((i * 256) % 4096, (i * 256) % 4096 + 256)
        loss = ((model(x[rows]) - y[rows]) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        big.mul_(6364136223846793005).add_(1442695040888963407)

    def digest() -> str:
        h = hashlib.sha256(big.cpu().numpy().tobytes())
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(p.detach().cpu().numpy().tobytes())
        return h.hexdigest()

    return step, torch.cuda.synchronize, digest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--framework", choices=["cupy", "torch"], default="cupy")
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--iters", type=int, default=1200)
    ap.add_argument("--pause", type=float, default=0.02, help="host sleep every 10 iterations (s)")
    args = ap.parse_args()
    step, sync, digest = (cupy_job if args.framework == "cupy" else torch_job)(args)
    put(args.dir, "ready.json", json.dumps({"pid": os.getpid()}))
    for i in range(args.iters):
        step(i)
        if i % 10 == 9:
            sync()
            time.sleep(args.pause)
        if i % 50 == 49:
            put(args.dir, "progress", f"iter {i + 1}\n")
    sync()
    put(args.dir, "done.json", json.dumps({"digest": digest(), "iters": args.iters}))


if __name__ == "__main__":
    main()
