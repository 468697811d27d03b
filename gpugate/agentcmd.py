"""The controller's side of the container agent (docs/agent-protocol.md): the agent's one-file
source and hash, and the short shell commands that run it in a container.

The agent (gpugate/agent/, with gpugate/rules/ and the engine's container side: one file made by
gpugate.bundle, a loader and the modules' sources) is installed content-addressed at
``/var/lib/gpugate/agent-<sha256>.py`` by the first ``start`` (its source travels on stdin). Every
command runs a small bootstrap that checks the installed file's hash; a missing or different file
answers ``{"agent_missing": true}`` (observe, follow) so the controller can observe once with the
agent inline (read-only) and install it with the hand-off.

Example::

    from gpugate import agentcmd
    ok, out = host.run_shell_command(agentcmd.observe_command("/usr/bin/python3", {"port": 30000}))
    doc = agentcmd.parse_output(out.stdout_lines)
    if doc.get("agent_missing"):
        ok, out = host.run_shell_command(agentcmd.inline_observe_command("/usr/bin/python3", {"port": 30000}))
        doc = agentcmd.parse_output(out.stdout_lines)
    command = agentcmd.start_command("/usr/bin/python3")
    stdin = agentcmd.start_stdin({"run": "r1", "desired": spec_doc, ...}, include_source=doc.get("agent_missing"))
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import shlex
from typing import Any, Iterable, Mapping

from gpugate import bundle
from gpugate.remote import pack, parse_probe_output
from gpugate.rules.procfs import PROBE_MARKER
from gpugate.rules.redact import argv_hash, env_hash  # noqa: F401 - the controller hashes exactly as the agent does

STATE_DIR = "/var/lib/gpugate"


@functools.lru_cache(maxsize=1)
def agent_source() -> str:
    """The agent as ONE file: gpugate/agent/loader.py with the sources of every module it runs in
    ``_BUNDLE`` (gpugate.bundle).

    >>> "def observe(" in agent_source()
    True
    """
    return bundle.agent_source()


@functools.lru_cache(maxsize=1)
def agent_sha() -> str:
    """sha256 (hex) of :func:`agent_source` as UTF-8: the installed file's name and check."""
    return hashlib.sha256(agent_source().encode("utf-8")).hexdigest()


def agent_path(sha: str | None = None) -> str:
    """``/var/lib/gpugate/agent-<sha>.py``.

    >>> agent_path("ab12")
    '/var/lib/gpugate/agent-ab12.py'
    """
    return f"{STATE_DIR}/agent-{sha or agent_sha()}.py"


# The bootstrap: checks the installed agent's hash (installs it from the start or install document's
# agent_source when that matches), then runs it from its compiled code, cached content-addressed beside
# it (``__pycache__/agent-<sha>.<cache tag>.code``: the interpreter's magic number, then marshal; the
# loader caches its bundled modules' code likewise, gpugate/agent/loader.py). observe is the converged
# re-run's only command, so every ms counts: no importlib (~3-10 ms), no compile of 200 KB (~20-30 ms).
# Only ``start`` and ``install`` (the commands that install the agent) write the caches; every other
# command reads them when they are there and compiles in memory when not (observe stays read-only).
_BOOT = r'''
import json, os, sys
try:
    from _sha256 import sha256
except ImportError:
    try:
        from _sha2 import sha256
    except ImportError:
        from hashlib import sha256
S = %(sha)r
P = %(path)r
a = sys.argv[1:]
if a and a[-1] == %(marker)r:
    a = a[:-1]
d = n = None
w = a[:1] == ["start"] or a[:1] == ["install"]
if w:
    try:
        d = json.loads(sys.stdin.read() or "null")
    except ValueError as e:
        print(json.dumps({"ok": False, "error": "the %%s document is not JSON: %%s" %% (a[0], e)}))
        sys.exit(0)
try:
    with open(P, "rb") as f:
        b = f.read()
except OSError:
    b = None
if b is None or sha256(b).hexdigest() != S:
    t = d.get("agent_source") if isinstance(d, dict) else None
    if t is None or sha256(t.encode("utf-8")).hexdigest() != S:
        print(json.dumps({"agent_missing": True, "sha256": S, "found": b is not None,
                          "ok": False, "error": "agent %%s is not installed" %% S[:12]}))
        sys.exit(0)
    try:
        os.makedirs(os.path.dirname(P), mode=0o700, exist_ok=True)
        os.chmod(os.path.dirname(P), 0o700)
        tmp = "%%s.tmp.%%d" %% (P, os.getpid())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        v = memoryview(t.encode("utf-8"))
        while v:
            v = v[os.write(fd, v):]
        os.fsync(fd)
        os.close(fd)
        os.replace(tmp, P)
    except OSError as e:
        print(json.dumps({"ok": False, "error": "cannot install the agent at %%s: %%s" %% (P, e)}))
        sys.exit(0)
    b = t.encode("utf-8")
    n = 1
import marshal
try:
    from _frozen_importlib_external import MAGIC_NUMBER as g  # loaded at start-up: free
except ImportError:
    from importlib.util import MAGIC_NUMBER as g
C = "%%s/__pycache__/agent-%%s.%%s.code" %% (os.path.dirname(P), S, sys.implementation.cache_tag)
c = None
try:
    with open(C, "rb") as f:
        x = f.read()
    if x[:len(g)] == g:
        c = marshal.loads(memoryview(x)[len(g):])
except (OSError, ValueError, EOFError, TypeError):
    c = None
if c is None:
    c = compile(b, P, "exec", dont_inherit=True)
    if w:
        try:
            os.makedirs(os.path.dirname(C), mode=0o700, exist_ok=True)
            tmp = "%%s.tmp.%%d" %% (C, os.getpid())
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            v = memoryview(g + marshal.dumps(c))
            while v:
                v = v[os.write(fd, v):]
            os.fsync(fd)
            os.close(fd)
            os.replace(tmp, C)
        except OSError:
            pass
m = type(sys)("gpugate_agent")
m.__file__ = P
sys.modules["gpugate_agent"] = m
m.WRITE_CACHE = w
m.INSTALLED_NOW = n == 1
exec(c, m.__dict__)
m.AGENT_SHA256 = S
sys.exit(m.main(a, d))
'''

