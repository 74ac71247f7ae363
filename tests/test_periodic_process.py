"""`gpu-ckpt periodic` with full-process images (images.kind = "process"): the profile's rules,
naming and retention over CRIU image directories (the dump faked: it writes what a finished
`gpu-ckpt --pid --image` leaves), and the process chosen by pid or command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import fake_cuda_process

from gpuos_tools.ckpt import periodic as per
from gpuos_tools.errors import ExitCode, GpuosError


def profile(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "p.toml"
    p.write_text(body)
    return p


GOOD = """
[images]
directory = "imgs"
name = "job"
kind = "process"

[retention]
keep = 2

[process]
pid = 4242
timeout_ms = 1000
"""


def test_a_process_profile_loads(tmp_path: Path) -> None:
    prof = per.load_periodic_profile(profile(tmp_path, GOOD))
    assert prof.kind == "process" and prof.process == {"pid": 4242, "timeout_ms": 1000}
    assert prof.directory == tmp_path / "imgs" and prof.keep == 2 and prof.chain_length == 0


@pytest.mark.parametrize("change,message", [
    (("kind = \"process\"", "kind = \"vm\""), "images.kind: must be"),
    (("[retention]", "[chain]\nlength = 3\n[retention]"), "chain.length must be 0"),
    (("pid = 4242", "pid = 4242\ncommand = 'x'"), "exactly one of pid, command"),
    (("pid = 4242", "pid = -1"), "process.pid: must be integer"),
    (("pid = 4242", "command = '('"), "bad regular expression"),
    (("timeout_ms = 1000", "timeout_ms = -5"), "timeout_ms: must be integer"),
    (("[process]", "[agent]\npid = 1\n[process]"), r"not \[agent\]"),
])
def test_bad_process_profiles_say_what_is_wrong(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    with pytest.raises(GpuosError, match=message) as e:
        per.load_periodic_profile(profile(tmp_path, GOOD.replace(*change)))
    assert e.value.code == ExitCode.BAD_INPUT


def test_an_agent_profile_takes_no_process_table(tmp_path: Path) -> None:
    body = GOOD.replace('kind = "process"\n', "").replace("[process]", "[agent]\npid = 1\n[process]")
    with pytest.raises(GpuosError, match=r"\[process\] goes with"):
        per.load_periodic_profile(profile(tmp_path, body))


def fake_dump(path: str, parent: str | None) -> dict:
    d = Path(path)
    d.mkdir()
    (d / "inventory.img").write_bytes(b"\0" * 100)
    (d / "pages-1.img").write_bytes(b"\1" * 4000)
    (d / "gpuos-ckpt.json").write_text(json.dumps({"pid": 4242, "bytes": 1 << 20}))
    return {"pid": 4242, "state": "running"}


def test_runs_take_full_process_images_and_retention_keeps_the_newest(tmp_path: Path) -> None:
    prof = per.load_periodic_profile(profile(tmp_path, GOOD))
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "notes.txt").write_text("not an image")
    (tmp_path / "imgs" / "job-20000101T000000.000Z").mkdir()  # named like one, but incomplete
    made, deleted = [], []
    for i in range(3):
        rec = per.run_periodic(prof, fake_dump, now=1_800_000_000 + 60 * i)
        assert rec["kind"] == "process" and rec["bytes"] == 1 << 20 and rec["stored_bytes"] >= 4100
        made.append(rec["image"])
        deleted += rec["deleted"]
    names = sorted(p.name for p in (tmp_path / "imgs").iterdir() if p.name != per.LOCK_FILE)
    # the newest two; the incomplete one is damaged: reported, never counted or deleted
    assert names == sorted(made[1:] + ["job-20000101T000000.000Z", "notes.txt"]), names
    assert deleted == [made[0]]
    assert [d["image"] for d in rec["damaged"]] == ["job-20000101T000000.000Z"]


def test_a_dump_that_leaves_no_complete_image_fails(tmp_path: Path) -> None:
    prof = per.load_periodic_profile(profile(tmp_path, GOOD))

    def broken(path: str, parent: str | None) -> dict:
        Path(path).mkdir()
        return {}

    with pytest.raises(GpuosError, match="did not leave a complete image"):
        per.run_periodic(prof, broken, now=1_800_000_000)


def test_the_process_is_found_by_command(tmp_path: Path) -> None:
    with fake_cuda_process(tmp_path, "gpuos-periodic-marker-7") as proc:
        assert per.find_process({"command": "gpuos-periodic-marker-7"}) == proc.pid
        with pytest.raises(GpuosError, match="exactly one CUDA process, not 0") as e:
            per.find_process({"command": "no-such-marker-xyz"})
        assert e.value.code == ExitCode.NO_SUCH_PROCESS
    assert per.find_process({"pid": 12}) == 12
