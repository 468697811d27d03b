"""``gpugate discover [HOSTS...]``: what each Proxmox host of the fleet really has (issue 36).

For each Proxmox host (of the fleet file, or those named), over the SSH connection the deploy uses
(pyinfra's, with the fleet's ssh settings; the same host key policy as the pct connector: the key
must be known unless the fleet says otherwise), two round trips: the node's container index, then
every container's config (gpugate.proxmox). It prints the containers (vmid, name, status, privileged
or not), the GPUs each config passes in (index and device node), and the GPUs passed into more than
one container, and the servers running in each running container: the status's observe
(gpugate.facts.sglang.observe_once_command: the agent's observe, inline where none is installed),
one more round trip per container, through ``pct exec`` on the same connection. ``--format json``:
the same as one document. ``--write FILE``: a fleet draft (the hosts, their containers, each
container's GPUs as a comment, a server section for each server found running, with the flags it
runs) that never replaces a file unless ``--force``. Secret values (a secret flag's, a secret env
variable's) never reach the draft: it names each one left out and where its value goes.

A server gpugate started is drafted from its record in the container's history (the spec whose argv
runs: flags and env as written, so a deploy of the draft changes nothing); another from its command
line (its environment cannot be read back: a deploy may restart it). The observe reads the servers
of one port (the fleet's server of that container, else the engine's default port) in full; a server
on another port is listed, not drafted.

Example::

    $ gpugate discover pve1
    pve1
      VMID  NAME    STATUS   PRIVILEGED  GPUS  DEVICES
      129   ct129   running  yes         0-1   /dev/nvidia0-1
      129: sglang :30000 serving, /models/x, flags {tp-size: 2}
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpugate import proxmox
from gpugate.claims import gpu_ranges
from gpugate.connectors.pct import make_pct_exec_command, strict_host_key_policy
from gpugate.engine import DEFAULT_ENGINE, get as engine
from gpugate.facts.sglang import DEFAULT_PYTHON, observe_args, observation_from, observe_once_command
from gpugate.fleet import Fleet, PveHost
from gpugate.rules.redact import MASK
from gpugate.spec import resolve_supervisor

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


# ---------------------------------------------------------------- the servers in a container


def _holds_secret(value: Any) -> bool:
    """A value that the record (or the redacted argv) shows masked, at any depth."""
    if isinstance(value, str):
        return MASK in value
    if isinstance(value, Mapping):
        return any(_holds_secret(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_secret(item) for item in value)
    return False


def _without_secrets(items: Mapping[str, Any], kind: str, left: list[str]) -> dict[str, Any]:
    """``items`` without the masked ones, each of which is named in ``left`` (``"env HF_TOKEN"``).

    >>> left = []; _without_secrets({"a": 1, "HF_TOKEN": MASK}, "env", left), left
    ({'a': 1}, ['env HF_TOKEN'])
    """
    kept = {}
    for name, value in items.items():
        if _holds_secret(value):
            left.append(f"{kind} {name}")
        else:
            kept[name] = value
    return kept


def running_record(server: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The history record of the spec that runs (its argv by hash, its env by the value hashes the
    observe read): the server as gpugate started it; None for a server gpugate did not start.

    >>> server = {"main": {"argv_hash": "a"}, "env_hashes": {"X": "h"},
    ...           "history": {"good": [{"argv_hash": "a", "env_hashes": {"X": "old"}}, {"argv_hash": "a", "env_hashes": {"X": "h"}}]}}
    >>> running_record(server)["env_hashes"]
    {'X': 'h'}
    """
    main = server.get("main") or {}
    have = server.get("env_hashes") or {}
    for record in reversed(list((server.get("history") or {}).get("good") or [])):
        if (isinstance(record, Mapping) and record.get("argv_hash") and record.get("argv_hash") == main.get("argv_hash")
                and all(have.get(name) == value for name, value in (record.get("env_hashes") or {}).items())):
            return record
    return None


