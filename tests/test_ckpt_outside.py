"""The scan for pipes a process tree shares with processes outside it, and the restore's plan for
them, on real pipes and FIFOs held by real child processes (no CRIU needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuos_tools.ckpt import criu, outside

#: Holds a pipe of its own, both ends (never outside), and waits for its stdin to close.
HOLDER = "import os, sys; r, w = os.pipe(); print('ready', file=sys.stderr, flush=True); sys.stdin.read()"


@pytest.fixture
def child() -> Iterator[tuple[subprocess.Popen, int, int]]:
    """A child whose stdin is the read end of a pipe the test writes, and whose fd 1 is the write end of
    a pipe the test reads (its stderr too, another pipe): (child, the test's write end of its stdin, the
    test's read end of its stdout)."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    p = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=in_r, stdout=out_w, stderr=subprocess.PIPE)
    os.close(in_r)
    os.close(out_w)
    assert p.stderr is not None and p.stderr.readline() == b"ready\n"
    yield p, in_w, out_r
    for fd in (in_w, out_r):
        try:
            os.close(fd)
        except OSError:
            pass
    p.kill()
    p.wait()


def test_scan_finds_the_ends_whose_other_end_is_outside(child) -> None:
    p, in_w, out_r = child
    found = outside.scan([p.pid])
    ends = {(e["end"], e["fds"][0]["fd"]): e for e in found}
    assert set(ends) == {("read", 0), ("write", 1), ("write", 2)}  # its own pipe (both ends held) is not there
    assert ends[("write", 1)]["pipe"] == os.readlink(f"/proc/{p.pid}/fd/1") == os.readlink(f"/proc/self/fd/{out_r}")
    assert all(e["kind"] == "pipe" and e["fds"] == [{"pid": p.pid, "fd": e["fds"][0]["fd"]}] for e in found)
    # the same pipes seen from a tree that holds both ends (the child and this test) are inside it
    both = outside.scan([p.pid, os.getpid()])
    assert not {e["pipe"] for e in both} & {e["pipe"] for e in found}
    # a pipe handled elsewhere (the agent's trace pipe) is skipped
    skipped = outside.scan([p.pid], skip={ends[("write", 1)]["pipe"]})
    assert [(e["end"], e["fds"][0]["fd"]) for e in skipped] == [("read", 0), ("write", 2)]


def test_scan_gathers_every_descriptor_of_one_pipe(tmp_path: Path) -> None:
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, stdout=w,
                         stderr=w)  # `prog 2>&1 | tee`: two descriptors, one pipe
    os.close(w)
    try:
        found = [e for e in outside.scan([p.pid]) if e["end"] == "write"]
        assert len(found) == 1 and found[0]["fds"] == [{"pid": p.pid, "fd": 1}, {"pid": p.pid, "fd": 2}]
    finally:
        assert p.stdin is not None
        p.stdin.close()
        p.wait()
        os.close(r)


