"""The records gpu-ckpt and gpu-restore write, and the sink that writes them after a header.

RECORDS = '''
header         tool, action, pid or profile; once the driver was reached also
               driver {cuda, release} and gpus [{index, uuid, name, memory}]
ckpt_process   pid, user, command, starttime, state (before anything is done);
               when checkpointing also gpus [{index, uuid, name, memory}] and
               bytes: the process's GPU memory as NVML shows it (null: unknown)
ckpt_step      pid, step (lock, checkpoint, restore, unlock, criu_dump,
               criu_restore), ok, state_before, state_after, duration_s,
               error (a CUresult name or exit status) when it failed,
               recovery: true when the step undoes a failed action
ckpt_result    action (checkpoint, restore, dump), pid, ok, state (what the
               process was left in: running, locked, checkpointed, failed,
               dumped; null when unknown), touched (false: nothing was done to it),
               code and error (the exit code and its name), message; on
               success bytes, lock_s, checkpoint_s, gbps, restore_s, unlock_s,
               duration_s, device and gpu_map (for a move), image
ckpt_status    (gpu-ckpt status) pid, user, command, state, error, gpus,
               memory (bytes on GPUs; 0 when checkpointed), seen_by (nvml,
               maps, gpu-ckpt, asked), checkpointed {checkpointed_at, bytes,
               gpus} for processes gpu-ckpt checkpointed
ckpt_profile   (--profile) action, profile, state_file, counts: selected,
               suspended, resumed, skipped [{pid, why}], failed [{pid, error,
               state, message}], ok
image_verify   (gpu-restore verify) image, ok, problems [sentences naming the
               file], chain [image paths, newest first], buffers, bytes
image_diff     (gpu-restore diff) buffer, change (added, removed, resized,
               changed), addr, size, kind; changed: ranges [[start, end)] at
               chunk granularity and bytes; resized: new_addr, new_size
image_diff_summary  a, b, buffers_a, buffers_b, added, removed, resized,
               changed, bytes_changed, identical
image_compact  (gpu-ckpt compact) head, chain [image ids folded], image,
               image_id, bytes, stored_bytes, chunks, buffers, seconds
ckpt_periodic  (gpu-ckpt periodic) profile, directory, image, kind (full,
               incremental), parent, why, bytes, stored_bytes, seconds,
               snapshot (the agent's summary), kept, deleted, cleaned (temp
               directories of dead writers removed)
ckpt_periodic_plan  (gpu-ckpt periodic --plan) the same without taking the
               image: image, kind, parent, why, would_keep, would_delete
'''

The last ``ckpt_result`` of a stream says what the process was left in, on success and on
every error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from gpuos_tools.stream import Writer, make_header, open_output

RECORDS = __doc__.split("RECORDS = '''\n", 1)[1].split("'''", 1)[0]


class Sink:
    """Hands records to a stream writer, the header first; the header is made at the first
    record, so that it carries the driver and the GPUs once they are known. Keeps every record."""

    def __init__(self, writer: Writer | None, tool: str, header_fields: Callable[[], dict[str, Any]],
                 **fields: Any):
        self.writer = writer
        self.tool = tool
        self.fields = fields
        self.header_fields = header_fields
        self.records: list[dict[str, Any]] = []
        self._started = False

    def _start(self) -> None:
        if not self._started:
            self._started = True
            if self.writer is not None:
                self.writer.write(make_header(self.tool, **self.fields, **self.header_fields()))

    def __call__(self, record: dict[str, Any]) -> None:
        self._start()
        self.records.append(record)
        if self.writer is not None:
            self.writer.write(record)

    def finish(self) -> None:
        self._start()


def run_recorded(output: str | None, tool: str, ckpt: Any, work: Callable[[], Any], **fields: Any) -> Any:
    """Run ``work`` (what a Checkpointer does) with its records going to ``output``.

    The work's own outcome comes first: its CkptError is raised as it is even when the output
    failed too; a closed pipe after a successful action ends quietly (BrokenPipeError, status 0,
    as everywhere in the toolkit); any other output failure after a successful action is an
    IO_ERROR that says the action itself succeeded.
    """
    from gpuos_tools.ckpt.driver import CkptError
    from gpuos_tools.errors import ExitCode, GpuosError

    started = False
    failure: CkptError | None = None
    result: Any = None
    try:
        with record_stream(output, tool, ckpt.header_fields, **fields) as sink:
            ckpt.emit = sink
            started = True
            try:
                result = work()
            except CkptError as e:
                failure = e
    except (OSError, GpuosError) as e:
        if not started:
            raise
        ckpt.output_error = ckpt.output_error or e
    if failure is not None:
        raise failure
    problem = ckpt.output_error
    if isinstance(problem, BrokenPipeError):
        raise problem
    if problem is not None:
        done = result.get("message", "the action succeeded") if isinstance(result, dict) else "the action succeeded"
        raise GpuosError(f"writing records failed ({problem}); {done}", ExitCode.IO_ERROR)
    return result


@contextmanager
def record_stream(output: str | None, tool: str, header_fields: Callable[[], dict[str, Any]],
                  **fields: Any) -> Iterator[Sink]:
    """A Sink on ``output`` (None: records are kept but written nowhere). The stream is
    finished (header at least) when the block ends normally."""
    if output is None:
        sink = Sink(None, tool, header_fields, **fields)
        yield sink
        return
    with open_output(output) as writer:
        sink = Sink(writer, tool, header_fields, **fields)
        yield sink
        sink.finish()


IMAGE_FORMAT = """\
Images of the agent path (`gpu-ckpt compact`, `gpu-ckpt periodic`, `gpu-restore verify` and
`gpu-restore diff`; the agent writes them through `gpuos_tools.ckpt.image.ImageWriter`) are
directories, not live processes: a JSON manifest (the allocation table with addresses and
sizes, GPU, driver, CUDA, process, parent image, T0 and the launch sequence number at T0) and
each buffer's bytes in fixed-size chunk files (64 MiB by default), each with a checksum of its
raw bytes and, optionally, zstd compression (kept only where it makes the chunk smaller). They
are unrelated to `--image DIR`, which is a CRIU process image.

