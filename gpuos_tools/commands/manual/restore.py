"""gpu-restore(1) beyond --help: notes and examples."""

from __future__ import annotations

from gpuos_tools.commands.manual.checkpoint import sections

EXAMPLES = """\
Resume a process where it was:

    gpu-restore --pid 4242

Move it onto GPU 1 (the same kind of GPU; by nvidia-smi index or UUID):

    gpu-restore --pid 4242 --device 1
    gpu-restore --pid 4242 --device GPU-5b2c1f9e

A process on GPUs 0 and 1, moved onto 2 and 3 of a four-GPU machine:

    gpu-restore --pid 4242 --device-map 0=2,1=3,2=0,3=1

Nightly maintenance from root's crontab: gpu-ckpt suspends the jobs the profile selects at
02:00, gpu-restore brings exactly those back at 02:30 (chronic, from moreutils, shows output
only when a command fails; both are quiet on success anyway):

    0 2 * * *  chronic gpu-ckpt --profile /etc/gpuos-tools/maintenance.toml
    30 2 * * * chronic gpu-restore --profile /etc/gpuos-tools/maintenance.toml

A full-process image written by `gpu-ckpt --pid 4242 --image /var/tmp/job.img` (as root):

    gpu-restore --image /var/tmp/job.img

The same image of a job that ran as `python train.py | tee train.log` (tee gone since), its
output from now on appended to train.log itself:

    gpu-restore --image /var/tmp/job.img --output-to train.log

Roll a program started with `gpu-trace run --agent` back to an image `gpu-ckpt --agent` took
of it (say, the last one before its loss went NaN), then let it go on:

    gpu-restore --agent 4242 --image /var/lib/gpuos-tools/images/train/train-20261122T031500.000Z

The same, letting the program go on at once, each buffer written back before its first use:

    gpu-restore --agent 4242 --image /var/lib/gpuos-tools/images/train/train-20261122T031500.000Z --lazy

Let a program suspended by `gpu-ckpt --agent 4242 --suspend` go on, after all its memory is
back, or at once, each launch waiting only for the buffers it touches:

    gpu-restore --agent 4242 --resume
    gpu-restore --agent 4242 --resume --lazy

Check an image of the agent path (and its parent chain), and compare two:

    gpu-restore verify /var/lib/gpuos-tools/images/train/train-20261122T031500.000Z
    gpu-restore diff before.img after.img
    gpu-restore diff before.img after.img | jq -c 'select(.type=="image_diff") | [.buffer, .change, .bytes]'"""

