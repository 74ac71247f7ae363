"""CPU checks over traces recorded on the GPU machine (tests/data/recorded/README.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuos_tools.cuda import elf
from gpuos_tools.errors import ExitCode
from gpuos_tools.stream import open_input
from gpuos_tools.model.allocs import AllocTable

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "recorded"
TRACES = ["cupy.ndjson.zst", "cupy-python.ndjson.zst", "torch.ndjson.zst", "torch-python.ndjson.zst",
          "apis.ndjson.zst"]


def load(name: str) -> list[dict]:
    with open_input(str(DATA / name)) as reader:
        return list(reader)


@pytest.mark.parametrize("name", TRACES)
def test_every_device_pointer_resolves_to_a_recorded_allocation(name):
    records = load(name)
    assert records[0]["type"] == "header" and records[-1]["type"] == "exit" and records[-1]["complete"]
    table = AllocTable()
    checked = 0
    for rec in records:
        if rec["type"] in ("alloc", "free"):
            table.feed(rec)
        elif rec["type"] == "launch":
            assert rec["layout"] in ("cuFuncGetParamInfo", "cuKernelGetParamInfo")
            for i, off, _ in rec["dptrs"]:
                word = int.from_bytes(bytes.fromhex(rec["params"][i]["hex"])[off : off + 8], "little")
                assert table.resolve(word) is not None, (rec["kernel"], i, off, hex(word))
                checked += 1
    assert checked > 10


def test_both_tracer_paths_record_the_same_program_alike():
    def shape(name):
        return [(r["type"], r.get("kernel"), r.get("grid"), [p["size"] for p in r.get("params", [])])
                for r in load(name) if r["type"] in ("launch", "alloc", "free", "memcpy", "memset")]

    assert shape("cupy.ndjson.zst") == shape("cupy-python.ndjson.zst")


def test_raw_kernel_struct_argument_is_decoded():
    records = load("cupy.ndjson.zst")
    report = json.loads((DATA / "cupy.report.json").read_text())
    (affine,) = [r for r in records if r["type"] == "launch" and r["kernel"] == "affine"]
    struct_bytes = bytes.fromhex(affine["params"][0]["hex"])
    assert int.from_bytes(struct_bytes[:8], "little") == report["pointers"]["out"]
    assert int.from_bytes(struct_bytes[8:16], "little") == report["pointers"]["y"]


def test_nv_info_layout_agrees_with_the_driver():
    """The .nv.info parser (pyelftools) gives the layout cuFuncGetParamInfo gave on the GPU."""
    records = load("cupy.ndjson.zst")
    modules = {m["hash"]: m for m in records if m["type"] == "module"}
    compared = 0
    for launch in (r for r in records if r["type"] == "launch"):
        module = modules.get(launch.get("module"))
        image = DATA / "cupy.images" / module["file"] if module else None
        if image is None or not image.is_file():
            continue
        layout = [(off, size) for _, off, size in elf.param_layout(image.read_bytes(), launch["kernel"])]
        assert layout == [(p["offset"], p["size"]) for p in launch["params"]], launch["kernel"]
        compared += 1
    assert compared >= 3


def test_torch_allocator_segments_are_live_at_exit():
    records = load("torch.ndjson.zst")
    report = json.loads((DATA / "torch.report.json").read_text())
    live = {}
    for rec in records:
        if rec["type"] == "alloc":
            live[rec["addr"]] = rec["size"]
        elif rec["type"] == "free":
            live.pop(rec["addr"], None)
    for addr, size in report["segments"]:
        assert live[addr] == size


def test_stats_separates_graph_capture_from_executed_launches():
    from gpuos_tools.trace.stats import compute_stats, stats_records

    summary = next(stats_records(compute_stats(load("apis.ndjson.zst"))))
    records = load("apis.ndjson.zst")
    launches = [r for r in records if r["type"] == "launch"]
    captured = [r for r in launches if r.get("captured")]
    assert captured and summary["captured_launches"] == len(captured)
    assert summary["launches"] == len(launches) - len(captured)
    assert summary["graph_launches"] == 2


def stats(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cmd" / "gpu-trace"), "stats", *args],
                          capture_output=True, text=True, timeout=60, **kw)


def test_stats_on_the_example_writes_json_records_to_a_pipe():
    proc = stats(str(ROOT / "examples" / "torch-train-step.ndjson.zst"))
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert out[0]["type"] == "header"
    summary = out[1]
    assert summary["type"] == "stats_summary" and summary["launches"] == 92 and summary["unknown_ptrs"] == 0
    kernels = [r for r in out if r["type"] == "stats_kernel"]
    assert sum(k["launches"] for k in kernels) <= 92 and kernels[0]["launches"] >= kernels[-1]["launches"]


def test_stats_reads_stdin():
    data = (ROOT / "examples" / "torch-train-step.ndjson.zst").read_bytes()
    proc = stats("-", "--top", "3", input=data.decode("latin-1"), encoding="latin-1")
    assert proc.returncode == 0, proc.stderr
    assert sum(1 for line in proc.stdout.splitlines() if '"stats_kernel"' in line) == 3


def test_stats_reports_a_truncated_trace(tmp_path):
    src = DATA / "torch.ndjson.zst"
    cut = tmp_path / "cut.ndjson.zst"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    proc = stats(str(cut))
    assert proc.returncode == ExitCode.TRUNCATED
    assert "cut.ndjson.zst" in proc.stderr and "truncated" in proc.stderr


def test_stats_reports_a_corrupt_line_with_its_number(tmp_path):
    plain = tmp_path / "t.ndjson"
    with open_input(str(DATA / "cupy.ndjson.zst")) as reader:
        lines = [json.dumps(r) for r in reader]
    lines[5] = lines[5][: len(lines[5]) // 2]
    plain.write_text("\n".join(lines) + "\n")
    proc = stats(str(plain))
    assert proc.returncode == ExitCode.BAD_INPUT
    assert "t.ndjson:6" in proc.stderr


def test_stats_on_a_missing_file():
    proc = stats("/nonexistent/trace.ndjson")
    assert proc.returncode == ExitCode.NO_INPUT


@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) for a terminal")
def test_stats_draws_tables_on_a_terminal():
    example = ROOT / "examples" / "torch-train-step.ndjson.zst"
    cmd = f"{sys.executable} {ROOT / 'cmd' / 'gpu-trace'} stats {example}"
    env = {"PATH": "/usr/bin:/bin", "NO_COLOR": "1", "COLUMNS": "160", "TERM": "dumb"}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    proc = subprocess.run(["script", "-qec", cmd, "/dev/null"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stdout
    assert "stats_summary" not in proc.stdout and "launches" in proc.stdout
