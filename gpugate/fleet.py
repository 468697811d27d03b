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
              sglang_version: "0.5.23"  # the SGLang release in the container (its flag table); quoted
              extra_args: ["--some-new-flag", "1"]   # argv items passed through as written

``ssh: {hostname: "@local"}`` means pyinfra runs on the Proxmox host itself: ``@pct/@local:129``.
Relative ``ssh.key``, ``ssh.known_hosts_file`` and ``ssh.config_file`` are relative to the
fleet file's directory. The Proxmox host's key must already be in known_hosts (the @pct
connector checks strictly); ``strict_host_key_checking: accept-new`` relaxes that explicitly.

What is refused (each with the entry named): unknown keys anywhere (with a did-you-mean), data of
the wrong type (``validated_settings``: the same rules for ``--data``), env values YAML did not
read as strings (``0755`` is 493, ``1.10`` is 1.1: quote them), integers YAML reads unlike a
person (``0201`` is octal 129, ``1:30`` is 90), a ``python:`` that is not a Python 3
interpreter, and files over ``MAX_FLEET_BYTES``. YAML merge keys work, and a key written beside
``<<: *anchor`` overrides the merged one; top-level ``x-<name>:`` keys may hold anchors (ignored
otherwise).

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
import reprlib
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml
from pyinfra.api.exceptions import PyinfraError

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
    "validated_settings",
    "SettingsError",
    "SETTINGS",
    "MAX_FLEET_BYTES",
    "SUPERVISORS",
    "LOCAL_HOST",
]

SUPERVISORS = ("process", "systemd", "auto")  # auto: systemd where PID 1 is systemd (gpugate.spec)
LOCAL_HOST = "@local"

# pyinfra's SSH connector settings, written in fleet.yaml without the ssh_ prefix.
SSH_SETTINGS = (
    "hostname", "port", "user", "password", "key", "key_password", "allow_agent", "look_for_keys",
    "forward_agent", "config_file", "known_hosts_file", "strict_host_key_checking",
    "paramiko_connect_kwargs", "connect_retries", "connect_retry_min_delay",
    "connect_retry_max_delay", "file_transfer_protocol",
)
_SSH_PATH_SETTINGS = ("key", "known_hosts_file", "config_file")

MAX_FLEET_BYTES = 1 << 20  # 1 MiB: a fleet of a thousand containers is well under 200 KiB


class SettingsError(PyinfraError, ValueError):
    """A host data value (``--data``, group data, fleet.yaml ``data:``) that gpugate cannot use:
    ``setting drain_timeout_s='abc': expected a number of seconds, got 'abc' (str)``.

    A PyinfraError, so that pyinfra prints the message and no traceback."""

    def __init__(self, key: str, value: Any, problem: str):
        self.key = key
        self.problem = problem
        shown = "(not shown: a secret)" if key == "sglang_env" else _SHORT.repr(value)
        super().__init__(f"setting {key}={shown}: {problem}")


_TRUE = ("true", "yes", "1")
_FALSE = ("false", "no", "0")


