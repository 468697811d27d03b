"""Every setting gpugate reads, once: one :class:`Setting` row each in :data:`SETTINGS`.

A row names the host-data key (``--data``, group data, fleet.yaml ``data:``), the key in
fleet.yaml's ``sglang:`` section where the setting belongs to the server, its converter (the one
check for every source), its default and one line of doc. fleet.yaml, group_data/all.py, the
deploy, the runbooks, the @pct connector and ``--data`` validation all read this table; nothing
else holds a default or a converter.

From host data to the desired server: :func:`gpugate.spec.desired_state` checks every value (here)
and builds the container's :class:`gpugate.spec.Desired` once (the operation and the status take
it as it is).

Example::

    >>> validated_settings({"rolling": "no", "drain_timeout_s": 30, "ssh_user": "root"})
    {'drain_timeout_s': 30, 'rolling': False}
    >>> SETTINGS["sglang_host"].fleet_key, SETTINGS["sglang_host"].default
    ('host', '127.0.0.1')

Adding a setting: one row here (with ``fleet_key`` when it may be written in the ``sglang:``
section), plus the field of :class:`gpugate.spec.Desired` or :class:`gpugate.spec.Spec` that
carries it (plus the agent, where it acts on it).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import reprlib
from typing import Any, Callable

from pyinfra.api.exceptions import PyinfraError

from gpugate.engine import DEFAULT_ENGINE
from gpugate.rules.redact import leaf_strings, mask_values

__all__ = ["Setting", "SETTINGS", "SettingsError", "validated_settings", "resolved", "defaults",
           "server_keys", "data_keys", "SUPERVISORS", "to_bool"]

SUPERVISORS = ("process", "systemd", "auto")  # auto: systemd where PID 1 is systemd (gpugate.spec)


class SettingsError(PyinfraError, ValueError):
    """A host data value (``--data``, group data, fleet.yaml ``data:``) that gpugate cannot use:
    ``setting drain_timeout_s='abc': expected a number, got 'abc' (str)``.

    A PyinfraError, so that pyinfra prints the message and no traceback."""

    def __init__(self, key: str, value: Any, problem: str):
        self.key = key
        if key in MAY_HOLD_SECRETS:  # an --api-key in flags, a token in extra_args or env: never shown
            shown = "(not shown: it may hold a secret)"
            problem = mask_values(problem, leaf_strings(value))
        else:
            shown = _SHORT.repr(value)
        self.problem = problem
        super().__init__(f"setting {key}={shown}: {problem}")


# the settings whose values may hold a secret: an error shows neither the value nor any part of it
MAY_HOLD_SECRETS = ("sglang_env", "sglang_flags", "sglang_extra_args", "sglang_servers")


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 2, 4, 4, 80, 80


def describe(value: Any) -> str:
    """A value for an error message, bounded (a YAML alias bomb is a small file and a huge repr)."""
    if value is None:
        return "nothing (null)"
    return f"{_SHORT.repr(value)} ({type(value).__name__})"


def suggest(word: str, choices: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


# ---------------------------------------------------------------- converters (one per kind of value)
_TRUE = ("true", "yes", "1")
_FALSE = ("false", "no", "0")


def to_bool(value: Any) -> bool:
    """true/false/yes/no/1/0 (any case; YAML and pyinfra's --data give bools and ints already).

    >>> to_bool("no"), to_bool(1), to_bool("TRUE")
    (False, True, True)
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"expected true or false (or yes/no, 1/0), got {describe(value)}")


def to_number(value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"expected a number, got {describe(value)}")
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"expected a finite number, got {value}")
    if value < 0:
        raise ValueError(f"must not be negative, got {value}")
    return value


def to_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected a whole number, got {describe(value)}")
    if value < 0:
        raise ValueError(f"must not be negative, got {value}")
    return value


def to_positive_count(value: Any) -> int:
    count = to_count(value)
    if count < 1:
        raise ValueError(f"must be 1 or more, got {count}")
    return count


def to_port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"expected a port number 1..65535, got {describe(value)}")
    return value


