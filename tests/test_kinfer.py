"""gpu-kinfer-bridge on the CPU: the C layout against the Python one, a C producer round-tripping
through a real daemon, bad input, restarts, model swaps, LinnOS encoding/training/replay, traces,
the feature store, the policy and profiles. No timing assertions (scripts/bench_kinfer.py
measures)."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import BRIDGE, REPO, child_env, kinfer_daemon

from gpuos_tools.kinfer import features as F
from gpuos_tools.kinfer import linnos
from gpuos_tools.kinfer import model as M
from gpuos_tools.kinfer import policy as P
from gpuos_tools.kinfer import ring as R
from gpuos_tools.kinfer import server as S
from gpuos_tools.kinfer import traces as T

CC = shutil.which("cc") or shutil.which("gcc")
INCLUDE = R.HEADER_FILE.parent


def _name() -> str:
    return f"kinfer-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def ring_name() -> Iterator[str]:
    name = _name()
    yield name
    R.ring_path(name).unlink(missing_ok=True)


def _server(name: str, model: M.Mlp | None = None, geometry: R.Geometry = R.Geometry(4, 4)) -> S.RingServer:
    return S.RingServer.open(name, geometry, model or M.Mlp.random(seed=3), P.Policy(), S.ServeOptions(use_gpu="off"),
                         recreate=True, log=lambda m: None)


def _daemon(name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return kinfer_daemon(name, *args, env=env, stdout=subprocess.PIPE)


def _stop(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    return out, err


# -- the layout ------------------------------------------------------------------------------

_OFFSETS_C = r"""
#include <stddef.h>
#include <stdio.h>
#include "gpuos_kinfer.h"
#define H(f) printf("header %s %zu\n", #f, offsetof(struct gpuos_kinfer_header, f));
#define M(f) printf("meta %s %zu\n", #f, offsetof(struct gpuos_kinfer_meta, f));
#define F(f) printf("features %s %zu\n", #f, offsetof(struct gpuos_kinfer_features, f));
int main(void) {
  BODY
  printf("size header %zu\nsize meta %zu\nsize features %zu\n", sizeof(struct gpuos_kinfer_header),
         sizeof(struct gpuos_kinfer_meta), sizeof(struct gpuos_kinfer_features));
  printf("const %llu %u %u %lld %lld\n", (unsigned long long)GPUOS_KINFER_MAGIC, GPUOS_KINFER_VERSION,
         GPUOS_KINFER_ENTRY_VERSION, (long long)GPUOS_KINFER_LOCK_DAEMON, (long long)GPUOS_KINFER_LOCK_LANE0);
  printf("states %d %d %d %d %d\n", GPUOS_KINFER_FREE, GPUOS_KINFER_WRITING, GPUOS_KINFER_READY, GPUOS_KINFER_TAKEN, GPUOS_KINFER_DONE);
  printf("fmagic %llu\n", (unsigned long long)GPUOS_KINFER_FEATURES_MAGIC);
  return 0;
}
"""


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_c_header_matches_the_python_layout(tmp_path: Path) -> None:
    body = " ".join(f"H({n})" for n in R.HEADER_DTYPE.names) + " " + " ".join(f"M({n})" for n in R.META_DTYPE.names)
    body += " " + " ".join(f"F({n})" for n in F.HEADER_DTYPE.names)
    src = tmp_path / "offsets.c"
    src.write_text(_OFFSETS_C.replace("BODY", body))
    subprocess.run([CC, "-std=c11", "-Wall", "-Werror", "-I", str(INCLUDE), str(src), "-o", str(tmp_path / "offsets")], check=True)
    out = subprocess.run([str(tmp_path / "offsets")], capture_output=True, text=True, check=True).stdout.split("\n")
    table = {("header", n): R.HEADER_DTYPE.fields[n][1] for n in R.HEADER_DTYPE.names}
    table |= {("meta", n): R.META_DTYPE.fields[n][1] for n in R.META_DTYPE.names}
    table |= {("features", n): F.HEADER_DTYPE.fields[n][1] for n in F.HEADER_DTYPE.names}
    seen = 0
    for line in out:
        words = line.split()
        if words and words[0] in ("header", "meta", "features"):
            assert table[(words[0], words[1])] == int(words[2]), line
            seen += 1
        elif words[:1] == ["size"]:
            want = {"header": R.HEADER_SIZE, "meta": R.META_SIZE, "features": F.HEADER_SIZE}[words[1]]
            assert int(words[2]) == want
        elif words[:1] == ["const"]:
            assert [int(w) for w in words[1:]] == [R.MAGIC, R.VERSION, R.ENTRY_VERSION, R.LOCK_DAEMON, R.LOCK_LANE0]
        elif words[:1] == ["states"]:
            assert [int(w) for w in words[1:]] == [R.FREE, R.WRITING, R.READY, R.TAKEN, R.DONE]
        elif words[:1] == ["fmagic"]:
            assert int(words[1]) == F.MAGIC
    assert seen == len(table)
    assert [R.HEADER_DTYPE.fields["counters"][1] + 8 * i for i in range(len(R.COUNTERS))] == [192 + 8 * i for i in range(len(R.COUNTERS))]


@pytest.fixture(scope="module")
def c_producer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CC is None:
        pytest.skip("no C compiler")
    exe = tmp_path_factory.mktemp("cprod") / "kinfer_producer"
    subprocess.run([CC, "-O2", "-std=c11", "-Wall", "-Werror", "-I", str(INCLUDE), str(REPO / "examples" / "kinfer_producer.c"),
                    "-o", str(exe)], check=True)
    return exe


def _expected(seed: int, k: int) -> np.ndarray:
    x = np.array([[(k + j) % 10 for j in range(31)]], dtype=np.float32)
    return M.Mlp.random(seed=seed).forward(x)[0]


def test_c_producers_round_trip_through_the_daemon(c_producer: Path, ring_name: str) -> None:
    proc = _daemon(ring_name, "--random-model", "7")
    try:
        runs = [subprocess.Popen([str(c_producer), ring_name, "40"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(3)]
        with R.RingClient(ring_name) as client:  # a Python producer at the same time
            py = [client.infer(np.arange(31) % 10) for _ in range(20)]
        outs = [r.communicate(timeout=60) for r in runs]
        bad = subprocess.run([str(c_producer), ring_name, "3", "9"], capture_output=True, text=True, timeout=60)
    finally:
        out, _ = _stop(proc)
    for r, (stdout, stderr) in zip(runs, outs):
        assert r.returncode == 0, stderr
        lines = stdout.splitlines()
        assert len(lines) == 40
        for line in lines:
            k, status, decision, where, batch, y0, y1, rt_ns = line.split()
            want = _expected(7, int(k))
            assert int(status) == R.OK and int(where) == R.CPU and int(batch) >= 1 and int(rt_ns) > 0
            assert np.allclose([float(y0), float(y1)], want, rtol=1e-5, atol=1e-4)
            assert int(decision) == int(np.argmax(want))
    want = M.Mlp.random(seed=7).forward((np.arange(31) % 10).astype(np.float32)[None])[0]
    assert all(a.ok and np.allclose(a.outputs, want, rtol=1e-5, atol=1e-4) for a in py)
    assert bad.returncode == 0
    assert [int(line.split()[1]) for line in bad.stdout.splitlines()] == [R.BAD_VERSION] * 3
    stats = [json.loads(line) for line in out.decode().splitlines()][-1]
    assert stats["type"] == "kinfer_stats" and stats["served"] == 3 * 40 + 20 and stats["drop_bad_version"] == 3
    # the daemon served through the native loop, which handed the bad entries to Python
    assert stats["native"] is True and stats["native_served"] >= 1 and stats["handed_batches"] >= 1
    assert stats["gpu_delay_us"] == 0.0 and stats["cpu_slowdown"] == 1.0 and (stats["cpu_extra_us"], stats["cpu_scale"]) == (0.0, 1.0)  # --gpu off: nothing to choose, nothing measured


# -- bad input, in process --------------------------------------------------------------------


def _put(ring: R.Ring, slot: int, x: np.ndarray, *, version: int = R.ENTRY_VERSION, model_id: int = 0, n: int | None = None) -> None:
    ring.state[slot] = R.WRITING
    m = ring.meta[slot:slot + 1]
    m["version"], m["model_id"], m["n_inputs"], m["seq"] = version, model_id, len(x) if n is None else n, 1000 + slot
    m["producer_pid"] = os.getpid()
    ring.inputs[slot, : len(x)] = x
    ring.state[slot] = R.READY


@pytest.mark.parametrize("path", ["small", "vector"])
def test_bad_entries_are_answered_and_counted(ring_name: str, path: str) -> None:
    model = M.Mlp.random(seed=5)
    srv = _server(ring_name, model)
    try:
        ring = srv.ring
        good = np.arange(31, dtype=np.float32) % 7
        nan = good.copy()
        nan[3] = np.nan
        _put(ring, 0, good)
        _put(ring, 1, good, version=9)
        _put(ring, 2, good[:5])
        _put(ring, 3, good, model_id=4)
        _put(ring, 4, nan)
        _put(ring, 5, good)
        ready = srv.ready_slots()
        assert ready == [0, 1, 2, 3, 4, 5]
        srv.process_small(ready) if path == "small" else srv.process(np.array(ready))
        assert list(ring.state[:6]) == [R.DONE] * 6
        assert list(ring.meta["status"][:6]) == [R.OK, R.BAD_VERSION, R.BAD_SIZE, R.BAD_MODEL, R.BAD_VALUE, R.OK]
        want = model.forward(good[None])[0]
        for slot in (0, 5):
            assert np.allclose(ring.outputs[slot, :2], want, rtol=1e-5)
            assert ring.meta["decision"][slot] == np.argmax(want)
            assert ring.meta["answer_seq"][slot] == 1000 + slot
            assert ring.meta["batch"][slot] == 6
        c = ring.counter_values()
        assert (c["served"], c["drop_bad_version"], c["drop_bad_size"], c["drop_bad_model"], c["drop_bad_value"]) == (2, 1, 1, 1, 1)
    finally:
        srv.close()


def test_small_and_vector_paths_agree(ring_name: str) -> None:
    srv = _server(ring_name)
    try:
        ring = srv.ring
        xs = np.random.default_rng(0).integers(0, 10, (8, 31)).astype(np.float32)
        results = []
        for fn in (srv.process_small, lambda slots: srv.process(np.array(slots))):
            for i in range(8):
                _put(ring, i, xs[i])
            fn(srv.ready_slots())
            results.append((ring.outputs[:8, :2].copy(), ring.meta["decision"][:8].copy(), ring.meta["n_outputs"][:8].copy()))
        for a, b in zip(*results):
            assert np.array_equal(a, b)
    finally:
        srv.close()


def test_producer_dying_mid_write_is_reclaimed(ring_name: str) -> None:
    srv = _server(ring_name)
    try:
        code = (
            "import os, sys\n"
            "from gpuos_tools.kinfer import ring as R\n"
            f"c = R.RingClient({ring_name!r})\n"
            "slot = c._first\n"
            "c._state[slot] = R.WRITING\n"
            "c.ring.meta32[slot, R.M32['producer_pid']] = os.getpid()\n"
            "print(slot, flush=True)\n"
            "os._exit(0)\n"
        )
        done = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60)
        slot = int(done.stdout)
        assert srv.ring.state[slot] == R.WRITING
        srv.housekeeping()
        assert srv.ring.state[slot] == R.FREE
        assert srv.ring.counter_values()["drop_abandoned"] == 1
        srv.ring.state[1] = 77  # a word no producer should write
        srv.housekeeping()
        assert srv.ring.state[1] == R.FREE and srv.ring.counter_values()["drop_bad_state"] == 1
        with R.RingClient(ring_name) as again:  # the dead producer's lane is free again
            assert again.lane == 0
    finally:
        srv.close()


def test_ring_attach_refuses_bad_files(tmp_path: Path, ring_name: str) -> None:
    with pytest.raises(R.RingError, match="no such ring"):
        R.Ring.attach(str(tmp_path / "missing"))
    junk = tmp_path / "junk"
    junk.write_bytes(b"x" * 8192)
    with pytest.raises(R.RingError, match="not a gpu-kinfer-bridge ring"):
        R.Ring.attach(str(junk))
    ring = R.Ring.create(ring_name, R.Geometry(2, 2))
    ring.header["version"] = 2
    ring.close()
    with pytest.raises(R.RingError, match="layout version 2"):
        R.Ring.attach(ring_name)
    ring = R.Ring.create(ring_name, R.Geometry(2, 2))
    ring.close()
    os.truncate(R.ring_path(ring_name), 5000)
    with pytest.raises(R.RingError, match="layout needs"):
        R.Ring.attach(ring_name)


def test_client_says_when_no_daemon_answers(ring_name: str) -> None:
    R.Ring.create(ring_name, R.Geometry(2, 2)).close()
    with R.RingClient(ring_name) as client:
        with pytest.raises(R.RingError, match="no daemon is serving"):
            client.infer(np.zeros(31), timeout=0.05)
        with pytest.raises(ValueError, match="at most 32"):
            client.submit(np.zeros(40))


def test_client_of_a_replaced_ring_is_told_so(ring_name: str) -> None:
    R.Ring.create(ring_name, R.Geometry(2, 2)).close()
    with R.RingClient(ring_name) as client:
        R.Ring.create(ring_name, R.Geometry(2, 2)).close()  # a new file: the old mapping stays valid
        assert client.ring.replaced()
        with pytest.raises(R.RingError, match="replaced or removed"):
            client.infer(np.zeros(31), timeout=0.05)


def test_lanes_are_exclusive_within_and_across_processes(ring_name: str) -> None:
    R.Ring.create(ring_name, R.Geometry(2, 2)).close()
    with R.RingClient(ring_name) as a, R.RingClient(ring_name) as b:
        assert {a.lane, b.lane} == {0, 1}
        with pytest.raises(R.RingError, match="no free lane"):
            R.RingClient(ring_name)
        # the refused client closed its descriptor: a and b must still hold their lanes
        with pytest.raises(R.RingError, match="no free lane"):
            R.RingClient(ring_name)
    code = f"from gpuos_tools.kinfer import ring as R\nc = R.RingClient({ring_name!r})\nprint(c.lane)\n"
    with R.RingClient(ring_name) as a:
        other = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60)
        assert int(other.stdout) == 1 - a.lane


def test_daemon_restart_keeps_producers_attached(ring_name: str) -> None:
    proc = _daemon(ring_name, "--random-model", "1")
    with R.RingClient(ring_name) as client:
        x = np.arange(31) % 10
        first = client.infer(x)
        epoch = int(client.ring.header["daemon_epoch"])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        ticket = client.submit(x)  # sent while no daemon runs
        orphan = client.ring.nslots - 1  # a request the dead daemon had taken (never written: version 0)
        assert orphan // client.ring.geometry.slots_per_lane != client.lane
        client.ring.state[orphan] = R.TAKEN
        proc = _daemon(ring_name, "--random-model", "1")
        try:
            again = client.wait(ticket, timeout=30)
            assert again.ok and np.allclose(again.outputs, first.outputs)
            assert int(client.ring.header["daemon_epoch"]) == epoch + 1
            assert client.infer(x).ok
            # the orphan sits in another lane: the daemon may answer it after this client's requests
            deadline = time.monotonic() + 10
            while (client.ring.state[orphan] != R.DONE or client.ring.counter_values()["drop_bad_version"] < 1) \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            c = client.ring.counter_values()
            assert c["requeued"] == 1 and c["drop_bad_version"] == 1
            assert client.ring.state[orphan] == R.DONE
        finally:
            _stop(proc)


def test_second_daemon_is_refused(ring_name: str) -> None:
    proc = _daemon(ring_name, "--random-model", "1")
    try:
        done = subprocess.run([*BRIDGE, "serve", "--ring", ring_name, "--random-model", "1", "--gpu", "off"],
                              env=child_env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and f"served by pid {proc.pid}" in done.stderr
        done = subprocess.run([*BRIDGE, "serve", "--ring", ring_name, "--random-model", "1", "--gpu", "off", "--recreate"],
                              env=child_env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and "served by" in done.stderr
    finally:
        _stop(proc)


# -- model swaps -----------------------------------------------------------------------------


def test_swap_applies_between_batches(ring_name: str, tmp_path: Path) -> None:
    a, b = M.Mlp.random(seed=1), M.Mlp.random(seed=2)
    srv = _server(ring_name, a)
    try:
        x = np.arange(31, dtype=np.float32) % 10
        srv._pending_swap = (1, 0, S.Backend(b), "")  # arrived while a batch is being answered
        _put(srv.ring, 0, x)
        srv.process_small(srv.ready_slots())
        assert np.allclose(srv.ring.outputs[0, :2], a.forward(x[None])[0])
        srv._apply_swap()
        _put(srv.ring, 0, x)
        srv.process_small(srv.ready_slots())
        assert np.allclose(srv.ring.outputs[0, :2], b.forward(x[None])[0])
        assert int(srv.ring.header["model_generation"]) == 1
    finally:
        srv.close()


def test_load_command_hot_swaps_the_running_daemon(ring_name: str, tmp_path: Path) -> None:
    a, b = M.Mlp.random(seed=1), M.Mlp.random(seed=2)
    a.save(tmp_path / "a.npz")
    b.save(tmp_path / "b.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    proc = _daemon(ring_name, "--model", str(tmp_path / "a.npz"))
    try:
        x = np.arange(31, dtype=np.float32) % 10
        with R.RingClient(ring_name) as client:
            assert np.allclose(client.infer(x).outputs, a.forward(x[None])[0])
            done = subprocess.run([*BRIDGE, "load", str(tmp_path / "b.npz"), "--ring", ring_name], env=child_env(),
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            assert np.allclose(client.infer(x).outputs, b.forward(x[None])[0])
            done = subprocess.run([*BRIDGE, "load", str(tmp_path / "bad.npz"), "--ring", ring_name], env=child_env(),
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 64 and "not a model file" in done.stderr
            assert S.request_load(ring_name, tmp_path / "bad.npz") == 1  # the daemon refuses it too, and lives
            assert np.allclose(client.infer(x).outputs, b.forward(x[None])[0])
            assert client.ring.counter_values()["model_swaps"] == 1
    finally:
        _stop(proc)


# -- LinnOS ----------------------------------------------------------------------------------


def test_encoding_is_31_digits() -> None:
    x = M.encode(np.array([7, 1234]), np.array([[1, 22, 333, 4444], [0, 0, 0, 0]]), np.array([[5, 66, 777, 8888], [12345, 0, 0, 1]]))
    assert x.shape == (2, 31)
    assert x[0].tolist() == [0, 0, 7, 0, 0, 1, 0, 2, 2, 3, 3, 3, 9, 9, 9, 0, 0, 0, 5, 0, 0, 6, 6, 0, 7, 7, 7, 8, 8, 8, 8]
    assert x[1, :3].tolist() == [9, 9, 9] and x[1, 15:19].tolist() == [9, 9, 9, 9] and x[1, 27:].tolist() == [0, 0, 0, 1]


def test_history_is_the_last_reads_completed_before_issue() -> None:
    issue = np.array([0.0, 10.0, 20.0, 30.0])
    lat = np.array([100.0, 5.0, 5.0, 5.0])  # read 0 completes last (t=100)
    pending = np.array([1, 2, 3, 4])
    x = M.features_from_reads(pending, lat, issue + lat, issue)
    # read 3 (issued at 30) has seen reads 1 (done 15) and 2 (done 25) complete, newest first
    assert x[3, 3:9].tolist() == [0, 0, 3, 0, 0, 2]
    assert x[3, 15:23].tolist() == [0, 0, 0, 5, 0, 0, 0, 5]
    assert x[3, 9:15].tolist() == [0] * 6 and x[0, 3:].sum() == 0


def test_thresholds() -> None:
    rng = np.random.default_rng(0)
    lat = np.concatenate([rng.normal(100, 5, 9000), rng.normal(2000, 100, 1000)])
    knee = M.inflection_threshold(lat)
    assert 100 < knee < 1500
    assert M.threshold(lat, "percentile", 50) == pytest.approx(np.percentile(lat, 50))
    with pytest.raises(ValueError):
        M.threshold(lat, "median")


def test_weighted_hinge_gradient_and_weight() -> None:
    rng = np.random.default_rng(1)
    s = rng.normal(0, 1, (6, 2)).astype(np.float64)
    y = np.array([0, 1, 1, 0, 1, 0])
    loss, g = M.weighted_hinge(s, y, 5.0)
    eps = 1e-6
    for i in range(6):
        for j in range(2):
            d = np.zeros_like(s)
            d[i, j] = eps
            num = (M.weighted_hinge(s + d, y, 5.0)[0] - M.weighted_hinge(s - d, y, 5.0)[0]) / (2 * eps)
            assert g[i, j] == pytest.approx(num, abs=1e-5)
    wrong = np.array([[2.0, 0.0]])  # predicted fast
    assert M.weighted_hinge(wrong, np.array([1]), 5.0)[0] == pytest.approx(5 * M.weighted_hinge(wrong[:, ::-1], np.array([0]), 5.0)[0])


def test_training_learns_and_model_files_round_trip(tmp_path: Path) -> None:
    recs = T.synthesize(20000, seed=3)
    model, report = linnos.train_trace(recs, epochs=6)
    assert report["holdout"]["accuracy"] > 0.9
    assert report["loss"][-1] < report["loss"][0]
    model.save(tmp_path / "m.npz")
    back = M.Mlp.load(tmp_path / "m.npz")
    assert np.array_equal(back.w1, model.w1) and back.meta["threshold_us"] == report["threshold_us"]
    (tmp_path / "bad.npz").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a model file"):
        M.Mlp.load(tmp_path / "bad.npz")
    np.savez(tmp_path / "nan.npz", w1=np.full((31, 4), np.nan), b1=np.zeros(4), w2=np.zeros((4, 2)), b2=np.zeros(2))
    with pytest.raises(ValueError, match="NaN"):
        M.Mlp.load(tmp_path / "nan.npz")


def test_replay_columns() -> None:
    recs = T.synthesize(20000, seed=4)
    model, report = linnos.train_trace(recs, epochs=6)
    thr = report["threshold_us"]
    out = linnos.replay(recs, model.predict, thr)
    assert out["oracle"]["avg"] <= out["none"]["avg"]
    never = linnos.replay(recs, lambda x: np.zeros(len(x)), thr)
    assert never["linnos"] == never["none"] and never["rerouted"] == 0 and never["false_fast"] == 1.0
    with pytest.raises(ValueError, match="two devices"):
        linnos.replay([r for r in recs if r["dev"] == 0], model.predict, thr)


def test_synthetic_trace_is_seeded_and_consistent() -> None:
    a, b, c = T.synthesize(3000, seed=9), T.synthesize(3000, seed=9), T.synthesize(3000, seed=10)
    assert a == b and a != c
    assert list(T.io_records(a)) == a
    assert [r["t_us"] for r in a] == sorted(r["t_us"] for r in a)
    assert {r["dev"] for r in a} == {0, 1} and all(r["size"] % 4096 == 0 for r in a)
    assert max(r["pending"] for r in a) > 0
    with pytest.raises(ValueError, match="record 1"):
        list(T.io_records([{"type": "io", "op": "X"}]))


def test_collect_measures_real_io(tmp_path: Path) -> None:
    try:
        recs = T.collect(tmp_path, 200, devices=2, depth=2, file_size=8 << 20)
    except OSError as e:
        pytest.skip(f"O_DIRECT refused here: {e}")
    reads = [r for r in recs if r["op"] == "R"]
    assert len(reads) >= 200 and all(r["lat_us"] > 0 for r in recs)
    assert {r["dev"] for r in recs} == {0, 1}
    assert not list(tmp_path.glob("kinfer-io-*"))


def test_cli_synth_train_replay(tmp_path: Path) -> None:
    trace, model = tmp_path / "io.ndjson", tmp_path / "m.npz"
    run = lambda *a: subprocess.run([*BRIDGE, *a], env=child_env(), capture_output=True, text=True, timeout=300)  # noqa: E731
    done = run("synth", "-n", "8000", "--seed", "2", "-o", str(trace))
    assert done.returncode == 0, done.stderr
    header = json.loads(trace.read_text().split("\n", 1)[0])
    assert header["trace"] == "synthetic" and header["seed"] == 2
    done = run("train", str(trace), "--model", str(model), "--epochs", "3")
    assert done.returncode == 0, done.stderr
    rep = json.loads(done.stdout.splitlines()[-1])
    assert rep["type"] == "kinfer_train" and model.exists()
    done = run("replay", str(trace), "--model", str(model))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["type"] == "kinfer_replay" and out["reads"] == rep["reads"] and out["inference_us"] > 0
    assert set(out["linnos"]) == {"n", "avg", "p50", "p99", "p99.9", "max"}
    assert out["linnos"]["avg"] == pytest.approx(out["linnos_uncharged"]["avg"] + out["inference_us"], abs=1e-2)
    done = run("train", str(tmp_path / "none.ndjson"), "--model", str(model))
    assert done.returncode == 66
    trace.write_text('{"type":"io","dev":0}\n')
    done = run("train", str(trace), "--model", str(model))
    assert done.returncode == 64 and f"{trace}:1: io record, field 't_us' is missing" in done.stderr


# -- feature store ---------------------------------------------------------------------------


def test_feature_store_records_from_several_processes(ring_name: str) -> None:
    store = F.FeatureStore.register(ring_name, "linnos", ["pending", "latency_us"], capacity=64)
    t0 = time.monotonic_ns()
    code = (
        "from gpuos_tools.kinfer.features import FeatureStore\n"
        f"s = FeatureStore.open({ring_name!r})\n"
        "for i in range(20): s.record([i, 1000 + i])\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], env=child_env()) for _ in range(3)]
    for i in range(10):
        store.record([i, -i])
    assert all(p.wait(timeout=60) == 0 for p in procs)
    ts, seq, values = store.window(t0)
    assert len(seq) == 64 and seq.tolist() == list(range(70 - 64, 70))  # the oldest 6 were overwritten
    assert (np.diff(seq) == 1).all() and (ts >= t0).all()
    assert store.fields == ["pending", "latency_us"] and store.schema == "linnos"
    with pytest.raises(ValueError, match="2 fields"):
        store.record([1, 2, 3])
    store.header["version"] = 5
    store.close()
    with pytest.raises(R.RingError, match="version 5"):
        F.FeatureStore.open(ring_name)


def test_capture_then_train_from_the_store(ring_name: str, tmp_path: Path) -> None:
    trace, model = tmp_path / "io.ndjson", tmp_path / "m.npz"
    run = lambda *a: subprocess.run([*BRIDGE, *a], env=child_env(), capture_output=True, text=True, timeout=300)  # noqa: E731
    assert run("synth", "-n", "6000", "--seed", "5", "-o", str(trace)).returncode == 0
    done = run("features", "capture", str(trace), ring_name)
    assert done.returncode == 0, done.stderr
    store = F.FeatureStore.open(ring_name)
    _, _, values = store.window()
    store.close()
    data, _ = linnos.dataset(list(T.io_records(json.loads(line) for line in trace.read_text().splitlines())))
    assert np.array_equal(values[:, :31], data.x) and np.allclose(values[:, 31], data.lat_us, rtol=1e-6)
    from_store = run("train", "--features", ring_name, "--model", str(model), "--epochs", "2")
    from_trace = run("train", str(trace), "--model", str(tmp_path / "t.npz"), "--epochs", "2")
    assert from_store.returncode == 0, from_store.stderr
    a, b = (json.loads(d.stdout.splitlines()[-1]) for d in (from_store, from_trace))
    assert a["reads"] == b["reads"] and a["threshold_us"] == pytest.approx(b["threshold_us"], rel=1e-5)
    assert run("train", "--model", str(model)).returncode == 2
    F.FeatureStore.register(ring_name, "other", ["a"]).close()
    bad = run("train", "--features", ring_name, "--model", str(model))
    assert bad.returncode == 64 and "not a LinnOS feature store" in bad.stderr


def test_feature_store_cli(ring_name: str) -> None:
    run = lambda *a, **k: subprocess.run([*BRIDGE, "features", *a], env=child_env(), capture_output=True, text=True, timeout=60, **k)  # noqa: E731
    assert run("register", ring_name, "-f", "a", "-f", "b").returncode == 0
    assert run("record", ring_name, input='{"type":"v","x":[1,2]}\n{"type":"v","x":[3,4]}\n').returncode == 0
    done = run("window", ring_name)
    recs = [json.loads(line) for line in done.stdout.splitlines()]
    assert recs[0]["fields"] == ["a", "b"] and [r["x"] for r in recs[1:]] == [[1.0, 2.0], [3.0, 4.0]]
    bad = run("record", ring_name, input='{"type":"v","x":[1]}\n')
    assert bad.returncode == 64 and "record 1" in bad.stderr


# -- policy and profiles ---------------------------------------------------------------------


def test_policy_rules() -> None:
    lake = P.Policy(cpu_below=8)
    assert lake.choose(4, True, False) == "cpu" and lake.choose(8, True, False) == "gpu"
    assert lake.choose(512, True, True) == "cpu" and lake.choose(512, False, False) == "cpu"
    cal = P.Policy(batches=[1, 8, 64, 512], cpu_us=[5, 40, 320, 2560], gpu_us=[50, 50, 60, 100])
    assert cal.choose(1, True) == "cpu" and cal.choose(8, True) == "cpu" and cal.choose(16, True) == "gpu"
    # NVML's "busy" does not move a calibrated choice: only the GPU's measured delay does, added to
    # its curve whatever the batch size (16: CPU 80 µs, GPU ~53 + delay)
    assert cal.choose(16, True, busy=True) == "gpu" and cal.choose(16, True, gpu_delay_us=40) == "cpu"
    assert cal.choose(512, True, gpu_delay_us=2000) == "gpu" and cal.choose(512, True, gpu_delay_us=3000) == "cpu"
    assert cal.choose(512, True, gpu_delay_us=math.inf) == "cpu"  # a failed GPU batch in the window
    assert cal.estimate("cpu", 4096) == pytest.approx(2560 * 8)
    # the CPU's measured fit (a + b x its curve) replaces its curve; LAKE's rule ignores both
    assert cal.choose(8, True, cpu_fit=(0.0, 2.0)) == "gpu" and cal.choose(16, True, gpu_delay_us=40, cpu_fit=(0.0, 4.0)) == "gpu"
    assert cal.choose(8, True, cpu_fit=(40.0, 1.0)) == "gpu" and cal.choose(16, True, cpu_fit=(-30.0, 1.0)) == "cpu"
    assert lake.choose(4, True, cpu_fit=(0.0, 100.0)) == "cpu" and lake.choose(8, True, cpu_fit=(0.0, 0.01)) == "gpu"
    for pol in (lake, cal):
        for busy, delay, cpu_fit, gpu in [(False, 0.0, (0.0, 1.0), True), (True, 0.0, (0.0, 1.0), True),
                                          (False, 250.0, (0.0, 1.0), True), (False, 0.0, (0.0, 1.0), False),
                                          (False, 0.0, (0.0, 1.7), True), (False, 250.0, (0.0, 0.5), True),
                                          (False, -20.0, (0.0, 3.0), False), (False, 2e4, (0.0, 1.0), True),
                                          (False, 0.0, (47.0, 1.0), True), (False, 150.0, (60.0, 1.3), True)]:
            table = pol.cpu_batches(600, gpu, busy, delay, cpu_fit)
            assert [bool(v) for v in table[1:]] == [pol.choose(b, gpu, busy, delay, cpu_fit) == "cpu"
                                                    for b in range(1, 601)]
    assert P.crossover([1, 8, 64], [5, 40, 320], [50, 30, 60]) == 8
    assert P.crossover([1, 8, 64], [5, 40, 320], [50, 50, 400]) is None


# The H100 sweep that missed the target (BENCHMARKS.md, P9): idle curve, and what the GPU measured
# under half and full load from another process.
H100 = P.Policy(batches=[1, 8, 64, 128, 256, 1024, 4096], cpu_us=[5.8, 8.3, 22.0, 45.8, 85.3, 310, 1771],
                gpu_us=[32.6, 32.5, 34.1, 35.8, 34.4, 42.2, 80.7])


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class DutyLoad:
    """A second process on the GPU as the H100 bench's load makes it (BENCHMARKS.md, P9): matrix
    products for the first ``busy_s`` of every ``period_s``; a batch sent then waits ``wait_us``
    (a time slice: 2.41 ms measured at full load, whatever the batch) on top of its idle latency."""

    def __init__(self, period_s: float = 0.065, busy_s: float = 0.040, wait_us: float = 2410.0):
        self.period_s, self.busy_s, self.wait_us = period_s, busy_s, wait_us

    def gpu_us(self, pol: P.Policy, batch: int, t: float) -> float:
        return pol.estimate("gpu", batch) + (self.wait_us if t % self.period_s < self.busy_s else 0.0)

    def mean_gpu_us(self, pol: P.Policy, batch: int) -> float:
        return pol.estimate("gpu", batch) + self.wait_us * self.busy_s / self.period_s


def _probe_on_schedule(speed: P.GpuSpeed, load: DutyLoad, clock: Clock, seconds: float, others: bool = True) -> None:
    """The daemon's loop, simulated: every millisecond it asks whether a probe is due and, if so,
    times a batch of probe_batch rows, which takes as long as the load makes it."""
    end = clock.t + seconds
    while clock.t < end:
        if speed.probe_due(others):
            b = speed.policy.probe_batch
            us = load.gpu_us(speed.policy, b, clock.t)
            speed.observe(b, us)
            speed.probes += 1
            clock.t += us / 1e6
        clock.t += 0.001


def test_delay_follows_the_mean_under_a_duty_cycled_load() -> None:
    """Half load as on the H100 (the GPU busy 40 ms of every 65): the probes (jittered, every ~20
    ms) see the GPU idle in ~40% of cases and 2.4 ms late in the rest. The mean delay they give is
    what a batch pays on average, and picks the side that is faster on average; the median of the
    same probes (the former estimate) says 0 or 2.4 ms depending on luck, never the mean."""
    clock, load = Clock(), DutyLoad()
    speed = P.GpuSpeed(H100, clock, random.Random(1))
    _probe_on_schedule(speed, load, clock, 1.0)
    n = len(speed.fresh())
    assert 35 <= n <= 60 and speed.probes >= n  # ~50 probes in the 1 s window
    true_delay = load.mean_gpu_us(H100, 64) - H100.estimate("gpu", 64)  # 1483 µs
    assert speed.delay_us() == pytest.approx(true_delay, rel=0.2)
    ratios = sorted(speed.fresh())
    assert abs(ratios[n // 2] * H100.estimate("gpu", 64) - H100.estimate("gpu", 64) - true_delay) > 0.5 * true_delay
    # the pick against the side faster on average (H100 CPU curve): GPU only at 4096 (1.56 vs 1.77 ms)
    for b in (1, 64, 128, 256, 1024, 4096):
        faster = "gpu" if load.mean_gpu_us(H100, b) < H100.estimate("cpu", b) else "cpu"
        assert H100.choose(b, True, busy=True, gpu_delay_us=speed.delay_us()) == faster, b
    # the ratio of the means (the probes' mean slowdown, ~45x) scales the whole curve and says CPU
    # at 4096 too: under time-slicing the wait does not grow with the batch
    assert H100.estimate("gpu", 4096) * speed.slowdown() > H100.estimate("cpu", 4096)
    # full load: every batch waits, 4096 goes to the CPU; idle: no delay, the calibrated crossover
    full = P.GpuSpeed(H100, clock, random.Random(2))
    _probe_on_schedule(full, DutyLoad(busy_s=0.065), clock, 1.0)
    assert full.delay_us() == pytest.approx(2410.0)
    assert [H100.choose(b, True, gpu_delay_us=full.delay_us()) for b in (64, 1024, 4096)] == ["cpu"] * 3
    idle = P.GpuSpeed(H100, clock, random.Random(3))
    _probe_on_schedule(idle, DutyLoad(busy_s=0.0), clock, 3.0, others=False)
    assert 35 <= idle.probes <= 65 and idle.delay_us() == pytest.approx(0.0, abs=1e-9)  # ~every 60 ms
    assert [H100.choose(b, True, gpu_delay_us=idle.delay_us()) for b in (64, 128, 256)] == ["cpu", "gpu", "gpu"]
    # old samples age out and the calibration is back
    clock.t += H100.window_ms / 1e3 + 0.001
    assert speed.delay_us() == 0.0 and speed.slowdown() == 1.0 and speed.fresh() == []


class IdleGpu:
    """An idle GPU as the H100 showed it (BENCHMARKS.md, P9, 2026-11-24): a batch costs its
    calibrated latency right after another, ``wake_us`` more once the GPU has been left alone
    for ``wake_s`` (batches 7 ms apart paid ~200 µs against 30 back to back)."""

    def __init__(self, wake_s: float = 0.005, wake_us: float = 170.0):
        self.wake_s, self.wake_us, self.last = wake_s, wake_us, -math.inf

    def run_us(self, pol: P.Policy, batch: int, t: float) -> float:
        us = pol.estimate("gpu", batch) + (self.wake_us if t - self.last >= self.wake_s else 0.0)
        self.last = t
        return us


@pytest.mark.parametrize("probe_idle_ms", [250.0, 1000.0, 5000.0])
def test_an_idle_gpu_is_known_by_several_unwarmed_probes(probe_idle_ms: float) -> None:
    """At idle (no other process on the GPU, no GPU batches of its own) the window must hold
    more than one probe at every moment, whatever the profile's probe_idle_ms, and the probes,
    unwarmed, give the GPU's cost as a lone request finds it. The two misses of the first H100
    run under the mean truth: batch 4 (GPU 257 vs CPU 71 µs) and 64 (278 vs 122), picked for the
    GPU on one warmed probe that said 41 and 62 µs."""
    pol = P.Policy(batches=H100.batches, cpu_us=H100.cpu_us, gpu_us=H100.gpu_us, probe_idle_ms=probe_idle_ms)
    clock, gpu = Clock(), IdleGpu()
    speed = P.GpuSpeed(pol, clock, random.Random(7))
    counts = []
    end = clock.t + 10.0
    while clock.t < end:  # the daemon's loop, as _probe_on_schedule (a probe is one run: test above)
        if speed.probe_due(False):
            speed.observe(pol.probe_batch, gpu.run_us(pol, pol.probe_batch, clock.t))
            speed.probes += 1
        if clock.t > 100.0 + pol.window_ms / 1e3 * 1.01:
            counts.append(len(speed.fresh()))
        clock.t += 0.001
    assert min(counts) >= P.GpuSpeed.MIN_PROBES_IN_WINDOW and speed.probes >= 20
    assert speed.period_s(False) == min(probe_idle_ms, 1000.0 / 3) / 1e3 and speed.period_s(True) == pol.probe_busy_ms / 1e3
    # every probe paid the wake-up, as a lone request does: the mean delay is the wake-up, and
    # batches 4 and 64 go to the CPU, the side faster on average for requests this sparse
    assert speed.delay_us() == pytest.approx(170.0)
    assert [pol.choose(b, True, gpu_delay_us=speed.delay_us()) for b in (4, 64, 1024, 4096)] == ["cpu", "cpu", "gpu", "gpu"]
    # dense traffic on the GPU keeps it warm: its own batches fill the window and the delay falls
    for _ in range(2000):
        speed.observe(64, gpu.run_us(pol, 64, clock.t))
        clock.t += 0.0002
    assert speed.delay_us() < 5.0 and not speed.probe_due(False)


def test_jittered_probes_do_not_lock_onto_the_load_s_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probing exactly once per load period sees the load at one phase only: always idle or always
    busy. Jittered, the same probes see it in proportion to its duty cycle."""
    pol = P.Policy(batches=H100.batches, cpu_us=H100.cpu_us, gpu_us=H100.gpu_us, probe_busy_ms=65.0, window_ms=30_000.0)
    load = DutyLoad(period_s=0.065, busy_s=0.040)
    true_delay = load.wait_us * load.busy_s / load.period_s
    monkeypatch.setattr(P.GpuSpeed, "PROBE_JITTER", 0.0)
    clock = Clock()
    clock.t += 0.050  # starts in the idle part of a period
    locked = P.GpuSpeed(pol, clock, random.Random(4))
    _probe_on_schedule(locked, load, clock, 20.0)
    assert locked.delay_us() < 0.35 * true_delay or locked.delay_us() > 1.4 * true_delay
    monkeypatch.undo()
    clock = Clock()
    clock.t += 0.050
    jittered = P.GpuSpeed(pol, clock, random.Random(5))
    _probe_on_schedule(jittered, load, clock, 20.0)
    assert len(jittered.fresh()) > 200 and jittered.delay_us() == pytest.approx(true_delay, rel=0.15)


