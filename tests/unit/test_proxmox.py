"""gpugate.proxmox and gpugate.discover on pvesh's own JSON shapes (issue 36): the container index
(pve-container src/PVE/LXC.pm vmstatus fields), configs with ``devN`` lines and their options, raw
``lxc`` pairs, privileged and unprivileged, a config pvesh could not read, a node without pvesh."""

from __future__ import annotations

import json

import pytest

from gpugate import discover, proxmox

# /nodes/{node}/lxc as PVE 8 prints it (--output-format json; Perl hash order, not sorted by vmid)
INDEX = json.dumps([
    {"cpu": 0.0123, "cpus": 32, "disk": 8127631360, "diskread": 0, "diskwrite": 0, "maxdisk": 536870912000,
     "maxmem": 274877906944, "maxswap": 0, "mem": 1234567, "name": "llm-b", "netin": 1, "netout": 2,
     "pid": 31337, "status": "running", "swap": 0, "type": "lxc", "uptime": 86400, "vmid": 130},
    {"cpu": 0, "cpus": 32, "disk": 0, "diskread": 0, "diskwrite": 0, "maxdisk": 536870912000,
     "maxmem": 274877906944, "maxswap": 0, "mem": 0, "name": "llm-a", "netin": 0, "netout": 0,
     "status": "running", "swap": 0, "tags": "gpu;llm", "type": "lxc", "uptime": 100, "vmid": 129},
    {"cpus": 2, "disk": 0, "maxdisk": 8589934592, "maxmem": 536870912, "maxswap": 536870912, "mem": 0,
     "name": "tmpl", "status": "stopped", "template": 1, "type": "lxc", "uptime": 0, "vmid": 9000},
])
# PVE 8.1+: devN with options; nvidiactl/uvm passed too
CONFIG_DEV = json.dumps({
    "arch": "amd64", "cores": 32, "hostname": "llm-a", "memory": 262144, "ostype": "debian", "swap": 0,
    "dev0": "/dev/nvidia0,gid=44", "dev1": "path=/dev/nvidia1,mode=0666", "dev2": "/dev/nvidiactl",
    "dev3": "/dev/nvidia-uvm", "dev4": "/dev/nvidia-caps/nvidia-cap1", "unprivileged": 1,
    "digest": "3f1c5e8a1c2b9f0b4f5e6d7c8b9a0f1e2d3c4b5a"})
# the older setup: raw lxc lines only
CONFIG_RAW = json.dumps({
    "arch": "amd64", "cores": 32, "hostname": "llm-b", "memory": 262144,
    "lxc": [["lxc.cgroup2.devices.allow", "c 195:* rwm"], ["lxc.cgroup2.devices.allow", "c 509:* rwm"],
            ["lxc.mount.entry", "/dev/nvidia1 dev/nvidia1 none bind,optional,create=file"],
            ["lxc.mount.entry", "/dev/nvidia2 dev/nvidia2 none bind,optional,create=file"],
            ["lxc.mount.entry", "/dev/nvidiactl dev/nvidiactl none bind,optional,create=file"]],
    "digest": "0b4f5e6d7c8b9a0f1e2d3c4b5a3f1c5e8a1c2b9f"})


def framed(*pairs: tuple[str, int, str]) -> list[str]:
    lines = []
    for key, status, text in pairs:
        lines += text.splitlines() + [f"{proxmox.MARK} {key} {status}"]
    return lines


def test_a_node_with_dev_and_raw_mapped_containers_and_a_shared_gpu():
    configs = proxmox.parse_framed(framed(("129", 0, CONFIG_DEV), ("130", 0, CONFIG_RAW),
                                          ("9000", 255, "Configuration file 'nodes/pve1/lxc/9000.conf' does not exist")))
    view = discover.host_view("pve1", proxmox.parse_framed(framed(("lxc", 0, INDEX)))["lxc"], configs)
    rows = [(c["vmid"], c["name"], c["status"], c["privileged"], c["gpus"]) for c in view["containers"]]
    assert rows == [(129, "llm-a", "running", False, [0, 1]), (130, "llm-b", "running", True, [1, 2]),
                    (9000, "tmpl", "stopped", None, [])]
    assert view["shared"] == {"1": [129, 130]}
    assert "9000 config: pvesh failed (exit 255): Configuration file" in view["containers"][2]["problem"]
    table = discover.format_table([view])
    assert "GPU 1 is passed into more than one container: 129, 130" in table
    assert "  129   llm-a  running  no          0-1   /dev/nvidia0-1" in table