NOTES = """\
A process checkpointed by `gpu-ckpt --pid` is restored in place by default: its memory goes
back to the GPUs it was on, at the same addresses, and its CUDA calls unblock. A process that
is merely locked (by an interrupted tool, say) is unlocked.

`--device` moves a one-GPU process onto another GPU of the same kind with enough free memory;
gpu-ckpt recorded which GPU it used. The driver wants a map of every GPU of the machine, so
gpu-restore swaps the process's GPU and the target and maps every other GPU onto itself; a
process that used several GPUs needs `--device-map OLD=NEW,...` (pairs not given map a GPU
onto itself; the result must be a permutation). Moving needs driver release 580 or later, and
the NVIDIA driver refuses it on some systems: the process then stays checkpointed, and
`gpu-restore --pid PID` restores it in place.

If the restore fails, the process is left checkpointed (restorable) and the message says so;
if the unlock fails after a restore, it is left locked and `gpu-restore --pid PID` unlocks it.

`--image DIR` runs `criu restore` (CRIU 4 or later, checked first) on an image written by
`gpu-ckpt --image`, then restores the GPU state and unlocks. CRIU restores the process tree under
its old process and thread ids, which must be free: while one is taken (the dumped process still
running, a zombie its parent has not reaped, another process), the restore is refused and says
which, nothing touched. Before CRIU runs, it waits for closed connections in TIME_WAIT
(the process's own, kept 60 s by the kernel) to free the ports of the listening sockets the image
records, since CRIU's bind of a listener without SO_REUSEADDR fails on them: said in one line on
stderr when the wait starts (on a terminal a second line counts the seconds), at most `--timeout`
seconds (default 90), the wait reported as `port_wait_s`. Such a connection goes 60 s after it
closed, at the latest when the dump ended the process: a restore started 60 s or more after the
dump does not wait. A port a
live process holds is refused, nothing touched. When the dump had the program's agent suspend it (a program
under the agent on interception, see gpu-ckpt(1)), the restored agent is then asked to resume it
(an agent_resume record); with `--lazy` the program goes on at once and its buffers load behind
it. If the agent does not resume it, the program runs on the driver's side but is held by its
agent, and the message names `gpu-restore --agent PID --resume`; a guard does the resume if
gpu-restore is killed. The pipe to the dumped program's launcher is replaced by /dev/null
(CRIU's --inherit-fd): the restored tracer and agent go on, without a stream.

A pipe whose other end was outside the image (`prog | tee log`, a launcher reading the job's
output), which CRIU alone would restore with nobody at the other end (the program then dies of
SIGPIPE at its next write), is recorded by the dump and given, through CRIU's --inherit-fd: the
same pipe while a process still holds its other end (so that reader reads on); else, for the
program's output, a file appended to beside the image, `DIR.restored-PID-fdN.log`, and for its
input, /dev/null. `--output-to FILE` sends every such output to FILE instead, even where the
reader is alive (`/dev/null` discards it). Each choice is said on stderr and listed in the
record's `outside` (pipe, end, fds, how, to). A FIFO (named pipe) with its other end outside
gets the same (`prog > FIFO` read by `cat FIFO`: the dump ended the writer, so cat read
end-of-file and is gone, and the restored program's output goes to the file); sockets are not
handled this way. Images written before this was recorded restore as
before.

`--profile FILE` resumes exactly the processes listed in the profile's state file by
`gpu-ckpt --profile`, removes them from it (the file goes when it is empty), and keeps those
that failed, so that running it again retries them. It is silent on success.

`--agent PID|SOCKET --image DIR` rolls a program started with `gpu-trace run --agent` back to an
image of the agent path (full, or incremental and read down its chain): its device memory is
written back at the same addresses. The image is read and every chunk's checksum checked into
pinned host memory first, while the program runs; then the agent stops the world (the program's
next launch, copy, memset or free waits), waits for the GPU work already submitted, copies every
buffer back and lets the program go on. Only device memory goes back: the program's host state
(its Python objects, a step counter) is its own, so roll back at a point the program knows
about. Refused, with nothing written: a damaged image or broken chain (90, IMAGE_CORRUPT, naming
the chunk); an image taken on another GPU model or CUDA driver version, or whose allocations
(address and size) are not exactly the program's live device allocations (92,
IMAGE_MISMATCH: allocations made or freed since the image was taken). A fresh run of the same
deterministic program often gets the same addresses, so an image can restart a job that
crashed. One `agent_rollback` record: the image, buffers, bytes, read_s, stall_s (how long
the program was held), GB/s, and hold_at and go_at (CLOCK_MONOTONIC seconds: when the program
was stopped and let go).

`--agent PID|SOCKET --resume` lets a program suspended by `gpu-ckpt --agent PID --suspend` go
on: its owned buffers get new physical memory at the same addresses, their contents are copied
back from the agent's pinned host memory, and the program's waiting call proceeds. One
`agent_resume` record: buffers, bytes, resume_s, load_gbps and held_s (how long the program
waited). Refused with 79 (WRONG_STATE) when the program is not suspended. When the GPU has not
enough free memory for it any more, the resume fails (71, CUDA_ERROR) and the program stays
suspended, its memory in host RAM: free the GPU and resume again. Onto another GPU: not
through the agent (the program's context stays on its GPU, and the driver's checkpoint, which
could move it, refuses a process with CUPTI loaded); `--device` is refused with `--resume`.

`--resume --lazy` lets the program go on at once and brings its memory back behind it, through
the agent's residency engine. The engine stands before each of the program's launches, copies,
memsets, graph launches and frees: a buffer the operation touches that is not back yet gets its
physical memory and its load (on a stream of the agent's) there and then, and the operation's
stream is made to wait on the GPU for that load; the program's thread never waits for a load.
What a launch touches is the agent's prediction of its reads and writes (gpu-predict-access's
rules, from the kernel's arguments and the pointer arrays the program copied to the GPU); a
launch whose footprint is unknown (no parameter layout, a pointer the prediction cannot
follow), and every graph launch, waits for every buffer not yet back, so "unknown" costs the
whole reload at that point, no more than an eager resume. A copy waits for its source and
destination (a 3D copy or one through a CUDA array: for every buffer), a memset for its
destination, a free for a load into what it frees. Meanwhile a
thread of the agent's loads the rest, the buffers the program touched most recently first (a
loop's working set), then in the order it first touched them, then by address, at most 512 MiB
ahead of the GPU; while a load on demand is in flight it queues nothing more, so that load waits
at most for those 512 MiB (~10 ms at link speed). The guarantee: every operation of the program runs
after the buffers it touches (as predicted, or all) hold their suspended contents at their
addresses. Until every buffer is back, `gpu-ckpt --agent` snapshots and suspends and rollbacks
are refused (79). A device-wide synchronisation by the program (cudaDeviceSynchronize,
cuCtxSynchronize) waits for the whole reload, the engine's streams being in its context; a
stream's or an event's synchronisation waits only for what that stream's work touches. The
agent's ping answer (`residency`) shows what is pending and, once done,
the reload's time and GB/s. The `agent_resume` record has `lazy: true`; its resume_s is the time
to let the program go.

`--agent PID|SOCKET --image DIR --lazy` rolls back the same way up to the write-back: the same
checks and the same staging (the whole image read and checked into pinned host memory while the
program runs; every refusal above leaves the program's memory as it was), then, under the lock,
the GPU work already submitted completes and the program goes on at once, without its buffers
written back. The residency engine stands before its operations as for `--resume --lazy`: an
operation that touches a buffer not yet written back makes its stream wait on the GPU for that
buffer's write-back (issued there on demand if it has not started); an unknown launch and every
graph launch wait for all of them; a copy (synchronous or not) waits for its source and
destination; a free waits for a write-back in flight into what it frees and the buffer is then
forgotten. A thread of the agent's writes the rest back, the most recently touched buffers
first, then in first-touch order, then by address, at link speed, pausing while a write-back on
demand is in flight. It works whether or not the program's memory is owned: for plain allocations the
agent starts its engine at the first lazy rollback, so that one writes back in address order
(demand first) and later ones in the order learned since. The costs: the guarantee rests on the
prediction, and a kernel that reaches a buffer by a pointer the prediction does not see reads
its old contents (an owned buffer of a lazy resume would fault instead); once the engine runs,
launches are predicted until every allocation has been touched; until every buffer is back,
snapshots, suspends and rollbacks are refused (79) and the image's pinned staging stays in use.
The `agent_rollback` record has `lazy: true`; its stall_s is the time the program was held (the
synchronisation included), gbps is null; the write-back's time and GB/s are in the agent's
ping answer (`residency.lazy`, kind rollback) once done.

`gpu-restore verify IMAGE` checks an image of the agent path and its parent chain: the manifest
parses and is complete, every chunk file the manifest lists is there with its size, its bytes
(decompressed) match its checksum, no chunk file is extra, and every parent is there with the
image id recorded, holding each inherited buffer at the same address and size. Each problem is a
line on standard error naming the file, the buffer and the chunk; the status is then 90
(IMAGE_CORRUPT). `--quick` skips reading the chunks.

`gpu-restore diff A B` compares the contents two images describe, each read through its chain:
buffers (by id) added, removed, moved or resized, and for the others the byte ranges that differ,
at chunk granularity: by the chunks' checksums when both images use the same chunk size (equal
sha256 sums are trusted; chunks with equal crc32 sums are read and compared), by reading and
comparing the bytes otherwise. Like diff(1) it exits 0 when the contents are the
same and 1 when they differ."""

