"""sglang.server's plan as pure functions: from the agent's observation and the container's
:class:`gpugate.spec.Desired` to what will happen (nothing, a start, a restart, a stop, attaching to a
transition that runs), the checks that must pass before anything stops, and the lines the operator
reads while the container's agent runs the transition (progress and outcome, from its journal).

Nothing here talks to a host: ``gpugate.operations.sglang`` feeds it documents (the agent's
``observe`` and ``follow`` answers, docs/agent-protocol.md), so every decision is unit-tested with
recorded documents.

Example::

    >>> from gpugate.spec import desired_state
    >>> desired = desired_state({"sglang_model_path": "/m", "sglang_flags": {"tp": 2}})
    >>> plan = make_plan({"sglang": {"running": False}, "container": {"pid1": "init"}}, desired)
    >>> plan.action, plan.reasons   # "noop" | "start" | "restart" | "stop" | "attach"; problems: refuse
    ('start', ('sglang is not running on :30000',))
    >>> plan_lines(plan, 30000)[:2]
    ['sglang :30000 will start: sglang is not running on :30000', '    + --model-path /m']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpugate.engine import DEFAULT_ENGINE, Change, get as engine, names
from gpugate.match import (cache_verdict, command_lines, compare, flag_differences, for_container, interpreter_lines,
                           running_command)
from gpugate.rules import gate as rules_gate
from gpugate.rules.redact import SECRET_MASK, argv_hash, env_hash
from gpugate.spec import Desired, Spec, option_items

OUTCOMES_OK = ("verified",)
PROGRESS_EVERY_S = 3.0  # at most one progress line per step this often (the agent journals every 1.5 s)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What sglang.server will do on one container, and why."""

    action: str                                   # noop | start | restart | stop | attach | live
    reasons: tuple[str, ...]
    lines: tuple[str, ...] = ()                   # the diff: flags, model, host, env (secrets ***)
    problems: tuple[str, ...] = ()                # checks that failed: refuse, nothing touched
    notes: tuple[str, ...] = ()                   # what the checks saw that does not block
    steps: tuple[str, ...] = ()
    replaces: Mapping[str, Any] | None = None     # SpecDoc of the server on another port (port change)
    rollback_to: Any = "auto"
    restart: bool = False
    attach_run: str | None = None
    last: str | None = None                       # the previous run's outcome, when worth saying
    gpus: tuple[int, ...] | None = None           # the GPUs the new server takes (locks)
    target: Mapping[str, Any] | None = None       # rollback runbook: the history record to run
    kind: str | None = None                       # which restart (the weight cache kept or not, gated)
    server: str = DEFAULT_ENGINE                  # how the lines name the server: its engine ("sglang :30000")
    changes: tuple[Change, ...] = ()              # what serves vs what is desired, each live or restart

    @property
    def touches(self) -> bool:
        return self.action in ("start", "restart", "stop")


# ---------------------------------------------------------------- small readers
def gpu_text(gpus: Iterable[int] | None) -> str:
    """``GPU 0-3,6`` / ``every GPU``."""
    if gpus is None:
        return "every GPU"
    from gpugate.claims import gpu_ranges

    return "GPU " + gpu_ranges(gpus)


def _compact(used: Mapping[str, Any] | Sequence[Any] | None) -> str:
    from gpugate.report.text import compact_mib

    if isinstance(used, Mapping):
        values = [used[key] for key in sorted(used, key=lambda k: int(k))]
    else:
        values = list(used or [])
    return compact_mib(values)


def _seconds(value: Any) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "?"
    return f"{number:.2f} s" if number < 10 else f"{number:.0f} s"


def foreign_memory(gpu_doc: Mapping[str, Any], gpus: Iterable[int] | None = None) -> list[dict[str, Any]]:
    """GPUs (of ``gpus``; None: all) whose used memory no process of this container accounts for:
    the host's or another container's (NVML in a container lists only its own processes), by the
    one foreign-memory rule (gpugate.rules.gate.foreign_mib; memory it cannot attribute is not
    listed). Never ours to end; the gate could not pass over it.

    >>> foreign_memory({"gpus": [{"index": 0, "used_mib": 900, "processes": []}]})
    [{'index': 0, 'foreign_mib': 900, 'used_mib': 900}]
    """
    used = {gpu.get("index"): gpu.get("used_mib") for gpu in gpu_doc.get("gpus") or []}
    return [{"index": index, "foreign_mib": mib, "used_mib": used[index]}
            for index, mib in rules_gate.foreign_by_gpu(gpu_doc, gpus).items()]


def same_desired(record: Mapping[str, Any] | None, spec: Spec | None, port: int) -> bool:
    """Whether a run's desired record (its journal's ``run`` event, observe's ``transition.desired``)
    is exactly ``spec`` (None: no server on ``port``): argv by hash (secret values included), env by
    value hashes, supervisor. A second operator who attaches to a run of another spec must not
    report that spec's verify as its own.

    >>> from gpugate.spec import build_spec
    >>> same_desired(None, None, 30000), same_desired(None, build_spec("/m", 30000, {}), 30000)
    (True, False)
    """
    if spec is None or record is None:
        return spec is None and record is None
    if record.get("argv_hash") != argv_hash(list(spec.argv)) or int(record.get("port") or 0) != int(spec.port):
        return False
    if dict(record.get("env_hashes") or {}) != {name: env_hash(value) for name, value in spec.env.items()}:
        return False
    return (record.get("supervisor") or "process") == spec.supervisor


def health_text(server: Mapping[str, Any]) -> str:
    health = server.get("health") or {}
    workers = server.get("workers") or {}
    parts = []
    if health.get("health") is not None:
        parts.append(f"/health {health['health']}")
    else:
        parts.append(str(health.get("health_error") or "no answer"))
    if workers.get("expected") is not None and (workers.get("dead") or workers.get("zombies")):
        parts.append(f"{workers.get('alive')} of {workers.get('expected')} scheduler workers alive")
    return ", ".join(parts)


def _record_same_as_running(record: Mapping[str, Any], server: Mapping[str, Any]) -> bool:
    """Whether a history record is the server that runs: its argv (the launch) and env, or the spec it
    was changed to live (``changed_live``: on this very main); either way it must serve the record's
    live state (docs/live-changes.md).

    >>> server = {"running": True, "main": {"argv_hash": "A", "pid": 7, "start_ticks": 9}, "live": {"model_path": "/m2"}}
    >>> _record_same_as_running({"argv_hash": "A", "model_path": "/m"}, server)
    False
    >>> _record_same_as_running({"argv_hash": "B", "model_path": "/m2", "changed_live": {"pid": 7, "start_ticks": 9}}, server)
    True
    """
    main = server.get("main") or {}
    if not server.get("running"):
        return False
    changed = record.get("changed_live") or {}
    reached_live = bool(changed) and (changed.get("pid"), changed.get("start_ticks")) == (main.get("pid"),
                                                                                           main.get("start_ticks"))
    if record.get("argv_hash") != main.get("argv_hash") and not reached_live:
        return False
    have = server.get("env_hashes") or {}
    wanted = record.get("env_hashes") or {}
    return all(have.get(name) == value for name, value in wanted.items()) and serves_record(record, server.get("live"))


