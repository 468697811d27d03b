"""The benchmark's own lab and the files each tool reads (fleet files, Ansible inventories).

Setup and teardown reach containers without SSH (``nsenter`` into the lab host, then the lab's ``pct``),
so nothing the bench does for itself is counted against either tool.

Example:
    >>> lab = BenchLab.up(Path("/tmp/gpugate-bench-lab"), hosts=2, vmids=(129, 130))   # doctest: +SKIP
    >>> lab.in_ct("pve1", 129, "hostname").stdout                                        # doctest: +SKIP
    'ct129\\n'
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import yaml

from gpugate_lab import core
from gpugate.engine.sglang.flags import render_argv

MODEL_PATH = "/opt/models/lab-model"
PORT = 30000
PYTHON = "/usr/bin/python3"

# Ends every SGLang stand-in and memory holder in a container (bench setup only, never measured).
RESET_SCRIPT = ("pkill -9 -f '[s]glang.launch_server' ; pkill -9 -f '[s]glang::' ; "
                "pkill -9 -f '[g]pugate_gpusim hold' ; rm -f /run/gpugate/*.lock ; true")


@dataclass(frozen=True)
class Container:
    host: str
    vmid: int
    port: int  # the lab host's SSH port

    @property
    def pyinfra_name(self) -> str:
        return f"@pct/{self.host}:{self.vmid}"

    @property
    def ansible_name(self) -> str:
        return f"{self.host}-{self.vmid}"


def server_argv(flags: dict) -> str:
    """The command line gpugate starts for ``flags`` (so Ansible starts, and compares, the same one)."""
    return " ".join([PYTHON, *render_argv(MODEL_PATH, PORT, flags)])


@dataclass
class BenchLab:
    dir: Path
    state: dict

    @classmethod
    def up(cls, lab_dir: Path, hosts: int, vmids: tuple[int, ...], gpus: int = 8) -> "BenchLab":
        # Only a lab this run made: a directory that holds hosts is someone's lab, never stopped here.
        if core.existing_hosts(lab_dir):
            raise core.LabError(f"{lab_dir} already holds a lab ({', '.join(core.existing_hosts(lab_dir))}); "
                                "the benchmark builds its own in a new directory")
        state = core.up(lab_dir, hosts=hosts, gpus=gpus, vmids=vmids)
        for host in state["hosts"]:
            if not host["running"] or any(c["status"] == "stopped" for c in host["containers"]):
                raise core.LabError(f"lab host {host['name']} did not come up: {host}")
        return cls(Path(state["dir"]), state)

    def down(self) -> None:
        core.down(self.dir)

    # ------------------------------------------------------------------ the fleet

    def containers(self) -> list[Container]:
        return [Container(h["name"], c["vmid"], h["port"]) for h in self.state["hosts"] for c in h["containers"]]

    def spread(self, count: int) -> list[Container]:
        """``count`` containers spread over the hosts: first vmid on every host, then the next, ..."""
        by_vmid = sorted(self.containers(), key=lambda c: (c.vmid, int(c.host[3:])))
        return by_vmid[:count]

    def write_fleet(self, path: Path, members: dict, env: dict, host_data: dict | None = None) -> Path:
        """A fleet.yaml for ``members`` = {Container: flags}."""
        hosts: dict = {}
        for ct, flags in members.items():
            entry = hosts.setdefault(ct.host, {
                "ssh": {"hostname": "127.0.0.1", "port": ct.port, "user": "root",
                        "key": str(self.dir / "id_ed25519"), "known_hosts_file": str(self.dir / "known_hosts")},
                "containers": {},
            })
            if host_data:
                entry["data"] = dict(host_data)
            entry["containers"][ct.vmid] = {"sglang": {"model_path": MODEL_PATH, "port": PORT,
                                                       "flags": dict(flags), "env": dict(env)}}
        path.write_text(yaml.safe_dump({"hosts": hosts}, sort_keys=False))
        return path

    def write_ansible_inventory(self, path: Path, members: dict, env: dict) -> Path:
        """An Ansible inventory: one host per container (SSH to its Proxmox host, `pct exec` there)."""
        env_text = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in sorted(env.items()))
        hosts = {
            ct.ansible_name: {
                "ansible_host": "127.0.0.1", "ansible_port": ct.port, "ansible_user": "root",
                "ansible_ssh_private_key_file": str(self.dir / "id_ed25519"),
                "vmid": ct.vmid, "sglang_port": PORT, "sglang_argv": server_argv(flags), "sglang_env": env_text,
            }
            for ct, flags in members.items()
        }
        known = self.dir / "known_hosts"
        doc = {"all": {
            "vars": {"ansible_ssh_common_args": f"-o UserKnownHostsFile={known} -o StrictHostKeyChecking=yes"},
            "children": {"containers": {"hosts": hosts}},
        }}
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    # ------------------------------------------------------------------ reaching containers (not measured)

    def in_ct(self, host: str, vmid: int, script: str, timeout: float = 60) -> subprocess.CompletedProcess:
        argv = core.host_exec_argv(self.dir, host) + ["pct", "exec", str(vmid), "--", "sh", "-c", script]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def reset(self, containers: list[Container] | None = None) -> None:
        """No server and no memory holder in ``containers`` (default: all); waits for every GPU to be free."""
        targets = containers or self.containers()
        procs = [subprocess.Popen(core.host_exec_argv(self.dir, c.host)
                                  + ["pct", "exec", str(c.vmid), "--", "sh", "-c", RESET_SCRIPT],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
                 for c in targets]
        for proc in procs:
            proc.wait(timeout=60)
        for host in sorted({c.host for c in targets}):
            self.wait_gpus(host, lambda used: not any(used), timeout=30)

    def gpu_used(self, host: str) -> list[int]:
        return [g["used_mib"] for g in core.gpu_usage(core.host_dir(self.dir, host) / "gpu")]

    def wait_gpus(self, host: str, predicate, timeout: float = 30) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.gpu_used(host)):
                return True
            time.sleep(0.02)
        return False

    def released_path(self, host: str) -> Path:
        return core.host_dir(self.dir, host) / "gpu" / "released.jsonl"

    def released_since(self, host: str, offset: int) -> list[dict]:
        path = self.released_path(host)
        with open(path, "rb") as handle:
            handle.seek(offset)
            text = handle.read().decode()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def released_offset(self, host: str) -> int:
        path = self.released_path(host)
        return path.stat().st_size if path.exists() else 0


def tool_path(name: str) -> str:
    """The real executable next to this interpreter (not a pyenv shim, which adds its own startup)."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    try:
        mem_kib = int(next(l for l in Path("/proc/meminfo").read_text().splitlines()
                           if l.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration, ValueError):
        mem_kib = 0
    return {
        "cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(), "python": platform.python_version(),
        "pyinfra": version("pyinfra"), "ansible_core": version("ansible-core"),
        "openssh": subprocess.run(["ssh", "-V"], capture_output=True, text=True).stderr.strip(),
    }
