"""The lab's pvesh against pve-container's API: the container index and config JSON (field names and
types, ``lxc`` pairs, ``digest``), its errors and exit codes, and GPU maps written as an operator
writes them (``devN`` or raw ``lxc.mount.entry`` lines). Sources: gpugate_lab/pvesh.py's docstring."""

from __future__ import annotations

import hashlib
import json

import pytest

from gpugate_lab import container, pvesh


def test_a_gpu_map_replaces_the_gpu_lines_and_pct_config_shows_the_dev_lines():
    text = container.default_config(130, 8)
    mapped = container.with_gpu_map(text, [2, 3])
    assert container.passed_device_nodes(mapped) == {"nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm"}
    shown = container.format_config(mapped)
    assert "dev0: /dev/nvidia2\ndev1: /dev/nvidia3\n" in shown and "lxc.mount.entry" not in shown
    raw = container.with_gpu_map(mapped, [0], "raw")
    assert container.passed_device_nodes(raw) == {"nvidia0", "nvidiactl", "nvidia-uvm"}
    assert "dev0:" not in raw and raw.rstrip().splitlines()[-1].startswith("lxc.mount.entry: /dev/nvidia-uvm")


def test_config_json_has_typed_keys_lxc_pairs_and_the_files_digest():
    text = container.with_gpu_map(container.default_config(129, 2), [0, 1], "raw") + "unprivileged: 1\n"
    doc = pvesh.config_json(text)
    assert doc["cores"] == 32 and doc["unprivileged"] == 1 and doc["hostname"] == "ct129"
    assert ["lxc.mount.entry", "/dev/nvidia1 dev/nvidia1 none bind,optional,create=file"] in doc["lxc"]
    assert doc["digest"] == hashlib.sha1(text.encode()).hexdigest()


@pytest.mark.parametrize("path, message", [
    ("/nodes/pve1/lxc/999/config", "Configuration file 'nodes/pve1/lxc/999.conf' does not exist"),
    ("/nodes/pve9/lxc", "hostname lookup 'pve9' failed - failed to get address info for: pve9: Name or service not known"),
    ("/nodes/pve1/lxc/129/nothing", "No 'get' handler defined for 'nodes/pve1/lxc/129/nothing'"),
])
@pytest.mark.lab
def test_errors_are_pveshs_with_exit_255(lab, path, message):
    result = lab.host_exec("pve1", "pvesh", "get", path, "--output-format", "json")
    assert (result.returncode, result.stdout, result.stderr) == (255, "", message + "\n")


@pytest.mark.lab
def test_the_container_index_and_a_config_over_ssh(lab):
    result = lab.ssh("pve1", "pvesh get /nodes/pve1/lxc --output-format json && "
                             "pvesh get /nodes/localhost/lxc/129/config --output-format json")
    assert result.returncode == 0, result.stderr
    index, config = (json.loads(line) for line in result.stdout.splitlines())
    ct = next(item for item in index if item["vmid"] == 129)
    assert (ct["status"], ct["name"], ct["type"], ct["maxmem"]) == ("running", "ct129", "lxc", 262144 * 1024 * 1024)
    assert isinstance(ct["pid"], int) and isinstance(ct["uptime"], int)
    assert config["hostname"] == "ct129" and len(config["digest"]) == 40
    assert ["lxc.cgroup2.devices.allow", "c 195:* rwm"] in config["lxc"]
