"""The validator's own start (replay.open_device) and reservation (Replayer._reserve) under each
address strategy, in real processes, against the stand-in driver of tests/fake_cuda (an area of
its own at cuInit wherever the kernel puts it; hints honoured only inside it, or also anywhere
free). The program is scripts/probe_validator_va.py's, on the same stand-in."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, child_env

FAKE = REPO / "tests" / "fake_cuda"

# as gpuos_tools/agent/validator.py does it, then one reservation per allocation of the program's
VALIDATOR = r"""
import json, sys
from gpuos_tools.agent.vaspace import AddressStrategy
name, targets = sys.argv[1], json.loads(sys.argv[2])
strategy = AddressStrategy(name, targets["windows"], targets["areas"])
strategy.start()
from gpuos_tools.agent import replay
device = replay.open_device("0000:00:00.0", strategy)
r = replay.Replayer(device, strategy.space, whole=name == "whole")
r.take_areas(strategy.areas)
out = []
for addr, size, _ in targets["allocs"]:
    r.hold(targets["windows"])
    got = r._reserve(addr, -(-size // device.granularity) * device.granularity)
    out.append(None if got is None else got[1])
print(json.dumps(out))
"""


def env(hints: str) -> dict:
    e = child_env(FAKE_CUDA_HINTS=hints)
    e["PYTHONPATH"] = os.pathsep.join([str(FAKE), e["PYTHONPATH"]])
    return e


@pytest.fixture(params=["own", "any"])
def program(request):
    """(hints, the program's allocations, windows and driver areas) while it runs."""
    p = subprocess.Popen([sys.executable, str(REPO / "scripts" / "probe_validator_va.py"), "--program"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env(request.param), cwd=REPO)
    try:
        yield request.param, json.loads(p.stdout.readline())["targets"]
    finally:
        p.stdin.close()
        p.wait(timeout=30)


def reserve(hints: str, name: str, targets: dict) -> list:
    out = subprocess.run([sys.executable, "-c", VALIDATOR, name, json.dumps(targets)], cwd=REPO, env=env(hints),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_steer_gets_the_programs_addresses_whether_or_not_the_driver_honours_hints_outside_its_area(program):
    hints, targets = program
    assert reserve(hints, "steer", targets) == [None] * len(targets["allocs"])


def test_a_driver_that_honours_hints_only_inside_its_area_refuses_the_others_as_the_drivers_refusal(program):
    hints, targets = program
    for name in ("hold", "plain", "whole"):
        got = reserve(hints, name, targets)
        if hints == "any":
            assert got == [None] * len(targets["allocs"]), name
        else:  # the program's allocations lie outside this validator's area: nothing of its own there
            assert "validator" not in got, (name, got)
            if _randomized():  # layouts differ from one process to the next
                assert "driver" in got, (name, got)


def _randomized() -> bool:
    try:
        with open("/proc/sys/kernel/randomize_va_space") as f:
            return f.read().strip() != "0"
    except OSError:
        return True
