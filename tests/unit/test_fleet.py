"""fleet.yaml: a valid file becomes inventory groups; every mistake names file, entry and problem."""

from __future__ import annotations

import textwrap

import pytest

from gpugate.fleet import FleetError, container_host_data, fleet_to_inventory, load_fleet

GOOD = """
groups:
  canary: {data: {drain_timeout_s: 30}}
hosts:
  pve1:
    ssh: {hostname: pve1.example.net, user: root, port: 2222, key: keys/id_ed25519, known_hosts_file: /etc/kh}
    data: {gpu_max_used_mib: 128}
    containers:
      129:
        groups: [canary]
        data: {gpu_max_used_mib: 256}
        sglang:
          model_path: moonshotai/Kimi-K2.5
          port: 30000
          flags: {tp: 8, kv-cache-dtype: fp8_e4m3, disable-radix-cache: true, mem-fraction-static: 0.88,
                  disable-cuda-graph: false}
          env: {HF_TOKEN: "hf_x", NCCL_DEBUG: "1"}
          supervisor: systemd
      130:
        sglang: {model_path: /opt/models/m, present: false}
  pve2:
    ssh: {hostname: "@local"}
    containers:
      "131": {sglang: {model_path: /m}}
"""


def write(tmp_path, text: str, name: str = "fleet.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_valid_fleet_becomes_pyinfra_groups(tmp_path):
    path = write(tmp_path, GOOD)
    groups = fleet_to_inventory(load_fleet(path))
    # pve_<host> per Proxmox host, and the host's own name too (`--limit pve1`)
    assert set(groups) == {"canary", "pve_pve1", "pve_pve2", "pve1", "pve2"}
    assert groups["canary"] == (["@pct/pve1:129"], {"drain_timeout_s": 30})
    hosts = dict(groups["pve_pve1"][0])
    assert list(hosts) == ["@pct/pve1:129", "@pct/pve1:130"]
    data = hosts["@pct/pve1:129"]
    assert data == {
        "ssh_hostname": "pve1.example.net", "ssh_user": "root", "ssh_port": 2222,
        "ssh_key": str(tmp_path / "keys/id_ed25519"), "ssh_known_hosts_file": "/etc/kh",
        "pct_vmid": 129, "pve_host": "pve1",
        "sglang_model_path": "moonshotai/Kimi-K2.5", "sglang_port": 30000, "sglang_present": True,
        "sglang_flags": {"disable-radix-cache": True, "kv-cache-dtype": "fp8_e4m3", "mem-fraction-static": 0.88,
                         "tp-size": 8},
        "sglang_env": {"HF_TOKEN": "hf_x", "NCCL_DEBUG": "1"},
        "sglang_supervisor": "systemd",
        "gpu_max_used_mib": 256,  # the container's data wins over its host's
    }
    assert hosts["@pct/pve1:130"]["sglang_present"] is False
    assert hosts["@pct/pve1:130"]["gpu_max_used_mib"] == 128
    local = dict(groups["pve_pve2"][0])
    assert list(local) == ["@pct/@local:131"]
    assert not any(key.startswith("ssh_") for key in local["@pct/@local:131"])


def test_a_pve_host_without_ssh_hostname_is_reached_by_its_name(tmp_path):
    path = write(tmp_path, "hosts: {gpu-01: {containers: {129: {sglang: {model_path: /m}}}}}")
    (name, data), = fleet_to_inventory(load_fleet(path))["pve_gpu_01"][0]
    assert (name, data["ssh_hostname"]) == ("@pct/gpu-01:129", "gpu-01")


def good_with(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new, 1)


@pytest.mark.parametrize(("text", "entry", "problem"), [
    (good_with("kv-cache-dtype: fp8_e4m3", "kv-cache-dtype: fp9"),
     "hosts.pve1.containers.129.sglang.flags.kv-cache-dtype", "'fp9' is not one of auto"),
    (good_with("tp: 8", "tp: eight"),
     "hosts.pve1.containers.129.sglang.flags.tp", "expects an integer, got 'eight'"),
    (good_with("tp: 8", "tp: 8, kv-cache-dtyp: auto"),
     "hosts.pve1.containers.129.sglang.flags.kv-cache-dtyp", "did you mean --kv-cache-dtype?"),
    (good_with("tp: 8", "tp: 8, model-path: /x"),
     "hosts.pve1.containers.129.sglang.flags.model-path", "set the model as sglang.model_path"),
    (good_with("disable-radix-cache: true", "disable-radix-cache: true, enable-hierarchical-cache: true"),
     "hosts.pve1.containers.129.sglang.flags.enable-hierarchical-cache", "mutually exclusive"),
    (good_with("model_path: moonshotai/Kimi-K2.5", "modelpath: moonshotai/Kimi-K2.5"),
     "hosts.pve1.containers.129.sglang.modelpath", "unknown key (did you mean model_path?)"),
    (good_with("        sglang: {model_path: /opt/models/m, present: false}", "        sglang: {port: 30001}"),
     "hosts.pve1.containers.130.sglang.model_path", "missing"),
    (good_with("port: 30000", "port: 70000"), "hosts.pve1.containers.129.sglang.port", "1..65535"),
    (good_with("port: 30000", "port: '30000'"), "hosts.pve1.containers.129.sglang.port", "expected a port"),
    (good_with("supervisor: systemd", "supervisor: runit"), "hosts.pve1.containers.129.sglang.supervisor",
     "expected one of process, systemd"),
    (good_with('HF_TOKEN: "hf_x"', 'HF_TOKEN: "a\\nb"'), "hosts.pve1.containers.129.sglang.env.HF_TOKEN",
     "line breaks"),
    (good_with('HF_TOKEN: "hf_x"', "HF_TOKEN: yes"), "hosts.pve1.containers.129.sglang.env.HF_TOKEN",
     "quote it"),
    (good_with('HF_TOKEN: "hf_x"', '"BAD NAME": x'), "hosts.pve1.containers.129.sglang.env.BAD NAME",
     "environment variable names"),
    (good_with("      129:", "      12:"), "hosts.pve1.containers.12", "vmids 100..999999999"),
    (good_with("supervisor: systemd", "supervisor: systemd\n          python: 'python3 -c x'"),
     "hosts.pve1.containers.129.sglang.python", "absolute path"),
    (good_with("user: root", "usr: root"), "hosts.pve1.ssh.usr", "unknown key (did you mean user?)"),
    (good_with("port: 2222", "port: ssh"), "hosts.pve1.ssh.port", "expected a port number"),
    (good_with("hostname: pve1.example.net", "hostname: '-oProxyCommand=x'"), "hosts.pve1.ssh.hostname",
     "expected a host name"),
    (good_with("data: {gpu_max_used_mib: 128}", "data: {gpu_max_used_mib: lots}"),
     "hosts.pve1.data.gpu_max_used_mib", "expected a whole number"),
    (good_with("data: {gpu_max_used_mib: 128}", "data: {rolling: maybe}"), "hosts.pve1.data.rolling",
     "expected true or false"),
    (good_with("data: {gpu_max_used_mib: 128}", "data: {sglang_flags: {}}"), "hosts.pve1.data.sglang_flags",
     "sglang: section"),
    (good_with("groups: [canary]", "groups: [pve_x]"), "hosts.pve1.containers.129.groups", "not a usable group"),
    (good_with("groups: [canary]", "groups: canary"), "hosts.pve1.containers.129.groups", "expected a list"),
    (good_with("  pve2:", "  'pve 2':"), "hosts.pve 2", "Proxmox host names"),
    (good_with("hosts:", "hostz: {}\nhosts:"), "hostz", "unknown key"),
])
def test_every_mistake_names_the_file_the_entry_and_the_problem(tmp_path, text, entry, problem):
    path = write(tmp_path, text)
    with pytest.raises(FleetError) as caught:
        load_fleet(path)
    assert caught.value.path == str(path)
    assert caught.value.entry == entry
    assert problem in caught.value.problem
    assert str(caught.value).startswith(f"{path}: {entry}: ")


def test_duplicate_keys_are_refused_not_silently_dropped(tmp_path):
    path = write(tmp_path, """
        hosts:
          pve1:
            containers:
              129: {sglang: {model_path: /a}}
              129: {sglang: {model_path: /b}}
        """)
    with pytest.raises(FleetError, match=r"line 6, column 7: not valid YAML: duplicate key 129"):
        load_fleet(path)


def test_the_same_container_twice_through_local_is_refused(tmp_path):
    path = write(tmp_path, """
        hosts:
          a: {ssh: {hostname: "@local"}, containers: {129: {}}}
          b: {ssh: {hostname: "@local"}, containers: {129: {}}}
        """)
    with pytest.raises(FleetError, match=r"hosts\.b\.containers\.129: @pct/@local:129 is already defined"):
        load_fleet(path)


@pytest.mark.parametrize(("text", "problem"), [
    ("", "hosts: missing"),
    ("hosts: {}", "hosts: missing"),
    ("- a\n- b\n", "expected a mapping"),
    ("hosts: {pve1: {containers: {}}}", "hosts.pve1.containers: missing"),
    ("hosts: [\n", "not valid YAML"),
])
def test_empty_or_malformed_files(tmp_path, text, problem):
    with pytest.raises(FleetError, match=problem):
        load_fleet(write(tmp_path, text))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FleetError) as caught:
        load_fleet(tmp_path / "nope.yaml")
    assert str(caught.value) == f"{tmp_path / 'nope.yaml'}: no such file"


