"""gpu-ckpt / gpu-restore on a machine without a GPU: arguments, real processes that are not
there, not ours or not CUDA programs, CRIU refusals, profiles, the registry and GPU maps.

The processes are real (a `sleep`, a Python child that maps a file named libcuda.so.1); only
the GPU-map arithmetic is checked against a GPU list written here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, child_env, fake_cuda_process

from gpuos_tools.ckpt import criu, registry
from gpuos_tools import procs
from gpuos_tools.ckpt.driver import Checkpointer, CkptError, error_code, uuid_bytes
from gpuos_tools.ckpt.profile import (
    Profile,
    load_profile,
    read_state,
    select,
    write_state,
)
from gpuos_tools.ckpt.records import Sink
from gpuos_tools.errors import DESCRIPTIONS, ExitCode, GpuosError

HAS_DRIVER = Path("/dev/nvidiactl").exists()
needs_no_driver = pytest.mark.skipif(HAS_DRIVER, reason="this machine has an NVIDIA driver (the GPU tests cover it)")


def run_cmd(command: str, *args: str, state_dir: Path, path: str | None = None,
            timeout: float = 120) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = child_env(GPUOS_CKPT_STATE_DIR=str(state_dir))
    if path is not None:
        env["PATH"] = path
    done = subprocess.run([sys.executable, "-m", f"gpuos_tools.commands.{command}", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout, check=False)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    return done, records


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


SLEEP = f"1000.{os.getpid()}"  #: the sleeper's argument: sleep takes a fraction
SLEEP_RE = SLEEP.replace(".", "\\.")


@pytest.fixture
def sleeper():
    # a duration of its own, so that profiles selecting it by command line meet no other test's
    # (or another checkout's) sleeper on a shared machine
    proc = subprocess.Popen(["sleep", SLEEP])
    try:
        deadline = time.monotonic() + 10
        while procs.read_proc(proc.pid).cmdline != ["sleep", SLEEP] and time.monotonic() < deadline:
            time.sleep(0.01)  # until exec has replaced the forked Python
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def fake_cuda(tmp_path: Path):
    """A real process that maps a file named libcuda.so.1: a CUDA process to everything but the driver."""
    with fake_cuda_process(tmp_path, "gpuos-fake-cuda") as proc:
        yield proc


def reaped_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not procs.exists(proc.pid)
    return proc.pid


def untouched(proc: subprocess.Popen) -> bool:
    """Still alive and not stopped (T) by anything."""
    return proc.poll() is None and procs.read_proc(proc.pid).state in ("S", "R")


def final(records: list[dict]) -> dict:
    results = [r for r in records if r["type"] == "ckpt_result"]
    assert results, records
    return results[-1]


# -- exit codes and arguments ----------------------------------------------------------------------


def test_new_exit_codes_are_distinct_and_described() -> None:
    names = ["NO_SUCH_PROCESS", "NOT_CUDA_PROCESS", "DRIVER_TOO_OLD", "WRONG_STATE", "LOCK_TIMEOUT", "BAD_GPU",
             "CRIU_UNUSABLE", "CRIU_FAILED", "NOT_CHECKPOINTABLE"]
    codes = [ExitCode[n] for n in names]
    assert len(set(codes)) == len(codes) == len({int(c) for c in ExitCode if c.name in names})
    assert all(64 <= c < 128 for c in codes)
    assert all(DESCRIPTIONS[c].strip() for c in codes)


@pytest.mark.parametrize(("command", "args"), [
    ("ckpt", []),
    ("ckpt", ["--pid", "1", "status"]),
    ("ckpt", ["--pid", "1", "--profile", "p.toml"]),
    ("ckpt", ["--pid", "1", "--leave-running"]),
    ("ckpt", ["--profile", "p.toml", "--image", "d"]),
    ("ckpt", ["--pid", "1", "--timeout", "-5"]),
    ("ckpt", ["--pid", "x"]),
    ("restore", []),
    ("restore", ["--pid", "1", "--image", "d"]),
    ("restore", ["--pid", "1", "--device", "0", "--device-map", "0=1"]),
    ("restore", ["--profile", "p.toml", "--device", "1"]),
    ("restore", ["--pid", "1", "--criu-arg", "-v4"]),
    # group options before a subcommand would be ignored by it: refused, whichever option it is
    ("ckpt", ["--timeout", "5", "status"]),
    ("ckpt", ["--parent", "img", "compact", "a", "b"]),
    ("ckpt", ["--compress", "status"]),
    ("ckpt", ["--checksum", "sha256", "status"]),
    ("restore", ["--timeout", "5", "verify", "img"]),
    ("restore", ["--agent", "1", "--resume", "--device", "1", "--pid", "1"]),
])
def test_usage_errors(command: str, args: list[str], state_dir: Path) -> None:
    done, records = run_cmd(command, *args, state_dir=state_dir)
    assert done.returncode == ExitCode.USAGE, done.stderr
    assert records == []
    assert done.stderr.strip()


def test_help_shows_the_three_forms() -> None:
    done = subprocess.run([sys.executable, "-m", "gpuos_tools.commands.ckpt", "--help"], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0
    assert "--pid" in done.stdout and "--profile" in done.stdout and "status" in done.stdout


# -- real processes, before the driver -------------------------------------------------------------


@pytest.mark.parametrize("command", ["ckpt", "restore"])
def test_no_such_pid(command: str, state_dir: Path) -> None:
    pid = reaped_pid()
    done, records = run_cmd(command, "--pid", str(pid), state_dir=state_dir)
    assert done.returncode == ExitCode.NO_SUCH_PROCESS, done.stderr
    assert f"no process with PID {pid}" in done.stderr
    assert records[0]["type"] == "header" and records[0]["pid"] == pid
    last = final(records)
    assert last == {**last, "ok": False, "state": None, "touched": False, "error": "NO_SUCH_PROCESS", "code": 76}


@pytest.mark.parametrize("command", ["ckpt", "restore"])
def test_not_a_cuda_process(command: str, sleeper, state_dir: Path) -> None:
    done, records = run_cmd(command, "--pid", str(sleeper.pid), state_dir=state_dir)
    assert done.returncode == ExitCode.NOT_CUDA_PROCESS, done.stderr
    assert "is not a CUDA process" in done.stderr and "not touched" in done.stderr
    assert final(records)["error"] == "NOT_CUDA_PROCESS" and final(records)["touched"] is False
    assert untouched(sleeper)


def test_own_pid_is_refused() -> None:
    with pytest.raises(GpuosError) as e:
        procs.check_target(os.getpid())
    assert e.value.code == ExitCode.USAGE


def test_zombie_is_no_such_process() -> None:
    proc = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while procs.read_proc(proc.pid).state != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert not procs.exists(proc.pid)
        with pytest.raises(GpuosError) as e:
            procs.check_target(proc.pid)
        assert e.value.code == ExitCode.NO_SUCH_PROCESS
    finally:
        proc.wait()


def _as_other_user(pid: int, uid: int) -> tuple[int, str]:
    """Run `gpu-ckpt --pid PID` in a forked child that has become ``uid``; (status, stderr)."""
    import typer

    from gpuos_tools.commands.cli import run
    from gpuos_tools.commands.ckpt import app

    command = typer.main.get_command(app)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        code = 99
        try:
            os.environ["GPUOS_CKPT_STATE_DIR"] = "/nonexistent"
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
            sys.stderr = open(os.devnull, "w")  # noqa: SIM115
            # a first run imports what the command imports lazily: the new user may not read them
            run(command, "gpu-ckpt", ["--pid", str(pid)])
            sys.stderr = os.fdopen(write, "w", buffering=1)
            os.setgid(65534)
            os.setuid(uid)
            code = run(command, "gpu-ckpt", ["--pid", str(pid)])
            sys.stderr.flush()
        finally:
            os._exit(int(code))
    os.close(write)
    with os.fdopen(read) as f:
        err = f.read()
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status), err


def test_another_users_process_is_refused(sleeper) -> None:
    if os.geteuid() == 0:
        code, err = _as_other_user(sleeper.pid, 65534)  # the sleep is root's; gpu-ckpt runs as nobody
        assert "belongs to root" in err, err
    else:
        others = [p for p in procs.all_pids() if procs.read_proc(p).uid != os.geteuid()]
        if not others:
            pytest.skip("no process of another user to try")
        done, _ = run_cmd("ckpt", "--pid", str(others[0]), state_dir=Path("/nonexistent"))
        code, err = done.returncode, done.stderr
    assert code == ExitCode.PERMISSION, err
    assert "only root or its owner" in err
    assert untouched(sleeper)


@needs_no_driver
@pytest.mark.parametrize("command", ["ckpt", "restore"])
def test_no_driver(command: str, fake_cuda, state_dir: Path) -> None:
    done, records = run_cmd(command, "--pid", str(fake_cuda.pid), state_dir=state_dir)
    assert done.returncode == ExitCode.NO_DRIVER, done.stderr
    assert "driver" in done.stderr or "cuda-python" in done.stderr
    assert "not touched" in done.stderr
    assert final(records)["touched"] is False
    assert fake_cuda.poll() is None


@needs_no_driver
def test_status_without_driver(state_dir: Path) -> None:
    done, _ = run_cmd("ckpt", "status", "--json", state_dir=state_dir)
    assert done.returncode == ExitCode.NO_DRIVER
    assert "driver" in done.stderr or "cuda-python" in done.stderr


def test_fake_cuda_process_passes_the_proc_checks(fake_cuda) -> None:
    info = procs.check_target(fake_cuda.pid)
    assert info.pid == fake_cuda.pid and "gpuos-fake-cuda" in info.command
    assert fake_cuda.pid in procs.scan_cuda_pids()[0]


# -- CRIU ------------------------------------------------------------------------------------------


def fake_criu(bin_dir: Path, version: str, check_rc: int = 0) -> Path:
    """A `criu` that logs its arguments, prints VERSION and whose `check` exits CHECK_RC."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = bin_dir / "criu.log"
    script = bin_dir / "criu"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{log}"\n'
        f'case "$1" in\n'
        f'  --version) echo "Version: {version}"; echo "GitID: v{version}";;\n'
        f'  check) if [ {check_rc} -ne 0 ]; then echo "Error (criu/cr-check.c:1): vDSO check failed" >&2; '
        f'exit {check_rc}; fi; echo "Looks good.";;\n'
        f'  *) echo "fake criu: $1 not done here" >&2; exit 1;;\n'
        "esac\n"
    )
    script.chmod(0o755)
    return log


