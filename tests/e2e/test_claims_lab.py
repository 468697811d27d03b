"""Two containers on one lab Proxmox host (pve1: 129 and 130, 4 simulated GPUs): the lab's own fleet gives
them disjoint GPUs, the per-GPU lock on the Proxmox host keeps two overlapping transitions (real agent
runs) from passing their gates together, a server whose scheduler is killed from the host dies as
SGLang's does, the real processes of tests/e2e/lab_processes.py, and an unknown host key refused through
the real pyinfra CLI.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess

import gevent
import pytest
from pyinfra.api import Config, Inventory, State

from gpugate import agentcmd
from gpugate.claims import hold_gpu_locks
from gpugate.fleet import fleet_to_inventory, load_fleet
from gpugate.engine.sglang.flags import render_argv, validate_flags
from tests import warm_pyinfra
from tests.conftest import REPO_ROOT, module_lab, pyinfra_exe
from tests.e2e.lab_processes import (ct_sh, start_bench_client, start_gpu_monitor, start_in_container,
                                     start_shared_group_server, wait_for)

pytestmark = pytest.mark.lab
GPUS = 4  # one host's, shared by the two containers (what is proven does not depend on the count)

MODEL = "/opt/models/lab-model"
FAST = {"SGLANG_STANDIN_LOAD_S": "0.3"}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-claims", hosts=1, gpus=GPUS, vmids=(129, 130))


def health(lab, vmid: int, port: int = 30000) -> int | str:
    code = ("import urllib.request,sys\ntry: print(urllib.request.urlopen('http://127.0.0.1:%d/health', timeout=2).status)\n"
            "except Exception as e: print(getattr(e, 'code', 'refused'))" % port)
    return (lambda out: int(out) if out.isdigit() else out)(ct_sh(lab, "pve1", vmid, f"python3 -c {shlex.quote(code)}").stdout.strip())


def gpu_used(lab) -> list[int]:
    out = lab.host_exec("pve1", "nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits").stdout
    return [int(line) for line in out.split()]


def stop_servers(lab) -> None:
    for vmid in (129, 130):
        ct_sh(lab, "pve1", vmid, "pkill -9 -f '[s]glang' ; pkill -9 -f '[h]ttp.server'; pkill -9 -f '[g]pustat'; true")
    wait_for(lambda: gpu_used(lab) == [0] * GPUS, what="GPUs free")


def start_server(lab, vmid: int, flags: dict, port: int = 30000, name: str = "server"):
    argv = ["python3", *render_argv(MODEL, port, validate_flags(flags))]
    env = " ".join(f"{k}={v}" for k, v in FAST.items())
    return start_in_container(lab, "pve1", vmid, f"env {env} " + " ".join(shlex.quote(a) for a in argv), name)


# ---------------------------------------------------------------- the lab's fleet


def test_the_lab_fleet_gives_two_containers_disjoint_gpus_and_both_serve(lab):
    hosts = dict(fleet_to_inventory(load_fleet(lab.fleet_path))["pve_pve1"][0])
    flags = {vmid: hosts[f"@pct/pve1:{vmid}"]["sglang_flags"] for vmid in (129, 130)}
    assert flags == {129: {"tp-size": 2}, 130: {"tp-size": 2, "base-gpu-id": 2}}
    try:
        for vmid in (129, 130):
            start_server(lab, vmid, flags[vmid], name=f"server-{vmid}")
        wait_for(lambda: health(lab, 129) == 200 and health(lab, 130) == 200, what="both servers serving")
        used = gpu_used(lab)
        assert all(mib > 80000 for mib in used), used  # every GPU held, each by exactly one server
        by_ct = lab.host_exec("pve1", "nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader").stdout
        assert by_ct.count("\n") == GPUS, by_ct
    finally:
        stop_servers(lab)


# ---------------------------------------------------------------- plan-time GPU claims (issue 12 item 3)


def runs_in(lab, vmid: int) -> str:
    return ct_sh(lab, "pve1", vmid, "ls /var/lib/gpugate/runs 2>/dev/null || true").stdout


def preview(lab) -> subprocess.CompletedProcess:
    """`pyinfra inventory.py deploy.py --dry` as an operator previews (without -y, which skips the plan)."""
    exe = pyinfra_exe()
    return warm_pyinfra.run([exe, "inventory.py", "deploy.py", "--dry"], cwd=REPO_ROOT, env=lab.env(),
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_two_desired_servers_on_the_same_gpus_are_both_refused_before_anything_is_touched(lab, tmp_path):
    text = lab.fleet_path.read_text()
    assert "flags: {tp: 2, base-gpu-id: 2}" in text, text  # the lab's own fleet: disjoint halves
    overlapping = tmp_path / "fleet.yaml"
    overlapping.write_text(text.replace("flags: {tp: 2, base-gpu-id: 2}", "flags: {tp: 2, base-gpu-id: 1}"))
    edited = dataclasses.replace(lab, fleet_path=overlapping)
    both = "pve1: ct 129 :30000 (GPU 0-1) and ct 130 :30000 (GPU 1-2) claim the same GPU 1"
    before = {vmid: runs_in(lab, vmid) for vmid in (129, 130)}

    dry = preview(edited)
    output = dry.stdout + dry.stderr
    assert dry.returncode != 0, output
    for vmid in (129, 130):  # each container of the pair is refused, naming the other
        assert re.search(rf"\[@pct/pve1:{vmid}\] sglang :30000 REFUSED, nothing touched: .*{re.escape(both)}", output), output
    assert "will start" not in output and "Traceback" not in output

    applied = edited.pyinfra("inventory.py", "deploy.py", "--data", f"sglang_env={json.dumps(FAST)}", timeout=120)
    output = applied.stdout + applied.stderr
    assert applied.returncode != 0, output
    assert output.count(both) >= 2 and "Traceback" not in output, output
    assert {vmid: runs_in(lab, vmid) for vmid in (129, 130)} == before  # no transition began anywhere
    assert health(lab, 129) == health(lab, 130) == "refused" and gpu_used(lab) == [0] * GPUS

    # the lab's own (disjoint) fleet plans both
    dry = preview(lab)
    output = dry.stdout + dry.stderr
    assert dry.returncode == 0 and "claim the same GPU" not in output, output
    assert output.count("will start") == 2, output


# ---------------------------------------------------------------- a dead scheduler


def test_fuser_k_of_a_gpu_device_file_on_the_host_takes_the_server_down(lab):
    try:
        server = start_server(lab, 129, {"tp": 2}, name="fuser-victim")
        wait_for(lambda: health(lab, 129) == 200, what="serving")
        # from the Proxmox host, as an operator clearing a GPU would: every holder of GPU 1 is SIGKILLed;
        # the main process holds no device file, and would answer /health 200 over dead workers
        killed = lab.host_exec("pve1", "fuser", "-k", "/run/gpugate-sim/dev/nvidia1")
        assert killed.returncode == 0, killed.stderr
        wait_for(lambda: not server.alive(), timeout_s=10, what="the main process gone")
        assert health(lab, 129) == "refused"  # not 200 over dead workers
        wait_for(lambda: gpu_used(lab) == [0] * GPUS, what="every scheduler's memory released")
        log = server.log()
        # every scheduler holds every /dev/nvidiaN (as CUDA does): fuser -k of one killed them all
        assert re.search(r"Subprocess scheduler_\d \(pid=\d+\) crashed with exit code -9\. Triggering SIGQUIT", log)
        assert "SIGQUIT received. signum=None, frame=None. It usually means one child failed." in log
        assert ct_sh(lab, "pve1", 129, "pgrep -f '^sglang::' || true").stdout.strip() == ""  # no worker left
    finally:
        stop_servers(lab)


# ---------------------------------------------------------------- real processes for the deploy tests


def test_bench_client_gpu_monitor_and_shared_group_run_and_can_be_checked(lab):
    try:
        group = start_shared_group_server(lab, "pve1", 129, flags="--tp 2")
        assert group.daemon.pgid() == group.pgid() == group.shell.pid  # one process group, not only SGLang
        wait_for(lambda: health(lab, 129) == 200, what="the hand-started server serving")
        client = start_bench_client(lab, "pve1", 129, rate=20)
        monitor = start_gpu_monitor(lab, "pve1", 129)
        wait_for(lambda: "progress:" in client.log(), timeout_s=15, what="the client's progress line")
        assert " 0 failed" in client.log() and monitor.alive() and client.alive() and group.daemon.alive()
        # the monitor holds every device file, and no memory
        fds = ct_sh(lab, "pve1", 129, f"ls -l /proc/{monitor.pid}/fd").stdout
        assert "/dev/nvidiactl" in fds and f"/dev/nvidia{GPUS - 1}" in fds
        assert "sglang.bench_serving" in ct_sh(lab, "pve1", 129, f"tr '\\0' ' ' < /proc/{client.pid}/cmdline").stdout
        smi = lab.host_exec("pve1", "nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader").stdout
        assert "gpustat" not in smi and "bench_serving" not in smi
        monitor.kill()
        wait_for(lambda: not monitor.alive(), what="the monitor killed")
        assert client.alive()
    finally:
        stop_servers(lab)


# ---------------------------------------------------------------- the per-GPU lock on the Proxmox host


def connectors(lab, *vmids: int):
    names = [(f"@pct/pve1:{vmid}", {"ssh_hostname": "127.0.0.1", "ssh_port": lab.host("pve1").port,
                                     "ssh_user": "root", "ssh_key": lab.host("pve1").key,
                                     "ssh_known_hosts_file": lab.host("pve1").known_hosts, "pct_vmid": vmid})
             for vmid in vmids]
    inventory = Inventory((names, {}))
    State(inventory, Config())
    hosts = [inventory.get_host(name) for name, _ in names]
    gevent.joinall([gevent.spawn(h.connect, raise_exceptions=True) for h in hosts], raise_error=True)
    return hosts


def hold(host, gpus, run: str, **kwargs) -> tuple[bool, str]:
    """gpugate.claims.hold_gpu_locks for a container of the lab -> (locked, message)."""
    claim = hold_gpu_locks(host.connector, gpus, run, **kwargs)
    return claim.locked, claim.message


def hand_off(host, run: str, flags: dict) -> dict:
    """The real agent's start (a real transition in the container), as sglang.server hands it off."""
    argv = ["/usr/bin/python3", *render_argv(MODEL, 30000, validate_flags(flags))]
    doc = {"run": run, "operator": "test", "rollback_to": None, "restart": False,
           "desired": {"argv": argv, "env": dict(FAST), "port": 30000, "gpus": None, "supervisor": "process",
                       "record": {}},
           "budgets": {"drain_timeout_s": 5, "kill_grace_s": 2, "gate_timeout_s": 10, "start_timeout_s": 30,
                       "max_used_mib": 64}}
    status, output = host.connector.run_shell_command(agentcmd.start_command("/usr/bin/python3"),
                                                      _stdin=agentcmd.start_stdin(doc, include_source=True))
    answer = agentcmd.parse_output(output.stdout_lines)
    assert status and answer.get("ok"), answer
    return answer


