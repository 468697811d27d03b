"""Two servers in one container on disjoint GPUs (issue 20, item 7): fleet.yaml's sglang: as a list,
tp 2 on GPU 0-1 at :30000 and tp 2 from base-gpu-id 2 at :30001 (4 simulated GPUs). Each is its own desired state,
history and GPU claim: changing or stopping one never touches the other (it used to be taken for
"the previous server" of a port change and stopped), and the status has a row for each."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests import warm_pyinfra
from tests.conftest import REPO_ROOT, module_lab, pyinfra_exe

pytestmark = [pytest.mark.lab]

ENV = {"SGLANG_STANDIN_LOAD_S": "0.3"}
LOW = {"model_path": "/opt/models/lab-model", "port": 30000, "flags": {"tp": 2}, "env": ENV}
HIGH = {"model_path": "/opt/models/lab-model", "port": 30001, "flags": {"tp": 2, "base-gpu-id": 2}, "env": ENV}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-two-servers", hosts=1, gpus=4)  # two halves of 2


def fleet(lab, path: Path, servers: list) -> Path:
    document = yaml.safe_load(lab.fleet_path.read_text())
    document["hosts"]["pve1"]["containers"][129]["sglang"] = servers
    path.write_text(yaml.safe_dump(document))
    return path


def pyinfra(lab, path: Path, *args: str) -> subprocess.CompletedProcess:
    exe = pyinfra_exe()
    return warm_pyinfra.run([exe, "inventory.py", *args], cwd=REPO_ROOT, env=dict(lab.env(), GPUGATE_FLEET=str(path)),
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def main_pids(lab) -> dict[int, int]:
    """port -> pid of each SGLang main process in the container (from /proc)."""
    pids = {}
    for pid, _ppid, cmd, _argv in lab.ps("pve1", 129):
        words = cmd.split()
        if "sglang.launch_server" in cmd and "--port" in words:
            pids[int(words[words.index("--port") + 1])] = pid
    return pids


def test_two_servers_of_one_container_are_each_their_own(lab, tmp_path):
    both = fleet(lab, tmp_path / "both.yaml", [LOW, HIGH])
    first = pyinfra(lab, both, "-y", "deploy.py")
    assert first.returncode == 0, first.stdout + first.stderr
    pids = main_pids(lab)
    assert set(pids) == {30000, 30001}

    status = pyinfra(lab, both, "-y", "runbooks/status.py", "--data", "format=json")
    rows = {row["port"]: row for row in json.loads(status.stdout)["servers"]}
    assert status.returncode == 0 and set(rows) == {30000, 30001}, status.stdout
    assert all(row["verdict"] == "serving as desired" for row in rows.values())

    # a flag change of :30001 alone: :30000 keeps its pid, :30001 restarts; no port change inferred
    changed = fleet(lab, tmp_path / "changed.yaml", [LOW, dict(HIGH, flags={**HIGH["flags"], "kv-cache-dtype": "fp8_e4m3"})])
    dry = pyinfra(lab, changed, "deploy.py", "--dry")
    out = dry.stdout + dry.stderr
    assert "sglang :30001 will restart" in out and "sglang :30000 will" not in out and "port change" not in out, out
    run = pyinfra(lab, changed, "-y", "deploy.py")
    assert run.returncode == 0, run.stdout + run.stderr
    after = main_pids(lab)
    assert after[30000] == pids[30000] and after[30001] != pids[30001]
    assert "stopping :30000" not in run.stdout + run.stderr

    # :30001 stopped (present: false): :30000 untouched, and the status has both rows right
    stopped = fleet(lab, tmp_path / "stopped.yaml", [LOW, dict(HIGH, present=False)])
    run = pyinfra(lab, stopped, "-y", "deploy.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert main_pids(lab) == {30000: pids[30000]}
    status = pyinfra(lab, stopped, "-y", "runbooks/status.py", "--data", "format=json")
    rows = {row["port"]: row["verdict"] for row in json.loads(status.stdout)["servers"]}
    assert rows == {30000: "serving as desired", 30001: "stopped as desired"}, status.stdout


def test_one_server_of_two_is_restarted_or_rolled_back_alone(lab, tmp_path):
    # the adversarial pass: restart.py restarted both; a rollback of :30000 to a spec from before
    # :30001 existed (every GPU) stopped :30000 and then waited out its gate on :30001's GPUs; the status
    # then blamed :30001 for :30000's failed run
    wide = fleet(lab, tmp_path / "wide.yaml", [dict(LOW, flags={"tp": 4})])
    run = pyinfra(lab, wide, "-y", "deploy.py")
    assert run.returncode == 0, run.stdout + run.stderr
    both = fleet(lab, tmp_path / "both.yaml", [LOW, HIGH])
    run = pyinfra(lab, both, "-y", "deploy.py")
    assert run.returncode == 0, run.stdout + run.stderr
    pids = main_pids(lab)

    restart = pyinfra(lab, both, "-y", "runbooks/restart.py", "--data", "only_port=30001")
    assert restart.returncode == 0, restart.stdout + restart.stderr
    after = main_pids(lab)
    assert after[30000] == pids[30000] and after[30001] != pids[30001]
    assert "sglang :30000" not in restart.stdout + restart.stderr

    rollback = pyinfra(lab, both, "-y", "runbooks/rollback.py", "--data", "only_port=30000")
    out = rollback.stdout + rollback.stderr
    assert rollback.returncode != 0, out
    assert "REFUSED, nothing touched: cannot roll back to the good spec #1 of :30000" in out, out
    assert "the server on :30001 holds GPU 2-3" in out and "stopping" not in out, out
    assert main_pids(lab) == after  # neither was touched

    status = pyinfra(lab, both, "-y", "runbooks/status.py", "--data", "format=json")
    rows = {row["port"]: row for row in json.loads(status.stdout)["servers"]}
    assert {port: row["verdict"] for port, row in rows.items()} == {30000: "serving as desired",
                                                                     30001: "serving as desired"}
    assert rows[30001]["last_change"].startswith("verified") and "stray" not in rows[30000]["server"]

    # the two swap their GPU halves in one deploy (issue 32 item 7): :30000's gate would wait on :30001's
    # memory (and :30001's on :30000's); both are refused before anything stops, saying how to do it
    swap = fleet(lab, tmp_path / "swap.yaml", [dict(LOW, flags={"tp": 2, "base-gpu-id": 2}), dict(HIGH, flags={"tp": 2})])
    dry = pyinfra(lab, swap, "deploy.py", "--dry")
    out = dry.stdout + dry.stderr
    assert dry.returncode != 0, out
    assert "sglang :30000 REFUSED, nothing touched: the server on :30001 holds GPU 2-3" in out, out
    assert "sglang :30001 REFUSED, nothing touched: the server on :30000 holds GPU 0-1" in out, out
    assert "in two deploys: (1) :30001 present: false" in out, out
    run = pyinfra(lab, swap, "-y", "deploy.py")
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "REFUSED, nothing touched: the server on :30001 holds GPU 2-3" in out, out
    assert "SIGTERM" not in out and main_pids(lab) == after, out  # neither was touched (no drain began)
