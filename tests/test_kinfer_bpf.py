"""gpu-kinfer-bridge's kernel-side producer and its waiting: the BPF object against its source,
the loader's record layout, the conversion and watch statistics, disk names; adaptive waiting
(the rule, its C copy, the client); and, where BPF may be loaded (root with the kernel's BTF),
the program itself: O_DIRECT reads issued here arrive as kinfer records with the inputs the
kernel computed, and the daemon's decisions on them. No timing assertions."""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import BRIDGE, REPO, child_env, kinfer_daemon

from gpuos_tools.kinfer import bpf as B
from gpuos_tools.kinfer import linnos
from gpuos_tools.kinfer import model as M
from gpuos_tools.kinfer import ring as R
from gpuos_tools.kinfer import wait as W
from gpuos_tools.kinfer.bpf import build as BB
from gpuos_tools.kinfer.bpf import collect as BC

PAGE = 4096


def _loader_lib() -> Any:
    from gpuos_tools.kinfer.bpf import loader as BL

    try:
        BL.library()
    except BL.BuildError as e:
        pytest.skip(f"the eBPF loader does not build here (cc and libbpf-dev needed): {str(e)[:200]}")
    return BL


def _bpf_allowed() -> Any:
    """The loader module, where the program may be loaded here; else skip, saying why."""
    reason = B.unavailable_reason()
    if reason is not None:
        pytest.skip(f"BPF not allowed here: {reason}")
    return _loader_lib()


# -- the object and its source -----------------------------------------------------------------


def test_shipped_object_rebuilds_from_its_source(tmp_path: Path) -> None:
    try:
        BB.tools()
    except BB.BuildError as e:
        pytest.skip(str(e))
    ok, how = BB.check(tmp_path)
    assert ok, how


def test_shipped_object_holds_the_programs_and_maps() -> None:
    if shutil.which("bpftool") is None:
        pytest.skip("bpftool not installed")
    d = BB.describe(B.OBJECT)
    assert dict(d["programs"]) == {
        "tp_btf/block_io_start": "on_io_start", "tp_btf/block_rq_issue": "on_issue",
        "tp_btf/block_rq_requeue": "on_requeue", "tp_btf/block_rq_complete": "on_complete",
    }
    assert d["maps"] == ["config", "counters", "disks", "events", "inflight", "wanted"]
    assert d["license"] == "GPL"  # the verifier refuses a non-GPL program that reads struct request
    structs = {t.split("'")[1] for t in d["btf_types"] if t.startswith("STRUCT ")}
    assert {"request", "request_queue", "gendisk", "blk_mq_hw_ctx", "inflight", "disk"} <= structs  # relocated at load


def test_check_refuses_a_source_changed_since_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = json.loads(BB.MANIFEST.read_text())
    manifest["inputs_sha256"] = "0" * 64
    fake = tmp_path / "m.json"
    fake.write_text(json.dumps(manifest))
    monkeypatch.setattr(BB, "MANIFEST", fake)
    ok, how = BB.check(tmp_path)
    assert not ok and "changed since the shipped object was built" in how


