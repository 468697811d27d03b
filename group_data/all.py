"""Defaults for every container in the inventory (pyinfra global data).

Precedence (highest first): `--data key=value` > fleet.yaml (container `data:`, then its Proxmox
host's `data:`, then its `sglang:` section) > `group_data/<group>.py` and fleet.yaml `groups:` data >
this file. Example: `pyinfra inventory.py deploy.py --data drain_timeout_s=120`.
"""

# --- the server (fleet.yaml's sglang: section sets these per container) ---
sglang_model_path = None       # the model path or Hugging Face repo id (required when present)
sglang_present = True          # false: no server on sglang_port (stopped, GPUs gated free)
sglang_supervisor = "process"  # "process" (own process group, pid file, log) or "systemd" (unit)
sglang_port = 30000            # SGLang's own default port
sglang_host = "127.0.0.1"      # --host: the address the server listens on inside the container
sglang_flags = {}              # SGLang flags (validated: gpugate.sglang_args); see docs/flags.md
sglang_python = "/usr/bin/python3"  # interpreter in the container that runs `-m sglang.launch_server`
sglang_env = {}                # environment of the server (file mode 0600; values never printed)

# --- the GPU gate ---
gpu_max_used_mib = 64          # a GPU counts as free at or under this many MiB used (NVML v2)
gpu_gate_timeout_s = 120       # how long to wait for every GPU to be free after the stop

# --- the transition ---
drain_timeout_s = 60           # SGLang's SIGTERM drain has no deadline: this is ours, then SIGKILL
kill_grace_s = 10              # after SIGKILL of the process group: wait this long for the tree to exit
start_timeout_s = 2700         # until healthy (45 min: cold TP8 load and CUDA graph capture)
health_poll_s = 2              # interval of /health polls while the server loads
lock_wait_s = 0                # a second operator on the same server: wait this long for the lock, then fail
rolling = False                # True: restart one container at a time (deploy.py); the rest keep serving

# --- records ---
audit_log = None               # audit file on the control machine; None: $GPUGATE_AUDIT_LOG or ./audit.jsonl
