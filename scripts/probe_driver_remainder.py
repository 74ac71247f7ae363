#!/usr/bin/env python3
"""Can the driver checkpoint API (cuCheckpointProcessLock/Checkpoint/Restore/Unlock) take a
program that runs under the agent (CUPTI subscribed)? And once the agent detached CUPTI
(unsubscribe + cuptiFinalize)? And while the program is parked in a CUPTI callback, as a
suspended program is? One JSON report on stdout.

Cases, each in a fresh child (workloads/driver_probe_child.py under `gpu-trace run --agent`,
GPUOS_AGENT_OWN=1):
  idle:   lock with CUPTI attached; detach; lock -> checkpoint -> restore -> unlock; checksum
  parked: park a launch in its callback; detach; lock; (if locked) checkpoint/restore/unlock; unpark
  alone:  the child without gpu-trace (no CUPTI), owning CuPy's memory itself (VMM): lock ->
          checkpoint -> restore -> unlock; checksum
Every lock has a timeout (LOCK_MS); a locked or checkpointed child is always restored/unlocked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "workloads" / "driver_probe_child.py"
LOCK_MS = 3000


def start(tmp: str, traced: bool = True) -> subprocess.Popen:
    env = dict(os.environ, GPUOS_AGENT_OWN="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(CHILD)]
    if traced:
        cmd = [sys.executable, "-m", "gpuos_tools.commands.trace", "run", "--agent", "--no-images", "-o",
               os.path.join(tmp, f"probe-{time.time_ns()}.ndjson"), "--", *cmd]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def ask(p: subprocess.Popen, cmd: str | None) -> dict:
    if cmd is not None:
        p.stdin.write(cmd + "\n")
        p.stdin.flush()
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"child ended (status {p.wait()})")
    return json.loads(line)


def child_pid(p: subprocess.Popen) -> int:
    """The program's pid: the child of gpu-trace (the Popen is gpu-trace itself)."""
    for _ in range(100):
        kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.05)
    raise RuntimeError("no program process under gpu-trace")


def driver_cycle(api, pid: int, out: dict, tag: str) -> None:
    t = time.perf_counter()
    err = api.lock(pid, LOCK_MS)
    out[f"{tag}_lock"] = err or "ok"
    out[f"{tag}_lock_s"] = round(time.perf_counter() - t, 3)
    if err:
        return
    try:
        t = time.perf_counter()
        out[f"{tag}_checkpoint"] = api.checkpoint(pid) or "ok"
        out[f"{tag}_checkpoint_s"] = round(time.perf_counter() - t, 3)
        if out[f"{tag}_checkpoint"] == "ok":
            t = time.perf_counter()
            out[f"{tag}_restore"] = api.restore(pid) or "ok"
            out[f"{tag}_restore_s"] = round(time.perf_counter() - t, 3)
    finally:
        out[f"{tag}_unlock"] = api.unlock(pid) or "ok"
        out[f"{tag}_state_after"] = api.get_state(pid)[0]


def main() -> int:
    import tempfile

    from gpuos_tools.ckpt.driver import DriverAPI

    api = DriverAPI()
    report: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in ("idle", "parked", "alone"):
            out: dict = {}
            report[case] = out
            p = start(tmp, traced=case != "alone")
            try:
                first = ask(p, None)
                pid = child_pid(p) if case != "alone" else p.pid
                if case == "alone":  # VMM (owned) memory, no CUPTI in the process at all
                    driver_cycle(api, pid, out, "alone")
                elif case == "idle":
                    driver_cycle(api, pid, out, "attached")
                    out["detach"] = ask(p, "detach")
                    driver_cycle(api, pid, out, "detached")
                else:
                    out["park"] = ask(p, "park")
                    out["detach"] = ask(p, "detach")
                    driver_cycle(api, pid, out, "parked_detached")
                    out["unpark"] = ask(p, "unpark")
                out["checksum_same"] = ask(p, "check")["checksum"] == first["checksum"]
                ask_exit = p.stdin.write("exit\n")
                p.stdin.flush()
                del ask_exit
                out["exit"] = p.wait(30)
            except Exception as e:  # noqa: BLE001 (the report says what happened)
                out["error"] = f"{type(e).__name__}: {e}"
            finally:
                if p.poll() is None:
                    try:
                        target = p.pid if case == "alone" else child_pid(p)
                        state = api.get_state(target)[0]
                        if state in ("locked", "checkpointed"):
                            if state == "checkpointed":
                                api.restore(target)
                            api.unlock(target)
                    except Exception:  # noqa: BLE001
                        pass
                    p.kill()
                    p.wait()
            print(f"probe {case}: {json.dumps(out)}", file=sys.stderr, flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
