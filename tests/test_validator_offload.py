"""The program's side of out-of-process validation (gpuos_tools/agent/offload.py): what it copies,
what it sends, and that a validator that hangs, crashes or answers garbage never reaches the
program. The validator here is tests/fake_validator.py (the real replay on a fake device)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, child_env

from gpuos_tools.agent.offload import Link, OffloadValidator, regions_of, validator_command
from gpuos_tools.agent.validate import CudaFailure
from gpuos_tools.model import wire

HERE = Path(__file__).resolve().parent
X, Y, Z = 0x7F0000000000, 0x7F0000010000, 0x7F0000020000
N = 100
COPY = "_Z4copyIfEvPKT_PS0_i"  # void copy<float>(const float*, float*, int)


class FakeCopier:
    """The program's memory as numpy buffers; copies recorded."""

    def __init__(self, fail: bool = False):
        self.mem = {X: np.arange(N, dtype=np.float32).view(np.uint8).copy(),
                    Y: np.zeros(4 * N, np.uint8), Z: np.zeros(4 * N, np.uint8)}
        self.copies: list[tuple[int, list]] = []
        self.fail = fail
        self.registered: list[int] = []

    def register(self, addr: int, size: int) -> bool:
        self.registered.append(addr)
        return True

    def unregister(self, addr: int) -> None:
        self.registered.remove(addr)

    def copy(self, stream: int, copies) -> None:
        if self.fail:
            raise CudaFailure("cuMemcpyDtoHAsync: CUDA_ERROR_ILLEGAL_ADDRESS")
        for host, dev, n in copies:  # as the driver: one copy stays inside one allocation
            base = max((a for a in self.mem if a <= dev), default=None)
            if base is None or dev + n > base + len(self.mem[base]):
                raise CudaFailure("cuMemcpyDtoHAsync: CUDA_ERROR_INVALID_VALUE")
        self.copies.append((stream, list(copies)))
        for host, dev, n in copies:
            base = max(a for a in self.mem if a <= dev)
            src = self.mem[base][dev - base : dev - base + n]
            ctypes.memmove(host, src.ctypes.data, n)

    @staticmethod
    def bus_id() -> str:
        return "0000:00:00.0"


#: the fallback's tests run three strategies in this order (the fake validator grants by name)
ORDER = ["steer", "hold", "plain"]


def make(mode: str = "ok", timeout_s: float = 20.0, fail: bool = False, kernel: str = COPY,
         image: bytes | None = b"cubin", relocate: bool = False) -> OffloadValidator:
    copier = FakeCopier(fail)
    v = OffloadValidator(samples=3, image_for=lambda name, sizes: image, timeout_s=timeout_s, copier=copier,
                         strategies=ORDER, relocate=relocate)
    v._command = [sys.executable, str(HERE / "fake_validator.py"), str(v.dir), mode]
    for addr in (X, Y, Z):
        v.on_alloc(addr, 4 * N, "device")
    return v


GEOMETRY = ((1, 1, 1), (32, 1, 1), 0, None, 7)


def launch(v: OffloadValidator, kernel: str = COPY, geometry=GEOMETRY, tid: int = 1) -> dict | None:
    args = struct.pack("<QQi", X, Y, N)
    v.enter(tid, "cuLaunchKernel", ("cuLaunchKernel", ()), 1, kernel, (8, 8, 4), args, geometry)
    return v.exit(tid, 0)


@pytest.fixture
def validator():
    made: list[OffloadValidator] = []

    def factory(*a, **kw):
        made.append(make(*a, **kw))
        return made[-1]

    yield factory
    for v in made:
        v.close()
        assert not v.dir.exists()


def test_regions_merge_reads_and_writes_with_their_modes():
    assert regions_of([[0, 10], [100, 10]], [[5, 10], [200, 4]]) == [(0, 15, "rw"), (100, 10, "r"), (200, 4, "w")]


def test_regions_keep_to_live_allocations_and_never_cross_from_one_to_the_next():
    live = [(0, 64), (64, 128), (256, 320)]  # two allocations end to end, and one further on
    reads, writes = [[0, 64], [64, 64], [300, 40]], [[64, 64], [128, 16]]
    assert regions_of(reads, writes) == [(0, 144, "rw"), (300, 40, "r")]
    # [128, 144) and [320, 340) lie in no allocation: not copied; [0, 64) and [64, 128) stay apart
    assert regions_of(reads, writes, live) == [(0, 64, "r"), (64, 64, "rw"), (300, 20, "r")]
    assert regions_of([[130, 8]], [], live) == []


