"""A fake of the driver checkpoint API whose states live in files, so that several processes see
the same driver: the test, a gpu-ckpt it starts and kills, and the guard that gpu-ckpt started.
Every call is appended to ``DIR/calls`` ("step pid"), whichever process made it.

The guard is a process of its own (``python -m gpuos_tools.ckpt.guard``): a tool started by a test
points ``guard.COMMAND`` at ``guard_command(DIR)``, which installs this fake in the guard process
before the guard's own ``main`` runs, as test_criu_guard.py installs its fake in the test process.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from gpuos_tools.ckpt import driver

#: The step of a pause: the first call of that step writes DIR/at-STEP and sleeps, for a test to
#: kill the caller there.
PAUSE_S = 600.0

#: From the step, the state a call needs and the state it leaves.
MOVES = {"lock": ("running", "locked"), "checkpoint": ("locked", "checkpointed"),
         "restore": ("checkpointed", "locked"), "unlock": ("locked", "running")}


class FileDriver:
    """``DriverAPI``'s methods over state files ``DIR/PID``; a pid without one has no CUDA state."""

    version = 13000

    def __init__(self, directory: str | os.PathLike[str], pause: str | None = None):
        self.dir = Path(directory)
        self.pause = pause

    def states(self, pids: list[int]) -> dict[int, str | None]:
        return {p: self.get_state(p)[0] for p in pids}

    def set(self, pid: int, state: str) -> None:
        tmp = self.dir / f".{pid}.{os.getpid()}"
        tmp.write_text(state)
        os.replace(tmp, self.dir / str(pid))

    def get_state(self, pid: int) -> tuple[str | None, str | None]:
        try:
            return (self.dir / str(pid)).read_text(), None
        except FileNotFoundError:
            return None, "CUDA_ERROR_NOT_INITIALIZED"

    def calls(self) -> list[tuple[str, int]]:
        try:
            text = (self.dir / "calls").read_text()
        except FileNotFoundError:
            return []
        return [(w[0], int(w[1])) for w in (line.split() for line in text.splitlines())]

    def _move(self, step: str, pid: int) -> str | None:
        if step == self.pause:
            try:
                fd = os.open(self.dir / f"at-{step}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                time.sleep(PAUSE_S)  # the test kills this process meanwhile
        with open(self.dir / "calls", "a") as f:
            f.write(f"{step} {pid}\n")
        before, after = MOVES[step]
        if self.get_state(pid)[0] != before:
            return "CUDA_ERROR_ILLEGAL_STATE"
        self.set(pid, after)
        return None

    def lock(self, pid: int, timeout_ms: int) -> str | None:
        return self._move("lock", pid)

    def checkpoint(self, pid: int) -> str | None:
        return self._move("checkpoint", pid)

    def restore(self, pid: int, pairs: Any = None) -> str | None:
        return self._move("restore", pid)

    def unlock(self, pid: int) -> str | None:
        return self._move("unlock", pid)


class FileCheckpointer(driver.Checkpointer):
    """A Checkpointer on a FileDriver, without NVML; its records are kept."""

    def __init__(self, fake: FileDriver):
        self.records: list[dict[str, Any]] = []
        super().__init__(emit=self.records.append)
        self._api = fake  # type: ignore[assignment]

    def usage(self, pid: int) -> tuple[list[dict[str, Any]], int | None]:
        return [], 1 << 20

    def header_fields(self) -> dict[str, Any]:
        return {}


def install(directory: str) -> None:
    """Every Checkpointer of this process drives the FileDriver of ``directory``."""
    driver.Checkpointer.api = property(lambda self: FileDriver(directory))  # type: ignore[assignment]
    driver.Checkpointer.usage = FileCheckpointer.usage  # type: ignore[method-assign]
    driver.Checkpointer.header_fields = FileCheckpointer.header_fields  # type: ignore[method-assign]


#: The guard process, on the FileDriver of the directory that follows it on its command line.
_GUARD = ("import sys; from file_driver import install; install(sys.argv[1]); "
          "from gpuos_tools.ckpt import guard; sys.exit(guard.main(sys.argv[2:]))")


def guard_command(directory: str | os.PathLike[str]) -> tuple[str, ...]:
    """What ``guard.COMMAND`` is set to in a tool whose guard must use the FileDriver of ``directory``."""
    return ("-c", _GUARD, str(directory))


def stop_at_phase(directory: str | os.PathLike[str], phase: str) -> None:
    """In a tool a test will SIGKILL: its guard runs on the FileDriver of ``directory`` and writes
    its pid to ``directory/guard.pid``; when the tool tells its guard ``phase``, it writes
    ``directory/at-PHASE`` and stops there (for the test to kill it)."""
    from gpuos_tools.ckpt import guard

    guard.COMMAND = guard_command(directory)
    started, told = guard.Guard.__init__, guard.Guard.phase

    def init(self, *args: Any, **kwargs: Any) -> None:
        started(self, *args, **kwargs)
        Path(directory, "guard.pid").write_text(str(self.proc.pid))

    def tell(self, name: str, **fields: Any) -> None:
        told(self, name, **fields)
        if name == phase:
            Path(directory, "at-" + name).write_text("")
            time.sleep(600)

    guard.Guard.__init__, guard.Guard.phase = init, tell  # type: ignore[method-assign]