def test_scan_tells_fifos_and_holds_read_write_ones_inside(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    both = tmp_path / "both"
    os.mkfifo(both)
    code = (f"import os, sys; a = os.open({str(both)!r}, os.O_RDWR); w = os.open({str(fifo)!r}, os.O_WRONLY); "
            "print('ready', flush=True); sys.stdin.read()")
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the reader outside, so the child's open goes through
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        fifos = [e for e in outside.scan([p.pid]) if e["kind"] == "fifo"]
        assert [(e["pipe"], e["end"]) for e in fifos] == [(str(fifo), "write")]
    finally:
        assert p.stdin is not None
        p.stdin.close()
        p.wait()
        os.close(reader)


def test_a_process_gone_is_no_error() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert outside.scan([p.pid]) == []


def meta_for(entries: list[dict]) -> dict:
    return {"pid": 1, outside.KEY: entries}


def test_plan_reconnects_a_live_reader_and_files_a_gone_one(tmp_path: Path, child) -> None:
    p, in_w, out_r = child
    image = tmp_path / "image"
    entries = outside.scan([p.pid])
    plan = outside.plan(image, meta_for(entries))
    try:
        how = {e["fds"][0]["fd"]: e for e in plan.done}
        # every other end is alive (this test holds them): the restored program gets the same pipes
        assert {e["how"] for e in plan.done} == {"reconnected"}
        assert how[1]["to"] == f"/proc/{os.getpid()}/fd/{out_r}"
        assert len(plan.pass_fds) == 3 and len(plan.criu_args) == 6
        for fd, e in zip(plan.pass_fds, plan.done):
            assert plan.criu_args[plan.criu_args.index(f"fd[{fd}]:{e['pipe']}") - 1] == "--inherit-fd"
            assert os.readlink(f"/proc/self/fd/{fd}") == e["pipe"]  # the very pipe, not a new one
        w = plan.pass_fds[list(how).index(1)]
        os.write(w, b"still read\n")
        assert os.read(out_r, 100) == b"still read\n"
    finally:
        plan.close()
    assert plan.pass_fds == ()
    # the reader gone: the output goes to a file beside the image; a writer gone: /dev/null
    os.close(out_r)
    os.close(in_w)
    plan = outside.plan(image, meta_for(entries))
    try:
        how = {e["fds"][0]["fd"]: e for e in plan.done}
        log = tmp_path / f"image.restored-{p.pid}-fd1.log"
        assert how[1]["how"] == "file" and how[1]["to"] == str(log) and log.exists()
        assert how[0]["how"] == "null" and how[0]["to"] == os.devnull
        assert how[2]["how"] == "reconnected"  # its stderr's reader is still here
        assert any(str(log) in n for n in plan.notes) and len(plan.notes) == 3
        os.write(plan.pass_fds[list(how).index(1)], b"a\n")
    finally:
        plan.close()
    plan = outside.plan(image, meta_for(entries))  # appended, never truncated
    try:
        os.write(plan.pass_fds[[e["fds"][0]["fd"] for e in plan.done].index(1)], b"b\n")
    finally:
        plan.close()
    assert log.read_bytes() == b"a\nb\n"


def test_output_to_and_another_boot_replace_even_a_live_reader(tmp_path: Path, child) -> None:
    p, in_w, out_r = child
    entries = outside.scan([p.pid])
    chosen = tmp_path / "chosen.log"
    # --output-to: every write end goes to the file, alive reader or not; a read end keeps its live writer
    # (only output is redirected); another boot: no process can hold the same pipe
    for kw, want in (({"output_to": str(chosen)}, {0: "reconnected", 1: "file", 2: "file"}),
                     ({"same_boot": False}, {0: "null", 1: "file", 2: "file"})):
        plan = outside.plan(tmp_path / "image", meta_for(entries), **kw)
        try:
            assert {e["fds"][0]["fd"]: e["how"] for e in plan.done} == want
        finally:
            plan.close()
    assert chosen.exists() and (tmp_path / f"image.restored-{p.pid}-fd1.log").exists()


def test_a_default_file_that_is_a_symlink_is_refused_and_nothing_stays_open(tmp_path: Path, child) -> None:
    p, in_w, out_r = child
    os.close(out_r)
    entries = outside.scan([p.pid])
    (tmp_path / f"image.restored-{p.pid}-fd1.log").symlink_to(tmp_path / "elsewhere")
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        outside.plan(tmp_path / "image", meta_for(entries))
    assert set(os.listdir("/proc/self/fd")) <= before
    assert not (tmp_path / "elsewhere").exists()


def test_old_images_get_no_inherited_descriptor(tmp_path: Path) -> None:
    assert outside.plan(tmp_path / "image", {"pid": 1}).criu_args == []


def test_a_fifo_gets_its_live_other_end_or_a_file_or_dev_null_under_crius_name(tmp_path: Path) -> None:
    """A FIFO is handed over as a pipe is, under the name CRIU gives a file: its path without the
    leading slash. Its reader alive: the same FIFO; gone: the file; a read end whose writer is gone:
    /dev/null."""
    out_fifo, in_fifo = tmp_path / "out.fifo", tmp_path / "in.fifo"
    os.mkfifo(out_fifo)
    os.mkfifo(in_fifo)
    entries = [{"pipe": str(out_fifo), "kind": "fifo", "end": "write", "fds": [{"pid": 5, "fd": 1}]},
               {"pipe": str(in_fifo), "kind": "fifo", "end": "read", "fds": [{"pid": 5, "fd": 0}]}]
    end = os.open(out_fifo, os.O_RDONLY | os.O_NONBLOCK)
    reader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdin=end)
    os.close(end)  # the child holds the read end, this test none
    try:
        plan = outside.plan(tmp_path / "image", meta_for(entries))
        try:
            done = {e["end"]: e for e in plan.done}
            assert done["write"]["how"] == "reconnected" and done["write"]["to"].startswith(f"/proc/{reader.pid}/fd/")
            assert done["read"]["how"] == "null" and done["read"]["to"] == os.devnull
            assert plan.criu_args[1] == f"fd[{plan.pass_fds[0]}]:{str(out_fifo).lstrip('/')}"
            assert plan.criu_args[3] == f"fd[{plan.pass_fds[1]}]:{str(in_fifo).lstrip('/')}"
            assert os.stat(f"/proc/self/fd/{plan.pass_fds[0]}").st_ino == os.stat(out_fifo).st_ino
            assert os.get_blocking(plan.pass_fds[0])
            assert any(f"the FIFO {in_fifo}" in n and "/dev/null" in n for n in plan.notes)
        finally:
            plan.close()
    finally:
        reader.kill()
        reader.wait()
    plan = outside.plan(tmp_path / "image", meta_for(entries))  # its reader gone: the file beside the image
    try:
        log = tmp_path / "image.restored-5-fd1.log"
        assert {e["end"]: e["how"] for e in plan.done} == {"write": "file", "read": "null"}
        assert log.exists() and any(f"wrote to the FIFO {out_fifo}; its reader is gone" in n for n in plan.notes)
    finally:
        plan.close()


