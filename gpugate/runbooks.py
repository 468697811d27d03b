"""What the runbooks (``runbooks/*.py``) show and decide, as pure functions over probe documents.

Nothing here talks to a host: the runbooks read facts (``SglangObservation``, ``GpuState``,
``HostGpuProcesses``) and hand the documents to these functions, so the tables and the decisions
are tested without a network (tests/unit/test_runbooks.py).

Example:

.. code:: python

    row = status_row("pve1", 129, observation, desired_flags={"tp": 8},
                     desired_model="/opt/models/m")
    print(format_table(STATUS_COLUMNS, [row]))
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Optional, TypedDict

from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.api.state import BaseStateCallback

from gpugate import agentcmd
from gpugate.facts.sglang import SglangObservation, observe_args
from gpugate.fleet import validated_settings
from gpugate.spec import DEFAULTS, SpecError, gpu_set, redact_flags
from gpugate.sglang_args import SECRET_MASK, FlagError, diff_flags, is_secret_value, validate_flags
from gpugate.plan import foreign_memory

# ---------------------------------------------------------------- tables


def format_table(columns: Sequence[tuple[str, str]], rows: Iterable[Mapping[str, Any]]) -> str:
    """A plain-text table: one header line, one line per row, columns padded to the widest cell.

    ``columns`` are ``(key, header)`` pairs; a missing or None cell prints as ``-``. The last
    column is not padded (no trailing blanks).

    >>> print(format_table([("a", "A"), ("b", "LONG")], [{"a": "xyz", "b": 1}]))
    A    LONG
    xyz  1
    """
    header = [title for _key, title in columns]
    body = [[_cell(row.get(key)) for key, _title in columns] for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(columns))]
    lines = []
    for line in [header, *body]:
        padded = [text.ljust(widths[i]) if i < len(line) - 1 else text for i, text in enumerate(line)]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None or value == "" or value == []:
        return "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(item) for item in value)
    return str(value)


def natural_key(text: str) -> list[Any]:
    """Sort key that puts pve2 before pve10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def compact_mib(values: Sequence[Optional[int]]) -> str:
    """Per-GPU MiB in GPU order, runs of one value folded: ``[0]*8`` -> ``0 x8``;
    ``[0, 0, 512]`` -> ``0 0 512``; unknown readings print as ``?``.

    >>> compact_mib([0] * 8), compact_mib([86658] * 7 + [0]), compact_mib([None, 3])
    ('0 x8', '86658 x7, 0', '? 3')
    """
    if not values:
        return "no GPU"
    texts = ["?" if value is None else str(value) for value in values]
    if len(set(texts)) == 1 and len(texts) > 2:
        return f"{texts[0]} x{len(texts)}"
    runs: list[tuple[str, int]] = []
    for text in texts:
        if runs and runs[-1][0] == text:
            runs[-1] = (text, runs[-1][1] + 1)
        else:
            runs.append((text, 1))
    if all(count < 3 for _text, count in runs):
        return " ".join(texts)
    return ", ".join(f"{text} x{count}" if count >= 3 else " ".join([text] * count) for text, count in runs)


# ---------------------------------------------------------------- printing one report for the fleet


class FleetReport(BaseStateCallback):
    """One item per host, collected while the runbook's deploy file runs (once per host, in
    parallel), printed ONCE as ``render(items in host order)`` on stdout when pyinfra has
    disconnected from the last host: the report is the last thing the run prints, and
    ``2>/dev/null`` leaves nothing else (pyinfra logs to stderr).

    ``missing(host, reason)``, when given, makes the item of a host of the run that never got
    one: pyinfra drops a host that fails to connect before the deploy file runs, and a report
    that leaves it out hides exactly the host that needs a look (``reason``: what
    ConnectErrors recorded).

    .. code:: python

        fleet_report(state, "status", render_status).add(host.name, row)
    """

    def __init__(self, render: Callable[[list[Any]], str | None], out: Callable[[str], None] | None = None,
                 missing: Callable[[Any, str], Any] | None = None) -> None:
        self.render = render
        self.out = out or (lambda text: print(text, flush=True))
        self.missing = missing
        self.items: dict[str, Any] = {}
        self.disconnected: set[str] = set()
        self.printed = False

    def add(self, host_name: str, item: Any) -> None:
        self.items[host_name] = item

    def add_missing(self, state: Any) -> None:
        """An item for every host of the run (``--limit`` applied) that has none: an unreachable one."""
        if self.missing is None or getattr(state, "inventory", None) is None:
            return
        errors = connect_errors(state)
        for host in state.inventory:
            if host.name not in self.items and state.is_host_in_limit(host):
                self.items[host.name] = self.missing(host, errors.get(host.name) or "could not connect")

    def text(self) -> str | None:
        return self.render([self.items[name] for name in sorted(self.items, key=natural_key)])

    def host_disconnect(self, state: Any, host: Any) -> None:  # type: ignore[override]
        self.disconnected.add(host.name)
        if self.printed or not self.disconnected >= {h.name for h in state.activated_hosts}:
            return
        self.printed = True
        self.add_missing(state)
        if self.items:
            text = self.text()
            if text is not None:  # a render that printed (or wrote) itself returns None
                self.out(text)


