"""What gpu-ckpt remembers about the processes it checkpointed.

A checkpointed process holds no GPU, so neither NVML nor the driver can say afterwards which GPUs
it used or how many bytes it had there. gpu-ckpt writes one small JSON file per process into a
state directory; gpu-restore reads it to move the process onto another GPU (``--device``) and
removes it after a restore; ``gpu-ckpt status`` lists the processes it names.

An entry names its process by pid *and* start time (and boot id), so a reused pid is never
mistaken for the checkpointed process. Files are written atomically (temp file + rename).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from gpuos_tools import procs
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.stream import atomic

#: Environment variable that overrides the state directory.
ENV = "GPUOS_CKPT_STATE_DIR"


def state_dir() -> Path:
    """$GPUOS_CKPT_STATE_DIR; for root /run/gpuos-tools/ckpt; otherwise
    $XDG_RUNTIME_DIR/gpuos-tools/ckpt or /tmp/gpuos-tools-UID/ckpt."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    if os.geteuid() == 0:
        return Path("/run/gpuos-tools/ckpt")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "gpuos-tools" / "ckpt"
    return Path(f"/tmp/gpuos-tools-{os.geteuid()}") / "ckpt"


def write_json_atomic(path: Path, data: Any, mode: int = 0o600) -> None:
    """Write ``data`` as JSON to ``path`` through a temp file and a rename (sponge-style)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise GpuosError(
            f"{path.parent}: cannot create: {e.strerror}",
            ExitCode.PERMISSION if isinstance(e, PermissionError) else ExitCode.IO_ERROR,
        ) from e
    target = os.path.realpath(path)
    temp, fd = atomic.create_temp(target)
    try:
        os.fchmod(fd, mode)
        with open(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, target)
    except OSError as e:
        atomic.discard(temp)
        raise GpuosError(f"{path}: cannot write: {e.strerror}", ExitCode.IO_ERROR) from e
    except BaseException:
        atomic.discard(temp)
        raise


def read_json(path: Path) -> Any | None:
    """The JSON in ``path``, None when it does not exist; BAD_INPUT when it is not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except PermissionError as e:
        raise GpuosError(f"{path}: cannot read: {e.strerror}", ExitCode.PERMISSION) from e
    except (OSError, ValueError, RecursionError) as e:
        raise GpuosError(f"{path}: not a readable JSON state file: {e}", ExitCode.BAD_INPUT) from e


def entry_for(info: procs.ProcInfo, **fields: Any) -> dict[str, Any]:
    """A registry (or profile state) entry for a process: who it is, plus ``fields``."""
    return {
        "pid": info.pid,
        "starttime": info.starttime,
        "boot_id": procs.boot_id(),
        "user": info.user,
        "command": info.command,
        "checkpointed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **fields,
    }


def same_process(entry: dict[str, Any]) -> bool:
    """Is the process the entry names still there (same pid, start time and boot)?"""
    try:
        info = procs.read_proc(int(entry["pid"]))
    except (GpuosError, KeyError, TypeError, ValueError):
        return False
    if entry.get("boot_id") and entry["boot_id"] != procs.boot_id():
        return False
    return info.state != "Z" and info.starttime == entry.get("starttime")


def _path(pid: int) -> Path:
    return state_dir() / f"{pid}.json"


def remember(entry: dict[str, Any]) -> Path | None:
    """Record a checkpointed process; None (and no error) when the state directory is not writable."""
    try:
        write_json_atomic(_path(int(entry["pid"])), entry)
    except GpuosError:
        return None
    return _path(int(entry["pid"]))


def lookup(pid: int) -> dict[str, Any] | None:
    """The entry of ``pid`` if it names the process that has this pid now."""
    try:
        entry = read_json(_path(pid))
    except GpuosError:
        return None
    if isinstance(entry, dict) and same_process(entry):
        return entry
    return None


def forget(pid: int) -> None:
    try:
        os.unlink(_path(pid))
    except OSError:
        pass


def known() -> list[dict[str, Any]]:
    """Entries whose processes still exist (stale ones are removed where we may)."""
    out = []
    try:
        names = sorted(os.listdir(state_dir()))
    except OSError:
        return []
    for name in names:
        if not (name.endswith(".json") and name[:-5].isdigit()):
            continue
        entry = lookup(int(name[:-5]))
        if entry is None:
            forget(int(name[:-5]))
        else:
            out.append(entry)
    return out
