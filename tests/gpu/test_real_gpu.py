"""The GPU fact and the gate on a real NVIDIA GPU, through pyinfra's @local connector.

Skipped unless NVML initialises and torch sees a CUDA device. One command: tests/gpu/run_on_gpu.sh

What it checks and measures (GPU 0):

- idle: GpuState reads ``used_mib`` at or under 64 MiB through NVML v2 (0 on an idle H200);
- held: a torch process holding ``GPUGATE_GPU_HOLD_GIB`` GiB (default 20) reads as held, the process
  listed as a holder;
- the gate's overhead: the gate's in-container wait (gpu.wait_for_idle) is started, the holder is
  killed (SIGKILL and SIGTERM alternately); a thread in this process polls NVML v2 every ~1 ms and
  records the moment the memory is actually back (``freed_at``). Overhead = the gate's passing read
  (``passed_at``, and the controller's ``returned_at``) minus ``freed_at``; the GPU's own release
  time = ``freed_at`` minus the kill. Median over ``GPUGATE_GPU_REPEATS`` runs (default 10).

Figures are printed as JSON and written to ``$GPUGATE_GPU_RESULTS`` when set.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.gpu

MIB = 1024 * 1024
MAX_USED_MIB = 64
HOLD_GIB = float(os.environ.get("GPUGATE_GPU_HOLD_GIB", "20"))
REPEATS = int(os.environ.get("GPUGATE_GPU_REPEATS", "10"))
HOLDER = r"""
import sys, torch
data = torch.empty(int(float(sys.argv[1]) * 2**30), dtype=torch.uint8, device="cuda:0")
data.fill_(1)
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.read()
"""


def _nvml_or_skip():
    try:
        import pynvml

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() < 1:
            pytest.skip("no NVIDIA GPU")
    except Exception as exc:  # noqa: BLE001 - any failure means: not a GPU machine
        pytest.skip(f"NVML unavailable: {exc}")
    return pynvml


@pytest.fixture(scope="module")
def nvml():
    module = _nvml_or_skip()
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("torch is needed to hold real CUDA memory")
    yield module
    module.nvmlShutdown()


@pytest.fixture(scope="module")
def baseline_holders(local_host):
    """GPU processes already running before the test (e.g. a monitoring agent): not ours to wait
    for; the gate ignores their pids here."""
    from gpugate.facts.gpu import GpuState

    holders = local_host.get_fact(GpuState)["holders"]
    if holders:
        print("pre-existing GPU processes (ignored):",
              [(h["pid"], h["cmdline"][:60]) for h in holders])
    return tuple(h["pid"] for h in holders)


@pytest.fixture(scope="module")
def local_host(nvml):
    from pyinfra.api import Config, Inventory, State

    inventory = Inventory((["@local"], {}))
    State(inventory, Config())
    host = inventory.get_host("@local")
    host.connect(raise_exceptions=True)
    yield host
    host.disconnect()


def used_mib(nvml, index: int = 0) -> int:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    return nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2).used // MIB


def start_holder(gib: float) -> subprocess.Popen:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(gib)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    line = holder.stdout.readline()
    assert line.strip() == "ready", "the torch holder did not start"
    return holder


class ReleaseWatcher(threading.Thread):
    """Polls NVML v2 about every millisecond; after ``arm()``, records when GPU 0 is back at or
    under the threshold."""

    def __init__(self, nvml, index: int = 0):
        super().__init__(daemon=True)
        self.nvml, self.index = nvml, index
        self.armed = threading.Event()
        self.freed_at: float | None = None

    def run(self):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.armed.is_set() and used_mib(self.nvml, self.index) <= MAX_USED_MIB:
                self.freed_at = time.time()
                return
            time.sleep(0.001)


def test_idle_gpu_reads_zero_and_held_reads_what_is_held(nvml, local_host, baseline_holders):
    from gpugate.facts.gpu import GpuState

    idle = local_host.get_fact(GpuState)
    assert idle["source"] in ("nvml", "nvidia-smi") and idle["memory_api"] == "v2", idle["errors"]
    assert idle["gpus"][0]["used_mib"] <= MAX_USED_MIB
    holder = start_holder(HOLD_GIB)
    try:
        held = local_host.get_fact(GpuState)
    finally:
        holder.kill()
        holder.wait()
    assert held["gpus"][0]["used_mib"] >= HOLD_GIB * 1024
    assert holder.pid in [h["pid"] for h in held["holders"]]
    print(json.dumps({"idle_used_mib": [g["used_mib"] for g in idle["gpus"]],
                      "idle_reserved_mib": [g["reserved_mib"] for g in idle["gpus"]],
                      "held_used_mib_gpu0": held["gpus"][0]["used_mib"], "source": idle["source"],
                      "driver": idle["driver"]}))


def measure_once(nvml, host, signum: int, ignore_pids=()) -> dict:
    from gpugate.operations.gpu import wait_for_idle

    holder = start_holder(HOLD_GIB)
    watcher = ReleaseWatcher(nvml)
    watcher.start()
    killed = {}

    def kill_later():
        # The wait is running and polling by then; a random moment, so that no poll phase lines up
        # with the kill run after run.
        time.sleep(random.uniform(0.5, 1.5))
        killed["at"] = time.time()
        watcher.armed.set()
        holder.send_signal(signum)
        holder.wait()

    killer = threading.Thread(target=kill_later, daemon=True)
    killer.start()
    decision = wait_for_idle(host, max_used_mib=MAX_USED_MIB, timeout=60, poll_interval_s=0.05,
                             ignore_pids=ignore_pids)
    killer.join(30)
    watcher.join(30)
    timing = decision.timing or {}
    freed_at = watcher.freed_at
    return {
        "signal": signal.Signals(signum).name,
        "passed": decision.passed,
        "release_s": None if freed_at is None else freed_at - killed["at"],
        "in_container_overhead_s": None if freed_at is None or not timing.get("passed_at")
        else timing["passed_at"] - freed_at,
        "controller_overhead_s": None if freed_at is None else timing["returned_at"] - freed_at,
        "polls": timing.get("polls"),
    }


def summary(values: list) -> dict:
    values = [v * 1000 for v in values if v is not None]
    if not values:
        return {}
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1),
            "max": round(max(values), 1)}


def test_gate_overhead_on_real_cuda_memory(nvml, local_host, baseline_holders):
    samples = [measure_once(nvml, local_host, signal.SIGKILL if run % 2 == 0 else signal.SIGTERM,
                            baseline_holders)
               for run in range(REPEATS)]
    figures = {
        "gpu": nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(0)),
        "driver": nvml.nvmlSystemGetDriverVersion(),
        "hold_gib": HOLD_GIB,
        "repeats": REPEATS,
        "poll_interval_s": 0.05,
        "release_ms": summary([s["release_s"] for s in samples]),
        "in_container_overhead_ms": summary([s["in_container_overhead_s"] for s in samples]),
        "controller_overhead_ms": summary([s["controller_overhead_s"] for s in samples]),
        "polls_median": statistics.median(s["polls"] or 0 for s in samples),
        "samples": samples,
    }
    print(json.dumps(figures, indent=1))
    if os.environ.get("GPUGATE_GPU_RESULTS"):
        with open(os.environ["GPUGATE_GPU_RESULTS"], "w") as handle:
            json.dump(figures, handle, indent=1)
    assert all(s["passed"] for s in samples)
    # The gate never opens before the memory is back.
    assert all(s["in_container_overhead_s"] is None or s["in_container_overhead_s"] > -0.005
               for s in samples)
