"""The agent-path images recorded on an H100 (tests/data/recorded/agent-image, by
scripts/record-agent-image): a full image of workloads/image_prog.py taken while it ran,
and an incremental one after it changed one buffer. What CPU-side readers must get from them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from gpuos_tools.agent.agent import fit_problems
from gpuos_tools.image import compact, diff, open_image, verify
from gpuos_tools.model.allocs import Allocation

HERE = Path(__file__).resolve().parent / "data" / "recorded" / "agent-image"


def test_the_recorded_chain_verifies_and_holds_what_the_program_wrote():
    assert verify(HERE / "inc") == []
    inc = open_image(HERE / "inc")
    assert [i.path for i in inc.chain()] == [str(HERE / "inc"), str(HERE / "full")]
    assert inc.manifest["gpu"].startswith("NVIDIA H100") and inc.incremental
    assert [b["id"] for b in inc.buffers if b.get("stored", True)] == [2]  # only b changed
    a, b, c = (inc.read(i) for i in (1, 2, 3))
    assert np.array_equal(np.frombuffer(a, np.float32), np.arange(16 << 10, dtype=np.float32))
    assert np.all(np.frombuffer(b, np.int32) == 8) and not any(c)
    assert np.all(np.frombuffer(open_image(HERE / "full").read(2), np.int32) == 7)


def test_diff_names_the_one_changed_buffer():
    (change,) = [d for d in diff(HERE / "full", HERE / "inc") if d.get("change") != "same"]
    assert change["buffer"] == 2 and change["bytes"] == 262144


def test_compacted_chain_reads_the_same(tmp_path):
    out = tmp_path / "full"
    compact(HERE / "inc", out)
    assert verify(out) == []
    one, chain = open_image(out), open_image(HERE / "inc")
    assert not one.incremental and all(one.read(i) == chain.read(i) for i in (1, 2, 3))


def test_rollback_fit_of_the_recorded_table():
    m = open_image(HERE / "inc").manifest
    facts = {"gpu": m["gpu"], "cuda": m["cuda"]}
    live = [Allocation(b["id"] + 10, b["addr"], b["size"], "device") for b in m["buffers"]]
    assert fit_problems(m, live, facts) == []
    assert fit_problems(m, live[:2], facts) and fit_problems(m, live, {**facts, "gpu": "NVIDIA H200"})


def test_a_flipped_byte_in_the_recorded_image_is_named(tmp_path):
    shutil.copytree(HERE, tmp_path / "copy")
    chunk = tmp_path / "copy" / "full" / "chunks" / "1-0.zst"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x40
    chunk.write_bytes(bytes(data))
    problems = verify(tmp_path / "copy" / "inc")
    assert problems and any("1-0.zst" in p for p in problems), problems