def draft_section(server: Mapping[str, Any], container: Mapping[str, Any] | None = None
                  ) -> tuple[str, dict[str, Any], list[str]]:
    """(the engine's section name, the fleet server section, what was left out) for the server that
    runs on the observed port: from its history record where gpugate started it (running_record),
    else from its command line. Secret values are left out, each named (``env HF_TOKEN``,
    ``flag api-key``); settings at their default are not written.

    >>> record = {"argv_hash": "a", "model_path": "/m", "port": 30000, "host": "127.0.0.1", "flags": {"tp-size": 1,
    ...           "api-key": "***"}, "env": {"HF_TOKEN": "***", "X": "1"}, "python": "/usr/bin/python3", "supervisor": "process"}
    >>> draft_section({"running": True, "main": {"argv_hash": "a"}, "history": {"good": [record]}}, {"pid1": "init"})
    ('sglang', {'model_path': '/m', 'port': 30000, 'flags': {'tp-size': 1}, 'env': {'X': '1'}}, ['flag api-key', 'env HF_TOKEN'])
    """
    record = running_record(server)
    left: list[str] = []
    section: dict[str, Any] = {}
    if record is not None:
        name = str(record.get("engine") or server.get("engine") or DEFAULT_ENGINE)
        source: Mapping[str, Any] = record
        env = dict(record.get("env") or {})
        extra = list(record.get("extra_args") or [])
        python, supervisor = record.get("python"), record.get("supervisor")
    else:
        name = str(server.get("engine") or DEFAULT_ENGINE)
        source = server.get("command") or {}
        env, extra = {}, list(source.get("unknown") or [])
        python, supervisor = ((server.get("main") or {}).get("argv") or [None])[0], (server.get("main") or {}).get("supervisor")
    section["model_path"] = source.get("model_path")
    section["port"] = int(source.get("port") or server.get("port") or 0) or None
    if source.get("host") and source.get("host") != "127.0.0.1":
        section["host"] = source["host"]
    flags = _without_secrets(source.get("flags") or {}, "flag", left)
    if flags:
        section["flags"] = flags
    kept = _without_secrets(env, "env", left)
    if kept:
        section["env"] = kept
    if python and python != DEFAULT_PYTHON:
        section["python"] = python
    if supervisor and supervisor != resolve_supervisor("auto", container or {}):
        section["supervisor"] = supervisor
    if extra:
        if _holds_secret(extra):
            left.append("extra_args")
        else:
            section["extra_args"] = extra
    if record is not None:
        if record.get("sglang_version"):
            section["sglang_version"] = record["sglang_version"]
        if record.get("lora_adapters") is not None:
            section["lora_adapters"] = dict(record["lora_adapters"])
        if record.get("weight_cache"):
            section["weight_cache"] = True
    return name, section, left


