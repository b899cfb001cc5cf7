"""The packages import one way (traffic and drafters, then eval, then train) and no module imports one that
imports it back, counting imports inside functions too, subpackages included (docs/architecture.md); and no
module of the packages or scripts/ is longer than MAX_LINES."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEVEL = {"traffic": 0, "drafters": 0, "eval": 1, "train": 2}
MAX_LINES = 450
SIZED = ("drafters", "eval", "train", "traffic", "scripts")


def module_name(path: Path) -> str:
    """A file's dotted module name: `eval/formats/checks.py` is eval.formats.checks, `eval/formats/__init__.py`
    the package eval.formats."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of the packages and the modules of the packages it imports, anywhere in its file."""
    modules = {module_name(f): f for pkg in LEVEL for f in sorted((ROOT / pkg).rglob("*.py"))}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def test_no_package_imports_one_above_it():
    upward = [f"{m} -> {d}" for m, deps in import_graph().items() for d in deps
              if LEVEL[d.split(".")[0]] > LEVEL[m.split(".")[0]]]
    assert not upward


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo += graph[node]
        return False

    circles = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if reaches(d, m))
    assert not circles


def test_the_graph_holds_the_modules_of_subpackages():
    assert module_name(ROOT / "eval" / "formats" / "__init__.py") == "eval.formats"
    assert {"eval", "eval.formats", "eval.formats.checks"} <= set(import_graph())


def test_no_module_is_longer_than_the_limit():
    long = [f"{f.relative_to(ROOT)}: {n} lines" for pkg in SIZED for f in sorted((ROOT / pkg).rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split them): " + ", ".join(long)
