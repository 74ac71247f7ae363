"""Full-process CRIU images of a job of several processes: ``gpu-ckpt --job PID --image DIR``.

Every CUDA rank of the launcher's tree is checkpointed through the driver (``job.suspend_job``:
all locked at once, then each checkpointed), so no process of the tree holds GPU memory; then one
``criu dump --tree PID`` takes the whole tree, launcher and helpers included. ``gpu-restore
--image DIR`` runs ``criu restore`` and then ``job.resume_job`` (every rank's GPU state back
before any is unlocked, optionally moved by a device map).

The ranks of a job talk over localhost TCP (torch.distributed's store, NCCL's socket transport),
so CRIU is given ``--tcp-established`` (and ``--file-locks``: a dump of a process that holds a file
lock, such as a compile cache's, fails without it); both ends of each connection are in the tree, and both
are frozen for the dump. CRIU locks the network during a TCP dump with iptables by default,
which many VMs and containers lack; since every peer is frozen with the tree, this module asks
for ``--network-lock skip`` unless ``--criu-arg`` names a lock. Connections to peers outside
the tree are then unprotected between the dump and the kill (the peer may see a reset).

NCCL maps a deleted shared-memory segment larger than CRIU's default limit for deleted files;
the dump raises the limit to the largest such file the tree holds (``criu.ghost_limit``).

CRIU cannot dump io_uring, which torchrun's TCPStore (libuv) sets up: a job holding one is
refused untouched, and ``python -m gpuos_tools.ckpt.no_io_uring COMMAND`` starts a job without it.

Ctrl-C and SIGTERM are caught: CRIU (in a session of its own) is waited for, and every rank is
brought back or the finished image kept. Against SIGKILL, which no ``finally`` survives, the dump
and the restore start the guard process of the single-process path (``guard.py``) and tell it each
phase: if the tool dies, the guard waits for CRIU, keeps a complete image, and brings every rank
of a job still there back (``job.bring_back_job``: every rank restored before any is unlocked).

The CRIU runner here is not ``criu.py``'s: this one waits for CRIU through Ctrl-C (the ranks can
be brought back only once CRIU lets go of the tree), where the single-process dump lets Ctrl-C end
CRIU and hands the rest to its guard. Both write CRIU's exit status the same way (``RC_WRAPPER``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from gpuos_tools import procs
from gpuos_tools.ckpt import outside, ports, registry
from gpuos_tools.ckpt.criu import (DUMP_LOG, METADATA, RC_WRAPPER, RESTORE_LOG, RESTORED_PID, checked_meta,
                                   empty_image_dir, ghost_limit, log_errors, outside_plan, refuse_taken_ids,
                                   usable_criu, wait_for_listeners)
from gpuos_tools.ckpt.driver import Checkpointer, CkptError, Record
from gpuos_tools.ckpt.guard import DUMP_RC, Guard, finalize
from gpuos_tools.ckpt.job import bring_back_job, resume_job, suspend_job
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.image import temp_name

#: What ``kind`` says in the metadata of a job's image (a single process's has none).
KIND = "job"
#: CRIU options every job dump and restore gets (see the module's text).
TREE_ARGS = ("--shell-job", "--tcp-established", "--file-locks")
NO_NETWORK_LOCK = ("--network-lock", "skip")


def is_job_image(image_dir: Path) -> bool:
    """Whether ``image_dir`` holds an image written by ``gpu-ckpt --job --image``."""
    meta = registry.read_json(Path(image_dir) / METADATA)
    return isinstance(meta, dict) and meta.get("kind") == KIND


def network_lock(criu_args: list[str]) -> list[str]:
    """CRIU's network-lock option for a job, unless the caller chose one."""
    if any(a == "--network-lock" or a.startswith("--network-lock=") for a in criu_args):
        return []
    return list(NO_NETWORK_LOCK)


