"""Gate latency on a real GPU, gpugate beside the ways people check by hand (issue 8, section 5).

Runs on a machine with an NVIDIA GPU and torch (the lent H200), from the repository root:

    tests/gpu/run_on_gpu.sh .whl            # installs pyinfra & co. offline first, if missing
    python3 bench/h200_gate.py --trials 8   # then this; JSON figures on stdout and in $OUT

Each trial: a torch process holds ``--gib`` GiB on GPU 0; the waiter starts; the holder is SIGKILLed
at a random moment 0.5-1.5 s later (random, so that no poll phase lines up with the kill); a thread
polling NVML v2 about every millisecond records ``freed_at``, the moment the memory is back. Latency =
the moment the waiter knows the GPU is free minus ``freed_at``. Waiters:

- gpugate: ``gpugate.operations.gpu.wait_for_idle`` through pyinfra's ``@local`` (one command that
  polls NVML v2 every 50 ms);
- hand-run: the check an operator types, ``sleep 3; nvidia-smi`` until it reads free;
- 1 s loop: a shell ``until`` loop with a 1 s delay, what an Ansible ``until:`` with ``delay: 1``
  polls at, without Ansible's own cost per try (so a lower bound for it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
_spec = importlib.util.spec_from_file_location("real_gpu", REPO / "tests" / "gpu" / "test_real_gpu.py")
real_gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(real_gpu)

SHELL_WAITERS = {
    "hand-run `sleep 3; nvidia-smi`": 3,
    "shell loop, 1 s delay": 1,
}


def shell_waiter(delay_s: int, max_used_mib: int) -> subprocess.Popen:
    script = (
        f"while :; do sleep {delay_s}; "
        "u=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0); "
        f'[ "$u" -le {max_used_mib} ] && break; done; date +%s.%N'
    )
    return subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, text=True)


def trial(nvml, host, method: str, gib: float) -> dict:
    from gpugate.operations.gpu import wait_for_idle

    holder = real_gpu.start_holder(gib)
    watcher = real_gpu.ReleaseWatcher(nvml)
    watcher.start()
    offset = random.uniform(0.5, 1.5)
    killed: dict[str, float] = {}

    def kill_later():
        time.sleep(offset)
        killed["at"] = time.time()
        watcher.armed.set()
        holder.kill()
        holder.wait()

    killer = threading.Thread(target=kill_later, daemon=True)
    if method == "gpugate":
        killer.start()
        decision = wait_for_idle(host, max_used_mib=real_gpu.MAX_USED_MIB, timeout=60, poll_interval_s=0.05)
        known_at = decision.timing["returned_at"] if decision.passed else None
    else:
        waiter = shell_waiter(SHELL_WAITERS[method], real_gpu.MAX_USED_MIB)
        killer.start()
        out, _ = waiter.communicate(timeout=60)
        known_at = float(out.strip())
    killer.join(30)
    watcher.join(30)
    freed_at = watcher.freed_at
    return {
        "method": method,
        "kill_offset_s": round(offset, 3),
        "release_ms": None if freed_at is None else round((freed_at - killed["at"]) * 1000, 1),
        "latency_ms": None if freed_at is None or known_at is None else round((known_at - freed_at) * 1000, 1),
    }


def summarize(values: list[float]) -> dict:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {}
    p90 = values[min(len(values) - 1, int(round(0.9 * (len(values) - 1))))]
    return {"n": len(values), "median": round(statistics.median(values), 1), "p90": p90,
            "min": values[0], "max": values[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8, help="trials per method")
    parser.add_argument("--gib", type=float, default=20.0, help="GiB the holder takes on GPU 0")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    random.seed(args.seed)

    import pynvml
    from pyinfra.api import Config, Inventory, State

    pynvml.nvmlInit()
    inventory = Inventory((["@local"], {}))
    State(inventory, Config())
    host = inventory.get_host("@local")
    host.connect(raise_exceptions=True)

    methods = ["gpugate", *SHELL_WAITERS]
    plan = [m for _ in range(args.trials) for m in random.sample(methods, len(methods))]
    samples = [trial(pynvml, host, method, args.gib) for method in plan]
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    result = {
        "gpu": pynvml.nvmlDeviceGetName(handle),
        "driver": pynvml.nvmlSystemGetDriverVersion(),
        "hold_gib": args.gib,
        "latency_ms": {m: summarize([s["latency_ms"] for s in samples if s["method"] == m]) for m in methods},
        "release_ms": summarize([s["release_ms"] for s in samples]),
        "samples": samples,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "h200_bench.json").write_text(text)
    host.disconnect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
