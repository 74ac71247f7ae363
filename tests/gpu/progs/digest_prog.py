"""The residency engine's digest kernel (gpuos_tools/memory/digest_kernel.py, run by
driver_ops.DriverOps.digest) on buffers of a few sizes and contents, without the agent: prints one JSON line, per case the
hex digest at two addresses and digest_reference's (numpy) of the same bytes, and the kernel's GB/s."""

import json

import cupy as cp
import numpy as np

from gpuos_tools.memory.digest_kernel import digest_reference
from gpuos_tools.memory.driver_ops import DriverOps

ops = DriverOps(owned=False)
ops.digest_prepare()
cp.cuda.Device().synchronize()  # the primary context exists and is current
why = ops.digest_init()
if why is not None:
    raise SystemExit(f"digest_init: {why}")
rng = np.random.default_rng(7)
cases = {}
sizes = [8, 13, 4096, 1000003, 64 << 20]
data = {f"rand{n}": rng.integers(0, 256, n, dtype=np.uint8) for n in sizes}
big = data[f"rand{64 << 20}"]
swapped = big.copy()
swapped[:8], swapped[8:16] = big[8:16].copy(), big[:8].copy()  # two words swapped
shifted = np.roll(big, 8)
flipped = big.copy()
flipped[-1] ^= 1  # the last byte of the last word
data.update({"swapped": swapped, "shifted": shifted, "flipped": flipped, "zeros1M": np.zeros(1 << 20, np.uint8),
             "zeros1M+1": np.zeros((1 << 20) + 1, np.uint8)})
slot = 0
for name, host in data.items():
    dev = cp.asarray(host)
    # twice, at two addresses: the digest depends on the bytes, not where they are
    dev2 = cp.empty(host.size + 64, np.uint8)[64:]
    dev2[...] = dev
    cp.cuda.Device().synchronize()
    vals = []
    for d in (dev, dev2):
        ops.digest(d.data.ptr, host.size, slot, 0)
        cp.cuda.Device().synchronize()
        vals.append(ops.digest_value(slot).hex())
        slot += 1
    cases[name] = {"size": int(host.size), "digest": vals[0], "again": vals[1],
                   "reference": digest_reference(host.tobytes()).hex()}
# timing: the kernel over 64 MiB and 1 GiB (GB/s)
ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
timing = {}
for n in (64 << 20, 1 << 30):
    buf = cp.ones(n // 4, dtype=cp.float32)
    ops.digest(buf.data.ptr, n, slot, 0)
    cp.cuda.Device().synchronize()
    ev0.record()
    for _ in range(5):
        ops.digest(buf.data.ptr, n, slot, 0)
    ev1.record()
    ev1.synchronize()
    timing[str(n)] = round(5 * n / (cp.cuda.get_elapsed_time(ev0, ev1) / 1e3) / 1e9, 1)
    del buf
print(json.dumps({"cases": cases, "gbps": timing}))