def test_measured_cpu_slowdown_moves_the_crossover() -> None:
    """The two misses of the GPU-only measurement (H100, policy phase): the CPU ran ~1.6x slower
    than its calibration at the crossover, and the policy, taking the CPU from the calibration
    alone, kept it. Measured, the CPU's slowdown gives those batches to the GPU."""
    clock = Clock()
    pol = P.Policy(batches=[1, 8, 64, 128, 256, 1024], cpu_us=[5.8, 8.3, 22.0, 48.7, 85.3, 310],
                   gpu_us=[52.0, 52.5, 54.0, 57.0, 58.0, 66.0], window_samples=5)
    cpu, gpu = P.CpuSpeed(pol, clock), P.GpuSpeed(pol, clock)
    for b in (64, 128, 64):
        gpu.observe(b, pol.estimate("gpu", b))  # the GPU as calibrated
    assert gpu.delay_us() == pytest.approx(0.0, abs=1e-9)
    assert pol.choose(128, True, gpu_delay_us=gpu.delay_us(), cpu_fit=cpu.fit()) == "cpu"  # 48.7 < 57
    assert cpu.slowdown() == 1.0 and cpu.fit() == (0.0, 1.0) and cpu.fresh() == [] and cpu.last_seen() is None
    seen = [(32, 24.0), (64, 35.5), (128, 78.0), (16, 19.0), (64, 33.0)]  # ~1.6x slower
    for b, us in seen:
        cpu.observe(b, us)
    # the ratio of the means: the batches' total time over what the curve says for them
    assert cpu.slowdown() == pytest.approx(sum(us for _, us in seen) / sum(pol.estimate("cpu", b) for b, _ in seen))
    slow = cpu.slowdown()
    assert 1.5 < slow < 1.7
    # as a proportional slowdown (b = the ratio, a = 0)
    assert [pol.choose(b, True, gpu_delay_us=gpu.delay_us(), cpu_fit=(0.0, slow)) for b in (8, 64, 128, 256)] == \
        ["cpu", "cpu", "gpu", "gpu"]
    table = pol.cpu_batches(300, True, False, gpu.delay_us(), (0.0, slow))
    assert [bool(v) for v in table[1:]] == [pol.choose(b, True, False, gpu.delay_us(), (0.0, slow)) == "cpu"
                                            for b in range(1, 301)]
    moved = int(np.argmin(table))
    assert table[:moved].all() and not table[moved:].any() and 90 <= moved <= 105  # from batch 157
    assert pol.cpu_batches(300, True, False, gpu.delay_us())[:157].all()
    # an outlier counts (a producer waits for it too); only the last window_samples are kept, and
    # the running sums are those of the samples kept; old samples age out to the calibration
    cpu.observe(8, pol.estimate("cpu", 8) * 50)
    kept = list(cpu.samples)
    assert len(kept) == pol.window_samples and kept[0][1] == 35.5
    assert cpu.slowdown() == pytest.approx(sum(s[1] for s in kept) / sum(s[2] for s in kept)) and cpu.slowdown() > slow
    assert cpu.last_seen() == clock.t
    clock.t += pol.window_ms / 1e3 + 0.001
    assert cpu.slowdown() == 1.0 and cpu.fresh() == [] and cpu._sum_us == cpu._sum_cal == cpu._sum_cal2 == 0.0
    assert cpu.fit() == (0.0, 1.0) and pol.choose(128, True, gpu_delay_us=gpu.delay_us(), cpu_fit=cpu.fit()) == "cpu"
    # a failed batch makes the side infinitely slow while it is in the window
    gpu.observe(64, math.inf)
    assert gpu.delay_us() == math.inf and gpu.slowdown() == math.inf
    assert pol.choose(4096, True, gpu_delay_us=gpu.delay_us()) == "cpu"
    gpu.reset()
    assert gpu.delay_us() == 0.0 and len(gpu.samples) == 0
    # without a calibration there is nothing to compare with, and the measurements are not kept
    lake = P.CpuSpeed(P.Policy(), clock)
    lake.observe(8, 100.0)
    assert len(lake.samples) == 0 and lake.slowdown() == 1.0
    cpu.observe(0, 10.0)
    cpu.observe(8, 0.0)
    cpu.observe(8, pol.estimate("cpu", 8) * 50)
    assert cpu.fresh() == [pytest.approx(50.0)]  # empty or zero-time batches are not samples
    assert P.CpuSpeed(pol).side == "cpu" and P.GpuSpeed(pol).side == "gpu"
    with pytest.raises(ValueError):
        P.Speed(pol, "tpu")


