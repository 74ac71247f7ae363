"""The NDJSON stream: framing, compression, errors, atomic output, live flushing, blobs."""

from __future__ import annotations

import hashlib
import json
import json.encoder
import os
import select
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import pytest
import zstandard
from helpers import REGISTER_TEST_TYPES, child_env, python, register_test_types

import gpuos_tools
from gpuos_tools.errors import ExitCode
from gpuos_tools.stream import (
    SCHEMA,
    StreamError,
    make_header,
    open_input,
    open_output,
    passthrough,
    store_blob,
)


register_test_types()  # the made-up types these tests write

def compact(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False)


def write_all(path: Path | str, records: list[dict[str, Any]], **kwargs: Any) -> None:
    with open_output(path, **kwargs) as writer:
        writer.write_many(records)


def read_all(path: Path | str, **kwargs: Any) -> list[dict[str, Any]]:
    with open_input(path, **kwargs) as reader:
        return list(reader)


def readline_within(stream: IO[bytes], seconds: float) -> bytes:
    """One line from a child's pipe, failing the test if none arrives in time."""
    ready, _, _ = select.select([stream], [], [], seconds)
    assert ready, f"no line within {seconds}s: the writer did not flush"
    return stream.readline()


# -- round trips ------------------------------------------------------------------------------


