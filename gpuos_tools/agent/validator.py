"""The validator process's entry point: ``python -m gpuos_tools.agent.validator --device BUS --dir DIR
--claims FILE`` (started by offload.py, the program's side).

It holds the program's address windows (vaspace.py) before anything else is imported: numpy, the
CUDA driver and its context all map memory of their own, and whatever of theirs lands on an
address of the program's makes that address unavailable to the replay. Then it serves requests
(replay.py).
"""

from __future__ import annotations

import json
import sys

from gpuos_tools.agent.vaspace import AddressClaims


def _claims_path(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--claims" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--claims="):
            return a.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    space = None
    path = _claims_path(argv)
    if path:
        try:
            with open(path) as f:
                windows = [(int(a), int(n)) for a, n in json.load(f)]
            space = AddressClaims()
            space.claim(windows)
        except (OSError, ValueError, TypeError) as exc:  # validation goes on, with less luck on addresses
            print(f"gpuos-validator: the program's address windows were not held: {exc}", file=sys.stderr)
    from gpuos_tools.agent import replay  # only now: numpy, and through it the driver

    return replay.main(argv, space)


if __name__ == "__main__":
    sys.exit(main())
