"""fleet.yaml: the Proxmox hosts, their containers and the SGLang server each should run.

``load_fleet(path)`` reads and validates the file; every problem is a ``FleetError`` naming the
file, the entry (``hosts.pve1.containers.129.sglang.flags.kv-cache-dtype``) and the problem.
``fleet_to_inventory(fleet)`` turns it into pyinfra inventory groups (what ``inventory.py``
exposes).

The file (every key but ``hosts`` is optional)::

    routers:                      # optional: gateways (smg) in front of servers
      gw: {url: "http://127.0.0.1:30080", kind: smg, api_key_env: GW_KEY}   # the key: $GW_KEY, never in the file
    canary: {soak_s: 120}         # optional: the first replica of a rolling change behind a router soaks and is
                                  # judged before the rest (docs/canary.md); or in one router's entry
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
              sglang_version: "0.5.23"  # the SGLang release in the container (its flag table); quoted
              extra_args: ["--some-new-flag", "1"]   # argv items passed through as written
              router: gw          # leaves gw, drains, restarts, rejoins (docs/transition.md "Routed")
              router_url: "http://10.0.0.5:30000"    # how the router reaches this server
              router_cordon: false  # true: kept out of gw (maintenance); false: added once verified
          130:
            sglang:               # several servers in one container: a list, each on its own port
              - {model_path: /opt/models/m, port: 30000, flags: {tp: 4}}
              - {model_path: /opt/models/m, port: 30001, flags: {tp: 4, base-gpu-id: 4}}

``ssh: {hostname: "@local"}`` means pyinfra runs on the Proxmox host itself: ``@pct/@local:129``.
Relative ``ssh.key``, ``ssh.known_hosts_file`` and ``ssh.config_file`` are relative to the
fleet file's directory. The Proxmox host's key must already be in known_hosts (the @pct
connector checks strictly); ``strict_host_key_checking: accept-new`` relaxes that explicitly.

What is refused (each with the entry named): two servers naming one ``router_url`` behind one
router (however it is written: the router keeps one worker per URL), unknown keys anywhere (with a did-you-mean), data of
the wrong type (``validated_settings``: the same rules for ``--data``), env values YAML did not
read as strings (``0755`` is 493, ``1.10`` is 1.1: quote them), integers YAML reads unlike a
person (``0201`` is octal 129, ``1:30`` is 90), a ``python:`` that is not a Python 3
interpreter, and files over ``MAX_FLEET_BYTES``. YAML merge keys work, and a key written beside
``<<: *anchor`` overrides the merged one; top-level ``x-<name>:`` keys may hold anchors (ignored
otherwise).

Example::

    >>> import pathlib, tempfile
    >>> with tempfile.TemporaryDirectory() as directory:
    ...     path = pathlib.Path(directory, "fleet.yaml")
    ...     _ = path.write_text("{hosts: {pve1: {ssh: {hostname: pve1.example.net}, containers: "
    ...                         "{129: {sglang: {model_path: /opt/models/m, port: 30000, flags: {tp: 8}}}}}}}")
    ...     fleet = load_fleet(path)
    >>> fleet_to_inventory(fleet)["pve_pve1"][0][0][0]
    '@pct/pve1:129'
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from gpugate.rules.redact import leaf_strings, mask_values
from gpugate.settings import (MAY_HOLD_SECRETS, REMOVED, SETTINGS, SSH_SETTINGS, data_keys, describe as _describe,
                              env_name, env_value, server_keys, suggest as _suggest)
from gpugate.router.smg import worker_url_key
from gpugate.engine import DEFAULT_ENGINE, Engine, FlagError, get as engine
from gpugate.engine import names as engine_names

__all__ = [
    "FleetError",
    "Fleet",
    "PveHost",
    "Container",
    "Router",
    "load_fleet",
    "parse_fleet",
    "fleet_to_inventory",
    "MAX_FLEET_BYTES",
    "LOCAL_HOST",
]

LOCAL_HOST = "@local"
_SSH_PATH_SETTINGS = ("key", "known_hosts_file", "config_file")

MAX_FLEET_BYTES = 1 << 20  # 1 MiB: a fleet of a thousand containers is well under 200 KiB


_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]*$")
_GROUP_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_DATA_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


class FleetError(ValueError):
    """A problem in the fleet file: ``<file>: <entry>: <problem>``."""

    def __init__(self, path: str | os.PathLike[str], entry: str, problem: str):
        self.path = str(path)
        self.entry = entry
        self.problem = problem
        where = f"{self.path}: {entry}" if entry else self.path
        super().__init__(f"{where}: {problem}")


@dataclasses.dataclass
class Container:
    vmid: int
    groups: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the sglang: section as settings (host-data key -> checked value); several servers: sglang_servers
    sglang: dict[str, Any] | None = None


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
    routers: dict[str, "Router"] = dataclasses.field(default_factory=dict)
    canary: dict[str, Any] | None = None  # the top level's canary: every routed server's (docs/canary.md)


@dataclasses.dataclass(frozen=True)
class Router:
    """A gateway in front of servers (fleet.yaml ``routers:``): ``gw: {url: "http://127.0.0.1:30080",
    kind: smg, api_key_env: GW_KEY}``. The key itself is never in the file: the control machine's
    environment variable ``api_key_env`` holds it."""

    name: str
    url: str
    kind: str = "smg"
    api_key_env: str | None = None
    canary: dict[str, Any] | None = None  # this router's replicas' canary (over the top level's)

    def host_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"router_endpoint": self.url, "router_kind": self.kind}
        if self.api_key_env:
            data["router_api_key_env"] = self.api_key_env
        if self.canary is not None:
            data["canary"] = self.canary
        return data


ROUTER_KINDS = ("smg",)


# --------------------------------------------------------------------------------------
# YAML: duplicate keys refused (PyYAML silently keeps the last one: two "129:" entries would
# quietly drop a container), merge keys with overrides, integers YAML 1.1 reads unlike a person
# --------------------------------------------------------------------------------------

_MERGE_TAG = "tag:yaml.org,2002:merge"


class AmbiguousInt(int):
    """An integer YAML 1.1 read from text a person reads otherwise (``0201`` is octal 129,
    ``1:30`` is 90, ``0x10``, ``1_000``); ``yaml_text`` is what was written. parse_fleet refuses
    each one, naming its entry."""

    yaml_text: str


# A fleet of a thousand containers is about 20,000 values and nests 8 deep; YAML aliases can make a
# few hundred bytes stand for billions of values ("billion laughs"), and deep nesting exhausts the
# parser's stack. Both are refused before anything is built from the document.
MAX_FLEET_DEPTH = 64
MAX_FLEET_VALUES = 200_000


class FleetBoundError(yaml.YAMLError):
    """A document that is too deep or too large once its aliases are expanded."""

    def __init__(self, problem: str, mark: Any = None):
        super().__init__(problem)
        self.problem = problem
        self.problem_mark = mark


class _StrictLoader(yaml.SafeLoader):
    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.gpugate_depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.gpugate_depth += 1
        try:
            if self.gpugate_depth > MAX_FLEET_DEPTH:
                raise FleetBoundError(f"nested more than {MAX_FLEET_DEPTH} levels deep (a fleet file nests "
                                      f"about 8)", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.gpugate_depth -= 1

    def construct_document(self, node: Any) -> Any:
        expanded = _expanded_size(node)
        if expanded > MAX_FLEET_VALUES:
            raise FleetBoundError(f"its aliases expand to more than {MAX_FLEET_VALUES:,} values (a fleet of a "
                                  f"thousand containers has about 20,000): an alias bomb?", node.start_mark)
        return super().construct_document(node)

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # Count the keys written in this mapping before PyYAML prepends the merged ones (it calls
        # this method again for nested merges, so each node is counted before it is flattened).
        if not hasattr(node, "gpugate_written"):
            setattr(node, "gpugate_written", sum(1 for key, _value in node.value if key.tag != _MERGE_TAG))
        super().flatten_mapping(node)


def _expanded_size(root: Any) -> int:
    """How many values the document holds with every alias expanded (a node reached through N
    aliases counts N times), counted without expanding anything: each node's size once, bottom up.

    >>> _expanded_size(yaml.compose("a: &x [1, 2, 3]\\nb: [*x, *x, *x]"))
    20
    """
    sizes: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = ([item for pair in node.value for item in pair] if isinstance(node, yaml.MappingNode)
                    else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if children_done or not children:
            sizes[id(node)] = min(1 + sum(sizes[id(child)] for child in children), MAX_FLEET_VALUES + 1)
        else:
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(root)]


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    merged = len(node.value) - getattr(node, "gpugate_written", len(node.value))
    mapping: dict = {}
    written: set = set()
    for index, (key_node, value_node) in enumerate(node.value):
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"unhashable key {key!r}", key_node.start_mark) from None
        if index >= merged:
            # a key written here overrides a merged one (<<: *base, then port: 30001); written twice
            # here is a mistake
            if key in written:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            written.add(key)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_PLAIN_DECIMAL = re.compile(r"^[-+]?(0|[1-9][0-9]*)$")


def _construct_int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    try:
        value = yaml.SafeLoader.construct_yaml_int(loader, node)
    except ValueError as error:  # a number of thousands of digits: Python refuses to read it
        raise FleetBoundError(f"a number too long to read ({len(node.value)} characters): {error}",
                              node.start_mark) from None
    if _PLAIN_DECIMAL.match(node.value):
        return value
    ambiguous = AmbiguousInt(value)
    ambiguous.yaml_text = node.value
    return ambiguous


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _refuse_ambiguous_ints(check: "_Checker", document: Any) -> None:
    """FleetError at the first AmbiguousInt (key or value), naming its entry. Each container is
    visited once (anchors make shared objects: an alias bomb stays linear)."""
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(document, "")]
    while stack:
        value, entry = stack.pop()
        if isinstance(value, (dict, list)):
            if id(value) in seen:
                continue
            seen.add(id(value))
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{entry}.{key}" if entry else str(key)
                if isinstance(key, AmbiguousInt):
                    raise check.fail(f"{entry}.{key.yaml_text}" if entry else key.yaml_text,
                                     _ambiguous_problem(key))
                stack.append((item, where))
        elif isinstance(value, list):
            stack.extend((item, f"{entry}[{index}]") for index, item in enumerate(value))
        elif isinstance(value, AmbiguousInt):
            if entry.rpartition(".")[0].endswith(".env"):
                # an env value: the check of env values says it, without showing a possible secret
                continue
            raise check.fail(entry, _ambiguous_problem(value))


def _ambiguous_problem(value: AmbiguousInt) -> str:
    text = value.yaml_text
    if re.match(r"^[-+]?0[0-9_]+$", text):
        how = f"has a leading zero: YAML reads it as the octal number {int(value)}"
    elif ":" in text:
        how = f"is read by YAML as a base-60 number, {int(value)}"
    else:
        how = f"is read by YAML as {int(value)}"
    return f"{text} {how}; write the number without it, or quote it if it is text"


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
        """A ``data:`` section: only gpugate's settings (SETTINGS, less the sglang_* ones, which
        the sglang: section sets), each checked as validated_settings checks --data."""
        data = self.mapping(value, entry)
        checked: dict[str, Any] = {}
        for key, item in data.items():
            where = f"{entry}.{key}"
            if not isinstance(key, str) or not _DATA_KEY.match(key):
                raise self.fail(where, "data keys are identifiers (letters, digits, _)")
            if key.startswith("sglang_"):
                raise self.fail(where, "write the server's settings in the container's sglang: "
                                       "section (validated), not as data")
            if key.startswith("ssh_"):
                raise self.fail(where, "write SSH settings in the host's ssh: section")
            if key in REMOVED:
                raise self.fail(where, f"no longer a setting: {REMOVED[key]}")
            if key not in data_keys():
                raise self.fail(where, f"unknown setting{_suggest(key, data_keys())}; "
                                       f"settings: {', '.join(data_keys())}")
            try:
                checked[key] = SETTINGS[key].convert(item)
            except ValueError as error:
                raise self.fail(where, str(error)) from None
        return checked


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


def _check_routers(check: _Checker, raw: Any) -> dict[str, Router]:
    """fleet.yaml's ``routers:`` section: name -> Router, each field by its settings row."""
    routers: dict[str, Router] = {}
    for name, raw_router in check.mapping(raw, "routers").items():
        entry = f"routers.{name}"
        try:
            SETTINGS["sglang_router"].convert(name)
        except ValueError as error:
            raise check.fail(entry, str(error)) from None
        body = check.mapping(raw_router, entry, ("url", "kind", "api_key_env", "canary"))
        if not body.get("url"):
            raise check.fail(f"{entry}.url", "missing: the router's URL (http://host:port)")
        kind = body.get("kind", "smg")
        if kind not in ROUTER_KINDS:
            raise check.fail(f"{entry}.kind", f"unknown router kind {_describe(kind)}; known: {', '.join(ROUTER_KINDS)}")
        fields: dict[str, Any] = {}
        for key, setting in (("url", "router_endpoint"), ("api_key_env", "router_api_key_env"), ("canary", "canary")):
            if body.get(key) is not None:
                try:
                    fields[key] = SETTINGS[setting].convert(body[key])
                except ValueError as error:
                    raise check.fail(f"{entry}.{key}", str(error)) from None
        routers[name] = Router(name=name, kind=kind, **fields)
    return routers