def test_event_layout_of_the_header_is_what_the_comments_say(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "l.c"
    fields = ["issue_ns", "done_ns", "rq", "sector", "dev", "bytes", "pending", "pid", "hwq", "error", "comm", "kind", "op",
              "features", "reserved"]
    src.write_text('#include <stdio.h>\n#include <stddef.h>\n#include "linnos_block.h"\nint main(void){\n'
                   + "".join(f'printf("{f} %zu\\n", offsetof(struct gk_event, {f}));\n' for f in fields)
                   + 'printf("size %zu\\n", sizeof(struct gk_event)); return 0; }\n')
    subprocess.run([cc, "-I", str(B.HERE), str(src), "-o", str(tmp_path / "l")], check=True)
    out = dict(line.split() for line in subprocess.run([str(tmp_path / "l")], capture_output=True, text=True).stdout.splitlines())
    header = B.HEADER.read_text()
    for f in fields:  # each field's comment in linnos_block.h gives its offset
        line = next(x for x in header.splitlines() if f" {f}" in x and "/*" in x and ";" in x)
        assert line.split("/*")[1].strip().split(":")[0].split()[0] == out[f], (f, line)
    assert out["size"] == "112"


def test_unavailable_reason_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(B, "_effective_caps", lambda: 0)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "not root" in (B.unavailable_reason() or "")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert "restricted container" in (B.unavailable_reason() or "")
    monkeypatch.setattr(B, "_effective_caps", lambda: (1 << 39) | (1 << 38))  # CAP_BPF + CAP_PERFMON is enough
    assert "BTF" in (B.unavailable_reason(tmp_path / "no-vmlinux") or "")


# -- records, disks, statistics ---------------------------------------------------------------


def _fake_sysfs(root: Path) -> Path:
    """/sys/dev/block and /sys/class/block-like trees: vda (254:0) with a partition vda1 (254:1)."""
    devices = root / "devices" / "virtio" / "block" / "vda"
    (devices / "vda1").mkdir(parents=True)
    (devices / "dev").write_text("254:0\n")
    (devices / "vda1" / "dev").write_text("254:1\n")
    (devices / "vda1" / "partition").write_text("1\n")
    sys_block = root / "dev" / "block"
    sys_block.mkdir(parents=True)
    (sys_block / "254:0").symlink_to(devices)
    (sys_block / "254:1").symlink_to(devices / "vda1")
    return sys_block


def test_disk_names_and_partitions(tmp_path: Path) -> None:
    sys_block = _fake_sysfs(tmp_path)
    vda = BC.make_dev(254, 0)
    assert BC.split_dev(vda) == (254, 0)
    assert BC.disk_name(vda, sys_block) == "vda"
    assert BC.disk_name(BC.make_dev(8, 0), sys_block) == "8:0"
    assert BC.resolve_disk("254:1", sys_block) == vda  # a partition stands for its disk
    assert BC.resolve_disk("254:0", sys_block) == vda
    with pytest.raises(ValueError, match="no such block device"):
        BC.resolve_disk("9:9", sys_block)
    with pytest.raises(ValueError, match="no such disk"):
        BC.resolve_disk("no-such-disk-here")
    with pytest.raises(ValueError, match="not on a block device"):
        BC.resolve_disk("/dev/shm")


def _records(dtype: np.dtype, rows: list[dict[str, Any]]) -> np.ndarray:
    a = np.zeros(len(rows), dtype=dtype)
    for i, row in enumerate(rows):
        for k, v in row.items():
            a[i][k] = v
    return a


def test_converter_makes_io_records() -> None:
    BL = _loader_lib()
    dtype = BL.record_dtype()
    vda = BC.make_dev(254, 0)
    t0 = 1_000_000
    feats = np.arange(31) % 10
    recs = _records(dtype, [
        {"issue_ns": t0 + 5000, "done_ns": t0 + 105_500, "sector": 8, "dev": vda, "bytes": 8192, "pending": 3, "pid": 42,
         "comm": b"fio", "op": 0, "predicted": 1, "decision": 1, "batch": 2, "where": 0, "submit_ns": t0 + 7000,
         "answer_ns": t0 + 9500, "decided_ns": t0 + 9000, "features": feats},
        {"issue_ns": t0 + 6000, "done_ns": t0 + 46_000, "sector": 16, "dev": vda, "bytes": 4096, "op": 1, "error": -5},
        {"issue_ns": t0 + 7000, "done_ns": t0 + 8000, "sector": 24, "dev": vda, "bytes": 4096, "op": 0, "predicted": 2},
    ])
    conv = BC.Converter(t0)
    out = conv.records(recs)
    name = BC.disk_name(vda)
    assert out[0] == {"type": "io", "dev": 0, "disk": name, "t_us": 5.0, "op": "R", "offset": 4096, "size": 8192, "pending": 3,
                      "lat_us": 100.5, "hwq": 0, "pid": 42, "comm": "fio", "x": feats.tolist(), "predicted": "answered",
                      "decision": 1, "batch": 2, "where": "cpu", "infer_us": 2.5, "added_us": 4.5, "decided_us": 4.0}
    assert out[1]["op"] == "W" and out[1]["error"] == -5 and "x" not in out[1]
    assert out[2]["predicted"] == "no_slot" and "decision" not in out[2]
    assert conv.disks() == [{"dev": 0, "disk": name, "devno": "254:0"}]
    assert list(T_io(out)) == out  # what traces.io_records accepts


def T_io(records: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    from gpuos_tools.kinfer.traces import io_records

    return io_records(records)


def test_watch_statistics() -> None:
    stats = BC.WatchStats(threshold_us=100.0)

    def read(lat: float, decision: int | None) -> dict[str, Any]:
        r: dict[str, Any] = {"op": "R", "disk": "vda", "lat_us": lat}
        if decision is None:
            r["predicted"] = "no_slot"
        else:
            r.update(decision=decision, added_us=10.0, decided_us=8.0, infer_us=3.0)
        return r

    stats.add([read(50, 0), read(50, 0), read(50, 1), read(200, 1), read(300, 0), read(40, None), {"op": "W", "disk": "vda"}])
    (rep,) = stats.reports("interval", 1.0)
    assert rep["reads"] == 6 and rep["writes"] == 1 and rep["predicted"] == 5 and rep["slow"] == 2
    assert rep["predicted_slow"] == 2 and rep["accuracy"] == 0.6 and rep["always_fast_accuracy"] == 0.6
    assert rep["false_fast"] == 0.5 and rep["false_slow"] == round(1 / 3, 4)
    assert rep["unpredicted"] == {"no_slot": 1} and rep["added_us"]["p50"] == 10.0
    assert stats.reports("interval", 1.0) == []  # the interval starts over
    (total,) = stats.reports("total", 2.0)
    assert total["reads"] == 6 and total["scope"] == "total"


def test_dataset_takes_the_kernel_inputs_when_the_trace_has_them() -> None:
    rng = np.random.default_rng(0)
    recs = []
    for i in range(50):
        x = rng.integers(0, 10, 31).tolist()
        recs.append({"type": "io", "dev": i % 2, "t_us": float(i), "op": "R", "pending": 0, "lat_us": 10.0 + i, "x": x})
    data, _ = linnos.dataset(recs)
    by_t = {r["t_us"]: r["x"] for r in recs}
    assert all(data.x[k].tolist() == by_t[t] for k, t in enumerate(data.t_us.tolist()))
    del recs[3]["x"]  # one read without: that device's inputs are computed from the trace
    data, _ = linnos.dataset(recs)
    assert data.x[data.dev == 1].tolist() != [by_t[t] for t in data.t_us[data.dev == 1].tolist()]


# -- adaptive waiting -------------------------------------------------------------------------


def test_adaptive_window_follows_the_gaps() -> None:
    a = W.Adaptive(200.0, 5000.0)
    assert a.hold() == 200.0 and a.idle(0.0)
    for t in range(0, 20_000, 1000):  # a request every 1000: spin through the gaps
        a.arrival(float(t))
    assert a.hold() == 2000.0 and not a.idle(19_000.0 + 1500) and a.idle(19_000.0 + 2500)
    a.arrival(60_000.0)  # a long pause: sparse traffic, no spinning for it
    assert a.hold() == 200.0 and a.gap == 10_000.0  # the gap enters capped at 2 spin_max
    holds = []
    for k in range(1, 60):  # traffic again, every 10: the estimate decays by 1/8 per arrival
        a.arrival(60_000.0 + 10 * k)
        holds.append(a.hold())
    assert holds[4] == 200.0 and holds[5] == 5000.0  # 10000 (7/8)^6 < 5000: spinning again after 6
    assert holds[-1] == 200.0  # and down to the floor once the long gap is forgotten
    b = W.Adaptive(200.0, 5000.0)
    for t in range(0, 80_000, 4000):
        b.arrival(float(t))
    assert b.hold() == 5000.0  # capped at spin_max


def test_c_loop_waits_by_the_same_rule() -> None:
    from gpuos_tools.kinfer import native as N

    try:
        lib = N.library()
    except N.BuildError as e:
        pytest.skip(str(e))
    rng = np.random.default_rng(1)
    for _ in range(200):
        gaps = rng.choice([rng.integers(1, 500), rng.integers(500, 20_000), rng.integers(20_000, 10**7)], size=rng.integers(1, 30))
        times = np.cumsum(np.concatenate([[10**9], gaps])).astype(np.uint64)
        a = W.Adaptive(200_000, 5_000_000)
        for t in times.tolist():
            a.arrival(t)
        c = lib.kn_wait_replay(200_000, 5_000_000, times.ctypes.data, len(times))
        assert abs(c - a.hold()) <= len(times), (times.tolist(), c, a.hold())  # C divides integers: 1 ns per arrival


def test_client_spins_by_the_same_rule(ring_name: str) -> None:
    from gpuos_tools.kinfer import policy as P
    from gpuos_tools.kinfer import server as S

    srv = S.RingServer.open(ring_name, R.Geometry(2, 2), M.Mlp.random(seed=3), P.Policy(),
                        S.ServeOptions(use_gpu="off", native="off"), recreate=True, log=lambda m: None)
    try:
        with R.RingClient(ring_name, native="off") as c:  # the C path's rule: test_kinfer_client.py
            assert c._hold == R.CLIENT_SPIN_MIN_S
            ref = W.Adaptive(R.CLIENT_SPIN_MIN_S, R.CLIENT_SPIN_MAX_S)
            t = 0.0
            for waited in (5e-6, 400e-6, 900e-6, 10e-6, 3e-3, 1e-6):  # answers after a daemon's wake-up, then a long one
                c._learn(waited)
                ref.arrival(t)  # Adaptive takes arrival times: the gaps are the waits
                t += waited
                ref.arrival(t)
                ref.last = None
                assert c._hold == pytest.approx(ref.hold())
            assert c._hold == R.CLIENT_SPIN_MIN_S  # 3 ms is past the 2 ms most: waits that long are slept
            slot = c.submit(np.zeros(31, dtype=np.float32))  # and a real round trip goes through the rule
            timer = threading.Timer(0.001, lambda: srv.serve(max_batches=1))
            timer.start()
            assert c.wait(slot).ok
            timer.join()
            assert c._gap > 0
            fixed = R.RingClient(ring_name, spin_s=50e-6, native="off")
            slot = fixed.submit(np.zeros(31, dtype=np.float32))
            srv.serve(max_batches=1)
            assert fixed.wait(slot).ok and fixed._hold == 50e-6
            fixed.close()
    finally:
        srv.close()


@pytest.fixture
def ring_name() -> Iterator[str]:
    name = f"kinfer-bpf-test-{uuid.uuid4().hex[:10]}"
    yield name
    R.ring_path(name).unlink(missing_ok=True)


# -- the program in the kernel ------------------------------------------------------------------

FS_IOC_FIEMAP = 0xC020660B


def physical_offsets(path: Path) -> list[tuple[int, int, int]]:
    """(logical, physical, length) of a file's extents on its filesystem's device (FIEMAP), with
    the partition's start added: byte offsets on the whole disk."""
    count = 64
    buf = bytearray(32 + 56 * count)
    struct.pack_into("QQIIII", buf, 0, 0, 2**64 - 1, 1, 0, count, 0)  # FIEMAP_FLAG_SYNC
    with open(path, "rb") as f:
        fcntl.ioctl(f.fileno(), FS_IOC_FIEMAP, buf)
    n = struct.unpack_from("I", buf, 20)[0]
    st = os.stat(path)
    start = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/start")
    base = int(start.read_text()) * 512 if start.exists() else 0
    return [(lo, base + ph, ln) for lo, ph, ln in (struct.unpack_from("QQQ", buf, 32 + 56 * i) for i in range(n))]


def _disk_dir(tmp_path: Path) -> Path:
    """A folder on a real block device (tmp_path, else one in the checkout)."""
    for candidate in (tmp_path, REPO):
        try:
            BC.resolve_disk(str(candidate))
            if candidate == REPO:
                folder = REPO / f".bpf-test-{uuid.uuid4().hex[:8]}"
                folder.mkdir()
                return folder
            return candidate
        except ValueError:
            continue
    pytest.skip("no folder on a block device to issue O_DIRECT reads to")


def _daemon(name: str) -> subprocess.Popen[bytes]:
    return kinfer_daemon(name, "--random-model", "0", "-o", os.devnull)


def _digits(v: int, width: int) -> list[int]:
    v = min(v, 10**width - 1)
    return [v // 10**(width - 1 - i) % 10 for i in range(width)]


def test_own_direct_reads_arrive_as_kinfer_records(tmp_path: Path, ring_name: str) -> None:
    BL = _bpf_allowed()
    folder = _disk_dir(tmp_path)
    path = folder / "reads.bin"
    try:
        with open(path, "wb") as f:
            f.write(os.urandom(4 << 20))
            f.flush()
            os.fsync(f.fileno())
        extents = physical_offsets(path)
        disk = BC.resolve_disk(str(path))
        daemon = _daemon(ring_name)
        n = 64
        offsets = [(k * 61 % 512) * 8192 for k in range(n)]  # distinct 8 KiB blocks, not in order

        def on_disk(off: int) -> int:
            lo, ph, _ = next(e for e in extents if e[0] <= off < e[0] + e[2])
            return ph + off - lo

        wanted = {on_disk(o): k for k, o in enumerate(offsets)}
        try:
            with BL.Loader([disk], predict=True) as loader:
                assert loader.attach_ring(R.ring_path(ring_name), lanes=4) == 4
                loader.start()
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                buf = mmap.mmap(-1, 8192)
                try:
                    for off in offsets:
                        assert os.preadv(fd, [buf], off) == 8192
                finally:
                    os.close(fd)
                    buf.close()
                got: dict[int, dict[str, Any]] = {}
                conv = BC.Converter(0)
                deadline = time.monotonic() + 10
                while len(got) < n and time.monotonic() < deadline:
                    for rec in conv.records(loader.take(0.1)):
                        if rec["op"] == "R" and rec["offset"] in wanted:
                            assert rec["offset"] not in got, "a read recorded twice"
                            got[rec["offset"]] = rec
                loader.stop()
                stats = loader.stats()
            ring = R.Ring.attach(ring_name)
            served = ring.counter_values()["served"]
            ring.close()
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=30)
    finally:
        path.unlink(missing_ok=True)
        if folder != tmp_path:
            folder.rmdir()
    assert len(got) == n, f"{n - len(got)} of our reads not seen; loader {stats}"
    comm = Path("/proc/self/comm").read_text().strip()
    model = M.Mlp.random(31, 256, 2, 0)  # what `serve --random-model 0` serves (the profile's shape)
    recs = [got[on_disk(o)] for o in offsets]
    for rec in recs:
        assert rec["size"] == 8192 and rec["lat_us"] > 0 and rec["pid"] == threading.get_native_id() and rec["comm"] == comm
        x = rec["x"]
        assert len(x) == 31 and all(0 <= v <= 9 for v in x)
        assert x[:3] == _digits(rec["pending"], 3)  # the kernel's pending count, as LinnOS digits
        # the loader never waits for a slot: on a busy machine a read may find all 32 in flight
        assert rec["predicted"] in ("answered", "no_slot")
        if rec["predicted"] == "answered":
            assert rec["decision"] == int(model.predict(np.array([x], dtype=np.float32))[0])
            assert rec["infer_us"] > 0 and rec["added_us"] >= rec["infer_us"] and 0 < rec["decided_us"] <= rec["added_us"]
    answered = sum(rec["predicted"] == "answered" for rec in recs)
    assert answered >= 1, stats  # how many depends on how busy the machine is, not on the code
    # the history is the kernel's: read k's last completed read is, but for a read of another
    # process completing in between, our read k-1 (its latency in whole us, as 4 digits)
    follows = sum(recs[k]["x"][15:19] == _digits(int(recs[k - 1]["lat_us"]), 4) for k in range(1, n))
    assert follows >= (n - 1) * 0.8, follows
    assert served >= answered and stats["predicted"] >= answered and stats["kernel_issued"] >= n


def test_collect_ebpf_cli_records_a_workload(tmp_path: Path) -> None:
    _bpf_allowed()
    folder = _disk_dir(tmp_path)
    out = tmp_path / "t.ndjson"
    try:
        done = subprocess.run([*BRIDGE, "collect", "--source", "ebpf", "--dir", str(folder), "--size-mib", "8", "--devices", "1",
                               "--reads", "300", "-o", str(out)], env=child_env(), capture_output=True, text=True, timeout=120)
    finally:
        if folder != tmp_path:
            shutil.rmtree(folder, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert recs[0]["type"] == "header" and recs[0]["source"] == "ebpf"
    summary = recs[-1]
    assert summary["type"] == "kinfer_collect" and summary["reason"] == "read count reached" and summary["reads"] >= 300
    reads = [r for r in recs if r["type"] == "io" and r["op"] == "R"]
    assert len(reads) >= 300 and all(len(r["x"]) == 31 for r in reads)
    assert any(r["op"] == "W" for r in recs if r["type"] == "io")  # the load writes too
    assert not list(folder.glob("kinfer-io-*"))  # the load's files are gone


def test_watch_cli_reports_decisions_per_disk(tmp_path: Path) -> None:
    _bpf_allowed()
    folder = _disk_dir(tmp_path)
    model = M.Mlp.random(seed=5)
    model.meta = {"name": "linnos", "threshold_us": 500.0}
    model.save(tmp_path / "m.npz")
    reader = tmp_path / "reads.py"
    reader.write_text(
        "import mmap, os, sys\n"
        "p = sys.argv[1]\n"
        "with open(p, 'wb') as f:\n    f.write(os.urandom(1 << 20)); f.flush(); os.fsync(f.fileno())\n"
        "fd = os.open(p, os.O_RDONLY | os.O_DIRECT); b = mmap.mmap(-1, 4096)\n"
        "for i in range(200): os.preadv(fd, [b], (i * 7 % 256) * 4096)\n"
        "os.close(fd); os.unlink(p)\n"
    )
    try:
        done = subprocess.run([*BRIDGE, "watch", "--model", str(tmp_path / "m.npz"), "--disk", str(folder), "--interval", "30",
                               "--", sys.executable, str(reader), str(folder / "w.bin")],
                              env=child_env(), capture_output=True, text=True, timeout=120)
    finally:
        if folder != tmp_path:
            shutil.rmtree(folder, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    recs = [json.loads(line) for line in done.stdout.splitlines()]
    (total,) = [r for r in recs if r["type"] == "kinfer_watch" and r["scope"] == "total"]
    assert total["reads"] >= 200 and total["predicted"] >= 1 and total["threshold_us"] == 500.0
    # every read is either decided or counted with the reason it was not (a busy machine: no free slot)
    assert total["predicted"] + sum(total["unpredicted"].values()) == total["reads"]
    assert set(total["unpredicted"]) <= {"no_slot", "no_issue_event"}  # the latter: in flight when attached
    assert total["accuracy"] is not None and total["added_us"]["p50"] > 0
    assert recs[-1]["type"] == "kinfer_collect" and recs[-1]["reason"] == "program exited" and recs[-1]["program_status"] == 0


def test_collect_ebpf_usage_errors(tmp_path: Path) -> None:
    done = subprocess.run([*BRIDGE, "collect", "--source", "direct", "--seconds", "1", "--dir", str(tmp_path)], env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--source ebpf" in done.stderr
    done = subprocess.run([*BRIDGE, "collect", "--source", "ebpf", "--disk", "no-such-disk-here", "--seconds", "1"],
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no such disk" in done.stderr
    done = subprocess.run([*BRIDGE, "watch", "--seconds", "1"], env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--ring" in done.stderr
    done = subprocess.run([*BRIDGE, "watch", "--ring", f"no-ring-{uuid.uuid4().hex[:6]}", "--threshold-us", "100", "--seconds", "1"],
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 66 and "is `gpu-kinfer-bridge serve` running?" in done.stderr



# -- replay on a one-disk trace, and what it charges ---------------------------------------------


def test_replay_models_a_replica_for_one_disk() -> None:
    from gpuos_tools.kinfer.traces import synthesize

    records = [r for r in synthesize(6000, seed=2, devices=1)]
    model, report = linnos.train_trace(records, epochs=2)
    with pytest.raises(ValueError, match="--replica shifted"):
        linnos.replay(records, model.predict, report["threshold_us"])
    out = linnos.replay(records, model.predict, report["threshold_us"], replica="shifted")
    assert out["replica"] == "shifted" and out["devices"] == 1
    assert out["oracle"]["p99"] <= out["none"]["p99"]  # the slow reads, sent to a replica not slow then
    assert 0 <= out["accuracy"] <= 1 and out["always_fast_accuracy"] == pytest.approx(1 - out["slow_fraction"])
    with pytest.raises(ValueError, match="unknown replica"):
        linnos.replay(records, model.predict, report["threshold_us"], replica="mirror")


def test_replay_cli_says_what_it_charged(tmp_path: Path) -> None:
    from gpuos_tools.kinfer.traces import synthesize
    from gpuos_tools.stream import make_header

    trace = tmp_path / "t.ndjson"
    trace.write_text("".join(json.dumps(r) + "\n" for r in [make_header("test"), *synthesize(3000, seed=4, devices=2)]))
    model, _ = linnos.train_trace([json.loads(line) for line in trace.read_text().splitlines()[1:]], epochs=2)
    model.meta = {"threshold_us": 150.0}
    model.save(tmp_path / "m.npz")
    done = subprocess.run([*BRIDGE, "replay", str(trace), "--model", str(tmp_path / "m.npz"), "--probes", "40"], env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rep = json.loads(done.stdout.splitlines()[-1])
    inf = rep["inference"]
    assert inf["requests"] == 40 and inf["charged_us"] == rep["inference_us"] > 0 and inf["pace_us"] > 0
    assert rep["linnos"]["p50"] == pytest.approx(rep["linnos_uncharged"]["p50"] + rep["inference_us"], abs=1e-3)  # inference_us is rounded
    assert f"charged {inf['charged_us']:.1f} us" in done.stderr
