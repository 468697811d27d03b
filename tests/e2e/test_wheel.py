"""gpugate built as a wheel and used from it, outside the checkout: templates, remote code, the runbooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import lab_unavailable_reason, start_lab

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel `pip wheel .` builds (as `pip install .` would), unpacked: a site dir holding gpugate only
    (its dependencies come from this interpreter's site-packages)."""
    out = tmp_path_factory.mktemp("wheel")
    source = tmp_path_factory.mktemp("src")
    # Build from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file() or (REPO / name).is_symlink():
            target = source / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if (REPO / name).is_symlink():
                target.symlink_to(os.readlink(REPO / name))
            else:
                target.write_bytes((REPO / name).read_bytes())
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(out.glob("gpugate-*.whl"))
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert "gpugate/templates/sglang.service.j2" in names
        assert "gpugate/project/runbooks/status.py" in names and "gpugate/project/inventory.py" in names
        assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith("LICENSE") for n in names)
        # the product only: the lab is its own package (lab/), never shipped to a fleet's controller
        assert not [n for n in names if "gpugate_lab" in n or n.startswith("gpugate/lab/") or "standin" in n]
        archive.extractall(site)
    return site


def run_installed(site: Path, code_or_args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *code_or_args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(site), **(env or {})}, stdin=subprocess.DEVNULL)


def test_the_wheel_renders_the_unit_and_finds_its_files(installed, tmp_path):
    code = (
        # the systemd supervisor's unit, rendered from the wheel's template (TemplateNotFound before)
        "import gpugate, json; from gpugate import resources; import gpugate.operations.sglang as op;"
        "from gpugate.spec import desired_state;"
        "unit = op.render_unit(desired_state({'sglang_model_path': '/m', 'sglang_port': 30000}).spec, 70);"
        "print(json.dumps({'file': gpugate.__file__, 'project': str(resources.project_dir()),"
        " 'unit': unit, 'runbooks': resources.runbook_names()}))"
    )
    result = run_installed(installed, ["-c", code], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["file"].startswith(str(installed))
    assert doc["project"] == str(installed / "gpugate" / "project")
    assert "ExecStart=\"/usr/bin/python3\" \"-m\" \"sglang.launch_server\"" in doc["unit"] and "KillMode=mixed" in doc["unit"]
    assert "status" in doc["runbooks"]
    version = run_installed(installed, ["-m", "gpugate", "--version"], cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("gpugate ")


def test_the_installed_runbook_runs_against_the_lab(installed, tmp_path):
    reason = lab_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from gpugate_lab import core

    lab = start_lab(tmp_path / "lab", hosts=1)
    try:
        # cwd is not the checkout: the inventory, group_data and runbook all come from the wheel
        result = run_installed(installed, ["-m", "gpugate", "runbook", "status", "-y"], cwd=tmp_path,
                               env={"GPUGATE_FLEET": str(lab.fleet_path), "GPUGATE_LAB_DIR": str(lab.dir)})
        assert "pve1" in result.stdout and "129" in result.stdout, result.stdout + result.stderr
        assert "Traceback" not in result.stderr
        # without the lab installed, `gpugate lab` says how to install it, in one line
        missing = run_installed(installed, ["-c", "import sys; sys.modules['gpugate_lab'] = None;"
                                            "from gpugate.cli import main; sys.exit(main(['lab', 'status']))"],
                                cwd=tmp_path)
        assert missing.returncode == 1 and "the local lab is not installed" in missing.stderr, missing.stderr
    finally:
        core.down(lab.dir)
