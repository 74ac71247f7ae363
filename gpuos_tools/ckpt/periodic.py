"""Periodic checkpoints from cron: which image to take next (full or incremental), what it is
called, and which old images to delete, for a profile like gpuos_tools/profiles/ckpt-periodic.toml::

    [images]
    directory = "/var/lib/gpuos-tools/images/train"  # relative paths: to the profile's directory
    name = "train"            # images are NAME-YYYYmmddTHHMMSS.mmmZ (UTC), sorting by time
    compress = false          # zstd per chunk (only where it makes a chunk smaller)
    chunk_size = "64MiB"
    checksum = "crc32"        # or "sha256"

    [chain]
    length = 6                # incremental images after each full one (0: every image is full)

    [retention]
    keep = 14                 # the newest images kept (0: no limit by count)
    max_age = "7d"            # and none older than this (absent: no limit by age)

    [agent]
    pid = 4242                # the agent to snapshot: pid, socket, or a command regex
    # socket = "/run/gpuos/agent-4242.sock"
    # command = 'python3? .*train'

Full-process images instead (``[images] kind = "process"``): each run dumps the whole process
with CRIU and leaves it running (`gpu-ckpt --pid PID --image DIR --leave-running`: the driver
checkpoint, ``criu dump --leave-running``, the driver restore), into NAME-STAMP; every image is
full (CRIU's incremental dumps need soft-dirty tracking, which recent kernels lack), so
``chain.length`` must be 0, and compress, chunk_size and checksum do not apply. The process is
named by a [process] table instead of [agent]::

    [process]
    pid = 4242                # or command = 'python3? .*train' (exactly one CUDA process)
    timeout_ms = 600000       # how long the lock may wait for its GPU work (0: no limit)

The snapshot itself is the agent's: ``run_periodic`` takes it as a function
``snapshot(path, parent) -> summary`` that writes a committed image at ``path`` (through
``ImageWriter``, so a failure leaves nothing visible), incremental on ``parent`` when that is
not None. ``agent_snapshot`` gets that function from the agent (``agent/snapshot.py``).

Rules: the newest image and every image a kept image chains to are never deleted; images are
deleted newest first, each by one rename, so no image ever points at a deleted parent; files in
the directory that are not images named by this profile are never touched; temp directories of
writers that died are removed; a lock file keeps two runs of one profile apart.

A damaged image (one whose manifest or parent chain does not pass gpuos_tools.image's
checks) never stops a run: it is listed in the record's ``damaged`` with what is wrong, is not
counted by ``keep``, is never chained to and never deleted (what is damaged is for a person to
look at), and the run goes on taking its image and applying retention to the others.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuos_tools import procs
from gpuos_tools.agent.snapshot import periodic_snapshot
from gpuos_tools.ckpt import agent_criu
from gpuos_tools.ckpt.criu import METADATA, image_state
from gpuos_tools.ckpt.driver import Checkpointer
from gpuos_tools.ckpt.profile import PATH, _bad, read_tables
from gpuos_tools.ckpt.registry import read_json
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools import image as img
from gpuos_tools.image.manifest import MAX_CHAIN, MAX_CHUNK
from gpuos_tools.stream.schema import Bool, Either, Int, Kind, Num, Str
from gpuos_tools.units import parse_age, parse_size

#: ``snapshot(path, parent) -> summary``: writes one committed image at ``path``.
SnapshotFn = Callable[[str, "str | None"], dict[str, Any]]

#: Every table and key of a periodic profile, and what each key's value may be.
_KEYS: dict[str, dict[str, Kind]] = {
    "images": {"directory": PATH, "name": Str(max_len=200), "compress": Bool(),
               "chunk_size": Either((Int(0, MAX_CHUNK, "bytes"), Str(max_len=64, form="a size such as 64MiB"))),
               "checksum": Str((*img.CHECKSUMS, "auto")), "kind": Str(("agent", "process"))},
    "chain": {"length": Int(0, MAX_CHAIN - 1)},
    "retention": {"keep": Int(0, 1 << 31), "max_age": Either((Num(0, unit="seconds"),
                                                               Str(max_len=64, form="an age such as 7d")))},
    "agent": {"pid": Int(1, (1 << 31) - 1), "socket": PATH,
              "command": Str(max_len=4096, form="a regular expression")},
    "process": {"pid": Int(1, (1 << 31) - 1), "command": Str(max_len=4096, form="a regular expression"),
                "timeout_ms": Int(0, 1 << 31)},
}
_STAMP = "%Y%m%dT%H%M%S"
LOCK_FILE = ".gpuos-periodic.lock"


@dataclass
class PeriodicProfile:
    path: Path
    directory: Path
    name: str = "image"
    compress: bool = False
    chunk_size: int = img.DEFAULT_CHUNK_SIZE
    checksum: str = "crc32"
    chain_length: int = 0
    keep: int = 0
    max_age_s: float | None = None
    agent: dict[str, Any] = field(default_factory=dict)
    kind: str = "agent"  #: "agent" (the agent's images) or "process" (CRIU full-process images)
    process: dict[str, Any] = field(default_factory=dict)

    @property
    def options(self) -> dict[str, Any]:
        """What the snapshot function needs to know to write the image."""
        return {"compress": self.compress, "chunk_size": self.chunk_size, "checksum": self.checksum}


def load_periodic_profile(path: str | os.PathLike[str]) -> PeriodicProfile:
    """Read and check a periodic-checkpoint profile; NO_INPUT when missing, BAD_INPUT when wrong."""
    path = Path(path)
    data = read_tables(path, _KEYS)
    images, chain, retention = data.get("images", {}), data.get("chain", {}), data.get("retention", {})
    directory = images.get("directory")
    if not isinstance(directory, str) or not directory:
        raise _bad(path, "images.directory is required: where the images go")
    d = Path(os.path.expanduser(directory))
    prof = PeriodicProfile(path=path, directory=d if d.is_absolute() else path.resolve().parent / d)
    name = images.get("name", "image")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_+-]*", name):
        raise _bad(path, "images.name must be letters, digits, _, + or - (it starts every image's name)")
    prof.name = name
    compress = images.get("compress", False)
    if not isinstance(compress, bool):
        raise _bad(path, "images.compress must be true or false")
    prof.compress = compress
    chunk = images.get("chunk_size", img.DEFAULT_CHUNK_SIZE)
    try:
        prof.chunk_size = chunk if isinstance(chunk, int) and not isinstance(chunk, bool) else parse_size(str(chunk))
    except ValueError as e:
        raise _bad(path, f"images.chunk_size: {e}") from None
    if not 4096 <= prof.chunk_size <= MAX_CHUNK:
        raise _bad(path, "images.chunk_size must be at least 4KiB and at most 4GiB")
    prof.checksum = images.get("checksum", "crc32")
    if prof.checksum not in img.CHECKSUMS:
        raise _bad(path, f"images.checksum must be one of {', '.join(img.CHECKSUMS)}")
    length = chain.get("length", 0)
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise _bad(path, "chain.length must be an integer >= 0")
    prof.chain_length = length
    keep = retention.get("keep", 0)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise _bad(path, "retention.keep must be an integer >= 0 (0: no limit by count)")
    prof.keep = keep
    age = retention.get("max_age")
    if age is not None:
        try:
            prof.max_age_s = float(age) if isinstance(age, (int, float)) and not isinstance(age, bool) \
                else parse_age(str(age))
        except ValueError as e:
            raise _bad(path, f"retention.max_age: {e}") from None
        if prof.max_age_s <= 0:
            raise _bad(path, "retention.max_age must be positive")
    prof.kind = images.get("kind", "agent")
    if prof.kind not in ("agent", "process"):
        raise _bad(path, 'images.kind must be "agent" (the agent\'s images) or "process" (full-process, CRIU)')
    if prof.kind == "process":
        return _process_profile(path, prof, data)
    if "process" in data:
        raise _bad(path, '[process] goes with images.kind = "process" ([agent] names the agent otherwise)')
    agent = data.get("agent", {})
    if sum(k in agent for k in ("pid", "socket", "command")) != 1:
        raise _bad(path, "[agent] needs exactly one of pid, socket, command: which process to snapshot")
    if "command" in agent:
        try:
            re.compile(agent["command"])
        except (re.error, TypeError) as e:
            raise _bad(path, f"agent.command: bad regular expression: {e}") from None
    prof.agent = dict(agent)
    return prof


def _process_profile(path: Path, prof: PeriodicProfile, data: dict[str, Any]) -> PeriodicProfile:
    if "agent" in data:
        raise _bad(path, 'images.kind = "process" names its process in [process], not [agent]')
    if prof.chain_length:
        raise _bad(path, 'chain.length must be 0 with images.kind = "process": every full-process image is full')
    proc = data.get("process", {})
    if sum(k in proc for k in ("pid", "command")) != 1:
        raise _bad(path, "[process] needs exactly one of pid, command: which process to dump")
    if "pid" in proc and (isinstance(proc["pid"], bool) or not isinstance(proc["pid"], int) or proc["pid"] <= 0):
        raise _bad(path, "process.pid must be a positive integer")
    if "command" in proc:
        try:
            re.compile(proc["command"])
        except (re.error, TypeError) as e:
            raise _bad(path, f"process.command: bad regular expression: {e}") from None
    timeout = proc.get("timeout_ms", 0)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
        raise _bad(path, "process.timeout_ms must be an integer >= 0")
    prof.process = dict(proc)
    return prof


# -- the images of a profile ------------------------------------------------------------------


@dataclass
class Entry:
    """An image of the profile's directory: its name, time (from the name), id and parent id."""

    name: str
    path: Path
    time: float
    image_id: str | None = None
    parent_id: str | None = None
    readable: bool = True
    #: why it is damaged (None: it reads)
    problem: str | None = None


