"""The desired state of every container in the inventory: its SGLang server, gated on its GPUs.

    pyinfra inventory.py deploy.py --dry          # per container: the diff, the checks and the steps; touches nothing
    pyinfra -y inventory.py deploy.py             # apply; containers run in parallel
    pyinfra -y inventory.py deploy.py --data rolling=true   # one container at a time; stops at the first failure

Every setting comes from the inventory's data (fleet.yaml, group_data/all.py, --data), mapped to
sglang.server's arguments by gpugate.runbooks.server_arguments (the runbooks use the same mapping):
see docs/architecture.md ("Inventory data") and docs/transition.md.
"""

from pyinfra import host

from gpugate.fleet import validated_settings
from gpugate.operations import sglang
from gpugate.runbooks import server_arguments

arguments = server_arguments(host.data)
settings = validated_settings(host.data)  # rolling=no is false, not the true string "no"

sglang.server(
    name=f"SGLang on :{arguments['port']}" + (" (present)" if arguments["present"] else " (absent)"),
    restarted=settings.get("sglang_restarted", False),
    # A rolling restart: this operation runs host by host instead of on every host at once, and
    # stops after max_failures failed containers (the rest are not touched).
    _serial=arguments["rolling"],
    **arguments,
)