def io_uring_holders(pids: list[int]) -> list[int]:
    """Those of ``pids`` that hold an io_uring instance (a descriptor or a mapping of one)."""
    out = []
    for p in pids:
        try:
            fds = os.listdir(f"/proc/{p}/fd")
            held = any(procs.link_target(f"/proc/{p}/fd/{fd}") == "anon_inode:[io_uring]" for fd in fds)
            if not held:
                with open(f"/proc/{p}/maps", encoding="utf-8", errors="replace") as f:
                    held = any(line.rstrip().endswith("[io_uring]") for line in f)
        except OSError:
            continue  # gone, or not ours: CRIU says so if it matters
        if held:
            out.append(p)
    return out


def _run_criu(ckpt: Checkpointer, pid: int, step: str, cmd: list[str], log: Path, out: Path,
              rc_file: Path, pass_fds: tuple[int, ...] = ()) -> tuple[int, str, BaseException | None]:
    """Run CRIU in a session of its own (a Ctrl-C at the terminal must not reach it) with its
    output into the file ``out``, and wait for it to end even when this tool is interrupted: the
    ranks can be brought back only once CRIU has let go of them. (exit status, output, the
    interruption that came meanwhile or None); one ``ckpt_step`` record. CRIU's exit status is
    also written to ``rc_file`` when it ends: the guard of a killed tool is not CRIU's parent."""
    t = time.monotonic()
    rc_file.unlink(missing_ok=True)
    with open(out, "wb") as f:
        proc = subprocess.Popen(["/bin/sh", "-c", RC_WRAPPER, "gpuos-criu", *cmd], stdin=subprocess.DEVNULL,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True, pass_fds=pass_fds,
                                env={**os.environ, "GPUOS_CRIU_RC": str(rc_file)})
    interrupted: BaseException | None = None
    while True:
        try:
            proc.wait()
            break
        except BaseException as e:  # noqa: BLE001 -- Ctrl-C, SIGTERM: acted on once CRIU has ended
            interrupted = interrupted or e
    try:  # an interruption can come between the reaping and the status: the wrapper's file says it
        rc = int(rc_file.read_text())
    except (OSError, ValueError):
        rc = proc.returncode if proc.returncode else 1
    try:
        text = out.read_text(errors="replace")
    except OSError:
        text = ""
    rec: Record = {"type": "ckpt_step", "pid": pid, "step": step, "ok": rc == 0,
                   "duration_s": round(time.monotonic() - t, 6), "command": cmd, "log": str(log)}
    if rc != 0:
        rec["error"] = f"exit {rc}"
    ckpt.out(rec)
    return rc, text, interrupted


def _said(text: str, log: Path) -> str:
    """CRIU's error lines: its log's, else what it printed."""
    said = log_errors(log)
    if said.startswith("(") and text.strip():
        return " | ".join(r.strip() for r in text.strip().splitlines()[-3:])
    return said


def _bring_back(ckpt: Checkpointer, pid: int, is_cuda: Callable[[int], bool] | None) -> str:
    """Every rank of ``pid``'s job back to running, whatever state the dump left it in; what
    each was left in, in words. Never raises."""
    return bring_back_job(ckpt, pid, is_cuda)[0]


