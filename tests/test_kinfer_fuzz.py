"""A seeded fuzzer for the kinfer daemon's side of the ring: random writes to every part of the
shared memory (header, control block, state words, entries, inputs, any byte) and truncations,
between and during real requests, on the Python loop and on the native loop.

What must hold: no exception and no signal in the daemon, every state word back in a known state
after housekeeping, the header valid, the file its full length, and a well-formed request
afterwards answered with the model's outputs. A failing case is minimised (mutations dropped
while it still fails) and printed as JSON: add it to data/fuzz/kinfer-ring.json, whose cases
(the ones the hardening review reported among them) are replayed on every run.

Each run happens in a forked child, so that a crash is a test failure, not the end of the run.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from other_user import StrangerFailed, in_child

from gpuos_tools.kinfer import model as M
from gpuos_tools.kinfer import policy as P
from gpuos_tools.kinfer import ring as R
from gpuos_tools.kinfer import server as S

CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
FIXTURES = Path(__file__).resolve().parent / "data" / "fuzz" / "kinfer-ring.json"
GEOMETRY = R.Geometry(4, 4)
X = (np.arange(31) % 10).astype(np.float32)
PYTHON_CASES = 2500
NATIVE_CASES = 1000

_U32 = [0, 1, 2, 3, 4, 5, 7, 31, 32, 63, 64, 77, 4096, 0x7FFFFFFF, 0x80000000, 0x80000001, R.PID_LIMIT + 1, 0xFFFFFFFF]
_U64 = [0, 1, 1 << 31, 1 << 62, (1 << 63) + 5, (1 << 64) - 1]
_F32 = ["nan", "inf", "-inf", 0.0, -0.0, 1e-45, 3.4e38, -3.4e38, 9.0, 1e30]
_PATHS = ["@good", "@other", "@fifo", "@planted", "@link-out", "@dir", "/etc/passwd", "/dev/zero", "relative.npz", "",
          "@long", "@nonul"]
_META_FIELDS = list(R.META_DTYPE.names)
_HEADER_FIELDS = [n for n in R.HEADER_DTYPE.names if n != "control_path"]


# -- mutations: JSON-able, so that a minimised failure can be kept as a fixture ---------------------


def random_mutation(rng: random.Random, nslots: int, size: int) -> dict[str, Any]:
    roll = rng.random()
    slot = rng.randrange(nslots)
    if roll < 0.2:
        return {"request": slot}
    if roll < 0.35:
        return {"state": slot, "value": rng.choice(_U32 + [rng.getrandbits(32)])}
    if roll < 0.6:
        field = rng.choice(_META_FIELDS)
        wide = R.META_DTYPE.fields[field][0].itemsize == 8
        return {"meta": slot, "field": field, "value": rng.choice(_U64 if wide else _U32 + [os.getpid()])}
    if roll < 0.7:
        return {"input": slot, "index": rng.randrange(GEOMETRY.max_inputs), "value": rng.choice(_F32)}
    if roll < 0.8:
        field = rng.choice(_HEADER_FIELDS)
        kind = R.HEADER_DTYPE.fields[field][0]
        if kind.shape:  # counters
            return {"header": field, "index": rng.randrange(kind.shape[0]), "value": rng.choice(_U64)}
        return {"header": field, "value": rng.choice(_U64 if kind.itemsize == 8 else _U32)}
    if roll < 0.88:
        return {"control": rng.choice(_PATHS), "model_id": rng.choice([0, 0, 0, 1, 63, 64, 0xFFFFFFFF])}
    if roll < 0.97:
        return {"byte": rng.randrange(size), "value": rng.randrange(256)}
    return {"truncate": rng.choice([0, 100, 4096, 5000, size // 2, size - 1])}


class Paths:
    """The files a control request may name, by key."""

    def __init__(self, base: Path):
        self.models = base / "models"
        self.models.mkdir(mode=0o700)
        M.Mlp.random(seed=3).save(self.models / "good.npz")
        M.Mlp.random(seed=4).save(self.models / "other.npz")
        os.mkfifo(self.models / "fifo.npz")
        (self.models / "sub").mkdir()
        planted = base / "planted.npz"
        M.Mlp.random(seed=666).save(planted)
        (self.models / "link-out.npz").symlink_to(planted)
        self.table = {
            "@good": str(self.models / "good.npz"), "@other": str(self.models / "other.npz"),
            "@fifo": str(self.models / "fifo.npz"), "@planted": str(planted), "@link-out": str(self.models / "link-out.npz"),
            "@dir": str(self.models / "sub"), "@long": "/" + "a" * 254, "@nonul": None,
        }

    def raw(self, key: str) -> bytes:
        if key == "@nonul":
            return b"\xff" * 256  # fills the field: no NUL at all
        return os.fsencode(self.table.get(key, key))


def apply(ring: R.Ring, m: dict[str, Any], paths: Paths) -> None:
    """One mutation, written the way any process that can write the ring could."""
    if "request" in m:
        s = m["request"]
        ring.state[s] = R.WRITING
        e = ring.meta[s : s + 1]
        e["version"], e["model_id"], e["n_inputs"], e["seq"], e["producer_pid"] = R.ENTRY_VERSION, 0, 31, 7000 + s, os.getpid()
        ring.inputs[s, :31] = X
        ring.state[s] = R.READY
    elif "state" in m:
        ring.state[m["state"]] = m["value"]
    elif "meta" in m:
        ring.meta[m["field"]][m["meta"]] = _as(R.META_DTYPE.fields[m["field"]][0], m["value"])
    elif "input" in m:
        ring.inputs[m["input"], m["index"]] = float(m["value"])
    elif "header" in m:
        kind = R.HEADER_DTYPE.fields[m["header"]][0]
        if "index" in m:
            ring.header[m["header"]][m["index"]] = _as(kind.base, m["value"])
        else:
            ring.header[m["header"]] = _as(kind, m["value"])
    elif "control" in m:
        h = ring.header
        raw = paths.raw(m["control"])
        ring.mm[336 : 336 + 256] = raw[:256].ljust(256, b"\0")
        h["control_model_id"] = m["model_id"]
        h["control_seq"] = (int(h["control_seq"]) + 1) & 0xFFFFFFFF
    elif "byte" in m:
        ring.mm[m["byte"]] = m["value"]
    elif "truncate" in m:
        os.truncate(ring.path, m["truncate"])


def _as(dtype: np.dtype, value: int) -> Any:
    """``value``'s bits in a field of ``dtype`` (a signed field takes 2^31 as -2^31, as memory would)."""
    bits = dtype.itemsize * 8
    value %= 1 << bits
    if dtype.kind == "i" and value >= 1 << (bits - 1):
        value -= 1 << bits
    return value


