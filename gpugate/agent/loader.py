"""The agent's artifact: this file, with ``_BUNDLE`` filled by gpugate.agentcmd.agent_source() with the
sources of every module the agent runs (gpugate.rules, gpugate.agent, the engine's container side:
module name -> source), is the ONE content-addressed file installed in a container
(``/var/lib/gpugate/agent-<sha256>.py``) and the text the inline observe sends.

``main`` puts a finder first on ``sys.meta_path`` that serves those modules from ``_BUNDLE``, so
``from gpugate.rules import gate`` imports the same code in a container as on the controller (a
package of the bundle without a source of its own, such as ``gpugate``, is an empty package: the
controller's ``gpugate/__init__.py`` never runs in a container). Then it runs gpugate.agent.main.
The inline probe commands (gpugate.remote) load this file the same way, with only the modules they
need, and call :func:`install` themselves.

Compiled code: the bootstrap caches this file's own code (``__pycache__/agent-<sha>.<tag>.code``);
this loader caches the bundled modules' code as ONE marshal of {module name: code object}
(``__pycache__/bundle-<sha16>-<major><minor>.marshal``), written only by a command that may write
(``WRITE_CACHE``: start, install) and read by every other, so observe compiles nothing. Without the
cache (deleted, a full disk, another interpreter's) it compiles in memory and writes nothing.

From the package (``_BUNDLE`` empty: tests, a checkout) it imports the package's own files::

    python3 gpugate/agent/loader.py observe '{"port": 30000}'
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from importlib.machinery import ModuleSpec
    from types import CodeType, ModuleType
    from typing import Any, Dict, List, Mapping, Optional, Sequence

_BUNDLE = {}  # filled by gpugate.agentcmd.agent_source(): {"gpugate.rules.gate": "<source>", ...}
# gpugate.agent.state's STATE_DIR, which this file cannot import before its finder serves the package.
STATE_DIR = "/var/lib/gpugate"


class BundleImporter(object):
    """A meta-path finder and loader in one (the protocol of importlib.abc.MetaPathFinder and
    importlib.abc.Loader, without importing importlib.abc: ~3-10 ms of every command) over
    ``sources`` (module name -> source), with ``code`` (module name -> compiled code) where cached.

    >>> importer = BundleImporter({"gpugate_demo.rule": "ANSWER = 42"})
    >>> importer.find_spec("gpugate_demo", None).submodule_search_locations, importer.find_spec("json", None)
    ([], None)
    """

    def __init__(self, sources: Mapping[str, str], code: Mapping[str, CodeType] | None = None,
                 origin: str = "<gpugate>") -> None:
        self.sources = dict(sources)
        self.code = dict(code or {})
        self.origin = origin
        self.packages: set[str] = set()
        for name in self.sources:
            parts = name.split(".")
            self.packages.update(".".join(parts[:end]) for end in range(1, len(parts)))

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname not in self.sources and fullname not in self.packages:
            return None
        return module_spec(fullname, self, self.filename(fullname), fullname in self.packages)

    def create_module(self, spec: ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        module.__file__ = self.filename(module.__name__)
        code = self.compiled(module.__name__)
        if code is not None:  # a package without a source of its own stays empty
            exec(code, module.__dict__)

    def filename(self, name: str) -> str:
        tail = "/__init__.py" if name in self.packages else ".py"
        return "%s/%s%s" % (self.origin, name.replace(".", "/"), tail)

    def compiled(self, name: str) -> CodeType | None:
        code = self.code.get(name)
        if code is None and name in self.sources:
            code = compile(self.sources[name], self.filename(name), "exec", dont_inherit=True)
            self.code[name] = code
        return code

    def compile_all(self) -> Dict[str, Optional[CodeType]]:
        """Every module's code (for the cache), compiled where it is not yet."""
        return dict((name, self.compiled(name)) for name in sorted(self.sources))


