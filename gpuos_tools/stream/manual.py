"""The source text of gpuos-stream(7), kept beside the code it describes.

The markup is gpuos_tools.commands.manpage's (``# TITLE``, paragraphs, ``- `` items, four-space
verbatim blocks, `backquotes`); ``$NAME`` stands for the number of ``ExitCode.NAME``.
"""

from __future__ import annotations

from gpuos_tools.errors import ExitCode

SUMMARY = "the NDJSON stream that gpuos-tools commands read and write"

# The codes the stream layer itself can cause; commands add their own.
EXIT_CODES = (
    ExitCode.OK,
    ExitCode.BAD_INPUT,
    ExitCode.TRUNCATED,
    ExitCode.NO_INPUT,
    ExitCode.PERMISSION,
    ExitCode.IO_ERROR,
    ExitCode.SOFTWARE,
)

MANUAL = """\
# DESCRIPTION
Every gpuos-tools command that produces or consumes data speaks one format: newline-delimited
JSON. Each line is one JSON object encoded as UTF-8 and ended by a newline (`\\n`). Writers
use the compact form (no spaces, non-ASCII characters unescaped), so a record never spans
lines and `grep`, `head`, `tail` and `jq -c` work on the stream as they do on text.

# RECORDS
Every record has a `type` field naming what it is. The first record of a stream is its
header, which announces the schema once for the whole stream:

    {"type":"header","schema":"gpuos/1","tool":"gpu-trace","version":"0.1.0","host":"node7",...}

- `schema` is `gpuos/1` for this version of the format. A reader refuses a stream whose header
  names another schema, or none (status $BAD_INPUT), whatever else it was asked to do: it cannot
  know what the records mean.
- `tool` and `version` name the program that wrote the stream, `host` the machine.
- Further fields (GPUs by UUID, driver version, process id) are added where the tool knows them.

A stream without a header is accepted by readers (as `gpuos/1`); tools that need it say so. A
header anywhere but on the first line is a bad line: two streams concatenated are not one
stream (their allocation ids and sequence numbers would collide).

Each record type a tool reads has its fields written down once, as data, with their types and
ranges: the RECORDS section of each tool's page lists them, with `?` marking the fields that may
be absent. Fields a type does not list, and types a tool does not know, pass through unchecked.
Integers are bounded (an address or handle to 64 bits, a size to 256 TiB, more than any machine
holds), numbers must be finite, and lists have a largest length, so no single record can make a
tool work or allocate without bound.

# PASS-THROUGH
A tool acts on the record types it owns and writes every other record unchanged, with the
fields it does not know kept, so that filters compose: a later tool in a pipeline sees what
an earlier one wrote even when the tools in between have never heard of it. A tool that
adds information adds fields or records; it does not drop what it does not understand.

# FILES
Wherever a command takes a file name for a stream:

- `-` means standard input or standard output.
- A name ending in `.zst` is read and written through zstandard. Compressed input is also
  recognised by its magic bytes (28 b5 2f fd), so a compressed standard input works too.
  Concatenated frames (`cat a.zst b.zst`) are read as one stream.
- An output file is written to a temporary file in the same directory and renamed over the
  destination only when the command succeeds, as sponge(1) does: a failed or interrupted
  command leaves the previous file, if any, untouched, and never a half-written one. An
  existing FIFO or device (for example `/dev/stdout`) is written in place, and so is a file
  written with `--unbuffered`, so that it can be followed while it grows.
- Standard output gets every record a command made before it stopped, whether it is a pipe, a
  terminal or a file (`> out.ndjson`): a filter that stops at a bad or truncated input line
  leaves everything before it, as in a pipe. Compressed output is then left without the end of
  its zstd frame, so that whoever reads it sees it was cut short.

# FLUSHING
When the output is a pipe, a socket or a terminal, every record is flushed as soon as it is
written (for `.zst` output, each record ends a zstd block), so the next command in a pipeline
sees records as they happen. Output to a regular file is buffered. Commands that offer
`--unbuffered` flush per record regardless.

# ERRORS
A line that is not valid UTF-8, not valid JSON, not a JSON object, an object without a
string `type`, longer than 256 MiB, or a record whose fields break its type's schema is a bad
line. Readers report it with the file name, line number and field,

    trace.ndjson:1234: not valid JSON: Expecting ',' delimiter (column 57)
    trace.ndjson:1235: alloc record, field 'size': must be bytes 0..2^48, not -1

and exit with status $BAD_INPUT. Blank lines are ignored. Commands that offer it may instead emit
each bad line in-band, so a long pipeline keeps going, as a record

    {"type":"error","line":1234,"message":"not valid JSON: ...","source":"trace.ndjson"}

A file whose last line is cut inside its JSON, or a zstd stream that ends inside a frame,
was cut short (a writer was killed, a disk filled up). Readers first pass on every complete
record, then report the truncation and exit with status $TRUNCATED, in-band mode or not. A
last line that is whole JSON and lacks only its newline (a file saved by an editor) is read
as a line like any other: a record if it is one, a bad line ("not a gpuos record") if not.

Fatal errors go to standard error as `gpu-xxx: error: message`; data goes to standard output
only.

# BLOBS
Large binary payloads (module images, buffer contents) never go inline. They are stored as
side files named by their content hash, `<sha256 hex>` plus a suffix such as `.cubin`, and
records refer to them by `"sha256:<hex>"` and by the file name relative to a directory the
header names. A file is written once, atomically, and never rewritten: the same content
always has the same name.

# ENVIRONMENT
- `GPUOS_CHECK_RECORDS`: when `1`, every record a command writes is checked against its type's
  schema as it is written, and one that readers would refuse is an internal error (status
  $SOFTWARE); so is a record of a type that has no schema, unless the command read it from its
  input (pass-through). The test suite sets it, so that every stream the tests make is checked.

# EXAMPLES
Count the kernel launches in a compressed trace:

    zstd -dc trace.zst | jq -c 'select(.type == "launch")' | wc -l

Follow a trace that is being written:

    tail -f trace.ndjson | jq -c 'select(.type == "alloc") | .size'

# SEE ALSO
gpu-trace(1), jq(1), zstd(1), sponge(1)
"""
