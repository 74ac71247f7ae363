"""gpu-ckpt(1) beyond --help: notes, periodic checkpoints, suspend through the agent, durable images, examples."""

from __future__ import annotations

from gpuos_tools.commands.manual.checkpoint import sections

EXAMPLES = """\
Free the GPU held by one process, then give it back:

    gpu-ckpt --pid 4242 -o ckpt.ndjson
    gpu-restore --pid 4242

Give a busy process at most 30 s to finish its submitted GPU work:

    gpu-ckpt --pid 4242 --timeout 30000

What works on this host (driver, checkpoint API, CRIU, CUPTI, permissions, memory):

    gpu-ckpt check
    gpu-ckpt check --dir /var/lib/gpuos-tools/images --json | jq 'select(.status=="fail")'

What is on the GPUs, and what is checkpointed:

    gpu-ckpt status
    gpu-ckpt status --json | jq -r 'select(.state=="checkpointed") | .pid'

Nightly maintenance from root's crontab: suspend the jobs the profile selects at 02:00, bring
exactly those back at 02:30 (chronic, from moreutils, shows output only when a command fails;
the commands are quiet on success anyway):

    0 2 * * *  chronic gpu-ckpt --profile /etc/gpuos-tools/maintenance.toml
    30 2 * * * chronic gpu-restore --profile /etc/gpuos-tools/maintenance.toml

The profile (gpuos_tools/profiles/maintenance.toml, installed with the package):

    [select]
    users = ["alice", "bob"]
    command = 'python3? .*train'
    exclude_command = 'jupyter'

    [checkpoint]
    timeout_ms = 600000
    on_error = "resume"

    [state]
    file = "/var/lib/gpuos-tools/maintenance.json"

A full-process image with CRIU 4 or later (as root), and back:

    gpu-ckpt --pid 4242 --image /var/tmp/job.img
    gpu-restore --image /var/tmp/job.img

Suspend a program started with `GPUOS_AGENT_OWN=1 gpu-ckpt run` (its GPU memory goes to host
RAM at link speed; it waits), with an image of it, then let it go on:

    gpu-ckpt --agent 4242 --suspend --image /var/tmp/job.suspended
    gpu-restore --agent 4242 --resume

A checkpoint image of a job every 15 minutes through its agent, from cron (full, then up to
`chain.length` incremental images, old ones retired by the profile's retention):

    */15 * * * * chronic gpu-ckpt periodic --profile /etc/gpuos-tools/ckpt-periodic.toml
    gpu-ckpt periodic --profile /etc/gpuos-tools/ckpt-periodic.toml --plan | jq .

Fold an incremental image and its chain into one full image, and check it:

    gpu-ckpt compact /var/lib/gpuos-tools/images/train/train-20261122T031500.000Z /var/tmp/train.full
    gpu-restore verify /var/tmp/train.full"""

