"""A stand-in for a program under the agent, for tests/test_agent_criu.py: a process that maps a
file named libcuda.so.1 (a CUDA process to everything but the driver) and serves the agent's
control socket, answering ``ping``, ``suspend`` and ``resume`` as the agent does. Each suspend and
resume is appended to DIR/calls ("agent_suspend PID", "agent_resume PID", "agent_resume_lazy
PID"), the file where file_driver.py's fake driver appends its steps, so that a test reads the
order of the agent's and the driver's steps across processes.

    agent_criu_fake.py DIR

Environment: FAKE_AGENT_MECHANISM (intercept), FAKE_AGENT_SUSPEND (ok, not_owned, refuse),
FAKE_AGENT_RESUME (ok, refuse, hang), and GPUOS_BOOT / a descriptor passed on, as the launcher
gives them. Writes DIR/agent-ready once its socket listens; under real CRIU, DIR/agent-alive
every 20 ms.
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from pathlib import Path

from gpuos_tools.agent import control
from gpuos_tools.errors import ExitCode, GpuosError

DIR = Path(sys.argv[1])
MECHANISM = os.environ.get("FAKE_AGENT_MECHANISM", "intercept")
SUSPEND = os.environ.get("FAKE_AGENT_SUSPEND", "ok")
RESUME = os.environ.get("FAKE_AGENT_RESUME", "ok")
state = "running"


def log(step: str) -> None:
    with open(DIR / "calls", "a") as f:
        f.write(f"{step} {os.getpid()}\n")


def handle(request: dict) -> dict:
    global state
    op = request["op"]
    if op == "ping":
        return {"ok": True, "pid": os.getpid(), "ops": 0, "mechanism": MECHANISM, "state": state}
    if op == "suspend":
        if state != "running":
            raise GpuosError(f"the program is already {state}", ExitCode.WRONG_STATE)
        if SUSPEND == "not_owned":
            raise GpuosError("no owned buffer is resident: nothing to suspend", ExitCode.NOT_OWNED)
        if SUSPEND == "refuse":
            raise GpuosError("a snapshot is in progress; suspend after it", ExitCode.WRONG_STATE)
        log("agent_suspend")
        state = "suspended"
        return {"ok": True, "state": "suspended", "pid": os.getpid(), "buffers": 3, "released_bytes": 3 << 20,
                "saved_bytes": 3 << 20, "not_owned": {"count": 1, "bytes": 4096, "largest": []},
                "suspend_s": 0.002, "save_gbps": 50.0}
    if op == "resume":
        if state != "suspended":
            raise GpuosError("the program is not suspended: nothing to resume", ExitCode.WRONG_STATE)
        if RESUME == "hang":
            time.sleep(3600)
        if RESUME == "refuse":
            raise GpuosError("could not map 1.0 MiB at 0x7f00 again; the program stays suspended", ExitCode.CUDA_ERROR)
        log("agent_resume_lazy" if request.get("lazy") else "agent_resume")
        state = "running"
        return {"ok": True, "state": "running", "buffers": 3, "bytes": 3 << 20, "resume_s": 0.001,
                "held_s": 0.5, **({"lazy": True} if request.get("lazy") else {})}
    return {"ok": False, "error": f"unknown op {op!r}"}


lib = DIR / "fakelib" / "libcuda.so.1"
lib.parent.mkdir(exist_ok=True)
if not lib.exists():
    lib.write_bytes(b"\0" * 4096)
with open(lib, "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
server = control.ControlServer(handle)
server.start()
(DIR / "agent-ready").write_text(str(os.getpid()))
trace = int(os.environ.get("FAKE_AGENT_TRACE_FD", "-1"))
while True:
    if trace >= 0:  # a tracer's writes: a pipe without a reader would fail them
        try:
            os.write(trace, b".")
            (DIR / ".alive").write_text(str(time.time()))
            os.replace(DIR / ".alive", DIR / "agent-alive")
        except OSError as e:
            (DIR / "trace-error").write_text(repr(e))
    time.sleep(0.02)
