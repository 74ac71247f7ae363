"""The online policy (online.py) driven launch by launch against the simulator's time model, on
the CPU: how its plans (``count``, ``time``) would fare, before a GPU says.

Each step of a workload (workload.py; use whole allocations as chunks, ``Chunks(None)``: the
online policy's records are allocations) is one decision of `OnlinePolicy.before`, made the way
the executor makes it inside a program, and its actions are timed as simulate.py times a plan:

- The host runs at most ``host_ahead`` launches ahead of the GPU (a launch is enqueued, and
  decided, once the launch that many before it has started), and waits on the host when a
  require must wait for room, as the executor's program thread does.
- Two copy engines, one per direction, first-in first-out at `Config`'s bandwidths.
- ``evict``: the engine orders the save after everything the program has enqueued (the steps
  before this one) and after the record's own load; a record written since its load is copied
  out, a clean one dropped; its room exists once that is done (the release).
- ``require`` and ``prefetch``: a load maps its record when the budget has room for it, in
  the order the loads were issued (a room clock that only moves forward, as the executor's
  load lock orders them), then copies in. Prefetches do not block the host; a require's wait
  for room does. A record first touched (never written) is mapped with nothing to copy.
- ``acting`` counts the decisions that move something (an eviction, a prefetch, a load on
  demand): under `run` on the native core the others' operations go by without entering Python.
- A step starts when the one before it ended, the host has enqueued it and its records'
  loads are done; the wait is a stall. After it ends, its GPU time is reported to the policy
  (``note_duration``) when ``feed`` is on: exactly, where the executor samples it.

Memory is physical: a record counts from its map until its release, so evictions in flight
hold room. Allocations (first touches) map at once whatever the budget, as a program's do, and
the next decisions evict down to it: ``peak_mapped`` is the most mapped at a decision's end or
a load's map from the first time mapped was within the budget after the last allocation or
step whose working set alone exceeds the budget (as the executor's ``peak_settled``);
``over_physical`` counts loads that mapped above the budget (no room was coming), outside those
steps too.
"""

from __future__ import annotations

import heapq
from typing import Any

from gpuos_tools.sched.online import OnlinePolicy
from gpuos_tools.sched.simulate import Config, simulate_planned
from gpuos_tools.sched.workload import Chunks, Job, Step, Workload, working_footprint


