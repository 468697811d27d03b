"""Every gpugate module's docstring examples, run by the README's one test command (issue 31).

The modules are found from the package's files, so a new module is covered the day it lands; one
case per module (``test_doctests[gpugate.gate]``), so a failure names the module, and its message
is the doctest report (every failing example with what it printed). A module without examples
still counts: it must import in the test process, as pytest's own collector imports it
(``python3 -m pytest --doctest-modules gpugate`` runs the same examples; the option flags are its
defaults, none). An example that needs a real container or GPU carries
``# doctest: +SKIP`` and says why next to it.
"""

from __future__ import annotations

import doctest
import importlib
import io
from pathlib import Path

import pytest

import gpugate

PACKAGE_DIR = Path(gpugate.__file__).resolve().parent


def package_modules() -> list[str]:
    """gpugate's modules by dotted name, from its ``*.py`` files. ``__main__.py`` is left out, as
    pytest's ``--doctest-modules`` leaves it out: importing it runs the CLI (``python -m gpugate``)."""
    names = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path.name == "__main__.py":
            continue
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = package_modules()


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    module = importlib.import_module(name)
    report = io.StringIO()
    runner = doctest.DocTestRunner(verbose=False)
    for test in doctest.DocTestFinder().find(module):
        runner.run(test, out=report.write)
    assert runner.failures == 0, f"{name}: {runner.failures} of {runner.tries} examples failed\n{report.getvalue()}"


def test_every_module_is_found():
    """The discovery reaches into the subpackages (a glob gone wrong would pass every case above by
    running nothing), and every folder it takes modules from is a package: a folder without an
    ``__init__.py`` would be named here as gpugate's but not be importable as such."""
    assert {"gpugate", "gpugate.gate", "gpugate.fleet", "gpugate.report.text", "gpugate.router.smg"} <= set(MODULES)
    folders = {path.parent for path in PACKAGE_DIR.rglob("*.py")}
    assert [str(folder) for folder in sorted(folders) if not (folder / "__init__.py").is_file()] == []
