"""What every stream shares: the schema tag, the header record and the error type."""

from __future__ import annotations

import socket
from typing import Any

import gpuos_tools
from gpuos_tools.errors import ExitCode, GpuosError

SCHEMA = "gpuos/1"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
STDIO = "-"


def make_header(tool: str, **fields: Any) -> dict[str, Any]:
    """The first record of a stream; ``fields`` add to (or override) the standard ones."""
    return {
        "type": "header",
        "schema": SCHEMA,
        "tool": tool,
        "version": gpuos_tools.__version__,
        "host": socket.gethostname(),
        **fields,
    }


class StreamError(GpuosError):
    """A stream could not be read or written; ``line`` is the 1-based line number when known."""

    def __init__(self, message: str, code: ExitCode, *, path: str, line: int | None = None):
        super().__init__(message, code)
        self.path = path
        self.line = line
