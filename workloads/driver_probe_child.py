"""The process scripts/probe_driver_remainder.py probes: does the driver checkpoint API lock a
program under the agent once CUPTI is detached? Run under `gpu-trace run --agent` with
GPUOS_AGENT_OWN=1, or alone (then it owns CuPy's allocations itself: VMM memory, no CUPTI). Holds 256 MiB of owned CuPy memory and a cuBLAS matmul's workspace (not
owned). Commands on stdin, one JSON answer per line on stdout:

  check     the data's checksum
  detach    cupti unsubscribe + finalize, from a thread (reports whether either hung)
  park      a thread takes the agent's lock, another starts a launch: it waits in the callback,
            inside the driver call, as a suspended program does
  unpark    the lock is let go; the parked launch completes
  exit
"""

import json
import sys
import threading
import time

import cupy as cp


def main() -> None:
    traced = sys.modules.get("gpuos_tools.injection.tracer")
    tracer = traced._tracer if traced is not None else None
    agent = tracer.agent if tracer is not None else None
    if tracer is None:  # run alone: own CuPy's allocations anyway (VMM memory, no CUPTI)
        from gpuos_tools.memory import owned

        owned.install_cupy()
    x = cp.arange(64 << 20, dtype=cp.float32)  # 256 MiB, owned
    m = cp.ones((256, 256), dtype=cp.float32)
    m = m @ m  # cuBLAS: its workspace is not owned
    cp.cuda.Device().synchronize()
    state = {}

    def say(**kw) -> None:
        print(json.dumps(kw), flush=True)

    def checksum() -> float:
        return float(x.sum()) + float(m.sum())

    say(ready=True, checksum=checksum())
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "check":
            say(checksum=checksum())
        elif cmd == "detach":
            out = {}

            def detach() -> None:
                t = time.perf_counter()
                try:
                    tracer.cupti.unsubscribe(tracer.subscriber)
                    out["unsubscribe"] = "ok"
                except Exception as e:  # noqa: BLE001
                    out["unsubscribe"] = repr(e)
                out["unsubscribe_s"] = time.perf_counter() - t
                t = time.perf_counter()
                try:
                    tracer.cupti.finalize()
                    out["finalize"] = "ok"
                except Exception as e:  # noqa: BLE001
                    out["finalize"] = repr(e)
                out["finalize_s"] = time.perf_counter() - t

            th = threading.Thread(target=detach, daemon=True)
            th.start()
            th.join(10)
            say(detached=not th.is_alive(), **out)
        elif cmd == "park":
            got = threading.Event()
            done = threading.Event()
            state["release"] = threading.Event()

            def holder() -> None:
                with agent.lock:
                    got.set()
                    state["release"].wait()

            def worker() -> None:
                y = x * 2  # a launch: waits in its callback
                state["y"] = float(y.sum())
                done.set()

            threading.Thread(target=holder, daemon=True).start()
            got.wait()
            threading.Thread(target=worker, daemon=True).start()
            time.sleep(0.5)
            state["done"] = done
            say(parked=not done.is_set())
        elif cmd == "unpark":
            state["release"].set()
            ok = state["done"].wait(20)
            say(unparked=ok, y=state.get("y"))
        elif cmd == "exit":
            break


if __name__ == "__main__":
    main()
