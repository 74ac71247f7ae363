"""Man pages: the checked-in pages are what the code generates now, and they are sound roff."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer
from cli_app import app
from helpers import REPO

from gpuos_tools.errors import DESCRIPTIONS, ExitCode
from gpuos_tools.commands.manpage import PAGES, markup_to_roff, render_man
from gpuos_tools.commands.registry import COMMANDS

MAN = REPO / "man"
PAGE_FILES = sorted(p for p in MAN.iterdir() if p.suffix[1:].isdigit())


def test_every_registered_page_is_checked_in() -> None:
    assert {f"{name}.{section}" for name, section, _ in PAGES} == {p.name for p in PAGE_FILES}
    assert {f"{c.prog}.{c.section}" for c in COMMANDS} < {f"{name}.{section}" for name, section, _ in PAGES}


def test_console_scripts_are_the_registry() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {c.prog: c.entry_point for c in COMMANDS}
    for c in COMMANDS:  # each entry point and manual module is there
        assert callable(c.load().main) and c.app is c.load().app and c.sections


def test_checkout_wrappers_are_the_registry() -> None:
    """cmd/ holds one wrapper per registered command (each runs the command it is named after)."""
    assert sorted(p.name for p in (REPO / "cmd").iterdir()) == sorted(c.prog for c in COMMANDS)


@pytest.mark.parametrize("path", PAGE_FILES, ids=lambda p: p.name)
def test_checked_in_page_matches_the_code(path: Path) -> None:
    render = {f"{name}.{section}": render for name, section, render in PAGES}[path.name]
    assert path.read_text(encoding="utf-8") == render(), "stale man page: run scripts/gen-man"


@pytest.mark.parametrize("path", PAGE_FILES, ids=lambda p: p.name)
def test_page_is_sound_roff(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.startswith(".TH ")
    assert "\n.SH NAME\n" in text
    if shutil.which("groff") is None:
        pytest.skip("groff not installed")
    done = subprocess.run(
        ["groff", "-man", "-Tutf8", "-ww", "-z", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and done.stderr == ""


def test_gen_man_check_agrees() -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen-man"), "--check"], capture_output=True,
                          text=True, timeout=60, check=False)  # this interpreter, whatever python3 is on PATH
    assert done.returncode == 0, done.stdout


def test_every_exit_code_is_described() -> None:
    assert set(DESCRIPTIONS) == set(ExitCode)
    assert all(text.strip() for text in DESCRIPTIONS.values())


def test_render_man_of_a_typer_app() -> None:
    page = render_man(
        typer.main.get_command(app),
        "gpu-test",
        extra_sections={"NOTES": "Nothing `here`.", "SEE ALSO": "jq(1)", "EXAMPLES": "    gpu-test flood | head"},
    )
    assert page == render_man(
        typer.main.get_command(app),
        "gpu-test",
        extra_sections={"NOTES": "Nothing `here`.", "SEE ALSO": "jq(1)", "EXAMPLES": "    gpu-test flood | head"},
    )
    assert page.startswith('.TH "GPU-TEST" 1 "" ')
    assert "gpu\\-test \\- Commands that misbehave on purpose\n" in page
    titles = [line[4:].strip('"') for line in page.splitlines() if line.startswith(".SH ")]
    assert titles == [
        "NAME",
        "SYNOPSIS",
        "DESCRIPTION",
        "OPTIONS",
        "COMMANDS",
        "NOTES",
        "EXIT STATUS",
        "ENVIRONMENT",
        "EXAMPLES",
        "SEE ALSO",
    ]
    for sub in ("flood", "fail", "crash", "interrupt", "status"):
        assert f'.SS "gpu-test {sub}"' in page
    assert ".TP\n\\fB\\-o\\fR, \\fB\\-\\-output\\fR \\fIFILE\\fR\n" in page
    assert ".TP\n\\fB\\-\\-records\\fR / \\fB\\-\\-no\\-records\\fR\n" in page
    assert "Exit with CODE" in page
    assert ".nf\n\\fBgpu\\-test status\\fR [\\fIOPTIONS\\fR] \\fICODE\\fR\n.fi\n" in page
    for code in ExitCode:
        assert f".TP\n\\fB{int(code)}\\fR\n" in page
    assert "\\fBGPUOS_DEBUG\\fR" in page and "\\fBNO_COLOR\\fR" in page
    assert page.rstrip().endswith("gpuos-stream(7), jq(1)")


def test_markup_escapes_roff() -> None:
    roff = markup_to_roff(".starts with a dot\n'and a quote \\ backslash\n\n- item -o\n  more\n\n    literal --flag")
    assert roff == [
        "\\&.starts with a dot",
        "\\&'and a quote \\e backslash",
        ".IP \\(bu 2",
        "item \\-o",
        "more",
        ".PP",
        ".RS 4",
        ".nf",
        "literal \\-\\-flag",
        ".fi",
        ".RE",
    ]
