"""A job's consistent cut through its ranks' agents, without stopping it (`gpu-ckpt --job PID --cut
--image DIR`), and its rollback (`gpu-restore --job PID --cut --image DIR`). Design and
guarantees: docs/multi-gpu-jobs.md; the agent's side: gpuos_tools/agent/cut.py.

The ranks are the processes of the launcher's tree that run under an agent (job.py's discovery);
every rank is asked for its count of collective launches, K is the largest plus a margin, and
every rank is armed with K at once. A rank already past K fails the attempt: every rank is
disarmed, what a rank took is deleted, and the cut is tried again with a larger margin. Then the
coordinator waits, bounded, for every rank's image; on a failure or the time limit it disarms
every rank and deletes every image. The job image is a directory: each rank's agent image and
`job.json` (host, launcher, K, and per rank its pid, rank, GPU, image and stall), written last;
the directory appears under its name only when complete.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuos_tools import procs
from gpuos_tools.agent import control
from gpuos_tools.ckpt import criu, criu_job
from gpuos_tools.ckpt import job as job_mod
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.image.layout import MANIFEST as AGENT_MANIFEST
from gpuos_tools.stream import atomic

MANIFEST = "job.json"
KIND = "gpuos-job-cut"
MARGIN = 4  #: collectives beyond the largest count, at the first attempt
MAX_MARGIN = 1_000_000  #: --margin's bound (times 4**(ATTEMPTS-1) at the last attempt, K stays far below 2**64)
ATTEMPTS = 4  #: the margin grows fourfold at each
WAIT_S = 120.0  #: how long every rank may take to reach K and write its image
DISCARD_WAIT_S = 120.0  #: how long an abandoned rank may take to finish an image it began
POLL_S = 0.5  #: how long one status request waits on the agent

Request = Callable[..., dict[str, Any]]


@dataclass
class AgentRank:
    info: procs.ProcInfo
    rank: int | None
    socket: Path

    @property
    def pid(self) -> int:
        return self.info.pid

    @property
    def label(self) -> str:
        """Its image's name in the job image."""
        return f"rank-{self.rank}" if self.rank is not None else f"pid-{self.pid}"


def agent_ranks(pid: int, is_cuda: Callable[[int], bool] | None = None,
                socket_of: Callable[[int], Path] = control.socket_path) -> list[AgentRank]:
    """The processes of ``pid``'s tree that run under an agent, in rank order. A CUDA process
    with a rank no agent process has (a rank not started under the agent) refuses the job; one
    without a rank (the launcher, a helper, the agent's own launcher) is not a rank."""
    cuda = is_cuda or job_mod._maps_libcuda

    def has_agent(p: int) -> bool:
        return socket_of(p).exists()

    start = "start each rank with `gpu-ckpt run` (e.g. torchrun --no-python ... gpu-ckpt run -- python train.py)"
    try:
        ranks = job_mod.job_ranks(pid, lambda p: has_agent(p) or cuda(p))
    except GpuosError as e:
        if e.code != ExitCode.NOT_CUDA_PROCESS:
            raise
        raise GpuosError(f"no process in the tree of PID {pid} runs under the agent or uses CUDA: give the PID of "
                         f"the job's launcher (torchrun) or of a parent of its ranks, and {start}",
                         ExitCode.NOT_CUDA_PROCESS) from None
    under = [r for r in ranks if has_agent(r.info.pid)]
    if not under:
        raise GpuosError(f"no process in the tree of PID {pid} runs under the agent: {start}",
                         ExitCode.NOT_CHECKPOINTABLE)
    have = [r.rank for r in under]
    twice = sorted({r for r in have if r is not None and have.count(r) > 1})
    if twice:
        raise GpuosError(f"several agent processes of the job of PID {pid} say they are rank "
                         + ", ".join(map(str, twice)) + ": cannot tell the ranks apart", ExitCode.NOT_CHECKPOINTABLE)
    lacking = [r for r in ranks if r not in under and r.rank is not None and r.rank not in have]
    if lacking:
        raise GpuosError("rank(s) " + ", ".join(f"{r.rank} (PID {r.info.pid})" for r in lacking)
                         + f" of the job use CUDA without the agent: every rank must run under it for a cut; {start}",
                         ExitCode.NOT_CHECKPOINTABLE)
    partial = job_mod.missing_ranks(pid)
    if partial:
        raise GpuosError(f"{partial}; a job across hosts cannot be cut", ExitCode.NOT_CHECKPOINTABLE)
    return [AgentRank(r.info, r.rank, socket_of(r.info.pid)) for r in under]


