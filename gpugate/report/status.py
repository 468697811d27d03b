"""The status to page on (runbooks/status.py): one row per desired server with a verdict, from the
agent's observation and the container's desired state. The verdict comes from
gpugate.match.compare, the function the deploy's plan decides by, so the status calls "as desired"
exactly what the deploy leaves alone.

Example::

    row = status_row("pve1", 129, observation, desired_state(host.data))
    publish_status([row])
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
import re
from typing import Any, TypedDict

from pyinfra import logger

from gpugate.engine import DEFAULT_ENGINE, get as engine
from gpugate.match import compare, diff_lines, env_lines, for_container, runs_exactly
from gpugate.plan import stall_text
from gpugate.rules import gate as rules_gate
from gpugate.report.fleet import connect_errors
from gpugate.report.prometheus import status_prometheus, write_atomically
from gpugate.report.text import (age_text, compact_mib, driver_overhead_text, epoch_of, flag_differences,
                                 format_table, index_ranges, natural_key, when_text)
from gpugate.spec import Desired, Spec, SpecError, desired_states, gpu_set

# ---------------------------------------------------------------- status


class StatusRow(TypedDict, total=False):
    host: str          # the Proxmox host (fleet.yaml name)
    vmid: Any
    port: int
    engine: str        # the server's engine (gpugate.engine): the desired one
    kind: str          # serving | drifted | down | stopped | transition_running | transition_failed | gpu_held
                       # | unreachable | unknown | unrouted | router_unknown | cordoned | cordon_pending
                       # (see VERDICT_KINDS)
    ok: bool           # as desired: nothing to page about
    verdict: str       # the kind in words, with why: "drifted: - --kv-cache-dtype auto, + --kv-cache-dtype fp8_e4m3"
    desired: bool      # a server should run here (sglang_present)
    up: bool           # it serves: main alive, /health 200, every scheduler alive
    drifted: bool      # it runs with other flags or another model than desired (or should not run)
    server: str        # serving | starting | loading | unhealthy | stopped | probe failed (+ pid, age)
    health: str        # what /health said, or why it could not answer
    model: str
    flags: str         # the flags that differ from the desired ones ("=" none, "-" not running)
    gpu_mib: str       # per-GPU used MiB (NVML v2), compacted
    gpu_used: list[Any]  # per-GPU used MiB in GPU order (None: unreadable); [] when unknown
    holders: str       # GPU processes in the container, memory held from outside it, driver overhead
    transition: dict[str, Any]   # the latest transition: run, active, step, outcome, began, updated, duration_s
    last_change: str   # the latest transition in a few words
    history: list[str]  # newest entries of the history, one line each
    good_specs: list[dict[str, Any]]  # the history's good specs in its order: label, key, at, by, against, changes
    problems: list[str]
    router: dict[str, Any]   # a routed server as its router sees it (gpugate.router.membership); {} if not routed
    router_text: str   # "lab: healthy", "lab: missing", "-"
    weight_cache: dict[str, Any]  # the server's weight-cache daemons (observe's view); {} without
    weight_cache_text: str  # "key 3f2a9c0d: GPU0 pid 45 12000 MiB, ...", "-"
    mapped_gpus: list[int]  # the GPUs the Proxmox node passes into the container (gpugate.proxmox); absent: not known
    mapped: str        # the same as device nodes: "/dev/nvidia0-1", "none"
    canary: dict[str, Any]  # the canary of a rolling change on this server: under way or its verdict (docs/canary.md)
    canary_text: str   # "soaking 40/120 s", "pass 3m ago", "REGRESSION, rolled back 1h ago"


VERDICT_KINDS = {
    "serving": "serving as desired", "drifted": "drifted", "down": "down but desired",
    "stopped": "stopped as desired", "transition_running": "transition running",
    "transition_failed": "transition failed", "gpu_held": "GPU memory held with no holder in the container",
    "unreachable": "unreachable", "unknown": "unknown", "invalid": "desired state invalid",
    "unrouted": "serving, but its router does not list it",
    "router_unknown": "serving, but its router does not answer (membership unknown)",
    "cordoned": "serving as desired, cordoned: out of its router",
    "cordon_pending": "serving, but cordoned and still in its router",
}
OK_KINDS = ("serving", "stopped", "cordoned")
FAILED_OUTCOMES = ("rolled_back", "nothing_serves", "interrupted")

STATUS_COLUMNS = [
    ("host", "HOST"), ("vmid", "VMID"), ("port", "PORT"), ("engine", "ENGINE"), ("verdict", "VERDICT"),
    ("server", "SERVER"), ("mapped", "MAPPED GPUS"),
    ("model", "MODEL"), ("router_text", "ROUTER"), ("gpu_mib", "GPU MiB"), ("holders", "GPU HOLDERS"),
    ("weight_cache_text", "WEIGHT CACHE"), ("canary_text", "CANARY"), ("last_change", "LAST CHANGE"),
]  # ENGINE, ROUTER, WEIGHT CACHE: shown only when a row runs another engine than the default, is
#   routed, or has a weight cache, MAPPED GPUS only when a Proxmox node told them (render_status)


def weight_cache_text(view: Mapping[str, Any] | None) -> str:
    """The daemons in one cell: ``key 3f2a9c0d (tp 0/2, /m): GPU0 pid 45 12000 MiB, GPU1 pid 46 12000 MiB``.

    >>> weight_cache_text({"running": True, "key": {"id": "3f2a9c0d11"}, "gpus": [{"index": 0, "pid": 45, "used_mib": 12000, "config": "tp 0/1, /m"}]})
    'key 3f2a9c0d (tp 0/1, /m): GPU0 pid 45 12000 MiB'
    """
    if not view:
        return "-"
    gpus = view.get("gpus") or []
    cells = ", ".join(f"GPU{g.get('index')} pid {g.get('pid') or '-'} "
                      f"{g.get('used_mib') if g.get('used_mib') is not None else '?'} MiB" for g in gpus)
    config = (gpus[0].get("config") if gpus else None) or "?"
    text = f"key {str((view.get('key') or {}).get('id') or '?')[:8]} ({config}): {cells or 'no GPU'}"
    if not view.get("running"):
        text = "NOT READY: " + "; ".join(view.get("problems") or ["?"]) + " | " + text
    return text


def server_state(server: Mapping[str, Any]) -> tuple[str, str]:
    """(state, health) of the server from the server document (the agent's observe ``sglang``)."""
    if "error" in server:
        return "probe failed", str(server["error"])[:80]
    health = server.get("health") or {}
    code = health.get("health")
    if not server.get("running"):
        # another server's parts (a container may hold several) are that server's, never strays here
        strays = [s for s in server.get("strays") or [] if s.get("port") in (None, server.get("port"))]
        state = f"stopped, {len(strays)} stray server part(s)" if strays else "stopped"
        return state, "-"
    main = server.get("main") or {}
    age = age_text(main.get("age_s"))
    workers = server.get("workers") or {}
    if workers.get("dead"):
        state = f"unhealthy ({workers['dead']} of {workers.get('expected', '?')} schedulers dead)"
    elif code == 200:
        state = "serving"
    elif code == 503:
        state = "starting"
    elif not server.get("listening"):
        state = "loading"
    else:
        state = "unhealthy"
    state += f" pid {main.get('pid')}" + (f" up {age}" if age else "")
    if main.get("state") in ("D", "Z", "T"):
        state += f" [{main['state']}]"
    if code is not None:
        text = f"/health {code}"
    else:
        text = str(health.get("health_error") or "no answer")
    return state, text


def foreign_mib(gpu_doc: Mapping[str, Any], max_used_mib: Any = 64) -> dict[int, int]:
    """GPU index -> MiB in use that no process of the container accounts for, above the gate's
    threshold: held from outside (the host's or another container's: NVML in a container lists
    only its own processes); at or under it, it is driver overhead, never this. The one rule
    (gpugate.rules.gate.outside_memory), as sglang.server's pre-stop check reads it."""
    held, _overhead = rules_gate.outside_memory(gpu_doc, max_used_mib)
    return {int(index): int(mib) for index, mib in held.items()}


def holders_text(gpu_doc: Mapping[str, Any], max_used_mib: Any = 64) -> str:
    """``9 in ct (sglang::scheduler_TP0..7, python3)``, ``none``; memory held from outside (over
    the gate's ``max_used_mib``), or driver overhead (at or under it: ``GPU 0: 8 MiB, driver
    overhead (under the gate's 64 MiB)``, which is no holder and blocks nothing)."""
    if "source" not in gpu_doc:
        return f"GPU probe failed: {gpu_doc.get('error', '?')}"[:80]
    holders = gpu_doc.get("holders") or []
    parts = []
    if holders:
        parts.append(f"{len(holders)} in ct ({_names(holders)})")
    foreign, overhead = rules_gate.outside_memory(gpu_doc, max_used_mib)
    if foreign:
        parts.append(f"OUTSIDE the ct: {sum(foreign.values())} MiB on GPU {index_ranges(sorted(foreign))}")
    if overhead:
        parts.append(driver_overhead_text(overhead, max_used_mib))
    stuck = [h for h in holders if h.get("state") in ("D", "Z")]
    if stuck:
        parts.append(f"{len(stuck)} stuck (D/Z)")
    return "; ".join(parts) or "none"


def _names(holders: Sequence[Mapping[str, Any]]) -> str:
    """Holder command names, TP ranks folded: ``sglang::scheduler_TP0..7``."""
    names: list[str] = []
    ranks: dict[str, list[int]] = {}
    for holder in holders:
        first = (holder.get("cmdline") or holder.get("comm") or "?").split()[0]
        first = os.path.basename(first) if first.startswith("/") else first
        match = re.match(r"^(.*?)(\d+)$", first)
        if match and "TP" in match.group(1):
            ranks.setdefault(match.group(1), []).append(int(match.group(2)))
            if match.group(1) not in names:
                names.append(match.group(1))
        elif first not in names:
            names.append(first)
    out = []
    for name in names:
        if name in ranks:
            numbers = sorted(ranks[name])
            out.append(f"{name}{numbers[0]}..{numbers[-1]}" if len(numbers) > 1 else f"{name}{numbers[0]}")
        else:
            out.append(name)
    return ", ".join(out)


def of_this_port(transition: Mapping[str, Any], port: Any) -> bool:
    """Whether a container's run (the agent's ``transition``: its ``ports``) concerned the server
    on ``port`` (a container may hold several servers; unknown ports: assume so).

    >>> of_this_port({"ports": [30001]}, 30000), of_this_port({"ports": [30000]}, 30000), of_this_port({}, 30000)
    (False, True, True)
    """
    ports = transition.get("ports")
    return not ports or port is None or int(port) in [int(p) for p in ports]


def transition_summary(server: Mapping[str, Any]) -> dict[str, Any]:
    """The latest transition from the agent's ``transition`` (or the history's ``last``):
    run, active, step, outcome, reasons, began, updated, duration_s (ended runs), by. {} when none."""
    transition = server.get("transition")
    if not isinstance(transition, Mapping) or not of_this_port(transition, server.get("port")):
        transition = None  # the container's latest run was another server's: this one's is its history's
    last = (server.get("history") or {}).get("last") if isinstance(server.get("history"), Mapping) else None
    source = transition if isinstance(transition, Mapping) else last if isinstance(last, Mapping) else None
    if not source:
        return {}
    summary = {key: source.get(key) for key in ("run", "active", "step", "phase", "outcome", "reasons", "message",
                                                  "began", "updated", "by", "at") if source.get(key) is not None}
    began, updated = epoch_of(source.get("began")), epoch_of(source.get("updated"))
    if began is not None and updated is not None and not source.get("active"):
        summary["duration_s"] = round(max(0.0, updated - began), 3)
    return summary


def _record_flags(record: Mapping[str, Any]) -> dict[str, Any]:
    argv = record.get("argv")
    if not isinstance(argv, list):
        return {}
    try:
        recorded = engine(record.get("engine") or DEFAULT_ENGINE)
    except KeyError:  # a spec of an engine this controller does not have: its flags as recorded
        return dict(record.get("flags") or {}) if isinstance(record.get("flags"), Mapping) else {}
    return dict(recorded.read_running(argv).flags)


def good_label(index: int, count: int) -> str:
    """The label of the ``index``-th entry of a history's good list, which is newest first (a
    rollback or a same-spec restart moves its spec to the front): the labels follow that order,
    never the time a spec was first verified. ``good K`` is ``rollback_to=K`` while good 0 runs.

    >>> [good_label(i, 3) for i in range(3)], good_label(0, 1)
    (['good 0 (newest)', 'good 1', 'good 2 (oldest kept)'], 'good 0 (newest)')
    """
    if index == 0:
        return "good 0 (newest)"
    return f"good {index}" + (" (oldest kept)" if index == count - 1 else "")


def good_specs(server: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The good specs of the container's history in its order (newest first), each with its label,
    key, when and by whom it was verified, its KV capacity, and what it changes against the one
    after it (the next older, in the one diff format): the JSON's ``good_specs``, and the text's
    history lines."""
    history = server.get("history")
    if not isinstance(history, Mapping):
        return []
    good = [r for r in history.get("good") or [] if isinstance(r, Mapping)]
    out = []
    for index, record in enumerate(good):
        older = good[index + 1] if index + 1 < len(good) else None
        capacity = record.get("capacity")
        tokens = capacity.get("max_total_num_tokens") if isinstance(capacity, Mapping) else None
        out.append({"index": index, "label": good_label(index, len(good)), "key": record.get("key"),
                    "at": record.get("at"), "by": record.get("by"),
                    "kv_tokens": tokens if isinstance(tokens, int) else None,
                    "against": f"good {index + 1}" if older is not None else None,
                    "changes": flag_differences(_record_flags(older), _record_flags(record)) if older is not None
                    else []})
    return out


def good_spec_line(entry: Mapping[str, Any]) -> str:
    """One good spec as the history shows it: ``2026-11-30 21:58Z good 0 (newest) by ana@ops: + --kv-cache-dtype
    fp8_e4m3 against good 1 (KV cache 319,488 tokens)``."""
    if entry.get("against") is None:
        what = "nothing older kept"
    else:
        what = f"{', '.join(entry.get('changes') or []) or 'the same flags'} against {entry['against']}"
    tokens = entry.get("kv_tokens")
    extra = f" (KV cache {tokens:,} tokens)" if isinstance(tokens, int) else ""
    return f"{when_text(entry.get('at'))} {entry.get('label')} by {entry.get('by') or '?'}: {what}{extra}"


def history_lines(server: Mapping[str, Any], limit: int = 3) -> list[str]:
    """The newest entries of the container's history (good and failed, newest first), one line each:
    the good specs in the history's own order (:func:`good_specs`, labelled ``good 0 (newest)``,
    ``good 1``, ...), each failed attempt placed among them by its time, e.g.
    ``2026-11-30 21:58Z good 0 (newest) by ana@ops: + --kv-cache-dtype fp8_e4m3 against good 1
    (KV cache 319,488 tokens)``."""
    history = server.get("history")
    if not isinstance(history, Mapping):
        return []
    good = [(epoch_of(entry.get("at")) or 0.0, good_spec_line(entry)) for entry in good_specs(server)]
    failed = sorted(((epoch_of(record.get("at")) or 0.0,
                      f"{when_text(record.get('at'))} FAILED by {record.get('by') or '?'}: "
                      f"{str(record.get('reason') or '?')[:120]}")
                     for record in history.get("failed") or [] if isinstance(record, Mapping)),
                    key=lambda entry: entry[0], reverse=True)
    lines: list[str] = []
    while (good or failed) and len(lines) < limit:  # a merge: the good list keeps its order
        take_failed = bool(failed) and (not good or failed[0][0] > good[0][0])
        lines.append((failed if take_failed else good).pop(0)[1])
    return lines


# ---------------------------------------------------------------- what a rollback restored
def history_spec_text(record: Mapping[str, Any], server: Mapping[str, Any]) -> str:
    """A history record (the rollback runbook's target, the agent's rollback ``to``) as the operator
    finds it in the status: its label in the history the observation read, its key, when and by
    whom it was verified. ``good 1 of :30000's history (key 3fa2c1d04e5b6a70, verified 2026-11-30
    21:58Z by ana@ops)``; a spec the history does not hold: ``the server that ran before (not in the
    history of :30000)``."""
    port = server.get("port") or record.get("port")
    key = record.get("key")
    for entry in good_specs(server):
        if key and entry.get("key") == key:
            return (f"{entry['label']} of :{port}'s history (key {key}, verified {when_text(entry.get('at'))} "
                    f"by {entry.get('by') or '?'})")
    return f"the server that ran before (not in the history of :{port})"


def desired_differences(record: Mapping[str, Any], spec: Spec | None, problem: str | None = None) -> str:
    """How the desired state differs from a recorded spec that serves (a rollback's), in the one diff
    format, as the next deploy would change it (and the status calls it drifted until then).

    >>> from gpugate.spec import build_spec
    >>> spec = build_spec("/m", 30000, {"tp": 2, "kv-cache-dtype": "fp8_e4m3"})
    >>> record = {"argv": list(build_spec("/m", 30000, {"tp": 2}).argv), "env_hashes": {}}
    >>> desired_differences(record, spec)
    'the desired state differs from it: + --kv-cache-dtype fp8_e4m3 (the next deploy.py applies it)'
    """
    if spec is None:
        return (f"the desired state has no server here ({problem or 'sglang_present: false'}): "
                f"the next deploy.py {'refuses it' if problem else 'stops it'}")
    argv = list(record.get("argv") or [])
    served = {"running": True, "env_hashes": dict(record.get("env_hashes") or {}),
              "main": {"argv": argv, "argv_hash": record.get("argv_hash"), "supervisor": record.get("supervisor")}}
    lines = diff_lines(served, spec) + env_lines(served, spec)
    if lines:
        return f"the desired state differs from it: {', '.join(lines)} (the next deploy.py applies it)"
    if record.get("argv_hash") and not runs_exactly(served, spec):
        return ("the desired state differs from it only in a secret value, an environment value or the "
                "supervisor (the next deploy.py applies it)")
    return "it is the desired state"


def _verdict(kind: str, why: str = "") -> str:
    return VERDICT_KINDS[kind] + (f": {why}" if why else "")


def own_gpus(desired: Desired, gpu_doc: Mapping[str, Any]) -> set[int]:
    """The GPUs the desired server uses (its Spec's), as indexes of the container's GPU document;
    every GPU of the document when the set cannot be told (UUIDs, no server desired).

    >>> from gpugate.spec import desired_state
    >>> desired = desired_state({"sglang_model_path": "/m", "sglang_flags": {"tp": 4, "base-gpu-id": 4}})
    >>> sorted(own_gpus(desired, {"gpus": [{"index": i} for i in range(8)]}))
    [4, 5, 6, 7]
    """
    if desired.spec is not None and desired.spec.gpus is not None:
        return set(desired.spec.gpus)
    if desired.spec is None and desired.flags:
        try:  # the memory a killed server of these flags left behind is still this server's
            return set(gpu_set(desired.flags))
        except SpecError:
            pass
    return {int(gpu["index"]) for gpu in gpu_doc.get("gpus") or [] if gpu.get("index") is not None}


def drift_items(match: Any, server: Mapping[str, Any], desired: Desired) -> list[str]:
    """What the status says a differing server differs in, from the same comparison the deploy
    plans by: its lines in the one diff format (``+ --disable-radix-cache``, ``- --model-path /a``,
    extra args); else the environment (each name with the value about to be applied, ``***`` for a
    secret), a secret flag value or the supervisor, which have no value to show."""
    items = list(match.flag_items)
    if not items:
        env = [line[len("+ env "):] for line in match.lines if line[1:].startswith(" env ")]
        if env:
            items.append("environment differs: " + ", ".join(env))
        elif match.replaced:
            items.append("port change: :" + ", :".join(str(r["port"]) for r in match.replaced)
                         + f" -> :{desired.port}")
        elif desired.spec is not None and desired.spec.secret_flags() or any(
                value == "***" for value in ((server.get("command") or {}).get("flags") or {}).values()):
            items.append("a secret flag value differs (by the argv's hash)")
        else:
            supervisor = (server.get("main") or {}).get("supervisor") or "process"
            items.append(f"supervisor {supervisor} runs, {desired.spec.supervisor if desired.spec else '?'} desired")
    return items


_ROUTER_CACHE: dict[str, tuple[float, list[dict[str, Any]] | None, str | None]] = {}
ROUTER_CACHE_S = 5.0  # one GET /workers per router for a whole status run (pyinfra asks per host)


def router_view(desired: Desired) -> dict[str, Any] | None:
    """A routed server's membership as its router sees it (None: not routed): one ``GET /workers``
    per router per status run; a router that does not answer is ``unknown``, with why."""
    routing = desired.routing
    if routing is None:
        return None
    from gpugate import router  # noqa: PLC0415 -- only routed servers talk to a router

    cached = _ROUTER_CACHE.get(routing.endpoint)
    if cached is None or time.monotonic() - cached[0] > ROUTER_CACHE_S:
        try:
            cached = (time.monotonic(), router.client_for(routing).workers(), None)
        except router.RouterError as error:
            cached = (time.monotonic(), None, str(error)[:160])
        _ROUTER_CACHE[routing.endpoint] = cached
    return router.membership(routing, cached[1], cached[2])


CANARY_LATE_S = 60.0  # a soak this long past its end without a verdict: its controller ended before one


def canary_view(record: Mapping[str, Any] | None, now: float | None = None) -> dict[str, Any]:
    """The container's canary record (written by the controller: gpugate.operations.sglang) as the
    status keeps it: ``state`` soaking, ended or interrupted (a soak long past its end, no verdict).

    >>> canary_view({"state": "soaking", "began": 100.0, "soak_s": 60}, now=400.0)["state"]
    'interrupted'
    >>> canary_view(None)
    {}
    """
    if not isinstance(record, Mapping) or not record:
        return {}
    view = dict(record)
    now = time.time() if now is None else now
    began, soak_s = view.get("began"), view.get("soak_s")
    if view.get("state") == "soaking" and isinstance(began, (int, float)) and isinstance(soak_s, (int, float)) \
            and now > began + soak_s + CANARY_LATE_S:
        view["state"] = "interrupted"
    return view


def canary_text(view: Mapping[str, Any] | None, now: float | None = None) -> str:
    """The CANARY column.

    >>> canary_text({"state": "soaking", "began": 100.0, "soak_s": 120.0}, now=140.0)
    'soaking 40/120 s'
    >>> canary_text({"state": "ended", "verdict": "regression", "rolled_back": True, "ended": 100.0}, now=280.0)
    'REGRESSION, rolled back 3m ago'
    """
    if not view:
        return "-"
    now = time.time() if now is None else now
    if view.get("state") == "soaking":
        soak_s = view.get("soak_s")
        soak = f"{soak_s:g}" if isinstance(soak_s, (int, float)) else str(soak_s)  # the record's 30.0: "30"
        return f"soaking {max(0.0, now - float(view.get('began') or now)):.0f}/{soak} s"
    if view.get("state") == "interrupted":
        return "soak interrupted (no verdict)"
    word = {"pass": "pass", "regression": "REGRESSION", "low-traffic": "too little traffic",
            "no-baseline": "no verdict"}.get(str(view.get("verdict")), str(view.get("verdict")))
    if view.get("rolled_back") is not None:
        word += ", rolled back" if view.get("rolled_back") else ", ROLLBACK FAILED"
    ended = view.get("ended")
    return f"{word} {age_text(now - ended)} ago" if isinstance(ended, (int, float)) else word


def router_text(view: Mapping[str, Any] | None) -> str:
    """The ROUTER column.

    >>> router_text({"router": "gw", "state": "healthy"}), router_text(None)
    ('gw: healthy', '-')
    """
    return f"{view.get('router')}: {view.get('state')}" if view else "-"


def status_row(host: str, vmid: Any, observation: Mapping[str, Any], desired: Desired,
               router: Mapping[str, Any] | None = None) -> StatusRow:
    """One row of the status from the agent's observation and the container's desired state
    (gpugate.settings.desired_state of its host data), with a verdict; the first that applies:

    - transition running (the agent holds the lock): ``transition running: stop since ...``;
    - the latest transition failed (rolled_back, nothing_serves, interrupted): ``transition failed: ...``
      (a later verified run clears it);
    - the desired state makes no server (a flag SGLang refuses, no model path): ``desired state invalid``;
    - what gpugate.match.compare says, the function the deploy plans by: serving as desired;
      drifted (what differs: flags, model, host, interpreter, env, a secret, supervisor; or should
      not run); down but desired (not running, or the desired server does not serve: loading,
      /health 503, dead schedulers); stopped as desired;
    - no server runs: GPU memory held with no holder in the container on the server's OWN GPUs
      (the stuck memory of a killed server; a neighbour container's server on other GPUs is no
      verdict), before down but desired / stopped as desired.

    - serving as desired, but routed and its router does not list it (``router``: router_view's
      membership): ``serving, but its router does not list it`` (the deploy adds it); a router that
      does not answer: ``serving, but its router does not answer`` (not ok: membership unknown is not
      as desired); declared out (``router_cordon: true``): out of its router (missing, or draining)
      is ``serving as desired, cordoned`` (ok), still listed ``serving, but cordoned and still in its
      router`` (the deploy takes it out).

    ``ok`` is true for serving as desired and stopped as desired only: exactly when the deploy
    would change nothing.
    """
    server = observation.get("sglang") or {"error": observation.get("error") or "no server section"}
    gpu_doc = observation.get("gpu") or {}
    port = desired.port
    present = desired.present
    state, health = server_state(server)
    lock = server.get("lock")
    if isinstance(lock, Mapping) and (lock.get("owner") or lock.get("held")):
        state += f" (locked: {lock.get('owner') or lock.get('run') or '?'}, {lock.get('step') or 'pid %s' % lock.get('pid')})"
    command = server.get("command") or {}
    # what it serves: a live weight update moves it away from the launch's (docs/live-changes.md)
    running_model = ((server.get("live") or {}).get("model_path") if isinstance(server.get("live"), Mapping) else None) \
        or command.get("model_path")
    desired_model = desired.spec.model_path if desired.spec is not None else None
    model = running_model or desired_model
    running = bool(server.get("running"))
    serving = bool(server.get("serving")) if "serving" in server else state.startswith("serving")
    serving = serving and not (server.get("workers") or {}).get("dead")
    gpus = gpu_doc.get("gpus") or []
    readable = "source" in gpu_doc
    gpu_mib = compact_mib([gpu.get("used_mib") for gpu in gpus]) if readable else "?"
    problems = []
    if gpu_doc.get("source") in (None, "none"):  # errors of a fallback that answered are not problems
        problems = [f"{error.get('source')}: {error.get('message')}" for error in gpu_doc.get("errors") or []
                    if isinstance(error, Mapping)]
    problems += [f"GPU {gpu.get('index')}: {gpu['error']}" for gpu in gpus if gpu.get("error")]
    history_problem = (server.get("history") or {}).get("problem") if isinstance(server.get("history"), Mapping) else None
    if history_problem:
        problems.append(history_problem)
    raw = server.get("transition")
    raw_transition: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    stalled = stall_text(raw_transition.get("agent"), desired.agent_silence_s) if raw_transition.get("active") else None
    if stalled:
        problems.append(f"the transition of run {raw_transition.get('run')} is stalled at "
                        f"{raw_transition.get('step') or 'its start'}: {stalled}")
    transition = transition_summary(server)
    # only the server's own GPUs: a neighbour container's healthy server holds memory on its GPUs,
    # which this container's NVML sees as held from outside (the lab's 129 on 0-3, 130 on 4-7)
    mine = own_gpus(desired, gpu_doc)
    held = ({index: mib for index, mib in foreign_mib(gpu_doc, desired.max_used_mib).items() if index in mine}
            if readable else {})
    spec = for_container(desired.spec, observation)
    match = (compare(observation, spec, port, desired.siblings)
             if "error" not in server and not desired.problem else None)
    flags_text = "-"
    if running and match is not None:
        flags_text = ("should not run" if match.verdict == "should_not_run"
                      else ", ".join(drift_items(match, server, desired)) if match.verdict == "differs" else "=")

    if "error" in server:
        kind, why = "unknown", f"probe failed: {str(server['error'])[:100]}"
    elif transition.get("active"):
        kind, why = "transition_running", (f"{transition.get('step') or '?'} (run {transition.get('run')}"
                                          f"{', since ' + when_text(transition.get('began')) if transition.get('began') else ''})"
                                          f"{', STALLED (its agent writes nothing: see problems)' if stalled else ''}")
    elif transition.get("outcome") in FAILED_OUTCOMES:
        reasons = transition.get("reasons")
        detail = ("; ".join(f"{k}: {v}" for k, v in reasons.items()) if isinstance(reasons, Mapping)
                  else str(reasons or transition.get("message") or ""))
        kind, why = "transition_failed", f"{transition['outcome']} (run {transition.get('run')}): {detail}"[:160]
    elif match is None:
        kind, why = "invalid", str(desired.problem)[:160]
    elif match.verdict == "should_not_run":
        kind, why = "drifted", "runs but should not"
    elif match.verdict == "differs":
        kind, why = "drifted", flags_text
    elif match.verdict == "not_serving":
        kind, why = "down", state.split(" pid")[0] + (f", {health}" if health not in ("-", "") else "")
    elif match.verdict == "as_desired" and router is not None and router.get("state") == "missing":
        kind, why = "unrouted", f"router {router.get('router')} has no worker at {router.get('url')} (the deploy adds it)"
    elif match.verdict == "as_desired" and router is not None and router.get("state") == "unknown":
        # a replica that dropped out because its router died must page: unknown is not as desired
        kind, why = "router_unknown", f"router {router.get('router')}: {str(router.get('error') or '?')[:120]}"
    elif match.verdict == "as_desired" and router is not None and router.get("state") == "cordoned":
        kind, why = "cordoned", f"router_cordon: true, router {router.get('router')} sends it nothing"
    elif match.verdict == "as_desired" and router is not None and router.get("cordoned"):
        kind, why = "cordon_pending", (f"router {router.get('router')} lists it {router.get('worker_id')} "
                                       f"(the deploy takes it out)")
    elif match.verdict == "as_desired":
        kind, why = "serving", ""
    elif held:
        kind, why = "gpu_held", f"{sum(held.values())} MiB on GPU {index_ranges(sorted(held))}"
    elif match.verdict == "strays":
        kind, why = "drifted", "stray server parts run but no server should"
    elif present:
        kind, why = "down", "no server runs" + (f" (last: {transition['outcome']})" if transition.get("outcome") else "")
    else:
        kind, why = "stopped", ""
    last_change = ""
    if transition:
        last_change = (f"{transition.get('outcome') or transition.get('step') or '?'} "
                       f"{when_text(transition.get('updated') or transition.get('at'))}")
        if transition.get("by"):
            last_change += f" by {transition['by']}"
    row = StatusRow(
        host=host, vmid=vmid, port=int(server.get("port") or port), engine=desired.engine, kind=kind, ok=kind in OK_KINDS,
        verdict=_verdict(kind, why), desired=bool(present), up=running and serving,
        drifted=kind == "drifted", server=state, health=health,
        model=os.path.basename(model.rstrip("/")) if model and model.startswith("/") else model or "-",
        flags=flags_text, gpu_mib=gpu_mib, gpu_used=[gpu.get("used_mib") for gpu in gpus] if readable else [],
        holders=holders_text(gpu_doc, desired.max_used_mib), transition=transition, last_change=last_change,
        history=history_lines(server), good_specs=good_specs(server), problems=problems, router=dict(router or {}),
        router_text=router_text(router), weight_cache=dict(server.get("weight_cache") or {}),
        weight_cache_text=weight_cache_text(server.get("weight_cache")))
    canary = canary_view(server.get("canary"))
    if canary:  # only where a canary ran: the column and the JSON key stay out of other fleets' output
        row["canary"], row["canary_text"] = canary, canary_text(canary)
    return row


def unreachable_row(host: str, vmid: Any, reason: str, desired: Desired) -> StatusRow:
    """The row of a container whose Proxmox host could not be reached: no figures, only why."""
    model = (desired.spec.model_path if desired.spec is not None else None) or "-"
    present, port = desired.present, desired.port
    return StatusRow(host=host, vmid=vmid, port=port, engine=desired.engine, kind="unreachable", ok=False,
                     verdict=_verdict("unreachable", reason), desired=bool(present), up=False, drifted=False,
                     server="-", health="-", model=os.path.basename(model.rstrip("/")) if model.startswith("/") else model,
                     flags="-", gpu_mib="-", gpu_used=[], holders="-", transition={}, last_change="",
                     history=[], good_specs=[], problems=[], router={}, router_text="-", weight_cache={},
                     weight_cache_text="-")


def render_status(rows: Sequence[StatusRow]) -> str:
    """The status table, a summary line, the newest history entries per container, then one
    line per problem (GPU probe errors)."""
    # the ENGINE and ROUTER columns only in a fleet that has them: the table others parse stays as it was
    columns = [c for c in STATUS_COLUMNS if (c[0] != "router_text" or any(row.get("router") for row in rows))
               and (c[0] != "weight_cache_text" or any(row.get("weight_cache") for row in rows))
               and (c[0] != "canary_text" or any(row.get("canary") for row in rows))
               and (c[0] != "mapped" or any(row.get("mapped") for row in rows))
               and (c[0] != "engine" or any(row.get("engine", DEFAULT_ENGINE) != DEFAULT_ENGINE for row in rows))]
    text = format_table(columns, rows)
    bad = [row for row in rows if not row.get("ok")]
    counts: dict[str, int] = {}
    for row in bad:
        counts[row.get("kind", "unknown")] = counts.get(row.get("kind", "unknown"), 0) + 1
    summary = f"{len(rows)} server(s): {len(rows) - len(bad)} as desired"
    if bad:
        summary += f", {len(bad)} NOT (" + ", ".join(f"{VERDICT_KINDS[k]} {n}" for k, n in sorted(counts.items())) + ")"
    text += "\n" + summary
    history = [f"  {row['host']}:{row['vmid']}  {line}" for row in rows for line in row.get("history") or []]
    if history:
        text += "\nhistory (newest first):\n" + "\n".join(history)
    notes = [f"  {row['host']}:{row['vmid']}: {problem}" for row in rows for problem in row.get("problems") or []]
    return text + ("\nproblems:\n" + "\n".join(notes) if notes else "")


def status_document(rows: Sequence[StatusRow]) -> dict[str, Any]:
    """What ``--data format=json`` prints: ONE document, ``ok`` false when any row is not as desired."""
    return {"ok": all(row.get("ok") for row in rows), "generated_at": time.time(),
            "summary": {kind: sum(1 for row in rows if row.get("kind") == kind) for kind in VERDICT_KINDS
                        if any(row.get("kind") == kind for row in rows)},
            "servers": [dict(row) for row in rows]}


def status_when_unreachable(state: Any) -> None:
    """The status runbook's output when no host of the run could be reached (one unreachable row each)."""
    errors = connect_errors(state)
    hosts = [h for h in state.inventory if state.is_host_in_limit(h)]
    rows = [unreachable_row(h.data.get("pve_host") or h.name, h.data.get("pct_vmid"),
                            errors.get(h.name) or "could not connect", desired)
            for h in hosts for desired in desired_states(h.data)]
    first = hosts[0].data if hosts else {}
    publish_status(rows, output_format=first.get("format", "table"), prom_path=first.get("prom"))


def publish_status(rows: Sequence[StatusRow], output_format: str = "table", prom_path: str | None = None,
                   out: Callable[[str], None] | None = None) -> bool:
    """Print the status (``table`` or ``json``) and write the Prometheus file when asked; returns
    True when every row is as desired."""
    rows = sorted(rows, key=lambda row: (natural_key(str(row.get("host"))), natural_key(str(row.get("vmid")))))
    emit = out or (lambda text: print(text, flush=True))
    # The report first: a Prometheus path that cannot be written must not cost the operator the table
    if output_format == "json":
        emit(json.dumps(status_document(rows), default=str))
    else:
        emit(render_status(rows))
    if prom_path:
        try:
            write_atomically(prom_path, status_prometheus(rows))
        except OSError as error:
            logger.error(f"gpugate: cannot write the Prometheus file {prom_path}: {error.strerror or error}")
            return False
    return all(row.get("ok") for row in rows)