def one_line(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected {what}, got {describe(value)}")
    if any(c in value for c in "\x00\n\r"):
        raise ValueError(f"expected {what} on one line (no NUL or line breaks)")
    return value


def to_optional_path(value: Any) -> str | None:
    return None if value is None else one_line(value, "a path")


def to_model_path(value: Any) -> str | None:
    return None if value is None else one_line(value, "a path or Hugging Face repo id")


def to_listen_host(value: Any) -> str:
    text = one_line(value, "an address to listen on")
    if text.startswith("-") or any(c.isspace() for c in text):
        raise ValueError(f"expected an address to listen on, got {describe(value)}")
    return text


_PYTHON3 = re.compile(r"^(python|python3|python3\.\d+|pypy3|pypy3\.\d+)$")


def to_python(value: Any) -> str:
    """The absolute path of a Python 3 interpreter in the container (its name says so: python,
    python3, python3.12, pypy3; ``/bin/sh`` or ``python2`` is refused here, before any SSH).

    >>> to_python("/opt/venv/bin/python3")
    '/opt/venv/bin/python3'
    """
    if not isinstance(value, str) or not value.startswith("/") or any(
            c.isspace() or c == "\x00" for c in value):
        raise ValueError(f"expected the absolute path of a Python 3 interpreter in the container, "
                         f"got {describe(value)}")
    if not _PYTHON3.match(os.path.basename(value)):
        raise ValueError(f"{value} is not a Python 3 interpreter (expected a path ending in python3, "
                         f"python3.N or python, e.g. /usr/bin/python3 or /opt/venv/bin/python)")
    return value


def to_optional_bool(value: Any) -> bool | None:
    """to_bool, or None (unset: the default is decided where it is used).

    >>> to_optional_bool(None), to_optional_bool("yes")
    (None, True)
    """
    return None if value is None else to_bool(value)


def to_engine(value: Any) -> str:
    """An installed engine's name (gpugate.engine: entry point group ``gpugate.engines``).

    >>> to_engine("sglang")
    'sglang'
    """
    from gpugate.engine import names  # noqa: PLC0415 -- the registry is read when an engine is named

    text = str(value).strip().lower() if isinstance(value, str) else value
    installed = names()
    if text not in installed:
        raise ValueError(f"{describe(value)} is not an installed engine (engines: {', '.join(installed)})"
                         + suggest(str(value), installed))
    return str(text)


def to_supervisor(value: Any) -> str:
    if value not in SUPERVISORS:
        raise ValueError(f"expected one of {', '.join(SUPERVISORS)}, got {describe(value)}")
    return value


def to_flags(value: Any) -> dict:
    # the flags themselves are validated by the engine (gpugate.engine), against the release in the
    # container; here only the shape
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping of the engine's flags, got {describe(value)}")
    return dict(value)


ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def env_name(name: Any) -> str:
    if not isinstance(name, str) or not ENV_NAME.match(name):
        raise ValueError(f"{name!r}: environment variable names are letters, digits and _, "
                         "not starting with a digit")
    return name


def env_value(name: str, value: Any, named: bool = True) -> str:
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


def to_env(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping NAME: \"value\", got {type(value).__name__}")
    return {env_name(name): env_value(name, item) for name, item in value.items()}


def to_env_names(value: Any) -> list[str]:
    """A list of environment variable names (``secret_env``).

    >>> to_env_names(["DB_URL"]), to_env_names("DB_URL")
    (['DB_URL'], ['DB_URL'])
    """
    if isinstance(value, str):  # --data sglang_secret_env=DB_URL: one name
        value = [value]
    if not isinstance(value, list):
        raise ValueError(f"expected a list of environment variable names, got {describe(value)}")
    return [env_name(name) for name in value]


_VERSION = re.compile(r"^[0-9]+(\.[0-9]+)*([.+-]?[A-Za-z0-9]+)*$")


def to_version(value: Any) -> str:
    if not isinstance(value, str) or not _VERSION.match(value):
        raise ValueError(f"expected an SGLang version as a quoted string like \"0.5.23\" "
                         f"(unquoted, YAML reads 0.5.10 as a number), got {describe(value)}")
    return value


def to_extra_args(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list of strings (argv items), got {describe(value)}")
    for item in value:
        if not isinstance(item, str):
            raise ValueError(f"expected strings (quote each item), got {describe(item)}")
        if any(c in item for c in "\x00\n\r"):
            raise ValueError("argv items cannot contain NUL or line breaks")
    return list(value)


_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def to_adapters(value: Any) -> dict[str, str] | None:
    """LoRA adapters a server serves, ``{name: path}`` (the engine checks what its release accepts);
    ``{}``: LoRA on, no adapter loaded; None: LoRA off.

    >>> to_adapters({"b": "/opt/models/lab-lora-b", "a": "/opt/models/lab-lora-a"})
    {'a': '/opt/models/lab-lora-a', 'b': '/opt/models/lab-lora-b'}
    >>> to_adapters({"a=b": "/m"})
    Traceback (most recent call last):
    ...
    ValueError: adapter name 'a=b': letters, digits, _ . and -, starting with a letter or digit
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping of adapter name: path, got {describe(value)}")
    adapters = {}
    for name in sorted(value, key=str):
        if not isinstance(name, str) or not _ADAPTER_NAME.match(name):
            raise ValueError(f"adapter name {name!r}: letters, digits, _ . and -, starting with a letter or digit")
        adapters[name] = one_line(value[name], f"the path of adapter {name}")
    return adapters


def to_servers(value: Any) -> list[dict[str, Any]]:
    """Several servers in one container (fleet.yaml's ``sglang:`` as a list): each a mapping of the
    server's settings by their host-data keys, each on its own port."""
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise ValueError(f"expected a list of servers (mappings of sglang_* settings), got {describe(value)}")
    servers = []
    for item in value:
        # a router's canary travels with the servers behind it (gpugate.fleet.Router.host_data)
        unknown = [key for key in item if key not in SETTINGS or key == "sglang_servers" or not (
            SETTINGS[key].scope in ("server", "fleet") or SETTINGS[key].fleet_key or key == "canary")]
        if unknown:
            why = f"no longer a setting: {REMOVED[unknown[0]]}" if unknown[0] in REMOVED else "is no setting of one server"
            raise ValueError(f"{unknown[0]!r} {why}")
        servers.append(validated_settings(item))
    ports = [server.get("sglang_port", SETTINGS["sglang_port"].default) for server in servers]
    if len(set(ports)) != len(ports):
        raise ValueError(f"two servers of one container on one port ({', '.join(map(str, ports))}): give each its own")
    return servers


def to_rank(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected 1 (the newest), 2, ..., got {describe(value)}")
    return value


def to_format(value: Any) -> str:
    if value not in ("table", "json"):
        raise ValueError(f"expected table or json, got {describe(value)}")
    return value


def to_text(value: Any) -> str:
    return one_line(value, "a string")


_ROUTER_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


def to_router_name(value: Any) -> str:
    """A router's name in fleet.yaml's ``routers:`` section.

    >>> to_router_name("gw")
    'gw'
    """
    if not isinstance(value, str) or not _ROUTER_NAME.match(value):
        raise ValueError(f"expected a router's name from the routers: section (letters, digits, _ and -), "
                         f"got {describe(value)}")
    return value


def to_http_url(value: Any) -> str:
    """An ``http://host:port`` URL (no path, no credentials: a key travels in a header, from env).

    >>> to_http_url("http://127.0.0.1:31129/")
    'http://127.0.0.1:31129'
    """
    text = one_line(value, "an http:// URL")
    match = re.match(r"^(https?)://([A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\])(:([0-9]{1,5}))?/?$", text)
    if not match or (match.group(4) and not 1 <= int(match.group(4)) <= 65535):
        raise ValueError(f"expected an URL like http://10.0.0.5:30000 (scheme, host, port; no path or "
                         f"user:password@), got {describe(value)}")
    return text.rstrip("/")


def to_env_name(value: Any) -> str:
    return env_name(one_line(value, "an environment variable name"))


# The canary's keys (docs/canary.md): the default of each and why in one line. Thresholds are relative
# to the unchanged replicas measured over the same window, so they hold for any model and load.
CANARY_DEFAULTS: dict[str, Any] = {
    "soak_s": 120.0,               # two minutes: several p95 windows at a few requests per second
    "min_requests": 100,           # per side: below it a p95 is the 5th-slowest request or worse
    "ttft_p95_ratio": 1.25,        # the canary's p95 time to first token at most 1.25x the others'
    "itl_p95_ratio": 1.25,         # the same for inter-token latency
    "error_ratio_points": 0.5,     # failed or aborted requests: at most 0.5 percentage points above
    "throughput_ratio": 0.8,       # tokens/s per running request at least 0.8x the others'
    "preemption_ratio_points": 1.0,  # preempted or retracted requests: at most 1 point above
    "proceed_on_low_traffic": False,  # too few requests for a verdict: roll the canary back and stop
}
_CANARY_OFF = ("off", "false", "no", "0", "")
_CANARY_ON = ("on", "true", "yes", "1")


def _canary_value(key: str, value: Any) -> Any:
    """One key of the canary, by the kind of its default."""
    default = CANARY_DEFAULTS[key]
    if isinstance(default, bool):
        return to_bool(value)
    if isinstance(value, str):  # --data canary=soak_s=5: numbers arrive as text
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    if isinstance(default, int):
        count = to_count(value)
        if key == "min_requests" and count < 1:  # 0 passed a soak that served nothing, judged on nothing
            raise ValueError(f"at least 1 request a side (a verdict on none judges nothing), got {value}")
        return count
    number = float(to_number(value))
    if key.endswith("_ratio") and key != "throughput_ratio" and number < 1:
        raise ValueError(f"a ratio to the unchanged replicas, 1 or more (1.25: at most 25% worse), got {value}")
    if key == "throughput_ratio" and not 0 < number <= 1:
        raise ValueError(f"a share of the unchanged replicas' figure, over 0 and at most 1 (0.8), got {value}")
    if key == "soak_s" and not 0 < number <= 86400:  # the run waits it out: 1e9 is a typo, not a soak
        raise ValueError(f"must be more than 0 seconds and at most a day (86400), got {value}")
    return number


def to_canary(value: Any) -> dict[str, Any] | None:
    """The canary of a rolling change behind a router (docs/canary.md): None (off), or every key of
    :data:`CANARY_DEFAULTS` with the given ones over the defaults. Written as a mapping (fleet.yaml),
    ``true``/``on`` (the defaults), ``false``/``off``, or ``--data canary=soak_s=5,min_requests=20``.

    >>> to_canary({"soak_s": 30})["soak_s"], to_canary("off"), to_canary("min_requests=20")["min_requests"]
    (30.0, None, 20)
    >>> to_canary({"soak": 30})
    Traceback (most recent call last):
    ...
    ValueError: canary.soak: unknown key (did you mean soak_s?); keys: soak_s, min_requests, ttft_p95_ratio, itl_p95_ratio, error_ratio_points, throughput_ratio, preemption_ratio_points, proceed_on_low_traffic
    """
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in _CANARY_OFF):
        return None
    if value is True or (isinstance(value, str) and value.strip().lower() in _CANARY_ON):
        value = {}
    if isinstance(value, str):
        pairs = [item.split("=", 1) for item in value.split(",") if item.strip()]
        if any(len(pair) != 2 for pair in pairs):
            raise ValueError("expected on, off, or key=value pairs separated by commas (soak_s=60,min_requests=50)")
        value = {key.strip(): item.strip() for key, item in pairs}
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping of canary keys (soak_s, min_requests, ...), on or off, "
                         f"got {describe(value)}")
    canary = dict(CANARY_DEFAULTS)
    for key in sorted(value, key=str):
        if key not in CANARY_DEFAULTS:
            raise ValueError(f"canary.{key}: unknown key{suggest(str(key), tuple(CANARY_DEFAULTS))}; keys: "
                             + ", ".join(CANARY_DEFAULTS))
        try:
            canary[key] = _canary_value(key, value[key])
        except ValueError as error:
            raise ValueError(f"canary.{key}: {error}") from None
    return canary


# ---------------------------------------------------------------- the table
# Where a setting may be written. server: the container's sglang: section of fleet.yaml (its
# fleet_key) or --data under its host-data key, never a data: section (the section validates it as
# part of the server); data: also data: sections of fleet.yaml and group data; run: --data of one
# run only (a runbook's choice, a one-off restart); fleet: set by the fleet file itself.
SCOPES = ("server", "data", "run", "fleet")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting: where it is written, how it is checked, its default, what it means."""

    key: str                          # host-data key: --data KEY=..., group data, fleet.yaml data:
    convert: Callable[[Any], Any]     # the one check (ValueError naming the problem), for every source
    default: Any
    doc: str
    scope: str = "data"               # see SCOPES
    fleet_key: str | None = None      # the key in fleet.yaml's sglang: section (server settings)


def _rows(*rows: Setting) -> dict[str, Setting]:
    return {row.key: row for row in rows}


SETTINGS: dict[str, Setting] = _rows(
    # --- the server (fleet.yaml's sglang: section) ---
    Setting("engine", to_engine, DEFAULT_ENGINE, "the inference engine that runs this server (gpugate.engine: an "
            "installed engine's name)", "server", "engine"),
    Setting("sglang_model_path", to_model_path, None,
            "the model path or Hugging Face repo id (required when present)", "server", "model_path"),
    Setting("sglang_port", to_port, 30000, "the server's port (in fleet.yaml: its engine's own default when not written)",
            "server", "port"),
    Setting("sglang_host", to_listen_host, "127.0.0.1",
            "--host: the address the server listens on inside the container", "server", "host"),
    Setting("sglang_flags", to_flags, {}, "SGLang flags as data (validated against the container's SGLang)",
            "server", "flags"),
    Setting("sglang_env", to_env, {}, "the server's environment (file mode 0600; the values of secret names "
            "never printed, the others shown: docs/transition.md, Secrets)", "server", "env"),
    Setting("sglang_secret_env", to_env_names, [], "env names whose values are secrets besides those the "
            "pattern list names (TOKEN, KEY, SECRET, PASSWORD, ...): masked everywhere", "server", "secret_env"),
    Setting("sglang_present", to_bool, True, "false: no server on this port (stopped, its GPUs swept)",
            "server", "present"),
    Setting("sglang_supervisor", to_supervisor, "auto",
            "auto: systemd where the container's PID 1 is systemd, else process; or name one", "server",
            "supervisor"),
    Setting("sglang_python", to_python, "/usr/bin/python3",
            "the interpreter in the container that runs the server (its engine's module)", "server", "python"),
    Setting("sglang_version", to_version, None,
            "the SGLang release the container must have (its flag table); quoted", "server", "sglang_version"),
    Setting("sglang_extra_args", to_extra_args, [], "argv items passed through as written, unchecked",
            "server", "extra_args"),
    Setting("sglang_lora_adapters", to_adapters, None,
            "LoRA adapters the server serves, {name: path}: loaded and unloaded live where the engine can "
            "(docs/live-changes.md); {} keeps LoRA on with none loaded", "server", "lora_adapters"),
    Setting("sglang_weight_cache", to_bool, False,
            "true: SGLang's weight-cache daemons hold the weights across restarts (docs/weight-cache.md)",
            "server", "weight_cache"),
    Setting("sglang_gated_launch", to_optional_bool, None,
            "start the new engine before the stop, gated until the GPUs are free (default: where the "
            "engine's release has a gated launch and the supervisor is process)", "server", "gated_launch"),
    Setting("sglang_servers", to_servers, [],
            "several servers in one container: fleet.yaml's sglang: as a list, each on its own port", "fleet"),
    # --- the gateway in front of the server (fleet.yaml routers:, docs/transition.md "Routed") ---
    Setting("sglang_router", to_router_name, None,
            "the router (fleet.yaml routers:) that sends this server its requests", "server", "router"),
    Setting("sglang_router_url", to_http_url, None,
            "the URL the router reaches this server at (its worker URL there)", "server", "router_url"),
    Setting("sglang_router_cordon", to_bool, False,
            "true: keep this server out of its router (maintenance): the deploy takes it out (leave, drain) and "
            "keeps it out; false: it is added once it serves and is verified", "server", "router_cordon"),
    Setting("router_endpoint", to_http_url, None, "the router's own URL (from fleet.yaml routers:)", "fleet"),
    Setting("router_kind", to_text, "smg", "the router's kind (from fleet.yaml routers:; smg only)", "fleet"),
    Setting("router_api_key_env", to_env_name, None,
            "the environment variable on the control machine that holds the router's API key", "fleet"),
    Setting("min_serving", to_count, 1,
            "a routed server leaves its router only when this many other healthy workers of its model stay"),
    Setting("canary", to_canary, None,
            "a rolling change behind a router soaks its first replica under traffic and judges it against the "
            "unchanged ones from the engine's /metrics; a regression rolls it back and stops (docs/canary.md). "
            "Off by default; fleet.yaml top level or a router's entry"),
    Setting("router_join_timeout_s", to_number, 120.0,
            "after the verify: until the server is /ready and its router lists it healthy again"),
    # --- the GPU gate (this server's GPUs only) ---
    Setting("gpu_max_used_mib", to_count, 64, "a GPU counts as free at or under this many MiB used (NVML v2)"),
    Setting("gpu_gate_timeout_s", to_number, 120.0, "how long the gate waits for the server's GPUs after the stop"),
    # --- the transition (run to its end by the agent in the container) ---
    Setting("drain_timeout_s", to_number, 60.0,
            "SGLang's SIGTERM drain has no deadline: this is ours, then SIGKILL", "data", "drain_timeout_s"),
    Setting("kill_grace_s", to_number, 10.0, "after SIGKILL of the server's tree: how long it may take to vanish"),
    Setting("start_timeout_s", to_number, 2700.0,
            "until healthy and generating (45 min: a cold TP8 load with CUDA graphs)"),
    Setting("generate_timeout_s", to_number, 30.0, "the first real generation after /health turns 200"),
    Setting("agent_silence_s", to_number, 30.0,
            "the container's agent writes its journal at least every 1.5 s in every long phase: silent longer "
            "than this, it is stuck (the controller says so and stops following; nothing is touched)"),
    Setting("min_free_mib", to_count, 64, "free MiB the log and state dirs need, checked before the stop"),
    Setting("end_other_gpu_holders", to_bool, False,
            "true: the agent may end other processes with memory on this server's GPUs"),
    Setting("rolling", to_bool, False, "true: one container at a time; the rest keep serving"),
    Setting("max_failures", to_count, 0, "rolling: stop after more failed containers than this"),
    Setting("audit_log", to_optional_path, None,
            "audit file on the control machine; None: $GPUGATE_AUDIT_LOG or ./audit.jsonl"),
    # --- the @pct connector (gpugate.connectors.pct) ---
    Setting("pct_binary", to_text, "pct", "the pct command on the Proxmox host"),
    Setting("pct_sudo", to_bool, None,
            "run pct with `sudo -n` on the host (default: when ssh_user is set and not root)"),
    Setting("pct_clear_env", to_bool, True,
            "give commands the container's own environment (`env -i PATH=...`), not pct's PATH and "
            "the SSH session's variables"),
    Setting("pct_ssh_share", to_positive_count, 4,
            "how many containers of one Proxmox host share one SSH connection in a run "
            "(1: one connection per container)"),
    Setting("pct_connect_check", to_bool, True,
            "check at connect that the container runs (one `pct list` per Proxmox host); false: the first "
            "command's own pct error says it, with the same message (a run of deploy.py alone: its "
            "sglang.server reports a stopped or missing container as a failed connect does)"),
    # --- one run's choices (--data on the command line) ---
    Setting("sglang_restarted", to_bool, False, "restart even when the desired spec already serves", "run"),
    Setting("only_port", to_port, None, "only the desired server(s) on this port (one server of a container that "
            "has several: a restart, a rollback, a deploy)", "run"),
    Setting("rollback_to", to_rank, 1, "the rollback runbook: the k-th newest good spec (1 = newest)", "run"),
    Setting("format", to_format, "table", "the status runbook: table or json", "run"),
    Setting("prom", to_optional_path, None, "the status runbook: also write a Prometheus textfile here", "run"),
    # --- set by the fleet file ---
    Setting("pve_host", to_text, None, "the Proxmox host's name in fleet.yaml", "fleet"),
)

# Settings that are no more (accepted and never read, or made needless by what gpugate now does
# itself): refused with why, so a fleet or a command line that sets one learns it does nothing (and
# what to do instead) rather than meeting "unknown setting".
REMOVED = {
    "health_poll_s": "it was accepted but never read (the container's agent polls the server every 50 ms); "
                     "remove it",
    "lock_wait_s": "it was accepted but never read (a deploy that finds a transition running follows it); "
                   "remove it",
    "router_register": "a server declared behind a router is added to it once it serves and is verified, "
                       "without being asked (issue 32 item 8); to keep one out, declare router_cordon: true "
                       "(--data sglang_router_cordon=true); remove it",
}

# Keys that are no setting of gpugate's but are fine in host data: the @pct connector's (set from
# the host name) and pyinfra's own (ssh_*, global arguments as _sudo, ...).
PASSTHROUGH = ("pct_vmid", "pct_local")
SSH_SETTINGS = (
    "hostname", "port", "user", "password", "key", "key_password", "allow_agent", "look_for_keys",
    "forward_agent", "config_file", "known_hosts_file", "strict_host_key_checking",
    "paramiko_connect_kwargs", "connect_retries", "connect_retry_min_delay",
    "connect_retry_max_delay", "file_transfer_protocol",
)


def defaults(scope: str | None = None) -> dict[str, Any]:
    """Host-data key -> default, of every row (or of one scope): what group_data/all.py exposes.

    >>> defaults("server")["sglang_port"], defaults()["drain_timeout_s"]
    (30000, 60.0)
    """
    return {row.key: _copy(row.default) for row in SETTINGS.values() if scope is None or row.scope == scope}


def _copy(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else value


def server_keys() -> dict[str, Setting]:
    """fleet.yaml sglang: key -> row (the keys the sglang: section accepts)."""
    return {row.fleet_key: row for row in SETTINGS.values() if row.fleet_key}


def data_keys() -> tuple[str, ...]:
    """The settings a fleet.yaml (or group) ``data:`` section accepts."""
    return tuple(row.key for row in SETTINGS.values() if row.scope == "data")


def validated_settings(data: Any) -> dict[str, Any]:
    """The host data gpugate reads, checked and normalised: the same rules as fleet.yaml for every
    source (``--data``, group data, fleet.yaml). Booleans come from true/false/yes/no/1/0 only
    (pyinfra's ``--data rolling=no`` is the string "no", which Python would call true); numbers
    must be numbers; an unknown key is refused with a did-you-mean. Raises SettingsError.

    ``data`` is pyinfra's ``host.data`` (or any mapping). Returns only the keys that are set;
    :func:`resolved` applies the defaults.

    >>> validated_settings({"drain_timout_s": 30})
    Traceback (most recent call last):
    ...
    gpugate.settings.SettingsError: setting drain_timout_s=30: unknown setting (did you mean drain_timeout_s?)
    """
    items = data.dict() if callable(getattr(data, "dict", None)) else dict(data)
    known = tuple(SETTINGS) + PASSTHROUGH + tuple(f"ssh_{name}" for name in SSH_SETTINGS)
    settings: dict[str, Any] = {}
    for key in sorted(items, key=str):
        value = items[key]
        if not isinstance(key, str):
            raise SettingsError(str(key), value, "setting names are strings")
        if key.startswith("_"):
            continue  # pyinfra's global arguments given as data (_sudo, _su_user, ...)
        if key in REMOVED:
            raise SettingsError(key, value, f"no longer a setting: {REMOVED[key]}")
        if key not in known:
            raise SettingsError(key, value, f"unknown setting{suggest(key, known)}")
        if key in SETTINGS and not (value is None and SETTINGS[key].default is None):
            try:
                settings[key] = SETTINGS[key].convert(value)
            except ValueError as error:
                raise SettingsError(key, value, str(error)) from None
    return settings


def resolved(data: Any) -> dict[str, Any]:
    """Every setting: the checked value where one is set, else the row's default."""
    given = validated_settings(data)
    return {key: given[key] if key in given else _copy(row.default) for key, row in SETTINGS.items()}