def nccl_without_cumem(pid: int) -> bool:
    """Whether the process maps NCCL with its cuMem allocator switched off: NCCL's buffers are
    then ordinary allocations that a cut cannot tell from the program's."""
    env = job_mod.nccl_environ(pid, ("NCCL_CUMEM_ENABLE",))
    return env is not None and env.get("NCCL_CUMEM_ENABLE") == "0"


def _each(ranks: list[AgentRank], fn: Callable[[AgentRank], Any]) -> dict[int, Any]:
    """``fn(rank)`` for every rank at once; a raised exception is the result."""
    return job_mod._each([r.pid for r in ranks], lambda p: fn(next(r for r in ranks if r.pid == p)))


def _failures(answers: dict[int, Any]) -> dict[int, BaseException]:
    return {p: a for p, a in answers.items() if isinstance(a, BaseException)}


def _say(failed: dict[int, BaseException]) -> str:
    return "; ".join(f"PID {p}: {e}" for p, e in sorted(failed.items()))


class Cutter:
    """One cut of a job (``cut_job``); keeps what each rank was asked, to undo it."""

    def __init__(self, ranks: list[AgentRank], request: Request, wait_s: float, discard_wait_s: float) -> None:
        self.ranks = ranks
        self.request = request
        self.wait_s = wait_s
        self.discard_wait_s = discard_wait_s

    def ask(self, r: AgentRank, op: str, **fields: Any) -> dict[str, Any]:
        return self.request(r.socket, op, timeout=max(60.0, POLL_S * 4), **fields)

    def counts(self) -> dict[int, dict[str, Any]]:
        answers = _each(self.ranks, lambda r: self.ask(r, "collectives"))
        failed = _failures(answers)
        if failed:
            raise GpuosError(f"could not ask every rank for its collectives ({_say(failed)}); nothing was taken",
                             _code(failed))
        unknown = {p: a.get("why", "not known") for p, a in answers.items() if not a.get("known")}
        if unknown:
            raise GpuosError("the count of collectives of some rank is not known, so no cut can be placed: "
                             + "; ".join(f"PID {p}: {w}" for p, w in sorted(unknown.items())) + "; nothing was taken",
                             ExitCode.NOT_CHECKPOINTABLE)
        return answers

    def arm(self, k: int, where: Path, options: dict[str, Any]) -> dict[int, Any]:
        return _each(self.ranks, lambda r: self.ask(r, "arm", k=k, image=str(where / r.label), **options))

    def abandon(self, ranks: list[AgentRank]) -> list[str]:
        """Disarm every rank; wait (bounded) for those whose T0 was taken to end their image.
        What could not be undone, in words (empty: all)."""
        left: list[str] = []
        answers = _each(ranks, lambda r: self.ask(r, "disarm"))
        busy = []
        for r in ranks:
            a = answers[r.pid]
            if isinstance(a, BaseException):
                left.append(f"PID {r.pid} could not be disarmed ({a})")
            elif a.get("state") == "taken":
                busy.append(r)
        deadline = time.monotonic() + self.discard_wait_s
        while busy and time.monotonic() < deadline:
            states = _each(busy, lambda r: self.ask(r, "cut", wait_s=POLL_S))
            busy = [r for r in busy if not isinstance(states[r.pid], BaseException)
                    and states[r.pid].get("state") == "taken"]
        left += [f"PID {r.pid} was still writing its image after {self.discard_wait_s:.0f} s" for r in busy]
        return left

    def wait(self) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
        """Every rank's description once done; or the failures ({pid: why}) and the time limit."""
        deadline = time.monotonic() + self.wait_s
        done: dict[int, dict[str, Any]] = {}
        while True:
            todo = [r for r in self.ranks if r.pid not in done]
            answers = _each(todo, lambda r: self.ask(r, "cut", wait_s=POLL_S))
            failed: dict[int, str] = {}
            for r in todo:
                a = answers[r.pid]
                if isinstance(a, BaseException):
                    failed[r.pid] = str(a)
                elif a.get("state") == "done":
                    done[r.pid] = a
                elif a.get("state") not in ("armed", "taken"):
                    failed[r.pid] = a.get("error_text") or f"its cut is {a.get('state')}"
            if failed or len(done) == len(self.ranks):
                return done, failed
            if time.monotonic() >= deadline:
                late = [r for r in self.ranks if r.pid not in done]
                return done, {r.pid: f"not done after {self.wait_s:g} s (the job did not reach the collective, "
                                     "or its image is still being written)" for r in late}