def host_holders_log(lab) -> list[dict]:
    out = lab.host_exec("pve1", "sh", "-c", "cat /run/gpugate/holders.log 2>/dev/null || true").stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_two_overlapping_transitions_cannot_pass_their_gates_together(lab):
    ct129, ct130 = connectors(lab, 129, 130)
    try:
        ok, message = hold(ct129, range(GPUS), "run-129", python="/usr/bin/python3", grace_s=20)
        assert ok, message
        hand_off(ct129, "run-129", {"tp": GPUS})
        # ct 130 wants GPUs 0-1 while 129's transition runs: refused before anything is touched
        ok, message = hold(ct130, range(2), "run-130", python="/usr/bin/python3", grace_s=5)
        assert not ok
        assert message.startswith("GPU 0 of pve1 is claimed by container 129 (run run-129, GPU 0-3)"), message
        assert "ct 130 did not begin run run-130; nothing was touched" in message
        assert ct_sh(lab, "pve1", 130, "ls /var/lib/gpugate/runs 2>/dev/null || true").stdout.strip() == ""
        # 129's run ends (its new server verified): the agent's wait returns and the holder lets go
        wait_for(lambda: [r["run"] for r in host_holders_log(lab)] == ["run-129"], timeout_s=60,
                 what="the holder of run-129 released")
        released = host_holders_log(lab)[0]
        assert json.loads(released["wait_answer"])["outcome"] == "verified", released
        assert health(lab, 129) == 200
        ok, message = hold(ct130, range(2), "run-130b", python="/usr/bin/python3", grace_s=1)
        assert ok, message  # free again (no run-130b follows: the holder lets go after grace_s)
    finally:
        for host in (ct129, ct130):
            host.disconnect()
        stop_servers(lab)