def module_spec(name: str, loader: BundleImporter, origin: str, is_package: bool) -> ModuleSpec:
    """importlib's ModuleSpec from the frozen bootstrap, which every CPython has loaded already."""
    try:
        spec_class = sys.modules["_frozen_importlib"].ModuleSpec
    except (KeyError, AttributeError):
        from importlib.machinery import ModuleSpec as spec_class
    return spec_class(name, loader, origin=origin, is_package=is_package)


def install(sources: Mapping[str, str], code: Mapping[str, CodeType] | None = None, origin: str = "<gpugate>") -> Any:
    """Serve ``sources`` first on sys.meta_path (once per process) -> the importer."""
    for finder in sys.meta_path:
        if isinstance(finder, BundleImporter) or type(finder).__name__ == "BundleImporter":
            return finder
    importer = BundleImporter(sources, code, origin)
    sys.meta_path.insert(0, importer)
    return importer


def cache_path(sha: str) -> str:
    """Where the bundled modules' code is cached for the agent ``sha``.

    >>> cache_path("ab" * 32).startswith("/var/lib/gpugate/__pycache__/bundle-abababababababab-")
    True
    """
    return "%s/__pycache__/bundle-%s-%d%d.marshal" % (STATE_DIR, sha[:16], sys.version_info[0], sys.version_info[1])


def read_cache(path: str) -> Dict[str, CodeType] | None:
    """{module name: code} from the cache file, or None (absent, torn, another interpreter's)."""
    import marshal

    try:
        with open(path, "rb") as handle:
            code = marshal.loads(handle.read())
    except (OSError, ValueError, EOFError, TypeError):
        return None
    return code if isinstance(code, dict) else None


def write_cache(path: str, code: Dict[str, Optional[CodeType]]) -> None:
    """The cache file, private and atomic (temp, fsync, rename); a full disk is no failure."""
    import marshal

    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = "%s.tmp.%d" % (path, os.getpid())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(marshal.dumps(code))
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except (OSError, ValueError):
        pass


def installed_sha(path: str | None) -> str | None:
    """The sha256 an installed agent's file name carries (``agent-<sha>.py``), else None."""
    name = os.path.basename(path or "")
    if os.path.dirname(path or "") == STATE_DIR and name.startswith("agent-") and name.endswith(".py"):
        return name[len("agent-"):-len(".py")]
    return None


def use_the_package() -> None:
    """Run from a checkout or an installed package: import gpugate from the files beside this one
    (and not this directory's modules as top-level names)."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != here]
    if root not in sys.path:
        sys.path.insert(0, root)


def main(argv: List[str], stdin_doc: Any = None) -> int:
    """The bootstrap's entry (and this file's as a program): the finder, the cache, then the
    agent's command. The bootstrap sets WRITE_CACHE, INSTALLED_NOW, AGENT_SHA256 (and INLINE for
    the inline observe) on this module before it calls."""
    found = globals()
    path = found.get("__file__")
    sha = found.get("AGENT_SHA256") or installed_sha(path)
    may_write = bool(found.get("WRITE_CACHE"))
    if _BUNDLE:
        cache = cache_path(sha) if sha and installed_sha(path) and not found.get("INLINE") else None
        code = read_cache(cache) if cache else None
        importer = install(_BUNDLE, code, origin="<gpugate-agent>")
        if cache and may_write and (code is None or set(code) != set(_BUNDLE)):
            write_cache(cache, importer.compile_all())
    else:
        use_the_package()
    from gpugate.agent import main as agent
    from gpugate.agent import state

    state.RUNTIME.update(sha256=found.get("AGENT_SHA256"), file=path, write_cache=may_write,
                         installed_now=bool(found.get("INSTALLED_NOW")), inline=bool(found.get("INLINE")))
    return agent.main(argv, stdin_doc)


if __name__ == "__main__":  # the log pump (``<artifact> logpump``), or by hand from a checkout
    sys.exit(main(sys.argv[1:]))
