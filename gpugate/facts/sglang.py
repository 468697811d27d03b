"""Facts about the SGLang server in a container.

``SglangServer``: the server on a port (running or not, main pid, process tree, argv and parsed
flags actually running, health, /get_server_info subset, recorded state, lock, stray SGLang
processes, stale /dev/shm segments, the container's memory).
``SglangObservation``: the same plus the GPU probe, in ONE remote command (the operation's
observe step).

Both are read-only and exit 0; the probe is sent inline (gpugate/remote/*.py), nothing is installed.

**Example:**

.. code:: python

    from gpugate.facts.sglang import SglangServer
    server = host.get_fact(SglangServer, port=30000)
    if server["running"]:
        print(server["main"]["pid"], server["command"]["flags"])

or from the CLI: ``pyinfra inventory.py fact gpugate.facts.sglang.SglangServer port=30000``
"""

from __future__ import annotations

from typing import Any, Optional, TypedDict

from pyinfra.api import FactBase

from gpugate import remote
from gpugate.remote import build_probe_command
from gpugate.sglang_args import parse_argv
from gpugate.transition import paths


class ProcessInfo(TypedDict):
    pid: int
    ppid: int
    pgid: int
    state: str
    cmdline: str


class MainProcess(TypedDict):
    pid: int
    pgid: int
    argv: list[str]
    state: str
    age_s: float


class RunningCommand(TypedDict):
    model_path: Optional[str]
    host: str
    port: int
    flags: dict[str, Any]
    unknown: list[str]


class SglangServerDoc(TypedDict, total=False):
    port: int
    running: bool
    main: Optional[MainProcess]
    command: Optional[RunningCommand]  # argv parsed with gpugate.sglang_args.parse_argv
    tree: list[ProcessInfo]           # main process first, then every descendant
    strays: list[ProcessInfo]         # SGLang processes outside the tree (orphaned workers...)
    pid_file_pid: Optional[int]
    listening: bool
    listener_pids: list[int]
    health: dict[str, Any]            # health, health_error, health_generate, health_generate_error
    server_info: Optional[dict[str, Any]]
    env_hashes: dict[str, Optional[str]]
    state: Optional[dict[str, Any]]   # /var/lib/gpugate/sglang-<port>.json (no secrets)
    previous_argv_saved: bool         # the previous server's exact argv is kept (0600) for a rollback
    lock: Optional[dict[str, Any]]    # /run/gpugate/sglang-<port>.lock
    shm_stale: list[str]
    memory_limit_bytes: Optional[int]
    model_path_exists: Optional[bool]
    log_tail: Optional[list[str]]
    error: str


def probe_kwargs(port: int, env_names=(), model_path: str | None = None, tail_lines: int = 0,
                 generate: bool = False) -> dict[str, Any]:
    """The server probe's keyword arguments (``sglang_probe.collect``) for ``port``; the facts and
    the transition's in-command looks (``transition_actions.observe``) use the same ones."""
    files = paths(port)
    return {"port": int(port), "pid_file": files["pid"], "state_file": files["state"], "lock_file": files["lock"],
            "log_file": files["log"], "env_names": sorted(env_names or ()), "model_path": model_path,
            "tail_lines": int(tail_lines), "generate": bool(generate), "previous_argv_file": files["previous_argv"]}


def probe_command(sections: dict[str, dict[str, Any]], python: str = "/usr/bin/python3") -> str:
    """One command printing one JSON document ``{section: <section>_probe.collect(**kwargs)}``
    (``sglang``, ``gpu``), run by ``python`` in the container (gpugate.remote.build_probe_command:
    the same loader as every inline command). Always exits 0."""
    return build_probe_command(sections, python=python)


def parse_probe_output(output: list[str]) -> dict[str, Any]:
    """The probe's JSON document, or ``{"error": ...}`` naming what it printed instead."""
    try:
        return remote.parse_probe_output(output)
    except ValueError:
        return {"error": "the probe printed no JSON: " + " | ".join(output[-5:])[:500]}


def with_command(server: dict[str, Any]) -> dict[str, Any]:
    """Add ``command``: the running argv parsed into model path, host, port and flags."""
    main = server.get("main")
    if main:
        parsed = parse_argv(main["argv"])
        server["command"] = {"model_path": parsed.model_path, "host": parsed.host, "port": parsed.port,
                             "flags": parsed.flags, "unknown": parsed.unknown}
    else:
        server["command"] = None
    return server


class SglangServer(FactBase):
    """The SGLang server on ``port`` in the container (see the module docstring)."""

    def command(self, port: int = 30000, env_names=(), model_path: str | None = None, tail_lines: int = 0,
                generate: bool = False, python: str = "/usr/bin/python3"):
        return probe_command({"sglang": probe_kwargs(port, env_names, model_path, tail_lines, generate)}, python)

    @staticmethod
    def default() -> SglangServerDoc:
        return {"running": False, "error": "no probe output"}

    def process(self, output) -> SglangServerDoc:
        doc = parse_probe_output(list(output))
        if "sglang" not in doc:
            return {"running": False, "error": doc.get("error", "no sglang section")}
        return with_command(doc["sglang"])


class SglangObservation(FactBase):
    """``{"sglang": SglangServerDoc, "gpu": <GPU probe document>}`` in one round trip."""

    def command(self, port: int = 30000, env_names=(), model_path: str | None = None, tail_lines: int = 0,
                python: str = "/usr/bin/python3"):
        return probe_command({"sglang": probe_kwargs(port, env_names, model_path, tail_lines),
                              "gpu": {}}, python)

    @staticmethod
    def default() -> dict[str, Any]:
        return {"sglang": {"running": False, "error": "no probe output"}, "gpu": {"error": "no probe output"}}

    def process(self, output) -> dict[str, Any]:
        doc = parse_probe_output(list(output))
        if "error" in doc and "sglang" not in doc:
            return {"sglang": {"running": False, "error": doc["error"]}, "gpu": {"error": doc["error"]}}
        if "sglang" in doc and "error" not in doc["sglang"]:
            with_command(doc["sglang"])
        return doc
