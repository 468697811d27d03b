"""`gpugate lab up|down|status` never surprises: host counts, the fleet file, down hosts (real CLI, real lab)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import lab_unavailable_reason

pytestmark = pytest.mark.lab


@pytest.fixture
def lab_dir(tmp_path):
    reason = lab_unavailable_reason()
    if reason:
        pytest.skip(reason)
    path = tmp_path / "lab"
    yield path
    subprocess.run([sys.executable, "-m", "gpugate", "lab", "--dir", str(path), "down"], capture_output=True,
                   timeout=60)


def lab(lab_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpugate", "lab", "--dir", str(lab_dir), *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL, env=dict(os.environ))


def test_host_count_fleet_edits_and_down_hosts(lab_dir):
    assert lab(lab_dir, "up", "--hosts", "2").returncode == 0
    fleet = lab_dir / "fleet.yaml"
    assert "pve2:" in fleet.read_text()

    # fewer hosts than the lab has: refused, naming what is there; nothing changes
    fewer = lab(lab_dir, "up", "--hosts", "1")
    assert fewer.returncode == 1 and "Traceback" not in fewer.stderr
    assert "this lab has 2 hosts (pve1..pve2); --hosts 1 would leave pve2 out" in fewer.stderr
    # no --hosts: the lab as it is
    again = lab(lab_dir, "up")
    assert again.returncode == 0 and "pve2: up" in again.stdout

    # the user's edit survives a grown lab; the lab's view is written beside it, and the run says so
    edited = fleet.read_text() + "# kept: my note\n"
    fleet.write_text(edited)
    grown = lab(lab_dir, "up", "--hosts", "3")
    assert grown.returncode == 0, grown.stderr
    assert fleet.read_text() == edited
    beside = lab_dir / "fleet.lab.yaml"
    assert "pve3:" in beside.read_text()
    assert f"{fleet} has edits of yours and was kept as it is" in grown.stdout and str(beside) in grown.stdout

    # down hosts: no GPU figures, the fleet file (with the edit) kept
    assert lab(lab_dir, "down").returncode == 0
    status = lab(lab_dir, "status")
    assert "pve1: down" in status.stdout and "gpu used MiB" not in status.stdout
    assert fleet.read_text() == edited


def test_an_unedited_fleet_file_follows_the_lab(lab_dir):
    assert lab(lab_dir, "up", "--hosts", "1").returncode == 0
    grown = lab(lab_dir, "up", "--hosts", "2")
    assert grown.returncode == 0
    assert "pve2:" in (lab_dir / "fleet.yaml").read_text()
    assert not (lab_dir / "fleet.lab.yaml").exists()
