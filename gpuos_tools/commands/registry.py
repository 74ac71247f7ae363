"""Every command of the toolkit, in one list: its program name, the module with its typer app
and ``main``, the module with its manual text, and its manual section.

The man pages (gpuos_tools.commands.manpage, ``scripts/gen-man``), the checkout's wrappers in
``cmd/`` and the tests read this list; pyproject's console scripts must name the same entry
points (tests/test_man.py checks it). Modules are imported only when asked for, so that one
command does not load the others.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Command:
    prog: str  #: the program's name, as installed on PATH
    module: str  #: gpuos_tools.commands.<module>: its typer ``app`` and ``main()``
    manual: str  #: gpuos_tools.commands.manual.<manual>: its ``SECTIONS``
    section: int = 1  #: the manual section

    @property
    def entry_point(self) -> str:
        """The console script's target, as pyproject's [project.scripts] writes it."""
        return f"{__package__}.{self.module}:main"

    def load(self) -> ModuleType:
        return importlib.import_module(f"{__package__}.{self.module}")

    @property
    def app(self) -> Any:
        """The command's typer app."""
        return self.load().app

    @property
    def sections(self) -> dict[str, str]:
        """The man page's sections beyond --help (gpuos_tools.commands.manpage.render_man)."""
        return importlib.import_module(f"{__package__}.manual.{self.manual}").SECTIONS


COMMANDS: tuple[Command, ...] = (
    Command("gpu-trace", "trace", "trace"),
    Command("gpu-ckpt", "ckpt", "ckpt"),
    Command("gpu-restore", "restore", "restore"),
    Command("gpu-predict-access", "predict_access", "predict_access"),
    Command("gpu-kinfer-bridge", "kinfer", "kinfer"),
    Command("gpu-prefetch-sched", "prefetch_sched", "prefetch_sched"),
)

BY_PROG: dict[str, Command] = {command.prog: command for command in COMMANDS}


def main(prog: str) -> None:
    """Run the command called ``prog`` (what its console script does)."""
    BY_PROG[prog].load().main()
