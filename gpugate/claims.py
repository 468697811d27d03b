"""GPU claims per Proxmox host: no two servers of one Proxmox host on the same GPUs.

Two checks, one at each end of a run:

- **Plan time** (pure): ``overlapping_claims(servers)`` names every pair of desired servers of one
  Proxmox host whose GPU sets overlap; sglang.server refuses those before touching anything.
  ``servers_of_inventory(hosts)`` reads the desired servers out of pyinfra host data.
- **Run time**: a lock per GPU on the Proxmox host, ``/run/gpugate/gpu-<index>.lock`` (a kernel
  flock, so a dead holder frees it), held for a transition by a detached holder on the Proxmox
  host (gpugate/host_gpu_lock.py, started by ``hold_gpu_locks`` or, with the hand-off in the same
  round trip, ``hand_off_holding_gpu_locks``; sent over the pct connector's host-command path,
  ``PctConnector.run_on_proxmox_host``): two transitions with overlapping GPU sets cannot pass
  their gates together, whatever the plan said (two operators, two fleet files, a hand-started
  server).

The same plan-time check for routers (issue 32): ``shared_worker_urls(routes_of_inventory(hosts))``
names every pair of routed servers of the inventory that name one worker URL behind one router
(fleet.yaml refuses it too; this also sees what ``--data`` overrides make of the inventory).

GPU indexes are the Proxmox host's (what ``nvidia-smi`` on the host numbers), as the container sees
them when its config passes every GPU through (the usual setup for TP servers).

Example::

    >>> overlapping_claims([("pve1", 129, 30000, (0, 1, 2, 3)), ("pve1", 130, 30000, (3, 4)),
    ...                     ("pve2", 129, 30000, (0, 1, 2, 3))])
    ['pve1: ct 129 :30000 (GPU 0-3) and ct 130 :30000 (GPU 3-4) claim the same GPU 3']
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpugate.router.smg import worker_url_key

if TYPE_CHECKING:  # the run-time half imports pyinfra when it runs: the plan-time half stays light
    from pyinfra.api.arguments import ConnectorArguments
    from pyinfra.api.command import StringCommand
    from pyinfra.connectors.util import CommandOutput
    from typing_extensions import Unpack

    from gpugate.connectors.pct import PctConnector

__all__ = ["ServerClaim", "overlapping_claims", "overlaps_of", "servers_of_inventory", "claim_host", "gpu_ranges",
           "LOCK_DIR", "HANDOFF_S", "lock_path", "busy_message", "own_claim_run", "GpuClaim", "hold_gpu_locks",
           "hand_off_holding_gpu_locks", "ServerRoute", "shared_worker_urls", "routes_of_inventory"]

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
    from gpugate.spec import desired_states  # noqa: PLC0415

    claims: list[ServerClaim] = []
    for name, data in hosts:
        if gpu_set is None:  # the desired state's own GPUs (the engine's rule, extra_args counted)
            try:
                vmid = int(data.get("pct_vmid"))  # type: ignore[arg-type]
                desired = desired_states(data)
            except Exception:  # noqa: BLE001 -- a server we cannot read is its own operation's error
                continue
            claims += [(claim_host(name, data), vmid, d.port, tuple(d.spec.gpus)) for d in desired
                       if d.present and d.spec is not None and d.spec.gpus is not None]
            continue
        # several servers in one container (fleet.yaml's sglang: list): each claims its own GPUs
        for server in data.get("sglang_servers") or [{}]:
            values = {**data, **server}
            try:
                if not to_bool(values.get("sglang_present", True)):
                    continue
                vmid = int(values.get("pct_vmid"))  # type: ignore[arg-type]
                port = int(values.get("sglang_port", SETTINGS["sglang_port"].default))
                gpus = tuple(int(g) for g in gpu_set(dict(values.get("sglang_flags") or {}),
                                                     values.get("sglang_env") or {}))
            except Exception:  # noqa: BLE001 -- a server we cannot read is its own operation's error
                continue
            claims.append((claim_host(name, data), vmid, port, gpus))
    return claims


# ---------------------------------------------------------------- plan time: one worker URL, one server

# (the server as its lines name it, the router's name, the router's URL, the server's worker URL)
ServerRoute = tuple[str, str, str, str]



def shared_worker_urls(routes: Iterable[ServerRoute]) -> list[str]:
    """One line per pair of servers behind one router (its URL, whatever its name) that name one
    worker URL (:func:`worker_url_key`): the router keeps one worker per URL, so the leave of one
    would take the OTHER out of the router, and the one that stops would still be routed to.

    >>> shared_worker_urls([("@pct/pve1:129 :30000", "gw", "http://gw:1", "http://10.0.0.5:30000"),
    ...                     ("@pct/pve2:130 :30000", "gw", "http://gw:1/", "HTTP://10.0.0.5:30000/"),
    ...                     ("@pct/pve2:131 :30000", "gw", "http://gw:1", "http://10.0.0.6:30000")])
    ['@pct/pve1:129 :30000 and @pct/pve2:130 :30000 both name worker URL http://10.0.0.5:30000 behind router gw']
    """
    listed = [(str(who), str(name), worker_url_key(endpoint), str(url), worker_url_key(url))
              for who, name, endpoint, url in routes]
    lines = []
    for i, (who, name, router, url, key) in enumerate(listed):
        for other, _other_name, other_router, _other_url, other_key in listed[i + 1:]:
            if router == other_router and key == other_key:
                lines.append(f"{who} and {other} both name worker URL {url} behind router {name}")
    return lines


def routes_of_inventory(hosts: Iterable[tuple[str, Mapping[str, Any]]]) -> list[ServerRoute]:
    """The routed servers of the inventory (every one that names a router, ``present: false`` too:
    it leaves its router before its stop), from each host's data (name, data) as the deploy reads
    it, ``--data`` overrides included and ``only_port`` ignored (the fleet is the desired state).
    A server whose data cannot be read is left out (its own operation reports it)."""
    from gpugate.spec import desired_states  # noqa: PLC0415

    routes: list[ServerRoute] = []
    for name, data in hosts:
        try:
            desired = desired_states({key: value for key, value in data.items() if key != "only_port"})
        except Exception:  # noqa: BLE001 -- a server we cannot read is its own operation's error
            continue
        routes += [(f"{name} :{d.port}", d.routing.router, d.routing.endpoint, d.routing.worker_url)
                   for d in desired if d.routing is not None]
    return routes


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


# ---------------------------------------------------------------- run time: the Proxmox host's GPU locks


@dataclasses.dataclass(frozen=True)
class GpuClaim:
    """What the Proxmox host's lock holder answered for a transition's GPUs.

    ``locked``: the locks are held (hand off); else refuse, nothing was touched. ``message``: what
    the operator reads either way. ``owner``: a busy claim's record (``vmid``, ``run``, ``gpus``),
    ``began``: whether its run exists in its container, ``until``: this claim's hand-off window,
    ``released``: the stale claims ended on the way. ``started``: the hand-off's ``(status,
    output)`` when the holder ran it (:func:`hand_off_holding_gpu_locks`), else None.
    """

    locked: bool
    message: str
    owner: Mapping[str, Any] | None = None
    began: bool | None = None
    until: float | None = None
    released: tuple[Mapping[str, Any], ...] = ()
    started: tuple[bool, CommandOutput] | None = None


def hold_gpu_locks(connector: PctConnector, gpus: Iterable[int], run: str, python: str = "/usr/bin/python3",
                   grace_s: float = HANDOFF_S, wait_s: float = 0, lock_dir: str = LOCK_DIR) -> GpuClaim:
    """Take a transition's GPU locks on the container's Proxmox host (``/run/gpugate/gpu-<i>.lock``,
    one exclusive flock per GPU, in index order) and hold them, in a detached process on the host
    (gpugate/host_gpu_lock.py), until the container agent's ``wait`` for ``run`` returns (``pct exec
    <vmid> -- sh -c '<gpugate.agentcmd.wait_command(python, run, grace_s)>'``: the run has ended, or
    it did not begin within ``grace_s``). Call it right before the hand-off: ``locked`` -> hand off;
    else refuse, nothing was touched (``message`` names the container whose run holds a GPU, after
    waiting up to ``wait_s`` for it to end). ``grace_s`` is the hand-off window: the holder lets go
    when no run began by then, the container's agent refuses a hand-off that comes later, and a
    claim met past its window whose run its container does not know is released at once (its
    holder ended).

    .. code:: python

        claim = hold_gpu_locks(host.connector, spec_gpus, run_id, python="/usr/bin/python3")
    """
    gpu_list = sorted({int(gpu) for gpu in gpus})
    if not gpu_list:
        return GpuClaim(True, "no GPU to claim")
    args = _lock_args(connector, gpu_list, run, python, grace_s, wait_s, lock_dir)
    status, output = connector.run_on_proxmox_host(_lock_program(args), _timeout=int(max(30, wait_s + 30)))
    answer = _last_json(output.stdout_lines)
    if not status or answer is None:
        return _claim(answer, False, _lock_failure(connector, gpu_list, run, output))
    return _lock_answer(connector, gpu_list, run, answer)


def hand_off_holding_gpu_locks(connector: PctConnector, gpus: Iterable[int], run: str, command: str | StringCommand,
                               stdin: str, python: str = "/usr/bin/python3", grace_s: float = HANDOFF_S,
                               wait_s: float = 0, lock_dir: str = LOCK_DIR, timeout: float = 120,
                               **arguments: Unpack[ConnectorArguments]) -> GpuClaim:
    """:func:`hold_gpu_locks` and the hand-off in ONE round trip: the host's lock holder, once it
    holds the locks, runs ``command`` in the container (as the connector's ``run_shell_command``
    would: pyinfra's wrapping inside, ``pct exec`` outside) with ``stdin`` (the start document; the
    holder sets its ``claim_until`` to this claim's window, and the agent refuses a hand-off after it).

    ``started`` is the command's ``(status, output)``, with pct's own failures made data exactly as
    ``run_shell_command`` makes them (``connector.last_failure``, a ``pct error: ...`` line), or None
    when the locks were not taken (nothing was run, nothing touched). A link lost before any answer
    is ``locked`` with ``started`` ``(False, <the lost-link line>)``: the hand-off may have begun.

    .. code:: python

        claim = hand_off_holding_gpu_locks(host.connector, spec_gpus, run_id, agentcmd.start_command(python),
                                           agentcmd.start_stdin(doc, False))
    """
    from pyinfra.api.command import StringCommand  # noqa: PLC0415
    from pyinfra.connectors.util import CommandOutput, OutputLine, extract_control_arguments  # noqa: PLC0415

    gpu_list = sorted({int(gpu) for gpu in gpus})
    command = command if isinstance(command, StringCommand) else StringCommand(command)
    if not gpu_list:
        plain = {**arguments, "_stdin": stdin, "_timeout": int(timeout)}
        return GpuClaim(True, "no GPU to claim", started=connector.run_shell_command(command, **plain))  # type: ignore[arg-type]
    # the host program's own exit status is 0 whatever the hand-off did: the codes apply to the hand-off
    success_codes = list(extract_control_arguments(dict(arguments)).get("_success_exit_codes") or [0])  # type: ignore[arg-type]
    args = _lock_args(connector, gpu_list, run, python, grace_s, wait_s, lock_dir)
    args["start"] = {"command": connector.container_command(command, **arguments).get_raw_value()}
    status, output = connector.run_on_proxmox_host(_lock_program(args), _stdin=stdin,
                                                   _timeout=int(max(30, wait_s + 30) + timeout))
    answer = _last_json(output.stdout_lines)
    if answer is None or not status:
        lost = connector.last_failure  # the link went: the holder, and so the hand-off, may have run
        if lost is not None and lost.kind == "link-lost":
            return _claim(answer, True, "no answer", started=connector.container_result(False, output, lost))
        return _claim(answer, False, _lock_failure(connector, gpu_list, run, output))
    claim = _lock_answer(connector, gpu_list, run, answer)
    start = answer.get("start")
    if not claim.locked or not isinstance(start, dict):
        return claim
    # the hand-off's own output: its stdout from the answer, pct's stderr as the holder passed it on
    lines = [OutputLine("stdout", line) for line in str(start.get("stdout") or "").splitlines()]
    lines += [OutputLine("stderr", line) for line in output.stderr_lines]
    rc = start.get("rc")
    ok = isinstance(rc, int) and rc in success_codes
    return dataclasses.replace(claim, started=connector.container_result(ok, CommandOutput(lines)))


def _lock_args(connector: PctConnector, gpu_list: list[int], run: str, python: str, grace_s: float, wait_s: float,
               lock_dir: str) -> dict[str, Any]:
    """The holder's arguments (gpugate/host_gpu_lock.py): it runs pct itself, so pct's argv and the
    container's PATH travel with them."""
    from gpugate.agentcmd import wait_command  # noqa: PLC0415
    from gpugate.connectors.pct import CONTAINER_PATH  # noqa: PLC0415

    return {
        "vmid": connector.vmid, "gpus": gpu_list, "run": str(run), "wait_s": wait_s, "lock_dir": lock_dir,
        "command": wait_command(python, str(run), grace_s=grace_s), "path": CONTAINER_PATH,
        "grace_s": grace_s, "check_command": wait_command(python, "@RUN@", grace_s=0, timeout_s=0),
        "pct": connector.pct_argv,  # argv: no shell quoting
        "clear_env": bool(connector.data["pct_clear_env"]),
    }


def _lock_program(args: Mapping[str, Any]) -> StringCommand:
    """The holder as one host command; the connector runs it as root where pct needs sudo (the lock
    dir is /run's, and the holder runs pct). -S: the holder is stdlib only, and site (site-packages,
    .pth files) is most of a Python start (it is on the restart's path, right before the hand-off)."""
    from pyinfra.api.command import QuoteString, StringCommand  # noqa: PLC0415

    from gpugate import host_gpu_lock  # noqa: PLC0415 -- its source travels, not the module
    from gpugate.remote import pack  # noqa: PLC0415

    source = Path(host_gpu_lock.__file__).read_text()
    return StringCommand("python3", "-S", "-c", QuoteString(pack(source)), QuoteString(json.dumps(args)))


def _last_json(lines: list[str]) -> dict[str, Any] | None:
    """The last stdout line that is a JSON object, or None."""
    for line in reversed(lines):
        text = line.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except ValueError:
                continue
            return value if isinstance(value, dict) else None
    return None


def _claim(answer: Mapping[str, Any] | None, locked: bool, message: str,
           started: tuple[bool, CommandOutput] | None = None) -> GpuClaim:
    answer = answer or {}
    return GpuClaim(locked, message, owner=answer.get("owner"), began=answer.get("began"),
                    until=answer.get("handoff_until"), released=tuple(answer.get("released") or ()), started=started)


def _lock_failure(connector: PctConnector, gpu_list: list[int], run: str, output: CommandOutput) -> str:
    from gpugate.connectors.pct import strip_host_noise  # noqa: PLC0415

    where = f"GPU {gpu_ranges(gpu_list)} of {connector.pve_host_name}"
    detail = " / ".join(strip_host_noise(output.stderr_lines)) or output.stdout or "no answer"
    return f"could not take the locks of {where} for run {run}: {detail}; nothing was touched"


def _lock_answer(connector: PctConnector, gpu_list: list[int], run: str, answer: Mapping[str, Any]) -> GpuClaim:
    where = f"GPU {gpu_ranges(gpu_list)} of {connector.pve_host_name}"
    released = "".join(f"; released the claim of run {gone.get('run')} (container {gone.get('vmid')}, GPU "
                       f"{gpu_ranges(gone.get('gpus') or [])}): {gone.get('why')}" for gone in answer.get("released") or [])
    if answer.get("ok"):
        return _claim(answer, True, f"holding the locks of {where} for run {run} (holder pid {answer.get('pid')} on "
                                    f"the host){released}")
    if answer.get("error") and "gpu" in answer:
        return _claim(answer, False, f"could not take the locks of {where} for run {run}: {answer['error']}; "
                                     f"nothing was touched")
    if "gpu" in answer:
        return _claim(answer, False, busy_message(connector.pve_host_name, connector.vmid, int(answer["gpu"]),
                                                  answer.get("owner"), run))
    return _claim(answer, False, f"could not take the locks of {where} for run {run}: {answer.get('error')}; "
                                 f"nothing was touched")
