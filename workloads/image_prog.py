"""A tiny CuPy job for recording the agent-path images in tests/data/recorded/agent-image:
three arrays; after `go` (in $GPUOS_RB_DIR) it changes one of them and writes `changed`, then
exits on `go2`. Driven by scripts/record-agent-image."""

import os
import sys
import time

import cupy as cp

where = os.environ["GPUOS_RB_DIR"]


def wait(name: str) -> None:
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(where, name)):
        if time.time() > deadline:
            sys.exit(f"image_prog: {name} never came")
        time.sleep(0.01)


def mark(name: str, text: str) -> None:
    with open(os.path.join(where, name + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(where, name + ".tmp"), os.path.join(where, name))


a = cp.arange(16 << 10, dtype=cp.float32)  # 64 KiB
b = cp.full(64 << 10, 7, dtype=cp.int32)  # 256 KiB
c = cp.zeros(256 << 10, dtype=cp.uint8)  # 256 KiB of zeros: compresses
cp.cuda.Device().synchronize()
mark("ready", str(os.getpid()))
wait("go")
b += 1  # the only buffer written between the two images
cp.cuda.Device().synchronize()
mark("changed", "")
wait("go2")