def test_probe_schedule_and_probe() -> None:
    clock = Clock()
    speed = P.GpuSpeed(H100, clock, random.Random(0))
    assert speed.probe_due(False)  # nothing measured yet
    calls = []

    def forward(x: np.ndarray) -> np.ndarray:
        calls.append(x.shape)
        # the GPU's wake-up: the first run after 100 ms without one is slow (as an idle H100's is)
        if clock.t - getattr(forward, "last", -math.inf) >= 0.1:
            time.sleep(0.02)
        forward.last = clock.t
        return np.zeros((len(x), 2), dtype=np.float32)

    us = speed.probe(forward)
    # one run, timed, as a request's would be: the GPU not used yet, so the wake-up is in the figure
    assert calls == [(H100.probe_batch, 31)] and us >= 20_000 and speed.probes == 1 and speed.last_seen() == clock.t
    assert speed.delay_us() == pytest.approx(us - H100.estimate("gpu", H100.probe_batch))
    clock.t += H100.probe_busy_ms / 1e3 * (1 - P.GpuSpeed.PROBE_JITTER) - 1e-6
    assert not speed.probe_due(True)  # never before the shortest interval
    clock.t += H100.probe_busy_ms / 1e3 * 2 * P.GpuSpeed.PROBE_JITTER + 2e-6
    assert speed.probe_due(True) and not speed.probe_due(False)  # another process on the GPU: probe sooner
    assert speed.probe(forward) < 20_000  # the GPU used 20 ms ago: no wake-up to pay
    assert len(calls) == 2 and speed.probes == 2
    clock.t += max(H100.probe_idle_ms / 1e3 * (1 + P.GpuSpeed.PROBE_JITTER), 0.101)  # past the fake wake-up threshold
    assert speed.probe_due(False)
    assert speed.probe(forward) >= 20_000  # idle since: still one run, and it pays the wake-up
    assert len(calls) == 3 and speed.probes == 3 and speed.last_probe_us == speed.samples[-1][1]
    speed.observe(64, 40.0)  # a batch the daemon ran on the GPU counts as a measurement too
    assert not speed.probe_due(True)
    assert not P.GpuSpeed(P.Policy(), clock).probe_due(True)  # no calibration: nothing to compare with
    # the intervals are drawn afresh after each measurement, within the jitter
    waits = []
    for _ in range(200):
        start = clock.t
        while not speed.probe_due(True):
            clock.t += 1e-4
        waits.append(clock.t - start)
        speed.observe(64, 40.0)
    lo, hi = (H100.probe_busy_ms / 1e3 * (1 + k * P.GpuSpeed.PROBE_JITTER) for k in (-1, 1))
    assert lo - 1e-3 <= min(waits) < lo + 2e-3 and hi - 2e-3 < max(waits) <= hi + 1e-3 and len(set(waits)) > 50


