#!/usr/bin/env python3
"""Where does this driver let a second process reserve a device virtual address that a first
process (the "program") uses, and why not elsewhere? The validator replays a program's launch at
the program's addresses (gpuos_tools/agent/replay.py); ``cuMemAddressReserve`` takes the address
only as a hint. One JSON report to the path given, a short table on stderr (one line a way):

    probe_validator_va.py [--program-kind simple|torch|cupy] OUT.json

The program child makes its context and allocates as its kind says:

- simple (default): cuInit and the primary context, then cuMemAlloc (2 MiB, 32 MiB, 1 GiB when
  8 GiB are free) and the VMM API (cuMemCreate, cuMemAddressReserve at no hint, cuMemMap);
- torch / cupy: the framework's own first call makes the context (``torch.zeros(1,
  device="cuda")``; ``cupy.arange``), a small matmul (and for CuPy an FFT) loads its libraries,
  then arrays of 120 KB (two), 2 MiB, 32 MiB and 1 GiB (when 8 GiB are free) come from the
  framework's allocator. In the report ``new_at_init`` is then what the first call mapped
  (cuInit and the context together) and ``new_at_context`` what the libraries mapped. A kind whose
  framework does not import is skipped, and the report says so.

It reports its /proc/self/maps around the allocations, every mapping of /dev/nvidia*, what the
driver mapped at each step, and the windows and driver areas the program's side of validation
would name (gpuos_tools/agent/vaspace.py). Then validators, each a fresh process, one per way,
try to reserve the program's addresses with cuMemAddressReserve(hint = the address) and record
requested vs granted and the maps around both (an exact grant is mapped with one granule to be
sure it is usable):

- areas: context first; for each program driver area, this process's mappings over it and when
  each appeared (before cuInit, at cuInit, with the context), then the area taken as the
  validator's ``whole`` strategy takes it (Replayer.take_areas: whole, else halves down to
  granules), the runs held and refused (with the maps over each refused run), and for each
  program allocation whether it lies in a held run;
- inside-own: context first; 2 MiB hints at the start, 1/4, 1/2, 3/4 and just below the end of
  each of this process's own driver areas (its new anonymous no-access mappings): whether the
  driver honours a hint inside its own area at all, and where;
- plain: context first, then the hints;
- whole: plain, reserving each of the program's driver areas whole at its start;
- far: a hint at a never-used address (0x600000000000); where a hint of 0 lands; hints just inside,
  in the middle of, and just outside the validator driver's own new areas (from diffing its maps
  across cuInit and the context);
- align: plain, with the alignment equal to the window (the size rounded up to a power of two);
- hold: the program's windows held with placeholders before the driver loads, lifted to reserve;
- late: context first, then the windows held, lifted to reserve;
- steer, steer-nospare, steer-windows: every free part of the address space but the program's
  driver areas (steer-windows: its windows) filled before cuInit, so that the driver's own areas
  can land only there (steer-nospare: with no room left for the driver's small mappings);
- zygote: a child forked by the program first of all (before its framework and its driver load,
  so with the program's layout then), initialised only after the program allocated;
- zygote-late: the same, forked after the framework's import and before its first CUDA call,
  where a real tool could fork it (for ``simple`` the framework is the driver bindings, so it
  differs from zygote only by their import);
- zygote-fill: a zygote-late that keeps what it gets, and where the hint is not honoured (an
  address inside one of its driver's own areas) fills the area from where the driver hands out
  next (a reservation with no hint, given back) down to the target's end, then asks for the
  target: whether the driver's allocator inside an area is a first fit from the top, so that
  filling steers it. It first records where three reservations with no hint land (the order).

A framework's block may start inside a granule: its hint is the granule-rounded range around it.
Time: ``simple`` took about 20 s on an H100 before areas, inside-own and zygote-late were added
(each way is a fresh process and context, a second or two more); ``torch`` and ``cupy`` add the
framework's import and start to the program, not yet measured (``phases_s`` in the report and the
table's first line give them). The ways run while the whole stays under TOTAL_S (55 s); one that
would not start in time is reported skipped, and they run in the order of WAYS.
"""