def serves_record(record: Mapping[str, Any], live: Mapping[str, Any] | None) -> bool:
    """What the server says it serves (observe's ``live``; None: its engine says nothing) is the
    record's model and adapters.

    >>> serves_record({"model_path": "/m", "lora_adapters": {"a": "/a"}}, {"model_path": "/m", "lora_adapters": {}})
    False
    """
    if not isinstance(live, Mapping):
        return True
    if record.get("model_path") and live.get("model_path") and record["model_path"] != live["model_path"]:
        return False
    adapters = record.get("lora_adapters")
    return adapters is None or dict(adapters) == dict(live.get("lora_adapters") or {})


def rollback_choice(server: Mapping[str, Any], k: int = 1) -> tuple[dict[str, Any] | None, str]:
    """The rollback runbook's target: the ``k``-th newest good spec (1 = newest) among those that
    differ from the running server -> (record, why) or (None, why not).

    >>> good = [{"key": "b", "argv_hash": "B"}, {"key": "a", "argv_hash": "A"}]
    >>> server = {"running": True, "main": {"argv_hash": "B"}, "history": {"good": good}}
    >>> rollback_choice(server)[0]["key"], rollback_choice(server, 2)[0]
    ('a', None)
    """
    good = [dict(record) for record in ((server.get("history") or {}).get("good") or []) if record]
    others = [record for record in good if not _record_same_as_running(record, server)]
    port = server.get("port")
    if k < 1:
        return None, f"rollback_to must be 1 (the newest good spec) or more, got {k}"
    if not others:
        what = "holds no good server" if not good else "holds no good server other than the one running"
        return None, f"nothing to roll back to: the history of :{port} {what}"
    if k > len(others):
        return None, (f"rollback_to={k}, but the history of :{port} holds {len(others)} good spec(s) other "
                      f"than the one running")
    return others[k - 1], f"the good spec #{k} of :{port} ({others[k - 1].get('at') or '?'}, by {others[k - 1].get('by') or '?'})"


def record_lines(server: Mapping[str, Any], record: Mapping[str, Any]) -> list[str]:
    """The diff from what runs to a recorded spec (redacted on both sides)."""
    name = record.get("engine") or server.get("engine") or DEFAULT_ENGINE
    recorded = engine(name)
    running = running_command(server, name)
    argv = list(record.get("argv") or [])
    target = recorded.read_running(argv)
    if running is None:
        return [f"+ {arg}" for arg in option_items(argv[target.args_start:])]
    lines = interpreter_lines(running["python"], (argv or [None])[0])
    lines += command_lines(recorded, running, target.model_path, target.host)
    lines += flag_differences(running["flags"], target.flags, name)
    have = server.get("env_hashes") or {}
    wanted = record.get("env_hashes") or {}
    shown = record.get("env") or {}  # the values that are no secret (a record before issue 32 has none: ***)
    for name in sorted(set(have) | set(wanted)):
        if wanted.get(name) is not None and have.get(name) is None:
            lines.append(f"+ env {name}={shown.get(name, SECRET_MASK)}")
        elif wanted.get(name) is not None and have.get(name) != wanted[name]:
            lines.append(f"~ env {name}={shown.get(name, SECRET_MASK)} (value changed)")
        elif wanted.get(name) is None and have.get(name) is not None:
            lines.append(f"- env {name}")
    if not lines:
        lines.append("~ the same flags; a secret flag value, the interpreter or the supervisor differs")
    return lines




# ---------------------------------------------------------------- port change
def replaces_doc(replaced: Mapping[str, Any]) -> dict[str, Any]:
    """A SpecDoc naming the server to drain first. Its exact argv and env stay in the container:
    the agent captures them from /proc (and its history) before the stop, for the rollback."""
    argv = replaced["cmdline"].split()
    return {"argv": argv, "env": {}, "port": int(replaced["port"]), "supervisor": "process",
            "gpus": list(replaced["gpus"]) if replaced.get("gpus") is not None else None,
            "record": {"source": "the server on :%d that the new port replaces" % int(replaced["port"])}}


# ---------------------------------------------------------------- checks before the stop
# What the agent keeps in each of its directories (gpugate.agent.state), for the refusal's words.
STATE_DIR_USES = {"/var/lib/gpugate": "history of good specs", "/var/lib/gpugate/runs": "journal",
                  "/run/gpugate": "transition lock and pid file", "/etc/gpugate": "env file",
                  "/var/log/gpugate": "server log"}
def checks(observation: Mapping[str, Any], spec: Spec | None, *, max_used_mib: int = 64, min_free_mib: int = 64,
           end_other_gpu_holders: bool = False, replacing: Sequence[int] = ()) -> tuple[list[str], list[str]]:
    """Everything that can be checked before anything stops -> (problems, notes). A problem means:
    do not begin (a transition that cannot pass its gate, or cannot start, must not stop the
    server that serves). Notes are shown with the plan."""
    problems: list[str] = []
    notes: list[str] = []
    if spec is None:
        return problems, notes
    server = observation.get("sglang") or {}
    _holder_checks(observation, spec, end_other_gpu_holders, replacing, problems, notes)
    problems += _gpu_checks(observation.get("gpu") or {}, spec.gpus, max_used_mib)
    problems += _container_checks(observation.get("container") or {}, spec, min_free_mib)
    problems += _server_checks(server, spec)
    problems += engine(spec.engine).preflight(observation, spec.launch)  # what is the engine's own to see
    notes += spec.warnings
    history_problem = (server.get("history") or {}).get("problem")
    if history_problem:  # the container's agent set a history aside (or will): said with the plan
        notes.append(history_problem)
    if replacing:
        notes.append("port change: the server on :" + ", :".join(str(p) for p in replacing)
                     + " drains and stops first (the rollback returns to it)")
    return problems, notes


