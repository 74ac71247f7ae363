"""What /proc says about a process: does it exist, who owns it, what runs, does it map libcuda.

Everything here works without a GPU or a driver, so that a wrong PID, a process of another user
and a process that is not a CUDA program are told apart before the driver is touched.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpuos_tools.errors import ExitCode, GpuosError

PROC = "/proc"
#: A process uses CUDA when the user-space driver is mapped into it.
LIBCUDA = b"/libcuda.so"


@dataclass
class ProcInfo:
    pid: int
    uid: int  #: real uid
    uids: tuple[int, ...]  #: real, effective, saved, filesystem
    user: str
    comm: str
    cmdline: list[str] = field(default_factory=list)
    #: clock ticks after boot at which the process started: with the pid, names it uniquely
    starttime: int = 0
    state: str = "?"  #: one letter of /proc/PID/stat (R, S, D, T, Z...)

    @property
    def command(self) -> str:
        return " ".join(self.cmdline) if self.cmdline else f"[{self.comm}]"

    def describe(self) -> dict:
        return {"pid": self.pid, "user": self.user, "command": self.command, "starttime": self.starttime}


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def exists(pid: int) -> bool:
    """True when a process (not a zombie) with this pid exists."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, it is someone else's
    try:
        return read_proc(pid).state != "Z"
    except GpuosError:
        return False