_INLINE = r'''
import json, sys, types
m = types.ModuleType("gpugate_agent")
m.__file__ = "<gpugate-agent>"
sys.modules["gpugate_agent"] = m
exec(compile(%(source)r, m.__file__, "exec"), m.__dict__)
m.AGENT_SHA256 = %(sha)r
m.INLINE = True
sys.exit(m.main(["observe", json.dumps(%(args)r)]))
'''


def _interpreter(python: str | None) -> str:
    return shlex.quote(python or "python3")


def _no_python(python: str | None) -> str:
    doc = {"ok": False, "no_python": True, "error": f"no Python interpreter {python or 'python3'} in the container"}
    return shlex.quote(json.dumps(doc, separators=(",", ":")))


@functools.lru_cache(maxsize=1)
def _boot() -> str:
    return pack(_BOOT % {"sha": agent_sha(), "path": agent_path(), "marker": PROBE_MARKER})


def args_word(args: Mapping[str, Any]) -> str:
    """A command's JSON argument for its argv: plain, or ``b64:<base64>`` when it names sglang in any
    case (a model path, ``SGLANG_*`` env names): no gpugate command line, in the container or in the
    host's ``pct exec``, may match an operator's ``pkill -f sglang`` (the agent decodes it).

    >>> args_word({"port": 30000}), args_word({"model_path": "/m/sglang"})
    ('{"port":30000}', 'b64:eyJtb2RlbF9wYXRoIjoiL20vc2dsYW5nIn0=')
    """
    text = json.dumps(dict(args), separators=(",", ":"), sort_keys=True)
    if "sglang" in text.lower():
        return "b64:" + base64.b64encode(text.encode("utf-8")).decode("ascii")
    return text


def _agent_command(python: str | None, command: str, args: Mapping[str, Any] | None) -> str:
    interpreter = _interpreter(python)
    words = [command] + ([args_word(args)] if args is not None else [])
    quoted = " ".join(shlex.quote(word) for word in words)
    # -S: no site/sitecustomize at start (~10-25 ms); the agent adds the site directories itself
    return (f"if command -v {interpreter} >/dev/null 2>&1; then exec {interpreter} -S -c '{_boot()}' {quoted} "
            f"{PROBE_MARKER}; else echo {_no_python(python)}; fi")


def observe_command(python: str | None, args: Mapping[str, Any]) -> str:
    """Run the installed agent's ``observe`` (read-only). Prints the observe document, or
    ``{"agent_missing": true, ...}`` when the agent of this controller is not installed.

    + args: ``{"port": 30000, "env_names": [...], "model_path": "...", "gpus": [...] | None,
      "tail_lines": 0, "generate": False, "secret_flags": [...]}``

    Example::

        observe_command("/usr/bin/python3", {"port": 30000, "env_names": ["HF_TOKEN"]})
    """
    return _agent_command(python, "observe", args)


def inline_observe_command(python: str | None, args: Mapping[str, Any]) -> str:
    """The same observe with the agent sent inline (zlib+base64 in the argv, ~75 KB); installs
    nothing and writes nothing (``--dry`` stays read-only)."""
    script = _INLINE % {"source": bundle.observe_source(), "sha": agent_sha(), "args": dict(args)}
    return (f"if command -v {_interpreter(python)} >/dev/null 2>&1; then exec {_interpreter(python)} "
            f"-c '{pack(script)}' {PROBE_MARKER}; else echo {_no_python(python)}; fi")


def start_command(python: str | None) -> str:
    """The hand-off: reads the start document (:func:`start_stdin`) on stdin, installs the agent
    when the document carries its source, answers ``{"ok": true, "run", "pid", "journal"}`` once
    the detached agent holds the transition lock, or ``{"ok": false, "busy": ...}`` /
    ``{"ok": false, "error": ...}``."""
    return _agent_command(python, "start", None)


