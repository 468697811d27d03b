"""Code that runs inside containers, sent inline as ONE shell command (never installed).

Each probe section is a stdlib-only module with a ``collect(**kwargs)`` function returning a
JSON-able dict: ``gpu`` is gpugate/agent/gpu_probe.py, any other ``<name>`` is
``gpugate/remote/<name>_probe.py``. The gpugate modules they import (gpugate.rules...) travel with
them as a bundle (gpugate.bundle: the agent's loader with those sources), imported in the container
under their own names, as the agent's artifact does. ``build_probe_command`` combines any of them
into one command that prints one JSON document ``{"<name>": collect(**kwargs), ...}`` and exits 0, so one fact (one
SSH round trip, one ``pct exec``) can read several things at once.

The command needs nothing in the container but ``python3`` (found on PATH=/sbin:/bin:/usr/sbin:/usr/bin);
without it, every section reads ``{"schema": 1, "error": ..., "errors": [{"kind": "NoPython"...}]}``.
The sources travel zlib-compressed and base64-encoded in a single-quoted ``python3 -c`` argument
(nothing in it needs shell quoting); the probe process has argv[-1] == ``gpugate-probe`` so probes
can tell each other apart from real GPU users.

Example (the command's run is skipped by the suite: it needs a container)::

    >>> from gpugate.remote import build_probe_command, parse_probe_output
    >>> command = build_probe_command({"gpu": {}})
    >>> ok, output = host.run_shell_command(command)  # doctest: +SKIP
    >>> parse_probe_output(output.stdout_lines)["gpu"]["gpus"][0]["used_mib"]  # doctest: +SKIP
    0
"""

from __future__ import annotations

import base64
import json
import shlex
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

from gpugate import bundle
from gpugate.rules.procfs import PROBE_MARKER

REMOTE_DIR = Path(__file__).resolve().parent
PACKAGE_DIR = REMOTE_DIR.parent
# Probe sections that are modules of the package elsewhere than gpugate/remote/<name>_probe.py.
SECTION_MODULES = {"gpu": "gpugate.agent.gpu_probe"}

# Runs first inside the container: loads the inlined modules under their own names (so dataclasses
# and pickling-free code work as in a normal import), and prints exactly one JSON line.
_PRELUDE = r'''
import json, os, sys, types
def _load(name, source):
    module = types.ModuleType(name)
    module.__file__ = "<gpugate:%s>" % name
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module
def _bundle(source):
    # gpugate/agent/loader.py with the gpugate modules the sections import: served first on sys.meta_path
    loader = _load("gpugate_bundle", source)
    loader.install(loader._BUNDLE)
def _failure(exc):
    text = "%s: %s" % (type(exc).__name__, exc)
    return {"schema": 1, "error": text,
            "errors": [{"source": "probe", "kind": type(exc).__name__, "message": text[:500]}]}
def _emit(document):
    try:
        sys.stdout.write(json.dumps(document, separators=(",", ":"), default=str) + "\n")
        sys.stdout.flush()
    finally:
        # A thread stuck in a driver call (D state) would keep this process, and so our stdout,
        # alive: close stdout and leave at once so the caller gets its answer.
        try:
            os.close(1)
        except OSError:
            pass
        os._exit(0)
'''


def module_source(name: str) -> str:
    """The source of probe section ``name``: ``gpugate/remote/<name>_probe.py``, else the package
    module that SECTION_MODULES names for it."""
    path = REMOTE_DIR / f"{name}_probe.py"
    if not path.is_file() and name in SECTION_MODULES:
        path = bundle.module_path(SECTION_MODULES[name])
    if not path.is_file():
        raise ValueError(f"no probe section {name!r}: {path} does not exist")
    return path.read_text()


def bundle_line(sources: Iterable[str] = (), modules: Iterable[str] = ()) -> str:
    """The program line that serves the gpugate modules these ``sources`` import (and ``modules``)
    in the container, by gpugate/agent/loader.py's finder."""
    names: set[str] = set(modules)
    for source in sources:
        names |= bundle.gpugate_imports(source)
    return f"_bundle({bundle.loader_source(bundle.with_imports(tuple(sorted(names))))!r})\n"


def pack(script: str) -> str:
    """``script`` as a ``python -c`` program: zlib+base64, so that nothing in it needs quoting
    through ssh's, pct's and sh's layers (the one loader every inline command uses)."""
    payload = base64.b64encode(zlib.compress(script.encode(), 9)).decode()
    # binascii (a builtin module), not base64: base64's import (re, struct) is ~2-10 ms of every command
    return f'import binascii,zlib;exec(zlib.decompress(binascii.a2b_base64("{payload}")))'


def inline_program(modules: Mapping[str, str], body: str) -> str:
    """A script that registers ``modules`` (name -> source) as importable modules, in order, then
    runs ``body`` (with ``_load``, ``_failure`` and ``_emit`` of the prelude at hand)."""
    loads = "".join(f"_load({name!r}, {source!r})\n" for name, source in modules.items())
    return _PRELUDE + loads + body