An image is written under a dot-named temp directory beside its final name, every file fsynced,
the manifest last, and renamed into place only when complete: a reader sees a whole image or
none, and a writer killed midway leaves only `.NAME.PID.XXXXXXXX.tmp`, removed by the next
`gpu-ckpt periodic` (or by hand) once that PID is gone. An incremental image holds only the
buffers written since its parent and names the parent (relative path and image id); reading a
buffer it does not hold goes down the chain. `gpu-ckpt compact` folds a chain into one full
image. There is no single-file form; `tar` carries an image directory.

Every reader (verify, diff, compact, periodic, rollback) checks a manifest strictly before it
reads anything: the type and range of every field below, unique buffer ids, buffers that do not
overlap, every chunk but a buffer's last exactly `chunk_size` bytes and named as the writer names
it, the manifest's own sum, and a parent chain that is bounded, free of loops and made of the very
images recorded (by their manifests' sums). Chunk files are opened only inside `chunks/`, never
through a symbolic link, only when they are regular files of the recorded size. A manifest that
fails is IMAGE_CORRUPT, naming the file and the field.

With `GPUOS_IMAGE_KEY` naming a key file (at least 16 bytes, readable by its owner only), every
image written carries an HMAC-SHA256 of its manifest and every image read must carry a valid one:
images that cross a trust boundary cannot be changed without the key. Such images need
`checksum = "sha256"`, since crc32 does not protect chunk contents from someone who chooses them.
"""


def man_sections(notes: str, examples: str, see_also: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The man-page sections gpu-ckpt(1) and gpu-restore(1) share, around their own text."""
    from gpuos_tools.ckpt.image import IMAGE_DOC
    from gpuos_tools.ckpt.manifest import render_format

    return {
        "RECORDS": (
            "One JSON object per line after the header; durations in seconds, sizes in bytes, GPUs by "
            "nvidia-smi index and UUID.\n\n" + "\n".join("    " + line for line in RECORDS.strip("\n").splitlines())
        ),
        "NOTES": notes,
        **(extra or {}),
        "IMAGE FORMAT": IMAGE_FORMAT + "\n\n" + "\n".join(
            "    " + line for line in IMAGE_DOC.strip("\n").split("\n\n")[0].splitlines()) + "\n\n" + render_format(),
        "ENVIRONMENT": (
            "- `GPUOS_CKPT_STATE_DIR`: where gpu-ckpt remembers the processes it checkpointed (default "
            "`/run/gpuos-tools/ckpt` for root, `$XDG_RUNTIME_DIR/gpuos-tools/ckpt` or "
            "`/tmp/gpuos-tools-UID/ckpt` for others).\n"
            "- `PATH`: where `criu` is looked for (`--image`).\n"
            "- `GPUOS_IMAGE_KEY`: a key file; images are then signed when written and must be signed "
            "to be read (see IMAGE FORMAT)."
        ),
        "FILES": (
            "- `profiles/maintenance.toml`: the example profile for a nightly maintenance run.\n"
            "- `profiles/ckpt-periodic.toml`: the example profile for periodic checkpoints (`gpu-ckpt periodic`).\n"
            "- `STATE_DIR/PID.json`: what gpu-ckpt recorded about a checkpointed process (its GPUs and bytes).\n"
            "- `DIR/gpuos-ckpt.json`, `DIR/dump.log`, `DIR/restore.log`: beside CRIU's image files in an `--image` directory."
        ),
        "EXAMPLES": examples,
        "SEE ALSO": see_also,
    }
