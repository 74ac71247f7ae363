"""The agent's side of a job's consistent cut (docs/multi-gpu-jobs.md): every rank of a
data-parallel job snapshotted just before the same collective, without stopping the job.

Each rank's agent counts its program's collective launches (NCCL's kernels, by name; the native
core counts them in C, the Python agent here). `gpu-ckpt --job PID --cut` asks every rank for its
count, picks K beyond the largest, and arms every rank with K: the snapshot is prepared at once
(staging, copy-on-write slots, side stream, events: ``Agent._prepare``), and at the enter of the
K-th collective launch, on the program's thread and before the launch, the agent takes the
snapshot's T0 (``Agent._t0``) and lets the launch go. A thread of the agent then copies and
writes the image while the program runs, as any snapshot does.

A rank already at or past K answers so and nothing is armed; the coordinator disarms the others
and tries again with a larger K. Disarming an armed rank gives back what was prepared; a rank
whose T0 is taken finishes its image, which the coordinator then deletes.

What a cut leaves out: memory mapped with cuMemMap (kind ``vmm``). NCCL maps its own buffers and
its peers' that way (its cuMem allocator, the default); they hold NCCL's sequence counters and
FIFOs, which a rollback must not move back while NCCL's host side goes on. A rank whose memory
is owned (the owned allocator maps with cuMemMap too) is refused.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from gpuos_tools.cuda.driver import context_facts
from gpuos_tools.cuda.driver import relax_capture
from gpuos_tools.errors import ExitCode, GpuosError

#: NCCL's kernel names begin so (mangled names after their ``_Z<length>``)
COLLECTIVE_PREFIXES = ("ncclDevKernel_", "ncclKernel_")
#: allocation kinds a job's cut leaves out (and its rollback leaves as they are)
JOB_EXCLUDED_KINDS = ("vmm",)
#: how long a status request waits for the cut to change state at most (the agent answers one
#: request at a time: a long wait would hold a disarm back)
STATUS_WAIT_MAX_S = 1.0


@lru_cache(maxsize=4096)
def is_collective(name: str) -> bool:
    """Whether a kernel (its symbol name, mangled or not) is one of NCCL's collectives."""
    if name.startswith("_Z"):
        i = 2
        while i < len(name) and name[i].isdigit():
            i += 1
        if i == 2:
            return False
        name = name[i:]
    return name.startswith(COLLECTIVE_PREFIXES)


def unknown_why(counts: dict[str, int]) -> str | None:
    """Why a rank's count of collectives cannot be trusted (None: it can). A graph runs its
    kernels without a launch the agent sees: a graph whose collectives were captured, or one
    built node by node (no capture ever began), may hold collectives the count misses."""
    if counts.get("captured"):
        return (f"{counts['captured']} collective launches were captured into CUDA graphs, whose launches "
                "run them uncounted")
    if counts.get("graphs") and not counts.get("capture_begun"):
        return (f"it launched {counts['graphs']} CUDA graphs built node by node (not captured), which may hold "
                "collectives the agent does not see")
    return None


@dataclass
class Cut:
    """One armed cut of this process."""

    k: int
    prep: Any  #: Agent._prepare's
    options: dict[str, Any]
    state: str = "armed"  #: armed, taken (T0 taken, copying), done, failed, disarmed
    taken: Any = None  #: Agent._t0's, once taken
    result: dict[str, Any] | None = None
    error: str | None = None
    code: int = int(ExitCode.FAILURE)
    t0_stall_ns: int = 0  #: the program's thread held at the K-th collective for T0
    armed_at: float = field(default_factory=time.monotonic)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def set(self, state: str, **fields: Any) -> None:
        with self.changed:
            self.state = state
            for k, v in fields.items():
                setattr(self, k, v)
            self.changed.notify_all()

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": True, "state": self.state, "k": self.k,
                               "t0_stall_s": round(self.t0_stall_ns / 1e9, 6)}
        if self.result is not None:
            out["result"] = self.result
        if self.error is not None:
            out.update(error_text=self.error, error_code=self.code)
        return out


def counts(agent: Any) -> dict[str, Any]:
    """The program's collective launches as the agent counted them, and whether the count is known."""
    if agent.core is not None:
        c = agent.core.collectives()
    else:
        c = {"collectives": agent.collectives, "graphs": agent.graph_launches, "captured": 0,
             "armed": agent.cut.k if agent.cut is not None and agent.cut.state == "armed" else 0,
             "capture_begun": 0}
    why = unknown_why(c)
    cut = agent.cut
    return {"ok": True, **c, "known": why is None, **({"why": why} if why else {}),
            "cut": cut.state if cut is not None else None}