# ---------------------------------------------------------------- input: an unknown host key


def test_an_unknown_host_key_is_refused_unless_relaxed_explicitly(lab, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    port = lab.host("pve1").port
    def text(relax: str) -> str:
        return (f"hosts:\n  pve1:\n    ssh: {{hostname: 127.0.0.1, port: {port}, user: root, "
                f"key: {lab.host('pve1').key}, known_hosts_file: {empty}{relax}}}\n    containers:\n      129: {{}}\n")

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(text(""))
    run = dataclasses.replace(lab, fleet_path=fleet).pyinfra("inventory.py", "exec", "--", "hostname", timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert "gpugate does not trust an unknown host key" in output and "strict_host_key_checking: accept-new" in output
    assert empty.read_text() == ""  # nothing learnt behind the operator's back
    fleet.write_text(text(", strict_host_key_checking: accept-new"))
    run = dataclasses.replace(lab, fleet_path=fleet).pyinfra("inventory.py", "exec", "--", "hostname", timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ct129" in run.stdout + run.stderr
    assert f"[127.0.0.1]:{port}" in empty.read_text()  # explicitly relaxed: the key is learnt


# ---------------------------------------------------------------- input: --data through the real CLI


@pytest.mark.parametrize(("data", "said"), [
    ("drain_timeout_s=abc", "setting drain_timeout_s='abc': expected a number, got 'abc' (str)"),
    ("rolling=maybe", "setting rolling='maybe': expected true or false (or yes/no, 1/0)"),
    ("drain_timout_s=5", "setting drain_timout_s=5: unknown setting (did you mean drain_timeout_s?)"),
])
def test_bad_data_on_the_command_line_is_refused_in_one_line(lab, data, said):
    def runs() -> str:
        return ct_sh(lab, "pve1", 129, "ls /var/lib/gpugate/runs 2>/dev/null || true").stdout

    before = runs()
    run = lab.pyinfra("inventory.py", "deploy.py", "--data", data, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert said in output and "Traceback" not in output
    assert runs() == before  # no transition began


def test_the_lab_inventory_passes_the_settings_check(lab):
    run = lab.pyinfra("inventory.py", "deploy.py", "--dry", "--data", "rolling=no", timeout=120)
    output = run.stdout + run.stderr
    assert "unknown setting" not in output and "setting rolling" not in output, output