def path_with(bin_dir: Path) -> str:
    """PATH with ``bin_dir`` first and the system's directories after, none of them with a criu."""
    dirs = [str(bin_dir)] + [d for d in ("/usr/bin", "/bin") if not (Path(d) / "criu").exists()]
    return os.pathsep.join(dirs)


def test_image_without_criu_is_refused_before_touching(sleeper, tmp_path: Path, state_dir: Path) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    image = tmp_path / "img"
    done, records = run_cmd("ckpt", "--pid", str(sleeper.pid), "--image", str(image), state_dir=state_dir,
                            path=path_with(empty))
    assert done.returncode == ExitCode.CRIU_UNUSABLE, done.stderr
    assert "no `criu` on PATH" in done.stderr and "nothing was touched" in done.stderr
    assert not image.exists()
    assert final(records)["touched"] is False and final(records)["error"] == "CRIU_UNUSABLE"
    assert untouched(sleeper)


def test_old_criu_is_refused(sleeper, tmp_path: Path, state_dir: Path) -> None:
    log = fake_criu(tmp_path / "bin", "3.17")
    done, _ = run_cmd("ckpt", "--pid", str(sleeper.pid), "--image", str(tmp_path / "img"), state_dir=state_dir,
                      path=path_with(tmp_path / "bin"))
    assert done.returncode == ExitCode.CRIU_UNUSABLE, done.stderr
    assert "is CRIU 3.17" in done.stderr and "CRIU 4 or later" in done.stderr
    assert log.read_text().split("\n")[:-1] == ["--version"]
    assert untouched(sleeper)