NOTES = """\
A checkpoint is stop-the-world: the lock waits for the process's CUDA calls in flight and its
submitted GPU work, then the driver copies its device memory to host memory (about 1 GB/s: seconds
per GiB) and releases its GPUs. The CPU side keeps running; its next CUDA call blocks
until the process is restored. `gpu-restore --pid PID` copies the memory back (onto another GPU
of the same kind with `--device`) and unlocks it.

The driver cannot checkpoint processes that use managed (unified) memory, CUDA IPC memory, MPS,
MIG or NCCL; it needs release 570 or later (580 to move onto another GPU).

Never stranded: if the lock times out, the process keeps running; if the checkpoint fails after
the lock, the process is unlocked (or restored and unlocked) before gpu-ckpt exits; SIGINT,
SIGTERM and SIGHUP during a checkpoint do the same. The error message and the `state` of the
last `ckpt_result` record say what the process was left in: `running`, `checkpointed`
(restorable with `gpu-restore --pid PID`), `locked` (`gpu-restore --pid PID` unlocks it), or
`failed` (the driver gave up on its CUDA state).

gpu-ckpt remembers, per checkpointed process, which GPUs it used and how much memory it had
there, in the state directory (`$GPUOS_CKPT_STATE_DIR`, or `/run/gpuos-tools/ckpt` for root,
`$XDG_RUNTIME_DIR/gpuos-tools/ckpt` otherwise); gpu-restore needs it to move the process with
`--device`, and `gpu-ckpt status` lists the processes it names.

With `--profile`, gpu-ckpt suspends every running CUDA process that the profile selects (by
user and/or command line) and writes the list of those it suspended to the profile's state
file, atomically, after each one; `gpu-restore --profile` resumes exactly those. Records are
written only where `-o` says, so both commands are silent on success and exit 0; a failure is
reported on standard error with a non-zero status. With `on_error = "resume"` (the default)
the first failure stops the run and the processes suspended so far are resumed; with `"keep"`
the run goes on and the failed processes stay running.

`--image DIR` needs CRIU 4 or later on PATH and a passing `criu check` (so root); both are
checked before the process is touched (`gpu-ckpt check` says whether they pass here). The GPU
state is checkpointed first, then `criu dump` writes the image (by default CRIU ends the
process; `--leave-running` resumes it on the GPU afterwards). If `criu dump` fails, the process
is restored and unlocked. DIR must be new or empty: the dump goes into a dot-named temp
directory beside it and is renamed to DIR once complete, so DIR holds a whole image or nothing.
A guard process started before anything is touched finishes or undoes the dump if gpu-ckpt is
killed, even with SIGKILL (and likewise the restore if gpu-restore is): it waits for CRIU, makes
a complete dump the image, and brings a process it finds locked or checkpointed back to
running; what it did is in STATE_DIR/guard.log and STATE_DIR/guard-PID.json (a ckpt_guard
record). With --job it does so for the whole job: every rank's GPU state is restored before any
rank is unlocked. CRIU restores an open regular file only if its size is what it was at the dump: a job
that keeps a growing log open cannot be restored from a --leave-running image after it wrote
more.

A program under the agent on interception (`gpu-ckpt run` or `gpu-trace run --agent` with
--mechanism intercept) whose memory the agent owns (GPUOS_AGENT_OWN=1) is dumped through its
agent first: the agent suspends it (an agent_suspend record; the owned memory goes to pinned
host memory at link speed and off the GPU), the driver's checkpoint then copies only what is
left (the context, memory not owned), and CRIU writes the process, staging included. The image's
metadata says so (agent.suspended_by_dump), and `gpu-restore --image DIR` has the restored agent
resume it (an agent_resume record). With --leave-running the agent resumes it after the dump.
--no-agent-suspend dumps it the plain way. A program whose agent owns nothing, or that was
suspended before (it stays so after the restore), is dumped the plain way; one under the agent
on CUPTI callbacks is refused (84, NOT_CHECKPOINTABLE), nothing touched, since the driver refuses
a process with CUPTI loaded. If the dump fails or is refused after the suspend, the agent resumes
the program and the error says so; the guard does the same if gpu-ckpt is killed. An agent that
does not answer leaves the program held, and the message names the command that resumes it
(`gpu-restore --agent PID --resume`). The trace stream of such a program goes to its launcher
through a pipe that cannot outlive it: the restored program's tracer writes to /dev/null instead
(the agent goes on; the stream of the restored run is not recorded). `gpu-ckpt periodic`'s
full-process images take the same path."""

