"""The kinfer ring as a security boundary: what any process that can write the ring (or plant a
file where it will be) may try, and what a second user may try against a daemon of another.

Each case the hardening review reported is a test here: a WRITING slot whose producer_pid is
2^31 or more, a ring cut short under the daemon, a ring pre-created by another user, a planted
model or a FIFO named in the control block, `serve --recreate` over a file that is not a ring.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, child_env
from other_user import Stranger, StrangerFailed, in_child, need_root, unused_id

from gpuos_tools.errors import ExitCode
from gpuos_tools.kinfer import guard as G
from gpuos_tools.kinfer import model as M
from gpuos_tools.kinfer import policy as P
from gpuos_tools.kinfer import ring as R
from gpuos_tools.kinfer import server as S

CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
BRIDGE = [sys.executable, str(REPO / "cmd" / "gpu-kinfer-bridge")]
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler: no truncation guard and no native loop")
X = (np.arange(31) % 10).astype(np.float32)


@pytest.fixture
def ring_name() -> Iterator[str]:
    name = f"kinfer-hard-{uuid.uuid4().hex[:10]}"
    yield name
    try:
        R.ring_path(name).unlink()
    except (FileNotFoundError, IsADirectoryError):
        pass


def _server(name: str, *, native: str = "off", model: M.Mlp | None = None, logs: list[str] | None = None,
            **opts: object) -> S.RingServer:
    say = logs.append if logs is not None else (lambda m: None)
    return S.RingServer.open(name, R.Geometry(4, 4), model or M.Mlp.random(seed=3), P.Policy(),
                         S.ServeOptions(use_gpu="off", native=native, **opts), recreate=True, log=say)


def _put(ring: R.Ring, slot: int, x: np.ndarray = X, **fields: int) -> None:
    ring.state[slot] = R.WRITING
    m = ring.meta[slot : slot + 1]
    m["version"], m["model_id"], m["n_inputs"], m["seq"] = R.ENTRY_VERSION, 0, len(x), 1000 + slot
    m["producer_pid"] = os.getpid()
    for k, v in fields.items():
        m[k] = v
    ring.inputs[slot, : len(x)] = x
    ring.state[slot] = R.READY


def _daemon(name: str, *args: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([*BRIDGE, "serve", "--ring", name, "--gpu", "off", *args], env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited {proc.returncode}: {proc.stderr.read().decode()}")
        if R.served_by(name, proc.pid):
            return proc
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("daemon did not start")


def _stop(proc: subprocess.Popen[bytes]) -> tuple[int, str, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out.decode(), err.decode()


def _ask(name: str, tries: float = 10.0) -> R.Answer:
    """One request from a fresh client, retried while the daemon repairs its ring."""
    deadline = time.monotonic() + tries
    while True:
        try:
            with R.RingClient(name) as c:
                return c.infer(X, timeout=2)
        except R.RingError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# -- values out of range in shared memory -----------------------------------------------------------


@pytest.mark.parametrize("native", ["off", "on"])
@pytest.mark.parametrize("pid", [1 << 31, (1 << 32) - 1, R.PID_LIMIT + 1, 0])
def test_a_writing_slot_with_an_impossible_pid_is_reclaimed(ring_name: str, native: str, pid: int) -> None:
    if native == "on" and CC is None:
        pytest.skip("no C compiler")
    srv = _server(ring_name, native=native)
    try:
        srv.ring.state[5] = R.WRITING
        srv.ring.meta32[5, R.M32["producer_pid"]] = pid
        srv.housekeeping()
        assert srv.ring.state[5] == R.FREE and srv.ring.counter_values()["drop_abandoned"] == 1
    finally:
        srv.close()


def test_a_daemon_restarted_on_such_a_ring_serves(ring_name: str) -> None:
    """The same case through the command: the old daemon stayed up, a restart on the ring too."""
    proc = _daemon(ring_name, "--random-model", "1")
    try:
        r = R.Ring.attach(ring_name)
        r.state[9] = R.WRITING
        r.meta32[9, R.M32["producer_pid"]] = 1 << 31
        r.close()
        time.sleep(0.3)  # housekeeping runs every 0.1 s
        assert proc.poll() is None and _ask(ring_name).ok
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        r = R.Ring.attach(ring_name)
        r.state[9] = R.WRITING
        r.meta32[9, R.M32["producer_pid"]] = 0xFFFFFFFF
        r.close()
        proc = _daemon(ring_name, "--random-model", "1")
        assert _ask(ring_name).ok
    finally:
        code, out, err = _stop(proc)
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["drop_abandoned"] >= 1


def test_a_client_takes_any_daemon_pid(ring_name: str) -> None:
    R.Ring.create(ring_name, R.Geometry(2, 2)).close()
    with R.RingClient(ring_name) as c:
        c.ring.header["daemon_pid"] = 0xFFFFFFFF
        assert not c.ring.daemon_alive()
        with pytest.raises(R.RingError, match="daemon pid 4294967295 is gone"):
            c.infer(X, timeout=0.05)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("nslots", 1 << 30, "geometry out of range: 32768 lanes x 32768 slots"),
    ("lanes", 0, "inconsistent slot counts"),
    ("max_inputs", 1 << 30, "geometry out of range"),
    ("meta_offset", 1 << 62, "meta_offset is"),
    ("total_size", 1 << 62, "layout needs"),
])
def test_header_values_out_of_range_are_refused_before_mapping(ring_name: str, field: str, value: int, message: str) -> None:
    ring = R.Ring.create(ring_name, R.Geometry(2, 2))
    if field == "nslots":
        ring.header["lanes"] = 1 << 15
        ring.header["slots_per_lane"] = 1 << 15
    ring.header[field] = value
    ring.close()
    with pytest.raises(R.RingError, match=message):
        R.Ring.attach(ring_name)


def test_a_header_rewritten_while_serving_is_restored(ring_name: str) -> None:
    logs: list[str] = []
    srv = _server(ring_name, logs=logs)
    try:
        srv.ring.header["magic"] = 0
        srv.ring.header["lanes"] = 1
        srv.ring.header["daemon_pid"] = 1
        srv.housekeeping()
        assert R.check_header(bytes(srv.ring.mm[: R.HEADER_SIZE]), srv.ring.size) is None
        assert int(srv.ring.header["daemon_pid"]) == os.getpid()
        assert any("header overwritten" in m for m in logs)
        with R.RingClient(ring_name) as c:  # a producer can attach again
            assert c.ring.geometry == srv.ring.geometry
    finally:
        srv.close()


@needs_cc
def test_the_native_loop_refuses_a_layout_beyond_its_mapping(ring_name: str) -> None:
    from gpuos_tools.kinfer import native

    ring = R.Ring.create(ring_name, R.Geometry(2, 2))
    try:
        lib = native.library()
        assert not lib.kn_create(ring.base, ring.size - 4096, 0, 0, 1)  # the outputs would be past the end
        ring.header["outputs_offset"] = 1 << 40
        assert not lib.kn_create(ring.base, ring.size, 0, 0, 1)
        R.write_header(ring.mm, ring.geometry)
        ring.header["state_offset"] = (1 << 64) - 8  # state_offset + 4 * nslots wraps around 2^64
        ring.header["meta_offset"] = 4096
        assert not lib.kn_create(ring.base, ring.size, 0, 0, 1)
        R.write_header(ring.mm, ring.geometry)
        handle = lib.kn_create(ring.base, ring.size, 0, 0, 1)
        assert handle
        lib.kn_destroy(handle)
    finally:
        ring.close()


# -- the file: type, owner, mode, size --------------------------------------------------------------


def test_a_new_ring_is_private_and_shared_only_on_purpose(ring_name: str) -> None:
    old = os.umask(0)  # a lax umask must not widen it
    try:
        R.Ring.create(ring_name, R.Geometry(2, 2)).close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(R.ring_path(ring_name)).st_mode) == 0o600
    os.umask(0o077)  # nor a strict one narrow a deliberate share
    try:
        R.Ring.create(ring_name, R.Geometry(2, 2), mode=0o660, group=os.getgid()).close()
    finally:
        os.umask(old)
    st = os.stat(R.ring_path(ring_name))
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()


def test_serve_gives_an_adopted_ring_the_mode_asked(ring_name: str) -> None:
    R.Ring.create(ring_name, R.Geometry(4, 4), mode=0o666).close()  # as older daemons made them
    srv = S.RingServer.open(ring_name, R.Geometry(4, 4), M.Mlp.random(seed=1), P.Policy(),
                        S.ServeOptions(use_gpu="off", native="off"), log=lambda m: None)
    try:
        assert stat.S_IMODE(os.fstat(srv.ring.fd).st_mode) == 0o600
    finally:
        srv.close()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_attach_and_serve_refuse_what_is_not_a_ring_file(ring_name: str, tmp_path: Path, kind: str) -> None:
    path = R.ring_path(ring_name)
    target = tmp_path / "target"
    if kind == "symlink":
        R.Ring.create(str(target), R.Geometry(2, 2)).close()
        path.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    try:
        t0 = time.monotonic()
        with pytest.raises(R.RingError, match="symbolic link|not a regular file|cannot open"):
            R.Ring.attach(ring_name)
        for recreate in (False, True):
            with pytest.raises(R.RingError, match="symbolic link|not a regular file|cannot open|not replacing"):
                S.RingServer.open(ring_name, R.Geometry(2, 2), M.Mlp.random(), P.Policy(), S.ServeOptions(use_gpu="off",
                              native="off"), recreate=recreate, log=lambda m: None)
        assert time.monotonic() - t0 < 5  # nothing waited on the FIFO
        assert os.path.lexists(path)
        if kind == "symlink":
            assert R.check_header(target.read_bytes()[: R.HEADER_SIZE], target.stat().st_size) is None  # untouched
    finally:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()


def test_recreate_replaces_only_a_ring(ring_name: str) -> None:
    path = R.ring_path(ring_name)
    path.write_bytes(b"precious data, not a ring\n" * 400)
    done = subprocess.run([*BRIDGE, "serve", "--ring", ring_name, "--random-model", "1", "--gpu", "off", "--recreate"],
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 64 and "not a gpu-kinfer-bridge ring: not replacing it" in done.stderr
    assert path.read_bytes().startswith(b"precious data")
    path.unlink()
    R.Ring.create(ring_name, R.Geometry(2, 3)).close()  # an old ring of another geometry: replaced
    proc = _daemon(ring_name, "--random-model", "1", "--recreate")
    try:
        assert _ask(ring_name).ok
    finally:
        _stop(proc)


# -- truncation ---------------------------------------------------------------------------------------


@needs_cc
def test_the_guard_gives_a_cut_file_its_length_back(tmp_path: Path) -> None:
    def child(path: str) -> list[object]:
        ring = R.Ring.create(path, R.Geometry(2, 2))
        ring.state[:] = R.DONE
        os.truncate(path, 100)
        seen = [int(ring.state[3]), ring.truncated(), os.stat(path).st_size]
        ring.outputs[-1, -1] = 7.0  # writes too
        seen.append(float(ring.outputs[-1, -1]))
        ring.close()
        return seen

    assert in_child(child, str(tmp_path / "ring")) == [0, True, R.Geometry(2, 2).offsets()["total"], 7.0]


@needs_cc
def test_when_the_length_cannot_come_back_zero_pages_do(tmp_path: Path) -> None:
    def child(path: str) -> list[object]:
        with open(path, "wb") as f:
            f.write(b"\1" * 16384)
        fd = os.open(path, os.O_RDWR)
        mm = mmap.mmap(fd, 16384)
        buf = np.frombuffer(mm, dtype=np.uint8)
        region = G.protect(buf.ctypes.data, 16384, -1, 16384)  # no descriptor to repair through
        os.truncate(path, 0)
        seen = [int(buf[10000]), region.lost, region.faults]
        region.release()
        del buf
        mm.close()
        return seen

    assert in_child(child, str(tmp_path / "f")) == [0, True, 1]


@needs_cc
def test_a_fault_outside_every_ring_still_ends_the_process(tmp_path: Path) -> None:
    def child(path: str) -> None:
        R.Ring.create(path + ".ring", R.Geometry(2, 2))  # installs the guard
        with open(path, "wb") as f:
            f.write(b"\1" * 8192)
        mm = mmap.mmap(os.open(path, os.O_RDWR), 8192)
        os.truncate(path, 0)
        mm[5000]  # a real bug: not ours to hide

    import faulthandler

    faulthandler.disable()  # the child's faulthandler would print a traceback first: the end is the same
    try:
        with pytest.raises(StrangerFailed, match="killed by SIGBUS"):
            in_child(child, str(tmp_path / "f"))
    finally:
        faulthandler.enable()


@needs_cc
@pytest.mark.parametrize("native", ["off", "on"])
@pytest.mark.parametrize("size", [0, 4096, 5000, 12000])
def test_a_ring_cut_short_under_the_daemon_is_repaired(ring_name: str, native: str, size: int) -> None:
    proc = _daemon(ring_name, "--random-model", "4", "--native", native)
    try:
        with R.RingClient(ring_name) as c:
            first = c.infer(X)
            assert first.ok
            os.truncate(R.ring_path(ring_name), size)  # what any writer of the ring can do
            time.sleep(0.3)
            assert proc.poll() is None, "the daemon died"
            answer = c.infer(X, timeout=5)  # the same producer, mapping and lane: served again
            assert answer.ok and np.allclose(answer.outputs, first.outputs)
        assert _ask(ring_name).ok
    finally:
        code, out, err = _stop(proc)
    assert code == 0, err
    assert "cut short by another process" in err
    assert json.loads(out.splitlines()[-1])["ring_repairs"] >= 1


# -- model loads ----------------------------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    d.mkdir(mode=0o700)
    M.Mlp.random(seed=11).save(d / "good.npz")
    return d


def _control(srv: S.RingServer, path: str | bytes, model_id: int = 0, wait: float = 10.0) -> int:
    """Write a model-load request into the control block as any producer could; run the daemon's
    side until it answers."""
    h = srv.ring.header
    seq = (int(h["control_seq"]) + 1) & 0xFFFFFFFF
    h["control_path"] = path if isinstance(path, bytes) else path.encode()
    h["control_model_id"] = model_id
    h["control_seq"] = seq
    deadline = time.monotonic() + wait
    while int(h["control_ack"]) != seq:
        assert time.monotonic() < deadline, "no answer to the load request"
        srv.housekeeping()
        if srv._pending_swap is not None:
            srv._apply_swap()
        time.sleep(0.005)
    return int(h["control_status"])


def _answer(srv: S.RingServer) -> np.ndarray:
    _put(srv.ring, 0)
    srv.process_small(srv.ready_slots())
    return srv.ring.outputs[0, :2].copy()


def test_loads_come_only_from_the_model_directories(ring_name: str, model_dir: Path, tmp_path: Path) -> None:
    srv = _server(ring_name, model_dirs=(str(model_dir),))
    try:
        before = _answer(srv)
        planted = tmp_path / "planted.npz"
        M.Mlp.random(seed=99).save(planted)
        (model_dir / "escape.npz").symlink_to(planted)
        for path in (str(planted), str(model_dir / "escape.npz"), str(model_dir / ".." / "planted.npz"), "/etc/passwd",
                     "relative.npz", str(model_dir)):
            assert _control(srv, path) == R.CONTROL_NOT_ALLOWED, path
        assert np.array_equal(_answer(srv), before)  # no answer changed
        assert _control(srv, str(model_dir / "good.npz"), model_id=64) == R.CONTROL_BAD_ID
        assert _control(srv, str(model_dir / "good.npz")) == R.CONTROL_OK
        assert np.allclose(_answer(srv), M.Mlp.random(seed=11).forward(X[None])[0], rtol=1e-5)
    finally:
        srv.close()


def test_no_model_directory_means_no_loads(ring_name: str, model_dir: Path) -> None:
    srv = _server(ring_name)
    try:
        assert _control(srv, str(model_dir / "good.npz")) == R.CONTROL_NOT_ALLOWED
    finally:
        srv.close()


def test_a_fifo_in_the_model_directory_does_not_block_the_loader(ring_name: str, model_dir: Path) -> None:
    os.mkfifo(model_dir / "fifo.npz")
    (model_dir / "dev.npz").symlink_to("/dev/zero")
    srv = _server(ring_name, model_dirs=(str(model_dir),))
    try:
        t0 = time.monotonic()
        assert _control(srv, str(model_dir / "fifo.npz")) == R.CONTROL_FAILED
        assert _control(srv, str(model_dir / "dev.npz")) == R.CONTROL_NOT_ALLOWED  # resolves outside
        assert time.monotonic() - t0 < 5
        assert _control(srv, str(model_dir / "good.npz")) == R.CONTROL_OK  # the loader is free again
    finally:
        srv.close()


def test_a_load_that_never_ends_times_out_and_its_late_result_is_dropped(ring_name: str, model_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real = S.read_model_file

    def stuck(path: Path, limit: int = S.MAX_MODEL_BYTES) -> bytes:
        release.wait(30)
        return real(path, limit)

    monkeypatch.setattr(S, "read_model_file", stuck)
    srv = _server(ring_name, model_dirs=(str(model_dir),), load_timeout_s=0.2)
    try:
        before = _answer(srv)
        assert _control(srv, str(model_dir / "good.npz")) == R.CONTROL_TIMEOUT
        release.set()
        time.sleep(0.3)
        if srv._pending_swap is not None:
            srv._apply_swap()
        assert np.array_equal(_answer(srv), before) and int(srv.ring.header["model_generation"]) == 0
        monkeypatch.setattr(S, "read_model_file", real)
        assert _control(srv, str(model_dir / "good.npz")) == R.CONTROL_OK
    finally:
        srv.close()


def test_oversized_and_bomb_model_files_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import zipfile

    big = tmp_path / "big.npz"
    big.write_bytes(b"\0" * 1024)
    with pytest.raises(ValueError, match="more than a model file may be"):
        S.read_model_file(big, limit=100)
    monkeypatch.setattr(M, "MAX_UNPACKED", 4 << 20)  # the real bound is 1 GiB: the same test, smaller
    bomb = tmp_path / "bomb.npz"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name in ("w1", "b1", "w2", "b2"):
            z.writestr(f"{name}.npy", b"\0" * (2 << 20))
    assert bomb.stat().st_size < (64 << 10)
    with pytest.raises(ValueError, match="unpack to"):
        M.Mlp.from_bytes(bomb.read_bytes(), str(bomb))


def test_the_load_command_says_why_the_daemon_refused(ring_name: str, model_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.npz"
    M.Mlp.random(seed=5).save(outside)
    proc = _daemon(ring_name, "--model", str(model_dir / "good.npz"))
    try:
        done = subprocess.run([*BRIDGE, "load", str(outside), "--ring", ring_name], env=child_env(), capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 1 and "not a regular file inside a directory the daemon loads models from" in done.stderr
        done = subprocess.run([*BRIDGE, "load", str(model_dir / "good.npz"), "--ring", ring_name], env=child_env(),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    finally:
        _stop(proc)


def test_a_model_in_a_directory_others_may_write_enables_no_loads(tmp_path: Path) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)
    M.Mlp.random().save(d / "m.npz")
    assert S.default_model_dirs(str(d / "m.npz")) == ()
    d.chmod(0o700)
    assert S.default_model_dirs(str(d / "m.npz")) == (str(d.resolve()),)
    assert S.default_model_dirs(None) == ()


# -- a second user --------------------------------------------------------------------------------------


def _precreate(name: str) -> str:
    R.Ring.create(name, R.Geometry(4, 4), mode=0o666).close()
    return "made"


def test_a_ring_pre_created_by_another_user_is_refused(ring_name: str) -> None:
    other = Stranger()
    assert other.run(_precreate, ring_name) == "made"
    for extra in ([], ["--recreate"]):
        done = subprocess.run([*BRIDGE, "serve", "--ring", ring_name, "--random-model", "1", "--gpu", "off", *extra],
                              env=child_env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 73, done.stderr
        assert f"belongs to uid {other.uid}" in done.stderr
    with pytest.raises(R.RingError, match=f"belongs to uid {other.uid}") as err:  # nor do producers trust it
        R.RingClient(ring_name)
    assert err.value.code == ExitCode.PERMISSION
    with R.RingClient(ring_name, owner=other.uid) as c:  # unless told to
        assert c.ring.geometry == R.Geometry(4, 4)
    assert os.stat(R.ring_path(ring_name)).st_uid == other.uid  # left as it was


def _produce(name: str) -> object:
    with R.RingClient(name) as c:
        a = c.infer(X, timeout=5)
        return [a.status, a.values]


def _open(name: str) -> str:
    try:
        os.open(R.ring_path(name), os.O_RDWR)
    except PermissionError:
        return "denied"
    return "opened"


def test_a_private_ring_keeps_another_user_out(ring_name: str) -> None:
    other = Stranger()
    proc = _daemon(ring_name, "--random-model", "2")
    try:
        assert other.run(_open, ring_name) == "denied"
        with pytest.raises(StrangerFailed, match="Permission denied"):
            other.run(_produce, ring_name)
    finally:
        _stop(proc)


def _attack(name: str, planted: str) -> dict[str, object]:
    """What a member of the ring's group can do to it: produce, then try every way in."""
    out: dict[str, object] = {"answer": _produce(name)}
    path = R.ring_path(name)
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, os.fstat(fd).st_size)
    buf = np.frombuffer(mm, dtype=np.uint8)
    h = buf[: R.HEADER_SIZE].view(R.HEADER_DTYPE)[0]
    geo = R.Geometry(int(h["lanes"]), int(h["slots_per_lane"]), int(h["max_inputs"]), int(h["max_outputs"]))
    off = geo.offsets()
    state = buf[off["state"] : off["state"] + 4 * geo.nslots].view(np.uint32)
    meta32 = buf[off["meta"] : off["meta"] + R.META_SIZE * geo.nslots].view(np.uint32).reshape(geo.nslots, 32)
    # a slot left WRITING by a "producer" no pid could be
    meta32[3, R.M32["producer_pid"]] = 1 << 31
    state[3] = R.WRITING
    # a planted model
    M.Mlp.random(seed=666).save(planted)
    h["control_path"] = planted.encode()
    h["control_model_id"] = 0
    h["control_seq"] = int(h["control_seq"]) + 1
    time.sleep(0.5)
    out["control_status"] = int(h["control_status"])
    out["control_acked"] = int(h["control_ack"]) == int(h["control_seq"])
    out["slot_reclaimed"] = int(state[3]) == R.FREE and int(h["counters"][R.C["drop_abandoned"]]) >= 1
    # the file cut short under everyone
    del h, state, meta32, buf
    mm.close()
    os.ftruncate(fd, 0)
    os.close(fd)
    time.sleep(0.4)
    out["after"] = _produce(name)
    try:
        os.unlink(path)
        out["unlinked"] = True
    except PermissionError:
        out["unlinked"] = False
    return out


