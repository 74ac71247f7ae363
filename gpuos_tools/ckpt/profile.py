"""Profiles: which CUDA processes a maintenance run suspends, and the state file that says which
ones it did, so that the run that resumes them brings back exactly those.

A profile is TOML (see gpuos_tools/profiles/maintenance.toml)::

    [select]
    users = ["alice", 1001]          # processes of these users (names or uids)
    command = 'python3? .*train'     # and/or whose command line matches (re.search)
    exclude_command = 'jupyter'      # never these
    all = false                      # true: every CUDA process (when no users/command is given)

    [checkpoint]
    timeout_ms = 600000              # lock timeout per process (0 = wait as long as it takes)
    on_error = "resume"              # "resume": stop and resume the ones suspended; "keep": go on

    [state]
    file = "/var/lib/gpuos-tools/maintenance.json"   # relative paths: to the profile's directory

``users`` and ``command`` must both match when both are given. The state file is rewritten
atomically after every process suspended, so a crash in the middle still leaves the list of
what is suspended.
"""

from __future__ import annotations

import functools
import os
import pwd
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuos_tools import procs
from gpuos_tools.ckpt import registry
from gpuos_tools.ckpt.driver import Checkpointer, CkptError, Record
from gpuos_tools.cuda.nvml import nvml_session
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.stream.schema import Bool, Either, Field, Int, Kind, List, Obj, Str
from gpuos_tools.tomlfile import load_toml

_UID = Int(0, (1 << 32) - 2)
_USER = Either((Str(max_len=256, pattern="[^\x00/:]+", form="a user name"), _UID))
_REGEX = Str(max_len=4096, form="a regular expression")
#: a path: not empty, no NUL (which no file name can hold)
PATH = Str(max_len=4096, pattern="[^\x00]+", form="a path")

#: Every table and key a maintenance profile may have, and what each key's value may be.
_KEYS: dict[str, dict[str, Kind]] = {
    "select": {"users": Either((List(_USER, max_len=4096), _USER)), "command": _REGEX,
               "exclude_command": _REGEX, "all": Bool()},
    "checkpoint": {"timeout_ms": Int(0, 1 << 40), "on_error": Str(("resume", "keep"))},
    "state": {"file": PATH},
}
STATE_SCHEMA = "gpuos-ckpt-profile/1"


@dataclass
class Profile:
    path: Path
    state_file: Path
    uids: set[int] = field(default_factory=set)
    command: re.Pattern[str] | None = None
    exclude_command: re.Pattern[str] | None = None
    select_all: bool = False
    timeout_ms: int = 0
    on_error: str = "resume"

    def matches(self, info: procs.ProcInfo) -> bool:
        """Does the profile select this process (whether or not it uses CUDA)?"""
        if self.exclude_command is not None and self.exclude_command.search(info.command):
            return False
        if self.select_all:
            return True
        if self.uids and info.uid not in self.uids:
            return False
        return self.command is None or self.command.search(info.command) is not None


def _bad(path: Path, message: str) -> GpuosError:
    return GpuosError(f"{path}: {message}", ExitCode.BAD_INPUT)


def _uid(path: Path, user: Any) -> int:
    if isinstance(user, bool) or not isinstance(user, (int, str)):
        raise _bad(path, f"select.users: {user!r} is neither a user name nor a uid")
    if isinstance(user, int) or user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise _bad(path, f"select.users: no user named {user!r} on this machine") from None


def _regex(path: Path, key: str, value: Any) -> re.Pattern[str] | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _bad(path, f"select.{key} must be a non-empty string (a regular expression)")
    try:
        return re.compile(value)
    except re.error as e:
        raise _bad(path, f"select.{key}: bad regular expression: {e}") from None


def read_tables(path: Path, keys: dict[str, dict[str, Kind]]) -> dict[str, Any]:
    """A TOML profile whose tables and keys must all be known (``keys``: table -> key -> the
    kind of its value); NO_INPUT when missing, PERMISSION when unreadable, BAD_INPUT naming the
    table and key that is wrong (not UTF-8, not TOML, unknown, or a value of the wrong type)."""
    data = load_toml(path)
    for table, value in data.items():
        if table not in keys:
            raise _bad(path, f"unknown table [{table}] (known: {', '.join(sorted(keys))})")
        if not isinstance(value, dict):
            raise _bad(path, f"{table} must be a table ([{table}])")
        for key, v in value.items():
            kind = keys[table].get(key)
            if kind is None:
                raise _bad(path, f"unknown key {table}.{key} (known: {', '.join(sorted(keys[table]))})")
            problem = _checker(kind)(v)
            if problem is not None:
                raise _bad(path, f"{table}.{key}{problem[0]}: {problem[1]}")
    return data


