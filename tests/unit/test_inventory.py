"""inventory.py: the fleet file as pyinfra sees it, and what the operator sees when it is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import pyinfra_exe

REPO = Path(__file__).resolve().parents[2]

FLEET = """
groups:
  canary: {data: {drain_timeout_s: 30}}
hosts:
  pve1:
    ssh: {hostname: 127.0.0.1, port: 2222, user: root}
    containers:
      129:
        groups: [canary]
        sglang:
          model_path: /opt/models/lab-model
          flags: {tp: 8, kv-cache-dtype: fp8_e4m3, disable-radix-cache: true}
      130:
        sglang: {model_path: /opt/models/lab-model, port: 30001}
"""


def pyinfra_debug_inventory(env_extra: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUGATE_FLEET", "GPUGATE_LAB_DIR")}
    env.update(env_extra)
    pyinfra = pyinfra_exe()
    return subprocess.run([str(pyinfra), str(REPO / "inventory.py"), "debug-inventory"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def fleet_file(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(textwrap.dedent(FLEET))
    return path


# pyinfra's CLI package gevent-patches the process that imports it (monkey.patch_all on import), so the
# inventory is built in a child process: importing it here would turn every later test's threads into
# greenlets.
INVENTORY_PROBE = """
import json, sys
from pyinfra.api import State
from pyinfra.context import ctx_state
from pyinfra_cli.inventory import make_inventory
with ctx_state.use(State()):  # pyinfra's CLI loads inventory files inside a state context
    inventory = make_inventory(sys.argv[1], cwd=sys.argv[2])
keys = ("sglang_flags", "ssh_hostname", "ssh_port", "pct_vmid", "drain_timeout_s", "start_timeout_s",
        "sglang_port")
print(json.dumps({
    "hosts": {h.name: {k: h.data.get(k) for k in keys} for h in inventory},
    "groups": {g: sorted(h.name for h in inventory.get_group(g)) for g in ("canary", "pve_pve1")},
}))
"""


def test_inventory_from_fleet_with_group_data_defaults(fleet_file):
    env = {k: v for k, v in os.environ.items() if k not in ("GPUGATE_FLEET", "GPUGATE_LAB_DIR")}
    env["GPUGATE_FLEET"] = str(fleet_file)
    result = subprocess.run([sys.executable, "-c", INVENTORY_PROBE, str(REPO / "inventory.py"), str(REPO)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    inventory = json.loads(result.stdout.strip().splitlines()[-1])
    hosts = inventory["hosts"]
    assert sorted(hosts) == ["@pct/pve1:129", "@pct/pve1:130"]
    host = hosts["@pct/pve1:129"]
    assert host["sglang_flags"] == {"disable-radix-cache": True, "kv-cache-dtype": "fp8_e4m3", "tp-size": 8}
    assert (host["ssh_hostname"], host["ssh_port"], host["pct_vmid"]) == ("127.0.0.1", 2222, 129)
    assert host["drain_timeout_s"] == 30          # the canary group's data
    assert host["start_timeout_s"] == 2700        # group_data/all.py
    assert host["sglang_port"] == 30000           # group_data/all.py default
    other = hosts["@pct/pve1:130"]
    assert (other["sglang_port"], other["drain_timeout_s"], other["sglang_flags"]) == (30001, 60, {})
    assert inventory["groups"]["canary"] == ["@pct/pve1:129"]
    assert inventory["groups"]["pve_pve1"] == ["@pct/pve1:129", "@pct/pve1:130"]


def test_debug_inventory_shows_the_fleet(fleet_file):
    result = pyinfra_debug_inventory({"GPUGATE_FLEET": str(fleet_file)})
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert "[@pct/pve1:129]" in output and "[@pct/pve1:130]" in output
    assert '"kv-cache-dtype": "fp8_e4m3"' in output


def test_a_malformed_fleet_is_one_clear_line_without_traceback(fleet_file):
    fleet_file.write_text(fleet_file.read_text().replace("fp8_e4m3", "fp9"))
    result = pyinfra_debug_inventory({"GPUGATE_FLEET": str(fleet_file)})
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert (f"gpugate: invalid fleet file: {fleet_file}: hosts.pve1.containers.129.sglang.flags.kv-cache-dtype: "
            "'fp9' is not one of auto") in output
    assert "Traceback" not in output


def test_no_fleet_anywhere_says_what_to_do(tmp_path):
    result = pyinfra_debug_inventory({"GPUGATE_LAB_DIR": str(tmp_path / "no-lab")}, cwd=tmp_path)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "gpugate: no fleet file" in output and "gpugate lab up" in output
    assert "Traceback" not in output


def test_the_lab_fleet_is_used_when_there_is_no_other(tmp_path):
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "fleet.yaml").write_text(textwrap.dedent(FLEET))
    result = pyinfra_debug_inventory({"GPUGATE_LAB_DIR": str(lab)}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[@pct/pve1:129]" in result.stdout + result.stderr
