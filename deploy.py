"""The desired state of every container in the inventory: its SGLang server, gated on its GPUs.

    pyinfra inventory.py deploy.py --dry          # per container: the diff, the checks and the steps; touches nothing
    pyinfra -y inventory.py deploy.py             # apply; containers run in parallel
    pyinfra -y inventory.py deploy.py --data rolling=true   # one container at a time; stops at the first failure

Every setting comes from the inventory's data (fleet.yaml, group_data/all.py, --data), each a row of
gpugate.settings.SETTINGS; gpugate.spec.desired_state builds the container's desired state from it
once (the runbooks and the status build it the same way): see docs/architecture.md and
docs/transition.md.
"""

from pyinfra import host

from gpugate.operations import sglang
from gpugate.spec import desired_states

for desired in desired_states(host.data):  # one server per container, or fleet.yaml's sglang: list
    sglang.server(
        name=f"{desired.label} on :{desired.port}" + (" (present)" if desired.present else " (absent)"),
        desired=desired,
        # A rolling restart: this operation runs host by host instead of on every host at once, and
        # stops after max_failures failed containers (the rest are not touched).
        _serial=desired.rolling,
    )
