"""Deterministic CuPy work for the owned-allocation tests (tests/gpu/test_owned_gpu.py).

Arrays of many sizes (small ones share the library's segments, large ones have ranges of their
own), elementwise work with temporaries, matmul (cuBLAS), FFT (cuFFT work areas), reductions and
frees. GPUOS_OWNED_CYCLE=1 (under the agent): half way, every record of the owned allocator
goes through the agent's residency engine -- evicted (saved to pinned memory, then released),
loaded back at the same address (half by prefetch, half by require on a stream of the program's)
and compared byte for byte with what it held before; device free memory is measured around the
release. GPUOS_ENGINE_EVICT=1 (under the agent): half way, every owned record is evicted through
the residency engine and the program goes on, loading back on demand what it touches.
GPUOS_SUSPEND_DIR=D: half way, it
writes its pid to D/pid and launches a small kernel on a scratch array every millisecond (its
results untouched) until D/go exists, so that a test can suspend and resume it through the
agent meanwhile (tests/gpu/test_suspend_gpu.py). Writes a JSON report to
GPUOS_OWNED_OUT: digests of the results, whether CuPy's allocations were owned, the cycle's
findings, and under the agent its residency engine's stats.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os

import cupy as cp

STEPS = 40


def digest(a) -> str:
    return hashlib.sha256(cp.ascontiguousarray(a).get().tobytes()).hexdigest()


def used_by_me() -> int | None:
    """Device memory NVML charges to this process, or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(cp.cuda.Device().id)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid():
                return int(p.usedGpuMemory or 0)
        return 0
    except Exception:
        return None


def running_engine():
    """The residency engine of the agent this program runs under (gpu-trace run --agent with
    GPUOS_AGENT_OWN=1), or None."""
    import sys

    tracer = sys.modules.get("gpuos_tools.injection.tracer")
    return getattr(getattr(getattr(tracer, "_tracer", None), "agent", None), "engine", None)


def evict_and_wait(engine, bases: list[int], timeout: float = 60) -> list[int]:
    """Ask the engine to evict each record of ``bases``; wait until those it accepted are
    released (or ``timeout``); the accepted ones."""
    import time

    accepted = [b for b in bases if engine.evict(b)]
    deadline = time.monotonic() + timeout
    while any(engine.state(b) != "released" for b in accepted) and time.monotonic() < deadline:
        time.sleep(0.005)
    return accepted


def device_sha256(base: int, size: int) -> str:
    from cuda.bindings import driver as drv

    buf = (ctypes.c_char * size)()
    drv.cuMemcpyDtoH(ctypes.addressof(buf), base, size)
    return hashlib.sha256(memoryview(buf)).hexdigest()


def cycle(report: dict) -> None:
    """evict (save + release) -> load back (make_resident + copy) of every owned record through
    the agent's residency engine, at the same addresses, compared byte for byte."""
    from cuda.bindings import driver as drv

    from gpuos_tools.memory import owned

    engine = running_engine()
    lib = owned.OwnedLibrary.load()
    records = lib.table()
    # one record goes and comes back first: the engine's one-time GPU allocations (its digest
    # kernel and slots, made at the first eviction) are then not in what the release frees
    stream = cp.cuda.Stream(non_blocking=True)
    warm = evict_and_wait(engine, [records[-1].base])
    for b in warm:
        ev = engine.prefetch(b)
        if ev is not None:
            drv.cuEventSynchronize(ev)
        engine.require([b], stream.ptr)  # its load has completed: the engine forgets it (resident)
    before = [device_sha256(r.base, r.size) for r in records]
    total = sum(r.size for r in records)
    free0 = int(drv.cuMemGetInfo()[1])
    nvml0 = used_by_me()
    accepted = evict_and_wait(engine, [r.base for r in records])
    free1 = int(drv.cuMemGetInfo()[1])
    nvml1 = used_by_me()
    released = [not r.resident for r in lib.table()]
    events = []
    for i, r in enumerate(records):
        if i % 2:  # the program's stream waits on the GPU for the load
            engine.require([r.base], stream.ptr)
        else:
            events.append(engine.prefetch(r.base))
    for ev in events:
        if ev is not None:
            drv.cuEventSynchronize(ev)
    stream.synchronize()
    resident_after = all(r.resident for r in lib.table())  # before anything else touches them
    after = [device_sha256(r.base, r.size) for r in records]
    report["cycle"] = {
        "records": len(records), "bytes": total, "small_segments": sum(r.small for r in records),
        "evictions_accepted": len(accepted), "warm_up_evictions": len(warm),
        "all_released": all(released), "meminfo_freed": free1 - free0,
        "nvml_freed": None if nvml0 is None or nvml1 is None else nvml0 - nvml1,
        "identical": before == after, "differ": [i for i, (a, b) in enumerate(zip(before, after)) if a != b],
        "same_addresses": [r.base for r in lib.table()] == [r.base for r in records],
        "resident_after": resident_after,
    }


