"""runbooks/status.py end to end through the real pyinfra CLI on a 2-host lab: verdicts, history, JSON,
the Prometheus file, an unreachable host and a fleet that is entirely unreachable. Tests run in order."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import time

import pytest

from tests import warm_pyinfra
from tests.conftest import REPO_ROOT, module_lab, pyinfra_exe

pytestmark = [pytest.mark.lab]

FAST = {"SGLANG_STANDIN_LOAD_S": "0.3"}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-status", hosts=2, gpus=4)  # tp 4: the ranks' count is not what is tested


def pyinfra(lab, deploy: str, *extra: str, flags=None) -> subprocess.CompletedProcess:
    exe = pyinfra_exe()
    args = [exe, "-y", "inventory.py", deploy, "--data", f"sglang_env={json.dumps(FAST)}",
            "--data", f"sglang_flags={json.dumps(flags or {'tp': 4})}", *extra]
    return warm_pyinfra.run(args, cwd=REPO_ROOT, env=lab.env(), capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def rows(stdout: str) -> dict[str, str]:
    return {line.split()[0]: line for line in stdout.splitlines()[1:] if line.startswith("pve")}


def test_drifted_and_down_rows_history_and_exit_status(lab):
    deployed = pyinfra(lab, "deploy.py", "--limit", "pve1")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    result = pyinfra(lab, "runbooks/status.py", flags={"tp": 4, "kv-cache-dtype": "fp8_e4m3"})
    assert result.returncode == 1, result.stderr
    table = rows(result.stdout)
    assert "drifted: + --kv-cache-dtype fp8_e4m3" in table["pve1"]  # one diff format (issue 20)
    assert "down but desired: no server runs" in table["pve2"]
    assert "2 server(s): 0 as desired, 2 NOT (down but desired 1, drifted 1)" in result.stdout
    assert "history (newest first):\n  pve1:129  " in result.stdout
    assert re.search(r"pve1:129  \S+ \S+ good 0 \(newest\) by \S+: nothing older kept", result.stdout), result.stdout
    assert "gpugate: fleet " in result.stderr and "gpugate: fleet " not in result.stdout

    as_desired = pyinfra(lab, "runbooks/status.py", "--limit", "pve1")
    assert as_desired.returncode == 0, as_desired.stdout + as_desired.stderr
    assert "serving as desired" in rows(as_desired.stdout)["pve1"]


def test_json_is_one_document_and_the_prometheus_file_is_written(lab, tmp_path):
    prom = tmp_path / "gpugate.prom"
    result = pyinfra(lab, "runbooks/status.py", "--data", "format=json", "--data", f"prom={prom}")
    doc = json.loads(result.stdout)  # the whole stdout is one document
    assert doc["ok"] is False and [s["host"] for s in doc["servers"]] == ["pve1", "pve2"]
    assert [s["kind"] for s in doc["servers"]] == ["serving", "down"]
    text = prom.read_text()
    assert 'gpugate_sglang_up{host="pve1",vmid="129",port="30000",engine="sglang"} 1' in text
    assert 'gpugate_sglang_up{host="pve2",vmid="129",port="30000",engine="sglang"} 0' in text
    assert 'gpugate_gpu_used_mib{host="pve1",vmid="129",port="30000",engine="sglang",gpu="0"}' in text
    assert 'gpugate_sglang_last_transition{host="pve1",vmid="129",port="30000",engine="sglang",outcome="verified"} 1' in text


def _kill_host(lab, name: str) -> None:
    from gpugate_lab import core

    pid = core.host_init_pid(lab.dir, name)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.02)


def test_an_unreachable_host_gets_a_row_with_why_and_so_does_a_whole_fleet(lab):
    _kill_host(lab, "pve2")
    result = pyinfra(lab, "runbooks/status.py")
    assert result.returncode == 1
    table = rows(result.stdout)
    assert "serving as desired" in table["pve1"]
    assert "unreachable: " in table["pve2"] and "Unable to connect" in table["pve2"], result.stdout
    assert table["pve2"].split()[-1] == "-"  # no GPU figures, no last change for a host that cannot be reached

    _kill_host(lab, "pve1")
    result = pyinfra(lab, "runbooks/status.py", "--data", "format=json")
    assert result.returncode != 0
    doc = json.loads(result.stdout)
    assert [s["kind"] for s in doc["servers"]] == ["unreachable", "unreachable"]
