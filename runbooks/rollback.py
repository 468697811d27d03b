"""Return an SGLang server to a spec that served before: the newest good spec in the container's
history that differs from the running one (``--data rollback_to=K``: the K-th newest, 1 = newest).

    pyinfra inventory.py runbooks/rollback.py --limit '@pct/pve1:129' --dry   # the diff back
    pyinfra -y inventory.py runbooks/rollback.py --limit '@pct/pve1:129'
    pyinfra -y inventory.py runbooks/rollback.py --limit '@pct/pve1:129' --data rollback_to=2

The history (/var/lib/gpugate/sglang-<port>.json, 0600 in the container) keeps the last 5 specs that
were verified serving, exact argv and env included; this machine sees them redacted, and the exact
spec never leaves the container. The same stop, gate, start, health check and verification as a
deploy; a failure returns to the server that runs now. The next deploy.py applies fleet.yaml again:
change fleet.yaml if the rollback is meant to stay. See docs/runbooks.md.
"""

from pyinfra import host

from gpugate.operations import sglang
from gpugate.spec import desired_states

for desired in desired_states(host.data):  # every server of the container, each to its own history
    sglang.server(name=f"Roll back {desired.label} on :{desired.port} to a good spec from its history", desired=desired,
                  restore_previous=True)
