"""Facts about the SGLang server in a container, read by the container's agent (docs/agent-protocol.md).

``SglangObservation``: everything sglang.server plans from, in ONE command: the server on a port
(main process, tree, strays, clients, health, /get_server_info, live workers, ``serving``), the
running transition and the history of good specs, the GPU probe, and the container (free space,
PID 1, port and GPU holders). The command is a short invocation of the installed agent
(``/var/lib/gpugate/agent-<sha256>.py``); when this controller's agent is not installed it answers
``{"agent_missing": true}`` and ``SglangObservationInline`` observes once with the agent sent
inline (read-only: installs nothing; the hand-off installs it). :func:`observe` does both.

``SglangServer``: the ``sglang`` part alone, with the running argv parsed (``command``).

Read-only, always exit 0; secret values never leave the container (argv and log tails redacted
there, env values as hashes).

**Example:**

.. code:: python

    from gpugate.facts.sglang import SglangServer, observe
    server = host.get_fact(SglangServer, port=30000)
    if server["running"]:
        print(server["main"]["pid"], server["command"]["flags"], server["serving"])
    observation = observe(host, port=30000)   # with the inline fallback

or from the CLI: ``pyinfra inventory.py fact gpugate.facts.sglang.SglangServer port=30000``
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pyinfra.api import FactBase, StringCommand

from gpugate import agentcmd
from gpugate.sglang_args import parse_argv

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


def observe(host: Any, python: str = DEFAULT_PYTHON, **kwargs: Any) -> dict[str, Any]:
    """The observation of ``host``'s container: the installed agent, else once inline. Adds
    ``agent_installed`` (False: the hand-off must carry the agent's source).

    .. code:: python

        observation = observe(host, port=30000, env_names=["HF_TOKEN"])
    """
    doc = host.get_fact(SglangObservation, python=python, **kwargs)
    installed = not doc.get("agent_missing")
    if not installed:
        doc = host.get_fact(SglangObservationInline, python=python, **kwargs)
    doc["agent_installed"] = installed
    return doc
