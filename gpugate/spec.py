"""The desired state of one container as ONE value: :class:`Desired` (the port, present or not,
the budgets, the run's options) holding a frozen :class:`Spec` (the server: the operator's
engine-neutral :class:`gpugate.engine.ServerInputs`, and the engine's :class:`gpugate.engine.Launch`
made of them once per flag table: the argv, the GPUs it will use, what it must report).

Everything the controller knows about "what should run" comes from here: ``deploy.py``, the
runbooks and the status build the container's Desired once from its host data
(:func:`desired_states`, with the defaults of the settings table), the operation takes it as it is
and sends :meth:`Spec.doc` to the container's agent (docs/agent-protocol.md, ``SpecDoc``); the
status compares the same Spec with what runs (``gpugate.match.compare``).

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
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gpugate.engine import DEFAULT_ENGINE, FlagError, Launch, LiveState, ServerInputs, get as engine
from gpugate.settings import SETTINGS, SUPERVISORS, resolved

__all__ = ["BUDGET_KEYS", "Desired", "Routing", "routing_of", "desired_state", "desired_states", "Spec", "SpecError",
           "build_spec", "gpu_set", "budgets"]

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


def gpu_set(flags: Mapping[str, Any], env: Mapping[str, Any] | None = None, extra_args: Sequence[str] = (),
            engine_name: str = DEFAULT_ENGINE) -> tuple[int, ...]:
    """The GPUs (indexes as the container numbers them) a server with these flags, this
    environment and these extra_args uses, by the engine's own rule (its launch). Raises SpecError
    when the set cannot be told (a ``CUDA_VISIBLE_DEVICES`` too short for the ranks, or of UUIDs).

    >>> gpu_set({"tp": 8})
    (0, 1, 2, 3, 4, 5, 6, 7)
    >>> gpu_set({"tp": 4, "base-gpu-id": 4}), gpu_set({"tp": 2}, extra_args=["--tp", "4"])
    ((4, 5, 6, 7), (0, 1, 2, 3))
    """
    spec = build_spec("/gpu-set", 30000, flags, env, extra_args=extra_args, engine_name=engine_name)
    if spec.gpus is None:
        raise SpecError("; ".join(spec.warnings) or "the GPU set cannot be told")
    return spec.gpus


def budgets(values: Mapping[str, Any] | None = None) -> dict[str, float]:
    """The agent's budgets (names of BUDGET_KEYS): the settings' defaults overridden by ``values``.

    >>> budgets({"drain_timeout_s": 5})["drain_timeout_s"], budgets()["max_used_mib"]
    (5.0, 64.0)
    """
    given = dict(values or {})
    return {key: float(given[key] if given.get(key) is not None else _default(setting))
            for key, setting in BUDGET_SETTINGS.items()}


def option_items(args: Sequence[str]) -> list[str]:
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
    """One desired server, validated (build it with :func:`build_spec`): the operator's
    engine-neutral ``inputs`` and the engine's ``launch`` made of them (the argv rendered once, the
    GPUs it will use: None when they cannot be told before the container is asked, e.g.
    ``CUDA_VISIBLE_DEVICES`` of UUIDs: the gate then waits for every GPU)."""

    inputs: ServerInputs
    launch: Launch
    table: Any = dataclasses.field(default=None, compare=False, repr=False)  # the flag table the launch was made against

    # what the rest of gpugate reads, by the names it always had
    engine = property(lambda self: self.inputs.engine)
    model_path = property(lambda self: self.inputs.model_path)
    port = property(lambda self: self.inputs.port)
    # the operator's env, and what the engine sets for its launch (vLLM's runtime LoRA switch)
    env = property(lambda self: {**self.inputs.env, **self.launch.env} if self.launch.env else self.inputs.env)
    secret_env = property(lambda self: self.inputs.secret_env)  # the operator's secret env names
    host = property(lambda self: self.inputs.host)
    supervisor = property(lambda self: self.inputs.supervisor)
    python = property(lambda self: self.inputs.python)
    extra_args = property(lambda self: self.inputs.extra_args)
    sglang_version = property(lambda self: self.inputs.version)  # the pinned release (setting sglang_version)
    weight_cache = property(lambda self: self.inputs.weight_cache)  # the weights held across engine restarts
    lora_adapters = property(lambda self: self.inputs.lora_adapters)  # {name: path}; None: LoRA off
    flags = property(lambda self: self.launch.flags)  # normalised (canonical names, typed values)
    argv = property(lambda self: self.launch.argv)
    gpus = property(lambda self: self.launch.gpus)
    warnings = property(lambda self: self.launch.warnings)
    daemon_argv = property(lambda self: self.launch.daemon_argv)  # the weight cache's daemons
    gated_launch = property(lambda self: self.launch.gated)  # the new engine starts before the stop, gated

    @property
    def live(self) -> LiveState:
        """What the engine may change while this server serves (docs/live-changes.md)."""
        return LiveState(self.model_path, self.lora_adapters)

    def with_live(self, live: LiveState) -> Spec:
        """The same launch as it would be with another live state (the model path and adapters a
        running server was started with): what :func:`gpugate.match.compare` holds against the
        running command, so that a server changed live is not "another command".

        >>> build_spec("/m2", 30000, {}, lora_adapters={"b": "/b"}).with_live(LiveState("/m", {"a": "/a"})).argv[3:5]
        ('--model-path', '/m')
        """
        if live == self.live:
            return self
        inputs = dataclasses.replace(self.inputs, model_path=live.model_path or self.model_path,
                                     lora_adapters=live.lora_adapters)
        try:
            return dataclasses.replace(self, inputs=inputs, launch=engine(self.engine).launch(inputs, self.table))
        except FlagError:  # that live state makes no launch of this spec's: it is no such server
            return self

    def with_supervisor(self, supervisor: str) -> Spec:
        """The same server under another supervisor (``auto`` resolved for a container)."""
        return dataclasses.replace(self, inputs=dataclasses.replace(self.inputs, supervisor=supervisor))

    def record(self, by: str | None = None) -> dict[str, Any]:
        """What may be shown and stored anywhere: secret flags ``***``, env as names only (the
        agent adds the value hashes, and the values that are no secret), argv redacted.

        >>> build_spec("/m", 30000, {"api-key": "sk-123456"}).record()["argv"][-2:]
        ['--api-key', '***']
        """
        launch = self.launch
        record: dict[str, Any] = {"model_path": self.model_path, "port": self.port, "host": self.host,
                                  "flags": dict(launch.shown_flags), "env_names": sorted(self.env),
                                  "supervisor": self.supervisor, "python": self.python, "argv": list(launch.shown_argv),
                                  "gpus": list(self.gpus) if self.gpus is not None else None}
        if self.engine != DEFAULT_ENGINE:
            record["engine"] = self.engine
        if self.extra_args:
            record["extra_args"] = engine(self.engine).redact_argv(list(self.extra_args))
        if self.sglang_version:
            record["sglang_version"] = self.sglang_version
        if self.weight_cache:
            record["weight_cache"] = {"argv": engine(self.engine).redact_argv(list(self.daemon_argv))}
        if self.lora_adapters is not None:
            record["lora_adapters"] = dict(self.lora_adapters)
        if by:
            record["by"] = by
        return record

    def expect_info(self) -> dict[str, Any]:
        """The info document's keys and values this server must report (checked at verify)."""
        return dict(self.launch.expect_info)

    def secret_flags(self) -> list[str]:
        """Option strings whose values the agent must mask beyond its own list (--api-key,
        --admin-api-key): a JSON-valued flag holding a secret key, ``--ssl-keyfile-password``...
        The SpecDoc's ``secret_flags`` (and observe's, for the running argv).

        >>> build_spec("/m", 30000, {"model-loader-extra-config": {"hf_token": "hf_1"}}).secret_flags()
        ['--model-loader-extra-config']
        """
        return list(self.launch.secret_options)

    def doc(self, unit_text: str | None = None, by: str | None = None) -> dict[str, Any]:
        """The SpecDoc the agent runs (docs/agent-protocol.md): it holds the env values and the
        exact argv, so it travels only on the hand-off's stdin."""
        doc: dict[str, Any] = {"argv": list(self.argv), "env": dict(self.env), "port": self.port,
                               "gpus": list(self.gpus) if self.gpus is not None else None,
                               "supervisor": self.supervisor, "record": self.record(by),
                               "expect_info": self.expect_info()}
        if self.secret_flags():
            doc["secret_flags"] = self.secret_flags()
        if self.secret_env:
            doc["secret_env"] = list(self.secret_env)
        if self.engine != DEFAULT_ENGINE:
            doc["engine"] = self.engine
        if self.weight_cache:
            doc["weight_cache"] = {"argv": list(self.daemon_argv)}
        if self.gated_launch:
            doc["gated_launch"] = True
        if self.supervisor == "systemd":
            doc["unit_text"] = unit_text or ""
        return doc

    def display_args(self) -> list[str]:
        """The server's own arguments (after the interpreter and the engine's entry point), one
        option (with its values) per item, secrets ``***``: the lines of a first start's plan."""
        return option_items(self.launch.shown_argv[self.launch.args_start:])


