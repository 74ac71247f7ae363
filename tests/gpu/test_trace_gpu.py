"""gpu-trace on a real GPU: CuPy and PyTorch programs traced end to end (pytest -m gpu)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuos_tools.stream import open_input
from gpuos_tools.model.allocs import AllocTable
from gpuos_tools.model.records import pointer_words

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROGS = Path(__file__).resolve().parent / "progs"
WORKLOADS = ROOT / "workloads"


def gpu_trace(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpuos_tools.commands.trace", *args],
        cwd=ROOT, env=env or os.environ.copy(), capture_output=True, text=True, timeout=600,
    )


BACKENDS = pytest.mark.parametrize("backend", ["native", "python"])


def traced(tmp_path: Path, prog: Path, name: str, backend: str, keep_images: bool = False, args: tuple = ()):
    out = tmp_path / f"{name}.ndjson.zst"
    report = tmp_path / f"{name}.report.json"
    env = os.environ.copy()
    env["GPUOS_TEST_REPORT"] = str(report)
    proc = gpu_trace("run", "--backend", backend, "--check-pointers", "-o", str(out), "--",
                     sys.executable, str(prog), *args, env=env)
    assert proc.returncode == 0, proc.stderr
    if backend == "python":  # the recorded fixtures come from the default (native) path
        name += "-python"
    keep = os.environ.get("GPUOS_KEEP_TRACES")
    if keep:  # scripts/device-test brings these back to record test fixtures
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(out, Path(keep) / f"{name}.ndjson.zst")
        shutil.copy(report, Path(keep) / f"{name}.report.json")
        if keep_images and backend == "native":
            shutil.copytree(tmp_path / f"{name}.images", Path(keep) / f"{name}.images", dirs_exist_ok=True)
    with open_input(str(out)) as reader:
        records = list(reader)
    assert records[0]["backend"] == backend
    return records, json.loads(report.read_text()), tmp_path / f"{name.removesuffix('-python')}.images"


def replay(records):
    """Yield (record, table) in stream order; the table holds the live allocations at that record."""
    table = AllocTable()
    for rec in records:
        if rec["type"] in ("alloc", "free"):
            table.feed(rec)
        yield rec, table


def device_live_bytes(records, stop) -> int:
    live: dict[int, int] = {}
    for rec in records:
        if rec is stop:
            break
        if rec["type"] == "alloc" and rec["kind"] in ("device", "pitch", "async", "pool", "vmm"):
            live[rec["addr"]] = rec["size"]
        elif rec["type"] == "free":
            live.pop(rec["addr"], None)
    return sum(live.values())


def check_common(records):
    assert records[0]["type"] == "header" and records[0]["tool"] == "gpu-trace"
    assert records[0]["gpus"], "header lists the GPUs"
    assert records[-1]["type"] == "exit" and records[-1]["code"] == 0 and records[-1]["complete"]
    assert not [r for r in records if r["type"] == "error"]
    launches = [r for r in records if r["type"] == "launch"]
    assert launches
    no_layout = [r["kernel"] for r in launches if r["layout"] == "none"]
    assert not no_layout, f"launches without parameter layout: {sorted(set(no_layout))[:5]}"
    # every argument word the driver says is a device pointer resolves to a live recorded allocation
    unresolved = []
    resolved_words = 0
    for rec, table in replay(records):
        if rec["type"] != "launch":
            continue
        for i, off, _memtype in rec["dptrs"]:
            raw = bytes.fromhex(rec["params"][i]["hex"])
            word = int.from_bytes(raw[off : off + 8], "little")
            if table.resolve(word) is None:
                unresolved.append((rec["kernel"], i, off, hex(word)))
            else:
                resolved_words += 1
    assert not unresolved, f"{len(unresolved)} device pointers resolve to no allocation: {unresolved[:5]}"
    assert resolved_words > 0
    return launches


@BACKENDS
def test_cupy_program(tmp_path, backend):
    records, report, images = traced(tmp_path, WORKLOADS / "cupy_prog.py", "cupy", backend, keep_images=True)
    launches = check_common(records)
    ptrs = report["pointers"]

    affine = [r for r in launches if r["kernel"] == "affine"]
    assert len(affine) == 1
    p = affine[0]["params"]
    assert [q["size"] for q in p] == [32, 8, 4]
    struct_bytes = bytes.fromhex(p[0]["hex"])
    assert int.from_bytes(struct_bytes[0:8], "little") == ptrs["out"]
    assert int.from_bytes(struct_bytes[8:16], "little") == ptrs["y"]
    assert int.from_bytes(struct_bytes[16:20], "little") == report["n"]
    assert int.from_bytes(bytes.fromhex(p[1]["hex"]), "little") == ptrs["extra"]
    assert int.from_bytes(bytes.fromhex(p[2]["hex"]), "little") == 7
    assert affine[0]["dptrs"] == [[0, 0, "device"], [0, 8, "device"], [1, 0, "device"]]
    assert affine[0]["grid"] == [report["n"] // 256, 1, 1] and affine[0]["block"] == [256, 1, 1]

    # each of the program's arrays is a recorded allocation when used
    table = AllocTable()
    for rec in records:
        if rec["type"] in ("alloc", "free"):
            table.feed(rec)
        if rec is affine[0]:
            for name in ("x", "y", "out", "extra"):
                assert table.resolve(ptrs[name]) is not None, name
            break

    # CuPy's elementwise kernels pass arrays as by-value structs whose first word is the pointer
    elementwise = [r for r in launches if r["params"] and r["params"][0]["size"] > 8]
    assert elementwise

    # allocation balance: live device bytes at the marker launch == CuPy's pool total
    marker = next(r for r in launches if r["kernel"] == "gpuos_marker")
    assert device_live_bytes(records, marker) == report["pool_total_bytes"]

    modules = [r for r in records if r["type"] == "module"]
    holder = [m for m in modules if "affine" in m["kernels"]]
    assert holder and holder[0]["format"] == "cubin"
    assert (images / holder[0]["file"]).is_file()
    assert affine[0]["module"] == holder[0]["hash"]

    copies = [r for r in records if r["type"] == "memcpy" and r["dir"] in ("DtoH", "default")]
    assert any(r["bytes"] == 16 for r in copies), "the 4-float device-to-host copy"


@BACKENDS
def test_torch_training_step(tmp_path, backend):
    records, report, _ = traced(tmp_path, PROGS / "torch_prog.py", "torch", backend)
    launches = check_common(records)
    words = {}
    for rec, table in replay(records):
        if rec["type"] == "launch":
            for _, _, w in pointer_words(rec):
                if w not in words:
                    words[w] = table.resolve(w)
    for name, ptr in {**report["pointers"], **{"grad." + k: v for k, v in report["grads"].items()}}.items():
        assert ptr in words, f"{name} never passed to a kernel"
        assert words[ptr] is not None, f"{name} passed but not inside a recorded allocation"
    # the caching allocator's segments are exactly allocations the trace holds live at the end
    live = {}
    for rec in records:
        if rec["type"] == "alloc":
            live[rec["addr"]] = rec["size"]
        elif rec["type"] == "free":
            live.pop(rec["addr"], None)
    assert sum(size for _, size in report["segments"]) == report["reserved"]
    for addr, size in report["segments"]:
        assert live.get(addr) == size, f"segment {addr:#x} of {size} bytes not live in the trace"
    # the segment given back by empty_cache() was allocated and freed, matched by id
    (big,) = [r for r in records if r["type"] == "alloc" and r["addr"] == report["released"]]
    assert big["size"] >= 256 << 20
    assert [r for r in records if r["type"] == "free" and r["id"] == big["id"]]
    assert report["released"] not in live
    assert any("gemm" in r["name"].lower() or "sgemm" in r["kernel"].lower() for r in launches)


@BACKENDS
def test_exit_status_and_signal_are_propagated(tmp_path, backend):
    out = tmp_path / "t.ndjson"
    proc = gpu_trace("run", "--backend", backend, "-o", str(out), "--", sys.executable, "-c",
                     "import cupy, sys; cupy.arange(4).sum(); sys.exit(3)")
    assert proc.returncode == 3, proc.stderr
    with open_input(str(out)) as reader:
        records = list(reader)
    assert records[-1]["type"] == "exit" and records[-1]["code"] == 3 and records[-1]["complete"]
    assert any(r["type"] == "launch" for r in records)

    proc = gpu_trace("run", "--backend", backend, "-o", str(out), "--", sys.executable, "-c",
                     "import cupy, os, signal; cupy.arange(4).sum(); os.kill(os.getpid(), signal.SIGKILL)")
    assert proc.returncode == 128 + 9, proc.stderr
    with open_input(str(out)) as reader:
        last = list(reader)[-1]
    assert last["signal"] == "SIGKILL" and last["complete"] is False


def test_missing_cupti_in_program_is_reported(tmp_path):
    """The program's interpreter cannot import cupti-python: clear message, NO_CUPTI (70)."""
    import cupti

    # a real environment like this one, less cupti-python: every other entry of its site dir
    site = Path(cupti.__file__).resolve().parents[1]
    without = tmp_path / "site-without-cupti"
    without.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith("cupti"):
            (without / entry.name).symlink_to(entry)
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(without)]
        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != site]
    )
    proc = gpu_trace("run", "-o", str(tmp_path / "t.ndjson"), "--", sys.executable, "-c", "pass", env=env)
    assert proc.returncode == 70, proc.stderr
    assert "tracer could not start" in proc.stderr and "cupti" in proc.stderr.lower()
    assert not (tmp_path / "t.ndjson").exists(), "a failed trace leaves no file behind"


