"""Suspend and resume through the agent: the physical memory of every
buffer the agent owns (gpuos_tools/memory/owned.py, `GPUOS_AGENT_OWN=1`) goes to pinned host
memory at link speed and back to the driver; the program waits; resume maps it again at the
same addresses and reloads it.

Suspend (`gpu-ckpt --agent PID --suspend`), on a thread of the agent's, the "holder":

- it takes the agent's lock: the program's next launch, copy, memset, free (any driver call the
  tracer sees) waits in its CUPTI callback; ``settle`` waits until every operation already past
  its callback has been enqueued, and ``cuCtxSynchronize`` until the GPU has done it all;
- every owned record (a large buffer, or a segment of small ones) is copied to the agent's
  pinned staging on a side stream, cut into the staging's pieces, and its physical memory is
  released as soon as its copy has completed (the addresses stay reserved);
- with an image (`--image DIR`), the program's other device allocations are copied too, and
  the whole lot is written as an image of the agent path (rollback and resume can read it);
- the holder keeps the lock and waits. The control socket goes on serving on its own thread:
  ``ping`` says the program is suspended, ``resume`` lets it go, ``snapshot`` and ``rollback``
  are refused (they would wait for the lock).

Resume (`gpu-restore --agent PID --resume`): the holder makes every released record resident
again at the same address (new physical memory), copies its contents back, waits for the
copies, and lets go of the lock; the program's waiting call proceeds. A resume that cannot get
the memory back (another process took the GPU meanwhile) is refused with the program still
suspended and nothing lost; it can be retried. The agent's shutdown, and ``max_hold_s`` when
the suspend asked for it, resume by themselves.

Not owned: what the program allocated outside CuPy's and PyTorch's allocators (cuBLAS's
workspace, cuDNN's and cuFFT's own small buffers and plans, cudaMalloc from extensions), the
CUDA context and module images. A suspend of a program
with such allocations is refused (NOT_OWNED, naming them) unless ``partial`` is asked; then the
owned memory is suspended and the answer reports what stayed (count, bytes, the largest).

The driver checkpoint API cannot take the remainder under an agent on CUPTI callbacks: it
refuses to lock a process with CUPTI attached (CUDA_ERROR_NOT_SUPPORTED); see the man page of
gpu-ckpt (SUSPEND) for what was measured. Under an agent on interception no CUPTI is loaded and
the held program waits in the interposer, before the driver: gpuos_tools/ckpt/move.py moves such
a job to another GPU that way.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpuos_tools.agent import control
from gpuos_tools.cuda.driver import context_facts
from gpuos_tools.cuda.driver import relax_capture
from gpuos_tools.cuda.nvml import nvml_session
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.image import DEFAULT_CHUNK_SIZE, ImageWriter
from gpuos_tools.memory import owned
from gpuos_tools.memory.owned import OwnedError
from gpuos_tools.memory.staging import Staging
from gpuos_tools.model.allocs import Allocation
from gpuos_tools.units import format_size

RUNNING, SUSPENDING, SUSPENDED, RESUMING = "running", "suspending", "suspended", "resuming"
LARGEST = 5  #: allocations named in a refusal or a report
SHUTDOWN_WAIT_S = 120.0  #: how long the agent's shutdown waits for the holder's resume


# -- the pure part: what is owned, what is not, where each buffer goes in the staging --------


@dataclass(frozen=True)
class Span:
    """A range saved to staging: an owned record (released after) or another allocation (kept)."""

    addr: int
    size: int
    offset: int  #: in the staging
    owned: bool


def split(allocations: Iterable[Allocation], records: Sequence[Any]) -> tuple[list[Allocation], list[Allocation]]:
    """(owned, outside): the program's device allocations that lie inside a record of the owned
    library (records: objects with ``base`` and ``size``, sorted by base), and the others."""
    bases = [r.base for r in records]
    owned, outside = [], []
    for a in allocations:
        i = bisect_right(bases, a.addr) - 1
        inside = i >= 0 and a.addr + a.size <= records[i].base + records[i].size
        (owned if inside else outside).append(a)
    return owned, outside


def summary(allocs: Sequence[Allocation], top: int = LARGEST) -> dict[str, Any]:
    """Count, bytes and the largest few of some allocations, for an answer."""
    largest = sorted(allocs, key=lambda a: (-a.size, a.addr))[:top]
    return {"count": len(allocs), "bytes": sum(a.size for a in allocs),
            "largest": [{"addr": a.addr, "size": a.size, "kind": a.kind} for a in largest]}


def named(allocs: Sequence[Allocation], top: int = LARGEST) -> str:
    """'3 allocations, 12.0 MiB: 8.0 MiB at 0x7f00 (device), ...' for a message."""
    s = summary(allocs, top)
    items = ", ".join(f"{_mib(x['size'])} at {x['addr']:#x} ({x['kind'] or '?'})" for x in s["largest"])
    more = f" and {s['count'] - top} more" if s["count"] > top else ""
    return f"{s['count']} allocation{'s' if s['count'] != 1 else ''}, {_mib(s['bytes'])}: {items}{more}"


def _mib(n: int) -> str:
    return format_size(n)


def refusal(owning: bool, owned_records: int, outside: Sequence[Allocation], partial: bool) -> str | None:
    """Why a suspend is refused (None: it may go on). ``owning``: the owned allocator is in the
    program at all; ``owned_records``: resident records it would release."""
    if not owning:
        text = ("the program's allocations are not owned by the agent: start it with GPUOS_AGENT_OWN=1 under "
                "`gpu-trace run --agent` (or `gpu-ckpt run`)")
        return text + (f"; its device memory: {named(outside)}" if outside else "")
    if outside and not partial:
        return (f"device memory outside the owned allocator would stay on the GPU: {named(outside)} "
                "(CUDA libraries' workspaces, or allocations not made through CuPy's or PyTorch's allocator); "
                "--partial suspends what is owned and reports the rest")
    if owned_records == 0:
        return "no owned buffer is resident: nothing to suspend"
    return None


def layout(records: Sequence[Any], extra: Sequence[Allocation]) -> tuple[list[Span], int]:
    """Staging offsets: the records (``base``, ``size``) first, then ``extra`` allocations
    (saved for an image, not released); (spans, total bytes)."""
    spans, off = [], 0
    for r in records:
        spans.append(Span(r.base, r.size, off, True))
        off += r.size
    for a in extra:
        spans.append(Span(a.addr, a.size, off, False))
        off += a.size
    return spans, off


def image_buffers(allocs: Sequence[Allocation], spans: Sequence[Span]) -> list[tuple[Allocation, int]]:
    """(allocation, staging offset of its first byte) for each allocation a saved span holds
    whole; an allocation in no span is left out (its contents were not saved)."""
    starts = [s.addr for s in spans]
    order = sorted(range(len(spans)), key=lambda i: starts[i])
    sorted_starts = [starts[i] for i in order]
    out = []
    for a in allocs:
        j = bisect_right(sorted_starts, a.addr) - 1
        if j < 0:
            continue
        s = spans[order[j]]
        if a.addr + a.size <= s.addr + s.size:
            out.append((a, s.offset + (a.addr - s.addr)))
    return out


# -- the agent's side ---------------------------------------------------------------------------


def _ok(result: tuple, what: str) -> Any:
    from cuda.bindings import driver as drv

    err = result[0]
    if err != drv.CUresult.CUDA_SUCCESS:
        raise GpuosError(f"{what}: {getattr(err, 'name', err)}", ExitCode.CUDA_ERROR)
    return result[1] if len(result) == 2 else (result[1:] or None)


def _process_gpu_memory() -> int | None:
    """Device memory NVML charges to this process (None without NVML, or not listed)."""
    try:
        with nvml_session() as nv:
            if nv is None:
                return None
            mine = nv.processes().get(os.getpid())
            return None if mine is None else sum(g["memory"] or 0 for g in mine)
    except Exception:  # noqa: BLE001 (a report, not a step)
        return None


class Suspendable(Protocol):
    """What a `Suspension` uses of the agent (gpuos_tools/agent/agent.py's Agent)."""

    lock: Any  #: the agent's lock: held, the program's next operation waits in its callback
    own: Any  #: thread ids whose driver calls are the agent's own
    snap: Any  #: the snapshot in progress, or None
    ctx: Any  #: the program's context (None: none yet)
    ops: int  #: the program's operations seen so far
    engine: Any  #: the residency engine, or None
    staging: Staging | None  #: pinned host memory, kept between requests
    last_image: str | None  #: the last image the agent wrote
    image_key: bytes | None  #: the MAC key of its images (None: unsigned)

    def buffers(self) -> list[Allocation]: ...

    def settle(self) -> int: ...

    def ensure_staging(self, total: int) -> Staging: ...


class Suspension:
    """Suspend / resume of the agent's program (module docstring). The control thread calls
    ``suspend``, ``resume``, ``status``; the agent's shutdown calls ``shutdown``."""

    def __init__(self, agent: Suspendable) -> None:
        self.agent = agent
        self.state = RUNNING
        self.info: dict[str, Any] = {}  #: the last suspend's answer (ping shows it)
        self._wake: queue.Queue[str] = queue.Queue()  #: "resume", "shutdown"
        self._answers: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        #: a resume request and the holder's own wake-up (max_hold) take turns: a request made
        #: while suspended is always the one answered
        self._turn = threading.Lock()
        # set by the holder while suspended
        self._spans: list[Span] = []
        self._side: Any = None
        self._lib: Any = None
        self._loaded: set[int] = set()
        self._held_since = 0.0
        self._lazy = False  #: the pending resume request asked for --lazy

    @property
    def held(self) -> bool:
        return self.state != RUNNING

    def status(self) -> dict[str, Any]:
        out = {"state": self.state}
        if self.held:
            out["held_s"] = round(time.perf_counter() - self._held_since, 3)
            out["released_bytes"] = self.info.get("released_bytes")
        return out

    # -- control thread -------------------------------------------------------------------------

    def suspend(self, partial: bool = False, image: str | None = None, compress: bool = False,
                chunk_size: int | None = None, checksum: str = "crc32", max_hold_s: float | None = None) -> dict[str, Any]:
        agent = self.agent
        if self.held:
            raise GpuosError(f"the program is already {self.state}", ExitCode.WRONG_STATE)
        if agent.snap is not None:
            raise GpuosError("a snapshot is in progress; suspend after it", ExitCode.WRONG_STATE)
        lib = owned.loaded()
        with agent.lock:
            allocs = agent.buffers()
            records = [r for r in lib.table() if r.resident] if lib is not None else []
        _, outside = split(allocs, records)
        why = refusal(lib is not None, len(records), outside, partial)
        if why:
            raise GpuosError(why, ExitCode.NOT_OWNED)
        if agent.ctx is None:
            raise GpuosError("the program has no CUDA context yet: nothing to suspend", ExitCode.WRONG_STATE)
        from cuda.bindings import driver as drv

        t_request = time.perf_counter()
        _ok(drv.cuCtxSetCurrent(agent.ctx), "cuCtxSetCurrent")
        # pinned staging for everything, before the program is stopped (pinning is ~2 GB/s)
        need = sum(r.size for r in records) + (sum(a.size for a in outside) if image else 0)
        agent.ensure_staging(need)
        staging_s = time.perf_counter() - t_request
        self._lib = lib
        self.state = SUSPENDING
        opts = {"partial": partial, "image": image, "compress": compress, "chunk_size": chunk_size,
                "checksum": checksum, "max_hold_s": max_hold_s, "t_request": t_request, "staging_s": staging_s,
                "nvml_before": _process_gpu_memory()}
        self._thread = threading.Thread(target=self._hold, args=(opts,), name="gpuos-agent-suspend", daemon=True)
        self._thread.start()
        answer = self._answers.get()
        if isinstance(answer, BaseException):
            raise answer
        nvml_after = _process_gpu_memory()
        answer["process_gpu_memory_before"] = opts["nvml_before"]
        answer["process_gpu_memory_after"] = nvml_after
        self.info = answer
        return answer

    def resume(self, timeout: float | None = None, lazy: bool = False) -> dict[str, Any]:
        """Let the program go on: every buffer loaded first, or (``lazy``) at once, each of its
        operations waiting on the GPU for the buffers it touches while the rest load behind
        (gpuos_tools/memory/engine.py)."""
        with self._turn:
            if self.state != SUSPENDED:
                raise GpuosError(f"the program is {self.state}, not suspended: nothing to resume",
                                 ExitCode.WRONG_STATE)
            if lazy and not getattr(getattr(self.agent, "engine", None), "owned", False):
                raise GpuosError("--lazy needs the agent's residency engine (the program's memory owned: "
                                 "GPUOS_AGENT_OWN=1)", ExitCode.USAGE)
            self._lazy = lazy
            self._wake.put("resume")
        answer = self._answers.get(timeout=timeout)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def shutdown(self) -> None:
        """The agent stops (the program exits): a suspended program is resumed first."""
        if self._thread is not None and self._thread.is_alive():
            self._wake.put("shutdown")
            self._thread.join(SHUTDOWN_WAIT_S)

    # -- the holder thread ----------------------------------------------------------------------

    def _hold(self, opts: dict[str, Any]) -> None:
        from cuda.bindings import driver as drv

        relax_capture()  # not an error for a graph the program captures meanwhile
        agent = self.agent
        me = threading.get_native_id()
        agent.own.add(me)
        locked = False
        try:
            _ok(drv.cuCtxSetCurrent(agent.ctx), "cuCtxSetCurrent")
            t_lock = time.perf_counter()
            agent.lock.acquire()
            locked = True
            self._held_since = time.perf_counter()
            answer = self._suspend_locked(opts, self._held_since - t_lock)
        except BaseException as exc:  # nothing was left changed (_suspend_locked undoes its part)
            self.state = RUNNING
            if locked:
                agent.lock.release()
            agent.own.discard(me)
            self._answers.put(exc)
            return
        self.state = SUSPENDED
        self._answers.put(answer)
        max_hold = opts.get("max_hold_s")
        try:
            while True:
                try:
                    why = self._wake.get(timeout=max_hold)
                except queue.Empty:
                    why = "max_hold"
                with self._turn:
                    if why == "max_hold":
                        try:  # a resume request came meanwhile: it gets the answer
                            why = self._wake.get_nowait()
                        except queue.Empty:
                            pass
                    self.state = RESUMING
                try:
                    out = self._resume_locked(lazy=why == "resume" and self._lazy)
                except Exception as exc:  # noqa: BLE001 (the program stays suspended; the caller hears why)
                    self.state = SUSPENDED
                    if why == "resume":
                        self._answers.put(exc)
                        continue
                    print(f"gpuos agent: resume ({why}) failed: {exc}", file=sys.stderr, flush=True)
                    if why == "shutdown":
                        return  # the program is exiting; let it go whatever its memory holds
                    max_hold = 1.0  # retry each second
                    continue
                out["why"] = why
                if why == "resume":
                    self._answers.put(out)
                return
        finally:
            self.state = RUNNING
            agent.lock.release()
            agent.own.discard(me)

    def _suspend_locked(self, opts: dict[str, Any], lock_s: float) -> dict[str, Any]:
        from cuda.bindings import driver as drv

        agent, lib = self.agent, self._lib
        t0 = time.perf_counter()
        unsettled = agent.settle()
        if unsettled:
            raise GpuosError(f"{unsettled} operations of the program were still being issued after the settle "
                             "timeout; nothing was suspended", ExitCode.WRONG_STATE)
        engine = getattr(agent, "engine", None)
        if engine is not None and not engine.settled:  # evicted since the request came
            raise GpuosError("owned buffers are being evicted or loaded by the residency engine; nothing was "
                             "suspended", ExitCode.WRONG_STATE)
        allocs = agent.buffers()
        records = [r for r in lib.table() if r.resident and not r.flags & 2]  # 2: F_BUSY
        owned_allocs, outside = split(allocs, records)
        why = refusal(True, len(records), outside, opts["partial"])
        if why:
            raise GpuosError(why + " (allocations changed while the suspend was prepared)", ExitCode.NOT_OWNED)
        t_settle = time.perf_counter()
        _ok(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        t_sync = time.perf_counter()
        spans, total = layout(records, outside if opts["image"] else [])
        staging = agent.ensure_staging(total)  # the program grew since the staging was pinned: pin the rest
        side = _ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        events = []
        released: list[Span] = []
        try:
            for s in spans:
                for host, n in staging.spans(s.offset, s.size):
                    _ok(drv.cuMemcpyDtoHAsync(host, s.addr + (host - staging.base - s.offset), n, side),
                        "cuMemcpyDtoHAsync(suspend)")
                ev = _ok(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
                _ok(drv.cuEventRecord(ev, side), "cuEventRecord")
                events.append(ev)
            t_enqueued = time.perf_counter()
            first_release = None
            for s, ev in zip(spans, events):
                _ok(drv.cuEventSynchronize(ev), "cuEventSynchronize(suspend)")
                if s.owned:
                    first_release = first_release or time.perf_counter()
                    lib.release(s.addr)
                    released.append(s)
            t_released = time.perf_counter()
            _ok(drv.cuStreamSynchronize(side), "cuStreamSynchronize(suspend)")
        except BaseException:
            self._spans, self._side, self._loaded = released, side, set()
            try:
                self._resume_locked(keep_side=False)
            except Exception as exc:  # noqa: BLE001 (say so; the original error is the one raised)
                print(f"gpuos agent: undoing a failed suspend failed too: {exc}", file=sys.stderr, flush=True)
            raise
        finally:
            for ev in events:
                drv.cuEventDestroy(ev)
        free_after = int(_ok(drv.cuMemGetInfo(), "cuMemGetInfo")[0])
        self._spans, self._side, self._loaded = released, side, set()
        saved = sum(s.size for s in spans)
        released_bytes = sum(s.size for s in released)
        copy_s = t_released - t_sync
        answer: dict[str, Any] = {
            "ok": True, "state": SUSPENDED, "pid": os.getpid(), "ops_before": agent.ops,
            "buffers": len(released), "released_bytes": released_bytes, "saved_bytes": saved,
            "owned_allocations": len(owned_allocs),
            "not_owned": summary(outside),
            "staging_s": round(opts["staging_s"], 6),
            "lock_s": round(lock_s, 6), "settle_s": round(t_settle - t0, 6), "sync_s": round(t_sync - t_settle, 6),
            "enqueue_s": round(t_enqueued - t_sync, 6), "save_s": round(copy_s, 6),
            "save_gbps": round(saved / copy_s / 1e9, 3) if copy_s > 0 else None,
            # from the request to the last physical page given back: what a waiting job sees
            "suspend_s": round(t_released - opts["t_request"], 6),
            "held_to_freed_s": round(t_released - self._held_since, 6),
            "device_free_after": free_after,
        }
        if opts["image"]:
            t = time.perf_counter()
            try:
                answer["image"] = self._write_image(allocs, spans, opts)
            except BaseException:
                try:
                    self._resume_locked(keep_side=False)
                except Exception as exc:  # noqa: BLE001
                    print(f"gpuos agent: undoing a suspend whose image failed failed too: {exc}", file=sys.stderr,
                          flush=True)
                raise
            answer["image_s"] = round(time.perf_counter() - t, 6)
        return answer

    def _write_image(self, allocs: list[Allocation], spans: list[Span], opts: dict[str, Any]) -> dict[str, Any]:
        agent = self.agent
        entries = image_buffers(allocs, spans)
        total = max((s.offset + s.size for s in spans), default=0)
        view = agent.staging.view(total)
        manifest = {
            "source": "gpuos-agent", "pid": os.getpid(), "argv": sys.argv, "t0_ns": time.time_ns(),
            "ops_before": agent.ops, "suspend": True, **context_facts(),
            "allocations": [{"id": a.id, "addr": a.addr, "size": a.size, "kind": a.kind} for a, _ in entries],
        }
        with ImageWriter(opts["image"], manifest, compress=opts["compress"],
                         chunk_size=opts["chunk_size"] or DEFAULT_CHUNK_SIZE, checksum=opts["checksum"],
                         key=self.agent.image_key) as w:
            for a, off in entries:
                w.add(a.id, a.addr, a.size, view[off : off + a.size])
            out = w.commit()
        agent.last_image = out["path"]
        out["incremental"] = False
        return out

    def _resume_locked(self, keep_side: bool = False, lazy: bool = False) -> dict[str, Any]:
        """Make every released record resident at its address and reload it (lock held); with
        ``lazy``, hand them to the residency engine instead, which loads them behind the
        program's back and ahead of its operations."""
        t0 = time.perf_counter()
        if lazy:
            return self._resume_lazy(t0)
        from cuda.bindings import driver as drv

        lib, staging, side = self._lib, self.agent.staging, self._side
        gone = 0
        mapped_s = 0.0
        loaded_bytes = 0
        try:
            for s in self._spans:
                if s.addr in self._loaded:
                    continue
                r = lib.lookup(s.addr)
                if r is None:  # the program freed it meanwhile (another thread): nothing to bring back
                    gone += 1
                    self._loaded.add(s.addr)
                    continue
                if not r.resident:
                    t = time.perf_counter()
                    try:
                        lib.make_resident(s.addr)
                    except OwnedError as exc:
                        raise GpuosError(
                            f"could not map {_mib(s.size)} at {s.addr:#x} again ({exc}); "
                            f"{len(self._loaded)} of {len(self._spans)} buffers are back; the program stays "
                            "suspended with its memory in host RAM: free GPU memory and resume again",
                            ExitCode.CUDA_ERROR) from exc
                    mapped_s += time.perf_counter() - t
                for host, n in staging.spans(s.offset, s.size):
                    _ok(drv.cuMemcpyHtoDAsync(s.addr + (host - staging.base - s.offset), host, n, side),
                        "cuMemcpyHtoDAsync(resume)")
                self._loaded.add(s.addr)
                loaded_bytes += s.size
        finally:
            _ok(drv.cuStreamSynchronize(side), "cuStreamSynchronize(resume)")
        t1 = time.perf_counter()
        held = t1 - self._held_since
        if not keep_side:
            drv.cuStreamDestroy(side)
            self._side = None
        load_s = t1 - t0
        n = len(self._spans) - gone
        self._spans = []
        return {"ok": True, "state": RUNNING, "buffers": n, "bytes": loaded_bytes, "freed_meanwhile": gone,
                "map_s": round(mapped_s, 6), "resume_s": round(load_s, 6),
                "load_gbps": round(loaded_bytes / load_s / 1e9, 3) if load_s > 0 else None,
                "held_s": round(held, 6)}


    def _resume_lazy(self, t0: float) -> dict[str, Any]:
        """Give every released record, with the staging pieces holding it, to the engine and
        start its background loader; the program goes on when the lock is let go."""
        engine, lib, staging = self.agent.engine, self._lib, self.agent.staging
        gone = adopted = nbytes = 0
        for s in self._spans:
            if s.addr in self._loaded:
                continue
            r = lib.lookup(s.addr)
            if r is None or r.base != s.addr:
                gone += 1
            else:
                engine.adopt(s.addr, s.size, list(staging.spans(s.offset, s.size)))
                adopted += 1
                nbytes += s.size
            self._loaded.add(s.addr)
        engine.load_rest()
        if self._side is not None:
            from cuda.bindings import driver as drv

            drv.cuStreamDestroy(self._side)
            self._side = None
        t1 = time.perf_counter()
        self._spans = []
        return {"ok": True, "state": RUNNING, "lazy": True, "buffers": adopted, "bytes": nbytes,
                "freed_meanwhile": gone, "map_s": 0.0, "resume_s": round(t1 - t0, 6), "load_gbps": None,
                "held_s": round(t1 - self._held_since, 6)}


# -- the client side (what gpu-ckpt and gpu-restore call) -----------------------------------------


def request_suspend(target: Any, *, partial: bool = False, image: str | None = None, compress: bool = False,
                    checksum: str = "crc32", max_hold_s: float | None = None, timeout: float = 3600.0) -> dict[str, Any]:
    """Ask the agent at ``target`` (a socket path) to suspend its program."""
    fields: dict[str, Any] = {"partial": partial, "compress": compress, "checksum": checksum}
    if image is not None:
        fields["image"] = str(Path(image).absolute())
    if max_hold_s is not None:
        fields["max_hold_s"] = max_hold_s
    answer = control.request(target, "suspend", timeout=timeout, **fields)
    answer.pop("ok", None)
    return answer


def request_resume(target: Any, timeout: float = 3600.0, lazy: bool = False) -> dict[str, Any]:
    """Ask the agent at ``target`` to resume its suspended program (``lazy``: at once, the
    buffers loaded behind it)."""
    answer = control.request(target, "resume", timeout=timeout, **({"lazy": True} if lazy else {}))
    answer.pop("ok", None)
    return answer