def _check_routed(check: _Checker, sglang: dict[str, Any], routers: Mapping[str, Router], entry: str) -> None:
    """A server that names a router names one of the routers: section, and says how it reaches it."""
    name = sglang.get("sglang_router")
    if name is None:
        for key, fleet_key in (("sglang_router_url", "router_url"), ("sglang_router_cordon", "router_cordon")):
            if sglang.get(key):
                raise check.fail(f"{entry}.{fleet_key}", "given without router: name the router (routers: section)")
        return
    if name not in routers:
        raise check.fail(f"{entry}.router", f"no router {name!r} in the routers: section"
                                            f"{_suggest(name, list(routers))}")
    if not sglang.get("sglang_router_url"):
        raise check.fail(f"{entry}.router_url", "missing: the URL the router reaches this server at "
                                                "(e.g. http://10.0.0.5:30000)")


def _check_worker_url(check: _Checker, sglang: dict[str, Any], routers: Mapping[str, Router], entry: str,
                      seen: dict[tuple[str, str], tuple[str, str]]) -> None:
    """One worker URL, one server, behind one router (issue 32): two servers naming one URL (written
    alike or not: gpugate.router.smg.worker_url_key) are refused, naming both. ``seen``: (router URL,
    worker URL) -> (the entry that named it, its router's name)."""
    name, url = sglang.get("sglang_router"), sglang.get("sglang_router_url")
    if not name or not url or name not in routers:
        return
    key = (worker_url_key(routers[name].url), worker_url_key(url))
    if key in seen:
        other, other_router = seen[key]
        behind = f"router {name}" + (f" (router {other_router}'s URL too)" if other_router != name else "")
        raise check.fail(f"{entry}.router_url",
                         f"{url} is also the router_url of {other} behind {behind}: the router keeps one worker "
                         f"per URL, so a restart of either would take the other out of the router and stop one it "
                         f"still sends requests to; give each server the URL the router reaches it at")
    seen[key] = (entry, name)