def _holder_checks(observation: Mapping[str, Any], spec: Spec, end_other_gpu_holders: bool, replacing: Sequence[int],
                   problems: list[str], notes: list[str]) -> None:
    """Other processes with memory on this server's GPUs (not parts of a server: those the agent
    sweeps or stops; monitors at 0 MiB are no obstacle)."""
    blockers, monitors = [], []
    for holder in (observation.get("container") or {}).get("gpu_holders") or []:
        mine = rules_gate.memory_gpus(holder, spec.gpus)
        if holder.get("server_part") or holder.get("weight_cache") in (spec.port, *replacing):
            continue  # the agent stops the server's parts; its own weight cache it keeps or stops
        if holder.get("memory") and mine:
            blockers.append((holder, mine))
        elif not holder.get("memory"):
            monitors.append(holder)
    for holder, on_mine in blockers:
        what = (f"pid {holder.get('pid')} ({(holder.get('cmdline') or '?')[:80]}) holds "
                f"{holder.get('used_mib') if holder.get('used_mib') is not None else '?'} MiB on {gpu_text(on_mine)}, "
                f"which this server needs")
        if end_other_gpu_holders:
            notes.append(what + ": the agent ends it (end_other_gpu_holders=true)")
        else:
            problems.append(what + "; it is not part of the server, so a deploy never ends it: stop it, or "
                            "re-run with --data end_other_gpu_holders=true to let the agent end it")
    for holder in monitors:
        notes.append(f"pid {holder.get('pid')} ({(holder.get('cmdline') or '?')[:60]}) holds the GPU device files "
                     f"without memory (a monitor): not waited for, never signalled")


def _gpu_checks(gpu_doc: Mapping[str, Any], gpus: Sequence[int] | None, max_used_mib: int) -> list[str]:
    """The GPUs the server needs are there, and no memory held from outside the container blocks the gate."""
    problems: list[str] = []
    if "source" not in gpu_doc and not gpu_doc.get("gpus"):
        return problems
    visible = [gpu.get("index") for gpu in gpu_doc.get("gpus") or []]
    if gpus is not None and visible and gpu_doc.get("source") not in (None, "none"):
        missing = sorted(set(gpus) - set(visible))
        if missing:
            problems.append(f"the server needs {gpu_text(gpus)}; the container sees GPU(s) "
                            f"{', '.join(str(i) for i in visible)} only (missing {', '.join(str(i) for i in missing)})")
    for gpu in foreign_memory(gpu_doc, gpus):
        if gpu["foreign_mib"] > max_used_mib:
            problems.append(f"GPU {gpu['index']}: {gpu['foreign_mib']} MiB held from outside the container "
                            f"(not this container's to free; see runbooks/who_holds_gpus.py): the gate "
                            f"(<= {max_used_mib} MiB) could not pass after a stop")
    return problems


def _container_checks(container: Mapping[str, Any], spec: Spec, min_free_mib: int) -> list[str]:
    """The supervisor, free space, the state directories, the port."""
    problems: list[str] = []
    if spec.supervisor == "systemd" and container.get("pid1") not in (None, "systemd"):
        problems.append(f"supervisor systemd, but PID 1 of the container is {container.get('pid1')}, not systemd")
    for path, free in sorted((container.get("free_mib") or {}).items()):
        if isinstance(free, (int, float)) and free < min_free_mib:
            problems.append(f"{path} has {free} MiB free, under the minimum of {min_free_mib} MiB "
                            f"(min_free_mib) for the server log, the journal and the history")
    # the journal, the history, the lock and pid file, the env file, the log
    for path, why in sorted((container.get("unwritable") or {}).items()):
        problems.append(f"{path} cannot be written in the container ({why}): the transition could not keep its "
                        f"{STATE_DIR_USES.get(path, 'state')}")
    for holder in container.get("port_holders") or []:
        if holder.get("server") or holder.get("server_part"):
            continue
        problems.append(f"port {spec.port} is taken by pid {holder.get('pid')} ({(holder.get('cmdline') or '')[:80]}), "
                        f"which is not the server being replaced")
    return problems


def _server_checks(server: Mapping[str, Any], spec: Spec) -> list[str]:
    """The model path, and the engine's release against the pin."""
    problems: list[str] = []
    if server.get("model_path_exists") is False:
        problems.append(f"the model path {spec.model_path} does not exist in the container")
    elif server.get("model_path_kind") not in (None, "directory", "missing"):
        # an engine loads a directory (or a hub id); a config.json named instead would stop the
        # server for a start that cannot work
        problems.append(f"the model path {spec.model_path} is a {server['model_path_kind']}, not a directory: give "
                        f"the model's directory (or a hub id)")
    have = server.get("sglang_version")
    if spec.sglang_version and have and have != spec.sglang_version:
        problems.append(f"the container has {engine(spec.engine).label} {have}; sglang_version pins {spec.sglang_version}")
    return problems


# ---------------------------------------------------------------- the plan
def steps_for(action: str, spec: Spec | None, max_used_mib: int, budgets: Mapping[str, float],
              replacing: Sequence[int] = (), cache: str = "none") -> tuple[str, ...]:
    """The steps the agent will take (printed by --dry). ``cache``: what a start does with the
    weight cache (match.cache_verdict's mode)."""
    if action in ("noop", "attach"):
        return ()
    # a request or stream still open past the drain is cut: said here, before anything stops (issue 32 item 3)
    stop = (f"stop (SIGTERM drain <= {budgets.get('drain_timeout_s', 60):g} s, SIGKILL of the tree: it cuts a "
            f"request or stream still open; sweep)")
    steps = ["hand off to the container's agent (one command)"]
    serving = engine(spec.engine if spec else DEFAULT_ENGINE)
    gated = bool(spec and spec.gated_launch and action != "stop")
    first = action == "start" and not replacing  # nothing runs on this port: nothing to serve on, nothing to stop
    if gated and first:
        steps.append(f"start the new engine gated ({serving.gated_option}): its imports and dist init first")
    elif gated:
        steps.append(f"start the new engine gated ({serving.gated_option}) while the old one serves: its imports "
                     "and dist init before the stop, a crash there stops nothing")
    if replacing:
        steps.append(f"stop :{', :'.join(str(p) for p in replacing)} first")
    if first:
        steps.append("sweep stray server parts of this port, if any")
    else:
        steps.append(stop)
    if action == "stop" or spec is None and action != "start":
        if cache == "stop" or action == "stop":
            steps.append("stop this server's weight-cache daemons, if any")
        return tuple(steps)
    where = gpu_text(spec.gpus if spec else None)
    if cache == "start":
        steps.append("stop the weight-cache daemons of the old key, if any")
    elif cache == "stop":
        steps.append("stop the weight-cache daemons (none wanted)")
    steps.append(f"gate ({where} <= {max_used_mib} MiB" + (" + the kept weight cache's memory" if cache == "keep" else "")
                 + (" + the gated engine's contexts" if gated else "") + ", no other holder)")
    steps.append("prepare (/dev/shm, port, env file)")
    if cache == "start":
        steps.append("start the weight-cache daemons, wait for every GPU's .ready")
    steps += [f"activate the gated engine ({serving.gate_activate})" if gated else
              "start (" + ("systemd unit" if spec and spec.supervisor == "systemd" else "own session, pid file, log") + ")",
              "healthy + a generation", f"verify argv and {serving.info_endpoint}", "commit to the history",
              "on any failure from the stop on: roll back to the last good spec"]
    return tuple(steps)


