"""Fixtures and helpers for the simulated-GPU tests (gpusim, nvidia-smi, pynvml, stand-in, faults).

No namespaces needed: the simulated driver lives in a temp lab layout
(``LAB/hosts/pve1/gpu`` and ``LAB/hosts/pve1/ct/129/labctl``) reached through $GPUGATE_SIM_DIR and
$GPUGATE_LAB_CTL, with a real driver daemon process; the container files are installed into a temp
/usr tree and run with the system's /usr/bin/python3, as inside a lab container.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

import pytest

from gpugate_lab import container_files, gpusim
from tests.conftest import poll

SYSTEM_PYTHON = "/usr/bin/python3"
GPU_COUNT = 4
TOTAL_MIB = 10000
RESERVED_MIB = 615
HOST = "pve1"
VMID = 129


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, what: str = "condition"):
    """Poll until predicate() is truthy; return its value. Fails the test after timeout_s."""
    value = poll(predicate, timeout_s, first_s=0.02)
    if not value:
        pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
    return value


@dataclass
class Sim:
    lab_dir: Path
    gpu_dir: Path
    ctl_dir: Path
    driver: subprocess.Popen

    def used(self, gpu: int) -> int:
        return gpusim.memory_info(gpu, self.gpu_dir).used_mib

    def all_used(self) -> List[int]:
        return [self.used(g) for g in range(GPU_COUNT)]

    def set_faults(self, faults: dict) -> None:
        (self.ctl_dir / "faults.json").write_text(json.dumps(faults))


@pytest.fixture
def sim(tmp_path, monkeypatch) -> Sim:
    """A simulated host driver (4 GPUs x 10000 MiB, 615 reserved, release after 0.05 s) with its daemon."""
    lab = tmp_path / "lab"
    gpu_dir = lab / "hosts" / HOST / "gpu"
    ctl_dir = lab / "hosts" / HOST / "ct" / str(VMID) / "labctl"
    ctl_dir.mkdir(parents=True)
    gpusim.setup_host(gpu_dir, count=GPU_COUNT, total_mib=TOTAL_MIB, reserved_mib=RESERVED_MIB,
                      release_delay_s=0.05)
    monkeypatch.setenv("GPUGATE_SIM_DIR", str(gpu_dir))
    monkeypatch.setenv("GPUGATE_LAB_CTL", str(ctl_dir))
    driver = subprocess.Popen([sys.executable, "-m", "gpugate_lab.gpusim", "driver", str(gpu_dir)])
    yield Sim(lab, gpu_dir, ctl_dir, driver)
    driver.terminate()
    driver.wait(timeout=5)


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> Path:
    """The container extras installed into a temp /usr tree (returns the /usr root)."""
    usr = tmp_path_factory.mktemp("usr-upper")
    container_files.install_container_extras(usr)
    return usr


def container_env(sim: Sim, usr: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SGLANG"))}
    env.update({"PYTHONPATH": str(container_files.dist_packages(usr)), "GPUGATE_SIM_DIR": str(sim.gpu_dir),
                "GPUGATE_LAB_CTL": str(sim.ctl_dir), "SGLANG_STANDIN_LOAD_S": "0.1"})
    env.update(extra)
    return env


def hold(sim: Sim, gpu: str = "0", mib: int = 1000, prefix: Optional[List[str]] = None) -> subprocess.Popen:
    """Start a process that holds memory (gpusim hold) and wait until it does."""
    proc = subprocess.Popen((prefix or []) + [sys.executable, "-m", "gpugate_lab.gpusim", "hold", "--gpu", gpu,
                                              "--mib", str(mib), "--sim-dir", str(sim.gpu_dir)],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    line = proc.stdout.readline().decode()
    assert line.startswith("holding"), line
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(port: int, path: str = "/health", timeout: float = 5.0):
    """The HTTP status code, or 'refused' when nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (ConnectionRefusedError, urllib.error.URLError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ConnectionRefusedError) or isinstance(exc, ConnectionRefusedError):
            return "refused"
        raise


def http_json(port: int, path: str, body: Optional[dict] = None, timeout: float = 30.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@dataclass
class Standin:
    proc: subprocess.Popen
    port: int
    log_path: Path
    children: List[int] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str, timeout_s: float = 15.0) -> str:
        return wait_until(lambda: re.search(pattern, self.log()), timeout_s, f"log line {pattern!r}").group(0)

    def wait_healthy(self, timeout_s: float = 15.0) -> None:
        wait_until(lambda: self.proc.poll() is None and http_status(self.port) == 200, timeout_s, "/health 200")

    def child_pids(self) -> List[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def cmdline(pid: int) -> List[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return []


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "models" / "lab-model"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                               "max_position_embeddings": 32768}))
    return d


@pytest.fixture
def start_standin(sim, installed, tmp_path):
    """start_standin(*flags, env={...}) -> Standin running /usr/bin/python3 -m sglang.launch_server."""
    started: List[Standin] = []

    def start(*flags: str, env: Optional[dict] = None, port: Optional[int] = None) -> Standin:
        port = port or free_port()
        log_path = tmp_path / f"standin-{len(started)}.log"
        argv = [SYSTEM_PYTHON, "-m", "sglang.launch_server", "--port", str(port), *flags]
        with open(log_path, "wb") as log:
            # cwd away from the repo: the container copies must work on their own
            proc = subprocess.Popen(argv, cwd=tmp_path, env=container_env(sim, installed, **(env or {})),
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        s = Standin(proc, port, log_path)
        started.append(s)
        return s

    yield start
    for s in started:
        kids = s.child_pids() if s.proc.poll() is None else []
        s.kill()
        for pid in kids + s.children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