def test_inputs_in_allocations_that_sit_end_to_end_are_copied_one_allocation_at_a_time(validator):
    """The driver refuses one copy across two allocations even where they touch (the first GPU run
    saw copy<float> of two 120320-byte CuPy arrays end to end fail so)."""
    v = validator()
    a, b = X + (4 << 20), X + (4 << 20) + 4 * N
    v.copier.mem.update({a: np.arange(N, dtype=np.float32).view(np.uint8).copy(), b: np.zeros(4 * N, np.uint8)})
    v.on_alloc(a, 4 * N, "device")
    v.on_alloc(b, 4 * N, "device")
    v.enter(1, "cuLaunchKernel", ("cuLaunchKernel", ()), 1, COPY, (8, 8, 4), struct.pack("<QQi", a, b, N), GEOMETRY)
    rec = v.exit(1, 0)
    assert rec["checked"] and rec["reads"] == "ok" and rec["missed_writes"] == [], rec
    _, copies = v.copier.copies[0]
    assert sorted((dev, n) for _, dev, n in copies) == [(a, 4 * N), (b, 4 * N)]


def test_the_validator_is_told_the_programs_address_windows_before_it_starts_and_with_each_launch(validator):
    v = validator()
    sent = []
    link = v._link()
    request = link.request
    link.request = lambda req: sent.append(req) or request(req)
    assert launch(v)["checked"]
    claims = json.loads((v.dir / "claims.json").read_text())
    windows = claims["windows"]
    assert windows == v.windows() == sent[0]["claims"]
    assert claims["areas"] == v.claims()["areas"]
    for addr in (X, Y, Z):  # every allocation lies in a window (2 MiB-rounded, or its mapping)
        assert any(s <= addr and addr + 4 * N <= s + n for s, n in windows), (hex(addr), windows)
    v.on_alloc(X + (64 << 20), 4 * N, "device")  # a new allocation: the next launch names it
    launch(v, tid=2)
    assert any(s <= X + (64 << 20) < s + n for s, n in sent[1]["claims"])


def test_a_sampled_launch_is_copied_out_replayed_and_validated(validator):
    v = validator()
    rec = launch(v)
    stream, copies = v.copier.copies[0]
    assert stream == 7  # ordered after the launch's own stream
    assert sorted((dev, n) for _, dev, n in copies) == [(X, 4 * N), (Y, 4 * N)]  # only the predicted buffers
    assert v.copier.registered == [v.staging.addr]  # the staging file is pinned
    assert rec["mode"] == "validator" and "seq" not in rec and "restart" not in rec
    assert rec["checked"] and rec["reads"] == "ok" and rec["missed_writes"] == [], rec
    assert rec["written"] == [[Y, 4 * N + (-4 * N) % 128]]
    assert rec["ms"] >= 0
    assert len(list(v.dir.glob("*.image"))) == 1
    launch(v, tid=2)
    assert len(list(v.dir.glob("*.image"))) == 1 and v.link.starts == 1  # one image file, one validator


LUT_COPY, LUT_VAR, MODULE, FUNC = "_Z8lut_copyPfi", 0x7F0000100000, 0x5A000, 0x5A010


