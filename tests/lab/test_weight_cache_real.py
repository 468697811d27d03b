"""The stand-in's weight cache in real mode (torch), when a Python with torch is at hand: the env of
``$GPUGATE_TORCH_ENV``, else ``.venv-gpu`` in the checkout, else the GPU machine's ``/opt/torch/.venv``
(as tests/gpu/test_real_lab.py finds one); skipped otherwise.

- CPU torch: a cold engine reads ``$SGLANG_STANDIN_WEIGHTS_FILE`` into its memory, the daemon refuses a
  CPU platform with SGLang's words, a client without a daemon falls back to the disk load.
- CUDA: the daemon child reads the file into device memory and exports it as a CUDA IPC handle; a
  client engine maps it (same checksum, ``weights: ipc``, no copy), a cold engine reads it again; the
  daemon SIGKILLed takes the client engine down. The figures (bytes, read and map seconds, the
  processes' memory as nvidia-smi reports it) go to ``$GPUGATE_WC_RESULTS`` (a JSON file) when set.

    GPUGATE_TORCH_ENV=/path/to/venv python -m pytest -q tests/lab/test_weight_cache_real.py -s
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import pytest
from gpusim_helpers import free_port, http_status, installed, model_dir, wait_until  # noqa: F401

from gpugate_lab import container_files

REPO_ROOT = Path(__file__).resolve().parents[2]
WEIGHTS_BYTES = 96 * 1024 * 1024 + 12345  # an odd size: the TP slices and the last chunk are short


def torch_python() -> Optional[str]:
    for env in (os.environ.get("GPUGATE_TORCH_ENV"), str(REPO_ROOT / ".venv-gpu"), "/opt/torch/.venv"):
        if env and (Path(env) / "bin" / "python3").exists():
            return str(Path(env) / "bin" / "python3")
    return None


@pytest.fixture(scope="module")
def torch_env():
    python = torch_python()
    if python is None:
        pytest.skip("no Python with torch ($GPUGATE_TORCH_ENV, .venv-gpu, /opt/torch/.venv)")
    probe = subprocess.run([python, "-c", "import torch; print(int(torch.cuda.is_available()))"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"{python} cannot import torch: {probe.stderr[-300:]}")
    return python, probe.stdout.strip().endswith("1")


@pytest.fixture
def real(torch_env, installed, tmp_path):
    python, cuda = torch_env
    directory = Path(tempfile.mkdtemp(prefix="wcr", dir="/tmp"))
    weights = tmp_path / "weights.bin"
    with open(weights, "wb") as f:
        f.write(os.urandom(WEIGHTS_BYTES))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SGLANG", "GPUGATE_SIM"))}
    env.update({"PYTHONPATH": str(container_files.dist_packages(installed)), "PYTHONUNBUFFERED": "1",
                "SGLANG_STANDIN_GPU": "real" if cuda else "cpu", "SGLANG_STANDIN_WEIGHTS_FILE": str(weights),
                "SGLANG_STANDIN_CPU_TOTAL_MIB": "1024", "GPUGATE_SIM_DIR": str(tmp_path / "no-sim"),
                "GPUGATE_LAB_CTL": str(tmp_path / "labctl"),
                "SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE": str(directory / "wc_{device_uuid}.sock"),
                "SGLANG_WEIGHT_CACHE_READY_TEMPLATE": str(directory / "wc_{device_uuid}.ready")})
    procs: List[subprocess.Popen] = []

    def start(module: str, *flags: str, name: str) -> tuple:
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([python, "-m", module, *flags], env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        return proc, log

    yield {"start": start, "cuda": cuda, "dir": directory, "env": env, "python": python}
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait(timeout=30)
    shutil.rmtree(directory, ignore_errors=True)


def weight_sets(log: Path) -> list:
    return [json.loads(m) for m in re.findall(r"Weight set: (\{.*\})", log.read_text(errors="replace"))]


def compute_apps() -> list:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60)
    return [line.split(", ") for line in out.stdout.splitlines() if line.strip()]


def test_real_mode_weight_sets(real, model_dir):
    start, results = real["start"], {"cuda": real["cuda"], "bytes": WEIGHTS_BYTES}
    common = ("--model-path", str(model_dir), "--mem-fraction-static", "0.3")
    if not real["cuda"]:
        port = free_port()
        engine, log = start("sglang.launch_server", *common, "--port", str(port), "--weight-cache-mode", "client",
                            name="cpu-client")
        wait_until(lambda: http_status(port) == 200 or engine.poll() is not None, 240, "the CPU engine serving")
        assert "[IpcModelLoader] Daemon socket not found at" in log.read_text()
        (cold,) = weight_sets(log)
        assert (cold["weights"], cold["bytes"]) == ("disk", WEIGHTS_BYTES)
        daemon, dlog = start("sglang.srt.weight_cache.daemon", *common, name="cpu-daemon")
        assert daemon.wait(timeout=240) == 1
        assert "the weight cache daemon requires a CUDA-alike platform (CUDA or ROCm)" in dlog.read_text()
        return

    # CUDA: the daemon loads and exports
    tic = time.monotonic()
    daemon, dlog = start("sglang.srt.weight_cache.daemon", *common, name="daemon")
    wait_until(lambda: list(real["dir"].glob("*.ready")) or daemon.poll() is not None, 300, "the daemon's .ready")
    assert daemon.poll() is None, dlog.read_text()[-3000:]
    results["daemon_ready_s"] = round(time.monotonic() - tic, 2)
    (ready,) = real["dir"].glob("*.ready")
    results["ready_file"] = ready.name
    results["device_uuid"] = ready.name[len("wc_"):-len(".ready")]
    daemon_sum = int(re.search(r"Weights checksum=(\d+)", dlog.read_text()).group(1))
    read = re.search(r"Weights read: (\d+) bytes from \S+ in ([\d.]+) s", dlog.read_text())
    results["daemon_read_s"] = float(read.group(2))
    results["apps_daemon_only"] = compute_apps()

    # a client maps it
    port = free_port()
    tic = time.monotonic()
    client, clog = start("sglang.launch_server", *common, "--port", str(port), "--weight-cache-mode", "client",
                         name="client")
    wait_until(lambda: http_status(port) == 200 or client.poll() is not None, 300, "the client engine serving")
    assert client.poll() is None, clog.read_text()[-3000:]
    results["client_ready_s"] = round(time.monotonic() - tic, 2)
    (mapped,) = weight_sets(clog)
    assert mapped["weights"] == "ipc" and mapped["bytes"] == WEIGHTS_BYTES and mapped["checksum"] == daemon_sum
    results["client"] = mapped
    results["apps_daemon_and_client"] = compute_apps()

    # the daemon gone: the client's watchdog SIGKILLs its scheduler, the engine's tree goes
    child = int(ready.read_text().split("\n")[0][len("pid="):])
    os.kill(child, signal.SIGKILL)
    assert client.wait(timeout=60) == -signal.SIGKILL
    assert "died while this engine holds its weights via CUDA IPC" in clog.read_text()

    # a cold engine reads the file itself
    port = free_port()
    tic = time.monotonic()
    cold_engine, cold_log = start("sglang.launch_server", *common, "--port", str(port), name="cold")
    wait_until(lambda: http_status(port) == 200 or cold_engine.poll() is not None, 300, "the cold engine serving")
    results["cold_ready_s"] = round(time.monotonic() - tic, 2)
    (cold,) = weight_sets(cold_log)
    assert cold["weights"] == "disk" and cold["checksum"] == daemon_sum
    results["cold"] = cold
    print(json.dumps(results, indent=1))
    if os.environ.get("GPUGATE_WC_RESULTS"):
        Path(os.environ["GPUGATE_WC_RESULTS"]).write_text(json.dumps(results, indent=1) + "\n")
