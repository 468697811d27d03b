"""Defaults for every container in the inventory (pyinfra global data), taken from the one place
they are defined: gpugate.spec.DEFAULTS.

Precedence (highest first): `--data key=value` > fleet.yaml (container `data:`, then its Proxmox
host's `data:`, then its `sglang:` section) > `group_data/<group>.py` and fleet.yaml `groups:` data >
this file. Example: `pyinfra inventory.py deploy.py --data drain_timeout_s=120`.
"""

from gpugate.spec import DEFAULTS as _D

# --- the server (fleet.yaml's sglang: section sets these per container) ---
sglang_model_path = None            # the model path or Hugging Face repo id (required when present)
sglang_present = _D["present"]      # false: no server on sglang_port (stopped, its GPUs swept)
sglang_supervisor = _D["supervisor"]  # "auto": systemd where PID 1 is systemd, else process; or name one
sglang_port = _D["port"]            # SGLang's own default port
sglang_host = _D["host"]            # --host: the address the server listens on inside the container
sglang_flags = {}                   # SGLang flags (validated: gpugate.sglang_args); see docs/flags.md
sglang_python = _D["python"]        # interpreter in the container that runs `-m sglang.launch_server`
sglang_env = {}                     # environment of the server (file mode 0600; values never printed)

# --- the GPU gate (this server's GPUs only: tp x pp x dp from base-gpu-id, CUDA_VISIBLE_DEVICES) ---
gpu_max_used_mib = _D["max_used_mib"]      # a GPU counts as free at or under this many MiB used (NVML v2)
gpu_gate_timeout_s = _D["gate_timeout_s"]  # how long to wait for the server's GPUs after the stop

# --- the transition (run to its end by the agent in the container) ---
drain_timeout_s = _D["drain_timeout_s"]    # SGLang's SIGTERM drain has no deadline: this is ours, then SIGKILL
kill_grace_s = _D["kill_grace_s"]          # after SIGKILL of the server's tree: wait this long for it to exit
start_timeout_s = _D["start_timeout_s"]    # until healthy and generating (45 min: cold TP8 load, CUDA graphs)
min_free_mib = _D["min_free_mib"]          # free MiB the log and state dirs need, checked before the stop
end_other_gpu_holders = False              # true: the agent may end other processes with memory on these GPUs
rolling = False                            # true: one container at a time (deploy.py); the rest keep serving
max_failures = _D["max_failures"]          # rolling: stop after more failed containers than this

# --- records ---
audit_log = None               # audit file on the control machine; None: $GPUGATE_AUDIT_LOG or ./audit.jsonl