def test_gpu_load_sampling_with_stubbed_nvml() -> None:
    class Proc:
        def __init__(self, pid: int):
            self.pid = pid

    class Nvml:
        util = 90
        procs = [Proc(os.getpid()), Proc(1)]

        def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
            return i

        def nvmlDeviceGetUtilizationRates(self, h: int):
            return type("U", (), {"gpu": self.util})()

        def nvmlDeviceGetComputeRunningProcesses(self, h: int):
            return self.procs

    nv = Nvml()
    load = P.GpuLoad(P.Policy(busy_util=70, busy_procs=1), nvml=nv)
    load.sample()
    assert load.busy and load.others == 1
    nv.procs = [Proc(os.getpid())]
    load.sample()
    assert not load.busy
    nv.procs, nv.util = [Proc(1)], 50
    load.sample()
    assert not load.busy


def test_profile_round_trip_and_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuos_tools.kinfer import calibrate as C

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # no profile of the user's own
    shipped = P.load_profile("linnos")
    assert shipped.section("model")["inputs"] == 31 and shipped.model_file() == REPO / "gpuos_tools" / "profiles" / "linnos.npz"
    path = tmp_path / "p.toml"
    path.write_text((REPO / "gpuos_tools" / "profiles" / "linnos.toml").read_text())
    prof = P.load_profile(str(path))
    result = C.measure(prof, [1, 4], 3)
    assert len(result["cpu_us"]) == 2 and all(v > 0 for v in result["cpu_us"])
    result["gpu_us"] = [100.0, 1.0]  # as a GPU machine would report it
    result["crossover"] = P.crossover(result["batches"], result["cpu_us"], result["gpu_us"])
    P.write_profile(path, C.updated_profile(prof, result), C.PROFILE_COMMENT)
    again = P.load_profile(str(path))
    pol = again.policy()
    assert pol.calibrated and pol.cpu_below == 4 and pol.gpu_us == [100.0, 1.0]
    assert again.section("ring") == shipped.section("ring")
    assert P.dump_profile({"t": {"s": 'a"b\\', "l": [1, 2.5], "b": True}}) == '[t]\ns = "a\\"b\\\\"\nl = [1, 2.5]\nb = true\n'
    path.write_text("[policy]\nbogus = 1\n")
    with pytest.raises(Exception, match="unknown keys"):
        P.load_profile(str(path))
    # profiles from before the measured slowdown, and from before the mean over a window
    path.write_text("[policy]\nbusy_factor = 4.0\ncpu_below = 9\nslowdown_samples = 5\nslowdown_max_age_ms = 2000.0\n")
    old = P.load_profile(str(path))
    assert old.policy().cpu_below == 9 and not {"busy_factor", "slowdown_samples"} & set(old.section("policy"))
    assert old.policy().window_ms == P.DEFAULTS["policy"]["window_ms"]
    assert old.section("native") == P.DEFAULTS["native"]


