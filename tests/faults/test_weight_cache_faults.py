"""Failures around the weight cache and the gated launch (issue 22), each with real processes killed
at real moments, through the real pyinfra CLI. Each ends in the new server verified, the last good
one serving again, or a loud NOTHING SERVES, and never in a client start against daemons of
another key (SGLang's hard error):

- a daemon killed while the new engine loads on its weights (the engine's liveness watchdog ends
  it): rolled back, with daemons of the old key started again;
- a daemon of another key, started by hand on the server's GPUs: refused before anything is
  touched; with ``end_other_gpu_holders`` it is ended and the deploy goes through;
- daemons whose ``.ready`` never comes (the start timeout): rolled back to the cold server, the
  loading daemons stopped;
- an engine that never reaches its gated launch: ended before the old server is stopped;
- an engine that crashes after its activation (its KV pool does not fit): rolled back, the daemons kept.
"""

from __future__ import annotations

import shlex
import time

import pytest

from tests.conftest import module_lab
from tests.e2e.lab_processes import ct_sh, start_in_container
from tests.faults.conftest import OnJournal, deploy_args, pyinfra

pytestmark = [pytest.mark.lab, pytest.mark.faults]

TP2 = {"tp": 2}
FP8 = {"tp": 2, "kv-cache-dtype": "fp8_e4m3"}
ENV = {"SGLANG_STANDIN_LOAD_S": "0.3", "SGLANG_STANDIN_WEIGHT_LOAD_S": "0.5", "SGLANG_STANDIN_DAEMON_LIVENESS_S": "0.1"}
CACHE = {"sglang_weight_cache": True}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-weight-cache-faults", hosts=1, gpus=2)


def ps(lab) -> list[tuple[int, int, str]]:
    return [(pid, ppid, cmd) for pid, ppid, cmd, _argv in lab.ps("pve1", 129)]


def daemons(lab) -> tuple[list[int], list[int]]:
    """(launcher pids, daemon child pids) in the container."""
    rows = ps(lab)
    launchers = [pid for pid, _, cmd in rows if "sglang.srt.weight_cache.daemon" in cmd]
    children = [pid for pid, ppid, cmd in rows if ppid in launchers and "spawn_main" in cmd]
    return launchers, children


def engine_flags(lab) -> list[str]:
    return [cmd for _, _, cmd in ps(lab) if "sglang.launch_server" in cmd]


def serving(lab) -> bool:
    return ct_sh(lab, "pve1", 129, "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:30000/health").stdout == "200"


def reset(lab) -> None:
    """Start from the cached server on tp 2 (the module's tests share the lab)."""
    run = pyinfra(lab, deploy_args(TP2, ENV, CACHE))
    assert run.returncode == 0, run


def test_a_daemon_killed_while_the_new_engine_maps_its_weights_rolls_back_with_new_daemons(lab):
    reset(lab)
    launchers, children = daemons(lab)
    assert len(launchers) == 1 and len(children) == 2

    def kill_a_daemon(_process) -> None:
        ct_sh(lab, "pve1", 129, f"kill -9 {children[0]}")

    def release() -> None:
        lab.fault("pve1", 129, "slow-start", clear=True)

    lab.fault("pve1", 129, "slow-start=60")  # the new engine holds in its load, on the daemons' weights
    try:
        # the rollback's start is let go as its agent begins it, not once the console says so (its next follow)
        with OnJournal(lab, "rollback", "begin", release):
            run = pyinfra(lab, deploy_args(FP8, ENV, CACHE), when=[("it loads now", kill_a_daemon)])
    finally:
        lab.fault("pve1", 129, "slow-start", clear=True)
    assert run.returncode != 0, run
    assert "the previous server serves again" in run.output, run
    assert serving(lab)
    after_launchers, after_children = daemons(lab)
    assert len(after_children) == 2 and after_launchers != launchers, (launchers, after_launchers)
    assert not any("fp8_e4m3" in cmd for cmd in engine_flags(lab)), engine_flags(lab)


STRANGER: list = []  # the tests of this module run in order, on the state the one before left


def test_a_daemon_of_another_key_on_the_gpus_is_refused_and_left_untouched(lab):
    cold = pyinfra(lab, deploy_args(TP2, ENV))  # a server without cache; then a daemon by hand on its GPUs
    assert cold.returncode == 0, cold
    stranger = start_in_container(lab, "pve1", 129, "env SGLANG_STANDIN_WEIGHT_LOAD_S=0.1 python3 -m "
                                  "sglang.srt.weight_cache.daemon --model-path /opt/models/lab-model --tp-size 2 "
                                  "--dtype float16", "stranger-daemon")
    deadline = time.monotonic() + 20
    while len(daemons(lab)[1]) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    before = engine_flags(lab)
    run = pyinfra(lab, deploy_args(FP8, ENV, CACHE))
    assert run.returncode != 0 and "REFUSED, nothing touched" in run.output, run
    assert "which this server needs" in run.output, run
    assert stranger.alive() and engine_flags(lab) == before and serving(lab)
    STRANGER.append(stranger)