def start_stdin(doc: Mapping[str, Any], include_source: bool) -> str:
    """The start document as the text to send on the start command's stdin (it holds secrets:
    never put it in an argv). ``include_source``: the agent is not installed yet (observe said
    ``agent_missing``): the bootstrap installs it from this text, checked by hash.

    + doc: ``{"run", "operator", "desired": SpecDoc | None, "replaces": SpecDoc | None,
      "rollback_to": SpecDoc | {"history": key|index} | {"running": True} | "auto" | None,
      "restart": bool, "budgets": {...}}``
    """
    body = dict(doc)
    body.pop("agent_source", None)
    if include_source:
        body["agent_source"] = agent_source()
    return json.dumps(body, separators=(",", ":"))


def live_command(python: str | None) -> str:
    """A change the engine applies while the server serves (gpugate.agent.live): reads its document on
    stdin (it holds the desired SpecDoc: env values), answers once it is applied and verified, or
    undone: ``{"ok", "run", "pid", "outcome", "error"?, "undone"?}``, or ``{"ok": false, "busy": ...}``."""
    return _agent_command(python, "live", None)


def install_command(python: str | None) -> str:
    """Install this controller's agent and nothing else: reads :func:`install_stdin` on stdin; the
    bootstrap checks the source's hash, writes ``agent-<sha>.py`` (temp, fsync, rename) and its code
    caches, and the agent answers ``{"ok": true, "sha256", "path", "installed": <written now>}``
    without touching anything else (no lock, no journal, no pruning of other agents: one of them
    may be running a transition that this controller is about to follow). A source whose hash is
    not this controller's: ``{"agent_missing": true, ...}``, nothing written.

    Example::

        ok, out = host.run_shell_command(install_command("/usr/bin/python3"), _stdin=install_stdin())
    """
    return _agent_command(python, "install", None)


def install_stdin() -> str:
    """The install command's stdin: ``{"agent_source": <this controller's agent>}`` (~140 KB)."""
    return json.dumps({"agent_source": agent_source()}, separators=(",", ":"))


def canary_record_command(port: int) -> str:
    """Write the canary's record of the server on ``port`` (its JSON on stdin: figures and verdict, no
    secret) where the observe reads it (``/var/lib/gpugate/canary-<port>.json``, 0600, replaced whole).

    >>> canary_record_command(30000)  # doctest: +ELLIPSIS
    'umask 077; mkdir -p /var/lib/gpugate && cat > /var/lib/gpugate/canary-30000.json.tmp && mv -f ...'
    """
    path = f"{STATE_DIR}/canary-{int(port)}.json"
    return f"umask 077; mkdir -p {STATE_DIR} && cat > {path}.tmp && mv -f {path}.tmp {path}"


def follow_command(python: str | None, run: str, offset: int = 0, wait_s: float = 3.0, batch: bool = False) -> str:
    """The run's journal events from byte ``offset``, waiting up to ``wait_s`` for new ones or
    the end: ``{"events", "offset", "active", "ended", "outcome", "reasons", "message"}``.
    ``batch``: answer at the end of the run or after ``wait_s``, with every event of that time (the
    controller's follow loop: one command per ``wait_s``, not one per event)."""
    args: dict[str, Any] = {"run": run, "offset": int(offset), "wait_s": float(wait_s)}
    if batch:
        args["batch"] = True
    return _agent_command(python, "follow", args)


def wait_command(python: str | None, run: str, grace_s: float = 30.0, timeout_s: float | None = None) -> str:
    """Blocks until run ``run`` has ended, or it did not appear within ``grace_s``:
    ``{"run", "appeared", "ended", "outcome"}`` (the host-side GPU lock holder uses it)."""
    args: dict[str, Any] = {"run": run, "grace_s": float(grace_s)}
    if timeout_s is not None:
        args["timeout_s"] = float(timeout_s)
    return _agent_command(python, "wait", args)


def parse_output(stdout_lines: Iterable[str] | str | None) -> dict:
    """The one JSON document an agent command printed (the last line that is a JSON object; a pty
    may add CR, a login shell noise). Never raises: ``{"error": ...}`` when there is none.

    >>> parse_output(['noise', '{"ok": true}'])
    {'ok': True}
    >>> parse_output(["Traceback ..."])["error"]
    'no JSON document in the agent output: Traceback ...'
    """
    if stdout_lines is None:
        return {"error": "no output from the agent"}
    lines = stdout_lines.splitlines() if isinstance(stdout_lines, str) else list(stdout_lines)
    try:
        return parse_probe_output(str(line) for line in lines)
    except ValueError:
        pass
    text = " | ".join(str(line).strip() for line in lines if str(line).strip())
    return {"error": "no JSON document in the agent output: " + (text[-300:] or "(empty)")}
