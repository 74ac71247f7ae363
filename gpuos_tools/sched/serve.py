"""`gpu-prefetch-sched serve`: several jobs on one GPU, time-sliced, their owned memory together
within one budget.

Each job runs as `gpu-prefetch-sched run` with ``serve`` in its config: its executor connects to
the ``Coordinator`` here over a Unix socket (one JSON object a line each way: ``hello``, ``wait``,
``need`` from the job; ``grant``, ``yield``, ``trim``, ``budget`` from the coordinator), and its
program's threads take the GPU turn at their launches, copies and memsets (``Executor.gate``,
called by the tracer before the agent's lock). Every load of every job is booked first in the
shared byte ledger (gpuos_tools/sched/ledger.py).

The protocol, the coordinator's rules, the budget invariant (mapped[j] <= held[j] and
sum(held) <= budget at every instant, allocations aside), the serial and overlapped switches and
how the combined peak is measured are written down in docs/scheduler.md ("Several programs on
one GPU"); tests/test_sched_serve.py holds the invariant under stress.
"""

from __future__ import annotations

import json
import os
import queue
import select
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from gpuos_tools.sched.ledger import Ledger

MAX_LINE = 1 << 20

#: how serve_jobs starts a job: (its serve config, argv, stdout, stderr) -> the process
StartJob = Callable[[dict[str, Any], list[str], IO[bytes], IO[bytes]], "subprocess.Popen[bytes]"]


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall((json.dumps(msg, separators=(",", ":")) + "\n").encode())


