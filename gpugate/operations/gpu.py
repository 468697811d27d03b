"""GPU operations: the gate every gpugate transition goes through.

``gpu.idle`` is the desired state "no GPU process in the container, every GPU at or under
``max_used_mib``". When it already holds: no change. Otherwise it (optionally) ends the container's
GPU holders, then waits, polling inside the container (no SSH round trip per poll), in remote
commands of ``PROGRESS_EVERY_S`` (3 s) each: it passes on the first idle reading, and after each
chunk that did not pass prints what it sees (``gate: 3 s of 120 s: GPU MiB 4096 x8; 1 holder(s)
left: 55 python3 hold.py``); on timeout it fails with a message that says, per GPU,
what is used, by which process (pid, cmdline, state) and whether the memory is held from outside the
container (never something to kill from here).

The helpers ``wait_for_idle``, ``end_gpu_holders`` and ``kill_gpu_holders_command`` are for other
operations (``sglang.server``) that gate inside their own transition.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, OperationError, operation

from gpugate.facts.gpu import GpuState, GpuStateResult, unreadable_state
from gpugate.gate import GateDecision, evaluate, format_failure
from gpugate.remote import (
    build_end_holders_command,
    build_wait_command,
    parse_probe_output,
)

# The wait's SSH command gets this much longer than the in-container deadline (connect, pct exec,
# python start) before the controller gives up on it.
WAIT_TRANSPORT_MARGIN_S = 30.0
KILL_SETTLE_S = 5.0


def kill_gpu_holders_command(grace_s: float = 10.0, ignore_pids: Iterable[int] = ()) -> str:
    """The shell command that ends the GPU holders of the pid namespace it runs in: SIGTERM, up to
    ``grace_s`` for them to exit, then SIGKILL; never pid 1 or itself. Through ``@pct`` that is the
    container's namespace, so nothing outside the container can be reached. Prints
    ``{"kill": {"targets", "terminated", "killed", "survivors", "errors", "elapsed_s"}}``."""
    return build_end_holders_command(grace_s=grace_s, ignore_pids=ignore_pids)


def end_holders(host, grace_s: float = 10.0, ignore_pids: Iterable[int] = ()) -> dict:
    """Run ``kill_gpu_holders_command`` on ``host``; -> its report (``error`` set when the command
    itself failed)."""
    command = kill_gpu_holders_command(grace_s, ignore_pids)
    try:
        _ok, output = host.run_shell_command(command, _timeout=grace_s + KILL_SETTLE_S + 30)
        report = parse_probe_output(output.stdout_lines).get("kill")
    except Exception as exc:  # noqa: BLE001 - transport or parse failure: report it, do not raise
        return {"error": f"{type(exc).__name__}: {exc}", "targets": [], "survivors": []}
    return report if isinstance(report, dict) else {"error": "no kill report", "survivors": []}


def wait_for_idle(host, max_used_mib: int = 64, timeout: float = 120.0,
                  poll_interval_s: float = 0.05, ignore_pids: Iterable[int] = ()) -> GateDecision:
    """Wait, polling inside the container, until the gate passes or ``timeout`` is over.

    -> the GateDecision of the last reading, with ``timing``: ``began_at`` and ``returned_at``
    (controller wall clock around the remote command), ``started_at`` and ``passed_at`` (in the
    container: the wait's start and the passing reading), ``polls``, ``elapsed_s`` (in-container
    wait), ``round_trip_s``.

    .. code:: python

        decision = wait_for_idle(host, max_used_mib=64, timeout=120)
        if not decision.passed:
            raise OperationError(format_failure(decision, host.name, timeout_s=120))
    """
    ignore = tuple(int(pid) for pid in ignore_pids)
    command = build_wait_command(max_used_mib, timeout, poll_interval_s, ignore)
    began_at = time.time()
    try:
        _ok, output = host.run_shell_command(command, _timeout=timeout + WAIT_TRANSPORT_MARGIN_S)
        document = parse_probe_output(output.stdout_lines)
    except Exception as exc:  # noqa: BLE001 - connection lost, timeout, no JSON: cannot decide
        document = {"error": str(exc) or "the wait command failed", "error_kind": type(exc).__name__}
    returned_at = time.time()
    decision = decision_from_wait(document, max_used_mib, ignore)
    decision.timing = {**(decision.timing or {}), "began_at": began_at, "returned_at": returned_at,
                       "round_trip_s": round(returned_at - began_at, 4)}
    return decision


def decision_from_wait(document: dict, max_used_mib: int = 64, ignore_pids: Iterable[int] = ()) -> GateDecision:
    """The gate's decision from one in-container wait's answer ``{"gpu": <GpuState>, "wait":
    {...}}`` (``build_wait_command``, or the transition's ``gate_wait`` step); an answer without a
    readable GPU document is undecidable. ``timing``: the wait's figures and ``used_mib``, the
    last reading per GPU.

    .. code:: python

        decision = decision_from_wait({"gpu": probe_document, "wait": {"passed": True, "polls": 3}})
    """
    gpu, wait = document.get("gpu"), document.get("wait")
    if not isinstance(gpu, dict) or "source" not in gpu:
        if document.get("error_kind"):
            gpu = unreadable_state(document["error_kind"], str(document.get("error")))
        else:
            gpu = unreadable_state("ProbeFailed", str((gpu or {}).get("error") if isinstance(gpu, dict)
                                                      else document.get("error")))
    decision = evaluate(gpu, max_used_mib, tuple(int(pid) for pid in ignore_pids))
    decision.timing = {
        **(wait if isinstance(wait, dict) else {}),
        "used_mib": [entry.get("used_mib") for entry in gpu.get("gpus") or []],  # the last reading
    }
    return decision


PROGRESS_EVERY_S = 3.0  # a waiting gate reports what it sees this often (one remote command per chunk)


def wait_for_idle_in_chunks(host, max_used_mib: int = 64, timeout: float = 120.0, poll_interval_s: float = 0.05,
                            ignore_pids: Iterable[int] = (), chunk_s: float = PROGRESS_EVERY_S,
                            progress=None) -> GateDecision:
    """``wait_for_idle`` in chunks of ``chunk_s``: after each chunk that did not pass,
    ``progress(waited_s, decision)`` is called with the last reading, so that the operator sees the
    memory draining instead of a silent wait (pyinfra shows a command's output only when it ends).
    A gate that passes within the first chunk costs one remote command, as before.
    ``decision.timing["waited_s"]`` is the whole wait."""
    began = time.monotonic()
    while True:
        left = timeout - (time.monotonic() - began)
        decision = wait_for_idle(host, max_used_mib, max(0.0, min(chunk_s, left)), poll_interval_s, ignore_pids)
        waited = time.monotonic() - began
        decision.timing = dict(decision.timing or {}, waited_s=round(waited, 3))
        if decision.passed or decision.permanent or waited >= timeout:
            return decision
        if "polls" not in decision.timing:  # no answer from the container's wait: asking again at once would spin
            return decision
        if progress is not None:
            progress(waited, decision)


def progress_text(waited_s: float, timeout: float, decision: GateDecision) -> str:
    """``gate: 6 s of 120 s: GPU MiB 4096 x8; 1 holder(s) left: 55 python3 hold.py``"""
    from gpugate.report.text import compact_mib

    used = (decision.timing or {}).get("used_mib") or []
    text = f"gate: {waited_s:.0f} s of {timeout:g} s: GPU MiB {compact_mib(used)}"
    if decision.holders:
        text += f"; {len(decision.holders)} holder(s) left: " + ", ".join(
            f"{h.get('pid')} {str(h.get('cmdline', ''))[:40]}" for h in decision.holders[:4])
    elif decision.reasons:
        text += f"; {decision.reasons[0]}"
    return text


def _audit(audit_log, step: str, **fields) -> None:
    try:
        from gpugate import audit
        audit.emit(step, path=audit_log, **fields)
    except Exception:  # an audit problem must not break the gate
        logger.debug("audit emit failed for %s", step, exc_info=True)


def plan_text(decision: GateDecision, kill: bool, kill_grace_s: float, timeout: float,
              max_used_mib: int) -> str:
    """What gpu.idle will do, for --dry and the log."""
    steps = []
    if kill and decision.holders:
        steps.append("end %d GPU process(es) in the container (%s): SIGTERM, %gs grace, SIGKILL"
                     % (len(decision.holders),
                        ", ".join(f"{h['pid']} {h.get('cmdline', '')[:60]}" for h in decision.holders),
                        kill_grace_s))
    steps.append(f"wait up to {timeout:g}s for every GPU <= {max_used_mib} MiB and no GPU process "
                 f"(now: {decision.summary})")
    return "; then ".join(steps)


def _end_gpu_holders_command(state, host, grace_s: float, ignore_pids: tuple) -> bool:
    report = end_holders(host, grace_s, ignore_pids)
    if report.get("error"):
        host.log_styled(f"could not end the GPU processes: {report['error']}", fg="yellow",
                        log_func=logger.warning)
        return True  # the wait decides; it reports what still holds the GPUs
    text = (f"GPU processes: {len(report.get('terminated', []))} ended on SIGTERM, "
            f"{len(report.get('killed', []))} on SIGKILL")
    if report.get("survivors"):
        text += "; still running: " + ", ".join(
            f"{s['pid']} [{s.get('state')}] {s.get('cmdline', '')[:80]}" for s in report["survivors"])
        host.log_styled(text, fg="yellow", log_func=logger.warning)
    else:
        host.log(text)
    return True


def _wait_for_idle_command(state, host, max_used_mib: int, timeout: float,
                           poll_interval_s: float, ignore_pids: tuple, audit_log=None,
                           chunk_s: float = PROGRESS_EVERY_S) -> bool:
    where = {"host": host.name, "vmid": host.data.get("pct_vmid"), "max_used_mib": max_used_mib}
    _audit(audit_log, "gate", phase="begin", **where)

    def report(waited_s: float, decision: GateDecision) -> None:
        # One line per chunk: pyinfra shows a command's output only once it ends, so a single
        # two-minute wait would look hung.
        host.log(progress_text(waited_s, timeout, decision))

    decision = wait_for_idle_in_chunks(host, max_used_mib, timeout, poll_interval_s, ignore_pids,
                                       chunk_s=chunk_s, progress=report)
    timing = decision.timing or {}
    _audit(audit_log, "gate", phase="end", outcome="passed" if decision.passed else "failed",
           duration_s=timing.get("waited_s"), gpu_used_mib=timing.get("used_mib"),
           holders=[{"pid": h.get("pid"), "cmdline": h.get("cmdline")} for h in decision.holders],
           reasons=decision.reasons, **where)
    if decision.passed:
        host.log(f"GPUs idle after {timing.get('waited_s', 0):.2f}s "
                 f"({timing.get('polls')} polls in the container's last wait)")
        return True
    # Logged here rather than raised: pyinfra prints an exception from a callback as a traceback.
    message = format_failure(decision, host.name,
                             timeout_s=timeout if timing.get("timed_out") else None)
    host.log_styled(message, fg="red", log_func=logger.error)
    return False


@operation()
def idle(
    max_used_mib: int = 64,
    timeout: float = 120,
    kill: bool = False,
    kill_grace_s: float = 10,
    poll_interval_s: float = 0.05,
    ignore_pids: Iterable[int] = (),
    audit_log: str | None = None,
):
    """
    No GPU process in the container and every GPU at or under ``max_used_mib`` (NVML v2 "used",
    which is 0 on an idle GPU).

    + max_used_mib: most memory in use per GPU that still counts as idle
    + timeout: seconds to wait for the state to hold before failing
    + kill: first end the container's GPU processes (SIGTERM, ``kill_grace_s``, SIGKILL); never
      anything outside the container, never pid 1
    + kill_grace_s: seconds between SIGTERM and SIGKILL
    + poll_interval_s: pause between readings of the in-container wait
    + ignore_pids: container pids that do not count as GPU processes
    + audit_log: the audit file (gate begin/end with per-GPU MiB); default ``./audit.jsonl``

    Memory used that no process of the container accounts for is held from outside (the host or
    another container): the gate waits for it but never kills for it, and its failure message says
    how to find the owner (``pyinfra <pve-host> fact gpugate.facts.gpu.HostGpuProcesses``).

    **Example:**

    .. code:: python

        from gpugate.operations import gpu

        gpu.idle(
            name="Free every GPU of the container",
            max_used_mib=64,
            timeout=120,
            kill=True,
        )
    """
    ignore = tuple(int(pid) for pid in ignore_pids)
    observed: GpuStateResult = host.get_fact(GpuState)
    decision = evaluate(observed, max_used_mib, ignore)
    if decision.passed:
        host.noop(decision.summary)
        return
    if decision.permanent:
        # No driver, no tools, v1-only memory: waiting cannot change that.
        raise OperationError(format_failure(decision, host.name))
    # Printed once: at prepare (also under --dry), or at execute when prepare was skipped (-y).
    if not state.is_executing or not state.check_for_changes:
        host.log(f"gpu.idle will {plan_text(decision, kill, kill_grace_s, timeout, max_used_mib)}")
    if kill and decision.holders:
        yield FunctionCommand(_end_gpu_holders_command, (kill_grace_s, ignore), {})
    yield FunctionCommand(
        _wait_for_idle_command, (max_used_mib, timeout, poll_interval_s, ignore), {"audit_log": audit_log}
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
