"""The image manifest, written once as data: every field's type and range, the rules that tie
them together (chunk geometry, unique ids, buffers that do not overlap), the manifest's own
checksum and the optional keyed MAC.

``check`` is the one strict validator every reader of an image goes through (gpuos_tools.ckpt.
image.open_image: verify, diff, compact, periodic and rollback). A manifest that fails it is
damaged (IMAGE_CORRUPT) and nothing of the image is read. Its chunk files are then looked at
by name only in the writer's pattern (``B-N`` or ``B-N.zst``), so a manifest cannot make a
reader open anything outside the image's ``chunks/`` directory.

Identity and tamper evidence:

- ``manifest_sum`` is the sha256 of the manifest's canonical JSON (every field but
  ``manifest_sum`` and ``mac``, keys sorted, no spaces, ASCII). A reader recomputes it: a
  manifest edited after it was written no longer matches. Images written before the field
  existed have none and are read as before.
- ``parent.manifest_sum`` names the parent by that same sum, so a chain cannot be re-pointed at
  another image that happens to carry the parent's random id.
- ``mac`` (``hmac-sha256:<hex>``) is written and required when a key is configured
  (``GPUOS_IMAGE_KEY``: a file holding at least 16 bytes): an image that crosses a trust boundary
  then cannot be changed by anyone without the key. The MAC covers the manifest, and the
  manifest covers every chunk through its checksum, so a keyed image must use a cryptographic
  chunk checksum (sha256): crc32 protects against damage, not against someone choosing bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from typing import Any

from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.stream.schema import (
    I63,
    U64,
    Bool,
    Field,
    Int,
    List,
    Num,
    Obj,
    RecordType,
    Str,
    render,
)
from gpuos_tools.units import MAX_BYTES

SCHEMA = "gpuos-image/1"
#: Largest manifest read (a manifest lists every chunk: 64 MiB is millions of them).
MAX_MANIFEST = 64 << 20
#: Largest chunk: every reader holds one chunk in memory at a time.
MAX_CHUNK = 1 << 32
#: Longest parent chain followed.
MAX_CHAIN = 1024
#: A zstd block holds at most 128 KiB and costs at least 4 bytes (an RLE block), so no frame
#: decompresses to more than this many times its size.
ZSTD_MAX_RATIO = 1 << 15
KEY_ENV = "GPUOS_IMAGE_KEY"
#: a ``key`` argument's default: the key is the file $GPUOS_IMAGE_KEY names (``load_key``)
KEY_FROM_ENVIRONMENT: Any = object()
#: Chunk checksums that identify content (equal sums: equal bytes; no one can choose bytes to fit).
CRYPTOGRAPHIC = frozenset({"sha256"})

_ID = Str(pattern="[0-9a-f]{32}", form="32 hex digits")
_SUM = Str(pattern="[a-z0-9]{1,16}:[0-9a-f]{8,128}", form='"ALGORITHM:HEX"')
_SHA = Str(pattern="sha256:[0-9a-f]{64}", form='"sha256:<64 hex digits>"')
_ADDR = Int(0, U64, "address")
_BYTES = Int(0, MAX_BYTES, "bytes")

CHUNK = Obj((
    Field("n", Int(0, I63), "its index in the buffer, from 0", required=True),
    Field("file", Str(max_len=64), "its file in chunks/: `B-N`, or `B-N.zst` when compressed", required=True),
    Field("size", Int(0, MAX_CHUNK, "bytes"), "raw bytes", required=True),
    Field("stored_size", Int(0, MAX_CHUNK, "bytes"), "bytes of the file", required=True),
    Field("zstd", Bool(), "stored as one zstd frame"),
    Field("sum", _SUM, "checksum of the raw bytes, `crc32:` or `sha256:` as `checksum` says", required=True),
), text="{n, file, size, stored_size, zstd, sum}")

BUFFER = Obj((
    Field("id", Int(0, I63), "the allocation's id (unique)", required=True),
    Field("addr", _ADDR, required=True),
    Field("size", _BYTES, required=True),
    Field("kind", Str(max_len=64), null=True),
    Field("stored", Bool(), "false in an incremental image for a buffer unchanged since the parent "
          "(its bytes are read from the chain)"),
    Field("chunks", List(CHUNK), "stored buffers: every chunk but the last exactly `chunk_size` bytes"),
), text="{id, addr, size, kind, stored, chunks}")

MANIFEST = RecordType(
    "manifest.json", "the image's table of contents, written last: its presence makes the directory an image.",
    (
        Field("schema", Str((SCHEMA,)), required=True),
        Field("image_id", _ID, "new for every image", required=True),
        Field("created", Str(max_len=64), "UTC time the image was committed (ISO 8601)"),
        Field("chunk_size", Int(1, MAX_CHUNK, "bytes"), "bytes per chunk (the last chunk of a buffer may be "
              "shorter)", required=True),
        Field("checksum", Str(max_len=16), "of each chunk's raw bytes: crc32 (default) or sha256", required=True),
        Field("compression", Obj((Field("codec", Str(("zstd",))), Field("level", Int(-(1 << 17), 22))),
                                 text="{codec, level}"), null=True),
        Field("parent", Obj((
            Field("path", Str(max_len=4096), "relative to this image's directory", required=True),
            Field("image_id", _ID, required=True),
            Field("manifest_sum", _SHA, "the parent manifest's own `manifest_sum`"),
        ), text="{path, image_id, manifest_sum}"), "an incremental image's parent", null=True),
        Field("buffers", List(BUFFER), required=True),
        Field("allocations", List(Obj((Field("id", Int(0, I63), required=True),
                                       Field("addr", _ADDR, required=True),
                                       Field("size", _BYTES, required=True)),
                                      text="{id, addr, size, kind}")),
              "the allocation table at T0, when the writer knew it"),
        Field("bytes", Int(0, I63, "bytes"), "raw bytes stored in this image"),
        Field("stored_bytes", Int(0, I63, "bytes"), "bytes on disk"),
        Field("write_s", Num(0, unit="s")),
        Field("compacted_from", List(_ID), "the images `gpu-ckpt compact` folded into this one"),
        Field("manifest_sum", _SHA, "sha256 of this manifest's canonical JSON"),
        Field("mac", Str(pattern="hmac-sha256:[0-9a-f]{64}", form='"hmac-sha256:<hex>"'),
              f"keyed MAC of the same, with `{KEY_ENV}`"),
    ),
    note="Every other key is the writer's (gpu, driver, cuda, process {pid, argv, host}, t0, launch_seq, "
    "...), kept as given. `?` marks an optional field.",
)


class ManifestError(GpuosError):
    """A manifest that cannot be trusted; the message names the field."""

    def __init__(self, message: str):
        super().__init__(message, ExitCode.IMAGE_CORRUPT)


_check_fields = MANIFEST.checker()


def chunk_name(buffer_id: int, n: int, zstd: bool) -> str:
    """The file of chunk ``n`` of a buffer, as the writer names it."""
    return f"{buffer_id}-{n}" + (".zst" if zstd else "")


def check(m: dict[str, Any], checksums: frozenset[str] | set[str]) -> None:
    """Raise ManifestError naming the first field that is wrong; ``checksums``: the algorithms
    this reader can compute."""
    problem = _check_fields(m)
    if problem is not None:
        raise ManifestError(problem)
    if m["checksum"] not in checksums:
        raise ManifestError(f"field 'checksum': {m['checksum']!r} is not one of {', '.join(sorted(checksums))}")
    cs = m["chunk_size"]
    prefix = m["checksum"] + ":"
    parent = m.get("parent")
    seen: set[int] = set()
    spans = []
    raw = 0
    for i, b in enumerate(m["buffers"]):
        where = f"buffers[{i}]"
        if b["id"] in seen:
            raise ManifestError(f"field '{where}.id': buffer {b['id']} is listed twice")
        seen.add(b["id"])
        if b["addr"] + b["size"] > U64 + 1:
            raise ManifestError(f"field '{where}.size': runs past the end of the 64-bit address space")
        spans.append((b["addr"], b["size"], b["id"]))
        if not b.get("stored", True):
            if "chunks" in b:
                raise ManifestError(f"field '{where}.chunks': a buffer read from the parent has no chunks")
            if parent is None:
                raise ManifestError(f"field '{where}.stored': buffer {b['id']} is inherited, but the image has "
                                    "no parent")
            continue
        chunks = b.get("chunks")
        if chunks is None:
            raise ManifestError(f"field '{where}.chunks' is missing")
        want = -(-b["size"] // cs)
        if len(chunks) != want:
            raise ManifestError(f"field '{where}.chunks': {len(chunks)} chunks for {b['size']} bytes in "
                                f"chunks of {cs} (want {want})")
        for n, c in enumerate(chunks):
            at = f"{where}.chunks[{n}]"
            if c["n"] != n:
                raise ManifestError(f"field '{at}.n': is {c['n']}, not {n} (chunks in order, none missing)")
            size = min(cs, b["size"] - n * cs)
            if c["size"] != size:
                raise ManifestError(f"field '{at}.size': is {c['size']}, but chunk {n} of a {b['size']}-byte "
                                    f"buffer in chunks of {cs} holds {size}")
            zstd = c.get("zstd", False)
            if c["file"] != chunk_name(b["id"], n, zstd):
                raise ManifestError(f"field '{at}.file': is {c['file']!r}, not {chunk_name(b['id'], n, zstd)!r}")
            if zstd:
                if not 0 < c["stored_size"] <= size or size > c["stored_size"] * ZSTD_MAX_RATIO:
                    raise ManifestError(f"field '{at}.stored_size': {c['stored_size']} compressed bytes cannot "
                                        f"hold {size}")
            elif c["stored_size"] != size:
                raise ManifestError(f"field '{at}.stored_size': is {c['stored_size']}, but the chunk is not "
                                    f"compressed and holds {size}")
            if not c["sum"].startswith(prefix):
                raise ManifestError(f"field '{at}.sum': not a {m['checksum']} sum")
            raw += size
    if m.get("bytes") is not None and m["bytes"] != raw:
        raise ManifestError(f"field 'bytes': is {m['bytes']}, but the chunks hold {raw}")
    spans.sort()
    for (a0, n0, id0), (a1, _, id1) in zip(spans, spans[1:], strict=False):
        if a0 + n0 > a1:
            raise ManifestError(f"field 'buffers': buffers {id0} and {id1} overlap at {a1:#x}")
    if parent is not None:
        path = parent["path"]
        if not path or "\0" in path or os.path.isabs(path):
            raise ManifestError("field 'parent.path': must be a relative path")


# -- the manifest's own checksum and MAC ------------------------------------------------------

_UNSUMMED = ("manifest_sum", "mac")


def canonical(m: dict[str, Any]) -> bytes:
    """The bytes ``manifest_sum`` and ``mac`` are computed over."""
    body = {k: v for k, v in m.items() if k not in _UNSUMMED}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def manifest_sum(m: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(canonical(m)).hexdigest()


def mac(m: dict[str, Any], key: bytes) -> str:
    return "hmac-sha256:" + hmac.new(key, canonical(m), hashlib.sha256).hexdigest()


def seal(m: dict[str, Any], key: bytes | None) -> None:
    """Add ``manifest_sum`` (and ``mac`` with a key) to a manifest about to be written."""
    for k in _UNSUMMED:
        m.pop(k, None)
    if key is not None:
        if m.get("checksum") not in CRYPTOGRAPHIC:
            raise GpuosError(f"{KEY_ENV} is set: a keyed image needs sha256 chunk checksums, not "
                             f"{m.get('checksum')!r} (crc32 does not protect contents from someone who "
                             "chooses them)", ExitCode.BAD_INPUT)
        m["mac"] = mac(m, key)
    m["manifest_sum"] = manifest_sum(m)


def check_seal(m: dict[str, Any], key: bytes | None) -> str:
    """Check a read manifest's own sum and, with a key, its MAC; return its sum."""
    computed = manifest_sum(m)
    recorded = m.get("manifest_sum")
    if recorded is not None and not hmac.compare_digest(recorded, computed):
        raise ManifestError("manifest_sum does not match the manifest (it was changed after it was written)")
    if key is not None:
        if "mac" not in m:
            raise ManifestError(f"no MAC, and {KEY_ENV} is set: an unsigned image is not trusted")
        if not hmac.compare_digest(m["mac"], mac(m, key)):
            raise ManifestError("MAC mismatch: the image was changed, or signed with another key")
        if m["checksum"] not in CRYPTOGRAPHIC:
            raise ManifestError(f"keyed, but its chunks use {m['checksum']} sums, which do not protect contents")
    return computed


def load_key(path: str | None = None) -> bytes | None:
    """The MAC key: from ``path``, else from the file ``$GPUOS_IMAGE_KEY`` names; None when neither
    is given. The file must be a regular file of at least 16 bytes that only its owner can read."""
    path = path if path is not None else os.environ.get(KEY_ENV) or None
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        code = ExitCode.PERMISSION if isinstance(e, PermissionError) else ExitCode.NO_INPUT
        raise GpuosError(f"{path}: cannot read the image key ({KEY_ENV}): {e.strerror}", code) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 1 << 16:
            raise GpuosError(f"{path}: the image key must be a regular file of at most 64 KiB", ExitCode.BAD_INPUT)
        if st.st_mode & 0o077:
            raise GpuosError(f"{path}: the image key is readable or writable by others (chmod 600 it)",
                             ExitCode.PERMISSION)
        key = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    if len(key) < 16:
        raise GpuosError(f"{path}: the image key is shorter than 16 bytes", ExitCode.BAD_INPUT)
    return key


def render_format() -> str:
    """The manifest's fields for the man pages (IMAGE FORMAT)."""
    return render([MANIFEST])
