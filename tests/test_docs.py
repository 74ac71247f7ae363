"""The documentation stays navigable and in step with the code: every link between the pages
resolves (file and heading), the architecture page names every package and top-level module,
and the user-facing pages, the code and the scripts' help carry no internal issue or target
numbers (the benchmark history keeps them, as it was written)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import REPO

PAGES = sorted([REPO / "README.md", REPO / "BENCHMARKS.md", *(REPO / "docs").rglob("*.md")])
HISTORY = REPO / "docs" / "benchmarks" / "history.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # no headings in code
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(page: Path) -> None:
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # an outside address
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target}: no such file"
        if anchor:
            assert anchor in anchors(file), f"{page.name}: {target}: no such heading in {file.name}"


def test_architecture_names_every_package_and_module() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    root = REPO / "gpuos_tools"
    names = [p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("__")]
    names += [p.stem for p in root.glob("*.py") if p.stem != "__init__"]
    missing = [n for n in sorted(names) if f"`{n}`" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}: update its tables"


GUIDES = [REPO / "README.md", REPO / "BENCHMARKS.md", *(REPO / "docs" / name for name in (
    "architecture.md", "snapshots-and-images.md", "owned-memory-and-residency.md", "residency-engine.md",
    "scheduler.md", "kinfer-bridge.md")), *(p for p in (REPO / "docs" / "benchmarks").glob("*.md") if p != HISTORY)]


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_internal_numbers_in_user_facing_pages(page: Path) -> None:
    text = page.read_text()
    assert not re.search(r"\bissue \d", text, flags=re.I), page
    # target labels (P1..P9, P2d, P4a, P6s); history anchors in links may carry them
    prose = LINK.sub("", text)
    assert not re.search(r"\bP[1-9][a-z]?\b", prose), page


#: The code and the scripts: their docstrings are the commands' and scripts' --help text, and their
#: comments are read by whoever takes the code over.
CODE = sorted([*(p for p in (REPO / "gpuos_tools").rglob("*") if p.suffix in (".py", ".c", ".h", ".toml", ".json")),
               *(p for p in (REPO / "scripts").iterdir() if p.is_file()), *(REPO / "cmd").iterdir(),
               *(REPO / "workloads").rglob("*.py")])


def test_no_internal_numbers_in_code_or_scripts_help() -> None:
    """No issue numbers or target labels (P1..P9...) in the code, the scripts and their --help:
    say what is meant (the target's figure, "the swap-pipeline target in DESIGN.md")."""
    found = []
    for path in CODE:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if re.search(r"\bissue \d", line, flags=re.I) or re.search(r"\bP[1-9][a-z]?\b", line):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert len(CODE) > 100 and not found, "\n".join(found)


def test_benchmark_pages_are_indexed_and_link_their_history() -> None:
    index = (REPO / "BENCHMARKS.md").read_text()
    pages = sorted((REPO / "docs" / "benchmarks").glob("*.md"))
    assert HISTORY in pages and len(pages) >= 6
    for page in pages:
        assert f"docs/benchmarks/{page.name}" in index, page.name
        if page != HISTORY:
            text = page.read_text()
            assert "history.md#" in text and "benchmarks/results" in text, page.name
            assert re.search(r"20\d\d-\d\d-\d\d", text), page.name  # dated


def test_history_keeps_every_recorded_run() -> None:
    """The history is the old BENCHMARKS.md: each of its sections is still there."""
    text = HISTORY.read_text()
    for heading in ("P4 — gpu-trace overhead per kernel launch", "Issue 6 — the agent's concurrent snapshots",
                    "P9 — gpu-kinfer-bridge on the GPU", "Swap pipeline on an H200 (P7)",
                    "Lookahead on the transfer-bound stencil, and a cold first job (H200)"):
        assert heading in text, heading
    assert len(re.findall(r"^#+ ", text, flags=re.M)) >= 37  # as many sections as the old BENCHMARKS.md
