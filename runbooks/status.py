"""The fleet at a glance: one table, one row per container. Read-only.

    pyinfra -y inventory.py runbooks/status.py 2>/dev/null  # only the table (pyinfra logs to stderr)
    pyinfra -y inventory.py runbooks/status.py --limit pve_pve1

Per container: the Proxmox host, the vmid, the server's state and /health, the model, the flags
that differ from the desired ones (host.data.sglang_flags), per-GPU used MiB (NVML v2) and the
processes holding the GPUs (memory held from outside the container is called out). One remote
command per container (SglangObservation: the server probe and the GPU probe together); the
table is printed once, when the last container has answered. See docs/runbooks.md.
"""

from pyinfra import host, state

from gpugate.facts.sglang import SglangObservation
from gpugate.runbooks import fleet_report, render_status, status_row

data = host.data
observation = host.get_fact(SglangObservation, port=data.get("sglang_port", 30000),
                            model_path=data.get("sglang_model_path"),
                            python=data.get("sglang_python", "/usr/bin/python3"))
row = status_row(data.get("pve_host") or host.name, data.get("pct_vmid"), observation,
                 desired_flags=data.get("sglang_flags") or {}, desired_model=data.get("sglang_model_path"),
                 present=data.get("sglang_present", True))
fleet_report(state, "status", render_status).add(host.name, row)
