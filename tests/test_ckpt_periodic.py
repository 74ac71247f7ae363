"""Periodic checkpoints (gpuos_tools.ckpt.periodic): profiles, full vs incremental, naming,
retention, failure handling, and `gpu-ckpt periodic` without an agent.

The snapshot function here is injected by the test (a unit test of the planning and retention
logic): it writes real images through ImageWriter from bytes generated in the test, as the
agent's snapshot function will from GPU memory; no GPU is involved and none is pretended.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from helpers import REPO, child_env

from gpuos_tools import image as img
from gpuos_tools.ckpt import periodic as per
from gpuos_tools.commands.cli import run
from gpuos_tools.errors import ExitCode, GpuosError

T = 1_700_000_000.0  # a fixed "now" (2023-11-14, in the past for --plan), advanced by the tests


def profile(tmp_path: Path, length: int = 2, keep: int = 0, max_age: str | None = None,
            extra: str = "") -> per.PeriodicProfile:
    text = (f'[images]\ndirectory = "imgs"\nname = "job"\nchunk_size = "4KiB"\n{extra}\n'
            f"[chain]\nlength = {length}\n[retention]\nkeep = {keep}\n"
            + (f'max_age = "{max_age}"\n' if max_age else "") + "[agent]\npid = 4242\n")
    path = tmp_path / "p.toml"
    path.write_text(text)
    return per.load_periodic_profile(path)


class FakeSnapshot:
    """Writes an image per call: buffer 1 always rewritten (incremental stores only it), buffer 2
    written once; records what it was asked."""

    def __init__(self, prof: per.PeriodicProfile, fail_at: int | None = None):
        self.prof = prof
        self.calls: list[tuple[str, str | None]] = []
        self.fail_at = fail_at

    def __call__(self, path: str, parent: str | None) -> dict:
        self.calls.append((path, parent))
        n = len(self.calls)
        with img.ImageWriter(path, {"t0": n}, parent=parent, chunk_size=self.prof.chunk_size,
                             compress=self.prof.compress) as w:
            w.add(1, 0x1000, 3 * 4096, bytes([n % 256]) * (3 * 4096))
            if n == self.fail_at:
                raise RuntimeError("agent lost mid-snapshot")
            if parent is None:
                w.add(2, 0x100000, 4096, b"\x02" * 4096)
            return w.commit()


def take(prof: per.PeriodicProfile, snap: FakeSnapshot, n: int, start: float = T, step: float = 900) -> list[dict]:
    return [per.run_periodic(prof, snap, now=start + i * step) for i in range(n)]


def test_shipped_profile_loads() -> None:
    prof = per.load_periodic_profile(REPO / "gpuos_tools" / "profiles" / "ckpt-periodic.toml")
    assert prof.chain_length == 6 and prof.keep == 14 and prof.max_age_s == 7 * 86400
    assert prof.chunk_size == 64 << 20 and prof.checksum == "crc32" and prof.agent == {"command": "python3? .*train"}


@pytest.mark.parametrize("text, message", [
    ("[images]\nname='x'\n[agent]\npid=1\n", "images.directory is required"),
    ("[images]\ndirectory='d'\n", "exactly one of pid, socket, command"),
    ("[images]\ndirectory='d'\n[agent]\npid=1\nsocket='s'\n", "exactly one of pid, socket, command"),
    ("[images]\ndirectory='d'\nfoo=1\n[agent]\npid=1\n", "unknown key images.foo"),
    ("[images]\ndirectory='d'\nname='a/b'\n[agent]\npid=1\n", "images.name"),
    ("[images]\ndirectory='d'\nchunk_size='12 parsecs'\n[agent]\npid=1\n", "images.chunk_size"),
    ("[images]\ndirectory='d'\n[chain]\nlength=-1\n[agent]\npid=1\n", "chain.length"),
    ("[images]\ndirectory='d'\n[retention]\nmax_age='soon'\n[agent]\npid=1\n", "retention.max_age"),
    ("[images]\ndirectory='d'\n[agent]\ncommand='('\n", "agent.command"),
    ("[images\n", "not valid TOML"),
])
def test_bad_profiles(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "p.toml").write_text(text)
    with pytest.raises(GpuosError, match=message) as e:
        per.load_periodic_profile(tmp_path / "p.toml")
    assert e.value.code == ExitCode.BAD_INPUT


def test_full_then_incremental_up_to_the_chain_length(tmp_path: Path) -> None:
    prof = profile(tmp_path, length=2)
    snap = FakeSnapshot(prof)
    records = take(prof, snap, 7)
    assert [r["kind"] for r in records] == ["full", "incremental", "incremental"] * 2 + ["full"]
    assert [r["parent"] for r in records[:3]] == [None, records[0]["image"], records[1]["image"]]
    assert records[0]["image"] == "job-20231114T221320.000Z"
    assert records[1]["image"] == "job-20231114T222820.000Z"
    for r in records:
        assert img.verify(prof.directory / r["image"]) == []
    head = img.open_image(prof.directory / records[5]["image"])
    assert [b["stored"] for b in head.buffers] == [True, False] and head.read(2) == b"\x02" * 4096
    assert head.read(1) == bytes([6]) * (3 * 4096)
    assert all(r["deleted"] == [] for r in records)  # keep = 0, no max_age: nothing goes
    assert sorted(os.listdir(prof.directory)) == sorted([r["image"] for r in records] + [per.LOCK_FILE])


def test_retention_never_deletes_what_a_kept_image_chains_to(tmp_path: Path) -> None:
    prof = profile(tmp_path, length=3, keep=2)
    snap = FakeSnapshot(prof)
    records = take(prof, snap, 10)
    names = [r["image"] for r in records]
    # chains: 0<-1<-2<-3, 4<-5<-6<-7, 8<-9; after image 9, the newest two are 8 and 9
    assert records[-1]["kept"] == [names[9], names[8]]
    on_disk = sorted(n for n in os.listdir(prof.directory) if n.startswith("job-"))
    assert on_disk == sorted([names[8], names[9]])
    # at image 4 (full), keep=2 means 4 and 3, and 3 chains to 2, 1, 0: all stay
    assert records[4]["kept"] == [names[4], names[3], names[2], names[1], names[0]] and records[4]["deleted"] == []
    # at image 5 the first chain goes, children before parents; at 6, 5 chains to 4: 4 stays
    assert records[5]["deleted"] == [names[3], names[2], names[1], names[0]]
    assert records[6]["kept"] == [names[6], names[5], names[4]] and records[6]["deleted"] == []
    for r in records:
        for kept in r["kept"]:
            assert kept in names
    assert img.verify(prof.directory / names[9]) == []


def test_max_age(tmp_path: Path) -> None:
    prof = profile(tmp_path, length=1, max_age="1h")
    snap = FakeSnapshot(prof)
    records = take(prof, snap, 6, step=1200)  # 20 min apart: 0<-1, 2<-3, 4<-5
    names = [r["image"] for r in records]
    # at image 5 (t = 100 min) images 0-1 (0, 20 min) are older than an hour; 2 (40 min) is
    # older too but image 3 (60 min, exactly an hour) chains to it
    assert records[5]["kept"] == [names[5], names[4], names[3], names[2]]
    assert set(records[5]["deleted"]) | set(records[4]["deleted"]) == {names[0], names[1]}


def test_failed_snapshot_leaves_nothing_visible_and_deletes_nothing(tmp_path: Path) -> None:
    prof = profile(tmp_path, length=2, keep=1)
    snap = FakeSnapshot(prof, fail_at=3)
    take(prof, snap, 2)
    before = sorted(os.listdir(prof.directory))
    with pytest.raises(RuntimeError, match="agent lost"):
        per.run_periodic(prof, snap, now=T + 3600)
    assert sorted(os.listdir(prof.directory)) == before  # no temp, no new image, no deletion
    record = per.run_periodic(prof, snap, now=T + 7200)
    assert record["kind"] == "incremental" and img.verify(prof.directory / record["image"]) == []


def test_snapshot_that_leaves_no_image_is_an_error(tmp_path: Path) -> None:
    prof = profile(tmp_path)
    with pytest.raises(GpuosError, match="did not leave an image") as e:
        per.run_periodic(prof, lambda path, parent: {}, now=T)
    assert e.value.code == ExitCode.SOFTWARE


def test_stale_temps_of_dead_writers_are_removed(tmp_path: Path) -> None:
    prof = profile(tmp_path)
    prof.directory.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    stale = prof.directory / f".job-20270101T000000.000Z.{int(dead.stdout)}.abcd1234.tmp"
    (stale / "chunks").mkdir(parents=True)
    (prof.directory / "notes.txt").write_text("not ours")
    live = img.ImageWriter(prof.directory / "other", {})
    record = per.run_periodic(prof, FakeSnapshot(prof), now=T)
    assert record["cleaned"] == [stale.name] and not stale.exists()
    assert (prof.directory / "notes.txt").exists() and os.path.isdir(live.temp)
    live.abort()


def test_an_unreadable_newest_image_makes_the_next_full(tmp_path: Path) -> None:
    prof = profile(tmp_path, length=5)
    snap = FakeSnapshot(prof)
    records = take(prof, snap, 2)
    (prof.directory / records[1]["image"] / "manifest.json").write_text("{")
    record = per.run_periodic(prof, snap, now=T + 3600)
    assert record["kind"] == "full" and "does not read" in record["why"]


def test_two_runs_at_once_are_refused(tmp_path: Path) -> None:
    prof = profile(tmp_path)
    prof.directory.mkdir()
    fd = os.open(prof.directory / per.LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(GpuosError, match="another periodic checkpoint"):
            per.run_periodic(prof, FakeSnapshot(prof), now=T)
    finally:
        os.close(fd)
    assert not any(n.startswith("job-") for n in os.listdir(prof.directory))


def test_clock_going_back_is_refused(tmp_path: Path) -> None:
    prof = profile(tmp_path)
    snap = FakeSnapshot(prof)
    take(prof, snap, 1)
    with pytest.raises(GpuosError, match="clock"):
        per.run_periodic(prof, snap, now=T - 60)


def test_command_without_the_agent_fails_clearly(tmp_path: Path) -> None:
    prof = profile(tmp_path)  # names PID 4242, which runs no agent
    done = subprocess.run([sys.executable, "-m", "gpuos_tools.commands.ckpt", "periodic", "--profile",
                           str(prof.path)], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == ExitCode.NO_SUCH_PROCESS
    assert "gpu-trace run --agent" in done.stderr and done.stdout == ""
    assert not prof.directory.exists()


def test_command_plan(tmp_path: Path) -> None:
    prof = profile(tmp_path, length=1, keep=1)
    take(prof, FakeSnapshot(prof), 2)
    done = subprocess.run([sys.executable, "-m", "gpuos_tools.commands.ckpt", "periodic", "--profile",
                           str(prof.path), "--plan"], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    rec = json.loads(done.stdout.splitlines()[-1])
    before = sorted(n for n in os.listdir(prof.directory) if n.startswith("job-"))
    assert rec["type"] == "ckpt_periodic_plan" and rec["kind"] == "full"  # the newest ends a chain of 1
    assert rec["would_delete"] == list(reversed(before)) and rec["image"] in rec["would_keep"]
    assert sorted(n for n in os.listdir(prof.directory) if n.startswith("job-")) == before  # nothing done


def test_command_is_quiet_on_success(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from gpuos_tools.commands import ckpt

    prof = profile(tmp_path)
    monkeypatch.setattr(per, "agent_snapshot", lambda p: FakeSnapshot(p))  # the hook, connected by the test
    assert run(typer.main.get_command(ckpt.app), "gpu-ckpt", ["periodic", "--profile", str(prof.path)]) == 0
    out, err = capsys.readouterr()
    assert out == "" and err == ""
    assert len([n for n in os.listdir(prof.directory) if n.startswith("job-")]) == 1
    out_file = tmp_path / "rec.ndjson"
    assert run(typer.main.get_command(ckpt.app), "gpu-ckpt",
               ["periodic", "--profile", str(prof.path), "-o", str(out_file)]) == 0
    rec = json.loads(out_file.read_text().splitlines()[-1])
    assert rec["type"] == "ckpt_periodic" and rec["kind"] == "incremental"


def test_a_damaged_image_is_skipped_and_reported_and_retention_goes_on(tmp_path: Path) -> None:
    """A manifest with a wrong field type once made every later run fail; now the run goes on:
    the damaged image is listed, not counted, not chained to, never deleted."""
    prof = profile(tmp_path, length=0, keep=2)
    snap = FakeSnapshot(prof)
    records = take(prof, snap, 3)
    bad = prof.directory / records[1]["image"]
    m = json.loads((bad / "manifest.json").read_text())
    del m["buffers"][0]["id"]
    (bad / "manifest.json").write_text(json.dumps(m))
    later = take(prof, snap, 3, start=T + 3 * 900)
    assert all(r["damaged"] == [{"image": bad.name, "problem": later[0]["damaged"][0]["problem"]}] for r in later)
    assert "field 'buffers[0].id' is missing" in later[0]["damaged"][0]["problem"]
    assert bad.is_dir() and bad.name not in sum((r["deleted"] for r in later), [])
    assert later[-1]["kept"] == [r["image"] for r in later[:0:-1]]  # keep = 2 counts only sound images
    assert sorted(os.listdir(prof.directory)) == sorted([bad.name, *later[-1]["kept"], per.LOCK_FILE])


def test_periodic_command_ends_with_failure_naming_a_damaged_image(tmp_path: Path, capsys) -> None:
    prof = profile(tmp_path, length=0)
    take(prof, FakeSnapshot(prof), 1)
    (bad,) = [p for p in prof.directory.iterdir() if p.name.startswith("job-")]
    (bad / "manifest.json").write_text('{"schema": "gpuos-image/1", "image_id": 5}')
    from gpuos_tools.commands import ckpt

    code = run(typer.main.get_command(ckpt.app), "gpu-ckpt", ["periodic", "--profile", str(prof.path), "--plan"])
    captured = capsys.readouterr()
    assert code == ExitCode.FAILURE
    assert "damaged image left as it is" in captured.err and str(bad) in captured.err
    plan = json.loads(captured.out.splitlines()[-1])
    assert plan["damaged"][0]["image"] == bad.name and plan["would_delete"] == []