def _one_line(what: str, text: str) -> None:
    if any(c in text for c in "\0\n\r"):
        raise SpecError(f"{what} must be one line (no newline, carriage return or NUL)")


def build_spec(model_path: str | None, port: int = SETTINGS["sglang_port"].default, flags: Mapping[str, Any] | None = None,
               env: Mapping[str, Any] | None = None, *, host: str | None = None, supervisor: str | None = None,
               python: str | None = None, extra_args: Sequence[str] | None = None,
               sglang_version: str | None = None, table: Any = None, weight_cache: bool = False,
               gated_launch: bool | None = None, engine_name: str = DEFAULT_ENGINE, secret_env: Sequence[str] = (),
               drain_timeout_s: float | None = None, lora_adapters: Mapping[str, str] | None = None,
               metrics: bool = False) -> Spec:
    """Validate the desired server completely (no host needed) and have the engine make its
    launch, once; raise SpecError naming the problem. What is no engine's business (port, model
    path, host, supervisor, interpreter, env, extra_args as text) is checked here; the flags, the
    GPU set, the weight cache and the gated launch by the engine (gpugate.engine.Engine.launch).
    ``table``: the engine's flag table of the release that will run (None: its default).
    ``extra_args``: argv elements passed verbatim after the flags, unchecked (a warning says so).
    ``secret_env``: env names whose values are secrets besides those the pattern list names
    (gpugate.rules.redact.names_a_secret). ``metrics``: the server must serve its engine's
    /metrics (a canary judges it: docs/canary.md).

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
    for name in secret_env or ():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise SpecError(f"secret_env: {name!r} is not a valid variable name")
    extras = tuple(extra_args or ())
    for item in extras:
        if not isinstance(item, str) or not item:
            raise SpecError(f"extra_args must be a list of non-empty strings, got {item!r}")
        _one_line("an extra_args element", item)
    if lora_adapters is not None:
        if not isinstance(lora_adapters, Mapping):
            raise SpecError(f"lora_adapters must be a mapping of name: path, got {type(lora_adapters).__name__}")
        for name, path in lora_adapters.items():
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path.strip():
                raise SpecError(f"lora_adapters: {name!r}: a name and a path (strings) each")
            _one_line(f"lora_adapters {name}", path)
        lora_adapters = dict(sorted(lora_adapters.items()))
    if sglang_version is not None and (not isinstance(sglang_version, str) or not sglang_version.strip()):
        raise SpecError(f"sglang_version must be a version string, got {sglang_version!r}")
    inputs = ServerInputs(engine=engine_name, model_path=model_path, port=port, flags=dict(flags or {}), env=clean_env,
                          host=host, supervisor=supervisor, python=python, extra_args=extras, version=sglang_version,
                          weight_cache=bool(weight_cache), gated_launch=gated_launch,
                          secret_env=tuple(secret_env or ()), lora_adapters=lora_adapters, metrics=bool(metrics),
                          drain_timeout_s=float(SETTINGS["drain_timeout_s"].default if drain_timeout_s is None
                                                else drain_timeout_s))
    try:
        serving = engine(engine_name)
    except KeyError as error:  # EngineError too: a broken plug-in refuses its own servers only
        raise SpecError(str(error).strip('"')) from None
    if weight_cache and not serving.has_weight_cache:
        raise SpecError(f"weight_cache: {serving.label} has no weight cache: set weight_cache: false")
    if gated_launch and not serving.gated_option:
        raise SpecError(f"gated_launch: {serving.label} has no gated launch: set gated_launch: false")
    try:
        return Spec(inputs=inputs, launch=serving.launch(inputs, table), table=table)
    except FlagError as error:
        raise SpecError(str(error)) from None


def for_version(spec: Spec, table: Any) -> Spec:
    """The same server made against another flag table (the release the container has): its
    launch again, from the same inputs; SpecError for what that release refuses."""
    known = _FOR_VERSION.get((id(spec), id(table)))
    if known is not None and known[0] is spec and known[1] is table:
        return known[2]  # pyinfra runs an operation's body twice without -y: the same launch, once
    try:
        made = dataclasses.replace(spec, launch=engine(spec.engine).launch(spec.inputs, table), table=table)
    except FlagError as error:
        raise SpecError(str(error)) from None
    _FOR_VERSION[(id(spec), id(table))] = (spec, table, made)  # the objects kept: their ids stay theirs
    while len(_FOR_VERSION) > 4096:
        _FOR_VERSION.pop(next(iter(_FOR_VERSION)))
    return made


_FOR_VERSION: dict[tuple[int, int], tuple[Spec, Any, Spec]] = {}


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a routed server meets its router (fleet.yaml ``routers:`` and the server's ``router:``,
    ``router_url:``): the transition leaves the router, drains, restarts and rejoins
    (gpugate.router). ``api_key_env`` names the control machine's variable that holds the key;
    the key itself is read when a request is sent, never kept here nor printed. ``cordon``
    (``router_cordon: true``): declared OUT of the router; else a member, added once it serves.

    >>> r = routing_of({"sglang_router": "gw", "router_endpoint": "http://127.0.0.1:30080",
    ...                 "sglang_router_url": "http://127.0.0.1:31129", "router_kind": "smg",
    ...                 "router_api_key_env": None, "min_serving": 1, "sglang_router_cordon": False})
    >>> r.router, r.worker_url, r.min_serving, r.cordon
    ('gw', 'http://127.0.0.1:31129', 1, False)
    """

    router: str
    endpoint: str
    worker_url: str
    kind: str = "smg"
    api_key_env: str | None = None
    min_serving: int = 1
    cordon: bool = False
    join_timeout_s: float = 120.0
    # the server's engine (its readiness, in-flight gauges and smg runtime): not part of what the routing is
    engine: str = dataclasses.field(default=DEFAULT_ENGINE, compare=False)
    # the canary of a rolling change behind this router (gpugate.settings.to_canary; None: off): docs/canary.md
    canary: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)


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
                   min_serving=int(values.get("min_serving", 1)), cordon=bool(values.get("sglang_router_cordon")),
                   join_timeout_s=float(values.get("router_join_timeout_s") or 120.0),
                   engine=engine(values.get("engine") or DEFAULT_ENGINE).name, canary=values.get("canary"))


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
    engine: str = DEFAULT_ENGINE     # the engine's name (gpugate.engine.get)
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
    # this run's servers of the container, in the order the deploy runs them: (port, the GPUs it
    # takes: () none (present: false), None when not told (refused, GPUs of UUIDs)); gpugate.plan
    # reads what each holds when a server's turn comes (issue 32 item 7)
    run_order: tuple[tuple[int, tuple[int, ...] | None], ...] = ()
    routing: Routing | None = None   # behind a router: leave, drain, restart, rejoin

    @property
    def label(self) -> str:
        """How messages name the server's engine ("SGLang"), for operation names."""
        try:
            return engine(self.engine).label
        except KeyError:
            return self.engine

    @property
    def max_used_mib(self) -> int:
        return int(self.budgets["max_used_mib"])

    def observe_args(self) -> dict[str, Any]:
        """What the agent's observe is asked (docs/agent-protocol.md, "observe"): the port, and for
        a desired server the env names whose value hashes it reports, its model path, GPUs and host.
        The deploy and the status ask the same, so they see the same."""
        args: dict[str, Any] = {"port": self.port}
        if self.engine != DEFAULT_ENGINE:
            args["engine"] = self.engine
        if self.spec is not None:
            args.update(env_names=sorted(self.spec.env), model_path=self.spec.model_path,
                        gpus=list(self.spec.gpus) if self.spec.gpus is not None else None, host=self.spec.host)
            if self.spec.secret_flags():
                args["secret_flags"] = self.spec.secret_flags()
            if self.spec.secret_env:
                args["secret_env"] = list(self.spec.secret_env)
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
    key = json.dumps(values, sort_keys=True, default=repr)
    known = _DESIRED.get(key)
    if known is None:
        known = _DESIRED[key] = _desired_states(values)
        while len(_DESIRED) > 4096:  # a fleet's containers, once each per run
            _DESIRED.pop(next(iter(_DESIRED)))
    return list(known)


