"""`gpu-ckpt check`: what works on this host for checkpointing, and why not, before anything is
touched (the way `criu check` and `bpftool feature probe` do it).

One ``ckpt_check`` record per check (check, status ok|warn|fail|skip, detail, and facts), then a
``ckpt_check_summary``: which of the three paths is usable here:

- driver: `gpu-ckpt --pid` (the NVIDIA driver's checkpoint API): driver, checkpoint_api;
- process images: `gpu-ckpt --pid --image` (CRIU around it): the driver path, criu, criu_check,
  permissions;
- agent: `gpu-ckpt run` / `gpu-ckpt --agent` (snapshots while the program runs): driver, cupti;
  vmm for suspends of owned memory.

Every probe is a method of ``Probes`` so that the tests swap them for fakes; the real ones touch
no process but this one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from gpuos_tools.ckpt import criu, registry
from gpuos_tools.ckpt.driver import MIN_DRIVER_MIGRATION, DriverAPI, error_code
from gpuos_tools.cuda.driver import probe_driver
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.image import chunkio

Record = dict[str, Any]

CAP_SYS_PTRACE, CAP_SYS_ADMIN, CAP_CHECKPOINT_RESTORE = 19, 21, 40

#: path -> the checks it needs (all must not fail)
PATHS = {
    "driver": ("driver", "checkpoint_api"),
    "process_images": ("driver", "checkpoint_api", "criu", "criu_check", "permissions"),
    "agent": ("driver", "cupti"),
}


class Probes:
    """The host as the checks see it (real); tests replace methods."""

    def driver(self) -> Any:
        return probe_driver()

    def checkpoint_api(self) -> Any:
        api = DriverAPI()
        state, err = api.get_state(os.getpid())  # answered for any pid where the API is supported
        return {"api": api, "own_state": state, "own_error": err}

    def vmm(self) -> list[dict[str, Any]]:
        from cuda.bindings import driver as drv

        out = []
        err, n = drv.cuDeviceGetCount()
        for i in range(int(n) if err == drv.CUresult.CUDA_SUCCESS else 0):
            err, dev = drv.cuDeviceGet(i)
            attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            err, value = drv.cuDeviceGetAttribute(attr, dev)
            out.append({"index": i, "vmm": bool(value) if err == drv.CUresult.CUDA_SUCCESS else None})
        return out

    def criu(self) -> Any:
        return criu

    def which(self, name: str) -> str | None:
        return shutil.which(name)

    def run(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)

    def cupti(self) -> str:
        """cupti-python's version; raises ImportError (or OSError for libcupti) when missing."""
        from importlib.metadata import version

        from cupti import cupti  # noqa: F401  (loads libcupti)

        return version("cupti-python")

    def euid(self) -> int:
        return os.geteuid()

    def capabilities(self) -> int:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
        return 0

    def ptrace_scope(self) -> int | None:
        try:
            return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
        except (OSError, ValueError):
            return None

    def state_dir(self) -> Path:
        return registry.state_dir()

    def meminfo(self) -> dict[str, int]:
        out = {}
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * 1024
        return out

    def fs(self, directory: str) -> dict[str, Any]:
        info = chunkio.fs_info(directory)
        st = os.statvfs(directory)
        return {"filesystem": info.fstype, "mount": info.mount, "direct": info.direct, "direct_why": info.why,
                "free": st.f_bavail * st.f_frsize, "writable": os.access(directory, os.W_OK)}


def _rec(check: str, status: str, detail: str, **facts: Any) -> Record:
    return {"type": "ckpt_check", "check": check, "status": status, "detail": detail, **facts}


def _why(e: BaseException) -> str:
    return str(e) if isinstance(e, GpuosError) else f"{type(e).__name__}: {e}"


