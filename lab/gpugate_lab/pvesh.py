"""The lab's ``pvesh``: Proxmox's API shell, for the lab's containers (runs on a lab host; stdlib only).

Only ``pvesh get`` of the two paths discovery reads, with ``--output-format json|json-pretty``:

- ``/nodes/{node}/lxc``: the container index, one object per container with the fields and types
  of pve-container's ``$PVE::LXC::vmstatus_return_properties`` (src/PVE/LXC.pm ``vmstatus``:
  ``vmid`` an integer, ``type`` "lxc", ``status`` running|stopped, ``name`` the hostname or
  ``CT<vmid>``, ``cpus``, ``maxmem``/``maxswap`` in bytes, ``maxdisk``, ``pid`` while running, ...;
  src/PVE/API2/LXC.pm ``vmlist``), in no particular order (Perl hash order);
- ``/nodes/{node}/lxc/{vmid}/config``: the config's keys (integers as numbers), ``lxc`` as
  ``[[key, value], ...]`` for the raw lines, ``digest`` the SHA1 of the config file
  (src/PVE/API2/LXC/Config.pm ``vm_config``).

Errors as pvesh prints them, exit 255 (a Perl ``die``): a container with no config ("Configuration
file 'nodes/pve1/lxc/999.conf' does not exist", pve-guest-common's load_config), a node that is not
this one (``hostname lookup`` of pve-cluster's remote_node_ip; ``localhost`` is this node), a path
with no handler. JSON is written as pvesh's ``to_json(..., canonical => 1)``: keys sorted.

Example (on a lab host):
    $ pvesh get /nodes/pve1/lxc --output-format json
    [{"cpus":32,"disk":0,...,"name":"ct129","status":"running","type":"lxc","uptime":12,"vmid":129}]
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from gpugate_lab import container

DIE = 255
USAGE = "USAGE: pvesh get <api_path> [OPTIONS] [FORMAT_OPTIONS]\n"
FORMATS = ("json", "json-pretty")
# keys of pve-container's config schema that are integers or booleans (numbers in the API's JSON)
NUMERIC_KEYS = {"cores", "memory", "swap", "onboot", "unprivileged", "cpuunits", "protection", "template",
                "console", "tty", "cpulimit", "debug"}
DISK_BYTES = 536870912000  # the lab's rootfs: size=500G


class Die(Exception):
    """A pvesh error: message on stderr, exit 255."""


def config_json(text: str) -> dict:
    """The API's view of a container config file: plain keys (numbers where the schema types them),
    ``lxc`` pairs for raw lines (when any), ``digest``.

    >>> doc = config_json("hostname: ct129\\ncores: 32\\ndev0: /dev/nvidia0\\nlxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind\\n")
    >>> doc["cores"], doc["dev0"], doc["lxc"], len(doc["digest"])
    (32, '/dev/nvidia0', [['lxc.mount.entry', '/dev/nvidiactl dev/nvidiactl none bind']], 40)
    """
    plain, raw = container.parse_config(text)
    doc: dict = {}
    for key, value in plain.items():
        doc[key] = int(value) if key in NUMERIC_KEYS and value.lstrip("-").isdigit() else value
    if raw:
        doc["lxc"] = [[key, value] for key, value in raw]
    doc["digest"] = hashlib.sha1(text.encode()).hexdigest()
    return doc


def status_json(vmid: int, text: str, pid: int | None, uptime: int = 0) -> dict:
    """One container of ``/nodes/{node}/lxc`` (pve-container's vmstatus for a container of this node).

    >>> sorted(status_json(129, "hostname: ct129\\ncores: 4\\nmemory: 1024\\n", None).items())[:6]
    [('cpu', 0), ('cpus', 4), ('disk', 0), ('diskread', 0), ('diskwrite', 0), ('maxdisk', 536870912000)]
    """
    plain, _ = container.parse_config(text)
    doc = {
        "vmid": vmid, "type": "lxc", "status": "running" if pid else "stopped",
        "name": "".join((plain.get("hostname") or f"CT{vmid}").split()),
        "cpus": int(plain.get("cores") or 0) or os.cpu_count() or 1,
        "maxmem": int(plain.get("memory") or 512) * 1024 * 1024,
        "maxswap": int(plain.get("swap") or 0) * 1024 * 1024,
        "maxdisk": DISK_BYTES, "disk": 0, "mem": 0, "swap": 0, "uptime": uptime, "cpu": 0,
        "netin": 0, "netout": 0, "diskread": 0, "diskwrite": 0,
    }
    if pid:
        doc["pid"] = pid
    if plain.get("tags"):
        doc["tags"] = plain["tags"]
    if plain.get("template") == "1":
        doc["template"] = 1
    if plain.get("lock"):
        doc["lock"] = plain["lock"]
    return doc


def route(path: str, node: str) -> tuple[str, int | None]:
    """``(what, vmid)`` for an API path: ``("lxc", None)``, ``("config", 129)``; Die otherwise.

    >>> route("/nodes/pve1/lxc/129/config", "pve1"), route("nodes/localhost/lxc/", "pve1")
    (('config', 129), ('lxc', None))
    """
    parts = [part for part in path.split("/") if part]
    if len(parts) >= 2 and parts[0] == "nodes" and parts[1] not in (node, "localhost"):
        raise Die(f"hostname lookup '{parts[1]}' failed - failed to get address info for: {parts[1]}: "
                  "Name or service not known")
    if parts[:1] == ["nodes"] and parts[2:3] == ["lxc"]:
        if len(parts) == 3:
            return "lxc", None
        if len(parts) == 5 and parts[4] == "config" and parts[3].isdigit():
            return "config", int(parts[3])
    raise Die(f"No 'get' handler defined for '{'/'.join(parts)}'")


class Pvesh:
    """pvesh bound to one lab host directory ($LAB/hosts/<name>)."""

    def __init__(self, host_dir: str):
        self.host_dir = host_dir
        self.node = os.path.basename(os.path.normpath(host_dir))
        self.cgroup_base = container.host_cgroup_base_inside(host_dir)

    def config_text(self, vmid: int) -> str:
        try:
            with open(os.path.join(self.host_dir, "ct", str(vmid), "config")) as handle:
                return handle.read()
        except OSError:
            raise Die(f"Configuration file 'nodes/{self.node}/lxc/{vmid}.conf' does not exist") from None

    def get(self, path: str) -> object:
        what, vmid = route(path, self.node)
        if what == "config":
            return config_json(self.config_text(vmid))
        from gpugate_lab import pct  # noqa: PLC0415 -- its uptime reading

        listing = []
        for each in container.list_vmids(self.host_dir):
            pid = container.find_init(self.host_dir, each, self.cgroup_base)
            listing.append(status_json(each, self.config_text(each), pid, pct._uptime_of(pid) if pid else 0))
        return listing


def main(argv: list[str], host_dir: str | None = None) -> int:
    """Entry point; host_dir is baked into the lab host's pvesh wrapper."""
    hdir = host_dir or os.environ.get("GPUGATE_LAB_HOST_DIR", ".")
    if not argv or argv[0] != "get":
        sys.stderr.write(("unknown command 'pvesh " + argv[0] + "'\n" if argv else "") + USAGE
                         + "(the lab's pvesh answers `get` only)\n")
        return DIE
    args = argv[1:]
    fmt = "text"
    positionals = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, _, inline = arg.lstrip("-").partition("=")
        if arg.startswith("-") and name == "output-format":
            if not inline and i + 1 >= len(args):
                sys.stderr.write("400 Parameter verification failed.\noutput-format: value is missing\n" + USAGE)
                return DIE
            fmt = inline or args[i + 1]
            i += 1 if inline else 2
            continue
        if arg.startswith("-") and name not in ("noproxy",):
            sys.stderr.write(f"Unknown option: {name}\n400 unable to parse option\n" + USAGE)
            return DIE
        if not arg.startswith("-"):
            positionals.append(arg)
        i += 1
    if len(positionals) != 1:
        sys.stderr.write(("400 too many arguments\n" if positionals else
                          "400 not enough arguments\napi_path: property is missing and it is not optional\n") + USAGE)
        return DIE
    if fmt not in FORMATS:
        sys.stderr.write(f"the lab's pvesh prints --output-format {' or '.join(FORMATS)} (not {fmt})\n")
        return DIE
    try:
        data = Pvesh(hdir).get(positionals[0])
    except Die as exc:
        sys.stderr.write(f"{exc}\n")
        return DIE
    if fmt == "json":
        sys.stdout.write(json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n")
    else:
        sys.stdout.write(json.dumps(data, sort_keys=True, indent=4) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
