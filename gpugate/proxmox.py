"""The Proxmox node's own view: its containers and the GPUs each one's config passes in (issue 36).

Read over the SSH connection the deploy uses, as proxmoxer's SSH backend reads the API: ``pvesh get
<path> --output-format json`` on the Proxmox host (``/nodes/localhost/...``: this node). Two API paths
(pve-container src/PVE/API2/LXC.pm ``vmlist``, src/PVE/API2/LXC/Config.pm ``vm_config``):

- ``/nodes/{node}/lxc``: ``[{"vmid": 129, "status": "running", "name": "ct129", ...}, ...]``;
- ``/nodes/{node}/lxc/{vmid}/config``: the config's keys (``unprivileged``, ``devN``...), raw lines as
  ``"lxc": [[key, value], ...]``, and ``digest``.

A GPU is passed in by a ``devN: [path=]/dev/nvidiaK[,...]`` line (PVE 8.1+) or a raw
``lxc.mount.entry: /dev/nvidiaK dev/nvidiaK none bind,...`` line. The index is K, the Proxmox host's
numbering (what ``nvidia-smi`` on the host shows), the numbering gpugate's GPU claims use
(gpugate.claims). A config that allows the NVIDIA major with ``lxc.cgroup2.devices.allow: c 195:*``
but binds no ``/dev/nvidiaK`` passes in no GPU. What the config cannot tell: PVE 9 adds a ``devN``
to a running container at once but removes one only at its restart (pve-container 6.0.4), so a
container that ran since its config changed may still hold a device the config no longer names.

Everything here is pure (the commands to send, the parsing of what they print, the checks), but
``node_views``: the plan's one round trip per Proxmox host, through the pct connector.

Example::

    >>> ct = container_of({"vmid": 129, "status": "running", "name": "ct129"},
    ...                   {"dev0": "/dev/nvidia0", "dev1": "path=/dev/nvidia1,mode=0666", "unprivileged": 1})
    >>> ct.vmid, ct.gpus, ct.privileged, describe_map(ct)
    (129, (0, 1), False, '/dev/nvidia0-1')
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpugate.claims import ServerClaim, gpu_ranges

if TYPE_CHECKING:
    from gpugate.connectors.pct import PctConnector

__all__ = ["ContainerView", "gpu_nodes_of", "container_of", "describe_map", "shared_gpus", "index_command",
           "configs_command", "parse_framed", "parse_pvesh_json", "node_view", "fit_problem", "MARK", "node_views",
           "map_refusals", "plan_map_refusals", "mapped_view"]

NODE = "localhost"  # the API's name for the node pvesh runs on
MARK = "@@gpugate-pvesh"
_GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")


@dataclasses.dataclass(frozen=True)
class ContainerView:
    """One container as its Proxmox node sees it. ``gpus``: the host GPU indexes its config passes
    in; ``nodes``: their device nodes; ``privileged``: None when the config could not be read;
    ``problem``: why its config could not be read (pvesh's own message)."""

    vmid: int
    name: str
    status: str
    privileged: bool | None = None
    gpus: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    digest: str | None = None
    problem: str | None = None

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"gpus": list(self.gpus), "nodes": list(self.nodes)}


def gpu_nodes_of(config: Mapping[str, Any]) -> list[str]:
    """The ``/dev/nvidiaK`` nodes a config (the API's JSON) passes in, from ``devN`` keys and raw
    ``lxc.mount.entry`` lines, each once, in the config's order.

    >>> gpu_nodes_of({"dev0": "/dev/nvidia2,gid=44", "dev1": "/dev/nvidiactl",
    ...               "lxc": [["lxc.mount.entry", "/dev/nvidia3 dev/nvidia3 none bind,optional,create=file"],
    ...                       ["lxc.cgroup2.devices.allow", "c 195:* rwm"]]})
    ['/dev/nvidia2', '/dev/nvidia3']
    """
    paths = [str(value).split(",")[0].removeprefix("path=") for key, value in config.items()
             if re.fullmatch(r"dev\d+", str(key))]
    for pair in config.get("lxc") or []:
        if isinstance(pair, (list, tuple)) and len(pair) == 2 and pair[0] == "lxc.mount.entry":
            paths += str(pair[1]).split()[:1]
    seen: list[str] = []
    for path in paths:
        if _GPU_NODE.match(path) and path not in seen:
            seen.append(path)
    return seen