JOB_ROLLBACK = """\
`gpu-restore --job PID --cut --image DIR` rolls every rank of a running job back to the job image
`gpu-ckpt --job PID --cut` wrote: the ranks must be the processes the cut took (same pids and
start times). Every rank's image is read and checked against its process first (checksums, the
GPU, the allocation table); only when all fit is any written, each rank stop-the-world as
`--agent --image` does. Memory the cut left out (NCCL's cuMemMap mappings) is left as it is.

What it guarantees: afterwards every rank's device memory (what the cut kept) is as it was just
before its K-th collective launch. Nothing else goes back: the program's host state, its threads,
NCCL's communicators and buffers are as they are. So the job must be paused where no collective
is in flight (every rank between steps, its work synchronised) while it is rolled back, and each
rank must then go on from a host state that matches: for a data-parallel training loop, the start
of the step whose collectives include K, whose parameters and optimizer state are then on the GPU
(none is written before the step's last collective); its loop counter, generator states and data
position are the program's to bring back. workloads/ddp_job.py --sync-dir shows one way.

A job image is taken by this command only: given to `gpu-restore --image` or `--agent PID
--image` it is refused, and so is a CRIU or agent-path image given to `--cut`; each message
names the command that takes the image. `--timeout` (seconds, default 3600) bounds each rank's
answer, its rollback included."""

SECTIONS = sections(NOTES, EXAMPLES, "gpu-ckpt(1), criu(8), chronic(1)", {"A JOB'S ROLLBACK": JOB_ROLLBACK})
