"""The driver path: stop-the-world checkpoint and restore of any CUDA process through the NVIDIA
driver checkpoint API (``cuCheckpointProcess*``, cuda-python), no preparation of the process.

    suspend(pid)   lock (waits for submitted work) + checkpoint (device memory to host, GPU released)
    resume(pid)    restore (onto another GPU where asked) + unlock
    state(pid)     the driver's checkpoint state: running, locked, checkpointed, failed...
    list_processes()  every CUDA process with its state and GPU memory

Each returns plain data (the records gpu-ckpt/gpu-restore write); ``Checkpointer`` does the same
and also hands every step's record to an ``emit`` callback as it happens.

Never strand a process: before the driver is touched, /proc tells a wrong PID, another user's
process and a non-CUDA process apart (procs.check_target); after a successful lock every failure
(a driver error, an exception, SIGINT/SIGTERM/SIGHUP) brings the process back to running
(unlock, or restore + unlock) in ``finally``, and the ``CkptError`` raised says which state the
process was left in, also as the ``state`` of the final ``ckpt_result`` record.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from gpuos_tools import procs
from gpuos_tools.ckpt import registry
from gpuos_tools.cuda import nvml
from gpuos_tools.cuda.driver import probe_driver
from gpuos_tools.cuda.nvml import nvml_session
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.units import format_size

Record = dict[str, Any]
Emit = Callable[[Record], None]

#: CUprocessState names as they appear in records.
STATE_NAMES = {
    "CU_PROCESS_STATE_RUNNING": "running",
    "CU_PROCESS_STATE_LOCKED": "locked",
    "CU_PROCESS_STATE_CHECKPOINTED": "checkpointed",
    "CU_PROCESS_STATE_FAILED": "failed",
    "CU_PROCESS_STATE_CHECKPOINTING": "checkpointing",
    "CU_PROCESS_STATE_RESTORING": "restoring",
}

#: Driver API versions (cuDriverGetVersion): lock/unlock and the restore arguments came with
#: CUDA 12.8 (driver 570), restoring onto another GPU with CUDA 13.0 (driver 580).
MIN_DRIVER = 12080
MIN_DRIVER_MIGRATION = 13000

_REQUIRED = (
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "CUcheckpointLockArgs",
    "CUcheckpointCheckpointArgs",
    "CUcheckpointRestoreArgs",
    "CUcheckpointUnlockArgs",
    "CUprocessState",
)


class CkptError(GpuosError):
    """A failed checkpoint or restore: the message, the exit code, and what the process was left in.

    ``state`` is the driver's state of the process afterwards (None when unknown, e.g. the
    driver is missing); ``touched`` is False when nothing was done to the process.
    """

    def __init__(self, message: str, code: ExitCode, *, pid: int | None, state: str | None, touched: bool):
        super().__init__(message, code)
        self.pid = pid
        self.state = state
        self.touched = touched
        self.record: Record = {}


def _version_string(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


class DriverAPI:
    """cuCheckpointProcess* through cuda-python, after cuInit(0) (probe_driver)."""

    def __init__(self) -> None:
        self.info = probe_driver()  # NO_DRIVER without cuda-python, libcuda or a GPU
        from cuda.bindings import driver as drv

        missing = [name for name in _REQUIRED if not hasattr(drv, name)]
        if missing:
            raise GpuosError(
                f"cuda-python has no {', '.join(missing)}: it predates the driver checkpoint API "
                "(install cuda-python >= 12.8)",
                ExitCode.DRIVER_TOO_OLD,
            )
        if self.info.version < MIN_DRIVER:
            raise GpuosError(
                f"the NVIDIA driver supports CUDA {self.info.version_string} "
                f"(release {self.info.release or 'unknown'}); the checkpoint API with lock and "
                "unlock needs a driver for CUDA 12.8 or later (release 570 or later)",
                ExitCode.DRIVER_TOO_OLD,
            )
        self.drv = drv
        self._states = {int(getattr(drv.CUprocessState, k)): v for k, v in STATE_NAMES.items()
                        if hasattr(drv.CUprocessState, k)}

    @property
    def version(self) -> int:
        return self.info.version

    def _call(self, name: str, *args: Any) -> tuple[Any, ...]:
        try:
            return getattr(self.drv, name)(*args)
        except RuntimeError as e:  # cuda-python: 'Function "cuCheckpoint..." not found'
            if "not found" in str(e):
                raise GpuosError(
                    f"the NVIDIA driver has no {name} (release {self.info.release or 'unknown'}): "
                    "the checkpoint API needs release 570 or later",
                    ExitCode.DRIVER_TOO_OLD,
                ) from e
            raise

    def _err(self, err: Any) -> str | None:
        return None if err == self.drv.CUresult.CUDA_SUCCESS else getattr(err, "name", str(err))

    def get_state(self, pid: int) -> tuple[str | None, str | None]:
        """(state name, None) or (None, CUresult name)."""
        err, value = self._call("cuCheckpointProcessGetState", pid)
        failed = self._err(err)
        if failed:
            return None, failed
        return self._states.get(int(value), f"unknown({int(value)})"), None

    def lock(self, pid: int, timeout_ms: int) -> str | None:
        args = self.drv.CUcheckpointLockArgs()
        args.timeoutMs = int(timeout_ms)
        return self._err(self._call("cuCheckpointProcessLock", pid, args)[0])

    def checkpoint(self, pid: int) -> str | None:
        return self._err(self._call("cuCheckpointProcessCheckpoint", pid, self.drv.CUcheckpointCheckpointArgs())[0])

    def restore(self, pid: int, pairs: list[tuple[str, str]] | None = None) -> str | None:
        """Restore; ``pairs`` of (old GPU UUID, new GPU UUID) must cover every GPU of the machine."""
        args = self.drv.CUcheckpointRestoreArgs()
        keep: list[Any] = []  # the UUID buffers live until the call returns
        if pairs:
            import ctypes

            entries = []
            for old, new in pairs:
                pair = self.drv.CUcheckpointGpuPair()
                pair.oldUuid = self._cuuuid(old, keep, ctypes)
                pair.newUuid = self._cuuuid(new, keep, ctypes)
                entries.append(pair)
            args.gpuPairs = entries
            args.gpuPairsCount = len(entries)
        return self._err(self._call("cuCheckpointProcessRestore", pid, args)[0])

    def _cuuuid(self, uuid: str, keep: list[Any], ctypes: Any) -> Any:
        raw = uuid_bytes(uuid)
        buf = ctypes.create_string_buffer(raw, 16)
        keep.append(buf)
        return self.drv.CUuuid(ctypes.addressof(buf))

    def unlock(self, pid: int) -> str | None:
        return self._err(self._call("cuCheckpointProcessUnlock", pid, self.drv.CUcheckpointUnlockArgs())[0])


def uuid_bytes(uuid: str) -> bytes:
    """The 16 bytes of a GPU UUID written as NVML and nvidia-smi do (GPU-xxxxxxxx-xxxx-...)."""
    text = uuid[4:] if uuid.upper().startswith("GPU-") else uuid
    raw = bytes.fromhex(text.replace("-", ""))
    if len(raw) != 16:
        raise ValueError(f"not a GPU UUID: {uuid}")
    return raw


def cupti_hint(pid: int, err: str | None) -> str:
    """Why the driver refused to lock ``pid`` when it has CUPTI loaded (an agent job on CUPTI
    callbacks, a profiler): the driver's checkpoint refuses any such process. Empty otherwise."""
    if not err or "NOT_SUPPORTED" not in err:
        return ""
    try:
        loaded = procs.maps_library(pid, b"/libcupti.so")
    except GpuosError:
        return ""
    if not loaded:
        return ""
    return (" (it has CUPTI loaded, which the driver's checkpoint refuses: an agent job on CUPTI callbacks can be "
            "checkpointed this way when it runs on interception, the default (not GPUOS_AGENT_MECHANISM=cupti))")


