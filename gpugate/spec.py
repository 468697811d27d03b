"""The desired state of one container as ONE value: :class:`Desired` (the port, present or not,
the budgets, the run's options) holding a frozen :class:`Spec` (the server: its validation, the
argv rendered once, here, and the GPUs it will use).

Everything the controller knows about "what should run" comes from here: ``deploy.py``, the
runbooks and the status build the container's Desired once from its host data
(``gpugate.settings.desired_state``, with the defaults of the settings table), the operation takes
it as it is and sends :meth:`Spec.doc` to the container's agent (docs/agent-protocol.md,
``SpecDoc``); the status compares the same Spec with what runs (``gpugate.rules.match``).

Example::

    >>> spec = build_spec("/opt/models/m", 30000, {"tp": 4, "base-gpu-id": 4}, {"HF_TOKEN": "x"}, host="0.0.0.0")
    >>> spec.argv[:9]
    ('/usr/bin/python3', '-m', 'sglang.launch_server', '--model-path', '/opt/models/m', '--host', '0.0.0.0', '--port', '30000')
    >>> spec.gpus
    (4, 5, 6, 7)
    >>> spec.record()["env_names"], spec.record()["flags"]["tp-size"]
    (['HF_TOKEN'], 4)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gpugate.engine import get as engine
from gpugate.rules import gpus as rules_gpus
from gpugate.rules.redact import SECRET_MASK
from gpugate.settings import SETTINGS, SUPERVISORS, resolved

__all__ = ["BUDGET_KEYS", "Desired", "Routing", "routing_of", "desired_state", "desired_states", "Spec", "SpecError",
           "build_spec", "gpu_set", "redact_flags", "budgets"]

# The budgets the agent enforces (docs/agent-protocol.md, "start") -> the setting that gives each.
BUDGET_SETTINGS = {"drain_timeout_s": "drain_timeout_s", "kill_grace_s": "kill_grace_s",
                   "gate_timeout_s": "gpu_gate_timeout_s", "start_timeout_s": "start_timeout_s",
                   "max_used_mib": "gpu_max_used_mib", "generate_timeout_s": "generate_timeout_s"}
BUDGET_KEYS = tuple(BUDGET_SETTINGS)


def _default(key: str) -> Any:
    return SETTINGS[key].default




def resolve_supervisor(requested: str, container: Mapping[str, Any] | None) -> str:
    """``auto`` -> ``systemd`` where the container's PID 1 is systemd (the agent's observe reports
    ``container.pid1``), else ``process``; ``process``/``systemd`` as asked.

    >>> resolve_supervisor("auto", {"pid1": "systemd"}), resolve_supervisor("auto", {"pid1": "init"})
    ('systemd', 'process')
    """
    if requested != "auto":
        return requested
    return "systemd" if (container or {}).get("pid1") == "systemd" else "process"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SpecError(ValueError):
    """The desired server is not valid; raised before anything is touched, with what to fix."""


def redact_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """Flags with the values of secret flags (``--api-key``...) replaced by ``***``, and the whole
    value of a JSON-valued flag whose document has a key naming a secret (``{"hf_token": ...}``).

    >>> redact_flags({"tp-size": 8, "api-key": "sk-1", "model-loader-extra-config": '{"hf_token":"hf_1"}'})
    {'tp-size': 8, 'api-key': '***', 'model-loader-extra-config': '***'}
    """
    return {name: SECRET_MASK if value not in (None, False) and engine().is_secret_value(name, value) else value
            for name, value in flags.items()}


def _int_flag(flags: Mapping[str, Any], name: str, default: int) -> int:
    value = flags.get(name, default)
    if isinstance(value, bool) or value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise SpecError(f"--{name} must be an integer, got {value!r}") from None


def gpu_set(flags: Mapping[str, Any], env: Mapping[str, Any] | None = None) -> tuple[int, ...]:
    """The GPUs (indexes as the container numbers them) a server with these flags and this
    environment uses, as SGLang assigns them: ``tp x pp x dp`` ranks (dp only without
    ``--enable-dp-attention``: with it the DP ranks share the TP GPUs), divided over ``--nnodes``,
    from ``--base-gpu-id`` every ``--gpu-id-step``, then mapped through ``CUDA_VISIBLE_DEVICES``.
    The one rule the agent uses too (gpugate.rules.gpus.gpu_set). ``flags`` in any
    spelling ``validate_flags`` accepts. Raises SpecError when the set cannot be told (a
    ``CUDA_VISIBLE_DEVICES`` too short for the ranks, or of UUIDs).

    >>> gpu_set({"tp": 8})
    (0, 1, 2, 3, 4, 5, 6, 7)
    >>> gpu_set({"tp": 4, "base-gpu-id": 4})
    (4, 5, 6, 7)
    >>> gpu_set({"tp": 2, "dp": 2}), gpu_set({"tp": 2, "dp": 2, "enable-dp-attention": True})
    ((0, 1, 2, 3), (0, 1))
    >>> gpu_set({"tp": 2, "gpu-id-step": 2}, {"CUDA_VISIBLE_DEVICES": "3,4,5,6"})
    (3, 5)
    """
    try:
        normal = engine().validate_flags(flags or {})
    except engine().FlagError as error:
        raise SpecError(str(error)) from None
    try:
        return tuple(rules_gpus.gpu_set(
            tp=_int_flag(normal, "tp-size", 1), pp=_int_flag(normal, "pp-size", 1),
            dp=_int_flag(normal, "dp-size", 1), dp_attention=bool(normal.get("enable-dp-attention")),
            nnodes=_int_flag(normal, "nnodes", 1), base_gpu_id=_int_flag(normal, "base-gpu-id", 0),
            gpu_id_step=_int_flag(normal, "gpu-id-step", 1), visible=(env or {}).get("CUDA_VISIBLE_DEVICES")))
    except rules_gpus.GpuSetError as error:
        raise SpecError(str(error)) from None


def budgets(values: Mapping[str, Any] | None = None) -> dict[str, float]:
    """The agent's budgets (names of BUDGET_KEYS): the settings' defaults overridden by ``values``.

    >>> budgets({"drain_timeout_s": 5})["drain_timeout_s"], budgets()["max_used_mib"]
    (5.0, 64.0)
    """
    given = dict(values or {})
    return {key: float(given[key] if given.get(key) is not None else _default(setting))
            for key, setting in BUDGET_SETTINGS.items()}


def option_items(args: list[str]) -> list[str]:
    """Arguments grouped one option (with its values) per item.

    >>> option_items(["--tp-size", "8", "--disable-radix-cache", "--x", "a", "b"])
    ['--tp-size 8', '--disable-radix-cache', '--x a b']
    """
    out: list[str] = []
    for token in args:
        if token.startswith("--") or not out:
            out.append(token)
        else:
            out[-1] += " " + token
    return out

@dataclasses.dataclass(frozen=True)
class Spec:
    """One desired server, validated (build it with :func:`build_spec`). ``argv`` is the exact
    command, rendered once; ``gpus`` the GPUs it will use (None: cannot be told before the
    container is asked, e.g. ``CUDA_VISIBLE_DEVICES`` of UUIDs: the gate then waits for every GPU)."""

    model_path: str
    port: int
    flags: Mapping[str, Any]        # normalised (canonical names, typed values)
    env: Mapping[str, str]
    host: str = SETTINGS["sglang_host"].default
    supervisor: str = SETTINGS["sglang_supervisor"].default
    python: str = SETTINGS["sglang_python"].default
    extra_args: tuple[str, ...] = ()
    sglang_version: str | None = None
    argv: tuple[str, ...] = ()
    gpus: tuple[int, ...] | None = None
    warnings: tuple[str, ...] = ()
    weight_cache: bool = False            # SGLang's weight-cache daemons hold the weights (docs/weight-cache.md)
    daemon_argv: tuple[str, ...] = ()     # their command, when weight_cache
    gated_launch: bool = False            # the new engine starts before the stop, gated

    def record(self, by: str | None = None) -> dict[str, Any]:
        """What may be shown and stored anywhere: secret flags ``***``, env as names only (the
        agent adds the value hashes), argv redacted.

        >>> build_spec("/m", 30000, {"api-key": "sk-123456"}).record()["argv"][-2:]
        ['--api-key', '***']
        """
        record = {"model_path": self.model_path, "port": self.port, "host": self.host,
                  "flags": redact_flags(self.flags), "env_names": sorted(self.env),
                  "supervisor": self.supervisor, "python": self.python, "argv": engine().redact_argv(list(self.argv)),
                  "gpus": list(self.gpus) if self.gpus is not None else None}
        if self.extra_args:
            record["extra_args"] = engine().redact_argv(list(self.extra_args))
        if self.sglang_version:
            record["sglang_version"] = self.sglang_version
        if self.weight_cache:
            record["weight_cache"] = {"argv": engine().redact_argv(list(self.daemon_argv))}
        if by:
            record["by"] = by
        return record

    def expect_info(self) -> dict[str, Any]:
        """The /get_server_info keys and values this server must report (checked at verify)."""
        # secret values are never expected by value (the failure message would show them); a
        # JSON-text flag is expected as the exact text SGLang keeps (server_info_view)
        secret = {name.replace("-", "_") for name, value in self.flags.items() if engine().is_secret_value(name, value)}
        info = {key: value for key, value in engine().server_info_view(self.flags).items() if key not in secret}
        info["host"] = self.host
        return info

    def secret_flags(self) -> list[str]:
        """Option strings whose values the agent must mask beyond its own list (--api-key,
        --admin-api-key): a JSON-valued flag holding a secret key, ``--ssl-keyfile-password``...
        The SpecDoc's ``secret_flags`` (and observe's, for the running argv).

        >>> build_spec("/m", 30000, {"model-loader-extra-config": {"hf_token": "hf_1"}}).secret_flags()
        ['--model-loader-extra-config']
        """
        return engine().secret_flag_options(self.flags)

    def doc(self, unit_text: str | None = None, by: str | None = None) -> dict[str, Any]:
        """The SpecDoc the agent runs (docs/agent-protocol.md): it holds the env values and the
        exact argv, so it travels only on the hand-off's stdin."""
        doc: dict[str, Any] = {"argv": list(self.argv), "env": dict(self.env), "port": self.port,
                               "gpus": list(self.gpus) if self.gpus is not None else None,
                               "supervisor": self.supervisor, "record": self.record(by),
                               "expect_info": self.expect_info()}
        if self.secret_flags():
            doc["secret_flags"] = self.secret_flags()
        if self.weight_cache:
            doc["weight_cache"] = {"argv": list(self.daemon_argv)}
        if self.gated_launch:
            doc["gated_launch"] = True
        if self.supervisor == "systemd":
            doc["unit_text"] = unit_text or ""
        return doc

    def display_args(self) -> list[str]:
        """The server's arguments after ``-m sglang.launch_server``, one option (with its values)
        per item, secrets ``***``: the lines of a first start's plan."""
        return option_items(engine().redact_argv(list(self.argv))[3:])