PERIODIC = """\
`gpu-ckpt periodic --profile FILE` takes one image of an agent process per run, for cron. The
profile (gpuos_tools/profiles/ckpt-periodic.toml, installed with the package) says where the
images go and what they are called, whether chunks are compressed, how many incremental images
may follow a full one, and how many images to keep and for how long:

    [images]
    directory = "/var/lib/gpuos-tools/images/train"
    name = "train"
    compress = false
    chunk_size = "64MiB"
    checksum = "crc32"

    [chain]
    length = 6

    [retention]
    keep = 14
    max_age = "7d"

    [agent]
    command = 'python3? .*train'

Each run removes the temp directories of image writers that died, then takes the next image:
incremental on the newest image while that image's chain has fewer than `chain.length`
increments and reads, full otherwise (or when `chain.length` is 0). Images are named
`NAME-YYYYmmddTHHMMSS.mmmZ` (UTC). The image appears only once complete; if the snapshot fails,
nothing is left and nothing is deleted. Then retention keeps the newest `keep` images no older
than `max_age`, the newest image always, and every image a kept image chains to; the rest are
deleted newest first (a child before its parent), each by one rename. Files in the directory
that are not this profile's images are never touched, and a lock file keeps two runs of the
same profile apart. Records go only where `-o` says: a run is silent on success, and a failure
is a message on standard error with a non-zero status. `--plan` writes what the next run would
do and changes nothing.

A damaged image in the directory (a manifest or parent chain that does not pass the checks of
`gpu-restore verify`) does not stop a run: the run still takes its image and applies retention
to the others, but the damaged image is never chained to, not counted by `keep` and never
deleted; the record lists it under `damaged`, and the run ends with a message per damaged image
and status 1, so that cron shows it until someone looks.

The snapshot is the agent's (the concurrent checkpoint path): the profile's [agent] names a
program started with `gpu-ckpt run` or `gpu-trace run --agent` (pid, socket, or a command-line
pattern that must match exactly one agent process), and each run asks it, over its control socket, for a
consistent snapshot written as the next image (incremental when the agent knows what was
written since the previous one). With no such agent the run fails (status 76) and writes
nothing.

`gpu-ckpt --agent PID|SOCKET --image DIR [--parent IMAGE]` takes one such image by hand and
writes an `agent_snapshot` record: T0, the operations before it, bytes, seconds and GB/s, the
copy-on-write count and bytes, stream waits, and `stall_s`, the time spent on the program's
path (`stall_parts_s` splits it: ordering streams after T0, enqueueing copy-on-writes, stream
waits). `staging_s` is the time spent before T0 pinning host staging (the first snapshot of a
process, unless it was started with `--stage-ahead`), `pool_s` the time allocating the
copy-on-write slots."""

