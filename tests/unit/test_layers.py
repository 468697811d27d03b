"""The package's layers (docs/architecture.md): no import cycle, no import upward, and the rules,
the engine and the agent import nothing of the controller. Read from the sources (every import,
a function's lazy one included), so a new module is checked as soon as it exists."""

from __future__ import annotations

import ast
import re
from fnmatch import fnmatch
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gpugate"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The gpugate modules ``path`` imports (``from gpugate.x import y``: gpugate.x.y when that is
    a module, else gpugate.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gpugate":
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "gpugate")
    return {name for name in found if name in known}


def graph() -> dict[str, set[str]]:
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    known = set(files)
    # importing a package's module runs the packages above it: those are no edges of the graph here
    return {name: imports_of(path, known) - {name} - {p for p in known if name.startswith(p + ".")}
            for name, path in files.items()}


def test_the_import_graph_has_no_cycle():
    edges = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node, path):
        state[node] = 1
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target] if target in path else [node, target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


# what each room may import (besides itself), as patterns: the shared rules and the engine import
# nothing of the controller (the engine's table builder goes out through gpugate.remote's inline
# commands); the agent (which runs in containers) only what it bundles: the rules and the engines'
# container interface (it loads an engine's container module by the name a document carries);
# the settings only the engine registry (an ``engine`` row names an installed engine)
ALLOWED = {
    "gpugate.rules": ("gpugate.rules.*",),
    "gpugate.engine": ("gpugate.engine", "gpugate.engine.*", "gpugate.rules.*", "gpugate.remote"),
    "gpugate.agent": ("gpugate.agent.*", "gpugate.rules.*", "gpugate.engine.container"),
    "gpugate.settings": ("gpugate.engine", "gpugate.rules.*"),
}


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_a_lower_room_imports_nothing_above_it(room):
    edges = graph()
    wrong = {name: sorted(target for target in targets if not any(fnmatch(target, rule) for rule in ALLOWED[room]))
             for name, targets in edges.items() if name == room or name.startswith(room + ".")}
    assert not {name: targets for name, targets in wrong.items() if targets}


def test_nothing_outside_the_engines_imports_an_engine_by_name():
    """Outside gpugate/engine/ only the seam (gpugate.engine) and the container interface
    (gpugate.engine.container) are imported: an engine is found by its entry point."""
    seam = ("gpugate.engine", "gpugate.engine.container")
    wrong = {name: sorted(t for t in targets if t.startswith("gpugate.engine") and t not in seam)
             for name, targets in graph().items() if not name.startswith("gpugate.engine")}
    assert not {name: targets for name, targets in wrong.items() if targets}


# SGLang's own words: its entry point, process titles, endpoints and options. Outside gpugate/engine/
# they may appear in docstrings (examples, explanations), never in code.
SGLANG_WORDS = re.compile(r"launch_server|sglang::|get_server_info|/health_generate|--gated-launch-port|"
                          r"--weight-cache-mode|--tp-size|tp-size|base-gpu-id|hicache|ServerArgs|server_args\b|"
                          r"sglang\.srt|enable-dp-attention|--model-path")


def code_strings(path: Path) -> list[tuple[int, str]]:
    """The string constants of a module that are no docstring."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]


def test_nothing_outside_the_engines_names_sglang_in_code():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {SGLANG_WORDS.search(text).group(0)}"
             for path in sorted(PACKAGE.rglob("*.py")) if PACKAGE / "engine" not in path.parents
             for line, text in code_strings(path) if SGLANG_WORDS.search(text)]
    assert not found, "\n".join(found)


def test_the_check_sees_sglang_where_it_is():
    """The scan is no test that cannot fail: the engine's own modules are full of it."""
    assert any(SGLANG_WORDS.search(text) for _, text in code_strings(PACKAGE / "engine" / "sglang" / "container.py"))


def test_the_product_never_imports_the_lab_but_to_run_it():
    users = {module_name(path) for path in PACKAGE.rglob("*.py") if "gpugate_lab" in path.read_text()
             and any(isinstance(node, (ast.Import, ast.ImportFrom)) and "gpugate_lab" in ast.dump(node)
                     for node in ast.walk(ast.parse(path.read_text())))}
    assert users <= {"gpugate.cli"}, users