def fleet_report(state: Any, key: str, render: Callable[[list[Any]], str | None],
                 missing: Callable[[Any, str], Any] | None = None) -> FleetReport:
    """The run's ``FleetReport`` named ``key`` (made and registered with pyinfra's state on first use)."""
    state = _real_state(state)
    reports = state.__dict__.setdefault("_gpugate_reports", {})
    if key not in reports:
        reports[key] = FleetReport(render, missing=missing)
        state.add_callback_handler(reports[key])
    return reports[key]


class ConnectErrors(BaseStateCallback):
    """Why each host failed to connect (pyinfra logs it, then drops the host). Installed by
    inventory.py while pyinfra loads the inventory, before it connects: a deploy file runs only
    after connecting, too late to hear of a failure.

    When every host of the run failed, pyinfra stops before any deploy file runs ("No hosts
    remaining"); ``on_all_failed`` is then called once (the status runbook prints its rows
    from it: a fleet that is entirely unreachable is the report most worth reading).
    """

    def __init__(self) -> None:
        self.errors: dict[str, str] = {}
        self.on_all_failed: Callable[[Any], None] | None = None

    def host_connect_error(self, state: Any, host: Any, error: Any) -> None:  # type: ignore[override]
        text = (str(error.args[0]) if getattr(error, "args", None) else str(error)) or type(error).__name__
        self.errors[host.name] = " ".join(text.split())[:200]
        wanted = [h.name for h in state.inventory if state.is_host_in_limit(h)]
        if self.on_all_failed is not None and wanted and set(wanted) <= set(self.errors):
            hook, self.on_all_failed = self.on_all_failed, None
            hook(state)


def _real_state(state: Any) -> Any:
    """pyinfra's ``from pyinfra import state`` is a context proxy; callbacks get the State itself.
    Whatever is stored on a state must go on the State, where both find it."""
    module = getattr(state, "_get_module", None)
    return module() if callable(module) else state


def watch_connections(state: Any, argv: Sequence[str] = ()) -> ConnectErrors:
    """Install (once) and return the run's ConnectErrors; inventory.py calls it at load time with
    pyinfra's command line, so that a status run whose every host is unreachable still prints
    its rows (the runbook itself never runs then)."""
    state = _real_state(state)
    recorder = state.__dict__.get("_gpugate_connect_errors")
    if recorder is None:
        recorder = state.__dict__["_gpugate_connect_errors"] = ConnectErrors()
        if getattr(state, "initialised", False):
            state.add_callback_handler(recorder)
        else:
            # The CLI loads the inventory before State.init(), which starts the callback list afresh:
            # register right after it, still before pyinfra connects.
            init = state.init

            def init_then_watch(*args: Any, **kwargs: Any) -> Any:
                result = init(*args, **kwargs)
                state.add_callback_handler(recorder)
                return result

            state.init = init_then_watch
    if any(os.path.basename(arg) == "status.py" and os.path.basename(os.path.dirname(os.path.abspath(arg))) == "runbooks"
           for arg in argv):
        recorder.on_all_failed = status_when_unreachable
    return recorder


def status_when_unreachable(state: Any) -> None:
    """The status runbook's output when no host of the run could be reached (one unreachable row each)."""
    errors = connect_errors(state)
    hosts = [h for h in state.inventory if state.is_host_in_limit(h)]
    rows = [unreachable_row(h.data.get("pve_host") or h.name, h.data.get("pct_vmid"),
                            errors.get(h.name) or "could not connect", present=h.data.get("sglang_present", True),
                            desired_model=h.data.get("sglang_model_path"), port=h.data.get("sglang_port", 30000))
            for h in hosts]
    first = hosts[0].data if hosts else {}
    publish_status(rows, output_format=first.get("format", "table"), prom_path=first.get("prom"))


def connect_errors(state: Any) -> dict[str, str]:
    """host name -> why it could not connect (empty when inventory.py installed no recorder)."""
    recorder = _real_state(state).__dict__.get("_gpugate_connect_errors")
    return dict(recorder.errors) if recorder is not None else {}


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


class StatusObservation(SglangObservation):
    """The agent's observation in one command (observe_once_command): the status's fact."""

    def command(self, port: int = 30000, model_path: str | None = None,  # type: ignore[override]
                python: str = "/usr/bin/python3", secret_flags: Sequence[str] = ()) -> Any:
        # secret_flags: the agent masks their values in the running argv it reports
        return StringCommand(observe_once_command(python, observe_args(port, (), model_path,
                                                                       secret_flags=tuple(secret_flags))))


