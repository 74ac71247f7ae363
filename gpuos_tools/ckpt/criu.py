"""Full-process images through CRIU: the GPU checkpoint around ``criu dump`` / ``criu restore``.

CRIU does the process (memory, threads, files, sockets); the driver does the GPU. gpu-ckpt
checkpoints the GPU state first (the process then holds no GPU, which CRIU requires) and runs
``criu dump``; gpu-restore runs ``criu restore`` and then restores the GPU state and unlocks.
Process checkpointing is not re-implemented here.

CRIU is checked before anything is touched: it must be on PATH, version 4 or later (3.x, e.g.
Debian 12's 3.17, fails on recent kernels) and ``criu check`` must pass (which needs root).

The dump also records the pipes of which the tree holds one end only (``outside.py``: a
``| tee`` reading its output, a launcher that captured it); the restore gives each one the
original pipe if its other end is still alive, else a file or /dev/null, so the program goes on.

The dump records the tree's listening TCP sockets in the manifest; before ``criu restore`` runs,
the restore waits for the process's own closed connections in TIME_WAIT to free their ports
(``ports.py`` says why), or refuses a port a live socket holds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gpuos_tools import procs
from gpuos_tools.ckpt import outside, ports, registry
from gpuos_tools.ckpt.driver import Checkpointer, CkptError, Record, left_message
from gpuos_tools.ckpt.guard import DUMP_RC, Guard, finalize
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.image import temp_name
from gpuos_tools.stream.records import BYTES, COUNT
from gpuos_tools.stream.schema import Anything, Bool, Field, Int, List, Obj, RecordType, Str

MIN_VERSION = (4, 0)
#: What gpu-ckpt writes beside CRIU's images: the process, its GPUs and bytes (``IMAGE_META``).
METADATA = "gpuos-ckpt.json"

_PID = Int(1, (1 << 31) - 1, "pid")
#: The manifest of a CRIU image, as data: the restore checks an image's against it.
IMAGE_META = RecordType(METADATA, "what gpu-ckpt --image writes beside CRIU's image files.", (
    Field("pid", _PID, "the dumped process (of a job: its launcher); CRIU restores it under this pid",
          required=True),
    Field("kind", Str(("job",)), "`job`: the whole tree of a job (gpu-ckpt --job PID --image); absent: one "
          "process"),
    Field("starttime", COUNT, "clock ticks after boot"), Field("boot_id", Str()), Field("user", Str()),
    Field("command", Str(), null=True), Field("checkpointed_at", Str()),
    Field("gpus", List(Anything()), "GPUs {index, uuid, name, memory}"),
    Field("bytes", BYTES, "GPU memory checkpointed; null: unknown", null=True),
    Field("criu", Str(), "the version of CRIU that dumped it"),
    Field("criu_args", List(Str()), "(job) CRIU options of the dump that the restore repeats"),
    Field("leave_running", Bool(), "the dumped process ran on"),
    Field("ranks", List(Obj((Field("pid", _PID), Field("rank", COUNT, null=True), Field("command", Str(), null=True),
                             Field("gpus", List(Anything())), Field("bytes", BYTES, null=True)),
                            text="{pid, rank, command, gpus, bytes}")), "(job) the processes on the GPU"),
    Field("pids", List(_PID), "the processes of the dumped tree"),
    Field("tids", List(_PID), "their threads: the restore is refused while any of these ids is taken (absent: "
          "only pid is checked)"),
    Field("driver", Anything(), "{cuda, release}"),
    Field("listeners", ports.LISTENERS, "the tree's listening TCP sockets: before CRIU runs, the restore "
          "waits until no closing connection holds their ports (absent: not recorded, not waited for)"),
    Field("agent", Anything(), "(a program under the agent) its agent's control socket and mechanism, and "
          "whether the dump had it suspend the program (the restore then has it resume)"),
    Field("trace_pipe", Anything(), "(a program under the agent) the pipe its tracer wrote to, which the "
          "restore replaces by /dev/null"),
    Field(outside.KEY, outside.ENTRIES, "the tree's pipes and FIFOs whose other end was outside it (the trace "
          "pipe excepted): the restore reconnects each to the original pipe where its other end is alive, else "
          "gives a write end a file and a read end /dev/null (absent: not recorded, restored as CRIU does)"),
), note="Every other key is the writer's, kept as given.")
_check_meta = IMAGE_META.checker()
DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"
RESTORED_PID = "restored.pid"


@dataclass
class Criu:
    path: str
    version: tuple[int, int]
    version_text: str


@dataclass
class Hooks:
    """What a caller adds to a dump or a restore (gpuos_tools/ckpt/agent_criu.py: the program's
    agent). Each callable runs while the guard still watches, so that a tool killed in it is
    recovered as the guard's fields say."""

    meta: dict[str, Any] = field(default_factory=dict)  #: more metadata (dump)
    guard: dict[str, Any] = field(default_factory=dict)  #: more fields of the guard's first message
    #: dump: after the guard started, before the driver's checkpoint; what it returns joins the metadata
    before_gpu: Callable[[Any], dict[str, Any] | None] | None = None
    #: dump: the result record before it is written (the image in place, with --leave-running the
    #: process resumed); restore: the driver's restore record, once the process runs
    after: Callable[[Any, Record], None] | None = None
    criu_args: list[str] = field(default_factory=list)  #: more arguments of `criu restore`
    pass_fds: tuple[int, ...] = ()  #: descriptors `criu restore` inherits (for --inherit-fd)


