"""Issue 32, "not yet tried": the gated launch's and the weight cache's failures behind a real smg,
each at the moment it can hurt, through the REAL pyinfra CLI, with the real ``openai`` client (and
SGLang's /generate) sending requests through smg during every deploy. One lab host, four containers
of 2 GPUs each, all behind smg: 129 and 130 are gated launches on a weight cache (the process
supervisor), 131 runs the weight cache under systemd (its PID 1 is Debian's systemd), 132 is a
gated launch that serves while the others fail (and fails last). The tests run in order, each from
the state the previous one left, as an operator's successive runs would; several containers fail
in one deploy (pyinfra runs them at once), which keeps the module to a few deploys.

How each ends is judged as an operator would: the new server verified, the last good one serving
again, or a loud NOTHING SERVES with both reasons; zero failed requests through smg while another
replica serves (a server leaves smg before anything stops); no engine left waiting at its gate; the
next deploy converges without a flag. Budgets are the fleet's per-container ``data:``, a second or
two, never a production timeout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT, Lab, LabHost, lab_unavailable_reason, pyinfra_exe
from tests.e2e.lab_processes import ct_sh
from tests.e2e.test_router_lab import Client, listed_healthy, server_info, workers
from tests.e2e.test_weight_cache_lab import wait_for

pytestmark = [pytest.mark.lab, pytest.mark.slow]

VMIDS = (129, 130, 131, 132)
SYSTEMD = 131  # the container whose PID 1 is systemd: the weight cache as its own unit
ENV = {"SGLANG_STANDIN_LOAD_S": "0.3", "SGLANG_STANDIN_WEIGHT_LOAD_S": "0.3", "SGLANG_STANDIN_DRAIN_TICK_S": "0.2",
       "SGLANG_STANDIN_SCHEDULER_EXIT_S": "0.1", "SGLANG_STANDIN_TOKEN_S": "0.01"}
FP8 = {"kv-cache-dtype": "fp8_e4m3"}
RUNS = "/var/lib/gpugate/runs"


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    reason = lab_unavailable_reason()
    if reason:
        pytest.skip(reason)
    if not os.path.exists("/lib/systemd/systemd"):
        pytest.skip("no /lib/systemd/systemd on this machine (scripts/bootstrap installs it)")
    from gpugate_lab import container, core

    lab_dir = tmp_path_factory.mktemp("lab-router-gated")
    # smg marks a worker unhealthy at its first failed health check (default: the third, 3 s): the
    # steps that crash 131 wait until smg stops sending it requests before a client starts
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("GPUGATE_LAB_SMG_ARGS", os.environ.get("GPUGATE_LAB_SMG_ARGS", "") + " --health-failure-threshold 1")
            state = core.up(lab_dir, hosts=1, gpus=8, vmids=VMIDS, router=True)
        lab = Lab(dir=Path(state["dir"]), hosts=[LabHost(h["name"], h["port"], h["key"], h["known_hosts"])
                                                 for h in state["hosts"]], fleet_path=Path(state["fleet"]))
        assert lab.pct("pve1", "stop", str(SYSTEMD)).returncode == 0
        container.set_init_flavour(core.host_dir(lab.dir, "pve1"), SYSTEMD, "systemd")
        assert lab.pct("pve1", "start", str(SYSTEMD)).returncode == 0
        assert wait_for(lambda: sh(lab, SYSTEMD, "systemctl is-system-running").strip() in ("running", "degraded"), 30)
        yield lab, state["router"]
    finally:
        core.down(lab_dir)


# ---------------------------------------------------------------- what the operator declares and runs
DESIRED: dict[int, dict] = {vmid: {} for vmid in VMIDS}  # each container's change, as the last step left it


def write_fleet(lab: Lab, router: dict, **changes: dict) -> None:
    """The lab's fleet, every server on a weight cache with the fast stand-in's env; ``changes``
    (``c129={"flags": ..., "env": ..., "data": ...}``) replace that container's change from then on."""
    from gpugate_lab import core

    DESIRED.update({int(key[1:]): value for key, value in changes.items()})
    doc = core.fleet_document(lab.dir, [(h.name, h.port) for h in lab.hosts], {"pve1": list(VMIDS)}, router=router)
    for vmid, entry in doc["hosts"]["pve1"]["containers"].items():
        change = DESIRED[vmid]
        entry["sglang"].update(env=dict(ENV, **change.get("env", {})), weight_cache=True)
        entry["sglang"]["flags"].update(change.get("flags", {}))
        if change.get("data"):
            entry["data"] = change["data"]
    path = lab.dir / "fleet.gated.yaml"
    path.write_text(yaml.safe_dump(doc))
    lab.fleet_path = path