def simulate_online(w: Workload, cfg: Config, plan: str = "count", lookahead: int = 2, policy: str = "belady",
                    host_ahead: int = 1, feed: bool = True, proactive: bool = False,
                    events: list[tuple] | None = None, fraction: float | None = None,
                    batch: int = 1) -> dict[str, Any]:
    """The summary of the online policy with ``plan`` on ``w`` under ``cfg.budget`` bytes (or,
    with ``fraction``, a percentage budget as `run --budget N%` takes it: the policy's own).

    ``events``, when given, gets one tuple per move, for accounting (gpuos_tools/sched/moves.py):
    ``("load", step, record, bytes copied, demand, period known at the decision)`` and
    ``("evict", step, record, bytes saved, period known, resident records at the decision)``."""
    sizes = w.chunks.sizes
    pol = OnlinePolicy(None if fraction is not None else cfg.budget, policy, lookahead, plan=plan,
                       proactive=proactive, fraction=fraction, batch=batch)
    pol.note_bandwidth(cfg.h2d_bw, cfg.d2h_bw)
    budget = cfg.budget
    h2d, d2h = cfg.h2d_bw, cfg.d2h_bw
    live: dict[int, int] = {}
    version = 0
    ready: dict[int, float] = {}  #: record -> when its last load completes
    last_end: dict[int, float] = {}  #: record -> end of the last step that used it
    mapped_now: set[int] = set()  #: records mapped (resident or being loaded or saved)
    dirty: set[int] = set()  #: written since their last load
    populated: set[int] = set()  #: hold data (a load copies them)
    releases: list[tuple[float, int]] = []  #: (time, bytes) of evictions not yet released
    mapped = 0  #: bytes mapped as of the room clock (releases up to it counted)
    room_t = 0.0
    h2d_free = d2h_free = 0.0
    starts: list[float] = []
    prev_end = 0.0
    host_t = 0.0
    compute = stall_s = 0.0
    stalls = bytes_in = bytes_out = dropped = 0
    demand = prefetch = evictions = room_waits = over_physical = acting = 0
    room_wait_s = stall_known = 0.0
    peak = 0
    settled = True  #: mapped has been within the budget since the last allocation

    def take_room(t0: float, size: int, over: bool = False) -> float:
        """When ``size`` bytes can be mapped, at ``t0`` or later, after the loads before it
        (``over``: a step's working set larger than the budget, which loads anyway)."""
        nonlocal mapped, room_t, over_physical
        t = t0 if t0 > room_t else room_t
        while releases and releases[0][0] <= t:
            mapped -= heapq.heappop(releases)[1]
        while mapped + size > budget and releases:
            rt, n = heapq.heappop(releases)
            mapped -= n
            if rt > t:
                t = rt
        if mapped + size > budget and not over:
            over_physical += 1
        mapped += size
        room_t = t
        return t

    def load(b: int, t0: float, over: bool = False) -> tuple[float, float]:
        """Map and copy in record ``b`` from ``t0``: (when it was mapped, when it is loaded)."""
        nonlocal h2d_free, bytes_in, peak
        size = live[b]
        t = take_room(t0, size, over)
        if settled and not over:
            peak = max(peak, mapped)
        mapped_now.add(b)
        if b in populated:
            s = t if t > h2d_free else h2d_free
            h2d_free = s + size / h2d
            bytes_in += size
            done = h2d_free
        else:
            done = t
        ready[b] = done
        dirty.discard(b)
        return t, done

    for i, st in enumerate(w.steps):
        dec = host_t
        if i >= host_ahead and starts[i - host_ahead] > dec:
            dec = starts[i - host_ahead]
        for c in st.frees:
            if c in live:
                del live[c]
                version += 1
                if c in mapped_now:
                    mapped_now.discard(c)
                    heapq.heappush(releases, (dec, sizes[c]))
                populated.discard(c)
                dirty.discard(c)
        for c in st.ws:
            if c not in live:  # an allocation: mapped by the allocator at once
                live[c] = sizes[c]
                version += 1
                mapped_now.add(c)
                take_room(dec, 0, True)  # (the releases due by now counted)
                mapped += sizes[c]
                ready[c] = dec
                settled = False
        known_before = pol.period.known is not None
        actions = pol.before(st.kernel or st.of, list(st.ws), live, version=version)
        if pol.last_budget < budget:  # a percentage budget shrank (a period learned): settle anew
            settled = False
        budget = pol.last_budget
        known = pol.period.known is not None
        resident = tuple(pol.resident) if events is not None and any(op == "evict" for op, _ in actions) else ()
        kid = pol.last_key
        enqueued = prev_end  # everything the program enqueued before this step ends then
        step_ready = dec
        over = len(st.ws) and sum(live[c] for c in st.ws) > budget
        # a decision that moves something: on the native core's fast path, the operations of the
        # others go by without entering Python (docs/native-core.md, "The fast path")
        acting += any(op != "require" or any(b not in mapped_now for b in st.ws) for op, _ in actions)
        for op, arg in actions:
            if op == "evict":
                b = arg
                size = live[b]
                t = max(dec, enqueued, ready.get(b, 0.0), last_end.get(b, 0.0))
                saved = b in dirty
                if saved:
                    s = t if t > d2h_free else d2h_free
                    d2h_free = s + size / d2h
                    bytes_out += size
                    t = d2h_free
                else:
                    dropped += size
                if events is not None:
                    events.append(("evict", i, b, size if saved else 0, known, resident))
                mapped_now.discard(b)
                heapq.heappush(releases, (t, size))
                evictions += 1
            elif op == "prefetch":
                if arg not in mapped_now:
                    if events is not None:
                        events.append(("load", i, arg, live[arg] if arg in populated else 0, False, known))
                    load(arg, dec)
                    prefetch += 1
            else:  # require
                for b in st.ws:
                    if b not in mapped_now:
                        if events is not None:
                            events.append(("load", i, b, live[b] if b in populated else 0, True, known))
                        t, done = load(b, dec, bool(over))
                        demand += 1
                        if t > dec:  # the program's thread waited for room
                            room_waits += 1
                            room_wait_s += t - dec
                            host_t = max(host_t, t)
                    if ready[b] > step_ready:
                        step_ready = ready[b]
        if over:
            settled = False  # its working set loaded above the budget: until the evictions after it
        else:
            if not settled and mapped <= budget:
                settled = True
            if settled:
                peak = max(peak, mapped)
        start = max(prev_end, step_ready, host_t)
        stall = start - prev_end
        if stall > 1e-12:
            stalls += 1
            stall_s += stall
            if pol.period.known is not None and known_before:
                stall_known += stall
        end = start + st.compute
        for c in st.ws:
            last_end[c] = end
        for c in st.writes:
            dirty.add(c)
            populated.add(c)
        starts.append(start)
        if feed:
            pol.note_duration(kid, st.compute)
        compute += st.compute
        prev_end = end
    bel = simulate_planned(w, "belady", Config(budget, h2d, d2h, lookahead=None))
    ps = pol.stats
    return {
        "type": "sched_online_sim", "plan": plan + ("+proactive" if proactive else ""), "policy": policy, "lookahead": lookahead, "batch": batch, "budget": budget,
        "footprint": w.footprint, "steps": len(w.steps), "compute_s": compute, "est_s": prev_end,
        "stall_s": stall_s, "stall_predicted_s": stall_known, "stalls": stalls, "speed_vs_in_memory": compute / prev_end if prev_end > 0 else 1.0,
        "bytes_in": bytes_in, "bytes_out": bytes_out, "bytes_dropped": dropped,
        "belady_bytes_in": bel["bytes_in"], "belady_bytes_out": bel["bytes_out"], "belady_est_s": bel["est_s"],
        "demand_loads": demand, "prefetches": prefetch, "evictions": evictions, "acting": acting,
        "proactive": ps.proactive,
        "walk_max": ps.walk_max, "room_waits": room_waits, "room_wait_s": room_wait_s, "peak_mapped": peak,
        "over_physical": over_physical, "over_budget": ps.over_budget, "periods": ps.periods[-4:],
        "predicted": ps.predicted,
    }


