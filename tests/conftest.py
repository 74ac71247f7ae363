"""Fixtures shared by the tests."""

from __future__ import annotations

import os
from typing import Any

import pytest

# Every stream the tests make, in this process and in the commands they start, is checked record
# by record against the record schemas (gpuos_tools.stream.records) as it is written.
os.environ["GPUOS_CHECK_RECORDS"] = "1"


@pytest.fixture
def records() -> list[dict[str, Any]]:
    """Records that exercise the encoder: unicode, nesting, big integers, floats, unknown fields."""
    return [
        {"type": "header", "schema": "gpuos/1", "tool": "test", "version": "0.1.0", "host": "h"},
        {
            "type": "launch",
            "seq": 1,
            "grid": [1, 2, 3],
            "name": "kernel<float>",
            "params": [{"offset": 0, "hex": "00ff"}],
        },
        {"type": "alloc", "id": 7, "addr": 0xFFFF_FF00_0000_0000, "size": 1 << 40, "note": "größe ✓ 日本"},
        {"type": "mystery", "x": 1.5, "y": -0.0, "z": None, "t": True, "nested": {"a": {"b": [[], {}]}}},
        {"type": "launch", "seq": 2, "quote": 'a "b" \\ c\n\td', "ctl": "\x00\x1f"},
    ]