@needs_cc
def test_a_group_member_cannot_crash_or_mislead_a_shared_daemon(ring_name: str, model_dir: Path) -> None:
    """The ring shared on purpose (--mode 0660 --group G): a member of G may produce, and nothing
    more: not crash the daemon, not change its answers, not take the ring over."""
    gid = unused_id(62000)
    other = Stranger(groups=(gid,))
    planted_dir = Path("/tmp") / f"gpuos-planted-{uuid.uuid4().hex[:8]}"
    planted_dir.mkdir(mode=0o777)
    planted_dir.chmod(0o777)
    proc = _daemon(ring_name, "--model", str(model_dir / "good.npz"), "--mode", "0660", "--group", str(gid))
    try:
        st = os.stat(R.ring_path(ring_name))
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid
        want = M.Mlp.random(seed=11).forward(X[None])[0]
        out = other.run(_attack, ring_name, str(planted_dir / "m.npz"), timeout=60)
        assert out["answer"][0] == R.OK and np.allclose(out["answer"][1], want, rtol=1e-5)
        assert out["control_acked"] and out["control_status"] == R.CONTROL_NOT_ALLOWED
        assert out["slot_reclaimed"]
        assert out["after"][0] == R.OK and np.allclose(out["after"][1], want, rtol=1e-5)  # same answers after it all
        assert out["unlinked"] is False
        assert proc.poll() is None
        a = _ask(ring_name)
        assert a.ok and np.allclose(a.outputs, want, rtol=1e-5)
    finally:
        code, out_text, err = _stop(proc)
        shutil.rmtree(planted_dir, ignore_errors=True)
    assert code == 0, err
    stats = json.loads(out_text.splitlines()[-1])
    assert stats["model_swaps"] == 0 and stats["ring_repairs"] >= 1
    assert "cut short by another process" in err


