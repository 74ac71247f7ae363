"""The validator process's entry point: ``python -m gpuos_tools.agent.validator --device BUS --dir DIR
--claims FILE [--strategy NAME]`` (started by offload.py, the program's side).

It takes its hold on the program's address windows (vaspace.py, by the address strategy it is
told) before anything else is imported: numpy, the CUDA driver and its context all map memory of
their own, and whatever of theirs lands on an address of the program's makes that address
unavailable to the replay. Then it serves requests (replay.py).

The claims file is ``{"windows": [[addr, size], ...], "areas": [[addr, size], ...]}`` (the
program's windows and its driver's areas), or the bare list of windows.
"""

from __future__ import annotations

import json
import sys

from gpuos_tools.agent.vaspace import STRATEGIES, AddressStrategy


def _option(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def read_claims(path: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(windows, areas) from the claims file; ValueError for one that is not as documented."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):
        data = {"windows": data}
    if not isinstance(data, dict):
        raise ValueError("the claims file holds neither a list nor an object")
    return ([(int(a), int(n)) for a, n in data.get("windows", [])],
            [(int(a), int(n)) for a, n in data.get("areas", [])])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name = _option(argv, "--strategy") or STRATEGIES[0]
    windows: list[tuple[int, int]] = []
    areas: list[tuple[int, int]] = []
    path = _option(argv, "--claims")
    if path:
        try:
            windows, areas = read_claims(path)
        except (OSError, ValueError, TypeError) as exc:  # validation goes on, with less luck on addresses
            print(f"gpuos-validator: the program's address windows were not held: {exc}", file=sys.stderr)
    try:
        strategy = AddressStrategy(name, windows, areas)
        strategy.start()
    except ValueError as exc:
        print(f"gpuos-validator: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"gpuos-validator: the program's address windows were not held: {exc}", file=sys.stderr)
        strategy = None
    from gpuos_tools.agent import replay  # only now: numpy, and through it the driver

    return replay.main(argv, strategy)


if __name__ == "__main__":
    sys.exit(main())
