"""Pipes a dumped tree shares with processes outside it, and what the restored tree gets instead.

``python train.py | tee train.log``: the program's stdout is the write end of a pipe whose read
end ``tee`` holds. CRIU dumps the program's end and, on restore, makes a new pipe of which the
tree holds only that end: nobody reads it, and the program dies of SIGPIPE on its next write (a
read end from outside gives EOF or a hang instead). So the dump records every pipe of which the
tree holds one end only (``scan``), and the restore hands each one something in its place through
CRIU's ``--inherit-fd fd[N]:pipe:[INODE]`` (``Plan``):

- the original pipe, when a live process still holds its other end (same boot): reopened through
  that process's ``/proc/PID/fd/N``, so the reader goes on reading the restored program, as if it
  had never stopped; ``--output-to`` replaces even such a pipe, when asked;
- otherwise a write end appends to a file: by default ``DIR.restored-PID-fdN.log`` beside the
  image, or the file the user names (``/dev/null`` allowed); a read end reads ``/dev/null``.

FIFOs (named pipes) with one end outside get the same: a dump ends the writer, so a reader such
as ``cat FIFO`` reads end-of-file and is gone by the restore, and CRIU, reopening the FIFO by its
path, would leave the restored writer with no reader (SIGPIPE at its next write) or block-free
reads of nothing. A FIFO's other end found alive is reopened (through /proc, wherever the path
now leads); otherwise a write end appends to the file, a read end reads /dev/null, handed over
with ``--inherit-fd`` under the FIFO's path as CRIU names it (relative to the root). Sockets are
not scanned: CRIU refuses a single
process's established TCP connection, and a job's connections to peers outside its tree (or a
connected Unix socket's) are restored without their peer.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuos_tools import procs
from gpuos_tools.stream.schema import Field, Int, List, Obj, Str

#: The metadata key (criu.METADATA) of the tree's pipes whose other end was outside.
KEY = "outside_pipes"
_FD = Obj((Field("pid", Int(1, (1 << 31) - 1, "pid"), required=True), Field("fd", Int(0, (1 << 31) - 1),
                                                                                    required=True)),
          text="{pid, fd}")
_ENTRY = (
    Field("pipe", Str(pattern=r"pipe:\[[0-9]+\]|/.*", form="pipe:[INODE]|/PATH"),
          "`pipe:[INODE]` (what CRIU's --inherit-fd names), or the FIFO's path", required=True),
    Field("kind", Str(("pipe", "fifo")), required=True),
    Field("end", Str(("read", "write")), "the end the tree holds", required=True),
    Field("fds", List(_FD), "the tree's descriptors of it", required=True),
)
#: The metadata's list, as data.
ENTRIES = List(Obj(_ENTRY, text="{pipe, kind, end, fds}"))
#: The restore's result field ``outside``: each entry and what it got.
DONE = List(Obj((*_ENTRY, Field("how", Str(("reconnected", "file", "null")), required=True),
                 Field("to", Str(), "the other end's /proc/PID/fd/N, the file, or /dev/null", required=True)),
                text="{pipe, kind, end, fds, how, to}"))


def inherit_args(fd: int, target: str) -> list[str]:
    """CRIU's options that give the restored tree our descriptor ``fd`` wherever it held ``target``
    (``pipe:[INODE]``, or a FIFO's path as CRIU names a file: relative to the root)."""
    return ["--inherit-fd", f"fd[{fd}]:{target}"]


def criu_name(entry: dict[str, Any]) -> str:
    """What CRIU's --inherit-fd calls the recorded pipe or FIFO: ``pipe:[INODE]``, or the FIFO's path
    without its leading slash."""
    return entry["pipe"] if entry.get("kind") == "pipe" else entry["pipe"].lstrip("/")


def _access(pid: int, fd: str) -> int | None:
    """O_RDONLY, O_WRONLY or O_RDWR of ``pid``'s descriptor ``fd`` (its fdinfo flags), or None."""
    try:
        with open(f"{procs.PROC}/{pid}/fdinfo/{fd}", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags:"):
                    return int(line.split()[1], 8) & os.O_ACCMODE
    except (OSError, ValueError, IndexError):
        return None
    return None


def _pipe_fds(pid: int) -> list[tuple[int, str, str, int]]:
    """(fd, key, kind, access) of each pipe or FIFO ``pid`` holds; [] for a process gone or unreadable.
    A FIFO's key is its device and inode (its path may have changed), its path kept for the message."""
    found = []
    for fd, link in procs.fd_targets(pid).items():
        name = str(fd)
        if link.startswith("pipe:["):
            kind, key = "pipe", link
        elif link.startswith("/"):
            try:
                st = os.stat(f"{procs.PROC}/{pid}/fd/{name}")
            except OSError:
                continue
            if not stat.S_ISFIFO(st.st_mode):
                continue
            kind, key = "fifo", f"fifo:{st.st_dev}:{st.st_ino}:{link}"
        else:
            continue
        mode = _access(pid, name)
        if mode is not None:
            found.append((int(name), key, kind, mode))
    return found


def scan(pids: list[int], skip: set[str] | frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """The pipes and FIFOs of which the processes ``pids`` hold one end only (the other end is
    outside, or nobody's), each ``{pipe, kind, end, fds}`` (``ENTRY``); ``skip``: pipes handled
    elsewhere (``pipe:[INODE]``). A descriptor opened read-write holds both ends."""
    seen: dict[str, dict[str, Any]] = {}
    for pid in sorted(set(pids)):
        for fd, key, kind, mode in _pipe_fds(pid):
            if key in skip:
                continue
            e = seen.setdefault(key, {"kind": kind, "read": False, "write": False, "fds": []})
            e["read"] |= mode in (os.O_RDONLY, os.O_RDWR)
            e["write"] |= mode in (os.O_WRONLY, os.O_RDWR)
            e["fds"].append({"pid": pid, "fd": fd})
    out = []
    for key, e in seen.items():
        if e["read"] and e["write"]:
            continue  # both ends in the tree: CRIU carries the pipe whole
        name = key if e["kind"] == "pipe" else key.split(":", 3)[3]
        out.append({"pipe": name, "kind": e["kind"], "end": "write" if e["write"] else "read", "fds": e["fds"]})
    return sorted(out, key=lambda e: (e["fds"][0]["pid"], e["fds"][0]["fd"]))


def other_end(pipe: str, end: str, exclude: set[int] | frozenset[int] = frozenset()) -> str | None:
    """``/proc/PID/fd/N`` of a live process (not in ``exclude``) that holds the end of ``pipe`` the
    tree did not (the reader of a write end), or None."""
    want = (os.O_RDONLY, os.O_RDWR) if end == "write" else (os.O_WRONLY, os.O_RDWR)
    for pid in procs.all_pids():
        if pid in exclude:
            continue
        for fd, link in procs.fd_targets(pid).items():
            if link == pipe and _access(pid, str(fd)) in want:
                return f"{procs.PROC}/{pid}/fd/{fd}"
    return None


def default_file(image_dir: Path, entry: dict[str, Any]) -> Path:
    """Where a write end goes by default: a file beside the image, named after the first descriptor."""
    first = entry["fds"][0]
    return image_dir.parent / f"{image_dir.name}.restored-{first['pid']}-fd{first['fd']}.log"


@dataclass
class Plan:
    """What the restore gives each recorded pipe: the descriptors to pass to ``criu restore``,
    its options, and words for stderr and the result record. ``close()`` once CRIU has run."""

    criu_args: list[str] = field(default_factory=list)
    pass_fds: tuple[int, ...] = ()
    done: list[dict[str, Any]] = field(default_factory=list)  #: {pipe, end, fds, to, how}
    notes: list[str] = field(default_factory=list)  #: one line each, for stderr
    created: list[Path] = field(default_factory=list)  #: files the plan made (``discard``)

    def close(self) -> None:
        for fd in self.pass_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.pass_fds = ()

    def discard(self) -> None:
        """Remove the files the plan made that are still empty: a restore that failed touching nothing
        leaves nothing behind."""
        for path in self.created:
            try:
                if path.stat().st_size == 0:
                    path.unlink()
            except OSError:
                pass


def _open_output(path: Path, chosen: bool, created: list[Path]) -> int:
    """Our descriptor of the file a write end appends to (added to ``created`` if this made it); a
    default file is never a symbolic link."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | (0 if chosen else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return os.open(path, flags)
    created.append(path)
    return fd


def _reopen(path: str, end: str) -> int:
    """Our descriptor of the pipe or FIFO another process holds at ``path`` (/proc/PID/fd/N), the end
    the tree held; -1 when it cannot be opened (gone meanwhile, another user's). Opened without
    waiting: a FIFO's write end whose reader went meanwhile fails (ENXIO) instead of blocking."""
    try:
        fd = os.open(path, (os.O_WRONLY if end == "write" else os.O_RDONLY) | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return -1
    os.set_blocking(fd, True)  # the restored program's descriptor blocks, as its own did
    return fd


def plan(image_dir: Path, meta: dict[str, Any], output_to: str | None = None, same_boot: bool = True) -> Plan:
    """The restore's ``Plan`` for the pipes ``meta`` (an image's metadata) records under ``KEY``:
    see the module's text. ``output_to``: the file every write end appends to, even where the
    reader is alive. Raises OSError (the plan's descriptors closed) when a file cannot be opened."""
    p = Plan()
    entries = [e for e in meta.get(KEY) or [] if isinstance(e, dict)]
    fds: list[int] = []
    try:
        for e in entries:
            where = ", ".join(f"PID {d['pid']} fd {d['fd']}" for d in e["fds"])
            fifo = e.get("kind") == "fifo"
            what = f"the FIFO {e['pipe']}" if fifo else "a pipe"
            reader = "reader" if e["end"] == "write" else "writer"
            alive = other_end(e["pipe"], e["end"]) if same_boot and not (output_to and e["end"] == "write") else None
            fd = _reopen(alive, e["end"]) if alive is not None else -1
            why = (f"its {reader} ({alive}) is alive but its pipe cannot be reopened from here" if alive is not None
                   else f"its {reader} is gone")
            if fd >= 0:
                how, to = "reconnected", str(alive)
                note = f"its {reader} ({to}) is still there: the restored program uses the same {'FIFO' if fifo else 'pipe'}"
            elif e["end"] == "read":
                fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                how, to = "null", os.devnull
                note = f"read from {what}; {why}: it now reads {to}"
            else:
                target = Path(output_to) if output_to else default_file(image_dir, e)
                fd = _open_output(target, output_to is not None, p.created)
                how, to = "file", str(target)
                note = (f"wrote to {what}; its output now goes to {to}, as --output-to asked" if output_to else
                        f"wrote to {what}; {why}: its output is now appended to {to}")
            fds.append(fd)
            p.criu_args += inherit_args(fd, criu_name(e))
            p.done.append({**e, "to": to, "how": how})
            p.notes.append(f"{where}: {note}")
    except OSError:
        for fd in fds:
            os.close(fd)
        p.discard()
        raise
    p.pass_fds = tuple(fds)
    return p
