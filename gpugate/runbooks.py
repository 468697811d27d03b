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

import os
import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Optional, TypedDict

from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, operation
from pyinfra.api.state import BaseStateCallback

from gpugate.fleet import validated_settings
from gpugate.sglang_args import SECRET_MASK, SPECS, FlagError, diff_flags, validate_flags
from gpugate.transition import foreign_memory

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

    .. code:: python

        fleet_report(state, "status", render_status).add(host.name, row)
    """

    def __init__(self, render: Callable[[list[Any]], str], out: Callable[[str], None] | None = None) -> None:
        self.render = render
        self.out = out or (lambda text: print(text, flush=True))
        self.items: dict[str, Any] = {}
        self.disconnected: set[str] = set()
        self.printed = False

    def add(self, host_name: str, item: Any) -> None:
        self.items[host_name] = item

    def text(self) -> str:
        return self.render([self.items[name] for name in sorted(self.items, key=natural_key)])

    def host_disconnect(self, state: Any, host: Any) -> None:  # type: ignore[override]
        self.disconnected.add(host.name)
        if self.printed or not self.disconnected >= {h.name for h in state.activated_hosts}:
            return
        self.printed = True
        if self.items:
            self.out(self.text())


def fleet_report(state: Any, key: str, render: Callable[[list[Any]], str]) -> FleetReport:
    """The run's ``FleetReport`` named ``key`` (made and registered with pyinfra's state on first use)."""
    reports = state.__dict__.setdefault("_gpugate_reports", {})
    if key not in reports:
        reports[key] = FleetReport(render)
        state.add_callback_handler(reports[key])
    return reports[key]


# ---------------------------------------------------------------- status


class StatusRow(TypedDict, total=False):
    host: str          # the Proxmox host (fleet.yaml name)
    vmid: int
    server: str        # serving | starting | loading | unhealthy | stopped | probe failed (+ lock)
    health: str        # what /health said, or why it could not answer
    model: str
    flags: str         # the flags that differ from the desired ones ("=" none, "-" not running)
    gpu_mib: str       # per-GPU used MiB (NVML v2), compacted
    holders: str       # GPU processes in the container, and memory held from outside it
    problems: list[str]


STATUS_COLUMNS = [
    ("host", "HOST"), ("vmid", "VMID"), ("server", "SERVER"), ("health", "HEALTH"), ("model", "MODEL"),
    ("flags", "FLAGS != DESIRED"), ("gpu_mib", "GPU MiB"), ("holders", "GPU HOLDERS"),
]


def flag_differences(running: Mapping[str, Any], desired: Mapping[str, Any]) -> list[str]:
    """The running flags against the desired ones, one short item per flag, secrets masked:
    ``--kv-cache-dtype auto->fp8_e4m3`` (changed), ``+--disable-radix-cache`` (desired, not
    running), ``-cuda-graph-max-bs 8`` as ``---cuda-graph-max-bs 8`` (running, not desired).

    >>> flag_differences({"tp-size": 8}, {"tp-size": 8, "disable-radix-cache": True})
    ['+--disable-radix-cache']
    """
    diff = diff_flags(running, desired)
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
    spec = SPECS.get(name)
    if spec is not None and spec.secret:
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
    """(state, health) of the server from the server probe document."""
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
    if code == 200:
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
    sglang.server's pre-stop check (gpugate.transition.foreign_memory)."""
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


def status_row(host: str, vmid: Any, observation: Mapping[str, Any], desired_flags: Mapping[str, Any] | None,
               desired_model: str | None, present: bool = True) -> StatusRow:
    """One line of the status table from a ``SglangObservation`` document and the desired state
    (``host.data.sglang_flags``, ``sglang_model_path``, ``sglang_present``).

    ``flags`` is ``=`` when the running flags are the desired ones, the differences otherwise,
    ``-`` when no server runs (``should not run`` when one runs and ``present`` is false).
    """
    server = observation.get("sglang") or {"error": "no server section"}
    gpu_doc = observation.get("gpu") or {}
    state, health = server_state(server)
    lock = server.get("lock")
    if lock:
        state += f" (locked: {lock.get('owner', '?')}, {lock.get('step', '?')})"
    command = server.get("command") or {}
    running_model = command.get("model_path")
    model = running_model or desired_model
    flags_text = "-"
    if server.get("running"):
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
            flags_text = ", ".join(items) or "="
    gpus = gpu_doc.get("gpus") or []
    gpu_mib = compact_mib([gpu.get("used_mib") for gpu in gpus]) if "source" in gpu_doc else "?"
    problems = []
    if gpu_doc.get("source") in (None, "none"):  # errors of a fallback that answered are not problems
        problems = [f"{error.get('source')}: {error.get('message')}" for error in gpu_doc.get("errors") or []]
    problems += [f"GPU {gpu.get('index')}: {gpu['error']}" for gpu in gpus if gpu.get("error")]
    return StatusRow(host=host, vmid=vmid, server=state, health=health,
                     model=os.path.basename(model.rstrip("/")) if model and model.startswith("/") else model,
                     flags=flags_text, gpu_mib=gpu_mib, holders=holders_text(gpu_doc), problems=problems)


def render_status(rows: Sequence[StatusRow]) -> str:
    """The status table, then one line per problem (GPU probe errors)."""
    text = format_table(STATUS_COLUMNS, rows)
    notes = [f"  {row['host']}:{row['vmid']}: {problem}" for row in rows for problem in row.get("problems") or []]
    return text + ("\nproblems:\n" + "\n".join(notes) if notes else "")


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
    return dict(
        port=data.get("sglang_port", 30000),
        model_path=data.get("sglang_model_path"),
        flags=data.get("sglang_flags") or {},
        env=data.get("sglang_env") or {},
        present=data.get("sglang_present", True),
        supervisor=data.get("sglang_supervisor", "process"),
        max_used_mib=data.get("gpu_max_used_mib", 64),
        gate_timeout=data.get("gpu_gate_timeout_s", 120),
        drain_timeout=data.get("drain_timeout_s", 60),
        kill_grace=data.get("kill_grace_s", 10),
        start_timeout=data.get("start_timeout_s", 2700),
        python=data.get("sglang_python", "/usr/bin/python3"),
        lock_wait=data.get("lock_wait_s", 0),
        audit_log=data.get("audit_log"),
    )


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