# the flags the GPU set is made of (gpu_set)
GPU_SET_FLAGS = ("tp-size", "pp-size", "dp-size", "enable-dp-attention", "nnodes", "base-gpu-id", "gpu-id-step")
SEPARATE_FIELD_TEXT = {"model-path": "set the model as sglang.model_path", "port": "set the port as sglang.port",
                       "host": "set the host as sglang.host"}


def extra_flags(extras: Sequence[str]) -> dict[str, Any]:
    """What SGLang would read from extra_args (they are passed verbatim, after the flags: argparse
    takes the last of a flag given twice); {} when it cannot tell.

    >>> extra_flags(["--tp", "8", "--some-new-flag", "1"]), extra_flags(["--port=31000"])
    ({'tp-size': 8}, {'port': True})
    """
    found: dict[str, Any] = {}
    for token in extras:
        name = token[2:].split("=", 1)[0] if token.startswith("--") else ""
        if name in ("model-path", "model", "port", "host"):
            found["model-path" if name == "model" else name] = True
    try:
        parsed = engine().parse_argv(["python3", "-m", "sglang.launch_server", *extras]) if extras else None
    except ValueError:
        parsed = None
    if parsed is not None:
        found.update((name, value) for name, value in parsed.flags.items() if name in GPU_SET_FLAGS)
    return found


