#!/usr/bin/env python3
"""Which driver calls a program makes to find and fill its modules' ``__device__`` variables, on
the GPU: the evidence for tracing module variables (docs/validation.md, "Module variables").

cuFFT loads small JIT-compiled modules and writes, from the host, the address of a table it
allocated into a variable of each module; a kernel of that module then reads the table through
the variable. To follow that pointer, the tracer must know where each module's variables lie,
and that depends on how the program asks for them (cuModuleGetGlobal, cuLibraryGetGlobal, the
runtime's symbol calls, which end in one of those).

Usage: probe_module_globals.py OUT.json -- PROGRAM.py [ARGS...]

Runs PROGRAM in this process under a CUPTI subscriber of the whole driver domain and writes:
- ``calls``: every driver function the program called, with counts;
- ``globals``: each cuModuleGetGlobal*/cuLibraryGetGlobal answer (name, address, size, handle);
- ``small_host_copies``: host-to-device copies of at most 64 bytes (destination, bytes, the
  first 8 bytes as a number), with the variable they land in when one was asked for before.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import runpy
import struct
import sys
from collections import Counter

_MEM = memoryview((ctypes.c_char * (1 << 47)).from_address(0)).cast("B")
_CBDATA = struct.Struct("<I4xQQQ").unpack_from  # site, functionParams, functionReturnValue (as in tracer.py)
_Q4 = struct.Struct("<QQQQ").unpack_from
_U64 = struct.Struct("<Q").unpack_from
_I32 = struct.Struct("<i").unpack_from


def _cstr(addr: int) -> str:
    return ctypes.string_at(addr).decode(errors="replace") if addr else ""


def main() -> int:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    out, prog, args = sys.argv[1], sys.argv[3], sys.argv[4:]
    from cupti import cupti

    names = {int(m): m.name for m in cupti.driver_api_trace_cbid}
    calls: Counter[str] = Counter()
    found: list[dict] = []
    copies: list[dict] = []

    def callback(userdata, domain, cbid, cbdata):
        try:
            site, _, pp, rp = _CBDATA(_MEM, cbdata.ptr)
            name = names.get(cbid, str(cbid))
            if site == 0:
                calls[name] += 1
                if name.startswith(("cuMemcpyHtoD", "cuMemcpy_", "cuMemcpyAsync")) or name == "cuMemcpy":
                    dst, src, size = _Q4(_MEM, pp)[:3]
                    if 0 < size <= 64:
                        # only a HtoD call's source is surely host memory; cuMemcpy's may be device
                        first = (int.from_bytes(bytes(_MEM[src:src + min(size, 8)]), "little")
                                 if name.startswith("cuMemcpyHtoD") else None)
                        copies.append({"api": name, "dst": dst, "bytes": size, "first_u64": first})
                return
            if "GetGlobal" in name and rp and _I32(_MEM, rp)[0] == 0:
                dptr_p, bytes_p, handle, name_p = _Q4(_MEM, pp)
                found.append({"api": name, "name": _cstr(name_p), "handle": handle,
                              "addr": _U64(_MEM, dptr_p)[0] if dptr_p else None,
                              "bytes": _U64(_MEM, bytes_p)[0] if bytes_p else None})
        except Exception as exc:  # never break the program
            calls[f"probe error: {type(exc).__name__}: {exc}"] += 1

    sub = cupti.subscribe(callback, None)
    cupti.enable_domain(1, sub, cupti.CallbackDomain.DRIVER_API)

    def write() -> None:
        cupti.unsubscribe(sub)  # before the driver tears down (it crashed at exit without)
        for c in copies:
            for g in found:
                if g["addr"] is not None and g["bytes"] and g["addr"] <= c["dst"] < g["addr"] + g["bytes"]:
                    c["variable"] = g["name"]
        with open(out, "w") as f:
            json.dump({"program": [prog, *args], "calls": dict(calls.most_common()), "globals": found,
                       "small_host_copies": copies}, f, indent=1)

    atexit.register(write)
    sys.argv = [prog, *args]
    runpy.run_path(prog, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