def dump_job(ckpt: Checkpointer, pid: int, image_dir: Path, timeout_ms: int = 0, leave_running: bool = False,
             criu_args: list[str] | None = None, force: bool = False,
             is_cuda: Callable[[int], bool] | None = None) -> Record:
    """Every rank of ``pid``'s job checkpointed on the driver, then ``criu dump`` of the whole
    tree into ``image_dir`` (written in a temp directory beside it, renamed into place when
    complete). Without ``leave_running`` CRIU ends the tree; with it, the job runs on. If CRIU
    fails, every rank is brought back and CRIU_FAILED raised with CRIU's error lines; no image
    is left."""
    criu_args = list(criu_args or [])
    criu = usable_criu(ckpt, "dump", pid)
    image_dir = empty_image_dir(ckpt, pid, image_dir)
    try:
        launcher = procs.read_proc(pid)
    except GpuosError as e:
        raise ckpt.fail("dump", pid, f"{e}; nothing was touched", e.code, None, False) from None
    uring = io_uring_holders(procs.descendants(pid))
    if uring:
        raise ckpt.fail("dump", pid, "CRIU cannot dump io_uring, and PIDs " + ", ".join(map(str, uring))
                        + " of the job hold one (torchrun's TCPStore sets one up through libuv whatever "
                        "UV_USE_IO_URING and USE_LIBUV say): start the job with `python -m "
                        "gpuos_tools.ckpt.no_io_uring COMMAND...`, which denies it io_uring (libuv then uses "
                        "epoll); `gpu-ckpt --job PID` without --image checkpoints its GPU state alone; "
                        "nothing was touched", ExitCode.NOT_CHECKPOINTABLE, "running", False)
    temp = Path(temp_name(str(image_dir)))
    # the guard first: killed at any moment after the temp directory exists, it is there to remove it
    guard = Guard("dump", pid, image_dir, temp, job=True, leave_running=leave_running)
    try:
        image_dir.parent.mkdir(parents=True, exist_ok=True)
        temp.mkdir(mode=0o700)
    except OSError as e:
        guard.done()
        raise ckpt.fail("dump", pid, f"{temp}: cannot create: {e.strerror}; nothing was touched",
                        ExitCode.IO_ERROR, None, False) from e
    try:
        return _dump(ckpt, criu, guard, pid, launcher, image_dir, temp, timeout_ms, leave_running, criu_args,
                     force, is_cuda)
    except CkptError:
        raise
    except BaseException as e:  # interrupted (or a bug) outside CRIU: the ranks go back to running
        where = _bring_back(ckpt, pid, is_cuda)
        code = ExitCode.INTERRUPTED if not isinstance(e, Exception) else ExitCode.SOFTWARE
        raise ckpt.fail("dump", pid, f"stopped by {type(e).__name__} ({e}) during the dump of the job of PID "
                        f"{pid}; no image was written; {where}", code, None, True) from e
    finally:
        shutil.rmtree(temp, ignore_errors=True)  # gone once renamed into place
        guard.done()  # killed before this line, the guard finishes or undoes what is left


def _dump(ckpt: Checkpointer, criu: Any, guard: Guard, pid: int, launcher: procs.ProcInfo, image_dir: Path,
          temp: Path, timeout_ms: int, leave_running: bool, criu_args: list[str], force: bool,
          is_cuda: Callable[[int], bool] | None) -> Record:
    guard.phase("gpu")
    job = suspend_job(ckpt, pid, timeout_ms, force=force, is_cuda=is_cuda)  # CkptError: the job left running
    ranks = []
    for r in job["ranks"]:
        entry = registry.lookup(r["pid"]) or {}
        ranks.append({"pid": r["pid"], "rank": r.get("rank"), "command": r.get("command"),
                      "gpus": entry.get("gpus", []), "bytes": entry.get("bytes")})
    pids, tids = procs.tree_ids(pid)
    lock = network_lock(criu_args)
    known = [r["bytes"] for r in ranks if r["bytes"] is not None]
    meta = {
        "kind": KIND,
        **registry.entry_for(launcher),
        "ranks": ranks,
        "pids": pids,
        "tids": tids,
        "bytes": sum(known) if len(known) == len(ranks) else None,
        "criu": criu.version_text,
        "criu_args": [*TREE_ARGS, *lock],
        "leave_running": leave_running,
        "listeners": ports.listeners(pids),
        outside.KEY: outside.scan(pids),
        **ckpt.header_fields(),
    }
    try:
        registry.write_json_atomic(temp / METADATA, meta, mode=0o644)
    except GpuosError as e:
        raise ckpt.fail("dump", pid, f"{e}; {_bring_back(ckpt, pid, is_cuda)}", e.code, None, True) from None
    cmd = [criu.path, "dump", "--tree", str(pid), "--images-dir", str(temp), "--log-file", DUMP_LOG, *TREE_ARGS,
           *lock, *ghost_limit(pids, criu_args), *(["--leave-running"] if leave_running else []), *criu_args]
    guard.phase("criu")
    rc, text, interrupted = _run_criu(ckpt, pid, "criu_dump", cmd, image_dir / DUMP_LOG, temp / "criu-dump.out",
                                      temp / DUMP_RC)
    if rc != 0:
        keep = image_dir.parent / f"{image_dir.name}.{DUMP_LOG}"
        try:
            os.replace(temp / DUMP_LOG, keep)
        except OSError:
            keep = temp / DUMP_LOG
        said = _said(text, keep)
        where = _bring_back(ckpt, pid, is_cuda)
        why = f"interrupted ({type(interrupted).__name__}) during " if interrupted else ""
        signalled = interrupted is not None and not isinstance(interrupted, Exception)
        code = ExitCode.INTERRUPTED if signalled else ExitCode.CRIU_FAILED
        raise ckpt.fail("dump", pid, f"{why}criu dump of the job of PID {pid} failed (exit {rc}; log {keep}): "
                        f"{said}; no image was written; {where}", code, None, True)
    guard.phase("finalize")
    try:
        finalize(temp, image_dir)
    except OSError as e:
        where = _bring_back(ckpt, pid, is_cuda) if procs.exists(pid) else "the job was ended by CRIU"
        raise ckpt.fail("dump", pid, f"{image_dir}: cannot move the finished dump there ({e.strerror}); "
                        f"{where}", ExitCode.IO_ERROR, None, True) from e
    if leave_running:
        guard.phase("resume")
        resume_job(ckpt, pid, is_cuda)
        state = "running"
        message = f"the job of PID {pid} ({len(pids)} processes) dumped to {image_dir} and left running"
    else:
        for r in ranks:
            registry.forget(r["pid"])
        state = "dumped"
        message = (f"the job of PID {pid} ({len(pids)} processes, {len(ranks)} on the GPU) dumped to {image_dir} "
                   f"and ended by CRIU; `gpu-restore --image {image_dir}` brings it back")
    if interrupted is not None:
        raise ckpt.fail("dump", pid, f"interrupted ({type(interrupted).__name__}) during the dump, which CRIU "
                        f"finished: {message}", ExitCode.INTERRUPTED, state, True, image=str(image_dir))
    result: Record = {
        "type": "ckpt_result", "action": "dump", "pid": pid, "ok": True, "state": state, "touched": True, "code": 0,
        "image": str(image_dir), "ranks": [r["pid"] for r in ranks], "bytes": meta["bytes"],
        "checkpoint_s": job.get("checkpoint_s"), "message": message,
    }
    ckpt.out(result)
    return result


