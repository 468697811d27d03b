"""The desired state of every container in the inventory: its SGLang server, gated on the GPUs.

    pyinfra inventory.py deploy.py --dry          # per container: the flag diff and the steps, nothing touched
    pyinfra -y inventory.py deploy.py             # apply; containers run in parallel
    pyinfra -y inventory.py deploy.py --data rolling=true   # one container at a time (the rest keep serving)

Every setting comes from the inventory's data (fleet.yaml, group_data/all.py, --data): see
docs/architecture.md ("Inventory data") and docs/transition.md.
"""

from pyinfra import host

from gpugate.operations import sglang

data = host.data

sglang.server(
    name=f"SGLang on :{data.get('sglang_port', 30000)}"
         + (" (present)" if data.get("sglang_present", True) else " (absent)"),
    port=data.get("sglang_port", 30000),
    model_path=data.get("sglang_model_path"),
    flags=data.get("sglang_flags") or {},
    env=data.get("sglang_env") or {},
    present=data.get("sglang_present", True),
    supervisor=data.get("sglang_supervisor", "process"),
    max_used_mib=data.get("gpu_max_used_mib", 64),
    gate_timeout=data.get("gpu_gate_timeout_s", 120),
    drain_timeout=data.get("drain_timeout_s", 60),
    kill_grace=data.get("kill_grace_s", 10),
    start_timeout=data.get("start_timeout_s", 2700),
    python=data.get("sglang_python", "/usr/bin/python3"),
    restarted=data.get("sglang_restarted", False),
    lock_wait=data.get("lock_wait_s", 0),
    # A rolling restart: this operation runs host by host instead of on every host at once.
    _serial=bool(data.get("rolling", False)),
)