def python_command(script: str, fallback: Mapping, python: str | None = None) -> str:
    """One POSIX shell command running ``script`` with the container's ``python`` (default:
    python3 on PATH); when there is none it prints ``fallback`` as JSON instead. Exits 0 either way
    (when python runs, the script's own exit status)."""
    boot = pack(script)
    fallback_json = json.dumps(fallback, separators=(",", ":"))
    if "'" in fallback_json:
        raise ValueError("fallback JSON must not contain single quotes")
    interpreter = shlex.quote(python) if python else "python3"
    return (
        f"if command -v {interpreter} >/dev/null 2>&1; "
        f"then exec {interpreter} -c '{boot}' {PROBE_MARKER}; "
        f"else echo '{fallback_json}'; fi"
    )


def no_python(names: Iterable[str]) -> dict:
    error = {"source": "probe", "kind": "NoPython", "message": "python3 not found in the container"}
    return {name: {"schema": 1, "error": error["message"], "errors": [error]} for name in names}


def build_probe_command(sections: Mapping[str, Mapping], python: str | None = None) -> str:
    """One shell command that prints ``{"<name>": <name>_probe.collect(**kwargs), ...}``.

    + sections: section name -> keyword arguments for that probe's ``collect`` (JSON-able);
      e.g. ``{"gpu": {}, "sglang": {"port": 30000}}``. A section whose collect raises reads
      ``{"schema": 1, "error": "...", "errors": [...]}``; the others are unaffected.
    + python: the interpreter in the container (default: python3 on PATH)

    Example::

        build_probe_command({"gpu": {"scope": "host"}})
    """
    if not sections:
        raise ValueError("build_probe_command needs at least one section")
    sources = {name: module_source(name) for name in sections}
    plan = [[name, dict(kwargs)] for name, kwargs in sections.items()]
    script = _PRELUDE + bundle_line(sources.values()) + (
        f"SOURCES = {sources!r}\n"
        f"PLAN = json.loads({json.dumps(plan)!r})\n"
        "out = {}\n"
        "for name, kwargs in PLAN:\n"
        "    try:\n"
        "        out[name] = _load('gpugate_remote_' + name, SOURCES[name]).collect(**kwargs)\n"
        "    except BaseException as exc:\n"
        "        out[name] = _failure(exc)\n"
        "_emit(out)\n"
    )
    return python_command(script, no_python(sections), python)


def build_wait_command(max_used_mib: int = 64, timeout_s: float = 120.0,
                       poll_interval_s: float = 0.05, ignore_pids: Iterable[int] = ()) -> str:
    """One shell command that polls the GPUs INSIDE the container until the gate passes or the
    timeout is over, then prints ``{"gpu": <last GpuState document>, "wait": {...}}`` (see
    gpugate.gate.poll_until_idle). NVML stays initialised between polls.

    Example::

        build_wait_command(max_used_mib=64, timeout_s=120, poll_interval_s=0.05)
    """
    arguments = {
        "max_used_mib": int(max_used_mib),
        "timeout_s": float(timeout_s),
        "poll_interval_s": float(poll_interval_s),
        "ignore_pids": [int(pid) for pid in ignore_pids],
    }
    script = _PRELUDE + bundle_line(modules=["gpugate.agent.gpu_probe", "gpugate.gate"]) + (
        f"ARGS = json.loads({json.dumps(arguments)!r})\n"
        "try:\n"
        "    from gpugate import gate\n"
        "    from gpugate.agent import gpu_probe as probe\n"
        "    out = gate.poll_until_idle(lambda: probe.collect(keep_nvml_open=True), **ARGS)\n"
        "except BaseException as exc:\n"
        "    out = {'gpu': _failure(exc), 'wait': None}\n"
        "_emit(out)\n"
    )
    return python_command(script, {**no_python(["gpu"]), "wait": None})


def build_end_holders_command(grace_s: float = 10.0, ignore_pids: Iterable[int] = ()) -> str:
    """One shell command that ends the GPU holders of the pid namespace it runs in (the container's,
    through @pct): SIGTERM, up to ``grace_s`` for them to exit, then SIGKILL. Never pid 1 or the
    command itself. Prints ``{"kill": gpu_probe.end_holders(...)}``.

    Example::

        build_end_holders_command(grace_s=10)
    """
    arguments = {"grace_s": float(grace_s), "ignore_pids": [int(pid) for pid in ignore_pids]}
    script = _PRELUDE + bundle_line(modules=["gpugate.agent.gpu_probe"]) + (
        f"ARGS = json.loads({json.dumps(arguments)!r})\n"
        "try:\n"
        "    from gpugate.agent import gpu_probe\n"
        "    out = {'kill': gpu_probe.end_holders(**ARGS)}\n"
        "except BaseException as exc:\n"
        "    out = {'kill': _failure(exc)}\n"
        "_emit(out)\n"
    )
    return python_command(script, no_python(["kill"]))


def parse_probe_output(lines: Iterable[str]) -> dict:
    """The JSON document printed by one of the commands above: the last line that is a JSON object
    (a pty may add CR, a login shell may print noise first). Raises ValueError when there is none."""
    for line in reversed([line.strip() for line in lines]):
        if line.startswith("{"):
            try:
                document = json.loads(line)
            except ValueError:
                continue
            if isinstance(document, dict):
                return document
    raise ValueError("no JSON document in the probe's output")
