"""Facts about the SGLang server in a container, read by the container's agent (docs/agent-protocol.md).

``SglangObservation``: everything sglang.server plans from, in ONE command: the server on a port
(main process, tree, strays, clients, health, /get_server_info, live workers, ``serving``), the
running transition and the history of good specs, the GPU probe, and the container (free space,
PID 1, port and GPU holders). The command is a short invocation of the installed agent
(``/var/lib/gpugate/agent-<sha256>.py``); when this controller's agent is not installed it answers
``{"agent_missing": true}`` and ``SglangObservationInline`` observes once with the agent sent
inline (read-only: installs nothing; the hand-off installs it). ``SglangObservationOnce`` does
both in one command (the status's).

``SglangServer``: the ``sglang`` part alone, with the running argv parsed (``command``).

Read-only, always exit 0; secret values never leave the container (argv and log tails redacted
there, env values as hashes).

**Example:**

.. code:: python

    from gpugate.facts.sglang import SglangObservationOnce, SglangServer
    server = host.get_fact(SglangServer, port=30000)
    if server["running"]:
        print(server["main"]["pid"], server["command"]["flags"], server["serving"])
    observation = host.get_fact(SglangObservationOnce, port=30000)   # with the inline fallback

or from the CLI: ``pyinfra inventory.py fact gpugate.facts.sglang.SglangServer port=30000``
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pyinfra.api import FactBase, StringCommand

from gpugate import agentcmd
from gpugate.engine.sglang.flags import parse_argv

DEFAULT_PYTHON = "/usr/bin/python3"


def observe_args(port: int = 30000, env_names: Iterable[str] = (), model_path: str | None = None,
                 gpus: Sequence[int] | None = None, tail_lines: int = 0, generate: bool = False,
                 secret_flags: Iterable[str] = (), host: str | None = None) -> dict[str, Any]:
    """The agent's ``observe`` arguments.

    >>> observe_args(30001, ["HF_TOKEN"])["port"]
    30001
    """
    args: dict[str, Any] = {"port": int(port), "env_names": sorted(env_names or ()), "tail_lines": int(tail_lines),
                            "generate": bool(generate)}
    if model_path:
        args["model_path"] = model_path
    if gpus is not None:
        args["gpus"] = [int(gpu) for gpu in gpus]
    if secret_flags:
        args["secret_flags"] = sorted(secret_flags)
    if host:
        args["host"] = host
    return args


def with_command(server: dict[str, Any]) -> dict[str, Any]:
    """Add ``command``: the running (redacted) argv parsed into model path, host, port and flags."""
    main = server.get("main")
    if main and main.get("argv"):
        parsed = parse_argv(main["argv"])
        server["command"] = {"model_path": parsed.model_path, "host": parsed.host, "port": parsed.port,
                             "flags": parsed.flags, "unknown": parsed.unknown}
    else:
        server["command"] = None
    return server


def process_observation(lines: Iterable[str]) -> dict[str, Any]:
    """The observe document from the agent's output (``{"error": ...}`` sections when it printed
    none; ``{"agent_missing": true, ...}`` passed through)."""
    return observation_from(agentcmd.parse_output(list(lines)))


def observation_from(doc: dict[str, Any]) -> dict[str, Any]:
    """:func:`process_observation` for an answer already parsed (``agentcmd.parse_output``)."""
    if doc.get("agent_missing") or doc.get("no_python"):
        return doc
    if "sglang" not in doc:
        error = doc.get("error") or "no sglang section in the agent's answer"
        return {"error": error, "sglang": {"running": False, "error": error}, "gpu": {"error": error}, "container": {}}
    if isinstance(doc["sglang"], dict) and "error" not in doc["sglang"]:
        with_command(doc["sglang"])
    return doc


class SglangObservation(FactBase):
    """``{"sglang", "gpu", "container", "agent"}`` in one round trip (the installed agent's
    observe), or ``{"agent_missing": true}`` (then: ``SglangObservationInline``)."""

    def command(self, port: int = 30000, env_names=(), model_path: str | None = None, gpus=None,
                tail_lines: int = 0, generate: bool = False, python: str = DEFAULT_PYTHON, secret_flags=(),
                host: str | None = None):
        return StringCommand(agentcmd.observe_command(python, observe_args(
            port, env_names, model_path, gpus, tail_lines, generate, secret_flags, host)))

    @staticmethod
    def default() -> dict[str, Any]:
        return {"error": "no answer", "sglang": {"running": False, "error": "no answer"}, "gpu": {"error": "no answer"},
                "container": {}}

    def process(self, output) -> dict[str, Any]:
        return process_observation(output)


class SglangObservationInline(SglangObservation):
    """The same observation with the agent sent inline (~45 KB argv): for a container where this
    controller's agent is not installed yet. Installs and writes nothing (``--dry`` stays read-only)."""

    def command(self, port: int = 30000, env_names=(), model_path: str | None = None, gpus=None,
                tail_lines: int = 0, generate: bool = False, python: str = DEFAULT_PYTHON, secret_flags=(),
                host: str | None = None):
        return StringCommand(agentcmd.inline_observe_command(python, observe_args(
            port, env_names, model_path, gpus, tail_lines, generate, secret_flags, host)))


