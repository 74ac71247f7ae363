"""No snapshot lost after T0: the agent's image writing, and what happens to an image in flight
when the program ends.

Once T0 has passed, every byte of the snapshot is in the agent's host staging, and what is left
is writing it out. If the program ends meanwhile, its exit would take the staging with it (the
writer's threads are stopped at exit, the process's memory goes away), and gpu-ckpt would be
left with a closed connection and no image. So:

1. The exit waits. The agent's exit handler (``finish_at_exit``, from ``Agent.stop_background``)
   waits while a control request is in progress (a snapshot between its request and its answer:
   pinning, T0, copies, the image write, the answer), up to ``GPUOS_AGENT_EXIT_WAIT`` seconds
   (default 30), saying on stderr what it waits for and how far the image is.
2. Then it hands the image over. If the image is still being written after that, the agent
   stops writing, copies the bytes of the image into a memfd (memory speed, several threads) and
   answers the request with the image's description and the memfd, passed over the control
   socket (SCM_RIGHTS). gpu-ckpt (``finish_handover``, through gpuos_tools/agent/snapshot.py)
   writes the image from it after the program is gone; the image appears only when complete, as
   always. The handover needs the requester still connected and the bytes' worth of available
   host memory; without either, the exit goes on waiting for the image in place, up to
   ``GPUOS_AGENT_EXIT_MAX`` seconds in all (default 600), and then says on stderr that the
   image is lost and why.

``GPUOS_AGENT_EXIT_WAIT=0`` hands over at once (the program ends sooner; gpu-ckpt writes).
A program killed by a signal it does not handle, or ending through ``os._exit``, runs no exit
handler: its image in flight is lost (its temp directory is removed by the next periodic run).
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpuos_tools.agent import control
from gpuos_tools.image import chunkio
from gpuos_tools.image import DEFAULT_CHUNK_SIZE, ImageWriter
from gpuos_tools.units import format_size

#: the variables that set the two (read by the launcher into the boot config: injection/config.py)
EXIT_WAIT_ENV = "GPUOS_AGENT_EXIT_WAIT"
EXIT_MAX_ENV = "GPUOS_AGENT_EXIT_MAX"
EXIT_WAIT_S = 30.0
EXIT_MAX_S = 600.0
POLL_S = 0.1
REPORT_S = 5.0  #: how often the exit says how far the image is
COPY_PIECE = 64 << 20  #: bytes per copy into the handover memfd

#: (buffer id, address, size, bytes): one buffer of an image to write
Entry = tuple[int, int, int, Any]


def _say(message: str) -> None:
    print(f"gpuos agent: {message}", file=sys.stderr, flush=True)


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None when unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Job:
    """One image being written by the agent, which the exit may ask to hand over."""

    def __init__(self, path: str, writer: ImageWriter, entries: list[Entry], manifest: dict[str, Any],
                 parent: str | None, options: dict[str, Any]):
        self.path = path
        self.writer = writer
        self.entries = entries
        self.manifest = manifest
        self.parent = parent
        self.options = options
        self.total = sum(e[2] for e in entries)
        self.exiting = False  #: the program started to exit while this image was written
        self.handover = threading.Event()  #: set by the exit: stop writing and hand the bytes over
        self.refused: str | None = None  #: why a handover asked for could not be done

    def progress(self) -> str:
        p = self.writer.progress()
        return f"{format_size(p['written'])} of {format_size(self.total)} written"


_jobs: list[Job] = []
_jobs_lock = threading.Lock()


def current() -> list[Job]:
    with _jobs_lock:
        return list(_jobs)


@contextmanager
def _registered(job: Job) -> Iterator[Job]:
    with _jobs_lock:
        _jobs.append(job)
    try:
        yield job
    finally:
        with _jobs_lock:
            _jobs.remove(job)


def write_image(path: str, manifest: dict[str, Any], entries: list[Entry], *, parent: str | None = None,
                compress: bool = False, chunk_size: int | None = None, checksum: str = "auto",
                threads: int | None = None, key: bytes | None = None) -> dict[str, Any]:
    """Write an image of ``entries`` (their bytes stay valid until this returns), every buffer
    queued at once so that all the writer's threads work. Returns the writer's summary, or,
    when the program's exit asked for it, the handover answer (``handover``: what gpu-ckpt needs
    to write the image; the memfd is attached to the control answer)."""
    chunk_size = chunk_size or DEFAULT_CHUNK_SIZE
    writer = ImageWriter(path, manifest, compress=compress, chunk_size=chunk_size, parent=parent,
                         checksum=checksum, threads=threads, key=key)
    options = {"compress": compress, "chunk_size": chunk_size, "checksum": writer.checksum,
               "level": writer.level, "threads": threads}
    job = Job(path, writer, entries, manifest, parent, options)
    with _registered(job), writer:
        for buf_id, addr, size, data in entries:
            writer.add(buf_id, addr, size, data, wait=False)
        while not writer.wait_written(POLL_S):
            if job.handover.is_set() and job.refused is None:
                answer = _hand_over(job)
                if answer is not None:
                    return answer
        summary = writer.commit()
    summary["during_exit"] = job.exiting
    return summary


def _hand_over(job: Job) -> dict[str, Any] | None:
    """Stop writing, copy the image's bytes into a memfd and attach it to the control answer;
    the answer to return, or None (``job.refused`` says why) when it cannot be done."""
    if not control.peer_connected():
        job.refused = "the requester (gpu-ckpt) is no longer connected"
        return None
    free = available_memory()
    if free is not None and free < job.total + (256 << 20):
        job.refused = (f"{format_size(job.total)} to hand over, {format_size(free)} of host memory "
                       "available")
        return None
    t = time.perf_counter()
    try:  # copied while the writer goes on: if the copy fails, the image is still written here
        fd = os.memfd_create("gpuos-image-handover", os.MFD_CLOEXEC)
    except OSError as e:
        job.refused = f"memfd_create: {e.strerror}"
        return None
    try:
        os.ftruncate(fd, job.total)
        buffers, pieces, offset = [], [], 0
        for buf_id, addr, size, data in job.entries:
            view = memoryview(data).cast("B")
            buffers.append({"id": buf_id, "addr": addr, "size": size, "offset": offset})
            for start in range(0, size, COPY_PIECE):
                pieces.append((view[start:start + COPY_PIECE], offset + start))
            offset += size
        workers = chunkio.Workers(job.options.get("threads") or min(16, os.cpu_count() or 1), "gpuos-handover")
        try:
            for f in [workers.submit(_pwrite_all, fd, piece, at) for piece, at in pieces]:
                f.result()
        finally:
            workers.shutdown()
    except OSError as e:
        os.close(fd)
        job.refused = f"copying into the memfd: {e.strerror or e}"
        return None
    except BaseException:
        os.close(fd)
        raise
    if job.writer.wait_written(0):  # every chunk got written meanwhile: commit it here after all
        os.close(fd)
        job.refused = "it was written meanwhile"
        return None
    job.writer.abort()  # chunks being written finish; no byte of the entries is read after
    control.attach_fds([fd])
    return {
        "path": job.path, "incremental": job.parent is not None, "during_exit": True,
        "handover": {"manifest": job.manifest, "parent": job.parent, "options": job.options,
                     "buffers": buffers, "bytes": job.total, "copy_s": round(time.perf_counter() - t, 6)},
    }


def _pwrite_all(fd: int, view: memoryview, at: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], at + done)


def finish_at_exit(server: Any, wait_s: float = EXIT_WAIT_S, max_s: float = EXIT_MAX_S) -> None:
    """The program is exiting: let a control request in progress finish (an image in flight
    written, or handed over), bounded and said on stderr. ``server`` is the agent's
    ControlServer (``busy``, ``wait_idle``); ``wait_s`` and ``max_s``: how long to wait before the
    handover, and in all (GPUOS_AGENT_EXIT_WAIT and GPUOS_AGENT_EXIT_MAX, through the boot
    config)."""
    if server is None or not server.busy:
        return
    for job in current():
        job.exiting = True
    start = time.monotonic()
    jobs = current()
    what = f"the image {jobs[0].path} ({jobs[0].progress()})" if jobs else "a snapshot in progress"
    _say(f"the program is exiting during a checkpoint request: waiting up to {wait_s:g} s for {what}, "
         f"then handing it to gpu-ckpt ({EXIT_WAIT_ENV}, {EXIT_MAX_ENV})")
    reported = start
    asked: set[int] = set()
    told: set[int] = set()
    while not server.wait_idle(POLL_S):
        now = time.monotonic()
        for job in current():
            job.exiting = True
            if now - start >= wait_s and id(job) not in asked:
                asked.add(id(job))
                _say(f"handing {job.path} over to gpu-ckpt ({job.progress()})")
                job.handover.set()
            if job.refused is not None and id(job) not in told:
                told.add(id(job))
                _say(f"{job.path} cannot be handed over ({job.refused}): waiting for it to be written here")
        if now - reported >= REPORT_S:
            reported = now
            for job in current():
                _say(f"still writing {job.path}: {job.progress()}")
        if now - start >= max_s:
            for job in current():
                _say(f"giving up after {max_s:g} s: the image {job.path} is lost ({job.progress()}); "
                     "nothing is left under its name")
            return
    _say(f"the checkpoint request finished after {time.monotonic() - start:.2f} s; the program exits")


# -- the other side: gpu-ckpt writes a handed-over image --------------------------------------


def finish_handover(summary: dict[str, Any], fds: list[int]) -> dict[str, Any]:
    """Write the image an exiting agent handed over (``summary`` is its answer's ``image``,
    ``fds`` the descriptors that came with it, closed here). Returns the writer's summary with
    ``handover`` and ``copy_s``."""
    info = summary["handover"]
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise RuntimeError(f"the agent handed over {len(fds)} descriptors, not 1: the image {summary['path']} "
                           "is lost")
    fd = fds[0]
    try:
        size = int(info["bytes"])
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) if size else None
    finally:
        os.close(fd)
    try:
        out = _write_handed_over(summary, info, mapped)
    finally:
        if mapped is not None:
            try:
                mapped.close()
            except BufferError:  # a view still held somewhere: unmapped when collected
                pass
    out.update(handover=True, during_exit=True, copy_s=info.get("copy_s"),
               incremental=bool(summary.get("incremental")))
    return out


def _write_handed_over(summary: dict[str, Any], info: dict[str, Any], mapped: mmap.mmap | None) -> dict[str, Any]:
    opts = info["options"]
    with memoryview(mapped if mapped is not None else b"") as view:
        with ImageWriter(summary["path"], info["manifest"], compress=bool(opts.get("compress")),
                         chunk_size=int(opts["chunk_size"]), parent=info.get("parent"), checksum=opts["checksum"],
                         level=int(opts.get("level", 1)), threads=opts.get("threads")) as w:
            for b in info["buffers"]:
                start, size = int(b["offset"]), int(b["size"])
                w.add(int(b["id"]), int(b["addr"]), size, view[start:start + size], wait=False)
            return w.commit()
