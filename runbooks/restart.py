"""Restart an SGLang server even when nothing changed (a hung server), through the same gate.

    pyinfra inventory.py runbooks/restart.py --limit '@pct/pve1:129' --dry
    pyinfra -y inventory.py runbooks/restart.py --limit '@pct/pve1:129'
    # an experiment: one flag changed for this run only (fleet.yaml is unchanged)
    pyinfra -y inventory.py runbooks/restart.py --limit '@pct/pve1:129' \
        --data 'sglang_flags={"tp": 8, "disable-radix-cache": true}'

sglang.server(restarted=True) with the desired state from the inventory (as deploy.py): lock,
record the running spec as "previous", drain/kill/sweep, gate on every GPU, start, wait healthy,
verify, unlock; a start that fails rolls back to the previous flags. See docs/runbooks.md.
"""

from pyinfra import host

from gpugate.operations import sglang
from gpugate.runbooks import server_arguments

arguments = server_arguments(host.data)
sglang.server(
    name=f"Restart SGLang on :{arguments['port']}",
    restarted=True,
    **arguments,
)
