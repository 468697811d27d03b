"""``gpugate discover [HOSTS...]``: what each Proxmox host of the fleet really has (issue 36).

For each Proxmox host (of the fleet file, or those named), over the SSH connection the deploy uses
(pyinfra's, with the fleet's ssh settings; the same host key policy as the pct connector: the key
must be known unless the fleet says otherwise), two round trips: the node's container index, then
every container's config (gpugate.proxmox). It prints the containers (vmid, name, status, privileged
or not), the GPUs each config passes in (index and device node), and the GPUs passed into more than
one container. ``--format json``: the same as one document. ``--write FILE``: a fleet draft (the
hosts, their containers, each container's GPUs as a comment) that never replaces a file unless
``--force``.

Not read here: the servers running in the containers (the status runbook's observe reads them:
``gpugate runbook status``).

Example::

    $ gpugate discover pve1
    pve1
      VMID  NAME    STATUS   PRIVILEGED  GPUS  DEVICES
      129   ct129   running  yes         0-1   /dev/nvidia0-1
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpugate import proxmox
from gpugate.claims import gpu_ranges
from gpugate.connectors.pct import strict_host_key_policy
from gpugate.fleet import Fleet, PveHost

__all__ = ["discover", "format_table", "draft_fleet", "host_view", "run"]


class DiscoverError(ValueError):
    """The command cannot do what was asked; str() says why (one line)."""


def pick_hosts(fleet: Fleet, names: Sequence[str]) -> list[PveHost]:
    """The fleet's Proxmox hosts named (all when none); an unknown name is a DiscoverError naming
    the hosts there are."""
    if not names:
        return list(fleet.hosts)
    known = {host.name: host for host in fleet.hosts}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise DiscoverError(f"{fleet.path} has no Proxmox host {', '.join(map(repr, unknown))}; its hosts: "
                            f"{', '.join(known) or 'none'}")
    return [known[name] for name in names]


def host_view(name: str, index_answer: tuple[int, str] | None,
              config_answers: Mapping[str, tuple[int, str]] | None) -> dict[str, Any]:
    """One host's part of the result, from what its two commands printed (gpugate.proxmox).

    >>> view = host_view("pve1", (0, '[{"vmid": 129, "status": "running", "name": "ct129"}]'),
    ...                  {"129": (0, '{"dev0": "/dev/nvidia0", "unprivileged": 0}')})
    >>> view["containers"][0]["gpus"], view["shared"], view["problem"]
    ([0], {}, None)
    """
    index, problem = proxmox.parse_pvesh_json(index_answer, f"{name}: the container index")
    if problem or not isinstance(index, list):
        return {"host": name, "containers": [], "shared": {}, "problem": problem or f"{name}: not a container index"}
    views = proxmox.node_view(index, config_answers or {})
    return {"host": name, "containers": [view.as_json() for view in views],
            "shared": {str(gpu): vmids for gpu, vmids in proxmox.shared_gpus(views).items()}, "problem": None}


def format_table(result: Iterable[Mapping[str, Any]]) -> str:
    """The operator's table: per host its containers, then GPUs passed into more than one.

    >>> print(format_table([{"host": "pve1", "problem": None, "shared": {"1": [129, 131]}, "containers": [
    ...     {"vmid": 129, "name": "ct129", "status": "running", "privileged": True, "gpus": [0, 1], "problem": None},
    ...     {"vmid": 131, "name": "ct131", "status": "stopped", "privileged": False, "gpus": [1], "problem": None}]}]), end="")
    pve1
      VMID  NAME   STATUS   PRIVILEGED  GPUS  DEVICES
      129   ct129  running  yes         0-1   /dev/nvidia0-1
      131   ct131  stopped  no          1     /dev/nvidia1
      GPU 1 is passed into more than one container: 129, 131
    """
    out: list[str] = []
    for host in result:
        out.append(host["host"])
        if host.get("problem"):
            out.append(f"  {host['problem']}")
            continue
        rows = [("VMID", "NAME", "STATUS", "PRIVILEGED", "GPUS", "DEVICES")]
        for ct in host["containers"]:
            privileged = {True: "yes", False: "no"}.get(ct.get("privileged"), "?")
            gpus = gpu_ranges(ct["gpus"]) if ct["gpus"] else "-"
            devices = f"/dev/nvidia{gpu_ranges(ct['gpus'])}" if ct["gpus"] else "-"
            rows.append((str(ct["vmid"]), ct["name"], ct["status"], privileged, gpus, devices))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        out += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        out += [f"  {ct['vmid']}: {ct['problem']}" for ct in host["containers"] if ct.get("problem")]
        if not host["containers"]:
            out.append("  no container on this node")
        out += [f"  GPU {gpu} is passed into more than one container: {', '.join(map(str, vmids))}"
                for gpu, vmids in host["shared"].items()]
    return "\n".join(out) + "\n"


def draft_fleet(result: Iterable[Mapping[str, Any]], fleet: Fleet | None) -> str:
    """A fleet.yaml draft: each host with its ssh settings (as the fleet has them) and its
    containers, each container's GPUs as a comment (the fleet has no key for them: the node is
    their source). Servers are for the operator to add (``sglang: {model_path: ..., flags: ...}``).

    >>> print(draft_fleet([{"host": "pve1", "problem": None, "shared": {}, "containers": [
    ...     {"vmid": 129, "name": "ct129", "status": "running", "privileged": True, "gpus": [0, 1]}]}], None), end="")
    # drafted by `gpugate discover` from each Proxmox node's own view (pvesh); add a server section per
    # container, e.g. sglang: {model_path: /models/x, flags: {tp: 2}}
    hosts:
      pve1:
        containers:
          129: {}  # ct129, running, privileged; GPUs 0-1 (/dev/nvidia0-1)
    """
    ssh = {host.name: host.ssh for host in (fleet.hosts if fleet else [])}
    lines = ["# drafted by `gpugate discover` from each Proxmox node's own view (pvesh); add a server section per",
             "# container, e.g. sglang: {model_path: /models/x, flags: {tp: 2}}", "hosts:"]
    for host in result:
        lines.append(f"  {host['host']}:")
        if ssh.get(host["host"]):
            lines.append("    ssh: {" + ", ".join(f"{key}: {json.dumps(value)}" for key, value in ssh[host["host"]].items()) + "}")
        if host.get("problem"):
            lines.append(f"    # {host['problem']}")
        if not host["containers"]:
            lines.append("    containers: {}")
            continue
        lines.append("    containers:")
        for ct in host["containers"]:
            kind = {True: "privileged", False: "unprivileged"}.get(ct.get("privileged"), "config unread")
            gpus = f"GPUs {gpu_ranges(ct['gpus'])} (/dev/nvidia{gpu_ranges(ct['gpus'])})" if ct["gpus"] else "no GPU"
            lines.append(f"      {ct['vmid']}: {{}}  # {ct['name']}, {ct['status']}, {kind}; {gpus}")
    return "\n".join(lines) + "\n"


def write_draft(path: Path, text: str, force: bool) -> None:
    """Write the draft; an existing file only with ``force`` (DiscoverError otherwise)."""
    if path.exists() and not force:
        raise DiscoverError(f"{path} exists; it was kept as it is (--force replaces it)")
    path.write_text(text)


def _connect(hosts: Sequence[PveHost]) -> Any:
    """pyinfra's SSH connections to the Proxmox hosts (the deploy's transport, the fleet's settings)."""
    from pyinfra.api import Config, Inventory, State  # noqa: PLC0415 -- only the command needs pyinfra
    from pyinfra.api.connect import connect_all  # noqa: PLC0415

    names = []
    for host in hosts:
        data = {f"ssh_{key}": value for key, value in host.ssh.items() if key != "hostname"}
        data["ssh_hostname"] = host.ssh.get("hostname", host.name)
        data["ssh_strict_host_key_checking"] = strict_host_key_policy(data)
        names.append(("@local" if host.is_local else host.name, data))
    state = State(Inventory((names, {})), Config())
    connect_all(state)
    return state


