"""One small PyTorch training run for the gpu-trace GPU tests. Writes what it knows to $GPUOS_TEST_REPORT."""

import json
import os

import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
steps = int(os.environ.get("STEPS", "3"))
for _ in range(steps):
    x = torch.randn(64, 256, device="cuda")
    target = torch.randint(0, 10, (64,), device="cuda")
    loss = F.cross_entropy(model(x), target)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
final_loss = float(loss)  # device-to-host copy + sync
# a segment the caching allocator gives back to the driver: the trace must show its free
big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
big_addr = big.data_ptr()
del big
torch.cuda.empty_cache()
torch.cuda.synchronize()
report = {
    "segments": [[s["address"], s["total_size"]] for s in torch.cuda.memory_snapshot()],
    "released": big_addr,
    "pointers": {name: p.data_ptr() for name, p in model.named_parameters()},
    "grads": {name: p.grad.data_ptr() for name, p in model.named_parameters()},
    "reserved": torch.cuda.memory_reserved(),
    "allocated": torch.cuda.memory_allocated(),
    "loss": final_loss,
}
with open(os.environ["GPUOS_TEST_REPORT"], "w") as f:
    json.dump(report, f)