# What a failing call means, per call: (CUresult name -> exit code). Anything else is CUDA_ERROR.
_CODES: dict[str, dict[str, ExitCode]] = {
    "state": {
        "CUDA_ERROR_NOT_SUPPORTED": ExitCode.DRIVER_TOO_OLD,
        "CUDA_ERROR_NOT_FOUND": ExitCode.DRIVER_TOO_OLD,
        "CUDA_ERROR_INVALID_VALUE": ExitCode.NOT_CUDA_PROCESS,
        "CUDA_ERROR_NOT_INITIALIZED": ExitCode.NOT_CUDA_PROCESS,
        "CUDA_ERROR_NOT_PERMITTED": ExitCode.PERMISSION,
    },
    "lock": {
        "CUDA_ERROR_NOT_READY": ExitCode.LOCK_TIMEOUT,
        "CUDA_ERROR_TIMEOUT": ExitCode.LOCK_TIMEOUT,
        "CUDA_ERROR_ILLEGAL_STATE": ExitCode.WRONG_STATE,
        "CUDA_ERROR_NOT_SUPPORTED": ExitCode.NOT_CHECKPOINTABLE,
        "CUDA_ERROR_NOT_PERMITTED": ExitCode.PERMISSION,
    },
    "checkpoint": {
        "CUDA_ERROR_ILLEGAL_STATE": ExitCode.WRONG_STATE,
        "CUDA_ERROR_NOT_SUPPORTED": ExitCode.NOT_CHECKPOINTABLE,
        "CUDA_ERROR_NOT_PERMITTED": ExitCode.PERMISSION,
    },
    "restore": {
        "CUDA_ERROR_ILLEGAL_STATE": ExitCode.WRONG_STATE,
        "CUDA_ERROR_NOT_SUPPORTED": ExitCode.NOT_CHECKPOINTABLE,
        "CUDA_ERROR_OUT_OF_MEMORY": ExitCode.BAD_GPU,
        "CUDA_ERROR_NOT_PERMITTED": ExitCode.PERMISSION,
    },
    "unlock": {
        "CUDA_ERROR_ILLEGAL_STATE": ExitCode.WRONG_STATE,
        "CUDA_ERROR_NOT_PERMITTED": ExitCode.PERMISSION,
    },
}


