"""Who holds the NVIDIA device nodes: a scan of ``/proc/*/fd`` for ``/dev/nvidia*`` (the GPU probe's
"holders", gpugate.agent.gpu_probe), each with its state from /proc/PID/stat (D: stuck in the
kernel, SIGKILL will not end it; Z: exited) and, on a Proxmox host, its container.
"""

from __future__ import annotations

import os
import re

from gpugate.rules import procfs
from gpugate.rules.procfs import PROBE_MARKER

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Dict, Iterable, List

# A device node of the NVIDIA driver (also matches the lab's bind-mounted stand-ins, whose host-side
# path ends in .../dev/nvidia0).
DEVICE_PATTERN = re.compile(r"/dev/nvidia(?:\d+|ctl|-uvm|-uvm-tools|-modeset|-caps/[\w.-]+)$")
# Proxmox puts container processes in cgroup .../lxc/<vmid>/... (cgroup v2: also lxc.payload.<vmid>).
LXC_CGROUP_PATTERNS = (
    re.compile(r"/lxc/(\d+)(?:/|$)"),
    re.compile(r"lxc\.payload[./](\d+)(?:/|$)"),
)
# Hold /dev/nvidia* without being GPU work (persistenced holds nvidia0 on most GPU hosts).
DRIVER_DAEMONS = ("nvidia-smi", "nvidia-persistenced", "nv-fabricmanager", "nv-hostengine")
DRIVER_DAEMON_COMMS = tuple(name[:15] for name in DRIVER_DAEMONS)  # /proc/PID/stat comm: 15 chars


def vmid_from_cgroup(text: str) -> int | None:
    """The Proxmox container of a process from its /proc/PID/cgroup text, or None (the host).

    >>> vmid_from_cgroup("0::/lxc/129/ns/user.slice")
    129
    """
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        for pattern in LXC_CGROUP_PATTERNS:
            match = pattern.search(path)
            if match:
                return int(match.group(1))
    return None


def read_vmid(proc_root: str, pid: int) -> int | None:
    try:
        with open(os.path.join(proc_root, str(pid), "cgroup")) as handle:
            return vmid_from_cgroup(handle.read())
    except OSError:
        return None


def ancestors(proc_root: str, pid: int) -> set:
    """pid and its ancestors (the shells and the pct/ssh session that run the probe)."""
    return procfs.lineage(pid, proc_root)


def is_probe_or_monitor(argv: list, comm: str) -> bool:
    """Another gpugate probe, nvidia-smi, or a driver daemon (persistenced, fabric manager, DCGM):
    they hold device nodes but are not GPU work to wait for or to end."""
    program = os.path.basename(argv[0]) if argv else ""
    if program in DRIVER_DAEMONS or comm in DRIVER_DAEMONS or comm in DRIVER_DAEMON_COMMS:
        return True
    return (len(argv) >= 3 and argv[-1] == PROBE_MARKER and "-c" in argv
            and "python" in os.path.basename(argv[0]))


def scan_holders(proc_root: str = "/proc", exclude_pids: Iterable[int] = (), with_vmid: bool = False) -> list:
    """Processes with an open /dev/nvidia* fd, sorted by pid, without ``exclude_pids``, probes and
    nvidia-smi."""
    exclude = set(int(pid) for pid in exclude_pids)
    holders: List[Dict[str, Any]] = []
    try:
        names = os.listdir(proc_root)
    except OSError:
        return holders
    for name in names:
        if not name.isdigit() or int(name) in exclude:
            continue
        pid = int(name)
        fd_dir = os.path.join(proc_root, name, "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue  # gone, or not ours to read
        devices = set()
        for fd in fds:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            match = DEVICE_PATTERN.search(target)
            if match:
                devices.add(match.group(0))
        if not devices:
            continue
        holder = describe_process(proc_root, pid, with_vmid)
        if holder is None or is_probe_or_monitor(procfs.read_argv(pid, proc_root), holder["comm"]):
            continue
        holder["devices"] = sorted(devices)
        holders.append(holder)
    holders.sort(key=lambda holder: holder["pid"])
    return holders


def describe_process(proc_root: str, pid: int, with_vmid: bool = False) -> Dict[str, Any] | None:
    stat = procfs.read_stat(pid, proc_root)
    if stat is None:
        return None
    comm, state, ppid, pgid = stat[:4]
    holder = {
        "pid": pid,
        "ppid": ppid,
        "pgid": pgid,
        "state": state,
        "comm": comm,
        "cmdline": procfs.read_cmdline(pid, proc_root) or "[%s]" % comm,
        "devices": [],
        "gpus": [],
        "used_mib": None,
    }
    if with_vmid:
        holder["vmid"] = read_vmid(proc_root, pid)
    return holder


def merge_listed_processes(doc: dict, proc_root: str, exclude: set, with_vmid: bool) -> None:
    """Attach NVML/nvidia-smi's per-GPU process list to the holders; a listed process we can see
    but that has no fd we could read is a holder too; one that does not exist is marked dead."""
    holders = {holder["pid"]: holder for holder in doc["holders"]}
    for gpu in doc["gpus"]:
        for process in gpu.get("processes") or []:
            pid = process["pid"]
            holder = holders.get(pid)
            if holder is None and pid not in exclude:
                holder = describe_process(proc_root, pid, with_vmid)
                if holder is not None and holder["state"] != "Z":
                    holder["listed_only"] = True
                    holders[pid] = holder
                    doc["holders"].append(holder)
                else:
                    holder = None
            process["alive"] = pid in exclude or holder is not None
            if holder is not None:
                holder["gpus"].append(gpu["index"])
                if process["used_mib"] is not None:
                    holder["used_mib"] = (holder["used_mib"] or 0) + process["used_mib"]
    doc["holders"].sort(key=lambda holder: holder["pid"])