def _run(host: Any, command: str, sudo: bool) -> list[str]:
    from pyinfra.api.command import StringCommand  # noqa: PLC0415

    _ok, output = host.run_shell_command(StringCommand(command), _sudo=sudo, print_output=False, print_input=False)
    return list(output.stdout_lines) + list(output.stderr_lines)


def discover(hosts: Sequence[PveHost]) -> list[dict[str, Any]]:
    """Every host's view (host_view), read over SSH; a host that cannot be reached says so."""
    state = _connect(hosts)
    result = []
    for pve, host in zip(hosts, state.inventory):
        if not host.connected:
            result.append({"host": pve.name, "containers": [], "shared": {},
                           "problem": f"{pve.name}: not reached over SSH"})
            continue
        sudo = bool(pve.data.get("pct_sudo"))
        index = proxmox.parse_framed(_run(host, proxmox.index_command(), sudo)).get("lxc")
        document, problem = proxmox.parse_pvesh_json(index, "")
        vmids = [int(e["vmid"]) for e in document if isinstance(e, Mapping) and "vmid" in e] if isinstance(document, list) else []
        configs = proxmox.parse_framed(_run(host, proxmox.configs_command(vmids), sudo)) if vmids else {}
        result.append(host_view(pve.name, index, configs))
        host.disconnect()
    return result


def run(fleet_path: str, names: Sequence[str], fmt: str, write: str | None, force: bool) -> int:
    """The command: 0 when every host answered, 1 otherwise (what it printed says why)."""
    from gpugate.fleet import load_fleet  # noqa: PLC0415

    fleet = load_fleet(fleet_path)
    hosts = pick_hosts(fleet, names)
    if write and Path(write).exists() and not force:  # before any host is asked
        raise DiscoverError(f"{write} exists; it was kept as it is (--force replaces it)")
    result = discover(hosts)
    print(json.dumps({"hosts": result}, indent=2) if fmt == "json" else format_table(result), end="\n" if fmt == "json" else "")
    if write:
        write_draft(Path(write), draft_fleet(result, fleet), force)
        print(f"fleet draft written: {os.path.abspath(write)}")
    return 1 if any(host.get("problem") for host in result) else 0