def _to_bool(value: Any) -> bool:
    """true/false/yes/no/1/0 (any case; YAML and pyinfra's --data give bools and ints already).

    >>> _to_bool("no"), _to_bool(1), _to_bool("TRUE")
    (False, True, True)
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"expected true or false (or yes/no, 1/0), got {_describe(value)}")


def _to_number(value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"expected a number, got {_describe(value)}")
    if value < 0:
        raise ValueError(f"must not be negative, got {value}")
    return value


def _to_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected a whole number, got {_describe(value)}")
    if value < 0:
        raise ValueError(f"must not be negative, got {value}")
    return value


def _to_port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"expected a port number 1..65535, got {_describe(value)}")
    return value


def _one_line(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected {what}, got {_describe(value)}")
    if any(c in value for c in "\x00\n\r"):
        raise ValueError(f"expected {what} on one line (no NUL or line breaks)")
    return value


def _to_optional_path(value: Any) -> str | None:
    return None if value is None else _one_line(value, "a path")


def _to_model_path(value: Any) -> str | None:
    return None if value is None else _one_line(value, "a path or Hugging Face repo id")


def _to_listen_host(value: Any) -> str:
    text = _one_line(value, "an address to listen on")
    if text.startswith("-") or any(c.isspace() for c in text):
        raise ValueError(f"expected an address to listen on, got {_describe(value)}")
    return text


_PYTHON3 = re.compile(r"^(python|python3|python3\.\d+|pypy3|pypy3\.\d+)$")


def _to_python(value: Any) -> str:
    """The absolute path of a Python 3 interpreter in the container (its name says so: python,
    python3, python3.12, pypy3; ``/bin/sh`` or ``python2`` is refused here, before any SSH).

    >>> _to_python("/opt/venv/bin/python3")
    '/opt/venv/bin/python3'
    """
    if not isinstance(value, str) or not value.startswith("/") or any(
            c.isspace() or c == "\x00" for c in value):
        raise ValueError(f"expected the absolute path of a Python 3 interpreter in the container, "
                         f"got {_describe(value)}")
    if not _PYTHON3.match(os.path.basename(value)):
        raise ValueError(f"{value} is not a Python 3 interpreter (expected a path ending in python3, "
                         f"python3.N or python, e.g. /usr/bin/python3 or /opt/venv/bin/python)")
    return value


def _to_supervisor(value: Any) -> str:
    if value not in SUPERVISORS:
        raise ValueError(f"expected one of {', '.join(SUPERVISORS)}, got {_describe(value)}")
    return value


def _to_flags(value: Any) -> dict:
    # the flags themselves are validated by sglang.server (gpugate.sglang_args), against the
    # container's SGLang version; here only the shape
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping of SGLang flags, got {_describe(value)}")
    return dict(value)


def _to_env(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping NAME: \"value\", got {type(value).__name__}")
    env: dict[str, str] = {}
    for name, item in value.items():
        env[_env_name(name)] = _env_value(name, item)
    return env


def _env_name(name: Any) -> str:
    if not isinstance(name, str) or not _ENV_NAME.match(name):
        raise ValueError(f"{name!r}: environment variable names are letters, digits and _, "
                         "not starting with a digit")
    return name


def _env_value(name: str, value: Any, named: bool = True) -> str:
    """Env values are strings as written: YAML reads unquoted 0755 as 493 and 1.10 as 1.1, so any
    other type is refused (the value itself is never shown: env values may be secrets)."""
    prefix = f"{name}: " if named else ""
    if not isinstance(value, str):
        read_as = ("a boolean" if isinstance(value, bool) else "null" if value is None
                   else "a number" if isinstance(value, (int, float)) else type(value).__name__)
        raise ValueError(f"{prefix}YAML read this value as {read_as}, not as the text written "
                         f"(0755 becomes 493, 1.10 becomes 1.1): quote it ({name}: \"...\")")
    if any(c in value for c in "\x00\n\r"):
        raise ValueError(f"{prefix}values cannot contain NUL or line breaks (one line per variable)")
    return value


def _to_version(value: Any) -> str:
    if not isinstance(value, str) or not _VERSION.match(value):
        raise ValueError(f"expected an SGLang version as a quoted string like \"0.5.23\" "
                         f"(unquoted, YAML reads 0.5.10 as a number), got {_describe(value)}")
    return value


def _to_extra_args(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list of strings (argv items), got {_describe(value)}")
    for item in value:
        if not isinstance(item, str):
            raise ValueError(f"expected strings (quote each item), got {_describe(item)}")
        if any(c in item for c in "\x00\n\r"):
            raise ValueError("argv items cannot contain NUL or line breaks")
    return list(value)


def _to_rank(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected 1 (the newest), 2, ..., got {_describe(value)}")
    return value


def _to_format(value: Any) -> str:
    if value not in ("table", "json"):
        raise ValueError(f"expected table or json, got {_describe(value)}")
    return value


def _to_text(value: Any) -> str:
    return _one_line(value, "a string")


_VERSION = re.compile(r"^[0-9]+(\.[0-9]+)*([.+-]?[A-Za-z0-9]+)*$")

# Every host data key gpugate reads (group_data/all.py documents each), with its checker. A new
# setting is added here, so that fleet.yaml, group data and --data accept it. ``data_key``: may be
# set in fleet.yaml ``data:`` sections (sglang_* belong in the sglang: section instead).
SETTINGS: dict[str, Callable[[Any], Any]] = {
    "sglang_model_path": _to_model_path,
    "sglang_present": _to_bool,
    "sglang_supervisor": _to_supervisor,
    "sglang_port": _to_port,
    "sglang_host": _to_listen_host,
    "sglang_flags": _to_flags,
    "sglang_python": _to_python,
    "sglang_env": _to_env,
    "sglang_restarted": _to_bool,
    "sglang_version": _to_version,
    "sglang_extra_args": _to_extra_args,
    "gpu_max_used_mib": _to_count,
    "gpu_gate_timeout_s": _to_number,
    "drain_timeout_s": _to_number,
    "kill_grace_s": _to_number,
    "start_timeout_s": _to_number,
    "health_poll_s": _to_number,
    "lock_wait_s": _to_number,
    "rolling": _to_bool,
    "max_failures": _to_count,
    "end_other_gpu_holders": _to_bool,
    "min_free_mib": _to_count,      # free space the log and state dirs need before a transition
    "audit_log": _to_optional_path,
    "pve_host": _to_text,
    "pct_sudo": _to_bool,
    "pct_clear_env": _to_bool,
    "pct_binary": _to_text,
    "pct_ssh_share": _to_count,
    # the runbooks' own (--data on their command line)
    "rollback_to": _to_rank,        # the rollback runbook: the k-th newest good spec (1 = newest)
    "format": _to_format,
    "prom": _to_optional_path,
}
# Keys that are no setting of gpugate's but are fine in host data: the @pct connector's (set from
# the host name) and pyinfra's own (ssh_*, global arguments as _sudo, ...).
_PASSTHROUGH = ("pct_vmid", "pct_local")
_RUNBOOK_KEYS = ("rollback_to", "format", "prom")
_DATA_KEYS = tuple(key for key in SETTINGS if not key.startswith("sglang_") and key not in ("pve_host",) + _RUNBOOK_KEYS)


def _ssh_data_keys() -> tuple[str, ...]:
    return tuple(f"ssh_{name}" for name in SSH_SETTINGS)


def validated_settings(data: Any) -> dict[str, Any]:
    """The host data gpugate reads, checked and normalised: the same rules as fleet.yaml for every
    source (``--data``, group data, fleet.yaml). Booleans come from true/false/yes/no/1/0 only
    (pyinfra's ``--data rolling=no`` is the string "no", which Python would call true); numbers
    must be numbers; an unknown key is refused with a did-you-mean. Raises SettingsError.

    ``data`` is pyinfra's ``host.data`` (or any mapping). Returns only the keys of SETTINGS that
    are set; callers apply defaults (``gpugate.runbooks.server_arguments``).

    >>> validated_settings({"rolling": "no", "drain_timeout_s": 30, "ssh_user": "root"})
    {'drain_timeout_s': 30, 'rolling': False}
    >>> validated_settings({"drain_timout_s": 30})
    Traceback (most recent call last):
    ...
    gpugate.fleet.SettingsError: setting drain_timout_s=30: unknown setting (did you mean drain_timeout_s?)
    """
    items = data.dict() if callable(getattr(data, "dict", None)) else dict(data)
    known = tuple(SETTINGS) + _PASSTHROUGH + _ssh_data_keys()
    settings: dict[str, Any] = {}
    for key in sorted(items, key=str):
        value = items[key]
        if not isinstance(key, str):
            raise SettingsError(str(key), value, "setting names are strings")
        if key.startswith("_"):
            continue  # pyinfra's global arguments given as data (_sudo, _su_user, ...)
        if key not in known:
            raise SettingsError(key, value, f"unknown setting{_suggest(key, known)}")
        if key in SETTINGS:
            try:
                settings[key] = SETTINGS[key](value)
            except ValueError as error:
                raise SettingsError(key, value, str(error)) from None
    return settings


_SGLANG_KEYS = ("model_path", "port", "host", "flags", "env", "present", "supervisor", "python",
                "sglang_version", "extra_args")
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
    version: str | None = None          # sglang_version: the SGLang release in the container
    extra_args: list[str] | None = None  # argv items passed through as written


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
# YAML: duplicate keys refused (PyYAML silently keeps the last one: two "129:" entries would
# quietly drop a container), merge keys with overrides, integers YAML 1.1 reads unlike a person
# --------------------------------------------------------------------------------------

_MERGE_TAG = "tag:yaml.org,2002:merge"


class AmbiguousInt(int):
    """An integer YAML 1.1 read from text a person reads otherwise (``0201`` is octal 129,
    ``1:30`` is 90, ``0x10``, ``1_000``); ``yaml_text`` is what was written. parse_fleet refuses
    each one, naming its entry."""

    yaml_text: str


class _StrictLoader(yaml.SafeLoader):
    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # Count the keys written in this mapping before PyYAML prepends the merged ones (it calls
        # this method again for nested merges, so each node is counted before it is flattened).
        if not hasattr(node, "gpugate_written"):
            setattr(node, "gpugate_written", sum(1 for key, _value in node.value if key.tag != _MERGE_TAG))
        super().flatten_mapping(node)


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
    value = yaml.SafeLoader.construct_yaml_int(loader, node)
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
            if key not in _DATA_KEYS:
                raise self.fail(where, f"unknown setting{_suggest(key, _DATA_KEYS)}; "
                                       f"settings: {', '.join(_DATA_KEYS)}")
            try:
                checked[key] = SETTINGS[key](item)
            except ValueError as error:
                raise self.fail(where, str(error)) from None
        return checked


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 2, 4, 4, 80, 80


def _describe(value: Any) -> str:
    """A value for an error message, bounded (a YAML alias bomb is a small file and a huge repr)."""
    if value is None:
        return "nothing (null)"
    return f"{_SHORT.repr(value)} ({type(value).__name__})"


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

    def checked(key: str, convert: Callable[[Any], Any]) -> Any:
        value = section.get(key)
        if value is None:
            return None
        try:
            return convert(value)
        except ValueError as error:
            raise check.fail(f"{entry}.{key}", str(error)) from None

    present = checked("present", _to_bool)
    present = True if present is None else present
    model_path = checked("model_path", _to_model_path)
    if model_path is None and present:
        raise check.fail(f"{entry}.model_path", "missing: the model path or Hugging Face repo id to serve")

    raw_flags = check.mapping(section.get("flags"), f"{entry}.flags")
    try:
        flags = validate_flags(raw_flags)
    except FlagError as error:
        raise check.fail(f"{entry}.flags.{_written_key(raw_flags, error.flag)}", error.message) from None

    env: dict[str, str] = {}
    for key, value in check.mapping(section.get("env"), f"{entry}.env").items():
        where = f"{entry}.env.{key}"
        try:
            env[_env_name(key)] = _env_value(key, value, named=False)
        except ValueError as error:
            raise check.fail(where, str(error)) from None

    return SglangSpec(model_path=model_path, port=checked("port", _to_port), host=checked("host", _to_listen_host),
                      flags=flags, env=env, present=present, supervisor=checked("supervisor", _to_supervisor),
                      python=checked("python", _to_python), version=checked("sglang_version", _to_version),
                      extra_args=checked("extra_args", _to_extra_args))


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
                        if isinstance(document, dict) else document, "", ("hosts", "groups"))
    _refuse_ambiguous_ints(check, top)
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
        if spec.version is not None:
            data["sglang_version"] = spec.version
        if spec.extra_args is not None:
            data["sglang_extra_args"] = list(spec.extra_args)
    data.update(host.data)
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
            members.append((host_name, container_host_data(host, container)))
            for group in container.groups:
                groups.setdefault(group, ([], {}))[0].append(host_name)
        groups[pve_group_name(host.name)] = (members, {})
        # `--limit pve1` names the Proxmox host as the fleet does (pve_pve1 stays, for files named after
        # it); a user group of that name keeps its meaning.
        if host.name not in fleet.groups:
            groups.setdefault(host.name, ([], {}))[0].extend(name for name, _data in members)
    return groups