def read_proc(pid: int) -> ProcInfo:
    """Read /proc/PID; raise NO_SUCH_PROCESS when there is none."""
    if pid <= 0:
        raise GpuosError(f"{pid} is not a process id", ExitCode.NO_SUCH_PROCESS)
    base = f"{PROC}/{pid}"
    try:
        with open(f"{base}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        with open(f"{base}/status", "rb") as f:
            status = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        raise GpuosError(f"no process with PID {pid}", ExitCode.NO_SUCH_PROCESS) from None
    except PermissionError as e:  # /proc mounted with hidepid
        raise GpuosError(f"PID {pid}: cannot read /proc/{pid}: {e.strerror}", ExitCode.PERMISSION) from None
    try:
        with open(f"{base}/cmdline", "rb") as f:
            cmdline = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        cmdline = []
    # comm is in parentheses and may itself contain spaces and parentheses
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    uids: tuple[int, ...] = (0, 0, 0, 0)
    for line in status.splitlines():
        if line.startswith("Uid:"):
            uids = tuple(int(x) for x in line.split()[1:5])
            break
    return ProcInfo(
        pid=pid,
        uid=uids[0],
        uids=uids,
        user=user_name(uids[0]),
        comm=comm,
        cmdline=cmdline,
        starttime=int(fields[19]),
        state=fields[0],
    )


def may_control(info: ProcInfo) -> bool:
    """Root may checkpoint any process; anyone else only their own (all its uids theirs)."""
    euid = os.geteuid()
    return euid == 0 or all(u == euid for u in info.uids[:3])


def maps_libcuda(pid: int) -> bool:
    """Does the process map libcuda.so? Raise PERMISSION when its maps cannot be read."""
    return maps_library(pid, LIBCUDA)


def maps_library(pid: int, name: bytes) -> bool:
    """Does the process map a file whose path contains ``name`` (e.g. ``b"/libnccl.so"``)? Raise
    PERMISSION when its maps cannot be read."""
    try:
        with open(f"{PROC}/{pid}/maps", "rb") as f:
            return name in f.read()
    except (FileNotFoundError, ProcessLookupError):
        raise GpuosError(f"PID {pid} exited", ExitCode.NO_SUCH_PROCESS) from None
    except PermissionError:
        raise GpuosError(
            f"PID {pid}: not allowed to read /proc/{pid}/maps (only root or the process's owner may)",
            ExitCode.PERMISSION,
        ) from None


def check_target(pid: int) -> ProcInfo:
    """The checks made before any driver call: the process exists, we may control it, it uses CUDA.

    Raises NO_SUCH_PROCESS, PERMISSION, NOT_CUDA_PROCESS or USAGE (our own pid); the process is
    never touched.
    """
    info = read_proc(pid)
    if info.state == "Z":
        raise GpuosError(f"PID {pid} has exited (a zombie waiting for its parent)", ExitCode.NO_SUCH_PROCESS)
    if pid == os.getpid():
        raise GpuosError("a process cannot checkpoint itself", ExitCode.USAGE)
    if not may_control(info):
        raise GpuosError(
            f"PID {pid} belongs to {info.user}: only root or its owner may checkpoint or restore it",
            ExitCode.PERMISSION,
        )
    if not maps_libcuda(pid):
        raise GpuosError(
            f"PID {pid} ({info.command[:80]}) is not a CUDA process: it does not map libcuda.so",
            ExitCode.NOT_CUDA_PROCESS,
        )
    return info


def all_pids() -> Iterator[int]:
    for name in os.listdir(PROC):
        if name.isdigit():
            yield int(name)


def scan_cuda_pids() -> tuple[list[int], int]:
    """Pids of the processes that map libcuda and whose maps we may read; and how many we could not read.

    This finds CUDA processes that NVML no longer lists because they are checkpointed (a
    checkpointed process holds no GPU, but libcuda stays mapped).
    """
    found: list[int] = []
    unreadable = 0
    me = os.getpid()
    for pid in all_pids():
        if pid == me:
            continue
        try:
            with open(f"{PROC}/{pid}/maps", "rb") as f:
                if LIBCUDA in f.read():
                    found.append(pid)
        except PermissionError:
            unreadable += 1
        except OSError:  # exited meanwhile
            continue
    return sorted(found), unreadable


def ancestors(pid: int | None = None) -> set[int]:
    """This process and its ancestors (never selected by a profile)."""
    out: set[int] = set()
    pid = os.getpid() if pid is None else pid
    while pid > 0 and pid not in out:
        out.add(pid)
        try:
            with open(f"{PROC}/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            pid = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def parent_of(pid: int) -> int | None:
    """The parent's pid, None when the process is gone."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return int(stat[stat.rindex(")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def unreaped(pid: int) -> bool:
    """Whether the process with this pid has ended and its parent has not reaped it yet (a
    zombie: it still holds the pid)."""
    try:
        return read_proc(pid).state == "Z"
    except GpuosError:
        return False


def taken(ids: list[int]) -> list[int]:
    """Those of ``ids`` some process or thread holds now, zombies included (a zombie's pid is
    not free until it is reaped)."""
    return [i for i in ids if os.path.exists(f"{PROC}/{i}")]


def tree_ids(pid: int) -> tuple[list[int], list[int]]:
    """The processes of ``pid``'s tree and all their threads (pids and tids, sorted): every one
    of them must be free again for CRIU to restore the tree under its old ids."""
    pids = [p for p in descendants(pid) if exists(p)]
    tids: set[int] = set()
    for p in pids:
        try:
            tids.update(int(t) for t in os.listdir(f"{PROC}/{p}/task"))
        except OSError:
            tids.add(p)
    return pids, sorted(tids)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (children, their children...), in pid order."""
    children: dict[int, list[int]] = {}
    for p in all_pids():
        parent = parent_of(p)
        if parent is not None:
            children.setdefault(parent, []).append(p)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out.append(p)
        todo.extend(children.get(p, []))
    return sorted(out)


def environ_values(pid: int, names: tuple[str, ...]) -> dict[str, str]:
    """Those of ``names`` set in the process's environment as it started (empty when unreadable:
    only root or the owner may read it)."""
    try:
        with open(f"{PROC}/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        name = key.decode(errors="replace")
        if sep and name in names:
            out[name] = value.decode(errors="replace")
    return out


#: What a launcher tells each rank of a job (torchrun, MPI launchers, SLURM), first found wins.
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def rank_of(pid: int) -> int | None:
    """The rank a launcher gave the process (its environment as it started), None when it has
    none or its environment is not ours to read."""
    env = environ_values(pid, RANK_VARIABLES)
    return next((int(env[k]) for k in RANK_VARIABLES if env.get(k, "").isdigit()), None)


#: The number of ranks a launcher tells each rank the job has, in RANK_VARIABLES' order.
SIZE_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def world_size_of(pid: int) -> int | None:
    """How many ranks the process's launcher said the job has, None when it said nothing or the
    environment is not ours to read."""
    env = environ_values(pid, SIZE_VARIABLES)
    return next((int(env[k]) for k in SIZE_VARIABLES if env.get(k, "").isdigit()), None)


def boot_id() -> str:
    try:
        with open(f"{PROC}/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def fd_targets(pid: int) -> dict[int, str]:
    """What each open descriptor of the process is (``/proc/PID/fd/N``'s link: a path,
    ``pipe:[INODE]``, ``socket:[INODE]``...); empty when the process is gone or not ours to read,
    and without descriptors closed while it is read."""
    try:
        fds = os.listdir(f"{PROC}/{pid}/fd")
    except OSError:
        return {}
    out = {}
    for fd in fds:
        target = link_target(f"{PROC}/{pid}/fd/{fd}")
        if target:
            out[int(fd)] = target
    return out


def gpu_device_minors(pid: int) -> list[int]:
    """Minor numbers of the /dev/nvidiaN nodes the process has open (empty when unreadable)."""
    minors: set[int] = set()
    for target in fd_targets(pid).values():
        name = target.rsplit("/", 1)[-1]
        if target.startswith("/dev/nvidia") and name[6:].isdigit():
            minors.add(int(name[6:]))
    return sorted(minors)


def link_target(path: str) -> str:
    """Where the symbolic link ``path`` points ("" when it cannot be read)."""
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _anonymous_shared(maps_line: str) -> bool:
    """A mapping /proc/PID/maps shows as deleted that is no file: shared anonymous memory
    (`/dev/zero (deleted)`) or a System V segment. CRIU dumps them as memory, not as deleted files."""
    path = maps_line.split(maxsplit=5)[-1].strip()
    return path == "/dev/zero (deleted)" or path.startswith("/SYSV")


def largest_deleted_file(pids: list[int]) -> int:
    """The size in bytes of the largest deleted file any of ``pids`` holds open or mapped, or the
    space it takes on disk where that is more (CRIU counts either); 0 if none. Processes that are
    gone or unreadable count as holding none."""
    largest = 0
    for pid in pids:
        try:
            fds = [f"{PROC}/{pid}/fd/{fd}" for fd in os.listdir(f"{PROC}/{pid}/fd")]
            with open(f"{PROC}/{pid}/maps", encoding="utf-8", errors="replace") as f:
                maps = [f"{PROC}/{pid}/map_files/{line.split(maxsplit=1)[0]}" for line in f
                        if line.rstrip().endswith(" (deleted)") and not _anonymous_shared(line)]
        except OSError:
            continue
        for path in [*(fd for fd in fds if link_target(fd).endswith(" (deleted)")), *maps]:
            try:
                st = os.stat(path)
            except OSError:
                continue
            largest = max(largest, st.st_size, st.st_blocks * 512)  # tmpfs allocates whole pages
    return largest