class SglangServer(FactBase):
    """The SGLang server on ``port`` (the observation's ``sglang`` part, ``command`` parsed)."""

    def command(self, port: int = 30000, env_names=(), model_path: str | None = None, tail_lines: int = 0,
                generate: bool = False, python: str = DEFAULT_PYTHON):
        # The inline agent: a fact read on its own (the CLI, a runbook) must answer without an install.
        return StringCommand(agentcmd.inline_observe_command(python, observe_args(
            port, env_names, model_path, None, tail_lines, generate)))

    @staticmethod
    def default() -> dict[str, Any]:
        return {"running": False, "error": "no answer"}

    def process(self, output) -> dict[str, Any]:
        doc = process_observation(output)
        server = doc.get("sglang")
        if not isinstance(server, dict):
            return {"running": False, "error": doc.get("error") or "no sglang section"}
        return server


def observe_once_command(python: str | None, args: Mapping[str, Any]) -> str:
    """ONE remote command for the agent's observe: the installed agent, and in the same shell, when
    it answers ``agent_missing``, the agent sent inline (read-only). The status pays one round trip
    per container whether or not a deploy installed the agent there.

    >>> "agent_missing" in observe_once_command("/usr/bin/python3", {"port": 30000})
    True
    """
    installed = agentcmd.observe_command(python, args)
    inline = agentcmd.inline_observe_command(python, args)
    return (f"out=$({installed}); case \"$out\" in *'\"agent_missing\"'*) {inline} ;; "
            f"*) printf '%s\\n' \"$out\" ;; esac")


class SglangObservationOnce(SglangObservation):
    """The agent's observation in one command (observe_once_command): the status's fact, asked
    what the deploy asks (``gpugate.spec.Desired.observe_args``), so both see the same."""

    def command(self, port: int = 30000, env_names=(), model_path: str | None = None, gpus=None,
                tail_lines: int = 0, generate: bool = False, python: str = DEFAULT_PYTHON, secret_flags=(),
                host: str | None = None):
        return StringCommand(observe_once_command(python, observe_args(
            port, env_names, model_path, gpus, tail_lines, generate, secret_flags, host)))


# ---------------------------------------------------------------- SGLang's own flag table (issue 13)
def flag_table_command(python: str = DEFAULT_PYTHON, known: Sequence[str] = (), build: bool = True,
                       cache_dir: str | None = None) -> str:
    """One command: gpugate/remote/flag_table.py sent inline, ``collect(...)`` printed as JSON."""
    import json  # noqa: PLC0415

    from gpugate.remote import REMOTE_DIR, inline_program, python_command  # noqa: PLC0415
    from gpugate.remote import flag_table  # noqa: PLC0415

    args = {"cache_dir": cache_dir or flag_table.CACHE_DIR, "known": sorted(known), "build_if_missing": bool(build)}
    body = (f"ARGS = json.loads({json.dumps(json.dumps(args))})\n"
            "try:\n"
            "    out = sys.modules['gpugate_flag_table'].collect(**ARGS)\n"
            "except BaseException as exc:\n"
            "    out = _failure(exc)\n"
            "_emit(out)\n")
    script = inline_program({"gpugate_flag_table": (REMOTE_DIR / "flag_table.py").read_text()}, body)
    return python_command(script, {"schema": 1, "version": None, "error": "python not found in the container"},
                          python)