from __future__ import annotations

import argparse
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
#: the validator children, in the order they run (what says most first, should time run out)
WAYS = ("areas", "inside-own", "plain", "whole", "far", "align", "hold", "late", "steer", "steer-nospare",
        "steer-windows")
CHILD_TIMEOUT_S = 12.0
#: the program's start, its framework's included, and its two zygotes
PROGRAM_TIMEOUT_S = 40.0
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

KINDS = ("simple", "torch", "cupy")
#: what the framework programs allocate: two small tensors (from the framework's small-block pool),
#: then one each of its large-block sizes; 1 GiB only when 8 GiB are free
FRAMEWORK_SIZES = (120_000, 120_000, 2 * MiB, 32 * MiB, GiB)


class Zygote:
    """A child forked now that waits for the targets, then runs ``validator_way(way, targets)`` with
    the layout of this process as it was at the fork, and writes its report back."""

    open_fds: list[int] = []  #: the parent's ends of every zygote's pipes (closed in each later child)

    def __init__(self, way: str) -> None:
        self.way = way
        zr, zw = os.pipe()  # targets to the zygote
        rr, rw = os.pipe()  # its report back
        self.pid = os.fork()
        if self.pid == 0:
            for fd in [zw, rr, *Zygote.open_fds]:
                os.close(fd)
            with os.fdopen(zr) as f:
                line = f.readline()
            rep = {}
            try:
                if line:
                    rep = validator_way(way, json.loads(line))
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
        self.zw, self.rr = zw, rr
        Zygote.open_fds += [zw, rr]

    def run(self, targets: dict | None) -> dict:
        """Hand it the targets (None: nothing to do, it ends) and take its report."""
        try:
            with os.fdopen(self.zw, "w") as f:
                if targets is not None:
                    f.write(json.dumps(targets) + "\n")
        except BrokenPipeError:
            pass
        text = _read_all(self.rr, CHILD_TIMEOUT_S)
        Zygote.open_fds = [fd for fd in Zygote.open_fds if fd not in (self.zw, self.rr)]
        if text is None:
            os.kill(self.pid, 9)
            text = json.dumps({"error": f"timed out after {CHILD_TIMEOUT_S:g} s"})
        os.waitpid(self.pid, 0)
        try:
            return json.loads(text) if text else {"error": "no report"}
        except ValueError:
            return {"error": text[:500]}


def import_framework(kind: str):
    """The framework's module (the driver bindings for ``simple``); ImportError when it is not there."""
    if kind == "torch":
        import torch

        return torch
    if kind == "cupy":
        import cupy

        return cupy
    return drv()


def first_call(kind: str, fw) -> None:
    """The framework's first CUDA call: the driver starts and the context is made its way."""
    if kind == "torch":
        fw.zeros(1, device="cuda")
        fw.cuda.synchronize()
    elif kind == "cupy":
        fw.arange(16)
        fw.cuda.Device().synchronize()
    else:
        ok(fw.cuInit(0), "cuInit")


def libraries(kind: str, fw) -> dict:
    """Load the framework's libraries the way a real program does (cuBLAS, cuFFT); what each did."""
    out: dict = {}
    calls = {"torch": {"matmul": lambda: fw.ones(64, 64, device="cuda") @ fw.ones(64, 64, device="cuda")},
             "cupy": {"fft": lambda: fw.fft.fft(fw.arange(1024, dtype=fw.complex64)),
                      "matmul": lambda: fw.ones((64, 64), dtype=fw.float32) @ fw.ones((64, 64), dtype=fw.float32)}}
    for name, call in calls.get(kind, {}).items():
        try:
            call()
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - a probe reports whatever went wrong
            out[name] = repr(exc)[:300]
    if kind == "torch":
        fw.cuda.synchronize()
    elif kind == "cupy":
        fw.cuda.Device().synchronize()
    return out


