"""The gpuos NDJSON stream: one JSON object per line, a header first, pass-through of the rest.

gpuos-stream(7) (source: gpuos_tools/stream/manual.py) describes the format for users.

    with open_input(args.input) as reader, open_output(args.output) as writer:
        passthrough(reader, writer, {"launch"}, annotate)
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from typing import Any

from gpuos_tools.stream.blobs import store_blob
from gpuos_tools.stream.framing import SCHEMA, StreamError, make_header
from gpuos_tools.stream.reader import Reader, open_input
from gpuos_tools.stream.writer import Writer, open_output

__all__ = [
    "SCHEMA",
    "Reader",
    "StreamError",
    "Writer",
    "make_header",
    "open_input",
    "open_output",
    "passthrough",
    "store_blob",
]


def passthrough(
    reader: Iterable[dict[str, Any]],
    writer: Writer,
    owned_types: Container[str],
    handler: Callable[[dict[str, Any]], Iterable[dict[str, Any]]],
) -> None:
    """Write every record of ``reader``: those of an owned type as ``handler`` replaces them
    (zero, one or more records), all others unchanged."""
    write = writer.write
    for record in reader:
        if record["type"] in owned_types:
            for out in handler(record):
                write(out)
        else:
            write(record)
