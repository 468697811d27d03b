"""The status and the deploy agree by construction (issue 18): one server deployed from a fleet
file, then each setting of fleet.yaml changed alone; for each, the status's verdict (table and
JSON, through the real pyinfra CLI) and the deploy's plan (``--dry``) must say the same thing:
"as desired" exactly when the deploy would change nothing.

Each case writes its own fleet file beside the lab's and touches nothing (``--dry`` and the
status are read-only), so the cases share one lab and one running server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT, module_lab

pytestmark = [pytest.mark.lab]

BASE = {"model_path": "/opt/models/lab-model", "port": 30000, "flags": {"tp": 8},
        "env": {"SGLANG_STANDIN_LOAD_S": "0.3"}, "extra_args": ["--enable-metrics"]}

# (what changes, the sglang: section's change, True when the deploy must change nothing)
CASES = [
    ("nothing", {}, True),
    ("a flag", {"flags": {"tp": 8, "kv-cache-dtype": "fp8_e4m3"}}, False),
    ("a flag's spelling only", {"flags": {"tp-size": 8}}, True),
    ("the model path", {"model_path": "/opt/models/other-model"}, False),
    ("the listen host", {"host": "0.0.0.0"}, False),
    ("the port", {"port": 30001}, False),
    ("an env value", {"env": {"SGLANG_STANDIN_LOAD_S": "0.4"}}, False),
    ("an env variable added", {"env": {"SGLANG_STANDIN_LOAD_S": "0.3", "HF_TOKEN": "hf_secret_canary"}}, False),
    ("the interpreter", {"python": "/usr/bin/python3.11"}, False),
    ("the supervisor", {"supervisor": "systemd"}, False),
    ("the supervisor, named as it runs", {"supervisor": "process"}, True),
    ("extra_args dropped", {"extra_args": []}, False),
    ("present: false", {"present": False}, False),
    ("an SGLang version pin it does not have", {"sglang_version": "0.5.10"}, False),
    ("the drain budget (no restart)", {"drain_timeout_s": 5}, True),
]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-agreement", hosts=1, gpus=8)


def fleet_with(lab, path: Path, change: dict) -> Path:
    fleet = yaml.safe_load(lab.fleet_path.read_text())
    container = fleet["hosts"]["pve1"]["containers"][129]
    container["sglang"] = {**BASE, **change}
    path.write_text(yaml.safe_dump(fleet))
    return path


def pyinfra(lab, fleet: Path, *args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("pyinfra") or str(Path(sys.executable).with_name("pyinfra"))
    return subprocess.run([exe, "inventory.py", *args], cwd=REPO_ROOT, env=dict(lab.env(), GPUGATE_FLEET=str(fleet)),
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def deployed(lab, tmp_path_factory):
    fleet = fleet_with(lab, tmp_path_factory.mktemp("agreement") / "fleet.yaml", {})
    result = pyinfra(lab, fleet, "-y", "deploy.py")
    assert result.returncode == 0, result.stdout + result.stderr
    return lab


def plan_action(output: str) -> str:
    """What the deploy's --dry says it would do: start, restart, stop, attach, REFUSED, or noop."""
    found = re.search(r"sglang :\d+ (?:will (\w+)|(REFUSED))", output)
    return (found.group(1) or found.group(2)) if found else "noop"


@pytest.mark.parametrize(("what", "change", "unchanged"), CASES, ids=[case[0] for case in CASES])
def test_status_and_deploy_agree_on_every_setting_changed_alone(deployed, tmp_path, what, change, unchanged):
    fleet = fleet_with(deployed, tmp_path / "fleet.yaml", change)
    dry = pyinfra(deployed, fleet, "deploy.py", "--dry")
    action = plan_action(dry.stdout + dry.stderr)
    table = pyinfra(deployed, fleet, "-y", "runbooks/status.py")
    document = pyinfra(deployed, fleet, "-y", "runbooks/status.py", "--data", "format=json")
    row = json.loads(document.stdout)["servers"][0]
    line = next(line for line in table.stdout.splitlines() if line.startswith("pve1"))

    assert (action == "noop") is unchanged, f"{what}: the deploy would {action}\n{dry.stdout}"
    assert row["ok"] is unchanged and (table.returncode == 0) is unchanged, f"{what}: {row['verdict']}"
    assert row["verdict"] in line  # the table says what the JSON says
    if unchanged:
        assert row["verdict"] == "serving as desired"
    elif action == "stop":
        assert row["verdict"] == "drifted: runs but should not"
    elif action == "start":  # nothing of the desired server runs (another port)
        assert row["verdict"].startswith("down but desired")
    else:  # restart, or a restart the checks refuse: the server that runs is not the desired one
        assert row["verdict"].startswith("drifted: "), row["verdict"]
    assert "hf_secret_canary" not in dry.stdout + dry.stderr + table.stdout + document.stdout