def _check_sglang(check: _Checker, raw: Any, entry: str, section_engine: str = DEFAULT_ENGINE) -> dict[str, Any]:
    """A server section as settings (host-data key -> checked value), each key by its row of
    gpugate.settings.SETTINGS; the flags validated here too (by ``section_engine``, the engine the
    section is named for), so a typo names its entry."""
    rows = server_keys()
    for key in raw if isinstance(raw, dict) else ():
        if key in REMOVED:
            raise check.fail(f"{entry}.{key}", f"no longer a setting: {REMOVED[key]}")
    section = check.mapping(raw, entry, tuple(rows))
    out: dict[str, Any] = {}
    if section_engine != DEFAULT_ENGINE:  # a section named for its engine (vllm:) is that engine's
        if section.get("engine") not in (None, section_engine):
            raise check.fail(f"{entry}.engine", f"{section['engine']!r} in a {section_engine}: section: move the "
                                                f"server to a {section['engine']}: section, or leave engine: out")
        section = {**section, "engine": section_engine}
    if section.get("engine") is not None:  # first: the flags are validated by the server's engine
        try:
            out["engine"] = rows["engine"].convert(section["engine"])
        except ValueError as error:
            raise check.fail(f"{entry}.engine", str(error)) from None
    try:
        serving: Engine | None = engine(out.get("engine") or DEFAULT_ENGINE)
    except KeyError:  # an installed engine that does not load: its own servers are refused (the deploy says why)
        serving = None
    for key, value in section.items():
        row = rows[key]
        where = f"{entry}.{key}"
        if key == "env":
            env = {}
            for name, item in check.mapping(value, where).items():
                try:
                    env[env_name(name)] = env_value(name, item, named=False)
                except ValueError as error:
                    raise check.fail(f"{where}.{name}", str(error)) from None
            out[row.key] = env
        elif key == "flags":
            raw_flags = check.mapping(value, where)
            if serving is None:
                out[row.key] = dict(raw_flags)
                continue
            try:
                out[row.key] = serving.validate_flags(raw_flags)
            except FlagError as error:
                raise check.fail(f"{where}.{_written_key(serving, raw_flags, error.flag)}", error.message) from None
        elif value is not None and key != "engine":
            try:
                out[row.key] = row.convert(value)
            except ValueError as error:  # a value that may hold a secret is never quoted back
                raise check.fail(where, mask_values(str(error), leaf_strings(value)) if row.key in MAY_HOLD_SECRETS
                                 else str(error)) from None
    if out.get("sglang_present", True) and not out.get("sglang_model_path"):
        raise check.fail(f"{entry}.model_path", "missing: the model path or Hugging Face repo id to serve")
    out.setdefault("sglang_flags", {})
    out.setdefault("sglang_env", {})
    out.setdefault("sglang_present", True)
    if serving is not None and serving.default_port is not None:  # no port: the engine's own default
        out.setdefault("sglang_port", serving.default_port)
    return out


