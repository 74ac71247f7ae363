"""The agent's resume of a program it holds for a full-process dump or restore
(gpuos_tools/ckpt/agent_criu.py), shared with the guard (gpuos_tools/ckpt/guard.py), which
resumes it when the tool that asked was killed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpuos_tools.agent import control

PING_TIMEOUT_S = 10.0
RESUME_TIMEOUT_S = 600.0
SETTLE_S = 60.0  #: how long a suspend or resume under way may take before the program's state is read


def resume_held(socket: str | Path, lazy: bool = False, timeout: float | None = None) -> dict[str, Any] | None:
    """Have the agent at ``socket`` resume its program if it holds it (a suspend or resume under
    way is waited for): the resume's answer, or None when it was not held. GpuosError when the
    agent does not answer or refuses."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        state = control.request(Path(socket), "ping", timeout=PING_TIMEOUT_S).get("state")
        if state not in ("suspending", "resuming") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if state != "suspended":
        return None
    answer = control.request(Path(socket), "resume", timeout=timeout or RESUME_TIMEOUT_S,
                             **({"lazy": True} if lazy else {}))
    answer.pop("ok", None)
    return answer


def still_held(pid: int, e: Exception) -> str:
    return (f"its agent did not resume it ({e}): the program is still held by its agent; "
            f"`gpu-restore --agent {pid} --resume` resumes it")
