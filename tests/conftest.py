"""Shared fixtures. The `lab` fixture starts one local lab (2 hosts x 8 GPUs) per test session.

Usage in a test (mark it `lab`):

    @pytest.mark.lab
    def test_something(lab):
        out = lab.pct("pve1", "exec", "129", "--", "hostname")
        assert out.stdout == "ct129\\n"
        result = lab.pyinfra("inventory.py", "deploy.py", "--dry")   # pyinfra CLI against the lab

xdist: every worker gets its own lab directory (and so its own cgroup tree and ports), so lab tests
may run in parallel workers; each worker then pays the lab's start (well under a second).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import warm_pyinfra

REPO_ROOT = Path(__file__).resolve().parent.parent
# A machine may set PYTHONDONTWRITEBYTECODE (the machines this suite is run on here do). The suite then compiled
# gpugate from source in every pyinfra run and every xdist worker re-rewrote every test module: about
# 0.06 CPU-s a run, 3 CPU-s a worker. Bytecode is written (into __pycache__, ignored by git) for this
# process, its workers and every process they start.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
LAB_HOSTS = 2
LAB_GPUS = 8
# scripts/bootstrap makes it: gpugate and its runtime dependencies only (docs/testing.md, "The controller")
CONTROLLER_VENV = REPO_ROOT / ".venv-controller"


def poll(predicate: Callable[[], Any], timeout_s: float, first_s: float = 0.05, most_s: float = 0.3) -> Any:
    """``predicate()`` until it is truthy or ``timeout_s`` has passed; its last value. The pause between
    looks grows from ``first_s`` to ``most_s``: a look is mostly a process in a container (~30-40 ms of
    CPU), and the suite is CPU-bound, so a long wait looks a few times a second, not twenty.

    Example: poll(lambda: health(lab) == 200, 10)
    """
    deadline = time.monotonic() + timeout_s
    pause = first_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(pause)
        pause = min(pause * 1.5, most_s)


def pyinfra_exe() -> str:
    """The pyinfra CLI every test runs: the controller venv's, as `pip install gpugate` leaves an
    operator's controller; where bootstrap has not made it, the one on PATH.

    Example: subprocess.run([pyinfra_exe(), "-y", "inventory.py", "deploy.py"], env=lab.env(), ...)
    """
    own = CONTROLLER_VENV / "bin" / "pyinfra"
    if own.is_file():
        return str(own)
    return shutil.which("pyinfra") or str(Path(sys.executable).with_name("pyinfra"))


@pytest.fixture(scope="session", autouse=True)
def audit_log_in_a_temporary_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every audit event of the test session (this process, its pyinfra children, every xdist worker)
    goes to a file under pytest's temporary directory, never to the repository's ./audit.jsonl nor to
    an operator's $GPUGATE_AUDIT_LOG. Tests that check the audit log pass their own path.

    Likewise the controller's cache of SGLang flag tables ($GPUGATE_CACHE_DIR, else ~/.cache/gpugate):
    one per worker, so no run of the suite reads a table another run (or another checkout, or the
    operator) left in the home directory. Tests that check the cache pass their own directory."""
    path = tmp_path_factory.mktemp("audit") / "audit.jsonl"
    cache = tmp_path_factory.mktemp("controller-cache")
    previous = {name: os.environ.get(name) for name in ("GPUGATE_AUDIT_LOG", "GPUGATE_CACHE_DIR")}
    os.environ["GPUGATE_AUDIT_LOG"] = str(path)
    os.environ["GPUGATE_CACHE_DIR"] = str(cache)
    yield path
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def lab_unavailable_reason() -> str | None:
    """Why the lab cannot run here (None when it can)."""
    if sys.platform != "linux":
        return "the lab needs Linux namespaces"
    if os.geteuid() != 0:
        return "the lab needs root (namespaces, mounts, sshd)"
    for tool in ("/usr/sbin/sshd", "ssh", "ssh-keygen", "nsenter"):
        if not (os.path.exists(tool) if tool.startswith("/") else shutil.which(tool)):
            return f"the lab needs {tool} (apt-get install openssh-server openssh-client util-linux)"
    return None


@dataclass(frozen=True)
class LabHost:
    name: str
    port: int
    key: str
    known_hosts: str


