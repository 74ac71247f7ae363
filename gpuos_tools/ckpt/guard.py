"""The guard of a full-process dump or restore: if gpu-ckpt or gpu-restore is killed (even with
SIGKILL, which no ``finally`` survives) while the process is locked, checkpointed, being dumped
by CRIU or being restored, the guard finishes the job or undoes it, so that what is left is a
running process or a complete image, never a stranded process.

gpu-ckpt starts the guard (``python -m gpuos_tools.ckpt.guard``, its own session, so that the
signal that kills gpu-ckpt does not reach it) before it touches anything, and tells it each
phase over a pipe, one JSON line each; at the end it says ``done`` and the guard exits. If the
pipe closes without ``done``, the tool died, and the guard acts on the last phase:

- before the first phase nothing was touched; a dump's temp directory, if made, is removed.
- dump, any phase: it waits for a ``criu dump`` of the image still running (CRIU carries on
  when its parent dies; its output goes to a file, not to the dead tool's pipes), lets the
  driver's state settle, then: a complete dump in the temp directory (CRIU exited 0, which the
  shell around it wrote into ``criu-dump.rc``) is made the image (renamed into place); a
  process still there is brought back to running (restore and unlock, or unlock).
- restore: it waits for a ``criu restore`` of the image still running, then a restored process
  in the checkpointed or locked state is restored on the GPU (onto the device asked) and
  unlocked. If CRIU had not restored it, the image is intact and nothing runs.

The dump of a program whose agent suspended it first (gpuos_tools/ckpt/agent_criu.py) names
the agent's socket (``agent``): once the process runs again on the driver's side, the guard has
the agent resume it (after a dump: whatever phase the tool died in, a suspend under way waited
for; after a restore: with ``lazy`` as asked). An agent that does not answer is said in the
outcome, with the command that resumes it.

A job (``gpu-ckpt --job PID --image``, and ``gpu-restore`` of its image) is guarded the same way,
PID being its launcher: where the dump above brings the process back, and the restore restores
it, the guard brings every rank of the job back at once (``job.bring_back_job``: each rank's GPU
state restored before any rank is unlocked, onto the device map asked on a restore), once the
driver's states of all the ranks have settled.

What it did goes to ``STATE_DIR/guard.log`` (a line per step) and, as a ``ckpt_guard`` record,
to ``STATE_DIR/guard-OWNER.json``, OWNER being the pid of the tool that died.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from gpuos_tools import procs
from gpuos_tools.ckpt import registry
from gpuos_tools.ckpt.agent_hold import resume_held, still_held
from gpuos_tools.ckpt.driver import Checkpointer, CkptError
from gpuos_tools.ckpt.job import bring_back_job, job_ranks, resume_job
from gpuos_tools.errors import GpuosError
from gpuos_tools.image import fsync_dir

#: How the guard process is started, after the interpreter (tests start one that fakes the driver).
COMMAND: tuple[str, ...] = ("-m", "gpuos_tools.ckpt.guard")
SETTLE_S = 1.0  #: the driver state must read the same this long before the guard acts on it
SETTLE_MAX_S = 60.0
CRIU_WAIT_S = 3600.0
#: The file in a dump's temp directory where the shell around ``criu dump`` writes its exit status.
DUMP_RC = "criu-dump.rc"


class Guard:
    """gpu-ckpt's side: start the guard, tell it each phase, say done."""

    def __init__(self, action: str, pid: int, image: Path, temp: Path | None = None, **extra: Any):
        self.proc: subprocess.Popen[bytes] | None = None
        first = {"action": action, "pid": pid, "image": str(image), "temp": str(temp) if temp else None, **extra}
        log = registry.state_dir()
        try:
            log.mkdir(parents=True, exist_ok=True, mode=0o700)
            out: IO[bytes] | int = open(log / "guard.log", "ab")
        except OSError:
            out = subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                [sys.executable, *COMMAND, "--owner", str(os.getpid())],
                stdin=subprocess.PIPE, stdout=out, stderr=out, start_new_session=True, close_fds=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_root(), os.environ.get("PYTHONPATH")]))})
        finally:
            if not isinstance(out, int):
                out.close()
        self._send(first)

    def _send(self, message: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # the guard died: go on, the tool itself still recovers in finally
            pass

    def phase(self, name: str, **fields: Any) -> None:
        self._send({"phase": name, **fields})

    def abandon(self) -> int | None:
        """Leave the rest to the guard (close the pipe without ``done``); its pid."""
        if self.proc is None:
            return None
        pid = self.proc.pid
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc = None
        return pid

    def done(self) -> None:
        """Nothing left to guard: the guard exits without acting."""
        if self.proc is None:
            return
        self._send({"phase": "done"})
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None


def _root() -> str:
    return str(Path(__file__).resolve().parents[2])


# -- the guard process ------------------------------------------------------------------------


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} gpuos guard {os.getpid()}: {message}", flush=True)


