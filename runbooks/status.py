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
is installed), and one per Proxmox host for the GPUs its node passes into each container (pvesh: the
MAPPED GPUS column; a host without pvesh shows none, said once); pyinfra runs this file for all
containers at once. See docs/runbooks.md.
"""

from pyinfra import host, logger, state

from gpugate.connectors.pct import PctConnector
from gpugate.facts.sglang import SglangObservationOnce
from gpugate.proxmox import mapped_view
from gpugate.report.fleet import fleet_report
from gpugate.report.status import publish_status, router_view, status_row, unreachable_row
from gpugate.spec import desired_states


def _unreachable(target, reason):
    return [unreachable_row(target.data.get("pve_host") or target.name, target.data.get("pct_vmid"), reason,
                            desired) for desired in desired_states(target.data)]


def _publish(rows_of_hosts):
    # returns None: FleetReport prints what it is given; publish_status prints (and writes --data prom=PATH)
    publish_status([row for rows in rows_of_hosts for row in rows], output_format=data.get("format", "table"),
                   prom_path=data.get("prom"))
    return None


data = host.data  # this host's: _publish runs later, from a callback, outside the host's context
rows = []
pve_host = data.get("pve_host") or host.name
# the GPUs its Proxmox node passes into this container: one pvesh round trip per Proxmox host per run
mapped = mapped_view(host.connector if isinstance(host.connector, PctConnector) else None, id(state), pve_host,
                     data.get("pct_vmid") or 0,
                     [h.data.get("pct_vmid") for h in state.inventory if (h.data.get("pve_host") or h.name) == pve_host
                      and h.data.get("pct_vmid") is not None], logger.warning)
# the same desired state, built the same way, as deploy.py's: one row per desired server
for desired in desired_states(data):
    # pyinfra runs this file for every host at once; the observe asks what the deploy's asks
    observation = dict(host.get_fact(SglangObservationOnce, python=desired.python, **desired.observe_args()))
    rows.append({**status_row(pve_host, data.get("pct_vmid"), observation, desired, router=router_view(desired)),
                 **mapped})
fleet_report(state, "status", _publish, missing=_unreachable).add(host.name, rows)
if not all(row["ok"] for row in rows):
    # Not as desired: the run's exit status says so (pyinfra exits 1 when a host failed). Nothing
    # else follows from it: the status has no operation to skip.
    state.failed_hosts.add(host)