@dataclass
class Lab:
    """A running lab, for tests: SSH into hosts, run pct, run pyinfra against it."""

    dir: Path
    hosts: list[LabHost]
    fleet_path: Path

    def host(self, name: str) -> LabHost:
        return next(h for h in self.hosts if h.name == name)

    def ssh_argv(self, host: str) -> list[str]:
        """ssh command line (key auth, host key checked against the lab's known_hosts)."""
        from gpugate_lab import core

        return core.ssh_argv(self.dir, host)

    def ssh(self, host: str, command: str, *, input: str | bytes | None = None, timeout: float = 60,
            text: bool = True) -> subprocess.CompletedProcess:
        """Run one shell command line on a lab host over real SSH (no tty)."""
        return subprocess.run(self.ssh_argv(host) + [command], input=input, capture_output=True,
                              text=text, timeout=timeout, stdin=None if input is not None else subprocess.DEVNULL)

    def pct(self, host: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`pct ARGS...` on a lab host, entered without SSH (as host_exec): a test's own look or setup.
        An SSH client's start costs ~0.08 CPU-s, nsenter's nothing; what goes over SSH is the product's
        own path (pyinfra's connector) and the lab's tests of it (pct_over_ssh)."""
        return self.host_exec(host, "pct", *args, timeout=timeout)

    def pct_over_ssh(self, host: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`pct ARGS...` on a lab host over SSH (each argument quoted), as an operator runs it."""
        return self.ssh(host, "pct " + " ".join(shlex.quote(a) for a in args), timeout=timeout)

    def ps(self, host: str = "pve1", vmid: int = 129) -> list[tuple[int, int, str, list[str]]]:
        """Every process of a container as ``(pid, ppid, command line, argv)``, the pids as the
        container sees them (its init is 1, the init's parent 0), the command line its arguments joined
        by spaces, as ``tr '\\0' ' ' < /proc/PID/cmdline`` shows it there.

        Read from this machine: the container's cgroup (``cgroup.procs`` of lxc/<vmid> and below) and
        /proc, with no process started; a shell loop over /proc through ``pct exec`` cost 50 to 70 ms
        of CPU a look (a fork per process), and the fault tests look often. Where the lab runs without
        cgroups, that loop in the container is the way."""
        from gpugate_lab import core, nsutil

        base = core.host_cgroup_dir(self.dir, host)
        mode = self.dir / "hosts" / host / "cgroup_mode"
        if base and mode.is_file() and mode.read_text().strip() == "on":
            members: list[str] = []
            for directory, _dirs, files in os.walk(os.path.join(base, "lxc", str(vmid))):
                if "cgroup.procs" in files:
                    with contextlib.suppress(OSError), open(os.path.join(directory, "cgroup.procs")) as procs:
                        members += procs.read().split()
            in_container: dict[int, int] = {}
            rows: list[tuple[int, int, list[str]]] = []
            for pid in members:
                chain, argv = nsutil.nspid_chain(pid), nsutil.cmdline(pid)
                try:
                    with open(f"/proc/{pid}/stat") as stat:
                        ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if chain:
                    in_container[int(pid)] = chain[-1]
                    rows.append((chain[-1], ppid, argv))
            return sorted((pid, in_container.get(ppid, 0), " ".join(argv), argv) for pid, ppid, argv in rows if argv)
        # a line per process: pid, ppid, then its cmdline with each NUL as \x01 (arguments may hold spaces)
        script = ("for p in /proc/[0-9]*; do c=$(tr '\\0' '\\001' < $p/cmdline 2>/dev/null); "
                  "s=$(awk '{print $4}' $p/stat 2>/dev/null); [ -n \"$c\" ] && printf '%s %s %s\\n' \"${p#/proc/}\" \"$s\" \"$c\"; done")
        out = self.pct(host, "exec", str(vmid), "--", "sh", "-c", script).stdout
        seen = []
        for pid, ppid, raw in (line.split(" ", 2) for line in out.splitlines() if line.count(" ") >= 2):
            argv = [arg for arg in raw.split("\x01") if arg]
            if pid.isdigit() and ppid.isdigit() and argv:
                seen.append((int(pid), int(ppid), " ".join(argv), argv))
        return sorted(seen)

    def host_exec(self, host: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run argv inside a lab host without SSH (nsenter into its namespaces); faster for setup."""
        from gpugate_lab import core

        return subprocess.run(core.host_exec_argv(self.dir, host) + list(argv), capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def env(self) -> dict[str, str]:
        """Environment under which `pyinfra inventory.py ...` reaches this lab.

        PYTHONPATH starts with this checkout: the `pyinfra` on PATH imports gpugate through whatever
        editable install its interpreter has, which on a shared machine can be another checkout's (the
        last `scripts/bootstrap` run anywhere wins); the controller under test is always this one."""
        env = dict(os.environ)
        env["GPUGATE_LAB_DIR"] = str(self.dir)
        env["GPUGATE_FLEET"] = str(self.fleet_path)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        return env

    def pyinfra(self, *args: str, timeout: float = 300, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
        """Run the pyinfra CLI (non-interactive) against the lab, e.g. lab.pyinfra("inventory.py", "deploy.py")."""
        return warm_pyinfra.run([pyinfra_exe(), "-y", *args], cwd=cwd, env=self.env(), timeout=timeout)

    def fault(self, host: str, vmid: int, name: str, clear: bool = False) -> str:
        from gpugate_lab import faults

        return faults.apply_fault(self.dir, host, vmid, name, clear=clear)

    @contextlib.contextmanager
    def load_held(self, host: str = "pve1", vmid: int = 129, safety_s: float = 90) -> Iterator[None]:
        """Every stand-in start in the container stays in its load (fault slow-start, read again while
        loading) until the block ends: a test acts while a server loads, for exactly as long as it
        needs, instead of a fixed long load that must outlast a busy machine. ``safety_s``: the load
        ends anyway after that long, so a test that fails inside the block never hangs the suite."""
        with self.faulted(host, vmid, f"slow-start={safety_s:g}"):
            yield

    @contextlib.contextmanager
    def faulted(self, host: str, vmid: int, name: str) -> Iterator[None]:
        """Lab fault ``name`` (``weights-load-fails=/opt/models/m``) on a container for the block,
        cleared when it ends, however it ends."""
        self.fault(host, vmid, name)
        try:
            yield
        finally:
            self.fault(host, vmid, name.split("=", 1)[0], clear=True)


def start_lab(lab_dir: Path, hosts: int = LAB_HOSTS, gpus: int = LAB_GPUS, vmids: tuple[int, ...] = (129,),
              engines: tuple[str, ...] | None = None, router: bool = False) -> Lab:
    from gpugate_lab import core

    state = core.up(lab_dir, hosts=hosts, gpus=gpus, vmids=vmids, engines=engines, router=router)
    return Lab(
        dir=Path(state["dir"]),
        hosts=[LabHost(h["name"], h["port"], h["key"], h["known_hosts"]) for h in state["hosts"]],
        fleet_path=Path(state["fleet"]),
    )


def module_lab(tmp_path_factory: pytest.TempPathFactory, name: str, hosts: int = LAB_HOSTS,
               gpus: int = LAB_GPUS, vmids: tuple[int, ...] = (129,), engines: tuple[str, ...] | None = None,
               router: bool = False):
    """A lab in its own directory (own ports, own cgroups) for a fixture of any scope: yields it and
    takes it down. Skipped where this machine cannot have a lab (lab_unavailable_reason); a lab that
    fails to start on a machine that can have one is an error, not a skip.

    .. code:: python

        @pytest.fixture(scope="module")
        def lab(tmp_path_factory):
            yield from module_lab(tmp_path_factory, "lab-server", hosts=1, gpus=8)

    ``vmids``: the containers of every host (``(129, 130)``: two containers, and a fleet file that
    gives them disjoint GPUs). ``engines``: the engine of each container in turn (``gpugate lab up
    --engine``). ``router``: a real smg in front of every server (``--router``). Processes a test
    starts in a container: tests/e2e/lab_processes.py.
    """
    reason = lab_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from gpugate_lab import core

    lab_dir = tmp_path_factory.mktemp(name)
    try:
        yield start_lab(lab_dir, hosts=hosts, gpus=gpus, vmids=vmids, engines=engines, router=router)
    finally:
        core.down(lab_dir)


def routed_lab(tmp_path_factory: pytest.TempPathFactory, name: str, **kwargs: Any):
    """:func:`module_lab` with a real smg in front of every server: yields ``(lab, router)``, the router
    as ``gpugate lab up --router`` recorded it (``url``, ``ports`` per container).

    .. code:: python

        @pytest.fixture(scope="module")
        def routed(tmp_path_factory):
            yield from routed_lab(tmp_path_factory, "lab-router", hosts=1, gpus=3, vmids=(129, 130, 131))
    """
    import json

    lab_fixture = module_lab(tmp_path_factory, name, router=True, **kwargs)
    lab = next(lab_fixture)
    yield lab, json.loads((lab.dir / "lab.json").read_text())["router"]
    next(lab_fixture, None)


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Lab:
    """One lab (2 hosts x 8 GPUs, container 129 running on each) for the whole session (per xdist worker)."""
    yield from module_lab(tmp_path_factory, "gpugate-lab")


# The longest lab modules, longest first (their share of a run, docs/testing.md): under xdist a worker
# that takes one of them last would run on alone while the others are idle, so they are collected first
# and the short modules fill in behind them. Every other module keeps its place, after these.
LONGEST_MODULES = (  # measured: docs/testing.md (each module alone, 2026-12-04 evening; the router lab's
    # -n 5 share keeps it first)
    "tests/e2e/test_router_lab.py",
    "tests/e2e/test_canary_lab.py",  # 60 s alone (2026-12-05): 7 routed restarts, 3 soaks of 3 s
    "tests/lab/test_agent_lab.py",
    "tests/e2e/test_transition_lab.py",
    "tests/e2e/test_runbooks_lab.py",
    "tests/faults/test_stop_and_gate.py",
    "tests/faults/test_start_and_operators.py",
    "tests/faults/test_weight_cache_faults.py",
    "tests/e2e/test_router_gated_lab.py",
    "tests/e2e/test_live_changes_lab.py",
    "tests/e2e/test_vllm_router_lab.py",
    "tests/e2e/test_gate_lab.py",
    "tests/faults/test_state_files.py",
    "tests/e2e/test_vllm_lab.py",
    "tests/faults/test_fleet_and_input.py",
    "tests/e2e/test_systemd_lab.py",
    "tests/e2e/test_weight_cache_edges_lab.py",
    "tests/e2e/test_server_lab.py",
    "tests/e2e/test_second_operator_lab.py",
    "tests/e2e/test_agreement_lab.py",
    "tests/e2e/test_two_servers_lab.py",
    "tests/e2e/test_claims_lab.py",
    "tests/faults/test_lost_host.py",
    "tests/e2e/test_connector_lab.py",
    "tests/e2e/test_flags_lab.py",
    "tests/e2e/test_weight_cache_lab.py",
    "tests/e2e/test_engine_seam_lab.py",
    "tests/e2e/test_vllm_weight_cache_lab.py",
    "tests/lab/test_weight_cache_standin.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first (LONGEST_MODULES), each whole and in its own order (a stable sort by
    module: a module's tests stay together, in file order, as its lab fixture and ordered tests need)."""
    rank = {path: i for i, path in enumerate(LONGEST_MODULES)}

    def module_rank(item: pytest.Item) -> int:
        path = Path(str(item.path)).resolve()
        relative = path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else ""
        return rank.get(relative, len(rank))

    items.sort(key=module_rank)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, ``-n N`` alone means ``--dist load``, which deals a module's tests to whichever worker
    is free: a module's lab would start on both workers and the tests of a module that run from the
    state the earlier ones left would find another state. Whole files go to one worker instead
    (``--dist loadfile``); any other ``--dist`` given is kept. Not in ``addopts``: ``-p no:xdist`` and a
    machine without xdist keep working."""
    if getattr(config.option, "dist", None) == "load":
        config.option.dist = "loadfile"
        # and in collection order (LONGEST_MODULES first), not xdist's default of most tests first, which
        # handed out the many short unit modules first and left a long lab module to run on alone at the end
        if hasattr(config.option, "loadscopereorder"):
            config.option.loadscopereorder = False


def pytest_collection_finish(session):
    """Importing ``pyinfra_cli`` gevent-patches the whole interpreter (subprocess, threading, socket). A
    test module that does it at import time changes every other test of the session (``subprocess.run``
    refuses ``stdin=None`` beside ``input=``, a thread becomes a greenlet that may never yield): CI saw
    both. Refuse such a session at once, naming the cause."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("subprocess"):
        raise pytest.UsageError("a test module gevent-patched the interpreter while being collected (an import "
                                "of pyinfra_cli?): import it inside a test or in a child process")