def framework_allocs(kind: str, fw, free: int, keep: list) -> list[dict]:
    """Allocate through the framework (arrays kept alive in ``keep``): [{how, size, addr}]."""
    allocs = []
    for size in FRAMEWORK_SIZES:
        if size == GiB and free < 8 * GiB:
            continue
        if kind == "torch":
            t = fw.empty(size, dtype=fw.uint8, device="cuda")
            addr = t.data_ptr()
        else:
            t = fw.empty(size, dtype=fw.uint8)
            addr = t.data.ptr
        keep.append(t)
        allocs.append({"how": kind, "size": size, "addr": int(addr)})
    return allocs


def simple_allocs(dev, free: int) -> list[dict]:
    """cuMemAlloc and VMM allocations: [{how, size, addr}]."""
    d = drv()
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
    return allocs


def program(kind: str) -> None:
    """Allocate, report, then wait for a line on stdin before exiting."""
    t0 = time.perf_counter()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        phases[name] = round(time.perf_counter() - t0 - sum(phases.values()), 3)

    zygote = Zygote("zygote")  # before the framework and the driver: the program's layout as it is now
    try:
        fw = import_framework(kind)
    except ImportError as exc:
        zygote.run(None)
        print(json.dumps({"skipped": f"{kind}: the framework is not importable here ({exc})"}), flush=True)
        return
    phase("import")
    m_import = maps_text()
    late = Zygote("zygote-late")  # after the framework's import, before its first CUDA call
    fill = Zygote("zygote-fill")
    d = drv()
    m0 = maps_text()
    first_call(kind, fw)
    m1 = maps_text()
    phase("first_call")
    loaded = libraries(kind, fw)
    # the primary context (the one a framework made, the same one retained again) current for the
    # driver bindings' own calls below
    ok(d.cuInit(0), "cuInit")
    dev = ok(d.cuDeviceGet(0), "cuDeviceGet")
    ctx = ok(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    ok(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    m2 = maps_text()
    phase("context")
    free, total = (int(x) for x in ok(d.cuMemGetInfo(), "cuMemGetInfo"))
    _, gran = prop_for(dev)
    keep: list = []
    allocs = simple_allocs(dev, free) if kind == "simple" else framework_allocs(kind, fw, free, keep)
    m3 = maps_text()
    phase("allocs")
    pairs = [(a["addr"], a["size"]) for a in allocs]
    for a in allocs:
        a["maps"] = around(a["addr"], a["size"], m3)
        a["addr_hex"] = hex(a["addr"])
    report = {
        "kind": kind, "pid": os.getpid(), "granularity": gran, "free": free, "total": total,
        "driver": int(ok(d.cuDriverGetVersion(), "cuDriverGetVersion")), "libraries": loaded,
        "allocs": allocs, "nvidia_at_import": nvidia(m_import),
        # a framework's first call and libraries map many files: room for them all
        "new_at_init": new_since(m0, m1, limit=300), "new_at_context": new_since(m1, m2, limit=300),
        "new_at_allocs": new_since(m2, m3), "nvidia": nvidia(m3),
        "windows": vaspace.program_windows(pairs, m3), "areas": vaspace.driver_areas(pairs, m3),
        "mappings": len(m3), "maps": [str(m) for m in m3][:5000],
    }
    targets = {"allocs": [[a["addr"], a["size"], a["how"]] for a in allocs],
               "windows": report["windows"], "areas": report["areas"]}
    report["zygote"] = zygote.run(targets)
    report["zygote-late"] = late.run(targets)
    report["zygote-fill"] = fill.run(targets)
    phase("zygotes")
    report["phases_s"] = phases
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

def when_mapped(lo: int, hi: int, m0: list[vaspace.Mapping], m1: list[vaspace.Mapping],
                m2: list[vaspace.Mapping], limit: int = 40) -> list[str]:
    """This process's mappings over [lo, hi) (from ``m2``), each with when it appeared: before
    cuInit (``m0``), at cuInit (``m1``) or with the context; a mapping the driver split or
    changed counts as new."""
    keys = [{(m.start, m.end, m.perms, m.path) for m in ms} for ms in (m0, m1)]
    lines = []
    for m in m2:
        if m.start < hi and lo < m.end:
            key = (m.start, m.end, m.perms, m.path)
            when = "before cuInit" if key in keys[0] else "new at cuInit" if key in keys[1] else "new at the context"
            lines.append(f"{m} [{when}]")
    return lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])


