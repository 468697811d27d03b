"""The sglang.server transition as pure logic: the desired spec, the comparison with what runs,
the checks that must pass before anything is stopped, the plan, and the remote calls' commands.

Nothing here talks to a host: ``gpugate.operations.sglang`` feeds it probe documents and runs
the commands it builds, so that most behaviour is tested without a network.

Example:

.. code:: python

    spec = desired_spec(model_path="/opt/models/m", port=30000, flags={"tp": 8}, env={"HF_TOKEN": "x"})
    change = compare(observation["sglang"], spec)   # Change(action="restart", flag_lines=[...], ...)
    problems = preflight(observation, spec, max_used_mib=64)   # [] or why a restart must not begin
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Mapping

from pyinfra.api import QuoteString, StringCommand

from gpugate.remote import inline_program, pack, parse_probe_output, sglang_probe
from gpugate.sglang_args import (SECRET_MASK, SPECS, FlagError, diff_flags, parse_argv, redact_argv, render_argv,
                                 validate_flags)

REMOTE_DIR = Path(__file__).parent / "remote"
SUPERVISORS = ("process", "systemd")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Names whose values are never shown, even in a diff (all env values are hidden anyway).
MASK = "***"


class SpecError(ValueError):
    """Bad desired state: raised before anything is touched."""


def paths(port: int) -> dict[str, str]:
    """The files sglang.server owns in a container (docs/architecture.md)."""
    return {
        "env": f"/etc/gpugate/sglang-{port}.env",
        # the desired env file, written (0600) with the lock, moved into place just before the start
        "staged_env": f"/etc/gpugate/sglang-{port}.env.next",
        "state": f"/var/lib/gpugate/sglang-{port}.json",
        # The exact argv and env file of the server a rollback returns to (0600; secrets live only
        # here and in the env file): "previous" = before the last change, "undo" = what a
        # restore_previous replaced (its own rollback if the restored server fails).
        "previous_argv": f"/var/lib/gpugate/sglang-{port}.previous.argv",
        "previous_env": f"/etc/gpugate/sglang-{port}.env.previous",
        "undo_argv": f"/var/lib/gpugate/sglang-{port}.undo.argv",
        "undo_env": f"/etc/gpugate/sglang-{port}.env.undo",
        "log": f"/var/log/gpugate/sglang-{port}.log",
        "pid": f"/run/gpugate/sglang-{port}.pid",
        "lock": f"/run/gpugate/sglang-{port}.lock",
        "unit": f"/etc/systemd/system/sglang-{port}.service",
        "unit_name": f"sglang-{port}.service",
    }


@dataclasses.dataclass
class Spec:
    """One desired (or recorded) server: what runs, how, with what environment."""

    model_path: str
    port: int
    flags: dict[str, Any]
    env: dict[str, str]
    supervisor: str = "process"
    python: str = "/usr/bin/python3"

    @property
    def argv(self) -> list[str]:
        return [self.python] + render_argv(self.model_path, self.port, self.flags)

    @property
    def env_hashes(self) -> dict[str, str]:
        return {name: sglang_probe.env_hash(value) for name, value in sorted(self.env.items())}

    def record(self) -> dict[str, Any]:
        """What the state file keeps: no secret value (secret flags masked, env values only as
        hashes; the values live in the 0600 env file), and the exact argv's hash."""
        return {"model_path": self.model_path, "port": self.port, "flags": redact_flags(self.flags),
                "env_names": sorted(self.env), "env_hashes": self.env_hashes,
                "supervisor": self.supervisor, "python": self.python, "argv": redact_argv(self.argv),
                "argv_hash": sglang_probe.argv_hash(self.argv)}


def redact_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """Flags with the values of secret flags (``--api-key``...) replaced by ``***``.

    >>> redact_flags({"tp-size": 8, "api-key": "sk-1"})
    {'tp-size': 8, 'api-key': '***'}
    """
    return {name: SECRET_MASK if getattr(SPECS.get(name), "secret", False) and value not in (None, False) else value
            for name, value in flags.items()}