def _one_line(what: str, text: str) -> None:
    if any(c in text for c in "\0\n\r"):
        raise SpecError(f"{what} must be one line (no newline, carriage return or NUL)")


def build_spec(model_path: str | None, port: int = SETTINGS["sglang_port"].default, flags: Mapping[str, Any] | None = None,
               env: Mapping[str, Any] | None = None, *, host: str | None = None, supervisor: str | None = None,
               python: str | None = None, extra_args: Sequence[str] | None = None,
               sglang_version: str | None = None, table: Any = None, weight_cache: bool = False,
               gated_launch: bool | None = None) -> Spec:
    """Validate the desired server completely (no host needed) and render its argv once; raise
    SpecError naming the problem. ``table``: a per-version flag table (gpugate.engine.sglang.flags,
    H3) to validate against instead of the built-in one. ``extra_args``: argv elements passed
    verbatim after the flags, unchecked (a warning says so). ``weight_cache``: the engine maps its
    weights from SGLang's weight-cache daemons (``--weight-cache-mode client``; their command is
    ``daemon_argv``). ``gated_launch``: None (the default) where the release has
    ``--gated-launch-port`` and the supervisor is a process.

    >>> build_spec("/m", 30000, {"tp": 2}).argv[-2:]
    ('--tp-size', '2')
    >>> build_spec("/m", 30000, {"kv-cache-dtype": "fp9"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gpugate.spec.SpecError: --kv-cache-dtype: ...
    """
    host = _default("sglang_host") if host is None else host
    supervisor = _default("sglang_supervisor") if supervisor is None else supervisor
    python = _default("sglang_python") if python is None else python
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise SpecError(f"port must be an integer in 1..65535, got {port!r}")
    if not isinstance(model_path, str) or not model_path.strip():
        raise SpecError("model_path is required (a directory in the container or a repo id)")
    _one_line("model_path", model_path)
    if not isinstance(host, str) or not host.strip() or any(c.isspace() for c in host):
        raise SpecError(f"host must be an address or host name, got {host!r}")
    if supervisor not in SUPERVISORS:
        raise SpecError(f"supervisor must be one of {', '.join(SUPERVISORS)}, got {supervisor!r}")
    if not isinstance(python, str) or not python.startswith("/") or any(c in python for c in "\0\n\r "):
        raise SpecError(f"python must be an absolute path, got {python!r}")
    clean_env: dict[str, str] = {}
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise SpecError(f"env name {name!r} is not a valid variable name")
        if not isinstance(value, str):
            raise SpecError(f"env {name}: the value must be a string, got {type(value).__name__} (quote it)")
        _one_line(f"env {name}", value)
        clean_env[name] = value
    extras = tuple(extra_args or ())
    for item in extras:
        if not isinstance(item, str) or not item:
            raise SpecError(f"extra_args must be a list of non-empty strings, got {item!r}")
        _one_line("an extra_args element", item)
    if sglang_version is not None and (not isinstance(sglang_version, str) or not sglang_version.strip()):
        raise SpecError(f"sglang_version must be a version string, got {sglang_version!r}")
    try:
        # a per-version table (H3's, when given) goes through; the built-in one otherwise
        normal = engine().validate_flags(flags or {}, table)
        normal = _with_weight_cache(normal, weight_cache, extra_args or (), table)
        for name, value in normal.items():
            # argv carries any byte but NUL; a line break would still end a line of the systemd unit
            for text in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(text, str) and any(c in text for c in "\0\n\r"):
                    raise engine().FlagError(name, "value must be one line (no newline, carriage return or NUL)")
        # the header only (model path, host, port: checked there); the flags are rendered from
        # the values validated above, so each flag is validated once
        header = engine().render_argv(model_path, port, {}, host)
    except engine().FlagError as error:
        raise SpecError(str(error)) from None
    argv = (python, *header, *engine().render_flag_args(normal), *extras)
    warnings: list[str] = []
    if extras:
        warnings.append("extra_args passed verbatim, unchecked: " + " ".join(engine().redact_argv(list(extras))))
    # the GPUs the server takes count what extra_args say too (`--tp 8` there is still tp 8 for the
    # gate and the claims); the fields gpugate owns may not hide there
    from_extras = extra_flags(extras)
    hidden = sorted(set(from_extras) & {"model-path", "port", "host"})
    if hidden:
        raise SpecError(f"extra_args sets --{hidden[0]}: {SEPARATE_FIELD_TEXT[hidden[0]]}")
    try:
        gpus: tuple[int, ...] | None = gpu_set(
            {**normal, **{k: v for k, v in from_extras.items() if k in GPU_SET_FLAGS}}, clean_env)
    except SpecError as error:
        if "UUID" not in str(error):
            raise
        gpus = None
        warnings.append(f"{error}; the gate waits for every GPU")
    gated = _gated_launch(gated_launch, supervisor, table, normal)
    daemon = tuple(engine().weight_cache_argv(python, model_path, normal, table)) if weight_cache else ()
    return Spec(model_path=model_path, port=port, flags=dict(normal), env=clean_env, host=host,
                supervisor=supervisor, python=python, extra_args=extras, sglang_version=sglang_version,
                argv=argv, gpus=gpus, warnings=tuple(warnings), weight_cache=bool(weight_cache),
                daemon_argv=daemon, gated_launch=gated)


