"""Helpers for the reliability fault suite (issue 7): a lab per module, the real pyinfra CLI
(optionally streamed, so that a test can act at a given moment of a transition), and readers of
what a container runs.

Run the suite alone: ``python3 -m pytest -m faults tests/faults`` (docs/reliability.md).
"""

from __future__ import annotations

import json
import subprocess
import threading
from typing import Callable, Iterable

from gpugate.engine.sglang.weight_cache import steady_argv
from tests import warm_pyinfra
from tests.conftest import REPO_ROOT, Lab, poll, pyinfra_exe

FLAGS = {"tp": 4}
FP8 = {"tp": 4, "kv-cache-dtype": "fp8_e4m3"}
# Short stand-in loads and short deadlines keep the suite at a few minutes.
FAST_ENV = {"SGLANG_STANDIN_LOAD_S": "0.3"}
SHORT = {"drain_timeout_s": 2, "kill_grace_s": 2, "gpu_gate_timeout_s": 3, "start_timeout_s": 8}
PORT = 30000
BYSTANDER_TITLE = "sglang::scheduler_TP0"  # looks exactly like an SGLang worker, but is not ours


def deploy_args(flags=None, env=None, data: dict | None = None, limit: str | None = "pve_pve1") -> list[str]:
    """Arguments of `pyinfra -y inventory.py deploy.py` with the desired flags/env and --data overrides."""
    args = ["inventory.py", "deploy.py",
            "--data", f"sglang_flags={json.dumps(FLAGS if flags is None else flags)}",
            "--data", f"sglang_env={json.dumps(FAST_ENV if env is None else env)}"]
    for key, value in {**SHORT, **(data or {})}.items():
        args += ["--data", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    if limit:
        args += ["--limit", limit]
    return args


class Run:
    """A finished pyinfra run: exit status and everything it printed (stdout and stderr)."""

    def __init__(self, returncode: int, output: str):
        self.returncode = returncode
        self.output = output

    def __repr__(self) -> str:  # shown by pytest when an assertion fails
        return f"Run(rc={self.returncode})\n{self.output}"


def pyinfra(lab: Lab, args: Iterable[str], when: Iterable[tuple[str, Callable[[subprocess.Popen], None]]] = (),
            timeout: float = 180, extra: Iterable[str] = ("-y",)) -> Run:
    """Run the pyinfra CLI against the lab, reading its output line by line; for each
    ``(text, action)`` in ``when``, ``action(process)`` runs once, as soon as a line contains text
    (e.g. kill the run while it drains, inject a fault when the rollback begins)."""
    process = warm_pyinfra.popen([pyinfra_exe(), *extra, *args], cwd=REPO_ROOT, env=lab.env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pending = list(when)
    lines: list[str] = []
    watchdog = threading.Timer(timeout, process.kill)
    watchdog.start()
    try:
        for line in process.stdout:
            lines.append(line)
            for item in list(pending):
                if item[0] in line:
                    pending.remove(item)
                    item[1](process)
        process.wait()
    finally:
        watchdog.cancel()
    return Run(process.returncode, "".join(lines))


class OnJournal:
    """Acts at the moment a container's agent journals an event, without waiting for the controller to
    print it (it reads the journal in batches: its line may come 3 s after the event). Around a run:

        with OnJournal(lab, "gate", "progress", end_holder, when=lambda event: event["elapsed_s"] >= 3):
            run = deploy(lab, ...)

    ``action()`` runs once, in a thread of this process, as soon as the journal of a run that began
    inside the block has an event of ``step`` and ``phase`` (and ``when(event)``); an exception it
    raised is raised again when the block ends. The journal is read where this machine sees it, the
    upper directory of the container's /var overlay (lab/gpugate_lab/container.py): no command in the
    container per look."""

    def __init__(self, lab: Lab, step: str, phase: str, action: Callable[[], None], host: str = "pve1",
                 vmid: int = 129, when: Callable[[dict], bool] = lambda event: True):
        self.runs = lab.dir / "hosts" / host / "ct" / str(vmid) / "var-upper" / "lib" / "gpugate" / "runs"
        self.step, self.phase, self.action, self.when = step, phase, action, when
        self.fired = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "OnJournal":
        self.before = set(self.runs.glob("*.jsonl"))
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(timeout=30)
        if self.error is not None and exc[0] is None:
            raise self.error

    def _watch(self) -> None:
        while not self.done.is_set():
            for path in set(self.runs.glob("*.jsonl")) - self.before:
                try:
                    lines = path.read_text().splitlines()
                except OSError:
                    continue
                for line in lines:
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue  # a line being written
                    if (isinstance(event, dict) and event.get("step") == self.step and event.get("phase") == self.phase
                            and self.when(event)):
                        try:
                            self.action()
                        except BaseException as error:  # noqa: BLE001 -- raised again in the test's thread
                            self.error = error
                        self.fired.set()
                        return
            self.done.wait(0.02)


def deploy(lab: Lab, flags=None, env=None, data: dict | None = None, limit: str | None = "pve_pve1",
           when=(), timeout: float = 180) -> Run:
    return pyinfra(lab, deploy_args(flags, env, data, limit), when=when, timeout=timeout)


def sh(lab: Lab, host: str, vmid: int, script: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """A shell script inside a container (through the lab host's nsenter + pct, no SSH)."""
    return lab.host_exec(host, "pct", "exec", str(vmid), "--", "sh", "-c", script, timeout=timeout)


def main_pid(lab: Lab, host: str = "pve1", vmid: int = 129) -> int | None:
    """The pid of the SGLang main process on PORT in the container (from /proc, not the pid file)."""
    pids = [pid for pid, _ppid, cmd, _argv in lab.ps(host, vmid) if cmd.startswith("/usr/bin/python3 -m sglang.launch_server")]
    return pids[0] if pids else None


def running_argv(lab: Lab, host: str = "pve1", vmid: int = 129) -> list[str]:
    mains = [argv for _pid, _ppid, cmd, argv in lab.ps(host, vmid) if cmd.startswith("/usr/bin/python3 -m sglang.launch_server")]
    return steady_argv(mains[0]) if mains else []  # without a gated launch's port


def sglang_processes(lab: Lab, host: str = "pve1", vmid: int = 129) -> list[str]:
    """Every SGLang-looking process in the container (main and workers), as 'pid state cmdline'."""
    out = sh(lab, host, vmid, "ps -eo pid=,stat=,args= | grep -E 'sglang(::|\\.launch_server)' | grep -v grep")
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def health(lab: Lab, host: str = "pve1", vmid: int = 129) -> int | None:
    out = sh(lab, host, vmid, "python3 -c \"import urllib.request as u, urllib.error as e\n"
                              "try: print(u.urlopen('http://127.0.0.1:%d/health', timeout=3).status)\n"
                              "except e.HTTPError as x: print(x.code)\n"
                              "except Exception: print('none')\"" % PORT)
    text = out.stdout.strip()
    return int(text) if text.isdigit() else None


def gpu_used(lab: Lab, host: str = "pve1") -> list[int]:
    """Device-wide used MiB per GPU, read on the lab host (whatever namespace holds it)."""
    out = lab.host_exec(host, "nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits")
    return [int(x) for x in out.stdout.split()]


def observed(lab: Lab, host: str = "pve1", vmid: int = 129, port: int = PORT) -> dict:
    """The container agent's own view of the server (observe, sent inline): running, serving,
    ``transition`` (the last run and its outcome), ``history`` (good and failed specs, redacted)."""
    from gpugate import agentcmd

    out = sh(lab, host, vmid, agentcmd.inline_observe_command("/usr/bin/python3", {"port": port}))
    doc = agentcmd.parse_output(out.stdout.splitlines())
    assert "sglang" in doc, (out.stdout, out.stderr)
    return doc["sglang"]


def log_starts(lab: Lab, host: str = "pve1", vmid: int = 129) -> int:
    """How many times the server was started (the supervisor's header lines in its log)."""
    out = sh(lab, host, vmid, f"grep -c '^=== gpugate start' /var/log/gpugate/sglang-{PORT}.log 2>/dev/null || true")
    return int(out.stdout.strip() or 0)


def wait_until(predicate: Callable[[], bool], timeout: float = 20) -> bool:
    return bool(poll(predicate, timeout))


def flag_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


class Bystanders:
    """Processes that look like SGLang workers but are not this container's: one on the lab host
    (outside every container), one in a sibling container. The tool must never touch them."""

    def __init__(self, lab: Lab, host: str = "pve1", sibling_vmid: int = 130):
        from gpugate_lab import core

        self.lab = lab
        core.add_container(lab.dir, host, sibling_vmid)
        spawn = ("import os; os.execvp('sleep', [%r, '3600'])" % BYSTANDER_TITLE)
        self.processes = [
            subprocess.Popen(core.host_exec_argv(lab.dir, host) + ["python3", "-c", spawn],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            subprocess.Popen(core.host_exec_argv(lab.dir, host) + ["pct", "exec", str(sibling_vmid), "--",
                                                                   "python3", "-c", spawn],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        ]
        self.host, self.sibling_vmid = host, sibling_vmid
        assert wait_until(lambda: len(self.host_pids()) == 2, 10), "bystanders did not start"
        self.pids = self.host_pids()

    def host_pids(self) -> list[int]:
        """Host pids (the lab host's namespace) of processes titled like an SGLang worker outside ct 129."""
        out = self.lab.host_exec(self.host, "sh", "-c", f"pgrep -f '^{BYSTANDER_TITLE} 3600'")
        return sorted(int(x) for x in out.stdout.split())

    def all_alive(self) -> bool:
        return self.host_pids() == self.pids

    def stop(self) -> None:
        for pid in self.pids:
            self.lab.host_exec(self.host, "kill", "-9", str(pid))
        # then the nsenter/pct parents we started, which reap them and exit: killed first, they left the
        # sleeps to this machine's PID 1, whose late reaping (up to a second) held the lab's down as long
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def ensure_serving(lab: Lab, flags=None, host: str = "pve1") -> int:
    """Make the container serve `flags` (deploy only when it does not already); -> the main pid."""
    from gpugate.spec import build_spec

    want = list(build_spec("/opt/models/lab-model", PORT, flags or FLAGS, FAST_ENV).argv)
    if running_argv(lab, host) != want or health(lab, host) != 200:
        run = deploy(lab, flags or FLAGS, limit=f"pve_{host}")
        assert run.returncode == 0, run
    assert running_argv(lab, host) == want
    return main_pid(lab, host)


def said(run: Run, *texts: str) -> None:
    """Assert that the operator saw each text (the whole output is shown when one is missing)."""
    missing = [text for text in texts if text not in run.output]
    assert not missing, f"missing {missing!r} in the output:\n{run.output}"
