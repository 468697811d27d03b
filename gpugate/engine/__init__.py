"""The engine seam: everything gpugate knows of the inference server it runs, behind one coarse
interface, :class:`Engine`, about the size of pyinfra's ``BaseConnector``. Engines are found by the
entry point group ``gpugate.engines`` (as pyinfra finds its connectors), so a second engine is a
package of its own: nothing outside it names its flags, argv, processes or endpoints.

An engine has two halves:

- the controller's (this interface): the flag table of the release that will run
  (:meth:`Engine.choose_table`), the launch built from the engine-neutral :class:`ServerInputs`
  (:meth:`Engine.launch`: validated once; argv, GPUs, what the server must report, what is
  secret, its weight-cache daemons, gated or not), a running command read back
  (:meth:`Engine.read_running`), the one diff format (:meth:`Engine.flag_lines`), the checks that
  are the engine's before anything stops (:meth:`Engine.preflight`) and its capacity figures;
- the container's: a stdlib-only module ``<engine package>.container`` (the interface with its
  defaults: gpugate/engine/container.py) that the agent loads by the name the start document
  carries, and that the agent's artifact bundles.

Example::

    >>> sglang = get("sglang")
    >>> launch = sglang.launch(ServerInputs(engine="sglang", model_path="/m", port=30000, flags={"tp": 2}))
    >>> launch.argv[-2:], launch.gpus
    (('--tp-size', '2'), (0, 1))
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import importlib
import importlib.util
import re
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

__all__ = ["Engine", "EngineError", "FlagError", "ServerInputs", "Launch", "Running", "LiveState", "Change",
           "adapter_changes", "lora_switch", "get", "names", "ENTRY_POINT_GROUP", "DEFAULT_ENGINE"]

ENTRY_POINT_GROUP = "gpugate.engines"
DEFAULT_ENGINE = "sglang"  # the ``engine`` setting's default: what every fleet.yaml before it ran


class EngineError(KeyError):
    """An installed engine that cannot be used (its plug-in does not load, or its container module
    is missing): only the servers of that engine are refused."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class FlagError(ValueError):
    """A flag (or a setting of the launch) the engine would reject. ``str()`` names the flag and
    the problem; ``flag`` is empty for a problem that is no flag's (``gated_launch: ...``).

    Example::

        >>> str(FlagError("kv-cache-dtype", "'fp9' is not one of auto, fp8_e5m2, ..."))
        "--kv-cache-dtype: 'fp9' is not one of auto, fp8_e5m2, ..."
    """

    def __init__(self, flag: str, message: str):
        self.flag = flag
        self.message = message
        super().__init__(f"--{flag}: {message}" if flag else message)


@dataclasses.dataclass(frozen=True)
class ServerInputs:
    """One desired server as the operator wrote it, engine-neutral: the settings' values, already
    checked for what is no engine's business (port range, env names, one-line values)."""

    engine: str
    model_path: str
    port: int
    flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # as written
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    host: str = "127.0.0.1"
    supervisor: str = "auto"
    python: str = "/usr/bin/python3"
    extra_args: tuple[str, ...] = ()
    version: str | None = None          # the release pinned (``sglang_version``), if any
    weight_cache: bool = False          # the weights are held across engine restarts
    gated_launch: bool | None = None    # None: where the release and the supervisor allow it
    drain_timeout_s: float = 60.0       # the stop's drain budget (an engine whose drain is a flag sets it)
    secret_env: tuple[str, ...] = ()    # env names the operator declares secret (beyond the pattern list)
    lora_adapters: Mapping[str, str] | None = None  # {name: path}; None: LoRA off (docs/live-changes.md)
    metrics: bool = False               # the server must serve its /metrics: a canary judges it (docs/canary.md)


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the engine makes of :class:`ServerInputs`: everything derived from the flags, once."""

    flags: Mapping[str, Any]                 # canonical names, typed values
    argv: tuple[str, ...]                    # the exact command, interpreter first
    args_start: int                          # argv[args_start:] are the server's own arguments
    gpus: tuple[int, ...] | None             # None: cannot be told before the container is asked
    shown_argv: tuple[str, ...]              # argv with every secret value ``***``
    shown_flags: Mapping[str, Any]           # flags with every secret value ``***``
    secret_options: tuple[str, ...] = ()     # option strings the agent masks beyond its own list
    expect_info: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # what the server must report
    warnings: tuple[str, ...] = ()
    daemon_argv: tuple[str, ...] = ()        # the weight cache's daemons, when wanted
    gated: bool = False                      # the new engine starts before the old one stops
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # what the engine sets in the server's env


@dataclasses.dataclass(frozen=True)
class LiveState:
    """What a server serves that its engine may change while it serves (docs/live-changes.md): the
    weights' model path and the LoRA adapters ``{name: path}`` (None: LoRA is off)."""

    model_path: str | None
    lora_adapters: Mapping[str, str] | None = None

    def doc(self) -> dict[str, Any]:
        """As the history and the agent's documents carry it.

        >>> LiveState("/m", {"a": "/a"}).doc()
        {'model_path': '/m', 'lora_adapters': {'a': '/a'}}
        """
        return {"model_path": self.model_path,
                "lora_adapters": None if self.lora_adapters is None else dict(sorted(self.lora_adapters.items()))}


