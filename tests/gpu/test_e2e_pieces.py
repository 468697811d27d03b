"""The pieces of tests/gpu/e2e_on_gpu.py that can be checked without a GPU: the NVML poller (against a
stand-in pynvml module that counts down the memory, as a process's exit does), the phase split and the
figures from a journal, and the shell script's syntax. The whole run is rehearsed on the simulated lab
with ``tests/gpu/run_e2e_on_gpu.sh DIR --simulated`` (about a minute)."""

from __future__ import annotations

import doctest
import json
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO_ROOT
from tests.gpu import e2e_on_gpu as e2e

FAKE_PYNVML = """
import time
nvmlMemory_v2 = 33554472
_start = time.time()
class _Mem:
    def __init__(self, used): self.used = used
def nvmlInit(): pass
def nvmlDeviceGetCount(): return 2
def nvmlDeviceGetHandleByIndex(i): return i
def nvmlDeviceGetMemoryInfo(handle, version=None):
    assert version == nvmlMemory_v2, "the poller must ask for v2"
    held = time.time() - _start < 0.3
    return _Mem((90000 << 20) if held and handle == 0 else 0)
"""


def test_doctests():
    assert doctest.testmod(e2e).failed == 0


def test_nvml_poller_writes_v2_readings_when_they_change(tmp_path):
    (tmp_path / "pynvml.py").write_text(FAKE_PYNVML)
    out = tmp_path / "samples.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", e2e.POLLER, str(out), "nvml", "-", "0.002"],
                            env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, stderr=subprocess.PIPE)
    # until the poller has written the freed reading (a fixed 0.8 s ran out before it on a busy machine)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (out.exists() and '"used": [0, 0]' in out.read_text()):
        time.sleep(0.02)
    time.sleep(0.05)  # a few more polls of the freed reading: the last sample is a whole line
    proc.kill()
    assert proc.wait() != 0 and not proc.stderr.read().strip()
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert samples[0]["used"] == [90000, 0] and samples[-1]["used"] == [0, 0]
    freed = e2e.first_free_after(samples, samples[0]["t"])
    assert 0.25 < freed - samples[0]["t"] < 0.35  # the moment the memory came back, to a few ms


def test_figures_from_a_journal_and_samples():
    t0 = 1000.0
    journal = [
        {"step": "stop", "phase": "begin", "t": t0, "target": "desired"},
        {"step": "drain", "phase": "begin", "t": t0 + 0.01, "target": "desired"},
        {"step": "drain", "phase": "end", "t": t0 + 2.0, "target": "desired"},
        {"step": "stop", "phase": "end", "t": t0 + 2.1, "target": "desired"},
        {"step": "gate", "phase": "begin", "t": t0 + 2.1, "target": "desired"},
        {"step": "gate", "phase": "end", "t": t0 + 2.3, "target": "desired"},
        {"step": "load", "phase": "begin", "t": t0 + 2.4, "target": "desired"},
        {"step": "load", "phase": "end", "t": t0 + 12.4, "target": "desired"},
        {"step": "verify", "phase": "begin", "t": t0 + 12.4, "target": "desired"},
        {"step": "verify", "phase": "end", "t": t0 + 12.5, "target": "desired"},
    ]
    samples = [{"t": t0, "used": [120000]}, {"t": t0 + 2.15, "used": [300]}, {"t": t0 + 2.19, "used": [0]}]
    figures = e2e.transition_figures(journal, [], samples, {"wall_s": 14.0, "rc": 0})
    assert figures["source"] == "journal"
    assert figures["phases_s"] == {"drain": 1.99, "stop": 2.1, "gate": 0.2, "load": 10.0, "verify": 0.1}
    assert figures["release_after_exit_s"] == 0.19  # drain end (the server's exit) -> NVML v2 back at 0
    assert figures["gate_overhead_s"] == 0.11  # the gate passed 0.11 s after the memory was back
    assert figures["tool_overhead_beyond_drain_and_load_s"] == 2.01
    assert figures["restart_in_container_s"] == 12.49
    first_start = e2e.transition_figures(journal[4:], [], samples, {"wall_s": 11.0, "rc": 0})
    assert "release_after_exit_s" not in first_start  # nothing was stopped: no release to measure


def test_the_scripts_parse():
    for script in ("run_e2e_on_gpu.sh", "pack_for_gpu.sh"):
        result = subprocess.run(["bash", "-n", str(REPO_ROOT / "tests" / "gpu" / script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    usage = subprocess.run([str(REPO_ROOT / "tests" / "gpu" / "run_e2e_on_gpu.sh")], capture_output=True, text=True)
    assert usage.returncode != 0 and "RESULTS_DIR" in usage.stderr
    assert Path(REPO_ROOT / "tests" / "gpu" / "e2e_on_gpu.py").is_file()