def test_a_host_without_pvesh_or_with_garbage_is_one_problem_line():
    missing = discover.host_view("pve2", (127, "sh: 1: pvesh: not found"), {})
    assert missing["problem"] == "pve2: the container index: pvesh failed (exit 127): sh: 1: pvesh: not found"
    assert discover.host_view("pve2", (0, "<html>"), {})["problem"].startswith("pve2: the container index: pvesh failed")
    assert discover.format_table([missing]).splitlines()[1].strip().startswith("pve2: the container index")


def test_fit_names_the_map_and_what_the_server_needs():
    view = proxmox.container_of({"vmid": 129, "status": "running"}, json.loads(CONFIG_DEV))
    assert proxmox.fit_problem(view, 129, [0, 1], "--tp-size 2") is None
    assert proxmox.fit_problem(view, 129, [0, 1, 2, 3], "--tp-size 4") == (
        "container 129 maps /dev/nvidia0-1; --tp-size 4 needs 4 GPUs (GPU 0-3), GPU 2-3 not mapped")


def test_the_draft_loads_as_a_fleet_and_is_never_written_over(tmp_path):
    from gpugate.fleet import load_fleet

    view = discover.host_view("pve1", (0, INDEX), {"129": (0, CONFIG_DEV), "130": (0, CONFIG_RAW)})
    draft = tmp_path / "fleet.yaml"
    discover.write_draft(draft, discover.draft_fleet([view], None), force=False)
    fleet = load_fleet(str(draft))
    assert [c.vmid for c in fleet.hosts[0].containers] == [129, 130, 9000]
    assert "129: {}  # llm-a, running, unprivileged; GPUs 0-1 (/dev/nvidia0-1)" in draft.read_text()
    draft.write_text("mine\n")
    with pytest.raises(discover.DiscoverError, match="exists; it was kept as it is"):
        discover.write_draft(draft, "new\n", force=False)
    assert draft.read_text() == "mine\n"
    discover.write_draft(draft, "new\n", force=True)
    assert draft.read_text() == "new\n"


class FakeConnector:
    """What plan_map_refusals needs of the pct connector: one command on the Proxmox host."""

    def __init__(self, lines: list[str]):
        self.lines, self.commands = lines, []

    def run_on_proxmox_host(self, command):
        from types import SimpleNamespace

        self.commands.append(str(command))
        return True, SimpleNamespace(stdout_lines=self.lines, stderr_lines=[])


def test_the_plan_reads_the_node_once_a_run_and_says_what_it_cannot_tell_once():
    node = FakeConnector(framed(("129", 0, CONFIG_DEV), ("130", 0, CONFIG_RAW)))
    fleet = [("pve1", 129, 30000, (0, 1)), ("pve1", 130, 30000, (2,))]
    said: list[str] = []
    assert proxmox.plan_map_refusals(node, 1, ("pve1", 129, 30000, (0, 1)), fleet[1:], {"tp": 2}, said.append) == []
    assert proxmox.plan_map_refusals(node, 1, ("pve1", 130, 30000, (2, 3)), fleet[:1], {"tp": 2}, said.append) == [
        "container 130 maps /dev/nvidia1-2; --tp 2 needs 2 GPUs (GPU 2-3), GPU 3 not mapped"]
    assert len(node.commands) == 1 and "/nodes/localhost/lxc/130/config" in node.commands[0]
    no_pvesh = FakeConnector(["sh: 1: pvesh: not found", f"{proxmox.MARK} 129 127"])
    for _ in range(2):
        assert proxmox.plan_map_refusals(no_pvesh, 2, ("pve2", 129, 30000, (0,)), [], {}, said.append) == []
    assert said == ["pve2: no pvesh there (pve2: container 129's config: pvesh failed (exit 127): sh: 1: pvesh: "
                    "not found); the GPUs each container maps are not checked"]


