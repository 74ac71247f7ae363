"""Moving an agent job to another GPU while the agent holds it suspended
(`gpu-restore --agent PID --resume --device N`).

The agent's suspend released the owned memory; what is left on the GPU (the CUDA context, what
is not owned) can move only through the driver's checkpoint: lock and checkpoint the process,
restore it onto the other GPU, unlock it, and then the agent's resume brings the owned buffers
back at their addresses, on the GPU the process now runs on. The driver refuses a process with
CUPTI loaded, so this works only for a job whose agent runs on interception (`--mechanism
intercept`); a job on CUPTI is refused before anything is touched, and the message says so.
"""

from __future__ import annotations

from typing import Any, Callable

from gpuos_tools.agent.suspend import SUSPENDED
from gpuos_tools.errors import ExitCode, GpuosError


def check_movable(status: dict[str, Any]) -> None:
    """Refuse (GpuosError) a job that cannot be moved, from its agent's ping answer."""
    mechanism = status.get("mechanism", "cupti")
    if mechanism != "intercept":
        raise GpuosError(
            f"--agent --resume --device: the agent of PID {status.get('pid')} sees the program's driver calls "
            "through CUPTI, and the driver's checkpoint, which moves a program to another GPU, refuses a process "
            "with CUPTI loaded; a job whose agent runs on interception (the default; not GPUOS_AGENT_MECHANISM=cupti) can move",
            ExitCode.NOT_CHECKPOINTABLE)
    if status.get("state") != SUSPENDED:
        raise GpuosError(f"--agent --resume --device: PID {status.get('pid')} is {status.get('state')}, not "
                         f"suspended: `gpu-ckpt --agent {status.get('pid')} --suspend` first", ExitCode.WRONG_STATE)


def check_target(ckpt: Any, pid: int, device: str | None, device_map: str | None) -> None:
    """Refuse (GpuosError, BAD_GPU) a GPU or a map that names no GPU of this machine, or a map that
    is no permutation of same-chip GPUs, before the driver's checkpoint: found only at the restore,
    it would leave the job checkpointed. (Which GPU the job is on is known only once checkpointed.)"""
    if device_map is not None:
        ckpt.gpu_pairs(pid, None, device_map)
    elif device is not None:
        ckpt.resolve_gpu(device)


def move_suspended(ckpt: Any, status: dict[str, Any], device: str | None, device_map: str | None,
                   resume: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Checkpoint the suspended job through the driver, restore it onto ``device`` (or by
    ``device_map``), unlock it, then ``resume()`` (the agent's resume) and write its record.
    Returns the driver's restore record; a failing step raises as the Checkpointer says, the
    process left as its message says (the agent still holding the program)."""
    check_movable(status)
    pid = int(status["pid"])
    check_target(ckpt, pid, device, device_map)
    ckpt.suspend(pid)
    result = ckpt.resume(pid, device, device_map)
    try:
        answer = resume()
    except GpuosError as e:
        raise GpuosError(f"PID {pid} was moved and unlocked by the driver, but its agent did not resume it ({e}): "
                         f"it is still suspended; `gpu-restore --agent {pid} --resume` resumes it", e.code) from None
    ckpt.out({"type": "agent_resume", "agent": str(pid), **answer})
    return result
