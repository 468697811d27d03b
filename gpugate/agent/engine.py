"""The engine of the server a command is about, as the agent sees it: the engine's container
module (gpugate/engine/container.py says what it holds), loaded by the name the controller's
document carries (``"engine": "sglang"``; none: the ``engine`` setting's default). The agent names
no engine itself: ``engine.is_main_argv(argv)`` asks whichever engine :func:`use` loaded.

Example::

    >>> use("sglang").LABEL
    'SGLang'
    >>> engine.is_main_argv(["python3", "-m", "http.server"])
    False
"""

from __future__ import annotations

import sys

from gpugate.engine import container as interface

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from types import ModuleType
    from typing import Any, Dict, Optional

_LOADED = {}  # type: Dict[str, ModuleType]
_current = None  # type: Optional[ModuleType]


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


def use(name: str | None = None) -> ModuleType:
    """Make engine ``name`` the one :data:`engine` answers for (each command calls it once)."""
    global _current
    _current = load(name)
    return _current


class _Current(object):
    """Attribute access on the engine in use; a name its module leaves out is the interface's default."""

    def __getattr__(self, name: str) -> Any:
        module = _current if _current is not None else use(None)
        try:
            return getattr(module, name)
        except AttributeError:
            return getattr(interface, name)


engine = _Current()