def observed(spec, secret_values: bool = True) -> dict:
    """The observe document of a container where gpugate started ``spec`` (its history record, as
    the agent writes it; the running argv's and env's hashes)."""
    from gpugate.agent.history import make_record
    from gpugate.rules.redact import env_hash

    record = make_record(spec.doc())
    return {"container": {"pid1": "init"}, "sglang": {
        "running": True, "serving": True, "port": spec.port, "engine": spec.engine,
        "main": {"pid": 7, "argv_hash": record["argv_hash"], "argv": record["argv"], "supervisor": spec.supervisor},
        "env_hashes": {name: env_hash(value) for name, value in spec.env.items()},
        "command": {"model_path": spec.model_path, "port": spec.port, "flags": dict(spec.launch.shown_flags)},
        "history": {"good": [record]}, "strays": []}}


def test_a_server_found_running_is_drafted_as_it_runs_without_its_secrets_and_the_draft_deploys_it_unchanged(tmp_path):
    from gpugate.fleet import container_host_data, load_fleet
    from gpugate.rules.redact import argv_hash
    from gpugate.spec import build_spec, desired_state

    spec = build_spec("/models/m", 30001, {"tp": 2, "mem-fraction-static": 0.8, "api-key": "sk-secret-1"},
                      {"HF_TOKEN": "hf_secret_2", "SGLANG_X": "1"}, supervisor="process")
    view = discover.host_view("pve1", (0, INDEX), {"129": (0, CONFIG_DEV), "130": (0, CONFIG_RAW)})
    view["containers"][0]["servers"], problem = discover.servers_of(observed(spec))
    assert problem is None
    draft = tmp_path / "fleet.yaml"
    discover.write_draft(draft, discover.draft_fleet([view], None), force=False)
    text = draft.read_text()
    assert "sk-secret-1" not in text and "hf_secret_2" not in text
    assert "# left out of :30001, secret: flag api-key, env HF_TOKEN; write their values" in text, text
    assert "# 130: {}  # llm-b" in text  # no server: a comment, never present: false
    (host,) = load_fleet(str(draft)).hosts
    (container,) = host.containers
    desired = desired_state(container_host_data(host, container))
    assert desired.spec.argv != spec.argv and "--api-key" not in desired.spec.argv  # the secret is for the operator
    # with the left-out values written where the draft says, the draft is the running server exactly
    draft.write_text(text.replace('"SGLANG_X": "1"}', '"SGLANG_X": "1", "HF_TOKEN": "hf_secret_2"}')
                     .replace('"mem-fraction-static": 0.8', '"mem-fraction-static": 0.8, "api-key": "sk-secret-1"'))
    (host,) = load_fleet(str(draft)).hosts
    desired = desired_state(container_host_data(host, host.containers[0]))
    assert argv_hash(list(desired.spec.argv)) == argv_hash(list(spec.argv)) and desired.spec.env == spec.env
    assert desired.spec.supervisor == "auto"  # process is what auto is in this container: left at its default


def test_the_status_shows_each_containers_map_from_one_read_of_its_node():
    node = FakeConnector(framed(("129", 0, CONFIG_DEV), ("130", 0, CONFIG_RAW)))
    said: list[str] = []
    assert proxmox.mapped_view(node, 7, "pve1", 129, [129, 130], said.append) == {
        "mapped_gpus": [0, 1], "mapped": "/dev/nvidia0-1"}
    assert proxmox.mapped_view(node, 7, "pve1", 130, [129, 130], said.append)["mapped_gpus"] == [1, 2]
    assert len(node.commands) == 1 and said == []
    no_pvesh = FakeConnector(framed(("129", 127, "sh: 1: pvesh: not found"), ("130", 127, "sh: 1: pvesh: not found")))
    assert [proxmox.mapped_view(no_pvesh, 8, "pve2", vmid, [129, 130], said.append) for vmid in (129, 130)] == [{}, {}]
    assert len(said) == 1 and "pve2: no pvesh there" in said[0]
    assert proxmox.mapped_view(None, 9, "pve3", 129, [129], said.append) == {}