SUSPEND = """\
`gpu-ckpt --agent PID --suspend` frees the GPU memory of a program started under the agent with
its allocations owned (`GPUOS_AGENT_OWN=1 gpu-trace run --agent`, or `gpu-ckpt run`; CuPy
and PyTorch programs), at link speed, and keeps the program waiting until `gpu-restore --agent PID
--resume`:

    GPUOS_AGENT_OWN=1 gpu-ckpt run -o run.ndjson.zst -- python3 job.py &
    gpu-ckpt --agent PID --suspend --partial -o suspend.ndjson
    gpu-restore --agent PID --resume          # or --resume --lazy

The agent takes its lock (the program's next launch, copy, memset, free or other driver call
waits in its callback), waits until the operations already issued are enqueued and the GPU has
done them, copies every owned buffer to its pinned host staging on a side stream and gives each
buffer's physical memory back to the driver as soon as its copy completed; the addresses stay
reserved. Resume maps new physical memory at the same addresses, copies the contents back, waits
for the copies and lets the program go on. The program's memory lives in host RAM (pinned) in
between; the first suspend of a process pins that staging first, while the program still runs
(seconds for several GiB), later ones reuse it.

With `--image DIR` the saved memory is also written as an image of the agent path (full; the
program's other device allocations are copied for it too), readable by `gpu-restore verify`,
`diff` and `--agent PID --image DIR`. `--max-hold S` resumes by itself after S seconds.

Guarantees: the program's state after resume is what it was at the suspend, at the same device
addresses. While suspended, the agent's
control socket keeps serving: `ping` answers `state` `suspended`; `snapshot`, `rollback` and a
second suspend are refused (79, WRONG_STATE); a resume without a suspend is refused (79). A
resume that cannot get the memory back (another process took the GPU) is refused with the
program still suspended and its memory still in host RAM: free the GPU and resume again. The
agent's shutdown resumes a suspended program first.

Not owned: the CUDA context and module images, and device memory allocated outside CuPy's and
PyTorch's allocators (cuBLAS's workspace, cuFFT's plans, cuDNN's small buffers, cudaMalloc in
extensions) stay on the GPU; a PyTorch training job keeps tens of MiB there with the default
cuBLAS workspace (gpu-trace(1), OWNED ALLOCATIONS). A program with such allocations is refused (93, NOT_OWNED, naming the largest) unless `--partial`
is given; a program started without GPUOS_AGENT_OWN=1 is refused with or without it; nothing is
changed then. The `agent_suspend` record lists what stayed (`not_owned`: count, bytes, the
largest), the bytes released, `staging_s`, `lock_s`, `settle_s`, `sync_s`, `save_s` and
`save_gbps`, `suspend_s` (from the request to the last buffer released) and NVML's view of the
process before and after (`process_gpu_memory_before`, `_after`); the `agent_resume` record
`resume_s`, `load_gbps` and `held_s`.

Lazy resume and the residency engine: `gpu-restore --agent PID --resume --lazy` lets the program
go on at once. The agent's residency engine then stands before each of its launches, copies,
memsets, graph launches and frees: every owned buffer the operation touches that is not back
yet is mapped and its load enqueued on a stream of the agent's, and the operation's stream
waits for the load on the GPU (the program's thread does not wait). What a launch touches is
the agent's prediction of its reads and writes; a launch it cannot predict ("unknown") and a
graph launch wait for every buffer not yet back, i.e. for the rest of the reload. The rest loads
in the background, the buffers the program touched most recently before the suspend first. So a
kernel may touch exactly what its arguments (and the pointer arrays the program copied to the
GPU) say it touches; a kernel that reaches a buffer some other way, and is not marked unknown
by the predictor, could run before that buffer is back. A device-wide synchronisation by the
program waits for the whole reload. Until every buffer is back, snapshots,
suspends and rollbacks are refused (79); ping's `residency` shows what is pending and, when
done, the reload's time and GB/s. The same engine evicts (saves after the buffer's last use,
then releases) and prefetches single buffers for gpu-prefetch-sched.

The residency API (gpuos_tools/memory/engine.py's ResidencyEngine, inside the program under the
agent; what gpu-prefetch-sched run and lazy resume use) guarantees, per owned buffer (a large
buffer, or a segment of small ones): `require` before an operation maps every buffer the
operation touches and makes the operation's stream wait on the GPU for each load in flight, so an
operation never runs on a buffer that is released or half loaded (unknown: every buffer);
`evict` saves the buffer on the engine's evict stream after an event on every stream the program
has used, once operations other threads are issuing have reached the driver (else the eviction
is refused and the buffer stays), and releases its physical memory only after the save has
completed; an operation that touches a buffer being evicted cancels the eviction; a buffer loaded
from the engine's host copy and not written since (as predicted) is released without a save
(with the GPU digest on, only once its digest says it is unchanged; changed, it is saved and the
kernels that may have written it are unknown from then on: gpu-prefetch-sched(1), SAFETY);
`prefetch` maps and loads on a stream of its own, never making the program's thread wait; no
eviction runs while a snapshot copies the buffers. What it does not guarantee: a kernel reaching
a buffer by a pointer its launch's prediction does not show (see above).

The remainder through the driver: the driver checkpoint API refuses to lock a process under
the agent (CUDA_ERROR_NOT_SUPPORTED), even after the agent unsubscribed its CUPTI callbacks and
called cuptiFinalize; the same program without CUPTI, its memory owned, locks, checkpoints and
restores. So a suspend does not free the remainder: it stays on the GPU (the CUDA context and
what is not owned: hundreds of MiB for a CuPy job), and a process that needs it all freed has
to be run without the agent and checkpointed with `gpu-ckpt --pid`. A job whose agent runs on
interception (`--mechanism intercept`, GPUOS_AGENT_MECHANISM=intercept) has no CUPTI: the driver's
checkpoint takes it, and `gpu-restore --agent PID --resume --device N` moves it, suspended, to
another GPU (not yet verified on a GPU)."""

