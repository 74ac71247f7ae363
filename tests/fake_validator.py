"""A stand-in validator process for the program side's unit tests (tests/test_validator_offload.py).

``fake_validator.py DIR MODE [--strategy NAME]``: MODE ok serves requests with
gpuos_tools.agent.replay on the fake VMM device of tests/fake_vmm.py; hang answers ready, then never
again; crash exits after ready; garbage writes a frame of nonsense; refuse says it could not start.
``areas:S1,S2`` serves as ok, but its driver honours address hints only when the address strategy
is one of S1, S2 (with the others the program's addresses lie outside its own areas); ``held``
serves with everything of the program's held by something else of the validator's;
``refuse:S1,S2`` says it could not start under those strategies and serves as ok under others;
``taken:S1=A1,S2=A2`` serves as ok, but under strategy S1 its driver will not give the address A1
(hexadecimal; as its own context's memory there would), and so on."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_vmm import KERNELS, FakeDevice, FakeSpace  # noqa: E402
from gpuos_tools.agent import replay  # noqa: E402

directory, mode = sys.argv[1], sys.argv[2]
strategy = sys.argv[sys.argv.index("--strategy") + 1] if "--strategy" in sys.argv else None
out = sys.stdout.buffer
if mode == "refuse" or mode.startswith("refuse:") and strategy in mode.split(":", 1)[1].split(","):
    replay.write_frame(out, {"ready": False, "why": "cuInit: CUDA_ERROR_NO_DEVICE"})
    sys.exit(1)
replay.write_frame(out, {"ready": True, "granularity": 4096})
if mode == "hang":
    time.sleep(3600)
elif mode == "crash":
    replay.read_frame(sys.stdin.buffer)
    print("Segmentation fault (pretend)", file=sys.stderr)
    sys.exit(7)
elif mode == "garbage":
    replay.read_frame(sys.stdin.buffer)
    out.write(b"\x03\x00\x00\x00abc")
    out.flush()
    time.sleep(3600)
elif mode.startswith("areas:"):
    device = FakeDevice(KERNELS, 4096, hints=strategy in mode.split(":", 1)[1].split(","))
    sys.exit(replay.serve(replay.Replayer(device), sys.stdin.buffer, out, directory))
elif mode.startswith("taken:"):
    pairs = dict(kv.split("=", 1) for kv in mode.split(":", 1)[1].split(","))
    taken = (int(pairs[strategy], 16),) if strategy in pairs else ()
    sys.exit(replay.serve(replay.Replayer(FakeDevice(KERNELS, 4096, taken=taken)), sys.stdin.buffer, out, directory))
elif mode == "held":
    space = FakeSpace(others=((0, 1 << 48),))
    sys.exit(replay.serve(replay.Replayer(FakeDevice(KERNELS, 4096, space=space), space), sys.stdin.buffer, out,
                          directory))
else:
    sys.exit(replay.serve(replay.Replayer(FakeDevice(KERNELS, 4096)), sys.stdin.buffer, out, directory))
