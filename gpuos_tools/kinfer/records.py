"""The records gpu-kinfer-bridge writes besides `io` (gpuos_tools.stream.records), as data: the
daemon's closing counters, a ring's status, a client's answers, what calibration, training,
replay, collection and watching found, and the feature store's vectors. Fields beyond those
listed pass (the daemon's and the loader's counters are many and grow).
"""

from __future__ import annotations

from gpuos_tools.stream.records import COUNT, register_output
from gpuos_tools.stream.schema import Anything, Bool, Either, Field, Int, List, Map, Num, RecordType, Str

_SECONDS = Num(0, unit="s")
_US = Num(0, unit="µs")
_FRACTION = Num(0, 1)

KINFER_STATS = RecordType("kinfer_stats", "(serve) the daemon's counters when it stops.", (
    Field("ring", Str(), "the ring's file", required=True), Field("seconds", _SECONDS, "how long it served"),
    Field("native", Bool(), "the native serving loop ran"), Field("gpu_delay_us", _US, null=True),
    Field("gpu_probes", COUNT), Field("cpu_extra_us", Num(), null=True), Field("ring_repairs", COUNT),
))
KINFER_STATUS = RecordType("kinfer_status", "(status) a ring: its geometry, its daemon, its slots.", (
    Field("ring", Str(), required=True), Field("version", COUNT), Field("lanes", COUNT),
    Field("slots_per_lane", COUNT), Field("daemon_pid", COUNT), Field("daemon_alive", Bool()),
    Field("model_generation", COUNT), Field("slots", Map(COUNT), "slots per state"), Field("counters", Map()),
))
KINFER_ANSWER = RecordType("kinfer_answer", "(infer) the daemon's answer to one input record.", (
    Field("status", Either((Str(), Int(0, 255))), "ok, or why not (its number when unnamed)", required=True),
    Field("decision", Anything(), "the model's class"), Field("outputs", List(Anything())),
    Field("batch", COUNT, "inputs in the batch it ran in"), Field("where", Str(("gpu", "cpu"))),
    Field("latency_us", _US, "the round trip"),
))
KINFER_CALIBRATION = RecordType("kinfer_calibration", "(calibrate) the measured CPU and GPU costs and the batch "
                                "size where the GPU wins.", (
    Field("crossover", Anything(), "the batch size from which the GPU is faster", required=True),
))
KINFER_TRAIN = RecordType("kinfer_train", "(train) the LinnOS model fitted to a trace.", (
    Field("reads", COUNT, required=True), Field("train_reads", COUNT), Field("threshold_us", _US),
    Field("label", Str()), Field("slow_fraction", _FRACTION), Field("loss", List(Num())),
    Field("train", Map(), "accuracy and error rates on the training reads"),
    Field("holdout", Map(), "the same on the reads held out", null=True),
))
KINFER_REPLAY = RecordType("kinfer_replay", "(replay) a trace's reads with and without the model's rerouting.", (
    Field("reads", COUNT, required=True), Field("devices", COUNT), Field("threshold_us", _US),
    Field("slow_fraction", _FRACTION), Field("inference_us", _US), Field("reroute_us", _US),
    Field("replica", Str()), Field("rerouted", _FRACTION), Field("accuracy", _FRACTION),
    Field("false_fast", _FRACTION), Field("false_slow", _FRACTION),
))
KINFER_COLLECT = RecordType("kinfer_collect", "(collect --source ebpf, watch) how the capture ended, after "
                            "its other records.", (
    Field("reason", Str(), "why it stopped", required=True), Field("seconds", _SECONDS), Field("reads", COUNT),
    Field("records", COUNT), Field("disks", Anything(), "the disks seen"), Field("program_status", Anything()),
))
KINFER_WATCH = RecordType("kinfer_watch", "(watch) one disk's reads over an interval, or in all.", (
    Field("scope", Str(("interval", "total")), required=True), Field("disk", Str(), required=True),
    Field("seconds", _SECONDS), Field("threshold_us", _US),
))
FEATURE = RecordType("feature", "(features window) one stored feature vector, oldest first.", (
    Field("seq", COUNT, required=True), Field("ts_ns", COUNT, required=True), Field("x", List(Num()), required=True),
))

#: Every record type gpu-kinfer-bridge writes besides `io`, the header and in-band errors.
TYPES = (KINFER_STATS, KINFER_STATUS, KINFER_ANSWER, KINFER_CALIBRATION, KINFER_TRAIN, KINFER_REPLAY, KINFER_COLLECT,
         KINFER_WATCH, FEATURE)
register_output(*TYPES)
