"""The packages import one way (traffic and drafters, then eval, then train) and no module imports one that
imports it back, counting imports inside functions too, subpackages included (docs/architecture.md); no
module of the packages or scripts/ is longer than MAX_LINES; and the tests mirror the files they test."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEVEL = {"traffic": 0, "drafters": 0, "eval": 1, "train": 2}
MAX_LINES = 450
SIZED = ("drafters", "eval", "train", "traffic", "scripts")


def module_name(path: Path) -> str:
    """A file's dotted module name: `eval/engines/formats/checks.py` is eval.engines.formats.checks, `eval/engines/formats/__init__.py`
    the package eval.engines.formats."""
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
    assert module_name(ROOT / "eval" / "engines" / "formats" / "__init__.py") == "eval.engines.formats"
    assert {"eval", "eval.engines", "eval.engines.formats", "eval.engines.formats.checks"} <= set(import_graph())


def test_no_module_is_longer_than_the_limit():
    long = [f"{f.relative_to(ROOT)}: {n} lines" for pkg in SIZED for f in sorted((ROOT / pkg).rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split them): " + ", ".join(long)


# Test files that test one thing across several modules, each with why it has no single file to mirror.
ACROSS = {
    "drafters/test_families.py": "every drafter kind on every model family the tests build",
    "eval/engines/test_llama_cpp_diagnosis.py": "llama_cpp.py's diagnosis of a dying server, run without the build "
                                               "that tests/eval/engines/test_llama_cpp.py needs",
    "eval/engines/test_llama_cpp_features.py": "train/hidden_states.py's llama.cpp path and the llama-hidden-states "
                                              "tool its patch adds, beside the other tests that need llama.cpp's build",
    "train/test_gpu_recipe.py": "conf/experiment/llama3_8b_eagle.yaml, the GPU recipe, composed and run",
}


def test_the_tests_mirror_the_files_they_test():
    """tests/<path>/test_<name>.py tests <path>/<name>.py (or the package <path>/<name>/, `__main__.py` for
    test_main, a script's .sh): a reader finds a module's tests by its name, and a test file by what it tests."""
    tests = ROOT / "tests"
    stray = []
    for path in sorted(tests.rglob("test_*.py")):
        rel = path.relative_to(tests)
        if len(rel.parts) == 1 or rel.as_posix() in ACROSS:  # tests/test_*.py: the repository as a whole
            continue
        name = rel.stem.removeprefix("test_")
        where = ROOT / rel.parent
        if not any(p.exists() for p in (where / f"{name}.py", where / name, where / f"__{name}__.py",
                                        where / f"{name}.sh")):
            stray.append(rel.as_posix())
    assert not stray, f"test files that name no file they test (rename them, or say why in ACROSS): {stray}"
    assert all((tests / f).exists() for f in ACROSS), "ACROSS names a test file that is gone"
