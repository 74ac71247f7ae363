"""A job of several CUDA processes (a launcher such as torchrun and its ranks) checkpointed and
restored together through the driver path.

Ranks of a data-parallel job wait for each other in every collective. Locking them one after
another can hang: a rank that is already locked never joins the next collective, and a rank
still running that has queued work for it cannot finish its work, so its own lock waits for
good. So every rank is asked for its lock at the same time, each with a time limit; when any
lock fails or times out, the locks taken are given back (the job runs on), and the whole round
is tried again after a pause, a bounded number of times. Only when every rank is locked is any
rank checkpointed; on any failure after that, every rank is brought back to running. A restore
puts every rank's memory back before unlocking any, so no rank runs while another is still
without its GPU. docs/snapshots-and-images.md ("Jobs of several processes") says what the
driver refuses (NCCL jobs are among what it cannot checkpoint on every driver).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuos_tools import procs
from gpuos_tools.ckpt import registry
from gpuos_tools.ckpt.driver import MIN_DRIVER_MIGRATION, Checkpointer, CkptError, Record, error_code
from gpuos_tools.errors import ExitCode, GpuosError

#: NCCL's transports that the driver restores (seen on two H100s, driver 580.159.04): with its
#: default ones (NVLink/PCIe peer memory, shared host memory, cuMem) every rank checkpoints but
#: its restore fails (CUDA_ERROR_NOT_SUPPORTED; INVALID_VALUE with cuMem off), which leaves the
#: job unable to run again. With these three set the ranks talk over sockets, and it restores.
NCCL_RESTORABLE = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0"}
LIBNCCL = b"/libnccl.so"
LOCK_TIMEOUT_MS = 10_000  #: per rank and round, when the caller gives none (0 would wait for ever)
ROUNDS = 3
PAUSE_S = 0.5  #: between rounds, so that collectives in flight can finish


@dataclass
class Rank:
    info: procs.ProcInfo
    rank: int | None  #: from the launcher's variables; None when unreadable or not set

    def describe(self) -> dict[str, Any]:
        return {**self.info.describe(), "rank": self.rank}


def job_ranks(pid: int, is_cuda: Callable[[int], bool] | None = None) -> list[Rank]:
    """The CUDA processes in ``pid``'s tree (``pid`` included), in rank order (then pid order).

    ``is_cuda``: whether a process uses CUDA (default: it maps libcuda). Raises NO_SUCH_PROCESS
    when ``pid`` is gone and NOT_CUDA_PROCESS when no process of the tree uses CUDA."""
    procs.read_proc(pid)  # NO_SUCH_PROCESS
    check = is_cuda or _maps_libcuda
    ranks = []
    for p in procs.descendants(pid):
        try:
            info = procs.read_proc(p)
        except GpuosError:
            continue  # exited meanwhile
        if info.state == "Z" or not check(p):
            continue
        ranks.append(Rank(info, procs.rank_of(p)))
    if not ranks:
        raise GpuosError(f"no process in the tree of PID {pid} uses CUDA (none maps libcuda.so): give the PID of "
                         "the job's launcher (torchrun) or of a parent of its ranks", ExitCode.NOT_CUDA_PROCESS)
    return sorted(ranks, key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0, r.info.pid))


def missing_ranks(pid: int) -> str | None:
    """Why ``pid``'s tree is not the whole job, when the launcher told its processes the job has
    more ranks (WORLD_SIZE or the like) than the tree holds; None when it is, or nothing says.
    Processes that carry a rank count whether or not they use CUDA (a rank may keep its state on
    the CPU). A part of a job checkpointed or cut alone leaves the others waiting in its
    collectives."""
    ranks: dict[int, int | None] = {}
    sizes = set()
    for p in procs.descendants(pid):
        rank = procs.rank_of(p)
        if rank is None:
            continue
        ranks[p] = rank
        if (n := procs.world_size_of(p)) is not None:
            sizes.add(n)
    size = max(sizes, default=None)
    if size is None or len(set(ranks.values())) >= size:
        return None
    return (f"the tree of PID {pid} holds {len(set(ranks.values()))} of the job's {size} ranks (rank "
            + ", ".join(str(r) for r in sorted(set(ranks.values()))) + "): give the PID of the launcher "
            "(torchrun) whose tree holds every rank")


def nccl_environ(pid: int, names: tuple[str, ...]) -> dict[str, str] | None:
    """Those of ``names`` the process's environment sets, when it maps NCCL; None when it does
    not, or has exited or is not ours (the checks that follow say so)."""
    try:
        if not procs.maps_library(pid, LIBNCCL):
            return None
    except GpuosError:
        return None
    return procs.environ_values(pid, names)


def nccl_unrestorable(pid: int) -> list[str]:
    """What the process would need set for the driver to restore it: those of ``NCCL_RESTORABLE``
    its environment lacks, when it maps NCCL (empty when it does not, or has them all)."""
    env = nccl_environ(pid, tuple(NCCL_RESTORABLE))
    if env is None:
        return []
    return [f"{k}={v}" for k, v in NCCL_RESTORABLE.items() if env.get(k) != v]


def _maps_libcuda(pid: int) -> bool:
    try:
        return procs.maps_libcuda(pid)
    except GpuosError:
        return False


def _each(pids: list[int], fn: Callable[[int], Any]) -> dict[int, Any]:
    """``fn(pid)`` for every pid at once, one thread each; a raised exception is the result."""
    out: dict[int, Any] = {}

    def run(pid: int) -> None:
        try:
            out[pid] = fn(pid)
        except BaseException as e:  # noqa: BLE001 -- reported with the pid
            out[pid] = e

    threads = [threading.Thread(target=run, args=(p,), name=f"gpu-ckpt-rank-{p}") for p in pids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _step_all(ckpt: Checkpointer, pids: list[int], step: str, before: str,
              fn: Callable[[int], Any]) -> tuple[float, dict[int, Any]]:
    """One driver step on every rank at once, each recorded; (seconds, {pid: error} of those
    that failed: a CUresult name, or the exception raised)."""
    t = time.monotonic()
    errors = _each(pids, fn)
    seconds = time.monotonic() - t
    for p in pids:
        err = errors[p]
        ckpt._step(p, step, before, seconds, str(err) if isinstance(err, BaseException) else err)
    return seconds, {p: e for p, e in errors.items() if e}


def _code(call: str, failed: dict[int, Any], remapped: bool = False) -> ExitCode:
    """The exit code of a step that failed on some ranks: theirs when they agree."""
    codes = {ExitCode.SOFTWARE if isinstance(e, BaseException) else error_code(call, e, remapped=remapped)
             for e in failed.values()}
    return codes.pop() if len(codes) == 1 else ExitCode.FAILURE


def suspend_job(ckpt: Checkpointer, pid: int, timeout_ms: int = 0, rounds: int = ROUNDS,
                pause_s: float = PAUSE_S, is_cuda: Callable[[int], bool] | None = None, force: bool = False,
                unrestorable: Callable[[int], list[str]] = nccl_unrestorable) -> Record:
    """Lock every rank of ``pid``'s job, then checkpoint each; the ``ckpt_job`` record.

    A job whose ranks use NCCL transports the driver cannot restore is refused before anything is
    touched, unless ``force``: its checkpoint would succeed and its restore fail, and the job
    would never run again. ``unrestorable(pid)`` says what a rank lacks (default: the NCCL check).
    Raises CkptError when the job could not be checkpointed, every rank left running (or, where
    the driver leaves no choice, in the state the error names)."""
    start = time.monotonic()
    ranks, states = _ranks_and_states(ckpt, "checkpoint", pid, is_cuda)
    partial = missing_ranks(pid)
    if partial and not force:
        raise ckpt.fail("checkpoint", pid, f"{partial}, or --force to checkpoint these alone (the others would "
                        "wait in their collectives); nothing was touched", ExitCode.NOT_CHECKPOINTABLE, "running",
                        False)
    pids = [r.info.pid for r in ranks]
    lacking = {p: need for p in pids if (need := unrestorable(p))}
    if lacking and not force:
        need = sorted({n for v in lacking.values() for n in v})
        raise ckpt.fail("checkpoint", pid, "the job uses NCCL over transports the driver cannot restore (peer "
                        "memory, shared memory or cuMem; seen on driver 580): its checkpoint would succeed and "
                        "its restore fail, leaving it unable to run again. Start the job with "
                        + " ".join(need) + " (NCCL then talks over sockets, which the driver restores), or give "
                        "--force to checkpoint it anyway; PIDs " + ", ".join(str(p) for p in lacking)
                        + " lack them; nothing was touched", ExitCode.NOT_CHECKPOINTABLE, "running", False)

    usage = {}
    for r in ranks:
        gpus, nbytes = usage[r.info.pid] = ckpt.usage(r.info.pid)
        ckpt.out({"type": "ckpt_process", **r.info.describe(), "state": states[r.info.pid], "gpus": gpus,
                  "bytes": nbytes})
    wrong = {p: s for p, s in states.items() if s != "running"}
    if wrong:
        raise ckpt.fail("checkpoint", pid, "cannot checkpoint the job: " + ", ".join(
            f"PID {p} is {s}" for p, s in wrong.items()) + "; nothing was done", ExitCode.WRONG_STATE, None, False)
    api = ckpt.api
    limit = timeout_ms or LOCK_TIMEOUT_MS
    lock_s: float | None = None
    tried = 0
    for tried in range(1, rounds + 1):
        lock_s, failed = _step_all(ckpt, pids, "lock", "running", lambda p: api.lock(p, limit))
        if not failed:
            break
        for p in pids:  # give back what was taken: the job runs on until the next round
            if p not in failed or ckpt._state(p) in ("locked", "checkpointed"):
                ckpt.bring_back(p)
        if tried < rounds:
            time.sleep(pause_s)
    else:
        left = {p: ckpt._state(p) for p in pids}
        detail = "; ".join(f"PID {p}: {e}" for p, e in failed.items())
        code = _code("lock", failed)
        raise ckpt.fail("checkpoint", pid, f"could not lock every rank of the job at once in {rounds} rounds of "
                        f"{limit} ms ({detail}); " + _left(left), code, _common(left),
                        any(s != "running" for s in left.values()))
    checkpoint_s, failed = _step_all(ckpt, pids, "checkpoint", "locked", api.checkpoint)
    if failed:
        left = {p: ckpt.bring_back(p) for p in pids}
        detail = "; ".join(f"PID {p}: {e}" for p, e in failed.items())
        raise ckpt.fail("checkpoint", pid, f"checkpoint of the job failed ({detail}): the driver cannot checkpoint "
                        f"what some rank uses (NCCL, IPC or managed memory, MPS, MIG); " + _left(left),
                        ExitCode.NOT_CHECKPOINTABLE, _common(left), True)
    for r in ranks:
        gpus, nbytes = usage[r.info.pid]
        registry.remember(registry.entry_for(r.info, gpus=gpus, bytes=nbytes))
    result: Record = {
        "type": "ckpt_job", "action": "checkpoint", "pid": pid, "ok": True, "state": "checkpointed",
        "ranks": [r.describe() for r in ranks], "rounds": tried, "lock_s": round(lock_s or 0.0, 6),
        "checkpoint_s": round(checkpoint_s, 6), "duration_s": round(time.monotonic() - start, 6),
        "message": f"{len(pids)} processes of the job of PID {pid} checkpointed; `gpu-restore --job {pid}` "
                   "resumes them" + ("" if not lacking else " if the driver restores their NCCL transports (forced: "
                                     "it did not when last seen)"),
    }
    if lacking:
        result["unrestorable"] = sorted(lacking)
    ckpt.out(result)
    return result


def resume_job(ckpt: Checkpointer, pid: int, is_cuda: Callable[[int], bool] | None = None,
               device_map: str | None = None) -> Record:
    """Restore every checkpointed rank of ``pid``'s job, then unlock every rank; the ``ckpt_job``
    record. ``device_map`` (``OLD=NEW,...``, the machine's GPUs permuted) moves every rank the
    same way: a job whose ranks talk to each other needs the whole job moved at once. Raises
    CkptError saying what each rank was left in."""
    start = time.monotonic()
    ranks, states = _ranks_and_states(ckpt, "restore", pid, is_cuda)
    pids = [r.info.pid for r in ranks]
    for r in ranks:
        ckpt.out({"type": "ckpt_process", **r.info.describe(), "state": states[r.info.pid]})
    wrong = {p: s for p, s in states.items() if s not in ("checkpointed", "locked")}
    if wrong:
        raise ckpt.fail("restore", pid, "cannot restore the job: " + ", ".join(
            f"PID {p} is {s}" for p, s in wrong.items()) + "; nothing was done", ExitCode.WRONG_STATE, None, False)
    pairs = _job_pairs(ckpt, pid, states, device_map) if device_map else None
    api = ckpt.api
    to_restore = [p for p in pids if states[p] == "checkpointed"]
    restore_s, failed = _step_all(ckpt, to_restore, "restore", "checkpointed", lambda p: api.restore(p, pairs))
    if failed:
        # the ranks whose memory is back run again only with the others: leave every rank where it is
        left = {p: ckpt._state(p) for p in pids}
        detail = "; ".join(f"PID {p}: {e}" for p, e in failed.items())
        why = (" (the driver refused the GPU remapping: each target must be the same chip with enough free "
               "memory)") if pairs and _code("restore", failed, remapped=True) == ExitCode.BAD_GPU else ""
        raise ckpt.fail("restore", pid, f"restore of the job failed ({detail}){why}; no rank was unlocked: "
                        + _left(left) + f"; `gpu-restore --job {pid}"
                        + (f" --device-map {device_map}" if pairs else "")
                        + "` tries again (the ranks restored stay where the map put them)" * bool(pairs)
                        + "` tries again" * (not pairs), _code("restore", failed, bool(pairs)),
                        _common(left), True)
    unlock_s, failed = _step_all(ckpt, pids, "unlock", "locked", api.unlock)
    if failed:
        left = {p: ckpt._state(p) for p in pids}
        raise ckpt.fail("restore", pid, "unlock failed for " + "; ".join(f"PID {p}: {e}" for p, e in failed.items())
                        + "; " + _left(left), ExitCode.FAILURE, _common(left), True)
    for p in pids:
        registry.forget(p)
    result: Record = {
        "type": "ckpt_job", "action": "restore", "pid": pid, "ok": True, "state": "running",
        "ranks": [r.describe() for r in ranks], "restore_s": round(restore_s, 6), "unlock_s": round(unlock_s, 6),
        "duration_s": round(time.monotonic() - start, 6), "gpu_map": [list(p) for p in pairs] if pairs else None,
        "message": f"{len(pids)} processes of the job of PID {pid} restored and running"
                   + (" on the GPUs --device-map named" if pairs else ""),
    }
    ckpt.out(result)
    return result


def bring_back_job(ckpt: Checkpointer, pid: int,
                   is_cuda: Callable[[int], bool] | None = None) -> tuple[str, dict[int, str | None]]:
    """Every rank of ``pid``'s job back to running from whatever state an interrupted action left
    it in; (what was done, in words; each rank's state afterwards). Never raises.

    When every rank is held (locked or checkpointed) this is ``resume_job``. Otherwise (a round of
    locks cut short, a restore that failed half-way) the checkpointed ranks are restored first and
    only then is any rank unlocked, the same order; while some rank stays checkpointed, none is
    unlocked (no rank runs while another has no GPU)."""
    try:
        if not procs.exists(pid):
            return f"the job of PID {pid} is gone", {}
        pids = [r.info.pid for r in job_ranks(pid, is_cuda)]
        states = {p: ckpt._state(p) for p in pids}
        held = [s in ("locked", "checkpointed") for s in states.values() if s is not None]
        if held and all(held):
            try:
                resume_job(ckpt, pid, is_cuda)
            except CkptError:
                pass  # the restore failed on some rank: rank by rank below
            states = {p: ckpt._state(p) for p in pids}
        for p in [p for p in pids if states[p] == "checkpointed"]:
            t = time.monotonic()
            err = ckpt.api.restore(p)
            ckpt._step(p, "restore", "checkpointed", time.monotonic() - t, err, recovery=True)
        if "checkpointed" not in (ckpt._state(p) for p in pids):  # else none runs: the job's own rule
            for p in pids:
                if ckpt._state(p) == "locked":
                    ckpt.bring_back(p)
        states = {p: ckpt._state(p) for p in pids}
        bad = {p: s for p, s in states.items() if s not in ("running", None)}
        if not bad:
            return f"every rank of the job of PID {pid} was brought back to running", states
        return _left(bad) + f"; `gpu-restore --job {pid}` tries again", states
    except BaseException as e:  # noqa: BLE001 -- the recovery path must not raise
        return f"bringing the job back failed ({e}); `gpu-restore --job {pid}` brings checkpointed ranks back", {}


def _job_pairs(ckpt: Checkpointer, pid: int, states: dict[int, str],
               device_map: str) -> list[tuple[str, str]] | None:
    """The driver's (old UUID, new UUID) pairs for ``device_map``, checked before any rank is
    touched: the map a permutation of same-chip GPUs, the driver new enough to remap, and some
    rank checkpointed. A rank only locked keeps its memory where it is (after a restore that
    failed half-way, the ranks restored already sit where the same map put them)."""
    if "checkpointed" not in states.values():
        raise ckpt.fail("restore", pid, "cannot move the job: no process of it is checkpointed (a locked "
                        f"process's memory is still on its GPU); `gpu-restore --job {pid}` without --device-map "
                        "unlocks the job; nothing was done", ExitCode.WRONG_STATE, None, False)
    try:
        pairs, _ = ckpt.gpu_pairs(pid, None, device_map)
        if pairs and ckpt.api.version < MIN_DRIVER_MIGRATION:
            raise GpuosError("restoring onto other GPUs needs a driver for CUDA 13.0 or later (release 580); this "
                             f"one supports CUDA {ckpt.api.info.version_string}", ExitCode.DRIVER_TOO_OLD)
    except GpuosError as e:
        raise ckpt.fail("restore", pid, f"{e}; nothing was done, the job stays checkpointed", e.code,
                        "checkpointed", False) from None
    return pairs


def _ranks_and_states(ckpt: Checkpointer, action: str, pid: int,
                      is_cuda: Callable[[int], bool] | None) -> tuple[list[Rank], dict]:
    """The ranks of ``pid``'s job the driver knows a CUDA state for, and those states. A process
    that maps libcuda without having initialised CUDA (a launcher that imported torch) is no
    rank; any error stops the action before anything is touched."""
    try:
        ranks = job_ranks(pid, is_cuda)
    except GpuosError as e:
        raise ckpt.fail(action, pid, f"{e}; nothing was touched", e.code, None, False) from None
    kept, states = [], {}
    for r in ranks:
        try:
            states[r.info.pid] = ckpt.state(r.info.pid)
        except CkptError as e:
            if e.code == ExitCode.NOT_CUDA_PROCESS:
                continue
            ckpt.out(e.record)
            raise
        kept.append(r)
    if not kept:
        raise ckpt.fail(action, pid, f"no process in the tree of PID {pid} has initialised CUDA; nothing was touched",
                        ExitCode.NOT_CUDA_PROCESS, None, False)
    return kept, states


def _left(states: dict[int, str | None]) -> str:
    return "left: " + ", ".join(f"PID {p} {s or 'unknown'}" for p, s in states.items())


def _common(states: dict[int, str | None]) -> str | None:
    """The one state every rank is in, else None."""
    values = set(states.values())
    return values.pop() if len(values) == 1 else None