def restart_kind(verdict_mode: str, why: str, spec: Spec | None) -> str | None:
    """Which restart a plan is, in words (None without a weight cache either side).

    >>> restart_kind("keep", "the weight cache's key is unchanged", None)
    "engine only: the weights stay on every GPU (the weight cache's key is unchanged)"
    """
    where = gpu_text(spec.gpus if spec else None)
    if verdict_mode == "keep":
        return f"engine only: the weights stay on {where} ({why})"
    if verdict_mode == "start":
        return f"engine and weight cache: {why}"
    if verdict_mode == "stop":
        return "engine, and the weight cache stops (weight_cache: false)"
    return None


def stall_text(agent: Mapping[str, Any] | None, bound_s: float) -> str | None:
    """What a stuck agent looks like, or None while it writes (``agent``: the agent's view of the
    run's agent, gpugate.agent.journal.agent_view). It writes its journal at least every 1.5 s in
    each long phase, so a silence over ``bound_s`` means it is stuck, whatever it was doing.

    >>> stall_text({"pid": 41, "state": "T", "state_name": "stopped", "silent_s": 31.2}, 30)
    'the agent pid 41 has written nothing for 31 s (state T: stopped)'
    >>> stall_text({"pid": 41, "state": "S", "state_name": "sleeping", "silent_s": 2.0}, 30) is None
    True
    >>> stall_text({"pid": 41, "state": "S", "silent_s": 50.0, "quiet_s": 30}, 30) is None  # a generation
    True
    """
    view: Mapping[str, Any] = agent or {}
    silent = view.get("silent_s")
    announced = view.get("quiet_s")
    quiet = float(announced) if isinstance(announced, (int, float)) else 0.0
    if not isinstance(silent, (int, float)) or silent <= bound_s + quiet:  # quiet_s: an announced blocking call
        return None
    state = f" (state {view.get('state')}: {view.get('state_name')})" if view.get("state") else " (gone)"
    return f"the agent pid {view.get('pid')} has written nothing for {silent:.0f} s{state}"


def last_run_line(server: Mapping[str, Any]) -> str | None:
    """The latest transition of this container, when it ended otherwise than verified or while
    nobody watched (a controller killed mid-run): what the operator should know first."""
    run = server.get("transition") or {}
    if not run or run.get("active") or not run.get("outcome") or (
            run.get("ports") and server.get("port") is not None and int(server["port"]) not in run["ports"]):
        return None  # nothing to say, or another server's run
    by = f" by {run['by']}" if run.get("by") else ""
    message = run.get("message") or ""
    return f"the last transition (run {run.get('run')}{by}) ended: {run.get('outcome')}" + (f": {message}" if message else "")


def held_by_other_servers(observation: Mapping[str, Any], port: int, gpus: Iterable[int] | None
                          ) -> list[tuple[int, list[int]]]:
    """(port, GPUs) of the container's servers on other ports that hold some of ``gpus`` (a rollback's
    spec from before a sibling server existed may want them).

    >>> obs = {"sglang": {"strays": [{"port": 30001, "main": True, "gpus": [4, 5, 6, 7]}]}}
    >>> held_by_other_servers(obs, 30000, range(8)), held_by_other_servers(obs, 30000, range(4))
    ([(30001, [4, 5, 6, 7])], [])
    """
    if gpus is None:
        return []
    wanted = set(gpus)
    out = []
    for other, held in other_servers(observation, port).items():
        shared = sorted(wanted & set(held))
        if shared:
            out.append((other, shared))
    return out


def other_servers(observation: Mapping[str, Any], port: int) -> dict[int, tuple[int, ...]]:
    """port -> GPUs of the container's servers (mains) on other ports than ``port`` that run now.

    >>> other_servers({"sglang": {"strays": [{"port": 30001, "main": True, "gpus": [4, 5]}]}}, 30000)
    {30001: (4, 5)}
    """
    out: dict[int, tuple[int, ...]] = {}
    for stray in (observation.get("sglang") or {}).get("strays") or []:
        other = stray.get("port")
        if stray.get("main") and other and other != port and stray.get("gpus") is not None:
            out[int(other)] = tuple(stray["gpus"])
    return out