def test_a_reader_that_leaves_early_ends_gpu_trace_quietly_and_the_program_still_finishes(tmp_path):
    """`gpu-trace run ... | head -3`: exit 0, no traceback, and the program runs to its end."""
    done = tmp_path / "done"
    prog = (f"import cupy\nx = cupy.zeros(1024)\nfor _ in range(20000):\n    x += 1\n"
            f"assert float(x[0]) == 20000\nopen({str(done)!r}, 'w').write('ok')\n")
    cmd = (f"set -o pipefail; {sys.executable} -m gpuos_tools.commands.trace run -- "
           f"{sys.executable} -c \"$PROG\" | head -3")
    env = os.environ.copy()
    env["PROG"] = prog
    proc = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 3 and '"type":"header"' in proc.stdout.splitlines()[0]
    assert "Traceback" not in proc.stderr
    assert done.read_text() == "ok"


@BACKENDS
def test_less_common_driver_paths(tmp_path, backend):
    records, report, _ = traced(tmp_path, PROGS / "apis_prog.py", "apis", backend)
    check_common(records)
    by_type: dict[str, list] = {}
    for rec in records:
        by_type.setdefault(rec["type"], []).append(rec)

    coop = [r for r in by_type["launch"] if r["kernel"] == "coop_sum"]
    assert coop and coop[0]["api"].startswith("cuLaunchCooperativeKernel")
    assert int.from_bytes(bytes.fromhex(coop[0]["params"][0]["hex"]), "little") == report["coop_out"]

    allocs = {r["addr"]: r for r in by_type["alloc"]}
    assert allocs[report["async_ptr"]]["kind"] in ("async", "pool")
    assert any(r["addr"] == report["async_ptr"] and r["api"].startswith("cuMemFreeAsync") for r in by_type["free"])
    assert allocs[report["managed_ptr"]]["kind"] == "managed"
    assert any(a["kind"] == "host" and a["addr"] <= report["pinned_ptr"] < a["addr"] + a["size"]
               for a in by_type["alloc"])

    copy2d = [r for r in by_type["memcpy"] if "width" in r]
    assert copy2d and copy2d[0]["dir"] == "DtoH" and (copy2d[0]["width"], copy2d[0]["height"]) == (8, 16)
    assert copy2d[0]["bytes"] == 128 and copy2d[0]["src_pitch"] == 64 and copy2d[0]["dst_pitch"] == 8
    assert any(r["dst"] == report["memset_dst"] and r["bytes"] == 4096 and r["value"] in (7, 0x0707, 0x07070707)
               for r in by_type["memset"])

    captured = [r for r in by_type["launch"] if r.get("captured")]
    assert captured, "the launches made while torch.cuda.graph() captured are marked"
    assert not [r for r in coop if r.get("captured")]
    graphs = by_type.get("graph_launch", [])
    assert len(graphs) == report["graph_replays"]
    assert len({g["graph"] for g in graphs}) == 1
    # the capture and the instantiation link the captured launches to the executable graph
    events = {r["event"]: r for r in by_type["graph"]}
    assert set(events) >= {"capture_begin", "capture_end", "instantiate"}
    assert events["capture_end"]["graph"] == events["instantiate"]["graph"]
    assert events["instantiate"]["exec"] == graphs[0]["graph"]
    from gpuos_tools.access.predict import Predictor

    pred = Predictor("range")
    graph_acc = [a for a in map(pred.feed, records) if a and a["of"] == "graph_launch"]
    assert len(graph_acc) == 2 and not graph_acc[0]["unknown"], graph_acc
    assert graph_acc[0]["launches"] == len(captured) and graph_acc[0]["writes"]


