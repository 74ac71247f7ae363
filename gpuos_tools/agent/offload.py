"""The program's side of out-of-process validation (`gpu-trace run --validate --validate-in validator`).

At a sampled launch's API enter the program only copies: the bytes the range prediction names
inside live allocations are copied device-to-host, one allocation per copy, on a side stream of
its own (ordered after the launch's stream by an event, like a snapshot) into a staging file in a
private directory, registered as pinned memory when the driver takes it; the kernel's module image
goes beside it once, named by its content hash. A request (the kernel's name, its parameter bytes,
grid, block and shared memory, the staged regions, and the program's address windows that the
validator must keep free: vaspace.py) goes down a pipe to the validator process
(gpuos_tools/agent/replay.py), which replays the launch in its own context while the program's
launch runs; a starting validator reads the windows from a file of the private directory before
it loads the driver. At the API exit the program waits for the verdict, at most ``timeout_s``.

In the program's process this allocates no device memory of its own: a stream and an event (once
per context), the staging file's mapping registered as pinned host memory, and the child process.

Nothing the validator does reaches the program: it is a child process on its own session; a
validator that crashes, answers garbage or does not answer in time is killed and the launch is
reported unvalidated; after ``max_failures`` such failures in a row validation is switched off,
which the trace says in an `error` record. A validator that lost its context to a fault it was
asked to find exits after answering; the next sampled launch starts a fresh one.

The private directory is removed when validation ends; one a program killed outright (SIGKILL)
leaves behind names its pid, and the next program of the same user to validate removes it.
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import json
import mmap
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from gpuos_tools.agent import replay, vaspace, zygote
from gpuos_tools.agent.validate import CudaFailure, Validator, _ok, extent_targets
from gpuos_tools.agent.view import launch_record
from gpuos_tools.image import clean_stale_temps, temp_name

#: how long the program waits for one verdict by default
TIMEOUT_S = 60.0
#: how long a fresh validator may take to create its context
START_TIMEOUT_S = 120.0
#: launches a run whose addresses the kept strategy's driver would not give, that the other
#: strategies' validators try (each try starts a validator: the program waits for it)
RETRIES = 16


class Staging:
    """A file in a private directory, mapped here and read by the validator; grows on demand."""

    def __init__(self, directory: Path, register: Callable[[int, int], bool] | None = None,
                 unregister: Callable[[int], None] | None = None):
        self.dir = directory
        self.register, self.unregister = register, unregister
        self.size = 0
        self.generation = 0
        self.path: Path | None = None
        self.map: mmap.mmap | None = None
        self._anchor: Any = None
        self.addr = 0
        self.pinned = False

    def ensure(self, size: int) -> None:
        if size <= self.size:
            return
        self.close()
        size = max(size, 1 << 20, 2 * self.size)
        self.generation += 1
        self.path = self.dir / f"staging-{self.generation}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self.map)
        self.addr = ctypes.addressof(self._anchor)
        self.size = size
        self.pinned = bool(self.register and self.register(self.addr, size))

    def close(self) -> None:
        if self.map is None:
            return
        if self.pinned and self.unregister:
            self.unregister(self.addr)
        self._anchor = None
        self.map.close()
        self.map = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        self.size, self.addr, self.pinned = 0, 0, False


class Link:
    """The pipe to one validator process at a time: started lazily, restarted, or given up on."""

    def __init__(self, command: list[str], env: dict[str, str], timeout_s: float = TIMEOUT_S,
                 start_timeout_s: float = START_TIMEOUT_S, max_failures: int = 3, stderr: Path | None = None,
                 before_start: Callable[[], None] | None = None,
                 spawn: Callable[[list[str], Path | None], Any] | None = None):
        self.command, self.env = command, env
        #: starts a validator from its command and stderr file instead of a fresh process (the
        #: zygote's, zygote.py); None: subprocess.Popen
        self.spawn = spawn
        self.before_start = before_start  #: called before each start (writes what the validator reads first)
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.max_failures = max_failures
        self.stderr = stderr
        self.proc: subprocess.Popen | None = None
        self.failures = 0
        self.off: str | None = None  #: why validation was switched off
        self.refused = False  #: the last validator started said it could not start
        self.starts = 0
        self.hello: dict[str, Any] = {}  #: the running validator's ready frame

    def _start(self) -> str | None:
        self.refused = False
        if self.before_start is not None:
            try:
                self.before_start()
            except OSError as exc:
                return self._failed(f"the validator could not start: {exc}")
        if self.spawn is not None:
            try:
                self.proc = self.spawn(self.command, self.stderr)
            except (OSError, ValueError) as exc:
                self.refused = True  # the next strategy's validator may start where this one cannot
                return self._failed(f"the validator could not start: {exc}")
        else:
            err = open(self.stderr, "ab") if self.stderr is not None else subprocess.DEVNULL
            try:
                self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                             env=self.env, close_fds=True, start_new_session=True)
            except OSError as exc:
                return self._failed(f"the validator could not start: {exc}")
            finally:
                if err is not subprocess.DEVNULL:
                    err.close()
        self.starts += 1
        hello = self._reply(self.start_timeout_s)
        if isinstance(hello, str):
            return hello
        if not hello.get("ready"):
            self.refused = True
            return self._failed(f"the validator could not start: {hello.get('why', 'no reason given')}")
        self.hello = hello
        return None

    def request(self, req: dict[str, Any]) -> dict[str, Any] | str:
        """Send a request; the reply frame, or why there is none."""
        if self.off is not None:
            return self.off
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            why = self._start()
            if why is not None:
                return why
        try:
            replay.write_frame(self.proc.stdin, req)
        except OSError as exc:
            return self._failed(f"the validator went away ({exc})")
        return {}

    def answer(self) -> dict[str, Any] | str:
        """The reply to the last request, or why there is none (the validator is then killed)."""
        rep = self._reply(self.timeout_s)
        if isinstance(rep, dict):
            self.failures = 0
            if rep.pop("restart", False):
                self.kill()  # it lost its context to the fault it found, as asked: not a failure
        return rep

    def _reply(self, timeout: float) -> dict[str, Any] | str:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = proc.stdout.fileno()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return self._failed(f"the validator did not answer within {timeout:g} s: killed")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                break
        try:
            rep = replay.read_frame(proc.stdout)  # a frame arrives whole (the writer flushes once)
        except (OSError, ValueError) as exc:
            return self._failed(f"the validator answered garbage ({exc}): killed")
        if rep is None or not isinstance(rep, dict):
            if rep is not None:
                return self._failed("the validator answered garbage: killed")
            try:
                status = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                status = None
            return self._failed(f"the validator exited (status {status}){self._last_words()}")
        return rep

    def _last_words(self) -> str:
        """The end of the validator's stderr, for the record that says it died."""
        try:
            tail = self.stderr.read_bytes()[-300:].decode(errors="replace").strip() if self.stderr else ""
        except OSError:
            return ""
        return f": {tail}" if tail else ""

    def _failed(self, why: str) -> str:
        self.kill()
        self.failures += 1
        if self.failures >= self.max_failures:
            self.off = f"validation switched off after {self.failures} validator failures in a row (last: {why})"
            return self.off
        return why

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for f in (proc.stdin, proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


class DriverCopier:
    """The program-side driver calls: pinning the staging file and copying a launch's inputs out."""

    def __init__(self) -> None:
        self.side: dict[int, tuple[int, int]] = {}  # context -> (side stream, event)

    @staticmethod
    def register(addr: int, size: int) -> bool:
        from cuda.bindings import driver as drv

        return drv.cuMemHostRegister(addr, size, 0)[0] == drv.CUresult.CUDA_SUCCESS

    @staticmethod
    def unregister(addr: int) -> None:
        from cuda.bindings import driver as drv

        drv.cuMemHostUnregister(addr)

    def copy(self, stream: int, copies: list[tuple[int, int, int]]) -> None:
        """Copy (host, device, bytes) after the work already queued on ``stream``, and wait for it."""
        from cuda.bindings import driver as drv

        ctx = int(_ok(drv.cuCtxGetCurrent(), "cuCtxGetCurrent"))
        side = self.side.get(ctx)
        if side is None:
            s = _ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
            e = _ok(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            side = self.side[ctx] = (s, e)
        s, e = side
        _ok(drv.cuEventRecord(e, stream), "cuEventRecord")
        _ok(drv.cuStreamWaitEvent(s, e, 0), "cuStreamWaitEvent")
        for host, dev, n in copies:
            _ok(drv.cuMemcpyDtoHAsync(host, dev, n, s), "cuMemcpyDtoHAsync")
        _ok(drv.cuStreamSynchronize(s), "cuStreamSynchronize")

    @staticmethod
    def variable_size(api: str, parent: int, name: str) -> int | None:
        """The size of a module (or library) variable the program located without asking it."""
        from cuda.bindings import driver as drv

        if api.startswith("cuLibraryGetGlobal"):
            err, _, size = drv.cuLibraryGetGlobal(drv.CUlibrary(parent), name.encode())
        else:
            err, _, size = drv.cuModuleGetGlobal(drv.CUmodule(parent), name.encode())
        return int(size) if err == drv.CUresult.CUDA_SUCCESS else None

    @staticmethod
    def bus_id() -> str:
        from cuda.bindings import driver as drv

        dev = _ok(drv.cuCtxGetDevice(), "cuCtxGetDevice")
        raw = _ok(drv.cuDeviceGetPCIBusId(32, dev), "cuDeviceGetPCIBusId")
        return (raw if isinstance(raw, bytes) else bytes(raw)).split(b"\0", 1)[0].decode()


def regions_of(reads: list[list[int]], writes: list[list[int]],
               live: list[tuple[int, int]] | None = None) -> list[tuple[int, int, str]]:
    """(addr, size, mode) of the union of the predicted reads and writes: each merged range is "r"
    when no predicted write touches it, "w" when no predicted read does, else "rw".

    With ``live`` (the [start, end) of the live allocations, sorted, disjoint), only bytes inside
    them are kept and no range crosses from one allocation into the next: the driver refuses a
    copy that does (CUDA_ERROR_INVALID_VALUE), even between two allocations that sit end to end."""
    marks = [(s, s + n, "r") for s, n in reads if n > 0] + [(s, s + n, "w") for s, n in writes if n > 0]
    if live is not None:
        marks = [(max(s, a), min(e, b), kind, a) for s, e, kind in marks for a, b in _overlapping(live, s, e)]
    else:
        marks = [(s, e, kind, 0) for s, e, kind in marks]
    out: list[list[Any]] = []
    for s, e, kind, owner in sorted(marks):
        if out and s <= out[-1][1] and owner == out[-1][3]:
            out[-1][1] = max(out[-1][1], e)
            out[-1][2].add(kind)
        else:
            out.append([s, e, {kind}, owner])
    return [(s, e - s, "rw" if len(k) == 2 else next(iter(k))) for s, e, k, _ in out]


def _overlapping(live: list[tuple[int, int]], s: int, e: int) -> list[tuple[int, int]]:
    """The live [start, end) intervals that overlap [s, e)."""
    i = max(0, bisect.bisect_right(live, (s, float("inf"))) - 1)
    out = []
    while i < len(live) and live[i][0] < e:
        if live[i][1] > s:
            out.append(live[i])
        i += 1
    return out


#: The private directories' name: each is ``$TMPDIR/.gpuos-validator.PID.RANDOM.tmp``
#: (gpuos_tools/image/layout.py temp_name), PID the program's, so that the directory of a
#: program killed before it could remove it is known as stale once that PID is gone.
PRIVATE_NAME = "gpuos-validator"


def private_dir(parent: str | None = None) -> Path:
    """A new private (0700) directory in ``parent`` ($TMPDIR by default), after removing this
    user's directories of programs that are gone (SIGKILL leaves them); another user's, or a
    running program's, are never touched."""
    parent = parent or tempfile.gettempdir()
    try:
        clean_stale_temps(parent, PRIVATE_NAME, uid=os.getuid())
    except OSError:  # best effort: a leftover must not stop validation
        pass
    for _ in range(100):  # the name's random part makes a clash unlikely; mkdtemp tries as often
        path = temp_name(os.path.join(parent, PRIVATE_NAME))
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        return Path(path)
    raise FileExistsError(f"no free name for a private directory in {parent}")


#: the address strategy of the validators the zygote forks (zygote.py): first, when there is one
ZYGOTE = "zygote"
#: the file of the private directory that names the program's address windows to a starting validator
CLAIMS = "claims.json"
#: how a verdict that could not get the launch's addresses begins (replay.py)
ADDRESS_UNAVAILABLE = "unvalidated: address unavailable"
#: GPUOS_VALIDATOR_RELOCATE=0 in the traced program's environment: a launch whose addresses no
#: validator got stays unvalidated instead of being replayed with its spans moved
RELOCATE_ENV = "GPUOS_VALIDATOR_RELOCATE"


def validator_command(directory: Path, bus_id: str) -> tuple[list[str], dict[str, str]]:
    """The validator's command line (less its ``--strategy``) and environment: this interpreter,
    this package, untraced."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPUOS_BOOT", "CUDA_INJECTION64_PATH", "LD_PRELOAD")}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return [sys.executable, "-m", "gpuos_tools.agent.validator", "--device", bus_id, "--dir", str(directory),
            "--claims", str(directory / CLAIMS)], env


class OffloadValidator(Validator):
    """Sampled launches are copied out and replayed by the validator process (module docstring).

    The sampling and the range prediction are the in-process validator's; ``image_for`` maps a
    kernel's name and parameter sizes to the module image (cubin) holding it, or None.

    The validator's address strategy (vaspace.py) is the first of ``strategies`` at first. When
    the validator answers that its driver would not give a launch's addresses although nothing of
    the validator's sat there, the next strategy's validator replaces it and the same launch is
    sent again, until one gets the addresses; that one is kept for the rest of the run (when
    every strategy lost the same launch, the first is kept), and a later launch it loses so is
    tried by the others that may get it (``_elsewhere``). Each
    validation record names the strategy that answered (``addresses``) and those that failed
    it first (``address_fallback``); ``addresses()`` sums it up for the run."""

    def __init__(self, samples: int = 3, max_bytes: int = 8 << 30,
                 image_for: Callable[[str, tuple | None], bytes | None] = None,
                 timeout_s: float = TIMEOUT_S, copier: Any = None, command: list[str] | None = None,
                 env: dict[str, str] | None = None, strategies: list[str] | None = None,
                 zygote_ok: bool = True, relocate: bool = True, extents: bool = True) -> None:
        super().__init__(samples, max_bytes, extents=extents)
        self.image_for = image_for or (lambda name, sizes: None)
        self.copier = copier or DriverCopier()
        self.dir = private_dir()
        self.staging = Staging(self.dir, self.copier.register, self.copier.unregister)
        self.images: dict[bytes, str] = {}  # image -> content hash written
        self._command, self._env, self.timeout_s = command, env, timeout_s
        self.link: Link | None = None
        self.switched_off: str | None = None  #: set once; the tracer turns it into an error record
        self._windows: tuple[int, dict[str, list[list[int]]]] = (-1, {})  #: (allocation count, claims)
        #: the validators' zygote (zygote.py), forked in the program's first cuInit (after this
        #: object): from the first validator on, its validators come first, as strategy ``zygote``
        self.zygote: zygote.Zygote | None = None
        self._zygote_ok = zygote_ok and strategies is None
        self.strategies = list(strategies or vaspace.STRATEGIES)
        self.strategy = 0  #: the index of the address strategy of the validators started now
        self.kept = False  #: a validator of this strategy got a launch's addresses: no more fallback
        self.lost: dict[str, int] = {}  #: launches each strategy could not get the addresses of
        self.had: set[str] = set()  #: strategies whose validator got a launch's addresses in this run
        self.retried = 0  #: launches the kept strategy lost that the others tried
        self._var_sizes: dict[tuple[int, str], int | None] = {}  #: variables' sizes asked of the driver
        #: a launch no strategy got the addresses of is replayed with its spans moved (replay.Moves)
        self.relocate = relocate
        self.moved = 0  #: launches answered so

    def _link(self) -> Link:
        if self.link is None:
            forked = zygote.current() if self._zygote_ok and self.strategy == 0 else None
            if forked is not None and ZYGOTE not in self.strategies:
                self.zygote = forked
                self.strategies.insert(0, ZYGOTE)
            if self._command is None:
                self._command, env = validator_command(self.dir, self.copier.bus_id())
                self._env = self._env or env
            self.link = Link(self._with_strategy(), self._env or dict(os.environ), self.timeout_s,
                             stderr=self.dir / "validator.log", before_start=self._write_claims,
                             spawn=self._spawn())
        return self.link

    def _with_strategy(self) -> list[str]:
        name = self.strategies[self.strategy]
        # the zygote's validator has the program's layout: it holds nothing, it asks as it goes
        return [*self._command, "--strategy", "bare" if name == ZYGOTE else name]

    def _spawn(self) -> Callable[[list[str], Path | None], Any] | None:
        if self.strategies[self.strategy] == ZYGOTE and self.zygote is not None:
            return self.zygote.spawn
        return None

    def addresses(self) -> dict[str, Any]:
        """The run's address strategy so far: the one in use, whether it was kept (it got a
        launch's addresses), and how many launches each strategy lost."""
        out = {"strategy": self.strategies[self.strategy], "kept": self.kept, "lost": dict(self.lost)}
        if self.retried:
            out["retried"] = self.retried
        if self.moved:
            out["moved"] = self.moved
        if self.zygote is not None:  # what the zygote's layout held when it was forked
            out["zygote"] = {"frameworks": self.zygote.frameworks}
        elif zygote.why_not():
            out["zygote"] = {"error": zygote.why_not()}
        areas = self.link.hello.get("areas") if self.link is not None else None
        if areas:  # under ``whole``: the program's driver areas the validator held whole, or not
            out["areas"] = areas
        return out

    def live(self) -> list[tuple[int, int]]:
        """[start, end) of every live allocation the program made, by address."""
        allocs = self.pred.allocs
        return [(allocs._live[s].addr, allocs._live[s].end) for s in allocs._starts]

    def claims(self) -> dict[str, list[list[int]]]:
        """The address windows the validator must keep free for this program and the program's
        driver areas around its allocations (vaspace.py), worked out again only when an
        allocation was made since."""
        if self._windows[0] != self.next_id:
            try:
                maps = vaspace.mappings()
            except OSError:
                maps = []
            allocs = [(s, e - s) for s, e in self.live()]
            self._windows = (self.next_id, {"windows": vaspace.program_windows(allocs, maps),
                                            "areas": vaspace.driver_areas(allocs, maps)})
        return self._windows[1]

    def windows(self) -> list[list[int]]:
        return self.claims()["windows"]

    def _write_claims(self) -> None:
        """Before a validator starts: the windows it holds before it loads the driver."""
        tmp = self.dir / f"{CLAIMS}.tmp"
        tmp.write_text(json.dumps(self.claims()))
        tmp.replace(self.dir / CLAIMS)

    def wants(self, func: int) -> bool:
        if self.link is not None and self.link.off is not None:
            return False
        sampled = super().wants(func)  # (counts the launch either way)
        # one launch at a time in the validator: a launch of another thread while one is out is
        # not sampled (its verdict could be read in place of the other's)
        return sampled and not any("seq" in s for s in self.pending.values())

    def _image_key(self, image: bytes) -> str:
        key = self.images.get(image)
        if key is None:
            key = hashlib.sha256(image).hexdigest()
            tmp = self.dir / f"{key}.tmp"
            tmp.write_bytes(image)
            tmp.replace(self.dir / f"{key}.image")
            self.images[image] = key
        return key

    def enter(self, tid: int, api: str, raw: tuple, func: int, kernel: str, sizes: tuple | None,
              args: bytes | None, geometry: tuple | None = None) -> None:
        """Copy the launch's predicted inputs out and hand them to the validator."""
        t0 = time.perf_counter()
        acc, _info, found = self.pred.launch(launch_record(kernel, sizes, args, func))
        state: dict[str, Any] = {"kernel": kernel, "t0": t0, "reads": self._absolute(acc["reads"]),
                                 "writes": self._absolute(acc["writes"]), "unknown": acc["unknown"]}
        why = self._refusal(state, sizes, args, geometry)
        image = self.image_for(kernel, sizes) if why is None else None
        if why is None and image is None:
            why = "unvalidated: no module image seen holds the kernel"
        regions = regions_of(state["reads"], state["writes"], self.live())
        total = sum(n for _, n, _ in regions)
        variables = self._variables(func) if why is None else []
        if why is None and not regions:
            why = ("unvalidated: the prediction names no device memory" if not state["reads"] + state["writes"]
                   else "unvalidated: the prediction names no byte inside a live allocation")
        if why is None and total > self.max_bytes:
            why = f"unvalidated: the prediction names {total} B, more than the validation limit {self.max_bytes} B"
        if why is not None:
            self.pending[tid] = {"skip": self._skipped(state, [why])}
            return
        self.validated += 1
        try:
            self.staging.ensure(total + sum(n for _, _, n in variables))
            staged, copies, off = [], [], 0
            for addr, n, mode in regions:
                staged.append([addr, n, off, mode])
                copies.append((self.staging.addr + off, addr, n))
                off += n
            staged_vars = []
            for name, addr, n in variables:  # the module's variables, as they are at the launch
                staged_vars.append([name, off, n])
                copies.append((self.staging.addr + off, addr, n))
                off += n
            self.copier.copy(geometry[4], copies)
        except (CudaFailure, OSError) as exc:
            self.pending[tid] = {"skip": self._skipped(state, [f"unvalidated: copying the inputs out failed: {exc}"])}
            return
        (gx, gy, gz), (bx, by, bz), shared = geometry[0], geometry[1], geometry[2]
        req = {"seq": self.validated, "kernel": kernel, "function": kernel, "image": self._image_key(image),
               "params": (args or b"").hex(), "sizes": list(sizes or ()), "grid": [gx, gy, gz],
               "block": [bx, by, bz], "shared": shared, "staging": self.staging.path.name,
               "regions": staged, "reads": state["reads"], "writes": state["writes"]}
        if staged_vars:
            req["variables"] = staged_vars
        if self.extents:  # the pointers whose read extents the validator measures
            req["extents"] = [list(t) for t in extent_targets(found)]
        if len(geometry) > 5 and geometry[5]:  # launch attributes the replay sets (a cluster's shape)
            req["attributes"] = geometry[5]
        try:
            self._link()
            claims = self.claims()
            req["claims"], req["areas"] = claims["windows"], claims["areas"]
            sent = self._send(req, state.setdefault("fallback", []))
        except CudaFailure as exc:  # the program's device could not be named
            sent = f"the validator could not start: {exc}"
        if isinstance(sent, str):
            self._note_off()
            skip = self._skipped(state, [f"unvalidated: {sent}"])
            if state.get("fallback"):
                skip["address_fallback"] = state["fallback"]
            self.pending[tid] = {"skip": skip}
            return
        state["seq"] = req["seq"]
        state["req"] = req
        self.pending[tid] = state

    def _variables(self, func: int) -> list[tuple[str, int, int]]:
        """(name, address, size) of the located variables of ``func``'s module: the validator's
        copy of the module starts with its initial values, the program's may hold what the
        program stored there since (a pointer to a table, a flag)."""
        out = []
        for var in self.pred.variables.of_function(func):
            size = var.size
            if size is None:
                key = (var.parent, var.name)
                if key not in self._var_sizes:
                    try:
                        self._var_sizes[key] = self.copier.variable_size(var.api, var.parent, var.name)
                    except Exception:  # noqa: BLE001 - the driver no longer knows the handle: not staged
                        self._var_sizes[key] = None
                size = self._var_sizes[key]
            if size:
                out.append((var.name, var.addr, size))
        return out

    def _next_strategy(self, to: int | None = None) -> None:
        self.strategy = self.strategy + 1 if to is None else to
        self.link.kill()
        self.link.command = self._with_strategy()
        self.link.spawn = self._spawn()

    def _send(self, req: dict[str, Any], fallback: list[dict[str, str]] | None = None) -> dict[str, Any] | str:
        """Send a request, starting a validator if none runs; one that could not start under its
        strategy (its driver would not initialise with the address space so arranged) gives way
        to the next strategy's, unless a strategy was kept already."""
        link = self.link
        sent = link.request(req)
        while (isinstance(sent, str) and link.refused and link.off is None
               and (not self.kept or self._zygote_gone()) and self.strategy + 1 < len(self.strategies)):
            if fallback is not None:
                fallback.append({"strategy": self.strategies[self.strategy], "why": f"unvalidated: {sent}"})
            self.kept = False  # (a zygote that is gone starts no more validators, kept or not)
            self._next_strategy()
            sent = link.request(req)
        return sent

    def _zygote_gone(self) -> bool:
        return (self.strategies[self.strategy] == ZYGOTE and self.zygote is not None and self.zygote.closed)

    def _refusal(self, state: dict[str, Any], sizes, args, geometry) -> str | None:
        if state["unknown"]:
            return "unvalidated: unknown launch (the validator maps only what the prediction names)"
        if sizes is None or args is None:
            return "unvalidated: the parameter layout is unknown"
        if geometry is None:
            return "unvalidated: the launch's geometry is unknown"
        if geometry[3]:
            return f"unvalidated: {geometry[3]}"
        return None

    def exit(self, tid: int, result: int) -> dict[str, Any] | None:
        """Wait for the verdict (bounded) and return the validation record's body."""
        state = self.pending.pop(tid, None)
        if state is None:
            return None
        if "skip" in state:
            return state["skip"]
        fallback: list[dict[str, str]] = state.get("fallback", [])
        while True:
            rep = self.link.answer()
            if isinstance(rep, str):
                self._note_off()
                return self._skipped(state, [f"unvalidated: {rep}"])
            if rep.pop("seq", None) != state["seq"]:
                self.link.kill()
                return self._skipped(state, ["unvalidated: the validator answered another launch: restarted"])
            name = self.strategies[self.strategy]
            rep["addresses"] = name
            if fallback:
                rep["address_fallback"] = fallback
            if not str(rep.get("why", "")).startswith(ADDRESS_UNAVAILABLE):
                if rep.get("checked") or "fault" in rep:  # it got the addresses: keep it
                    self.kept = True
                    self.had.add(name)
                break
            self.lost[name] = self.lost.get(name, 0) + 1
            if rep.get("refused_by") != "driver":
                break
            if self.kept:
                rep = self._elsewhere(state, rep, fallback)
                break
            if self.strategy + 1 >= len(self.strategies):
                if fallback and self.strategy:
                    # every strategy lost this launch: the first (the one that gets most where
                    # any does) answers the next launches, with no more fallback
                    self._next_strategy(0)
                    self.kept = True
                break
            # the driver would not give addresses that were free: the next strategy, same launch
            why = rep["why"]
            if name == ZYGOTE and self.zygote is not None:
                why += f" (the zygote was forked with {', '.join(self.zygote.frameworks) or 'no framework'} loaded)"
            fallback.append({"strategy": name, "why": why})
            self._next_strategy()
            sent = self._send(state["req"], fallback)
            if isinstance(sent, str):
                self._note_off()
                return dict(self._skipped(state, [f"unvalidated: {sent}"]), address_fallback=fallback)
        if self.relocate and str(rep.get("why", "")).startswith(ADDRESS_UNAVAILABLE) and self.link.off is None:
            rep = self._moved(state, rep)
        if result:
            return {"kernel": state["kernel"], "checked": False, "mode": "validator",
                    "why": f"the launch failed (CUresult {result})"}
        rep["ms"] = round((time.perf_counter() - state["t0"]) * 1000, 3)
        return rep

    def _moved(self, state: dict[str, Any], rep: dict[str, Any]) -> dict[str, Any]:
        """No strategy got the launch's addresses: the validator now answering replays it with the
        spans it could not have moved elsewhere and the pointers to them moved (replay.Moves); the
        record's ``relocated`` says what moved, ``address_fallback`` why. Its verdict stands
        unless that fails too."""
        req = dict(state["req"], relocate=True, live=[[s, e - s] for s, e in self.live()])
        link = self.link
        sent = link.request(req)
        got = sent if isinstance(sent, str) else link.answer()
        if isinstance(got, str):
            self._note_off()
            return rep
        if got.pop("seq", None) != state["seq"]:
            link.kill()
            return rep
        if not (got.get("checked") or "fault" in got):
            return rep
        got["addresses"] = self.strategies[self.strategy]
        got["address_fallback"] = rep.get("address_fallback", []) + [
            {"strategy": rep.get("addresses", got["addresses"]), "why": rep["why"]}]
        self.moved += 1
        return got

    def _elsewhere(self, state: dict[str, Any], rep: dict[str, Any], fallback: list[dict[str, str]]) -> dict[str, Any]:
        """The kept strategy's driver would not give this launch's addresses (each strategy
        loses some: the zygote's the area of the program's first allocations, ``whole`` the
        parts its own context took): the zygote's validator while the zygote is there, the
        strategy after the zygote's when that is the one kept, and those that got a launch's
        addresses in this run try this launch in turn, at most ``RETRIES`` launches a run (none
        when no strategy but the kept one ever got addresses: every one lost the first launch).
        The first that gets the addresses answers; else the kept one's verdict stands. The kept
        strategy's validator answers the next launch."""
        kept = self.strategy
        zygote_kept = self.strategies[kept] == ZYGOTE
        others = [i for i, s in enumerate(self.strategies) if i != kept and (
            s in self.had or (s == ZYGOTE and self.zygote is not None and not self.zygote.closed)
            or (zygote_kept and i == kept + 1))]
        if not others or self.retried >= RETRIES:
            return rep
        self.retried += 1
        link = self.link
        failures = link.failures
        tries: list[dict[str, str]] = [{"strategy": self.strategies[kept], "why": rep["why"]}]
        answer = rep
        for i in others:
            name = self.strategies[i]
            self._next_strategy(i)
            sent = link.request(state["req"])
            got = sent if isinstance(sent, str) else link.answer()
            if isinstance(got, str):
                tries.append({"strategy": name, "why": f"unvalidated: {got}"})
                if link.off is not None:
                    break
                continue
            if got.pop("seq", None) != state["seq"]:
                link.kill()
                tries.append({"strategy": name, "why": "unvalidated: the validator answered another launch"})
                continue
            if str(got.get("why", "")).startswith(ADDRESS_UNAVAILABLE):
                self.lost[name] = self.lost.get(name, 0) + 1
                tries.append({"strategy": name, "why": got["why"]})
                continue
            got["addresses"] = name
            if got.get("checked") or "fault" in got:
                self.had.add(name)
            answer = got
            break
        if link.off is None:
            link.failures = failures  # a try under another strategy is no failure of the kept one's
        self._next_strategy(kept)
        out = fallback + (tries if answer is not rep else tries[1:])
        if out:
            answer["address_fallback"] = out
        return answer

    def _note_off(self) -> None:
        if self.link is not None and self.link.off is not None and self.switched_off is None:
            self.switched_off = self.link.off

    @staticmethod
    def _skipped(state: dict[str, Any], why: list[str]) -> dict[str, Any]:
        return dict(Validator._skipped(state, why), mode="validator")

    def close(self) -> None:
        """End the validator (its input closes) and remove the private directory."""
        if self.link is not None:
            proc = self.link.proc
            if proc is not None and proc.stdin is not None:
                try:
                    proc.stdin.close()
                    proc.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self.link.kill()
        if self.zygote is not None:
            self.zygote.close()  # it ends with its socket
        self.staging.close()
        shutil.rmtree(self.dir, ignore_errors=True)