@pytest.mark.parametrize("size_known", [True, False])
def test_a_pointer_the_program_stored_in_a_module_variable_is_followed_and_the_variable_staged(validator, size_known):
    """As cuFFT does: the program locates its module's variable (maybe without its size) and
    stores a table's address (X) there; the kernel's only parameters are its output and a count.
    The prediction reads X through the variable, and the validator's module gets the variable's
    bytes: without either, the replay faults."""
    v = validator()
    v.copier.mem[LUT_VAR] = np.frombuffer(X.to_bytes(8, "little"), np.uint8).copy()
    v.copier.variable_size = lambda api, parent, name: 8 if (api, parent, name) == ("cuModuleGetGlobal_v2", MODULE, "lut") else None
    v.observe((wire.HELLO, 0, "3.12", None, {5: "cuModuleGetGlobal_v2", 6: "cuMemcpyHtoD_v2"}, {}, "python", "cupti"))
    v.observe((wire.SYMBOL, 0, 1, 5, "variable", 0, MODULE, LUT_VAR, 8 if size_known else -1, "lut"))
    v.observe((wire.SYMBOL, 0, 1, wire.ASKED, "function", FUNC, MODULE, 0, -1, LUT_COPY))
    v.observe((wire.COPY, 0, 1, 6, "HtoD", LUT_VAR, 0, 8, 0, False, None, X.to_bytes(8, "little")))
    v.enter(1, "cuLaunchKernel", ("cuLaunchKernel", ()), FUNC, LUT_COPY, (8, 4), struct.pack("<Qi", Y, N), GEOMETRY)
    rec = v.exit(1, 0)
    assert rec["checked"] and rec["reads"] == "ok" and rec["missed_writes"] == [], rec
    assert [X, 4 * N] in rec["predicted"]["reads"]
    copied = {dev: n for _, dev, n in v.copier.copies[0][1]}
    assert copied[LUT_VAR] == 8  # the variable, staged with the launch's inputs

    # another function of another module: the variable is not its, nothing reaches X
    v.enter(2, "cuLaunchKernel", ("cuLaunchKernel", ()), FUNC + 0x10, LUT_COPY, (8, 4), struct.pack("<Qi", Z, N),
            GEOMETRY)
    rec = v.exit(2, 0)
    assert rec["checked"] and rec["reads"] == "missed" and rec["fault"] == "CUDA_ERROR_ILLEGAL_ADDRESS", rec


def test_a_kernel_the_image_lacks_is_unvalidated(validator):
    v = validator()
    rec = launch(v, kernel="_Z7unknownPKfPfi")  # void unknown(const float*, float*, int)
    assert rec["checked"] is False and "CUDA_ERROR_NOT_FOUND" in rec["why"]


def test_a_validator_that_hangs_is_killed_and_the_launch_unvalidated(validator):
    v = validator("hang", timeout_s=0.5)
    t0 = time.monotonic()
    rec = launch(v)
    assert time.monotonic() - t0 < 10
    assert rec["checked"] is False and "did not answer within 0.5 s" in rec["why"]
    assert v.link.proc is None  # killed


def test_a_validator_that_keeps_failing_switches_validation_off(validator):
    v = validator("crash")
    whys = [launch(v, tid=t)["why"] for t in range(1, 4)]
    assert all("exited (status 7): Segmentation fault (pretend)" in w for w in whys[:2]), whys
    assert "switched off" in whys[2] and v.switched_off == v.link.off
    assert v.link.starts == 3
    assert not v.wants(1)  # nothing more is sampled


def test_garbage_from_the_validator_is_a_failure_not_a_crash(validator):
    v = validator("garbage")
    rec = launch(v)
    assert rec["checked"] is False and "garbage" in rec["why"]


def test_a_validator_that_cannot_start_says_why(validator):
    v = validator("refuse")
    rec = launch(v)
    assert rec["checked"] is False and "CUDA_ERROR_NO_DEVICE" in rec["why"]


def test_a_failed_copy_never_reaches_the_program(validator):
    v = validator(fail=True)
    rec = launch(v)
    assert rec["checked"] is False and "copying the inputs out failed" in rec["why"]
    assert v.link is None  # no validator was started for it


@pytest.mark.parametrize("geometry, image, why", [
    (None, b"cubin", "geometry is unknown"),
    (((1, 1, 1), (1, 1, 1), 0, "cooperative launches are not replayed", 0), b"cubin", "cooperative"),
    (GEOMETRY, None, "no module image"),
])
def test_launches_that_cannot_be_recreated_are_unvalidated(validator, geometry, image, why):
    v = validator(image=image)
    rec = launch(v, geometry=geometry)
    assert rec["checked"] is False and why in rec["why"] and rec["mode"] == "validator"
    assert v.link is None