def _check_servers(check: _Checker, sections: Mapping[str, Any], entry: str) -> dict[str, Any]:
    """A container's server sections, each named for its engine (``sglang:``, ``vllm:``): one
    server (a mapping), or several (a list of mappings), all of them each on its own port, each its
    own desired state, history and GPU claim; several servers as ``sglang_servers``."""
    servers: list[dict[str, Any]] = []
    where: list[str] = []
    for section_engine, raw in sections.items():
        at = f"{entry}.{section_engine}"
        if not isinstance(raw, list):
            servers.append(_check_sglang(check, raw, at, section_engine))
            where.append(at)
            continue
        if not raw:
            raise check.fail(at, f"an empty list: write the container's servers, or leave {section_engine}: out")
        for index, item in enumerate(raw):
            servers.append(_check_sglang(check, item, f"{at}[{index}]", section_engine))
            where.append(f"{at}[{index}]")
    if len(servers) == 1:
        return servers[0]
    seen: dict[int, int] = {}
    for index, server in enumerate(servers):
        port = int(server.get("sglang_port", SETTINGS["sglang_port"].default))
        if port in seen:
            raise check.fail(f"{where[index]}.port", f"{port} is also the port of {where[seen[port]]}: "
                                                     f"each server of a container needs its own port")
        seen[port] = index
    return {"sglang_servers": servers}