# -- one run: a daemon on its ring, cases of mutations, the invariants ------------------------------------


def _check(srv: S.RingServer, where: str) -> None:
    ring = srv.ring
    assert (ring.state <= R.DONE).all(), f"{where}: a state word left unknown"
    assert ring.file_size() == ring.size, f"{where}: the file is {ring.file_size()} bytes, not {ring.size}"
    problem = R.check_header(bytes(ring.mm[: R.HEADER_SIZE]), ring.size)
    assert problem is None, f"{where}: header {problem}"


def _final_request(srv: S.RingServer, native: bool) -> None:
    """A well-formed request after everything: answered with the outputs of a model the daemon
    was allowed to load (the one it started with or one from its directory)."""
    ring = srv.ring
    allowed = [M.Mlp.random(seed=3).forward(X[None])[0], M.Mlp.random(seed=4).forward(X[None])[0]]
    if native:
        with R.RingClient(str(ring.path)) as c:
            a = c.infer(X, timeout=10)
            assert a.ok, f"final request: status {a.status}"
            out = a.outputs
    else:
        slot = ring.nslots - 1
        apply(ring, {"request": slot}, None)  # type: ignore[arg-type]
        srv.process_small([slot])
        assert ring.meta["status"][slot] == R.OK
        out = ring.outputs[slot, :2]
    assert any(np.allclose(out, want, rtol=1e-4, atol=1e-4) for want in allowed), f"final answer {out} from no allowed model"


def _settle_loads(srv: S.RingServer, wait: float = 0.0) -> None:
    deadline = time.monotonic() + wait
    while True:
        if srv._pending_swap is not None:
            srv._apply_swap()
        if not srv._loading or time.monotonic() >= deadline:
            return
        time.sleep(0.002)


def run_cases(base: str, cases: list[list[dict[str, Any]]], native: bool) -> dict[str, Any]:
    """Serve a fresh ring and put it through ``cases`` (lists of mutations). Returns
    {"failed": index, "error": ...} at the first broken invariant, else {"failed": None}."""
    basep = Path(base)
    paths = Paths(basep)
    name = str(basep / "ring")
    logs: list[str] = []
    srv = S.RingServer.open(name, GEOMETRY, M.Mlp.random(seed=3), P.Policy(),
                        S.ServeOptions(use_gpu="off", native="on" if native else "off", model_dirs=(str(paths.models),),
                                       load_timeout_s=0.5),
                        recreate=True, log=logs.append)
    thread_error: list[BaseException] = []
    thread = None
    if native:
        def serve() -> None:
            try:
                srv.serve()
            except BaseException as e:  # noqa: BLE001 - reported below
                thread_error.append(e)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
    i = -1
    try:
        for i, case in enumerate(cases):
            for m in case:
                apply(srv.ring, m, paths)
            if native:
                if i % 50 == 49:  # let the loops run over what was written, housekeeping included
                    time.sleep(S.HOUSEKEEPING_S * 1.5)
                    assert not thread_error, f"serve loop: {thread_error[0]!r}"
            else:
                ready = srv.ready_slots()
                if ready:
                    (srv.process_small if len(ready) <= S.SMALL_BATCH or i % 2 else lambda r: srv.process(np.asarray(r)))(ready)
                srv.housekeeping()
                _settle_loads(srv)
                _check(srv, f"case {i}")
        i = len(cases)
        if native:
            time.sleep(S.HOUSEKEEPING_S * 2)
            assert not thread_error, f"serve loop: {thread_error[0]!r}"
            assert thread is not None and thread.is_alive(), "the serve loop ended"
            srv.ring.state[:] = R.FREE  # what a restart would leave: every lane usable again
        else:
            srv.housekeeping()
            _settle_loads(srv, wait=2.0)
        _check(srv, "after all cases")
        _final_request(srv, native)
        seen = {what: sum(what in line for line in logs) for what in _REACHED}
        return {"failed": None, "reached": seen}
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the case
        return {"failed": i, "error": f"{type(e).__name__}: {e}"}
    finally:
        srv.stop.set()
        if thread is not None:
            thread.join(10)
        srv.close()


