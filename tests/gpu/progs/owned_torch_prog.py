"""PyTorch on the owned allocator's C library through CUDAPluggableAllocator (no agent, no
caching in front): a few ops whose results must equal the CPU's, and the library's table must
hold the tensors. Prints one JSON line."""

from __future__ import annotations

import json

import torch

from gpuos_tools.memory import owned

lib = owned.OwnedLibrary.load()  # initialises the library torch loads by the same path
alloc = torch.cuda.memory.CUDAPluggableAllocator(lib.path, "gpuos_torch_malloc", "gpuos_torch_free")
torch.cuda.memory.change_current_allocator(alloc)
g = torch.Generator().manual_seed(3)
a, b = torch.randn(300, 200, generator=g, dtype=torch.float64), torch.randn(200, 50, generator=g, dtype=torch.float64)
x = torch.arange(5_000_000, dtype=torch.float64)
da, db, dx = a.cuda(), b.cuda(), x.cuda()
records = len(lib.table())
out = {
    "matmul": bool(torch.allclose((da @ db).cpu(), a @ b)),
    "sum": float(dx.sum().item()) == float(x.sum().item()),
    "records_with_tensors": records,
    "owned": all(lib.lookup(t.data_ptr()) is not None for t in (da, db, dx)),
}
del da, db, dx
torch.cuda.synchronize()
out["records_after_free"] = len([r for r in lib.table() if r.live])
print(json.dumps(out))
