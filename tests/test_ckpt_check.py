"""`gpu-ckpt check` (gpuos_tools/ckpt/check.py) through fakes of the host: a good host, each thing
missing in turn, and the command's records and exit status with a fake `criu` on PATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import REPO, child_env

from gpuos_tools.ckpt import check
from gpuos_tools.errors import ExitCode, GpuosError


class Good(check.Probes):
    """A host where everything works (driver 580, CUDA 13.0, one H100, CRIU 4.2)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp

    def driver(self):
        return SimpleNamespace(version_string="13.0", release="580.159.04",
                               gpus=[{"index": 0, "uuid": "GPU-1", "name": "H100", "memory": 80 << 30}])

    def checkpoint_api(self):
        return {"api": SimpleNamespace(version=13000), "own_state": "running", "own_error": None}

    def vmm(self):
        return [{"index": 0, "vmm": True}]

    def which(self, name):
        return "/opt/criu/bin/criu"

    def run(self, argv, timeout=60):
        if argv[-1] == "--version":
            return subprocess.CompletedProcess(argv, 0, "Version: 4.2\n", "")
        return subprocess.CompletedProcess(argv, 0, "", "Warn (criu/kerndat.c:1642): no nftables\nLooks good.\n")

    def cupti(self):
        return "13.0.1"

    def euid(self):
        return 0

    def capabilities(self):
        return (1 << check.CAP_SYS_ADMIN) | (1 << check.CAP_CHECKPOINT_RESTORE) | (1 << check.CAP_SYS_PTRACE)

    def ptrace_scope(self):
        return 1

    def state_dir(self):
        return self.tmp / "state"

    def meminfo(self):
        return {"MemAvailable": 120 << 30, "MemTotal": 128 << 30}

    def fs(self, directory):
        return {"filesystem": "ext4", "mount": "/", "direct": True, "direct_why": "O_DIRECT", "free": 500 << 30,
                "writable": True}


def by_check(records: list[dict]) -> dict[str, dict]:
    return {r["check"]: r for r in records if r["type"] == "ckpt_check"}


def test_a_good_host_passes_every_check(tmp_path: Path) -> None:
    records = check.run_checks(Good(tmp_path), image_dir="/images")
    checks = by_check(records)
    assert {k: v["status"] for k, v in checks.items()} == {
        "driver": "ok", "checkpoint_api": "ok", "vmm": "ok", "criu": "ok", "criu_check": "ok", "cupti": "ok",
        "permissions": "ok", "host_memory": "ok", "image_dir": "ok"}
    assert checks["criu"]["version"] == "4.2" and "Looks good" in checks["criu_check"]["detail"]
    assert checks["checkpoint_api"]["restore_onto_other_gpu"] is True
    assert records[-1] == {"type": "ckpt_check_summary", "driver": True, "process_images": True, "agent": True,
                           "failed": [], "warnings": []}


def test_no_driver_skips_what_needs_it(tmp_path: Path) -> None:
    host = Good(tmp_path)
    host.driver = lambda: (_ for _ in ()).throw(GpuosError("no NVIDIA driver (libcuda.so.1 not found)", ExitCode.NO_DRIVER))
    records = check.run_checks(host)
    checks = by_check(records)
    assert checks["driver"]["status"] == "fail" and "libcuda" in checks["driver"]["detail"]
    assert checks["checkpoint_api"]["status"] == checks["vmm"]["status"] == "skip"
    assert records[-1]["driver"] is False and records[-1]["process_images"] is False and records[-1]["agent"] is False


@pytest.mark.parametrize("version,check_rc,criu_status,check_status", [
    ("3.17", 0, "fail", "ok"), ("4.1", 1, "ok", "fail"), (None, 0, "fail", "skip")])
