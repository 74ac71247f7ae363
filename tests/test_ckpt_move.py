"""Moving a suspended agent job to another GPU (gpuos_tools/ckpt/move.py): refused for a job on
CUPTI and for one not suspended, before anything is touched; for a job on interception, the
driver's checkpoint and restore onto the GPU asked, then the agent's resume, in that order."""

from __future__ import annotations

import pytest

from gpuos_tools.ckpt import records as _schemas  # noqa: F401 -- registers the schemas check_written uses
from gpuos_tools.ckpt.move import check_movable, move_suspended
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.stream.records import check_written


class FakeCheckpointer:
    def __init__(self, fail_at: str | None = None) -> None:
        self.calls: list[tuple] = []
        self.records: list[dict] = []
        self.fail_at = fail_at

    def suspend(self, pid: int) -> dict:
        self.calls.append(("suspend", pid))
        if self.fail_at == "suspend":
            raise GpuosError("cannot lock", ExitCode.NOT_CHECKPOINTABLE)
        return {"type": "ckpt_result"}

    def resume(self, pid: int, device, device_map) -> dict:
        self.calls.append(("resume", pid, device, device_map))
        return {"type": "ckpt_result", "message": "restored"}

    def out(self, record: dict) -> None:
        self.records.append(record)

    def resolve_gpu(self, spec: str) -> dict:
        self.calls.append(("resolve_gpu", spec))
        if spec not in ("0", "1"):
            raise GpuosError(f"no GPU with index {spec} (this machine has 2)", ExitCode.BAD_GPU)
        return {"index": int(spec), "uuid": f"GPU-{spec}"}

    def gpu_pairs(self, pid: int, device, device_map) -> tuple:
        self.calls.append(("gpu_pairs", pid, device, device_map))
        for item in device_map.split(","):
            old, sep, new = item.partition("=")
            if not sep:
                raise GpuosError(f"--device-map: {item!r} is not OLD=NEW", ExitCode.USAGE)
            self.resolve_gpu(old), self.resolve_gpu(new)
        return [("GPU-0", "GPU-1"), ("GPU-1", "GPU-0")], {"uuid": "GPU-1"}


SUSPENDED = {"ok": True, "pid": 42, "state": "suspended", "mechanism": "intercept"}


@pytest.mark.parametrize("status,code,words", [
    ({**SUSPENDED, "mechanism": "cupti"}, ExitCode.NOT_CHECKPOINTABLE, "CUPTI loaded"),
    ({k: v for k, v in SUSPENDED.items() if k != "mechanism"}, ExitCode.NOT_CHECKPOINTABLE, "runs on interception (the default"),
    ({**SUSPENDED, "state": "running"}, ExitCode.WRONG_STATE, "not suspended: `gpu-ckpt --agent 42 --suspend` first"),
])
def test_a_job_that_cannot_move_is_refused_untouched(status, code, words):
    ckpt = FakeCheckpointer()
    resumed = []
    with pytest.raises(GpuosError) as e:
        move_suspended(ckpt, status, "1", None, lambda: resumed.append(1) or {})
    assert e.value.code == code and words in str(e.value)
    assert ckpt.calls == [] and resumed == []


def test_a_job_on_interception_moves_through_the_driver_then_resumes():
    ckpt = FakeCheckpointer()
    order = []

    def resume():
        order.append(list(ckpt.calls))
        return {"state": "running", "bytes": 10, "buffers": 1}

    result = move_suspended(ckpt, SUSPENDED, "1", None, resume)
    assert ckpt.calls == [("resolve_gpu", "1"), ("suspend", 42), ("resume", 42, "1", None)]
    assert order == [ckpt.calls]  # the agent resumes only once the driver has restored and unlocked
    assert ckpt.records == [{"type": "agent_resume", "agent": "42", "state": "running", "bytes": 10, "buffers": 1}]
    assert check_written(ckpt.records[0]) is None
    assert result["message"] == "restored"
    check_movable(SUSPENDED)


def test_a_failed_driver_step_never_resumes_the_agent():
    ckpt = FakeCheckpointer(fail_at="suspend")
    with pytest.raises(GpuosError):
        move_suspended(ckpt, SUSPENDED, None, "0=1", lambda: pytest.fail("resumed"))


def test_a_refused_lock_says_when_cupti_is_loaded(tmp_path, monkeypatch):
    from gpuos_tools import procs
    from gpuos_tools.ckpt.driver import cupti_hint

    maps = {1: b"7f00-7f10 r-xp 0 0:0 0 /usr/local/cuda/lib64/libcupti.so.13\n", 2: b"7f00-7f10 r-xp 0 0:0 0 /x/libc.so\n"}
    for pid, text in maps.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "maps").write_bytes(text)
    monkeypatch.setattr(procs, "PROC", str(tmp_path))
    assert "CUPTI loaded" in cupti_hint(1, "CUDA_ERROR_NOT_SUPPORTED")
    assert cupti_hint(2, "CUDA_ERROR_NOT_SUPPORTED") == ""  # refused for another reason
    assert cupti_hint(1, "CUDA_ERROR_NOT_PERMITTED") == ""
    assert cupti_hint(3, "CUDA_ERROR_NOT_SUPPORTED") == ""  # gone: no hint rather than a second error


@pytest.mark.parametrize("device,device_map,code", [("7", None, ExitCode.BAD_GPU), ("GPU-nope", None, ExitCode.BAD_GPU),
                                                     (None, "0=7", ExitCode.BAD_GPU), (None, "0", ExitCode.USAGE)])
def test_a_gpu_that_is_not_there_is_refused_before_the_driver_checkpoint(device, device_map, code):
    """Found only at the restore, it would leave the job checkpointed by the driver."""
    ckpt = FakeCheckpointer()
    with pytest.raises(GpuosError) as e:
        move_suspended(ckpt, SUSPENDED, device, device_map, lambda: pytest.fail("resumed"))
    assert e.value.code == code
    assert not [c for c in ckpt.calls if c[0] in ("suspend", "resume")]


def test_an_agent_that_does_not_resume_after_the_move_is_said_to_hold_the_program_still():
    ckpt = FakeCheckpointer()

    def resume():
        raise GpuosError("no answer from the agent in 5 s", ExitCode.SNAPSHOT_UNAVAILABLE)

    with pytest.raises(GpuosError) as e:
        move_suspended(ckpt, SUSPENDED, "1", None, resume)
    assert e.value.code == ExitCode.SNAPSHOT_UNAVAILABLE
    assert "still suspended; `gpu-restore --agent 42 --resume` resumes it" in str(e.value)
    assert [c[0] for c in ckpt.calls] == ["resolve_gpu", "suspend", "resume"]