def _code(failed: dict[int, BaseException]) -> ExitCode:
    codes = {e.code if isinstance(e, GpuosError) else ExitCode.SOFTWARE for e in failed.values()}
    return codes.pop() if len(codes) == 1 else ExitCode.FAILURE


def cut_job(pid: int, image: Path, *, margin: int = MARGIN, attempts: int = ATTEMPTS, wait_s: float = WAIT_S,
            compress: bool = False, checksum: str = "auto", threads: int | None = None,
            request: Request = control.request, is_cuda: Callable[[int], bool] | None = None,
            socket_of: Callable[[int], Path] = control.socket_path,
            discard_wait_s: float = DISCARD_WAIT_S) -> dict[str, Any]:
    """Cut every rank of ``pid``'s job just before the same collective into the job image
    ``image`` (a new directory); the ``ckpt_job_cut`` record. Raises GpuosError with nothing
    left behind (every rank disarmed, every image deleted) when the cut cannot be taken."""
    start = time.monotonic()
    image = Path(image).absolute()
    if image.exists() or image.is_symlink():
        raise GpuosError(f"{image} exists: a job image goes into a new directory", ExitCode.USAGE)
    if not image.parent.is_dir():
        raise GpuosError(f"{image.parent} is not a directory", ExitCode.USAGE)
    if margin < 1 or attempts < 1:
        raise GpuosError("the margin and the attempts must be at least 1", ExitCode.USAGE)
    ranks = agent_ranks(pid, is_cuda, socket_of)
    off = [r.pid for r in ranks if nccl_without_cumem(r.pid)]
    if off:
        raise GpuosError("NCCL_CUMEM_ENABLE=0 in PIDs " + ", ".join(map(str, off)) + ": NCCL's buffers are then "
                         "ordinary allocations that a cut cannot tell from the program's, and a rollback would move "
                         "NCCL's counters back; start the job with NCCL's default (cuMem); nothing was taken",
                         ExitCode.NOT_CHECKPOINTABLE)
    cutter = Cutter(ranks, request, wait_s, discard_wait_s)
    options = {"compress": compress, "checksum": checksum, **({"threads": threads} if threads else {})}
    tmp = image.parent / f".{image.name}.cut-{os.getpid()}"
    try:
        tmp.mkdir(mode=0o755)
    except OSError as e:
        raise GpuosError(f"{image}: cannot write the job image in {image.parent} ({e.strerror}): choose a directory "
                         "you can write; nothing was taken",
                         ExitCode.PERMISSION if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
                         else ExitCode.IO_ERROR) from None
    try:
        for attempt in range(1, attempts + 1):
            counts = cutter.counts()
            k = max(int(a["collectives"]) for a in counts.values()) + margin
            answers = cutter.arm(k, tmp, options)
            armed = [r for r in ranks if not isinstance(answers[r.pid], BaseException) and answers[r.pid].get("armed")]
            failed = _failures(answers)
            if failed:
                left = cutter.abandon(armed)
                raise GpuosError(f"arming every rank at collective {k} failed ({_say(failed)}); every rank was "
                                 "disarmed and nothing kept" + (f" ({'; '.join(left)})" if left else ""), _code(failed))
            if len(armed) < len(ranks):  # some rank was past K: undo, and again with a larger margin
                left = cutter.abandon(armed)
                if left:
                    raise GpuosError(f"a rank was past collective {k}, and the others could not all be undone: "
                                     + "; ".join(left), ExitCode.FAILURE)
                for r in ranks:
                    shutil.rmtree(tmp / r.label, ignore_errors=True)
                margin *= 4
                continue
            done, failed_why = cutter.wait()
            if failed_why:
                left = cutter.abandon(ranks)
                raise GpuosError(f"the cut at collective {k} failed: " + "; ".join(
                    f"PID {p}: {w}" for p, w in sorted(failed_why.items())) + "; every rank was disarmed and "
                    "every image deleted" + (f" ({'; '.join(left)})" if left else ""),
                    ExitCode.LOCK_TIMEOUT if all("not done after" in w for w in failed_why.values())
                    else ExitCode.FAILURE)
            break
        else:
            raise GpuosError(f"every attempt found some rank past the collective chosen ({attempts} attempts, the "
                             f"last margin {margin // 4}): the job issues collectives faster than its ranks can be "
                             "armed; try a larger --margin; nothing was taken", ExitCode.LOCK_TIMEOUT)
        rows = []
        for r in ranks:
            res = done[r.pid]["result"]
            img = res.get("image") or {}
            rows.append({"pid": r.pid, "starttime": r.info.starttime, "rank": r.rank, "gpu": res.get("gpu"),
                         "image": r.label, "collective": k, "stall_s": res["stall_s"],
                         "t0_stall_s": res["t0_stall_s"], "protect_stall_s": res["protect_stall_s"],
                         "bytes": res["bytes"], "buffers": res["buffers"], "ops_before": res["ops_before"],
                         "t0_ns": res["t0_ns"], "seconds": res["seconds"], "image_id": img.get("image_id"),
                         "left_out": res.get("left_out")})
        manifest = {"kind": KIND, "version": 1, "host": socket.gethostname(), "boot_id": procs.boot_id(),
                    "launcher": pid, "k": k, "attempts": attempt, "created_ns": time.time_ns(), "ranks": rows}
        atomic.replace(str(tmp / MANIFEST), (json.dumps(manifest, indent=1) + "\n").encode(), fsync=True)
        os.rename(tmp, image)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stalls = ", ".join(f"rank {row['rank']} {row['stall_s'] * 1e3:.2f} ms" for row in rows)
    return {"type": "ckpt_job_cut", "action": "checkpoint", "pid": pid, "ok": True, "image": str(image), "k": k,
            "attempts": attempt, "ranks": rows, "duration_s": round(time.monotonic() - start, 6),
            "message": f"{len(ranks)} ranks of the job of PID {pid} cut just before collective {k} into {image} "
                       f"(stall per rank: {stalls}); `gpu-restore --job {pid} --cut --image {image}` rolls them back"}


