"""The Python producer's two request paths, C (csrc/kinfer_client.c, one call per request) and
CPython (ring.py): against the same daemons they must give the same answers and behave the same
way (timeouts, a dead daemon, a full lane, bad input sizes and model ids, the futex sleep while
the daemon is quiet, signals during a wait, the adaptive spin). No timing assertions beyond
"asleep, not spinning" (scripts/bench_kinfer.py measures)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import child_env, kinfer_daemon

from gpuos_tools.kinfer import client_native as CN
from gpuos_tools.kinfer import model as M
from gpuos_tools.kinfer import policy as P
from gpuos_tools.kinfer import ring as R
from gpuos_tools.kinfer import server as S
from gpuos_tools.kinfer import wait as W



def _native_or_skip() -> None:
    try:
        CN.library()
    except CN.BuildError as e:
        pytest.skip(f"no C request path here: {e}")


@pytest.fixture(params=["off", "on"])
def mode(request: pytest.FixtureRequest) -> str:
    if request.param == "on":
        _native_or_skip()
    return request.param


@pytest.fixture
def ring_name() -> Iterator[str]:
    name = f"kinfer-client-test-{uuid.uuid4().hex[:10]}"
    yield name
    R.ring_path(name).unlink(missing_ok=True)


def _daemon(name: str, *args: str) -> subprocess.Popen[bytes]:
    return kinfer_daemon(name, "--recreate", *args)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)


def _server(name: str) -> S.RingServer:
    """A daemon in this process whose loop the test turns by hand (serve(max_batches=1))."""
    return S.RingServer.open(name, R.Geometry(2, 2), M.Mlp.random(seed=3), P.Policy(), S.ServeOptions(use_gpu="off", native="off"),
                             recreate=True, log=lambda m: None)


def _answer(a: R.Answer) -> tuple:
    return a.status, a.decision, a.values, a.batch, a.where


@pytest.mark.parametrize("native_loop", ["on", "off"])
def test_both_paths_give_the_same_answers(ring_name: str, native_loop: str) -> None:
    _native_or_skip()
    rng = np.random.default_rng(7)
    rows = [rng.integers(0, 10, 31).astype(np.float32) for _ in range(150)]
    odd = [
        rng.random(31),  # float64: converted
        list(range(31)),  # a list
        rng.random((1, 31)).astype(np.float32),  # 2-D, one row
        rng.random(62).astype(np.float32)[::2],  # strided
        np.zeros(30, dtype=np.float32),  # a wrong size: BAD_SIZE
        np.zeros(0, dtype=np.float32),  # nothing: BAD_SIZE
        np.full(31, np.nan, dtype=np.float32),  # BAD_VALUE
    ]
    proc = _daemon(ring_name, "--random-model", "1", "--native", native_loop)
    try:
        with R.RingClient(ring_name, native="off") as py, R.RingClient(ring_name, native="on") as c:
            assert not py.native and c.native and py.lane != c.lane
            model = M.Mlp.random(seed=1)
            for x in rows + odd:
                a, b = py.infer(x), c.infer(x)
                assert _answer(a) == _answer(b), x
                if a.ok:
                    assert np.allclose(b.outputs, model.forward(np.asarray(x, dtype=np.float32).reshape(1, -1))[0], atol=1e-4)
            assert py.infer(rows[0], model_id=5).status == c.infer(rows[0], model_id=5).status == R.BAD_MODEL
            assert _answer(py.infer(rows[1], np.int64(0))) == _answer(c.infer(rows[1], np.int64(0)))
            statuses = {py.infer(x).status for x in odd[4:]}
            assert statuses == {R.BAD_SIZE, R.BAD_VALUE}
            # tickets: both slots of the lane in flight, answered out of order
            for client in (py, c):
                t1, t2 = client.submit(rows[2]), client.submit(rows[3])
                assert t1 != t2 and {t1, t2} <= set(client._slots)
                late, early = client.wait(np.int64(t2)), client.wait(t1)  # a numpy integer is a slot too
                for got, x in ((late, rows[3]), (early, rows[2])):  # maybe in one batch of 2: its own rounding
                    alone = py.infer(x)
                    assert got.batch in (1, 2) and (got.status, got.decision) == (alone.status, alone.decision)
                    assert np.allclose(got.values, alone.values, rtol=1e-5, atol=1e-5)
            # the answer names its request: seq counts this client's requests on either path
            seq = int(c.ring.meta["seq"][c._slots.start : c._slots.stop].max())
            assert seq == len(rows) + len(odd) + 4
    finally:
        _stop(proc)


def test_timeouts_a_full_lane_and_a_dead_daemon_read_the_same(ring_name: str) -> None:
    _native_or_skip()
    said: dict[str, list[str]] = {}
    for mode in ("off", "on"):
        R.Ring.create(ring_name, R.Geometry(2, 2)).close()
        out = said[mode] = []
        with R.RingClient(ring_name, native=mode) as client:
            x = np.zeros(31, dtype=np.float32)
            for _ in range(3):  # each timed-out request keeps its slot: the third finds the lane full
                t0 = time.monotonic()
                with pytest.raises(R.RingError) as e:
                    client.infer(x, timeout=0.05)
                out.append(str(e.value).replace(str(client.ring.path), "RING"))
                assert "all 2 slots" in out[-1] or time.monotonic() - t0 >= 0.05
            with pytest.raises(ValueError) as v:
                client.submit(np.zeros(40))
            out.append(str(v.value))
            for bad in (-1, R.MODEL_ID_LIMIT, 1 << 32, 1 << 40):  # ctypes would pass the low 32 bits of these
                with pytest.raises(ValueError) as v:
                    client.submit(x, model_id=bad)
                out.append(str(v.value))
            with pytest.raises(TypeError):
                client.infer(x, model_id=1.5)
            with pytest.raises(ValueError) as v:
                client.wait(client._first + (1 << 32))  # not a slot of this lane, whatever its low bits
            out.append(str(v.value))
            with pytest.raises(ValueError) as v:
                client.wait(client._first + 2)
            out.append(str(v.value))
            assert list(client.ring.state) == [R.READY, R.READY, R.FREE, R.FREE]  # nothing else was published
    assert said["off"][0].startswith("RING: no answer in time for slot 0 (state READY); no daemon is serving")
    assert "all 2 slots are in flight" in said["off"][2] and "at most 32" in said["off"][3]
    assert said["off"][4:8] == [f"model id {v}: 0 to 2147483647" for v in (-1, 1 << 31, 1 << 32, 1 << 40)]
    assert said["off"] == said["on"]

    proc = _daemon(ring_name, "--random-model", "1")
    with R.RingClient(ring_name, native="off") as py, R.RingClient(ring_name, native="on") as c:
        assert py.infer(np.zeros(31)).ok and c.infer(np.zeros(31)).ok
        proc.kill()
        proc.wait(timeout=30)
        for client in (py, c):
            with pytest.raises(R.RingError, match=f"daemon pid {proc.pid} is gone"):
                client.infer(np.zeros(31), timeout=0.05)


def test_a_numpy_integer_is_a_ticket_even_asleep(ring_name: str, mode: str) -> None:
    srv = _server(ring_name)
    try:
        with R.RingClient(ring_name, native=mode) as client:
            slot = client.submit(np.arange(31) % 10)
            helper = threading.Timer(0.05, lambda: srv.serve(max_batches=1))  # after the spin: asleep
            helper.start()
            assert client.wait(np.int64(slot), timeout=10).ok
            helper.join()
    finally:
        srv.close()


def test_a_quiet_daemon_is_waited_for_asleep(ring_name: str, mode: str) -> None:
    """An answer that takes long is slept for on the slot's futex (meta.waiting set), not spun
    for, and the daemon's wake-up ends the sleep."""
    srv = _server(ring_name)
    try:
        with R.RingClient(ring_name, native=mode) as client:
            seen: dict[str, int] = {}

            def answer_late() -> None:
                time.sleep(0.3)
                slot = client._first
                seen["waiting"] = int(srv.ring.meta["waiting"][slot])
                srv.serve(max_batches=1)

            helper = threading.Thread(target=answer_late)
            cpu0, t0 = time.thread_time(), time.monotonic()
            helper.start()
            a = client.infer(np.arange(31) % 10, timeout=10)
            cpu, wall = time.thread_time() - cpu0, time.monotonic() - t0
            helper.join()
            assert a.ok and seen["waiting"] == 1 and int(srv.ring.meta["waiting"][client._first]) == 0
            assert 0.3 <= wall < 5
            assert cpu < 0.5 * wall, (cpu, wall)  # a spin would have used the whole wait
    finally:
        srv.close()