@functools.cache
def _checker(kind: Kind) -> Any:
    return kind.checker()


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and check a profile; NO_INPUT when missing, BAD_INPUT when wrong."""
    path = Path(path)
    data = read_tables(path, _KEYS)
    select = data.get("select", {})
    ckpt = data.get("checkpoint", {})
    state = data.get("state", {})
    users = select.get("users", [])
    if isinstance(users, (str, int)):
        users = [users]
    if not isinstance(users, list):
        raise _bad(path, "select.users must be a list of user names or uids")
    select_all = select.get("all", False)
    if not isinstance(select_all, bool):
        raise _bad(path, "select.all must be true or false")
    profile = Profile(
        path=path,
        state_file=Path(),
        uids={_uid(path, u) for u in users},
        command=_regex(path, "command", select.get("command")),
        exclude_command=_regex(path, "exclude_command", select.get("exclude_command")),
        select_all=select_all,
    )
    if not (profile.uids or profile.command or profile.select_all):
        raise _bad(path, "selects nothing: give select.users and/or select.command "
                         "(or select.all = true for every CUDA process)")
    timeout = ckpt.get("timeout_ms", 0)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
        raise _bad(path, "checkpoint.timeout_ms must be an integer >= 0")
    profile.timeout_ms = timeout
    on_error = ckpt.get("on_error", "resume")
    if on_error not in ("resume", "keep"):
        raise _bad(path, 'checkpoint.on_error must be "resume" or "keep"')
    profile.on_error = on_error
    file = state.get("file")
    if not isinstance(file, str) or not file:
        raise _bad(path, "state.file is required: where the list of suspended processes is kept")
    state_file = Path(os.path.expanduser(file))
    profile.state_file = state_file if state_file.is_absolute() else path.resolve().parent / state_file
    return profile


def cuda_candidates() -> list[procs.ProcInfo]:
    """Running CUDA processes as NVML and /proc/*/maps show them (not this one, nor its ancestors)."""
    with nvml_session() as nv:
        on_gpu = set(nv.processes()) if nv is not None else set()
    mapped, _ = procs.scan_cuda_pids()
    skip = procs.ancestors()
    out = []
    for pid in sorted((on_gpu | set(mapped)) - skip):
        try:
            info = procs.read_proc(pid)
        except GpuosError:
            continue
        if info.state != "Z" and (pid in mapped or _maps(pid)):
            out.append(info)
    return out


def _maps(pid: int) -> bool:
    try:
        return procs.maps_libcuda(pid)
    except GpuosError:
        return False


def select(profile: Profile, candidates: list[procs.ProcInfo]) -> list[procs.ProcInfo]:
    return [info for info in candidates if profile.matches(info)]


#: One process of a state file: what resuming it needs to trust.
_STATE_ENTRY = Obj((
    Field("pid", Int(1, (1 << 31) - 1), required=True),
    Field("starttime", Int(0, 1 << 62)),
    Field("boot_id", Str(max_len=64)),
    Field("user", Str(max_len=256)),
    Field("command", Str()),
    Field("checkpointed_at", Str(max_len=64)),
))


def read_state(profile: Profile) -> list[dict[str, Any]]:
    """The entries of the profile's state file ([] when there is none); BAD_INPUT naming the
    entry and field when it is damaged (nothing is resumed from a list that cannot be trusted)."""
    data = registry.read_json(profile.state_file)
    if data is None:
        return []
    if not isinstance(data, dict) or data.get("schema") != STATE_SCHEMA or not isinstance(data.get("processes"), list):
        raise GpuosError(f"{profile.state_file}: not a gpu-ckpt profile state file", ExitCode.BAD_INPUT)
    check = _checker(_STATE_ENTRY)
    for i, e in enumerate(data["processes"]):
        problem = check(e)
        if problem is not None:
            raise GpuosError(f"{profile.state_file}: damaged state file: processes[{i}]{problem[0]}: {problem[1]}",
                             ExitCode.BAD_INPUT)
    return data["processes"]


def write_state(profile: Profile, entries: list[dict[str, Any]]) -> None:
    """Write the state file atomically; remove it when nothing is suspended."""
    if not entries:
        try:
            os.unlink(profile.state_file)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise GpuosError(f"{profile.state_file}: cannot remove: {e.strerror}", ExitCode.IO_ERROR) from e
        return
    registry.write_json_atomic(profile.state_file, {
        "schema": STATE_SCHEMA,
        "profile": str(profile.path.resolve()),
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "processes": entries,
    })


def _summary(ckpt: Checkpointer, action: str, profile: Profile, **counts: Any) -> Record:
    rec: Record = {"type": "ckpt_profile", "action": action, "profile": str(profile.path),
                   "state_file": str(profile.state_file), **counts}
    ckpt.out(rec)
    return rec


def suspend_profile(ckpt: Checkpointer, profile: Profile) -> tuple[Record, list[CkptError]]:
    """Suspend every running CUDA process the profile selects; record them in the state file.

    Returns the ``ckpt_profile`` summary and the failures (each process that failed was left
    running or in the state its error names). With on_error = "resume" the first failure stops
    the run and the processes it suspended are resumed.
    """
    carried = [e for e in read_state(profile) if registry.same_process(e)]
    carried_pids = {int(e["pid"]) for e in carried}
    chosen = [i for i in select(profile, cuda_candidates()) if i.pid not in carried_pids]
    entries = list(carried)
    done: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    failures: list[CkptError] = []
    write_state(profile, entries)
    for info in chosen:
        try:
            state = ckpt.state(info.pid)
        except CkptError as e:
            if e.code in (ExitCode.NO_SUCH_PROCESS, ExitCode.NOT_CUDA_PROCESS):
                skipped.append({"pid": info.pid, "why": str(e)})
                continue
            ckpt.out(e.record)
            failures.append(e)
            break
        if state != "running":
            skipped.append({"pid": info.pid, "why": f"{state}, not running (not suspended by this profile)"})
            continue
        try:
            result = ckpt.suspend(info.pid, profile.timeout_ms)
        except CkptError as e:
            failures.append(e)
            if profile.on_error == "resume":
                break
            continue
        known = registry.lookup(info.pid) or {}
        entry = registry.entry_for(info, gpus=known.get("gpus", []), bytes=result.get("bytes"))
        entries.append(entry)
        done.append(entry)
        write_state(profile, entries)
    resumed = 0
    if failures and profile.on_error == "resume":
        for entry in reversed(done):
            try:
                ckpt.resume(int(entry["pid"]))
                resumed += 1
                entries.remove(entry)
            except CkptError as e:
                failures.append(e)
            write_state(profile, entries)
    summary = _summary(ckpt, "checkpoint", profile, selected=len(chosen), suspended=len(done) - resumed,
                       resumed_after_failure=resumed, already_suspended=len(carried), skipped=skipped,
                       failed=[{"pid": e.pid, "error": e.code.name, "state": e.state, "message": str(e)}
                               for e in failures],
                       ok=not failures)
    return summary, failures


def resume_profile(ckpt: Checkpointer, profile: Profile) -> tuple[Record, list[CkptError]]:
    """Resume exactly the processes the state file lists; keep in it those that failed."""
    entries = read_state(profile)
    remaining: list[dict[str, Any]] = []
    failures: list[CkptError] = []
    skipped: list[dict[str, Any]] = []
    resumed = 0
    for entry in entries:
        pid = int(entry["pid"])
        if not registry.same_process(entry):
            failures.append(ckpt.fail(
                "restore", pid, f"PID {pid} ({entry.get('command', '?')[:60]}) suspended at "
                f"{entry.get('checkpointed_at')} is gone (it exited or was killed while suspended)",
                ExitCode.NO_SUCH_PROCESS, None, False))
            continue
        try:
            if ckpt.state(pid, quiet=False) == "running":
                skipped.append({"pid": pid, "why": "already running (resumed by someone else)"})
                continue
            ckpt.resume(pid)
            resumed += 1
        except CkptError as e:
            failures.append(e)
            remaining.append(entry)
    write_state(profile, remaining)
    summary = _summary(ckpt, "restore", profile, listed=len(entries), resumed=resumed, skipped=skipped,
                       failed=[{"pid": e.pid, "error": e.code.name, "state": e.state, "message": str(e)}
                               for e in failures],
                       still_suspended=len(remaining), ok=not failures)
    return summary, failures