def container_of(entry: Mapping[str, Any], config: Mapping[str, Any] | None, problem: str | None = None
                 ) -> ContainerView:
    """A ContainerView from its ``/nodes/{node}/lxc`` entry and its ``/config`` (None: unread, with
    ``problem``). ``unprivileged`` comes as ``1``/``0`` (or a string of it).

    >>> container_of({"vmid": "130", "status": "stopped"}, None, "Configuration file ... does not exist")
    ContainerView(vmid=130, name='CT130', status='stopped', privileged=None, gpus=(), nodes=(), digest=None, problem='Configuration file ... does not exist')
    """
    vmid = int(entry["vmid"])
    name = str(entry.get("name") or f"CT{vmid}")
    status = str(entry.get("status") or "unknown")
    if config is None:
        return ContainerView(vmid, name, status, problem=problem)
    nodes = gpu_nodes_of(config)
    gpus = tuple(sorted(int(_GPU_NODE.match(node).group(1)) for node in nodes))  # type: ignore[union-attr]
    privileged = str(config.get("unprivileged", 0)).strip() not in ("1", "true")
    return ContainerView(vmid, name, status, privileged, gpus, tuple(f"/dev/nvidia{g}" for g in gpus),
                         config.get("digest"), problem)


def describe_map(view: ContainerView) -> str:
    """How a container's GPUs are named to the operator: its device nodes as a range.

    >>> describe_map(ContainerView(129, "ct129", "running", gpus=(0, 1, 2, 3)))
    '/dev/nvidia0-3'
    >>> describe_map(ContainerView(130, "ct130", "running"))
    'no /dev/nvidiaN'
    """
    return f"/dev/nvidia{gpu_ranges(view.gpus)}" if view.gpus else "no /dev/nvidiaN"


def shared_gpus(views: Iterable[ContainerView]) -> dict[int, list[int]]:
    """GPU -> the containers (vmids) whose configs pass it in, for GPUs passed into more than one.

    >>> shared_gpus([ContainerView(129, "a", "running", gpus=(0, 1)), ContainerView(131, "b", "stopped", gpus=(1,))])
    {1: [129, 131]}
    """
    holders: dict[int, list[int]] = {}
    for view in views:
        for gpu in view.gpus:
            holders.setdefault(gpu, []).append(view.vmid)
    return {gpu: vmids for gpu, vmids in sorted(holders.items()) if len(vmids) > 1}


# ---------------------------------------------------------------- commands and their output


def _pvesh(path: str) -> str:
    return f"pvesh get {shlex.quote(path)} --output-format json"


def index_command() -> str:
    """The container index of the node pvesh runs on, framed (parse_framed).

    >>> index_command()
    "pvesh get /nodes/localhost/lxc --output-format json 2>&1; echo '@@gpugate-pvesh lxc' $?"
    """
    return f"{_pvesh(f'/nodes/{NODE}/lxc')} 2>&1; echo {shlex.quote(MARK + ' lxc')} $?"


def configs_command(vmids: Iterable[int]) -> str:
    """Each container's config in one round trip, each answer framed by its vmid (parse_framed).

    >>> configs_command([129])
    "pvesh get /nodes/localhost/lxc/129/config --output-format json 2>&1; echo '@@gpugate-pvesh 129' $?"
    """
    return "; ".join(f"{_pvesh(f'/nodes/{NODE}/lxc/{int(v)}/config')} 2>&1; echo {shlex.quote(f'{MARK} {int(v)}')} $?"
                     for v in vmids)


def parse_framed(lines: Sequence[str]) -> dict[str, tuple[int, str]]:
    """What framed commands printed: key -> (pvesh's exit status, its output, stderr merged).

    >>> parse_framed(['[{"vmid":129}]', "@@gpugate-pvesh lxc 0", "Configuration file 'nodes/pve1/lxc/7.conf' does not exist",
    ...               "@@gpugate-pvesh 7 255"])
    {'lxc': (0, '[{"vmid":129}]'), '7': (255, "Configuration file 'nodes/pve1/lxc/7.conf' does not exist")}
    """
    answers: dict[str, tuple[int, str]] = {}
    held: list[str] = []
    for line in lines:
        if line.startswith(MARK + " "):
            parts = line.split()
            try:
                answers[parts[1]] = (int(parts[2]), "\n".join(held).strip())
            except (IndexError, ValueError):
                pass
            held = []
        else:
            held.append(line.rstrip("\r"))
    return answers