def error_code(call: str, err: str, *, remapped: bool = False) -> ExitCode:
    """The exit code for CUresult ``err`` returned by ``call`` (state, lock, checkpoint, restore, unlock)."""
    if call == "restore" and remapped and err == "CUDA_ERROR_INVALID_VALUE":
        return ExitCode.BAD_GPU
    return _CODES.get(call, {}).get(err, ExitCode.CUDA_ERROR)


#: What to do about a process found in each state, for the messages.
_WRONG_STATE_HINT = {
    "checkpointed": "it is already checkpointed (its GPU memory is in host memory); `gpu-restore --pid {pid}` resumes it",
    "locked": "it is locked (by another checkpoint tool, or an interrupted one); `gpu-restore --pid {pid}` unlocks it",
    "failed": "the driver reports its CUDA state as failed: it cannot be checkpointed or restored",
    "checkpointing": "a checkpoint to custom storage is in progress in another tool",
    "restoring": "a restore from custom storage is in progress in another tool",
    "running": "it is running, not checkpointed: there is nothing to restore",
}


def left_message(state: str | None, pid: int) -> str:
    """How a message says what the process was left in."""
    if state == "running":
        return "left running"
    if state == "checkpointed":
        return f"left checkpointed (restorable: `gpu-restore --pid {pid}`)"
    if state == "locked":
        return f"left locked with its memory on the GPU (`gpu-restore --pid {pid}` unlocks it)"
    if state == "failed":
        return "left in the driver's FAILED state: its CUDA calls will fail and it cannot be restored"
    if state is None:
        return "in an unknown state (the driver did not answer)"
    return f"left {state}"


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise (like SIGINT) while a process is locked, so ``finally`` runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):
            pass
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


#: What a caller adds to a failure's message, given the process and the state the driver left
#: it in ('' for nothing); see Checkpointer.failure_note.
FailureNote = Callable[[int | None, str | None], str]


