"""The parts of gpu-ckpt(1) and gpu-restore(1) that both pages have: their records, the image
format, environment and files."""

from __future__ import annotations

from gpuos_tools.ckpt.records import TYPES
from gpuos_tools.image import IMAGE_DOC
from gpuos_tools.image.manifest import render_format
from gpuos_tools.stream.schema import render

IMAGE_FORMAT = """\
Images of the agent path (`gpu-ckpt compact`, `gpu-ckpt periodic`, `gpu-restore verify` and
`gpu-restore diff`; the agent writes them through `gpuos_tools.image.ImageWriter`) are
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


def sections(notes: str, examples: str, see_also: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The man-page sections gpu-ckpt(1) and gpu-restore(1) share, around their own text."""
    return {
        "RECORDS": (
            "One JSON object per line after the header (tool, action, pid or profile; once the driver was "
            "reached also driver {cuda, release} and gpus); durations in seconds, sizes in bytes, GPUs by "
            "nvidia-smi index and UUID; `?` marks a field that may be absent.\n\n" + render(TYPES)
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
            "- `GPUOS_AGENT_EXIT_WAIT`, `GPUOS_AGENT_EXIT_MAX` (in the environment of `gpu-ckpt run` or "
            "`gpu-trace run --agent`, for the program it starts): how long the program's exit waits for an "
            "image in flight before handing it to gpu-ckpt (default 30 s), and in all (default 600 s); a value "
            "that is not a number of seconds is refused before the program starts.\n"
            "- `GPUOS_IMAGE_KEY`: a key file; images are then signed when written and must be signed "
            "to be read (see IMAGE FORMAT). The agent signs its images with the key named in the environment "
            "of the command that started the program (`gpu-ckpt run`, `gpu-trace run --agent`), checked there "
            "before the program starts; the program's own environment does not carry it."
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