#: What the daemon says when a case reached each of its defences (counted from its messages).
_REACHED = ("cut short", "header overwritten", "died while writing", "unknown state word", "model load refused",
            "swapped in")


def _run(tmp_path: Path, cases: list[list[dict[str, Any]]], native: bool) -> dict[str, Any]:
    base = tmp_path / f"run-{uuid.uuid4().hex[:8]}"
    base.mkdir()
    try:
        return in_child(run_cases, str(base), cases, native, timeout=120)
    except StrangerFailed as e:  # killed by a signal, or failed to report
        return {"failed": -1, "error": str(e)}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _minimise(tmp_path: Path, cases: list[list[dict[str, Any]]], native: bool) -> list[dict[str, Any]]:
    """The failing case's mutations (and those of the cases before it), with every one that is
    not needed for the failure dropped."""
    result = _run(tmp_path, cases, native)
    upto = len(cases) if result["failed"] in (None, -1) else min(result["failed"] + 1, len(cases))
    flat = [m for case in cases[:upto] for m in case]
    k = 0
    while k < len(flat):
        trial = flat[:k] + flat[k + 1 :]
        if _run(tmp_path, [trial], native)["failed"] is not None:
            flat = trial
        else:
            k += 1
    return flat


def _generate(seed: int, n: int) -> list[list[dict[str, Any]]]:
    rng = random.Random(seed)
    size = GEOMETRY.offsets()["total"]
    return [[random_mutation(rng, GEOMETRY.nslots, size) for _ in range(rng.randint(1, 6))] for _ in range(n)]


def _fuzz(tmp_path: Path, seed: int, n: int, native: bool) -> dict[str, int]:
    cases = _generate(seed, n)
    result = _run(tmp_path, cases, native)
    if result["failed"] is not None:
        minimal = _minimise(tmp_path, cases, native)
        raise AssertionError(f"seed {seed}, case {result['failed']}: {result['error']}\nminimised (add it to "
                             f"{FIXTURES.name}): {json.dumps({'name': 'new', 'native': native, 'mutations': minimal})}")
    return result["reached"]


def test_fuzzed_ring_writes_never_break_the_python_loop(tmp_path: Path) -> None:
    reached = _fuzz(tmp_path, 20261125, PYTHON_CASES, native=False)
    assert all(reached.values()), f"some defences were never reached: {reached}"


@pytest.mark.skipif(CC is None, reason="no C compiler: no native loop")
def test_fuzzed_ring_writes_never_break_the_native_loop(tmp_path: Path) -> None:
    _fuzz(tmp_path, 20261126, NATIVE_CASES, native=True)


def _fixtures() -> list[dict[str, Any]]:
    return json.loads(FIXTURES.read_text())


@pytest.mark.parametrize("fixture", _fixtures(), ids=lambda f: f["name"])
def test_kept_ring_cases_stay_fixed(tmp_path: Path, fixture: dict[str, Any]) -> None:
    for native in (False, True) if CC is not None else (False,):
        if fixture.get("native") is not None and fixture["native"] != native:
            continue
        if any("truncate" in m for m in fixture["mutations"]) and CC is None:
            pytest.skip("no C compiler: no truncation guard")
        result = _run(tmp_path, [fixture["mutations"]], native)
        assert result["failed"] is None, (native, result)


def test_the_fuzzer_finds_a_planted_bug(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness fails, and minimises, when the daemon breaks: with the pid check taken away, a
    WRITING slot whose producer_pid is 2^31 crashes housekeeping again."""
    from gpuos_tools import procs

    monkeypatch.setattr(R, "pid_alive", lambda pid: procs.exists(pid))
    cases = [[{"request": 1}], [{"byte": 9000, "value": 1}, {"state": 5, "value": R.WRITING}],
             [{"meta": 3, "field": "producer_pid", "value": 1 << 31}, {"state": 3, "value": R.WRITING}], [{"request": 2}]]
    result = _run(tmp_path, cases, native=False)
    assert result["failed"] == 2 and "OverflowError" in result["error"]
    assert _minimise(tmp_path, cases, native=False) == [{"meta": 3, "field": "producer_pid", "value": 1 << 31},
                                                        {"state": 3, "value": R.WRITING}]


def test_mutations_are_json(tmp_path: Path) -> None:
    for case in _generate(1, 200):
        assert json.loads(json.dumps(case)) == case
        for m in case:
            if "input" in m and isinstance(m["value"], str):
                assert math.isnan(float(m["value"])) or math.isinf(float(m["value"]))
