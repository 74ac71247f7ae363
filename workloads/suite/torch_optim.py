"""Accuracy suite: optimizer steps with multi-tensor kernels: Adam foreach, AdamW fused, SGD foreach."""

import os

import torch
import torch.nn as nn

torch.manual_seed(0)
dev = "cuda"
S = int(os.environ.get("GPUOS_SUITE_SCALE", "1"))  # sizes: learning (1) and scoring (2)
for make in (
    lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
    lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=True),
):
    model = nn.Sequential(nn.Linear(64, 128 * S), nn.GELU(), nn.Linear(128 * S, 64), nn.LayerNorm(64)).to(dev)
    opt = make(model.parameters())
    x = torch.randn(32 * S, 64, device=dev)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
torch.cuda.synchronize()
print("ok")
