"""Faults at the start (crash, never healthy, a rollback that fails too), the SSH connection dropping
mid-transition, and two operators at once: the real pyinfra CLI against one lab host.

A lab fault applies to the container, so to every start; for "the NEW flags fail" the test clears the
fault at the moment the rollback begins (the stand-in reads its faults when a server starts), so
that the previous flags start cleanly, as they would when only the new flags are at fault.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import module_lab
from tests.faults.conftest import (FLAGS, FP8, PORT, deploy, ensure_serving, flag_value, gpu_used, health,
                                   log_starts, main_pid, running_argv, said, sglang_processes, sh,
                                   state_file, wait_until)

pytestmark = [pytest.mark.faults, pytest.mark.lab]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "faults-start", hosts=1, gpus=8)


@pytest.fixture
def serving(lab):
    pid = ensure_serving(lab)
    yield pid
    lab.fault("pve1", 129, "all", clear=True)


def clear_fault_at_rollback(lab, name):
    return ("rolling back to the previous flags", lambda _: lab.fault("pve1", 129, name, clear=True))


def assert_rolled_back(lab, run, serving_pid):
    """The previous flags serve again (a new process), the state file says what runs and what was tried."""
    assert run.returncode != 0, run.output
    said(run, "rolled back: the previous server serves again", "Log tail of the failed start:")
    assert health(lab) == 200 and main_pid(lab) != serving_pid
    assert "--kv-cache-dtype" not in running_argv(lab)
    state = state_file(lab)
    assert state["phase"] == "rolled back"
    assert state["current"]["flags"] == {"tp-size": 8}  # what runs: the restored spec
    assert state["attempted"]["flags"] == {"tp-size": 8, "kv-cache-dtype": "fp8_e4m3"}  # what failed
    assert "lock" not in json.dumps(sh(lab, "pve1", 129, "ls /run/gpugate").stdout)  # released
    rerun = deploy(lab, FLAGS)  # the recorded state agrees with what runs: nothing to do
    assert rerun.returncode == 0 and "No changes" in rerun.output, rerun.output


def test_new_flags_crash_at_start_rollback_serves_again(lab, serving):
    lab.fault("pve1", 129, "crash-on-start")
    run = deploy(lab, FP8, when=[clear_fault_at_rollback(lab, "crash-on-start")])
    said(run, "crashed during start", "RuntimeError: CUDA error: an illegal memory access was encountered")
    assert_rolled_back(lab, run, serving)


def test_new_flags_never_healthy_rollback_serves_again(lab, serving):
    lab.fault("pve1", 129, "never-healthy")
    run = deploy(lab, FP8, data={"start_timeout_s": 2}, when=[clear_fault_at_rollback(lab, "never-healthy")])
    said(run, "not healthy within 2 s (last phase: starting)", "/health stays 503")
    assert_rolled_back(lab, run, serving)


def test_rollback_unhealthy_too_is_stopped_and_gated(lab, serving):
    lab.fault("pve1", 129, "never-healthy")  # kept: the previous flags fail as well
    run = deploy(lab, FP8, data={"start_timeout_s": 2})
    assert run.returncode != 0, run.output
    said(run, "the rollback server was not healthy within 2 s (last phase: starting): stopping it too",
         "so it was stopped and the GPUs gated free: NOTHING SERVES on :30000 now",
         "log tail of the failed start:", "log tail of the rollback:")
    assert sglang_processes(lab) == [] and gpu_used(lab) == [0] * 8
    state = state_file(lab)
    assert state["phase"] == "stopped: the rollback failed too" and state["current"] is None
    assert state["attempted"]["flags"]["kv-cache-dtype"] == "fp8_e4m3"
    assert state["previous"]["flags"] == {"tp-size": 8}
    lab.fault("pve1", 129, "never-healthy", clear=True)
    run = deploy(lab, FP8)  # the cause is gone: a re-run serves the desired flags
    assert run.returncode == 0, run.output
    assert flag_value(running_argv(lab), "--kv-cache-dtype") == "fp8_e4m3"


def drop_ssh(lab):
    """Kill the lab host's sshd session processes (not the listener): the connection drops as on a
    network failure; what runs in the container through it is not killed."""
    out = lab.host_exec("pve1", "sh", "-c", "pgrep -f '^sshd: root' || true")
    for pid in out.stdout.split():
        lab.host_exec("pve1", "kill", "-9", pid)


def expire_lock(lab):
    """Move the dead run's lease into the past: what its expiry would do after drain + grace + 60 s."""
    script = ("import json; p='/run/gpugate/sglang-%d.lock'; d=json.load(open(p)); d['expires']=0; "
              "open(p,'w').write(json.dumps(d)); print(d['owner'], d['step'])" % PORT)
    return sh(lab, "pve1", 129, f'python3 -c "{script}"').stdout.strip()


def test_ssh_drop_mid_transition_rerun_takes_over_the_stale_lock_and_converges(lab, serving):
    lab.fault("pve1", 129, "ignore-sigterm")  # the stop takes drain_timeout_s: the drop lands inside it
    starts = log_starts(lab)
    run = deploy(lab, FP8, data={"drain_timeout_s": 3}, when=[("stopping pid", lambda _: drop_ssh(lab))])
    assert run.returncode != 0, run.output
    lab.fault("pve1", 129, "ignore-sigterm", clear=True)
    # the dead run's stop still ends in the container (deadline, SIGKILL): nothing left half-killed
    assert wait_until(lambda: sglang_processes(lab) == [] and gpu_used(lab) == [0] * 8, 20)
    # a re-run at once meets the dead run's live lease: it fails clearly and touches nothing
    rerun = deploy(lab, FP8)
    assert rerun.returncode != 0
    said(rerun, "another transition holds the lock /run/gpugate/sglang-30000.lock", "(step stop)",
         "Nothing was touched")
    assert sglang_processes(lab) == []
    assert "stop" in expire_lock(lab)
    rerun = deploy(lab, FP8)
    assert rerun.returncode == 0, rerun.output
    said(rerun, "took over a lapsed lock from", "(step stop)", "healthy and generating")
    assert flag_value(running_argv(lab), "--kv-cache-dtype") == "fp8_e4m3" and health(lab) == 200
    assert log_starts(lab) == starts + 1  # one start, by the re-run
    state = state_file(lab)
    assert state["phase"] == "running" and state["current"]["flags"]["kv-cache-dtype"] == "fp8_e4m3"


def test_two_operators_at_once_one_restart(lab, serving):
    lab.fault("pve1", 129, "ignore-sigterm")  # a 4 s stop: both others arrive while the first holds the lock
    starts = log_starts(lab)
    others = {}
    pool = ThreadPoolExecutor(2)

    def arrive(_):
        others["fail"] = pool.submit(deploy, lab, FP8)
        others["wait"] = pool.submit(deploy, lab, FP8, data={"lock_wait_s": 60})

    first = deploy(lab, FP8, data={"drain_timeout_s": 4}, when=[("stopping pid", arrive)])
    second, third = others["fail"].result(timeout=120), others["wait"].result(timeout=120)
    pool.shutdown()
    assert first.returncode == 0, first.output
    assert second.returncode != 0, second.output
    said(second, "another transition holds the lock", "lease ends in", "Nothing was touched")
    assert third.returncode == 0, third.output
    said(third, "already converged (by another run) when the lock was taken: nothing to do")
    assert log_starts(lab) == starts + 1  # exactly one restart
    assert flag_value(running_argv(lab), "--kv-cache-dtype") == "fp8_e4m3" and health(lab) == 200