def test_group_sharing_needs_a_group_this_user_has() -> None:
    need_root()
    done = subprocess.run([*BRIDGE, "serve", "--ring", "kinfer-nogroup", "--random-model", "1", "--gpu", "off", "--group",
                           "no-such-group-here"], env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no group named" in done.stderr
    assert not R.ring_path("kinfer-nogroup").exists()


# -- the feature store, the ring's neighbour in /dev/shm -------------------------------------------------


def test_feature_store_register_replaces_only_a_store(ring_name: str) -> None:
    from gpuos_tools.kinfer import features as F

    R.Ring.create(ring_name, R.Geometry(2, 2)).close()
    with pytest.raises(R.RingError, match="not a feature store: not replacing it"):
        F.FeatureStore.register(ring_name, "s", ["a"], 8)
    assert R.Ring.attach(ring_name).geometry == R.Geometry(2, 2)  # the ring is still there
    R.ring_path(ring_name).unlink()
    F.FeatureStore.register(ring_name, "s", ["a"], 8).close()
    assert stat.S_IMODE(os.stat(R.ring_path(ring_name)).st_mode) == 0o600
    F.FeatureStore.register(ring_name, "s", ["a", "b"], 8).close()  # a store of ours: replaced
    assert F.FeatureStore.open(ring_name).fields == ["a", "b"]


def test_feature_store_header_out_of_range_is_refused_and_counts_wrap(ring_name: str) -> None:
    from gpuos_tools.kinfer import features as F

    store = F.FeatureStore.register(ring_name, "s", ["a"], 8)
    store.header["write_index"] = (1 << 64) - 1
    assert store.record([1.0]) == (1 << 64) - 1 and int(store.header["write_index"]) == 0
    store.header["capacity"] = 0
    store.close()
    with pytest.raises(R.RingError, match="capacity 0 out of range"):
        F.FeatureStore.open(ring_name)


@needs_cc
def test_a_feature_store_cut_short_under_a_writer_is_no_crash(ring_name: str) -> None:
    from gpuos_tools.kinfer import features as F

    def child(name: str) -> int:
        store = F.FeatureStore.register(name, "s", ["a", "b"], 1024)
        os.truncate(R.ring_path(name), 0)
        for k in range(2000):
            store.record([k, k])
        n = len(store.window()[0])
        store.close()
        return n

    assert in_child(child, ring_name) == 1024


def test_a_feature_store_of_another_user_is_refused(ring_name: str) -> None:
    from gpuos_tools.kinfer import features as F

    other = Stranger()
    other.run(lambda name: F.FeatureStore.register(name, "s", ["a"], 8, mode=0o666).close(), ring_name)
    with pytest.raises(R.RingError, match=f"belongs to uid {other.uid}"):
        F.FeatureStore.open(ring_name)
    with pytest.raises(R.RingError, match=f"belongs to uid {other.uid}: not replacing"):
        F.FeatureStore.register(ring_name, "s", ["a"], 8)
