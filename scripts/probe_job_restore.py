#!/usr/bin/env python3
"""Which NCCL transports the driver can restore: a 2-GPU torchrun DDP job (workloads/ddp_job.py)
is started under each NCCL setting, checkpointed with `gpu-ckpt --job` mid-run and restored with
`gpu-restore --job`; one JSON line per setting says which step the driver refused, on which
process, and whether the job then ended with its ranks agreeing.

Needs two GPUs. Usage: scripts/probe_job_restore.py [--steps N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: name -> NCCL variables; NVLink multicast stays off in every one
SETTINGS = {
    "default": {},
    "no_cumem": {"NCCL_CUMEM_ENABLE": "0"},
    "no_p2p": {"NCCL_P2P_DISABLE": "1"},
    "no_p2p_no_shm_no_cumem": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0"},
}


def tool(command: str, *args: str, state: Path) -> tuple[int, list[dict]]:
    done = subprocess.run([sys.executable, "-m", f"gpuos_tools.commands.{command}", *args], cwd=ROOT,
                          env=dict(os.environ, GPUOS_CKPT_STATE_DIR=str(state)), capture_output=True, text=True,
                          timeout=300, check=False)
    return done.returncode, [json.loads(x) for x in done.stdout.splitlines() if x.strip()]


def trial(name: str, nccl: dict[str, str], steps: int, tmp: Path) -> dict:
    progress, out, state = tmp / f"{name}.progress", tmp / f"{name}.json", tmp / f"{name}.state"
    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1", **nccl)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(29400 + len(name)), str(ROOT / "workloads" / "ddp_job.py"),
                             "--steps", str(steps), "--progress", str(progress), "--out", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    rec: dict = {"setting": name, "nccl": nccl}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if int(progress.read_text()) >= steps // 3:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        rc, records = tool("ckpt", "--job", str(proc.pid), "--timeout", "5000", state=state)
        rec["ckpt_rc"] = rc
        rec["ckpt_failed"] = [(r["pid"], r["step"], r.get("error")) for r in records
                              if r.get("type") == "ckpt_step" and not r.get("ok")]
        if rc == 0:
            rc, records = tool("restore", "--job", str(proc.pid), state=state)
            rec["restore_rc"] = rc
            rec["restore_failed"] = [(r["pid"], r["step"], r.get("error")) for r in records
                                     if r.get("type") == "ckpt_step" and not r.get("ok")]
        if rec.get("restore_rc", 0) != 0:  # ranks the driver would not restore never run again
            return rec
        try:
            proc.wait(timeout=120)
            rec["job_rc"] = proc.returncode
            rec["result"] = json.loads(out.read_text()) if out.exists() else None
        except subprocess.TimeoutExpired:
            rec["job_rc"] = "hung"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--only", default=None, help="comma-separated setting names (default: all)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(SETTINGS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            row = trial(name, SETTINGS[name], args.steps, Path(tmp))
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