def test_shell_metacharacters_in_values_are_kept_literally(tmp_path):
    nasty = "$(touch /tmp/pwned); rm -rf / `id` 'q'"
    path = write(tmp_path, f"""
        hosts:
          pve1:
            containers:
              129:
                sglang:
                  model_path: {nasty!r}
                  flags: {{served-model-name: {nasty!r}}}
                  env: {{X: {nasty!r}}}
        """)
    fleet = load_fleet(path)
    data = container_host_data(fleet.hosts[0], fleet.hosts[0].containers[0])
    assert data["sglang_model_path"] == nasty
    assert data["sglang_flags"] == {"served-model-name": nasty}
    assert data["sglang_env"] == {"X": nasty}


def test_the_server_interpreter_can_be_chosen_per_container(tmp_path):
    path = write(tmp_path, good_with("supervisor: systemd", "supervisor: systemd\n          python: /opt/venv/bin/python3"))
    hosts = dict(fleet_to_inventory(load_fleet(path))["pve_pve1"][0])
    assert hosts["@pct/pve1:129"]["sglang_python"] == "/opt/venv/bin/python3"
    assert "sglang_python" not in hosts["@pct/pve1:130"]  # group_data/all.py's default applies


def test_the_fleet_file_the_lab_writes_loads(tmp_path):
    from gpugate_lab.core import fleet_document, render_fleet_yaml

    doc = fleet_document(tmp_path, [("pve1", 2201), ("pve2", 2202)], {"pve1": [129, 130], "pve2": [131]})
    path = write(tmp_path, render_fleet_yaml(doc))
    groups = fleet_to_inventory(load_fleet(path))
    names = [name for name, _ in groups["pve_pve1"][0] + groups["pve_pve2"][0]]
    assert names == ["@pct/pve1:129", "@pct/pve1:130", "@pct/pve2:131"]
    # two containers of one host share its 8 GPUs: disjoint halves; one container alone has all 8
    pve1 = dict(groups["pve_pve1"][0])
    assert pve1["@pct/pve1:129"]["sglang_flags"] == {"tp-size": 4}
    assert pve1["@pct/pve1:130"]["sglang_flags"] == {"tp-size": 4, "base-gpu-id": 4}
    assert dict(groups["pve_pve2"][0])["@pct/pve2:131"]["sglang_flags"] == {"tp-size": 8}