def status_observation(host: Any) -> dict[str, Any]:
    """The observation of ``host``'s container for the status, from the host's data
    (sglang_port, sglang_model_path, sglang_python)."""
    data = host.data
    spec = desired_spec(data)
    return dict(host.get_fact(StatusObservation, port=data.get("sglang_port", 30000),
                              model_path=data.get("sglang_model_path"),
                              python=data.get("sglang_python", "/usr/bin/python3"),
                              secret_flags=tuple(spec.secret_flags()) if spec is not None else ()))


# ---------------------------------------------------------------- status


class StatusRow(TypedDict, total=False):
    host: str          # the Proxmox host (fleet.yaml name)
    vmid: Any
    port: int
    kind: str          # serving | drifted | down | stopped | transition_running | transition_failed | gpu_held
                       # | unreachable | unknown (see VERDICT_KINDS)
    ok: bool           # as desired: nothing to page about
    verdict: str       # the kind in words, with why: "drifted: --kv-cache-dtype auto->fp8_e4m3"
    desired: bool      # a server should run here (sglang_present)
    up: bool           # it serves: main alive, /health 200, every scheduler alive
    drifted: bool      # it runs with other flags or another model than desired (or should not run)
    server: str        # serving | starting | loading | unhealthy | stopped | probe failed (+ pid, age)
    health: str        # what /health said, or why it could not answer
    model: str
    flags: str         # the flags that differ from the desired ones ("=" none, "-" not running)
    gpu_mib: str       # per-GPU used MiB (NVML v2), compacted
    gpu_used: list[Any]  # per-GPU used MiB in GPU order (None: unreadable); [] when unknown
    holders: str       # GPU processes in the container, and memory held from outside it
    transition: dict[str, Any]   # the latest transition: run, active, step, outcome, began, updated, duration_s
    last_change: str   # the latest transition in a few words
    history: list[str]  # newest entries of the history, one line each
    problems: list[str]


VERDICT_KINDS = {
    "serving": "serving as desired", "drifted": "drifted", "down": "down but desired",
    "stopped": "stopped as desired", "transition_running": "transition running",
    "transition_failed": "transition failed", "gpu_held": "GPU memory held with no holder in the container",
    "unreachable": "unreachable", "unknown": "unknown",
}
OK_KINDS = ("serving", "stopped")
FAILED_OUTCOMES = ("rolled_back", "nothing_serves", "interrupted")

STATUS_COLUMNS = [
    ("host", "HOST"), ("vmid", "VMID"), ("port", "PORT"), ("verdict", "VERDICT"), ("server", "SERVER"),
    ("model", "MODEL"), ("gpu_mib", "GPU MiB"), ("holders", "GPU HOLDERS"), ("last_change", "LAST CHANGE"),
]


def flag_differences(running: Mapping[str, Any], desired: Mapping[str, Any]) -> list[str]:
    """The running flags against the desired ones, one short item per flag, secrets masked:
    ``--kv-cache-dtype auto->fp8_e4m3`` (changed), ``+--disable-radix-cache`` (desired, not
    running), ``-cuda-graph-max-bs 8`` as ``---cuda-graph-max-bs 8`` (running, not desired).

    Secret values are compared as the plan compares them (gpugate.plan.diff_lines): masked on both
    sides, so the agent's ``***`` for a running --api-key is not a difference (the argv's hash
    tells a changed secret: status_row).

    >>> flag_differences({"tp-size": 8}, {"tp-size": 8, "disable-radix-cache": True})
    ['+--disable-radix-cache']
    >>> flag_differences({"tp-size": 4, "api-key": "***"}, {"tp-size": 4, "api-key": "sk-1"})
    []
    """
    diff = diff_flags(redact_flags(running), redact_flags(desired))
    items = []
    for name in sorted(set(diff.added) | set(diff.removed) | set(diff.changed)):
        if name in diff.changed:
            before, after = diff.changed[name]
            items.append(f"--{name} {_value(name, before)}->{_value(name, after)}")
        elif name in diff.added:
            items.append("+" + _flag_item(name, diff.added[name]))
        else:
            items.append("-" + _flag_item(name, diff.removed[name]))
    return items


def _value(name: str, value: Any) -> str:
    if value == SECRET_MASK or (value not in (None, False, True) and is_secret_value(name, value)):
        return SECRET_MASK
    if value is True:
        return "on"
    if value is False or value is None:
        return "off"
    if isinstance(value, (list, tuple)):
        return " ".join(shlex.quote(str(item)) for item in value)
    return shlex.quote(str(value))


def _flag_item(name: str, value: Any) -> str:
    return f"--{name}" if value is True else f"--{name} {_value(name, value)}"


