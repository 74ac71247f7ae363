"""The record types that gpuos-tools commands read, as data (gpuos_tools.stream.schema).

Every reader checks every record of these types as it reads it (``open_input``), and the man
pages list them from here: the header and in-band errors every stream shares; what `gpu-trace`
writes (a traced program's allocations, launches, copies, modules, graphs, validation results
and exit); what `gpu-predict-access` adds (`access`) and learns (`access_template`); and the
block-I/O records of `gpu-kinfer-bridge` traces (`io`).

Addresses, handles and sizes are JSON integers (device pointers fit in 64 bits). Times are
nanoseconds of CLOCK_MONOTONIC in ``ts``; ``tid`` is the native thread id of the caller.
"""

from __future__ import annotations

from typing import Any

from gpuos_tools.stream.framing import SCHEMA
from gpuos_tools.stream.schema import (
    I63,
    U64,
    Anything,
    Bool,
    Checker,
    Either,
    Field,
    Hex,
    Int,
    Kind,
    List,
    Map,
    Num,
    Obj,
    Problem,
    RecordType,
    Registry,
    Str,
    Tuple,
    _show,
    when_present,
)
from gpuos_tools.units import MAX_BYTES

# -- the kinds of value fields share ---------------------------------------------------------

ADDR = Int(0, U64, "address")
HANDLE = Int(0, U64, "handle")
BYTES = Int(0, MAX_BYTES, "bytes")
COUNT = Int(0, I63)
TS = Int(0, I63, "ns")
#: CUDA passes at most 32 KiB of kernel arguments
PARAM_INDEX = Int(0, 1 << 15)
PARAM_OFFSET = Int(0, 1 << 16)
U32 = Int(0, (1 << 32) - 1)
SHA256 = Str(pattern="sha256:[0-9a-f]{64}", form='"sha256:<64 hex digits>"')
NAME = Str(max_len=1 << 16)
RANGE = Tuple((ADDR, BYTES), ("addr", "bytes"))
RANGES = List(RANGE)


def _common() -> tuple[Field, ...]:
    return (Field("ts", TS, "when it happened (CLOCK_MONOTONIC)"),
            Field("tid", COUNT, "the native thread id of the caller"),
            Field("api", NAME, "the driver call"))


# -- cross-field checks ------------------------------------------------------------------------


def _ends_in_64_bits(addr: str, size: str) -> Any:
    end = U64 + 1

    @when_present(addr, size)
    def check(rec: dict[str, Any]) -> Problem:
        a, n = rec.get(addr), rec.get(size)
        if a is not None and n is not None and a + n > end:
            return size, f"runs past the end of the 64-bit address space ({addr} {a:#x} + {n})"
        return None

    return check


@when_present("params", "dptrs")
def _launch_arguments(rec: dict[str, Any]) -> Problem:
    """No parameter holds more bytes than its size (fewer: the capture was cut short); each
    driver pointer lies inside the bytes of a parameter."""
    params = rec.get("params") or ()
    for p in params:  # the common case, without bookkeeping; a problem is found again below
        hexs = p.get("hex")
        if hexs is not None and (size := p.get("size")) is not None and len(hexs) > 2 * size:
            break
    else:
        n = len(params)
        for param, offset, _memtype in rec.get("dptrs") or ():
            if param >= n:
                break
            p = params[param]
            hexs = p.get("hex")
            length = len(hexs) // 2 if hexs is not None else p.get("size")
            if length is None or offset + 8 > length:
                break
        else:
            return None
    return _launch_arguments_problem(params, rec.get("dptrs") or ())