class Lines:
    """Messages out of a byte stream of JSON lines."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self.buf += data
        out = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if line.strip():
                msg = json.loads(line)
                if isinstance(msg, dict):
                    out.append(msg)
        if len(self.buf) > MAX_LINE:
            raise ValueError("a line longer than 1 MiB")
        return out


# -- the coordinator (the serve command's process) ----------------------------------------------


@dataclass
class Job:
    index: int
    name: str
    conn: socket.socket | None = None
    lines: Lines = field(default_factory=Lines)
    pid: int | None = None
    state: str = "starting"  #: starting, running (on its own, before its first wait), waiting, holding, gone
    mapped: int = 0
    want: int = 0
    trimming: bool = False
    trim_keep: int = 0  #: what it was asked to keep, while trimming
    stuck_at: int = -1  #: mapped bytes it could not go below when asked (evictions refused)
    yield_sent: bool = False
    budget: int = 0  #: the last budget it was given
    granted_at: float = 0.0
    wait_since: float | None = None
    counts: dict[str, Any] = field(default_factory=lambda: {
        "grants": 0, "turn_s": 0.0, "turn_waits": 0, "turn_wait_s": 0.0, "yields": 0, "trims": 0,
        "budget_updates": 0, "early_grants": 0, "needs": 0, "budget_min": None, "budget_max": None, "left_holding": False,
        "peak": 0})
    releasing: int = 0  #: its evictions issued, not released yet, as it last said (figures only)


class Coordinator:
    """The turn and the budget among the jobs (module docstring). ``step`` serves the socket
    for a while; the caller says when a job's process has exited (``leave``)."""

    def __init__(self, path: str, total: int, slice_s: float, names: list[str], ledger: Any = None) -> None:
        if total <= 0:
            raise ValueError("the budget must be more than 0 bytes")
        self.path = path
        self.ledger = ledger  #: the jobs' byte ledger (gpuos_tools/sched/ledger.py), or None
        self.total = total
        self.slice_s = slice_s
        self.jobs = [Job(i, n) for i, n in enumerate(names)]
        self.queue: deque[int] = deque()  #: waiting jobs, in the order they asked
        self.holder: int | None = None
        self.switches = 0  #: grants to a job other than the last holder
        self._last: int | None = None
        self.errors: list[str] = []
        self.log: list[tuple[float, int, str, int]] = []  #: (t, job, what, bytes), bounded
        self.t0 = time.perf_counter()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(len(names) + 8)
        self._pending: list[socket.socket] = []  #: connected, no hello yet

    # -- bookkeeping ---------------------------------------------------------------------------

    def _note(self, job: int, what: str, value: int = 0) -> None:
        if len(self.log) < 100_000:
            self.log.append((round(time.perf_counter() - self.t0, 6), job, what, value))

    def _live(self) -> list[Job]:
        return [j for j in self.jobs if j.state != "gone"]

    def others(self, i: int) -> int:
        """What the jobs other than ``i`` hold mapped, as they last said."""
        return sum(j.mapped for j in self._live() if j.index != i)

    @property
    def done(self) -> bool:
        return all(j.state == "gone" for j in self.jobs)

    def _send(self, j: Job, msg: dict[str, Any]) -> None:
        if j.conn is None:
            return
        try:
            send(j.conn, msg)
        except OSError as exc:
            self.leave(j.index, f"send: {exc}")

    # -- the loop ------------------------------------------------------------------------------

    def step(self, timeout: float = 0.05) -> None:
        """Serve messages for up to ``timeout`` seconds (less when a slice ends sooner)."""
        conns = {j.conn: j for j in self.jobs if j.conn is not None}
        rlist: list[Any] = [self.listener, *self._pending, *conns]
        h = self.jobs[self.holder] if self.holder is not None else None
        if h is not None and self.queue and not h.yield_sent:
            timeout = min(timeout, max(0.0, h.granted_at + self.slice_s - time.perf_counter()))
        try:
            ready, _, _ = select.select(rlist, [], [], timeout)
        except (OSError, ValueError):  # a socket closed under us: the next step sees it gone
            ready = []
        for s in ready:
            if s is self.listener:
                try:
                    conn, _ = self.listener.accept()
                except OSError:
                    continue
                self._pending.append(conn)
            elif s in conns:
                self._read(conns[s])
            else:
                self._hello(s)
        self._schedule()

    def _recv(self, s: socket.socket) -> bytes:
        try:
            return s.recv(65536)
        except OSError:
            return b""

    def _hello(self, s: socket.socket) -> None:
        data = self._recv(s)
        self._pending.remove(s)
        try:
            lines = Lines()
            msgs = lines.feed(data)
            first = msgs[0]
            j = self.jobs[int(first["job"])]
            if first.get("op") != "hello" or j.conn is not None or j.state == "gone":
                raise ValueError(f"unexpected {first}")
        except (ValueError, IndexError, KeyError, TypeError) as exc:
            self.errors.append(f"a connection without a valid hello: {exc}")
            s.close()
            return
        j.conn, j.lines, j.pid, j.state = s, lines, first.get("pid"), "running"
        self._note(j.index, "hello")
        for msg in msgs[1:]:
            self._message(j, msg)

    def _read(self, j: Job) -> None:
        data = self._recv(j.conn) if j.conn is not None else b""
        if not data:
            self.leave(j.index, "connection closed")
            return
        try:
            msgs = j.lines.feed(data)
        except ValueError as exc:
            self.leave(j.index, f"bad message: {exc}")
            return
        for msg in msgs:
            self._message(j, msg)

    def _message(self, j: Job, msg: dict[str, Any]) -> None:
        if j.state == "gone":
            return
        op = msg.get("op")
        if op == "need":  # the holder's load does not fit: trim the waiting jobs for its want
            j.want = max(j.want, int(msg.get("want", 0)))
            j.counts["needs"] += 1
            self._note(j.index, "need", j.want)
            if j.state == "holding":
                self._rebalance(j)
            return
        if op != "wait":
            self.errors.append(f"job {j.index}: unknown message {msg}")
            return
        now = time.perf_counter()
        j.mapped = int(msg.get("mapped", 0))
        j.releasing = max(0, int(msg.get("releasing", 0)))
        j.want = max(int(msg.get("want", 0)), j.mapped)
        j.counts["peak"] = max(j.counts["peak"], int(msg.get("peak", 0)))
        self._note(j.index, "wait", j.mapped)
        if j.trimming:
            j.trimming = False
            if j.mapped > j.trim_keep:
                j.stuck_at = j.mapped  # not trimmed again below this until it runs
            return  # a trimmed job waits on, in its place
        if j.state == "holding":
            if j.yield_sent and j.mapped > j.trim_keep:
                j.stuck_at = j.mapped
            j.counts["turn_s"] += now - j.granted_at
            if j.yield_sent:
                j.counts["yields"] += 1
            self.holder = None
        j.state, j.yield_sent, j.wait_since = "waiting", False, now
        if j.index not in self.queue:
            self.queue.append(j.index)

    def leave(self, i: int, why: str = "") -> None:
        """Job ``i`` is gone (its connection closed, or its process exited)."""
        j = self.jobs[i]
        if j.state == "gone":
            return
        if j.state == "holding":
            j.counts["turn_s"] += time.perf_counter() - j.granted_at
            j.counts["left_holding"] = True
            self.holder = None
        j.state, j.mapped, j.trimming = "gone", 0, False
        if self.ledger is not None:  # its bytes stay booked (and awaited) until its process is reaped
            self.ledger.set_exiting(i)
        if i in self.queue:
            self.queue.remove(i)
        if j.conn is not None:
            try:
                j.conn.close()
            except OSError:
                pass
            j.conn = None
        self._note(i, "leave")

    # -- the rules -----------------------------------------------------------------------------

    def _need(self, j: Job) -> int:
        return min(max(j.want, 1), self.total)

    def _schedule(self) -> None:
        now = time.perf_counter()
        if self.holder is None:
            if not self.queue:
                return
            nxt = self.jobs[self.queue[0]]
            self._rebalance(nxt)
            if any(self.jobs[w].trimming for w in self.queue):
                return  # granted once the room is made
            self.queue.popleft()
            self._grant(nxt, now)
            return
        h = self.jobs[self.holder]
        if self.queue and not h.yield_sent and now - h.granted_at >= self.slice_s:
            nxt = self.jobs[self.queue[0]]
            rest = sum(self.jobs[w].mapped for w in self.queue if w != nxt.index)
            idle = sum(j.mapped for j in self._live() if j.state == "running")
            keep = max(0, self.total - self._need(nxt) - rest - idle)
            h.yield_sent, h.trim_keep = True, keep
            self._note(h.index, "yield", keep)
            self._send(h, {"op": "yield", "keep": keep})
            return
        if not h.yield_sent:
            self._rebalance(h)
            b = self.total - self.others(h.index)
            if b != h.budget:
                h.budget = b
                h.counts["budget_updates"] += 1
                self._span(h, b)
                self._send(h, {"op": "budget", "budget": b, "others": self.total - b})

    def _rebalance(self, target: Job) -> None:
        """Trim waiting jobs (the last in the queue first) until those that do not run hold at
        most total - need(target)."""
        waiting = [self.jobs[w] for w in self.queue if w != target.index]
        held = [j.trim_keep if j.trimming else j.mapped for j in self._live() if j.index != target.index]
        excess = sum(held) + self._need(target) - self.total
        for j in reversed(waiting):
            if excess <= 0:
                break
            if j.trimming or j.mapped <= 0 or j.mapped <= j.stuck_at:
                continue
            keep = max(0, j.mapped - excess)
            excess -= j.mapped - keep
            j.trimming, j.trim_keep = True, keep
            j.counts["trims"] += 1
            self._note(j.index, "trim", keep)
            self._send(j, {"op": "trim", "keep": keep})

    def _span(self, j: Job, b: int) -> None:
        c = j.counts
        c["budget_min"] = b if c["budget_min"] is None else min(c["budget_min"], b)
        c["budget_max"] = b if c["budget_max"] is None else max(c["budget_max"], b)

    def _grant(self, j: Job, now: float) -> None:
        b = self.total - self.others(j.index)
        j.state, j.budget, j.granted_at, j.yield_sent, j.stuck_at = "holding", b, now, False, -1
        if j.wait_since is not None:
            j.counts["turn_waits"] += 1
            j.counts["turn_wait_s"] += now - j.wait_since
            j.wait_since = None
        j.counts["grants"] += 1
        if self.ledger is not None and self.ledger.inflight_of_others(j.index) > 0:
            j.counts["early_grants"] += 1  # other jobs' releases still in flight (overlapped switch)
        self._span(j, b)
        if self._last is not None and self._last != j.index:
            self.switches += 1
        self._last = self.holder = j.index
        self._note(j.index, "grant", b)
        self._send(j, {"op": "grant", "budget": b, "others": self.total - b})

    def close(self) -> None:
        for j in self.jobs:
            if j.conn is not None:
                j.conn.close()
                j.conn = None
        for s in self._pending:
            s.close()
        self.listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def job_stats(self, i: int) -> dict[str, Any]:
        c = dict(self.jobs[i].counts)
        c["turn_s"] = round(c["turn_s"], 6)
        c["turn_wait_s"] = round(c["turn_wait_s"], 6)
        return c


