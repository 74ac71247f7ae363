"""The fuzzers of tests/fuzz.py, seeded and bounded for CI (2,000 cases per surface), and the
shrunk inputs they once crashed on (tests/data/fuzz/), kept as regression fixtures."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import fuzz

CASES = 2000
SEED = 20261125


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """A directory on tmpfs where there is one: thousands of small images are made and removed."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="gpuos-fuzz-") as tmp:
            yield Path(tmp)
    else:
        yield tmp_path


def _report(found: list[tuple[int, str, bytes]]) -> str:
    return "\n".join(f"case {i}:\n{why}\n{data[:500]!r}" for i, why, data in found[:3])


def test_stream_readers_and_what_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    found = fuzz.fuzz_streams(CASES, SEED)
    assert not found, f"{len(found)} of {CASES} stream cases crashed:\n{_report(found)}"


def test_images_verify_diff_compact(scratch: Path) -> None:
    found = fuzz.fuzz_images(CASES, SEED, scratch)
    assert not found, f"{len(found)} of {CASES} image cases failed:\n{_report(found)}"


def test_profiles(scratch: Path) -> None:
    found = fuzz.fuzz_profiles(CASES, SEED, scratch)
    assert not found, f"{len(found)} of {CASES} profile cases crashed:\n{_report(found)}"


STREAM_FIXTURES = sorted((fuzz.FIXTURES / "stream").glob("*.ndjson"))
PROFILE_FIXTURES = sorted((fuzz.FIXTURES / "profile").glob("*.toml"))


@pytest.mark.parametrize("path", STREAM_FIXTURES, ids=[p.stem for p in STREAM_FIXTURES])
def test_stream_regression(path: Path) -> None:
    assert fuzz.failure(lambda: fuzz.run_stream(path.read_bytes()), fuzz._stream_ok) is None


@pytest.mark.parametrize("path", PROFILE_FIXTURES, ids=[p.stem for p in PROFILE_FIXTURES])
def test_profile_regression(path: Path, tmp_path: Path) -> None:
    copy = tmp_path / path.name
    copy.write_bytes(path.read_bytes())
    assert fuzz.failure(lambda: fuzz.run_profile(path.name, copy), fuzz._profile_ok) is None


def test_the_fuzzers_reach_past_the_readers() -> None:
    """Most cases are refused at the door; enough must get through to exercise the tools."""
    import random

    through = 0
    for i in range(200):
        data = fuzz.stream_case(random.Random(SEED * 1_000_003 + i))
        try:
            fuzz.run_stream(data)
            through += 1
        except Exception:  # noqa: BLE001 (counting only)
            pass
    assert through >= 20


IMAGE_FIXTURES = sorted(p for p in (fuzz.FIXTURES / "image").iterdir() if p.is_dir())


@pytest.mark.parametrize("path", IMAGE_FIXTURES, ids=[p.name for p in IMAGE_FIXTURES])
def test_image_regression(path: Path) -> None:
    """A damaged chain once crashed a reader: it is now refused, naming the chunk."""
    from gpuos_tools.image import ImageError, open_image, verify

    head = path / "inc"
    problems = verify(head)
    assert problems and all(str(path) in p for p in problems), problems
    image = open_image(head)
    for b in image.buffers:
        try:
            image.read(b["id"])
        except ImageError as e:
            assert e.code == fuzz.ExitCode.IMAGE_CORRUPT
