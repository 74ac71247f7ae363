"""`gpu-trace run --validate --validate-in validator`: the replay runs in a validator process, so that
nothing it does (a fault, a device-side assert) reaches the program (pytest -m gpu).

Each program of progs/validator_prog.py runs twice, plainly and validated; its results must be
identical byte for byte, and its exit status 0 both times. With GPUOS_KEEP_TRACES set, the traces
and a summary of the verdicts (validator-summary-MODE.json: checked, faults, why unvalidated,
whether read-only mappings were taken, the address strategy used and the launches each strategy
lost) are kept there."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from gpuos_tools.stream import open_input

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PROG = Path(__file__).resolve().parent / "progs" / "validator_prog.py"
NEEDS = {"kernels": "cupy", "solve": "cupy", "fft": "cupy", "torch": "torch", "sparse": "cupy", "compiled": "triton",
         "timm": "timm", "gemm": "cupy"}
#: the programs of library kernels only (no deliberate miss among them)
LIBRARIES = ("solve", "fft", "torch", "sparse", "compiled", "timm", "gemm")
#: the programs whose read extents are measured too (the bisection takes tens of replays a
#: launch: the others run without, to keep the file's time in bounds)
EXTENTS = ("kernels", "gemm")
_runs: dict[str, dict] = {}


def summary(records: list[dict]) -> dict:
    vals = [r for r in records if r["type"] == "validation"]
    return {
        "validations": len(vals),
        "checked": sum(bool(v["checked"]) for v in vals),
        "reads": dict(Counter(v.get("reads", "-") for v in vals if v["checked"])),
        "missed_write_launches": sum(bool(v.get("missed_writes")) for v in vals),
        "faults": dict(Counter(v["fault"] for v in vals if "fault" in v)),
        "read_only": dict(Counter(v["read_only"] for v in vals if "read_only" in v)),
        "with_attributes": dict(Counter(str(v["attributes"]) for v in vals if v["checked"] and "attributes" in v)),
        "unvalidated": dict(Counter(v.get("why", "")[:200] for v in vals if not v["checked"])),
        "ms": sorted(v["ms"] for v in vals if "ms" in v),
        # launches replayed with spans moved away from addresses no validator could have
        "relocated": sum("relocated" in v for v in vals if v["checked"]),
        "relocated_pointers": dict(sum((Counter(v["relocated"]["pointers"]) for v in vals if "relocated" in v),
                                       Counter())),
        # the address strategy that answered, and the launches each strategy could not get the
        # addresses of (those it passed on to the next, and those left unvalidated)
        "addresses": dict(Counter(v["addresses"] for v in vals if "addresses" in v)),
        "address_lost": dict(Counter([f["strategy"] for v in vals for f in v.get("address_fallback", [])]
                                     + [v["addresses"] for v in vals if "addresses" in v and not v["checked"]
                                        and v.get("why", "").startswith("unvalidated: address unavailable")])),
        "errors": [r.get("message", r) for r in records if r["type"] == "error"][:20],
    }


def runs(mode: str, tmp_root: Path) -> dict:
    """The plain and the validated run of ``mode`` (once per session)."""
    if mode in _runs:
        return _runs[mode]
    if importlib.util.find_spec(NEEDS[mode]) is None:
        pytest.skip(f"{NEEDS[mode]} is not installed")
    tmp = tmp_root / mode
    tmp.mkdir()
    out = {}
    for tag in ("plain", "validated"):
        report = tmp / f"{tag}.json"
        trace = tmp / f"{tag}.ndjson"
        env = dict(os.environ, GPUOS_TEST_REPORT=str(report))
        cmd = [sys.executable, str(PROG), mode]
        if tag == "validated":
            cmd = [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--validate", "--validate-in",
                   "validator", "--validate-samples", "1", "--no-images", "-o", str(trace),
                   *(() if mode in EXTENTS else ("--no-validate-extents",)), "--", *cmd]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
        out[tag] = {"rc": proc.returncode, "stderr": proc.stderr[-4000:],
                    "report": json.loads(report.read_text()) if report.exists() else None}
        if tag == "validated" and trace.exists():
            with open_input(str(trace)) as reader:
                out["records"] = list(reader)
    records = out.get("records", [])
    out["summary"] = summary(records)
    keep = os.environ.get("GPUOS_KEEP_TRACES")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"validator-summary-{mode}.json").write_text(json.dumps(out["summary"], indent=1))
        if (tmp / "validated.ndjson").exists():
            (Path(keep) / f"validator-{mode}.ndjson").write_bytes((tmp / "validated.ndjson").read_bytes())
    print(f"\nvalidator {mode}: {json.dumps(out['summary'])}", file=sys.stderr)
    _runs[mode] = out
    return out


@pytest.fixture(scope="session")
def tmp_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("validator")


def by_kernel(records: list[dict], name: str) -> list[dict]:
    vals = [r for r in records if r["type"] == "validation" and name in r.get("kernel", "")]
    assert vals, (name, sorted({r.get("kernel") for r in records if r["type"] == "validation"}))
    return vals


def covers(ranges, start, size):
    """True when [start, start + size) lies inside the union of [addr, size] ranges."""
    pos = start
    for a, n in sorted(ranges):
        if a <= pos < a + n:
            pos = a + n
    return pos >= start + size


@pytest.mark.parametrize("mode", list(NEEDS))
def test_the_program_runs_as_it_does_plainly(mode, tmp_root):
    r = runs(mode, tmp_root)
    assert r["plain"]["rc"] == 0, r["plain"]["stderr"]
    assert r["validated"]["rc"] == 0, r["validated"]["stderr"]
    assert r["validated"]["report"]["digest"] == r["plain"]["report"]["digest"]
    s = r["summary"]
    assert s["validations"] > 0, s
    assert all(v.get("mode") == "validator" for v in r["records"] if v["type"] == "validation")
    # no exception escaped the tracer's callbacks, and the validator was never switched off
    assert not [e for e in s["errors"] if "callback" in str(e) or "switched off" in str(e)], s["errors"]


def test_a_right_prediction_is_checked_and_passes(tmp_root):
    r = runs("kernels", tmp_root)
    v = by_kernel(r["records"], "_Z4copyIf")[0]  # copy<float>, its first launch
    assert v["checked"], v
    assert v["reads"] == "ok" and v["missed_writes"] == [], v
    y, n = r["validated"]["report"]["bufs"]["y"][0], 10000
    assert covers(v["written"], y, 4 * n - 128), v
    assert sum(size for _, size in v["written"]) < 4 * n + 128


def test_read_extents_are_measured_in_the_validator(tmp_root):
    """copy<float> reads n floats of x and writes n of y: the bisection in the validator finds
    both to the chunk."""
    r = runs("kernels", tmp_root)
    v = by_kernel(r["records"], "_Z4copyIf")[0]
    ext = {e["ptr"]: e for e in v["extents"]}
    bufs, n = r["validated"]["report"]["bufs"], 10000
    x, y = bufs["x"][0], bufs["y"][0]
    assert 4 * n - 128 < ext[x]["read"] <= 4 * n + 128, ext
    assert 4 * n - 128 < ext[y]["written"] <= 4 * n + 128 and ext[y]["read"] <= 128, ext
    gemm = [e for v in runs("gemm", tmp_root)["records"] if v["type"] == "validation" for e in v.get("extents", [])]
    assert gemm and all(e["read"] <= e["limit"] for e in gemm)


def test_a_pointer_table_copied_from_the_host_is_followed_and_passes(tmp_root):
    r = runs("kernels", tmp_root)
    v = by_kernel(r["records"], "follow_write")[0]
    assert v["checked"] and v["missed_writes"] == [] and v["reads"] == "ok", v


def test_a_read_through_a_pointer_stored_on_the_gpu_is_caught(tmp_root):
    r = runs("kernels", tmp_root)
    v = by_kernel(r["records"], "hidden_read")[0]
    assert v["checked"] and v["reads"] == "missed", v


def test_a_deliberately_wrong_prediction_is_caught(tmp_root):
    """hidden_write writes a 32 MiB buffer of its own that its prediction does not name: the replay
    faults (nothing is mapped there) or, were it in a mapped granule, shows changed chunks."""
    r = runs("kernels", tmp_root)
    v = by_kernel(r["records"], "hidden_write")[0]
    assert v["checked"], v
    assert v.get("fault") == "CUDA_ERROR_ILLEGAL_ADDRESS" or v["missed_writes"], v


def test_read_only_mappings_are_measured(tmp_root):
    """Where the prediction says a granule is only read, the validator asks for a read-only mapping;
    whether the driver took it is in the record (refused: a write to it shows as a changed chunk)."""
    r = runs("kernels", tmp_root)
    seen = [v["read_only"] for v in r["records"] if v["type"] == "validation" and "read_only" in v]
    print(f"\nread-only mappings: {dict(Counter(seen))}", file=sys.stderr)
    assert seen, "no launch with a read-only granule was checked"
    assert set(seen) <= {"enforced", "refused"}
    v = by_kernel(r["records"], "twice")[0]  # reads 16 MiB of granules of its own, writes others
    assert v["checked"] and v["reads"] == "ok" and v["missed_writes"] == [] and "read_only" in v, v


@pytest.mark.parametrize("mode", list(NEEDS))
def test_the_programs_addresses_are_had_and_one_strategy_is_kept(mode, tmp_root):
    """Some launch of every program gets its addresses in the validator, and from the first that
    does, every answer comes from a validator of that same address strategy."""
    r = runs(mode, tmp_root)
    vals = [v for v in r.get("records", []) if v["type"] == "validation" and "addresses" in v]
    assert vals, r["summary"]
    got = [i for i, v in enumerate(vals) if (v["checked"] or "fault" in v) and "relocated" not in v]
    assert got, r["summary"]
    kept = vals[got[0]]["addresses"]
    print(f"\nvalidator {mode}: addresses by {kept}, lost {r['summary']['address_lost']}", file=sys.stderr)
    assert {v["addresses"] for v in vals[got[0]:]} == {kept}, r["summary"]


@pytest.mark.parametrize("mode", LIBRARIES)
def test_library_kernels_miss_no_read_and_no_write(mode, tmp_root):
    """cuSOLVER, cuBLAS, cuFFT, cuSPARSE, PyTorch's indexing kernels, Triton's and cuDNN's: every
    launch the validator checked read and wrote only what its prediction named."""
    r = runs(mode, tmp_root)
    s = r["summary"]
    assert s["checked"] > 0, s
    assert s["missed_write_launches"] == 0 and "missed" not in s["reads"], s


@pytest.mark.parametrize("mode", list(NEEDS))
def test_no_launch_is_left_unvalidated_for_want_of_its_addresses(mode, tmp_root):
    """A launch whose addresses no validator got is replayed with those spans moved and the
    pointers to them moved with them."""
    r = runs(mode, tmp_root)
    lost = {w: n for w, n in r["summary"]["unvalidated"].items() if w.startswith("unvalidated: address unavailable")}
    print(f"\nvalidator {mode}: {r['summary']['relocated']} launches moved, pointers "
          f"{r['summary']['relocated_pointers']}", file=sys.stderr)
    assert not lost, r["summary"]


@pytest.mark.parametrize("where", ["process", "validator"])
def test_in_place_reads_are_seen_and_overwrites_read_nothing(where, tmp_path):
    """progs/validator_prog.py inplace, validated in the program's process and in the validator,
    with read extents: the operands that scale and add_ update in place are read to their ends,
    seen only through the bytes the control run wrote (``in_place``); the operand overwrite fills
    from y, and the one partial writes every other word of, are not read at all."""
    for lib in ("cupy", "torch"):
        if importlib.util.find_spec(lib) is None:
            pytest.skip(f"{lib} is not installed")
    report, trace = tmp_path / "report.json", tmp_path / "trace.ndjson"
    proc = subprocess.run(
        [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--validate", "--validate-in", where,
         "--validate-samples", "1", "--no-images", "-o", str(trace), "--", sys.executable, str(PROG), "inplace"],
        cwd=ROOT, env=dict(os.environ, GPUOS_TEST_REPORT=str(report)), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open_input(str(trace)) as reader:
        records = list(reader)
    keep = os.environ.get("GPUOS_KEEP_TRACES")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"inplace-{where}.ndjson").write_bytes(trace.read_bytes())
    bufs = json.loads(report.read_text())["bufs"]
    vals = [r for r in records if r["type"] == "validation"]
    # each buffer's extent in the launch of the kernel that updates it (its name holds the word)
    kernels = {"scaled": "scale", "over": "overwrite", "part": "partial", "a": "_add"}
    ext, launch = {}, {}
    for name, word in kernels.items():
        launch[name] = v = next((v for v in vals if word in v["kernel"]), None)
        assert v is not None, (name, sorted({v["kernel"] for v in vals}))
        assert v["checked"] and v["reads"] == "ok" and v["missed_writes"] == [], v
        ext[name] = {e["ptr"]: e for e in v["extents"]}[bufs[name][0]]
    print(f"\nin-place extents ({where}): {json.dumps(ext)}", file=sys.stderr)
    n = bufs["scaled"][1]
    for name in ("scaled", "a"):  # read to the end of what they update, seen only by the written bytes
        assert n <= ext[name]["read"] <= n + 128 and ext[name]["written"] >= n, ext[name]
        assert ext[name]["in_place"] > 0, ext[name]
    for name in ("over", "part"):
        assert ext[name]["written"] >= n and ext[name]["read"] == 0 and ext[name]["in_place"] == 0, ext[name]
    y = {e["ptr"]: e for e in launch["over"]["extents"]}[bufs["y"][0]]
    assert n <= y["read"] <= n + 128 and y["in_place"] == 0, y  # what it copies: seen as before
