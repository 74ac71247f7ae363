"""The tracer-to-gpu-trace wire and its decoding (unit tests: the tuples stand in for the tracer)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuos_tools.cuda import elf
from gpuos_tools.model import wire
from gpuos_tools.model.decode import Decoder


def test_frames_round_trip_through_a_pipe():
    r, w = os.pipe()
    items = [(wire.ALLOC, 1, 2, 3, 0x7F0000000000, 4096, "device", 0)] * 1000
    wire.write_all(w, wire.encode_frame(items) + wire.encode_frame(items[:3]))
    os.close(w)
    frames = list(wire.read_frames(r, chunk=777))
    os.close(r)
    assert [len(f) for f in frames] == [1000, 3]
    assert frames[0][0] == items[0]


def test_a_cut_frame_is_reported():
    r, w = os.pipe()
    data = wire.encode_frame([(wire.END, 1, {})])
    os.write(w, data[:-2])
    os.close(w)
    with pytest.raises(wire.TruncatedWire):
        list(wire.read_frames(r))
    os.close(r)


def test_launch_parameters_are_sliced_by_layout(tmp_path):
    dec = Decoder(tmp_path)
    ptr = 0x7F1234560000
    args = ptr.to_bytes(8, "little") + (5).to_bytes(4, "little") + bytes(range(24))
    out = list(dec.feed([
        (wire.HELLO, 42, "3.12", "13.0.1", {307: "cuLaunchKernel", 20: "cuMemAlloc_v2", 21: "cuMemFree_v2"}, {}),
        (wire.ALLOC, 10, 7, 20, ptr, 1 << 20, "device", 0),
        (wire.FUNC, 0xABC, "_Z3addPfi", "cuFuncGetParamInfo", ((0, 8), (8, 4), (16, 24))),
        (wire.LAUNCH, 11, 7, 307, 0xABC, 4, 1, 1, 128, 1, 1, 0, 0, args, 0, False),
        (wire.FREE, 12, 7, 21, ptr, -1, 0),
        (wire.END, 13, {"callbacks": 3}),
    ]))
    alloc, launch, free = out
    assert alloc["id"] == 1 and alloc["api"] == "cuMemAlloc_v2"
    assert launch["name"] == "add(float*, int)"
    assert [(p["offset"], p["size"]) for p in launch["params"]] == [(0, 8), (8, 4), (16, 24)]
    assert int.from_bytes(bytes.fromhex(launch["params"][0]["hex"]), "little") == ptr
    assert launch["params"][2]["hex"] == bytes(range(24)).hex()
    assert free["id"] == 1 and "size" not in free
    assert "captured" not in launch and "dptrs" not in launch
    assert dec.end == {"callbacks": 3}


def test_a_launch_without_layout_says_so(tmp_path):
    dec = Decoder(None)
    list(dec.feed([(wire.FUNC, 1, "k", "none", None)]))
    (launch,) = dec.feed([(wire.LAUNCH, 1, 1, 307, 1, 1, 1, 1, 1, 1, 1, 0, 0, None, 0, True)])
    assert launch["layout"] == "none" and launch["params"] == []
    assert launch["captured"] is True


def test_module_images_are_stored_once_by_hash(tmp_path):
    dec = Decoder(tmp_path)
    ptx = b".version 8.0\n.target sm_90\n"
    a, b = dec.feed([(wire.LIBRARY, 1, 1, 5, "ptx", len(ptx), ptx)] * 2)
    assert a["hash"] == b["hash"] and a["hash"].startswith("sha256:")
    assert (tmp_path / a["file"]).read_bytes() == ptx
    assert len(list(tmp_path.iterdir())) == 1


def test_a_launch_names_the_module_its_function_came_from_not_a_later_one_of_the_same_name(tmp_path):
    """CuPy loads one module per array rank, each defining a kernel of the same name: a launch of
    the 2-D kernel after the 1-D module was loaded still names the 2-D module."""
    cubin = (Path(__file__).resolve().parent / "data" / "kernels.sm_90.cubin").read_bytes()
    name = elf.kernels(cubin)[0]
    dec = Decoder(None)
    launch = (wire.LAUNCH, 3, 1, 307, 0xF2, 1, 1, 1, 1, 1, 1, 0, 0, None, 0, False)
    out = list(dec.feed([(wire.MODULE, 1, 1, 1, cubin), (wire.FUNC, 0xF2, name, "none", None), launch,
                         (wire.MODULE, 2, 1, 2, cubin + b"\0" * 8), (wire.FUNC, 0xF1, name, "none", None),
                         launch, launch[:4] + (0xF1,) + launch[5:]]))
    two_d, one_d = out[0]["hash"], out[2]["hash"]
    assert two_d != one_d
    assert [r["module"] for r in out if r["type"] == "launch"] == [two_d, two_d, one_d]
