"""Return an SGLang server to the flags it ran with before the last change.

    pyinfra inventory.py runbooks/rollback.py --limit '@pct/pve1:129' --dry   # the diff back
    pyinfra -y inventory.py runbooks/rollback.py --limit '@pct/pve1:129'

sglang.server(restore_previous=True): the server recorded as "previous" in the container
(/var/lib/gpugate/sglang-<port>.json, redacted) is started again from its exact argv and env file,
which sglang.server keeps in 0600 files in the container before every stop; no secret crosses to
this machine. The same lock, drain, gate, start, health check and verification as a deploy; a
second run is a no-op. The next deploy.py applies fleet.yaml again: change fleet.yaml if the
rollback is meant to stay. See docs/runbooks.md.
"""

from pyinfra import host

from gpugate.operations import sglang
from gpugate.runbooks import server_arguments

arguments = server_arguments(host.data)
sglang.server(
    name=f"Roll back SGLang on :{arguments['port']} to the server before the last change",
    **dict(arguments, present=True, restore_previous=True),
)