def criu_running(path: str, verb: str) -> list[int]:
    """Pids of ``criu VERB`` processes whose command line names ``path``."""
    out = []
    for pid in procs.all_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv if a]
        # CRIU itself, the bundle's launcher scripts, or the shell that records CRIU's status
        if verb in words and path in words and any("criu" in os.path.basename(w) for w in words):
            if procs.exists(pid):
                out.append(pid)
    return out


def wait_criu(path: str, verb: str, timeout: float = CRIU_WAIT_S) -> bool:
    """Wait until no ``criu VERB`` on ``path`` runs; whether none did within ``timeout``."""
    deadline = time.monotonic() + timeout
    waited = False
    while criu_running(path, verb):
        if not waited:
            _log(f"waiting for criu {verb} of {path} to end")
            waited = True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def dump_complete(temp: Path) -> bool:
    """Did ``criu dump`` into ``temp`` finish successfully (its status, recorded by the shell
    around it, is 0)?"""
    try:
        rc = (temp / DUMP_RC).read_text().strip()
    except OSError:
        return False
    return rc == "0" and (temp / "inventory.img").exists()


def settled_state(ckpt: Any, pid: int) -> str | None:
    """The driver's state of ``pid`` once it reads the same for SETTLE_S (a lock or checkpoint
    the dead tool asked for may still be under way)."""
    return settled_states(ckpt, [pid])[pid]


def settled_states(ckpt: Any, pids: list[int]) -> dict[int, str | None]:
    """The driver's states of ``pids`` once none has changed for SETTLE_S (the ranks of a job
    settle together: the dead tool asked each for its lock or checkpoint at the same time)."""
    last, since = {p: ckpt._state(p) for p in pids}, time.monotonic()
    deadline = since + SETTLE_MAX_S
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = {p: ckpt._state(p) for p in pids}
        if now != last or any(v in ("checkpointing", "restoring") for v in now.values()):
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= SETTLE_S:
            break
    return last


def finalize(temp: Path, image: Path) -> None:
    """Make a complete dump in ``temp`` the image at ``image`` (an empty directory there is replaced)."""
    os.rename(temp, image)  # rename(2) replaces an empty directory
    fsync_dir(str(image.parent))


