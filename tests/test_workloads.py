"""The programs the benchmarks and the GPU tests run are where they are named: every program path
in scripts/, tests/gpu/, workloads/ and the documentation exists and compiles, and no script or
GPU program imports from tests/ or edits sys.path (scripts/README.md: the repository root is on
PYTHONPATH). Read from the source, without a GPU and without running anything."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers import REPO

SCRIPTS = sorted(p for p in (REPO / "scripts").iterdir() if p.is_file() and p.suffix != ".md")
GPU_TESTS = sorted((REPO / "tests" / "gpu").glob("*.py"))
WORKLOAD_FILES = sorted(p for p in (REPO / "workloads").rglob("*.py") if "__pycache__" not in p.parts)
TEST_PROGRAMS = sorted(p for p in (REPO / "tests" / "gpu" / "progs").rglob("*.py") if "__pycache__" not in p.parts)
PAGES = sorted([REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "scripts" / "README.md",
                REPO / "tests" / "data" / "recorded" / "README.md", *(REPO / "docs").rglob("*.md")])
#: a program named by its path from the repository root, in prose, a shell line or a string
NAMED = re.compile(r"(?<![\w/.])((?:workloads|tests/gpu/progs|scripts)/[\w./-]*\w\.py)\b")
#: the tools that write files of the checkout they sit in (man/, tests/data/golden/) put that
#: checkout first on sys.path themselves; make-golden runs the golden cases of tests/
REPO_TOOLS = {"gen-man", "make-golden"}


def is_python(path: Path) -> bool:
    return path.suffix == ".py" or path.read_text(errors="replace").startswith("#!/usr/bin/env python")


def path_of(node: ast.AST, env: dict[str, Path], here: Path) -> Path | None:
    """The path an expression of the usual forms stands for (``Path(__file__).resolve().parents[1]
    / "workloads" / "x.py"``, a name bound to one, ...); None for anything else."""
    if isinstance(node, ast.Name):
        return env.get(node.id)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Path":
        args = node.args
        if len(args) == 1 and isinstance(args[0], ast.Name) and args[0].id == "__file__":
            return here
        return None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "resolve":
        return path_of(node.func.value, env, here)
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        base = path_of(node.value, env, here)
        return base.parent if base else None
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents"
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)):
        base = path_of(node.value.value, env, here)
        return base.parents[node.slice.value] if base else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        base = path_of(node.left, env, here)
        if base is not None and isinstance(node.right, ast.Constant) and isinstance(node.right.value, str):
            return base / node.right.value
    return None


def docstrings(tree: ast.Module) -> set[int]:
    return {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}


def python_refs(path: Path) -> list[tuple[int, Path]]:
    """(line, path) for every path a Python file builds from its own location, and for every bare
    program name (``"agent_job.py"``) it joins to a directory later (``WORKLOADS / program``): the
    name must be in one of the directories it joins names to."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    env: dict[str, Path] = {"REPO": REPO}  # tests/helpers.py's
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            value = path_of(stmt.value, env, path)
            if value is not None:
                env[stmt.targets[0].id] = value
    refs = [(n.lineno, p) for n in ast.walk(tree) if isinstance(n, ast.BinOp)
            and (p := path_of(n, env, path)) is not None]
    joined_to = {base for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)
                 and not isinstance(n.right, ast.Constant) and (base := path_of(n.left, env, path)) is not None}
    prose = docstrings(tree)
    joined = {id(n.right) for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)}
    for n in ast.walk(tree):
        if (isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in prose | joined
                and re.fullmatch(r"\w+\.py", n.value)):
            where = [d / n.value for d in sorted(joined_to) if (d / n.value).exists()]
            refs.append((n.lineno, where[0] if where else Path(f"<none of {sorted(map(str, joined_to))}>") / n.value))
    return refs


def text_refs(path: Path) -> list[tuple[int, Path]]:
    return [(text.count("\n", 0, m.start()) + 1, REPO / m.group(1))
            for text in [path.read_text(encoding="utf-8")] for m in NAMED.finditer(text)]


def refs_of(path: Path) -> list[tuple[int, Path]]:
    return text_refs(path) + (python_refs(path) if path.suffix != ".md" and is_python(path) else [])


