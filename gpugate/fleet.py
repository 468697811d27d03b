"""fleet.yaml: the Proxmox hosts, their containers and the SGLang server each should run.

``load_fleet(path)`` reads and validates the file; every problem is a ``FleetError`` naming the
file, the entry (``hosts.pve1.containers.129.sglang.flags.kv-cache-dtype``) and the problem.
``fleet_to_inventory(fleet)`` turns it into pyinfra inventory groups (what ``inventory.py``
exposes).

The file (every key but ``hosts`` is optional)::

    groups:                       # optional: data for groups that containers join
      canary: {data: {drain_timeout_s: 30}}
    hosts:
      pve1:                       # a name of your choosing: hosts are @pct/pve1:<vmid>
        ssh: {hostname: pve1.example.net, user: root}   # any pyinfra ssh_* setting, without ssh_
        data: {gpu_max_used_mib: 128}                   # data for every container on pve1
        containers:
          129:
            groups: [canary]      # extra inventory groups (rolling restarts, --limit canary)
            data: {start_timeout_s: 3600}               # data for this container only
            sglang:
              model_path: moonshotai/Kimi-K2.5
              port: 30000
              flags: {tp: 8, kv-cache-dtype: fp8_e4m3, disable-radix-cache: true}
              env: {HF_TOKEN: "..."}
              present: true       # false: no server on this port (stopped, GPUs freed)
              supervisor: process # or systemd
              python: /opt/venv/bin/python3   # the interpreter that has sglang (default /usr/bin/python3)

``ssh: {hostname: "@local"}`` means pyinfra runs on the Proxmox host itself: ``@pct/@local:129``.
Relative ``ssh.key``, ``ssh.known_hosts_file`` and ``ssh.config_file`` are relative to the
fleet file's directory.

Example::

    >>> fleet = load_fleet("fleet.yaml")                      # doctest: +SKIP
    >>> fleet_to_inventory(fleet)["pve_pve1"][0][0][0]        # doctest: +SKIP
    '@pct/pve1:129'
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from gpugate.sglang_args import FlagError, canonical_name, validate_flags

__all__ = [
    "FleetError",
    "Fleet",
    "PveHost",
    "Container",
    "SglangSpec",
    "load_fleet",
    "parse_fleet",
    "fleet_to_inventory",
    "SUPERVISORS",
    "LOCAL_HOST",
]

SUPERVISORS = ("process", "systemd")
LOCAL_HOST = "@local"

# pyinfra's SSH connector settings, written in fleet.yaml without the ssh_ prefix.
SSH_SETTINGS = (
    "hostname", "port", "user", "password", "key", "key_password", "allow_agent", "look_for_keys",
    "forward_agent", "config_file", "known_hosts_file", "strict_host_key_checking",
    "paramiko_connect_kwargs", "connect_retries", "connect_retry_min_delay",
    "connect_retry_max_delay", "file_transfer_protocol",
)
_SSH_PATH_SETTINGS = ("key", "known_hosts_file", "config_file")

# Types of the inventory data gpugate reads (group_data/all.py documents each).
DATA_TYPES: dict[str, tuple[type, ...]] = {
    "gpu_max_used_mib": (int,),
    "gpu_gate_timeout_s": (int, float),
    "drain_timeout_s": (int, float),
    "start_timeout_s": (int, float),
    "health_poll_s": (int, float),
    "kill_grace_s": (int, float),
    "rolling": (bool,),
    "audit_log": (str, type(None)),
    "pct_sudo": (bool,),
    "lock_wait_s": (int, float),
}
_SGLANG_KEYS = ("model_path", "port", "host", "flags", "env", "present", "supervisor", "python")
_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]*$")
_GROUP_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_DATA_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class FleetError(ValueError):
    """A problem in the fleet file: ``<file>: <entry>: <problem>``."""

    def __init__(self, path: str | os.PathLike[str], entry: str, problem: str):
        self.path = str(path)
        self.entry = entry
        self.problem = problem
        where = f"{self.path}: {entry}" if entry else self.path
        super().__init__(f"{where}: {problem}")


@dataclasses.dataclass
class SglangSpec:
    """The desired server of one container (flags validated and normalised)."""

    model_path: str | None
    port: int | None = None
    host: str | None = None
    flags: dict[str, Any] = dataclasses.field(default_factory=dict)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    present: bool = True
    supervisor: str | None = None
    python: str | None = None


@dataclasses.dataclass
class Container:
    vmid: int
    groups: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    sglang: SglangSpec | None = None


@dataclasses.dataclass
class PveHost:
    name: str
    ssh: dict[str, Any] = dataclasses.field(default_factory=dict)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    containers: list[Container] = dataclasses.field(default_factory=list)

    @property
    def is_local(self) -> bool:
        return self.ssh.get("hostname") == LOCAL_HOST

    def inventory_name(self, vmid: int) -> str:
        return f"@pct/{LOCAL_HOST if self.is_local else self.name}:{vmid}"


@dataclasses.dataclass
class Fleet:
    path: str
    hosts: list[PveHost] = dataclasses.field(default_factory=list)
    groups: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


# --------------------------------------------------------------------------------------
# YAML with duplicate keys refused (PyYAML silently keeps the last one: two "129:" entries
# would quietly drop a container)
# --------------------------------------------------------------------------------------

class _StrictLoader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    mapping: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"unhashable key {key!r}", key_node.start_mark) from None
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------

class _Checker:
    def __init__(self, path: str):
        self.path = path

    def fail(self, entry: str, problem: str) -> FleetError:
        return FleetError(self.path, entry, problem)

    def mapping(self, value: Any, entry: str, allowed: tuple[str, ...] | None = None) -> dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(entry, f"expected a mapping, got {_describe(value)}")
        if allowed is not None:
            for key in value:
                if key not in allowed:
                    raise self.fail(f"{entry}.{key}" if entry else str(key),
                                    f"unknown key{_suggest(str(key), allowed)}; "
                                    f"allowed: {', '.join(allowed)}")
        return value

    def data(self, value: Any, entry: str) -> dict[str, Any]:
        data = self.mapping(value, entry)
        for key, item in data.items():
            where = f"{entry}.{key}"
            if not isinstance(key, str) or not _DATA_KEY.match(key):
                raise self.fail(where, "data keys are identifiers (letters, digits, _)")
            if key.startswith("sglang_"):
                raise self.fail(where, "write the server's settings in the container's sglang: "
                                       "section (validated), not as data")
            if key.startswith("ssh_"):
                raise self.fail(where, "write SSH settings in the host's ssh: section")
            if key in DATA_TYPES:
                types = DATA_TYPES[key]
                ok = isinstance(item, types) and not (isinstance(item, bool) and bool not in types)
                if not ok:
                    names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
                    raise self.fail(where, f"expected {names}, got {_describe(item)}")
                if isinstance(item, (int, float)) and not isinstance(item, bool) and item < 0:
                    raise self.fail(where, f"must not be negative, got {item}")
        return dict(data)


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    return f"{value!r} ({type(value).__name__})"


def _suggest(word: str, choices: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _check_ssh(check: _Checker, raw: Any, entry: str, base_dir: Path, default_hostname: str) -> dict:
    ssh = dict(check.mapping(raw, entry, SSH_SETTINGS))
    ssh.setdefault("hostname", default_hostname)
    for key, value in ssh.items():
        where = f"{entry}.{key}"
        if key == "port":
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
                raise check.fail(where, f"expected a port number 1..65535, got {_describe(value)}")
        elif key == "hostname":
            if not isinstance(value, str) or not value or value.startswith("-") or any(
                    c.isspace() for c in value):
                raise check.fail(where, f"expected a host name or address, got {_describe(value)}")
        elif key in _SSH_PATH_SETTINGS:
            if not isinstance(value, str) or not value:
                raise check.fail(where, f"expected a path, got {_describe(value)}")
            expanded = Path(value).expanduser()
            ssh[key] = str(expanded if expanded.is_absolute() else (base_dir / expanded))
    return ssh


def _check_sglang(check: _Checker, raw: Any, entry: str) -> SglangSpec:
    section = check.mapping(raw, entry, _SGLANG_KEYS)
    present = section.get("present", True)
    if not isinstance(present, bool):
        raise check.fail(f"{entry}.present", f"expected true or false, got {_describe(present)}")

    model_path = section.get("model_path")
    if model_path is None:
        if present:
            raise check.fail(f"{entry}.model_path", "missing: the model path or Hugging Face repo id to serve")
    elif not isinstance(model_path, str) or not model_path.strip() or "\x00" in model_path or "\n" in model_path:
        raise check.fail(f"{entry}.model_path", f"expected a path or repo id, got {_describe(model_path)}")

    port = section.get("port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        raise check.fail(f"{entry}.port", f"expected a port number 1..65535, got {_describe(port)}")

    host = section.get("host")
    if host is not None and (not isinstance(host, str) or not host or host.startswith("-")
                             or any(c.isspace() or c == "\x00" for c in host)):
        raise check.fail(f"{entry}.host", f"expected an address to listen on, got {_describe(host)}")

    python = section.get("python")
    if python is not None and (not isinstance(python, str) or not python.startswith("/")
                               or any(c.isspace() or c == "\x00" for c in python)):
        raise check.fail(f"{entry}.python", f"expected the absolute path of a Python interpreter in the "
                                            f"container, got {_describe(python)}")

    supervisor = section.get("supervisor")
    if supervisor is not None and supervisor not in SUPERVISORS:
        raise check.fail(f"{entry}.supervisor", f"expected one of {', '.join(SUPERVISORS)}, "
                                                f"got {_describe(supervisor)}")

    raw_flags = check.mapping(section.get("flags"), f"{entry}.flags")
    try:
        flags = validate_flags(raw_flags)
    except FlagError as error:
        raise check.fail(f"{entry}.flags.{_written_key(raw_flags, error.flag)}", error.message) from None

    env: dict[str, str] = {}
    for key, value in check.mapping(section.get("env"), f"{entry}.env").items():
        where = f"{entry}.env.{key}"
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise check.fail(where, "environment variable names are letters, digits and _, "
                                    "not starting with a digit")
        if isinstance(value, bool) or value is None or not isinstance(value, (str, int, float)):
            raise check.fail(where, f"expected a string (quote it in YAML), got {_describe(value)}")
        text = str(value)
        if "\x00" in text or "\n" in text or "\r" in text:
            raise check.fail(where, "values cannot contain NUL or line breaks (one line per variable)")
        env[key] = text

    return SglangSpec(model_path=model_path, port=port, host=host, flags=flags, env=env,
                      present=present, supervisor=supervisor, python=python)


def _written_key(raw_flags: Mapping[Any, Any], canonical: str) -> str:
    """The key as the user wrote it for a canonical flag name (for error locations)."""
    for key in raw_flags:
        try:
            if canonical_name(str(key)) == canonical:
                return str(key)
        except FlagError:
            if str(key).lstrip("-") == canonical:
                return str(key)
    return canonical


def _vmid(check: _Checker, key: Any, entry: str) -> int:
    if isinstance(key, bool):
        raise check.fail(entry, f"container ids are Proxmox vmids (integers), got {key!r}")
    if isinstance(key, str) and key.isdigit():
        key = int(key)
    if not isinstance(key, int) or not 100 <= key <= 999_999_999:
        raise check.fail(entry, f"container ids are Proxmox vmids 100..999999999, got {key!r}")
    return key


def parse_fleet(document: Any, path: str | os.PathLike[str] = "fleet.yaml") -> Fleet:
    """Validate an already-loaded fleet document (a dict as YAML gives it)."""
    path = str(path)
    check = _Checker(path)
    base_dir = Path(path).resolve().parent
    top = check.mapping(document, "", ("hosts", "groups"))
    if not top.get("hosts"):
        raise check.fail("hosts", "missing: list at least one Proxmox host with its containers")

    fleet = Fleet(path=path)
    for name, raw_group in check.mapping(top.get("groups"), "groups").items():
        entry = f"groups.{name}"
        if not isinstance(name, str) or not _GROUP_NAME.match(name) or name == "all" or name.startswith("pve_"):
            raise check.fail(entry, "group names are identifiers, not 'all' and not starting with pve_ "
                                    "(those are made per Proxmox host)")
        group = check.mapping(raw_group, entry, ("data",))
        fleet.groups[name] = check.data(group.get("data"), f"{entry}.data")

    seen_names: dict[str, str] = {}
    for host_name, raw_host in check.mapping(top["hosts"], "hosts").items():
        entry = f"hosts.{host_name}"
        if not isinstance(host_name, str) or not _HOST_NAME.match(host_name):
            raise check.fail(entry, "Proxmox host names are letters, digits, '.' and '-'")
        body = check.mapping(raw_host, entry, ("ssh", "data", "containers"))
        host = PveHost(
            name=host_name,
            ssh=_check_ssh(check, body.get("ssh"), f"{entry}.ssh", base_dir, host_name),
            data=check.data(body.get("data"), f"{entry}.data"),
        )
        containers = check.mapping(body.get("containers"), f"{entry}.containers")
        if not containers:
            raise check.fail(f"{entry}.containers", "missing: list the containers (by vmid) on this host")
        for raw_vmid, raw_container in containers.items():
            where = f"{entry}.containers.{raw_vmid}"
            vmid = _vmid(check, raw_vmid, where)
            container_body = check.mapping(raw_container, where, ("sglang", "groups", "data"))
            groups = container_body.get("groups") or []
            if not isinstance(groups, list):
                raise check.fail(f"{where}.groups", f"expected a list of group names, got {_describe(groups)}")
            for group in groups:
                if not isinstance(group, str) or not _GROUP_NAME.match(group) or group == "all" \
                        or group.startswith("pve_"):
                    raise check.fail(f"{where}.groups", f"{group!r} is not a usable group name "
                                                        "(an identifier, not 'all', not pve_*)")
            container = Container(
                vmid=vmid,
                groups=list(dict.fromkeys(groups)),
                data=check.data(container_body.get("data"), f"{where}.data"),
                sglang=(_check_sglang(check, container_body["sglang"], f"{where}.sglang")
                        if container_body.get("sglang") is not None else None),
            )
            name = host.inventory_name(vmid)
            if name in seen_names:
                raise check.fail(where, f"{name} is already defined at {seen_names[name]}")
            seen_names[name] = where
            host.containers.append(container)
        fleet.hosts.append(host)
    return fleet


def load_fleet(path: str | os.PathLike[str]) -> Fleet:
    """Read and validate a fleet file. Raises FleetError (file, entry, problem)."""
    path = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FleetError(path, "", "no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise FleetError(path, "", f"cannot read it: {error}") from None
    try:
        document = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        raise FleetError(path, where, f"not valid YAML: {problem}") from None
    return parse_fleet(document, path)


# --------------------------------------------------------------------------------------
# pyinfra inventory
# --------------------------------------------------------------------------------------

def pve_group_name(host_name: str) -> str:
    """``pve1`` -> ``pve_pve1``; ``gpu-01.dc`` -> ``pve_gpu_01_dc``."""
    return "pve_" + re.sub(r"[^A-Za-z0-9_]", "_", host_name)


def container_host_data(host: PveHost, container: Container) -> dict[str, Any]:
    """The pyinfra host data of one container: ssh_*, pct_vmid, sglang_*, then data overrides
    (the Proxmox host's ``data``, then the container's)."""
    data: dict[str, Any] = {}
    if not host.is_local:
        data.update({f"ssh_{key}": value for key, value in host.ssh.items()})
    data["pct_vmid"] = container.vmid
    data["pve_host"] = host.name
    spec = container.sglang
    if spec is not None:
        data["sglang_model_path"] = spec.model_path
        data["sglang_flags"] = dict(spec.flags)
        data["sglang_env"] = dict(spec.env)
        data["sglang_present"] = spec.present
        if spec.port is not None:
            data["sglang_port"] = spec.port
        if spec.host is not None:
            data["sglang_host"] = spec.host
        if spec.supervisor is not None:
            data["sglang_supervisor"] = spec.supervisor
        if spec.python is not None:
            data["sglang_python"] = spec.python
    data.update(host.data)
    data.update(container.data)
    return data


def fleet_to_inventory(fleet: Fleet) -> dict[str, tuple[list, dict]]:
    """pyinfra groups: ``pve_<host>`` per Proxmox host (hosts with their data), and each user
    group (``groups: [canary]``) with its data from the fleet's ``groups:`` section.

    Example::

        >>> fleet = parse_fleet({"hosts": {"pve1": {"ssh": {"hostname": "10.0.0.5"},
        ...     "containers": {129: {"sglang": {"model_path": "/m", "flags": {"tp": 8}}}}}}})
        >>> groups = fleet_to_inventory(fleet)
        >>> name, data = groups["pve_pve1"][0][0]
        >>> name, data["ssh_hostname"], data["pct_vmid"], data["sglang_flags"]
        ('@pct/pve1:129', '10.0.0.5', 129, {'tp-size': 8})
    """
    groups: dict[str, tuple[list, dict]] = {}
    for name, data in fleet.groups.items():
        groups[name] = ([], dict(data))
    for host in fleet.hosts:
        members: list[tuple[str, dict[str, Any]]] = []
        for container in host.containers:
            host_name = host.inventory_name(container.vmid)
            members.append((host_name, container_host_data(host, container)))
            for group in container.groups:
                groups.setdefault(group, ([], {}))[0].append(host_name)
        groups[pve_group_name(host.name)] = (members, {})
    return groups