DURABLE = """\
Images at the storage's speed: the agent queues every buffer's chunks at once on the image
writer's threads (`--threads`, default the CPUs up to 16), each chunk one file written in large
writes straight from the pinned staging, with O_DIRECT where the filesystem takes it and it is
not memory (tmpfs), checksummed on the same threads with the fastest checksum measured on this
CPU (`--checksum auto`: xxh3 where the xxhash package is installed, else crc32; sha256 on
request).

No snapshot lost after T0: if the program ends while its image is being written, its exit
waits for the image, up to GPUOS_AGENT_EXIT_WAIT seconds (default 30), saying so on its
standard error; then it hands the image over: its bytes go into a memfd passed to the waiting
gpu-ckpt over the control socket, and gpu-ckpt writes the image after the program is gone (the
record's image says `handover`; `during_exit` says the program ended during the write). Without
a gpu-ckpt still connected, or without the host memory for the copy, the exit waits for the
image in place, up to GPUOS_AGENT_EXIT_MAX seconds in all (default 600), and says so if it gives
up. The same holds for `gpu-ckpt periodic`. A program killed by a signal, or ending through
os._exit, runs no exit handler: its image in flight is lost (no partial image is ever visible).

`gpu-ckpt periodic` takes full-process images too: with `kind = "process"` in [images] and a
[process] table (pid or command, timeout_ms) each run is a `gpu-ckpt --pid PID --image DIR
--leave-running`, named and retired like the agent's images (chain.length must be 0: every
full-process image is full)."""

JOB_CUT = """\
`gpu-ckpt --job PID --cut --image DIR` takes one consistent image of a running data-parallel job
through its ranks' agents, without stopping it. Every rank must run under the agent, e.g.

    torchrun --nproc-per-node 2 --no-python gpu-ckpt run -o /dev/null -- python3 train.py
    gpu-ckpt --job "$(pgrep -of torchrun)" --cut --image /var/tmp/job.cut

Each rank's agent counts its program's collective launches (NCCL's kernels); gpu-ckpt asks every
rank for its count, picks K = the largest + `--margin`, and arms every rank with K. At the K-th
collective launch of each rank, before the launch, its agent takes the snapshot's T0 on the
program's thread and lets the launch go; the copy and the image follow while the job runs. Every
image therefore holds its rank's device memory after its collective K-1 and before K. A rank
already past K when armed makes the attempt fail: every rank is disarmed, what was taken is
deleted, and the cut is tried again with a fourfold margin. gpu-ckpt waits for every image at most
`--timeout` (default 120 s); then, or on any failure, every rank is disarmed and no image is kept.

DIR is new: the ranks' images (rank-N, agent-path images) and job.json (host, launcher, K, and
per rank its pid, rank, GPU, image and stall) go into a temp directory beside it, job.json last,
renamed to DIR when complete. The `ckpt_job_cut` record reports each rank's stall: the time its
program was held at collective K (t0_stall_s) plus its time protecting buffers still being copied
(protect_stall_s).

PID is the launcher's (or any parent of every rank): a tree holding fewer ranks than the job's
WORLD_SIZE is refused. `-o /dev/null` drops each rank's trace stream, which the ranks would
otherwise interleave on torchrun's output.

Refused, untouched: a rank that launched CUDA graphs whose collectives the agent cannot count
(captured collectives, or graphs built node by node), a rank whose memory is owned
(GPUOS_AGENT_OWN), a rank of the job not under the agent, and a job with NCCL_CUMEM_ENABLE=0. The
cut leaves out memory mapped with cuMemMap (NCCL's buffers and its peers', through its cuMem
allocator): `gpu-restore --job PID --cut --image DIR` leaves it as it is."""

SECTIONS = sections(NOTES, EXAMPLES, "gpu-restore(1), criu(8), chronic(1)",
                            {"PERIODIC CHECKPOINTS": PERIODIC, "SUSPEND THROUGH THE AGENT": SUSPEND,
                             "DURABLE IMAGES": DURABLE, "A JOB'S CUT THROUGH THE AGENTS": JOB_CUT})
