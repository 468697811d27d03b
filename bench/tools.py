"""Running each tool once and reading what it did: gpugate (pyinfra CLI, counted), the Ansible playbook,
the hand-run shell check, and gpugate's gate through pyinfra's API.

Every runner returns a plain dict of wall-clock times (``time.time()``, the same clock the lab's
simulated driver writes ``freed_at`` with) and remote-command counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from bench.benchlab import BenchLab, Container, tool_path

REPO_ROOT = Path(__file__).resolve().parent.parent
ANSIBLE_DIR = REPO_ROOT / "bench" / "ansible"
COUNTED_PYINFRA = REPO_ROOT / "bench" / "pyinfra_counted.py"
REMOTE_ACTIONS = {"command", "shell", "ansible.builtin.command", "ansible.builtin.shell"}

# The hand-run check: an operator on the Proxmox host types this (sleep first, then look).
SHELL_CHECK = ("while :; do sleep 3; used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits "
               "| sort -n | tail -1); echo \"check $used\"; [ \"$used\" -le {max_mib} ] && break; done")


class ToolFailed(RuntimeError):
    """A tool run did not succeed; the message carries its output's tail."""


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------- gpugate


def run_gpugate(fleet: Path, *extra: str, workdir: Path) -> dict:
    """``pyinfra -y inventory.py deploy.py`` (counted) against ``fleet``. -> wall time, calls, audit timings."""
    count_file = Path(tempfile.mkstemp(prefix="count-", suffix=".json", dir=workdir)[1])
    audit = Path(tempfile.mkstemp(prefix="audit-", suffix=".jsonl", dir=workdir)[1])
    env = dict(os.environ, GPUGATE_FLEET=str(fleet), GPUGATE_AUDIT_LOG=str(audit))
    # bench/run.py's frozen copy of the tree (GPUGATE_BENCH_SRC): every run of one bench measures the same
    # gpugate, whatever is edited in the checkout meanwhile (an edit of the agent mid-run changes its hash,
    # and every container would then be observed twice: once to learn the agent is not this one's)
    root = Path(os.environ.get("GPUGATE_BENCH_SRC") or REPO_ROOT)
    if root != REPO_ROOT:
        env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    began = time.time()
    result = subprocess.run([sys.executable, str(COUNTED_PYINFRA), str(count_file), "-y", "inventory.py",
                             "deploy.py", *extra], cwd=root, env=env, capture_output=True, text=True,
                            timeout=600, stdin=subprocess.DEVNULL)
    ended = time.time()
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise ToolFailed(f"gpugate deploy failed ({result.returncode}):\n{_tail(output)}")
    counted = json.loads(count_file.read_text())
    events = [json.loads(line) for line in audit.read_text().splitlines() if line.strip()]
    return summarize_pyinfra(counted, events, began, ended)


def summarize_pyinfra(counted: dict, audit_events: list[dict], began: float, ended: float) -> dict:
    calls = counted["calls"]
    per_host: dict[str, Counter] = defaultdict(Counter)
    for call in calls:
        per_host[call["host"]][call["kind"]] += 1
    commands = {h: c["exec"] + c["put"] + c["get"] for h, c in per_host.items()}
    first_connect = min((c["start"] for c in calls if c["kind"] == "connect"), default=ended)
    remote_busy = sum(c["end"] - c["start"] for c in calls if c["kind"] != "connect")
    connect_s = sum(c["end"] - c["start"] for c in calls if c["kind"] == "connect")
    # one outcome per container that changed (the agent's phase timings, e.g. {"desired:drain": 0.03,
    # "desired:gate": 0.17, "desired:load": 1.13}, and the run's total in the container)
    timings = [dict(e.get("timings") or {}, total=e.get("total_s"), outcome=e.get("outcome"))
               for e in audit_events if e.get("step") == "outcome" and e.get("phase") == "end"]
    return {
        "wall_s": ended - began,
        "startup_s": first_connect - began,        # interpreter, pyinfra, inventory, deploy import
        "connect_s": connect_s,                     # SSH handshakes, summed over containers
        "remote_s": remote_busy,                    # remote commands, summed over containers
        "commands": commands,                       # per container: exec + put + get
        "connections": {h: c["connect"] for h, c in per_host.items()},
        "calls": [{"host": c["host"], "kind": c["kind"], "label": c.get("label", c["kind"]),
                   "s": round(c["end"] - c["start"], 4), "at": round(c["start"] - began, 4),
                   "what": c["what"][:80]} for c in calls],
        "transitions": [t for t in timings if t],   # one per container that changed
    }


