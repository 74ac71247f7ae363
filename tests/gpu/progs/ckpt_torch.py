"""A PyTorch program for the gpu-ckpt GPU tests: a small MLP trained on fixed synthetic data beside
GIB GiB of integers stepped by a 64-bit LCG, deterministically (cuBLAS workspace pinned,
deterministic algorithms, no TF32), progress on stdout, a digest of everything at the end.

    ckpt_torch.py [--gib N] [--iters N] [--pause S]

stdout, one line each: "ready {json}" once everything is on the GPU, "iter N" every 50
iterations, "done {json}" with the SHA-256 of the weights and the integers and the UUID of the
GPU the context is on. No managed memory.
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402


def device_uuid() -> str:
    """The UUID of the GPU the current context is on (it changes when gpu-restore moves the process)."""
    from cuda.bindings import driver as drv

    err, dev = drv.cuCtxGetDevice()
    assert err == drv.CUresult.CUDA_SUCCESS, err
    err, uuid = drv.cuDeviceGetUuid(dev)
    assert err == drv.CUresult.CUDA_SUCCESS, err
    h = bytes(uuid.bytes).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=1500)
    ap.add_argument("--pause", type=float, default=0.02, help="host sleep every 10 iterations (s)")
    args = ap.parse_args()

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    torch.manual_seed(1234)

    n = int(args.gib * (1 << 30)) // 8
    big = torch.randint(0, 2**62, (n,), dtype=torch.int64, device=dev, generator=gen)
    x = torch.randn(4096, 512, device=dev, generator=gen)
    w_true = torch.randn(512, 16, device=dev, generator=gen)
    y = torch.tanh(x @ w_true)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.cuda.synchronize()
    print("ready " + json.dumps({"pid": os.getpid(), "bytes": int(big.numel() * 8), "uuid": device_uuid()}),
          flush=True)

    for i in range(args.iters):
        rows = slice((i * 256) % 4096, (i * 256) % 4096 + 256)
        loss = ((model(x[rows]) - y[rows]) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        big.mul_(6364136223846793005).add_(1442695040888963407)  # wraps modulo 2**64
        if i % 10 == 9:
            torch.cuda.synchronize()
            time.sleep(args.pause)
        if i % 50 == 49:
            print(f"iter {i + 1}", flush=True)
    h = hashlib.sha256(big.cpu().numpy().tobytes())
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().numpy().tobytes())
    print("done " + json.dumps({"digest": h.hexdigest(), "iters": args.iters, "loss": float(loss),
                                "uuid": device_uuid()}), flush=True)


if __name__ == "__main__":
    main()
