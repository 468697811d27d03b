"""On each Proxmox host of the inventory: every GPU process, with the container it runs in.

    pyinfra -y inventory.py runbooks/who_holds_gpus.py 2>/dev/null          # every Proxmox host
    pyinfra -y inventory.py runbooks/who_holds_gpus.py --limit pve_pve1
    pyinfra -y pve1.example.org runbooks/who_holds_gpus.py                   # a Proxmox host by SSH

Read-only. For @pct containers the reading is taken on their Proxmox host (through the pct
connector's own connection to it, with sudo when pct needs it), once per Proxmox host; for a
plain @ssh/@local host it is taken on that host. The fact is HostGpuProcesses: host pid, vmid
(from /proc/PID/cgroup), GPUs, MiB, state, command. One table for the run, printed at the end.
See docs/runbooks.md.
"""

from pyinfra import host, state
from pyinfra.api import StringCommand

from gpugate.connectors.pct import PctConnector
from gpugate.facts.gpu import HostGpuProcesses
from gpugate.report.fleet import fleet_report
from gpugate.report.holders import render_holders
from gpugate.report.text import natural_key
from gpugate.spec import desired_state


def pve_host_of(target) -> str:
    if isinstance(target.connector, PctConnector):
        return target.data.get("pve_host") or target.connector.pve_host_name
    return target.name


pve_host = pve_host_of(host)
max_used_mib = desired_state(host.data).max_used_mib  # the gate's threshold: under it, driver overhead
if isinstance(host.connector, PctConnector):
    # One reading per Proxmox host: taken by the first of its containers in this run.
    siblings = sorted((h.name for h in state.inventory.get_active_hosts() if pve_host_of(h) == pve_host),
                      key=natural_key)
    if siblings[0] == host.name:
        fact = HostGpuProcesses()
        _ok, output = host.connector.run_on_proxmox_host(StringCommand(fact.command()))
        fleet_report(state, "who_holds_gpus", render_holders).add(
            pve_host, (pve_host, fact.process(output.stdout_lines), max_used_mib))
else:
    fleet_report(state, "who_holds_gpus", render_holders).add(
        pve_host, (pve_host, host.get_fact(HostGpuProcesses), max_used_mib))
