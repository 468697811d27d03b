"""Lab hosts: real sshd per host with host key checking, own namespaces, idempotent `lab up`, status, fleet."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpugate_lab import core

# ---------------------------------------------------------------- pure helpers (no lab)


def test_sshd_config_is_key_only_loopback_with_sftp_and_pct_on_path(tmp_path):
    text = core.sshd_config_text(tmp_path / "pve1", 40123, tmp_path / "authorized_keys")
    for line in ("ListenAddress 127.0.0.1", "Port 40123", "PasswordAuthentication no", "UsePAM no",
                 "PermitRootLogin prohibit-password", "Subsystem sftp internal-sftp", "StrictModes no"):
        assert line in text.splitlines()
    assert f"SetEnv PATH={tmp_path / 'pve1' / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin" in text


def test_fleet_yaml_has_the_shape_inventory_reads(tmp_path):
    doc = core.fleet_document(tmp_path, [("pve1", 40123)], {"pve1": [129]})
    parsed = yaml.safe_load(core.render_fleet_yaml(doc))
    assert parsed == {"hosts": {"pve1": {
        "ssh": {"hostname": "127.0.0.1", "port": 40123, "user": "root", "key": str(tmp_path / "id_ed25519"),
                "known_hosts_file": str(tmp_path / "known_hosts")},
        "containers": {129: {"sglang": {"model_path": "/opt/models/lab-model", "port": 30000, "flags": {"tp": 8}}}},
    }}}


def test_a_lab_of_both_engines_gives_each_container_its_engines_server_on_its_own_gpus(tmp_path):
    from gpugate.fleet import fleet_to_inventory, load_fleet
    from gpugate.spec import desired_states

    doc = core.fleet_document(tmp_path, [("pve1", 40123)], {"pve1": [130, 129]}, engines=("sglang", "vllm"))
    path = tmp_path / "fleet.yaml"
    path.write_text(core.render_fleet_yaml(doc))
    containers = yaml.safe_load(path.read_text())["hosts"]["pve1"]["containers"]
    assert containers[129] == {"sglang": {"model_path": "/opt/models/lab-model", "port": 30000, "flags": {"tp": 4}}}
    assert containers[130] == {"vllm": {"model_path": "/opt/models/lab-model", "port": 8000,
                                        "flags": {"tensor-parallel-size": 4}, "env": {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}}}
    # what gpugate makes of it: one server per engine, on disjoint GPUs (no claim refused)
    hosts, _data = fleet_to_inventory(load_fleet(path))["pve_pve1"]
    gpus = {}
    for _name, data in hosts:
        for desired in desired_states(data):
            assert desired.problem is None, desired.problem
            gpus[desired.spec.engine] = desired.spec.launch.gpus
    assert gpus == {"sglang": (0, 1, 2, 3), "vllm": (4, 5, 6, 7)}, gpus


def test_an_engine_the_lab_has_no_server_for_is_refused_naming_the_ones_it_has(tmp_path):
    with pytest.raises(core.LabError, match="the lab has servers of sglang, vllm"):
        core.lab_engines(tmp_path, ("sglang", "tgi"))
    assert core.lab_engines(tmp_path, ("vllm",)) == ("vllm",)
    assert core.lab_engines(tmp_path, None) == ("vllm",)  # kept for the next `lab up`


def test_two_lab_dirs_get_different_cgroups(tmp_path):
    assert core.cgroup_name(tmp_path / "a") != core.cgroup_name(tmp_path / "b")


def test_lab_dir_under_an_overlaid_tree_is_refused():
    with pytest.raises(core.LabError, match="overlay"):
        core.check_lab_dir(Path("/var/tmp/lab"))


# ---------------------------------------------------------------- against the lab

lab_only = pytest.mark.lab


@lab_only
def test_each_host_is_its_own_machine_over_ssh(lab):
    for host in ("pve1", "pve2"):
        out = lab.ssh(host, "hostname; tr '\\0' ' ' </proc/1/cmdline; echo; which pct").stdout.splitlines()
        assert out[0] == host
        assert "gpugate_lab.hostinit" in out[1] and f" {host} " in out[1]
        assert out[2].endswith(f"/hosts/{host}/bin/pct")


@lab_only
def test_host_key_checking_stays_on(lab, tmp_path):
    wrong = tmp_path / "known_hosts"
    other = lab.host("pve2")
    key = " ".join(Path(lab.dir, "hosts", "pve2", "ssh_host_ed25519_key.pub").read_text().split()[:2])
    wrong.write_text(f"[127.0.0.1]:{lab.host('pve1').port} {key}\n")  # pve2's key for pve1's port
    argv = [a if not a.startswith("UserKnownHostsFile=") else f"UserKnownHostsFile={wrong}" for a in lab.ssh_argv("pve1")]
    result = subprocess.run(argv + ["true"], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
    assert result.returncode == 255 and "HOST IDENTIFICATION HAS CHANGED" in result.stderr
    assert other.port != lab.host("pve1").port


@lab_only
def test_pct_is_also_at_usr_sbin_as_on_proxmox(lab):
    assert lab.ssh("pve1", "/usr/sbin/pct status 129").stdout == "status: running\n"


@lab_only
def test_sftp_works_for_pyinfra(lab, tmp_path):
    src = tmp_path / "payload.txt"
    src.write_text("over sftp\n")
    port = str(lab.host("pve1").port)
    argv = ["sftp", "-b", "-", "-P", port, "-i", lab.host("pve1").key, "-o", f"UserKnownHostsFile={lab.host('pve1').known_hosts}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "root@127.0.0.1"]
    result = subprocess.run(argv, input=f"put {src} /root/sftp-test.txt\n", capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert lab.ssh("pve1", "cat /root/sftp-test.txt").stdout == "over sftp\n"


@lab_only
def test_hosts_do_not_see_each_others_processes(lab):
    pve1_sshd = lab.ssh("pve1", "pgrep -a sshd").stdout
    pve2_sshd = lab.ssh("pve2", "pgrep -a sshd").stdout
    assert "hosts/pve1/sshd_config" in pve1_sshd and "hosts/pve2" not in pve1_sshd
    assert "hosts/pve2/sshd_config" in pve2_sshd and "hosts/pve1" not in pve2_sshd


@lab_only
def test_lab_up_again_leaves_the_running_lab_as_it_is(lab):
    before = core.status(lab.dir)
    marker = lab.pct_over_ssh("pve1", "exec", "129", "--", "sh", "-c", "echo kept > /run/up-twice")
    again = core.up(lab.dir, hosts=2)
    after_marker = lab.pct_over_ssh("pve1", "exec", "129", "--", "cat", "/run/up-twice")
    sshd_count = lab.ssh("pve1", "pgrep -c -x sshd").stdout.strip()
    assert marker.returncode == 0
    assert [(h["name"], h["port"], h["init_pid"]) for h in again["hosts"]] == \
           [(h["name"], h["port"], h["init_pid"]) for h in before["hosts"]]
    assert after_marker.stdout == "kept\n"          # the container was not restarted
    assert sshd_count == "2"                        # the listener and this session's privsep child, no second sshd


@lab_only
def test_status_json_gives_scripts_what_they_need(lab):
    result = subprocess.run([sys.executable, "-m", "gpugate.cli", "lab", "status", "--json", "--dir", str(lab.dir)],
                            capture_output=True, text=True, timeout=30)
    state = json.loads(result.stdout)
    pve1 = next(h for h in state["hosts"] if h["name"] == "pve1")
    assert {k: pve1[k] for k in ("hostname", "user", "running")} == {"hostname": "127.0.0.1", "user": "root", "running": True}
    assert pve1["port"] == lab.host("pve1").port and Path(pve1["key"]).exists() and Path(pve1["known_hosts"]).exists()
    assert {"vmid": 129, "status": "running", "name": "ct129", "init": "lab"} in pve1["containers"]
    assert [g["index"] for g in pve1["gpus"]] == list(range(8))


@lab_only
def test_fleet_file_points_at_the_running_hosts(lab):
    fleet = yaml.safe_load(lab.fleet_path.read_text())
    assert set(fleet["hosts"]) == {"pve1", "pve2"}
    assert fleet["hosts"]["pve1"]["ssh"]["port"] == lab.host("pve1").port
    assert 129 in fleet["hosts"]["pve1"]["containers"]


@lab_only
def test_done_when_nvidia_smi_in_the_container_shows_eight_idle_gpus(lab):
    out = lab.ssh("pve1", "pct exec 129 -- nvidia-smi --query-gpu=index,memory.used --format=csv,noheader").stdout
    assert out.splitlines() == [f"{i}, 0 MiB" for i in range(8)]