def _written_key(serving: Engine, raw_flags: Mapping[Any, Any], canonical: str) -> str:
    """The key as the user wrote it for a canonical flag name (for error locations)."""
    for key in raw_flags:
        try:
            if serving.canonical_name(str(key)) == canonical:
                return str(key)
        except FlagError:
            if str(key).lstrip("-") == canonical:
                return str(key)
    return canonical


def _vmid(check: _Checker, key: Any, entry: str) -> int:
    if isinstance(key, bool):
        raise check.fail(entry, f"container ids are Proxmox vmids (integers), got {key!r}")
    if isinstance(key, str) and key.isdigit():
        if key.startswith("0"):
            raise check.fail(entry, f"{key} has a leading zero (unquoted, YAML reads it as an octal "
                                    f"number); write the vmid without it")
        key = int(key)
    if not isinstance(key, int) or not 100 <= key <= 999_999_999:
        raise check.fail(entry, f"container ids are Proxmox vmids 100..999999999, got {key!r}")
    return key


def parse_fleet(document: Any, path: str | os.PathLike[str] = "fleet.yaml") -> Fleet:
    """Validate an already-loaded fleet document (a dict as YAML gives it)."""
    path = str(path)
    check = _Checker(path)
    base_dir = Path(path).resolve().parent
    # x-* top-level keys hold YAML anchors for the rest of the file (as in docker compose), and are
    # otherwise ignored
    top = check.mapping({key: value for key, value in document.items() if not str(key).startswith("x-")}
                        if isinstance(document, dict) else document, "", ("hosts", "groups", "routers", "canary"))
    _refuse_ambiguous_ints(check, top)
    if not top.get("hosts"):
        raise check.fail("hosts", "missing: list at least one Proxmox host with its containers")

    fleet = Fleet(path=path, routers=_check_routers(check, top.get("routers")))
    if top.get("canary") is not None:
        try:
            fleet.canary = SETTINGS["canary"].convert(top["canary"])
        except ValueError as error:
            raise check.fail("canary", str(error)) from None
    for name, raw_group in check.mapping(top.get("groups"), "groups").items():
        entry = f"groups.{name}"
        if not isinstance(name, str) or not _GROUP_NAME.match(name) or name == "all" or name.startswith("pve_"):
            raise check.fail(entry, "group names are identifiers, not 'all' and not starting with pve_ "
                                    "(those are made per Proxmox host)")
        group = check.mapping(raw_group, entry, ("data",))
        fleet.groups[name] = check.data(group.get("data"), f"{entry}.data")

    seen_names: dict[str, str] = {}
    worker_urls: dict[tuple[str, str], tuple[str, str]] = {}  # every routed server's, across hosts
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
            sections = (DEFAULT_ENGINE, *(name for name in engine_names() if name != DEFAULT_ENGINE))
            container_body = check.mapping(raw_container, where, (*sections, "groups", "data"))
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
                # in the order written: a container's servers run in that order (one moves off GPUs another takes)
                sglang=(_check_servers(check, {name: body for name, body in container_body.items()
                                                if name in sections and body is not None}, where)
                        if any(container_body.get(name) is not None for name in sections) else None),
            )
            servers = (container.sglang or {}).get("sglang_servers")
            for index, server in enumerate(servers or ([container.sglang] if container.sglang else [])):
                section = server.get("engine") or DEFAULT_ENGINE
                at = f"{where}.{section}" + (f"[{index}]" if servers else "")
                _check_routed(check, server, fleet.routers, at)
                _check_worker_url(check, server, fleet.routers, at, worker_urls)
            name = host.inventory_name(vmid)
            if name in seen_names:
                raise check.fail(where, f"{name} is already defined at {seen_names[name]}")
            seen_names[name] = where
            host.containers.append(container)
        fleet.hosts.append(host)
    return fleet


