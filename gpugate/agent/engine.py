"""The engines as the agent sees them: their container modules (gpugate/engine/container.py says
what one holds), of every engine the artifact carries. The agent names no engine itself:

- a process is recognised by every engine (``engine.is_server_part(argv)``: a part of any engine's
  server; ``engine.argv_port(argv)``: as the engine that owns that argv reads it), so a server of
  another engine on the port (a switch of engines, a rollback to the other one's spec) is seen,
  stopped and swept as what it is, and a stranger is never taken for one;
- what belongs to one server (its health, generation and info paths, its workers) is the engine of
  the server being acted on: :func:`use` (the engine a document names; none: the ``engine``
  setting's default) and :func:`use_for` (the engine whose server an argv is).

Example::

    >>> use("sglang").LABEL
    'SGLang'
    >>> engine.is_main_argv(["python3", "-m", "http.server"]), engine.argv_port(["python3", "-m", "sglang.launch_server"])
    (False, 30000)
"""

from __future__ import annotations

import sys

from gpugate.engine import container as interface

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from types import ModuleType
    from typing import Any, Callable, Dict, List, Optional, Sequence

_LOADED = {}  # type: Dict[str, ModuleType]
_current = None  # type: Optional[ModuleType]
# asked of every engine: true when any engine says so
ANY_ENGINE = frozenset(["is_main_argv", "is_worker_argv", "is_scheduler_argv", "is_server_part", "is_client_argv",
                        "is_daemon_argv"])
# answered by the engine whose process the argv (the first argument) is
BY_ARGV = frozenset(["argv_port", "argv_host", "argv_model", "argv_token", "server_gpus", "steady_argv", "gated_argv"])


class UnknownEngine(ValueError):
    """A document names an engine this artifact does not carry."""


def load(name: str | None = None) -> ModuleType:
    """The container module of engine ``name`` (None: the default engine)."""
    name = name or interface.default_engine()
    module = _LOADED.get(name)
    if module is None:
        modules = interface.modules()
        if name not in modules:
            raise UnknownEngine("no engine %r in this agent (engines: %s)" % (name, ", ".join(sorted(modules)) or "none"))
        __import__(modules[name])
        module = _LOADED[name] = sys.modules[modules[name]]
    return module


_ALL = []  # type: List[ModuleType]  # every engine's module, loaded once per command


def every() -> List[ModuleType]:
    """Every engine's container module, the one in use first."""
    current = _current if _current is not None else use(None)
    if not _ALL:
        for name in sorted(interface.modules()):
            try:
                _ALL.append(load(name))
            except Exception:  # noqa: BLE001 -- an engine whose module fails is no engine here
                continue
    return [current] + [module for module in _ALL if module is not current]


def _asked(module: ModuleType, name: str) -> Any:
    if hasattr(module, name):
        return getattr(module, name)
    if name == "is_server_part":  # main or worker, by the same engine's own tests
        return lambda argv: _asked(module, "is_main_argv")(argv) or _asked(module, "is_worker_argv")(argv)
    if name in ("generation_request", "read_info"):  # the default reads the engine's own paths
        default = getattr(interface, "default_" + name)
        return lambda *args: default(module, *args)
    return getattr(interface, name)


def owner(argv: Sequence[str] | None) -> ModuleType | None:
    """The engine whose server (main or worker) or weight-cache daemon ``argv`` is, else None."""
    for module in every():
        if any(_asked(module, test)(argv) for test in ("is_main_argv", "is_worker_argv", "is_daemon_argv")):
            return module
    return None


def use(name: str | None = None) -> ModuleType:
    """Make engine ``name`` the one :data:`engine` answers for (each command calls it once)."""
    global _current
    _current = load(name)
    return _current


def use_for(argv: Sequence[str] | None) -> ModuleType:
    """Make the engine whose server ``argv`` is the one in use (the one in use stays, for an argv no
    engine owns): before a server is started, waited for or verified."""
    global _current
    _current = owner(argv) or (_current if _current is not None else use(None))
    return _current


def _any(name: str) -> Callable[..., bool]:
    def asked(*args: Any) -> bool:
        return any(_asked(module, name)(*args) for module in every())
    return asked


def _by_argv(name: str) -> Callable[..., Any]:
    def asked(argv: Sequence[str], *args: Any, **kwargs: Any) -> Any:
        module = owner(argv) or (_current if _current is not None else use(None))
        return _asked(module, name)(argv, *args, **kwargs)
    return asked


class _Current(object):
    """Attribute access on the engines: see the module's docstring; a name an engine's module leaves
    out is the interface's default."""

    @staticmethod
    def use_for(argv: Sequence[str] | None) -> ModuleType:
        return use_for(argv)

    def __getattr__(self, name: str) -> Any:
        if name in ANY_ENGINE:
            return _any(name)
        if name in BY_ARGV:
            return _by_argv(name)
        if name == "SHM_PREFIXES":  # what any engine's killed server leaves behind
            return tuple(prefix for module in every() for prefix in _asked(module, "SHM_PREFIXES"))
        return _asked(_current if _current is not None else use(None), name)


engine = _Current()
