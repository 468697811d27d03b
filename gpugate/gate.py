"""The GPU gate as gpu.idle and the in-container wait see it: gpugate.rules.gate's decision over a GpuState
document (gpugate.agent.gpu_probe), in the operator's words.

Stdlib only: this module is also sent inline into containers, where ``poll_until_idle`` runs the
wait loop next to the GPUs (one remote command for the whole wait, not one SSH round trip per poll).

The gate passes when the reading can be trusted and shows the container idle:

- a source answered (``nvml`` or ``nvidia-smi``) with no error of its own, memory read through the
  v2 API (v1 ``used`` counts the driver's reserved memory in: ~615 MiB on an idle H200), and at
  least one GPU is visible;
- every GPU's ``used_mib`` is known and at or under ``max_used_mib``;
- no process in the container holds ``/dev/nvidia*`` (other than ``ignore_pids``).

Memory in use that no process in the container accounts for is ``foreign``: held by the Proxmox host
or another container (inside a container NVML lists only the container's own processes, but memory
is device-wide). It blocks the gate and is never something to kill from here.

Example::

    >>> probe_document = {"source": "nvml", "memory_api": "v2", "errors": [],
    ...                   "gpus": [{"index": 0, "used_mib": 30000, "processes": [{"pid": 4242, "used_mib": 30000}]}],
    ...                   "holders": [{"pid": 4242, "state": "S", "cmdline": "python3 train.py"}]}
    >>> decision = evaluate(probe_document, max_used_mib=64)
    >>> decision.passed
    False
    >>> print(format_failure(decision, host_name="@pct/pve1:129"))  # doctest: +NORMALIZE_WHITESPACE
    GPU gate did not pass on @pct/pve1:129: GPU 0 over 64 MiB (30000 MiB used);
        1 process(es) in the container hold /dev/nvidia*: 4242 (S)
      GPU 0: 30000 MiB used (max 64); listed: pid 4242 30000 MiB
      processes in the container holding /dev/nvidia*:
        pid 4242 [S] python3 train.py
      to end them: gpu.idle(kill=True) (SIGTERM, grace period, SIGKILL; only processes of this container)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping  # typing's Mapping: this file also runs in containers with Python 3.8

from gpugate.rules import gate as rules

HOST_FACT = "gpugate.facts.gpu.HostGpuProcesses"
WHO_HOLDS_RUNBOOK = "runbooks/who_holds_gpus.py"
# The rules' names, kept here for the callers of this module.
PERMANENT_ERROR_KINDS = rules.PERMANENT_ERROR_KINDS
reading_problems = rules.reading_problems
foreign_memory = rules.foreign_mib


@dataclass
class GateDecision:
    """What the gate concluded from one GPU reading.

    + passed: every GPU at or under max_used_mib and no holder in the container
    + undecidable: the reading itself cannot be trusted (no source, errors, v1 memory, unknown used)
    + permanent: undecidable for a reason that waiting will not change (no driver, no tools, v1)
    + reasons: one line per thing that keeps the gate closed
    + gpu_lines: one line per GPU, for the operator
    + holders: the container's processes holding /dev/nvidia* (pid, cmdline, state, ...)
    + foreign_mib: per GPU index, memory used that no process in the container accounts for
      (None: cannot tell, e.g. the driver gives no per-process figures)
    + stale: per GPU index, processes the driver still lists but that no longer exist
    + timing: filled by the wait (began_at, passed_at, polls, ...), None for a single reading
    """

    passed: bool
    max_used_mib: int
    undecidable: bool = False
    permanent: bool = False
    reasons: list = field(default_factory=list)
    gpu_lines: list = field(default_factory=list)
    holders: list = field(default_factory=list)
    foreign_mib: dict = field(default_factory=dict)
    stale: dict = field(default_factory=dict)
    source: str | None = None
    memory_api: str | None = None
    errors: list = field(default_factory=list)
    timing: dict | None = None

    @property
    def d_state_pids(self) -> list:
        return [holder["pid"] for holder in self.holders if holder.get("state") == "D"]

    @property
    def summary(self) -> str:
        if self.passed:
            return "every GPU at or under %d MiB, no GPU process in the container" % self.max_used_mib
        return "; ".join(self.reasons)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["foreign_mib"] = {str(key): value for key, value in self.foreign_mib.items()}
        data["stale"] = {str(key): value for key, value in self.stale.items()}
        return data


def evaluate(state: Mapping[str, Any], max_used_mib: int = 64, ignore_pids=(),
             expected_mib: Mapping[Any, float] | None = None) -> GateDecision:
    """Decide whether the container's GPUs are idle (gpugate.rules.gate.decide over every GPU,
    every holder counting) and say why in the operator's words. Pure: no I/O.

    + state: a GpuState document (gpugate.agent.gpu_probe.collect())
    + max_used_mib: the most memory a GPU may have in use and count as idle (v2 idle is 0)
    + ignore_pids: container pids that do not count as holders (e.g. a known monitor)
    + expected_mib: GPU index -> MiB it may hold beyond max_used_mib (none by default)

    Example::

        evaluate({"source": "nvml", "memory_api": "v2", "errors": [], "holders": [],
                  "gpus": [{"index": 0, "used_mib": 0, "processes": []}]}).passed  # True
    """
    ignore = set(int(pid) for pid in ignore_pids)
    verdict = rules.decide(state, max_used_mib, None, ignore, expected_mib, idle_holders_block=True)
    state = state if isinstance(state, dict) else {}
    decision = GateDecision(
        passed=False,
        max_used_mib=max_used_mib,
        undecidable=verdict["undecidable"],
        permanent=verdict["permanent"],
        source=state.get("source"),
        memory_api=state.get("memory_api"),
        errors=list(state.get("errors") or []),
    )
    decision.reasons.extend(verdict["reading_problems"])
    decision.holders = verdict["holders"]
    decision.foreign_mib = dict(verdict["foreign_mib"])
    decision.stale = dict(verdict["stale"])
    limits = dict((index, limit) for index, _, limit in verdict["over"])
    over = []
    undecidable = bool(verdict["reading_problems"])  # one "unknown" reason after those, not one per GPU
    for gpu in state.get("gpus") or []:
        index = gpu.get("index")
        used = gpu.get("used_mib")
        listed = [p for p in gpu.get("processes") or [] if p.get("pid") not in ignore]
        foreign = decision.foreign_mib.get(index)
        line = "GPU %s%s: " % (index, " (%s)" % gpu["name"] if gpu.get("name") else "")
        if used is None:
            line += "used memory unknown"
            if gpu.get("used_v1_mib") is not None:
                line += " (v1 reads %d MiB, reserved counted in)" % gpu["used_v1_mib"]
            if gpu.get("error"):
                line += " [%s]" % gpu["error"]
            if not undecidable or gpu.get("error"):
                decision.reasons.append("GPU %s: used memory unknown%s" % (
                    index, " (%s)" % gpu["error"] if gpu.get("error") else ""))
            undecidable = True
        else:
            line += "%d MiB used" % used
            if gpu.get("total_mib") is not None:
                line += " of %d" % gpu["total_mib"]
            line += " (max %d)" % limits.get(index, max_used_mib)
            if index in limits:
                over.append((index, used))
        if listed:
            line += "; listed: " + ", ".join(
                "pid %s %s%s" % (
                    p["pid"],
                    "?" if p.get("used_mib") is None else "%d MiB" % p["used_mib"],
                    " (no such process)" if p.get("alive") is False else "",
                )
                for p in listed
            )
        if foreign:
            line += "; %d MiB held from outside the container" % foreign
        decision.gpu_lines.append(line)
    if over:
        decision.reasons.append(over_threshold_reason(over, max_used_mib))
    if decision.holders:
        decision.reasons.append("%d process(es) in the container hold /dev/nvidia*: %s" % (
            len(decision.holders),
            ", ".join("%s (%s)" % (h["pid"], h.get("state")) for h in decision.holders),
        ))
    decision.passed = verdict["passed"]
    return decision


def over_threshold_reason(over: list, max_used_mib: int) -> str:
    """[(0, 4096), (1, 4096)] -> "GPU 0, 1 over 64 MiB (4096 MiB used on each)": one clause, even
    for 8 GPUs."""
    indices = ", ".join(str(index) for index, _ in over)
    amounts = set(used for _, used in over)
    if len(amounts) == 1:
        each = " on each" if len(over) > 1 else ""
        return "GPU %s over %d MiB (%d MiB used%s)" % (indices, max_used_mib, amounts.pop(), each)
    return "GPU %s over %d MiB (%s MiB used)" % (
        indices, max_used_mib, ", ".join(str(used) for _, used in over))


def holder_line(holder: dict) -> str:
    text = "pid %s [%s] %s" % (holder.get("pid"), holder.get("state"), holder.get("cmdline"))
    if holder.get("used_mib") is not None:
        text += " (%d MiB)" % holder["used_mib"]
    if holder.get("state") == "D":
        text += (" -- uninterruptible sleep (D): stuck in the kernel/driver, even SIGKILL will not "
                 "end it until that call returns; if it stays, the GPU needs a reset or the host a "
                 "reboot")
    elif holder.get("state") == "Z":
        text += " -- zombie: exited, but other threads may still be stuck in the driver"
    return text


def format_failure(decision: GateDecision, host_name: str | None = None,
                   timeout_s: float | None = None) -> str:
    """The operator's message when the gate did not pass: what is held, by whom, what to do."""
    where = " on %s" % host_name if host_name else ""
    head = "GPU gate did not pass%s" % where
    if timeout_s is not None:
        head += " within %g s" % timeout_s
    lines = [head + ": " + "; ".join(decision.reasons)]
    lines.extend("  " + line for line in decision.gpu_lines)
    if decision.holders:
        lines.append("  processes in the container holding /dev/nvidia*:")
        lines.extend("    " + holder_line(holder) for holder in decision.holders)
        if not decision.d_state_pids:
            lines.append("  to end them: gpu.idle(kill=True) (SIGTERM, grace period, SIGKILL; "
                         "only processes of this container)")
    foreign = {index: mib for index, mib in decision.foreign_mib.items()
               if mib and mib > decision.max_used_mib}
    if foreign:
        lines.append(
            "  memory held from OUTSIDE the container (%s): the Proxmox host or another container "
            "holds it; never something to kill from here. Find the owner on the Proxmox host: "
            "`pyinfra <pve-host> fact %s` or the %s runbook."
            % (", ".join("GPU %s: %d MiB" % item for item in sorted(foreign.items())),
               HOST_FACT, WHO_HOLDS_RUNBOOK)
        )
    if decision.stale:
        stale = "; ".join(
            "GPU %s: %s" % (index, ", ".join(
                "pid %s (%s MiB)" % (p["pid"], p.get("used_mib")) for p in processes))
            for index, processes in sorted(decision.stale.items())
        )
        lines.append("  memory listed for processes that no longer exist (%s): the driver has not "
                     "freed it; check the host (`pyinfra <pve-host> fact %s`), a GPU reset may be "
                     "needed" % (stale, HOST_FACT))
    if decision.timing:
        timing = decision.timing
        lines.append("  waited %.2f s over %s polls" % (
            timing.get("elapsed_s") or 0.0, timing.get("polls")))
    return "\n".join(lines)