# SGLang's IPC allowlist (weight_cache/protocol.py IPC_QUANT_ALLOWLIST): unquantized, or block-wise
# FP8; any other method is a hard error of the daemon and the engine
WEIGHT_CACHE_QUANTIZATION = (None, "fp8")


def _with_weight_cache(normal: dict[str, Any], wanted: bool, extras: Sequence[str], table: Any) -> dict[str, Any]:
    """The flags with ``--weight-cache-mode client`` where the weight cache is wanted; FlagError for
    what would make SGLang refuse it, or make the daemons hold other weights than the engine maps."""
    from gpugate.engine.sglang.weight_cache import WEIGHT_FLAGS

    if "weight-cache-mode" in normal:
        raise engine().FlagError("weight-cache-mode", "gpugate sets it: write weight_cache: true (or false) instead")
    if not wanted:
        return normal
    if normal.get("quantization") not in WEIGHT_CACHE_QUANTIZATION:
        raise engine().FlagError("quantization", f"{normal['quantization']!r} cannot use the weight cache (SGLang shares "
                                 f"only unquantized or block-wise fp8 weights over CUDA IPC): set weight_cache: false")
    try:
        parsed = engine().parse_argv(["python3", "-m", "sglang.launch_server", *extras]) if extras else None
    except ValueError:
        parsed = None
    shaping = sorted(set(parsed.flags) & set(WEIGHT_FLAGS)) if parsed is not None else []
    if shaping:
        raise engine().FlagError(shaping[0], "shapes the weights: with weight_cache: true give it in flags, not "
                                 "extra_args (the daemons must get it too)")
    if not engine().supports("weight-cache-mode", table):
        raise engine().FlagError("weight-cache-mode", "this SGLang has no weight cache (0.5.23 and later): set "
                                 "weight_cache: false")
    return {**normal, "weight-cache-mode": "client"}