def test_the_manifest_schema_checks_the_field() -> None:
    check = criu.IMAGE_META.checker()
    good = {"pid": 7, outside.KEY: [{"pipe": "pipe:[12]", "kind": "pipe", "end": "write",
                                     "fds": [{"pid": 7, "fd": 1}]}]}
    assert check(good) is None
    assert check({"pid": 7, outside.KEY: [{"pipe": "pipe:[12]", "kind": "pipe", "end": "sideways",
                                           "fds": [{"pid": 7, "fd": 1}]}]}) is not None
    assert check({"pid": 7, outside.KEY: [{"pipe": "pipe:[12]", "kind": "pipe", "end": "write"}]}) is not None
    # what goes to CRIU's command line is a pipe's name, nothing else
    assert check({"pid": 7, outside.KEY: [{**good[outside.KEY][0], "pipe": "pipe:[12] --action-script x"}]}) \
        is not None


def test_gpu_restore_passes_output_to_through(tmp_path: Path, capsys, monkeypatch) -> None:
    """`gpu-restore --image DIR --output-to FILE` hands FILE to the restore (the restore itself is
    faked here: the real one, with CRIU, is test_criu_outside_cpu.py's)."""
    from test_agent_criu import tool

    from gpuos_tools.ckpt import agent_criu

    image = tmp_path / "image"
    image.mkdir()
    (image / criu.METADATA).write_text('{"pid": 5}')
    (image / "inventory.img").write_bytes(b"")
    seen = {}

    def restore(ckpt, image_dir, *args, **kw):
        seen.update(kw)
        rec = {"type": "ckpt_result", "action": "restore", "pid": 5, "ok": True, "state": "running", "touched": True,
               "code": 0, "message": "restored"}
        ckpt.out(rec)
        return rec

    monkeypatch.setattr(agent_criu, "restore", restore)
    monkeypatch.chdir(tmp_path)
    code, recs, err = tool("gpu-restore", ["--image", str(image), "--output-to", "out.log"], capsys)
    assert code == 0, err
    assert seen["output_to"] == str(tmp_path / "out.log") and recs[-1]["type"] == "ckpt_result"


def test_the_result_field_is_in_the_record_schema(tmp_path: Path) -> None:
    from gpuos_tools.ckpt.records import CKPT_RESULT

    check = CKPT_RESULT.checker()
    plan = outside.plan(tmp_path / "image", meta_for([{"pipe": "pipe:[1]", "kind": "pipe", "end": "read",
                                                      "fds": [{"pid": 5, "fd": 0}]}]), same_boot=False)
    plan.close()
    rec = {"type": "ckpt_result", "action": "restore", "ok": True, "outside": plan.done}
    assert plan.done[0]["how"] == "null" and check(rec) is None
    assert check({**rec, "outside": [{**plan.done[0], "how": "elsewhere"}]}) is not None


def test_discard_removes_only_the_empty_files_the_plan_made(tmp_path: Path, child) -> None:
    p, in_w, out_r = child
    os.close(out_r)
    entries = [e for e in outside.scan([p.pid]) if e["fds"][0]["fd"] == 1]
    made = outside.plan(tmp_path / "image", meta_for(entries))  # a restore that then failed, untouched
    made.close()
    log = tmp_path / f"image.restored-{p.pid}-fd1.log"
    assert made.created == [log] and log.exists()
    made.discard()
    assert not log.exists()
    log.write_bytes(b"earlier\n")  # a file that was there is the user's: kept, appended to
    kept = outside.plan(tmp_path / "image", meta_for(entries))
    kept.close()
    kept.discard()
    assert kept.created == [] and log.read_bytes() == b"earlier\n"
    written = outside.plan(tmp_path / "image2", meta_for(entries))
    os.write(written.pass_fds[0], b"x\n")
    written.close()
    written.discard()  # not empty: the program wrote into it
    assert (tmp_path / f"image2.restored-{p.pid}-fd1.log").read_bytes() == b"x\n"