def parse_pvesh_json(answer: tuple[int, str] | None, what: str) -> tuple[Any, str | None]:
    """(document, None) for a pvesh answer that is JSON, else (None, the problem in one line).

    >>> parse_pvesh_json((127, "sh: 1: pvesh: not found"), "the container index")
    (None, 'the container index: pvesh failed (exit 127): sh: 1: pvesh: not found')
    """
    if answer is None:
        return None, f"{what}: no answer from pvesh"
    status, text = answer
    if status == 0:
        try:
            return json.loads(text), None
        except ValueError:
            pass
    last = text.strip().splitlines()[-1] if text.strip() else "no output"
    return None, f"{what}: pvesh failed (exit {status}): {last}"


def node_view(index: Any, configs: Mapping[str, tuple[int, str]]) -> list[ContainerView]:
    """The node's containers, by vmid, from the index document and the framed config answers.

    >>> views = node_view([{"vmid": 130, "status": "running"}, {"vmid": 129, "status": "running"}],
    ...                   {"129": (0, '{"dev0": "/dev/nvidia0"}'), "130": (255, "Configuration file gone")})
    >>> [(v.vmid, v.gpus, v.problem) for v in views]
    [(129, (0,), None), (130, (), '130 config: pvesh failed (exit 255): Configuration file gone')]
    """
    views = []
    for entry in sorted((e for e in index or [] if isinstance(e, Mapping) and "vmid" in e), key=lambda e: int(e["vmid"])):
        vmid = int(entry["vmid"])
        config, problem = parse_pvesh_json(configs.get(str(vmid)), f"{vmid} config")
        views.append(container_of(entry, config if isinstance(config, Mapping) else None, problem))
    return views


# ---------------------------------------------------------------- checks before anything stops


def fit_problem(view: ContainerView | None, vmid: int, gpus: Sequence[int], needs: str) -> str | None:
    """Why a server on host GPUs ``gpus`` cannot run in this container, naming its map and what the
    server needs (``needs``: "--tp-size 8"); None when it fits. ``view`` None: not on this node.

    >>> fit_problem(ContainerView(129, "ct129", "running", gpus=(0, 1, 2, 3)), 129, range(8), "--tp-size 8")
    'container 129 maps /dev/nvidia0-3; --tp-size 8 needs 8 GPUs (GPU 0-7), GPU 4-7 not mapped'
    >>> fit_problem(ContainerView(129, "ct129", "running", gpus=(0, 1)), 129, [0, 1], "--tp-size 2") is None
    True
    """
    if view is None:
        return f"container {vmid} is not on this Proxmox node (pvesh lists no such container)"
    if view.problem:
        return None  # unread: said once, as a note (the deploy finds it on its own)
    missing = sorted(set(int(g) for g in gpus) - set(view.gpus))
    if not missing:
        return None
    count = len(set(gpus))
    return (f"container {vmid} maps {describe_map(view)}; {needs} needs {count} GPU{'s' if count != 1 else ''} "
            f"(GPU {gpu_ranges(gpus)}), GPU {gpu_ranges(missing)} not mapped")


# ---------------------------------------------------------------- plan time: the GPUs each container maps

# (id of the pyinfra State, Proxmox host) -> vmid -> the container as its node sees it (gpugate.proxmox),
# or the one line why the node's view could not be read: one round trip per Proxmox host per run
_NODE_VIEWS: dict[tuple[int, str], tuple[dict[int, Any], str | None]] = {}
_SAID: set[tuple[int, str]] = set()


def node_views(connector: PctConnector, run_key: int, pve_host: str, vmids: Iterable[int]) -> tuple[dict[int, Any], str | None]:
    """Every named container's config as its Proxmox node reads it (``pvesh get
    /nodes/localhost/lxc/<vmid>/config``, gpugate.proxmox), one round trip per Proxmox host per
    run: vmid -> ContainerView, and the one line why none could be read (no pvesh: not Proxmox)."""
    from pyinfra.api.command import StringCommand  # noqa: PLC0415

    key = (run_key, pve_host)
    if key not in _NODE_VIEWS:
        wanted = sorted(set(int(v) for v in vmids))
        _ok, output = connector.run_on_proxmox_host(StringCommand(configs_command(wanted)))
        answers = parse_framed(list(output.stdout_lines) + list(output.stderr_lines))
        views: dict[int, Any] = {}
        problem = None
        for vmid in wanted:
            config, trouble = parse_pvesh_json(answers.get(str(vmid)), f"{pve_host}: container {vmid}'s config")
            if isinstance(config, Mapping):
                views[vmid] = container_of({"vmid": vmid}, config)
            elif trouble and ("not found" in trouble or answers.get(str(vmid)) is None):
                problem = f"{pve_host}: no pvesh there ({trouble}); the GPUs each container maps are not checked"
            else:
                views[vmid] = container_of({"vmid": vmid}, None, trouble)
        _NODE_VIEWS[key] = (views, problem)
    return _NODE_VIEWS[key]