def evict_all(report: dict) -> None:
    """Evict every resident owned record through the agent's residency engine (saved after its
    last use, then released) and wait until all are released; the program's next operations
    load back what they touch (GPUOS_ENGINE_EVICT=1, under gpu-trace run --agent)."""
    from gpuos_tools.memory import owned

    engine = running_engine()
    lib = owned.OwnedLibrary.load()
    bases = [r.base for r in lib.table() if r.resident]
    accepted = evict_and_wait(engine, bases)
    table = {r.base: r for r in lib.table()}
    report["evict"] = {"records": len(bases), "accepted": len(accepted),
                       "released": sum(1 for b in accepted if b in table and not table[b].resident),
                       "stats": engine.stats()}


def wait_for_go(d: str, report: dict) -> None:
    """Launch on a scratch array until d/go appears (a suspend and resume happen meanwhile)."""
    import time

    scratch = cp.zeros(1 << 16, dtype=cp.float32)
    with open(os.path.join(d, "pid.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(d, "pid.tmp"), os.path.join(d, "pid"))
    spins = 0
    while not os.path.exists(os.path.join(d, "go")):
        scratch += 1.0
        cp.cuda.Device().synchronize()
        spins += 1
        time.sleep(0.001)
    report["spins"] = spins
    report["scratch_ok"] = float(scratch[0]) == float(spins)


def main() -> None:
    report: dict = {}
    rng = cp.random.RandomState(7)
    state = {
        "big": rng.standard_normal(8 << 20, dtype=cp.float32),  # 32 MiB
        "mat": rng.standard_normal((512, 512), dtype=cp.float32),
        "odd": rng.standard_normal(3 * (1 << 19) + 11, dtype=cp.float64),  # 12 MiB + 88 B
        "small": [rng.standard_normal(n, dtype=cp.float32) for n in (1, 7, 100, 1000, 5000, 60000, 200000)],
        "ints": cp.arange(123457, dtype=cp.int64),
    }
    for step in range(STEPS):
        if step == STEPS // 2 and os.environ.get("GPUOS_OWNED_CYCLE") == "1":
            cp.cuda.Device().synchronize()  # the hashes before: nothing in flight writes the buffers
            cycle(report)
        if step == STEPS // 2 and os.environ.get("GPUOS_ENGINE_EVICT") == "1":
            evict_all(report)
        if step == STEPS // 2 and os.environ.get("GPUOS_SUSPEND_DIR"):
            wait_for_go(os.environ["GPUOS_SUSPEND_DIR"], report)
        big = state["big"]
        tmp = cp.sin(big) * 0.5 + cp.cos(big[::-1]) * 0.25  # temporaries, freed at once
        state["big"] = (big * 0.9 + tmp * 0.1).astype(cp.float32)
        state["mat"] = cp.tanh(state["mat"] @ state["mat"].T / 512.0)
        spec = cp.fft.rfft(state["odd"])
        state["odd"] = cp.fft.irfft(spec * 0.5, n=state["odd"].size) + state["odd"] * 0.5
        state["small"] = [s * 1.0001 + float(s.sum() % 3) for s in state["small"]]
        state["ints"] = (state["ints"] * 3 + step) % 1000003
        if step % 5 == 0:  # allocation churn: many short-lived arrays of assorted sizes
            junk = [cp.full(int(n), step, dtype=cp.int32) for n in rng.randint(1, 300000, size=20).get()]
            state["ints"][: len(junk)] += cp.asarray([int(j[-1]) for j in junk])
    cp.cuda.Device().synchronize()
    report["digests"] = {k: ([digest(x) for x in v] if isinstance(v, list) else digest(v)) for k, v in state.items()}
    from gpuos_tools.memory import owned

    pool = owned.pool()
    report["owned"] = pool is not None and cp.cuda.get_allocator() == pool.malloc
    if report["owned"]:
        table = owned.OwnedLibrary.load().table()
        report["records"] = len(table)
        report["small_segments"] = sum(r.small for r in table)
        report["stats"] = owned.OwnedLibrary.load().stats()
        lib = owned.OwnedLibrary.load()
        arrays = [x for v in state.values() for x in (v if isinstance(v, list) else [v])]
        report["arrays_owned"] = all(lib.lookup(a.data.ptr) is not None for a in arrays)
    engine = running_engine()
    if engine is not None:  # what the residency engine did (a lazy resume's loads, among others)
        report["residency_settled"] = engine.wait_settled(60)
        report["residency"] = engine.stats()
    with open(os.environ["GPUOS_OWNED_OUT"], "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
