"""Module variables the program located by name (gpuos_tools/access/variables.py) and the
predictor following the pointers the host stored in them. The end-to-end cases are on recorded
and stand-in traces: tests/test_access_validation.py (cuFFT on an H100) and
tests/test_intercept_agent.py (both tracer front ends on the stand-in driver)."""

from __future__ import annotations

from gpuos_tools.access.predict import Predictor
from gpuos_tools.access.variables import ModuleVariables

MOD_A, MOD_B = 0xA000, 0xB000
F_A, F_B = 0xA010, 0xB010
BUF, TABLE = 0x7F0000000000, 0x7F0000100000


def symbol(of: str, parent: int, name: str, **kw) -> dict:
    return {"type": "symbol", "of": of, "parent": parent, "name": name, "api": "cuModuleGetGlobal_v2", **kw}


def host_copy(dst: int, data: bytes) -> dict:
    return {"type": "memcpy", "dir": "HtoD", "dst": dst, "src": 0x1000, "bytes": len(data), "data": data.hex()}


def launch(func: int, *words: int) -> dict:
    return {"type": "launch", "kernel": "k", "func": func, "layout": "cuFuncGetParamInfo",
            "params": [{"size": 8, "hex": w.to_bytes(8, "little").hex()} for w in words]}


def test_a_variable_of_unknown_size_holds_only_the_writes_that_start_at_it():
    v = ModuleVariables()
    v.symbol(symbol("variable", MOD_A, "lut", addr=0x5000))
    assert v.write(0x5000, 8, TABLE.to_bytes(8, "little"))
    assert not v.write(0x5008, 8, b"\1" * 8)  # past what is known of it: someone else's bytes
    assert list(v.find(0x5000).words()) == [TABLE]
    v.write(0x5000, 8, None)  # overwritten with bytes not known (a memset)
    assert list(v.find(0x5000).words()) == []


def test_a_sized_variable_keeps_pieces_and_reads_only_aligned_words():
    v = ModuleVariables()
    v.symbol(symbol("variable", MOD_A, "ptrs", addr=0x6000, bytes=32))
    v.write(0x6008, 8, TABLE.to_bytes(8, "little"))
    v.write(0x6010, 12, b"\0\0\0\0" + BUF.to_bytes(8, "little"))  # BUF at 0x6014: not aligned
    assert list(v.find(0x601F).words()) == [TABLE]
    assert v.find(0x6020) is None


def test_a_module_loaded_where_another_was_replaces_its_variables():
    v = ModuleVariables()
    v.symbol(symbol("variable", MOD_A, "lut", addr=0x5000))
    v.write(0x5000, 8, TABLE.to_bytes(8, "little"))
    v.symbol(symbol("function", MOD_A, "k", func=F_A))
    v.symbol(symbol("variable", MOD_B, "lut", addr=0x5000))  # A unloaded, B loaded at its place
    v.symbol(symbol("function", MOD_B, "k", func=F_B))
    assert v.of_function(F_A) == [] and [x.parent for x in v.of_function(F_B)] == [MOD_B]
    assert list(v.find(0x5000).words()) == []  # B's variable holds nothing known yet


def test_each_module_instance_reads_its_own_variable():
    """Two copies of one module (same kernel name, two function handles): each kernel reads
    what its own module's variable points to, and the memo does not mix them up."""
    p = Predictor("range")
    for rec in ({"type": "alloc", "id": 1, "addr": BUF, "size": 4096, "kind": "device"},
                {"type": "alloc", "id": 2, "addr": TABLE, "size": 1 << 20, "kind": "device"},
                symbol("variable", MOD_A, "lut", addr=0x5000), symbol("function", MOD_A, "k", func=F_A),
                symbol("variable", MOD_B, "lut", addr=0x5100), symbol("function", MOD_B, "k", func=F_B),
                host_copy(0x5000, TABLE.to_bytes(8, "little"))):
        acc = p.feed(rec)
        if rec["type"] == "memcpy":
            assert acc["writes"] == [] and not acc["unknown"]
    a = p.feed(launch(F_A, BUF))
    b = p.feed(launch(F_B, BUF))
    assert [(e["alloc"], e["how"]) for e in a["reads"]] == [(1, "scan:untyped"), (2, "variable:lut")]
    assert [(e["alloc"], e["how"]) for e in b["reads"]] == [(1, "scan:untyped")]
    p.feed(host_copy(0x5100, (TABLE + 512).to_bytes(8, "little")))  # now B's points into the table too
    b = p.feed(launch(F_B, BUF))
    assert {"alloc": 2, "offset": 512, "size": (1 << 20) - 512, "how": "variable:lut"} in b["reads"]
    # a copy to an address that is neither an allocation nor a located variable stays unknown
    assert p.feed(host_copy(0x9000, b"\0" * 8))["unknown"]
