"""mypy over the package (configured in pyproject.toml: everything but the lab simulator), so that
`python3 -m pytest` checks the types the package promises with py.typed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_mypy_is_clean_outside_the_lab():
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--no-color-output"], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert result.returncode == 0 and not errors, f"{len(errors)} mypy errors:\n" + result.stdout[-6000:] + result.stderr