def _launch_arguments_problem(params: Any, dptrs: Any) -> Problem:
    lengths = []
    for i, p in enumerate(params):
        hexs = p.get("hex")
        size = p.get("size")
        if hexs is not None and size is not None and len(hexs) > 2 * size:
            return f"params[{i}].hex", f"holds {len(hexs) // 2} bytes, but size says {size}"
        lengths.append(len(hexs) // 2 if hexs is not None else size)
    for k, (param, offset, _memtype) in enumerate(dptrs):
        if param >= len(lengths):
            return f"dptrs[{k}]", f"names parameter {param}, but the launch has {len(lengths)}"
        if lengths[param] is None or offset + 8 > lengths[param]:
            return f"dptrs[{k}]", f"an 8-byte word at offset {offset} does not fit in parameter {param}"
    return None


@when_present("height")
def _copy_shape(rec: dict[str, Any]) -> Problem:
    """A 2-D copy spans at most 256 TiB (a zero width or height is a copy of nothing)."""
    width, height = rec.get("width") or 0, rec.get("height") or 0
    if height > 1 and (height - 1) * max(rec.get("src_pitch") or width, rec.get("dst_pitch") or width) + width \
            > MAX_BYTES:
        return "height", "the copy spans more than 256 TiB"
    return None


@when_present("height")
def _memset_shape(rec: dict[str, Any]) -> Problem:
    height, pitch = rec.get("height") or 0, rec.get("pitch") or 0
    if height > 1 and (height - 1) * pitch > MAX_BYTES:
        return "pitch", "the memset spans more than 256 TiB"
    return None


class SizeExpr(Kind):
    """A size template's expression: {"const": n}, {"scale": k, "args": [[param, offset,
    width], ...]}, or {"max": [one of those, ...]}."""

    text = 'null or {"const": bytes} | {"scale": k, "args": [[param, offset, width], ...]} | {"max": [...]}'

    def checker(self) -> Checker:
        arg = Tuple((PARAM_INDEX, PARAM_OFFSET, Int(1, 8)), ("param", "offset", "width")).checker()
        scale = Int(0, MAX_BYTES).checker()
        const = BYTES.checker()

        def simple(value: Any) -> Problem:
            if value.__class__ is not dict:
                return "", f"must be an object, not {_show(value)}"
            if "const" in value:
                p = const(value["const"])
                return None if p is None else (".const" + p[0], p[1])
            if "scale" in value:
                p = scale(value["scale"])
                if p is not None:
                    return ".scale" + p[0], p[1]
                args = value.get("args")
                if args.__class__ is not list or not 1 <= len(args) <= 8:
                    return ".args", "must be a list of 1 to 8 [param, offset, width]"
                for i, a in enumerate(args):
                    p = arg(a)
                    if p is not None:
                        return f".args[{i}]{p[0]}", p[1]
                return None
            return "", 'must have "const", "scale" or "max"'

        def check(value: Any) -> Problem:
            if value.__class__ is dict and "max" in value:
                options = value["max"]
                if options.__class__ is not list or not 1 <= len(options) <= 64:
                    return ".max", "must be a list of 1 to 64 expressions"
                for i, v in enumerate(options):
                    p = simple(v)
                    if p is not None:
                        return f".max[{i}]{p[0]}", p[1]
                return None
            return simple(value)

        return check


# -- the types ---------------------------------------------------------------------------------

HEADER = RecordType(
    "header", "the first record of every stream; it announces the schema once for all of it.",
    (
        Field("schema", Str((SCHEMA,)), "the format's version; a reader refuses one it does not know",
              required=True),
        Field("tool", NAME, "the program that wrote the stream"),
        Field("version", NAME, "its version"),
        Field("host", NAME, "the machine"),
        Field("pid", COUNT, "the traced or served process", null=True),
        Field("argv", List(Str()), "its command line"),
        Field("gpus", List(Obj((Field("index", COUNT), Field("uuid", NAME), Field("name", NAME),
                                Field("memory", BYTES)))), "the GPUs it could see"),
        Field("images", Str(), "the side directory of module images: relative to the stream file's "
              "directory, absolute when the stream went to standard output; null without images", null=True),
    ),
    note="Each tool adds fields of its own (the tracer: `driver` (the NVIDIA driver's version), `cuda` (the "
    "CUDA driver API version), `python`, `cupti` (null when CUPTI was not loaded), `backend` (native, python, or native-agent: the agent on its native core), "
    "`mechanism` (how the driver calls were seen: cupti, or intercept: the agent's preloaded interposer), `agent` {socket, mechanism} "
    "with `--agent`, `validate` {samples, max_bytes, extents, in} with `--validate`; other tools their options).",
)

ERROR = RecordType(
    "error", "a problem reported in-band: the stream goes on.",
    (
        Field("message", Str(), "what went wrong", required=True),
        Field("source", Str(), "who saw it: the tracer, or the file a bad line was read from"),
        Field("line", Int(1, I63), "the bad line's number, for an error from a reader"),
        Field("ts", TS),
    ),
)

ALLOC = RecordType(
    "alloc", "an allocation the program made.",
    (
        *_common(),
        Field("id", COUNT, "its id in this stream; `free` and `access` records name it", required=True),
        Field("addr", ADDR, "its first byte", required=True),
        Field("size", BYTES, required=True),
        Field("kind", NAME, "device, pitch, managed, async, pool, host (pinned host memory) or vmm"),
        Field("stream", HANDLE, "the stream of a stream-ordered allocation"),
    ),
    (_ends_in_64_bits("addr", "size"),),
)

FREE = RecordType(
    "free", "an allocation released.",
    (
        *_common(),
        Field("id", COUNT, "the allocation's id; null when the address was never seen allocated", null=True),
        Field("addr", ADDR, required=True),
        Field("size", BYTES),
        Field("stream", HANDLE),
    ),
)

PARAM = Obj((
    Field("offset", PARAM_OFFSET, "where the parameter starts in the argument buffer"),
    Field("size", PARAM_OFFSET, "its bytes"),
    Field("hex", Hex(1 << 16), "its bytes as passed"),
), text="{offset, size, hex}")

LAUNCH = RecordType(
    "launch", "a kernel launch.",
    (
        *_common(),
        Field("seq", COUNT, "its number in the stream, from 1; `access` and `validation` records name it",
              required=True),
        Field("func", HANDLE, "the CUfunction"),
        Field("kernel", Str(max_len=1 << 20), "the mangled name"),
        Field("name", Str(max_len=1 << 20), "the demangled name"),
        Field("grid", List(U32, length=3)),
        Field("block", List(U32, length=3)),
        Field("smem", U32, "dynamic shared memory bytes"),
        Field("stream", HANDLE),
        Field("layout", NAME, "where the parameter layout came from: cuFuncGetParamInfo, "
              "cuKernelGetParamInfo, nv.info, or none (arguments not decoded)"),
        Field("params", List(PARAM, max_len=1 << 15), "the arguments, one per parameter"),
        Field("module", SHA256, "the content hash of the module image it came from"),
        Field("result", Int(0, (1 << 32) - 1), "the CUresult, only when the launch failed"),
        Field("captured", Bool(), "true when the stream was being captured into a CUDA graph: the kernel "
              "did not run then; it runs with each `graph_launch` of that graph"),
        Field("dptrs", List(Tuple((PARAM_INDEX, PARAM_OFFSET, Anything()),
                                  ("param", "offset", '"device"|"unified"')), max_len=1 << 12),
              "with `--check-pointers`: the argument words the driver itself says are device pointers"),
    ),
    (_launch_arguments,),
)

MEMCPY = RecordType(
    "memcpy", "a copy.",
    (
        *_common(),
        Field("dir", Str(("HtoD", "DtoH", "DtoD", "HtoH", "default", "peer")), required=True),
        Field("dst", ADDR, required=True),
        Field("src", ADDR, required=True),
        Field("bytes", BYTES, required=True),
        Field("stream", HANDLE),
        Field("async", Bool()),
        Field("width", BYTES, "2-D copies: bytes per row"),
        Field("height", BYTES, "2-D copies: rows"),
        Field("src_pitch", BYTES),
        Field("dst_pitch", BYTES),
        Field("data", Hex(4096), "the bytes of a copy from host memory of at most 4096 bytes (how "
              "pointer arrays are seen)"),
    ),
    (_ends_in_64_bits("dst", "bytes"), _ends_in_64_bits("src", "bytes"), _copy_shape),
)

MEMSET = RecordType(
    "memset", "a memset.",
    (
        *_common(),
        Field("dst", ADDR, required=True),
        Field("bytes", BYTES, "in all", required=True),
        Field("value", U32),
        Field("elem", Int(1, 4), "bytes per element: 1, 2 or 4"),
        Field("stream", HANDLE),
        Field("async", Bool()),
        Field("height", BYTES, "2-D memsets: rows"),
        Field("pitch", BYTES, "2-D memsets: bytes from one row to the next"),
    ),
    (_ends_in_64_bits("dst", "bytes"), _memset_shape),
)

MODULE = RecordType(
    "module", "a module image the driver loaded.",
    (
        *_common(),
        Field("id", COUNT),
        Field("hash", SHA256, "its content hash"),
        Field("size", BYTES),
        Field("file", Str(max_len=4096), "its file, relative to the header's `images` directory"),
        Field("format", NAME, "cubin, fatbin, ptx or unknown"),
        Field("kernels", List(Str(max_len=1 << 20), max_len=1 << 20), "the mangled names of its kernels"),
    ),
)

LIBRARY = RecordType(
    "library", "a library loaded from memory (cubins reach the trace as `module` records once the "
    "driver loads them).",
    (
        *_common(),
        Field("format", NAME),
        Field("size", Int(0, U64, "bytes"), "as the image's header says"),
        Field("hash", SHA256, "PTX only"),
        Field("file", Str(max_len=4096), "PTX only"),
    ),
)

SYMBOL = RecordType(
    "symbol", "the program looked up a module's (or library's) variable or function by name; a "
    "kernel reads its module's variables, which is how pointers stored in them are followed.",
    (
        *_common(),
        Field("of", Str(("variable", "function")), required=True),
        Field("name", NAME, required=True),
        Field("parent", HANDLE, "the module or library it was looked up in", required=True),
        Field("addr", ADDR, "variable: its device address"),
        Field("bytes", BYTES, "variable: its size, when the program asked for it"),
        Field("func", HANDLE, "function: the handle launches name"),
    ),
)

STREAM = RecordType(
    "stream", "a stream created or destroyed.",
    (
        *_common(),
        Field("stream", HANDLE, required=True),
        Field("event", Str(("create", "destroy")), required=True),
    ),
)

GRAPH_LAUNCH = RecordType(
    "graph_launch", "an executable graph launched.",
    (
        *_common(),
        Field("graph", HANDLE, "the executable graph", required=True),
        Field("stream", HANDLE),
    ),
)

GRAPH = RecordType(
    "graph", "stream capture and graph instantiation.",
    (
        *_common(),
        Field("event", Str(("capture_begin", "capture_end", "instantiate")), required=True),
        Field("stream", HANDLE, "the stream captured (capture_begin, capture_end)"),
        Field("graph", HANDLE, "the graph captured (capture_end) or instantiated"),
        Field("exec", HANDLE, "the executable graph that `graph_launch` names (instantiate)"),
    ),
)

EXTENT = Obj((
    Field("param", PARAM_INDEX, required=True),
    Field("offset", PARAM_OFFSET, required=True),
    Field("ptr", ADDR, required=True),
    Field("limit", BYTES, "bytes from the pointer to the end of its allocation", required=True),
    Field("read", BYTES, "bytes past the pointer read, chunk-rounded", required=True),
    Field("written", BYTES, "bytes past the pointer written, chunk-rounded"),
    Field("steps", COUNT),
    Field("in_place", COUNT, "bisection steps whose read only the bytes the control run wrote showed (an "
          "update in place; absent: those bytes were not compared)"),
    Field("in_place_zeros", COUNT, "steps of the second bisection, over zeros the launch updated in place "
          "poisoned non-zero, that showed a read (validator process only; absent: not run, or its run "
          "failed)"),
), text="{param, offset, ptr, limit, read, written, steps, in_place, in_place_zeros}")

VALIDATION = RecordType(
    "validation", "with `--validate`: how a sampled launch's predicted accesses compared with what it did "
    "on the GPU; follows the launch.",
    (
        *_common(),
        Field("seq", COUNT, "the launch's", required=True),
        Field("kernel", Str(max_len=1 << 20)),
        Field("checked", Bool(), "false: skipped, see why", required=True),
        Field("predicted", Obj((Field("reads", RANGES), Field("writes", RANGES), Field("unknown", Bool())),
                               text="{reads, writes, unknown}"),
              "the range prediction made in the program"),
        Field("chunk", Int(1, 1 << 30), "bytes per hashed chunk"),
        Field("checked_bytes", BYTES),
        Field("written", RANGES, "the chunks whose contents changed"),
        Field("missed_writes", RANGES, "written outside the predicted writes"),
        Field("mode", Str(("process", "validator")), "where the launch was replayed (absent: in the program, "
              "`--validate-in process`)"),
        Field("fault", Str(max_len=200), "the error the replay ended with (an illegal address: an access "
              "outside every mapped granule of the prediction)"),
        Field("read_only", Str(("enforced", "refused")), "whether the driver mapped the granules holding only "
              "predicted reads read-only for the replay (refused: a write to them shows as a changed chunk)"),
        Field("reads", Str(("ok", "missed", "nondeterministic", "skipped"))),
        Field("read_effects", RANGES, "output that changed when memory outside the predicted reads was poisoned"),
        Field("extents", List(EXTENT), "bytes past each pointer read and written"),
        Field("stored_pointers", List(Anything())),
        Field("nondeterministic", List(Anything())),
        Field("why", Str()),
        Field("ms", Num(0, unit="ms"), "time the check took"),
        Field("addresses", Str(max_len=32), "`--validate-in validator`: the address strategy of the validator that "
              "answered (how it got the program's addresses)"),
        Field("attributes", List(Int(0, 1 << 31)), "`--validate-in validator`: the launch attributes the replay "
              "launched with, as the program did (CUlaunchAttributeID: 4 a cluster's shape)"),
        Field("refused_by", Str(("driver", "validator")), "address unavailable: the validator's driver gave "
              "another address where nothing else of the validator's sat, or something of the validator's "
              "sat there"),
        Field("address_fallback", List(Obj((Field("strategy", Str(max_len=32), required=True),
                                            Field("why", Str(), required=True)), text="{strategy, why}")),
              "address strategies that could not get this launch's addresses before the one named by "
              "`addresses`, and why"),
        Field("relocated", Obj((Field("spans", List(List(Int(0, (1 << 64) - 1))), "[program address, size, "
                                      "validator address] of each span replayed away from the program's address",
                                      required=True),
                                Field("pointers", Map(COUNT), "{parameters, memory, variables}: the 8-byte "
                                      "words pointing into a moved span, moved with it", required=True)),
                               text="{spans, pointers}"),
              "`--validate-in validator`: no validator got this launch's addresses, so the replay moved the "
              "spans it could not have and the pointers to them (a pointer built some other way reads the "
              "program's address in the validator: not caught)"),
    ),
)

EXIT = RecordType(
    "exit", "the traced program ended.",
    (
        Field("ts", TS),
        Field("code", Int(-(1 << 31), (1 << 31) - 1), "its exit status; null when a signal ended it", null=True),
        Field("signal", Either((Str(max_len=32), Int(0, 1 << 16))), "the signal that ended it: its name (SIGKILL) as gpu-trace writes it, or its number"),
        Field("complete", Bool(), "the tracer said goodbye"),
        Field("records", Map(COUNT), "{type: count}"),
        Field("wall_s", Num(0, unit="s")),
        Field("tracer", Map(), "{callbacks, errors, functions, and on the native path callback_ns; under the agent's native core its counters, core}"),
    ),
)

ENTRY = Obj((
    Field("alloc", COUNT, "the allocation's id", required=True),
    Field("offset", BYTES, required=True),
    Field("size", BYTES, required=True),
    Field("how", Str(max_len=256)),
), text="{alloc, offset, size, how}")

ACCESS = RecordType(
    "access", "what the operation before it reads and writes.",
    (
        Field("of", Str(("launch", "memcpy", "memset", "graph_launch")), required=True),
        Field("seq", COUNT, "launches: the launch's seq", null=True),
        Field("index", COUNT, "memcpy, memset, graph_launch: 1-based count of those records"),
        Field("kernel", Str(max_len=1 << 20), "launches: the mangled kernel name"),
        Field("captured", Bool(), "true: the launch was captured into a CUDA graph and did not run then"),
        Field("graph", HANDLE, "graph_launch"),
        Field("launches", COUNT, "graph_launch: the captured launches it runs"),
        Field("reads", List(ENTRY), required=True),
        Field("writes", List(ENTRY), required=True),
        Field("unknown", Bool(), "true: it may touch any memory", required=True),
        Field("why", Str(), "what made it unknown, or that a failed launch ran nothing"),
        Field("ts", TS, "the `ts` of the record it follows"),
        Field("validated", Map(), "on a `--validate` trace: how the prediction scored"),
    ),
)

ACCESS_TEMPLATE = RecordType(
    "access_template", "a size template: bytes read and written past one pointer argument of a kernel.",
    (
        Field("kernel", Str(max_len=1 << 20), "mangled", required=True),
        Field("param", PARAM_INDEX, required=True),
        Field("offset", PARAM_OFFSET, "where the pointer word is in the parameter", required=True),
        Field("read", SizeExpr(), null=True),
        Field("write", SizeExpr(), null=True),
        Field("samples", COUNT, "validated launches fitted"),
        Field("fits", Map(COUNT), "how many expressions fitted them"),
    ),
    note="`read` and `write` are null when no expression fits (the range then runs to the end of the "
    "allocation). `scale` is k times the product of those unsigned integer words of the arguments; `max` "
    "means the samples could not tell the expressions apart, so the largest value is used; "
    '`{"const": 0}` means the kernel was never seen reading (or writing) there.',
)

IO = RecordType(
    "io", "one block I/O of a gpu-kinfer-bridge trace.",
    (
        Field("dev", Int(0, 1 << 16), "the device", required=True),
        Field("t_us", Num(0, unit="µs"), "issue time from the start", required=True),
        Field("op", Str(("R", "W")), required=True),
        Field("offset", Int(0, I63)),
        Field("size", BYTES),
        Field("pending", Int(0, 1 << 32), "I/Os in flight on the device when it was issued, in 4 KiB units",
              required=True),
        Field("lat_us", Num(0, unit="µs"), "its latency", required=True),
    ),
)

TRACE_TYPES = (ALLOC, FREE, LAUNCH, MEMCPY, MEMSET, MODULE, LIBRARY, SYMBOL, STREAM, GRAPH_LAUNCH, GRAPH, VALIDATION,
               ERROR, EXIT)

#: Every type a reader checks.
INPUT = Registry((HEADER, *TRACE_TYPES, ACCESS, ACCESS_TEMPLATE, IO))


# -- what tools write but no reader checks ---------------------------------------------------------

_OUTPUT: dict[str, Any] = {}
#: the checker of every type a tool may write: INPUT's and those registered
_WRITTEN: dict[str, Any] = dict(INPUT.checkers)


class Passed(dict):  # type: ignore[type-arg]
    """A record of a type with no schema in INPUT, as a reader read it (another tool's, or a newer
    version's): a tool may write it on unchanged (pass-through). A record a tool makes itself is a
    plain dict, and its type must have a schema."""

    __slots__ = ()


def register_output(*types: RecordType) -> None:
    """Add the schemas of record types a higher layer writes (its man page lists them): a tool
    may write no record of a type without one, and with GPUOS_CHECK_RECORDS=1 every record
    written is checked against it."""
    for t in types:
        if t.name in INPUT or _OUTPUT.get(t.name, (t,))[0] is not t:
            raise ValueError(f"record type {t.name!r} defined twice")
        _OUTPUT[t.name] = (t, t.checker())
        _WRITTEN[t.name] = _OUTPUT[t.name][1]


def registered(name: str) -> RecordType | None:
    """The schema of record type ``name``, if any layer imported so far registered one."""
    if name in INPUT:
        return INPUT[name]
    entry = _OUTPUT.get(name)
    return None if entry is None else entry[0]


def check_written(record: dict[str, Any]) -> str | None:
    """None for a record a tool may write, else what is wrong with it: a record of a registered
    type must pass its schema; one of a type without a schema only when a reader read it as it is
    (a ``Passed`` record: pass-through)."""
    kind = record.get("type")
    if kind.__class__ is not str or not kind:
        return INPUT.check(record)  # what is wrong with its type
    checker = _WRITTEN.get(kind)
    if checker is not None:
        return checker(record)
    if record.__class__ is Passed:
        return None
    return (f"type {kind!r} has no schema (register one with gpuos_tools.stream.records.register_output "
            "in the layer that writes it)")
