"""The package's layers (docs/architecture.md): no import cycle, no import upward, and the rules,
the engine and the agent import nothing of the controller. Read from the sources (every import,
a function's lazy one included), so a new module is checked as soon as it exists."""

from __future__ import annotations

import ast
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


# what each room may import (besides itself): the shared rules and the engine import nothing of the
# controller; the agent (which runs in containers) only what it bundles
ALLOWED = {
    "gpugate.rules": ("gpugate.rules",),
    "gpugate.engine": ("gpugate.engine", "gpugate.rules"),
    "gpugate.agent": ("gpugate.agent", "gpugate.rules", "gpugate.engine.sglang.processes",
                      "gpugate.engine.sglang.installed", "gpugate.engine.sglang.weight_cache"),
    "gpugate.settings": (),
}


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_a_lower_room_imports_nothing_above_it(room):
    edges = graph()
    wrong = {name: sorted(target for target in targets if not target.startswith(ALLOWED[room]))
             for name, targets in edges.items() if name == room or name.startswith(room + ".")}
    assert not {name: targets for name, targets in wrong.items() if targets}


def test_the_product_never_imports_the_lab_but_to_run_it():
    users = {module_name(path) for path in PACKAGE.rglob("*.py") if "gpugate_lab" in path.read_text()
             and any(isinstance(node, (ast.Import, ast.ImportFrom)) and "gpugate_lab" in ast.dump(node)
                     for node in ast.walk(ast.parse(path.read_text())))}
    assert users <= {"gpugate.cli"}, users
