"""gpu-trace(1) beyond --help: its records, validation, the agent, owned allocations, examples."""

from __future__ import annotations

from gpuos_tools.agent.agent import __doc__ as _agent_doc
from gpuos_tools.agent.control import __doc__ as _control_doc
from gpuos_tools.agent.validate import __doc__ as _validate_doc
from gpuos_tools.commands.cli import MECHANISM_DEFAULT
from gpuos_tools.memory.owned import __doc__ as _owned_doc
from gpuos_tools.stream.records import HEADER, TRACE_TYPES
from gpuos_tools.stream.schema import render

SECTIONS = {
    "RECORDS": (
        "One JSON object per line after the header; addresses, handles and sizes are integers. "
        "Records of the traced program's calls also carry `ts` (when, CLOCK_MONOTONIC "
        "nanoseconds), `tid` (the caller's thread id) and `api` (the driver call). Each record is "
        "listed with its fields, `?` marking those that may be absent; every reader of the stream "
        "checks these types and ranges, and refuses a record that breaks them, naming its line "
        "and field.\n\n" + render([HEADER, *TRACE_TYPES], omit=("ts", "tid", "api"))
    ),
    "EXAMPLES": (
        "Trace a training script into a compressed file, then summarise it:\n\n"
        "    gpu-trace run -o train.ndjson.zst -- python3 train.py --epochs 1\n"
        "    gpu-trace stats train.ndjson.zst\n\n"
        "Follow launches live, one kernel name per line:\n\n"
        "    gpu-trace run -- python3 infer.py | jq -r 'select(.type==\"launch\") | .name'\n\n"
        "Validate a trace against the driver (slow; every pointer-sized argument word is checked):\n\n"
        "    gpu-trace run --check-pointers -o t.ndjson -- python3 step.py"
    ),
    "ENVIRONMENT": (
        "- `GPUOS_IMAGES`: default directory for module images.\n"
        "- `CC`: the C compiler that builds the native tracer (default `cc`).\n"
        "- `GPUOS_AGENT_MECHANISM`: `intercept` or `cupti`: how the agent sees the program's driver calls when "
        "`--mechanism` is not given (`gpu-ckpt run` and `gpu-prefetch-sched run` have no option); without it, "
        f"{MECHANISM_DEFAULT}.\n"
        "- `GPUOS_AGENT_OWN`: `1` makes the program's CuPy and PyTorch allocations go through the "
        "owned allocator (`cupy` or `torch` for one of them; see OWNED ALLOCATIONS); opt-in, default off.\n"
        "- `GPUOS_VALIDATOR_ZYGOTE`: `0` starts every validator of `--validate-in validator` as a fresh "
        "process instead of forking the first from the program before its driver starts (see VALIDATION).\n"
        "- `GPUOS_VALIDATOR_RELOCATE`: `0` leaves a launch whose addresses no validator could have "
        "unvalidated instead of replaying it with those spans moved and the pointers to them rewritten.\n"
        "- `XDG_CACHE_HOME`: the native tracer and the owned allocator are cached in "
        "`$XDG_CACHE_HOME/gpuos-tools` (default `~/.cache/gpuos-tools`)."
    ),
    "NOTES": (
        "`gpu-trace run` exits with the program's own status (128+N when signal N ended it); "
        "the codes below that are 64 or more are gpu-trace's own, and the trace's `exit` record "
        "always says which happened.\n\n"
        "Only the started process is traced, not the programs it starts; a program that forks "
        "stops tracing in the child. The native tracer needs a C compiler once; without one, "
        "`--backend auto` falls back to cupti-python callbacks, which cost far more per launch. Another CUPTI tool (Nsight Systems, a profiler) attached to "
        "the same program prevents tracing. With `--check-pointers` the native path records at "
        "most 64 driver-confirmed pointers per launch (`--backend python` records all of them)."
    ),
    "VALIDATION": _validate_doc.split("\n\n", 1)[1].strip("\n")
    + "\n\n`--validate` runs in the python backend; with its trials a validated launch takes "
    "milliseconds (tens with extents), so sample few launches in big programs "
    "(`--validate-samples`). With `--validate-in validator` the replay runs in a validator process on the "
    "same GPU instead, fed with copies of the launch's predicted inputs, so that a replay that faults or "
    "asserts cannot harm the program (docs/access-prediction.md, \"Where validation runs\"). The "
    "validator replays at the program's own addresses; to get them, the first validators are forked "
    "from a copy of the program made just before its driver started (the interposer, built with the "
    "C compiler, is preloaded for that), fresh processes take over where they cannot, and a launch "
    "the fresh ones cannot have goes back to a validator forked from the copy.",
    "AGENT": _agent_doc.split("\n\n", 1)[1].strip("\n")
    + "\n\n" + _control_doc.split("\n\n", 1)[1].strip("\n"),
    "OWNED ALLOCATIONS": _owned_doc.split("\n\n", 1)[1].strip("\n"),
    "SEE ALSO": "gpu-predict-access(1), gpu-ckpt(1)",
}