WAIT_CHILD = r"""
import sys, numpy as np
from gpuos_tools.kinfer import ring as R
c = R.RingClient(sys.argv[1], native=sys.argv[2])
print("waiting", flush=True)
try:
    c.infer(np.zeros(31), timeout=60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_ends_a_wait(ring_name: str, mode: str) -> None:
    R.Ring.create(ring_name, R.Geometry(2, 2)).close()
    child = subprocess.Popen([sys.executable, "-c", WAIT_CHILD, ring_name, mode], env=child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "waiting"
        time.sleep(0.3)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=20)  # well before the 60 s timeout
        assert out.strip() == "interrupted", err
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_c_path_spins_by_the_python_rule(ring_name: str) -> None:
    _native_or_skip()
    R.Ring.create(ring_name, R.Geometry(2, 2)).close()
    with R.RingClient(ring_name, native="off") as py, R.RingClient(ring_name, native="on") as c:
        lib = CN.library()
        state = np.zeros(4, dtype=np.uint64)

        def c_hold() -> tuple[float, float]:
            lib.kc_state(c._kc, state.ctypes.data)
            return state[0] / 1e9, state[1] / 1e9

        assert c_hold() == (R.CLIENT_SPIN_MIN_S, 0.0)
        ref = W.Adaptive(R.CLIENT_SPIN_MIN_S, R.CLIENT_SPIN_MAX_S)
        rng = np.random.default_rng(3)
        waits = np.concatenate([[5e-6, 400e-6, 900e-6, 10e-6, 3e-3, 1e-6], rng.choice([2e-6, 150e-6, 1.5e-3, 8e-3], 200)])
        t = 0.0
        for waited in waits:
            py._learn(float(waited))
            lib.kc_learn(c._kc, int(round(waited * 1e9)))
            ref.arrival(t)
            t += waited
            ref.arrival(t)
            ref.last = None
            hold, gap = c_hold()
            assert hold == pytest.approx(py._hold, abs=2e-8) and hold == pytest.approx(ref.hold(), abs=2e-8)
            assert gap == pytest.approx(py._gap, abs=2e-8)
    with R.RingClient(ring_name, native="on", spin_s=50e-6) as fixed:
        lib.kc_learn(fixed._kc, 10_000)
        lib.kc_state(fixed._kc, state.ctypes.data)
        assert state[0] == 50_000  # a fixed spin learns nothing


def test_without_a_compiler_the_python_path_serves(ring_name: str, tmp_path: Path) -> None:
    srv = _server(ring_name)
    code = (
        "import sys, numpy as np\n"
        "from gpuos_tools.kinfer import ring as R\n"
        "c = R.RingClient(sys.argv[1])\n"
        "print(c.native, c.native_why, flush=True)\n"
        "a = c.infer(np.arange(31) % 10, timeout=30)\n"
        "print(a.ok, a.decision, flush=True)\n"
        "try:\n"
        "    R.RingClient(sys.argv[1], native='on')\n"
        "except R.RingError as e:\n"
        "    print('refused:', e)\n"
    )
    env = child_env(CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    env["PATH"] = str(tmp_path)  # no cc, gcc or clang either
    child = subprocess.Popen([sys.executable, "-c", code, ring_name], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        first = child.stdout.readline().split()
        assert first[0] == "False" and "no-such-cc" in " ".join(first), first
        deadline = time.monotonic() + 30
        while srv.ring.state[0] != R.READY and time.monotonic() < deadline:
            time.sleep(0.005)
        srv.serve(max_batches=1)
        out, err = child.communicate(timeout=60)
        lines = out.splitlines()
        assert lines[0].split()[0] == "True", err
        assert lines[1].startswith("refused: native on, but the C request path cannot run")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        srv.close()