def gpugate_host(fleet: Path, name: str):
    """A connected pyinfra Host for one container, through pyinfra's API (the gate's own wait)."""
    from pyinfra.api import Config, Inventory, State

    from gpugate.fleet import fleet_to_inventory, load_fleet

    groups = fleet_to_inventory(load_fleet(fleet))
    entries = [entry for hosts, _data in groups.values() for entry in hosts]
    inventory = Inventory((entries, {}))
    State(inventory, Config())
    host = inventory.get_host(name)
    host.connect(raise_exceptions=True)
    return host


# ---------------------------------------------------------------------------------------------- Ansible


def ansible_env(log: Path) -> dict:
    return dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_DIR / "ansible.cfg"),
                ANSIBLE_CALLBACK_PLUGINS=str(ANSIBLE_DIR / "callback_plugins"), BENCH_ANSIBLE_LOG=str(log),
                ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0")


def start_ansible(playbook: str, inventory: Path, extra_vars: dict, workdir: Path) -> tuple[subprocess.Popen, Path, float]:
    log = Path(tempfile.mkstemp(prefix="ansible-", suffix=".jsonl", dir=workdir)[1])
    argv = [tool_path("ansible-playbook"), "-i", str(inventory), str(ANSIBLE_DIR / playbook)]
    for key, value in extra_vars.items():
        argv += ["-e", f"{key}={value}"]
    began = time.time()
    proc = subprocess.Popen(argv, cwd=ANSIBLE_DIR, env=ansible_env(log), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    return proc, log, began


def read_events(log: Path) -> list[dict]:
    try:
        text = log.read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip().endswith("}")]


def run_ansible(playbook: str, inventory: Path, extra_vars: dict, workdir: Path) -> dict:
    proc, log, began = start_ansible(playbook, inventory, extra_vars, workdir)
    output, _ = proc.communicate(timeout=600)
    ended = time.time()
    if proc.returncode != 0:
        raise ToolFailed(f"ansible-playbook {playbook} failed ({proc.returncode}):\n{_tail(output)}")
    return summarize_ansible(read_events(log), began, ended)


def summarize_ansible(events: list[dict], began: float, ended: float) -> dict:
    commands: Counter = Counter()
    tasks: list[dict] = []
    current = None
    for event in events:
        kind = event["event"]
        if kind == "task_start":
            current = {"task": event["task"], "start": event["t"], "end": event["t"], "commands": 0}
            tasks.append(current)
        elif kind in ("ok", "failed", "retry", "unreachable") and event.get("action") in REMOTE_ACTIONS:
            commands[event["host"]] += 1
            if current:
                current["commands"] += 1
        if kind in ("ok", "failed", "retry", "skipped", "unreachable") and current:
            current["end"] = max(current["end"], event["t"])
    first_task = tasks[0]["start"] if tasks else ended
    playbook_end = next((e["t"] for e in events if e["event"] == "playbook_end"), ended)
    return {
        "wall_s": ended - began,
        "startup_s": first_task - began,
        "teardown_s": ended - playbook_end,
        "commands": dict(commands),
        "tasks": [{"task": t["task"], "s": round(t["end"] - t["start"], 4), "commands": t["commands"]}
                  for t in tasks],
        "events": events,
    }


def shell_check_argv(lab: BenchLab, ct: Container, max_mib: int = 64) -> list[str]:
    """ssh to the Proxmox host, then the hand-run loop inside the container."""
    from gpugate_lab import core

    script = SHELL_CHECK.format(max_mib=max_mib)
    return core.ssh_argv(lab.dir, ct.host) + [f"pct exec {ct.vmid} -- sh -c '{script}'"]
