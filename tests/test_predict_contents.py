"""The predictor's known device contents (pointer arrays copied from the host), kept as sorted,
non-overlapping pieces per allocation: checked against a byte-by-byte model of the memory
under random copies and memsets (a piece partly overwritten is forgotten whole, so what is
known is a subset of the truth, and always holds the last copy), and a pointer stored in them
is followed."""

import random
import struct

from gpuos_tools.access.predict import STORED, Predictor

BASE = 0x7F00_0000_0000
SIZE = 1 << 16


def model_apply(model: dict[int, int], off: int, n: int, data: bytes | None) -> None:
    for k in range(off, off + n):
        model.pop(k, None)
    if data:
        for k, b in enumerate(data):
            model[off + k] = b


def test_pieces_match_a_byte_model_under_random_writes():
    rng = random.Random(5)
    p = Predictor("range")
    p.feed({"type": "alloc", "id": 1, "addr": BASE, "size": SIZE, "kind": "device"})
    model: dict[int, int] = {}
    for step in range(2000):
        off = rng.randrange(0, SIZE - 512)
        n = rng.choice([8, 16, 64, 200, 512])
        if rng.random() < 0.8:
            data = bytes(rng.randrange(256) for _ in range(n))
            p.feed({"type": "memcpy", "dir": "HtoD", "dst": BASE + off, "src": 0, "bytes": n, "data": data.hex()})
        else:
            data = None
            p.feed({"type": "memset", "dst": BASE + off, "bytes": n})
        model_apply(model, off, n, data)
        pieces = p.contents.get(1, [])
        starts = [s for s, _ in pieces]
        assert starts == sorted(starts)
        assert all(s + len(d) <= t for (s, d), t in zip(pieces, starts[1:], strict=False))
        i = next((j for j, (s0, d) in enumerate(pieces) if s0 <= off < s0 + len(d)), None)
        if data:
            assert pieces[i] == (off, data)  # the last copy is known, whole
        else:
            assert i is None and not any(off < s0 < off + n for s0 in starts)
        if step % 50 == 0 or step == 1999:
            known = {s + k: b for s, d in pieces for k, b in enumerate(d)}
            assert all(model.get(k) == b for k, b in known.items())  # nothing stale


def test_a_pointer_stored_in_a_piece_is_followed():
    p = Predictor("range")
    p.feed({"type": "alloc", "id": 1, "addr": BASE, "size": SIZE, "kind": "device"})
    p.feed({"type": "alloc", "id": 2, "addr": BASE + (1 << 20), "size": 4096, "kind": "device"})
    for k in range(50):  # other pieces around it
        p.feed({"type": "memcpy", "dir": "HtoD", "dst": BASE + 1024 * k, "src": 0, "bytes": 8,
                "data": struct.pack("<q", k).hex()})
    table = struct.pack("<QQ", 7, BASE + (1 << 20))
    p.feed({"type": "memcpy", "dir": "HtoD", "dst": BASE + 1024 * 20 + 64, "src": 0, "bytes": 16, "data": table.hex()})
    rec = {"kernel": "_Z1kPPf", "params": [{"size": 8, "hex": struct.pack("<Q", BASE + 1024 * 20 + 64).hex()}]}
    acc, _, found = p.launch(rec)
    assert any(f.found == STORED and f.alloc.id == 2 for f in found)
    assert 2 in {e["alloc"] for e in acc["reads"]}