class ProbeDevice:
    """What Replayer.take_areas asks of a device (its granularity, a reservation at a hint, giving
    one back), on this process's context; each refusal counted by its error."""

    def __init__(self, granularity: int) -> None:
        self.granularity = granularity
        self.calls = 0
        self.errors: dict[str, int] = {}

    def reserve(self, addr: int, size: int) -> int:
        d = drv()
        self.calls += 1
        err, got = d.cuMemAddressReserve(size, self.granularity, addr, 0)
        if err != d.CUresult.CUDA_SUCCESS:
            name = getattr(err, "name", str(err))
            self.errors[name] = self.errors.get(name, 0) + 1
            return -1  # never an address asked for: the Replayer counts it refused
        return int(got)

    def free_address(self, addr: int, size: int) -> None:
        if addr >= 0:
            drv().cuMemAddressFree(addr, size)


def take_program_areas(replayer_cls, gran: int, targets: dict, m0, m1, m2) -> dict:
    """The ``areas`` way: what of this process sits in each program driver area, then each area
    taken as the validator's ``whole`` strategy takes it (Replayer.take_areas), the runs held and
    refused, and which program allocations lie in a held run."""
    device = ProbeDevice(gran)
    replayer = replayer_cls(device, whole=True)
    t = time.perf_counter()
    replayer.take_areas(targets["areas"])
    took = time.perf_counter() - t
    held = vaspace.merge((s, s + n) for s, n in replayer.reserved.items())
    maps = maps_text()

    def run(s: int, e: int) -> str:
        return f"{s:#x}-{e:#x} ({(e - s) / MiB:g} MiB)"

    areas = []
    for (lo, hi), refused in replayer.areas.items():
        mine = [(max(s, lo), min(e, hi)) for s, e in held if s < hi and lo < e]
        areas.append({
            "area": run(lo, hi), "own_mappings": when_mapped(lo, hi, m0, m1, m2),
            "held": [run(s, e) for s, e in mine], "held_bytes": sum(e - s for s, e in mine),
            "refused_runs": len(refused), "refused_bytes": sum(e - s for s, e, _, _ in refused),
            "refused": [{"run": run(s, e), "by": by, "why": why, "maps": around(s, e - s, maps, pad=0, limit=6)}
                        for s, e, by, why in refused[:30]],
        })
    allocs = []
    for addr, size, how in targets["allocs"]:
        lo, hi = vaspace.round_out(addr, addr + size, gran)
        allocs.append({"what": f"{how} {size}", "addr": hex(addr),
                       "held": any(s <= lo and hi <= e for s, e in held),
                       "refused": [run(s, e) for r in replayer.areas.values() for s, e, _, _ in r
                                   if s < hi and lo < e][:8]})
    replayer.close()
    n = sum(a["held"] for a in allocs)
    got = sum(a["held_bytes"] for a in areas)
    total = sum(hi - lo for lo, hi in replayer.areas)
    return {"areas": areas, "allocs": allocs, "reserve_calls": device.calls, "reserve_errors": device.errors,
            "take_s": round(took, 3),
            "summary": f"{n}/{len(allocs)} allocations in held runs; held {got / MiB:g} of {total / MiB:g} MiB "
                       f"in {len(areas)} area(s)"}


