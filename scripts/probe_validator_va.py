#!/usr/bin/env python3
"""Where does this driver let a second process reserve a device virtual address that a first
process (the "program") uses? The validator replays a program's launch at the program's addresses
(gpuos_tools/agent/replay.py); ``cuMemAddressReserve`` takes the address only as a hint. One JSON
report to the path given (``probe_validator_va.py OUT.json``), a short table on stderr; about 20 s.

The program child makes a context and allocates with cuMemAlloc (2 MiB, 32 MiB, 1 GiB when 8 GiB
are free) and through the VMM API (cuMemCreate, cuMemAddressReserve at no hint, cuMemMap); it
reports its /proc/self/maps around them, every mapping of /dev/nvidia*, what cuInit and the context
mapped, and the windows and driver areas the program's side of validation would name
(gpuos_tools/agent/vaspace.py). Then fresh "validator" children, one per way, each try to reserve
every one of those addresses with cuMemAddressReserve(hint = the address) and record requested vs
granted and the maps around both (an exact grant is mapped with one granule to be sure it is usable):

- plain: context first, then the hints;
- hold: the program's windows held with placeholders before the driver loads, lifted to reserve;
- late: context first, then the windows held, lifted to reserve;
- steer, steer-nospare, steer-windows: every free part of the address space but the program's
  driver areas (steer-windows: its windows) filled before cuInit, so that the driver's own areas
  can land only there (steer-nospare: with no room left for the driver's small mappings);
- align: plain, with the alignment equal to the window (the size rounded up to a power of two);
- whole: plain, reserving each of the program's driver areas whole at its start;
- far: a hint at a never-used address (0x600000000000); where a hint of 0 lands; hints just inside,
  in the middle of, and just outside the validator driver's own new areas (from diffing its maps
  across cuInit and the context);
- zygote: a child forked by the program before its cuInit (so with the program's layout then),
  initialised only after the program allocated.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuos_tools.agent import vaspace

MiB, GiB = 1 << 20, 1 << 30
WAYS = ("plain", "hold", "late", "steer", "steer-nospare", "steer-windows", "align", "whole", "far")
CHILD_TIMEOUT_S = 12.0
TOTAL_S = 55.0
FAR = 0x600000000000


def drv():
    from cuda.bindings import driver

    return driver


def ok(res, what: str):
    d = drv()
    if res[0] != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {getattr(res[0], 'name', res[0])}")
    return res[1] if len(res) == 2 else (res[1:] if len(res) > 2 else None)


def maps_text() -> list[vaspace.Mapping]:
    return vaspace.mappings()


def around(addr: int, size: int, maps: list[vaspace.Mapping], pad: int = 64 * MiB, limit: int = 12) -> list[str]:
    """The mappings within ``pad`` of [addr, addr + size), as text."""
    lines = [str(m) for m in maps if m.start < addr + size + pad and addr - pad < m.end]
    return lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])


def new_since(before: list[vaspace.Mapping], after: list[vaspace.Mapping], limit: int = 40) -> list[str]:
    old = {(m.start, m.end, m.perms, m.path) for m in before}
    lines = [str(m) for m in after if (m.start, m.end, m.perms, m.path) not in old]
    return lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])


def nvidia(maps: list[vaspace.Mapping]) -> list[str]:
    return [str(m) for m in maps if m.path.startswith("/dev/nvidia")]


def context():
    d = drv()
    ok(d.cuInit(0), "cuInit")
    dev = ok(d.cuDeviceGet(0), "cuDeviceGet")
    ctx = ok(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    ok(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return dev


def prop_for(dev):
    d = drv()
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = int(dev)
    gran = int(ok(d.cuMemGetAllocationGranularity(
        prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity"))
    return prop, gran


def try_reserve(dev, addr: int, size: int, align: int = 0, what: str = "") -> dict:
    """Reserve [addr, addr + size) with the address as the hint; map a granule there when exact."""
    d = drv()
    prop, gran = prop_for(dev)
    size = -(-size // gran) * gran
    out = {"what": what, "requested": hex(addr), "size": size, "align": align or gran}
    err, got = d.cuMemAddressReserve(size, align or gran, addr, 0)
    if err != d.CUresult.CUDA_SUCCESS:
        out["error"] = getattr(err, "name", str(err))
        out["maps_requested"] = around(addr, size, maps_text())
        return out
    got = int(got)
    out.update(granted=hex(got), exact=got == addr)
    maps = maps_text()
    out["maps_requested"] = around(addr, size, maps)
    if got != addr:
        out["maps_granted"] = around(got, size, maps)
    else:
        handle = ok(d.cuMemCreate(gran, prop, 0), "cuMemCreate")
        err = d.cuMemMap(got, gran, 0, handle, 0)[0]
        out["map"] = getattr(err, "name", str(err))
        if err == d.CUresult.CUDA_SUCCESS:
            d.cuMemUnmap(got, gran)
        d.cuMemRelease(handle)
    d.cuMemAddressFree(got, size)
    return out


# ------------------------------------------------------------------ the program

def program() -> None:
    """Allocate, report, then wait for a line on stdin before exiting."""
    zr, zw = os.pipe()  # targets to the zygote
    rr, rw = os.pipe()  # its report back
    zygote = os.fork()
    if zygote == 0:  # before cuInit: the program's layout as it is now
        os.close(zw)
        os.close(rr)
        with os.fdopen(zr) as f:
            line = f.readline()
        rep = {}
        try:
            if line:
                rep = validator_way("zygote", json.loads(line))
        except Exception as exc:  # noqa: BLE001 - a probe reports whatever went wrong
            rep = {"error": repr(exc)}
        try:
            with os.fdopen(rw, "w") as f:
                f.write(json.dumps(rep))
        except BrokenPipeError:  # the program is gone
            pass
        os._exit(0)
    os.close(zr)
    os.close(rw)
    d = drv()
    m0 = maps_text()
    ok(d.cuInit(0), "cuInit")
    m1 = maps_text()
    dev = ok(d.cuDeviceGet(0), "cuDeviceGet")
    ctx = ok(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    ok(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    m2 = maps_text()
    free, total = (int(x) for x in ok(d.cuMemGetInfo(), "cuMemGetInfo"))
    prop, gran = prop_for(dev)
    allocs = []
    for size in (2 * MiB, 32 * MiB, GiB):
        if size == GiB and free < 8 * GiB:
            continue
        allocs.append({"how": "cuMemAlloc", "size": size, "addr": int(ok(d.cuMemAlloc(size), "cuMemAlloc"))})
    for size in (gran, 64 * MiB):
        handle = ok(d.cuMemCreate(size, prop, 0), "cuMemCreate")
        addr = int(ok(d.cuMemAddressReserve(size, gran, 0, 0), "cuMemAddressReserve"))
        ok(d.cuMemMap(addr, size, 0, handle, 0), "cuMemMap")
        desc = d.CUmemAccessDesc()
        desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = int(dev)
        desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        ok(d.cuMemSetAccess(addr, size, [desc], 1), "cuMemSetAccess")
        allocs.append({"how": "vmm", "size": size, "addr": addr})
    m3 = maps_text()
    pairs = [(a["addr"], a["size"]) for a in allocs]
    for a in allocs:
        a["maps"] = around(a["addr"], a["size"], m3)
        a["addr_hex"] = hex(a["addr"])
    report = {
        "pid": os.getpid(), "granularity": gran, "free": free, "total": total,
        "driver": int(ok(d.cuDriverGetVersion(), "cuDriverGetVersion")),
        "allocs": allocs, "new_at_init": new_since(m0, m1), "new_at_context": new_since(m1, m2),
        "new_at_allocs": new_since(m2, m3), "nvidia": nvidia(m3),
        "windows": vaspace.program_windows(pairs, m3), "areas": vaspace.driver_areas(pairs, m3),
        "mappings": len(m3), "maps": [str(m) for m in m3][:1500],
    }
    targets = {"allocs": [[a["addr"], a["size"], a["how"]] for a in allocs],
               "windows": report["windows"], "areas": report["areas"]}
    with os.fdopen(zw, "w") as f:
        f.write(json.dumps(targets) + "\n")
    text = _read_all(rr, CHILD_TIMEOUT_S)
    if text is None:
        os.kill(zygote, 9)
        text = json.dumps({"error": f"timed out after {CHILD_TIMEOUT_S:g} s"})
    os.waitpid(zygote, 0)
    try:
        report["zygote"] = json.loads(text) if text else {"error": "no report"}
    except ValueError:
        report["zygote"] = {"error": text[:500]}
    print(json.dumps({"report": report, "targets": targets}), flush=True)
    sys.stdin.readline()  # the parent says when the validators are done


def _read_all(fd: int, timeout: float) -> str | None:
    """Everything from ``fd`` up to its end, or None when it does not end in time."""
    deadline, parts = time.monotonic() + timeout, []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            os.close(fd)
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            os.close(fd)
            return b"".join(parts).decode()
        parts.append(chunk)


# ------------------------------------------------------------------ a validator

def validator_way(way: str, targets: dict) -> dict:
    d = drv()
    windows = [(a, n) for a, n in targets["windows"]]
    areas = [(a, n) for a, n in targets["areas"]]
    out: dict = {"way": way, "tries": []}
    strategy = None
    if way in ("hold", "steer", "steer-nospare", "steer-windows"):
        strategy = vaspace.AddressStrategy("hold" if way == "hold" else "steer", windows,
                                           [] if way == "steer-windows" else areas,
                                           spare=0 if way == "steer-nospare" else vaspace.SPARE)
        strategy.start()
    elif way == "late":
        strategy = vaspace.AddressStrategy("plain", windows, areas)
    t0 = time.perf_counter()
    d.cuDriverGetVersion()  # loads libcuda
    if strategy is not None:
        strategy.before_init()
    m0 = maps_text()
    if strategy is not None and strategy.fill is not None:  # what the filling left free
        gaps = vaspace.free_gaps(vaspace.STEER_LOW, vaspace.STEER_HIGH, m0)
        out["left_free"] = [f"{a:#x}-{b:#x} ({(b - a) >> 20} MiB)" for a, b in gaps][:30]
    ok(d.cuInit(0), "cuInit")
    m1 = maps_text()
    dev = context()
    m2 = maps_text()
    if strategy is not None:
        strategy.after_init()
    out["init_s"] = round(time.perf_counter() - t0, 3)
    out["new_at_init"] = new_since(m0, m1)
    out["new_at_context"] = new_since(m1, m2)
    out["nvidia"] = nvidia(m2)
    if strategy is not None:
        out["notes"] = strategy.notes
    space = strategy.space if strategy is not None else None
    _, gran = prop_for(dev)
    if way == "whole":
        for a, n in areas:
            out["tries"].append(try_reserve(dev, a, n, what="area"))
    if way == "far":
        out["tries"].append(try_reserve(dev, FAR, 2 * MiB, what="far"))
        out["tries"].append(try_reserve(dev, 0, 2 * MiB, what="hint 0"))
        old = {(m.start, m.end) for m in m0}
        grown = sorted((m for m in m2 if (m.start, m.end) not in old and m.end - m.start >= 256 * MiB),
                       key=lambda m: m.start - m.end)[:3]  # the three largest new mappings
        for m in grown:
            lo = -(-m.start // gran) * gran
            hi = m.end // gran * gran
            mid = (lo + hi) // 2 // gran * gran
            for what, addr in (("just inside", lo), ("middle", mid), ("last granule", hi - gran),
                               ("just below", lo - 2 * gran), ("just above", hi + gran)):
                out["tries"].append(try_reserve(dev, addr, gran, what=f"{what} {m}"))
    else:
        for addr, size, how in targets["allocs"]:
            if space is not None:
                space.release(addr, size)
            align = 0
            if way == "align":
                align = 1 << max(0, (size - 1).bit_length())
            out["tries"].append(try_reserve(dev, addr, size, align, what=f"{how} {size}"))
    out["exact"] = f"{sum(bool(t.get('exact')) for t in out['tries'])}/{len(out['tries'])} exact"
    return out


# ------------------------------------------------------------------ the parent

def main(out_path: str) -> int:
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    me = [sys.executable, str(Path(__file__).resolve())]
    result: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "ways": {}}
    prog = subprocess.Popen([*me, "--program"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        # the program (and its zygote) must report in time: a hung driver call must not hang the probe
        if not select.select([prog.stdout], [], [], 2 * CHILD_TIMEOUT_S)[0]:
            prog.kill()
            result["error"] = f"the program did not report within {2 * CHILD_TIMEOUT_S:g} s"
            return _write(out_path, result, 1)
        line = prog.stdout.readline()
        if not line:
            result["error"] = f"the program ended (status {prog.wait(timeout=10)})"
            return _write(out_path, result, 1)
        got = json.loads(line)
        result["program"], targets = got["report"], got["targets"]
        tfile = Path(tempfile.mkdtemp(prefix="probe-va-")) / "targets.json"
        tfile.write_text(json.dumps(targets))
        for way in WAYS:
            if time.monotonic() - t0 > TOTAL_S - CHILD_TIMEOUT_S:
                result["ways"][way] = {"skipped": "out of time"}
                continue
            try:
                p = subprocess.run([*me, "--validator", way, str(tfile)], capture_output=True, text=True,
                                   env=env, timeout=CHILD_TIMEOUT_S)
                result["ways"][way] = (json.loads(p.stdout) if p.returncode == 0 and p.stdout.strip()
                                       else {"error": f"status {p.returncode}: {p.stderr[-1500:]}"})
            except subprocess.TimeoutExpired:
                result["ways"][way] = {"error": f"timed out after {CHILD_TIMEOUT_S:g} s"}
            except ValueError as exc:
                result["ways"][way] = {"error": f"bad output: {exc}"}
        tfile.unlink(missing_ok=True)
        tfile.parent.rmdir()
    finally:
        try:
            prog.stdin.write("done\n")
            prog.stdin.close()
            prog.wait(timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            prog.kill()
    result["ways"]["zygote"] = result.get("program", {}).pop("zygote", {"error": "no report"})
    result["wall_s"] = round(time.monotonic() - t0, 2)
    for way, rep in result["ways"].items():
        print(f"{way:14s} {rep.get('exact', rep.get('error', rep.get('skipped', '?')))[:150]}", file=sys.stderr)
    return _write(out_path, result, 0)


def _write(path: str, result: dict, rc: int) -> int:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)
    return rc


if __name__ == "__main__":
    if sys.argv[1:2] == ["--program"]:
        program()
    elif sys.argv[1:2] == ["--validator"]:
        try:
            rep = validator_way(sys.argv[2], json.loads(Path(sys.argv[3]).read_text()))
        except Exception as exc:  # noqa: BLE001 - a probe reports whatever went wrong
            rep = {"error": repr(exc)}
        print(json.dumps(rep))
    elif len(sys.argv) == 2 and not sys.argv[1].startswith("-"):
        sys.exit(main(sys.argv[1]))
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
