"""gpu-predict-access(1) beyond --help: its records, the report, validation and templates, examples."""

from __future__ import annotations

from gpuos_tools.access import __doc__ as _access_doc
from gpuos_tools.access.templates import __doc__ as _templates_doc
from gpuos_tools.stream.records import ACCESS, ACCESS_TEMPLATE
from gpuos_tools.stream.schema import render

_REST = _access_doc.split("\n\n", 2)[2]
_TEMPLATE_REST = _templates_doc.split("\n\n", 3)[3]

SECTIONS = {
    "RECORDS": (
        "After each `launch`, `memcpy`, `memset` and `graph_launch` record (which pass through "
        "unchanged, as every other record does) comes one `access` record (`?` marks a field that "
        "may be absent):\n\n"
        + render([ACCESS])
        + "\n\n"
        + _REST.strip("\n")
    ),
    "REPORT": (
        "`--report` reads the whole trace and writes, instead of the stream, one `access_report` "
        "record per kernel (then one each for all memcpys, memsets and graph launches): `of`, "
        "`kernel` (mangled), `name` (demangled), `granularity`, `launches`, `captured`, "
        "`reads_per_launch` and `writes_per_launch` (buffers, mean), `bytes_read` and "
        "`bytes_written` (summed over launches at the chosen granularity), `unknown` (launches) "
        "and `why` ({reason: launches}). On a terminal it draws a table instead.\n\n"
        "`--explain SEQ` writes one `access_explain` record for the launch with that `seq`: each "
        "parameter's offset, size, type and basis; each pointer word with its parameter, offset, "
        "value, how it was found, the allocation and offset it lies in and the decision; and the "
        "`access` record. On a terminal it prints the same as text."
    ),
    "VALIDATION": (
        "`gpu-trace run --validate` checks these predictions on the GPU for sampled launches "
        "(see gpu-trace(1)) and puts a `validation` record after each launch it checked. On "
        "such a trace each launch's `access` record gains `validated`: `writes` and `reads` "
        "(\"ok\", \"missed\", \"unknown\", \"nondeterministic\", \"skipped\" or \"unchecked\"), "
        "`missed_write_bytes`, `extra_write_bytes`, `written_bytes`, and where read extents were "
        "measured `read_bytes`, `missed_read_bytes`, `extra_read_bytes`; `--report` adds per "
        "kernel a `validation` object with the same sums and draws a table of them. The prediction "
        "scored is this command's, at its granularity and with its templates, against what the "
        "GPU showed, in 128-byte chunks.\n\n"
        "`--learn` writes size templates (`access_template` records) fitted to the read and write "
        "extents in the validation records; `--templates FILE` uses them at range granularity:\n\n"
        + render([ACCESS_TEMPLATE])
        + "\n\n" + _TEMPLATE_REST.strip("\n")
    ),
    "NOTES": (
        "Without validation this is speculation (as PhOS does it): directions come from the "
        "demangled prototype (const pointer: read; anything else: read and write), and launch "
        "ranges run to the end of the allocation unless a size template says otherwise, so range "
        "and alloc predictions err on the side of too much. Templates learned at one program size "
        "are tighter but can miss accesses at another size, so use templates where being tight "
        "matters more than being safe, and validate them.\n\n"
        "Pointers inside by-value structs are found, and pointer arrays copied from the host are "
        "followed; pointers written into device memory by kernels are not (a launch through such "
        "a `T**` parameter is unknown). PyTorch's caching allocator places many tensors in one "
        "allocation, so at `alloc` granularity a PyTorch kernel usually reads and writes the "
        "whole segment."
    ),
    "EXAMPLES": (
        "Annotate a trace as it is recorded and keep the launches that may write allocation 3:\n\n"
        "    gpu-trace run -- python3 train.py | gpu-predict-access | \\\n"
        "      jq -c 'select(.type==\"access\" and any(.writes[]; .alloc==3))'\n\n"
        "Per-kernel summary of a recorded trace:\n\n"
        "    gpu-predict-access --report trace.ndjson.zst\n\n"
        "Why launch 14 was predicted as it was:\n\n"
        "    gpu-predict-access --explain 14 trace.ndjson.zst\n\n"
        "Validate on the GPU, learn size templates, then score them on a run at another size:\n\n"
        "    gpu-trace run --validate -o small.ndjson.zst -- python3 step.py --batch 16\n"
        "    gpu-predict-access --learn small.ndjson.zst -o step.templates\n"
        "    gpu-trace run --validate -o big.ndjson.zst -- python3 step.py --batch 32\n"
        "    gpu-predict-access --templates step.templates --report big.ndjson.zst"
    ),
    "SEE ALSO": "gpu-trace(1)",
}