def _file_size(path: str) -> str:
    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0
    return f"{size / (1 << 20):.1f} MiB" if size > MAX_FLEET_BYTES else f"more than {MAX_FLEET_BYTES >> 20} MiB"


def load_fleet(path: str | os.PathLike[str]) -> Fleet:
    """Read and validate a fleet file. Raises FleetError (file, entry, problem)."""
    path = str(path)
    try:
        with open(path, "rb") as file:
            # read one byte past the bound: never more, whatever the file's size (a pipe, /dev/zero)
            raw = file.read(MAX_FLEET_BYTES + 1)
        if len(raw) > MAX_FLEET_BYTES:
            size = _file_size(path)
            raise FleetError(path, "", f"the file is {size}, over the limit of {MAX_FLEET_BYTES >> 20} MiB "
                                       f"for a fleet file (a thousand containers take under 200 KiB): is it "
                                       f"the right file?")
        text = raw.decode("utf-8")
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
        if isinstance(error, FleetBoundError):  # valid YAML, but not a document gpugate will build
            raise FleetError(path, where, f"refused: {problem}") from None
        raise FleetError(path, where, f"not valid YAML: {problem}") from None
    return parse_fleet(document, path)


# --------------------------------------------------------------------------------------
# pyinfra inventory
# --------------------------------------------------------------------------------------