def deploy_argv(*extra: str) -> list[str]:
    return [pyinfra_exe(), "-y", "inventory.py", "deploy.py", "--data", "router_join_timeout_s=20", *extra]


def deploy(lab: Lab, *extra: str) -> tuple[int, str]:
    result = subprocess.run(deploy_argv(*extra), cwd=REPO_ROOT, env=lab.env(), capture_output=True, text=True,
                            timeout=240, stdin=subprocess.DEVNULL)
    return result.returncode, log_run(lab, " ".join(extra), result.stdout + result.stderr)


def log_run(lab: Lab, what: str, out: str) -> str:
    with open(lab.dir / "deploys.log", "a") as log:  # every run's output, for a failure's post-mortem
        log.write(f"=== {time.strftime('%H:%M:%S')} deploy {what}\n{out}")
    return out


def of(out: str, vmid: int) -> str:
    """The lines of one container in a run's output."""
    return "\n".join(line for line in out.splitlines() if f"[@pct/pve1:{vmid}]" in line)


# ---------------------------------------------------------------- what runs in a container
def sh(lab: Lab, vmid: int, script: str) -> str:
    return ct_sh(lab, "pve1", vmid, script).stdout


def mains(lab: Lab, vmid: int) -> list[int]:
    """The engine main processes of the container (a gated engine waiting at its gate is one)."""
    return sorted(pid for pid, _ppid, cmd, _argv in lab.ps("pve1", vmid) if cmd.startswith("/usr/bin/python3 -m sglang.launch_server"))


def daemons(lab: Lab, vmid: int) -> list[int]:
    """The weight cache's daemon children (one per GPU), under their launcher."""
    out = sh(lab, vmid, "ps -eo pid=,args= | grep 'spawn_main' | grep -v grep | awk '{print $1}'")
    return sorted(int(pid) for pid in out.split())


def unit(lab: Lab, name: str) -> dict[str, str]:
    out = sh(lab, SYSTEMD, f"systemctl show {name} -p ActiveState -p MainPID -p NRestarts")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


ENGINE_UNIT, CACHE_UNIT = "sglang-30000.service", "sglang-weight-cache-30000.service"


def url(router: dict, vmid: int) -> str:
    return f"http://127.0.0.1:{router['ports'][f'pve1:{vmid}']}"