def is_cut_image(image: Path) -> bool:
    return (Path(image) / MANIFEST).is_file()


#: What each kind of image directory holds, and the command that restores it.
IMAGE_KINDS = {
    "cut": ("a job's cut (gpu-ckpt --job PID --cut)", "gpu-restore --job PID --cut --image {image}"),
    "criu-job": ("a CRIU image of a job (gpu-ckpt --job PID --image)", "gpu-restore --image {image}"),
    "criu": ("a CRIU image of one process (gpu-ckpt --pid PID --image)", "gpu-restore --image {image}"),
    "agent": ("an agent-path image of one program (gpu-ckpt --agent PID)", "gpu-restore --agent PID --image {image}"),
}


def image_kind(image: Path) -> str | None:
    """Which of ``IMAGE_KINDS`` the directory ``image`` holds, from the file each writes (None:
    none of them)."""
    image = Path(image)
    if is_cut_image(image):
        return "cut"
    if (image / criu.METADATA).is_file():
        return "criu-job" if criu_job.is_job_image(image) else "criu"
    if (image / AGENT_MANIFEST).is_file():
        return "agent"
    return None


def wrong_image(image: Path, kind: str, wanted: str) -> GpuosError:
    """The USAGE error for an image of ``kind`` given where ``wanted`` (a description) is taken:
    what it is, and the command that restores it."""
    what, how = IMAGE_KINDS[kind]
    return GpuosError(f"{image} is {what}, not {wanted}: `{how.format(image=image)}` restores it; nothing was touched",
                      ExitCode.USAGE)