def restore_job(ckpt: Checkpointer, image_dir: Path, device_map: str | None = None,
                criu_args: list[str] | None = None, is_cuda: Callable[[int], bool] | None = None,
                port_wait_s: float = ports.WAIT_S, warn: Callable[[str], None] | None = None,
                output_to: str | None = None, waiting: Callable[[float | None], None] | None = None) -> Record:
    """``criu restore`` of a job's image, then every rank's GPU state back (moved by
    ``device_map`` if given, every rank the same way) before any rank is unlocked. Refuses,
    touching nothing, an image whose processes' ids are taken. Before CRIU runs, waits up to
    ``port_wait_s`` seconds for the ports of the job's listeners (``criu.wait_for_listeners``: ``warn``
    and ``waiting`` hear of it).
    The tree's pipes to processes outside it are handled as ``criu.restore`` does (``output_to``)."""
    criu_args = list(criu_args or [])
    criu = usable_criu(ckpt, "restore", None)
    image_dir = Path(image_dir).resolve()
    meta = registry.read_json(image_dir / METADATA)
    if not isinstance(meta, dict) or meta.get("kind") != KIND or "pid" not in meta \
            or not (image_dir / "inventory.img").exists():
        raise ckpt.fail("restore", None, f"{image_dir} holds no image written by gpu-ckpt --job --image "
                        f"(no {METADATA} of a job)", ExitCode.NO_INPUT, None, False)
    meta = checked_meta(ckpt, image_dir, meta)
    pid = int(meta["pid"])
    refuse_taken_ids(ckpt, pid, meta, "job", f"is the dumped job still running? then `gpu-restore --job {pid}`")
    try:
        _ = ckpt.api  # the driver must be there before CRIU brings the job back
    except GpuosError as e:
        raise ckpt.fail("restore", pid, f"{e}; nothing was touched", e.code, None, False) from None
    waited = wait_for_listeners(ckpt, pid, meta, port_wait_s, warn, waiting)
    plan = outside_plan(ckpt, pid, image_dir, meta, output_to, warn)
    pidfile = image_dir / RESTORED_PID
    pidfile.unlink(missing_ok=True)
    dumped_with = [a for a in meta.get("criu_args") or [] if isinstance(a, str)]
    lock = network_lock(criu_args) if "--network-lock" in dumped_with else []
    cmd = [criu.path, "restore", "--images-dir", str(image_dir), "--log-file", RESTORE_LOG, *TREE_ARGS, *lock,
           "--restore-detached", "--pidfile", str(pidfile), *plan.criu_args, *criu_args]
    guard = Guard("restore", pid, image_dir, job=True, device_map=device_map)
    try:
        result = _restore(ckpt, guard, pid, image_dir, cmd, device_map, is_cuda, waited, plan)
    except CkptError as e:
        guard.done()
        if not e.touched:
            plan.discard()
        raise
    except BaseException as e:  # a bug: the guard brings the job back
        gpid = guard.abandon()
        raise ckpt.fail("restore", pid, f"stopped by {type(e).__name__} ({e}) during the restore of the job of PID "
                        f"{pid}; its guard (PID {gpid}) waits for CRIU and brings every rank back (what it did: "
                        f"{registry.state_dir() / 'guard.log'})", ExitCode.SOFTWARE, None, True) from e
    guard.done()
    return result


