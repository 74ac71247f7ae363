"""The job scripts/bench_suspend.py suspends: --gib GiB of pseudo-random data in 256 MiB CuPy
arrays (a splitmix64 kernel, as scripts/bench_ckpt_child.py), then a loop that launches a small
kernel about every millisecond, so that a suspend finds it between launches. The same file runs
under `gpu-trace run --agent` with GPUOS_AGENT_OWN=1 (the agent path) and alone (the driver path).

--dir D: D/ready holds {"pid", "checksum"} once the data is there; whenever D/check exists the
job writes D/check.json with the checksum computed again and removes D/check; whenever D/stamp
exists, after its next launch has completed on the GPU (its stream synchronised) the job writes
D/stamp.json with {"t": time.monotonic()} (CLOCK_MONOTONIC, comparable across processes) and
removes D/stamp: the bench's resume-to-first-kernel; D/exit ends it.

For scripts/bench_rollback.py: whenever D/damage exists the job overwrites every chunk with other
data (another seed), writes D/damage.json with the new checksum and removes D/damage; while
D/stamps exists, after each launch it synchronises its stream and notes time.monotonic(), and
once D/stamps is gone it writes the times noted to D/stamps.json.
"""

import argparse
import json
import os
import time

import cupy as cp

FILL = cp.ElementwiseKernel(
    "uint64 seed", "uint32 x",
    """
    unsigned long long z = (unsigned long long)i + seed + 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    x = (unsigned int)(z ^ (z >> 31));
    """,
    "gpuos_suspend_fill",
)
CHUNK = 256 << 20


def checksum(chunks: list) -> int:
    return sum(int(c.sum(dtype=cp.uint64)) for c in chunks) % (1 << 64)


def write(path: str, obj: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.rename(path + ".tmp", path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, required=True)
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    n = int(args.gib * (1 << 30)) // CHUNK
    chunks = []
    for k in range(n):
        c = cp.empty(CHUNK // 4, dtype=cp.uint32)
        FILL(cp.uint64(k * (CHUNK // 4)), c)
        chunks.append(c)
    small = cp.zeros(1 << 18, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    write(os.path.join(args.dir, "ready"), {"pid": os.getpid(), "checksum": checksum(chunks), "chunks": n})
    check, stop = os.path.join(args.dir, "check"), os.path.join(args.dir, "exit")
    stamp = os.path.join(args.dir, "stamp")
    damage, stamps = os.path.join(args.dir, "damage"), os.path.join(args.dir, "stamps")
    times: list[float] | None = None
    while not os.path.exists(stop):
        small += 1.0
        if os.path.exists(stamps):
            cp.cuda.get_current_stream().synchronize()
            if times is None:
                times = []
            times.append(time.monotonic())
        elif times is not None:
            write(stamps + ".json", {"t": times})
            times = None
        if os.path.exists(damage):
            for k, c in enumerate(chunks):
                FILL(cp.uint64(k * (CHUNK // 4) + 12345), c)
            write(damage + ".json", {"checksum": checksum(chunks)})
            os.unlink(damage)
        if os.path.exists(stamp):
            # the launch above has run: its stream only. A device-wide synchronize would also wait
            # for the agent's background loads of a lazy resume (same context), i.e. the whole reload
            cp.cuda.get_current_stream().synchronize()
            write(stamp + ".json", {"t": time.monotonic()})
            os.unlink(stamp)
        if os.path.exists(check):
            write(check + ".json", {"checksum": checksum(chunks)})
            os.unlink(check)
        time.sleep(0.001)


if __name__ == "__main__":
    main()