def kept_gpu_problems(observation: Mapping[str, Any], desired: Desired, spec: Spec, replacing: Sequence[int] = (),
                      executing: bool = False) -> list[str]:
    """The refusals of a server whose GPUs another server of the container holds and keeps holding
    when this one's turn comes (issue 32 item 7): it is not stopped before this one in this run, so
    this one's gate after its stop could only time out on the other's memory. ``replacing``: the
    servers this one's own transition stops first (a port change). ``executing``: the container's
    earlier servers of this run have run (pyinfra's execute phase: the observation shows what they
    hold); else what they will hold is foretold from ``desired.run_order``: a server set
    ``present: false`` frees its GPUs, one that moves holds its new ones, unless its own move meets
    GPUs still held (then it is refused and keeps its own). Each line names both servers and the GPUs,
    and how to get there.

    >>> from gpugate.spec import build_spec
    >>> spec = build_spec("/m", 30000, {"tp": 4, "base-gpu-id": 4})
    >>> swap = Desired(port=30000, present=True, python="/usr/bin/python3", spec=spec, budgets={}, siblings=(30001,),
    ...                run_order=((30000, (4, 5, 6, 7)), (30001, (0, 1, 2, 3))))
    >>> obs = {"sglang": {"gpus": [0, 1, 2, 3], "strays": [{"port": 30001, "main": True, "gpus": [4, 5, 6, 7]}]}}
    >>> line = kept_gpu_problems(obs, swap, spec)[0]
    >>> line[:42], "in two deploys" in line
    ('the server on :30001 holds GPU 4-7, which ', True)
    """
    if spec.gpus is None:
        return []
    holding = {port: set(gpus) for port, gpus in other_servers(observation, desired.port).items()}
    holding[desired.port] = set((observation.get("sglang") or {}).get("gpus") or [])
    ports = [port for port, _ in desired.run_order]
    turn = ports.index(desired.port) if desired.port in ports else len(ports)
    later = dict(desired.run_order[turn + 1:])
    refused_earlier = set()
    for port, takes in (() if executing else desired.run_order[:turn]):
        if takes is None:
            continue  # refused for its own reason, or GPUs not told: it keeps what it holds
        if any(set(takes) & held for other, held in holding.items() if other != port):
            refused_earlier.add(port)  # its own move meets GPUs still held: refused, it keeps its own
            continue
        holding[port] = set(takes)  # () for present: false
    mine_now = holding.pop(desired.port)
    problems = []
    for other, held in sorted(holding.items()):
        shared = set(spec.gpus) & held
        if not shared or other in replacing:
            continue
        head = (f"the server on :{other} holds {gpu_text(shared)}, which :{desired.port} would move onto, and keeps "
                f"them through the turn of :{desired.port} (it is not stopped before it in this run): stopping "
                f":{desired.port} would leave its gate waiting on that memory until it timed out; ")
        takes = later.get(other)
        if takes == ():
            how = (f":{other} stops (present: false) after :{desired.port} in this run: list it before :{desired.port} "
                   f"in the container (its servers run in the order fleet.yaml lists them, engine sections included)")
        elif isinstance(takes, tuple) and set(takes) & mine_now:
            how = (f"the two swap GPUs (:{other} moves to {gpu_text(takes)}, which :{desired.port} holds), and neither "
                   f"can move while the other holds its GPUs: do it in two deploys: (1) :{other} present: false, "
                   f":{desired.port} as it runs now (:{other} stops, :{desired.port} keeps serving); (2) both on their "
                   f"new GPUs, :{other} present again (:{desired.port} moves onto the freed {gpu_text(shared)}, then "
                   f":{other} starts on {gpu_text(takes)})")
        elif isinstance(takes, tuple):
            how = (f":{other} moves to {gpu_text(takes)} after :{desired.port} in this run: list it before "
                   f":{desired.port} in the container, so that it moves off first (its servers run in the order "
                   f"fleet.yaml lists them, engine sections included)")
        elif other in later:  # its GPUs not told, or refused for its own reason
            how = (f":{other} runs after :{desired.port} in this run and keeps its GPUs until then: stop it first "
                   f"(present: false, in a deploy of its own), or give :{desired.port} other GPUs")
        elif other in refused_earlier:
            how = (f":{other} cannot move off first (its own new GPUs are held: see its line): free those first, "
                   f"or stop :{other} (present: false) in a deploy of its own")
        else:
            how = (f":{other} is not changed by this run: stop it first (present: false on its port, in a deploy of "
                   f"its own), or give :{desired.port} other GPUs")
        problems.append(head + how)
    return problems


def make_plan(observation: Mapping[str, Any], desired: Desired, *, restoring: bool = False,
              executing: bool = False) -> Plan:
    """What sglang.server does on one container: the agent's observation against the container's
    desired state (its ``spec``: the server, None for none on its port; the run's settings: the
    gate, the free space, restart, the other servers' ports). ``restoring``: the rollback runbook
    (``desired.rollback_to``: the k-th newest good spec unlike the running one). ``executing``: the
    container's servers before this one in the run have run (pyinfra's execute phase), so the
    observation shows what they hold (else it is foretold: :func:`kept_gpu_problems`)."""
    return dataclasses.replace(_decide(observation, desired, restoring, executing), server=desired.engine)


def _decide(observation: Mapping[str, Any], desired: Desired, restoring: bool, executing: bool = False) -> Plan:
    spec = for_container(desired.spec, observation)  # auto: systemd where the container's PID 1 is systemd
    port, restart, siblings = desired.port, desired.restarted, desired.siblings
    rollback_k = desired.rollback_to if restoring else None
    max_used_mib, min_free_mib, agent_silence_s = desired.max_used_mib, desired.min_free_mib, desired.agent_silence_s
    end_other_gpu_holders = desired.end_other_gpu_holders
    server = observation.get("sglang") or {}
    budgets = dict(desired.budgets)
    last = last_run_line(server)
    running = bool(server.get("running"))
    transition = server.get("transition") or {}
    if transition.get("active"):
        step = transition.get("step") or "its start"
        stalled = stall_text(transition.get("agent"), agent_silence_s)
        if stalled:  # attaching would hang as the first controller did: say it and touch nothing
            why = (f"the transition of run {transition.get('run')} is stalled at {step}: {stalled}; "
                   f"nothing was touched (it holds the container's lock: see the agent's process, "
                   f"then end it or let it go on)")
            return Plan("refuse", (why,), problems=(why,))
        return Plan("attach", (f"a transition runs in the container (run {transition.get('run')}"
                               f"{' by ' + transition['by'] if transition.get('by') else ''}, at {step}): "
                               f"following it instead of starting another",), attach_run=transition.get("run"))
    if rollback_k is not None:
        record, why = rollback_choice(server, rollback_k)
        if record is None:
            return Plan("refuse", (why,), problems=(f"cannot roll back: {why}",), last=last)
        taken = held_by_other_servers(observation, port, record.get("gpus"))
        if taken:
            return Plan("refuse", (why,), last=last, problems=tuple(
                f"cannot roll back to {why}: it takes {gpu_text(record.get('gpus'))}, and the server on :{other} "
                f"holds {gpu_text(gpus)} of them (it would never pass its gate; stop that server first, or pick "
                f"another spec with --data rollback_to=K)" for other, gpus in taken))
        if (record.get("engine") or DEFAULT_ENGINE) not in names():
            return Plan("refuse", (why,), last=last, problems=(
                f"cannot roll back to {why}: it is a server of the engine {record.get('engine')!r}, which this "
                f"controller does not have (engines: {', '.join(names())})",))
        lines = record_lines(server, record)
        action = "restart" if running else "start"
        steps = steps_for(action, None, max_used_mib, budgets)
        steps = steps + (f"gate ({gpu_text(record.get('gpus'))} <= {max_used_mib} MiB, no holder)",
                         "prepare", "start the recorded spec (exact argv and env, kept in the container)",
                         "healthy + a generation", "verify", "commit",
                         "on any failure: roll back to the server that runs now")
        return Plan(action, (f"roll back to {why}",), lines=tuple(lines), steps=steps,
                    rollback_to={"running": True} if running else None, restart=True, last=last,
                    gpus=tuple(record["gpus"]) if record.get("gpus") is not None else None, target=record)
    match = compare(observation, spec, port, siblings)
    if spec is None:
        if match.verdict in ("should_not_run", "strays"):
            return Plan("stop", match.why, steps=steps_for("stop", None, max_used_mib, budgets), rollback_to=None,
                        last=last)
        return Plan("noop", match.why, last=last)

    replaced = list(match.replaced)
    replacing = tuple(int(r["port"]) for r in replaced)
    problems, notes = checks(observation, spec, max_used_mib=max_used_mib, min_free_mib=min_free_mib,
                             end_other_gpu_holders=end_other_gpu_holders, replacing=replacing)
    if len(replaced) > 1:
        problems.append("servers on :" + ", :".join(str(r["port"]) for r in replaced) + " use GPUs the desired server "
                        "needs; a deploy replaces at most one of them (stop the others first)")
    problems += kept_gpu_problems(observation, desired, spec, replacing, executing)
    if match.live and not restart:  # the engine applies every difference while it serves: nothing stops
        return live_plan(observation, spec, match.changes, last)
    if match.verdict == "as_desired" and not restart:
        return Plan("noop", (f"{desired.engine} on :{spec.port} already serves the desired spec ({spec_summary(server)})",),
                    last=last)
    lines = list(match.lines)
    reasons = list(match.why)
    action = "start" if match.verdict == "not_running" else "restart"
    weights = cache_verdict(observation, spec)
    if match.verdict != "not_running" and match.exact:
        reasons.append("restart requested (same spec)" if restart else
                       f"{desired.engine} on :{spec.port} runs the desired spec but does not serve ({health_text(server)}): "
                       f"the agent waits for it, or restarts it when a worker is dead")
    if replaced:
        reasons.append("port change: :" + ", :".join(str(p) for p in replacing) + f" -> :{spec.port}")
    strays = [s for s in server.get("strays") or [] if s.get("port") in (None, spec.port)]
    if strays:
        reasons.append(f"{len(strays)} stray {desired.engine} server part(s) will be swept")
    return Plan(action, tuple(reasons), lines=tuple(lines), problems=tuple(problems), notes=tuple(notes),
                steps=steps_for(action, spec, max_used_mib, budgets, replacing, weights.mode),
                replaces=replaces_doc(replaced[0]) if len(replaced) == 1 else None, rollback_to="auto",
                restart=restart, last=last, gpus=spec.gpus, kind=restart_kind(weights.mode, weights.why, spec),
                changes=match.changes)


