"""Restart an SGLang server even when nothing changed (a hung server), through the same gate.

    pyinfra inventory.py runbooks/restart.py --limit '@pct/pve1:129' --dry
    pyinfra -y inventory.py runbooks/restart.py --limit '@pct/pve1:129'
    # an experiment: one flag changed for this run only (fleet.yaml is unchanged)
    pyinfra -y inventory.py runbooks/restart.py --limit '@pct/pve1:129' \
        --data 'sglang_flags={"tp": 8, "disable-radix-cache": true}'

sglang.server with the desired state, restarted, from the inventory (as deploy.py): the agent
stops the server (drain, SIGKILL of its tree, sweep), gates its GPUs, starts it, waits until it
generates, verifies it; a failure rolls back to the server that ran. The same spec again adds
nothing to the history of good specs. See docs/runbooks.md.
"""

import dataclasses

from pyinfra import host

from gpugate.operations import sglang
from gpugate.spec import desired_states

for desired in desired_states(host.data):
    desired = dataclasses.replace(desired, restarted=True)
    sglang.server(name=f"Restart {desired.label} on :{desired.port}", desired=desired, _serial=desired.rolling)