def running_record(server: Mapping[str, Any]) -> dict[str, Any] | None:
    """The state file's record of the server that runs now (redacted, with its argv hash); the
    env names and hashes are completed in the container from its env file."""
    main = server.get("main")
    if not main:
        return None
    command = running_command(server) or {}
    recorded = (server.get("state") or {}).get("current") or {}
    return {"model_path": command.get("model_path"), "port": server.get("port"),
            "flags": redact_flags(command.get("flags") or {}), "argv": redact_argv(main["argv"]),
            "argv_hash": sglang_probe.argv_hash(main["argv"]), "python": main["argv"][0],
            "env_names": recorded.get("env_names", []), "supervisor": recorded.get("supervisor", "process")}


def desired_spec(model_path: str | None, port: int, flags: Mapping[str, Any] | None,
                 env: Mapping[str, Any] | None, supervisor: str = "process",
                 python: str = "/usr/bin/python3") -> Spec:
    """Validate the desired state completely (no host needed); raise SpecError naming the problem."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise SpecError(f"port must be an integer in 1..65535, got {port!r}")
    if not isinstance(model_path, str) or not model_path.strip():
        raise SpecError("model_path is required (a directory in the container or a repo id)")
    if supervisor not in SUPERVISORS:
        raise SpecError(f"supervisor must be one of {', '.join(SUPERVISORS)}, got {supervisor!r}")
    if not isinstance(python, str) or not python.startswith("/") or any(c in python for c in "\0\n\r"):
        raise SpecError(f"python must be an absolute path, got {python!r}")
    clean_env: dict[str, str] = {}
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            raise SpecError(f"env name {name!r} is not a valid variable name")
        if isinstance(value, bool):
            value = "1" if value else "0"
        if not isinstance(value, (str, int, float)):
            raise SpecError(f"env {name}: value must be a string or number")
        text = str(value)
        if any(c in text for c in "\0\n\r"):
            raise SpecError(f"env {name}: value must be one line (no newline or NUL)")
        clean_env[name] = text
    try:
        normalised = validate_flags(flags or {})
        for key, value in normalised.items():
            # argv carries any byte but NUL literally; a line break would still end a line of the
            # systemd unit (ExecStart=...), and the next line would be read as a directive.
            texts = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(text, str) and any(c in text for c in "\0\n\r") for text in texts):
                raise FlagError(key, "value must be one line (no newline, carriage return or NUL)")
        if any(c in model_path for c in "\0\n\r"):
            raise SpecError("model_path must be one line (no newline, carriage return or NUL)")
        for key in ("model-path", "port", "host"):
            if key in normalised:
                raise FlagError(key, "is set by sglang.server's own arguments, not in flags")
        spec = Spec(model_path, port, normalised, clean_env, supervisor, python)
        spec.argv  # renders: checks model path and values once more
    except FlagError as error:
        raise SpecError(str(error)) from error
    return spec


def env_file_text(env: Mapping[str, str]) -> str:
    """systemd EnvironmentFile syntax, double-quoted, read back by transition_actions.parse_env_file."""
    lines = ["# written by gpugate sglang.server; secrets live only here (mode 0600)"]
    for name, value in sorted(env.items()):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'{name}="{escaped}"')
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- comparing with what runs
@dataclasses.dataclass
class Change:
    """What sglang.server has to do on one host, and why (for the printed plan)."""

    action: str  # noop | start | restart | wait | stop | sweep
    reasons: list[str]
    flag_lines: list[str] = dataclasses.field(default_factory=list)
    env_lines: list[str] = dataclasses.field(default_factory=list)
    running: dict[str, Any] | None = None  # parsed running command (model_path, port, flags)


def running_command(server: Mapping[str, Any]) -> dict[str, Any] | None:
    if not server.get("running"):
        return None
    parsed = parse_argv(server["main"]["argv"])
    return {"model_path": parsed.model_path, "port": parsed.port, "flags": parsed.flags,
            "python": server["main"]["argv"][0], "argv": server["main"]["argv"]}


def env_changes(server: Mapping[str, Any], spec: Spec) -> list[str]:
    """Env differences as display lines; values never shown. Compares the running process's
    environment (by hash) for desired names, and names recorded before that are now gone."""
    lines = []
    running_hashes = server.get("env_hashes") or {}
    for name, wanted in spec.env_hashes.items():
        have = running_hashes.get(name)
        if have is None:
            lines.append(f"+ env {name}={MASK}")
        elif have != wanted:
            lines.append(f"~ env {name}={MASK} (value changed)")
    recorded = ((server.get("state") or {}).get("current") or {}).get("env_names") or []
    for name in sorted(set(recorded) - set(spec.env)):
        lines.append(f"- env {name}")
    return lines


def compare(server: Mapping[str, Any], spec: Spec | None, healthy_codes=(200,)) -> Change:
    """Decide the action from the server probe document and the desired spec (None = absent)."""
    running = running_command(server)
    strays = server.get("strays") or []
    if spec is None:
        if running:
            return Change("stop", [f"sglang runs on :{server['port']} (pid {server['main']['pid']}) and should not"],
                          running=running)
        if strays:
            return Change("sweep", [f"{len(strays)} stray sglang process(es) left in the container"])
        return Change("noop", [f"sglang on :{server['port']} is absent"])
    if not running:
        reasons = [f"sglang is not running on :{spec.port}"]
        if strays:
            reasons.append(f"{len(strays)} stray sglang process(es) will be swept first")
        return Change("start", reasons, flag_lines=[f"+ {arg}" for arg in _display_args(spec)])
    flag_lines = diff_flags(running["flags"], spec.flags).lines(redact=True)
    reasons = []
    if running["model_path"] != spec.model_path:
        flag_lines.insert(0, f"- --model-path {running['model_path']}")
        flag_lines.insert(1, f"+ --model-path {spec.model_path}")
    if running["python"] != spec.python:
        reasons.append(f"interpreter {running['python']} -> {spec.python}")
    if flag_lines:
        reasons.append("the running flags differ from the desired flags")
    env_lines = env_changes(server, spec)
    if env_lines:
        reasons.append("the server's environment differs")
    if strays:
        reasons.append(f"{len(strays)} stray sglang process(es) outside the server's tree")
    if reasons:
        return Change("restart", reasons, flag_lines, env_lines, running)
    health = (server.get("health") or {}).get("health")
    if health in healthy_codes:
        return Change("noop", [f"sglang on :{spec.port} already runs with the desired flags"], running=running)
    # same flags but not (yet) healthy: a load in progress (e.g. a re-run after an SSH drop)
    return Change("wait", [f"sglang on :{spec.port} runs with the desired flags but is not healthy yet "
                           f"({_health_text(server)}); waiting for it"], running=running)


def decide(server: Mapping[str, Any], spec: Spec | None, restarted: bool = False) -> Change:
    """``compare``, then honour ``restarted``: a server that runs (or loads) the desired flags is
    restarted all the same. Used before the lock and again under it, so the answer is the same."""
    change = compare(server, spec)
    if restarted and spec is not None and change.action in ("noop", "wait"):
        return Change("restart", ["restarted=True"], running=change.running)
    return change


def previous_target(server: Mapping[str, Any], state_file: str) -> dict[str, Any]:
    """The recorded previous server (``restore_previous``), or SpecError saying why there is none."""
    state = server.get("state")
    if not state:
        raise SpecError(f"cannot roll back: no recorded state ({state_file} is missing): gpugate never "
                        f"changed this server")
    previous = state.get("previous")
    if not isinstance(previous, dict) or not previous.get("model_path"):
        raise SpecError(f"cannot roll back: {state_file} records no previous server (nothing changed since "
                        f"the first start)")
    if not previous.get("argv_hash") or not server.get("previous_argv_saved"):
        raise SpecError("cannot roll back: the previous server's exact command was not kept in the "
                        "container (recorded by an older gpugate); deploy the flags you want instead")
    return previous


def compare_previous(server: Mapping[str, Any], target: Mapping[str, Any]) -> Change:
    """``compare`` for ``restore_previous``: the running argv (by hash: secrets included) and env
    (by value hashes) against the recorded previous server."""
    running = running_command(server)
    port = server.get("port")
    if not running:
        return Change("start", [f"sglang is not running on :{port}; starting the recorded previous server"],
                      flag_lines=[f"+ {arg}" for arg in _args_pairs(list(target.get("argv") or [])[3:])])
    flag_lines = diff_flags(redact_flags(running["flags"]), target.get("flags") or {}).lines(redact=True)
    if running["model_path"] != target.get("model_path"):
        flag_lines[:0] = [f"- --model-path {running['model_path']}", f"+ --model-path {target.get('model_path')}"]
    reasons = []
    if sglang_probe.argv_hash(running["argv"]) != target.get("argv_hash"):
        reasons.append("the running command is not the recorded previous one"
                       + ("" if flag_lines else " (a secret flag value or the interpreter differs)"))
    running_hashes = server.get("env_hashes") or {}
    wanted = target.get("env_hashes") or {}
    env_lines = [f"~ env {name}={MASK}" if running_hashes.get(name) else f"+ env {name}={MASK}"
                 for name, value in sorted(wanted.items()) if running_hashes.get(name) != value]
    recorded = ((server.get("state") or {}).get("current") or {}).get("env_names") or []
    env_lines += [f"- env {name}" for name in sorted(set(recorded) - set(wanted))]
    if env_lines:
        reasons.append("the server's environment is not the previous one")
    if reasons:
        return Change("restart", ["roll back to the recorded previous server: " + "; ".join(reasons)],
                      flag_lines, env_lines, running)
    if (server.get("health") or {}).get("health") == 200:
        return Change("noop", [f"sglang on :{port} already runs the recorded previous server"], running=running)
    return Change("wait", [f"sglang on :{port} runs the recorded previous server but is not healthy yet "
                           f"({_health_text(server)}); waiting for it"], running=running)


def _health_text(server: Mapping[str, Any]) -> str:
    health = server.get("health") or {}
    if health.get("health") is not None:
        return f"/health {health['health']}"
    return health.get("health_error") or "no answer"


def _display_args(spec: Spec) -> list[str]:
    return _args_pairs(redact_argv(spec.argv)[3:])  # after python -m sglang.launch_server


def _args_pairs(args: list[str]) -> list[str]:
    out, index = [], 0
    while index < len(args):
        if index + 1 < len(args) and not args[index + 1].startswith("--"):
            out.append(f"{args[index]} {args[index + 1]}")
            index += 2
        else:
            out.append(args[index])
            index += 1
    return out


# ---------------------------------------------------------------- checks before the stop
def foreign_memory(gpu_doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """GPUs whose used memory is not held by any process of this container (NVML in a container
    lists only the container's processes): the host's or another container's. Never ours to kill."""
    holders = gpu_doc.get("holders") or []
    out = []
    for gpu in gpu_doc.get("gpus") or []:
        used = gpu.get("used_mib")
        if not used:
            continue
        procs = gpu.get("processes") or []
        known = [p.get("used_mib") for p in procs]
        if procs and all(isinstance(mib, (int, float)) for mib in known):
            foreign = used - sum(known)
        elif procs or holders:
            foreign = 0  # someone in the container holds it; the gate will deal with it after the stop
        else:
            foreign = used
        if foreign > 0:
            out.append({"index": gpu.get("index"), "foreign_mib": foreign, "used_mib": used})
    return out


def preflight(observation: Mapping[str, Any], spec: Spec | None, max_used_mib: int) -> list[str]:
    """Every check that can be made before the stop; a non-empty list means: do not begin
    (a restart that cannot pass its gate, or cannot start, must not stop the running server)."""
    server = observation.get("sglang") or {}
    gpu_doc = observation.get("gpu") or {}
    problems: list[str] = []
    if spec is None:
        return problems
    if server.get("model_path_exists") is False:
        problems.append(f"model path {spec.model_path} does not exist in the container")
    tp = int(spec.flags.get("tp-size", 1))
    dp = int(spec.flags.get("dp-size", 1))
    gpus = gpu_doc.get("gpus")
    if gpus is not None and gpu_doc.get("source") not in (None, "none") and tp * dp > len(gpus):
        problems.append(f"--tp-size {tp} x --dp-size {dp} needs {tp * dp} GPUs; the container sees {len(gpus)}")
    hicache = spec.flags.get("hicache-size")
    limit = server.get("memory_limit_bytes")
    if hicache and limit:
        needed = float(hicache) * 1e9 * tp * dp  # --hicache-size is GB per TP rank
        if needed > 0.9 * limit:
            problems.append(f"--hicache-size {hicache} GB x {tp * dp} ranks = {needed / 1e9:.0f} GB of host "
                            f"memory; the container has {limit / 1e9:.0f} GB (limit at 90%)")
    for gpu in foreign_memory(gpu_doc):
        if gpu["foreign_mib"] > max_used_mib:
            problems.append(f"GPU {gpu['index']}: {gpu['foreign_mib']} MiB held from outside the container "
                            f"(not this container's to free; see the who_holds_gpus runbook); "
                            f"the gate (<= {max_used_mib} MiB) could not pass after a stop")
    listeners = server.get("listener_pids") or []
    tree = {p["pid"] for p in server.get("tree") or []}
    if server.get("listening") and listeners and not set(listeners) & tree:
        problems.append(f"port {spec.port} is in use by pid(s) {listeners}, not an sglang server of ours")
    return problems


def steps_for(action: str, supervisor: str = "process") -> list[str]:
    """The steps the transition will take, in order (printed by --dry)."""
    start = "start (systemd unit)" if supervisor == "systemd" else "start (own process group, pid file, log)"
    if action == "start":
        return ["lock", "record", "sweep strays", "gate", "clean /dev/shm + check port + env file", start,
                "wait healthy (+ a generation)", "verify flags", "unlock"]
    if action == "restart":
        return ["lock", "record previous spec", "stop (SIGTERM drain, SIGKILL tree, sweep)", "gate",
                "clean /dev/shm + check port + env file", start, "wait healthy (+ a generation)",
                "verify flags", "unlock (rollback to the previous spec if the start fails)"]
    if action == "wait":
        return ["wait healthy (+ a generation)", "verify flags"]
    if action in ("stop", "sweep"):
        return ["lock", "stop (SIGTERM drain, SIGKILL tree, sweep)", "gate", "remove pid file", "record absent",
                "unlock"]
    return []


# ---------------------------------------------------------------- remote calls
def _module_source(name: str) -> str:
    if name == "gate":  # the gate's decision (stdlib only) lives beside the package's other logic
        return (REMOTE_DIR.parent / "gate.py").read_text()
    return (REMOTE_DIR / f"{name}.py").read_text()


@dataclasses.dataclass(frozen=True)
class RemoteCall:
    """A remote call to run: ``command`` (its argv holds no secret value) and ``stdin``, the
    JSON document of secret arguments the container's program reads from its standard input
    (None: there are none, nothing is read). Run it with
    ``host.run_shell_command(call.command, _stdin=call.stdin)`` (see :func:`run_remote`): values
    on a command line are readable by anyone on the Proxmox host (``ps``, /proc/PID/cmdline)
    for as long as the command runs; stdin is not."""

    command: StringCommand
    stdin: str | None = None


def run_remote(host, call: RemoteCall):
    """``host.run_shell_command`` for a :class:`RemoteCall`: its secrets go on the command's stdin."""
    if call.stdin is None:
        return host.run_shell_command(call.command)
    return host.run_shell_command(call.command, _stdin=call.stdin)


def remote_call(function: str, python: str = "/usr/bin/python3", secret: Mapping[str, Any] | None = None,
                with_gpu_probe: bool = False, with_gate: bool = False, **kwargs: Any) -> RemoteCall:
    """One command that runs transition_actions.<function>(**kwargs, **secret) in the container
    and prints its JSON result. ``secret``: arguments whose values must never be on a command
    line (env values, an argv with ``--api-key``): they travel on the command's stdin.
    ``with_gpu_probe``: the GPU probe travels too (the drain's per-GPU readings); ``with_gate``:
    the probe and the gate's decision (``gate_wait``).

    Example::

        call = remote_call("stage_env", lock=lock, staged_file=path, secret={"env_b64": text})
        status, output = run_remote(host, call)   # "text" is in neither the argv nor pyinfra's log
    """
    document: dict[str, Any] = {"function": function, "kwargs": kwargs}
    if secret:
        document["secret_on_stdin"] = True
    call = base64.b64encode(json.dumps(document).encode()).decode()
    modules = ["sglang_probe"] + (["gpu_probe"] if with_gpu_probe or with_gate else []) + (
        ["gate"] if with_gate else []) + ["transition_actions"]
    script = inline_program({name: _module_source(name) for name in modules},
                            "import transition_actions\ntransition_actions.main(sys.argv[1:])\n")
    command = StringCommand(QuoteString(python), "-c", QuoteString(pack(script)), call)
    return RemoteCall(command, json.dumps(dict(secret), separators=(",", ":")) if secret else None)


def step_call(function: str, *, budget_kwarg: str | None = None, secret: Mapping[str, Any] | None = None,
              inputs: Mapping[str, str] | None = None, always: bool = False, **kwargs: Any) -> dict[str, Any]:
    """One step of a :func:`sequence_call` (transition_actions.<function>(**kwargs, **secret));
    ``secret``: arguments that travel on the command's stdin, never in its argv; see
    transition_actions.sequence for ``budget_kwarg``, ``inputs`` and ``always``."""
    call: dict[str, Any] = {"function": function, "kwargs": kwargs}
    if inputs:
        call["inputs"] = dict(inputs)
    if budget_kwarg:
        call["budget_kwarg"] = budget_kwarg
    if secret:
        call["secret"] = dict(secret)
    if always:
        call["always"] = True
    return call


def split_secrets(calls: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """``calls`` without their secret arguments, and those arguments by step position (as the
    strings JSON keys are): what :func:`sequence_call` sends on stdin.

    >>> split_secrets([{"function": "observe", "kwargs": {}}, {"function": "stage_env", "kwargs": {}, "secret": {"env_b64": "x"}}])
    ([{'function': 'observe', 'kwargs': {}}, {'function': 'stage_env', 'kwargs': {}}], {'1': {'env_b64': 'x'}})
    """
    public, secrets = [], {}
    for index, call in enumerate(calls):
        call = dict(call)
        secret = call.pop("secret", None)
        if secret:
            secrets[str(index)] = dict(secret)
        public.append(call)
    return public, secrets


def sequence_call(calls: list[dict[str, Any]], python: str = "/usr/bin/python3", budget_s: float | None = None,
                  with_gpu_probe: bool = False, with_gate: bool = False) -> RemoteCall:
    """ONE command running ``calls`` (from :func:`step_call`) in order in the container
    (transition_actions.sequence): each step only after the one before it completed. The steps'
    secret arguments, if any, travel on the command's stdin (:class:`RemoteCall`).

    Example::

        sequence_call([step_call("record", lock=lock, ...), step_call("drain", lock=lock, ...)])
    """
    public, secrets = split_secrets(calls)
    return remote_call("sequence", python=python, secret={"secrets": secrets} if secrets else None,
                       with_gpu_probe=with_gpu_probe, with_gate=with_gate, calls=public, budget_s=budget_s)


def sequence_results(document: Mapping[str, Any], expected: int) -> list[dict[str, Any]]:
    """The per-step results of a sequence's output; when the command itself failed (no results),
    the first step carries its error, so that the step that was due reports it."""
    results = document.get("results")
    if isinstance(results, list) and results:
        return [dict(r) for r in results]
    error = document.get("error") or "no result from the container"
    return [{"ok": False, "error": error}] if expected else []


def parse_result(stdout_lines: list[str]) -> dict[str, Any]:
    """The JSON document a remote call printed last (anything before it is noise)."""
    try:
        return parse_probe_output(stdout_lines)
    except ValueError:
        return {"ok": False, "error": "no result from the container: " + " | ".join(stdout_lines[-5:])[:400]}