LIVE_STEPS = ("apply each change live (the server keeps serving)",
              "verify: the engine answered success, the server lists the desired state, a real generation (through "
              "each adapter that changed)", "commit the live state to the history",
              "on a refusal or a failed verify: undo what was applied, exit non-zero")


def live_plan(observation: Mapping[str, Any], spec: Spec, changes: Sequence[Change], last: str | None) -> Plan:
    """The plan of a change the engine applies while it serves (docs/live-changes.md): nothing stops,
    so only what the change itself needs is checked before it (the new model path exists)."""
    server = observation.get("sglang") or {}
    pid = (server.get("main") or {}).get("pid")
    weights = any((change.op or {}).get("op") == "update_weights" for change in changes)
    problems = _server_checks(server, spec) if weights else []
    if not server.get("serving"):
        problems.append(f"the server (pid {pid}) does not serve: a live change needs one that does")
    why = f"what it serves differs from the desired state: {len(changes)} change(s) applied live, pid {pid} keeps serving"
    return Plan("live", (why,), lines=tuple(change.line for change in changes), problems=tuple(problems),
                steps=LIVE_STEPS, rollback_to=None, last=last, gpus=spec.gpus, changes=tuple(changes))


def spec_summary(server: Mapping[str, Any]) -> str:
    main = server.get("main") or {}
    workers = server.get("workers") or {}
    parts = [f"pid {main.get('pid')}"]
    if workers.get("expected") is not None:
        parts.append(f"{workers.get('alive')}/{workers.get('expected')} workers")
    return ", ".join(parts)


def plan_lines(plan: Plan, port: int) -> list[str]:
    """The plan as printed once per container (``--dry`` stops after it)."""
    lines = []
    if plan.last:
        lines.append(plan.last)
    if plan.problems:
        lines.append(f"{plan.server} :{port} REFUSED, nothing touched" + (": " if len(plan.problems) == 1 else ":")
                     + (plan.problems[0] if len(plan.problems) == 1 else ""))
        if len(plan.problems) > 1:
            lines += [f"    - {problem}" for problem in plan.problems]
        lines += [f"    note: {note}" for note in plan.notes]
        return lines
    doing = "change live" if plan.action == "live" else plan.action
    lines.append(f"{plan.server} :{port} will {doing}: {'; '.join(plan.reasons)}")
    lines += ["    " + line for line in plan.lines]
    if plan.changes:  # the path of the whole change: any restart difference makes it a restart
        lines.append("    path: live (no restart)" if plan.action == "live" else
                     f"    path: {plan.action} (its launch carries the adapters and the model path)")
    if plan.kind:
        lines.append(f"    {plan.action}: {plan.kind}")
    lines += [f"    note: {note}" for note in plan.notes]
    if plan.steps:
        lines.append("    steps: " + " -> ".join(plan.steps))
    return lines


