"""The container-side code as text, for the commands that carry it into a container: the agent's
one-file artifact (gpugate.agentcmd) and the inline probe commands (gpugate.remote).

A bundle is gpugate/agent/loader.py with its ``_BUNDLE`` filled with module sources (module name ->
source, read from this package's files): in the container the loader serves them through a
meta-path finder, so both sides import the same modules by the same names, never a copy.

Example::

    >>> from gpugate import bundle
    >>> text = bundle.loader_source(bundle.with_imports(("gpugate.agent.gpu_probe",)))
    >>> "gpugate.rules.procfs" in text
    True
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
ROOT = PACKAGE_DIR.parent
LOADER = PACKAGE_DIR / "agent" / "loader.py"
BUNDLE_LINE = "_BUNDLE = {}  # filled by gpugate.agentcmd.agent_source(): {\"gpugate.rules.gate\": \"<source>\", ...}"
# What the agent runs, and so what its artifact carries (their gpugate imports come along).
AGENT_MODULES = ("gpugate.agent.main", "gpugate.agent.observe", "gpugate.agent.commands", "gpugate.agent.logs",
                 "gpugate.agent.gpu_probe", "gpugate.agent.live")


def module_path(name: str) -> Path:
    """The file of module ``name`` in this package (a package's ``__init__.py``), or, for an
    engine installed from another package, where Python finds it.

    >>> module_path("gpugate.rules").name, module_path("gpugate.rules.gate").name
    ('__init__.py', 'gate.py')
    """
    if name.split(".")[0] != "gpugate":
        found = importlib.util.find_spec(name)
        if found is None or not found.origin:
            raise ImportError(f"no module {name!r} to bundle")
        return Path(found.origin)
    base = ROOT.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


# An import statement at the start of a line (at any indent: a function's lazy import counts):
# ``from gpugate.x import a, b as c`` (names perhaps in parentheses over several lines) or
# ``import gpugate.x, os``. A regular expression, not ast.parse: every controller run bundles the
# agent, and parsing its modules cost 0.13 s of each run (tests/unit/test_bundle.py checks that both
# find at least what ast finds in every file of the package, and exactly the agent's bundle).
_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(\w+(?:\.\w+)*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)"
                     r"|import[ \t]+([^\n]*))", re.M)


def _names(clause: str) -> list[str]:
    """``a, b as c  # note`` or ``(a,\n b)`` -> ['a', 'b']."""
    words = [line.split("#", 1)[0] for line in clause.strip("()").splitlines()]
    return [part.split()[0] for part in " ".join(words).split(",") if part.strip()]


def _module_file(name: str) -> Path | None:
    try:
        path = module_path(name)
    except (ImportError, ValueError):  # a name imported from a module, not a module
        return None
    return path if path.is_file() and path.name != "__init__.py" else None


def gpugate_imports(source: str, packages: Iterable[str] = ("gpugate",)) -> set[str]:
    """The modules of ``packages`` (gpugate's, and an engine plug-in's own) a source imports (at any
    depth: a function's lazy import counts). Never a package's ``__init__.py``: in a container the
    loader serves every package empty, so what the controller's package files hold never runs there.

    >>> sorted(gpugate_imports("from gpugate.rules import gate, procfs\\nimport os"))
    ['gpugate.rules.gate', 'gpugate.rules.procfs']
    """
    tops = set(packages)
    found: set[str] = set()
    for module, names, plain in _IMPORT.findall(source):
        if module and module.split(".")[0] in tops:
            found.add(module)
            found.update("%s.%s" % (module, name) for name in _names(names))
        elif not module:
            found.update(name for name in _names(plain) if name.split(".")[0] in tops)
    return {name for name in found if _module_file(name) is not None}


@functools.lru_cache(maxsize=None)
def with_imports(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` and every gpugate module they import, transitively, sorted."""
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(gpugate_imports(module_path(name).read_text(), ("gpugate", name.split(".")[0])) - seen)
    return tuple(sorted(seen))


def sources(names: Iterable[str]) -> dict[str, str]:
    """module name -> source, for ``names``."""
    return {name: module_path(name).read_text() for name in names}


@functools.lru_cache(maxsize=None)
def engine_sources() -> dict[str, str]:
    """The container modules of every installed engine (gpugate.engine.container: what the agent
    loads by the name a document carries), their imports, and their table as the module
    ``gpugate.engine.bundled`` (``MODULES``: engine name -> module; ``DEFAULT``: the default engine)."""
    from gpugate.engine import DEFAULT_ENGINE, EngineError, get, names  # noqa: PLC0415 -- only the agent's bundle

    modules = {}
    for name in names():
        try:
            modules[name] = get(name).container_module
        except EngineError:  # a broken plug-in: its servers are refused (gpugate.spec), the others go on
            continue
    table = f"MODULES = {modules!r}\nDEFAULT = {DEFAULT_ENGINE!r}\n"
    return dict(sources(with_imports(tuple(sorted(modules.values())))), **{"gpugate.engine.bundled": table})


def loader_source(names: Iterable[str], extra: Mapping[str, str] | None = None) -> str:
    """gpugate/agent/loader.py with ``_BUNDLE`` holding the sources of ``names`` (and ``extra``:
    name -> source, for sources that are not this package's files); a bundle that loads engines
    (gpugate.agent.engine) carries every installed engine's container module."""
    text = LOADER.read_text()
    if text.count(BUNDLE_LINE) != 1:
        raise RuntimeError("gpugate/agent/loader.py lost its _BUNDLE line; gpugate.bundle cannot fill it")
    names = tuple(names)
    engines = engine_sources() if "gpugate.agent.engine" in names else {}
    bundle = dict(sources(names), **engines, **dict(extra or {}))
    return text.replace(BUNDLE_LINE, "_BUNDLE = " + repr(bundle))


def agent_source() -> str:
    """The agent's artifact: the loader with every module the agent runs."""
    return loader_source(with_imports(AGENT_MODULES))


@functools.lru_cache(maxsize=1)
def observe_source() -> str:
    """The loader with what ``observe`` alone runs (the agent's main with its module-level imports,
    and observe's): the inline observe sends it in one argv string, which the kernel caps at 128 KiB
    (MAX_ARG_STRLEN) -- the whole artifact, with every command's modules, no longer fits there.

    >>> "def observe(" in observe_source() and "def command_live(" not in observe_source()
    True
    """
    main = module_path("gpugate.agent.main").read_text()
    top = "\n".join(line for line in main.splitlines() if not line.startswith((" ", "\t")))
    return loader_source(sorted(set(with_imports(("gpugate.agent.observe", *gpugate_imports(top))))
                                | {"gpugate.agent.main"}))