def image_name(prof: PeriodicProfile, now: float) -> str:
    ms = min(999, int((now % 1) * 1000))
    return f"{prof.name}-{time.strftime(_STAMP, time.gmtime(now))}.{ms:03d}Z"


def _name_time(prof: PeriodicProfile, name: str) -> float | None:
    m = re.fullmatch(re.escape(prof.name) + r"-(\d{8}T\d{6})\.(\d{3})Z", name)
    if m is None:
        return None
    import calendar

    return calendar.timegm(time.strptime(m.group(1), _STAMP)) + int(m.group(2)) / 1000


def list_images(prof: PeriodicProfile) -> list[Entry]:
    """The profile's images, newest first. An unreadable one is listed with readable=False."""
    out = []
    try:
        names = os.listdir(prof.directory)
    except FileNotFoundError:
        return out
    except OSError as e:
        code = (ExitCode.PERMISSION if isinstance(e, PermissionError) else
                ExitCode.BAD_INPUT if e.errno in (errno.ENAMETOOLONG, errno.ENOTDIR, errno.ELOOP) else
                ExitCode.IO_ERROR)
        raise GpuosError(f"{prof.directory}: cannot list the images (images.directory of {prof.path}): "
                         f"{e.strerror}", code) from None
    for name in names:
        t = _name_time(prof, name)
        path = prof.directory / name
        if t is None or not path.is_dir():
            continue
        entry = Entry(name, path, t)
        if prof.kind == "process":
            entry.readable = image_state(path) == "complete"
            out.append(entry)
            continue
        try:
            m = img.open_image(path).manifest
            entry.image_id = m["image_id"]
            entry.parent_id = (m.get("parent") or {}).get("image_id")
        except img.ImageError as e:
            entry.readable = False
            entry.problem = str(e)
        out.append(entry)
    out.sort(key=lambda e: (e.time, e.name), reverse=True)
    return out