@dataclasses.dataclass(frozen=True)
class Change:
    """One difference between what serves and what is desired, and the path it takes: ``live``
    (the engine applies it while it serves: ``op`` is what the container's agent sends) or
    ``restart`` (``text`` says why it cannot be live).

    >>> Change("live", "load adapter b", {"op": "load_adapter", "name": "b", "path": "/b"}).line
    'live: load adapter b'
    """

    path: str                               # "live" | "restart"
    text: str
    op: Mapping[str, Any] | None = None     # live: the agent's operation (the engine's container module sends it)

    @property
    def line(self) -> str:
        return f"{self.path}: {self.text}"


@dataclasses.dataclass
class Running:
    """A running server's command read back (never raises): ``flags`` normalised as the launch's,
    unknown flags kept under their written name; ``unknown`` the names the table does not know;
    ``args_start``: where the server's own arguments begin in the argv read."""

    model_path: str | None
    host: str
    port: int
    flags: dict[str, Any] = dataclasses.field(default_factory=dict)
    unknown: list[str] = dataclasses.field(default_factory=list)
    args_start: int = 0


class Engine(abc.ABC):
    """What gpugate needs of an inference server. Flags travel as data: a mapping of canonical
    names to typed values (``{"tp-size": 8, "disable-radix-cache": True}``); a ``table`` is the
    engine's own flag table of one release (what :meth:`choose_table` returns), None for the
    engine's default."""

    name: str = ""                 # the engine's name in settings and entry points: "sglang"
    label: str = ""                # how messages name it: "SGLang"
    model_option: str = "--model"  # how a diff line shows the model and the listen host
    host_option: str = "--host"
    info_endpoint: str = "/server_info"   # what the verify reads, named in the plan's steps
    drain_words: str = "the engine's drain"  # what SIGTERM starts, in the stop's line
    ready_paths: tuple[str, ...] = ("/health",)  # readiness before a router sends to it again (first that exists)
    router_runtime: str = ""       # smg's ``runtime`` of this engine's workers ("": smg detects it)
    default_port: int | None = None  # the engine's own default port: a fleet.yaml server without port:
    # systemd's Restart= for the server's unit, and why: how the engine exits when it dies
    systemd_restart: tuple[str, str] = ("on-failure", "the engine exits non-zero when it dies")
    in_flight_gauges: tuple[str, ...] = ()  # the Prometheus gauges whose sum is what a server still holds
    # what a canary reads on /metrics (gpugate.canary, docs/canary.md), by role: histograms ``ttft``,
    # ``itl``, ``e2e`` (base names), counters ``requests`` (every request that ended), ``errors``,
    # ``aborts``, ``preemptions``, ``tokens`` (generated), gauge ``running``; each a tuple of selectors
    # ``name`` or ``name{label="value"}``, summed. Empty: this engine's servers cannot be judged.
    canary_metrics: Mapping[str, tuple[str, ...]] = {}
    metrics_flag: str = ""         # the launch flag that turns /metrics on, where it is off by default
    has_weight_cache: bool = False  # the weights can be held across engine restarts (docs/weight-cache.md)
    gated_option: str = ""         # a gated launch's option and how the gate opens (plan's steps); "": none
    gate_activate: str = ""
    container_module: str = ""     # the stdlib-only module the agent loads (gpugate/engine/container.py)

    @property
    def container(self) -> ModuleType:
        """That module, imported (the controller shares its rules: the weight cache's key)."""
        return importlib.import_module(self.container_module)

    # --- the flags of the release that will run
    @abc.abstractmethod
    def choose_table(self, container: Mapping[str, Any] | None, pinned: str | None) -> tuple[Any, str]:
        """The flag table of the release that will run (the container's, else the pinned
        snapshot, else the newest) and a note naming it."""

    def fetch_table(self, run: Callable[[str], Mapping[str, Any]], python: str,
                    observation: Mapping[str, Any] | None, say: Callable[[str], Any] | None = None
                    ) -> Mapping[str, Any] | None:
        """The container's own flag table document (``run`` sends one shell command to the
        container and returns its JSON answer), for :meth:`choose_table`; None where the engine
        has none."""
        return None

    def table_command(self, python: str, known: Sequence[str] = (), build: bool = True) -> str | None:
        """One shell command that reads (``build``: or builds) the container's own flag table
        (None: the engine has none); ``known``: table keys the controller has (not sent again)."""
        return None

    def flag_warnings(self, flags: Mapping[str, Any], table: Any = None) -> list[str]:
        """The engine's own deprecation warnings for these (validated) flags."""
        return []

    @abc.abstractmethod
    def validate_flags(self, flags: Mapping[str, object] | None, table: Any = None) -> dict[str, Any]:
        """Canonical names and typed values, or FlagError naming the flag and what is wrong."""

    @abc.abstractmethod
    def canonical_name(self, name: str, table: Any = None) -> str:
        """The canonical name of a flag as a person writes it (FlagError for none)."""

    # --- the launch: validated once, everything derived from the flags
    @abc.abstractmethod
    def launch(self, inputs: ServerInputs, table: Any = None) -> Launch:
        """The server these inputs make, or FlagError naming what the engine refuses."""

    # --- what runs, read back and compared
    @abc.abstractmethod
    def read_running(self, argv: Sequence[str], table: Any = None) -> Running:
        """A running command (``/proc/PID/cmdline``) read back; never raises."""

    @abc.abstractmethod
    def flag_lines(self, running: Mapping[str, Any], desired: Mapping[str, Any], table: Any = None) -> list[str]:
        """THE rendering of a flag difference: ``+ --flag value`` desired and not running,
        ``- --flag value`` running and not desired, sorted by flag; secrets compared and shown
        ``***`` on both sides."""

    @abc.abstractmethod
    def redact_argv(self, argv: Sequence[str], table: Any = None) -> list[str]:
        """argv with every secret value ``***``."""

    def redact_flags(self, flags: Mapping[str, Any], table: Any = None) -> dict[str, Any]:
        """Flags with every secret value ``***`` (as the engine knows its secrets)."""
        return dict(flags)

    # --- what the engine changes while it serves (docs/live-changes.md)
    def launched_live(self, running: Running) -> LiveState:
        """The live state a running command was launched with (its model path, its initial adapters)."""
        return LiveState(running.model_path, None)

    def live_changes(self, have: LiveState, want: LiveState, *, same_shape: bool | None = None,
                     weight_cache: bool = False) -> list[Change]:
        """Every difference from ``have`` (what serves) to ``want``, each with its path: ``live`` where
        this engine applies it while it serves, else ``restart`` saying why. ``same_shape``: the two
        models' config.json describe the same architecture and shapes (None: not known);
        ``weight_cache``: the weight cache is active. An engine that changes nothing live: all restart."""
        changes = []
        if have.model_path != want.model_path:
            changes.append(Change("restart", f"weights {have.model_path} -> {want.model_path} "
                                             f"({self.label} loads other weights only at its start)"))
        if (have.lora_adapters or {}) != (want.lora_adapters or {}):
            changes.append(Change("restart", f"adapters {_names(have.lora_adapters)} -> {_names(want.lora_adapters)} "
                                             f"({self.label} loads adapters only at its start)"))
        return changes

    # --- before anything stops, and after the start
    def preflight(self, observation: Mapping[str, Any], launch: Launch) -> list[str]:
        """Problems that are this engine's to see before anything stops (host memory its flags
        need...): each one refuses the change."""
        return []

    def capacity(self, info: Mapping[str, Any] | None) -> dict[str, Any]:
        """What the server says it can hold (KV tokens...), from its info document."""
        return {}

    def capacity_line(self, before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> str | None:
        """The capacity before and after a change, in one line for the operator."""
        return None

    def read_info(self, get: Callable[[str], tuple[int | None, str]]) -> dict[str, Any]:
        """The server's info document as the container's agent reads it (the container module's
        ``read_info``, else its ``INFO_PATHS``' first answer), through ``get(path) -> (status,
        body)``: the router's identity check reads a worker URL with the same rule.
        -> ``{"path", "error", "status", "args"}``."""
        module = self.container
        reader = getattr(module, "read_info", None)
        if reader is not None:
            return dict(reader(get))
        from gpugate.engine.container import default_read_info  # noqa: PLC0415 -- the container's defaults

        return default_read_info(module, get)

    def in_flight(self, get: Callable[[str], tuple[int, bytes]]) -> int | None:
        """The requests a running server still holds (streams among them), read from the server
        itself through ``get(path) -> (status, body)``: the sum of :attr:`in_flight_gauges` on its
        ``/metrics``; None when it has none of them (metrics off, or not this engine)."""
        status, body = get("/metrics")
        return prometheus_sum(body.decode(errors="replace"), self.in_flight_gauges) if status == 200 else None

    def check_report(self, flags: Mapping[str, Any], pinned: str | None, extra_args: Sequence[str] | None
                     ) -> tuple[bool, list[str]]:
        """``gpugate check``: whether these flags are valid for the pinned release, and why not."""
        try:
            normal = self.validate_flags(flags)
        except FlagError as error:
            return False, [f"REFUSED by {self.label}: {error}"]
        return True, [f"ok for {self.label}, {len(normal)} flag(s)"]


def adapter_changes(had: Mapping[str, str], wanted: Mapping[str, str]) -> list[Change]:
    """The live load and unload of LoRA adapters from ``had`` to ``wanted``: unloads first (a slot
    freed before a load), a changed path as an unload then a load.

    >>> [c.line for c in adapter_changes({"a": "/a", "c": "/c"}, {"b": "/b", "c": "/c2"})]
    ['live: unload adapter a', 'live: unload adapter c', 'live: load adapter b', 'live: load adapter c (/c2)']
    """
    changes = [Change("live", f"unload adapter {name}", {"op": "unload_adapter", "name": name, "path": path})
               for name, path in sorted(had.items()) if wanted.get(name) != path]
    changes += [Change("live", f"load adapter {name}" + (f" ({path})" if name in had else ""),
                       {"op": "load_adapter", "name": name, "path": path})
                for name, path in sorted(wanted.items()) if had.get(name) != path]
    return changes


def lora_switch(have: LiveState, want: LiveState) -> Change | None:
    """LoRA turned on or off: a launch flag of every engine gpugate knows, so a restart."""
    if (have.lora_adapters is None) == (want.lora_adapters is None):
        return None
    return Change("restart", "LoRA " + ("on" if have.lora_adapters is None else "off") + " (a launch flag)")


def _names(adapters: Mapping[str, str] | None) -> str:
    return ", ".join(sorted(adapters or {})) or "none"


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*")


def prometheus_sum(text: str, names: Sequence[str]) -> int | None:
    """The sum of the samples of ``names`` in a Prometheus text page, over every label set (one per
    rank); None when the page has none of them.

    >>> prometheus_sum('a:x{rank="0"} 2.0\\na:x{rank="1"} 1.0\\nb 5\\n', ("a:x", "a:y"))
    3
    >>> prometheus_sum("# nothing here\\n", ("a:x",)) is None
    True
    """
    total, seen = 0.0, False
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in names and match.group(3) != "NaN":
            total += float(match.group(3))
            seen = True
    return int(round(total)) if seen else None


@functools.lru_cache(maxsize=None)
def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points  # noqa: PLC0415 -- read once, when an engine is first named

    return {entry.name: entry for entry in entry_points(group=ENTRY_POINT_GROUP)}


def names() -> list[str]:
    """The engines installed (entry point group ``gpugate.engines``), sorted.

    >>> "sglang" in names()
    True
    """
    return sorted(_entry_points())


@functools.lru_cache(maxsize=None)
def get(name: str) -> Engine:
    """The engine of this name, loaded from its entry point; KeyError naming the engines there are.

    >>> get("sglang").label
    'SGLang'
    >>> get("tgi")
    Traceback (most recent call last):
    ...
    KeyError: "no engine 'tgi'; engines: sglang, vllm"
    """
    entry = _entry_points().get(name)
    if entry is None:
        raise KeyError(f"no engine {name!r}; engines: {', '.join(names()) or 'none installed'}")
    try:
        loaded = entry.load()
        engine = loaded() if isinstance(loaded, type) else loaded
        found = importlib.util.find_spec(engine.container_module) if engine.container_module else None
    except Exception as error:  # a broken plug-in is that engine's problem alone
        raise EngineError(f"the engine {name!r} ({entry.value}) cannot be loaded: {type(error).__name__}: {error}") \
            from None
    if not isinstance(engine, Engine):
        raise EngineError(f"the engine {name!r} ({entry.value}) is no gpugate.engine.Engine")
    if found is None:
        raise EngineError(f"the engine {name!r}: its container module {engine.container_module!r} cannot be found")
    return engine