def test_cli_infer_and_status(ring_name: str) -> None:
    proc = _daemon(ring_name, "--random-model", "2")
    try:
        x = (np.arange(31) % 10).tolist()
        done = subprocess.run([*BRIDGE, "infer", "--ring", ring_name], env=child_env(), capture_output=True, text=True,
                              timeout=60, input=json.dumps({"type": "q", "x": x}) + "\n" + '{"type":"other"}\n')
        assert done.returncode == 0, done.stderr
        recs = [json.loads(line) for line in done.stdout.splitlines()]
        assert [r["type"] for r in recs] == ["header", "q", "kinfer_answer", "other"]
        want = M.Mlp.random(seed=2).forward(np.array([x], dtype=np.float32))[0]
        assert recs[2]["status"] == "ok" and np.allclose(recs[2]["outputs"], want, rtol=1e-5, atol=1e-4)
        st = subprocess.run([*BRIDGE, "status", "--ring", ring_name], env=child_env(), capture_output=True, text=True, timeout=60)
        rec = json.loads(st.stdout.splitlines()[-1])
        assert rec["daemon_pid"] == proc.pid and rec["daemon_alive"] and rec["counters"]["served"] == 1
    finally:
        _stop(proc)
    gone = subprocess.run([*BRIDGE, "status", "--ring", ring_name + "-none"], env=child_env(), capture_output=True, text=True, timeout=60)
    assert gone.returncode == 66 and "no such ring" in gone.stderr


