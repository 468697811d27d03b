"""Real processes a test starts in a lab container, beside (or instead of) the managed server, and how
to tell they are still alive: the parts of issue 12's cases that a deploy must leave alone.

- ``start_bench_client``: ``python3 -m sglang.bench_serving --port P ...`` (the stand-in's benchmark
  client: requests in a loop; matches SGLang's own kill pattern ``sglang.bench``, holds no GPU);
- ``start_gpu_monitor``: ``python3 -m gpustat -i 1`` (nvmlInit, /dev/nvidia* held open at 0 MiB);
- ``start_shared_group_server``: ``setsid sh -c "python3 -m sglang.launch_server ... & python3 -m
  http.server 8080 & wait"`` (a server started by hand whose process group holds another daemon);
- ``start_in_container``: any command line, detached (own session, output to a log in the container).

Each returns a ``LabProcess`` (pid as the container sees it, and its start time, so a reused pid is
never taken for the same process); ``proc.alive()`` is true while that very process runs (a zombie
is not alive). Example::

    from tests.e2e.lab_processes import start_bench_client, start_gpu_monitor

    client = start_bench_client(lab, "pve1", 129, port=30000)
    monitor = start_gpu_monitor(lab, "pve1", 129)
    run = lab.pyinfra("inventory.py", "deploy.py", ...)
    assert client.alive() and monitor.alive()
    assert client.log().count("ok") ...
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

LOG_DIR = "/var/log/lab-processes"  # in the container (its /var is persistent; /tmp is fresh at each start)
MODEL = "/opt/models/lab-model"


def ct_sh(lab: Any, host: str, vmid: int, script: str, timeout: float = 60):
    """Run ``sh -c script`` in the container (via the lab host's pct, without SSH)."""
    return lab.host_exec(host, "pct", "exec", str(vmid), "--", "sh", "-c", script, timeout=timeout)


@dataclass(frozen=True)
class LabProcess:
    lab: Any
    host: str
    vmid: int
    pid: int            # as the container sees it
    start_ticks: int    # /proc/PID/stat field 22: tells this process from a later one with the same pid
    name: str           # short label: its log is LOG_DIR/<name>.log in the container

    def stat(self) -> list[str] | None:
        out = ct_sh(self.lab, self.host, self.vmid, f"cat /proc/{self.pid}/stat 2>/dev/null || true").stdout
        if ")" not in out:
            return None
        return out.rpartition(")")[2].split()

    def alive(self) -> bool:
        """True while this very process runs (not a zombie, not a later process with its pid)."""
        fields = self.stat()
        return bool(fields) and fields[0] != "Z" and int(fields[19]) == self.start_ticks

    def pgid(self) -> int:
        fields = self.stat()
        assert fields, f"{self.name} (pid {self.pid}) is gone"
        return int(fields[2])

    def log(self) -> str:
        return ct_sh(self.lab, self.host, self.vmid, f"cat {LOG_DIR}/{self.name}.log 2>/dev/null || true").stdout

    def kill(self) -> None:
        if self.alive():
            ct_sh(self.lab, self.host, self.vmid, f"kill -9 {self.pid} 2>/dev/null || true")


def start_in_container(lab: Any, host: str, vmid: int, command: str, name: str) -> LabProcess:
    """Start ``command`` (a shell command line) detached in the container: own session, stdin from
    /dev/null, output to LOG_DIR/<name>.log. Returns once the process exists."""
    log = f"{LOG_DIR}/{shlex.quote(name)}.log"
    script = (f"mkdir -p {LOG_DIR} && cd / && setsid sh -c {shlex.quote('exec ' + command)} "
              f"</dev/null >{log} 2>&1 & pid=$!; sleep 0.05; "
              "echo $pid $(cut -d')' -f2- /proc/$pid/stat | awk '{print $20}')")
    result = ct_sh(lab, host, vmid, script)
    fields = result.stdout.split()
    assert result.returncode == 0 and len(fields) == 2, f"could not start {name}: {result.stdout} {result.stderr}"
    return LabProcess(lab, host, vmid, int(fields[0]), int(fields[1]), name)


def start_bench_client(lab: Any, host: str, vmid: int, port: int = 30000, rate: float = 5,
                       name: str = "bench") -> LabProcess:
    """SGLang's benchmark client sending requests to :port in a loop (for hours: a deploy must not end it)."""
    return start_in_container(
        lab, host, vmid, f"python3 -m sglang.bench_serving --backend sglang --port {int(port)} "
                         f"--num-prompts 1000000 --request-rate {rate} --random-output-len 4", name)


def start_gpu_monitor(lab: Any, host: str, vmid: int, name: str = "gpustat") -> LabProcess:
    """A GPU monitor: nvmlInit and every /dev/nvidia* held open, 0 MiB, printing once a second."""
    monitor = start_in_container(lab, host, vmid, "python3 -m gpustat -i 1 --no-color", name)
    wait_for(lambda: "MB |" in monitor.log(), what=f"{name} printing")
    return monitor


@dataclass(frozen=True)
class SharedGroup:
    shell: LabProcess    # the setsid'd `sh -c`: the process group leader
    daemon: LabProcess   # python3 -m http.server, same process group, not SGLang
    server_pid: int      # the hand-started SGLang main process (its child)

    def pgid(self) -> int:
        return self.shell.pgid()


def start_shared_group_server(lab: Any, host: str, vmid: int, port: int = 30000, http_port: int = 8080,
                              flags: str = "--tp 8", name: str = "shared") -> SharedGroup:
    """A server started by hand in one process group with another daemon, as an operator might:
    ``setsid sh -c "python3 -m sglang.launch_server ... & python3 -m http.server 8080 & wait"``."""
    inner = (f"python3 -m sglang.launch_server --model-path {MODEL} --port {int(port)} {flags} & "
             f"python3 -m http.server {int(http_port)} --bind 127.0.0.1 & wait")
    shell = start_in_container(lab, host, vmid, f"sh -c {shlex.quote(inner)}", name)
    children: list[tuple[int, str]] = []

    def find_children() -> bool:
        out = ct_sh(lab, host, vmid, f"for p in $(cat /proc/{shell.pid}/task/*/children); do "
                                     "printf '%s ' $p; tr '\\0' ' ' < /proc/$p/cmdline; echo; done").stdout
        children[:] = [(int(line.split()[0]), line) for line in out.splitlines() if line.strip()]
        return len(children) == 2

    wait_for(find_children, what="the shell's two children")
    server_pid = next(pid for pid, line in children if "sglang.launch_server" in line)
    daemon_pid = next(pid for pid, line in children if "http.server" in line)
    ticks = ct_sh(lab, host, vmid, f"cut -d')' -f2- /proc/{daemon_pid}/stat | awk '{{print $20}}'").stdout.strip()
    return SharedGroup(shell, LabProcess(lab, host, vmid, daemon_pid, int(ticks), name + "-http"), server_pid)


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition"):
    from tests.conftest import poll

    value = poll(predicate, timeout_s)
    if not value:
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
    return value