def test_plain_round_trip_writes_compact_lines(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    path = tmp_path / "t.ndjson"
    write_all(path, records)
    assert path.read_text(encoding="utf-8") == "".join(compact(r) + "\n" for r in records)
    assert read_all(path) == records


def test_write_and_write_many_give_the_same_bytes(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    with open_output(tmp_path / "one.ndjson") as writer:
        for record in records:
            writer.write(record)
    write_all(tmp_path / "many.ndjson", records)
    assert (tmp_path / "one.ndjson").read_bytes() == (tmp_path / "many.ndjson").read_bytes()


def test_pure_python_encoder_gives_the_same_bytes(
    tmp_path: Path, records: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    write_all(tmp_path / "c.ndjson", records)
    monkeypatch.setattr(json.encoder, "c_make_encoder", None)
    write_all(tmp_path / "py.ndjson", records)
    assert (tmp_path / "c.ndjson").read_bytes() == (tmp_path / "py.ndjson").read_bytes()


def test_zst_round_trip(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    path = tmp_path / "t.ndjson.zst"
    many = records + records[1:] * 500  # one header, first
    write_all(path, many)
    raw = path.read_bytes()
    assert raw[:4] == b"\x28\xb5\x2f\xfd"
    text = zstandard.ZstdDecompressor().decompressobj().decompress(raw).decode()
    assert text == "".join(compact(r) + "\n" for r in many)
    assert read_all(path) == many


def test_zst_is_recognised_by_magic_without_the_name(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    path = tmp_path / "t.ndjson"
    path.write_bytes(zstandard.ZstdCompressor().compress("".join(compact(r) + "\n" for r in records).encode()))
    assert read_all(path) == records


def test_concatenated_zst_frames_read_as_one_stream(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    write_all(tmp_path / "a.zst", records[:2])
    write_all(tmp_path / "b.zst", records[2:])
    both = tmp_path / "both.zst"
    both.write_bytes((tmp_path / "a.zst").read_bytes() + (tmp_path / "b.zst").read_bytes())
    assert read_all(both) == records


@pytest.mark.parametrize("compress", [False, True])
def test_stdin_round_trip(records: list[dict[str, Any]], compress: bool) -> None:
    data = "".join(compact(r) + "\n" for r in records).encode()
    if compress:
        data = zstandard.ZstdCompressor().compress(data)
    code = "import json; from gpuos_tools.stream import open_input; print(json.dumps(list(open_input('-'))))"
    done = python(code, input=data)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == records


def test_stdout_round_trip_through_a_pipe(records: list[dict[str, Any]]) -> None:
    code = (
        REGISTER_TEST_TYPES + "import json, sys; from gpuos_tools.stream import open_output\n"
        "with open_output('-') as w: w.write_many(json.loads(sys.stdin.read()))"
    )
    done = python(code, input=json.dumps(records).encode())
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == "".join(compact(r) + "\n" for r in records)


def test_big_records_and_crlf_lines(tmp_path: Path) -> None:
    big = {"type": "module", "blob": "x" * 3_000_000}
    path = tmp_path / "t.ndjson"
    path.write_bytes(b'{"type":"a"}\r\n' + compact(big).encode() + b"\n" + b'{"type":"b"}\r\n')
    assert read_all(path) == [{"type": "a"}, big, {"type": "b"}]


def test_lone_surrogates_survive_as_json_escapes(tmp_path: Path) -> None:
    path = tmp_path / "t.ndjson"
    path.write_bytes(b'{"type":"odd","s":"a\\ud800b"}\n')
    (record,) = read_all(path)
    assert record["s"] == "a\ud800b"
    write_all(tmp_path / "out.ndjson", [record])
    assert (tmp_path / "out.ndjson").read_bytes() == b'{"type":"odd","s":"a\\ud800b"}\n'
    assert read_all(tmp_path / "out.ndjson") == [record]


def test_write_many_encodes_a_reused_dict_as_it_goes(tmp_path: Path) -> None:
    def reusing() -> Any:
        record: dict[str, Any] = {"type": "tick"}
        for i in range(3000):
            record["seq"] = i
            yield record

    write_all(tmp_path / "t.ndjson", reusing())
    assert [r["seq"] for r in read_all(tmp_path / "t.ndjson")] == list(range(3000))


# -- header and pass-through ------------------------------------------------------------------


def test_make_header() -> None:
    header = make_header("gpu-test", pid=42, host="override")
    assert header == {
        "type": "header",
        "schema": SCHEMA,
        "tool": "gpu-test",
        "version": gpuos_tools.__version__,
        "host": "override",
        "pid": 42,
    }
    assert make_header("gpu-test")["host"] == socket.gethostname()
    assert SCHEMA == "gpuos/1"


def test_header_is_peeked_and_still_iterated(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    path = tmp_path / "t.ndjson"
    write_all(path, records)
    with open_input(path) as reader:
        assert reader.header == records[0]
        assert list(reader) == records
        assert reader.header == records[0]


def test_header_after_iteration_began(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    path = tmp_path / "t.ndjson"
    write_all(path, records)
    with open_input(path) as reader:
        it = iter(reader)
        assert next(it) == records[0]
        assert reader.header == records[0]
        assert list(it) == records[1:]


def test_stream_without_header(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    path = tmp_path / "t.ndjson"
    write_all(path, records[1:])
    with open_input(path) as reader:
        assert reader.header is None
        assert list(reader) == records[1:]


def test_empty_stream(tmp_path: Path) -> None:
    path = tmp_path / "t.ndjson"
    path.write_bytes(b"")
    with open_input(path) as reader:
        assert reader.header is None
        assert list(reader) == []


def test_passthrough_keeps_unowned_records_byte_for_byte(tmp_path: Path) -> None:
    lines = [
        '{"type":"header","schema":"gpuos/1","tool":"x","future_field":{"k":[1,2]}}',
        '{"type":"launch","seq":1}',
        '{"type":"from_the_future","blob":"ß","n":18446744073709551615,"f":0.1}',
        '{"type":"launch","seq":2}',
        '{"type":"drop_me"}',
        '{"type":"error","line":9,"message":"m","source":"s"}',
    ]
    source = tmp_path / "in.ndjson"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")

    def handle(record: dict[str, Any]) -> list[dict[str, Any]]:
        if record["type"] == "drop_me":
            return []
        return [{**record, "seen": True}, {"type": "note", "of": record["seq"]}]

    with open_input(source) as reader, open_output(tmp_path / "out.ndjson") as writer:
        passthrough(reader, writer, {"launch", "drop_me"}, handle)
    out = (tmp_path / "out.ndjson").read_text(encoding="utf-8").splitlines()
    assert out == [
        lines[0],
        '{"type":"launch","seq":1,"seen":true}',
        '{"type":"note","of":1}',
        lines[2],
        '{"type":"launch","seq":2,"seen":true}',
        '{"type":"note","of":2}',
        lines[5],
    ]


# -- bad input --------------------------------------------------------------------------------


def test_bad_json_reports_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "t.ndjson"
    path.write_text('{"type":"a"}\n\n{"type":"b",}\n{"type":"c"}\n')
    with open_input(path) as reader:
        it = iter(reader)
        assert next(it) == {"type": "a"}
        with pytest.raises(StreamError) as caught:
            next(it)
    err = caught.value
    assert err.code == ExitCode.BAD_INPUT
    assert err.line == 3 and err.path == str(path)
    assert str(err).startswith(f"{path}:3: not valid JSON: ")


def test_bad_lines_can_be_emitted_in_band(tmp_path: Path) -> None:
    path = tmp_path / "t.ndjson"
    path.write_bytes(b'{"type":"a"}\nnope\n[1,2]\n{"no_type":1}\n\xff\xfe{}\n{"type":"b"}\n')
    got = read_all(path, on_error="emit")
    assert got[0] == {"type": "a"} and got[-1] == {"type": "b"}
    errors = got[1:-1]
    assert [e["type"] for e in errors] == ["error"] * 4
    assert [e["line"] for e in errors] == [2, 3, 4, 5]
    assert all(e["source"] == str(path) for e in errors)
    assert errors[0]["message"].startswith("not valid JSON")
    assert errors[1]["message"] == "not a JSON object (a list): not a gpuos record"
    assert errors[2]["message"] == 'not a gpuos record (a JSON object without "type")'
    assert errors[3]["message"].startswith("not valid UTF-8")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"type":"a"}\n"just a string"\n', "not a JSON object (a string): not a gpuos record"),
        (b'{"type":"a"}\n{"kind":"x"}\n', 'not a gpuos record (a JSON object without "type")'),
        (b'{"type":"a"}\n{"type":"b"}\xc3\n', "not valid UTF-8"),
        (b'{"type":"a"}\n' + b"[" * 100_000 + b"\n", "not valid JSON: nested too deeply"),
    ],
)
def test_records_must_be_objects_with_a_type(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "t.ndjson"
    path.write_bytes(content)
    with pytest.raises(StreamError) as caught:
        read_all(path)
    assert caught.value.code == ExitCode.BAD_INPUT
    assert str(caught.value).startswith(f"{path}:2: {message}")


def test_truncated_plain_file(tmp_path: Path) -> None:
    path = tmp_path / "t.ndjson"
    path.write_text('{"type":"a"}\n{"type":"b"}\n{"type":"c","x":')
    records = iter(open_input(path, on_error="emit"))
    assert [next(records), next(records)] == [{"type": "a"}, {"type": "b"}]
    with pytest.raises(StreamError) as caught:
        next(records)
    assert caught.value.code == ExitCode.TRUNCATED
    assert str(caught.value) == f"{path}: truncated after line 2 (last line has no newline)"


def test_truncated_zst_file(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    whole = tmp_path / "whole.zst"
    write_all(whole, records + records[1:] * 2000)
    data = whole.read_bytes()
    for cut in (len(data) // 2, len(data) - 1):
        path = tmp_path / "cut.zst"
        path.write_bytes(data[:cut])
        with pytest.raises(StreamError) as caught:
            read_all(path)
        assert caught.value.code == ExitCode.TRUNCATED
        assert "truncated after line" in str(caught.value)
        assert "zstd" in str(caught.value)


def test_zst_name_without_zstd_data(tmp_path: Path) -> None:
    path = tmp_path / "t.zst"
    path.write_text('{"type":"a"}\n')
    with pytest.raises(StreamError) as caught:
        read_all(path)
    assert caught.value.code == ExitCode.BAD_INPUT


def test_corrupt_zst_data(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    path = tmp_path / "t.zst"
    write_all(path, records + records[1:] * 100)
    data = bytearray(path.read_bytes())
    data[20:60] = b"\xff" * 40
    path.write_bytes(bytes(data))
    with pytest.raises(StreamError) as caught:
        read_all(path)
    assert caught.value.code == ExitCode.BAD_INPUT


def test_missing_input(tmp_path: Path) -> None:
    with pytest.raises(StreamError) as caught:
        open_input(tmp_path / "nope.ndjson")
    assert caught.value.code == ExitCode.NO_INPUT
    assert str(caught.value) == f"{tmp_path / 'nope.ndjson'}: no such file"


def test_directory_as_input(tmp_path: Path) -> None:
    with pytest.raises(StreamError) as caught:
        open_input(tmp_path)
    assert caught.value.code == ExitCode.NO_INPUT


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_input(tmp_path: Path) -> None:
    path = tmp_path / "t.ndjson"
    path.write_text('{"type":"a"}\n')
    path.chmod(0)
    with pytest.raises(StreamError) as caught:
        open_input(path)
    assert caught.value.code == ExitCode.PERMISSION


def test_on_error_must_be_known(tmp_path: Path) -> None:
    path = tmp_path / "t.ndjson"
    path.write_text("")
    with pytest.raises(ValueError):
        open_input(path, on_error="ignore")  # type: ignore[arg-type]


# -- output files -----------------------------------------------------------------------------


def test_output_appears_only_when_closed(tmp_path: Path) -> None:
    path = tmp_path / "t.ndjson"
    with open_output(path) as writer:
        writer.write_many({"type": "tick", "seq": i} for i in range(5000))
        assert not path.exists()
    assert len(read_all(path)) == 5000
    assert sorted(os.listdir(tmp_path)) == ["t.ndjson"]


@pytest.mark.parametrize("name", ["t.ndjson", "t.ndjson.zst"])
def test_abort_leaves_no_file_and_keeps_the_old_one(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    with pytest.raises(RuntimeError), open_output(path) as writer:
        writer.write_many({"type": "tick", "seq": i} for i in range(5000))
        raise RuntimeError("stop")
    assert os.listdir(tmp_path) == []

    write_all(path, [{"type": "old"}])
    with pytest.raises(RuntimeError), open_output(path) as writer:
        writer.write({"type": "new"})
        raise RuntimeError("stop")
    assert read_all(path) == [{"type": "old"}]
    assert os.listdir(tmp_path) == [name]


def test_rewrite_keeps_the_file_mode(tmp_path: Path) -> None:
    path = tmp_path / "t.ndjson"
    write_all(path, [{"type": "a"}])
    path.chmod(0o640)
    write_all(path, [{"type": "b"}])
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert read_all(path) == [{"type": "b"}]


def test_new_file_mode_follows_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_all(tmp_path / "t.ndjson", [{"type": "a"}])
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "t.ndjson").stat().st_mode) == 0o640


def test_write_through_a_symlink_replaces_its_target(tmp_path: Path) -> None:
    target = tmp_path / "real.ndjson"
    write_all(target, [{"type": "a"}])
    link = tmp_path / "link.ndjson"
    link.symlink_to(target)
    write_all(link, [{"type": "b"}])
    assert link.is_symlink()
    assert read_all(target) == [{"type": "b"}]


def test_unbuffered_file_is_written_in_place_as_it_goes(tmp_path: Path) -> None:
    path = tmp_path / "t.ndjson"
    with open_output(path, unbuffered=True) as writer:
        assert writer.per_record
        writer.write({"type": "a"})
        assert path.read_bytes() == b'{"type":"a"}\n'
        writer.write({"type": "b"})
        assert path.read_bytes() == b'{"type":"a"}\n{"type":"b"}\n'


def test_regular_file_is_buffered(tmp_path: Path) -> None:
    with open_output(tmp_path / "t.ndjson") as writer:
        assert not writer.per_record


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(StreamError) as caught:
        open_output(tmp_path / "no" / "t.ndjson")
    assert caught.value.code == ExitCode.IO_ERROR


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_disk_is_an_io_error() -> None:
    writer = open_output("/dev/full")
    writer.write({"type": "a"})
    with pytest.raises(StreamError) as caught:
        writer.close()
    assert caught.value.code == ExitCode.IO_ERROR


def test_write_after_close(tmp_path: Path) -> None:
    writer = open_output(tmp_path / "t.ndjson")
    writer.close()
    with pytest.raises(ValueError):
        writer.write({"type": "late"})


# -- live flushing ----------------------------------------------------------------------------

CONSUMER = """
import sys
from gpuos_tools.stream import open_input
for record in open_input(sys.argv[1]):
    print(record["seq"], flush=True)
"""


@pytest.mark.parametrize("name", ["live.ndjson", "live.ndjson.zst"])
def test_pipe_consumer_sees_each_record_while_the_writer_is_open(tmp_path: Path, name: str) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    consumer = subprocess.Popen([sys.executable, "-c", CONSUMER, str(fifo)], stdout=subprocess.PIPE, env=child_env())
    try:
        with open_output(fifo) as writer:
            assert writer.per_record
            for i in range(5):
                writer.write({"type": "tick", "seq": i})
                assert readline_within(consumer.stdout, 20) == f"{i}\n".encode()
        assert consumer.wait(timeout=20) == 0
    finally:
        consumer.kill()
        consumer.wait()


WRITER = REGISTER_TEST_TYPES + """
import sys
from gpuos_tools.stream import open_output
with open_output("-") as writer:
    assert writer.per_record
    for i in range(3):
        writer.write({"type": "tick", "seq": i})
        sys.stdin.readline()
"""


def test_stdout_pipe_is_flushed_per_record() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env()
    )
    try:
        for i in range(3):
            assert json.loads(readline_within(child.stdout, 20)) == {"type": "tick", "seq": i}
            child.stdin.write(b"next\n")
            child.stdin.flush()
        assert child.wait(timeout=20) == 0
    finally:
        child.kill()
        child.wait()


def test_unbuffered_false_batches_even_on_a_pipe() -> None:
    code = "from gpuos_tools.stream import open_output; print(open_output('-', unbuffered=False).per_record)"
    done = python(code)
    assert done.stdout == b"False\n"


# -- blobs ------------------------------------------------------------------------------------


def test_store_blob(tmp_path: Path) -> None:
    data = b"\x7fELF" + bytes(range(256)) * 10
    ref, name = store_blob(tmp_path / "images", data, ".cubin")
    digest = hashlib.sha256(data).hexdigest()
    assert ref == f"sha256:{digest}"
    assert name == f"{digest}.cubin"
    path = tmp_path / "images" / name
    assert path.read_bytes() == data
    before = path.stat()
    assert store_blob(tmp_path / "images", data, ".cubin") == (ref, name)
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert os.listdir(tmp_path / "images") == [name]
    assert store_blob(tmp_path / "images", b"other")[1] != name


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_value_json_cannot_carry_is_refused_naming_its_field(tmp_path: Path, bad: float) -> None:
    """NaN and infinities are not JSON: written, the line would be refused by every reader. The
    writer refuses the record as the tool's bug (SOFTWARE), saying which record and field."""
    import gpuos_tools.sched.records  # noqa: F401 -- the schema of sched_summary

    path = tmp_path / "out.ndjson"
    header = make_header("test")
    with pytest.raises(StreamError) as e:
        with open_output(path) as writer:
            writer.write(header)
            writer.write({"type": "x", "n": 1})
            writer.write({"type": "sched_summary", "jobs": [{"ok": 1.0}, {"ok": bad}]})
    assert e.value.code == ExitCode.SOFTWARE
    assert "sched_summary record: field jobs[1].ok is" in str(e.value)
    assert ("NaN" if bad != bad else "Infinity") in str(e.value)
    with pytest.raises(StreamError) as e:
        write_all(tmp_path / "many.ndjson", [header, {"type": "x", "v": [1.5, bad]}])
    assert e.value.code == ExitCode.SOFTWARE and "NaN or infinite" in str(e.value)


def test_a_producers_own_value_error_is_not_taken_for_a_bad_number(tmp_path: Path) -> None:
    def records():
        yield make_header("test")
        raise ValueError("the producer's own")

    with pytest.raises(ValueError, match="the producer's own"):
        write_all(tmp_path / "x.ndjson", records())
