"""Accuracy suite: a PyTorch CNN training step (conv, batchnorm, ReLU, pooling, linear,
cross-entropy, SGD with momentum), three steps."""

import os

import torch
import torch.nn as nn

torch.manual_seed(0)
dev = "cuda"
model = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
    nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(32 * 16 * 16, 10),
).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=False)
B = 16 * int(os.environ.get("GPUOS_SUITE_SCALE", "1"))  # batch: learning (1) and scoring (2) sizes
x = torch.randn(B, 3, 32, 32, device=dev)
t = torch.randint(0, 10, (B,), device=dev)
for _ in range(3):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), t)
    loss.backward()
    opt.step()
torch.cuda.synchronize()
print(float(loss))