def blocked_gemm(rows: int = 4, inner: int = 3, cols: int = 4, block: int = 64 << 20, step_s: float = 0.065,
                 small: int = 2, small_s: float = 70e-6, repeats: int = 8) -> Workload:
    """A synthetic out-of-core blocked GEMM, C += A B, shaped like the one measured on an H100:
    A is ``rows`` x ``inner`` blocks of ``block`` bytes, B ``inner`` x ``cols``, C ``rows`` x
    ``cols``, and a temporary block (the defaults: 24 input blocks of 64 MiB, 41 blocks in all,
    2.56 GiB). Per C block (i, j) and k: a GEMM launch writes A[i, k] B[k, j] into the
    temporary, then ``small`` short launches (``small_s`` each: an add into C[i, j] and the
    elementwise kernels a framework puts around it) read it and update C[i, j]. A step is a row
    of C: ``step_s`` of compute (65 ms) shared by its GEMMs. The inputs are uploaded first (they
    hold data); the product is repeated ``repeats`` times, as an iterative job repeats its loop.

    The short launches are what a plan by launch count does not see: two launches ahead of a
    GEMM may be a fraction of a millisecond of compute, less than a block's copy."""
    chunks = Chunks(None)
    ids: dict[tuple[str, int, int], int] = {}
    for name, n, m in (("A", rows, inner), ("B", inner, cols), ("C", rows, cols)):
        for a in range(n):
            for b in range(m):
                first, _ = chunks.add_allocation(0, len(ids), block)
                ids[(name, a, b)] = first
    tmp, _ = chunks.add_allocation(0, len(ids), block)
    job = Job(0, "blocked-gemm")
    for (name, _, _), c in ids.items():
        if name != "C":
            job.steps.append(Step(0, "memcpy", len(job.steps) + 1, (c,), (c,), (), 0.0, False, None))
    gemm_s = step_s / (cols * inner)
    for _ in range(repeats):
        for i in range(rows):
            for j in range(cols):
                for k in range(inner):
                    c, a, b = ids[("C", i, j)], ids[("A", i, k)], ids[("B", k, j)]
                    job.steps.append(Step(0, "launch", len(job.steps), (a, b, tmp), (tmp,), (), gemm_s, False, "gemm"))
                    for s in range(small):
                        job.steps.append(Step(0, "launch", len(job.steps), (c, tmp), (c,), (), small_s, False,
                                              f"elementwise{s}"))
    job.peak_bytes = (len(ids) + 1) * block
    return Workload(chunks, [job], job.steps, [], working_footprint(job.steps, chunks.sizes))


def training_step(layers: int = 16, activation: int = 192 << 20, weight: int = 16 << 20, launches: int = 30,
                  launch_s: float = 33e-6, steps: int = 8) -> Workload:
    """A synthetic training loop shaped like a CNN's under the owned allocator: per layer, an
    activation record (``activation`` bytes: a cache segment of the forward's outputs) and a
    weight record (``weight`` bytes, with its gradient and optimizer state). The forward writes
    layer i's activation from layer i - 1's with layer i's weight, in ``launches`` short
    launches (``launch_s`` each); the backward reads layer i's activation and weight and
    updates the weight, in the same number, layers in reverse; ``steps`` steps. The defaults:
    3.3 GB, about 32 ms a step, and a layer's activation takes 3.8 ms to copy at 50 GB/s, a
    hundred launches: two launches of lead are 66 µs."""
    chunks = Chunks(None)
    act = [chunks.add_allocation(0, i, activation)[0] for i in range(layers)]
    wts = [chunks.add_allocation(0, layers + i, weight)[0] for i in range(layers)]
    job = Job(0, "training-step")
    for w in wts:
        job.steps.append(Step(0, "memcpy", len(job.steps) + 1, (w,), (w,), (), 0.0, False, None))
    for _ in range(steps):
        for i in range(layers):
            ws = (act[i - 1], wts[i], act[i]) if i else (wts[i], act[i])
            for k in range(launches):
                job.steps.append(Step(0, "launch", len(job.steps), ws, (act[i],), (), launch_s, False, f"fwd{k}"))
        for i in reversed(range(layers)):
            for k in range(launches):
                job.steps.append(Step(0, "launch", len(job.steps), (act[i], wts[i]), (wts[i],), (), launch_s, False,
                                      f"bwd{k}"))
    job.peak_bytes = layers * (activation + weight)
    return Workload(chunks, [job], job.steps, [], working_footprint(job.steps, chunks.sizes))