# ---------------------------------------------------------------- following the journal
class Narrator:
    """Turns the agent's journal events into the lines the operator reads (docs/transition.md,
    "Progress while waiting"): one per step begin/end, at most one progress line per step every
    PROGRESS_EVERY_S, and the timings of the run.

    >>> n = Narrator()
    >>> n.lines({"step": "gate", "phase": "end", "passed": True, "elapsed_s": 0.19, "used_mib": {"0": 0, "1": 0}})
    ['gate passed in 0.19 s: GPU MiB 0 0, no holder']
    """

    def __init__(self, engine_name: str = DEFAULT_ENGINE) -> None:
        self.engine = engine(engine_name)  # whose endpoints and options the lines name
        self.last_progress: dict[str, float] = {}
        self.timings: dict[str, float] = {}
        self.began: float | None = None
        self.ended: float | None = None
        self.step: str | None = None           # the step the agent is in (last event)
        self.step_began: float | None = None
        self.capacity: dict[str, Any] | None = None
        self.tails: dict[str, list[str]] = {}  # target -> the log tail of a crashed load
        self.outcome: dict[str, Any] | None = None
        self.gpus: Any = None
        self.desired_what = "the desired flags"  # what a verify of the run's own spec matched (a rollback
        # runbook's run starts a recorded spec: "the restored spec", never the desired flags it may lack)

    def lines(self, event: Mapping[str, Any]) -> list[str]:
        phase = event.get("phase")
        step = event.get("step")
        t = event.get("t")
        if isinstance(t, (int, float)):
            if self.began is None:
                self.began = float(t)
            self.ended = float(t)
            current = "load" if step == "start" and phase == "end" else step  # started: it loads from now on
            if current != self.step and phase != "progress":
                self.step, self.step_began = current, float(t)
            elif self.step_began is None:
                self.step, self.step_began = current, float(t)
        target = event.get("target")
        prefix = "rollback: " if target == "rollback" else ("cleanup: " if target == "cleanup" else "")
        if target == "replaces":
            prefix = f"old server :{event.get('port')}: "
        if phase == "progress":
            key = f"{target}:{step}"
            elapsed = event.get("elapsed_s")
            if isinstance(elapsed, (int, float)) and elapsed < PROGRESS_EVERY_S:
                return []  # a wait that ends within its first seconds prints only its end
            if isinstance(t, (int, float)) and t - self.last_progress.get(key, -1e9) < PROGRESS_EVERY_S:
                return []
            if isinstance(t, (int, float)):
                self.last_progress[key] = float(t)
            progress = self._progress(event)
            return [prefix + progress] if progress else []
        said = self._event(event)
        if isinstance(said, list):
            return [prefix + line for line in said]
        return [prefix + said] if said else []

    def _progress(self, event: Mapping[str, Any]) -> str | None:
        step = event.get("step")
        elapsed = event.get("elapsed_s")
        if step == "drain":
            return (f"draining: {elapsed:.0f} s, {event.get('alive')} process(es) left" if isinstance(elapsed, (int, float))
                    else "draining")
        if step == "gate":
            problems = "; ".join(event.get("problems") or [])
            return (f"gate: {elapsed:.0f} s: GPU MiB {_compact(event.get('used_mib'))}" + (f"; {problems}" if problems else ""))
        if step == "cache_start":
            return f"weight cache loading: {event.get('ready')}/{event.get('of')} GPU(s) ready, {elapsed:.0f} s" \
                if isinstance(elapsed, (int, float)) else "weight cache loading"
        if step == "gated":
            return f"the gated engine initialises: {elapsed:.0f} s" if isinstance(elapsed, (int, float)) else None
        if step == "load":
            state = event.get("state") or "loading"
            what = {"loading": "loading (port closed)", "starting": "starting (/health 503)",
                    "generating": "healthy, waiting for the first generation"}.get(state, state)
            return f"{what}, {elapsed:.0f} s since the start" if isinstance(elapsed, (int, float)) else what
        return None

    def _event(self, event: Mapping[str, Any]) -> str | list[str] | None:
        """The line of one journal event: each step's own method (``_on_<step>``), None for none."""
        on = getattr(self, "_on_" + str(event.get("step")), None)
        return on(event, event.get("phase"), event.get("target")) if on is not None else None

    def _on_run(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        recovered = event.get("recovered") if phase == "begin" else None
        if recovered:
            return (f"recovering run {recovered.get('run')}, whose agent ended during "
                    f"{recovered.get('last_step') or 'its start'}")
        return None

    def _on_adopt(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        return f"the desired server already runs (pid {event.get('pid')}): waiting for it"

    def _on_stop(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        if phase == "begin" and event.get("main"):
            return (f"stopping :{event.get('port')} pid {event.get('main')} ({event.get('tree')} processes): "
                    f"SIGTERM, {self.engine.drain_words}")
        return None

    def _on_drain(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        if phase != "end":
            return None
        self.timings.setdefault(f"{target}:drain", float(event.get("elapsed_s") or 0))
        if event.get("drained"):
            return f"drained and exited in {_seconds(event.get('elapsed_s'))}"
        return (f"drain deadline passed after {_seconds(event.get('elapsed_s'))}: SIGKILL of the tree, which cuts "
                f"any request or stream it still served")

    def _on_kill(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        if phase != "end":
            return None
        parts = []
        if event.get("killed"):
            parts.append(f"SIGKILLed {len(event['killed'])} process(es)")
        if event.get("swept"):
            parts.append(f"swept {len(event['swept'])} stray server part(s)")
        if event.get("survivors"):
            parts.append(f"{len(event['survivors'])} survived SIGKILL: {event['survivors']}")
        return ", ".join(parts) or None

    def _on_sweep(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        pids = event.get("pids") or [] if phase == "begin" else []
        return "sweeping " + ", ".join(f"{p.get('pid')} ({p.get('why')})" for p in pids[:6]) if pids else None

    def _on_gate(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        if phase == "begin":
            self.gpus = event.get("gpus")
            return None
        if phase != "end":
            return None
        self.timings.setdefault(f"{target}:gate", float(event.get("elapsed_s") or 0))
        used = _compact(event.get("used_mib"))
        if event.get("passed"):
            monitors = event.get("monitors") or []
            extra = f"; monitor(s) {monitors} not waited for" if monitors else ""
            own = (f" besides this server's own {_compact(event['expected_mib'])} ({', '.join(event.get('own') or [])})"
                   if event.get("expected_mib") else "")
            return f"gate passed in {_seconds(event.get('elapsed_s'))}: GPU MiB {used}{own}, no holder{extra}"
        return f"gate did NOT pass in {_seconds(event.get('elapsed_s'))}: GPU MiB {used}; " + "; ".join(event.get("problems") or [])

    def _on_prepare(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        """The engine's /dev/shm segments a dead server left and nobody alive holds, removed before
        the start (a leftover can fail every later start: vLLM's KV offload region, vllm#54002).

        >>> Narrator().lines({"step": "prepare", "phase": "end", "removed_shm": ["vllm_offload_1.mmap"]})
        ['removed 1 stale /dev/shm segment(s) no live process holds: vllm_offload_1.mmap']
        """
        removed = [str(name) for name in event.get("removed_shm") or []] if phase == "end" else []
        if not removed:
            return None
        return (f"removed {len(removed)} stale /dev/shm segment(s) no live process holds: {', '.join(removed[:4])}"
                f"{f' and {len(removed) - 4} more' if len(removed) > 4 else ''}")

    def _on_start(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        if phase != "end":
            return None
        if event.get("gated"):
            return f"started pid {event.get('pid')}: the gated engine activated ({self.engine.gate_activate}), it loads now"
        return f"started pid {event.get('pid')}"

    def _on_cache(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        if phase != "end" or event.get("mode") == "none":
            return None
        return {"keep": "weight cache kept: ", "start": "weight cache (re)starts: "}.get(
            str(event.get("mode")), "weight cache: ") + str(event.get("why") or "")

    def _on_cache_stop(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        if phase == "end" and (event.get("terminated") or event.get("killed")):
            return (f"stopped the weight-cache daemons ({len(event.get('terminated') or [])} ended on SIGTERM, "
                    f"{len(event.get('killed') or [])} SIGKILLed)")
        return None

    def _on_cache_start(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        if phase != "end":
            return None
        self.timings.setdefault(f"{target}:weight cache", float(event.get("elapsed_s") or 0))
        if event.get("ok"):
            return f"weight cache ready on every GPU after {_seconds(event.get('elapsed_s'))} (daemons {event.get('daemons')})"
        tail = [str(line) for line in event.get("log_tail") or []]
        if tail:
            self.tails[f"{target} weight cache"] = tail
        return "the weight cache did NOT come up: " + ("; ".join(event.get("problems") or []) or
                                                     f"exit code {event.get('exit_code')}")

    def _on_gated(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        if phase == "begin":
            started = f"started the new engine gated (pid {event.get('pid')}, gate :{event.get('gate_port')})"
            # "old": the servers it overlaps, as the agent found them (an older agent does not say: one runs)
            if event.get("old", True):
                return f"{started} while the old one serves"
            return f"{started}; no server runs on :{event.get('port')} (a first start, or after NOTHING SERVES)"
        if phase != "end":
            return None
        if event.get("reached"):
            return f"the gated engine reached its gate {_seconds(event.get('elapsed_s'))} after its start"
        if event.get("taken_by"):
            return (f"the gated engine's gate port is taken by pid {', '.join(str(p) for p in event['taken_by'])}: "
                    f"it can never be activated; ended, an ordinary start instead")
        if event.get("ended"):
            return f"ended the gated engine, never activated (pids {event.get('ended')})"
        return None

    def _on_load(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        if phase != "end":
            return None
        self.timings.setdefault(f"{target}:load", float(event.get("elapsed_s") or 0))
        state = event.get("state")
        if state == "ready":
            return f"healthy and generating after {_seconds(event.get('elapsed_s'))}"
        tail = [str(line) for line in event.get("log_tail") or []]
        if tail:
            self.tails[str(target)] = tail
        code = event.get("exit_code")
        if state == "crashed":
            what = "crashed" + (f" (exit code {code})" if code is not None else "")
        elif state == "timeout":
            what = "was not healthy in time"
        else:
            what = f"ended its load: {state}"
        return f"the server {what} after {_seconds(event.get('elapsed_s'))}"

    def _on_verify(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        if phase != "end":
            return None
        if event.get("capacity"):
            self.capacity = dict(event["capacity"])
        if event.get("ok"):
            what = self.desired_what if target in (None, "desired") else "the recorded spec"
            return f"verified: the running argv and {self.engine.info_endpoint} match {what}"
        return "verify FAILED: " + "; ".join(event.get("problems") or [])

    def _on_failed(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        return f"the desired server failed: {event.get('reason')}"

    def _on_rollback(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        if phase == "begin":
            argv = list((event.get("to") or {}).get("argv") or [])
            args = " ".join(argv[self.engine.read_running(argv).args_start:])
            return f"rolling back to the last good spec: {args[:200]}"
        if phase == "end" and not event.get("ok"):
            return f"the rollback failed too: {event.get('reason')}"
        return None

    # a live change (gpugate/agent/live.py), as a second controller following it reads it
    def _on_live_apply(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        if phase != "end":
            return None
        if event.get("ok"):
            return f"applied live: {event.get('change')}"
        return f"the engine refused {event.get('change')}: {event.get('error')}"

    def _on_live_verify(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        if phase != "end":
            return None
        return ("verified live: the server lists the desired state and generates" if event.get("ok")
                else f"the live verify failed: {event.get('error')}")

    def _on_live_undo(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        if phase == "begin":
            return f"undoing {', '.join(event.get('changes') or []) or 'nothing (none was applied)'}: {event.get('reason')}"
        return ("undone: the previous state serves" if event.get("ok")
                else "the undo failed: " + "; ".join(event.get("problems") or ["?"]))

    def _on_outcome(self, event: Mapping[str, Any], phase: Any, target: Any) -> str | None:
        self.outcome = dict(event)
        return None

    def timing_text(self) -> str:
        parts = []
        for key, label in (("desired:drain", "drain"), ("replaces:drain", "old drain"), ("desired:gate", "gate"),
                           ("desired:load", "load")):
            if key in self.timings:
                parts.append(f"{label} {self.timings[key]:.2f} s")
        return ", ".join(parts)

    def total_s(self) -> float | None:
        if self.began is None or self.ended is None:
            return None
        return round(self.ended - self.began, 2)

    def doing(self, now: float) -> str:
        """What the container is doing, for an interrupt: ``loading, 12 s``."""
        step = {"run": "beginning", "plan": "beginning", "stop": "stopping", "drain": "draining",
                "kill": "killing the old tree", "sweep": "sweeping", "gate": "waiting for the GPU gate",
                "prepare": "preparing", "start": "starting", "load": "loading", "verify": "verifying",
                "commit": "committing", "failed": "rolling back", "rollback": "rolling back",
                "adopt": "loading"}.get(self.step or "", self.step or "beginning")
        if self.step_began is None:
            return step
        return f"{step}, {max(0.0, now - self.step_began):.0f} s"


def outcome_lines(outcome: str | None, reasons: Mapping[str, Any] | None, message: str | None, port: int,
                  narrator: Narrator | None = None) -> tuple[bool, list[str]]:
    """(succeeded, lines) for a run's outcome. Only ``verified`` succeeds; NOTHING SERVES is loud
    and gives both reasons; a rollback shows the failed start's log tail."""
    reasons = dict(reasons or {})
    tails = narrator.tails if narrator else {}
    if outcome == "verified":
        total = narrator.total_s() if narrator else None
        timing = narrator.timing_text() if narrator else ""
        text = "done" + (f" in {total:.1f} s" if total is not None else "") + (f" ({timing})" if timing else "")
        return True, [text]
    if outcome == "rolled_back":
        lines = [f"ROLLED BACK: {message or 'the previous server serves again'}"]
        lines += _tail_lines("log tail of the failed start", tails.get("desired"))
        return False, lines
    if outcome == "nothing_serves":
        lines = ["!" * 78,
                 f"!! NOTHING SERVES on :{port}",
                 f"!!   the desired server failed: {reasons.get('desired') or '?'}",
                 f"!!   the rollback: {reasons.get('rollback') or '?'}",
                 "!! every port involved was stopped and its GPUs swept; fix the cause and re-run",
                 "!" * 78]
        lines += _tail_lines("log tail of the failed start", tails.get("desired"))
        lines += _tail_lines("log tail of the rollback", tails.get("rollback"))
        return False, lines
    if outcome in ("live_undone", "live_undo_failed"):  # a live change: the server never stopped
        word = "UNDONE" if outcome == "live_undone" else "UNDO FAILED"
        return False, [f"LIVE CHANGE FAILED, {word}: {message or reasons.get('live') or '?'}"]
    if outcome == "refused":
        return False, [f"refused by the agent, nothing touched: {reasons.get('desired') or message}"]
    if outcome == "interrupted":
        return False, [f"the agent ended without an outcome ({message or 'killed?'}); "
                       f"a re-run recovers the run"]
    return False, [f"ended with {outcome!r}: {message or ''}"]


def _tail_lines(title: str, tail: Sequence[str] | None, keep: int = 15) -> list[str]:
    if not tail:
        return []
    return [f"    {title}:"] + ["    | " + (line if len(line) <= 400 else line[:400] + " ...")
                                for line in list(tail)[-keep:]]
