"""The fleet as a pyinfra inventory: `pyinfra inventory.py deploy.py`.

Reads, in order: `$GPUGATE_FLEET`; else `./fleet.yaml`; else the local lab's fleet file
(`$GPUGATE_LAB_DIR/fleet.yaml`, default /tmp/gpugate-lab/fleet.yaml, written by `gpugate lab up`).

Groups (pyinfra makes a group of every top-level list/tuple here):
- `pve_<host>`: the containers of one Proxmox host, e.g. `pyinfra inventory.py deploy.py --limit pve_pve1`
- every group named in fleet.yaml (`groups: [canary]` on a container), with its `groups:` data
Hosts are `@pct/<pve-host>:<vmid>` (or `@pct/@local:<vmid>`), with the data that
gpugate.fleet.container_host_data documents.
"""

import os as _os
import sys as _sys
from pathlib import Path as _Path

from gpugate.fleet import FleetError as _FleetError
from gpugate.fleet import fleet_to_inventory as _fleet_to_inventory
from gpugate.fleet import load_fleet as _load_fleet


def _fleet_path() -> tuple[_Path, str]:
    """The fleet file and why that one (what the run prints first, so that nobody edits one fleet
    file and deploys another)."""
    explicit = _os.environ.get("GPUGATE_FLEET")
    if explicit:
        return _Path(explicit), "$GPUGATE_FLEET"
    local = _Path("fleet.yaml")
    if local.exists():
        return local.resolve(), "./fleet.yaml"
    lab_env = _os.environ.get("GPUGATE_LAB_DIR")
    lab = _Path(lab_env or "/tmp/gpugate-lab") / "fleet.yaml"
    if lab.exists():
        return lab, "the lab's, $GPUGATE_LAB_DIR" if lab_env else "the default lab's: no ./fleet.yaml, no $GPUGATE_FLEET"
    _sys.stderr.write(
        "gpugate: no fleet file. Write ./fleet.yaml (see docs/flags.md), set GPUGATE_FLEET=PATH, "
        f"or start the local lab with `gpugate lab up` (it writes {lab}).\n")
    raise SystemExit(2)


def _groups() -> dict:
    path, why = _fleet_path()
    # Once, first, on stderr: `--data format=json` keeps stdout one JSON document.
    _sys.stderr.write(f"gpugate: fleet {path} ({why})\n")
    try:
        return _fleet_to_inventory(_load_fleet(path))
    except _FleetError as error:
        # One clear line instead of a traceback through pyinfra's inventory loader.
        _sys.stderr.write(f"gpugate: invalid fleet file: {error}\n")
        raise SystemExit(2) from None


def _watch_connections() -> None:
    # pyinfra drops a host that fails to connect before any deploy file runs; the runbooks still
    # report it (with why), from what this recorder hears while pyinfra connects.
    from pyinfra import state as _state
    from pyinfra.context import ctx_state as _ctx_state

    from gpugate.report.fleet import watch_connections as _watch
    from gpugate.report.status import status_when_unreachable as _status_rows

    def _is_status(arg: str) -> bool:
        return _os.path.basename(arg) == "status.py" and _os.path.basename(
            _os.path.dirname(_os.path.abspath(arg))) == "runbooks"

    if _ctx_state.isset():
        _watch(_state, _status_rows if any(_is_status(arg) for arg in _sys.argv) else None)


def _deploy_checks_containers() -> bool:
    """Whether this run is of deploy.py (beside this file) alone: its sglang.server observes every
    container first and reports a stopped or missing one with connect's own message, so connect's
    check (one `pct list` per Proxmox host) is left to that observe (pct_connect_check false; a
    `--data pct_connect_check=true` keeps it). Runbooks, `exec` and any other deploy file keep it."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    files = [_os.path.abspath(arg) for arg in _sys.argv[1:] if arg.endswith(".py")]
    return files == [_os.path.join(here, "inventory.py"), _os.path.join(here, "deploy.py")]


def _with_connect_check_left_to_the_deploy(groups: dict) -> dict:
    if _deploy_checks_containers():
        for hosts, _data in groups.values():
            for entry in hosts:  # (name, data) where a container's data is; other groups name it only
                if isinstance(entry, tuple):
                    entry[1].setdefault("pct_connect_check", False)
    return groups


globals().update(_with_connect_check_left_to_the_deploy(_groups()))
_watch_connections()
