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

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pyinfra.api import FactBase, StringCommand

from gpugate import agentcmd
from gpugate.engine import DEFAULT_ENGINE, get as engine

DEFAULT_PYTHON = "/usr/bin/python3"


def observe_args(port: int = 30000, env_names: Iterable[str] = (), model_path: str | None = None,
                 gpus: Sequence[int] | None = None, tail_lines: int = 0, generate: bool = False,
                 secret_flags: Iterable[str] = (), host: str | None = None, engine: str | None = None,
                 secret_env: Iterable[str] = ()) -> dict[str, Any]:
    """The agent's ``observe`` arguments (``engine``: whose processes and endpoints it reads;
    none: the default engine; ``secret_env``: the operator's secret env names, masked as the
    pattern list's are).

    >>> observe_args(30001, ["HF_TOKEN"])["port"]
    30001
    """
    args: dict[str, Any] = {"port": int(port), "env_names": sorted(env_names or ()), "tail_lines": int(tail_lines),
                            "generate": bool(generate)}
    if engine and engine != DEFAULT_ENGINE:
        args["engine"] = engine
    if model_path:
        args["model_path"] = model_path
    if gpus is not None:
        args["gpus"] = [int(gpu) for gpu in gpus]
    if secret_flags:
        args["secret_flags"] = sorted(secret_flags)
    if secret_env:
        args["secret_env"] = sorted(secret_env)
    if host:
        args["host"] = host
    return args


def with_command(server: dict[str, Any]) -> dict[str, Any]:
    """Add ``command``: the running (redacted) argv parsed into model path, host, port and flags."""
    main = server.get("main")
    if main and main.get("argv"):
        parsed = engine(server.get("engine") or DEFAULT_ENGINE).read_running(main["argv"])
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


class _Observe:
    """The observe facts' one command signature (pyinfra reads it: getcallargs; a fact's
    arguments must be named): the agent's observe arguments (observe_args) and the interpreter.
    Each fact says only which program carries them (``program``)."""

    program: Callable[[str | None, Mapping[str, Any]], str] = staticmethod(agentcmd.observe_command)

    def command(self, port: int = 30000, env_names: Iterable[str] = (), model_path: str | None = None,
                gpus: Sequence[int] | None = None, tail_lines: int = 0, generate: bool = False,
                python: str = DEFAULT_PYTHON, secret_flags: Iterable[str] = (), host: str | None = None,
                engine: str | None = None, secret_env: Iterable[str] = ()) -> StringCommand:
        return StringCommand(self.program(python, observe_args(port, env_names, model_path, gpus, tail_lines, generate,
                                                               secret_flags, host, engine, secret_env)))


class SglangObservation(_Observe, FactBase):
    """``{"sglang", "gpu", "container", "agent"}`` in one round trip (the installed agent's
    observe), or ``{"agent_missing": true}`` (then: ``SglangObservationInline``)."""

    @staticmethod
    def default() -> dict[str, Any]:
        return {"error": "no answer", "sglang": {"running": False, "error": "no answer"}, "gpu": {"error": "no answer"},
                "container": {}}

    def process(self, output) -> dict[str, Any]:
        return process_observation(output)


class SglangObservationInline(SglangObservation):
    """The same observation with the agent sent inline (~45 KB argv): for a container where this
    controller's agent is not installed yet. Installs and writes nothing (``--dry`` stays read-only)."""

    program = staticmethod(agentcmd.inline_observe_command)


class SglangServer(_Observe, FactBase):
    """The server on ``port`` (the observation's ``sglang`` part, ``command`` parsed)."""

    # The inline agent: a fact read on its own (the CLI, a runbook) must answer without an install.
    program = staticmethod(agentcmd.inline_observe_command)

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

    program = staticmethod(observe_once_command)


# ---------------------------------------------------------------- the engine's own flag table (issue 13)
def flag_table_command(python: str = DEFAULT_PYTHON, known: Sequence[str] = (), build: bool = True,
                       engine_name: str = DEFAULT_ENGINE) -> str:
    """One command that reads (or builds) the engine's own flag table in the container."""
    return engine(engine_name).table_command(python, known, build) or "true"


class SglangFlagTable(FactBase):
    """SGLang's own flag table for the SGLang installed in the container (gpugate/engine/sglang/table_builder.py):
    ``{"version", "server_args_sha256", "key", "cached", "built", "build_s", "table"?, "error"?}``.

    ``known``: table keys the controller already has (shipped snapshots, its own cache): such a table
    is not sent again. ``build``: False only reads (version, key, and whether a cached table exists).

    Read-only but for ONE write, on purpose: the first time a version is seen, the table is built
    (importing ``sglang.srt.server_args``, which pulls torch: seconds to a minute) and cached in
    ``/var/lib/gpugate/sglang-flags/<version>-<sha>.json``, so that no later plan pays for it again.
    The cache is derived data (deleting it costs one rebuild); nothing the server reads.
    docs/flags.md says why this is the one exception to "facts write nothing".
    """

    def command(self, python: str = DEFAULT_PYTHON, known: Sequence[str] = (), build: bool = True,
                command_text: str | None = None, engine_name: str = DEFAULT_ENGINE):
        return StringCommand(command_text or flag_table_command(python, known, build, engine_name))

    @staticmethod
    def default() -> dict[str, Any]:
        return {"schema": 1, "version": None, "error": "no answer"}

    def process(self, output) -> dict[str, Any]:
        try:
            return agentcmd.parse_output(list(output))
        except Exception as exc:  # noqa: BLE001 -- a fact answers, it does not raise
            return {"schema": 1, "version": None, "error": f"no JSON from the table builder: {exc}"}


def flag_table(host: Any, python: str = DEFAULT_PYTHON, say=None, run=None,
               observation: Mapping[str, Any] | None = None, engine_name: str = DEFAULT_ENGINE
               ) -> Mapping[str, Any] | None:
    """The container's flag table document for the engine (gpugate.engine.Engine.fetch_table), in the
    fewest commands. ``run``: a function running a command in the container and returning its JSON
    answer (the operation's own runner); default the SglangFlagTable fact.

    .. code:: python

        doc = flag_table(host, say=host.log)
        table, note = engine("sglang").choose_table(doc, pinned="0.5.23")
    """
    def fact_run(command: str) -> Mapping[str, Any]:
        return host.get_fact(SglangFlagTable, python=python, command_text=command)

    return engine(engine_name).fetch_table(run or fact_run, python, observation, say)
