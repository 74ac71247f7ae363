"""The records gpu-ckpt and gpu-restore write, and the sink that writes them after a header.

Their schemas are below, as data (``TYPES``): the man pages list them from there.

The last ``ckpt_result`` of a stream says what the process was left in, on success and on
every error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from gpuos_tools.ckpt import outside
from gpuos_tools.ckpt.driver import CkptError
from gpuos_tools.errors import ExitCode, GpuosError
from gpuos_tools.stream import Writer, make_header, open_output
from gpuos_tools.stream.records import ADDR, BYTES, COUNT, register_output
from gpuos_tools.stream.schema import Anything, Bool, Field, Int, List, Map, Num, Obj, RecordType, Str

_PID = Int(1, (1 << 31) - 1, "pid")
_SECONDS = Num(0, unit="s")
# memory is null where NVML lists no memory for the process (a launcher that only opened the GPU's
# device file, or NVML seen from another pid namespace): its GPU is known, its bytes are not
_GPU = Obj((Field("index", COUNT), Field("uuid", Str()), Field("name", Str()), Field("memory", BYTES, null=True)),
           text="{index, uuid, name, memory}")
_STATE = Str(form="running, locked, checkpointed, failed, dumped")
_NAMES = List(Str())
_FAILED = List(Obj((Field("pid", _PID), Field("error", Str()), Field("state", _STATE, null=True),
                    Field("message", Str())), text="{pid, error, state, message}"))
_SKIPPED = List(Obj((Field("pid", _PID), Field("why", Str())), text="{pid, why}"))
_DAMAGED = List(Obj((Field("image", Str(), required=True), Field("problem", Str(), required=True)),
                    text="{image, problem}"))

CKPT_PROCESS = RecordType("ckpt_process", "a process before anything is done to it.", (
    Field("pid", _PID, required=True), Field("user", Str()), Field("command", Str()),
    Field("starttime", COUNT, "clock ticks after boot"), Field("state", _STATE, null=True),
    Field("gpus", List(_GPU), "when checkpointing"),
    Field("bytes", BYTES, "its GPU memory as NVML shows it; null: unknown", null=True),
))
CKPT_STEP = RecordType("ckpt_step", "one step of an action.", (
    Field("pid", _PID, required=True),
    Field("step", Str(("lock", "checkpoint", "restore", "unlock", "criu_dump", "criu_restore")), required=True),
    Field("ok", Bool(), required=True), Field("state_before", _STATE, null=True),
    Field("state_after", _STATE, null=True), Field("duration_s", _SECONDS),
    Field("error", Str(), "a CUresult name or exit status, when it failed"),
    Field("recovery", Bool(), "true when the step undoes a failed action"),
))
CKPT_RESULT = RecordType("ckpt_result", "how an action ended; the last of a stream says what the process was "
                         "left in, on success and on every error.", (
    Field("action", Str(("checkpoint", "restore", "dump", "criu_restore")), required=True),
    Field("pid", _PID, null=True), Field("ok", Bool(), required=True),
    Field("state", _STATE, "what the process was left in; null when unknown", null=True),
    Field("touched", Bool(), "false: nothing was done to it"),
    Field("code", Int(0, 255), "the exit code"), Field("error", Str(), "its name"), Field("message", Str()),
    Field("bytes", BYTES, null=True), Field("lock_s", _SECONDS, null=True), Field("checkpoint_s", _SECONDS, null=True),
    Field("gbps", Num(0), null=True), Field("restore_s", _SECONDS, null=True), Field("unlock_s", _SECONDS, null=True),
    Field("duration_s", _SECONDS, null=True), Field("device", Anything(), "for a move"),
    Field("gpu_map", Anything(), "for a move"),
    Field("image", Anything()),
    Field("ranks", List(_PID), "(--job --image) the job's processes checkpointed on the GPU"),
    Field("port_wait_s", _SECONDS, "(restore --image) how long the restore waited, before CRIU ran, for closing "
          "connections to free the ports of the image's listening sockets"),
    Field("agent_suspended", Bool(), "(--pid --image) the program's agent suspended it for the dump"),
    Field("outside", outside.DONE, "(restore --image) the pipes whose other end was outside the image, and what "
          "each got: the same pipe (its other end alive), a file, or /dev/null"),
))
CKPT_STATUS = RecordType("ckpt_status", "(gpu-ckpt status) one CUDA process.", (
    Field("pid", _PID, required=True), Field("user", Str()), Field("command", Str()),
    Field("state", _STATE, null=True), Field("error", Str()), Field("gpus", List(_GPU)),
    Field("memory", BYTES, "bytes on GPUs; 0 when checkpointed", null=True),
    Field("seen_by", List(Str()), "nvml, maps, gpu-ckpt, asked"),
    Field("job", _PID, "a rank's launcher (its parent): `gpu-ckpt --job JOB` takes the job whole", null=True),
    Field("rank", COUNT, "the rank its launcher gave it (RANK and the like)"),
    Field("checkpointed", Map(), "{checkpointed_at, bytes, gpus}, for processes gpu-ckpt checkpointed", null=True),
))
CKPT_PROFILE = RecordType("ckpt_profile", "(--profile) what a maintenance run did.", (
    Field("action", Str(("checkpoint", "restore")), required=True), Field("profile", Str()),
    Field("state_file", Str()), Field("selected", COUNT), Field("suspended", COUNT), Field("resumed", COUNT),
    Field("skipped", _SKIPPED), Field("failed", _FAILED), Field("ok", Bool()),
), note="Also the counts `resumed_after_failure`, `already_suspended`, `listed` and `still_suspended`.")
CKPT_JOB = RecordType("ckpt_job", "(--job) the processes of a job checkpointed or restored together.", (
    Field("action", Str(("checkpoint", "restore")), required=True), Field("pid", _PID, "the job's launcher",
                                                                        required=True),
    Field("ok", Bool(), required=True), Field("state", _STATE, null=True),
    Field("ranks", List(Obj((Field("pid", _PID), Field("user", Str()), Field("command", Str()),
                             Field("starttime", COUNT), Field("rank", COUNT, null=True)),
                            text="{pid, user, command, starttime, rank}")), "rank order"),
    Field("rounds", COUNT, "rounds of locking every rank at once until all held"),
    Field("lock_s", _SECONDS), Field("checkpoint_s", _SECONDS), Field("restore_s", _SECONDS),
    Field("unlock_s", _SECONDS), Field("duration_s", _SECONDS),
    Field("gpu_map", List(List(Str(), length=2)), "restore --device-map: [old UUID, new UUID] for every GPU",
          null=True),
    Field("unrestorable", List(_PID), "checkpoint --force: the processes using NCCL transports the driver did "
          "not restore when last seen"),
    Field("message", Str()),
))
_CUT_RANK = Obj((
    Field("pid", _PID), Field("starttime", COUNT), Field("rank", COUNT, null=True), Field("gpu", Str(), null=True),
    Field("image", Str()), Field("collective", COUNT), Field("stall_s", _SECONDS), Field("t0_stall_s", _SECONDS),
    Field("protect_stall_s", _SECONDS), Field("bytes", BYTES), Field("buffers", COUNT), Field("ops_before", COUNT),
    Field("t0_ns", COUNT), Field("seconds", _SECONDS), Field("image_id", Str(), null=True),
    Field("left_out", Anything(), null=True),
), text="{pid, starttime, rank, gpu, image, collective, stall_s, t0_stall_s, protect_stall_s, bytes, buffers, "
        "ops_before, t0_ns, seconds, image_id, left_out: {allocations, bytes, kinds} not in the image (NCCL's)}")
CKPT_JOB_CUT = RecordType("ckpt_job_cut", "(--job --cut) every rank of a job snapshotted just before the same "
                          "collective, while it ran.", (
    Field("action", Str(("checkpoint",)), required=True), Field("pid", _PID, "the job's launcher", required=True),
    Field("ok", Bool(), required=True), Field("image", Str(), "the job image (a directory with job.json)"),
    Field("k", COUNT, "the collective each rank was cut before (1 = its first)"),
    Field("attempts", COUNT, "attempts until no rank was past K when armed"),
    Field("ranks", List(_CUT_RANK), "rank order; stall_s: the program's time held (t0_stall_s at the collective, "
          "protect_stall_s protecting buffers while copied)"),
    Field("duration_s", _SECONDS), Field("message", Str()),
), note="The job image's job.json holds the same ranks, with host, boot_id, launcher and k.")
CKPT_JOB_ROLLBACK = RecordType("ckpt_job_rollback", "(gpu-restore --job --cut) every rank of a job rolled back to "
                               "its cut.", (
    Field("action", Str(("restore",)), required=True), Field("pid", _PID, "the job's launcher", required=True),
    Field("ok", Bool(), required=True), Field("image", Str()), Field("k", COUNT, "the collective of the cut"),
    Field("ranks", List(Obj((Field("pid", _PID), Field("rank", COUNT, null=True), Field("image", Str()),
                             Field("stall_s", _SECONDS, null=True), Field("bytes", BYTES, null=True),
                             Field("read_s", _SECONDS, null=True)),
                            text="{pid, rank, image, stall_s, bytes, read_s}")), "rank order"),
    Field("duration_s", _SECONDS), Field("message", Str()),
))
IMAGE_VERIFY = RecordType("image_verify", "(gpu-restore verify) whether an image and its chain are sound.", (
    Field("image", Str(), required=True), Field("ok", Bool(), required=True),
    Field("problems", _NAMES, "sentences naming the file", required=True), Field("quick", Bool()),
    Field("chain", _NAMES, "image paths, newest first"), Field("buffers", COUNT), Field("bytes", BYTES),
))
IMAGE_DIFF = RecordType("image_diff", "(gpu-restore diff) one buffer that differs.", (
    Field("buffer", COUNT, required=True), Field("change", Str(("added", "removed", "resized", "changed")),
                                                  required=True),
    Field("addr", Int(0, (1 << 64) - 1, "address")), Field("size", BYTES), Field("kind", Str(), null=True),
    Field("ranges", List(List(BYTES, length=2)), "changed: [start, end) at chunk granularity"),
    Field("bytes", BYTES, "changed: bytes in the ranges"),
    Field("new_addr", Int(0, (1 << 64) - 1, "address"), "resized"), Field("new_size", BYTES, "resized"),
))
IMAGE_DIFF_SUMMARY = RecordType("image_diff_summary", "(gpu-restore diff) the counts.", (
    Field("a", Str()), Field("b", Str()), Field("buffers_a", COUNT), Field("buffers_b", COUNT),
    Field("added", COUNT), Field("removed", COUNT), Field("resized", COUNT), Field("changed", COUNT),
    Field("bytes_changed", COUNT), Field("identical", Bool(), required=True),
))
IMAGE_COMPACT = RecordType("image_compact", "(gpu-ckpt compact) the full image written.", (
    Field("head", Str(), required=True), Field("chain", _NAMES, "image ids folded"), Field("image", Str()),
    Field("image_id", Str()), Field("bytes", COUNT), Field("stored_bytes", COUNT), Field("chunks", COUNT),
    Field("buffers", COUNT), Field("seconds", _SECONDS), Field("incremental", Bool()),
))
_PERIODIC_COMMON = (
    Field("profile", Str()), Field("directory", Str()), Field("image", Str(), required=True),
    Field("kind", Str(("full", "incremental", "process")), required=True), Field("parent", Str(), null=True),
    Field("why", Str()),
    Field("damaged", _DAMAGED, "images that did not read: never chained to, counted or deleted"),
)
CKPT_PERIODIC = RecordType("ckpt_periodic", "(gpu-ckpt periodic) the image taken and what retention did.", (
    *_PERIODIC_COMMON, Field("bytes", COUNT, null=True), Field("stored_bytes", COUNT, null=True),
    Field("seconds", _SECONDS), Field("snapshot", Anything(), "the agent's summary"), Field("kept", _NAMES),
    Field("deleted", _NAMES), Field("cleaned", _NAMES, "temp directories of dead writers removed"),
))
CKPT_PERIODIC_PLAN = RecordType("ckpt_periodic_plan", "(gpu-ckpt periodic --plan) the same, without taking the "
                                "image.", (*_PERIODIC_COMMON, Field("would_keep", _NAMES),
                                           Field("would_delete", _NAMES)))

CKPT_CHECK = RecordType("ckpt_check", "(gpu-ckpt check) one check of what works on this host, with the facts "
                        "it found.", (
    Field("check", Str(("driver", "checkpoint_api", "vmm", "criu", "criu_check", "cupti", "permissions",
                        "host_memory", "image_dir")), required=True),
    Field("status", Str(("ok", "warn", "fail", "skip")), required=True), Field("detail", Str()),
))
CKPT_CHECK_SUMMARY = RecordType("ckpt_check_summary", "(gpu-ckpt check) whether each path is usable here.", (
    Field("driver", Bool()), Field("process_images", Bool()), Field("agent", Bool()),
    Field("failed", _NAMES, "check names"), Field("warnings", _NAMES, "check names"),
))
CKPT_GUARD = RecordType("ckpt_guard", "(STATE_DIR/guard-OWNER.json, written by the guard of a dump or restore "
                        "whose tool was killed) what the guard found and did.", (
    Field("action", Str()), Field("pid", _PID, null=True), Field("image", Str(), null=True),
    Field("phase", Str(), "where the tool died"), Field("state", _STATE, "the process afterwards", null=True),
    Field("image_ok", Bool(), null=True), Field("message", Str()), Field("steps", Anything()),
    Field("job", Bool(), "true when pid is the launcher of a job (--job)"),
    Field("ranks", List(Obj((Field("pid", _PID), Field("state", _STATE, null=True)), text="{pid, state}")),
          "a job's ranks and their states afterwards"),
    Field("agent", Obj((Field("socket", Str()), Field("resumed", Bool()), Field("error", Str())),
                       text="{socket, resumed, error}"),
          "when the program's agent had suspended it for the dump or was to resume it after the restore"),
))

# The agent's answers to a suspend and a resume (gpuos_tools/agent/suspend.py), as gpu-ckpt and
# gpu-restore write them: its "ok" taken off, "agent" added.
_AGENT = Field("agent", Str(), "the agent asked: --agent's PID or socket as given, or the program's PID (--pid "
               "--image, --agent --resume --device, a restore)", required=True)
_ALLOCATION = Obj((Field("addr", ADDR), Field("size", BYTES), Field("kind", Str())), text="{addr, size, kind}")
_AGENT_IMAGE = Obj((
    Field("path", Str()), Field("image_id", Str()), Field("bytes", BYTES), Field("stored_bytes", BYTES),
    Field("chunks", COUNT), Field("buffers", COUNT), Field("seconds", _SECONDS), Field("incremental", Bool()),
), text="{path, image_id, bytes, stored_bytes, chunks, buffers, seconds, incremental}")
AGENT_SUSPEND = RecordType("agent_suspend", "(--agent --suspend, and --pid --image of a program under the agent on "
                           "interception) the program held by its agent, its owned buffers copied to the agent's "
                           "pinned host memory and their GPU memory given back.", (
    _AGENT, Field("state", Str(("suspended",)), required=True), Field("pid", _PID, "the program"),
    Field("ops_before", COUNT, "the program's operations before it was held"),
    Field("buffers", COUNT, "owned buffers released", required=True),
    Field("released_bytes", BYTES, "GPU memory given back", required=True),
    Field("saved_bytes", BYTES, "copied to host memory: the owned buffers and, with --image, the allocations not "
          "owned"),
    Field("owned_allocations", COUNT, "the program's allocations inside owned memory"),
    Field("not_owned", Obj((Field("count", COUNT), Field("bytes", BYTES), Field("largest", List(_ALLOCATION))),
                           text="{count, bytes, largest}"),
          "(--partial) what stays on the GPU, the largest first"),
    Field("staging_s", _SECONDS, "pinning host memory for it, before the program was held"),
    Field("lock_s", _SECONDS, "until the program was held"), Field("settle_s", _SECONDS),
    Field("sync_s", _SECONDS, "until the GPU finished the program's work"), Field("enqueue_s", _SECONDS),
    Field("save_s", _SECONDS, "the copies to host memory"), Field("save_gbps", Num(0), null=True),
    Field("suspend_s", _SECONDS, "from the request to the last buffer released"),
    Field("held_to_freed_s", _SECONDS, "from the program held to the last buffer released"),
    Field("device_free_after", BYTES, "the GPU's free memory afterwards"),
    Field("process_gpu_memory_before", BYTES, "the process's GPU memory as NVML shows it; null: unknown", null=True),
    Field("process_gpu_memory_after", BYTES, "the same, afterwards", null=True),
    Field("image", _AGENT_IMAGE, "(--image) the image written"), Field("image_s", _SECONDS, "(--image)"),
))
AGENT_RESUME = RecordType("agent_resume", "(--agent --resume, and the restore of an image whose dump suspended the "
                          "program, a move of a suspended program, or a dump that failed after the suspend) the "
                          "program let go by its agent, its owned buffers back at the same addresses.", (
    _AGENT, Field("state", Str(("running",)), required=True),
    Field("lazy", Bool(), "(--lazy) the program went on at once, its buffers loading behind it"),
    Field("buffers", COUNT, "owned buffers brought back (lazy: handed to the loader)", required=True),
    Field("bytes", BYTES, "their bytes", required=True),
    Field("freed_meanwhile", COUNT, "buffers the program freed while it was held: nothing to bring back"),
    Field("map_s", _SECONDS, "mapping GPU memory again"),
    Field("resume_s", _SECONDS, "from the resume to the program let go"),
    Field("load_gbps", Num(0), "null when lazy", null=True),
    Field("held_s", _SECONDS, "how long the program was held"),
    Field("why", Str(("resume", "max_hold", "shutdown")), "what resumed it: a resume request, --max-hold, the "
          "program's exit"),
))

AGENT_SNAPSHOT = RecordType("agent_snapshot", "(--agent --image) the agent's consistent snapshot of the program, "
                            "taken while it ran, written as an image of the agent path.", (
    Field("agent", Str(), "the agent asked: --agent's PID or socket as given"),
    Field("t0_ns", COUNT, "T0, the snapshot's instant (CLOCK_MONOTONIC, in the program)", required=True),
    Field("ops_before", COUNT, "the program's operations before T0"),
    Field("buffers", COUNT, "allocations in the snapshot", required=True),
    Field("bytes", BYTES, "their bytes", required=True),
    Field("seconds", _SECONDS, "from the request to the last buffer copied"),
    Field("gbps", Num(0), null=True),
    Field("cow", COUNT, "buffers copied on the GPU first because a launch was about to write them"),
    Field("cow_bytes", BYTES), Field("host_saves", COUNT, "copy-on-writes past the budget, saved to the host at once"),
    Field("stream_waits", COUNT, "operations made to wait for a buffer's copy"),
    Field("stall_s", _SECONDS, "time spent on the program's path", required=True),
    Field("stall_parts_s", Map(Num(0, unit="s")), "stall_s split: ordering streams after T0, enqueueing "
          "copy-on-writes, stream waits"),
    Field("unsettled", COUNT, "operations still being issued when the lock was taken"),
    Field("t0_streams", COUNT, "streams ordered after T0"),
    Field("staging_s", _SECONDS, "pinning host staging before T0"), Field("pool_s", _SECONDS, "allocating the "
                                                                                               "copy-on-write slots"),
    Field("cow_budget", BYTES, "device memory for copy-on-write slots"),
    Field("digests", Anything(), "per-buffer digests, when asked for"),
    Field("image", _AGENT_IMAGE, "the image written (`handover`: written here after the program ended)"),
))
AGENT_ROLLBACK = RecordType("agent_rollback", "(gpu-restore --agent --image) the image written back into the "
                            "program's allocations, at the same addresses.", (
    Field("agent", Str(), "the agent asked: --agent's PID or socket as given", required=True),
    Field("image", Str(), "its path", required=True), Field("image_id", Str()),
    Field("chain", COUNT, "images read: the image and its parents"),
    Field("checked", Bool(), "true: the image was only read and checked, nothing written back"),
    Field("buffers", COUNT, required=True), Field("bytes", BYTES, required=True),
    Field("read_s", _SECONDS, "reading the image (and checking every chunk) into pinned host memory"),
    Field("stall_s", _SECONDS, "how long the program was held"),
    Field("gbps", Num(0), "null when lazy", null=True),
    Field("ops_before", COUNT, "the program's operations when it was held"),
    Field("t0_image_ns", COUNT, "the image's T0", null=True),
    Field("hold_at", Num(0, unit="s"), "when the program was held (CLOCK_MONOTONIC seconds)"),
    Field("go_at", Num(0, unit="s"), "when it was let go"),
    Field("lazy", Bool(), "(--lazy) the program went on at once, its buffers written back behind it"),
    Field("owned", Bool(), "(--lazy) the agent owns the program's memory"),
    Field("order_predicted", Anything(), "(--lazy) how the write-back order was chosen"),
))

#: Every record type gpu-ckpt and gpu-restore write (besides the header), as data.
TYPES = (CKPT_PROCESS, CKPT_STEP, CKPT_RESULT, CKPT_STATUS, CKPT_PROFILE, CKPT_JOB, CKPT_JOB_CUT,
         CKPT_JOB_ROLLBACK, IMAGE_VERIFY, IMAGE_DIFF,
         IMAGE_DIFF_SUMMARY, IMAGE_COMPACT, CKPT_PERIODIC, CKPT_PERIODIC_PLAN, CKPT_CHECK, CKPT_CHECK_SUMMARY,
         CKPT_GUARD, AGENT_SUSPEND, AGENT_RESUME, AGENT_SNAPSHOT, AGENT_ROLLBACK)
register_output(*TYPES)


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
    started = False
    failure: GpuosError | None = None
    result: Any = None
    try:
        with record_stream(output, tool, ckpt.header_fields, **fields) as sink:
            ckpt.emit = sink
            started = True
            try:
                result = work()
            except GpuosError as e:  # the work's own (a failing sink never raises: ckpt.out keeps it)
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