# -- the native path ---------------------------------------------------------------------------

native_only = pytest.mark.skipif(CC is None, reason="no C compiler: the native path cannot be built")


def _native_server(name: str, model: M.Mlp | None = None, policy: P.Policy | None = None, **opts: object) -> S.RingServer:
    srv = S.RingServer.open(name, R.Geometry(4, 4), model or M.Mlp.random(seed=3), policy or P.Policy(),
                        S.ServeOptions(use_gpu="off", native="on", **opts), recreate=True, log=lambda m: None)
    assert srv.native is not None
    return srv


class _Serving:
    """``srv.serve()`` in a thread for the length of a with-block."""

    def __init__(self, srv: S.RingServer):
        import threading

        self.srv = srv
        srv.stop.clear()
        self.thread = threading.Thread(target=srv.serve, daemon=True)

    def __enter__(self) -> S.RingServer:
        self.thread.start()
        return self.srv

    def __exit__(self, *exc: object) -> None:
        self.srv.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


def _until(cond, what: str, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.001)


@native_only
@pytest.mark.parametrize("kind", ["generic", "avx2"])
@pytest.mark.parametrize("shape", [(31, 256, 2), (5, 64, 3), (32, 100, 4), (1, 8, 1), (31, 48, 2)])
def test_native_model_gives_the_numpy_outputs(shape: tuple[int, int, int], kind: str) -> None:
    from gpuos_tools.kinfer import native as N

    lib = N.library()
    best = lib.kn_forward_kind()
    if kind == "avx2" and lib.kn_use_forward(1) != 1:
        pytest.skip("no AVX2+FMA on this CPU")
    if kind == "generic":
        assert lib.kn_use_forward(0) == 0
    try:
        _check_native_model(shape)
    finally:
        lib.kn_use_forward(best)


def _check_native_model(shape: tuple[int, int, int]) -> None:
    from gpuos_tools.kinfer import native as N

    model = M.Mlp.random(*shape, seed=sum(shape))
    rng = np.random.default_rng(1)
    for x in (rng.integers(0, 10, (300, shape[0])).astype(np.float32), rng.normal(0, 3, (300, shape[0])).astype(np.float32)):
        got, want = N.native_forward(model, x), model.forward(x)
        assert got.shape == want.shape
        assert np.allclose(got, want, rtol=1e-5, atol=1e-4 * max(1.0, float(np.abs(want).max())))
        if shape[2] > 1:
            margin = np.sort(want, axis=1)[:, -1] - np.sort(want, axis=1)[:, -2]
            clear = margin > 1e-3
            assert np.array_equal(got.argmax(1)[clear], want.argmax(1)[clear])


@native_only
def test_native_path_answers_and_hands_bad_batches_to_python(ring_name: str) -> None:
    model = M.Mlp.random(seed=5)
    srv = _native_server(ring_name, model)
    try:
        ring = srv.ring
        good = np.arange(31, dtype=np.float32) % 7
        nan = good.copy()
        nan[3] = np.nan
        want = model.forward(good[None])[0]
        for k, entry in enumerate([dict(), dict(version=9), dict(n=5), dict(model_id=4), dict(x=nan), dict()]):
            x = entry.pop("x", good)
            _put(ring, k, x, **entry)
        with _Serving(srv):
            _until(lambda: (ring.state[:6] == R.DONE).all(), "the mixed batch answered")
            assert list(ring.meta["status"][:6]) == [R.OK, R.BAD_VERSION, R.BAD_SIZE, R.BAD_MODEL, R.BAD_VALUE, R.OK]
            assert srv.native.stats()["handed_batches"] >= 1
            for slot in (0, 5):
                assert np.allclose(ring.outputs[slot, :2], want, rtol=1e-5)
            # clean requests now: the C loop answers them itself
            for slot in range(8, 12):
                _put(ring, slot, good)
            _until(lambda: (ring.state[8:12] == R.DONE).all(), "the clean batch answered")
            assert srv.native.stats()["native_served"] >= 4
            assert (ring.meta["status"][8:12] == R.OK).all() and (ring.meta["where"][8:12] == R.CPU).all()
            assert np.allclose(ring.outputs[8:12, :2], want, rtol=1e-5, atol=1e-4)
            assert (ring.meta["decision"][8:12] == np.argmax(want)).all()
            assert (ring.meta["answer_seq"][8:12] == 1000 + np.arange(8, 12)).all()
        c = ring.counter_values()
        assert (c["served"], c["drop_bad_version"], c["drop_bad_size"], c["drop_bad_model"], c["drop_bad_value"]) == (6, 1, 1, 1, 1)
    finally:
        srv.close()


@native_only
def test_native_path_reclaims_a_dead_producers_slot(ring_name: str) -> None:
    srv = _native_server(ring_name)
    try:
        code = (
            "import os\n"
            "from gpuos_tools.kinfer import ring as R\n"
            f"c = R.RingClient({ring_name!r})\n"
            "c._state[c._first] = R.WRITING\n"
            "c.ring.meta32[c._first, R.M32['producer_pid']] = os.getpid()\n"
            "print(c._first, flush=True)\n"
            "os._exit(0)\n"
        )
        with _Serving(srv):
            done = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60)
            slot = int(done.stdout)
            _until(lambda: srv.ring.counter_values()["drop_abandoned"] == 1, "the abandoned slot counted")
            assert srv.ring.state[slot] == R.FREE
            with R.RingClient(ring_name) as client:
                assert client.infer(np.arange(31) % 10).ok
    finally:
        srv.close()


@native_only
def test_native_hot_swap_never_mixes_models(ring_name: str, tmp_path: Path) -> None:
    a, b = M.Mlp.random(seed=1), M.Mlp.random(seed=2)
    b.save(tmp_path / "b.npz")
    a.save(tmp_path / "a.npz")
    srv = _native_server(ring_name, a, model_dirs=(str(tmp_path),))
    x = np.arange(31, dtype=np.float32) % 10
    ya, yb = a.forward(x[None])[0], b.forward(x[None])[0]
    try:
        with _Serving(srv), R.RingClient(ring_name) as client:
            seen = []
            for k in range(6):
                path = tmp_path / ("b.npz" if k % 2 == 0 else "a.npz")
                ring = client.ring
                seq = (int(ring.header["control_seq"]) + 1) & 0xFFFFFFFF
                ring.header["control_path"] = str(path).encode()
                ring.header["control_model_id"] = 0
                ring.header["control_seq"] = seq
                while int(ring.header["control_ack"]) != seq:  # requests keep flowing during the swap
                    seen.append(client.infer(x).outputs)
                assert int(ring.header["control_status"]) == 0
                after = client.infer(x).outputs  # sent after the ack: the new model answers
                assert np.allclose(after, yb if path.name == "b.npz" else ya, rtol=1e-5, atol=1e-4)
            for y in seen:  # each answer is entirely one model's
                assert np.allclose(y, ya, rtol=1e-5, atol=1e-4) or np.allclose(y, yb, rtol=1e-5, atol=1e-4)
            assert client.ring.counter_values()["model_swaps"] == 6
        assert srv.native.release() == 0  # the thread is stopped: no old weights held any more
        assert set(srv.native.installed) == {0} and srv.native.installed[0].model is srv.models[0].model
    finally:
        srv.close()