def test_the_validator_runs_untraced_with_this_package(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUOS_BOOT", "{}")
    monkeypatch.setenv("CUDA_INJECTION64_PATH", "/x.so")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    cmd, env = validator_command(tmp_path, "0000:17:00.0")
    assert cmd[1:3] == ["-m", "gpuos_tools.agent.validator"]
    assert cmd[3:] == ["--device", "0000:17:00.0", "--dir", str(tmp_path), "--claims", str(tmp_path / "claims.json")]
    v = OffloadValidator(copier=FakeCopier())
    try:
        v._command = cmd
        assert v._with_strategy() == [*cmd, "--strategy", "whole"]  # the first strategy, until it fails
    finally:
        v.close()
    assert "GPUOS_BOOT" not in env and "CUDA_INJECTION64_PATH" not in env
    assert env["PYTHONPATH"].split(":")[0] == str(HERE.parent) and env["PYTHONPATH"].endswith("/somewhere")


def test_a_driver_that_grants_hints_only_inside_its_own_areas_moves_the_run_to_the_next_strategy(validator):
    """The first strategy's driver puts its areas elsewhere (every hint comes back at another
    address, nothing of the validator's there): the same launch goes to a validator of the next
    strategy, which gets the addresses; that strategy is kept for the rest of the run."""
    v = validator("areas:hold")
    starts = []
    first = launch(v)
    starts.append(v.link.starts)
    assert first["checked"] and first["reads"] == "ok", first
    assert first["addresses"] == "hold"
    assert [f["strategy"] for f in first["address_fallback"]] == ["steer"]
    assert first["address_fallback"][0]["why"].startswith("unvalidated: address unavailable")
    assert "refused_by" not in first
    second = launch(v, tid=2)
    assert second["checked"] and second["addresses"] == "hold" and "address_fallback" not in second
    assert v.link.starts == starts[0] == 2  # the steer validator, then one hold validator for both
    assert v.link.command[-2:] == ["--strategy", "hold"]
    assert v.addresses() == {"strategy": "hold", "kept": True, "lost": {"steer": 1}}
    from gpuos_tools.stream.records import check_written

    assert check_written({"type": "validation", "ts": 1, "tid": 1, "seq": 1, **first}) is None


def test_a_driver_that_grants_any_free_hint_keeps_the_first_strategy(validator):
    v = validator("areas:steer,hold,plain")
    recs = [launch(v, tid=t) for t in (1, 2)]
    assert all(r["checked"] and r["addresses"] == "steer" and "address_fallback" not in r for r in recs), recs
    assert v.link.starts == 1
    assert v.addresses() == {"strategy": "steer", "kept": True, "lost": {}}


def test_when_no_strategy_gets_a_launchs_addresses_the_first_one_answers_the_next_launches(validator):
    v = validator("areas:none")
    rec = launch(v)
    assert rec["checked"] is False and rec["why"].startswith("unvalidated: address unavailable"), rec
    assert rec["refused_by"] == "driver" and rec["addresses"] == "plain"
    assert [f["strategy"] for f in rec["address_fallback"]] == ["steer", "hold"]
    again = launch(v, tid=2)  # back to the first strategy, and no more fallback
    assert again["checked"] is False and again["addresses"] == "steer" and "address_fallback" not in again
    assert launch(v, tid=3)["addresses"] == "steer"
    assert v.link.starts == 4
    assert v.addresses() == {"strategy": "steer", "kept": True, "lost": {"steer": 3, "hold": 1, "plain": 1}}


def test_a_launch_no_strategy_gets_the_addresses_of_is_replayed_moved(validator):
    """Every strategy's driver refuses the program's addresses: the validator answering last
    replays the launch with its spans moved elsewhere and the pointers to them moved; the
    record says what moved and why."""
    v = validator("areas:none", relocate=True)
    rec = launch(v)
    assert rec["checked"] and rec["reads"] == "ok" and rec["missed_writes"] == [], rec
    assert {s[0] for s in rec["relocated"]["spans"]} == {X, Y}
    assert rec["relocated"]["pointers"]["parameters"] == 2
    assert [f["strategy"] for f in rec["address_fallback"]] == ["steer", "hold", "plain"]
    assert rec["addresses"] == "steer" and "refused_by" not in rec  # the first, which answers from now on
    again = launch(v, tid=2)
    assert again["checked"] and again["addresses"] == "steer" and "relocated" in again, again
    assert v.addresses()["moved"] == 2
    from gpuos_tools.stream.records import check_written

    assert check_written({"type": "validation", "ts": 1, "tid": 1, "seq": 1, **rec}) is None


def test_an_address_the_validator_itself_holds_is_moved_too(validator):
    v = validator("held", relocate=True)
    rec = launch(v)
    assert rec["checked"] and "relocated" in rec and rec["addresses"] == "steer", rec
    assert v.link.starts == 1


def test_a_strategy_under_which_the_validator_cannot_start_gives_way_to_the_next(validator):
    """(A driver that will not initialise in a filled address space.)"""
    v = validator("refuse:steer")
    rec = launch(v)
    assert rec["checked"] and rec["addresses"] == "hold", rec
    assert [f["strategy"] for f in rec["address_fallback"]] == ["steer"]
    assert "could not start" in rec["address_fallback"][0]["why"]
    assert v.addresses()["strategy"] == "hold" and v.addresses()["kept"]
    assert launch(v, tid=2)["checked"] and v.link.starts == 2


def test_an_address_the_validator_itself_holds_is_not_a_reason_to_change_strategy(validator):
    v = validator("held")
    rec = launch(v)
    assert rec["checked"] is False and rec["refused_by"] == "validator" and rec["addresses"] == "steer", rec
    assert "address_fallback" not in rec and v.link.starts == 1
    assert v.addresses() == {"strategy": "steer", "kept": False, "lost": {"steer": 1}}


def test_a_kept_strategy_is_not_given_up_when_a_later_launch_is_refused(validator):
    v = validator("areas:steer")
    assert launch(v)["addresses"] == "steer"
    v.copier.mem[X + (1 << 30)] = np.zeros(4 * N, np.uint8)
    v.on_alloc(X + (1 << 30), 4 * N, "device")
    link = v.link
    answer = link.answer
    def refused():  # as the kept strategy's driver would answer for an address outside its areas
        rep = answer()
        if isinstance(rep, dict):
            rep.update(checked=False, why="unvalidated: address unavailable (0x1: ...)", refused_by="driver")
        return rep
    link.answer = refused
    rec = launch(v, tid=2)
    assert rec["checked"] is False and rec["addresses"] == "steer" and "address_fallback" not in rec
    assert link.starts == 1 and v.addresses() == {"strategy": "steer", "kept": True, "lost": {"steer": 1}}


def test_a_restart_after_a_lost_context_is_not_a_failure(tmp_path):
    script = ("import sys; sys.path.insert(0, %r); from gpuos_tools.agent import replay as r; "
              "o = sys.stdout.buffer; r.write_frame(o, {'ready': True}); q = r.read_frame(sys.stdin.buffer); "
              "r.write_frame(o, {'seq': q['seq'], 'checked': True, 'restart': True}); sys.exit(3)") % str(HERE.parent)
    link = Link([sys.executable, "-c", script], {}, timeout_s=20)
    for seq in (1, 2, 3, 4):
        assert link.request({"seq": seq}) == {}
        rep = link.answer()
        assert rep == {"seq": seq, "checked": True}
    assert link.failures == 0 and link.off is None and link.starts == 4


def test_the_image_of_a_kernel_is_the_latest_loaded_module_defining_it(monkeypatch):
    from gpuos_tools.cuda import elf
    from gpuos_tools.injection import tracer

    cubin = (HERE / "data" / "kernels.sm_90.cubin").read_bytes()
    name = elf.kernels(cubin)[0]
    newer = cubin + b"\0" * 8  # the same module loaded again: the later copy is the one live
    monkeypatch.setattr(tracer, "_cubins", [cubin, b"not an ELF"])
    monkeypatch.setattr(tracer, "_kernel_sets", [])
    assert tracer._image_for(name) is cubin
    assert tracer._image_for("no_such_kernel") is None
    tracer._cubins.append(newer)
    assert tracer._image_for(name) is newer


def test_the_image_of_a_kernel_is_the_one_whose_parameters_match_the_launch(monkeypatch):
    """CuPy compiles a kernel once per array rank, in modules of their own, under one name: a
    launch of the 2-D copy after the 1-D one was loaded must get the 2-D module (its array
    structs are 48 bytes, the 1-D one's 32), or the replay misreads its arguments."""
    from gpuos_tools.cuda import elf
    from gpuos_tools.injection import tracer

    cubin = (HERE / "data" / "kernels.sm_90.cubin").read_bytes()
    name = elf.kernels(cubin)[0]
    two_d, one_d = cubin, cubin + b"\0" * 8  # the same kernels; their layouts told apart below
    real = elf.param_layout
    monkeypatch.setattr(elf, "param_layout", lambda image, kernel: (
        [(0, 0, 48), (1, 48, 48), (2, 96, 40)] if image is two_d else [(0, 0, 32), (1, 32, 32), (2, 64, 24)])
        if kernel == name else real(image, kernel))
    monkeypatch.setattr(tracer, "_cubins", [two_d, one_d])
    monkeypatch.setattr(tracer, "_kernel_sets", [])
    assert tracer._image_for(name, (48, 48, 40)) is two_d
    assert tracer._image_for(name, (32, 32, 24)) is one_d
    assert tracer._image_for(name) is one_d  # no sizes: the latest
    assert tracer._image_for(name, (8,)) is None  # no module with that layout


def test_a_second_thread_is_not_sampled_while_a_launch_is_out(validator):
    v = validator()
    args = struct.pack("<QQi", X, Y, N)
    assert v.wants(1)
    v.enter(1, "cuLaunchKernel", ("cuLaunchKernel", ()), 1, COPY, (8, 8, 4), args, GEOMETRY)
    assert not v.wants(2)  # a first launch of another kernel, on another thread
    assert v.exit(1, 0)["checked"]
    assert v.wants(3)


def test_the_programs_own_failed_launch_is_not_judged(validator):
    v = validator()
    args = struct.pack("<QQi", X, Y, N)
    v.enter(1, "cuLaunchKernel", ("cuLaunchKernel", ()), 1, COPY, (8, 8, 4), args, GEOMETRY)
    rec = v.exit(1, 700)
    assert rec["checked"] is False and "CUresult 700" in rec["why"]
    assert launch(v, tid=2)["checked"]  # the validator's answer was consumed: the next one lines up


def test_validate_in_is_checked_before_anything_runs():
    from gpuos_tools.errors import ExitCode, GpuosError
    from gpuos_tools.trace.run import run_program

    for kw, words in (({"validate": True, "validate_in": "gpu"}, "--validate-in: must be validator or process"),
                      ({"validate_in": "validator"}, "--validate-in is an option of --validate")):
        with pytest.raises(GpuosError) as err:
            run_program(["true"], **kw)
        assert err.value.code == ExitCode.USAGE and words in str(err.value)


def test_the_boot_config_carries_where_validation_runs():
    from gpuos_tools.injection.config import BootConfig, ConfigError, TraceConfig, ValidateConfig

    cfg = BootConfig(TraceConfig(3), validate=ValidateConfig(2, 1 << 30, False, "validator", 5.0))
    assert BootConfig.from_json(cfg.to_json()) == cfg
    # a config without the field reads as the default: the validator process
    old = cfg.to_json().replace(',"where":"validator","timeout_s":5.0', "")
    assert BootConfig.from_json(old).validate.where == "validator"
    with pytest.raises(ConfigError, match="validate.where"):
        ValidateConfig(2, 1 << 30, False, "elsewhere")


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig as cuda.h lays it out (the tracer reads it by offsets)."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


class _Recorder:
    """A validator that only records what the tracer's launch handler hands it."""

    def __init__(self):
        self.calls = []
        self.pending: dict = {}
        self.busy_tid = 0

    def wants(self, func):
        return True

    def enter(self, *args):
        self.calls.append(args)


@pytest.mark.parametrize("api, attrs", [("cuLaunchKernel", ()), ("cuLaunchKernel_ptsz", ()),
                                        ("cuLaunchKernelEx", ()), ("cuLaunchKernelEx", (4,)),
                                        ("cuLaunchKernelEx", (6, 8)), ("cuLaunchKernelEx", (6, 3, 4))])
def test_the_launch_handler_hands_the_validator_the_launch_geometry(monkeypatch, api, attrs):
    """... and its launch attributes: programmatic stream serialization (6) and a priority (8)
    change no result and are dropped; a cluster's shape (4) is replayed with its value; any other
    (3, a synchronization policy) leaves the launch unreplayed."""
    from types import SimpleNamespace

    from gpuos_tools.injection import tracer

    monkeypatch.setattr(tracer, "_layouts", {})
    monkeypatch.setattr(tracer, "_append", lambda item: None)
    monkeypatch.setattr(tracer, "_capture_begun", False)
    monkeypatch.setattr(tracer, "_param_info", lambda func: (((0, 8), (8, 4)), "cuFuncGetParamInfo"))
    keep = []
    a, b = ctypes.create_string_buffer(struct.pack("<Q", X), 8), ctypes.create_string_buffer(struct.pack("<i", 5), 4)
    kp = (ctypes.c_uint64 * 2)(ctypes.addressof(a), ctypes.addressof(b))
    func, stream = 0x5000, 0 if api.endswith("_ptsz") else 0x9000
    if api.startswith("cuLaunchKernelEx"):
        table = ctypes.create_string_buffer(b"".join(struct.pack("<I4x3I52x", i, 2, 1, 1) for i in attrs) or b"\0",
                                            72 * len(attrs) or 1)
        keep.append(table)
        cfg = _LaunchConfig((3, 2, 1), (128, 1, 1), 4096, stream, ctypes.addressof(table) if attrs else 0, len(attrs))
        params = struct.pack("<QQQQ", ctypes.addressof(cfg), func, ctypes.addressof(kp), 0)
        keep.append(cfg)
    else:
        params = struct.pack("<Q7I4xQQQ", func, 3, 2, 1, 128, 1, 1, 4096, stream, ctypes.addressof(kp), 0)
    pbuf = ctypes.create_string_buffer(params, len(params))
    cb = ctypes.create_string_buffer(struct.pack("<I4xQQQ", 0, 0, ctypes.addressof(pbuf), 0), 32)
    rec = _Recorder()
    handlers = tracer._validating_handlers(rec, {1: (api, None, 0)})
    handlers[1](1, SimpleNamespace(ptr=ctypes.addressof(cb), symbol_name="k"))
    (tid, name, raw, f, kernel, sizes, args, geometry), = rec.calls
    assert (name, f, kernel, sizes) == (api, func, "k", (8, 4))
    assert args == struct.pack("<Qi", X, 5)
    grid, block, shared, not_replayed, on, replayed = geometry
    assert (tuple(grid), tuple(block), shared) == ((3, 2, 1), (128, 1, 1), 4096)
    assert on == (2 if api.endswith("_ptsz") else stream)  # the per-thread default stream's handle
    assert (not_replayed is not None) == (3 in attrs)
    if not_replayed:
        assert not_replayed == "launch attributes 3 are not replayed"
    assert replayed == ([[4, struct.pack("<3I52x", 2, 1, 1).hex()]] if 4 in attrs else [])


def test_a_launch_naming_no_device_memory_is_not_sent(validator):
    v = validator()
    v.enter(1, "cuLaunchKernel", ("cuLaunchKernel", ()), 1, "_Z4tickv", (), b"", GEOMETRY)  # void tick()
    rec = v.exit(1, 0)
    assert rec["checked"] is False and "names no device memory" in rec["why"]
    assert v.link is None and v.copier.copies == []


def test_a_module_handed_as_ptx_text_is_found_by_its_entries(monkeypatch):
    from gpuos_tools.injection import tracer

    ptx = (HERE / "data" / "kernels.ptx").read_bytes()
    monkeypatch.setattr(tracer, "_cubins", [])
    monkeypatch.setattr(tracer, "_kernel_sets", [])
    monkeypatch.setattr(tracer, "_ptx", [])
    monkeypatch.setattr(tracer, "_append", lambda item: None)
    desc = ctypes.create_string_buffer(struct.pack("<I4xQQ", 1, len(ptx), 0), 24)
    data = ctypes.create_string_buffer(ptx, len(ptx))
    struct.pack_into("<Q", desc, 16, ctypes.addressof(data))
    cb = ctypes.create_string_buffer(struct.pack("<QQQ", 0, 0, ctypes.addressof(desc)), 24)
    from types import SimpleNamespace

    tracer._resource(6, SimpleNamespace(ptr=ctypes.addressof(cb)))  # MODULE_LOADED
    (entries, text), = tracer._ptx
    assert text == ptx and entries
    name = sorted(entries)[0]
    assert tracer._image_for(name) == ptx


PROGRAM = r"""
import sys, time
from gpuos_tools.agent.offload import OffloadValidator

class Copier:  # the program's side without a GPU: the staging is a plain file
    register = unregister = None

v = OffloadValidator(copier=Copier())
v.staging.ensure(1 << 20)
print(v.dir, flush=True)
time.sleep(600)
"""


def start_program(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    child = subprocess.Popen([sys.executable, "-c", PROGRAM], cwd=REPO, stdout=subprocess.PIPE, text=True,
                             env=child_env(TMPDIR=str(tmp_path)))
    assert child.stdout is not None
    return child, Path(child.stdout.readline().strip())


def test_the_private_directory_of_a_killed_program_goes_at_the_next_start(tmp_path: Path, monkeypatch):
    """SIGKILL leaves the program's private directory behind; the next validator started as this
    user removes it, and keeps a running program's and another user's."""
    killed, dead_dir = start_program(tmp_path)
    live, live_dir = start_program(tmp_path)
    try:
        assert dead_dir.parent == tmp_path and dead_dir.name.startswith(f".gpuos-validator.{killed.pid}.")
        assert live_dir.name.startswith(f".gpuos-validator.{live.pid}.")
        assert stat.S_IMODE(dead_dir.stat().st_mode) == 0o700 and (dead_dir / "staging-1").exists()
        killed.kill()  # SIGKILL: nothing of the program runs to remove it
        assert killed.wait(timeout=30) == -signal.SIGKILL and dead_dir.exists()
        # the same leftovers, another user's; and a file of another program named like ours
        theirs = tmp_path / f".gpuos-validator.{2**22 + 7}.ab.tmp"  # above any pid_max: never running
        theirs.mkdir(mode=0o700)
        other_uid = os.getuid() + 1
        if os.getuid() == 0:
            os.chown(theirs, other_uid, other_uid)
        not_ours = tmp_path / f".gpuos-validator-x.{killed.pid}.ab.tmp"
        not_ours.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        v = make()
        try:
            assert v.dir.parent == tmp_path and v.dir.name.startswith(f".gpuos-validator.{os.getpid()}.")
            assert not dead_dir.exists()
            assert live_dir.exists() and (live_dir / "staging-1").exists()
            assert not_ours.exists()
            assert theirs.exists() == (os.getuid() == 0)  # not root: the directory is this user's after all
        finally:
            v.close()
        assert not v.dir.exists()
    finally:
        for child in (killed, live):
            if child.poll() is None:
                child.kill()
                child.wait()


def test_the_cleaner_keeps_other_users_directories(tmp_path: Path):
    from gpuos_tools.image import clean_stale_temps

    gone = tmp_path / f".gpuos-validator.{2**22 + 7}.ab.tmp"
    gone.mkdir()
    (tmp_path / f".gpuos-validator.{2**22 + 7}.cd.tmp").symlink_to(gone)
    assert clean_stale_temps(tmp_path, "gpuos-validator", uid=os.getuid() + 1) == []
    assert clean_stale_temps(tmp_path, "another-name", uid=os.getuid()) == []
    assert clean_stale_temps(tmp_path, "gpuos-validator", uid=os.getuid()) == [str(gone)]
    assert os.listdir(tmp_path) == [f".gpuos-validator.{2**22 + 7}.cd.tmp"]  # a link is never followed


@pytest.mark.parametrize("where", ["process", "validator"])
def test_validation_runs_the_python_tracer_whatever_backend_was_left_to_choose(monkeypatch, where):
    """The validating launch handler is the Python tracer's: --validate with the backend left to
    choose (auto) runs it, in either place validation happens."""
    from gpuos_tools.trace import run as launcher

    seen = {}

    def fake(program, writer, images_dir, **kw):
        seen.update(kw)
        return "traced"

    monkeypatch.setattr(launcher, "trace_program", fake)
    assert launcher.run_program(["true"], output=os.devnull, validate=True, validate_in=where) == "traced"
    assert seen["backend"] == "python" and seen["validate"].where == where


def test_a_clusters_shape_goes_to_the_validator_with_the_launch(validator):
    v = validator()
    cluster = [[4, struct.pack("<3I52x", 2, 1, 1).hex()]]
    v.enter(1, "cuLaunchKernelEx", ("cuLaunchKernelEx", ()), 1, COPY, (8, 8, 4), struct.pack("<QQi", X, Y, N),
            GEOMETRY + (cluster,))
    assert v.pending[1]["req"]["attributes"] == cluster
    rec = v.exit(1, 0)
    assert rec["checked"] and rec["reads"] == "ok" and rec["attributes"] == [4], rec


def test_the_validator_measures_read_extents_of_the_pointers_the_prediction_found(validator):
    v = validator()
    rec = launch(v)
    assert rec["checked"], rec
    ext = {e["ptr"]: e for e in rec["extents"]}
    assert set(ext) == {X, Y}
    assert ext[X]["read"] == 4 * N and ext[X]["limit"] == 4 * N  # x[0] = 0: zeroing it changes nothing
    assert ext[Y]["written"] == 4 * N and ext[Y]["read"] == 0


def test_without_extents_none_are_asked_for(validator):
    v = validator()
    v.extents = False
    assert "extents" not in launch(v)