def _tail(text: str, lines: int = 5) -> str:
    rows = [r for r in text.strip().splitlines() if r.strip()]
    return " | ".join(rows[-lines:]) if rows else "(no output)"


def log_errors(log: Path, lines: int = 3) -> str:
    """CRIU's own words for a failure: the last ``Error`` lines of its log (stdout is usually empty)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - (1 << 20)))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    rows = [r.strip() for r in text.splitlines() if "Error" in r]
    return " | ".join(rows[-lines:]) if rows else "(no error line in the log)"


def find_criu(timeout: float = 60) -> Criu:
    """The usable CRIU on PATH, or raise CRIU_UNUSABLE saying what is missing. Touches no process."""
    untouched = "nothing was touched (without --image, the GPU state alone is checkpointed)"
    exe = shutil.which("criu")
    if exe is None:
        raise GpuosError(
            f"--image needs CRIU 4 or later and there is no `criu` on PATH; {untouched}", ExitCode.CRIU_UNUSABLE)
    try:
        done = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise GpuosError(f"cannot run `{exe} --version`: {e}; {untouched}", ExitCode.CRIU_UNUSABLE) from e
    m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", done.stdout + done.stderr)
    if done.returncode != 0 or m is None:
        raise GpuosError(
            f"cannot tell the version of {exe} (`criu --version` said: {_tail(done.stdout + done.stderr)}); "
            f"{untouched}", ExitCode.CRIU_UNUSABLE)
    version = (int(m.group(1)), int(m.group(2)))
    text = ".".join(g for g in m.groups() if g is not None)
    if version < MIN_VERSION:
        raise GpuosError(
            f"{exe} is CRIU {text}; --image needs CRIU {MIN_VERSION[0]} or later (3.x, such as Debian 12's "
            f"3.17, fails on recent kernels): install a newer CRIU; {untouched}", ExitCode.CRIU_UNUSABLE)
    try:
        check = subprocess.run([exe, "check"], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise GpuosError(f"cannot run `{exe} check`: {e}; {untouched}", ExitCode.CRIU_UNUSABLE) from e
    if check.returncode != 0:
        raise GpuosError(
            f"`criu check` failed (exit {check.returncode}): {_tail(check.stdout + check.stderr)}; CRIU {text} "
            f"cannot checkpoint on this machine (it needs root and kernel support); {untouched}",
            ExitCode.CRIU_UNUSABLE)
    return Criu(exe, version, text)


#: Runs CRIU and then writes its exit status to $GPUOS_CRIU_RC (temp file, rename): the guard of a
#: killed tool is not CRIU's parent, so this is how it learns whether a dump finished.
RC_WRAPPER = ('rc=0; "$@" || rc=$?; echo "$rc" > "$GPUOS_CRIU_RC.tmp" && mv -f "$GPUOS_CRIU_RC.tmp" "$GPUOS_CRIU_RC"; '
            'exit "$rc"')


def _run_criu(ckpt: Checkpointer, pid: int | None, step: str, cmd: list[str], log: Path,
              out: Path, rc_file: Path | None = None, pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess:
    """Run CRIU with its output into the file ``out``, not into pipes of ours: if this tool is
    killed, CRIU must carry on (a write to a dead reader's pipe would end it). With ``rc_file``,
    its exit status is written there when it ends, whoever waits for it."""
    t = time.monotonic()
    argv, env = cmd, None
    if rc_file is not None:
        argv = ["/bin/sh", "-c", RC_WRAPPER, "gpuos-criu", *cmd]
        env = {**os.environ, "GPUOS_CRIU_RC": str(rc_file)}
    with open(out, "wb") as f:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                              pass_fds=pass_fds, check=False)
    try:
        text = out.read_text(errors="replace")
    except OSError:
        text = ""
    done = subprocess.CompletedProcess(cmd, done.returncode, text, "")
    rec: Record = {
        "type": "ckpt_step",
        "pid": pid,
        "step": step,
        "ok": done.returncode == 0,
        "duration_s": round(time.monotonic() - t, 6),
        "command": cmd,
        "log": str(log),
    }
    if done.returncode != 0:
        rec["error"] = f"exit {done.returncode}"
    ckpt.out(rec)
    return done


def image_state(image_dir: Path) -> str:
    """"complete" (an image gpu-ckpt finished), "empty" (missing or an empty directory), or
    "other" (anything else: never written over)."""
    if (image_dir / METADATA).exists() and (image_dir / "inventory.img").exists():
        return "complete"
    if not image_dir.exists() or (image_dir.is_dir() and not any(image_dir.iterdir())):
        return "empty"
    return "other"


def usable_criu(ckpt: Checkpointer, action: str, pid: int | None) -> Criu:
    """``find_criu()``, its refusal recorded as the action's failure (nothing touched)."""
    try:
        return find_criu()
    except GpuosError as e:
        raise ckpt.fail(action, pid, str(e), e.code, None, False) from None


def empty_image_dir(ckpt: Checkpointer, pid: int, image_dir: Path) -> Path:
    """``image_dir`` resolved, refused (nothing touched) unless it is missing or empty: a dump
    never writes over anything."""
    image_dir = Path(image_dir).resolve()
    if image_state(image_dir) != "empty":
        raise ckpt.fail("dump", pid, f"{image_dir} is not empty (it holds an image or other files): choose a new "
                        "or empty directory; nothing was touched", ExitCode.USAGE, None, False)
    return image_dir


#: CRIU carries a deleted file a process still holds (a "ghost") inside the image only up to
#: this size unless told otherwise (``--ghost-limit``, CRIU's default 1 MiB).
CRIU_GHOST_LIMIT = 1 << 20


def ghost_limit(pids: list[int], criu_args: list[str]) -> list[str]:
    """``--ghost-limit`` large enough for every deleted file the tree holds, unless the caller
    chose one or CRIU's default suffices: without it such a dump fails ("Can't dump ghost file")."""
    if any(a == "--ghost-limit" or a.startswith("--ghost-limit=") for a in criu_args):
        return []
    largest = procs.largest_deleted_file(pids)
    return ["--ghost-limit", str(largest)] if largest > CRIU_GHOST_LIMIT else []


def dump(ckpt: Checkpointer, pid: int, image_dir: Path, timeout_ms: int = 0, leave_running: bool = False,
         criu_args: list[str] | None = None, hooks: Hooks | None = None) -> Record:
    """GPU checkpoint of ``pid``, then ``criu dump`` of it into ``image_dir``.

    Without ``leave_running`` CRIU ends the process after the dump (the image is its restorable
    state); with it, the process gets its GPU state back and runs on. If ``criu dump`` fails
    the process is restored and unlocked, and CRIU_FAILED raised.

    The image is written into a dot-named temp directory beside ``image_dir`` and renamed into
    place once CRIU has finished and the metadata is written: ``image_dir`` holds a complete
    image or nothing. A guard process (gpuos_tools/ckpt/guard.py) finishes or undoes the dump if
    this process is killed, even by SIGKILL.
    """

    criu = usable_criu(ckpt, "dump", pid)
    image_dir = empty_image_dir(ckpt, pid, image_dir)
    temp = Path(temp_name(str(image_dir)))
    # the guard first: killed at any moment after the temp directory exists, it is there to remove it
    hooks = hooks or Hooks()
    guard = Guard("dump", pid, image_dir, temp, leave_running=leave_running, **hooks.guard)
    try:
        image_dir.parent.mkdir(parents=True, exist_ok=True)
        temp.mkdir(mode=0o700)
    except OSError as e:
        guard.done()
        raise ckpt.fail("dump", pid, f"{temp}: cannot create: {e.strerror}; nothing was touched",
                         ExitCode.IO_ERROR, None, False) from e
    try:
        result = _dump(ckpt, criu, guard, pid, image_dir, temp, timeout_ms, leave_running, criu_args, hooks)
    except CkptError:  # the process was left in the state the error names
        guard.done()
        shutil.rmtree(temp, ignore_errors=True)
        raise
    except BaseException as e:  # interrupted (or a bug): the guard finishes or undoes the dump
        raise _handed_to_guard(ckpt, guard, "dump", pid, e) from e
    guard.done()
    return result


def _handed_to_guard(ckpt: Checkpointer, guard: Any, action: str, pid: int, e: BaseException) -> CkptError:
    gpid = guard.abandon()
    code = ExitCode.INTERRUPTED if isinstance(e, KeyboardInterrupt) else ExitCode.SOFTWARE
    return ckpt.fail(action, pid, f"interrupted ({type(e).__name__}: {e}) during the {action} of PID {pid}; its "
                     f"guard (PID {gpid}) waits for CRIU, keeps a complete image and brings the process back "
                     f"to running (what it did: {registry.state_dir() / 'guard.log'})", code, None, True)


def _dump(ckpt: Checkpointer, criu: Criu, guard: Any, pid: int, image_dir: Path, temp: Path, timeout_ms: int,
          leave_running: bool, criu_args: list[str] | None, hooks: Hooks) -> Record:
    info = procs.read_proc(pid) if procs.exists(pid) else None
    extra = dict(hooks.meta)
    if hooks.before_gpu is not None:
        extra.update(hooks.before_gpu(guard) or {})
    guard.phase("gpu")
    gpu = ckpt.suspend(pid, timeout_ms)  # raises CkptError, the process left running
    entry = registry.lookup(pid) or {}
    meta = {
        **ckpt.header_fields(),  # the driver; its list of the machine's GPUs gives way to the process's below
        **(registry.entry_for(info) if info else {"pid": pid}),
        "gpus": entry.get("gpus", []),  # what the restore maps from (source GPUs)
        "bytes": gpu.get("bytes"),
        "criu": criu.version_text,
        "leave_running": leave_running,
        "listeners": ports.listeners(procs.descendants(pid)),
        **dict(zip(("pids", "tids"), procs.tree_ids(pid))),  # each must be free for the restore
        outside.KEY: outside.scan(procs.descendants(pid), skip=trace_pipe_of(extra)),
        **extra,
    }
    try:
        registry.write_json_atomic(temp / METADATA, meta, mode=0o644)
    except GpuosError as e:
        left = ckpt.bring_back(pid)
        raise ckpt.fail("dump", pid, f"{e}; {left_message(left, pid)}", e.code, left, left != "running") from None
    cmd = [criu.path, "dump", "--tree", str(pid), "--images-dir", str(temp), "--log-file", DUMP_LOG,
           "--shell-job", *ghost_limit(procs.descendants(pid), criu_args or []),
           *(["--leave-running"] if leave_running else []), *(criu_args or [])]
    guard.phase("criu")
    done = _run_criu(ckpt, pid, "criu_dump", cmd, image_dir / DUMP_LOG, temp / "criu-dump.out", temp / DUMP_RC)
    if done.returncode != 0:
        keep = _keep_log(temp / DUMP_LOG, image_dir.parent / f"{image_dir.name}.{DUMP_LOG}")
        if procs.exists(pid):
            left = ckpt.bring_back(pid)
            where = left_message(left, pid)
        else:
            left, where = None, "the process is gone"
        raise ckpt.fail(
            "dump", pid,
            f"criu dump failed (exit {done.returncode}; log {keep}): "
            f"{_said(done.stdout, keep)}; no image was written; {where}", ExitCode.CRIU_FAILED, left, True)
    guard.phase("finalize")
    try:
        finalize(temp, image_dir)
    except OSError as e:
        left = ckpt.bring_back(pid) if procs.exists(pid) else None
        raise ckpt.fail("dump", pid, f"{image_dir}: cannot move the finished dump there ({e.strerror}); "
                         f"{left_message(left, pid) if left else 'the process is gone'}",
                         ExitCode.IO_ERROR, left, True) from e
    if leave_running:
        guard.phase("resume")
        ckpt.resume(pid)
        state, message = "running", f"PID {pid} dumped to {image_dir} and left running"
    else:
        registry.forget(pid)
        state = "dumped"
        message = f"PID {pid} dumped to {image_dir} and ended by CRIU; `gpu-restore --image {image_dir}` brings it back"
    result: Record = {
        "type": "ckpt_result",
        "action": "dump",
        "pid": pid,
        "ok": True,
        "state": state,
        "touched": True,
        "code": 0,
        "image": str(image_dir),
        "bytes": gpu.get("bytes"),
        "checkpoint_s": gpu.get("checkpoint_s"),
        "message": message,
    }
    if hooks.after is not None:
        hooks.after(guard, result)
    ckpt.out(result)
    return result


def trace_pipe_of(meta: dict[str, Any]) -> set[str]:
    """The agent's trace pipe named in ``meta`` (its restore handles it): not scanned as outside."""
    pipe = meta.get("trace_pipe")
    return {str(pipe["pipe"])} if isinstance(pipe, dict) and "pipe" in pipe else set()


def outside_plan(ckpt: Checkpointer, pid: int, image_dir: Path, meta: dict[str, Any], output_to: str | None,
                 warn: Callable[[str], None] | None) -> outside.Plan:
    """``outside.plan`` for an image, its notes said through ``warn``; a file that cannot be opened
    is refused, nothing touched."""
    try:
        plan = outside.plan(image_dir, meta, output_to, same_boot=meta.get("boot_id") == procs.boot_id())
    except OSError as e:
        raise ckpt.fail("restore", pid, f"{e.filename}: cannot open for the restored program's output "
                        f"({e.strerror}); nothing was touched", ExitCode.IO_ERROR, None, False) from None
    for note in plan.notes:
        if warn is not None:
            warn(note)
    return plan


def _said(stdout: str, log: Path) -> str:
    """What CRIU printed, else the error lines of its log."""
    return _tail(stdout) if stdout.strip() else log_errors(log)


def _keep_log(log: Path, keep: Path) -> Path:
    """Move CRIU's log of a failed dump out of the temp directory (which goes) beside the image."""
    try:
        os.replace(log, keep)
        return keep
    except OSError:
        return log


def checked_meta(ckpt: Checkpointer, image_dir: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` (an image's METADATA), refused as IMAGE_CORRUPT, nothing touched, unless it is
    what IMAGE_META says."""
    problem = _check_meta(meta)
    if problem is not None:
        pid = meta.get("pid") if isinstance(meta.get("pid"), int) and meta["pid"] > 0 else None
        raise ckpt.fail("restore", pid, f"{image_dir / METADATA}: {problem}; nothing was touched",
                        ExitCode.IMAGE_CORRUPT, None, False)
    return meta


def refuse_taken_ids(ckpt: Checkpointer, pid: int, meta: dict[str, Any], what: str, running_hint: str) -> None:
    """Refused, nothing touched, while a process or thread id of the image (``pid``, its
    manifest's ``pids`` and ``tids``; older images name only ``pid``) is taken, a zombie's
    included: CRIU restores the tree under its old ids. ``running_hint`` is said when ``pid``
    itself still runs."""
    ids = sorted({pid, *(int(p) for p in meta.get("pids") or []), *(int(t) for t in meta.get("tids") or [])})
    busy = procs.taken(ids)
    if not busy:
        return
    hint = (f" ({running_hint})" if running_hint and pid in busy and procs.exists(pid) else
            f" ({pid} has ended, and its parent (PID {procs.parent_of(pid)}) has not reaped it)"
            if pid in busy and procs.unreaped(pid) else "")
    raise ckpt.fail("restore", pid, f"CRIU restores the {what} under its old process and thread ids, and "
                    + ", ".join(str(i) for i in busy[:10]) + (" ..." if len(busy) > 10 else "")
                    + f" {'is' if len(busy) == 1 else 'are'} taken now{hint}; nothing was touched",
                    ExitCode.WRONG_STATE, None, False)


def wait_for_listeners(ckpt: Checkpointer, pid: int, meta: dict[str, Any], wait_s: float,
                       warn: Callable[[str], None] | None,
                       waiting: Callable[[float | None], None] | None = None) -> float | None:
    """Before CRIU restores the image: wait, at most ``wait_s`` seconds, until no closing connection
    holds a port of the listening sockets its manifest records (CRIU's bind of one without
    SO_REUSEADDR fails on it); the seconds waited, None for an image that records none. A port a
    live socket holds, or one still held after ``wait_s``, is refused: nothing touched. ``warn`` and
    ``waiting`` hear of the wait as ``ports.wait_for_ports`` says."""
    wanted = meta.get("listeners")
    if wanted is None:
        return None
    try:
        return ports.wait_for_ports(wanted, wait_s, warn, waiting=waiting)
    except GpuosError as e:
        raise ckpt.fail("restore", pid, f"{e}; nothing was touched", e.code, None, False) from None


def restore(ckpt: Checkpointer, image_dir: Path, device: str | None = None, device_map: str | None = None,
            criu_args: list[str] | None = None, hooks: Hooks | None = None, port_wait_s: float = ports.WAIT_S,
            warn: Callable[[str], None] | None = None, output_to: str | None = None,
            waiting: Callable[[float | None], None] | None = None) -> Record:
    """``criu restore`` of the image in ``image_dir``, then GPU restore (onto ``device``) and unlock.
    First, up to ``port_wait_s`` seconds for the ports of its listeners (``wait_for_listeners``;
    ``warn`` says once that it waits, ``waiting`` hears how long so far); ``hooks`` add to the command line, the guard and the end.
    Pipes whose other end was outside the image get what ``outside.plan`` gives them (``output_to``:
    the file their output goes to), said through ``warn`` and in the result's ``outside``."""
    criu = usable_criu(ckpt, "restore", None)
    image_dir = Path(image_dir).resolve()
    meta = registry.read_json(image_dir / METADATA)
    if not isinstance(meta, dict) or "pid" not in meta or not (image_dir / "inventory.img").exists():
        raise ckpt.fail("restore", None, f"{image_dir} holds no image written by gpu-ckpt --image "
                         f"(no {METADATA})", ExitCode.NO_INPUT, None, False)
    meta = checked_meta(ckpt, image_dir, meta)
    pid = int(meta["pid"])
    if procs.exists(pid):
        raise ckpt.fail("restore", pid, f"PID {pid} is taken by a running process, and CRIU restores the "
                         f"image under its old PID (is the dumped process still running? then "
                         f"`gpu-restore --pid {pid}`); nothing was touched", ExitCode.WRONG_STATE, None, False)
    refuse_taken_ids(ckpt, pid, meta, "process", "")
    try:
        _ = ckpt.api  # the driver must be there before CRIU brings the process back
    except GpuosError as e:
        raise ckpt.fail("restore", pid, f"{e}; nothing was touched", e.code, None, False) from None
    waited = wait_for_listeners(ckpt, pid, meta, port_wait_s, warn, waiting)
    plan = outside_plan(ckpt, pid, image_dir, meta, output_to, warn)
    try:
        return _restore(ckpt, criu, image_dir, meta, pid, device, device_map, criu_args, hooks or Hooks(), waited,
                        plan)
    except CkptError as e:
        if not e.touched:
            plan.discard()
        raise
    finally:
        plan.close()


def _restore(ckpt: Checkpointer, criu: Criu, image_dir: Path, meta: dict[str, Any], pid: int, device: str | None,
             device_map: str | None, criu_args: list[str] | None, hooks: Hooks, waited: float | None,
             plan: outside.Plan) -> Record:
    pidfile = image_dir / RESTORED_PID
    pidfile.unlink(missing_ok=True)
    sources = [g["uuid"] for g in meta.get("gpus") or [] if isinstance(g, dict) and "uuid" in g]
    cmd = [criu.path, "restore", "--images-dir", str(image_dir), "--log-file", RESTORE_LOG, "--shell-job",
           "--restore-detached", "--pidfile", str(pidfile), *hooks.criu_args, *plan.criu_args, *(criu_args or [])]
    fields: Record = {} if waited is None else {"port_wait_s": waited}
    if plan.done:
        fields["outside"] = plan.done
    guard = Guard("restore", pid, image_dir, device=device, device_map=device_map, source_gpus=sources or None,
                  **hooks.guard)
    try:
        guard.phase("criu")
        done = _run_criu(ckpt, pid, "criu_restore", cmd, image_dir / RESTORE_LOG, image_dir / "criu-restore.out",
                         pass_fds=(*hooks.pass_fds, *plan.pass_fds))
        if done.returncode != 0:
            if procs.exists(pid):  # CRIU failed after the process came back: do not leave it without its GPU
                left = ckpt.bring_back(pid)
                raise ckpt.fail("restore", pid, f"criu restore reported a failure (exit {done.returncode}; log "
                                f"{image_dir / RESTORE_LOG}) but PID {pid} is there: {left_message(left, pid)}",
                                ExitCode.CRIU_FAILED, left, True)
            raise ckpt.fail(
                "restore", pid, f"criu restore failed (exit {done.returncode}; log {image_dir / RESTORE_LOG}): "
                f"{_said(done.stdout, image_dir / RESTORE_LOG)}; nothing was restored, the image is intact",
                ExitCode.CRIU_FAILED, None, False)
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            pass
        guard.phase("gpu", pid=pid)
        result = ckpt.resume(pid, device, device_map, source_gpus=sources or None,
                             result_fields=fields or None)
        if hooks.after is not None:
            hooks.after(guard, result)
    except CkptError:
        guard.done()
        raise
    except BaseException as e:  # interrupted: the guard finishes the restore
        raise _handed_to_guard(ckpt, guard, "restore", pid, e) from e
    guard.done()
    return result