def chain_depth(path: Path) -> int | None:
    """How many incremental links lead from this image to its full image; None if it or its
    chain cannot be read (the next image is then full)."""
    try:
        return len(img.open_image(path).chain()) - 1
    except img.ImageError:
        return None


@dataclass
class Plan:
    name: str
    path: Path
    parent: Path | None
    why: str


def plan_next(prof: PeriodicProfile, images: list[Entry], now: float) -> Plan:
    """Full or incremental, and on what: incremental on the newest image while its chain is
    shorter than chain.length and it reads; full otherwise."""
    name = image_name(prof, now)
    newest = images[0] if images else None
    if newest is not None and newest.time >= (_name_time(prof, name) or now):
        raise GpuosError(f"{newest.path} is not older than the image to take now ({name}): is the clock right?",
                         ExitCode.FAILURE)
    if prof.chain_length == 0:
        return Plan(name, prof.directory / name, None, "chain.length = 0: every image is full")
    if newest is None:
        return Plan(name, prof.directory / name, None, "no image yet")
    depth = chain_depth(newest.path)
    if depth is None:
        return Plan(name, prof.directory / name, None, f"{newest.name} or its chain does not read")
    if depth >= prof.chain_length:
        return Plan(name, prof.directory / name, None, f"{newest.name} ends a chain of {depth} increments")
    return Plan(name, prof.directory / name, newest.path, f"increment {depth + 1} of {prof.chain_length}")