def test_criu_old_failing_or_missing(tmp_path: Path, version, check_rc, criu_status, check_status) -> None:
    host = Good(tmp_path)
    if version is None:
        host.which = lambda name: None
    else:
        def run(argv, timeout=60):
            if argv[-1] == "--version":
                return subprocess.CompletedProcess(argv, 0, f"Version: {version}\n", "")
            return subprocess.CompletedProcess(argv, check_rc, "", "Error (criu/cr-check.c:1): vDSO check failed\n")

        host.run = run
    records = check.run_checks(host)
    checks = by_check(records)
    assert (checks["criu"]["status"], checks["criu_check"]["status"]) == (criu_status, check_status)
    assert records[-1]["driver"] is True and records[-1]["process_images"] is False
    if version is None:
        assert "Debian 12's 3.17 is too old" in checks["criu"]["detail"]
    if check_rc:
        assert "vDSO check failed" in checks["criu_check"]["detail"]


def test_a_driver_without_checkpoint_support_fails_the_api_check(tmp_path: Path) -> None:
    host = Good(tmp_path)
    host.checkpoint_api = lambda: {"api": SimpleNamespace(version=12080), "own_state": None,
                                   "own_error": "CUDA_ERROR_NOT_SUPPORTED"}
    checks = by_check(check.run_checks(host))
    assert checks["checkpoint_api"]["status"] == "fail" and "MPS" in checks["checkpoint_api"]["detail"]
    host.checkpoint_api = lambda: {"api": SimpleNamespace(version=12080), "own_state": None,
                                   "own_error": "CUDA_ERROR_INVALID_VALUE"}  # this pid: callable all the same
    checks = by_check(check.run_checks(host))
    assert checks["checkpoint_api"]["status"] == "ok" and checks["checkpoint_api"]["restore_onto_other_gpu"] is False


def test_permissions_memory_and_cupti(tmp_path: Path) -> None:
    host = Good(tmp_path)
    host.euid = lambda: 1000
    host.capabilities = lambda: 0
    host.meminfo = lambda: {"MemAvailable": 10 << 30, "MemTotal": 16 << 30}
    host.cupti = lambda: (_ for _ in ()).throw(ImportError("No module named 'cupti'"))
    host.vmm = lambda: [{"index": 0, "vmm": False}]
    records = check.run_checks(host)
    checks = by_check(records)
    assert checks["permissions"]["status"] == "fail" and "CAP_CHECKPOINT_RESTORE" in checks["permissions"]["detail"]
    assert checks["host_memory"]["status"] == "warn" and "cannot be staged" in checks["host_memory"]["detail"]
    assert checks["cupti"]["status"] == "fail" and checks["vmm"]["status"] == "warn"
    summary = records[-1]
    assert summary["driver"] is True and summary["process_images"] is False and summary["agent"] is False
    assert set(summary["failed"]) == {"permissions", "cupti"} and set(summary["warnings"]) == {"vmm", "host_memory"}


def test_the_real_probes_on_this_host(tmp_path: Path) -> None:
    records = check.run_checks(image_dir=str(tmp_path))  # whatever this host has: every check answers
    checks = by_check(records)
    assert set(checks) == {"driver", "checkpoint_api", "vmm", "criu", "criu_check", "cupti", "permissions",
                           "host_memory", "image_dir"}
    assert all(r["status"] in ("ok", "warn", "fail", "skip") and r["detail"] for r in checks.values())
    assert checks["image_dir"]["status"] in ("ok", "warn") and checks["host_memory"]["available"] > 0


def test_the_command_writes_records_and_fails_when_a_check_fails(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "criu"
    fake.write_text('#!/bin/sh\ncase "$1" in --version) echo "Version: 4.2";; check) echo "Looks good.";; esac\n')
    fake.chmod(0o755)
    env = child_env(PATH=f"{bindir}:/usr/bin:/bin", GPUOS_CKPT_STATE_DIR=str(tmp_path / "state"))
    done = subprocess.run([sys.executable, "-m", "gpuos_tools.commands.ckpt", "check", "--dir", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    records = [json.loads(x) for x in done.stdout.splitlines()]
    assert records[0]["type"] == "header" and records[0]["tool"] == "gpu-ckpt check"
    checks = by_check(records)
    assert checks["criu"]["status"] == "ok" and checks["criu"]["path"] == str(fake)
    assert checks["criu_check"]["status"] == "ok"
    failed = records[-1]["failed"]
    assert done.returncode == (ExitCode.FAILURE if failed else 0), done.stderr
    assert os.path.exists(tmp_path)