def test_failing_criu_check_is_refused(sleeper, tmp_path: Path, state_dir: Path) -> None:
    log = fake_criu(tmp_path / "bin", "4.1", check_rc=1)
    done, _ = run_cmd("ckpt", "--pid", str(sleeper.pid), "--image", str(tmp_path / "img"), state_dir=state_dir,
                      path=path_with(tmp_path / "bin"))
    assert done.returncode == ExitCode.CRIU_UNUSABLE, done.stderr
    assert "`criu check` failed (exit 1)" in done.stderr and "vDSO check failed" in done.stderr
    assert log.read_text().split("\n")[:-1] == ["--version", "check"]
    assert untouched(sleeper)


def test_usable_criu_still_needs_a_cuda_process(sleeper, tmp_path: Path, state_dir: Path) -> None:
    log = fake_criu(tmp_path / "bin", "4.1")
    done, _ = run_cmd("ckpt", "--pid", str(sleeper.pid), "--image", str(tmp_path / "img"), state_dir=state_dir,
                      path=path_with(tmp_path / "bin"))
    assert done.returncode == ExitCode.NOT_CUDA_PROCESS, done.stderr
    assert "dump" not in log.read_text()
    assert untouched(sleeper)


def test_restore_image_refusals(tmp_path: Path, state_dir: Path) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    image = tmp_path / "img"
    image.mkdir()
    done, _ = run_cmd("restore", "--image", str(image), state_dir=state_dir, path=path_with(empty))
    assert done.returncode == ExitCode.CRIU_UNUSABLE and "no `criu` on PATH" in done.stderr
    fake_criu(tmp_path / "old", "3.17")
    done, _ = run_cmd("restore", "--image", str(image), state_dir=state_dir, path=path_with(tmp_path / "old"))
    assert done.returncode == ExitCode.CRIU_UNUSABLE and "is CRIU 3.17" in done.stderr
    log = fake_criu(tmp_path / "new", "4.0")
    done, _ = run_cmd("restore", "--image", str(image), state_dir=state_dir, path=path_with(tmp_path / "new"))
    assert done.returncode == ExitCode.NO_INPUT and "holds no image written by gpu-ckpt" in done.stderr
    assert "restore" not in log.read_text()