def run_checks(probes: Probes | None = None, image_dir: str | None = None) -> list[Record]:
    """Every check's record, then the summary record."""
    p = probes or Probes()
    out: list[Record] = []
    gpu_memory = 0
    try:
        info = p.driver()
        gpu_memory = sum(int(g.get("memory") or 0) for g in info.gpus)
        out.append(_rec("driver", "ok", f"CUDA {info.version_string} (driver {info.release or 'release unknown'}), "
                        f"{len(info.gpus)} GPU(s)", cuda=info.version_string, release=info.release,
                        gpus=[{k: g.get(k) for k in ("index", "uuid", "name", "memory")} for g in info.gpus]))
        driver_ok = True
    except Exception as e:  # noqa: BLE001
        out.append(_rec("driver", "fail", _why(e)))
        driver_ok = False
    if driver_ok:
        try:
            got = p.checkpoint_api()
            api = got["api"]

            move = api.version >= MIN_DRIVER_MIGRATION

            err = got.get("own_error")
            if err and error_code("state", err) == ExitCode.DRIVER_TOO_OLD:  # the entry point is there, not the support
                out.append(_rec("checkpoint_api", "fail", f"cuCheckpointProcessGetState answers {err}: the driver "
                                "cannot checkpoint here (too old, or MPS, MIG or vGPU)", restore_onto_other_gpu=move))
            else:
                out.append(_rec("checkpoint_api", "ok", "lock, checkpoint, restore, unlock" +
                                ("; restore onto another GPU of the same kind" if move else
                                 "; no restore onto another GPU (needs CUDA 13.0, driver 580)"),
                                restore_onto_other_gpu=move))
        except Exception as e:  # noqa: BLE001
            out.append(_rec("checkpoint_api", "fail", _why(e)))
        try:
            gpus = p.vmm()
            bad = [g["index"] for g in gpus if not g["vmm"]]
            out.append(_rec("vmm", "warn" if bad else "ok",
                            f"GPU(s) {bad} lack the virtual memory management API: no owned memory, no suspend there"
                            if bad else "virtual memory management on every GPU (owned memory, suspend)", gpus=gpus))
        except Exception as e:  # noqa: BLE001
            out.append(_rec("vmm", "warn", _why(e)))
    else:
        out += [_rec("checkpoint_api", "skip", "no driver"), _rec("vmm", "skip", "no driver")]
    out += _criu_checks(p)
    try:
        out.append(_rec("cupti", "ok", f"cupti-python {p.cupti()}: the agent can trace (the driver's checkpoint API "
                        "refuses a process that has CUPTI loaded: the agent's jobs are checkpointed through the agent)"))
    except Exception as e:  # noqa: BLE001
        out.append(_rec("cupti", "fail", f"no CUPTI ({_why(e)}): no agent path (pip install cupti-python)"))
    out.append(_permissions(p))
    out.append(_host_memory(p, gpu_memory))
    if image_dir is not None:
        out.append(_image_dir(p, image_dir, gpu_memory))
    status = {r["check"]: r["status"] for r in out}
    usable = {path: all(status.get(c) == "ok" or status.get(c) == "warn" for c in needs)
              for path, needs in PATHS.items()}
    out.append({"type": "ckpt_check_summary", **usable,
                "failed": [r["check"] for r in out if r["status"] == "fail"],
                "warnings": [r["check"] for r in out if r["status"] == "warn"]})
    return out


def _criu_checks(p: Probes) -> list[Record]:
    criu = p.criu()
    exe = p.which("criu")
    if exe is None:
        return [_rec("criu", "fail", "no `criu` on PATH: no full-process images (--image). CRIU 4 or later: the "
                     "distribution's package where it carries one, else a build from source; Debian 12's 3.17 "
                     "is too old for recent kernels"),
                _rec("criu_check", "skip", "no criu")]
    try:
        done = p.run([exe, "--version"])
    except (OSError, subprocess.TimeoutExpired) as e:
        return [_rec("criu", "fail", f"{exe} --version: {e}", path=exe), _rec("criu_check", "skip", "criu does not run")]
    import re

    m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", done.stdout + done.stderr)
    if m is None:
        return [_rec("criu", "fail", f"cannot tell the version of {exe}", path=exe),
                _rec("criu_check", "skip", "criu version unknown")]
    version = ".".join(g for g in m.groups() if g is not None)
    if (int(m.group(1)), int(m.group(2))) < criu.MIN_VERSION:
        first = _rec("criu", "fail", f"{exe} is CRIU {version}; 4 or later is needed (3.x fails on recent kernels)",
                     path=exe, version=version)
    else:
        first = _rec("criu", "ok", f"CRIU {version} at {exe}", path=exe, version=version)
    try:
        check = p.run([exe, "check"])
    except (OSError, subprocess.TimeoutExpired) as e:
        return [first, _rec("criu_check", "fail", f"`criu check`: {e}")]
    tail = criu._tail(check.stdout + check.stderr, 3)
    if check.returncode == 0:
        return [first, _rec("criu_check", "ok", f"`criu check`: {tail}")]
    return [first, _rec("criu_check", "fail", f"`criu check` failed (exit {check.returncode}): {tail} (it needs root "
                        "and kernel support)", exit=check.returncode)]