def test_a_daemon_of_another_key_is_ended_when_the_operator_allows_it(lab):
    stranger = STRANGER.pop()  # left by the test before: a daemon by hand on the server's GPUs
    assert stranger.alive()
    run = pyinfra(lab, deploy_args(FP8, ENV, {**CACHE, "end_other_gpu_holders": True}))
    assert run.returncode == 0, run
    assert not stranger.alive()
    assert any("fp8_e4m3" in cmd and "--weight-cache-mode client" in cmd for cmd in engine_flags(lab))
    log = ct_sh(lab, "pve1", 129, "cat /var/log/gpugate/sglang-30000.log").stdout.split("=== gpugate start")[-1]
    assert "Zero-copy: mapped" in log and "mismatch" not in log.lower(), log


def test_daemons_that_never_get_ready_roll_back_to_the_cold_server_and_are_stopped(lab):
    cold = pyinfra(lab, deploy_args(TP2, ENV, {"sglang_weight_cache": False}))
    assert cold.returncode == 0, cold
    slow = dict(ENV, SGLANG_STANDIN_WEIGHT_LOAD_S="60")
    run = pyinfra(lab, deploy_args(FP8, slow, {**CACHE, "start_timeout_s": 3}))
    assert run.returncode != 0, run
    assert "the weight cache was not ready within 3s" in run.output, run
    assert "the previous server serves again" in run.output, run
    assert daemons(lab) == ([], []) and serving(lab)
    assert ct_sh(lab, "pve1", 129, "ls /tmp | grep -c sglang_weight_cache || true").stdout.strip() == "0"


def test_an_engine_that_never_reaches_its_gate_is_ended_and_the_old_server_never_stopped(lab):
    reset(lab)
    before = engine_flags(lab)
    stuck = dict(ENV, SGLANG_STANDIN_DIST_INIT_S="60")
    run = pyinfra(lab, deploy_args(FP8, stuck, {**CACHE, "start_timeout_s": 3}))
    assert run.returncode != 0, run
    assert "did not reach its gated launch within 3s" in run.output, run
    assert "refused by the agent, nothing touched" in run.output and "stopping :30000" not in run.output, run
    assert serving(lab) and engine_flags(lab) == before  # the old server, never stopped; the gated one ended


def test_an_engine_that_crashes_after_its_activation_rolls_back(lab):
    reset(lab)
    launchers, children = daemons(lab)
    # its KV pool cannot be allocated (SGLang's "Not enough memory"): a crash after the activation
    crashing = dict(FP8, **{"mem-fraction-static": 0.02})
    run = pyinfra(lab, deploy_args(crashing, ENV, CACHE))
    assert run.returncode != 0, run
    assert "the gated engine activated" in run.output and "the previous server serves again" in run.output, run
    assert "rollback: weight cache kept" in run.output, run
    assert serving(lab)
    assert daemons(lab) == (launchers, children)  # the key never changed: the weights stayed


# Waits in the container for an engine started with --gated-launch-port and listens on that port at once
# (the port free_port chose, read from the engine's own argv): taken before the engine's imports end.
GATE_SQUATTER = """
import os, socket, time
port = None
while port is None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open("/proc/%s/cmdline" % pid, "rb").read().split(b"\\0")
        except OSError:
            continue
        if b"--gated-launch-port" in argv:
            port = int(argv[argv.index(b"--gated-launch-port") + 1])
            break
    else:
        time.sleep(0.02)
listener = socket.socket()
listener.bind(("127.0.0.1", port))
listener.listen()
print("listening on", port, flush=True)
time.sleep(3600)
"""


def test_a_gate_port_taken_before_the_gated_engine_binds_it_falls_back_to_an_ordinary_start(lab):
    reset(lab)
    # started before the deploy, it takes the gate port within a poll of the engine's start; the engine
    # binds it after 1.5 s of imports (the controller's "started the new engine gated" line may come 3 s
    # after the start: acting on it needed 5 s of imports)
    squatter = start_in_container(lab, "pve1", 129, f"python3 -c {shlex.quote(GATE_SQUATTER)}", "gate-squatter")
    slow_import = dict(ENV, SGLANG_STANDIN_IMPORT_S="1.5")
    try:
        run = pyinfra(lab, deploy_args(FP8, slow_import, CACHE))
        assert run.returncode == 0, run
        assert "listening on" in squatter.log(), squatter.log()
        assert "the gated engine's gate port is taken by pid" in run.output and "an ordinary start instead" in run.output, run
        assert serving(lab) and any("fp8_e4m3" in cmd for cmd in engine_flags(lab))
        assert squatter.alive()  # never ours to end
    finally:
        squatter.kill()