def test_find_criu_reads_the_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_criu(tmp_path / "bin", "4.0.1")
    monkeypatch.setenv("PATH", path_with(tmp_path / "bin"))
    found = criu.find_criu()
    assert found.version == (4, 0) and found.version_text == "4.0.1"
    assert found.path == str(tmp_path / "bin" / "criu")


# -- profiles --------------------------------------------------------------------------------------


def write_profile(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_shipped_profile() -> None:
    import pwd
    import tomllib

    path = REPO / "gpuos_tools" / "profiles" / "maintenance.toml"
    data = tomllib.loads(path.read_text())
    assert data["state"]["file"].startswith("/") and data["checkpoint"]["on_error"] == "resume"
    users = data["select"]["users"]
    missing = [u for u in users if not any(p.pw_name == u for p in pwd.getpwall())]
    if missing:
        with pytest.raises(GpuosError) as e:
            load_profile(path)
        assert e.value.code == ExitCode.BAD_INPUT and f"no user named {missing[0]!r}" in str(e.value)
    else:
        profile = load_profile(path)
        assert profile.command is not None and profile.timeout_ms == data["checkpoint"]["timeout_ms"]


@pytest.mark.parametrize(("text", "message"), [
    ("[select\n", "not valid TOML"),
    ("[select]\ncommand='x'\nfoo=1\n[state]\nfile='s'\n", "unknown key select.foo"),
    ("[nope]\n", "unknown table [nope]"),
    ("[select]\n[state]\nfile='s'\n", "selects nothing"),
    ("[select]\ncommand='('\n[state]\nfile='s'\n", "bad regular expression"),
    ("[select]\ncommand='x'\n", "state.file is required"),
    ("[select]\ncommand='x'\n[checkpoint]\non_error='panic'\n[state]\nfile='s'\n", "on_error"),
    ("[select]\ncommand='x'\n[checkpoint]\ntimeout_ms=-1\n[state]\nfile='s'\n", "timeout_ms"),
    ("[select]\nusers=['no-such-user-gpuos']\n[state]\nfile='s'\n", "no user named"),
    ("[select]\nall='yes'\n[state]\nfile='s'\n", "select.all"),
])
def test_bad_profiles(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(GpuosError) as e:
        load_profile(write_profile(tmp_path / "p.toml", text))
    assert e.value.code == ExitCode.BAD_INPUT
    assert message in str(e.value)


def test_missing_profile(tmp_path: Path, state_dir: Path) -> None:
    done, _ = run_cmd("ckpt", "--profile", str(tmp_path / "none.toml"), state_dir=state_dir)
    assert done.returncode == ExitCode.NO_INPUT and "no such profile" in done.stderr


def test_profile_paths_and_defaults(tmp_path: Path) -> None:
    p = load_profile(write_profile(tmp_path / "p.toml", "[select]\nusers = [0, 'root']\n[state]\nfile = 'sub/s.json'\n"))
    assert p.uids == {0} and p.command is None and p.timeout_ms == 0 and p.on_error == "resume"
    assert p.state_file == tmp_path / "sub" / "s.json"


def test_profile_selects_real_processes(sleeper, tmp_path: Path) -> None:
    me = procs.read_proc(sleeper.pid)
    others = [procs.read_proc(p) for p in procs.all_pids() if p != sleeper.pid and procs.exists(p)]
    everyone = [me, *others]

    def chosen(text: str) -> list[int]:
        prof = load_profile(write_profile(tmp_path / "p.toml", text + "\n[state]\nfile = 's.json'\n"))
        return [i.pid for i in select(prof, everyone)]

    assert chosen(f"[select]\ncommand = '^sleep {SLEEP_RE}$'") == [sleeper.pid]
    assert chosen(f"[select]\nusers = [{me.uid}]\ncommand = '^sleep {SLEEP_RE}$'") == [sleeper.pid]
    assert chosen(f"[select]\nusers = [{me.uid + 4242}]\ncommand = '^sleep {SLEEP_RE}$'") == []
    assert sleeper.pid in chosen(f"[select]\nusers = ['{me.user}']")
    assert chosen(f"[select]\ncommand = '^sleep {SLEEP_RE}$'\nexclude_command = '{SLEEP_RE}'") == []
    assert len(chosen("[select]\nall = true")) == len(everyone)


def test_profile_run_with_no_cuda_match_is_quiet(sleeper, tmp_path: Path, state_dir: Path) -> None:
    prof = write_profile(tmp_path / "p.toml", f"[select]\ncommand = '^sleep {SLEEP_RE}$'\n[state]\nfile = 'run.json'\n")
    done, records = run_cmd("ckpt", "--profile", str(prof), state_dir=state_dir)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert not (tmp_path / "run.json").exists()
    done, _ = run_cmd("ckpt", "--profile", str(prof), "-o", str(tmp_path / "rec.ndjson"), state_dir=state_dir)
    records = [json.loads(line) for line in (tmp_path / "rec.ndjson").read_text().splitlines()]
    assert records[0]["type"] == "header" and records[0]["profile"] == str(prof)
    summary = records[-1]
    assert summary["type"] == "ckpt_profile" and summary["selected"] == 0 and summary["ok"] is True
    assert untouched(sleeper)
    done, _ = run_cmd("restore", "--profile", str(prof), state_dir=state_dir)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@needs_no_driver
def test_profile_run_without_driver_is_loud(fake_cuda, tmp_path: Path, state_dir: Path) -> None:
    prof = write_profile(tmp_path / "p.toml", "[select]\ncommand = 'gpuos-fake-cuda'\n[state]\nfile = 'run.json'\n")
    done, _ = run_cmd("ckpt", "--profile", str(prof), state_dir=state_dir)
    assert done.returncode == ExitCode.NO_DRIVER, done.stderr
    assert done.stdout == "" and ("driver" in done.stderr or "cuda-python" in done.stderr)
    assert "0 suspended" in done.stderr
    assert "1 failed; nothing is left suspended" in done.stderr
    assert not (tmp_path / "run.json").exists()
    assert fake_cuda.poll() is None


def test_restore_profile_reports_gone_processes(tmp_path: Path, state_dir: Path) -> None:
    prof = load_profile(write_profile(tmp_path / "p.toml", "[select]\ncommand='x'\n[state]\nfile='run.json'\n"))
    gone = {"pid": reaped_pid(), "starttime": 1, "boot_id": procs.boot_id(), "command": "train.py",
            "checkpointed_at": "2026-11-22T02:00:00+0000"}
    write_state(prof, [gone])
    done, _ = run_cmd("restore", "--profile", str(prof.path), state_dir=state_dir)
    assert done.returncode == ExitCode.NO_SUCH_PROCESS
    assert "train.py" in done.stderr and "is gone" in done.stderr
    assert not prof.state_file.exists()  # nothing left to retry


@needs_no_driver
def test_restore_profile_keeps_what_failed(fake_cuda, tmp_path: Path, state_dir: Path) -> None:
    prof = load_profile(write_profile(tmp_path / "p.toml", "[select]\ncommand='x'\n[state]\nfile='run.json'\n"))
    entry = registry.entry_for(procs.read_proc(fake_cuda.pid), gpus=[], bytes=None)
    write_state(prof, [entry])
    done, _ = run_cmd("restore", "--profile", str(prof.path), state_dir=state_dir)
    assert done.returncode == ExitCode.NO_DRIVER
    assert "1 still listed" in done.stderr
    assert [e["pid"] for e in read_state(prof)] == [fake_cuda.pid]


def test_state_file_is_written_atomically(tmp_path: Path, sleeper) -> None:
    prof = Profile(path=tmp_path / "p.toml", state_file=tmp_path / "deep" / "s.json", command=None)
    entry = registry.entry_for(procs.read_proc(sleeper.pid), gpus=[{"uuid": "GPU-x"}], bytes=5)
    write_state(prof, [entry])
    assert read_state(prof) == [entry]
    assert os.stat(prof.state_file).st_mode & 0o777 == 0o600
    assert sorted(p.name for p in prof.state_file.parent.iterdir()) == ["s.json"]
    write_state(prof, [])
    assert not prof.state_file.exists()
    prof.state_file.write_text("{}")
    with pytest.raises(GpuosError) as e:
        read_state(prof)
    assert e.value.code == ExitCode.BAD_INPUT


# -- the registry ----------------------------------------------------------------------------------


def test_registry_names_a_process_by_pid_and_start_time(sleeper, state_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv(registry.ENV, str(state_dir))
    info = procs.read_proc(sleeper.pid)
    assert registry.remember(registry.entry_for(info, gpus=[{"uuid": "GPU-a"}], bytes=7)) is not None
    assert registry.lookup(sleeper.pid)["bytes"] == 7
    assert [e["pid"] for e in registry.known()] == [sleeper.pid]
    stale = registry.read_json(state_dir / f"{sleeper.pid}.json")
    registry.write_json_atomic(state_dir / f"{sleeper.pid}.json", {**stale, "starttime": stale["starttime"] - 1})
    assert registry.lookup(sleeper.pid) is None  # a reused pid is not the checkpointed process
    assert registry.known() == [] and not (state_dir / f"{sleeper.pid}.json").exists()
    registry.remember(registry.entry_for(info))
    registry.forget(sleeper.pid)
    assert registry.lookup(sleeper.pid) is None


# -- GPU maps (the arithmetic; the driver's side is in tests/gpu) ----------------------------------


UUIDS = [f"GPU-{i:08x}-1111-2222-3333-444455556666" for i in range(4)]


def checkpointer(names: list[str], free: int = 100 << 30) -> Checkpointer:
    ckpt = Checkpointer()
    ckpt._gpus = [{"index": i, "uuid": UUIDS[i], "name": n, "memory": 141 << 30, "memory_free": free, "minor": i}
                  for i, n in enumerate(names)]
    return ckpt


@pytest.fixture
def remembered(sleeper, state_dir: Path, monkeypatch):
    """The sleep, recorded as checkpointed from GPU 0 with 1 GiB."""
    monkeypatch.setenv(registry.ENV, str(state_dir))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    registry.remember(registry.entry_for(procs.read_proc(sleeper.pid), gpus=[{"uuid": UUIDS[0]}], bytes=1 << 30))
    return sleeper.pid


def test_moving_a_one_gpu_process_swaps_two_gpus(remembered) -> None:
    ckpt = checkpointer(["H200"] * 3)
    pairs, target = ckpt.gpu_pairs(remembered, "1", None)
    assert target["uuid"] == UUIDS[1]
    assert pairs == sorted([(UUIDS[0], UUIDS[1]), (UUIDS[1], UUIDS[0]), (UUIDS[2], UUIDS[2])])
    assert ckpt.gpu_pairs(remembered, UUIDS[2][:12], None)[0] == sorted(
        [(UUIDS[0], UUIDS[2]), (UUIDS[2], UUIDS[0]), (UUIDS[1], UUIDS[1])])
    assert ckpt.gpu_pairs(remembered, "0", None) == (None, ckpt._gpus[0])


@pytest.mark.parametrize(("names", "free", "device", "message"), [
    (["H200", "H200"], 100 << 30, "7", "no GPU with index 7"),
    (["H200", "H200"], 100 << 30, "GPU-ffff", "no GPU with UUID"),
    (["H200", "H100"], 100 << 30, "1", "is not the same chip"),
    (["H200", "H200"], 1 << 20, "1", "1.0 MiB free"),
])
def test_bad_targets(remembered, names, free, device, message) -> None:
    with pytest.raises(GpuosError) as e:
        checkpointer(names, free).gpu_pairs(remembered, device, None)
    assert e.value.code == ExitCode.BAD_GPU and message in str(e.value)


def test_unknown_source_gpu_needs_a_map(sleeper, state_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv(registry.ENV, str(state_dir))
    with pytest.raises(GpuosError) as e:
        checkpointer(["H200", "H200"]).gpu_pairs(sleeper.pid, "1", None)
    assert e.value.code == ExitCode.BAD_GPU and "--device-map" in str(e.value)
    pairs, _ = checkpointer(["H200", "H200"]).gpu_pairs(sleeper.pid, "1", None, source_gpus=[UUIDS[0]])
    assert pairs == sorted([(UUIDS[0], UUIDS[1]), (UUIDS[1], UUIDS[0])])
    with pytest.raises(GpuosError) as e:
        checkpointer(["H200", "H200"]).gpu_pairs(sleeper.pid, "1", None, source_gpus=UUIDS[:2])
    assert "used 2 GPUs" in str(e.value)


def test_device_maps(sleeper) -> None:
    ckpt = checkpointer(["H200"] * 4)
    pairs, _ = ckpt.gpu_pairs(sleeper.pid, None, "0=2,1=3,2=0,3=1")
    assert pairs == sorted([(UUIDS[0], UUIDS[2]), (UUIDS[1], UUIDS[3]), (UUIDS[2], UUIDS[0]), (UUIDS[3], UUIDS[1])])
    pairs, _ = ckpt.gpu_pairs(sleeper.pid, None, f"0=1,{UUIDS[1]}=0")
    assert (UUIDS[2], UUIDS[2]) in pairs and (UUIDS[0], UUIDS[1]) in pairs
    for bad, message, code in (("0=1", "permutation", ExitCode.BAD_GPU), ("0=9", "index 9", ExitCode.BAD_GPU),
                               ("0-1", "not OLD=NEW", ExitCode.USAGE), ("0=", "not OLD=NEW", ExitCode.USAGE),
                               ("0=1,0=2", "twice", ExitCode.USAGE)):
        with pytest.raises(GpuosError) as e:
            ckpt.gpu_pairs(sleeper.pid, None, bad)
        assert e.value.code == code and message in str(e.value), (bad, e.value)


def test_uuid_bytes() -> None:
    assert uuid_bytes("GPU-00010203-0405-0607-0809-0a0b0c0d0e0f") == bytes(range(16))
    with pytest.raises(ValueError):
        uuid_bytes("GPU-0001")


def test_driver_errors_map_to_exit_codes() -> None:
    assert error_code("lock", "CUDA_ERROR_NOT_READY") == ExitCode.LOCK_TIMEOUT
    assert error_code("lock", "CUDA_ERROR_TIMEOUT") == ExitCode.LOCK_TIMEOUT
    assert error_code("lock", "CUDA_ERROR_ILLEGAL_STATE") == ExitCode.WRONG_STATE
    assert error_code("state", "CUDA_ERROR_NOT_SUPPORTED") == ExitCode.DRIVER_TOO_OLD
    assert error_code("state", "CUDA_ERROR_INVALID_VALUE") == ExitCode.NOT_CUDA_PROCESS
    assert error_code("restore", "CUDA_ERROR_INVALID_VALUE", remapped=True) == ExitCode.BAD_GPU
    assert error_code("restore", "CUDA_ERROR_INVALID_VALUE") == ExitCode.CUDA_ERROR
    assert error_code("checkpoint", "CUDA_ERROR_NOT_SUPPORTED") == ExitCode.NOT_CHECKPOINTABLE


# -- records ---------------------------------------------------------------------------------------


def test_sink_writes_the_header_first_with_what_is_known(tmp_path: Path) -> None:
    from gpuos_tools.stream import open_input, open_output

    known: dict = {}
    out = tmp_path / "r.ndjson"
    with open_output(str(out)) as writer:
        sink = Sink(writer, "gpu-ckpt", lambda: dict(known), action="checkpoint", pid=5)
        known["driver"] = {"cuda": "13.0"}
        sink({"type": "ckpt_step", "pid": 5, "step": "lock", "ok": True})
        sink.finish()
    with open_input(str(out)) as reader:
        records = list(reader)
    assert records[0]["type"] == "header" and records[0]["driver"] == {"cuda": "13.0"} and records[0]["pid"] == 5
    assert records[1:] == [{"type": "ckpt_step", "pid": 5, "step": "lock", "ok": True}] == sink.records


def test_ckpt_error_carries_the_state() -> None:
    ckpt = Checkpointer()
    seen: list = []
    ckpt.emit = seen.append
    err = ckpt.fail("checkpoint", 7, "boom; left running", ExitCode.LOCK_TIMEOUT, "running", False)
    assert isinstance(err, CkptError) and err.code == ExitCode.LOCK_TIMEOUT and err.state == "running"
    assert seen == [err.record] and err.record["error"] == "LOCK_TIMEOUT" and err.record["code"] == 80



def test_a_failure_note_extends_failures_only_while_in_force() -> None:
    ckpt = Checkpointer()
    seen: list = []
    ckpt.emit = seen.append
    asked: list = []

    def note(pid: int | None, state: str | None) -> str:
        asked.append((pid, state))
        return "its agent resumed it" if pid == 7 else ""

    with ckpt.failure_note(note):
        err = ckpt.fail("dump", 7, "criu dump failed; left running", ExitCode.CRIU_FAILED, "running", False)
        other = ckpt.fail("dump", 8, "refused; nothing was touched", ExitCode.USAGE, None, False)
    after = ckpt.fail("dump", 7, "refused; nothing was touched", ExitCode.USAGE, None, False)
    assert asked == [(7, "running"), (8, None)]  # asked in force, never after
    assert str(err) == "criu dump failed; left running; its agent resumed it" and err.touched
    assert err.record["message"] == str(err) and err.record["touched"] is True
    assert str(other) == "refused; nothing was touched" and not other.touched
    assert str(after) == "refused; nothing was touched" and not after.touched
    assert seen == [err.record, other.record, after.record]

@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_failing_output_neither_undoes_nor_hides_the_work() -> None:
    from gpuos_tools.ckpt.records import run_recorded

    ckpt = Checkpointer()
    done: list[str] = []

    def work() -> dict:
        ckpt.out({"type": "ckpt_step", "pid": 1})
        done.append("checkpointed")  # the work goes on although the output fails
        return {"message": "PID 1 checkpointed"}

    with pytest.raises(GpuosError) as e:
        run_recorded("/dev/full", "gpu-ckpt", ckpt, work, pid=1)
    assert done == ["checkpointed"]
    assert e.value.code == ExitCode.IO_ERROR and "PID 1 checkpointed" in str(e.value)

    def failing() -> dict:
        ckpt.out({"type": "ckpt_step", "pid": 1})
        raise ckpt.fail("checkpoint", 1, "lock timed out; left running", ExitCode.LOCK_TIMEOUT, "running", False)

    ckpt = Checkpointer()
    with pytest.raises(CkptError) as f:
        run_recorded("/dev/full", "gpu-ckpt", ckpt, failing, pid=1)
    assert f.value.code == ExitCode.LOCK_TIMEOUT  # the action's own failure wins


def test_the_works_own_error_is_raised_as_it_is(tmp_path: Path) -> None:
    """A GpuosError of the work that is no CkptError (the agent's answer in a move) is the work's,
    not the output's: raised with its own code, never as 'writing records failed'."""
    from gpuos_tools.ckpt.records import run_recorded

    def failing() -> dict:
        raise GpuosError("the agent did not answer", ExitCode.SNAPSHOT_UNAVAILABLE)

    with pytest.raises(GpuosError) as e:
        run_recorded(str(tmp_path / "out.ndjson"), "gpu-restore", Checkpointer(), failing, pid=1)
    assert e.value.code == ExitCode.SNAPSHOT_UNAVAILABLE and str(e.value) == "the agent did not answer"


def test_man_pages_show_cron_the_profile_and_the_codes() -> None:
    import tomllib

    from gpuos_tools.commands.manual import ckpt as ckpt_manual

    ckpt_page = (REPO / "man" / "gpu-ckpt.1").read_text()
    restore_page = (REPO / "man" / "gpu-restore.1").read_text()
    for page in (ckpt_page, restore_page):
        assert "chronic gpu\\-ckpt \\-\\-profile" in page and "chronic gpu\\-restore \\-\\-profile" in page
        for code in (76, 77, 78, 79, 80, 81, 82, 83, 84):
            assert f".TP\n\\fB{code}\\fR\n" in page
    assert "[\\fICOMMAND\\fR [\\fIARGS\\fR]...]" in ckpt_page  # `gpu-ckpt --pid` works without one
    # the profile the examples show is a valid profile with the shipped profile's sections
    example = ckpt_manual.EXAMPLES.split("The profile (gpuos_tools/profiles/maintenance.toml, installed with the package):", 1)[1]
    example = example.split("A full-process image", 1)[0]
    block = "\n".join(line[4:] for line in example.splitlines() if line.startswith("    "))
    shown = tomllib.loads(block)
    shipped = tomllib.loads((REPO / "gpuos_tools" / "profiles" / "maintenance.toml").read_text())
    assert shown.keys() == shipped.keys() and shown["select"] == shipped["select"]
    assert shown["checkpoint"] == shipped["checkpoint"] and shown["state"] == shipped["state"]