def say_once(run_key: int, line: str) -> bool:
    """True the first time ``line`` is said in this run (a note for every container would repeat it)."""
    if (run_key, line) in _SAID:
        return False
    _SAID.add((run_key, line))
    return True


def map_refusals(mine: ServerClaim, views: Mapping[int, Any], needs: str) -> list[str]:
    """Why this desired server cannot run as its Proxmox node has its container (plan time, before
    anything stops): its GPUs are not all passed into its container (fit_problem: the container's
    map and what the server needs). A container whose config could not be read refuses nothing. (A
    GPU passed into two containers, with a server desired on it in each, is two servers claiming
    one GPU: gpugate.claims.overlapping_claims refuses both, and ``gpugate discover`` names the map.)

    >>> views = {129: ContainerView(129, "a", "running", gpus=(0, 1))}
    >>> map_refusals(("pve1", 129, 30000, (0, 1, 2, 3)), views, "--tp-size 4")
    ['container 129 maps /dev/nvidia0-1; --tp-size 4 needs 4 GPUs (GPU 0-3), GPU 2-3 not mapped']
    >>> map_refusals(("pve1", 129, 30000, (1,)), views, "--tp-size 1")
    []
    """
    _host, vmid, _port, gpus = mine
    view = views.get(int(vmid))
    if view is None or view.problem:
        return []
    fit = fit_problem(view, int(vmid), gpus, needs)
    return [fit] if fit else []


def plan_map_refusals(connector: PctConnector | None, run_key: int, mine: ServerClaim, servers: Sequence[ServerClaim],
                      flags: Mapping[str, Any], say: Callable[[str], None]) -> list[str]:
    """The plan's check of this desired server against its Proxmox node's own view (issue 36):
    map_refusals, the configs of every container of this Proxmox host with a desired server read
    once a run (node_views, ``servers``: the inventory's desired servers); ``say`` gets, once a run
    each, what the node could not tell (no pvesh there, a config it could not read). Nothing under another connector than pct's."""
    if connector is None:
        return []
    host_name = mine[0]
    vmids = {int(claim[1]) for claim in servers if claim[0] == host_name} | {int(mine[1])}
    views, problem = node_views(connector, run_key, host_name, vmids)
    for line in [problem] + [view.problem for view in views.values() if view.problem]:
        if line and say_once(run_key, line):
            say(line)
    # the flag that sizes the server, as the operator wrote it (any engine's tensor-parallel flag)
    size = next((f"--{name} {value}" for name, value in flags.items()
                 if re.search(r"(^|-)(tp|tensor-parallel)(-size)?$", str(name))), "the server")
    return map_refusals(mine, views, size)


def mapped_view(connector: PctConnector | None, run_key: int, pve_host: str, vmid: int, vmids: Iterable[int],
                say: Callable[[str], None]) -> dict[str, Any]:
    """What the status shows of a container's map (issue 36): ``mapped_gpus`` (its node's GPU
    indexes) and ``mapped`` (their device nodes), from node_views (one round trip per Proxmox host
    per run; ``vmids``: the run's containers of that host); nothing where the node cannot tell (no
    pvesh there, an unread config: ``say`` gets it, once a run), nor under another connector."""
    if connector is None:
        return {}
    views, problem = node_views(connector, run_key, pve_host, set(vmids) | {int(vmid)})
    view = views.get(int(vmid))
    for line in [problem, view.problem if view is not None else None]:
        if line and say_once(run_key, line):
            say(line)
    if view is None or view.problem:
        return {}
    return {"mapped_gpus": list(view.gpus), "mapped": describe_map(view) if view.gpus else "none"}
