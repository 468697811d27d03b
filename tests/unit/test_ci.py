"""CI runs the README's test command, no other (issue 19): the line a user copies is the line CI proves."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ci_runs_exactly_the_readmes_test_command():
    readme = (REPO / "README.md").read_text()
    command = re.search(r"^scripts/bootstrap && (python3 -m pytest.*)$", readme, re.M)
    assert command, "the README's test command line (scripts/bootstrap && python3 -m pytest ...) is missing"
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert ci[ci.index("scripts/bootstrap") + 1] == command.group(1)
    assert "set -euo pipefail" in ci  # a failing bootstrap or suite fails CI


def test_the_longest_modules_named_for_the_schedule_exist():
    """tests/conftest.py collects these first (xdist gives them out first); a renamed or moved module
    would silently fall back to its collection place and make a worker run on alone at the end."""
    from tests.conftest import LONGEST_MODULES

    assert [path for path in LONGEST_MODULES if not (REPO / path).is_file()] == []


def test_the_controller_of_the_lab_tests_imports_this_checkout(tmp_path):
    """The `pyinfra` the lab tests run (Lab.env) imports this checkout's gpugate, whichever checkout
    the interpreter's editable install points at (on a shared machine: the last bootstrap run)."""
    import subprocess

    from tests.conftest import Lab

    env = Lab(dir=tmp_path, hosts=[], fleet_path=tmp_path / "fleet.yaml").env()
    out = subprocess.run([controller_python(), "-c", "import gpugate; print(gpugate.__file__)"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.stdout.strip() == str(REPO / "gpugate" / "__init__.py"), (out.stdout, out.stderr)


def test_the_controller_holds_gpugate_without_its_test_dependencies():
    """The lab tests run pyinfra from the venv scripts/bootstrap makes with gpugate's runtime
    dependencies only: a deploy that imported something of the test extra would fail there, as it
    would on an operator's controller after `pip install gpugate`."""
    import subprocess

    from tests.conftest import CONTROLLER_VENV, pyinfra_exe

    assert pyinfra_exe() == str(CONTROLLER_VENV / "bin" / "pyinfra"), "scripts/bootstrap makes .venv-controller"
    probe = ("import importlib.util as u; "
             "print(*[m for m in ('pytest', 'hypothesis', 'mypy', 'xdist', 'gpugate_lab') if u.find_spec(m)])")
    out = subprocess.run([controller_python(), "-c", probe], capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0 and out.stdout.strip() == "", (out.stdout, out.stderr)


def controller_python() -> str:
    """The interpreter behind the tests' pyinfra CLI (its script's shebang)."""
    from tests.conftest import pyinfra_exe

    shebang = Path(pyinfra_exe()).read_text().splitlines()[0]
    assert shebang.startswith("#!") and "python" in shebang, shebang
    return shebang[2:].strip().split()[0]