def retention(prof: PeriodicProfile, images: list[Entry], now: float) -> tuple[list[Entry], list[Entry]]:
    """(kept, to delete), both newest first: the newest ``keep`` images not older than
    ``max_age``, the newest image always, and every image a kept one chains to. Damaged images
    are in neither list: they are not counted and not deleted."""
    kept_ids: set[str] = set()
    kept: set[str] = set()
    images = [e for e in images if e.readable]
    for i, e in enumerate(images):
        young = prof.max_age_s is None or now - e.time <= prof.max_age_s
        if i == 0 or ((prof.keep == 0 or i < prof.keep) and young):
            kept.add(e.name)
    by_id = {e.image_id: e for e in images if e.image_id}
    for e in images:
        if e.name in kept:
            cur: Entry | None = e
            while cur is not None:
                kept.add(cur.name)
                if cur.image_id in kept_ids:
                    break
                if cur.image_id:
                    kept_ids.add(cur.image_id)
                cur = by_id.get(cur.parent_id) if cur.parent_id else None
    return [e for e in images if e.name in kept], [e for e in images if e.name not in kept]


def damaged(images: list[Entry]) -> list[dict[str, str]]:
    """The damaged images of a listing, for the record: [{image, problem}]."""
    return [{"image": e.name, "problem": e.problem or "does not read"} for e in images if not e.readable]


# -- one run ----------------------------------------------------------------------------------


