"""The validator process's replay and verdicts (gpuos_tools/agent/replay.py), on a fake GPU."""

from __future__ import annotations

import io
import os
import struct

import numpy as np
import pytest

from fake_vmm import KERNELS, FakeDevice, FakeSpace
from gpuos_tools.agent import replay
from gpuos_tools.agent.replay import EXIT_CONTEXT_LOST, Replayer, spans_of, Region

X, Y = 0x7F0000000000, 0x7F0000010000  # two buffers, far enough apart to sit in separate granules
N = 100  # floats the kernels are told to copy
G = 4096


def staged(x: np.ndarray, y: np.ndarray) -> bytes:
    return x.tobytes() + y.tobytes()


def request(kernel: str, reads, writes, regions, n=N) -> dict:
    return {"kernel": kernel, "function": kernel, "image": "0" * 64, "params": struct.pack("<QQi", X, Y, n).hex(),
            "sizes": [8, 8, 4], "grid": [1, 1, 1], "block": [32, 1, 1], "shared": 0,
            "regions": regions, "reads": reads, "writes": writes}


def plain(kernel: str, dev: FakeDevice | None = None, **kw) -> tuple[dict, FakeDevice]:
    """Replay ``kernel`` under the prediction "reads x[0:N], writes y[0:N]" with x = 0..N-1, y = 0."""
    dev = dev or FakeDevice(KERNELS, G, **kw)
    x = np.arange(N, dtype=np.float32)
    y = np.zeros(N, dtype=np.float32)
    req = request(kernel, [[X, 4 * N]], [[Y, 4 * N]], [[X, 4 * N, 0, "r"], [Y, 4 * N, 4 * N, "w"]])
    return Replayer(dev).replay(req, staged(x, y), b"image"), dev


def no_leaks(dev: FakeDevice) -> None:
    """Nothing mapped or loaded after a replay; reservations only at the program's addresses (kept
    for the next launch)."""
    assert dev.maps == {} and dev.loaded == []
    assert set(dev.reserved) <= {X, Y}, sorted(map(hex, dev.reserved))


def test_spans_round_out_to_granules_and_merge():
    regions = [Region(0x1010, 16, 0, "r"), Region(0x1ff0, 32, 16, "w"), Region(0x9000, 8, 48, "r")]
    assert spans_of(regions, 0x1000) == [(0x1000, 0x2000, False), (0x9000, 0x1000, True)]


def test_a_right_prediction_validates_and_leaves_nothing_mapped():
    rec, dev = plain("copy")
    assert rec["checked"] and rec["mode"] == "validator"
    assert rec["reads"] == "ok" and rec["missed_writes"] == []
    # y's first N floats changed (not the zeros: x[0] = 0 copies a zero), chunk-rounded
    assert rec["written"] == [[Y, 4 * N + (-4 * N) % 128]]
    assert rec["read_only"] == "enforced"
    assert dev.launches == 2  # one run per poison, no third when nothing differs
    no_leaks(dev)


def test_a_write_past_the_prediction_is_a_missed_write():
    rec, dev = plain("copy_and_spill")
    assert rec["checked"]
    # y[N + 32] lies in the chunk after the last one the prediction touches (a partly predicted
    # chunk counts as predicted: writes are judged at chunk granularity)
    assert rec["missed_writes"] == [[Y + 512, 128]]
    no_leaks(dev)


def test_a_read_past_the_prediction_inside_the_granule_is_a_missed_read():
    rec, dev = plain("sum_past")
    assert rec["reads"] == "missed"
    assert rec["read_effects"] == [[Y, 128]]  # the output the poison changed
    assert dev.launches == 3  # the third run tells it from a nondeterministic kernel
    no_leaks(dev)


