"""Bring a container's GPUs to idle by ending the GPU processes INSIDE that container.

    pyinfra inventory.py runbooks/free_gpus.py --limit pve_pve1 --dry   # what it would end
    pyinfra -y inventory.py runbooks/free_gpus.py --limit '@pct/pve1:129'

Ends (SIGTERM, kill_grace_s, SIGKILL) every process of the container that holds /dev/nvidia*,
then waits until every GPU is at or under gpu_max_used_mib (gpu.idle(kill=True)). It never
reaches outside the container (the kill runs in the container's PID namespace), and it refuses,
touching nothing, when
- the managed SGLang server runs (stop or restart it through sglang.server instead), or
- memory is held from outside the container (find the owner with runbooks/who_holds_gpus.py).
See docs/runbooks.md.
"""

from pyinfra import host

from gpugate.facts.sglang import SglangObservationOnce
from gpugate.operations import gpu
from gpugate.report.holders import free_gpus_refusal
from gpugate.spec import desired_state, desired_states

desired = desired_state(host.data)  # the container's gate settings
reason = None
for server in desired_states(host.data):  # every server of the container: none of them may run
    # the installed agent, else the agent sent inline, in one command: a container this controller never
    # deployed to has no agent installed, and without its observation the refusals below would see nothing
    observation = host.get_fact(SglangObservationOnce, port=server.port, python=server.python)
    reason = reason or free_gpus_refusal(observation.get("sglang") or {}, observation.get("gpu") or {},
                                         server.max_used_mib, host.name, server.port)
if reason:
    gpu.refused(name="Free the container's GPUs", reason=reason)
else:
    gpu.idle(
        name="Free the container's GPUs (end its GPU processes)",
        max_used_mib=desired.max_used_mib,
        timeout=desired.budgets["gate_timeout_s"],
        kill=True,
        kill_grace_s=desired.budgets["kill_grace_s"],
        audit_log=desired.audit_log,
    )