def run_periodic(prof: PeriodicProfile, snapshot: SnapshotFn, now: float | None = None) -> dict[str, Any]:
    """Take the next image and apply retention; return a ``ckpt_periodic`` record.

    A failing snapshot is raised after its temp is gone (nothing visible is left and nothing is
    deleted); retention runs only after a new image is committed and opens."""
    try:
        prof.directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GpuosError(f"{prof.directory}: cannot create: {e.strerror}",
                         ExitCode.PERMISSION if isinstance(e, PermissionError) else ExitCode.IO_ERROR) from e
    lock_fd = os.open(prof.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GpuosError(f"{prof.directory}: another periodic checkpoint of it is running",
                             ExitCode.FAILURE) from None
        return _run_locked(prof, snapshot, time.time() if now is None else now)
    finally:
        os.close(lock_fd)


def _run_locked(prof: PeriodicProfile, snapshot: SnapshotFn, now: float) -> dict[str, Any]:
    cleaned = img.clean_stale_temps(prof.directory)
    images = list_images(prof)
    plan = plan_next(prof, images, now)
    started = time.perf_counter()
    try:
        summary = snapshot(str(plan.path), None if plan.parent is None else str(plan.parent))
    finally:
        img.clean_stale_temps(prof.directory)
    if prof.kind == "process":
        if image_state(plan.path) != "complete":
            raise GpuosError(f"the dump did not leave a complete image at {plan.path}", ExitCode.SOFTWARE)
        meta = read_json(plan.path / METADATA) or {}
        nbytes = sum(f.stat().st_size for f in plan.path.iterdir() if f.is_file())
        return _retire(prof, plan, now, started, summary, meta.get("bytes"), nbytes, cleaned, "process")
    try:
        made = img.open_image(plan.path)
    except img.ImageError as e:
        raise GpuosError(f"the snapshot did not leave an image at {plan.path}: {e}", ExitCode.SOFTWARE) from None
    recorded = (made.manifest.get("parent") or {}).get("image_id")
    wanted = None if plan.parent is None else img.open_image(plan.parent).image_id
    if recorded != wanted:
        raise GpuosError(f"{plan.path}: the snapshot chained to {recorded}, not to {wanted} as planned",
                         ExitCode.SOFTWARE)
    return _retire(prof, plan, now, started, summary, made.manifest.get("bytes"), made.manifest.get("stored_bytes"),
                   cleaned, "full" if plan.parent is None else "incremental")


def _retire(prof: PeriodicProfile, plan: Plan, now: float, started: float, summary: dict[str, Any],
            nbytes: int | None, stored: int | None, cleaned: list[str], kind: str) -> dict[str, Any]:
    """Apply retention after a new image was committed; the ``ckpt_periodic`` record."""
    seconds = time.perf_counter() - started
    images = list_images(prof)
    kept, doomed = retention(prof, images, now)
    deleted = []
    for e in doomed:  # newest first: a child goes before its parent
        img.remove_image(e.path)
        deleted.append(e.name)
    return {
        "type": "ckpt_periodic", "profile": str(prof.path), "directory": str(prof.directory),
        "damaged": damaged(images),
        "image": plan.name, "kind": kind,
        "parent": None if plan.parent is None else plan.parent.name, "why": plan.why,
        "bytes": nbytes, "stored_bytes": stored,
        "seconds": round(seconds, 6), "snapshot": summary, "kept": [e.name for e in kept],
        "deleted": deleted, "cleaned": [os.path.basename(p) for p in cleaned],
    }


def agent_snapshot(prof: PeriodicProfile) -> SnapshotFn:
    """The snapshot function for ``gpu-ckpt periodic`` of an agent's job: ``snapshot(path, parent)``
    takes one consistent snapshot of the profile's [agent] (pid, socket or command) into a
    committed image at ``path``, incremental on ``parent`` when not None, and returns its summary."""
    return periodic_snapshot(dict(prof.agent), prof.options)


def process_snapshot(prof: PeriodicProfile) -> SnapshotFn:
    """The snapshot function of a full-process profile: a CRIU dump of the [process] that leaves
    it running (gpuos_tools/ckpt/criu.py ``dump``; a program under the agent on interception is
    suspended by its agent around it, gpuos_tools/ckpt/agent_criu.py), into the image's path."""
    pid = find_process(prof.process)

    def snapshot(path: str, parent: str | None) -> dict[str, Any]:
        assert parent is None  # every full-process image is full
        rec = agent_criu.dump(Checkpointer(), pid, Path(path), int(prof.process.get("timeout_ms", 0)),
                              leave_running=True)
        return {k: rec[k] for k in ("pid", "state", "bytes", "checkpoint_s", "message") if k in rec}

    return snapshot


def find_process(spec: dict[str, Any]) -> int:
    """The pid a [process] table names: its pid, or the one CUDA process whose command line
    matches its command (NO_SUCH_PROCESS when none or several do)."""
    if "pid" in spec:
        return int(spec["pid"])
    pattern = re.compile(spec["command"])
    mapped, _ = procs.scan_cuda_pids()
    skip = procs.ancestors()
    hits = []
    for pid in sorted(set(mapped) - skip):
        try:
            info = procs.read_proc(pid)
        except GpuosError:
            continue
        if info.state != "Z" and pattern.search(info.command):
            hits.append((pid, info.command))
    if len(hits) != 1:
        listed = "; ".join(f"{p}: {c[:80]}" for p, c in hits) or "none"
        raise GpuosError(f"the command pattern {spec['command']!r} must match exactly one CUDA process, not "
                         f"{len(hits)} ({listed})", ExitCode.NO_SUCH_PROCESS)
    return hits[0][0]


def snapshot_function(prof: PeriodicProfile) -> SnapshotFn:
    """The profile's snapshot function: the agent's, or a CRIU dump for full-process profiles."""
    return process_snapshot(prof) if prof.kind == "process" else agent_snapshot(prof)