# resolved host data (as JSON) -> its Desired list: deploy.py, the claims of the whole inventory and
# the status ask for the same containers' desired states within one run; each is built (and its
# flags validated) once
_DESIRED: dict[str, tuple[Desired, ...]] = {}


def _desired_states(values: Mapping[str, Any]) -> tuple[Desired, ...]:
    servers = values["sglang_servers"]
    if not servers:
        desired = [_desired(values)]
    else:
        ports = [int(server.get("sglang_port", values["sglang_port"])) for server in servers]
        desired = [dataclasses.replace(_desired({**values, **server}), siblings=tuple(p for p in ports if p != port))
                   for server, port in zip(servers, ports)]
    only = values["only_port"]  # --data only_port=30001: one server of a container that has several
    chosen = tuple(d for d in desired if only is None or d.port == int(only))
    if len(chosen) < 2:
        return chosen
    order = tuple((d.port, gpus_taken(d)) for d in chosen)
    return tuple(dataclasses.replace(d, run_order=order) for d in chosen)


def gpus_taken(desired: Desired) -> tuple[int, ...] | None:
    """The GPUs a desired server holds once its turn in a run is over, as ``Desired.run_order``
    says it: () for none (``present: false``), None when not told (refused, GPUs of UUIDs).

    >>> gpus_taken(desired_state({"sglang_model_path": "/m", "sglang_flags": {"tp": 2}})), gpus_taken(desired_state({"sglang_present": False}))
    ((0, 1), ())
    """
    if not desired.present:
        return ()
    return None if desired.spec is None or desired.spec.gpus is None else tuple(desired.spec.gpus)


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
                              gated_launch=values["sglang_gated_launch"], engine_name=values["engine"],
                              secret_env=values["sglang_secret_env"], drain_timeout_s=values["drain_timeout_s"],
                              lora_adapters=values["sglang_lora_adapters"],
                              # a canary reads the engine's /metrics: every replica behind its router serves
                              # them, a cordoned one too (cordoning it must not restart it to drop them)
                              metrics=bool(routing is not None and routing.canary))
        except SpecError as error:
            problem = str(error)
    return Desired(port=port, present=present, python=values["sglang_python"], spec=spec, engine=values["engine"],
                   budgets=budgets({key: values[setting] for key, setting in BUDGET_SETTINGS.items()}),
                   problem=problem, flags=dict(values["sglang_flags"] or {}),
                   sglang_version=values["sglang_version"], min_free_mib=int(values["min_free_mib"]),
                   agent_silence_s=float(values["agent_silence_s"]),
                   end_other_gpu_holders=bool(values["end_other_gpu_holders"]),
                   # a canary soaks one replica before the others: one container at a time
                   rolling=bool(values["rolling"]) or bool(routing is not None and routing.canary),
                   max_failures=int(values["max_failures"]), audit_log=values["audit_log"],
                   restarted=bool(values["sglang_restarted"]), rollback_to=int(values["rollback_to"]),
                   gated_launch=values["sglang_gated_launch"],
                   routing=routing)