class _FakeGpu:
    """A stand-in GPU backend (numpy), to test which side the daemon picks without a GPU."""

    def __init__(self, model: M.Mlp):
        self.model = model
        self.batches: list[int] = []

    def forward(self, x: np.ndarray) -> np.ndarray:
        self.batches.append(len(x))
        return self.model.forward(x)


@native_only
def test_native_loop_leaves_gpu_batches_to_python_by_the_measured_delay(ring_name: str) -> None:
    model = M.Mlp.random(seed=4)
    pol = P.Policy(batches=[1, 4, 16], cpu_us=[5, 20, 80], gpu_us=[10, 10, 10], probe_idle_ms=1e9, window_ms=1e9)
    srv = _native_server(ring_name, model, pol)
    fake = _FakeGpu(model)
    srv.models[0].gpu = fake
    srv.gpu_ready = True
    srv.speed.observe(4, 10.0)  # measured as calibrated: no probe due, GPU from batch 3 on
    srv._refresh_policy(force=True)
    x = np.random.default_rng(2).integers(0, 10, (8, 31)).astype(np.float32)
    try:
        for i in range(8):
            _put(srv.ring, i, x[i])
        with _Serving(srv):
            _until(lambda: (srv.ring.state[:8] == R.DONE).all(), "batch of 8")
        assert (srv.ring.meta["where"][:8] == R.GPU).all() and fake.batches == [8]
        assert srv.ring.counter_values()["gpu_batches"] == 1
        for _ in range(5):  # the GPU is now measured 100x slower than calibrated
            srv.speed.observe(4, 1000.0)
        srv._refresh_policy()
        for i in range(8):
            _put(srv.ring, i, x[i])
        with _Serving(srv):
            _until(lambda: (srv.ring.state[:8] == R.DONE).all(), "batch of 8 again")
        assert (srv.ring.meta["where"][:8] == R.CPU).all() and fake.batches == [8]
        assert srv.native.stats()["native_served"] == 8
        assert np.allclose(srv.ring.outputs[:8, :2], model.forward(x), rtol=1e-5, atol=1e-4)
    finally:
        srv.close()