# -- the job side (inside the program, for the executor) ------------------------------------------


class CoordinatorClient:
    """The job's end of the protocol. A reader thread takes the coordinator's messages: a yield
    request and budget updates are left in ``ask`` and ``update`` for the program's next
    operation to find (a look at two attributes, the only cost per operation); grants and trims
    go to ``inbox``, where the program's thread waits for them. ``inbox`` gets ``{"op": "gone"}``
    when the coordinator is gone."""

    def __init__(self, path: str, job: int, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.sock.settimeout(None)
        self.job = job
        self.inbox: queue.Queue[dict[str, Any]] = queue.Queue()
        self.ask: dict[str, Any] | None = None
        self.update: dict[str, Any] | None = None
        self.gone = False
        self._send_lock = threading.Lock()
        self.send({"op": "hello", "job": job, "pid": os.getpid()})
        self._reader = threading.Thread(target=self._read, name="gpuos-serve-reader", daemon=True)
        self._reader.start()

    def send(self, msg: dict[str, Any]) -> None:
        with self._send_lock:
            send(self.sock, msg)

    def _read(self) -> None:
        lines = Lines()
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                for msg in lines.feed(data):
                    op = msg.get("op")
                    if op == "yield":
                        self.ask = msg
                    elif op == "budget":
                        self.update = msg
                    else:
                        self.inbox.put(msg)
        except (OSError, ValueError):
            pass
        self.gone = True
        self.inbox.put({"op": "gone"})

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# -- the serve command's driver ---------------------------------------------------------------


def job_output(text: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the run's sched_summary, the job's own last JSON object line) in a job's stdout."""
    summary = own = None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("type") == "sched_summary":
            summary = rec
        elif rec.get("type") != "header":
            own = rec
    return summary, own


def throughput(own: dict[str, Any] | None) -> tuple[float | None, str | None]:
    """The job's own throughput where it prints one: a ``throughput`` field (its ``unit`` if
    given), else ``steps`` / ``loop_s`` (steps per second)."""
    if not own:
        return None, None
    v = own.get("throughput")
    if isinstance(v, (int, float)):
        return float(v), str(own.get("unit", ""))
    steps, secs = own.get("steps"), own.get("loop_s")
    if isinstance(steps, (int, float)) and isinstance(secs, (int, float)) and secs > 0:
        return steps / secs, "steps/s"
    return None, None


def serve_jobs(jobs: list[list[str]], total: int, slice_s: float, policy: str, lookahead: int,
               workdir: str, start_job: StartJob, on_start: Any = None,
               overlap: bool = False) -> dict[str, Any]:
    """Start every job under the coordinator, serve them until all have ended, and return the
    result (per job: exit status, times, turns, bytes moved, throughput; the ledger's combined
    peaks). ``workdir`` holds the socket, the ledger and each job's stdout and stderr.
    ``start_job(serve, argv, stdout, stderr)`` starts one job, a program run as `gpu-prefetch-sched
    run` does with ``serve`` ({"socket", "job", "overlap", "ledger"}) as its executor's config's
    ``serve``, writing its ``sched_summary`` record to ``stdout``: the command hands it in (it
    knows how a program is launched; this layer does not). ``overlap``: the overlapped switch
    (experimental: it failed the GPU test once in three runs on an H200, see BENCHMARKS.md); the
    default is the serial one (saves complete, then the grant)."""
    path = os.path.join(workdir, "serve.sock")
    names = [" ".join(argv) for argv in jobs]
    ledger_path = os.path.join(workdir, "serve.ledger")
    ledger = Ledger(ledger_path, None, total=total, jobs=len(jobs))
    coord = Coordinator(path, total, slice_s, names, ledger)
    procs: list[subprocess.Popen[bytes]] = []
    outs, t_start, t_end = [], [], [0.0] * len(jobs)
    t0 = time.perf_counter()
    try:
        for i, argv in enumerate(jobs):
            out = open(os.path.join(workdir, f"job{i}.out"), "wb")
            err = open(os.path.join(workdir, f"job{i}.err"), "wb")
            outs.append((out, err))
            t_start.append(time.perf_counter())
            serve = {"socket": path, "job": i, "overlap": overlap, "ledger": ledger_path}
            procs.append(start_job(serve, argv, out, err))
            if on_start is not None:
                on_start(i, procs[-1])
        codes: list[int | None] = [None] * len(jobs)
        while not coord.done or any(c is None for c in codes):
            coord.step(0.02)
            for i, p in enumerate(procs):
                if codes[i] is None and p.poll() is not None:
                    codes[i] = p.returncode
                    t_end[i] = time.perf_counter()
                    coord.leave(i, f"exited {p.returncode}")
                    ledger.zero(i)  # reaped: its memory is gone
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for out, err in outs:
            out.close()
            err.close()
        coord.close()
    wall = time.perf_counter() - t0
    led = ledger.snapshot()
    ledger.close()
    rows = []
    for i, argv in enumerate(jobs):
        with open(os.path.join(workdir, f"job{i}.out"), errors="replace") as f:
            text = f.read()
        with open(os.path.join(workdir, f"job{i}.err"), errors="replace") as f:
            err_text = f.read()
        summary, own = job_output(text)
        tput, unit = throughput(own)
        s = summary or {}
        turns = s.get("serve") or {}
        c = coord.job_stats(i)
        rows.append({
            "job": i, "argv": argv, "exit": codes[i], "ok": codes[i] == 0 and summary is not None,
            "wall_s": round(t_end[i] - t_start[i], 6), "turn_s": c["turn_s"], "grants": c["grants"],
            "turn_waits": c["turn_waits"], "turn_wait_s": c["turn_wait_s"], "switches": c["yields"],
            "trims": c["trims"], "early_grants": c["early_grants"],
            "budget_min": c["budget_min"], "budget_max": c["budget_max"],
            "bytes_in": s.get("bytes_in"), "bytes_out": s.get("bytes_out"), "evictions": s.get("evictions"),
            "prefetches": s.get("prefetches"), "demand_loads": s.get("demand_loads"),
            "footprint": s.get("footprint"), "peak_settled": s.get("peak_settled"),
            "over_physical": s.get("over_physical"), "turn_peak": turns.get("turn_peak_max"),
            "ledger_waits": turns.get("ledger_waits"), "forced_loads": turns.get("forced_loads"),
            "evict_errors": (s.get("engine") or {}).get("evict_errors", 0),
            "evict_error": (s.get("engine") or {}).get("evict_error"),
            "throughput": tput, "throughput_unit": unit, "left_holding": c["left_holding"],
            "output": own,
            "summary": summary, "stderr_tail": err_text[-3000:] if codes[i] != 0 or summary is None else "",
        })
    return {"type": "serve_summary", "budget": total, "slice_s": slice_s, "policy": policy, "lookahead": lookahead,
            "switch": "overlap" if overlap else "serial", "jobs": rows, "switches": coord.switches,
            "early_grants": sum(j.counts["early_grants"] for j in coord.jobs), "wall_s": round(wall, 6),
            "combined_peak": led["peak"], "combined_peak_loads": led["peak_loads"],
            "forced_loads": led["forced_loads"], "forced_over_max": led["forced_over_max"],
            "unreserved_maps": led["unreserved_maps"], "alloc_charges": led["alloc_charges"],
            "errors": coord.errors[:20]}
