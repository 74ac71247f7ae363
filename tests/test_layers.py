"""The layers of gpuos_tools, read from the code: each package imports only the layers below it,
no package is in a circle with another, and nothing outside `commands` reaches `commands`.

Every import counts, at the top of a file or inside a function, and so does a string that names a
module of the package (``-m gpuos_tools.x`` for a subprocess, ``importlib``, ``sys.modules``):
those are imports made at run time. docs/architecture.md draws the same layers.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "gpuos_tools"

#: Lowest first. A layer may import its own and any lower layer's modules.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "units", "names", "tomlfile", "figures", "procs", "cbuild"),  # base
    ("stream",),
    ("cuda",),
    ("model",),
    ("access",),
    ("image",),
    ("memory",),
    ("agent",),
    ("ckpt",),
    ("sched",),
    ("injection",),
    ("trace",),
    ("kinfer",),
    ("commands",),
]
LEVEL = {name: i for i, layer in enumerate(LAYERS) for name in layer}
MODULE_NAME = re.compile(r"\bgpuos_tools(?:\.\w+)+")


def unit(module: str) -> str | None:
    """The package (or base module) a dotted name belongs to: gpuos_tools.agent.x -> agent."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "gpuos_tools" else None


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def unit_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def edges_of(path: Path) -> list[tuple[str, int, str]]:
    """(module named, line, how) for every import of and string naming a gpuos_tools module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, "import") for a in node.names if a.name.startswith("gpuos_tools")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "gpuos_tools":
                out += [(f"gpuos_tools.{a.name}", node.lineno, "import") for a in node.names]
            elif node.module.startswith("gpuos_tools."):
                out.append((node.module, node.lineno, "import"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            # docstrings name modules for readers; any other string may be what gets loaded
            out += [(m, node.lineno, "string") for m in MODULE_NAME.findall(node.value)]
    return out


def all_edges() -> list[tuple[str, str, str, int, str]]:
    """(from unit, to unit, file, line, how) across units."""
    rows = []
    for path in sources():
        src = unit_of(path)
        for module, line, how in edges_of(path):
            dst = unit(module)
            if dst and dst != src and dst != "__init__":
                rows.append((src, dst, str(path.relative_to(REPO)), line, how))
    return rows


def test_every_unit_has_a_layer() -> None:
    units = {unit_of(p) for p in sources()} - {"__init__"}
    assert units <= set(LEVEL), f"give these a layer in LAYERS and docs/architecture.md: {sorted(units - set(LEVEL))}"


def test_no_unit_imports_a_higher_layer() -> None:
    upward = [f"{f}:{line}: {src} -> {dst} ({how})" for src, dst, f, line, how in all_edges()
              if LEVEL.get(dst, -1) > LEVEL.get(src, -1)]
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_no_circle_between_units() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for src, dst, *_ in all_edges():
        graph[src].add(dst)
    circles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == path[0]:
                circles.append(" -> ".join([*path, nxt]))
            elif nxt not in path and nxt > path[0]:
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert not circles, "circles between packages:\n" + "\n".join(circles)


def test_nothing_outside_commands_reaches_commands() -> None:
    reach = [f"{f}:{line} ({how})" for src, dst, f, line, how in all_edges() if dst == "commands"]
    assert not reach, "only commands may import commands (a subprocess's -m included):\n" + "\n".join(reach)


def test_the_checker_sees_each_kind_of_edge(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import gpuos_tools.agent.agent\n"
        "from gpuos_tools import units\n"
        "from gpuos_tools.sched.executor import x\n"
        "def f():\n"
        "    \"\"\"A docstring that names gpuos_tools.kinfer.ring.\"\"\"\n"
        "    from gpuos_tools.commands import trace\n"
        "    return ['-m', 'gpuos_tools.commands.kinfer']\n")
    found = {(unit(m), how) for m, _, how in edges_of(probe)}
    assert found == {("agent", "import"), ("units", "import"), ("sched", "import"), ("commands", "import"),
                     ("commands", "string")}


def test_no_circle_between_modules() -> None:
    """Inside a package too, no two modules import each other, directly or round a loop (importing
    a module's own package, its face, does not count)."""
    modules = {}
    for path in sources():
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for module, _, how in edges_of(path):
            for target in (module, module.rsplit(".", 1)[0]):
                if target in modules and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
                    break
    circles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == path[0]:
                circles.append(" -> ".join([*path, nxt]))
            elif nxt not in path and nxt > path[0] and len(path) < 8:
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert not circles, "modules in a circle:\n" + "\n".join(circles)


#: Imports of the toolkit's own modules that stay inside functions, and why: each keeps a heavy
#: package (numpy, pyelftools, matplotlib) out of a path that does not use it, or, in the
#: bootstrap, keeps a program that is not traced from importing anything.
INNER_ALLOWED = {
    ("injection/boot/sitecustomize.py", "gpuos_tools.injection"): "nothing is imported unless GPUOS_BOOT is set",
    ("injection/tracer.py", "gpuos_tools.agent.validate"): "numpy, in the traced program, under --validate only",
    ("injection/tracer.py", "gpuos_tools.agent.replay"): "numpy, in the traced program, under --validate only",
    ("injection/tracer.py", "gpuos_tools.agent.offload"): "numpy, in the traced program, under --validate-in "
    "validator only",
    ("injection/tracer.py", "gpuos_tools.cuda"): "pyelftools, in the traced program, when a layout is read",
    ("agent/validator.py", "gpuos_tools.agent"): "numpy and the CUDA driver, only once the validator process "
    "holds the program's addresses",
    ("commands/kinfer.py", "gpuos_tools.kinfer"): "numpy, not for --help",
    ("commands/predict_access.py", "gpuos_tools.access.plot"): "matplotlib, for --plot only",
}


def test_imports_stand_at_the_tops_of_files() -> None:
    inside = []
    for path in sources():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        top = {id(n) for n in tree.body}
        rel = str(path.relative_to(PACKAGE))
        for node in ast.walk(tree):
            if id(node) in top or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if name.startswith("gpuos_tools") and not any(
                        rel == f and name.startswith(m) for f, m in INNER_ALLOWED):
                    inside.append(f"{rel}:{node.lineno}: {name}")
    assert not inside, "imports inside functions (move them to the top, or say why in INNER_ALLOWED):\n" + \
        "\n".join(inside)


def test_a_long_module_says_why_at_its_top() -> None:
    """Past about 800 lines a module is split, or says at its top why it is one piece."""
    files = [*sources(), *PACKAGE.rglob("*.c")]
    quiet = []
    for path in files:
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) > 850 and "over 800 lines" not in " ".join(lines[:15]).lower():
            quiet.append(f"{path.relative_to(REPO)}: {len(lines)} lines")
    assert not quiet, "long modules without a reason at the top:\n" + "\n".join(quiet)


def test_the_architecture_page_draws_these_layers() -> None:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## The layers", 1)[1].split("```", 2)[1]
    drawn = [line.split()[0] for line in block.splitlines() if line.strip() and not line.startswith(" ─")]
    drawn = [name for name in drawn if not name.startswith("─")]
    expected = [layer[0] if len(layer) == 1 else "base" for layer in reversed(LAYERS)]
    assert drawn == expected, "docs/architecture.md's drawing of the layers is not tests/test_layers.py's LAYERS"