def healthy(router: dict, vmid: int) -> bool:
    try:
        with urllib.request.urlopen(url(router, vmid) + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def at_agent_step(lab: Lab, vmid: int, event: str, action: str) -> subprocess.Popen:
    """A watcher in the container that runs the shell ``action`` the moment the journal of the
    container's NEXT run holds ``event`` (a JSON fragment such as ``"step":"drain","phase":"begin"``):
    the moment itself, not when the controller's follow prints it (its lines come in 3 s batches).
    ``$GATED`` is that run's gated engine's pid. wait() it to know the moment has passed."""
    from gpugate_lab import core

    before = sh(lab, vmid, f"cat {RUNS}/latest 2>/dev/null").strip()
    journal = f"{RUNS}/$r.jsonl"
    script = (f"while :; do r=$(cat {RUNS}/latest 2>/dev/null); "
              f"[ \"$r\" != '{before}' ] && grep -qF '{event}' {journal} 2>/dev/null && break; sleep 0.02; done; "
              f"GATED=$(grep -F '\"step\":\"gated\",\"phase\":\"begin\"' {journal} | sed 's/.*\"pid\":\\([0-9]*\\).*/\\1/'); "
              f"{action}")
    return subprocess.Popen(core.host_exec_argv(lab.dir, "pve1") + ["pct", "exec", str(vmid), "--", "sh", "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)


SEEN: dict[str, object] = {}  # what a step saw that a later one compares with


# ---------------------------------------------------------------- the steps
def test_first_start_of_four_routed_servers_one_under_systemd(routed):
    """Every server starts on its weight cache and is added to smg once verified; a gated launch with
    nothing running says so (before: "while the old one serves", on a first start too)."""
    lab, router = routed
    write_fleet(lab, router)
    code, out = deploy(lab)
    assert code == 0, out
    assert out.count("router lab: verified: adding it") == 4, out
    assert "; no server runs on :30000 (a first start, or after NOTHING SERVES)" in of(out, 129), out
    assert "while the old one serves" not in out and "started the new engine gated" not in of(out, SYSTEMD), out
    assert wait_for(lambda: len(listed_healthy(router)) == 4, 10), workers(router)
    assert unit(lab, ENGINE_UNIT)["ActiveState"] == unit(lab, CACHE_UNIT)["ActiveState"] == "active"


def test_a_hang_before_the_gate_a_drain_that_frees_nothing_and_a_systemd_engine_only_change(routed):
    """Three containers fail or change in one deploy while 132 serves:

    - 129: the new engine hangs in its distributed init, before its gate (start_timeout_s 1): it is
      ended, the old server (left out of smg first) was never stopped, and it is re-added;
    - 130: the old server's drain fails (SIGTERM ignored) and its memory is never released (stuck):
      the gated engine holds its contexts at its gate while the GPU gate times out; it is ended, the
      rollback's gate times out too: NOTHING SERVES with both reasons, left out of smg, said;
    - 131 (systemd): a flag that keeps the weight cache's key restarts the engine's unit only; the
      weight cache's unit and its daemons stay, and it rejoins.
    """
    lab, router = routed
    before = {vmid: mains(lab, vmid) for vmid in (129, 130)}
    cache_before = unit(lab, CACHE_UNIT)
    daemons_before = daemons(lab, SYSTEMD)
    seed_129 = server_info(router, 129)["random_seed"]
    write_fleet(lab, router, c129={"flags": FP8, "env": {"SGLANG_STANDIN_DIST_INIT_S": "60"}, "data": {"start_timeout_s": 1}},
                c130={"flags": FP8, "data": {"drain_timeout_s": 1, "kill_grace_s": 1, "gpu_gate_timeout_s": 1}},
                c131={"flags": FP8})
    lab.fault("pve1", 130, "ignore-sigterm")
    lab.fault("pve1", 130, "stuck-memory")  # the memory of its running server (and daemons) as they stop
    try:
        with Client(router["url"], streams=1) as client:
            code, out = deploy(lab)
    finally:
        lab.fault("pve1", 130, "all", clear=True)
    assert code != 0, out
    assert client.failed == 0 and client.ok > 20, (client.failed, client.errors[:5], out)

    one = of(out, 129)
    assert "refused by the agent, nothing touched: the new server failed before its gated launch: the server did " \
           "not reach its gated launch within 1s; the old server was never stopped" in one, one
    assert "ended the gated engine, never activated" in one and "stopping" not in one, one
    assert "router lab: the agent touched nothing: the old server still serves: re-adding it" in one, one
    assert mains(lab, 129) == before[129], "the old server, the same process; no engine left at a gate"
    assert server_info(router, 129)["random_seed"] == seed_129 and url(router, 129) in listed_healthy(router)

    two = of(out, 130)
    assert "drain deadline passed" in two and "ended the gated engine, never activated" in two, two
    assert "!! NOTHING SERVES on :30000" in two and "!!   the desired server failed: GPU gate did not pass within 1s" \
           in two and "!!   the rollback: rollback failed: GPU gate did not pass within 1s" in two, two
    assert "router lab: left out of the router (http://127.0.0.1:" in two, two
    assert mains(lab, 130) == [] and daemons(lab, 130) == [], "nothing runs, nothing waits at a gate"
    assert url(router, 130) not in listed_healthy(router), workers(router)

    three = of(out, SYSTEMD)
    assert "weight cache kept: the key is unchanged" in three and "started pid" in three, three
    assert "back in router lab, listed healthy" in three, three
    assert unit(lab, CACHE_UNIT) == cache_before and daemons(lab, SYSTEMD) == daemons_before
    assert unit(lab, ENGINE_UNIT)["NRestarts"] == "0" and server_info(router, SYSTEMD)["kv_cache_dtype"] == "fp8_e4m3"


def test_a_crash_right_after_activation_a_rerun_after_nothing_serves_and_a_dead_daemon_under_systemd(routed):
    """131's weight cache loses a daemon (SIGKILL): SGLang's liveness watchdog ends its engine, and
    systemd's restart of the engine alone cannot map daemons that are gone. Then, in one deploy:

    - 129: the gated engine crashes right after its activation (its KV pool does not fit): rolled
      back on the same daemons and re-added;
    - 130 (the cause fixed): the re-run needs no flag: started, verified, added;
    - 131: the daemons and the engine restarted, verified, re-added.
    """
    lab, router = routed
    sh(lab, SYSTEMD, f"kill -9 {daemons(lab, SYSTEMD)[0]}")
    assert wait_for(lambda: unit(lab, ENGINE_UNIT)["MainPID"] == "0", 15), unit(lab, ENGINE_UNIT)
    assert wait_for(lambda: url(router, SYSTEMD) not in listed_healthy(router), 15), workers(router)
    daemons_129 = daemons(lab, 129)
    write_fleet(lab, router, c129={"flags": dict(FP8, **{"mem-fraction-static": 0.02})})
    with Client(router["url"], streams=1) as client:
        code, out = deploy(lab)
    assert code != 0, out
    assert client.failed == 0 and client.ok > 20, (client.failed, client.errors[:5], out)

    one = of(out, 129)
    assert "the gated engine activated" in one and "Not enough memory" in one and "ROLLED BACK" in one, one
    assert "rollback: weight cache kept" in one, one
    assert "router lab: rolled back: the previous server serves again: re-adding it" in one, one
    assert "back in router lab, listed healthy" in one and daemons(lab, 129) == daemons_129, one
    assert len(mains(lab, 129)) == 1 and "mem_fraction_static" in server_info(router, 129)
    assert server_info(router, 129)["mem_fraction_static"] != 0.02

    two = of(out, 130)
    assert "verified: the running argv and /get_server_info match the desired flags" in two, two
    assert "router lab: verified: adding it" in two and "back in router lab" in two, two

    three = of(out, SYSTEMD)
    assert "weight cache (re)starts: the daemons are gone" in three and "weight cache ready on every GPU" in three, three
    assert "verified" in three and "back in router lab, listed healthy" in three, three
    assert unit(lab, CACHE_UNIT)["ActiveState"] == "active" and len(daemons(lab, SYSTEMD)) == 2
    assert wait_for(lambda: len(listed_healthy(router)) == 4, 10), workers(router)
    SEEN["cache_131"] = unit(lab, CACHE_UNIT)


def test_the_controller_killed_while_a_gated_engine_waits_and_another_gated_engine_killed_at_its_gate(routed):
    """131's engine is SIGKILLed under systemd (out of smg's selection first); then two operators'
    deploys at once, while 130 serves:

    - 129: the old server drains slowly (SIGTERM ignored, held) while the new gated engine waits at
      its gate, and at that moment the controller (the whole `pyinfra` process group) is SIGKILLed.
      The container's agent goes on. The re-run, at once and with no flag, follows the run still in
      progress instead of starting another (the drain ends once it follows), and adds the server
      back to smg when it ended verified;
    - 132: the old server's drain fails (SIGTERM ignored, 2 s, then SIGKILL) and the new gated engine
      is SIGKILLed at its gate meanwhile. Said as what it is, a crash of the new server at its gate
      (before: "POST /gate/activate on :P: ConnectionRefusedError", or the OLD server's last log line
      "Gracefully exiting..." given as the new one's reason); rolled back, re-added.
    """
    lab, router = routed
    SEEN["engine_131"] = unit(lab, ENGINE_UNIT)
    sh(lab, SYSTEMD, f"kill -9 {SEEN['engine_131']['MainPID']}")  # systemd restarts it after RestartSec (5 s)
    assert wait_for(lambda: url(router, SYSTEMD) not in listed_healthy(router), 15), workers(router)
    old = {vmid: mains(lab, vmid) for vmid in (129, 132)}
    write_fleet(lab, router, c129={"flags": FP8, "data": {"drain_timeout_s": 30}},
                c132={"flags": FP8, "data": {"drain_timeout_s": 2, "kill_grace_s": 1}})
    for vmid in (129, 132):
        lab.fault("pve1", vmid, "ignore-sigterm")
    at_gate = at_agent_step(lab, 129, '"step":"drain","phase":"begin"', "echo at-gate $GATED")
    killer = at_agent_step(lab, 132, '"step":"drain","phase":"begin"', "kill -9 $GATED; echo killed $GATED")
    started: list[subprocess.Popen] = []

    def start(*extra: str) -> subprocess.Popen:
        started.append(subprocess.Popen(deploy_argv(*extra), cwd=REPO_ROOT, env=lab.env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
                                        start_new_session=True))
        return started[-1]

    try:
        with Client(router["url"], streams=1) as client:
            other = start("--limit", "@pct/pve1:132")
            first = start("--limit", "@pct/pve1:129")
            gated = int(at_gate.communicate(timeout=60)[0].split()[-1])
            os.killpg(first.pid, signal.SIGKILL)  # the controller, killed: no Ctrl-C, no clean-up
            first_out = log_run(lab, "129 (killed at the gate)", first.communicate(timeout=30)[0])
            assert gated not in old[129] and mains(lab, 129) == sorted(old[129] + [gated]), mains(lab, 129)
            rerun, lines = start("--limit", "@pct/pve1:129"), []
            for line in rerun.stdout:
                lines.append(line)
                if "will attach: a transition runs in the container" in line:
                    lab.fault("pve1", 129, "ignore-sigterm", clear=True)  # its drain ends: the run goes on
            rerun.wait(timeout=60)
            out = log_run(lab, "129 (re-run)", "".join(lines))
            other_out = log_run(lab, "132", other.communicate(timeout=60)[0])
        killed = killer.communicate(timeout=10)[0]
    finally:
        for proc in started + [at_gate, killer]:
            if proc.poll() is None:
                proc.kill()
        lab.fault("pve1", 129, "ignore-sigterm", clear=True)
        lab.fault("pve1", 132, "ignore-sigterm", clear=True)
    assert client.failed == 0 and client.ok > 20, (client.failed, client.errors[:5], out, other_out)

    assert first.returncode == -signal.SIGKILL, first_out
    assert rerun.returncode == 0, out
    assert "will attach: a transition runs in the container" in out and "following run" in out, out
    assert f"started pid {gated}: the gated engine activated" in out and "verified" in out, out
    # smg still lists it draining (the killed controller's DELETE, within smg's settle time) or not at all:
    # either way no membership, and it is added (before: while draining, nothing; exit 0, out of smg)
    assert re.search(r"router lab: the run it followed ended verified, (not listed: adding it|listed draining \(taken "
                     r"out before the run, by a controller that is gone\): re-adding it)", out), out
    assert "back in router lab, listed healthy" in out, out
    assert mains(lab, 129) == [gated], "the activated engine serves; nothing else runs, nothing waits at a gate"
    assert server_info(router, 129)["kv_cache_dtype"] == "fp8_e4m3" and url(router, 129) in listed_healthy(router)

    assert other.returncode != 0 and "killed" in killed, (killed, other_out)
    assert "drain deadline passed" in other_out and "the desired server failed: the server exited at its gate (not " \
           "yet activated) with code -9: killed by SIGKILL (signal 9)" in other_out, other_out
    assert "Gracefully exiting" not in other_out.split("log tail of the failed start")[0], other_out
    assert "rollback: verified" in other_out and "re-adding it" in other_out, other_out
    assert "back in router lab, listed healthy" in other_out, other_out
    assert server_info(router, 132).get("kv_cache_dtype") != "fp8_e4m3" and len(mains(lab, 132)) == 1


def test_the_next_deploy_converges_without_a_flag_and_systemd_restarted_the_engine_on_its_daemons(routed):
    """131's engine, SIGKILLed in the step before, was restarted by systemd (Restart=on-failure) on the
    same weight-cache daemons, under the same unit, and serves as desired again. With 132's change
    taken back (what serves there is the rollback's), the next deploy of the whole fleet, no flag,
    finds every server as desired and in smg: nothing to do."""
    lab, router = routed
    assert wait_for(lambda: healthy(router, SYSTEMD), 20), unit(lab, ENGINE_UNIT)
    engine, killed = unit(lab, ENGINE_UNIT), SEEN["engine_131"]
    assert engine["MainPID"] != killed["MainPID"] and int(engine["NRestarts"]) == int(killed["NRestarts"]) + 1, engine
    assert unit(lab, CACHE_UNIT) == SEEN["cache_131"]
    write_fleet(lab, router, c132={})
    with Client(router["url"], streams=1) as client:
        code, out = deploy(lab)
    assert code == 0, out
    assert client.failed == 0, (client.failed, client.errors[:5], out)
    for vmid in VMIDS:
        assert "will " not in of(out, vmid) and "router lab:" not in of(out, vmid), of(out, vmid)
    assert unit(lab, CACHE_UNIT) == SEEN["cache_131"] and server_info(router, SYSTEMD)["kv_cache_dtype"] == "fp8_e4m3"
    assert wait_for(lambda: len(listed_healthy(router)) == 4, 10), workers(router)
    assert all(len(mains(lab, vmid)) == 1 for vmid in VMIDS)