def test_an_access_outside_every_granule_faults_in_the_validator_and_is_a_missed_access():
    rec, dev = plain("far_read")
    assert rec["checked"] and rec["reads"] == "missed"
    assert rec["fault"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    replayer = Replayer(FakeDevice(KERNELS, G))
    replayer.replay(request("far_read", [[X, 4 * N]], [[Y, 4 * N]], [[X, 4 * N, 0, "r"], [Y, 4 * N, 4 * N, "w"]]),
                    bytes(8 * N), b"image")
    assert replayer.lost  # the context is gone: the process answers, then exits


def test_a_write_to_memory_predicted_read_only_faults_where_the_driver_maps_read_only():
    rec, _ = plain("scribble_input")
    assert rec["fault"] == "CUDA_ERROR_ILLEGAL_ADDRESS" and rec["reads"] == "missed"


def test_without_read_only_mappings_the_write_shows_as_a_changed_chunk():
    rec, dev = plain("scribble_input", read_only=False)
    assert rec["checked"] and "fault" not in rec
    assert rec["read_only"] == "refused"
    assert rec["missed_writes"] == [[X, 128]]
    no_leaks(dev)


def test_a_nondeterministic_kernel_is_not_called_a_missed_read():
    rec, _ = plain("stamp")
    assert rec["reads"] == "nondeterministic"
    assert rec["nondeterministic"] == [[Y, 128]] and "read_effects" not in rec


def test_an_address_the_driver_will_not_give_is_unvalidated_never_guessed():
    rec, dev = plain("copy", taken=(Y,))
    assert rec["checked"] is False
    assert rec["why"].startswith(f"unvalidated: address unavailable ({Y:#x}: ")
    assert dev.launches == 0
    no_leaks(dev)  # the address the driver gave instead was given back
    assert dev.reserved == {X: G}  # X's, made first, is kept for later launches


def test_reservations_are_kept_and_reused_by_later_launches():
    dev = FakeDevice(KERNELS, G)
    replayer = Replayer(dev)
    reserve = dev.reserve
    calls = []
    dev.reserve = lambda addr, size: calls.append(addr) or reserve(addr, size)
    x = np.arange(N, dtype=np.float32)
    req = request("copy", [[X, 4 * N]], [[Y, 4 * N]], [[X, 4 * N, 0, "r"], [Y, 4 * N, 4 * N, "w"]])
    for _ in range(2):
        assert replayer.replay(req, staged(x, np.zeros(N, np.float32)), b"image")["reads"] == "ok"
    assert calls == [X, Y]  # reserved by the first replay only
    # a later launch whose span grows past a kept reservation gets one reservation over both
    wide = request("copy", [[X, 4 * N]], [[X + G, 4 * N]], [[X, 4 * N, 0, "r"], [X + G, 4 * N, 4 * N, "w"]])
    wide["params"] = struct.pack("<QQi", X, X + G, N).hex()
    assert replayer.replay(wide, staged(x, np.zeros(N, np.float32)), b"image")["reads"] == "ok"
    assert replayer.reserved == {X: 2 * G, Y: G} and dev.reserved == {X: 2 * G, Y: G}
    replayer.close()
    assert dev.reserved == {}


def test_the_programs_windows_are_held_and_lifted_only_to_reserve():
    """The validator holds the program's windows with placeholders; a reservation over a
    placeholder would be refused (under UVA the host mapping is in the way), so the replay lifts
    the placeholder of just the span it reserves."""
    space = FakeSpace()
    dev = FakeDevice(KERNELS, G, space=space)
    replayer = Replayer(dev, space)
    replayer.hold([[X, Y - X], [Y, 16 * G]])
    x = np.arange(N, dtype=np.float32)
    req = request("copy", [[X, 4 * N]], [[Y, 4 * N]], [[X, 4 * N, 0, "r"], [Y, 4 * N, 4 * N, "w"]])
    rec = replayer.replay(req, staged(x, np.zeros(N, np.float32)), b"image")
    assert rec["checked"] and rec["reads"] == "ok", rec
    assert space.released == [(X, X + G), (Y, Y + G)]
    assert space.held == [(X + G, Y), (Y + G, Y + 16 * G)]  # the rest still held
    replayer.hold([[X, Y - X], [Y, 16 * G]])  # the next request names the windows again
    assert space.held == [(X + G, Y), (Y + G, Y + 16 * G)]  # never over the reservations kept


def test_an_address_something_else_holds_says_what():
    space = FakeSpace(others=((Y, Y + G),))
    dev = FakeDevice(KERNELS, G, space=space)
    replayer = Replayer(dev, space)
    replayer.hold([[X, 2 * G], [Y, 2 * G]])
    x = np.arange(N, dtype=np.float32)
    req = request("copy", [[X, 4 * N]], [[Y, 4 * N]], [[X, 4 * N, 0, "r"], [Y, 4 * N, 4 * N, "w"]])
    rec = replayer.replay(req, staged(x, np.zeros(N, np.float32)), b"image")
    assert rec["checked"] is False
    assert rec["why"].startswith(f"unvalidated: address unavailable ({Y:#x}: the validator holds {Y:#x}; "
                                 "the driver offered 0x"), rec["why"]
    assert dev.reserved == {X: G} and dev.launches == 0
    assert (Y + G, Y + 2 * G) in space.held  # what was lifted for the attempt is held again


def test_a_device_side_assert_is_reported_not_judged():
    rec, dev = plain("asserting")
    assert rec["checked"] is False and rec["fault"] == "CUDA_ERROR_ASSERT"
    assert "replay failed" in rec["why"]


def test_a_kernel_missing_from_the_image_is_unvalidated():
    rec, dev = plain("no_such_kernel")
    assert rec["checked"] is False and "CUDA_ERROR_NOT_FOUND" in rec["why"]
    no_leaks(dev)


def test_a_granularity_the_chunks_do_not_divide_is_refused():
    with pytest.raises(ValueError):
        Replayer(FakeDevice(KERNELS, granularity=100))


def frames(*objs) -> io.BytesIO:
    buf = io.BytesIO()
    for o in objs:
        replay.write_frame(buf, o)
    buf.seek(0)
    return buf


def test_serve_answers_each_request_and_stops_after_a_lost_context(tmp_path):
    (tmp_path / ("0" * 64 + ".image")).write_bytes(b"image")
    x = np.arange(N, dtype=np.float32)
    (tmp_path / "staging-1").write_bytes(staged(x, np.zeros(N, np.float32)))
    regions = [[X, 4 * N, 0, "r"], [Y, 4 * N, 4 * N, "w"]]
    good = dict(request("copy", [[X, 4 * N]], [[Y, 4 * N]], regions), seq=1, staging="staging-1")
    bad = dict(good, seq=2, staging="no-such-file")
    fault = dict(good, seq=3, kernel="far_read", function="far_read")
    never = dict(good, seq=4)
    out = io.BytesIO()
    status = replay.serve(Replayer(FakeDevice(KERNELS, G)), frames(good, bad, fault, never), out, str(tmp_path))
    assert status == EXIT_CONTEXT_LOST
    out.seek(0)
    answers = [replay.read_frame(out), replay.read_frame(out), replay.read_frame(out)]
    assert replay.read_frame(out) is None  # the fourth request was never answered
    assert [a["seq"] for a in answers] == [1, 2, 3]
    assert answers[0]["reads"] == "ok"
    assert answers[1]["checked"] is False and "bad request" in answers[1]["why"]
    assert answers[2]["fault"] == "CUDA_ERROR_ILLEGAL_ADDRESS" and answers[2]["restart"] is True


def test_serve_reads_only_files_of_its_own_directory(tmp_path):
    (tmp_path / ("0" * 64 + ".image")).write_bytes(b"image")
    outside = tmp_path.parent / "outside-staging"
    outside.write_bytes(bytes(8 * N))
    req = dict(request("copy", [[X, 4 * N]], [[Y, 4 * N]], [[X, 4 * N, 0, "r"], [Y, 4 * N, 4 * N, "w"]]),
               seq=1, staging=str(outside))
    out = io.BytesIO()
    replay.serve(Replayer(FakeDevice(KERNELS, G)), frames(req), out, str(tmp_path))
    out.seek(0)
    assert "bad request" in replay.read_frame(out)["why"]


def test_torn_and_oversized_frames_are_errors():
    with pytest.raises(ValueError):
        replay.read_frame(io.BytesIO(b"\x05\x00"))
    with pytest.raises(ValueError):
        replay.read_frame(io.BytesIO(b"\x05\x00\x00\x00{}"))
    with pytest.raises(ValueError):
        replay.read_frame(io.BytesIO(struct.pack("<I", replay.MAX_FRAME + 1)))


def test_a_fault_scores_as_a_missed_read_with_writes_unchecked():
    from gpuos_tools.access.report import Row
    from gpuos_tools.access.score import score
    from gpuos_tools.model.allocs import Allocation

    rec, _ = plain("far_read")
    by_id = {1: Allocation(1, X, 4 * N), 2: Allocation(2, Y, 4 * N)}
    access = {"reads": [{"alloc": 1, "offset": 0, "size": 4 * N}],
              "writes": [{"alloc": 2, "offset": 0, "size": 4 * N}], "unknown": False}
    v = score(access, rec, by_id)
    assert v["reads"] == "missed" and v["writes"] == "unchecked" and v["fault"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    row = Row("launch", "far_read")
    row.add_score(v)
    assert row.missed_read_launches == 1 and row.missed_write_launches == 0 and row.validated == 1


def test_a_validator_whose_program_died_ends_even_mid_replay(tmp_path):
    """The program (here a shell that starts the validator in the background and exits) is gone
    while the validator is stuck: the watch ends it."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pidfile = tmp_path / "pid"
    code = ("import os, sys, time; sys.path.insert(0, %r); from gpuos_tools.agent import replay; "
            "open(%r, 'w').write(str(os.getpid())); replay._orphan_watch(os.getppid(), 0.05); time.sleep(60)"
            % (str(root), str(pidfile)))
    subprocess.run(["bash", "-c", f'{sys.executable} -c "{code}" & sleep 0.5'], check=True, timeout=30)
    deadline = time.monotonic() + 20
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    while time.monotonic() < deadline:
        try:  # gone, or a zombie its new parent has not reaped yet
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        pytest.fail("the orphaned validator kept running")


@pytest.mark.parametrize("kernel", ["copy", "copy_and_spill", "sum_past", "far_read", "stamp", "asserting"])
def test_every_verdict_is_a_valid_validation_record(kernel):
    from gpuos_tools.stream.records import check_written

    rec, _ = plain(kernel)
    rec["ms"] = 1.5
    assert check_written({"type": "validation", "ts": 1, "tid": 2, "seq": 3, **rec}) is None
    skipped, _ = plain("copy", taken=(X,))
    assert check_written({"type": "validation", "ts": 1, "tid": 2, "seq": 3, **skipped}) is None


def test_under_whole_an_area_reserved_whole_gives_addresses_the_driver_refuses_one_by_one():
    """A driver that will not place a reservation at X by itself (its own bookkeeping sits there)
    but grants the program's whole driver area around X and Y: the launch is checked, with the
    area's one reservation and none of its own."""
    one_by_one, _ = plain("copy", taken=(X,))
    assert one_by_one["checked"] is False and "address unavailable" in one_by_one["why"]
    dev = FakeDevice(KERNELS, G, taken=(X,))
    r = Replayer(dev, whole=True)
    r.take_areas([[X - G, 32 * G]])
    assert dev.reserved == {X - G: 32 * G} and r.area_counts() == {"held": 1, "held_in_part": 0, "refused_bytes": 0}
    x, y = np.arange(N, dtype=np.float32), np.zeros(N, dtype=np.float32)
    req = request("copy", [[X, 4 * N]], [[Y, 4 * N]], [[X, 4 * N, 0, "r"], [Y, 4 * N, 4 * N, "w"]])
    rec = r.replay(req, staged(x, y), b"image")
    assert rec["checked"] and rec["reads"] == "ok" and rec["missed_writes"] == [], rec
    assert dev.reserved == {X - G: 32 * G} and dev.maps == {}
    r.close()
    assert dev.reserved == {}


class PartlyUsed(FakeDevice):
    """A driver whose own allocations sit on the granules ``used``: a reservation over any of
    them lands elsewhere."""

    def __init__(self, used, **kw):
        super().__init__(KERNELS, G, **kw)
        self.used, self.asked = set(used), 0

    def reserve(self, addr, size):
        self.asked += 1
        if any(addr <= u < addr + size for u in self.used):
            got = addr + (1 << 40)
            self.reserved[got] = size
            return got
        return super().reserve(addr, size)


def test_under_whole_an_area_the_driver_uses_in_part_is_held_around_what_it_uses():
    """The area [X - 4G, X + 28G) with the validator driver's own allocation on the granule
    X - 2G: everything else of it is held (Y included), the launch on X and Y is checked, and
    a launch on the used granule says what became of it."""
    used = X - 2 * G
    dev = PartlyUsed([used])
    r = Replayer(dev, whole=True)
    r.take_areas([[X - 4 * G, 32 * G]])
    assert r.area_counts() == {"held": 0, "held_in_part": 1, "refused_bytes": G}
    held = sorted((s, s + n) for s, n in dev.reserved.items())
    assert sum(e - s for s, e in held) == 31 * G and all(not (s <= used < e) for s, e in held)
    assert dev.asked <= 2 * 5 + 1  # halves down to the granule: about two tries a level
    rec = r.replay(request("copy", [[X, 4 * N]], [[Y, 4 * N]], [[X, 4 * N, 0, "r"], [Y, 4 * N, 4 * N, "w"]]),
                   staged(np.arange(N, dtype=np.float32), np.zeros(N, dtype=np.float32)), b"image")
    assert rec["checked"], rec
    bad = r.replay(request("copy", [[used, 4 * N]], [[Y, 4 * N]], [[used, 4 * N, 0, "r"], [Y, 4 * N, 4 * N, "w"]]),
                   staged(np.arange(N, dtype=np.float32), np.zeros(N, dtype=np.float32)), b"image")
    assert bad["checked"] is False and f"was held but for [{used:#x}, {used + G:#x}), refused by the driver" in bad["why"]
    before = dev.asked
    r.take_areas([[X - 4 * G, 32 * G]])  # asked for once
    assert dev.asked == before


def test_under_whole_a_refusal_outside_every_named_area_says_so():
    x, y = np.arange(N, dtype=np.float32), np.zeros(N, dtype=np.float32)
    req = request("copy", [[X, 4 * N]], [[Y, 4 * N]], [[X, 4 * N, 0, "r"], [Y, 4 * N, 4 * N, "w"]])
    r = Replayer(FakeDevice(KERNELS, G, taken=(X,)), whole=True)
    rec = r.replay(req, staged(x, y), b"image")
    assert rec["why"].endswith("no driver area of the program's was named around it (0 named)"), rec["why"]
    other = FakeDevice(KERNELS, G)
    Replayer(other).take_areas([[X, G]])  # not under whole: nothing asked
    assert other.reserved == {}


# ------------------------------------------------------------------ replays moved elsewhere

T = 0x7F0000020000  # a pointer table's address


def table_request(kernel: str, table: bytes, relocate: bool = True, live=()) -> tuple[dict, bytes]:
    """``kernel`` (table, y, n) under the prediction "reads the table and x[0:N], writes y[0:N]"."""
    x = np.arange(N, dtype=np.float32)
    regions = [[T, len(table), 0, "r"], [X, 4 * N, len(table), "r"], [Y, 4 * N, len(table) + 4 * N, "w"]]
    req = request(kernel, [[T, len(table)], [X, 4 * N]], [[Y, 4 * N]], regions)
    req["params"] = struct.pack("<QQi", T, Y, N).hex()
    if relocate:
        req.update(relocate=True, live=[list(r) for r in live])
    return req, table + x.tobytes() + bytes(4 * N)


def test_an_address_the_driver_will_not_give_is_replayed_moved_when_asked():
    """X is the validator's driver's own: moved, the parameter pointing at it moved with it."""
    dev = FakeDevice(KERNELS, G, taken=(X,))
    x = np.arange(N, dtype=np.float32)
    req = request("copy", [[X, 4 * N]], [[Y, 4 * N]], [[X, 4 * N, 0, "r"], [Y, 4 * N, 4 * N, "w"]])
    req.update(relocate=True, live=[[X, 4 * N], [Y, 4 * N]])
    rec = Replayer(dev).replay(req, staged(x, np.zeros(N, np.float32)), b"image")
    assert rec["checked"] and rec["reads"] == "ok" and rec["missed_writes"] == [], rec
    (moved,) = rec["relocated"]["spans"]
    assert moved[:2] == [X, G] and moved[2] != X
    assert rec["relocated"]["pointers"] == {"parameters": 1, "memory": 0, "variables": 0}
    assert rec["written"] == [[Y, 4 * N + (-4 * N) % 128]]  # in the program's addresses
    no_leaks(dev)  # the moved span's room was given back


def test_a_pointer_in_a_predicted_table_is_moved_with_its_span():
    dev = FakeDevice(KERNELS, G, taken=(X,))
    req, data = table_request("follow", struct.pack("<Q", X))
    rec = Replayer(dev).replay(req, data, b"image")
    assert rec["checked"] and rec["reads"] == "ok" and rec["missed_writes"] == [], rec
    assert rec["relocated"]["pointers"] == {"parameters": 0, "memory": 1, "variables": 0}
    assert rec["written"] == [[Y, 4 * N + (-4 * N) % 128]]
    from gpuos_tools.stream.records import check_written

    assert check_written({"type": "validation", "ts": 1, "tid": 2, "seq": 3, **rec}) is None


def test_a_pointer_built_another_way_reads_the_programs_address_and_faults_there():
    """x at the table's address plus an offset: no word holds x's address, so the moved replay
    reads where x was; nothing of the validator's is mapped there in this fake, so it faults."""
    dev = FakeDevice(KERNELS, G, taken=(X,))
    req, data = table_request("follow_offset", struct.pack("<i", X - T) + bytes(4))
    rec = Replayer(dev).replay(req, data, b"image")
    assert rec["checked"] and rec["reads"] == "missed" and rec["fault"] == "CUDA_ERROR_ILLEGAL_ADDRESS", rec


def test_a_word_only_partly_predicted_is_not_taken_for_a_pointer():
    """The table's last 2 bytes lie outside the prediction: the word is not moved (the poison
    around it must not decide), so the kernel reads through an unpredicted byte and faults."""
    dev = FakeDevice(KERNELS, G, taken=(X,))
    req, data = table_request("follow", struct.pack("<Q", X))
    req["reads"][0][1] = 6
    req["regions"] = [[T, 6, 0, "r"], [X, 4 * N, 6, "r"], [Y, 4 * N, 6 + 4 * N, "w"]]
    rec = Replayer(dev).replay(req, data[:6] + data[8:], b"image")
    assert rec["relocated"]["pointers"]["memory"] == 0
    assert rec["checked"] and rec["reads"] == "missed", rec


def test_a_move_never_lands_on_a_live_allocation_of_the_programs():
    """The driver's first offer lies on one of the program's live allocations: an unpredicted
    access to it must fault, not find the moved copy; the room is taken above them all."""
    from fake_vmm import ANYWHERE

    dev = FakeDevice(KERNELS, G, taken=(X,))
    req, data = table_request("follow", struct.pack("<Q", X), live=[[ANYWHERE, G], [X, 4 * N]])
    rec = Replayer(dev).replay(req, data, b"image")
    (moved,) = rec["relocated"]["spans"]
    assert moved[2] != ANYWHERE and rec["checked"] and rec["reads"] == "ok", rec


def test_without_relocate_a_refused_address_stays_unvalidated():
    dev = FakeDevice(KERNELS, G, taken=(X,))
    req, data = table_request("follow", struct.pack("<Q", X), relocate=False)
    rec = Replayer(dev).replay(req, data, b"image")
    assert rec["checked"] is False and rec["why"].startswith("unvalidated: address unavailable") and dev.launches == 0


def test_moves_move_aligned_words_and_one_past_the_end_only_where_no_span_starts():
    from gpuos_tools.agent.replay import Moves

    spans = [(X, G, False), (X + G, G, False), (Y, G, False)]
    moves = Moves([(X, X + G, 0x1000), (Y, Y + G, 0x9000)], spans)
    words = np.array([X + 8, X + G, Y + G, Y - 1, 7], dtype="<u8")
    assert list(moves.words(words)) == [0, 2]
    assert list(words) == [0x1008, X + G, 0x9000 + G, Y - 1, 7]  # X + G starts a span of its own
    data, n = moves.patch(struct.pack("<QQi", X, Y + 16, 3))
    assert n == 2 and struct.unpack("<QQi", data) == (0x1000, 0x9010, 3)
    assert moves.address(Y + 5) == 0x9005 and moves.address(X + G) == X + G


# ------------------------------------------------------------------ read extents

def test_read_extents_are_bisected_per_pointer_as_in_the_programs_process():
    """copy reads 400 bytes of x and writes 400 of y; x's whole granule is predicted read. The
    read extent is the first chunk boundary past what it reads; the write extent, what changed."""
    dev = FakeDevice(KERNELS, G)
    x = np.arange(1, N + 1, dtype=np.float32)  # no zero among them: zeroing any changes the copy
    regions = [[X, G, 0, "r"], [Y, 4 * N, G, "w"]]
    req = request("copy", [[X, G]], [[Y, 4 * N]], regions)
    req["extents"] = [[0, 0, X, X + G, X], [1, 0, Y, Y + G, Y]]
    data = x.tobytes() + bytes(G - 4 * N) + bytes(4 * N)
    rec = Replayer(dev).replay(req, data, b"image")
    assert rec["checked"] and rec["reads"] == "ok", rec
    ext = {e["param"]: e for e in rec["extents"]}
    assert ext[0]["read"] == 512 and ext[0]["written"] == 0 and ext[0]["limit"] == G
    assert ext[1]["read"] == 0 and ext[1]["written"] == 512
    assert 0 < ext[0]["steps"] <= 6 and rec["extents"][0]["ptr"] == X
    no_leaks(dev)
    from gpuos_tools.stream.records import check_written

    assert check_written({"type": "validation", "ts": 1, "tid": 2, "seq": 3, **rec}) is None


def test_a_pointer_in_memory_is_never_zeroed_by_the_measurement():
    """follow reads x through the table: zeroing the table's word would fault; it is kept, and
    it counts as read, and x's 400 bytes are measured."""
    dev = FakeDevice(KERNELS, G)
    req, data = table_request("follow", struct.pack("<Q", X), relocate=False)
    data = data[:8] + np.arange(1, N + 1, dtype=np.float32).tobytes() + data[8 + 4 * N :]
    req["extents"] = [[0, 0, T, T + 8, T], [0, 0, X, X + 4 * N, X]]
    rec = Replayer(dev).replay(req, data, b"image")
    assert rec["checked"] and rec["reads"] == "ok" and not dev.maps, rec
    ext = {e["ptr"]: e for e in rec["extents"]}
    assert ext[X]["read"] == 4 * N and ext[T]["read"] == 8  # the table's word: never zeroed, counted read


def test_the_measurement_stops_at_its_run_budget(monkeypatch):
    monkeypatch.setattr(replay, "EXTENT_RUNS", 2)
    dev = FakeDevice(KERNELS, G)
    x = np.arange(1, N + 1, dtype=np.float32)
    req = request("copy", [[X, G]], [[Y, 4 * N]], [[X, G, 0, "r"], [Y, 4 * N, G, "w"]])
    req["extents"] = [[0, 0, X, X + G, X], [1, 0, Y, Y + G, Y]]
    rec = Replayer(dev).replay(req, x.tobytes() + bytes(G - 4 * N) + bytes(4 * N), b"image")
    assert rec["checked"] and rec["extents"] == [] and dev.launches == 2 + 2


def both_read_and_written(kernel: str, x: np.ndarray | None = None, replayer: Replayer | None = None) -> dict:
    """``kernel`` (x, y, n) with both whole granules predicted read and written, x = 1, 2, ...
    unless given and y = 1001, 1002, ... (no zero among them, and no value of x's), and both
    extents measured."""
    x = np.arange(1, G // 4 + 1, dtype=np.float32) if x is None else x
    y = np.arange(1001, 1001 + G // 4, dtype=np.float32)
    req = request(kernel, [[X, G], [Y, G]], [[X, G], [Y, G]], [[X, G, 0, "rw"], [Y, G, G, "rw"]])
    req["extents"] = [[0, 0, X, X + G, X], [1, 0, Y, Y + G, Y]]
    rec = (replayer or Replayer(FakeDevice(KERNELS, G))).replay(req, x.tobytes() + y.tobytes(), b"image")
    assert rec["checked"] and rec["reads"] == "ok", rec
    return {e["ptr"]: e for e in rec["extents"]}


def test_an_update_in_place_reads_what_it_overwrites_in_the_validator_too():
    """scale (x = 2x + 1) changes only x's chunks: zeroing them leaves nothing else to compare,
    and the bytes the control wrote there show the read."""
    ext = both_read_and_written("scale")
    assert ext[X]["read"] == 512 and ext[X]["written"] == 512 and ext[X]["in_place"] > 0, ext
    assert ext[Y]["read"] == 0 and ext[Y]["in_place"] == 0, ext


def test_an_overwrite_and_a_partial_writer_read_none_of_what_they_overwrite():
    ext = both_read_and_written("overwrite")  # x = y
    assert ext[X]["read"] == 0 and ext[X]["in_place"] == 0 and ext[X]["written"] == 512, ext
    assert ext[Y]["read"] == 512 and ext[Y]["in_place"] == 0, ext
    ext = both_read_and_written("partial")  # every other word of x, none read: the rest keeps the zeros
    assert ext[X]["read"] == 0 and ext[X]["in_place"] == 0 and ext[X]["written"] == 896, ext


def test_an_unpredicted_byte_updated_in_place_is_a_missed_read():
    """scale of 16 floats past the 100 predicted: they hold the poison, read and written back. No
    chunk is wholly unpredicted, so no write is missed; the bytes either run visibly wrote differ
    between the poisons. A partial writer there writes them alike under both: no read."""
    x = np.arange(1, N + 1, dtype=np.float32)
    regions = [[X, 4 * N, 0, "rw"], [Y, 4 * N, 4 * N, "w"]]
    req = request("scale", [[X, 4 * N]], [[X, 4 * N], [Y, 4 * N]], regions, n=N + 16)
    rec = Replayer(FakeDevice(KERNELS, G)).replay(req, staged(x, np.zeros(N, np.float32)), b"image")
    assert rec["missed_writes"] == [] and rec["reads"] == "missed", rec
    assert rec["read_effects"] == [[X + 384, 128]], rec
    req = request("partial", [[X, 4 * N]], [[X, 4 * N], [Y, 4 * N]], regions, n=N // 2 + 6)  # to byte 448
    rec = Replayer(FakeDevice(KERNELS, G)).replay(req, staged(x, np.zeros(N, np.float32)), b"image")
    assert rec["missed_writes"] == [] and rec["reads"] == "ok", rec


def test_an_update_in_place_of_zeros_reads_them():
    """accumulate (x += y) on x all zeros: zeroing x changes nothing, so only the zeros' poison
    shows the read; the first bisection alone measured x unread."""
    ext = both_read_and_written("accumulate", np.zeros(G // 4, np.float32))
    assert ext[X]["read"] == 512 and ext[X]["in_place_zeros"] > 0 and ext[X]["written"] == 512, ext
    assert ext[Y]["read"] == 512 and "in_place_zeros" not in ext[Y], ext  # y holds no zeros x's update wrote


def test_an_overwrite_of_zeros_still_reads_none_of_them():
    ext = both_read_and_written("overwrite", np.zeros(G // 4, np.float32))  # x = y
    assert ext[X]["read"] == 0 and ext[X]["in_place_zeros"] == 0 and ext[X]["written"] == 512, ext
    ext = both_read_and_written("partial", np.zeros(G // 4, np.float32))
    assert ext[X]["read"] == 0 and ext[X]["written"] == 896, ext


def test_a_kernel_that_spins_under_the_zeros_poison_times_out_and_keeps_the_first_answer():
    """turnstile waits for its counter at zero: under the zeros' poison it never ends. That run
    is bounded, the context is counted lost, and each pointer keeps the first bisection's extent."""
    dev = FakeDevice(KERNELS, G)
    replayer = Replayer(dev)
    ext = both_read_and_written("turnstile", np.zeros(G // 4, np.float32), replayer)
    assert replayer.lost
    assert ext[X]["written"] == 512 and "in_place_zeros" not in ext[X], ext
    assert ext[Y]["read"] == 512, ext
    bounded = [t for t in dev.timeouts if t is not None]
    assert bounded and all(t >= replay.TIMEOUT_FLOOR_S for t in bounded), dev.timeouts
    assert dev.timeouts[:2] == [None, None]  # the two poisons' runs wait as long as the kernel takes


def test_a_pointer_table_stored_after_the_array_is_not_read_by_the_launch():
    """copy reads 400 bytes of x; a pointer to y sits 2 KiB into x's allocation (another array's
    table, packed there by a caching allocator): never zeroed, and not counted read, as the
    table a pointer argument points at is."""
    dev = FakeDevice(KERNELS, G)
    x = np.arange(1, N + 1, dtype=np.float32)
    tail = bytearray(G - 4 * N)
    struct.pack_into("<Q", tail, 2048 - 4 * N, Y)
    regions = [[X, G, 0, "r"], [Y, 4 * N, G, "w"]]
    req = request("copy", [[X, G]], [[Y, 4 * N]], regions)
    req["extents"] = [[0, 0, X, X + G, X]]
    rec = Replayer(dev).replay(req, x.tobytes() + bytes(tail) + bytes(4 * N), b"image")
    assert rec["checked"] and rec["reads"] == "ok", rec
    assert rec["extents"][0]["read"] == 512, rec["extents"]