def test_without_a_compiler_the_daemon_says_so_and_serves_in_python(ring_name: str, tmp_path: Path) -> None:
    env = child_env(CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = _daemon(ring_name, "--random-model", "3", env=env)
    try:
        with R.RingClient(ring_name) as client:
            x = np.arange(31) % 10
            answer = client.infer(x)
            assert answer.ok and np.allclose(answer.outputs, M.Mlp.random(seed=3).forward(x[None].astype(np.float32))[0])
    finally:
        out, err = _stop(proc)
    assert b"native path off" in err and b"no-such-cc" in err and b"Python loop" in err
    assert json.loads(out.decode().splitlines()[-1])["native"] is False
    refused = subprocess.run([*BRIDGE, "serve", "--ring", ring_name, "--gpu", "off", "--random-model", "3", "--native", "on"],
                             env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "--native on" in refused.stderr


@pytest.mark.parametrize("path", ["small", "vector"])
def test_python_loop_picks_by_the_measured_delay_and_feeds_it(ring_name: str, path: str) -> None:
    model = M.Mlp.random(seed=8)
    pol = P.Policy(batches=[1, 4, 16], cpu_us=[5, 20, 80], gpu_us=[10, 10, 10], window_ms=1e9)
    srv = S.RingServer.open(ring_name, R.Geometry(4, 4), model, pol, S.ServeOptions(use_gpu="off", native="off"), recreate=True,
                        log=lambda m: None)
    fake = _FakeGpu(model)
    srv.models[0].gpu = fake
    srv.gpu_ready = True
    x = np.random.default_rng(3).integers(0, 10, (8, 31)).astype(np.float32)
    run = srv.process_small if path == "small" else (lambda slots: srv.process(np.array(slots)))
    try:
        assert srv.native is None
        for i in range(8):
            _put(srv.ring, i, x[i])
        run(srv.ready_slots())  # no measurement yet: the calibration as it stands, GPU from batch 3
        assert (srv.ring.meta["where"][:8] == R.GPU).all() and fake.batches == [8]
        assert len(srv.speed.samples) == 1  # the daemon measured its own GPU batch
        srv.speed.reset()
        for _ in range(3):
            srv.speed.observe(8, 500.0)  # 50x slower than calibrated
        srv._refresh_policy()
        for i in range(8):
            _put(srv.ring, i, x[i])
        run(srv.ready_slots())
        assert (srv.ring.meta["where"][:8] == R.CPU).all() and fake.batches == [8]
        assert np.allclose(srv.ring.outputs[:8, :2], model.forward(x), rtol=1e-5, atol=1e-4)
        c = srv.ring.counter_values()
        assert (c["gpu_batches"], c["cpu_batches"], c["served"]) == (1, 1, 16)
    finally:
        srv.close()


@pytest.mark.parametrize("path", ["small", "vector"])
def test_python_loop_times_its_cpu_batches_and_picks_by_the_cpu_slowdown(ring_name: str, path: str) -> None:
    model = M.Mlp.random(seed=9)
    # calibrated: a batch of 2 takes 10 µs on the CPU, 12 on the GPU
    pol = P.Policy(batches=[1, 4, 16], cpu_us=[5, 20, 80], gpu_us=[12, 12, 12], window_ms=1e9)
    srv = S.RingServer.open(ring_name, R.Geometry(4, 4), model, pol, S.ServeOptions(use_gpu="off", native="off"), recreate=True,
                        log=lambda m: None)
    x = np.random.default_rng(4).integers(0, 10, (2, 31)).astype(np.float32)
    run = srv.process_small if path == "small" else (lambda slots: srv.process(np.array(slots)))

    def serve_two() -> None:
        for i in range(2):
            _put(srv.ring, i, x[i])
        run(srv.ready_slots())
        assert np.allclose(srv.ring.outputs[:2, :2], model.forward(x), rtol=1e-5, atol=1e-4)

    try:
        serve_two()  # no GPU: nothing to choose between, so nothing is timed
        assert (srv.ring.meta["where"][:2] == R.CPU).all() and len(srv.cpu_speed.samples) == 0
        fake = _FakeGpu(model)
        srv.models[0].gpu = fake
        srv.gpu_ready = True
        serve_two()  # the calibration as it stands: CPU
        assert (srv.ring.meta["where"][:2] == R.CPU).all() and fake.batches == []
        assert len(srv.cpu_speed.samples) == 1 and len(srv.speed.samples) == 0  # the daemon timed its own CPU batch
        assert srv._cpu_fit == srv.cpu_speed.fit()
        assert srv.cpu_speed.fit()[1] == 1.0 and srv.cpu_speed.fit()[0] == pytest.approx(srv.cpu_speed.samples[0][1] - 10.0)
        srv.cpu_speed.reset()
        for _ in range(3):
            srv.cpu_speed.observe(2, 30.0)  # 3x slower than calibrated
        srv._refresh_policy()
        serve_two()
        assert (srv.ring.meta["where"][:2] == R.GPU).all() and fake.batches == [2]
        assert len(srv.cpu_speed.samples) == 3 and len(srv.speed.samples) == 1  # a GPU batch feeds the GPU's estimate
        c = srv.ring.counter_values()
        assert (c["gpu_batches"], c["cpu_batches"], c["served"]) == (1, 2, 6)
    finally:
        srv.close()


@native_only
def test_native_loop_table_follows_the_cpu_slowdown(ring_name: str) -> None:
    model = M.Mlp.random(seed=10)
    pol = P.Policy(batches=[1, 4, 16], cpu_us=[5, 20, 80], gpu_us=[12, 12, 12], probe_idle_ms=1e9, window_ms=1e9)
    srv = _native_server(ring_name, model, pol)
    fake = _FakeGpu(model)
    srv.models[0].gpu = fake
    srv.gpu_ready = True
    srv.speed.observe(4, 12.0)  # the GPU measured as calibrated: no probe due
    srv._refresh_policy(force=True)
    x = np.random.default_rng(5).integers(0, 10, (2, 31)).astype(np.float32)
    try:
        for i in range(2):
            _put(srv.ring, i, x[i])
        with _Serving(srv):
            _until(lambda: (srv.ring.state[:2] == R.DONE).all(), "batch of 2")
        assert (srv.ring.meta["where"][:2] == R.CPU).all() and fake.batches == []
        assert srv.native.stats()["native_served"] == 2
        assert len(srv.cpu_speed.samples) == 0  # the C loop's own batches are not timed
        for _ in range(3):
            srv.cpu_speed.observe(2, 30.0)  # the CPU measured 3x slower than calibrated
        srv._refresh_policy()
        for i in range(2):
            _put(srv.ring, i, x[i])
        with _Serving(srv):
            _until(lambda: (srv.ring.state[:2] == R.DONE).all(), "batch of 2 again")
        assert (srv.ring.meta["where"][:2] == R.GPU).all() and fake.batches == [2]
        assert srv.native.stats()["native_served"] == 2
        assert np.allclose(srv.ring.outputs[:2, :2], model.forward(x), rtol=1e-5, atol=1e-4)
    finally:
        srv.close()


def test_steady_curve_keeps_each_batch_s_best_pass() -> None:
    """A batch that is slow in one sweep only (a GPU waking up) gets its steady figure; every
    pass starts with work at the largest batch, and the sweeps alternate direction."""
    from gpuos_tools.kinfer.policy import steady_curve

    calls: list[int] = []
    slow_once = {8: 1}

    def run(batch: int):
        def fn() -> None:
            calls.append(batch)
            if slow_once.get(batch) and len([c for c in calls if c == batch]) <= 3:
                time.sleep(0.003)  # the first pass of batch 8: 3 ms a call

        return fn

    curve = steady_curve(run, [1, 8, 64], reps=3, passes=2, warm_s=0.0, warmup=0)
    assert curve[1] < 1000, curve  # µs: the slow pass is not the one kept
    timed = [c for c in calls if c != 64]
    assert timed[:6] == [1, 1, 1, 8, 8, 8] and timed[6:] == [8, 8, 8, 1, 1, 1]


# the calibration of the 2026-11-24 run 2 on the H100 (BENCHMARKS.md, P9): a CPU batch run alone paid
# a roughly fixed extra over these back-to-back figures (47 µs at batch 1, 77 at 64, 87 at 128, 98 at 256)
RUN2 = P.Policy(batches=[1, 4, 16, 64, 128, 256, 1024, 4096], cpu_us=[5.176, 6.343, 9.074, 20.934, 43.019, 78.47, 302.548, 1685.751],
                gpu_us=[33.038, 33.12, 31.837, 32.514, 33.1, 33.904, 41.539, 79.551])


def _feed(cpu: P.CpuSpeed, clock: Clock, sizes: list[int], measured: Callable[[float], float]) -> None:
    """One CPU batch per ms, sizes in turn, each taking ``measured(calibrated µs)``."""
    for b in sizes:
        cpu.observe(b, measured(cpu.policy.estimate("cpu", b)))
        clock.t += 0.001


def test_cpu_isolation_overhead_is_fixed_not_proportional() -> None:
    """Run 2's idle miss at batch 128: the window held batch-64 CPU batches at 98 µs (21 calibrated),
    a ratio of 4.7 that made batch 128 cost 201 µs where it took 130, and the GPU (33 + 125 µs of
    probe delay) got it. Taken as the fixed extra it is (one batch size in the window: b = 1), the
    CPU's 120 µs keeps it."""
    clock = Clock()
    cpu = P.CpuSpeed(RUN2, clock)
    _feed(cpu, clock, [64] * 140, lambda cal: cal + 77.0)
    a, b = cpu.fit()
    assert b == 1.0 and a == pytest.approx(77.0)
    assert cpu.slowdown() == pytest.approx(98.0 / 20.934, rel=1e-3)  # the ratio, still reported
    cpu_128 = a + b * RUN2.estimate("cpu", 128)
    assert cpu_128 == pytest.approx(120.0, abs=0.1)  # true mean 130
    assert RUN2.choose(128, True, gpu_delay_us=125.0, cpu_fit=cpu.fit()) == "cpu"
    assert RUN2.choose(128, True, gpu_delay_us=125.0, cpu_fit=(0.0, cpu.slowdown())) == "gpu"  # run 2's pick
    # batches of several sizes each paying the same fixed extra: the line through them has slope 1
    cpu.reset()
    rng = random.Random(3)
    _feed(cpu, clock, [rng.choice([1, 4, 16, 64, 128, 256]) for _ in range(300)], lambda cal: cal + 60.0 + rng.gauss(0, 5))
    a, b = cpu.fit()
    assert b == pytest.approx(1.0, abs=0.05) and a == pytest.approx(60.0, abs=3.0)
    # so a big batch is not charged the small ones' ratio (~4): 1024 stays with the GPU at ~360 µs
    assert a + b * RUN2.estimate("cpu", 1024) == pytest.approx(362.0, rel=0.05)
    assert RUN2.choose(1024, True, gpu_delay_us=200.0, cpu_fit=cpu.fit()) == "gpu"


def test_cpu_contention_is_proportional() -> None:
    """Another process on the daemon's core makes every CPU batch 2.5x slower: over a window of
    several sizes the fit is the ratio (a = 0, b = 2.5), and with a fixed isolation extra on top
    (2 x curve + 50 µs) both parts are recovered — where the ratio of the means, learnt from
    small batches (6.9x), would charge a large one far more than it pays."""
    clock = Clock()
    cpu = P.CpuSpeed(RUN2, clock)
    sizes = [1, 4, 8, 16, 32, 64, 128, 256] * 30
    _feed(cpu, clock, sizes, lambda cal: 2.5 * cal)
    a, b = cpu.fit()
    assert b == pytest.approx(2.5) and a == pytest.approx(0.0, abs=1e-6)
    assert a + b * RUN2.estimate("cpu", 1024) == pytest.approx(2.5 * RUN2.estimate("cpu", 1024))
    # both at once, from the small batches the CPU gets picked for
    cpu.reset()
    _feed(cpu, clock, [1, 4, 8, 16, 32, 64] * 30, lambda cal: 2.0 * cal + 50.0)
    a, b = cpu.fit()
    assert (a, b) == (pytest.approx(50.0), pytest.approx(2.0))
    ratio = cpu.slowdown()
    assert ratio > 6.5
    true_256 = 2.0 * RUN2.estimate("cpu", 256) + 50.0  # 207 µs against the GPU's 34 + 200
    assert RUN2.choose(256, True, gpu_delay_us=200.0, cpu_fit=cpu.fit()) == "cpu"
    assert true_256 < RUN2.estimate("gpu", 256) + 200.0
    assert RUN2.choose(256, True, gpu_delay_us=200.0, cpu_fit=(0.0, ratio)) == "gpu"  # the ratio's wrong pick
    # the C loop's table follows the same line
    table = RUN2.cpu_batches(300, True, False, 200.0, cpu.fit())
    assert [bool(v) for v in table[1:]] == [RUN2.choose(b, True, False, 200.0, cpu.fit()) == "cpu" for b in range(1, 301)]


def test_cpu_fit_bounds_and_window() -> None:
    """The slope stays between 1 (all fixed) and the ratio of the means (all proportional), so the
    line always passes through the means; too few samples, or one size, give b = 1; the running
    sums are those of the samples still in the window; a failed batch makes the CPU infinitely
    slow while it is there."""
    clock = Clock()
    pol = P.Policy(batches=[1, 1000], cpu_us=[10.0, 10000.0], gpu_us=[50.0, 60.0])  # CPU: 10 µs x batch
    cpu = P.CpuSpeed(pol, clock)
    assert cpu.fit() == (0.0, 1.0)
    _feed(cpu, clock, [1, 5] * 3, lambda cal: 100.0 if cal < 20 else 90.0)  # 6 samples: too few for a slope
    assert cpu.fit() == (pytest.approx(95.0 - 30.0), 1.0)
    _feed(cpu, clock, [1, 5], lambda cal: 100.0 if cal < 20 else 90.0)  # 8: a slope, negative, kept at 1
    assert cpu.fit() == (pytest.approx(65.0), 1.0)
    cpu.reset()
    _feed(cpu, clock, [1, 5] * 4, lambda cal: 10.0 if cal < 20 else 200.0)  # slope 4.75 > ratio 3.5
    assert cpu.fit() == (pytest.approx(0.0, abs=1e-9), pytest.approx(3.5))
    cpu.reset()
    _feed(cpu, clock, [4, 5] * 10, lambda cal: 3.0 * cal)  # spread 0.11 < FIT_MIN_SPREAD: b = 1
    assert cpu.fit() == (pytest.approx(3.0 * 45.0 - 45.0), 1.0)
    # a CPU faster than its calibration: b between the ratio (< 1) and 1
    cpu.reset()
    _feed(cpu, clock, [1, 10, 100] * 4, lambda cal: 0.5 * cal)
    assert cpu.fit() == (pytest.approx(0.0, abs=1e-9), pytest.approx(0.5))
    # the window: what aged out is out of the sums, and the fit is a least-squares line of the rest
    cpu.reset()
    rng = random.Random(7)
    _feed(cpu, clock, [rng.choice([1, 3, 10, 30, 100]) for _ in range(2000)], lambda cal: 1.5 * cal + 40 + rng.gauss(0, 20))
    fit = cpu.fit()  # expires what is older than the window
    kept = list(cpu.samples)
    assert len(kept) < 2000  # 1 ms apart: a 1 s window holds ~1000
    cal = np.array([s[2] for s in kept])
    us = np.array([s[1] for s in kept])
    slope, icpt = np.polyfit(cal, us, 1)
    assert fit == (pytest.approx(icpt, rel=1e-6), pytest.approx(slope, rel=1e-6))
    cpu.observe(10, math.inf)
    assert cpu.fit() == (math.inf, 1.0) and pol.choose(1, True, cpu_fit=cpu.fit()) == "gpu"
    clock.t += pol.window_ms / 1e3 + 0.01
    assert cpu.fit() == (0.0, 1.0) and cpu._sum_cal2 == cpu._sum_cal_us == 0.0


def test_idle_gpu_delay_is_the_mean_of_enough_probes() -> None:
    """Run 2's idle GPU delays came from 3 to 5 probes each: 125 to 344 µs where isolated batches
    paid 181 to 215 more than calibrated. With probes that pay 190 µs +- 80 (an isolated batch on
    the idle H100), the default idle period fills the 1 s window with enough of them that the
    delay stays within 50 µs of the truth, and batch 256 (CPU 78 + 87 µs) stays on the CPU."""
    clock = Clock()
    rng = random.Random(11)
    idle = DutyLoad(busy_s=0.0)
    idle.gpu_us = lambda pol, b, t: pol.estimate("gpu", b) + max(20.0, rng.gauss(190.0, 80.0))  # type: ignore[method-assign]
    speed = P.GpuSpeed(RUN2, clock, random.Random(12))
    _probe_on_schedule(speed, idle, clock, 1.5, others=False)
    worst = 0.0
    for _ in range(100):  # 100 moments, 0.3 s apart
        _probe_on_schedule(speed, idle, clock, 0.3, others=False)
        assert len(speed.fresh()) >= 11
        worst = max(worst, abs(speed.delay_us() - 190.0))
        assert RUN2.choose(256, True, gpu_delay_us=speed.delay_us(), cpu_fit=(87.0, 1.0)) == "cpu"
    assert worst < 60.0


def test_a_failed_batch_makes_the_stats_null_not_infinite() -> None:
    """While a failed GPU batch is in the window the delay is infinite; the kinfer_stats record
    says null (JSON has no infinity), and a finite estimate is kept, rounded."""
    from gpuos_tools.commands.kinfer import _measured

    clock = Clock()
    speed = P.GpuSpeed(H100, clock, random.Random(5))
    speed.observe(64, float("inf"))
    assert speed.delay_us() == float("inf") and _measured(speed.delay_us(), 3) is None
    assert _measured(1483.25049, 3) == 1483.25