def server_state(server: Mapping[str, Any]) -> tuple[str, str]:
    """(state, health) of the server from the server document (the agent's observe ``sglang``)."""
    if "error" in server:
        return "probe failed", str(server["error"])[:80]
    health = server.get("health") or {}
    code = health.get("health")
    if not server.get("running"):
        strays = server.get("strays") or []
        state = f"stopped, {len(strays)} stray sglang process(es)" if strays else "stopped"
        return state, "-"
    main = server.get("main") or {}
    age = _age(main.get("age_s"))
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


def _age(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return ""
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def foreign_mib(gpu_doc: Mapping[str, Any]) -> dict[int, int]:
    """GPU index -> MiB in use that no process of the container accounts for (the host's or
    another container's: NVML in a container lists only its own processes); the same reading as
    sglang.server's pre-stop check (gpugate.plan.foreign_memory)."""
    return {int(gpu["index"]): int(gpu["foreign_mib"]) for gpu in foreign_memory(gpu_doc)}


def holders_text(gpu_doc: Mapping[str, Any]) -> str:
    """``9 in ct (sglang::scheduler_TP0..7, python3)``, ``none``, and memory held from outside."""
    if "source" not in gpu_doc:
        return f"GPU probe failed: {gpu_doc.get('error', '?')}"[:80]
    holders = gpu_doc.get("holders") or []
    parts = []
    if holders:
        parts.append(f"{len(holders)} in ct ({_names(holders)})")
    foreign = foreign_mib(gpu_doc)
    if foreign:
        parts.append(f"OUTSIDE the ct: {sum(foreign.values())} MiB on GPU {_index_ranges(sorted(foreign))}")
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


def _index_ranges(indices: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts: list[str] = []
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    for run in runs:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def _seconds(value: Any) -> float | None:
    """An epoch from a number or an ISO 8601 text (the journal has both)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and value:
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def _when(value: Any) -> str:
    """``2026-11-30 21:58Z`` from an epoch or ISO text; ``?`` when unreadable."""
    seconds = _seconds(value)
    if seconds is None:
        return "?"
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%d %H:%MZ")


def transition_summary(server: Mapping[str, Any]) -> dict[str, Any]:
    """The latest transition from the agent's ``transition`` (or the history's ``last``):
    run, active, step, outcome, reasons, began, updated, duration_s (ended runs), by. {} when none."""
    transition = server.get("transition")
    last = (server.get("history") or {}).get("last") if isinstance(server.get("history"), Mapping) else None
    source = transition if isinstance(transition, Mapping) else last if isinstance(last, Mapping) else None
    if not source:
        return {}
    summary = {key: source.get(key) for key in ("run", "active", "step", "phase", "outcome", "reasons", "message",
                                                  "began", "updated", "by", "at") if source.get(key) is not None}
    began, updated = _seconds(source.get("began")), _seconds(source.get("updated"))
    if began is not None and updated is not None and not source.get("active"):
        summary["duration_s"] = round(max(0.0, updated - began), 3)
    return summary


def _record_flags(record: Mapping[str, Any]) -> dict[str, Any]:
    argv = record.get("argv")
    if not isinstance(argv, list):
        return {}
    from gpugate.sglang_args import parse_argv  # noqa: PLC0415 -- only the history needs the parser

    return dict(parse_argv(argv).flags)


def history_lines(server: Mapping[str, Any], limit: int = 3) -> list[str]:
    """The newest entries of the container's history (good and failed, newest first), one line
    each, a good entry with what changed against the one before it and its KV capacity:
    ``2026-11-30 21:58Z good by ana@ops: --kv-cache-dtype auto->fp8_e4m3 (KV cache 319,488 tokens)``."""
    history = server.get("history")
    if not isinstance(history, Mapping):
        return []
    good = [r for r in history.get("good") or [] if isinstance(r, Mapping)]
    entries: list[tuple[float, str]] = []
    for index, record in enumerate(good):
        older = good[index + 1] if index + 1 < len(good) else None
        what = ", ".join(flag_differences(_record_flags(older), _record_flags(record))) if older else "first good spec"
        capacity = record.get("capacity")
        tokens = capacity.get("max_total_num_tokens") if isinstance(capacity, Mapping) else None
        extra = f" (KV cache {tokens:,} tokens)" if isinstance(tokens, int) else ""
        entries.append((_seconds(record.get("at")) or 0.0,
                        f"{_when(record.get('at'))} good by {record.get('by') or '?'}: {what or 'same flags'}{extra}"))
    for record in history.get("failed") or []:
        if isinstance(record, Mapping):
            entries.append((_seconds(record.get("at")) or 0.0, f"{_when(record.get('at'))} FAILED by "
                            f"{record.get('by') or '?'}: {str(record.get('reason') or '?')[:120]}"))
    entries.sort(key=lambda entry: entry[0], reverse=True)
    return [text for _at, text in entries[:limit]]


def _verdict(kind: str, why: str = "") -> str:
    return VERDICT_KINDS[kind] + (f": {why}" if why else "")


def own_gpus(desired_flags: Mapping[str, Any] | None, desired_env: Mapping[str, Any] | None,
             gpu_doc: Mapping[str, Any]) -> set[int]:
    """The GPUs the desired server uses (gpugate.spec.gpu_set), as indexes of the container's GPU
    document; every GPU of the document when the set cannot be told (UUIDs, bad flags).

    >>> sorted(own_gpus({"tp": 4, "base-gpu-id": 4}, {}, {"gpus": [{"index": i} for i in range(8)]}))
    [4, 5, 6, 7]
    """
    try:
        return set(gpu_set(desired_flags or {}, desired_env or {}))
    except SpecError:
        return {int(gpu["index"]) for gpu in gpu_doc.get("gpus") or [] if gpu.get("index") is not None}


def status_row(host: str, vmid: Any, observation: Mapping[str, Any], desired_flags: Mapping[str, Any] | None,
               desired_model: str | None, present: bool = True, port: int = 30000,
               max_used_mib: int = 64, desired_env: Mapping[str, Any] | None = None,
               desired_argv_hash: str | None = None) -> StatusRow:
    """One row of the status from the agent's observation and the desired state
    (``host.data.sglang_flags``, ``sglang_model_path``, ``sglang_present``), with a verdict; the
    first that applies:

    - transition running (the agent holds the lock): ``transition running: stop since ...``;
    - the latest transition failed (rolled_back, nothing_serves, interrupted): ``transition failed: ...``
      (a later verified run clears it);
    - a server runs: serving as desired / drifted (which flags, another model, should not run) /
      down but desired (not serving: loading, /health 503, dead schedulers);
    - no server runs: GPU memory held with no holder in the container on the server's OWN GPUs
      (gpugate.spec.gpu_set of the desired flags and env: the stuck memory of a killed server; a
      neighbour container's server on other GPUs is no verdict), else down but desired / stopped
      as desired.

    Secret flags compare as the plan compares them: masked on both sides, and, given
    ``desired_argv_hash`` (gpugate.agentcmd.argv_hash of the desired Spec's argv), by the running
    main's argv hash: a changed secret is ``drifted: a secret flag value differs``, never shown.

    ``ok`` is true for serving as desired and stopped as desired only.
    """
    server = observation.get("sglang") or {"error": observation.get("error") or "no server section"}
    gpu_doc = observation.get("gpu") or {}
    state, health = server_state(server)
    lock = server.get("lock")
    if isinstance(lock, Mapping) and (lock.get("owner") or lock.get("held")):
        state += f" (locked: {lock.get('owner') or lock.get('run') or '?'}, {lock.get('step') or 'pid %s' % lock.get('pid')})"
    command = server.get("command") or {}
    running_model = command.get("model_path")
    model = running_model or desired_model
    running = bool(server.get("running"))
    items: list[str] = []
    flags_text = "-"
    if running:
        if not present:
            flags_text = "should not run"
        else:
            try:
                items = flag_differences(command.get("flags") or {}, validate_flags(desired_flags or {}))
            except FlagError as error:
                items = [f"desired flags invalid: {error}"]
            if running_model and desired_model and running_model != desired_model:
                items.insert(0, f"model {desired_model} desired")
            if command.get("unknown"):
                items.append("unknown args: " + " ".join(command["unknown"]))
            running_hash = (server.get("main") or {}).get("argv_hash")
            secret_involved = any(value not in (None, False, True) and is_secret_value(name, value)
                                  for flags in (command.get("flags") or {}, desired_flags or {})
                                  for name, value in flags.items())
            if (not items and secret_involved and desired_argv_hash and running_hash
                    and running_hash != desired_argv_hash):
                items.append("a secret flag value differs (by the argv's hash)")
            flags_text = ", ".join(items) or "="
    gpus = gpu_doc.get("gpus") or []
    readable = "source" in gpu_doc
    gpu_mib = compact_mib([gpu.get("used_mib") for gpu in gpus]) if readable else "?"
    problems = []
    if gpu_doc.get("source") in (None, "none"):  # errors of a fallback that answered are not problems
        problems = [f"{error.get('source')}: {error.get('message')}" for error in gpu_doc.get("errors") or []
                    if isinstance(error, Mapping)]
    problems += [f"GPU {gpu.get('index')}: {gpu['error']}" for gpu in gpus if gpu.get("error")]
    serving = bool(server.get("serving")) if "serving" in server else state.startswith("serving")
    serving = serving and not (server.get("workers") or {}).get("dead")
    transition = transition_summary(server)
    # only the server's own GPUs: a neighbour container's healthy server holds memory on its GPUs,
    # which this container's NVML sees as held from outside (the lab's 129 on 0-3, 130 on 4-7)
    mine = own_gpus(desired_flags, desired_env, gpu_doc)
    held = ({index: mib for index, mib in foreign_mib(gpu_doc).items() if mib > max_used_mib and index in mine}
            if readable else {})

    if "error" in server:
        kind, why = "unknown", f"probe failed: {str(server['error'])[:100]}"
    elif transition.get("active"):
        kind, why = "transition_running", (f"{transition.get('step') or '?'} (run {transition.get('run')}"
                                          f"{', since ' + _when(transition.get('began')) if transition.get('began') else ''})")
    elif transition.get("outcome") in FAILED_OUTCOMES:
        reasons = transition.get("reasons")
        detail = ("; ".join(f"{k}: {v}" for k, v in reasons.items()) if isinstance(reasons, Mapping)
                  else str(reasons or transition.get("message") or ""))
        kind, why = "transition_failed", f"{transition['outcome']} (run {transition.get('run')}): {detail}"[:160]
    elif running and not present:
        kind, why = "drifted", "runs but should not"
    elif running and items:
        kind, why = "drifted", ", ".join(items)
    elif running and not serving:
        kind, why = "down", state.split(" pid")[0] + (f", {health}" if health not in ("-", "") else "")
    elif running:
        kind, why = "serving", ""
    elif held:
        kind, why = "gpu_held", f"{sum(held.values())} MiB on GPU {_index_ranges(sorted(held))}"
    elif present:
        kind, why = "down", "no server runs" + (f" (last: {transition['outcome']})" if transition.get("outcome") else "")
    else:
        kind, why = "stopped", ""
    last_change = ""
    if transition:
        last_change = (f"{transition.get('outcome') or transition.get('step') or '?'} "
                       f"{_when(transition.get('updated') or transition.get('at'))}")
        if transition.get("by"):
            last_change += f" by {transition['by']}"
    return StatusRow(
        host=host, vmid=vmid, port=int(server.get("port") or port), kind=kind, ok=kind in OK_KINDS,
        verdict=_verdict(kind, why), desired=bool(present), up=running and serving,
        drifted=kind == "drifted", server=state, health=health,
        model=os.path.basename(model.rstrip("/")) if model and model.startswith("/") else model or "-",
        flags=flags_text, gpu_mib=gpu_mib, gpu_used=[gpu.get("used_mib") for gpu in gpus] if readable else [],
        holders=holders_text(gpu_doc), transition=transition, last_change=last_change,
        history=history_lines(server), problems=problems)


def unreachable_row(host: str, vmid: Any, reason: str, present: bool = True, desired_model: str | None = None,
                    port: int = 30000) -> StatusRow:
    """The row of a container whose Proxmox host could not be reached: no figures, only why."""
    model = desired_model or "-"
    return StatusRow(host=host, vmid=vmid, port=port, kind="unreachable", ok=False,
                     verdict=_verdict("unreachable", reason), desired=bool(present), up=False, drifted=False,
                     server="-", health="-", model=os.path.basename(model.rstrip("/")) if model.startswith("/") else model,
                     flags="-", gpu_mib="-", gpu_used=[], holders="-", transition={}, last_change="",
                     history=[], problems=[])


def render_status(rows: Sequence[StatusRow]) -> str:
    """The status table, a summary line, the newest history entries per container, then one
    line per problem (GPU probe errors)."""
    text = format_table(STATUS_COLUMNS, rows)
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


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def status_prometheus(rows: Sequence[StatusRow]) -> str:
    """The node_exporter textfile collector's format: per server up, desired, drifted, as desired,
    reachable, the last transition's outcome and duration; per GPU used MiB."""
    metrics: dict[str, tuple[str, list[str]]] = {
        "gpugate_sglang_up": ("1 when the server serves (main alive, /health 200, every scheduler alive)", []),
        "gpugate_sglang_desired": ("1 when a server should run here (sglang_present)", []),
        "gpugate_sglang_drifted": ("1 when it runs with other flags or model than desired, or should not run", []),
        "gpugate_sglang_as_desired": ("1 when the status verdict is serving or stopped as desired", []),
        "gpugate_sglang_reachable": ("0 when the Proxmox host could not be reached", []),
        "gpugate_sglang_last_transition": ("1 for the outcome of the latest transition (label outcome)", []),
        "gpugate_sglang_last_transition_duration_seconds": ("wall time of the latest ended transition", []),
        "gpugate_gpu_used_mib": ("GPU memory in use (NVML v2), per GPU seen from the container", []),
    }
    for row in rows:
        labels = f'host="{_label(row.get("host"))}",vmid="{_label(row.get("vmid"))}",port="{_label(row.get("port"))}"'
        reachable = row.get("kind") != "unreachable"
        metrics["gpugate_sglang_up"][1].append(f"{{{labels}}} {int(bool(row.get('up')))}")
        metrics["gpugate_sglang_desired"][1].append(f"{{{labels}}} {int(bool(row.get('desired')))}")
        metrics["gpugate_sglang_drifted"][1].append(f"{{{labels}}} {int(bool(row.get('drifted')))}")
        metrics["gpugate_sglang_as_desired"][1].append(f"{{{labels}}} {int(bool(row.get('ok')))}")
        metrics["gpugate_sglang_reachable"][1].append(f"{{{labels}}} {int(reachable)}")
        transition = row.get("transition") or {}
        outcome = transition.get("outcome") or ("running" if transition.get("active") else None)
        if outcome:
            metrics["gpugate_sglang_last_transition"][1].append(f'{{{labels},outcome="{_label(outcome)}"}} 1')
        if isinstance(transition.get("duration_s"), (int, float)):
            metrics["gpugate_sglang_last_transition_duration_seconds"][1].append(
                f"{{{labels}}} {transition['duration_s']}")
        for index, used in enumerate(row.get("gpu_used") or []):
            if isinstance(used, (int, float)):
                metrics["gpugate_gpu_used_mib"][1].append(f'{{{labels},gpu="{index}"}} {used}')
    lines = []
    for name, (help_text, samples) in metrics.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"] + [name + sample for sample in samples]
    return "\n".join(lines) + "\n"


def write_atomically(path: str | os.PathLike[str], text: str, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` so that a reader (the textfile collector) sees the old file or the
    new one, never half: a temporary file in the same directory, fsync'd, then renamed over it."""
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    handle, temporary = tempfile.mkstemp(prefix=".gpugate-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


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


# ---------------------------------------------------------------- who holds the GPUs (Proxmox host)


class HolderRow(TypedDict, total=False):
    host: str
    owner: str     # "ct 129" or "host"
    pid: int
    gpus: str
    mib: Any
    state: str
    cmdline: str


HOLDER_COLUMNS = [("host", "PVE HOST"), ("owner", "OWNER"), ("pid", "HOST PID"), ("gpus", "GPUS"),
                  ("mib", "MiB"), ("state", "STATE"), ("cmdline", "COMMAND")]


def holder_rows(pve_host: str, document: Mapping[str, Any], max_cmdline: int = 70) -> list[HolderRow]:
    """One row per GPU process of a ``HostGpuProcesses`` document, containers first by vmid."""
    rows = []
    for process in document.get("processes") or []:
        vmid = process.get("vmid")
        cmdline = process.get("cmdline") or process.get("comm") or "?"
        rows.append(HolderRow(
            host=pve_host, owner=f"ct {vmid}" if vmid is not None else "host", pid=process.get("pid"),
            gpus=_index_ranges(sorted(process.get("gpus") or [])) or "all (fd)",
            mib=process.get("used_mib"), state=process.get("state"),
            cmdline=cmdline if len(cmdline) <= max_cmdline else cmdline[:max_cmdline - 3] + "...",
        ))
    rows.sort(key=lambda row: (row["owner"] == "host", natural_key(row["owner"]), row.get("pid") or 0))
    return rows


def host_summary(pve_host: str, document: Mapping[str, Any]) -> str:
    """``pve1: GPU MiB 86658 x8; 9 GPU process(es); errors: ...`` (one line per Proxmox host)."""
    gpus = document.get("gpus") or []
    line = f"{pve_host}: GPU MiB {compact_mib([gpu.get('used_mib') for gpu in gpus])}"
    processes = document.get("processes") or []
    line += f"; {len(processes)} GPU process(es)"
    accounted: dict[int, int] = {}
    for process in processes:
        for index in process.get("gpus") or []:
            if len(process.get("gpus") or []) == 1 and isinstance(process.get("used_mib"), int):
                accounted[index] = accounted.get(index, 0) + process["used_mib"]
    unaccounted = [gpu.get("index") for gpu in gpus
                   if (gpu.get("used_mib") or 0) > 0 and not any(gpu.get("processes") or [])
                   and gpu.get("index") not in accounted]
    if unaccounted:
        line += f"; memory with no process on GPU {_index_ranges(sorted(unaccounted))} (stuck in the driver?)"
    line += f"; read by {document.get('source') or 'none'}"
    errors = document.get("errors") or []
    if errors and document.get("source") in (None, "none"):  # a fallback that answered is not a problem
        line += "; errors: " + "; ".join(f"{e.get('source')}: {e.get('message')}" for e in errors)
    return line


def render_holders(reports: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """The who_holds_gpus output: the process table for every Proxmox host, then one summary
    line per host."""
    rows = [row for pve_host, document in reports for row in holder_rows(pve_host, document)]
    table = format_table(HOLDER_COLUMNS, rows) if rows else "no GPU process on any Proxmox host"
    return table + "\n" + "\n".join(host_summary(pve_host, document) for pve_host, document in reports)


# ---------------------------------------------------------------- free_gpus


def free_gpus_refusal(server: Mapping[str, Any], gpu_doc: Mapping[str, Any], max_used_mib: int,
                      host: str, port: int) -> str | None:
    """Why free_gpus must not touch this container (None: go ahead).

    - the managed SGLang server runs: ending its GPU workers would leave a broken server; stop
      or restart it through sglang.server instead (deploy with sglang_present=false, or restart);
    - memory is held from outside the container: nothing in the container can free it.
    """
    if server.get("running"):
        main = server.get("main") or {}
        return (f"{host}: sglang on :{port} runs (pid {main.get('pid')}); free_gpus does not end a managed "
                f"server's workers. Restart it (runbooks/restart.py) or stop it "
                f"(deploy.py --data sglang_present=false). Nothing was touched.")
    foreign = {index: mib for index, mib in foreign_mib(gpu_doc).items() if mib > max_used_mib}
    if foreign:
        detail = ", ".join(f"GPU {index}: {mib} MiB" for index, mib in sorted(foreign.items()))
        return (f"{host}: memory held from OUTSIDE the container ({detail}); no process in the container "
                f"holds it, so free_gpus ends nothing for it. Find the owner with "
                f"`pyinfra inventory.py runbooks/who_holds_gpus.py --limit {host}`. Nothing was touched.")
    return None


# ---------------------------------------------------------------- shared by the runbooks


def server_arguments(data: Any) -> dict[str, Any]:
    """sglang.server's arguments from host data (group_data/all.py's names): the one mapping, used
    by deploy.py and the runbooks (restart and rollback go through the same operation, so through
    the same gate and into the same audit log).

    Every value is checked first (gpugate.fleet.validated_settings: types, booleans from
    true/false/yes/no/1/0 only, unknown settings refused with a did-you-mean); a bad one raises
    gpugate.fleet.SettingsError naming the setting.

    >>> server_arguments({"sglang_port": 30001, "audit_log": "/srv/audit.jsonl"})["port"]
    30001
    >>> server_arguments({"rolling": "no", "drain_timeout_s": "abc"})
    Traceback (most recent call last):
    ...
    gpugate.fleet.SettingsError: setting drain_timeout_s='abc': expected a number, got 'abc' (str)
    """
    data = validated_settings(data)
    d = DEFAULTS
    return dict(
        port=data.get("sglang_port", d["port"]),
        model_path=data.get("sglang_model_path"),
        flags=data.get("sglang_flags") or {},
        env=data.get("sglang_env") or {},
        present=data.get("sglang_present", d["present"]),
        supervisor=data.get("sglang_supervisor", d["supervisor"]),
        listen_host=data.get("sglang_host", d["host"]),
        python=data.get("sglang_python", d["python"]),
        extra_args=list(data.get("sglang_extra_args") or []),
        sglang_version=data.get("sglang_version"),
        max_used_mib=data.get("gpu_max_used_mib", d["max_used_mib"]),
        gate_timeout=data.get("gpu_gate_timeout_s", d["gate_timeout_s"]),
        drain_timeout=data.get("drain_timeout_s", d["drain_timeout_s"]),
        kill_grace=data.get("kill_grace_s", d["kill_grace_s"]),
        start_timeout=data.get("start_timeout_s", d["start_timeout_s"]),
        min_free_mib=data.get("min_free_mib", d["min_free_mib"]),
        end_other_gpu_holders=data.get("end_other_gpu_holders", False),
        rolling=data.get("rolling", False),
        max_failures=data.get("max_failures", d["max_failures"]),
        audit_log=data.get("audit_log"),
    )


def desired_spec(data: Any) -> Any:
    """The desired :class:`gpugate.spec.Spec` of a host's data (server_arguments), or None when
    none is desired or the data do not make one (the status still shows the row)."""
    from gpugate.spec import build_spec  # noqa: PLC0415

    try:
        args = server_arguments(data)
        if not args["present"] or not args["model_path"]:
            return None
        return build_spec(args["model_path"], args["port"], args["flags"], args["env"], host=args["listen_host"],
                          supervisor=args["supervisor"], python=args["python"], extra_args=args["extra_args"],
                          sglang_version=args["sglang_version"])
    except (SpecError, ValueError, TypeError, KeyError):
        return None


def _fail_host(state: Any, host: Any, reason: str) -> bool:
    host.log_styled(reason, fg="red", log_func=logger.error)
    return False


@operation(is_idempotent=False)
def refused(reason: str):
    """
    Touch nothing and fail this host with ``reason`` (the other hosts go on). The reason is
    printed while preparing (so ``--dry`` shows it) and again when the host fails.

    + reason: what the operator reads: why nothing was done and what to do instead

    **Example:**

    .. code:: python

        refused(name="Free the GPUs", reason="memory held from outside the container ...")
    """
    if not state.is_executing:
        host.log_styled(reason, fg="yellow", log_func=logger.warning)
    yield FunctionCommand(_fail_host, (reason,), {})
