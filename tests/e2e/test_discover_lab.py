"""Issue 36 through the real CLI: a lab host whose containers 129 and 130 each get 2 of its 4 GPUs
(``gpugate lab up --containers 129:0-1,130:2-3``), then a third container 131 passed GPU 1 of 129
by raw lxc lines. ``gpugate discover`` lists them with their GPUs and the shared one, and writes a
draft; a deploy's ``--dry`` refuses, before anything stops, a server needing more GPUs than its
container maps (naming the node's map) and a server on the shared GPU (two servers claiming it). Then
one tp 1 server started in 129 by a deploy: discover lists it and drafts it (its secret env left out
and named), a deploy of the draft changes nothing, and the status shows each container's mapped GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import warm_pyinfra
from tests.conftest import REPO_ROOT, lab_unavailable_reason, pyinfra_exe

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def lab_dir(tmp_path_factory):
    reason = lab_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from gpugate_lab import core

    path = tmp_path_factory.mktemp("discover-lab")
    try:
        up = gpugate("lab", "up", "--dir", str(path), "--gpus", "4", "--containers", "129:0-1,130:2-3")
        assert up.returncode == 0, up.stderr
        core.add_container(path, "pve1", 131, gpus=(1,), gpu_style="raw")
        yield path
    finally:
        core.down(path)


def gpugate(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpugate", *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          env=env, timeout=120, stdin=subprocess.DEVNULL)


def lab_env(lab_dir, fleet) -> dict:
    return {**os.environ, "GPUGATE_LAB_DIR": str(lab_dir), "GPUGATE_FLEET": str(fleet),
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


def test_discovery_lists_each_containers_gpus_and_the_shared_one_and_writes_a_draft(lab_dir, tmp_path):
    from gpugate_lab import core

    seen = subprocess.run(core.host_exec_argv(lab_dir, "pve1") + ["pct", "exec", "130", "--", "ls", "/dev"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL).stdout.split()
    assert [name for name in seen if name.startswith("nvidia")] == ["nvidia-uvm", "nvidia2", "nvidia3", "nvidiactl"]
    draft = tmp_path / "fleet.yaml"
    result = gpugate("discover", "--format", "json", "--write", str(draft), env=lab_env(lab_dir, lab_dir / "fleet.yaml"))
    assert result.returncode == 0, result.stderr
    (host,) = json.loads(result.stdout.split("fleet draft written")[0])["hosts"]
    assert [(ct["vmid"], ct["status"], ct["gpus"]) for ct in host["containers"]] == [
        (129, "running", [0, 1]), (130, "running", [2, 3]), (131, "running", [1])]
    assert host["shared"] == {"1": [129, 131]}
    text = draft.read_text()
    assert "129: {}  # ct129, running, privileged; GPUs 0-1 (/dev/nvidia0-1)" in text and "port:" in text
    again = gpugate("discover", "--write", str(draft), env=lab_env(lab_dir, lab_dir / "fleet.yaml"))
    assert (again.returncode, draft.read_text()) == (1, text) and "exists; it was kept as it is (--force" in again.stderr


def test_the_plan_refuses_a_server_beyond_its_containers_map_and_one_on_a_shared_gpu(lab_dir, tmp_path):
    fleet = tmp_path / "fleet.yaml"
    lines = (lab_dir / "fleet.yaml").read_text().splitlines()
    ssh = next(line for line in lines if line.strip().startswith("ssh:"))
    server = "{sglang: {model_path: /opt/models/lab-model, port: 30000, flags: {%s}}}"
    # 129 and 131 both want GPU 1, which both map; 130 wants GPU 0, which it does not map (2-3). The map is
    # read before a start only, after the pure checks: 130's claim overlaps no other server's
    fleet.write_text("\n".join(["hosts:", "  pve1:", ssh, "    containers:",
                                "      129: " + server % "tp: 1, base-gpu-id: 1", "      130: " + server % "tp: 1",
                                "      131: " + server % "tp: 1, base-gpu-id: 1"]) + "\n")
    result = warm_pyinfra.run([pyinfra_exe(), "-y", "inventory.py", "deploy.py", "--dry"], cwd=REPO_ROOT,
                            env=lab_env(lab_dir, fleet), capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert ("[@pct/pve1:130] sglang :30000 REFUSED, nothing touched: container 130 maps /dev/nvidia2-3; "
            "--tp-size 1 needs 1 GPU (GPU 0), GPU 0 not mapped") in out, out
    assert ("[@pct/pve1:131] sglang :30000 REFUSED, nothing touched: another desired server of this Proxmox host "
            "claims its GPUs: pve1: ct 129 :30000 (GPU 1) and ct 131 :30000 (GPU 1) claim the same GPU 1") in out, out


def pyinfra(lab_dir, fleet, *args: str) -> subprocess.CompletedProcess:
    return warm_pyinfra.run([pyinfra_exe(), "-y", "inventory.py", *args], cwd=REPO_ROOT, env=lab_env(lab_dir, fleet),
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_discovery_drafts_the_server_it_finds_running_and_a_deploy_of_the_draft_changes_nothing(lab_dir, tmp_path):
    fleet = tmp_path / "fleet.yaml"
    ssh = next(line for line in (lab_dir / "fleet.yaml").read_text().splitlines() if line.strip().startswith("ssh:"))
    fleet.write_text("\n".join(["hosts:", "  pve1:", ssh, "    containers:", "      129: {sglang: {model_path: "
                                "/opt/models/lab-model, port: 30000, flags: {tp: 1}, env: {SGLANG_STANDIN_LOAD_S: '0.3', "
                                "HF_TOKEN: hf_discover_secret}}}"]) + "\n")
    deploy = pyinfra(lab_dir, fleet, "deploy.py")
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    draft = tmp_path / "draft.yaml"
    found = gpugate("discover", "--format", "json", "--write", str(draft), env=lab_env(lab_dir, fleet))
    assert found.returncode == 0, found.stderr
    containers = {ct["vmid"]: ct for ct in json.loads(found.stdout.split("fleet draft written")[0])["hosts"][0]["containers"]}
    (server,) = containers[129]["servers"]
    assert (server["engine"], server["port"], server["serving"], server["flags"]) == ("sglang", 30000, True, {"tp-size": 1})
    assert containers[130]["servers"] == [] and containers[131]["servers"] == []
    text = draft.read_text()
    assert "hf_discover_secret" not in text + found.stdout + found.stderr
    assert "# left out of :30000, secret: env HF_TOKEN" in text and "# 130: {}" in text, text
    # the draft with the secret's value written in, as the draft says: a deploy of it changes nothing
    draft.write_text(text.replace('"SGLANG_STANDIN_LOAD_S": "0.3"}', '"SGLANG_STANDIN_LOAD_S": "0.3", "HF_TOKEN": "hf_discover_secret"}'))
    again = pyinfra(lab_dir, draft, "deploy.py")
    out = again.stdout + again.stderr
    assert again.returncode == 0 and "[@pct/pve1:129] No changes" in out and "stopping" not in out, out
    # the status shows what each container maps, from the node's view
    status = pyinfra(lab_dir, draft, "runbooks/status.py", "--data", "format=json")
    rows = json.loads(status.stdout)["servers"]
    assert [(row["vmid"], row["mapped_gpus"]) for row in rows] == [(129, [0, 1])], status.stdout