def _permissions(p: Probes) -> Record:
    euid, caps = p.euid(), p.capabilities()
    scope = p.ptrace_scope()
    has = {name: bool(caps >> bit & 1) for name, bit in
           (("sys_admin", CAP_SYS_ADMIN), ("checkpoint_restore", CAP_CHECKPOINT_RESTORE), ("sys_ptrace", CAP_SYS_PTRACE))}
    state = p.state_dir()
    probe = state if state.exists() else state.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    writable = os.access(probe, os.W_OK)
    facts = {"euid": euid, "capabilities": has, "ptrace_scope": scope, "state_dir": str(state),
             "state_dir_writable": writable}
    problems = []
    if not (has["sys_admin"] or has["checkpoint_restore"]):
        problems.append("neither CAP_SYS_ADMIN nor CAP_CHECKPOINT_RESTORE: CRIU cannot dump or restore (run as root)")
    if not writable:
        problems.append(f"the state directory {state} is not writable")
    if problems:
        return _rec("permissions", "fail", "; ".join(problems), **facts)
    who = "root" if euid == 0 else f"uid {euid}"
    note = "" if euid == 0 else "; only your own processes can be checkpointed"
    if scope is not None and scope >= 2 and not has["sys_ptrace"]:
        note += f"; ptrace_scope {scope} without CAP_SYS_PTRACE"
    return _rec("permissions", "ok", f"{who}, state directory {state}{note}", **facts)


def _host_memory(p: Probes, gpu_memory: int) -> Record:
    mem = p.meminfo()
    avail = mem.get("MemAvailable", 0)
    facts = {"available": avail, "total": mem.get("MemTotal"), "gpu_memory": gpu_memory}
    gib = 2**30
    if gpu_memory and avail < gpu_memory:
        return _rec("host_memory", "warn", f"{avail / gib:.1f} GiB available for staging, the GPUs hold "
                    f"{gpu_memory / gib:.1f} GiB: a snapshot of a job that fills them cannot be staged", **facts)
    return _rec("host_memory", "ok", f"{avail / gib:.1f} GiB available for staging"
                + (f" (GPUs: {gpu_memory / gib:.1f} GiB)" if gpu_memory else ""), **facts)


def _image_dir(p: Probes, directory: str, gpu_memory: int) -> Record:
    try:
        fs = p.fs(directory)
    except OSError as e:
        return _rec("image_dir", "fail", f"{directory}: {e.strerror or e}", dir=directory)
    gib = 2**30
    facts = {"dir": directory, **fs}
    if not fs["writable"]:
        return _rec("image_dir", "fail", f"{directory} is not writable", **facts)
    text = (f"{directory}: {fs['filesystem']}, {fs['free'] / gib:.1f} GiB free, "
            + ("O_DIRECT" if fs["direct"] else f"buffered ({fs['direct_why']})"))
    if gpu_memory and fs["free"] < gpu_memory:
        return _rec("image_dir", "warn", text + f"; less than the GPUs' {gpu_memory / gib:.1f} GiB", **facts)
    return _rec("image_dir", "ok", text, **facts)


def table_rows(records: list[Record]) -> list[tuple[str, str, str]]:
    """(check, status, detail) rows for a terminal."""
    return [(r["check"], r["status"], r["detail"]) for r in records if r["type"] == "ckpt_check"]