def _restore(ckpt: Checkpointer, guard: Guard, pid: int, image_dir: Path, cmd: list[str], device_map: str | None,
             is_cuda: Callable[[int], bool] | None, port_wait_s: float | None, plan: outside.Plan) -> Record:
    guard.phase("criu")
    try:
        rc, text, interrupted = _run_criu(ckpt, pid, "criu_restore", cmd, image_dir / RESTORE_LOG,
                                          image_dir / "criu-restore.out", image_dir / "criu-restore.rc",
                                          pass_fds=plan.pass_fds)
    finally:
        plan.close()
    if rc != 0:
        if procs.exists(pid):  # CRIU failed after the tree came back: do not leave it without its GPUs
            where = _bring_back(ckpt, pid, is_cuda)
            raise ckpt.fail("restore", pid, f"criu restore reported a failure (exit {rc}; log "
                            f"{image_dir / RESTORE_LOG}) but PID {pid} is there: {where}", ExitCode.CRIU_FAILED,
                            None, True)
        raise ckpt.fail("restore", pid, f"criu restore of the job failed (exit {rc}; log {image_dir / RESTORE_LOG}): "
                        f"{_said(text, image_dir / RESTORE_LOG)}; nothing was restored, the image is intact",
                        ExitCode.CRIU_FAILED, None, False)
    if interrupted is not None:
        raise ckpt.fail("restore", pid, f"interrupted ({type(interrupted).__name__}) after CRIU restored the job of "
                        f"PID {pid}: its ranks are still checkpointed; `gpu-restore --job {pid}` brings them back",
                        ExitCode.INTERRUPTED, "checkpointed", True)
    guard.phase("gpu")
    try:
        job = resume_job(ckpt, pid, is_cuda, device_map=device_map)
    except CkptError as e:
        raise ckpt.fail("restore", pid, f"CRIU restored the job of PID {pid} from {image_dir}, then: {e}", e.code,
                        e.state, True, image=str(image_dir)) from None
    result: Record = {
        "type": "ckpt_result", "action": "restore", "pid": pid, "ok": True, "state": "running", "touched": True,
        "code": 0, "image": str(image_dir), "ranks": [r["pid"] for r in job["ranks"]],
        "restore_s": job.get("restore_s"), "gpu_map": job.get("gpu_map"),
        **({} if port_wait_s is None else {"port_wait_s": port_wait_s}),
        **({"outside": plan.done} if plan.done else {}),
        "message": f"the job of PID {pid} restored from {image_dir}: {len(job['ranks'])} processes on the GPU, "
                   "running" + (" on the GPUs --device-map named" if job.get("gpu_map") else ""),
    }
    ckpt.out(result)
    return result
