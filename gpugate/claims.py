"""GPU claims per Proxmox host: no two servers of one Proxmox host on the same GPUs.

Two checks, one at each end of a run:

- **Plan time** (pure): ``overlapping_claims(servers)`` names every pair of desired servers of one
  Proxmox host whose GPU sets overlap; sglang.server refuses those before touching anything.
  ``servers_of_inventory(hosts)`` reads the desired servers out of pyinfra host data.
- **Run time**: a lock per GPU on the Proxmox host, ``/run/gpugate/gpu-<index>.lock`` (a kernel
  flock, so a dead holder frees it), held for a transition by a detached holder on the Proxmox
  host (gpugate/host_gpu_lock.py, started by ``PctConnector.hold_gpu_locks``): two transitions
  with overlapping GPU sets cannot pass their gates together, whatever the plan said (two
  operators, two fleet files, a hand-started server).

GPU indexes are the Proxmox host's (what ``nvidia-smi`` on the host numbers), as the container sees
them when its config passes every GPU through (the usual setup for TP servers).

Example::

    >>> overlapping_claims([("pve1", 129, 30000, (0, 1, 2, 3)), ("pve1", 130, 30000, (3, 4)),
    ...                     ("pve2", 129, 30000, (0, 1, 2, 3))])
    ['pve1: ct 129 :30000 (GPU 0-3) and ct 130 :30000 (GPU 3-4) claim the same GPU 3']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["ServerClaim", "overlapping_claims", "overlaps_of", "servers_of_inventory", "claim_host", "gpu_ranges",
           "LOCK_DIR", "HANDOFF_S", "lock_path", "busy_message", "own_claim_run"]

# (Proxmox host, vmid, port, the server's GPUs as host GPU indexes)
ServerClaim = tuple[str, int, int, tuple[int, ...]]

LOCK_DIR = "/run/gpugate"
# The hand-off window of a GPU claim: the controller hands off right after taking the claim (a few
# seconds, the agent's install included); a claim whose run has not begun by then is let go by its
# holder, a hand-off that comes later is refused by the container's agent (so the run cannot begin
# unclaimed), and another deploy that meets such a claim past its window releases it at once.
HANDOFF_S = 15.0


def lock_path(gpu: int, lock_dir: str = LOCK_DIR) -> str:
    """The lock file of one GPU on the Proxmox host.

    >>> lock_path(3)
    '/run/gpugate/gpu-3.lock'
    """
    return f"{lock_dir}/gpu-{int(gpu)}.lock"


def gpu_ranges(gpus: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``0-3,6``.

    >>> gpu_ranges([4, 5, 6, 7]), gpu_ranges([1, 3]), gpu_ranges([])
    ('4-7', '1,3', 'none')
    """
    indexes = sorted(set(int(gpu) for gpu in gpus))
    if not indexes:
        return "none"
    parts: list[str] = []
    start = previous = indexes[0]
    for index in indexes[1:] + [None]:  # type: ignore[list-item]
        if index is not None and index == previous + 1:
            previous = index
            continue
        parts.append(f"{start}-{previous}" if previous != start else str(start))
        if index is not None:
            start = previous = index
    return ",".join(parts)


def overlapping_claims(servers: Iterable[ServerClaim]) -> list[str]:
    """One line per pair of servers of one Proxmox host whose GPU sets overlap, naming both and the
    GPUs they share, in the order the servers were given. Servers of different Proxmox hosts never
    overlap (GPU 0 of pve1 is not GPU 0 of pve2).

    >>> overlapping_claims([("pve1", 129, 30000, (0, 1)), ("pve1", 130, 30000, (2, 3))])
    []
    >>> overlapping_claims([("pve1", 129, 30000, (0, 1)), ("pve1", 129, 30001, (1,))])
    ['pve1: ct 129 :30000 (GPU 0-1) and ct 129 :30001 (GPU 1) claim the same GPU 1']
    """
    listed = [(str(host), int(vmid), int(port), tuple(int(g) for g in gpus)) for host, vmid, port, gpus in servers]
    lines = []
    for i, (host, vmid, port, gpus) in enumerate(listed):
        for other_host, other_vmid, other_port, other_gpus in listed[i + 1:]:
            if other_host != host:
                continue
            shared = set(gpus) & set(other_gpus)
            if shared:
                lines.append(f"{host}: ct {vmid} :{port} (GPU {gpu_ranges(gpus)}) and ct {other_vmid} "
                             f":{other_port} (GPU {gpu_ranges(other_gpus)}) claim the same GPU "
                             f"{gpu_ranges(shared)}")
    return lines


