"""The records gpu-prefetch-sched writes, as data (gpuos_tools.stream.schema): the schedule of
`simulate --schedule` (switch, evict, prefetch, stall), the summaries of `simulate`, `run` and
`online-sim`, and `serve`'s per-job rows and summary. Fields beyond those listed pass: the
summaries carry every counter of the policy and the engine that produced them.
"""

from __future__ import annotations

from gpuos_tools.stream.records import BYTES, COUNT, register_output
from gpuos_tools.stream.schema import Anything, Bool, Field, List, Num, RecordType, Str

_SECONDS = Num(0, unit="s")
_POLICY = Field("policy", Str(), "the eviction policy", required=True)
_STEP = Field("step", COUNT, "the operation's index in the workload", required=True)
_FOR = Field("for", Anything(), "the operation it serves: {job, of, seq or index}")
_CHUNKS = (Field("job", COUNT, required=True), Field("alloc", COUNT, "the allocation's id in that job's trace",
                                                       required=True),
           Field("offset", BYTES, required=True), Field("size", BYTES, required=True),
           Field("start_s", _SECONDS), Field("end_s", _SECONDS))

SWITCH = RecordType("switch", "(simulate --schedule) the GPU passes from one job to another.", (
    _POLICY, _STEP, Field("from", COUNT, "the job before"), Field("to", COUNT, "the job after"),
    Field("at_s", _SECONDS),
))
EVICT = RecordType("evict", "(simulate --schedule) bytes of one allocation leave the GPU.", (
    _POLICY, _STEP, _FOR, *_CHUNKS, Field("writeback", Bool(), "false: the host copy was current, nothing copied"),
))
PREFETCH = RecordType("prefetch", "(simulate --schedule) bytes of one allocation come to the GPU.", (
    _POLICY, _STEP, _FOR, *_CHUNKS, Field("copy", Bool(), "false: first touch, mapped without a copy"),
))
STALL = RecordType("stall", "(simulate --schedule) an operation waits for its memory.", (
    _POLICY, _STEP, _FOR, Field("wait_s", _SECONDS, required=True), Field("at_s", _SECONDS),
))
SCHED_SUMMARY = RecordType("sched_summary", "(simulate, run) one policy's outcome: bytes moved, estimated or "
                           "measured time, stalls.", (
    Field("policy", Str()), Field("mode", Str(("online",)), "run: measured in the program"),
    Field("budget", Num(0, unit="bytes"), "GPU memory the policy may use", null=True),
    Field("footprint", BYTES, "memory the workload touches", null=True),
    Field("bytes_in", Num(0, unit="bytes")), Field("bytes_out", Num(0, unit="bytes")),
    Field("est_s", _SECONDS, "simulate: estimated time"), Field("speed_vs_in_memory", Num(0)),
    Field("exit", Anything(), "run: the program's exit status"),
))
SCHED_ONLINE_SIM = RecordType("sched_online_sim", "(online-sim) the online policy replayed on a recorded trace, "
                              "beside Belady's plan.", (
    Field("plan", Str(), required=True), Field("policy", Str(), required=True), Field("budget", Num(0, unit="bytes")),
    Field("footprint", BYTES), Field("steps", COUNT), Field("est_s", _SECONDS), Field("stall_s", _SECONDS),
    Field("speed_vs_in_memory", Num(0)), Field("bytes_in", Num(0, unit="bytes")), Field("bytes_out", Num(0, unit="bytes")),
))
SERVE_JOB = RecordType("serve_job", "(serve) one job: how it ended and what it was given.", (
    Field("job", COUNT, required=True), Field("argv", List(Str()), required=True),
    Field("exit", Anything(), "its exit status"), Field("ok", Bool(), required=True), Field("wall_s", _SECONDS),
    Field("summary", Anything(), "its engine's and policy's summary, null when it gave none"),
))
SERVE_SUMMARY = RecordType("serve_summary", "(serve) the jobs together under one budget.", (
    Field("budget", Num(0, unit="bytes"), required=True), Field("slice_s", _SECONDS), Field("policy", Str()),
    Field("switch", Str(("overlap", "serial"))), Field("switches", COUNT), Field("wall_s", _SECONDS),
    Field("combined_peak", Num(0, unit="bytes")), Field("errors", List(Anything())),
))

#: Every record type gpu-prefetch-sched writes (besides the header and in-band errors).
TYPES = (SWITCH, EVICT, PREFETCH, STALL, SCHED_SUMMARY, SCHED_ONLINE_SIM, SERVE_JOB, SERVE_SUMMARY)
register_output(*TYPES)
