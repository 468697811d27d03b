"""The bundle's import scan (gpugate.bundle.gpugate_imports) finds what Python's own parser finds: a
module the agent imports and the scan missed would be absent in the container, and the agent would
fail there with ModuleNotFoundError."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpugate import bundle

PACKAGE_FILES = sorted(bundle.PACKAGE_DIR.rglob("*.py"))


def parsed_imports(source: str) -> set[str]:
    """What ast sees: the reference the scan is held to."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gpugate":
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "gpugate")
    return {name for name in found if bundle.module_path(name).is_file() and bundle.module_path(name).name != "__init__.py"}


@pytest.mark.parametrize("path", PACKAGE_FILES, ids=[p.relative_to(bundle.ROOT).as_posix() for p in PACKAGE_FILES])
def test_the_scan_finds_every_import_the_parser_finds(path: Path):
    source = path.read_text()
    assert parsed_imports(source) <= bundle.gpugate_imports(source)


def test_the_agent_bundle_is_exactly_what_its_modules_import():
    todo, seen = list(bundle.AGENT_MODULES), set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(parsed_imports(bundle.module_path(name).read_text()) - seen)
    assert bundle.with_imports(bundle.AGENT_MODULES) == tuple(sorted(seen))


@pytest.mark.parametrize("source, expected", [
    ("from gpugate.rules import (\n    gate,  # the decision\n    procfs,\n)\n", {"gpugate.rules.gate", "gpugate.rules.procfs"}),
    ("def lazy():\n    from gpugate.rules.gate import decide as choose\n", {"gpugate.rules.gate"}),
    ("import os, gpugate.rules.redact as redact\n", {"gpugate.rules.redact"}),
    ("from gpugate.rules import nothing_such\nimport gpugateway\n", set()),
])
def test_the_forms_an_import_takes(source: str, expected: set[str]):
    assert bundle.gpugate_imports(source) == expected
