"""gpu-predict-access on the traces recorded on an H200 (tests/data/recorded, examples/)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, child_env

from gpuos_tools.access import Predictor
from gpuos_tools.access.report import compute_report, explain, report_records
from gpuos_tools.errors import ExitCode
from gpuos_tools.stream import open_input
from gpuos_tools.model.records import pointer_words

RECORDED = REPO / "tests" / "data" / "recorded"
TRACES = ["cupy", "cupy-python", "torch", "torch-python", "apis"]
EXAMPLE = REPO / "examples" / "torch-train-step.ndjson.zst"
CMD = [sys.executable, str(REPO / "cmd" / "gpu-predict-access")]


def load(name: str) -> list[dict]:
    with open_input(RECORDED / f"{name}.ndjson.zst") as reader:
        return list(reader)


def annotate(records: list[dict], granularity: str = "alloc") -> list[dict]:
    return list(Predictor(granularity).annotate(copy.deepcopy(records)))


def accesses(records: list[dict], granularity: str = "alloc") -> dict:
    """{("launch", seq) | (of, index): access record}."""
    out = {}
    for rec in Predictor(granularity).annotate(copy.deepcopy(records)):
        if rec["type"] == "access":
            out[(rec["of"], rec.get("seq", rec.get("index")))] = rec
    return out


def command(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*CMD, *args], input=stdin, capture_output=True, env=child_env(), timeout=120, check=False)


@pytest.mark.parametrize("name", TRACES)
def test_every_dptr_is_read_or_written(name: str) -> None:
    records = load(name)
    acc = accesses(records)
    allocs: dict[int, tuple[int, int]] = {}
    launches = 0
    for rec in records:
        if rec["type"] == "alloc":
            allocs[rec["id"]] = (rec["addr"], rec["addr"] + rec["size"])
        if rec["type"] != "launch":
            continue
        launches += 1
        a = acc[("launch", rec["seq"])]
        assert not a["unknown"], a.get("why")
        words = {(i, off): v for i, off, v in pointer_words(rec)}
        touched = {e["alloc"] for e in a["reads"] + a["writes"]}
        assert rec["dptrs"], "the recorded traces were taken with --check-pointers"
        for i, off, _ in rec["dptrs"]:
            word = words[(i, off)]
            assert any(lo <= word < hi for aid, (lo, hi) in allocs.items() if aid in touched), (rec["seq"], i, off)
    assert launches == sum(1 for a in acc if a[0] == "launch")


def test_const_pointers_are_read_only() -> None:
    records = load("torch")
    softmax = next(r for r in records if r["type"] == "launch" and "softmax_warp_backward" in r["name"])
    acc = accesses(records, "range")[("launch", softmax["seq"])]
    # (float*, float const*, float const*, int, int, int, bool const*): three pointers into allocation 1
    reads = {e["alloc"]: e for e in acc["reads"]}
    writes = {e["alloc"]: e for e in acc["writes"]}
    assert set(reads) == set(writes) == {1}
    assert writes[1]["how"] == "dptr:pointer"
    assert reads[1]["how"] == "dptr:pointer,dptr:const"
    out_word, in1, in2 = (int.from_bytes(bytes.fromhex(softmax["params"][i]["hex"]), "little") for i in range(3))
    lows = [r for r in records if r["type"] == "alloc" and r["id"] == 1][0]["addr"]
    # written: from the output pointer; read: from the lowest of the three
    assert writes[1]["offset"] == out_word - lows
    assert reads[1]["offset"] == min(out_word, in1, in2) - lows
    assert in1 < out_word and in2 < out_word  # so the const inputs are read, not written


def test_const_only_pointer_is_never_written() -> None:
    records = load("torch")
    # seq 16: cuBLAS's split-K reduction reads its partial sums (a 32 MiB cuBLAS workspace,
    # allocation 9) only through `float const*` parameters
    splitk = next(r for r in records if r["type"] == "launch" and r["seq"] == 16)
    assert "splitKreduce_kernel" in splitk["name"]
    acc = accesses(records)[("launch", 16)]
    hows = {e["alloc"]: e["how"] for e in acc["reads"]}
    written = {e["alloc"] for e in acc["writes"]}
    const_only = [a for a, how in hows.items() if set(how.split(",")) == {"dptr:const"}]
    assert const_only == [9] and 9 not in written


def test_cupy_struct_arguments_are_read_and_written() -> None:
    acc = accesses(load("cupy"))
    mul = acc[("launch", 2)]
    assert mul["kernel"] == "cupy_multiply__float32_float_float32"
    assert [e["alloc"] for e in mul["reads"]] == [e["alloc"] for e in mul["writes"]] == [1, 2]
    assert {e["how"] for e in mul["reads"] + mul["writes"]} == {"dptr:struct"}


def test_without_dptrs_the_scan_finds_the_same_buffers() -> None:
    for name in ("cupy", "torch", "apis"):
        records = load(name)
        stripped = copy.deepcopy(records)
        for rec in stripped:
            rec.pop("dptrs", None)
        with_d, without = accesses(records), accesses(stripped)
        assert with_d.keys() == without.keys()
        for key, a in with_d.items():
            b = without[key]
            assert [e["alloc"] for e in a["reads"]] == [e["alloc"] for e in b["reads"]], key
            assert [e["alloc"] for e in a["writes"]] == [e["alloc"] for e in b["writes"]], key
            assert all(e["how"].startswith("scan:") for e in b["reads"] + b["writes"] if key[0] == "launch")


def test_captured_launches_and_graph_launches() -> None:
    acc = accesses(load("apis"))
    captured = acc[("launch", 9)]
    assert captured["captured"] is True and not captured["unknown"]
    assert {e["alloc"] for e in captured["reads"]} == {11, 8}
    assert all("captured" not in a for k, a in acc.items() if k != ("launch", 9))
    for i in (1, 2):
        g = acc[("graph_launch", i)]
        # recorded before the tracer saw stream captures: the graph's contents are unknown
        assert g["unknown"] is True and "contents were not seen" in g["why"]
        assert g["reads"] == g["writes"] == [] and g["graph"] == 401265728


def test_layout_none_is_unknown_never_dropped() -> None:
    # No recorded trace has a launch without layout; this one is a copy of a real launch (cupy
    # seq 2) edited the way the tracer writes such a launch: layout none, no params, no dptrs.
    records = load("cupy")
    launch = copy.deepcopy(next(r for r in records if r["type"] == "launch" and r["seq"] == 2))
    launch.update(seq=99, layout="none", params=[])
    launch.pop("dptrs")
    acc = Predictor().feed(launch)
    assert acc["unknown"] is True and "layout none" in acc["why"]
    assert acc["seq"] == 99 and acc["reads"] == acc["writes"] == []


def test_unresolved_dptr_is_unknown() -> None:
    # A copy of cupy seq 2 whose first allocation was never traced (its alloc record removed).
    records = [r for r in load("cupy") if not (r["type"] == "alloc" and r["id"] == 1)]
    acc = accesses(records)[("launch", 2)]
    assert acc["unknown"] is True and "in no traced allocation" in acc["why"]
    assert [e["alloc"] for e in acc["writes"]] == [2]


def test_memcpy_and_memset() -> None:
    acc = accesses(load("apis"), "range")
    dtoh = acc[("memcpy", 1)]  # 4 bytes from allocation 2 to pageable host memory
    assert dtoh["reads"] == [{"alloc": 2, "offset": 0, "size": 4, "how": "copy source"}] and dtoh["writes"] == []
    two_d = acc[("memcpy", 2)]  # 8 x 16 rows, pitch 64, out of allocation 6
    assert two_d["reads"] == [{"alloc": 6, "offset": 0, "size": 15 * 64 + 8, "how": "copy source"}]
    dtod = acc[("memcpy", 4)]
    assert dtod["reads"] == [{"alloc": 9, "offset": 0, "size": 4096, "how": "copy source"}]
    assert dtod["writes"] == [{"alloc": 8, "offset": 4096, "size": 4096, "how": "copy destination"}]
    pinned = acc[("memcpy", 6)]  # into cuMemHostAlloc memory: a traced allocation, listed
    assert pinned["writes"] == [{"alloc": 12, "offset": 0, "size": 4, "how": "copy destination"}]
    ms = acc[("memset", 2)]
    assert ms["reads"] == [] and ms["writes"] == [{"alloc": 6, "offset": 0, "size": 4096, "how": "memset"}]
    assert not any(a["unknown"] for k, a in acc.items() if k[0] in ("memcpy", "memset"))


def test_granularity_alloc_vs_range() -> None:
    records = load("apis")
    whole, ranged = accesses(records, "alloc"), accesses(records, "range")
    assert whole[("memcpy", 4)]["writes"][0] == {"alloc": 8, "offset": 0, "size": 2097152, "how": "copy destination"}
    assert ranged[("memcpy", 4)]["writes"][0]["size"] == 4096
    # cupy_copy reads allocation 6 from its start: both granularities give the whole of it; at
    # range CuPy's decoded indexer says which of its struct's words is that pointer
    a, b = whole[("launch", 4)]["reads"][0], ranged[("launch", 4)]["reads"][0]
    assert {**a, "how": ""} == {**b, "how": ""}
    assert (a["how"], b["how"]) == ("dptr:struct", "dptr:cupy")
    torch = load("torch")
    w, r = accesses(torch, "alloc"), accesses(torch, "range")
    for key in w:  # range names fewer (a decoded direction) and less of each allocation
        for side in ("reads", "writes"):
            whole_of = {a["alloc"]: a for a in w[key][side]}
            assert all(a["offset"] == 0 for a in whole_of.values())
            for b in r[key][side]:
                a = whole_of[b["alloc"]]
                assert 0 < b["size"] <= a["size"] and b["offset"] + b["size"] <= a["size"]
    assert sum(e["size"] for a in r.values() for e in a["reads"]) < sum(e["size"] for a in w.values() for e in a["reads"])


def test_report_on_the_example_trace() -> None:
    with open_input(EXAMPLE) as reader:
        rows = compute_report(reader)
    recs = list(report_records(rows, "alloc"))
    launches = [r for r in recs if r["of"] == "launch"]
    assert sum(r["launches"] for r in launches) == 92
    assert all(r["unknown"] == 0 for r in recs)
    softmax = next(r for r in launches if "softmax_warp_backward" in r["name"])
    assert (softmax["launches"], softmax["reads_per_launch"], softmax["writes_per_launch"]) == (3, 1.0, 1.0)
    assert softmax["bytes_read"] == softmax["bytes_written"] == 3 * 2097152
    copies = next(r for r in recs if r["of"] == "memcpy")
    assert copies["launches"] == 5
    assert [r["of"] for r in recs[-2:]] == ["memcpy", "memset"]


def test_report_through_the_command() -> None:
    done = command("--report", str(EXAMPLE))
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines[0]["type"] == "header" and lines[0]["tool"] == "gpu-predict-access"
    assert {r["type"] for r in lines[1:]} == {"access_report"}
    assert sum(r["launches"] for r in lines[1:] if r["of"] == "launch") == 92


def test_explain() -> None:
    with open_input(RECORDED / "torch.ndjson.zst") as reader:
        ex = explain(reader, 14)
    assert ex is not None and ex["type"] == "access_explain" and ex["seq"] == 14
    assert [p["type"] for p in ex["params"]][:3] == ["float*", "float const*", "float const*"]
    assert [(w["param"], w["found"], w["alloc"], w["decision"][:4]) for w in ex["words"]] == [
        (0, "dptr", 1, "read"), (1, "dptr", 1, "read"), (2, "dptr", 1, "read"),
    ]  # fmt: skip
    assert ex["words"][0]["decision"].startswith("read+write") and ex["words"][1]["decision"] == "read"
    done = command("--explain", "14", str(RECORDED / "torch.ndjson.zst"))
    assert done.returncode == 0
    assert json.loads(done.stdout.splitlines()[1]) == json.loads(json.dumps(ex))
    missing = command("--explain", "12345", str(RECORDED / "torch.ndjson.zst"))
    assert missing.returncode == ExitCode.FAILURE and b"no launch with seq 12345" in missing.stderr


def test_passthrough_keeps_every_record_in_order() -> None:
    path = RECORDED / "apis.ndjson.zst"
    original = load("apis")
    done = command(str(path))
    assert done.returncode == 0, done.stderr
    out = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r for r in out if r["type"] != "access"] == original
    # each access record follows the record it describes
    for prev, rec in zip(out, out[1:]):
        if rec["type"] == "access":
            assert prev["type"] == rec["of"]
            if rec["of"] == "launch":
                assert prev["seq"] == rec["seq"]
    assert sum(r["type"] == "access" for r in out) == 10 + 6 + 2 + 2


def test_stdin_and_range_option() -> None:
    data = (RECORDED / "cupy.ndjson.zst").read_bytes()
    done = command("--granularity", "range", "-", stdin=data)
    assert done.returncode == 0
    assert sum(b'"type":"access"' in line for line in done.stdout.splitlines()) == 8 + 4 + 2
    assert command("--granularity", "page", stdin=b"").returncode == ExitCode.USAGE


def test_truncated_input_exit_code(tmp_path: Path) -> None:
    text = (RECORDED / "cupy.ndjson.zst").read_bytes()
    import zstandard

    plain = zstandard.ZstdDecompressor().decompressobj().decompress(text)
    cut = tmp_path / "cut.ndjson"
    cut.write_bytes(plain[: len(plain) // 2])
    done = command(str(cut))
    assert done.returncode == ExitCode.TRUNCATED and b"truncated" in done.stderr
    short = tmp_path / "cut.ndjson.zst"
    short.write_bytes(text[: len(text) // 2])
    assert command(str(short)).returncode == ExitCode.TRUNCATED


def test_corrupt_input_exit_code_names_the_line(tmp_path: Path) -> None:
    lines = (RECORDED / "cupy.ndjson.zst").read_bytes()
    import zstandard

    plain = zstandard.ZstdDecompressor().decompressobj().decompress(lines).split(b"\n")
    plain[5] = plain[5][:40]  # a launch record cut in the middle of its JSON
    bad = tmp_path / "bad.ndjson"
    bad.write_bytes(b"\n".join(plain))
    done = command(str(bad))
    assert done.returncode == ExitCode.BAD_INPUT
    assert f"{bad}:6:".encode() in done.stderr
    assert command(str(tmp_path / "nothing.ndjson")).returncode == ExitCode.NO_INPUT
