"""The fleet at a glance, to page on: one row per desired server, with a verdict. Read-only.

    pyinfra -y inventory.py runbooks/status.py 2>/dev/null        # only the table (pyinfra logs to stderr)
    pyinfra -y inventory.py runbooks/status.py --limit pve1
    pyinfra -y inventory.py runbooks/status.py --data format=json 2>/dev/null | jq .ok   # ONE JSON document
    pyinfra -y inventory.py runbooks/status.py --data prom=/var/lib/node_exporter/gpugate.prom

Verdicts: serving as desired, stopped as desired (the two that are fine); drifted (which flags),
down but desired, transition running / failed (from the container's journal), GPU memory held with
no holder in the container, unreachable (why: the connection error of the Proxmox host, whose
containers pyinfra would otherwise drop from the run). The exit status is non-zero when any row
is not as desired. Under the table: the newest entries of each container's history.

One remote command per container (the agent's observe; in the same shell the inline agent where none
is installed); pyinfra runs this file for all containers at once. See docs/runbooks.md.
"""

from pyinfra import host, state

from gpugate.agentcmd import argv_hash
from gpugate.runbooks import (desired_spec, fleet_report, publish_status, status_observation, status_row,
                              unreachable_row)


def _unreachable(target, reason):
    data = target.data
    return unreachable_row(data.get("pve_host") or target.name, data.get("pct_vmid"), reason,
                           present=data.get("sglang_present", True), desired_model=data.get("sglang_model_path"),
                           port=data.get("sglang_port", 30000))


def _publish(rows):
    # returns None: FleetReport prints what it is given; publish_status prints (and writes --data prom=PATH)
    publish_status(rows, output_format=data.get("format", "table"), prom_path=data.get("prom"))
    return None


data = host.data
observation = status_observation(host)  # pyinfra runs this file for every host at once
spec = desired_spec(data)  # None: no server desired, or data that make none (the row still shows)
row = status_row(data.get("pve_host") or host.name, data.get("pct_vmid"), observation,
                 desired_flags=data.get("sglang_flags") or {}, desired_model=data.get("sglang_model_path"),
                 present=data.get("sglang_present", True), port=data.get("sglang_port", 30000),
                 max_used_mib=data.get("gpu_max_used_mib", 64), desired_env=data.get("sglang_env") or {},
                 desired_argv_hash=argv_hash(list(spec.argv)) if spec is not None else None)
fleet_report(state, "status", _publish, missing=_unreachable).add(host.name, row)
if not row["ok"]:
    # Not as desired: the run's exit status says so (pyinfra exits 1 when a host failed). Nothing
    # else follows from it: the status has no operation to skip.
    state.failed_hosts.add(host)