class Checkpointer:
    """Suspend, resume and inspect CUDA processes; every step's record goes to ``emit``."""

    def __init__(self, emit: Emit | None = None):
        self.emit: Emit = emit or (lambda record: None)
        self._api: DriverAPI | None = None
        self._gpus: list[dict[str, Any]] | None = None
        self.nvml_missing: str | None = None
        #: processes whose maps list_processes() could not read (another user's, without root)
        self.unreadable = 0
        #: the first error writing records (a closed pipe...); records stop, the action goes on
        self.output_error: BaseException | None = None
        self._failure_notes: list[FailureNote] = []

    def out(self, record: Record) -> None:
        """Hand a record to ``emit``. A failing output (``| head``, a full disk) must neither
        strand the process nor undo what was asked: it is remembered and records stop."""
        if self.output_error is not None:
            return
        try:
            self.emit(record)
        except (OSError, GpuosError) as e:  # BrokenPipeError is an OSError
            self.output_error = e

    # -- the driver, the GPUs --------------------------------------------------------------

    @property
    def api(self) -> DriverAPI:
        if self._api is None:
            self._api = DriverAPI()
        return self._api

    def machine_gpus(self) -> list[dict[str, Any]]:
        """Every GPU of the machine (NVML; the driver's own list when NVML is missing)."""
        if self._gpus is None:
            with nvml_session() as nv:
                if nv is not None:
                    self._gpus = nv.gpus()
                else:
                    self.nvml_missing = nvml.NVML_MISSING[0] if nvml.NVML_MISSING else "NVML unavailable"
                    self._gpus = [{**g, "memory_free": None, "minor": None} for g in self.api.info.gpus]
        return self._gpus

    def header_fields(self) -> dict[str, Any]:
        """Driver and GPUs for the stream's header, once the driver has been probed."""
        if self._api is None:
            return {}
        info = self._api.info
        return {
            "driver": {"cuda": info.version_string, "release": info.release},
            "gpus": [{k: g[k] for k in ("index", "uuid", "name", "memory")} for g in self.machine_gpus()],
        }

    def usage(self, pid: int) -> tuple[list[dict[str, Any]], int | None]:
        """The GPUs ``pid`` holds memory on and its bytes in all (NVML); (gpus, None) when unknown.

        When NVML does not list the process (no NVML, another pid namespace), its GPUs are the
        /dev/nvidiaN nodes it has open, without bytes.
        """
        names = {g["uuid"]: g for g in self.machine_gpus()}
        with nvml_session() as nv:
            listed = nv.processes().get(pid) if nv is not None else None
        if listed:
            gpus = [{**g, "name": names.get(g["uuid"], {}).get("name")} for g in listed]
            known = [g["memory"] for g in listed if g["memory"] is not None]
            return gpus, (sum(known) if len(known) == len(listed) else None)
        minors = procs.gpu_device_minors(pid)
        gpus = [
            {"index": g["index"], "uuid": g["uuid"], "memory": None, "name": g["name"]}
            for g in self.machine_gpus()
            if g.get("minor") is not None and g["minor"] in minors
        ]
        return gpus, None

    # -- records ---------------------------------------------------------------------------

    def _state(self, pid: int) -> str | None:
        try:
            return self.api.get_state(pid)[0]
        except Exception:
            return None

    def _step(self, pid: int, step: str, before: str | None, seconds: float, err: str | None,
              recovery: bool = False) -> Record:
        rec: Record = {
            "type": "ckpt_step",
            "pid": pid,
            "step": step,
            "ok": err is None,
            "state_before": before,
            "state_after": self._state(pid),
            "duration_s": round(seconds, 6),
        }
        if err:
            rec["error"] = err
        if recovery:
            rec["recovery"] = True
        self.out(rec)
        return rec

    @contextmanager
    def failure_note(self, note: FailureNote) -> Iterator[None]:
        """While inside, every failure (``fail``) asks ``note(pid, state)`` what else was done to
        the process on the way out, for a caller that holds it by other means than the driver (its
        agent, in gpuos_tools/ckpt/agent_criu.py). Failures raised deep inside ``suspend`` or a
        CRIU step then name it too, in the same record and error: words it answers are added to
        the message, and the process counts as touched."""
        self._failure_notes.append(note)
        try:
            yield
        finally:
            self._failure_notes.remove(note)

    def fail(self, action: str, pid: int | None, message: str, code: ExitCode, state: str | None,
             touched: bool, quiet: bool = False, **fields: Any) -> CkptError:
        """The final record of a failed action (emitted unless ``quiet``) and the error to raise,
        its message extended by any ``failure_note`` in force."""
        for note in self._failure_notes:
            words = note(pid, state)
            if words:
                message, touched = f"{message}; {words}", True
        err = CkptError(message, code, pid=pid, state=state, touched=touched)
        err.record = {
            "type": "ckpt_result",
            "action": action,
            "pid": pid,
            "ok": False,
            "state": state,
            "touched": touched,
            "code": int(code),
            "error": code.name,
            "message": message,
            **fields,
        }
        if not quiet:
            self.out(err.record)
        return err

    def bring_back(self, pid: int, restore: bool = True) -> str | None:
        """Return a locked (and, with ``restore``, a checkpointed) process to running; never raises.

        This is the recovery path of every failure after a lock. Returns the state it was left in.
        """
        try:
            state = self._state(pid)
            if state == "checkpointed" and restore:
                t = time.monotonic()
                err = self.api.restore(pid)
                self._step(pid, "restore", state, time.monotonic() - t, err, recovery=True)
                if err:
                    return self._state(pid)
                state = "locked"
            if state == "locked":
                t = time.monotonic()
                err = self.api.unlock(pid)
                self._step(pid, "unlock", state, time.monotonic() - t, err, recovery=True)
            return self._state(pid)
        except BaseException:  # the recovery path must not raise
            return self._state(pid)

    def _prepare(self, action: str, pid: int, quiet: bool = False) -> tuple[procs.ProcInfo, str]:
        """/proc checks, the driver, the current state; raise CkptError (untouched) on any problem."""
        try:
            info = procs.check_target(pid)
            api = self.api
        except GpuosError as e:
            untouched = "" if e.code == ExitCode.NO_SUCH_PROCESS else "; the process was not touched"
            raise self.fail(action, pid, f"{e}{untouched}", e.code, None, False, quiet) from None
        state, err = api.get_state(pid)
        if err:
            code = error_code("state", err)
            if code == ExitCode.NOT_CUDA_PROCESS:
                message = (f"the driver knows no CUDA state for PID {pid} ({err}): it maps libcuda "
                           "but has not initialised CUDA")
            elif code == ExitCode.DRIVER_TOO_OLD:
                message = (f"the driver cannot checkpoint PID {pid} ({err}): driver too old, or the "
                           "process runs under MPS, MIG or vGPU")
            else:
                message = f"cuCheckpointProcessGetState({pid}) failed: {err}"
            raise self.fail(action, pid, f"{message}; the process was not touched", code, None, False, quiet)
        return info, state

    # -- actions ---------------------------------------------------------------------------

    def state(self, pid: int, quiet: bool = True) -> str:
        """The driver's checkpoint state of ``pid`` (checks /proc first); raises CkptError
        (emitting its record unless ``quiet``)."""
        return self._prepare("state", pid, quiet)[1]

    def suspend(self, pid: int, timeout_ms: int = 0) -> Record:
        """Lock ``pid`` (waiting up to ``timeout_ms`` for submitted work; 0 = no limit) and checkpoint it.

        Returns the ``ckpt_result`` record. On failure raises CkptError, the process left
        running (or, where the driver leaves no choice, in the state the error names).
        """
        start = time.monotonic()
        info, state = self._prepare("checkpoint", pid)
        gpus, nbytes = self.usage(pid)
        self.out({"type": "ckpt_process", **info.describe(), "state": state, "gpus": gpus, "bytes": nbytes})
        if state != "running":
            hint = _WRONG_STATE_HINT.get(state, f"it is {state}").format(pid=pid)
            raise self.fail("checkpoint", pid, f"cannot checkpoint PID {pid}: {hint}; nothing was done",
                            ExitCode.WRONG_STATE, state, False)
        api = self.api
        locked = False
        with _signals_raise():
            try:
                t = time.monotonic()
                err = api.lock(pid, timeout_ms)
                lock_s = time.monotonic() - t
                self._step(pid, "lock", state, lock_s, err)
                if err:
                    code = error_code("lock", err)
                    left = self._state(pid)
                    if left in ("locked", "checkpointed"):  # not what the driver promises; undo it
                        left = self.bring_back(pid)
                    if code == ExitCode.LOCK_TIMEOUT:
                        message = (f"PID {pid} could not be locked within {timeout_ms} ms ({err}): it is busy "
                                   f"in a CUDA call or waiting for long GPU work; {left_message(left, pid)}")
                    else:
                        message = f"cannot lock PID {pid}: {err}{cupti_hint(pid, err)}; {left_message(left, pid)}"
                    raise self.fail("checkpoint", pid, message, code, left, left != "running")
                locked = True
                t = time.monotonic()
                err = api.checkpoint(pid)
                checkpoint_s = time.monotonic() - t
                self._step(pid, "checkpoint", "locked", checkpoint_s, err)
                if err:
                    code = error_code("checkpoint", err)
                    left = self.bring_back(pid)
                    why = (" (the process uses something the driver cannot checkpoint: managed memory, "
                           "IPC memory, MPS, MIG or NCCL)" if code == ExitCode.NOT_CHECKPOINTABLE else "")
                    raise self.fail("checkpoint", pid, f"checkpoint of PID {pid} failed: {err}{why}; "
                                    f"{left_message(left, pid)}", code, left, True)
            except CkptError:
                raise
            except BaseException as e:
                # interrupted (SIGINT, SIGTERM, SIGHUP) or a bug: never leave it locked
                left = self.bring_back(pid)
                code = ExitCode.INTERRUPTED if isinstance(e, KeyboardInterrupt) else ExitCode.SOFTWARE
                raise self.fail("checkpoint", pid, f"interrupted ({type(e).__name__}: {e}) while checkpointing "
                                f"PID {pid}; {left_message(left, pid)}", code, left,
                                locked or left != "running") from e
        registry.remember(registry.entry_for(info, gpus=gpus, bytes=nbytes))
        result: Record = {
            "type": "ckpt_result",
            "action": "checkpoint",
            "pid": pid,
            "ok": True,
            "state": "checkpointed",
            "touched": True,
            "code": 0,
            "bytes": nbytes,
            "lock_s": round(lock_s, 6),
            "checkpoint_s": round(checkpoint_s, 6),
            "duration_s": round(time.monotonic() - start, 6),
            "gbps": round(nbytes / checkpoint_s / 1e9, 3) if nbytes and checkpoint_s > 0 else None,
            "message": f"PID {pid} checkpointed: its GPU memory is in host memory and its GPUs are released; "
                       f"`gpu-restore --pid {pid}` resumes it",
        }
        self.out(result)
        return result

    def resume(self, pid: int, device: str | None = None, device_map: str | None = None,
               source_gpus: list[str] | None = None, result_fields: Record | None = None) -> Record:
        """Restore ``pid`` (onto GPU ``device``, or by ``device_map``) and unlock it.

        ``source_gpus`` (UUIDs) says which GPUs the process was checkpointed on when gpu-ckpt's
        registry does not know (a CRIU image carries them); ``result_fields`` go into the result
        (what the caller did before, such as a CRIU restore's wait). Returns the ``ckpt_result``
        record; raises CkptError saying what the process was left in.
        """
        start = time.monotonic()
        info, state = self._prepare("restore", pid)
        self.out({"type": "ckpt_process", **info.describe(), "state": state})
        moving = bool(device is not None or device_map)
        if state not in ("checkpointed", "locked") or (state == "locked" and moving):
            hint = _WRONG_STATE_HINT.get(state, f"it is {state}").format(pid=pid)
            if state == "locked":
                hint = (f"it is locked but not checkpointed (its memory is still on its GPU, so it cannot "
                        f"move); `gpu-restore --pid {pid}` without --device unlocks it")
            raise self.fail("restore", pid, f"cannot restore PID {pid}: {hint}; nothing was done",
                            ExitCode.WRONG_STATE, state, False)
        api = self.api
        pairs: list[tuple[str, str]] | None = None
        target: dict[str, Any] | None = None
        if state == "checkpointed" and moving:
            try:
                pairs, target = self.gpu_pairs(pid, device, device_map, source_gpus)
                if pairs and api.version < MIN_DRIVER_MIGRATION:
                    raise GpuosError(
                        f"restoring onto another GPU needs a driver for CUDA 13.0 or later (release 580); "
                        f"this one supports CUDA {api.info.version_string}", ExitCode.DRIVER_TOO_OLD)
            except GpuosError as e:
                raise self.fail("restore", pid, f"{e}; {left_message(state, pid)}", e.code, state, False) from None
        restore_s = None
        with _signals_raise():
            try:
                if state == "checkpointed":
                    t = time.monotonic()
                    err = api.restore(pid, pairs)
                    restore_s = time.monotonic() - t
                    self._step(pid, "restore", state, restore_s, err)
                    if err:
                        code = error_code("restore", err, remapped=bool(pairs))
                        left = self._state(pid)
                        if left == "locked":  # restored after all: let it run where it is
                            left = self.bring_back(pid)
                        why = ""
                        if code == ExitCode.BAD_GPU and pairs:
                            why = (" (the driver refused the GPU remapping: the target must be the same chip "
                                   "with enough free memory, and the map must cover every GPU)")
                        elif code == ExitCode.BAD_GPU:
                            why = " (not enough free memory on its GPU now)"
                        place = f" onto {target['uuid']}" if target else ""
                        raise self.fail("restore", pid, f"restore of PID {pid}{place} failed: {err}{why}; "
                                         f"{left_message(left, pid)}", code, left, left != "checkpointed")
                t = time.monotonic()
                err = api.unlock(pid)
                unlock_s = time.monotonic() - t
                self._step(pid, "unlock", "locked", unlock_s, err)
                if err:
                    left = self._state(pid)
                    raise self.fail("restore", pid, f"unlock of PID {pid} failed: {err}; {left_message(left, pid)}",
                                     error_code("unlock", err), left, True)
            except CkptError:
                raise
            except BaseException as e:
                # interrupted: a restored (locked) process is unlocked, a checkpointed one stays so
                left = self.bring_back(pid, restore=False)
                code = ExitCode.INTERRUPTED if isinstance(e, KeyboardInterrupt) else ExitCode.SOFTWARE
                raise self.fail("restore", pid, f"interrupted ({type(e).__name__}: {e}) while restoring "
                                 f"PID {pid}; {left_message(left, pid)}", code, left, left != "checkpointed") from e
        registry.forget(pid)
        result: Record = {
            "type": "ckpt_result",
            "action": "restore",
            "pid": pid,
            "ok": True,
            "state": "running",
            "touched": True,
            "code": 0,
            "restore_s": None if restore_s is None else round(restore_s, 6),
            "unlock_s": round(unlock_s, 6),
            "duration_s": round(time.monotonic() - start, 6),
            "gpu_map": [list(p) for p in pairs] if pairs else None,
            "device": target["uuid"] if target else None,
            "message": f"PID {pid} restored and running" + (f" on {target['uuid']}" if target else "")
                       + ("" if state == "checkpointed" else " (it was locked, not checkpointed: unlocked)"),
            **(result_fields or {}),
        }
        self.out(result)
        return result

    # -- GPU remapping ---------------------------------------------------------------------

    def resolve_gpu(self, spec: str) -> dict[str, Any]:
        """A GPU by nvidia-smi index or by UUID (a unique prefix will do); BAD_GPU if none."""
        gpus = self.machine_gpus()
        spec = spec.strip()
        if spec.isdigit():
            for g in gpus:
                if g["index"] == int(spec):
                    return g
            raise GpuosError(f"no GPU with index {spec} (this machine has {len(gpus)})", ExitCode.BAD_GPU)
        want = spec.lower() if spec.lower().startswith("gpu-") else f"gpu-{spec.lower()}"
        hits = [g for g in gpus if g["uuid"].lower().startswith(want)]
        if len(hits) == 1:
            return hits[0]
        if not hits:
            raise GpuosError(f"no GPU with UUID {spec} on this machine", ExitCode.BAD_GPU)
        raise GpuosError(f"{spec} names {len(hits)} GPUs: give more of the UUID", ExitCode.BAD_GPU)

    def gpu_pairs(self, pid: int, device: str | None, device_map: str | None,
                  source_gpus: list[str] | None = None) -> tuple[list[tuple[str, str]] | None, dict[str, Any]]:
        """The (old UUID, new UUID) pairs for restoring ``pid`` onto ``device`` (or by ``device_map``).

        The driver wants a map of every GPU the kernel driver shows, user-space masks such as
        CUDA_VISIBLE_DEVICES notwithstanding, so moving a one-GPU process from A to B swaps A and
        B and maps every other GPU onto itself. Returns (None, target) when nothing moves.
        Raises BAD_GPU before anything is touched.
        """
        gpus = self.machine_gpus()
        if self.nvml_missing and os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            raise GpuosError(
                f"cannot list every GPU of the machine ({self.nvml_missing}) while CUDA_VISIBLE_DEVICES "
                "hides some from this process: the driver needs a map of all of them", ExitCode.BAD_GPU)
        by_uuid = {g["uuid"]: g for g in gpus}
        mapping: dict[str, str] = {}
        if device_map:
            for item in device_map.split(","):
                old, sep, new = item.partition("=")
                if not sep or not old.strip() or not new.strip():  # how it is written: a usage error
                    raise GpuosError(f"--device-map: {item!r} is not OLD=NEW (e.g. 0=1,1=0)", ExitCode.USAGE)
                a, b = self.resolve_gpu(old), self.resolve_gpu(new)
                if a["uuid"] in mapping:
                    raise GpuosError(f"--device-map maps {a['uuid']} twice", ExitCode.USAGE)
                mapping[a["uuid"]] = b["uuid"]
            for g in gpus:
                mapping.setdefault(g["uuid"], g["uuid"])
            targets = list(mapping.values())
            dup = sorted({u for u in targets if targets.count(u) > 1})
            if dup:
                raise GpuosError(
                    f"--device-map must be a permutation of this machine's GPUs: {', '.join(dup)} would "
                    "receive two GPUs (add the reverse pair, e.g. A=B,B=A)", ExitCode.BAD_GPU)
            moved = {o: n for o, n in mapping.items() if o != n}
            target = by_uuid[next(iter(moved.values()))] if moved else by_uuid[targets[0]]
            needed = None
        else:
            assert device is not None
            target = self.resolve_gpu(device)
            entry = registry.lookup(pid)
            sources = source_gpus or ([g["uuid"] for g in entry.get("gpus") or []] if entry else [])
            sources = sorted(set(sources))
            if not sources:
                raise GpuosError(
                    f"which GPU PID {pid} was checkpointed from is not known (it was not checkpointed by "
                    "gpu-ckpt on this boot, or NVML could not see it): give the whole map with "
                    "--device-map OLD=NEW,...", ExitCode.BAD_GPU)
            if len(sources) > 1:
                raise GpuosError(
                    f"PID {pid} used {len(sources)} GPUs ({', '.join(sources)}): --device moves a one-GPU "
                    "process; give --device-map OLD=NEW,... for each", ExitCode.BAD_GPU)
            source = sources[0]
            if source not in by_uuid:
                raise GpuosError(f"PID {pid} was checkpointed on {source}, which this machine does not have: "
                                 "give --device-map", ExitCode.BAD_GPU)
            if source == target["uuid"]:
                return None, target
            mapping = {g["uuid"]: g["uuid"] for g in gpus}
            mapping[source] = target["uuid"]
            mapping[target["uuid"]] = source
            needed = entry.get("bytes") if entry else None
        for old, new in mapping.items():
            if old != new and by_uuid[old]["name"] != by_uuid[new]["name"]:
                raise GpuosError(
                    f"{new} ({by_uuid[new]['name']}) is not the same chip as {old} ({by_uuid[old]['name']}): "
                    "the driver restores only onto the same kind of GPU", ExitCode.BAD_GPU)
        free = target.get("memory_free")
        if needed and free is not None and free < needed:
            raise GpuosError(
                f"{target['uuid']} has {format_size(free)} free; PID {pid} needs {format_size(needed)}",
                ExitCode.BAD_GPU)
        if all(o == n for o, n in mapping.items()):
            return None, target
        return sorted(mapping.items()), target

    # -- status ----------------------------------------------------------------------------

    def list_processes(self, pids: Iterable[int] = ()) -> list[Record]:
        """Every CUDA process that NVML lists, that maps libcuda (where /proc lets us read), that
        gpu-ckpt checkpointed, and every pid in ``pids``: with its checkpoint state and GPU memory.

        One ``ckpt_status`` record per process, sorted by pid.
        """
        api = self.api
        gpu_names = {g["uuid"]: g for g in self.machine_gpus()}
        with nvml_session() as nv:
            on_gpu = nv.processes() if nv is not None else {}
        mapped, self.unreadable = procs.scan_cuda_pids()
        known = {int(e["pid"]): e for e in registry.known()}
        wanted = set(pids)
        out = []
        for pid in sorted(set(on_gpu) | set(mapped) | set(known) | wanted):
            if pid == os.getpid():
                continue
            seen_by = [name for name, group in (("nvml", on_gpu), ("maps", mapped), ("gpu-ckpt", known),
                                                 ("asked", wanted)) if pid in group]
            rec: Record = {"type": "ckpt_status", "pid": pid, "seen_by": seen_by}
            try:
                info = procs.read_proc(pid)
                rec.update(user=info.user, command=info.command)
                rank = procs.rank_of(pid)
                if rank is not None:  # a rank of a job: its launcher is the job (gpu-ckpt --job PPID)
                    rec.update(job=procs.parent_of(pid), rank=rank)
            except GpuosError as e:
                rec.update(state=None, error=ExitCode(e.code).name, message=str(e))
                out.append(rec)
                continue
            state, err = api.get_state(pid)
            rec["state"] = state
            if err:
                rec["error"] = err
            gpus = [{**g, "name": gpu_names.get(g["uuid"], {}).get("name")} for g in on_gpu.get(pid, [])]
            rec["gpus"] = gpus
            mem = [g["memory"] for g in gpus if g["memory"] is not None]
            rec["memory"] = sum(mem) if gpus and len(mem) == len(gpus) else (0 if state == "checkpointed" else None)
            if pid in known:
                rec["checkpointed"] = {k: known[pid].get(k) for k in ("checkpointed_at", "bytes", "gpus")}
            out.append(rec)
        return out


# -- the library interface ---------------------------------------------------------------------


def suspend(pid: int, timeout_ms: int = 0, emit: Emit | None = None) -> Record:
    """Lock and checkpoint ``pid``; the ``ckpt_result`` record (raises CkptError)."""
    return Checkpointer(emit).suspend(pid, timeout_ms)


def resume(pid: int, device: str | None = None, device_map: str | None = None, emit: Emit | None = None) -> Record:
    """Restore (onto ``device`` if given: nvidia-smi index or UUID) and unlock ``pid``."""
    return Checkpointer(emit).resume(pid, device, device_map)


def state(pid: int) -> str:
    """The driver's checkpoint state of ``pid``: running, locked, checkpointed, failed..."""
    return Checkpointer().state(pid)


def list_processes(pids: Iterable[int] = ()) -> list[Record]:
    """``ckpt_status`` records for every CUDA process (see Checkpointer.list_processes)."""
    return Checkpointer().list_processes(pids)