def poll_until_idle(read, max_used_mib: int = 64, timeout_s: float = 120.0,
                    poll_interval_s: float = 0.05, ignore_pids=(), clock=time.monotonic,
                    wall=time.time, sleep=time.sleep) -> dict:
    """Read until the gate passes or ``timeout_s`` is over; runs inside the container.

    + read: a function returning a GpuState document (gpu_probe.collect)

    -> {"gpu": the last document, "wait": {"passed", "timed_out", "polls", "started_at",
        "passed_at" (wall clock of the passing read, None), "elapsed_s"}}
    """
    started_at = wall()
    start = clock()
    deadline = start + timeout_s
    polls = 0
    while True:
        document = read()
        polls += 1
        decision = evaluate(document, max_used_mib, ignore_pids)
        now = clock()
        if decision.passed or decision.permanent or now >= deadline:
            read_at = document.get("read_at") if isinstance(document, dict) else None
            return {
                "gpu": document,
                "wait": {
                    "passed": decision.passed,
                    "timed_out": not decision.passed and not decision.permanent,
                    "polls": polls,
                    "started_at": started_at,
                    "passed_at": (read_at or wall()) if decision.passed else None,
                    "elapsed_s": round(now - start, 4),
                },
            }
        sleep(max(0.0, min(poll_interval_s, deadline - now)))