#: where ``inside-own`` puts its hints in each of this process's own driver areas
INSIDE = (("start", 0, 4), ("1/4", 1, 4), ("1/2", 2, 4), ("3/4", 3, 4), ("end", 4, 4))


def own_driver_areas(m0: list[vaspace.Mapping], m2: list[vaspace.Mapping], gran: int,
                     limit: int = 4) -> list[list[int]]:
    """[addr, size] of this process's own driver areas, largest first: the runs of driver mappings
    (vaspace.driver_areas) around each anonymous no-access mapping new since before cuInit."""
    old = {(m.start, m.end, m.perms, m.path) for m in m0}
    new = [m for m in m2 if (m.start, m.end, m.perms, m.path) not in old and m.perms.startswith("---")
           and (not m.path or m.path.startswith("[anon")) and m.end - m.start >= 4 * gran]
    runs = vaspace.driver_areas([(m.start, 1) for m in new], m2)
    return sorted(runs, key=lambda r: -r[1])[:limit]


def inside_own(dev, gran: int, m0, m2) -> tuple[list[dict], str]:
    """The ``inside-own`` way: 2 MiB hints at the start, 1/4, 1/2, 3/4 and just below the end of
    each of this process's own driver areas; the tries and a one-line account."""
    tries, words = [], []
    for a, n in own_driver_areas(m0, m2, gran):
        lo, hi = -(-a // gran) * gran, (a + n) // gran * gran
        marks = []
        for label, k, of in INSIDE:
            addr = min((lo + (hi - lo) * k // of) // gran * gran, hi - 2 * MiB)
            t = try_reserve(dev, addr, 2 * MiB, what=f"{label} of {a:#x}-{a + n:#x}")
            t["area"] = [a, n]
            tries.append(t)
            marks.append(("+" if t.get("exact") else "-") + label)
        words.append(f"[{a:#x} {n / MiB:g} MiB: {' '.join(marks)}]")
    exact = sum(bool(t.get("exact")) for t in tries)
    return tries, f"{exact}/{len(tries)} exact " + (" ".join(words) if words else "(no own driver area found)")


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
    replayer_cls = None
    if way == "areas":  # before the driver, as the validator loads it
        from gpuos_tools.agent.replay import Replayer as replayer_cls
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
    if way == "areas":
        out.pop("tries")
        out.update(take_program_areas(replayer_cls, gran, targets, m0, m1, m2))
        return out
    if way == "inside-own":
        out["tries"], out["summary"] = inside_own(dev, gran, m0, m2)
        return out
    if way == "zygote-fill":
        out["order"], out["tries"] = fill_take(dev, gran, targets)
        out["exact"] = f"{sum(bool(t.get('exact')) for t in out['tries'])}/{len(out['tries'])} exact"
        return out
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
            lo, hi = vaspace.round_out(addr, addr + size, gran)  # a framework's block may start inside a granule
            if space is not None:
                space.release(lo, hi - lo)
            align = 0
            if way == "align":
                align = 1 << max(0, (hi - lo - 1).bit_length())
            out["tries"].append(try_reserve(dev, lo, hi - lo, align, what=f"{how} {size}"))
    out["exact"] = f"{sum(bool(t.get('exact')) for t in out['tries'])}/{len(out['tries'])} exact"
    return out


def fill_take(dev, gran: int, targets: dict) -> tuple[list[str], list[dict]]:
    """zygote-fill's tries (module docstring): each target kept once got; the order of three
    reservations with no hint first."""
    d = drv()

    def reserve(size: int, hint: int) -> int:
        err, got = d.cuMemAddressReserve(size, gran, hint, 0)
        return int(got) if err == d.CUresult.CUDA_SUCCESS else -1

    order = [reserve(gran, 0) for _ in range(3)]
    for a in order:
        if a >= 0:
            d.cuMemAddressFree(a, gran)
    held: list[tuple[int, int]] = []
    tries: list[dict] = []
    for addr, size, how in targets["allocs"]:
        lo, hi = vaspace.round_out(addr, addr + size, gran)
        t: dict = {"what": f"{how} {size}", "requested": hex(lo), "size": hi - lo}
        tries.append(t)
        if any(a <= lo and hi <= a + n for a, n in held):
            t.update(exact=True, how="held already")
            continue
        got = reserve(hi - lo, lo)
        if got == lo:
            t.update(exact=True, how="hint")
            held.append((lo, hi - lo))
            continue
        if got >= 0:
            d.cuMemAddressFree(got, hi - lo)
        t["hint_got"] = hex(got) if got >= 0 else "refused"
        nxt = reserve(gran, 0)  # where the driver hands out next
        if nxt >= 0:
            d.cuMemAddressFree(nxt, gran)
        t["next"] = hex(nxt)
        top = nxt + gran
        if nxt < 0 or top < hi:
            t.update(exact=False, how="the target lies above where the driver hands out next")
            continue
        filler = top - hi
        f = reserve(filler, hi) if filler else hi
        t["filler"] = f"{filler >> 20} MiB at {f:#x}" if filler else "none"
        got = reserve(hi - lo, lo)
        t.update(granted=hex(got) if got >= 0 else "refused", exact=got == lo, how="fill")
        if filler and f >= 0:
            d.cuMemAddressFree(f, filler)
        if got == lo:
            held.append((lo, hi - lo))
        elif got >= 0:
            d.cuMemAddressFree(got, hi - lo)
    for a, n in held:
        d.cuMemAddressFree(a, n)
    return [hex(a) for a in order], tries


# ------------------------------------------------------------------ the parent

def main(out_path: str, kind: str = "simple") -> int:
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    me = [sys.executable, str(Path(__file__).resolve())]
    result: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "kind": kind, "ways": {}}
    prog = subprocess.Popen([*me, "--program", kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        # the program (and its zygotes) must report in time: a hung driver call must not hang the probe
        if not select.select([prog.stdout], [], [], PROGRAM_TIMEOUT_S)[0]:
            prog.kill()
            result["error"] = f"the program did not report within {PROGRAM_TIMEOUT_S:g} s"
            return _write(out_path, result, 1)
        line = prog.stdout.readline()
        if not line:
            result["error"] = f"the program ended (status {prog.wait(timeout=10)})"
            return _write(out_path, result, 1)
        got = json.loads(line)
        if "skipped" in got:
            result["skipped"] = got["skipped"]
            print(f"skipped: {got['skipped']}", file=sys.stderr)
            return _write(out_path, result, 0)
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
    for way in ("zygote", "zygote-late", "zygote-fill"):
        result["ways"][way] = result.get("program", {}).pop(way, {"error": "no report"})
    result["wall_s"] = round(time.monotonic() - t0, 2)
    print(f"{kind}: program {result['program'].get('phases_s')}, {result['wall_s']} s in all", file=sys.stderr)
    for way, rep in result["ways"].items():
        line = rep.get("summary", rep.get("exact", rep.get("error", rep.get("skipped", "?"))))
        print(f"{way:14s} {line[:150]}", file=sys.stderr)
    return _write(out_path, result, 0)


def _write(path: str, result: dict, rc: int) -> int:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)
    return rc


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--program-kind", choices=KINDS, default="simple",
                   help="how the program makes its context and allocates (default: %(default)s)")
    p.add_argument("out", help="the JSON report to write")
    return p


if __name__ == "__main__":
    if sys.argv[1:2] == ["--program"]:  # the children
        program(sys.argv[2] if len(sys.argv) > 2 else "simple")
    elif sys.argv[1:2] == ["--validator"]:
        try:
            rep = validator_way(sys.argv[2], json.loads(Path(sys.argv[3]).read_text()))
        except Exception as exc:  # noqa: BLE001 - a probe reports whatever went wrong
            rep = {"error": repr(exc)}
        print(json.dumps(rep))
    else:
        args = parser().parse_args()
        sys.exit(main(args.out, args.program_kind))