def read_manifest(image: Path) -> dict[str, Any]:
    path = Path(image) / MANIFEST
    if not Path(image).is_dir():
        raise GpuosError(f"{image}: no such directory (give the job image `gpu-ckpt --job PID --cut --image DIR` "
                         "wrote)", ExitCode.NO_INPUT)
    kind = image_kind(image)
    if kind not in (None, "cut"):
        raise wrong_image(image, kind, "a job's cut")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise GpuosError(f"{image} is not a job image of the agent path (no {MANIFEST}: give the directory "
                         "`gpu-ckpt --job PID --cut --image DIR` wrote)", ExitCode.NO_INPUT) from None
    except (OSError, ValueError) as e:
        raise GpuosError(f"{path}: unreadable ({e})", ExitCode.IMAGE_CORRUPT) from None
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND or not isinstance(manifest.get("ranks"), list):
        raise GpuosError(f"{path} is not the manifest of a job's cut", ExitCode.IMAGE_CORRUPT)

    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not integer(manifest.get("k")) or not manifest["ranks"]:
        raise GpuosError(f"{path}: no collective 'k' or no ranks: not a complete job image", ExitCode.IMAGE_CORRUPT)
    for i, row in enumerate(manifest["ranks"]):
        name = row.get("image") if isinstance(row, dict) else None
        if not (isinstance(row, dict) and integer(row.get("pid")) and integer(row.get("starttime"))
                and isinstance(name, str) and name and "/" not in name and name not in (".", "..")):
            raise GpuosError(f"{path}: rank entry {i} lacks its pid, start time or image name", ExitCode.IMAGE_CORRUPT)
        if not (Path(image) / name).is_dir():
            raise GpuosError(f"{Path(image) / name}: the image of rank {row.get('rank')} is missing",
                             ExitCode.IMAGE_CORRUPT)
    return manifest


def rollback_job(pid: int, image: Path, *, request: Request = control.request,
                 is_cuda: Callable[[int], bool] | None = None,
                 socket_of: Callable[[int], Path] = control.socket_path, timeout: float = 3600.0) -> dict[str, Any]:
    """Roll every rank of ``pid``'s job back to its image in the job image ``image``; the
    ``ckpt_job_rollback`` record. Every rank's image is read and checked against its process
    first; only when all fit is any written. The ranks must be the processes the cut took
    (same pids, same start times): a rollback goes into the running job."""
    start = time.monotonic()
    image = Path(image).absolute()
    manifest = read_manifest(image)
    ranks = {r.pid: r for r in agent_ranks(pid, is_cuda, socket_of)}
    rows = manifest["ranks"]
    problems = []
    for row in rows:
        r = ranks.get(row.get("pid"))
        if r is None or r.info.starttime != row.get("starttime"):
            problems.append(f"rank {row.get('rank')} (PID {row.get('pid')}) of the image is not a process of the job now")
    extra = sorted(set(ranks) - {row.get("pid") for row in rows})
    if extra:
        problems.append("PIDs " + ", ".join(map(str, extra)) + " of the job are not in the image")
    if problems:
        raise GpuosError(f"{image} is not a cut of the job of PID {pid} as it runs now: " + "; ".join(problems)
                         + "; nothing was written", ExitCode.IMAGE_MISMATCH)
    order = [ranks[row["pid"]] for row in rows]
    where = {row["pid"]: str(image / row["image"]) for row in rows}

    def ask(r: AgentRank, check: bool) -> dict[str, Any]:
        return request(r.socket, "rollback", timeout=timeout, image=where[r.pid], **({"check": True} if check else {}))

    checked = _each(order, lambda r: ask(r, True))
    failed = _failures(checked)
    if failed:
        raise GpuosError(f"the job's images do not all fit their ranks ({_say(failed)}); nothing was written",
                         _code(failed))
    answers = _each(order, lambda r: ask(r, False))
    failed = _failures(answers)
    if failed:
        back = [p for p in where if p not in failed]
        raise GpuosError(f"the rollback failed on some ranks ({_say(failed)}); rolled back: "
                         + (", ".join(f"PID {p}" for p in back) or "none")
                         + f": the ranks are not at one point; `gpu-restore --job {pid} --cut --image {image}` tries "
                         "again (writing an image twice is harmless)", _code(failed))
    out_rows = [{"pid": r.pid, "rank": r.rank, "image": str(image / row["image"]),
                 "stall_s": answers[r.pid].get("stall_s"), "bytes": answers[r.pid].get("bytes"),
                 "read_s": answers[r.pid].get("read_s")} for r, row in zip(order, rows)]
    return {"type": "ckpt_job_rollback", "action": "restore", "pid": pid, "ok": True, "image": str(image),
            "k": manifest["k"], "ranks": out_rows, "duration_s": round(time.monotonic() - start, 6),
            "message": f"{len(order)} ranks of the job of PID {pid} rolled back to just before their collective "
                       f"{manifest['k']}; each must now go on from the matching point of its own host state "
                       "(docs/multi-gpu-jobs.md)"}