def servers_of(observation: Mapping[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The servers one observe found in a container, and the observe's problem (None: it answered):
    the observed port's server with its drafted section (draft_section), each other port's server
    listed (its port, pid, command line).

    >>> servers, problem = servers_of({"container": {}, "sglang": {"running": True, "port": 30000, "serving": True, "engine": "sglang",
    ...     "main": {"pid": 7, "argv_hash": "x"}, "command": {"model_path": "/m", "port": 30000, "flags": {"tp-size": 1}},
    ...     "strays": [{"pid": 9, "port": 30001, "main": True, "cmdline": "python3 -m sglang.launch_server --port 30001"}]}})
    >>> [(s["port"], s["flags"], s.get("drafted_from")) for s in servers], problem
    ([(30000, {'tp-size': 1}, 'command line'), (30001, None, None)], None)
    """
    server = observation.get("sglang") or {}
    problem = observation.get("error") or server.get("error")
    if problem:
        return [], f"observe failed: {str(problem)[:200]}"
    found: list[dict[str, Any]] = []
    if server.get("running"):
        main = server.get("main") or {}
        command = server.get("command") or {}
        name, section, left = draft_section(server, observation.get("container"))
        found.append({"port": server.get("port"), "engine": name, "pid": main.get("pid"), "serving": bool(server.get("serving")),
                      "model_path": command.get("model_path"), "flags": dict(command.get("flags") or {}),
                      "drafted_from": "history" if running_record(server) is not None else "command line",
                      "section": section, "left_out": left})
    for stray in server.get("strays") or []:
        if stray.get("main") and stray.get("port") != server.get("port"):
            found.append({"port": stray.get("port"), "engine": None, "pid": stray.get("pid"), "serving": None,
                          "model_path": None, "flags": None, "cmdline": stray.get("cmdline"),
                          "managed": stray.get("managed")})
    return found, None


def server_line(vmid: Any, server: Mapping[str, Any]) -> str:
    """One server of a container, as the table shows it.

    >>> server_line(129, {"port": 30000, "engine": "sglang", "pid": 7, "serving": True, "model_path": "/m", "flags": {"tp-size": 1}})
    '129: sglang :30000 serving pid 7, /m, flags {tp-size: 1}'
    >>> server_line(129, {"port": 30001, "engine": None, "pid": 9, "cmdline": "python3 -m x --port 30001"})
    '129: a server on :30001 pid 9 (not read: observe reads one port): python3 -m x --port 30001'
    """
    if server.get("engine") is None:
        return (f"{vmid}: a server on :{server['port']} pid {server.get('pid')} (not read: observe reads one port): "
                f"{server.get('cmdline') or '?'}")
    flags = ", ".join(f"{flag}: {json.dumps(value) if not isinstance(value, str) else value}"
                      for flag, value in (server.get("flags") or {}).items())
    state = "serving" if server.get("serving") else "not serving"
    return f"{vmid}: {server['engine']} :{server['port']} {state} pid {server.get('pid')}, {server.get('model_path')}, flags {{{flags}}}"


def format_table(result: Iterable[Mapping[str, Any]]) -> str:
    """The operator's table: per host its containers, then GPUs passed into more than one.

    >>> print(format_table([{"host": "pve1", "problem": None, "shared": {"1": [129, 131]}, "containers": [
    ...     {"vmid": 129, "name": "ct129", "status": "running", "privileged": True, "gpus": [0, 1], "problem": None},
    ...     {"vmid": 131, "name": "ct131", "status": "stopped", "privileged": False, "gpus": [1], "problem": None,
    ...      "servers": [{"port": 30000, "engine": "sglang", "pid": 7, "serving": True, "model_path": "/m", "flags": {"tp-size": 1}}]}]}]), end="")
    pve1
      VMID  NAME   STATUS   PRIVILEGED  GPUS  DEVICES
      129   ct129  running  yes         0-1   /dev/nvidia0-1
      131   ct131  stopped  no          1     /dev/nvidia1
      131: sglang :30000 serving pid 7, /m, flags {tp-size: 1}
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
        out += [f"  {ct['vmid']}: {ct['observe_problem']}" for ct in host["containers"] if ct.get("observe_problem")]
        out += ["  " + server_line(ct["vmid"], server) for ct in host["containers"] for server in ct.get("servers") or []]
        if not host["containers"]:
            out.append("  no container on this node")
        out += [f"  GPU {gpu} is passed into more than one container: {', '.join(map(str, vmids))}"
                for gpu, vmids in host["shared"].items()]
    return "\n".join(out) + "\n"


def draft_fleet(result: Iterable[Mapping[str, Any]], fleet: Fleet | None) -> str:
    """A fleet.yaml draft: each host with its ssh settings (as the fleet has them) and its
    containers, each container's GPUs as a comment (the fleet has no key for them: the node is
    their source), and a server section for each server found running (draft_section: as it runs,
    secrets left out and named). A container with no server is a comment (never ``present:
    false``, which would stop something; a container without a server is refused by the deploy);
    a server on a port the observe did not read is a comment. The draft deploys as written. (On a
    host where no server runs, its containers stay listed ``129: {}``: a fleet's host lists one.)

    >>> print(draft_fleet([{"host": "pve1", "problem": None, "shared": {}, "containers": [
    ...     {"vmid": 129, "name": "ct129", "status": "running", "privileged": True, "gpus": [0, 1], "servers": [
    ...      {"port": 30000, "engine": "sglang", "section": {"model_path": "/m", "port": 30000, "flags": {"tp-size": 1}},
    ...       "left_out": ["env HF_TOKEN"]}]},
    ...     {"vmid": 130, "name": "ct130", "status": "running", "privileged": True, "gpus": [2, 3]}]}], None), end="")
    # drafted by `gpugate discover` from each Proxmox node's own view (pvesh) and each container's observe;
    # a server section for each server found running, as it runs; add one per container to serve more,
    # e.g. sglang: {model_path: /models/x, flags: {tp: 2}}
    hosts:
      pve1:
        containers:
          129:  # ct129, running, privileged; GPUs 0-1 (/dev/nvidia0-1)
            sglang: {"model_path": "/m", "port": 30000, "flags": {"tp-size": 1}}
            # left out of :30000, secret: env HF_TOKEN; write their values in the section above (env:, flags:) before a deploy
          # 130: {}  # ct130, running, privileged; GPUs 2-3 (/dev/nvidia2-3); no server found running: add a section to serve here
    """
    ssh = {host.name: host.ssh for host in (fleet.hosts if fleet else [])}
    lines = ["# drafted by `gpugate discover` from each Proxmox node's own view (pvesh) and each container's observe;",
             "# a server section for each server found running, as it runs; add one per container to serve more,",
             "# e.g. sglang: {model_path: /models/x, flags: {tp: 2}}", "hosts:"]
    for host in result:
        lines.append(f"  {host['host']}:")
        if ssh.get(host["host"]):
            lines.append("    ssh: {" + ", ".join(f"{key}: {json.dumps(value)}" for key, value in ssh[host["host"]].items()) + "}")
        if host.get("problem"):
            lines.append(f"    # {host['problem']}")
        if not host["containers"]:
            lines.append("    containers: {}")
            continue
        drafted = any(server.get("section") for ct in host["containers"] for server in ct.get("servers") or [])
        lines.append("    containers:")
        for ct in host["containers"]:
            kind = {True: "privileged", False: "unprivileged"}.get(ct.get("privileged"), "config unread")
            gpus = f"GPUs {gpu_ranges(ct['gpus'])} (/dev/nvidia{gpu_ranges(ct['gpus'])})" if ct["gpus"] else "no GPU"
            lines += container_lines(ct, f"{ct['name']}, {ct['status']}, {kind}; {gpus}", hide_empty=drafted)
    return "\n".join(lines) + "\n"


def container_lines(ct: Mapping[str, Any], comment: str, hide_empty: bool = True) -> list[str]:
    """One container of the draft: its server sections (one per engine; a list where an engine has
    several), what was left out of each, a comment for each server not read. A container with no
    server is a comment where ``hide_empty`` (the deploy refuses a container without a server,
    touching nothing: a comment keeps the draft's deploy clean), else ``129: {}`` (a fleet's host
    lists at least one container)."""
    drafted = [server for server in ct.get("servers") or [] if server.get("section")]
    if not drafted and hide_empty:
        out = [f"      # {ct['vmid']}: {{}}  # {comment}; no server found running: add a section to serve here"]
    elif not drafted:
        out = [f"      {ct['vmid']}: {{}}  # {comment}"]
    else:
        out = [f"      {ct['vmid']}:  # {comment}"]
        by_engine: dict[str, list[Mapping[str, Any]]] = {}
        for server in drafted:
            by_engine.setdefault(str(server["engine"]), []).append(server)
        for name, servers in by_engine.items():
            sections = [json.dumps(server["section"]) for server in servers]
            out.append(f"        {name}: " + (sections[0] if len(sections) == 1 else "[" + ", ".join(sections) + "]"))
            out += [f"        # left out of :{server['port']}, secret: {', '.join(server['left_out'])}; write their values in "
                    "the section above (env:, flags:) before a deploy" for server in servers if server.get("left_out")]
    out += [f"        # also running: a server on :{server['port']} (pid {server.get('pid')}), not read: {server.get('cmdline')}"
            for server in ct.get("servers") or [] if not server.get("section")]
    return out


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


def observe_request(pve: PveHost, vmid: int) -> tuple[str, dict[str, Any]]:
    """(interpreter, observe arguments) for a container: its first server of the fleet's (port,
    engine, interpreter), else the default engine on its default port."""
    container = next((ct for ct in pve.containers if int(ct.vmid) == int(vmid)), None)
    section = (container.sglang if container is not None else None) or {}
    first = (section.get("sglang_servers") or [section])[0]
    name = first.get("engine") or DEFAULT_ENGINE
    port = first.get("sglang_port") or engine(name).default_port or 30000
    return first.get("sglang_python") or DEFAULT_PYTHON, observe_args(int(port), engine=name)


def _observe(host: Any, pve: PveHost, vmid: int, sudo: bool) -> dict[str, Any]:
    from pyinfra.api.command import StringCommand  # noqa: PLC0415

    python, args = observe_request(pve, vmid)
    command = make_pct_exec_command(int(vmid), StringCommand(observe_once_command(python, args)),
                                    binary=str(pve.data.get("pct_binary") or "pct"), sudo=sudo)
    _ok, output = host.run_shell_command(command, _sudo=False, print_output=False, print_input=False)
    from gpugate import agentcmd  # noqa: PLC0415

    return observation_from(agentcmd.parse_output(list(output.stdout_lines)))


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
        view = host_view(pve.name, index, configs)
        for ct in view["containers"]:
            if ct["status"] == "running":  # the status's observe, one command per container
                ct["servers"], ct["observe_problem"] = servers_of(_observe(host, pve, ct["vmid"], sudo))
        result.append(view)
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