class SglangFlagTable(FactBase):
    """SGLang's own flag table for the SGLang installed in the container (gpugate/remote/flag_table.py):
    ``{"version", "server_args_sha256", "key", "cached", "built", "build_s", "table"?, "error"?}``.

    ``known``: table keys the controller already has (shipped snapshots, its own cache): such a table
    is not sent again. ``build``: False only reads (version, key, and whether a cached table exists).

    Read-only but for ONE write, on purpose: the first time a version is seen, the table is built
    (importing ``sglang.srt.server_args``, which pulls torch: seconds to a minute) and cached in
    ``/var/lib/gpugate/sglang-flags/<version>-<sha>.json``, so that no later plan pays for it again.
    The cache is derived data (deleting it costs one rebuild); nothing the server reads.
    docs/flags.md says why this is the one exception to "facts write nothing".
    """

    def command(self, python: str = DEFAULT_PYTHON, known: Sequence[str] = (), build: bool = True):
        return StringCommand(flag_table_command(python, known, build))

    @staticmethod
    def default() -> dict[str, Any]:
        return {"schema": 1, "version": None, "error": "no answer"}

    def process(self, output) -> dict[str, Any]:
        try:
            return agentcmd.parse_output(list(output))
        except Exception as exc:  # noqa: BLE001 -- a fact answers, it does not raise
            return {"schema": 1, "version": None, "error": f"no JSON from the table builder: {exc}"}


def flag_table(host: Any, python: str = DEFAULT_PYTHON, say=None, run=None,
               observation: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The container's flag table document (the SglangFlagTable fact), in the fewest commands: a read
    first; when no table is cached for the installed version, ``say`` is told
    "building SGLang's flag table in the container (first time for <version>)" and the build runs.
    A table received is kept in the controller's cache (gpugate.engine.sglang.flags.remember_table), so that
    later runs tell the container not to send it again. ``run``: a function running a command in
    the container and returning its JSON answer (the operation's own runner); default the fact.
    ``observation``: the agent's observe document; when its ``sglang.flag_table`` names a table this
    controller has, no command is sent at all (the converged re-run stays at one command per container).

    .. code:: python

        doc = flag_table(host, say=host.log)
        table, note = sglang_args.choose_table(doc, pinned="0.5.23")
    """
    from gpugate.engine.sglang import flags as sglang_args  # noqa: PLC0415

    known = sglang_args.known_table_keys()
    seen = ((observation or {}).get("sglang") or {}).get("flag_table") or {}
    if isinstance(seen, dict) and seen.get("key") and seen["key"] in known:
        # observe named it (the same key the table builder gives): what read(False) would answer
        doc = {"schema": 1, "version": seen.get("version"), "server_args_sha256": seen.get("server_args_sha256"),
               "key": seen["key"], "cached": bool(seen.get("cached")), "built": False, "build_s": None}
        cached = sglang_args.cached_table_doc(seen["key"])
        return dict(doc, table=cached) if cached is not None else doc

    def read(build: bool) -> dict[str, Any]:
        if run is None:
            return host.get_fact(SglangFlagTable, python=python, known=known, build=build)
        return run(flag_table_command(python, known, build))

    doc = read(False)
    if doc.get("key") in known and not doc.get("table"):  # the controller has it: no build, no transfer
        doc = {key: value for key, value in doc.items() if key != "error"}
        cached = sglang_args.cached_table_doc(doc["key"])
        return dict(doc, table=cached) if cached is not None else doc
    if not doc.get("cached") and doc.get("key") and "no cached table" in str(doc.get("error") or ""):
        if say is not None:
            say(f"building SGLang's flag table in the container (first time for {doc.get('version')})")
        doc = read(True)
    if doc.get("table"):
        sglang_args.remember_table(doc["table"])
    elif doc.get("key") and not doc.get("error"):
        cached = sglang_args.cached_table_doc(doc["key"])
        if cached is not None:
            doc = dict(doc, table=cached)
    return doc
