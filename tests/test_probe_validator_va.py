"""scripts/probe_validator_va.py on a stand-in driver (tests/fake_cuda) that behaves as this
driver is thought to: it reserves an area of its own at cuInit, wherever the kernel puts it, and
honours an address hint only inside it (``own``), or also anywhere free (``any``). The address
space, the placeholders and the children are real; so the test shows the probe runs whole, writes
what the lead reads, and that ``steer`` gets the program's addresses from such a driver."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, child_env

SCRIPT = REPO / "scripts" / "probe_validator_va.py"
FAKE = REPO / "tests" / "fake_cuda"


def run_probe(tmp_path, hints: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE), env.get("PYTHONPATH", str(REPO))])
    env["FAKE_CUDA_HINTS"] = hints
    out = tmp_path / f"{hints}.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())


def probe(tmp_path, hints: str) -> dict:
    proc, report = run_probe(tmp_path, hints)
    for way in report["ways"]:  # the table: one line a way
        assert [ln for ln in proc.stderr.splitlines() if ln.split()[:1] == [way]], (way, proc.stderr)
    return report


def exact(way: dict) -> list[bool]:
    return [bool(t.get("exact")) for t in way["tries"]]


@pytest.mark.parametrize("hints", ["own", "any"])
def test_the_probe_reports_every_way_and_steering_gets_the_programs_addresses(tmp_path, hints):
    r = probe(tmp_path, hints)
    prog = r["program"]
    assert [a["how"] for a in prog["allocs"]] == ["cuMemAlloc"] * 3 + ["vmm"] * 2
    assert prog["areas"] and prog["windows"] and prog["new_at_init"]
    for a in prog["allocs"]:  # each allocation lies in one of the program's driver areas
        assert any(s <= a["addr"] and a["addr"] + a["size"] <= s + n for s, n in prog["areas"]), a
    assert r["kind"] == "simple" and set(prog["phases_s"]) == {"import", "first_call", "context", "allocs", "zygotes"}
    assert set(r["ways"]) == {"areas", "inside-own", "plain", "hold", "late", "steer", "steer-nospare",
                              "steer-windows", "align", "whole", "far", "zygote", "zygote-late", "zygote-fill"}
    # steer-nospare leaves the validator no room of its own after the filling: whether its Python
    # still finds some depends on where ASLR put things, so it may end in an error (a finding)
    assert not [w for w, v in r["ways"].items() if "error" in v and w != "steer-nospare"], r["ways"]
    for way in ("steer", "steer-nospare", "zygote", "zygote-late"):
        if way == "steer-nospare" and "error" in r["ways"][way]:
            continue
        assert exact(r["ways"][way]) == [True] * 5, r["ways"][way]
        assert all(t["map"] == "CUDA_SUCCESS" for t in r["ways"][way]["tries"])
    assert r["ways"]["steer"]["left_free"]  # what the filling left free is shown
    fill = r["ways"]["zygote-fill"]  # the stand-in honours hints in its area: each had by its hint
    assert exact(fill) == [True] * 5 and {t["how"] for t in fill["tries"]} <= {"hint", "held already"}, fill
    assert len(fill["order"]) == 3 and all(int(a, 16) > 0 for a in fill["order"])
    far = {t["what"]: t for t in r["ways"]["far"]["tries"]}
    assert far["far"]["exact"] is (hints == "any")  # a free address outside the driver's own area
    assert any(w.startswith("just inside") and t["exact"] for w, t in far.items())
    if hints == "any":
        assert exact(r["ways"]["hold"]) == [True] * 5
    else:  # outside its area a hint comes back elsewhere, and the maps say what sits at both
        refused = [t for t in r["ways"]["plain"]["tries"] if not t["exact"]]
        assert all(t["maps_granted"] for t in refused)
    assert r["wall_s"] < 60


@pytest.mark.parametrize("hints", ["own", "any"])
def test_areas_and_inside_own_say_where_the_driver_honours_a_hint(tmp_path, hints):
    r = probe(tmp_path, hints)
    prog = r["program"]
    areas = r["ways"]["areas"]
    [area] = areas["areas"]  # the stand-in has one area, holding every allocation
    lo, n = prog["areas"][0]
    assert area["area"].startswith(f"{lo:#x}-{lo + n:#x}")
    assert [a["addr"] for a in areas["allocs"]] == [a["addr_hex"] for a in prog["allocs"]]
    for a in areas["allocs"]:  # held, or else the refused run it lies in is named
        assert a["held"] != bool(a["refused"]), a
    # the validator's own mappings over the area are listed, and when each came (under address
    # space randomisation one of its libraries may, rarely, land there)
    mine = area["own_mappings"]
    assert all(m.endswith(("[before cuInit]", "[new at cuInit]", "[new at the context]")) for m in mine)
    if hints == "any" and not mine:  # any free address is had: the area is held whole
        assert area["held_bytes"] == n and area["refused_runs"] == 0
        assert areas["summary"].startswith("5/5 allocations in held runs")
    elif hints == "own" and not any(m.endswith("[new at cuInit]") for m in mine):
        # outside its own area a hint is never honoured: refused whole, in halves and in granules
        assert area["held_bytes"] == 0 and area["refused_bytes"] == n
        assert area["refused"][0]["by"] == "driver"
        assert not any(a["held"] for a in areas["allocs"])
        assert areas["reserve_calls"] > 1  # halves were tried
        assert areas["summary"].startswith("0/5 allocations in held runs")
    # its own area (the stand-in's, 4 GiB) is found, and a hint anywhere in it is honoured
    inside = r["ways"]["inside-own"]
    tries = inside["tries"][:5]  # the largest area first
    assert tries[0]["area"][1] >= 4 << 30 and len({tuple(t["area"]) for t in tries}) == 1
    assert [t["what"].split()[0] for t in tries] == ["start", "1/4", "1/2", "3/4", "end"]
    assert all(t["exact"] and t["map"] == "CUDA_SUCCESS" for t in tries), inside
    a, n = tries[0]["area"]
    g = 2 << 20
    lo, hi = -(-a // g) * g, (a + n) // g * g
    assert [int(t["requested"], 16) for t in tries] == [(lo + (hi - lo) * k // 4) // g * g for k in range(4)] + [hi - g]
    assert f"{n / (1 << 20):g} MiB: +start +1/4 +1/2 +3/4 +end]" in inside["summary"]


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is here: the probe would run it")
def test_a_kind_whose_framework_is_missing_is_skipped_and_said_so(tmp_path):
    proc, r = run_probe(tmp_path, "own", "--program-kind", "torch")
    assert r["kind"] == "torch" and "torch" in r["skipped"] and "not importable" in r["skipped"]
    assert "skipped" in proc.stderr and not r["ways"]