def recover(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """What the guard does when its tool died after ``last`` (see the module's text)."""
    action, pid = first["action"], int(first["pid"])
    image = Path(first["image"])
    outcome: dict[str, Any] = {"type": "ckpt_guard", "action": action, "pid": pid, "image": str(image),
                               "phase": last.get("phase"), "steps": []}
    steps = outcome["steps"]
    ckpt = Checkpointer(emit=lambda record: steps.append(record))
    job = bool(first.get("job"))
    if job:
        outcome["job"] = True
    if last.get("phase") == "start":
        temp = Path(first["temp"]) if first.get("temp") else None
        if action == "dump" and temp is not None and temp.is_dir() and not dump_complete(temp):
            import shutil

            shutil.rmtree(temp, ignore_errors=True)  # made before the first phase: CRIU never ran
        outcome.update(state="running" if procs.exists(pid) else None, image_ok=False,
                       message=f"nothing had been done to PID {pid}")
        return outcome
    if action == "dump":
        temp = Path(first["temp"])
        if not wait_criu(str(temp), "dump"):
            outcome.update(message=f"criu dump of {temp} still runs after {CRIU_WAIT_S} s: left to it")
            return outcome
        image_ok = False
        if temp.is_dir() and dump_complete(temp):
            finalize(temp, image)
            _log(f"the dump of PID {pid} was complete: made it the image {image}")
            image_ok = True
        elif image.is_dir() and dump_complete(image):
            image_ok = True  # the tool had finalised it
        state, where = None, "the process is gone"
        if procs.exists(pid) and job:
            state, words = _job_back(ckpt, pid, outcome, None)
            where = f"the job of PID {pid}: {words}"
            _log(where)
        elif procs.exists(pid):
            state = settled_state(ckpt, pid)
            if state in ("checkpointed", "locked"):
                state = ckpt.bring_back(pid)
                _log(f"PID {pid} brought back: {state}")
            if state:
                where = f"PID {pid} {state}"
            if state == "running" and first.get("agent"):
                where += _agent_back(first, pid, outcome)
        elif not image_ok:
            _log(f"PID {pid} is gone and no complete image of it is at {image} (temp {temp})")
        if not image_ok and temp.is_dir():
            import shutil

            shutil.rmtree(temp, ignore_errors=True)
        outcome.update(state=state, image_ok=image_ok,
                       message=(f"image {image} complete" if image_ok else "no image") + f"; {where}")
        return outcome
    # restore
    if not wait_criu(str(image), "restore"):
        outcome.update(message=f"criu restore of {image} still runs after {CRIU_WAIT_S} s: left to it")
        return outcome
    try:
        pid = int((image / "restored.pid").read_text().strip())
    except (OSError, ValueError):
        pass
    if not procs.exists(pid):
        outcome.update(pid=pid, state=None, message=f"nothing was restored; the image {image} is intact")
        return outcome
    if job:
        state, words = _job_back(ckpt, pid, outcome, first)
        outcome.update(pid=pid, state=state, message=f"the job of PID {pid} restored from {image}: {words}")
        return outcome
    state = settled_state(ckpt, pid)
    if state in ("checkpointed", "locked"):
        try:
            ckpt.resume(pid, first.get("device"), first.get("device_map"), source_gpus=first.get("source_gpus"))
            state = "running"
        except CkptError as e:
            state = ckpt.bring_back(pid)
            _log(f"restore of PID {pid} as asked failed ({e}); brought back where it was: {state}")
    words = _agent_back(first, pid, outcome) if state == "running" and first.get("agent") else ""
    outcome.update(pid=pid, state=state, message=f"PID {pid} restored from {image}: {state}{words}")
    return outcome


def _agent_back(first: dict[str, Any], pid: int, outcome: dict[str, Any]) -> str:
    """The program's agent (its socket: ``first["agent"]``) resumes it if it holds it; words for
    the message, what was done into ``outcome["agent"]``."""
    try:
        answer = resume_held(first["agent"], lazy=bool(first.get("lazy")))
    except GpuosError as e:
        outcome["agent"] = {"socket": first["agent"], "resumed": False, "error": str(e)}
        _log(f"PID {pid}: {still_held(pid, e)}")
        return f"; {still_held(pid, e)}"
    outcome["agent"] = {"socket": first["agent"], "resumed": answer is not None}
    if answer is None:
        return "; its agent did not hold it"
    _log(f"PID {pid} resumed by its agent")
    return "; its agent resumed it"


def _job_back(ckpt: Any, pid: int, outcome: dict[str, Any],
              restore: dict[str, Any] | None) -> tuple[str | None, str]:
    """Every rank of the job of launcher ``pid`` brought back once the driver's states settle:
    restored (onto the GPUs of ``restore``'s device map, when it is a restore) before any is
    unlocked. (the state every rank is in, else None; what was done, in words); each rank's
    state goes to ``outcome``."""
    try:
        pids = [r.info.pid for r in job_ranks(pid)]
    except GpuosError as e:
        return None, f"no rank found ({e})"
    states = settled_states(ckpt, pids)
    words = ""
    held = [s in ("locked", "checkpointed") for s in states.values() if s is not None]
    if restore is not None and restore.get("device_map") and held and all(held):
        try:
            resume_job(ckpt, pid, device_map=restore["device_map"])
        except CkptError as e:
            now = {p: ckpt._state(p) for p in pids}
            if any(states[p] == "checkpointed" and now[p] != "checkpointed" for p in pids):
                # some ranks sit on the GPUs the map named: the others must follow them, not go back
                outcome["ranks"] = [{"pid": p, "state": s} for p, s in now.items()]
                return None, (f"the restore onto the GPUs asked failed half-way ({e}); left as it is: `gpu-restore "
                              f"--job {pid} --device-map {restore['device_map']}` tries again")
            words = f"the restore onto the GPUs asked failed ({e}); "
    said, states = bring_back_job(ckpt, pid)
    outcome["ranks"] = [{"pid": p, "state": s} for p, s in states.items()]
    values = set(states.values())
    return (values.pop() if len(values) == 1 else None), words + said


def main(argv: list[str]) -> int:
    owner = argv[argv.index("--owner") + 1] if "--owner" in argv else "?"
    first: dict[str, Any] | None = None
    last: dict[str, Any] = {"phase": "start"}
    for line in sys.stdin.buffer:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if first is None:
            first = message
        else:
            last = message
    if first is None or last.get("phase") == "done":
        return 0
    _log(f"{first['action']} of PID {first['pid']} by PID {owner} ended during phase {last.get('phase')!r}: recovering")
    try:
        outcome = recover(first, last)
    except Exception as e:  # noqa: BLE001 (said, with what is known)
        outcome = {"type": "ckpt_guard", "action": first["action"], "pid": first["pid"], "error": repr(e)}
    outcome["owner"] = int(owner) if owner.isdigit() else owner
    _log(outcome.get("message") or outcome.get("error", "done"))
    try:
        registry.write_json_atomic(registry.state_dir() / f"guard-{owner}.json", outcome)
    except Exception as e:  # noqa: BLE001
        _log(f"cannot write the outcome: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
