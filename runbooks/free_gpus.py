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

from gpugate.facts.sglang import observe
from gpugate.operations import gpu
from gpugate.runbooks import free_gpus_refusal, refused

data = host.data
port = data.get("sglang_port", 30000)
max_used_mib = data.get("gpu_max_used_mib", 64)
# observe(): the installed agent, else the agent sent inline; a container this controller never deployed to
# has no agent installed, and without its observation the refusals below would see nothing (issue 19)
observation = observe(host, python=data.get("sglang_python", "/usr/bin/python3"), port=port)
reason = free_gpus_refusal(observation.get("sglang") or {}, observation.get("gpu") or {}, max_used_mib,
                           host.name, port)
if reason:
    refused(name="Free the container's GPUs", reason=reason)
else:
    gpu.idle(
        name="Free the container's GPUs (end its GPU processes)",
        max_used_mib=max_used_mib,
        timeout=data.get("gpu_gate_timeout_s", 120),
        kill=True,
        kill_grace_s=data.get("kill_grace_s", 10),
        audit_log=data.get("audit_log"),
    )