def pve_group_name(host_name: str) -> str:
    """``pve1`` -> ``pve_pve1``; ``gpu-01.dc`` -> ``pve_gpu_01_dc``."""
    return "pve_" + re.sub(r"[^A-Za-z0-9_]", "_", host_name)


def container_host_data(host: PveHost, container: Container,
                        routers: Mapping[str, Router] | None = None,
                        canary: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The pyinfra host data of one container: ssh_*, pct_vmid, the fleet's ``canary``, then the Proxmox host's ``data``,
    the container's sglang: section (settings by their host-data keys), its router's URL and kind
    (``router_endpoint``, ``router_kind``, ``router_api_key_env``), the container's ``data``."""
    data: dict[str, Any] = {}
    if not host.is_local:
        data.update({f"ssh_{key}": value for key, value in host.ssh.items()})
    data["pct_vmid"] = container.vmid
    data["pve_host"] = host.name
    if canary is not None:
        data["canary"] = dict(canary)
    data.update(host.data)
    data.update(container.sglang or {})  # a server setting (drain_timeout_s) is the server's own

    def with_router(server: dict[str, Any]) -> dict[str, Any]:
        router = (routers or {}).get(server.get("sglang_router") or "")
        return {**server, **router.host_data()} if router is not None else server

    if data.get("sglang_servers"):  # several servers: each its own router
        data["sglang_servers"] = [with_router(server) for server in data["sglang_servers"]]
    else:
        data.update(with_router(container.sglang or {}))
    data.update(container.data)
    return data


def fleet_to_inventory(fleet: Fleet) -> dict[str, tuple[list, dict]]:
    """pyinfra groups: ``pve_<host>`` per Proxmox host (hosts with their data), the same members
    as a group named like the host (``--limit pve1``; unless a user group has that name), and each
    user group (``groups: [canary]``) with its data from the fleet's ``groups:`` section.

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
            members.append((host_name, container_host_data(host, container, fleet.routers, fleet.canary)))
            for group in container.groups:
                groups.setdefault(group, ([], {}))[0].append(host_name)
        groups[pve_group_name(host.name)] = (members, {})
        # `--limit pve1` names the Proxmox host as the fleet does (pve_pve1 stays, for files named after
        # it); a user group of that name keeps its meaning.
        if host.name not in fleet.groups:
            groups.setdefault(host.name, ([], {}))[0].extend(name for name, _data in members)
    return groups

