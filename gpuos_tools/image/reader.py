"""Reading checkpoint images (the layout: gpuos_tools/image/layout.py): open an image and its
parent chain, read buffers back, and verify, diff and compact images, trusting nothing a
manifest says before it is checked."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.image import manifest as mf
from gpuos_tools.image.layout import CHECKSUMS, CHUNKS, MANIFEST, SCHEMA, Buffer, ImageError, _io_error, checksum

# -- reading ----------------------------------------------------------------------------------
#
# Nothing a manifest says is trusted before gpuos_tools.image.manifest.check has passed it: field
# types, unique ids, bounded sizes, buffers that do not overlap, and the chunk geometry (every
# chunk but the last exactly chunk_size, in order, named as the writer names them). Files are
# then opened only inside the image's chunks/ directory, never through a symlink, only when they
# are regular files of the size the manifest says, and without blocking (a FIFO is refused, not
# waited on).

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """object_pairs_hook: a key given twice makes a manifest ambiguous; refuse it."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _open_regular(path: str, limit: int, what: str, *, dir_fd: int | None = None) -> tuple[int, int]:
    """(fd, size) of a regular file, opened without following a symlink and without blocking;
    IMAGE_CORRUPT when it is something else or larger than ``limit``."""
    try:
        fd = os.open(path, _OPEN, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ImageError(f"{what}: is a symbolic link (refused)", ExitCode.IMAGE_CORRUPT, path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageError(f"{what}: not a regular file (refused)", ExitCode.IMAGE_CORRUPT, path)
        if st.st_size > limit:
            raise ImageError(f"{what}: {st.st_size} bytes, more than the {limit} expected", ExitCode.IMAGE_CORRUPT,
                             path)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _read_exactly(fd: int, out: memoryview) -> int:
    got = 0
    while got < len(out):
        n = os.readv(fd, [out[got:]])
        if not n:
            break
        got += n
    return got


def _read_manifest(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise ImageError(f"{path}: no such image", ExitCode.NO_INPUT, path)
    mpath = os.path.join(path, MANIFEST)
    try:
        fd, size = _open_regular(mpath, mf.MAX_MANIFEST, mpath)
    except FileNotFoundError:
        raise ImageError(f"{path}: not an image (no {MANIFEST}; a write that never finished?)",
                         ExitCode.IMAGE_CORRUPT, mpath) from None
    except OSError as e:
        raise _io_error("cannot read", mpath, e) from e
    try:
        raw = bytearray(size)
        got = _read_exactly(fd, memoryview(raw))
    except OSError as e:
        raise _io_error("cannot read", mpath, e) from e
    finally:
        os.close(fd)
    try:
        m = json.loads(bytes(raw[:got]), object_pairs_hook=_pairs, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ImageError(f"{mpath}: truncated or malformed manifest ({e})", ExitCode.IMAGE_CORRUPT, mpath) from None
    if not isinstance(m, dict) or m.get("schema") != SCHEMA:
        raise ImageError(f"{mpath}: not a {SCHEMA} manifest", ExitCode.IMAGE_CORRUPT, mpath)
    return m


class Image:
    """A committed image, opened read-only and checked (its manifest only: ``open_image`` also
    follows and checks the parent chain). ``buffers`` is the manifest's buffer list. ``key``: the
    MAC key (default: from GPUOS_IMAGE_KEY)."""

    def __init__(self, path: str | os.PathLike[str], key: bytes | None = mf.KEY_FROM_ENVIRONMENT):
        self.path = os.path.abspath(os.fspath(path))
        self.key = mf.load_key() if key is mf.KEY_FROM_ENVIRONMENT else key
        m = _read_manifest(self.path)
        mpath = os.path.join(self.path, MANIFEST)
        try:
            mf.check(m, frozenset(CHECKSUMS))
            #: sha256 of the manifest's canonical form: what a child image names its parent by
            self.sum = mf.check_seal(m, self.key)
        except GpuosError as e:
            raise ImageError(f"{mpath}: {e}", ExitCode.IMAGE_CORRUPT, mpath) from None
        self.manifest = m
        self.buffers: list[dict[str, Any]] = m["buffers"]
        self._by_id = {b["id"]: b for b in self.buffers}
        self._chain: list[Image] | None = None
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"Image({self.path!r})"

    @property
    def image_id(self) -> str:
        return self.manifest["image_id"]

    @property
    def incremental(self) -> bool:
        return self.manifest.get("parent") is not None

    def buffer(self, buffer_id: int) -> dict[str, Any] | None:
        return self._by_id.get(buffer_id)

    def _open_parent(self) -> Image | None:
        """The parent this manifest names, checked to be the one recorded (by its manifest's sum
        where the image records it, by its id otherwise)."""
        ref = self.manifest.get("parent")
        if ref is None:
            return None
        where = os.path.normpath(os.path.join(os.path.dirname(self.path), ref["path"]))
        try:
            st = os.lstat(where)
        except OSError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise ImageError(f"{self.path}: broken parent chain: {where} is a symbolic link (refused)",
                             ExitCode.IMAGE_CORRUPT, where)
        try:
            parent = Image(where, self.key)
        except ImageError as e:
            raise ImageError(f"{self.path}: broken parent chain: {e}", ExitCode.IMAGE_CORRUPT, where) from None
        want = ref.get("manifest_sum")
        if want is not None and parent.sum != want:
            raise ImageError(f"{self.path}: broken parent chain: {where} is not the image it was taken on (its "
                             f"manifest's sum is {parent.sum}, not {want})", ExitCode.IMAGE_CORRUPT, where)
        if parent.image_id != ref["image_id"]:
            raise ImageError(f"{self.path}: broken parent chain: {where} is image {parent.image_id}, "
                             f"not the parent {ref['image_id']}", ExitCode.IMAGE_CORRUPT, where)
        return parent

    def walk(self) -> tuple[list[Image], ImageError | None]:
        """This image and the ancestors that open, newest first, and the error that ended the walk
        early (None when it reached a full image). Bounded, and stops at a loop."""
        out: list[Image] = [self]
        seen = {os.path.realpath(self.path), self.sum}
        while True:
            try:
                parent = out[-1]._open_parent()
            except ImageError as e:
                return out, e
            if parent is None:
                return out, None
            real = os.path.realpath(parent.path)
            if real in seen or parent.sum in seen:
                return out, ImageError(f"{self.path}: parent chain loops at {parent.path}", ExitCode.IMAGE_CORRUPT,
                                       parent.path)
            if len(out) > mf.MAX_CHAIN:
                return out, ImageError(f"{self.path}: parent chain longer than {mf.MAX_CHAIN} images",
                                       ExitCode.IMAGE_CORRUPT, parent.path)
            seen |= {real, parent.sum}
            out.append(parent)

    def chain(self) -> list[Image]:
        """This image and its ancestors, newest first, down to the full image; every inherited
        buffer is found in it at the same address and size (IMAGE_CORRUPT otherwise)."""
        if self._chain is None:
            images, error = self.walk()
            if error is not None:
                raise error
            for image, older in zip(images, images[1:], strict=False):
                for b in image.buffers:
                    if not b.get("stored", True):
                        old = older.buffer(b["id"])
                        if old is None:
                            raise ImageError(f"{older.path}: broken parent chain: buffer {b['id']} is not there",
                                             ExitCode.IMAGE_CORRUPT, older.path)
                        if (old["addr"], old["size"]) != (b["addr"], b["size"]):
                            raise ImageError(
                                f"{image.path}: broken parent chain: buffer {b['id']} is {b['addr']:#x}+{b['size']} "
                                f"here but {old['addr']:#x}+{old['size']} in {older.path}", ExitCode.IMAGE_CORRUPT,
                                image.path)
            self._chain = images
        return self._chain

    def parent(self) -> Image | None:
        """The parent image (incremental images), checked to be the one recorded."""
        chain = self.chain()
        return chain[1] if len(chain) > 1 else None

    def holder(self, buffer_id: int) -> tuple[Image, dict[str, Any]]:
        """The image of the chain that stores this buffer's bytes, and its entry there."""
        for image in self.chain():
            entry = image.buffer(buffer_id)
            if entry is None:
                break
            if entry.get("stored", True):
                return image, entry
        if self.buffer(buffer_id) is None:
            raise ImageError(f"{self.path}: no buffer {buffer_id}", ExitCode.BAD_INPUT, self.path)
        raise ImageError(f"{self.path}: broken parent chain: buffer {buffer_id} is stored in none of its images",
                         ExitCode.IMAGE_CORRUPT, self.path)

    def chunk_problems(self) -> list[str]:
        """Every chunk file that is missing, extra, not a regular file or of the wrong size,
        from the directory alone (no file is opened)."""
        return self._chunk_check()[0]

    def _chunk_check(self) -> tuple[list[str], set[str] | None]:
        """(problems, names of the chunk files that cannot be read; None: none can)."""
        problems: list[str] = []
        unreadable: set[str] = set()
        chunks = os.path.join(self.path, CHUNKS)
        expected = {c["file"]: (b, c) for b in self.buffers if b.get("stored", True) for c in b["chunks"]}
        try:
            dfd = os.open(chunks, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if expected or e.errno not in (errno.ENOENT,):
                why = "is not a directory" if e.errno in (errno.ENOTDIR, errno.ELOOP) else (e.strerror or str(e))
                problems.append(f"{chunks}: {why}" if e.errno != errno.ENOENT
                                else f"{self.path}: no {CHUNKS}/ directory")
            return problems, None
        try:
            present = set(os.listdir(dfd))
            for name, (b, c) in expected.items():
                path = os.path.join(chunks, name)
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    problems.append(f"{path}: missing chunk (buffer {b['id']}, chunk {c['n']})")
                    unreadable.add(name)
                    continue
                if not stat.S_ISREG(st.st_mode):
                    problems.append(f"{path}: not a regular file (buffer {b['id']}, chunk {c['n']})")
                    unreadable.add(name)
                elif st.st_size != c["stored_size"]:
                    problems.append(f"{path}: chunk is {st.st_size} bytes, the manifest says {c['stored_size']} "
                                    f"(buffer {b['id']}, chunk {c['n']})")
                    unreadable.add(name)
        finally:
            os.close(dfd)
        for name in sorted(present - set(expected)):
            problems.append(f"{os.path.join(chunks, name)}: extra chunk file, not in the manifest")
        return problems, unreadable

    def _check_files(self, entry: dict[str, Any]) -> None:
        """IMAGE_CORRUPT unless every chunk file of a buffer of this image is there, a regular file
        of its recorded size (looked at, not opened)."""
        chunks = os.path.join(self.path, CHUNKS)
        try:
            dfd = os.open(chunks, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise ImageError(f"{chunks}: cannot be read as the image's chunk directory ({e.strerror})",
                             ExitCode.IMAGE_CORRUPT, chunks) from None
        try:
            for c in entry["chunks"]:
                path = os.path.join(chunks, c["file"])
                try:
                    st = os.stat(c["file"], dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    raise ImageError(f"{path}: missing chunk (buffer {entry['id']}, chunk {c['n']})",
                                     ExitCode.IMAGE_CORRUPT, path) from None
                if not stat.S_ISREG(st.st_mode) or st.st_size != c["stored_size"]:
                    raise ImageError(f"{path}: not a regular file of {c['stored_size']} bytes (buffer {entry['id']}, "
                                     f"chunk {c['n']})", ExitCode.IMAGE_CORRUPT, path)
        finally:
            os.close(dfd)

    def _decompressor(self) -> Any:
        d = getattr(self._local, "zstd", None)
        if d is None:
            import zstandard

            # a damaged frame header may ask for a window of up to 2 GiB; the writer's levels use at most 128 MiB
            d = self._local.zstd = zstandard.ZstdDecompressor(max_window_size=1 << 27)
        return d

    def read_chunk(self, entry: dict[str, Any], chunk: dict[str, Any], out: memoryview, verify: bool = True) -> None:
        """Read one chunk of ``entry`` (a buffer of this image) into ``out`` (its size)."""
        path = os.path.join(self.path, CHUNKS, chunk["file"])
        start = chunk["n"] * self.manifest["chunk_size"]
        where = f"{path}: chunk {chunk['n']} of buffer {entry['id']} (bytes {start}+{chunk['size']})"
        if len(out) != chunk["size"]:
            raise ValueError(f"out holds {len(out)} bytes, the chunk {chunk['size']}")
        try:
            dfd = os.open(os.path.join(self.path, CHUNKS), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ImageError(f"{where}: missing (no {CHUNKS}/ directory)", ExitCode.IMAGE_CORRUPT, path) from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ImageError(f"{where}: {CHUNKS}/ is not a directory (refused)", ExitCode.IMAGE_CORRUPT,
                                 path) from None
            raise _io_error("cannot read", path, e) from e
        try:
            fd, size = _open_regular(chunk["file"], chunk["stored_size"], where, dir_fd=dfd)
        except FileNotFoundError:
            raise ImageError(f"{where}: missing", ExitCode.IMAGE_CORRUPT, path) from None
        except OSError as e:
            raise _io_error("cannot read", path, e) from e
        finally:
            os.close(dfd)
        try:
            if size != chunk["stored_size"]:
                raise ImageError(f"{where}: file is {size} bytes, the manifest says {chunk['stored_size']}",
                                 ExitCode.IMAGE_CORRUPT, path)
            if chunk.get("zstd"):
                packed = bytearray(size)
                got = _read_exactly(fd, memoryview(packed))
                import zstandard

                try:
                    # what the frame says it holds, before anything is allocated for it
                    declared = zstandard.frame_content_size(bytes(packed[:18]))
                    if declared not in (-1, chunk["size"]):
                        raise ImageError(f"{where}: the zstd frame says it holds {declared} bytes",
                                         ExitCode.IMAGE_CORRUPT, path)
                    data = self._decompressor().decompress(bytes(packed[:got]), max_output_size=chunk["size"])
                except zstandard.ZstdError as e:
                    raise ImageError(f"{where}: does not decompress ({e})", ExitCode.IMAGE_CORRUPT, path) from None
                if len(data) != chunk["size"]:
                    raise ImageError(f"{where}: decompresses to {len(data)} bytes", ExitCode.IMAGE_CORRUPT, path)
                out[:] = data
            else:
                got = _read_exactly(fd, out)
            if got != size or os.read(fd, 1):
                raise ImageError(f"{where}: file changed size while it was read", ExitCode.IMAGE_CORRUPT, path)
        except OSError as e:
            raise _io_error("cannot read", path, e) from e
        finally:
            os.close(fd)
        if verify and checksum(self.manifest["checksum"], out) != chunk["sum"]:
            raise ImageError(f"{where}: checksum mismatch", ExitCode.IMAGE_CORRUPT, path)

    def read(self, buffer_id: int, out: Buffer | None = None, *, verify: bool = True,
             threads: int | None = None) -> bytes | memoryview:
        """A buffer's bytes, from this image or its chain; checked against the chunk checksums.
        With ``out`` (a writable buffer of at least its size, e.g. pinned host memory) the bytes
        are read into it and a memoryview of that part is returned; otherwise new bytes."""
        image, entry = self.holder(buffer_id)
        size = entry["size"]
        if out is None:
            image._check_files(entry)  # before memory is taken for what the manifest says they hold
            target = memoryview(bytearray(size))
        else:
            target = memoryview(out).cast("B")
            if target.readonly or len(target) < size:
                raise ValueError(f"out must be writable and hold {size} bytes")
            target = target[:size]
        cs = image.manifest["chunk_size"]
        jobs = [(c, target[c["n"] * cs:c["n"] * cs + c["size"]]) for c in entry["chunks"]]
        workers = threads or min(16, os.cpu_count() or 1)
        if workers > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
                for f in [pool.submit(image.read_chunk, entry, c, part, verify) for c, part in jobs]:
                    f.result()
        else:
            for c, part in jobs:
                image.read_chunk(entry, c, part, verify)
        return bytes(target) if out is None else target

    def resolved(self) -> Iterator[tuple[dict[str, Any], Image, dict[str, Any]]]:
        """Every buffer of this image with the image and entry that hold its bytes."""
        for b in self.buffers:
            image, entry = self.holder(b["id"])
            yield b, image, entry


def open_image(path: str | os.PathLike[str], key: bytes | None = mf.KEY_FROM_ENVIRONMENT) -> Image:
    """Open a committed image and check it and its parent chain: every manifest strictly (see
    gpuos_tools.image.manifest), the chain bounded, loop-free and made of the images recorded.
    NO_INPUT when there is no such directory, IMAGE_CORRUPT naming the file and field otherwise.
    Chunk files are checked as they are read (``verify`` checks them all)."""
    image = Image(path, key)
    image.chain()
    return image


# -- verify, diff, compact --------------------------------------------------------------------


def verify(path: str | os.PathLike[str], *, data: bool = True, key: bytes | None = mf.KEY_FROM_ENVIRONMENT) -> list[str]:
    """Every problem of an image and its parent chain, as sentences naming the file at fault:
    unreadable, truncated or inconsistent manifest, missing, extra or wrong-sized chunk files,
    checksum mismatches, a broken parent chain. [] when it is sound. ``data=False`` skips reading
    the chunks (sizes only)."""
    problems: list[str] = []
    try:
        image = Image(path, key)
    except ImageError as e:
        return [str(e)]
    images, error = image.walk()
    if error is not None:
        problems.append(str(error))
    else:
        try:
            image.chain()
        except ImageError as e:
            problems.append(str(e))
    for img in images:
        problems += _verify_one(img, data)
    return problems


def _verify_one(image: Image, data: bool, threads: int | None = None) -> list[str]:
    problems, unreadable = image._chunk_check()
    if not data or unreadable is None:
        return problems
    to_read = [(b, c) for b in image.buffers if b.get("stored", True) for c in b["chunks"]
               if c["file"] not in unreadable]
    local = threading.local()

    def check(job: tuple[dict[str, Any], dict[str, Any]]) -> str | None:
        b, c = job
        scratch = getattr(local, "buf", None)  # one chunk-sized buffer per thread, reused
        if scratch is None or len(scratch) < c["size"]:
            scratch = local.buf = bytearray(c["size"])
        try:
            image.read_chunk(b, c, memoryview(scratch)[:c["size"]])
        except ImageError as e:
            return str(e)
        return None

    if to_read:
        with ThreadPoolExecutor(max_workers=min(threads or min(16, os.cpu_count() or 1), len(to_read))) as pool:
            problems += [p for p in pool.map(check, to_read) if p is not None]
    return problems


def diff(a: str | os.PathLike[str] | Image, b: str | os.PathLike[str] | Image) -> list[dict[str, Any]]:
    """Which buffers differ between two images (each resolved through its chain): one
    ``image_diff`` record per buffer that was added, removed, moved/resized or changed, with
    the changed byte ranges at chunk granularity ([start, end) pairs, merged when adjacent)."""
    ia = a if isinstance(a, Image) else open_image(a)
    ib = b if isinstance(b, Image) else open_image(b)
    out: list[dict[str, Any]] = []
    ids = sorted({x["id"] for x in ia.buffers} | {x["id"] for x in ib.buffers})
    for buf_id in ids:
        ea, eb = ia.buffer(buf_id), ib.buffer(buf_id)
        if ea is None or eb is None:
            e = eb if ea is None else ea
            out.append({"type": "image_diff", "buffer": buf_id, "change": "added" if ea is None else "removed",
                        "addr": e["addr"], "size": e["size"], "kind": e.get("kind")})
            continue
        if (ea["addr"], ea["size"]) != (eb["addr"], eb["size"]):
            out.append({"type": "image_diff", "buffer": buf_id, "change": "resized", "addr": ea["addr"],
                        "size": ea["size"], "new_addr": eb["addr"], "new_size": eb["size"], "kind": eb.get("kind")})
            continue
        ranges = _changed_ranges(ia, ib, buf_id)
        if ranges:
            out.append({"type": "image_diff", "buffer": buf_id, "change": "changed", "addr": ea["addr"],
                        "size": ea["size"], "kind": eb.get("kind"), "ranges": ranges,
                        "bytes": sum(e - s for s, e in ranges)})
    return out


def _changed_ranges(ia: Image, ib: Image, buf_id: int) -> list[list[int]]:
    ha, ea = ia.holder(buf_id)
    hb, eb = ib.holder(buf_id)
    size = int(ea["size"])
    if ha.image_id == hb.image_id:
        return []  # the very same stored bytes
    cs_a, cs_b = int(ha.manifest["chunk_size"]), int(hb.manifest["chunk_size"])
    ranges: list[list[int]] = []
    if cs_a == cs_b and ha.manifest["checksum"] == hb.manifest["checksum"]:
        trusted = ha.manifest["checksum"] == "sha256"  # equal sums mean equal bytes
        chunks_b = {c["n"]: c for c in eb["chunks"]}
        for c in ea["chunks"]:
            cb = chunks_b.get(c["n"])
            same = cb is not None and cb["sum"] == c["sum"] and cb["size"] == c["size"]
            if same and not trusted:  # a short checksum: equal sums are checked byte by byte
                pa, pb = memoryview(bytearray(c["size"])), memoryview(bytearray(c["size"]))
                ha.read_chunk(ea, c, pa)
                hb.read_chunk(eb, cb, pb)
                same = pa == pb
            if not same:
                _merge(ranges, c["n"] * cs_a, c["n"] * cs_a + c["size"])
        return ranges
    da, db = ia.read(buf_id), ib.read(buf_id)  # different layouts or short checksums: compare bytes
    step = min(cs_a, cs_b)
    for start in range(0, size, step):
        if da[start:start + step] != db[start:start + step]:
            _merge(ranges, start, min(size, start + step))
    return ranges


def _merge(ranges: list[list[int]], start: int, end: int) -> None:
    if ranges and ranges[-1][1] == start:
        ranges[-1][1] = end
    else:
        ranges.append([start, end])


def is_image(path: str | os.PathLike[str]) -> bool:
    """Does ``path`` hold a committed image (a directory with a sound manifest of our schema)?"""
    try:
        Image(path)
    except ImageError:
        return False
    return True