def _gated_launch(wanted: bool | None, supervisor: str, table: Any, flags: Mapping[str, Any] | None = None) -> bool:
    """Whether the engine is started gated (None: where it can be). Never where the new engine's
    own ports are the old one's: with DP attention on one node SGLang derives its ZMQ ports from
    --port (server_args.py PortArgs, ``port + 233``), and an explicit --nccl-port is fixed, so the
    new engine would wait for the old one's ports and fail."""
    has = engine().supports("gated-launch-port", table)
    flags = flags or {}
    clash = ("--enable-dp-attention" if flags.get("enable-dp-attention") and not flags.get("dist-init-addr")
             else "--nccl-port" if flags.get("nccl-port") else None)
    if wanted is None:
        return has and supervisor != "systemd" and clash is None
    if wanted and clash:
        raise SpecError(f"gated_launch: not with {clash} (the new engine would need the old one's ports while it "
                        f"drains): set gated_launch: false")
    if wanted and not has:
        raise SpecError("gated_launch: this SGLang has no --gated-launch-port (0.5.23 and later): set gated_launch: false")
    if wanted and supervisor == "systemd":
        raise SpecError("gated_launch: not with the systemd supervisor (the unit's command is fixed): use supervisor: "
                        "process, or gated_launch: false")
    return bool(wanted)


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a routed server meets its router (fleet.yaml ``routers:`` and the server's ``router:``,
    ``router_url:``): the transition leaves the router, drains, restarts and rejoins
    (gpugate.router). ``api_key_env`` names the control machine's variable that holds the key;
    the key itself is read when a request is sent, never kept here nor printed.

    >>> r = routing_of({"sglang_router": "gw", "router_endpoint": "http://127.0.0.1:30080",
    ...                 "sglang_router_url": "http://127.0.0.1:31129", "router_kind": "smg",
    ...                 "router_api_key_env": None, "min_serving": 1, "router_register": False})
    >>> r.router, r.worker_url, r.min_serving
    ('gw', 'http://127.0.0.1:31129', 1)
    """

    router: str
    endpoint: str
    worker_url: str
    kind: str = "smg"
    api_key_env: str | None = None
    min_serving: int = 1
    register: bool = False
    join_timeout_s: float = 120.0


def routing_of(values: Mapping[str, Any]) -> Routing | None:
    """The Routing of resolved settings (None: the server is not routed). Raises SpecError when it
    names a router without the router's URL (a ``--data sglang_router=`` that fleet.yaml's
    ``routers:`` does not know) or without its own ``router_url``."""
    name = values.get("sglang_router")
    if not name:
        return None
    if not values.get("router_endpoint"):
        raise SpecError(f"router {name!r}: its URL is not known (name a router of fleet.yaml's routers: section)")
    if not values.get("sglang_router_url"):
        raise SpecError(f"router {name!r}: router_url is missing (the URL the router reaches this server at)")
    return Routing(router=name, endpoint=values["router_endpoint"], worker_url=values["sglang_router_url"],
                   kind=values.get("router_kind") or "smg", api_key_env=values.get("router_api_key_env"),
                   min_serving=int(values.get("min_serving", 1)), register=bool(values.get("router_register")),
                   join_timeout_s=float(values.get("router_join_timeout_s") or 120.0))


@dataclasses.dataclass(frozen=True)
class Desired:
    """One container's desired state, built once from its settings (gpugate.settings.desired_state).
    ``spec`` is the server (None when none should run, or when ``problem`` says why the values make
    none: that container is refused, nothing touched)."""

    port: int
    present: bool
    python: str
    spec: Spec | None
    budgets: Mapping[str, float]
    problem: str | None = None
    flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # as written: re-checked per version
    sglang_version: str | None = None
    min_free_mib: int = SETTINGS["min_free_mib"].default
    agent_silence_s: float = SETTINGS["agent_silence_s"].default
    end_other_gpu_holders: bool = False
    rolling: bool = False
    max_failures: int = SETTINGS["max_failures"].default
    audit_log: str | None = None
    restarted: bool = False
    rollback_to: int = 1
    gated_launch: bool | None = None  # as written (None: where it can be); decided per container's SGLang
    siblings: tuple[int, ...] = ()   # the ports of the container's other desired servers
    routing: Routing | None = None   # behind a router: leave, drain, restart, rejoin

    @property
    def max_used_mib(self) -> int:
        return int(self.budgets["max_used_mib"])

    def observe_args(self) -> dict[str, Any]:
        """What the agent's observe is asked (docs/agent-protocol.md, "observe"): the port, and for
        a desired server the env names whose value hashes it reports, its model path, GPUs and host.
        The deploy and the status ask the same, so they see the same."""
        args: dict[str, Any] = {"port": self.port}
        if self.spec is not None:
            args.update(env_names=sorted(self.spec.env), model_path=self.spec.model_path,
                        gpus=list(self.spec.gpus) if self.spec.gpus is not None else None, host=self.spec.host)
            if self.spec.secret_flags():
                args["secret_flags"] = self.spec.secret_flags()
        return args


def desired_state(data: Any) -> Desired:
    """The container's desired state from its host data (pyinfra's ``host.data`` or any mapping),
    built once: gpugate.settings.SettingsError for a value that cannot be used (the whole run stops
    before any host is touched); a server that the values do not make (no model path, a flag SGLang
    refuses) is the Desired's ``problem``, so that only this container is refused.

    >>> desired = desired_state({"sglang_model_path": "/m", "sglang_flags": {"tp": 2}, "drain_timeout_s": 5})
    >>> desired.spec.argv[-2:], desired.budgets["drain_timeout_s"], desired.present
    (('--tp-size', '2'), 5.0, True)
    >>> desired_state({"sglang_present": "false"}).present, desired_state({}).problem
    (False, 'model_path is required (a directory in the container or a repo id)')
    """
    return _desired(resolved(data))


def desired_states(data: Any) -> list[Desired]:
    """Every desired server of a container: one (desired_state), or each of fleet.yaml's
    ``sglang:`` list (``sglang_servers``), each with the container's other settings and its own
    port, knowing its siblings' ports (a server on a sibling's port is never "the previous one").

    >>> two = {"sglang_servers": [{"sglang_model_path": "/m"}, {"sglang_model_path": "/m", "sglang_port": 30001}]}
    >>> [d.port for d in desired_states(two)], [d.port for d in desired_states({**two, "only_port": 30001})]
    ([30000, 30001], [30001])
    """
    values = resolved(data)
    servers = values["sglang_servers"]
    if not servers:
        desired = [_desired(values)]
    else:
        ports = [int(server.get("sglang_port", values["sglang_port"])) for server in servers]
        desired = [dataclasses.replace(_desired({**values, **server}), siblings=tuple(p for p in ports if p != port))
                   for server, port in zip(servers, ports)]
    only = values["only_port"]  # --data only_port=30001: one server of a container that has several
    return [d for d in desired if only is None or d.port == int(only)]


def _desired(values: Mapping[str, Any]) -> Desired:
    port = int(values["sglang_port"])
    present = bool(values["sglang_present"])
    spec: Spec | None = None
    problem = None
    routing = None
    try:
        routing = routing_of(values)
    except SpecError as error:
        problem = str(error)
    if present and problem is None:
        try:
            spec = build_spec(values["sglang_model_path"], port, values["sglang_flags"], values["sglang_env"],
                              host=values["sglang_host"], supervisor=values["sglang_supervisor"],
                              python=values["sglang_python"], extra_args=values["sglang_extra_args"],
                              sglang_version=values["sglang_version"], weight_cache=bool(values["sglang_weight_cache"]),
                              gated_launch=values["sglang_gated_launch"])
        except SpecError as error:
            problem = str(error)
    return Desired(port=port, present=present, python=values["sglang_python"], spec=spec,
                   budgets=budgets({key: values[setting] for key, setting in BUDGET_SETTINGS.items()}),
                   problem=problem, flags=dict(values["sglang_flags"] or {}),
                   sglang_version=values["sglang_version"], min_free_mib=int(values["min_free_mib"]),
                   agent_silence_s=float(values["agent_silence_s"]),
                   end_other_gpu_holders=bool(values["end_other_gpu_holders"]), rolling=bool(values["rolling"]),
                   max_failures=int(values["max_failures"]), audit_log=values["audit_log"],
                   restarted=bool(values["sglang_restarted"]), rollback_to=int(values["rollback_to"]),
                   gated_launch=values["sglang_gated_launch"],
                   routing=routing)