@BACKENDS
def test_numba_program(tmp_path, backend):
    """Numba passes each array as several flattened parameters (meminfo, parent, sizes, data...)."""
    env = os.environ.copy()
    env["GPUOS_TEST_REPORT"] = str(tmp_path / "untraced.json")
    plain = subprocess.run([sys.executable, str(PROGS / "numba_prog.py")], env=env,
                           capture_output=True, text=True, timeout=300)
    if plain.returncode != 0:  # e.g. numba-cuda older than the installed NumPy (np.row_stack gone)
        pytest.skip(f"Numba does not run here even untraced: {plain.stderr.strip().splitlines()[-1]}")
    records, report, _ = traced(tmp_path, PROGS / "numba_prog.py", "numba", backend)
    launches = check_common(records)
    (saxpy,) = [r for r in launches if "saxpy" in r["name"]]
    seen = {int.from_bytes(bytes.fromhex(saxpy["params"][i]["hex"])[off : off + 8], "little")
            for i, off, _ in saxpy["dptrs"]}
    assert set(report["pointers"].values()) <= seen
    assert any(r["type"] == "memcpy" and r["dir"] == "HtoD" for r in records)


@BACKENDS
def test_cufft_module_variables_are_traced_and_followed(tmp_path, backend):
    """cuFFT stores its twiddle table's address in a variable of each JIT-linked module it loads
    and reads the table through it; it gets its kernels through no public call, so the tracer
    asks the driver which module holds each kernel it sees launched. The prediction of every
    cuFFT launch then reads the table through the variable."""
    pytest.importorskip("cupy")
    records, _, _ = traced(tmp_path, PROGS / "validator_prog.py", "fft", backend, args=("fft",))
    from gpuos_tools.access.predict import Predictor

    variables = {r["addr"]: r for r in records if r["type"] == "symbol" and r["of"] == "variable"}
    assert "lut_sp" in {v["name"] for v in variables.values()}, sorted({r["type"] for r in records})
    modules = {r["func"]: r["parent"] for r in records if r["type"] == "symbol" and r["of"] == "function"}
    fft = [r for r in records if r["type"] == "launch" and "fft" in r["kernel"]]
    assert fft and all(r["func"] in modules for r in fft)
    stored = [r for r in records if r["type"] == "memcpy" and r["dst"] in variables]
    assert stored and all(r.get("data") for r in stored)
    pred = Predictor("range")
    accs = {acc["seq"]: acc for r in records if (acc := pred.feed(r)) is not None and acc["of"] == "launch"}
    for r in fft:
        assert any("variable:lut_sp" in e["how"] for e in accs[r["seq"]]["reads"]), r["kernel"]
