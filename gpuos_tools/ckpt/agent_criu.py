"""Full-process images of a program under the agent on interception: its owned device memory
leaves the GPU through the agent at link speed, then the driver's checkpoint and CRIU take the rest.

`gpu-ckpt --pid PID --image DIR` of a program started under the agent (`gpu-ckpt run`,
`gpu-trace run --agent`) with ``--mechanism intercept`` and owned memory (GPUOS_AGENT_OWN=1):

1. its agent suspends it (``--partial``: what is not owned stays for the driver): the owned
   buffers go to the agent's pinned staging at ~55 GB/s and their physical memory back to the
   driver; the program waits in the interposer;
2. the driver's checkpoint then copies only what is left (the context, memory not owned) and
   ``criu dump`` writes the process, the staging included (gpuos_tools/ckpt/criu.py);
3. the metadata says so (``agent.suspended_by_dump``); `gpu-restore --image DIR` runs
   ``criu restore`` and the driver's restore as for any image, and then asks the restored agent
   to resume (``--lazy``: at once, the buffers loading behind the program).

With ``--leave-running`` the agent resumes the program after the dump. This is automatic where
it applies; ``agent_suspend=False`` (``--no-agent-suspend``) dumps such a program the plain way.
A program whose agent owns nothing (no GPUOS_AGENT_OWN) is dumped the plain way; one whose agent
is already suspended (`gpu-ckpt --agent PID --suspend`) too, and it stays suspended after the
restore, as it was. A program under the agent on CUPTI callbacks is refused before anything is
touched: the driver refuses a process with CUPTI loaded.

Never stranded: a dump that fails or is refused after the suspend has the agent resume the
program (the error says so); the guard (gpuos_tools/ckpt/guard.py), given the agent's socket,
does the same if gpu-ckpt is killed, and resumes the agent after a restore whose tool was killed.
An agent that does not answer leaves the program held, and the message names the command that
resumes it.

The program's trace stream goes to its launcher (`gpu-trace run`) through a pipe, which CRIU
cannot carry across: restored, the pipe would have no reader, the tracer would stop at its first
write and the agent with it. The dump records the pipe; the restore hands the restored program
/dev/null in its place (CRIU's ``--inherit-fd``), so its agent goes on, without a stream. The
program's other pipes to processes outside the image are the plain path's (``outside.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from collections.abc import Callable
from typing import Any

from gpuos_tools import procs
from gpuos_tools.agent import control
from gpuos_tools.ckpt import criu, outside, ports, registry
from gpuos_tools.ckpt.agent_hold import PING_TIMEOUT_S, resume_held, still_held
from gpuos_tools.ckpt.driver import Checkpointer, CkptError, Record
from gpuos_tools.errors import ExitCode, GpuosError

#: The metadata key (in criu.METADATA) of what the dump did with the program's agent.
AGENT = "agent"
#: The metadata key of the trace pipe the restore replaces.
TRACE_PIPE = "trace_pipe"
#: The launcher's boot configuration in the program's environment (gpuos_tools/injection/config.py,
#: a layer above this one, names it ENV); its ``trace.fd`` is the pipe's write end.
BOOT_ENV = "GPUOS_BOOT"
SUSPEND_TIMEOUT_S = 600.0


def agent_status(pid: int) -> tuple[Path | None, dict[str, Any] | None, str | None]:
    """(the socket, the agent's ping answer, why there is none) of ``pid``'s agent; (None, None,
    None) when it has no agent socket."""
    path = control.socket_path(pid)
    if not path.exists():
        return None, None, None
    try:
        status = control.request(path, "ping", timeout=PING_TIMEOUT_S)
    except GpuosError as e:
        return path, None, str(e)
    if status.get("pid", pid) != pid:
        return path, None, f"the agent at {path} is PID {status.get('pid')}'s, not PID {pid}'s"
    return path, status, None


def trace_pipe(pid: int) -> dict[str, Any] | None:
    """The pipe to its launcher that the program's tracer writes (fd, ``pipe:[inode]``), or None."""
    boot = procs.environ_values(pid, (BOOT_ENV,)).get(BOOT_ENV)
    if not boot:
        return None
    try:
        fd = int(json.loads(boot)["trace"]["fd"])
        target = os.readlink(f"{procs.PROC}/{pid}/fd/{fd}")
    except (ValueError, KeyError, TypeError, OSError):
        return None
    return {"fd": fd, "pipe": target} if target.startswith("pipe:[") else None


def refuse_cupti(ckpt: Checkpointer, pid: int, socket: Path) -> CkptError:
    return ckpt.fail(
        "dump", pid, f"PID {pid} runs under the agent on CUPTI callbacks ({socket}), and the driver's checkpoint, "
        "which a full-process image needs, refuses a process with CUPTI loaded; nothing was touched. A program "
        "on interception (the default; not --mechanism cupti or GPUOS_AGENT_MECHANISM=cupti) can be dumped; this one can be "
        f"snapshotted through its agent: `gpu-ckpt --agent {pid} --image DIR`", ExitCode.NOT_CHECKPOINTABLE,
        "running", False)


class _Suspended:
    """The agent's side of one dump: suspend it, and resume it on every way out."""

    def __init__(self, ckpt: Checkpointer, pid: int, socket: Path, mechanism: str):
        self.ckpt, self.pid, self.socket, self.mechanism = ckpt, pid, socket, mechanism
        self.suspended = False  #: this dump suspended the program
        self.resumed = False  #: ... and its agent was asked to resume it (whatever it answered)

    def before_gpu(self, guard: Any) -> dict[str, Any]:
        """Suspend, after the guard knows where the agent is."""
        guard.phase("agent")
        meta = {"socket": str(self.socket), "mechanism": self.mechanism, "suspended_by_dump": False}
        try:
            answer = control.request(self.socket, "suspend", timeout=SUSPEND_TIMEOUT_S, partial=True)
        except GpuosError as e:
            if e.code == ExitCode.NOT_OWNED:  # nothing owned to take off the GPU: the plain way
                return {AGENT: {**meta, "why": str(e)}}
            words = self._undo()  # it may have suspended before the answer was lost
            raise self.ckpt.fail("dump", self.pid, f"its agent did not suspend PID {self.pid} ({e}); "
                                 f"{words or 'nothing was touched'}; `--no-agent-suspend` dumps it without its "
                                 "agent", e.code, "running", bool(words)) from None
        answer.pop("ok", None)
        self.suspended = True
        self.ckpt.out({"type": "agent_suspend", "agent": str(self.pid), **answer})
        return {AGENT: {**meta, "suspended_by_dump": True, "released_bytes": answer.get("released_bytes"),
                        "buffers": answer.get("buffers"), "suspend_s": answer.get("suspend_s"),
                        "not_owned": answer.get("not_owned")}}

    def _undo(self) -> str:
        """Resume the program through its agent if it holds it: what was done, in words ('' when
        it was not held)."""
        self.resumed = True
        try:
            answer = resume_held(self.socket)
        except GpuosError as e:
            return still_held(self.pid, e) if procs.exists(self.pid) else "the program is gone"
        if answer is None:
            return ""
        self.ckpt.out({"type": "agent_resume", "agent": str(self.pid), **answer})
        return "its agent resumed it"

    def failed(self, state: str | None) -> str:
        """Words for the error of a dump that failed after the suspend, the agent resumed where
        the driver left the program running."""
        if not self.suspended or self.resumed or not procs.exists(self.pid):
            return ""
        if state == "running":
            return self._undo()
        if state in ("locked", "checkpointed"):
            return (f"its agent holds it suspended too: after `gpu-restore --pid {self.pid}`, "
                    f"`gpu-restore --agent {self.pid} --resume` resumes it")
        return "its guard has its agent resume it once the process runs"

    def after(self, guard: Any, result: Record) -> None:
        """The image is in place: with --leave-running the program runs again on the driver's side,
        and its agent resumes it; otherwise CRIU ended it and the restore will."""
        if not self.suspended:
            return
        result["agent_suspended"] = True
        if result["state"] != "running":
            result["message"] += "; its agent had suspended it: the restore has it resume"
            return
        guard.phase("agent_resume")
        self.resumed = True
        try:
            answer = resume_held(self.socket)
        except GpuosError as e:
            raise self.ckpt.fail("dump", self.pid, f"PID {self.pid} dumped to {result['image']} and running on the "
                                 f"driver's side, but {still_held(self.pid, e)}", e.code, "running", True,
                                 image=result["image"]) from None
        if answer is not None:
            self.ckpt.out({"type": "agent_resume", "agent": str(self.pid), **answer})
        result["message"] += "; its agent resumed it"


def dump(ckpt: Checkpointer, pid: int, image_dir: Path, timeout_ms: int = 0, leave_running: bool = False,
         criu_args: list[str] | None = None, agent_suspend: bool = True) -> Record:
    """`gpu-ckpt --pid PID --image DIR`: criu.dump, through the program's agent where it has one
    on interception that owns memory (the module's text); ``agent_suspend=False``: never."""
    socket, status, unreachable = agent_status(pid) if procs.exists(pid) else (None, None, None)
    if socket is None:
        return criu.dump(ckpt, pid, image_dir, timeout_ms, leave_running, criu_args)
    pipe = trace_pipe(pid)
    hooks = criu.Hooks(meta={TRACE_PIPE: pipe} if pipe else {})
    if status is None:  # a socket nobody answers on (a program gone, its pid reused): the plain way
        hooks.meta[AGENT] = {"socket": str(socket), "suspended_by_dump": False, "why": unreachable}
        return criu.dump(ckpt, pid, image_dir, timeout_ms, leave_running, criu_args, hooks)
    mechanism = status.get("mechanism", "cupti")
    if mechanism != "intercept":
        raise refuse_cupti(ckpt, pid, socket)
    meta = {"socket": str(socket), "mechanism": mechanism, "suspended_by_dump": False}
    if not agent_suspend:
        hooks.meta[AGENT] = {**meta, "why": "--no-agent-suspend"}
        return criu.dump(ckpt, pid, image_dir, timeout_ms, leave_running, criu_args, hooks)
    if status.get("state", "running") != "running":
        hooks.meta[AGENT] = {**meta, "state": status.get("state"),
                             "why": f"already {status.get('state')} before the dump: left so after the restore"}
        return criu.dump(ckpt, pid, image_dir, timeout_ms, leave_running, criu_args, hooks)
    agent = _Suspended(ckpt, pid, socket, mechanism)
    hooks.guard = {"agent": str(socket)}
    hooks.before_gpu, hooks.after = agent.before_gpu, agent.after

    def note(fpid: int | None, state: str | None) -> str:  # every failure after the suspend says what the agent did
        return agent.failed(state) if fpid == pid else ""

    with ckpt.failure_note(note):
        return criu.dump(ckpt, pid, image_dir, timeout_ms, leave_running, criu_args, hooks)


def image_agent(image_dir: Path) -> dict[str, Any]:
    """What the dump of the image did with its program's agent ({} when nothing)."""
    meta = registry.read_json(Path(image_dir) / criu.METADATA)
    return (meta.get(AGENT) or {}) if isinstance(meta, dict) else {}


def restore(ckpt: Checkpointer, image_dir: Path, device: str | None = None, device_map: str | None = None,
            criu_args: list[str] | None = None, lazy: bool = False, port_wait_s: float = ports.WAIT_S,
            warn: Callable[[str], None] | None = None, output_to: str | None = None,
            waiting: Callable[[float | None], None] | None = None) -> Record:
    """`gpu-restore --image DIR`: criu.restore (``port_wait_s``, ``warn``, ``waiting`` and ``output_to`` as there), then, when
    the dump suspended the program's agent, the agent's resume (``lazy``: at once, the buffers
    loading behind the program)."""
    meta = registry.read_json(Path(image_dir) / criu.METADATA)
    meta = meta if isinstance(meta, dict) else {}
    agent = meta.get(AGENT) or {}
    ours = bool(agent.get("suspended_by_dump"))
    if lazy and not ours:
        raise GpuosError(f"--lazy: the dump of {image_dir} did not suspend its program's agent, so the restore "
                         "has no agent resume to make lazy; restore it without --lazy", ExitCode.USAGE)
    hooks = criu.Hooks()
    pipe = meta.get(TRACE_PIPE)
    null = -1
    if isinstance(pipe, dict) and str(pipe.get("pipe", "")).startswith("pipe:["):
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        hooks.criu_args = outside.inherit_args(null, pipe["pipe"])
        hooks.pass_fds = (null,)
    if agent.get("state") == "suspended":  # suspended before the dump, by someone else: left so
        def held(guard: Any, result: Record) -> None:
            result["message"] = result.get("message", "") + (
                f"; its agent holds it suspended, as before the dump: `gpu-restore --agent {result.get('pid')} "
                "--resume` resumes it")

        hooks.after = held
    if ours:
        pid = int(meta["pid"])
        socket = agent.get("socket") or str(control.socket_path(pid))
        hooks.guard = {"agent": socket, "lazy": lazy}

        def after(guard: Any, result: Record) -> None:
            guard.phase("agent_resume")
            rpid = int(result.get("pid") or pid)
            try:
                answer = resume_held(socket, lazy=lazy)
            except GpuosError as e:
                raise ckpt.fail("restore", rpid, f"PID {rpid} restored from {image_dir} and running on the driver's "
                                f"side, but {still_held(rpid, e)}", e.code, "running", True) from None
            if answer is None:
                words = "; its agent did not hold it (resumed already)"
            else:
                ckpt.out({"type": "agent_resume", "agent": str(rpid), **answer})
                words = ("; its agent resumed it, its buffers loading behind it" if answer.get("lazy")
                         else "; its agent resumed it")
            result["message"] = result.get("message", "") + words

        hooks.after = after
    try:
        return criu.restore(ckpt, image_dir, device, device_map, criu_args, hooks, port_wait_s=port_wait_s, warn=warn,
                            output_to=output_to, waiting=waiting)
    finally:
        if null >= 0:
            os.close(null)