def arm(agent: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Prepare a snapshot and arm the cut at collective ``k``; answers ``armed`` false (and the
    count) when the program is at or past it already."""
    k = request.get("k")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise GpuosError("arm needs 'k': the collective (a positive integer) to cut before", ExitCode.USAGE)
    if not isinstance(request.get("image"), str):
        raise GpuosError("arm needs 'image': where this rank's image goes", ExitCode.USAGE)
    old = agent.cut
    if old is not None and old.state in ("armed", "taken"):
        raise GpuosError(f"a cut is {old.state} at collective {old.k} already", ExitCode.WRONG_STATE)
    if agent.engine is not None:
        raise GpuosError("the program's memory is owned (GPUOS_AGENT_OWN): a job's cut leaves out cuMemMap "
                         "mappings (NCCL's), which the owned allocator's memory is too", ExitCode.NOT_CHECKPOINTABLE)
    why = unknown_why(counts(agent))
    if why:
        raise GpuosError(f"the count of collectives is not known: {why}", ExitCode.NOT_CHECKPOINTABLE)
    prep = agent._prepare(request.get("cow_budget"), exclude=JOB_EXCLUDED_KINDS)
    options = {key: request.get(key) for key in ("image", "compress", "chunk_size", "checksum", "threads")}
    cut = Cut(k, prep, options)
    with agent.lock:
        now = counts(agent)["collectives"]
        if now >= k:
            ok = False
        elif agent.core is not None:
            ok = agent.core.arm(k)
        else:
            ok = True
        if ok:
            agent.cut = cut
    if not ok:
        agent._discard(prep)
        return {"ok": True, "armed": False, "collectives": now, "k": k}
    threading.Thread(target=_finish, args=(agent, cut), name="gpuos-agent-cut", daemon=True).start()
    return {"ok": True, "armed": True, "collectives": now, "k": k}


def cut_now(agent: Any, k: int) -> None:
    """At the enter of collective ``k`` (the program's thread, the agent's lock held): T0."""
    cut = agent.cut
    if cut is None or cut.state != "armed" or cut.k != k:
        return
    me = threading.get_native_id()
    agent.own.add(me)  # the driver calls of T0 are the agent's, not the program's
    t = time.perf_counter_ns()
    try:
        taken = agent._t0(cut.prep, own=1)
    except GpuosError as e:
        cut.set("failed", error=str(e), code=int(e.code), t0_stall_ns=time.perf_counter_ns() - t)
    except Exception as e:  # noqa: BLE001 (never let the agent break the program: the cut fails instead)
        cut.set("failed", error=f"{type(e).__name__}: {e}", t0_stall_ns=time.perf_counter_ns() - t)
    else:
        cut.set("taken", taken=taken, t0_stall_ns=time.perf_counter_ns() - t)
    finally:
        agent.own.discard(me)


def disarm(agent: Any) -> dict[str, Any]:
    """Take an armed cut back (what was prepared is given back). A cut whose T0 is taken goes on
    to its image: the answer says so, and the caller deletes it."""
    with agent.lock:
        cut = agent.cut
        if cut is None:
            return {"ok": True, "disarmed": False, "state": None}
        if cut.state != "armed":
            return {"ok": True, "disarmed": False, "state": cut.state}
        if agent.core is not None:
            agent.core.arm(0)
        cut.set("disarmed")
    return {"ok": True, "disarmed": True, "state": "disarmed"}


def status(agent: Any, wait_s: float = 0.0) -> dict[str, Any]:
    """The cut's state (and, once done, the snapshot's description); waits up to ``wait_s``
    (at most STATUS_WAIT_MAX_S) for it to leave armed or taken."""
    cut = agent.cut
    if cut is None:
        return {"ok": True, "state": None}
    wait = min(max(float(wait_s or 0.0), 0.0), STATUS_WAIT_MAX_S)
    with cut.changed:
        cut.changed.wait_for(lambda: cut.state not in ("armed", "taken"), wait)
    return cut.describe()


def _finish(agent: Any, cut: Cut) -> None:
    """The agent's thread of one cut: wait for T0 (or a disarm), then copy and write the image."""
    agent.own.add(threading.get_native_id())
    relax_capture()  # its copies must not break a graph the program captures meanwhile
    if agent.ctx is not None:  # the program's context on this thread (none in tests without CUDA)
        from cuda.bindings import driver as drv

        drv.cuCtxSetCurrent(agent.ctx)
    with cut.changed:
        cut.changed.wait_for(lambda: cut.state != "armed")
    if cut.state != "taken":  # disarmed, or T0 failed: nothing was taken
        agent._discard(cut.prep)
        return
    try:
        o = cut.options
        out = agent._finish(cut.taken, digest=False, image=o["image"], parent=None, compress=bool(o.get("compress")),
                            chunk_size=o.get("chunk_size"), checksum=o.get("checksum") or "auto",
                            threads=o.get("threads"),
                            manifest={"cut": {"collective": cut.k, "excluded_kinds": list(JOB_EXCLUDED_KINDS)}})
    except GpuosError as e:
        cut.set("failed", error=str(e), code=int(e.code))
        return
    except Exception as e:  # noqa: BLE001 (reported in the cut's state)
        cut.set("failed", error=f"{type(e).__name__}: {e}")
        return
    out.pop("allocations", None)
    left = getattr(cut.taken, "left_out", [])
    out["left_out"] = {"allocations": len(left), "bytes": sum(b.size for b in left),
                       "kinds": sorted({b.kind for b in left})}
    t0 = cut.t0_stall_ns / 1e9
    out.update(collective=cut.k, t0_stall_s=round(t0, 6), stall_s=round(t0 + out["stall_s"], 6),
               protect_stall_s=out["stall_s"], gpu=_gpu() if agent.ctx is not None else None)
    cut.set("done", result=out)


def _gpu() -> str | None:
    """The UUID of the program's GPU (the context current on this thread)."""
    facts = context_facts()
    return facts.get("gpu_uuid")
