"""Who holds the GPUs of a Proxmox host (runbooks/who_holds_gpus.py), and why free_gpus must not
touch a container (runbooks/free_gpus.py). Pure functions over probe documents.

Example::

    print(render_holders([("pve1", host_gpu_processes_document)]))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from gpugate.report.status import foreign_mib
from gpugate.report.text import compact_mib, driver_overhead_text, format_table, index_ranges, natural_key
from gpugate.rules import gate as rules_gate

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
            gpus=index_ranges(sorted(process.get("gpus") or [])) or "all (fd)",
            mib=process.get("used_mib"), state=process.get("state"),
            cmdline=cmdline if len(cmdline) <= max_cmdline else cmdline[:max_cmdline - 3] + "...",
        ))
    rows.sort(key=lambda row: (row["owner"] == "host", natural_key(row["owner"]), row.get("pid") or 0))
    return rows


def host_summary(pve_host: str, document: Mapping[str, Any], max_used_mib: Any = 64) -> str:
    """``pve1: GPU MiB 86658 x8; 9 GPU process(es); errors: ...`` (one line per Proxmox host). Memory
    that no process holds is named by the gate's rule (gpugate.rules.gate.outside_memory): over
    ``max_used_mib``, memory with no process (stuck in the driver?); at or under it, driver overhead."""
    gpus = document.get("gpus") or []
    line = f"{pve_host}: GPU MiB {compact_mib([gpu.get('used_mib') for gpu in gpus])}"
    processes = document.get("processes") or []
    line += f"; {len(processes)} GPU process(es)"
    accounted: dict[int, int] = {}
    for process in processes:
        for index in process.get("gpus") or []:
            if len(process.get("gpus") or []) == 1 and isinstance(process.get("used_mib"), int):
                accounted[index] = accounted.get(index, 0) + process["used_mib"]
    unlisted = [gpu for gpu in gpus if (gpu.get("used_mib") or 0) > 0 and not any(gpu.get("processes") or [])
                and gpu.get("index") not in accounted]
    stuck, overhead = rules_gate.outside_memory({"gpus": [dict(gpu, processes=[]) for gpu in unlisted]}, max_used_mib)
    if stuck:
        line += f"; memory with no process on GPU {index_ranges(sorted(stuck))} (stuck in the driver?)"
    if overhead:
        line += f"; {driver_overhead_text(overhead, max_used_mib)}"
    line += f"; read by {document.get('source') or 'none'}"
    errors = document.get("errors") or []
    if errors and document.get("source") in (None, "none"):  # a fallback that answered is not a problem
        line += "; errors: " + "; ".join(f"{e.get('source')}: {e.get('message')}" for e in errors)
    return line


def render_holders(reports: Sequence[tuple[Any, ...]]) -> str:
    """The who_holds_gpus output: the process table for every Proxmox host, then one summary
    line per host. ``reports``: ``(pve_host, document)`` or ``(pve_host, document, max_used_mib)``
    (the gate's threshold, which tells driver overhead from memory that no process holds)."""
    rows = [row for pve_host, document, *_ in reports for row in holder_rows(pve_host, document)]
    table = format_table(HOLDER_COLUMNS, rows) if rows else "no GPU process on any Proxmox host"
    return table + "\n" + "\n".join(host_summary(report[0], report[1], *report[2:3]) for report in reports)


# ---------------------------------------------------------------- free_gpus


def free_gpus_refusal(server: Mapping[str, Any], gpu_doc: Mapping[str, Any], max_used_mib: int,
                      host: str, port: int) -> str | None:
    """Why free_gpus must not touch this container (None: go ahead).

    - the managed server runs: ending its GPU workers would leave a broken server; stop
      or restart it through sglang.server instead (deploy with sglang_present=false, or restart);
    - memory is held from outside the container: nothing in the container can free it.
    """
    if server.get("running"):
        main = server.get("main") or {}
        return (f"{host}: {server.get('engine') or 'the server'} on :{port} runs (pid {main.get('pid')}); free_gpus does not end a managed "
                f"server's workers. Restart it (runbooks/restart.py) or stop it "
                f"(deploy.py --data sglang_present=false). Nothing was touched.")
    foreign = foreign_mib(gpu_doc, max_used_mib)  # driver overhead under the threshold is nobody's
    if foreign:
        detail = ", ".join(f"GPU {index}: {mib} MiB" for index, mib in sorted(foreign.items()))
        return (f"{host}: memory held from OUTSIDE the container ({detail}); no process in the container "
                f"holds it, so free_gpus ends nothing for it. Find the owner with "
                f"`pyinfra inventory.py runbooks/who_holds_gpus.py --limit {host}`. Nothing was touched.")
    return None