def overlaps_of(server: ServerClaim, servers: Iterable[ServerClaim]) -> list[str]:
    """The lines of overlapping_claims that involve ``server`` (one container's refusal at plan
    time: each container of an overlapping pair is refused, naming the other).

    >>> fleet = [("pve1", 129, 30000, (0, 1)), ("pve1", 130, 30000, (1, 2)), ("pve1", 131, 30000, (3,))]
    >>> overlaps_of(("pve1", 131, 30000, (3,)), fleet), len(overlaps_of(fleet[0], fleet))
    ([], 1)
    """
    host, vmid, port, _gpus = server
    me = f"ct {int(vmid)} :{int(port)} "
    return [line for line in overlapping_claims(servers)
            if line.startswith(f"{host}: ") and (f": {me}" in line or f" and {me}" in line)]


def servers_of_inventory(hosts: Iterable[tuple[str, Mapping[str, Any]]],
                         gpu_set: Callable[[Mapping[str, Any], Mapping[str, str]], Sequence[int]] | None = None,
                         ) -> list[ServerClaim]:
    """The desired servers of the inventory as ServerClaims, from each host's data (name, data):
    ``pve_host`` (else ``ssh_hostname``, else ``@local``), ``pct_vmid``, ``sglang_port``,
    ``sglang_flags`` and ``sglang_env``; servers with ``sglang_present`` false claim nothing.
    ``gpu_set(flags, env)`` maps a server's flags and environment to its GPUs (default
    ``gpugate.spec.gpu_set``); a server whose flags it cannot read is left out (its own operation
    reports the flag error).

    .. code:: python

        from pyinfra import state
        lines = overlapping_claims(servers_of_inventory(
            (h.name, h.data) for h in state.inventory))
    """
    from gpugate.settings import SETTINGS, to_bool  # noqa: PLC0415
    from gpugate.spec import GPU_SET_FLAGS, extra_flags, gpu_set as spec_gpu_set  # noqa: PLC0415

    claims: list[ServerClaim] = []
    for name, data in hosts:
        # several servers in one container (fleet.yaml's sglang: list): each claims its own GPUs
        for server in data.get("sglang_servers") or [{}]:
            values = {**data, **server}
            try:
                if not to_bool(values.get("sglang_present", True)):
                    continue
                vmid = int(values.get("pct_vmid"))  # type: ignore[arg-type]
                port = int(values.get("sglang_port", SETTINGS["sglang_port"].default))
                flags = dict(values.get("sglang_flags") or {})
                if gpu_set is None:  # the spec's own rule: what extra_args say counts too
                    extra = extra_flags(values.get("sglang_extra_args") or [])
                    flags.update((k, v) for k, v in extra.items() if k in GPU_SET_FLAGS)
                gpus = tuple(int(g) for g in (gpu_set or spec_gpu_set)(flags, values.get("sglang_env") or {}))
            except Exception:  # noqa: BLE001 -- a server we cannot read is its own operation's error
                continue
            claims.append((claim_host(name, data), vmid, port, gpus))
    return claims


def claim_host(name: str, data: Mapping[str, Any]) -> str:
    """The Proxmox host a container's GPUs belong to, from its pyinfra host data: ``pve_host`` (the
    fleet's host name), else ``ssh_hostname``, else ``@local`` (pyinfra on the Proxmox host), else
    the inventory name. One rule for every claim, so two containers of one host always compare.

    >>> claim_host("@pct/pve1:129", {"pve_host": "pve1", "ssh_hostname": "10.0.0.5"})
    'pve1'
    >>> claim_host("@pct/@local:129", {"pct_local": True})
    '@local'
    """
    return str(data.get("pve_host") or data.get("ssh_hostname") or ("@local" if data.get("pct_local") else name))


def busy_message(pve_host: str, vmid: int, gpu: int, owner: Mapping[str, Any] | None, run: str) -> str:
    """What the operator reads when a GPU lock on the Proxmox host is held by another transition.

    >>> busy_message("pve1", 130, 4, {"vmid": 129, "run": "r1", "gpus": [0, 1, 2, 3, 4]}, "r2")
    'GPU 4 of pve1 is claimed by container 129 (run r1, GPU 0-4): a transition there holds it. ct 130 did not begin run r2; nothing was touched (retry when that run ended, or give the servers disjoint GPUs)'
    """
    if owner and owner.get("vmid") is not None:
        who = f"container {owner.get('vmid')} (run {owner.get('run', '?')}, GPU {gpu_ranges(owner.get('gpus') or [])})"
    else:
        who = "another transition (its lock file names no owner yet)"
    return (f"GPU {gpu} of {pve_host} is claimed by {who}: a transition there holds it. ct {vmid} did not "
            f"begin run {run}; nothing was touched (retry when that run ended, or give the servers "
            f"disjoint GPUs)")


def own_claim_run(owner: Mapping[str, Any] | None, vmid: Any) -> str | None:
    """The run to attach to when a GPU claim is held by a run of this very container (two deploys
    of one container at once: the other's run holds the claim), else None.

    >>> own_claim_run({"vmid": 129, "run": "r1"}, "129"), own_claim_run({"vmid": 130, "run": "r1"}, 129)
    ('r1', None)
    """
    if not owner or owner.get("vmid") is None or not owner.get("run"):
        return None
    return str(owner["run"]) if str(owner.get("vmid")) == str(vmid) else None