NAMING = [*SCRIPTS, *GPU_TESTS, *WORKLOAD_FILES, *PAGES]


@pytest.mark.parametrize("source", NAMING, ids=lambda p: str(p.relative_to(REPO)))
def test_every_program_path_named_exists(source: Path) -> None:
    missing = [f"{source.relative_to(REPO)}:{line}: {p}" for line, p in refs_of(source) if not p.exists()]
    assert not missing, "\n".join(missing)


def test_the_programs_the_benchmarks_and_gpu_tests_start_are_found() -> None:
    """The reading above finds what it must: the shared programs from both sides, by path."""
    named = {p.resolve() for source in NAMING if source.suffix != ".md" for _, p in refs_of(source)}
    for name in ("stencil_job.py", "agent_job.py", "agent_job_llm.py", "snapshot_prog.py", "torch_decode_job.py",
                 "train_steps.py", "suspend_job.py", "driver_probe_child.py", "image_prog.py", "cupy_prog.py"):
        assert (REPO / "workloads" / name).resolve() in named, name
    assert (REPO / "workloads" / "suite").resolve() in named
    assert (REPO / "tests" / "gpu" / "progs" / "owned_prog.py").resolve() in named
    assert (REPO / "tests" / "gpu" / "progs" / "ckpt_cupy.py").resolve() in named


def test_a_wrong_program_path_is_reported(tmp_path: Path) -> None:
    script = tmp_path / "bench_x.py"
    script.write_text('from pathlib import Path\nROOT = Path(__file__).resolve().parents[1]\n'
                      'JOB = ROOT / "workloads" / "stencil_job.py"\nJOBS = {"a": ("nonesuch.py",)}\n'
                      'def f(name):\n    return JOB.parent / name\n"""workloads/nonesuch_either.py"""\n')
    refs = [p for _, p in refs_of(script)]
    assert tmp_path.parent / "workloads" / "stencil_job.py" in refs
    assert not any(p.exists() for p in refs if p.name.startswith("nonesuch"))
    assert {p.name for p in refs} >= {"nonesuch.py", "nonesuch_either.py"}


PROGRAMS = sorted({*WORKLOAD_FILES, *TEST_PROGRAMS, *(p for p in SCRIPTS if is_python(p))})
TEST_MODULES = {p.stem for p in (REPO / "tests").rglob("*.py")} | {"tests"}


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: str(p.relative_to(REPO)))
def test_programs_compile_and_import_nothing_from_tests(program: Path) -> None:
    source = program.read_text(encoding="utf-8")
    tree = ast.parse(source, str(program))
    compile(tree, str(program), "exec")
    if program.name in REPO_TOOLS:
        return
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    from_tests = imported & TEST_MODULES - {p.stem for p in program.parent.glob("*.py")}  # not a sibling
    assert not from_tests, f"imports from tests/: {sorted(from_tests)}"
    edits = [i for i, line in enumerate(source.splitlines(), 1) if re.search(r"sys\.path(\.insert|\.append|\[)", line)]
    assert not edits, f"edits sys.path (line {edits}): the repository root is on PYTHONPATH (scripts/README.md)"


def test_the_device_scripts_parts_hold_every_gpu_test_file_once() -> None:
    """scripts/device-test's GPU_PART=a/b/c/d/e: five device calls run the whole GPU suite, so a new
    file of tests/gpu must join one part (and a removed one leave it)."""
    text = (REPO / "scripts" / "device-test").read_text()
    parts = {k: v.split() for k, v in re.findall(r'^(GPU_PART_[A-Z])="([^"]*)"$', text, re.M)}
    assert sorted(parts) == ["GPU_PART_A", "GPU_PART_B", "GPU_PART_C", "GPU_PART_D", "GPU_PART_E"]
    named = [f"test_{n}_gpu.py" for names in parts.values() for n in names]
    files = sorted(p.name for p in (REPO / "tests" / "gpu").glob("test_*.py"))
    assert sorted(named) == files, (sorted(set(files) - set(named)), sorted(set(named) - set(files)),
                                    sorted(n for n in named if named.count(n) > 1))
