"""Faults at the start (crash, never healthy, a rollback that fails too), the SSH connection dropping
mid-transition, and two operators at once: the real pyinfra CLI against one lab host.

"The NEW spec fails" is made with the spec itself (a model directory without config.json: SGLang
exits 1 while loading; a load longer than start_timeout_s), so that the previous spec starts cleanly
in the same container; a lab fault (which applies to every start) makes the rollback fail too.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import module_lab
from tests.faults.conftest import (FLAGS, FP8, OnJournal, deploy, ensure_serving, flag_value, gpu_used, health,
                                   log_starts, main_pid, observed, running_argv, said, sglang_processes, sh,
                                   wait_until)

pytestmark = [pytest.mark.faults, pytest.mark.lab]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "faults-start", hosts=1, gpus=4)


@pytest.fixture
def serving(lab):
    pid = ensure_serving(lab)
    yield pid
    lab.fault("pve1", 129, "all", clear=True)


def assert_rolled_back(lab, run, serving_pid):
    """The previous spec serves again (a new process); the container's history says what runs and
    what was tried, and the lock is free."""
    assert run.returncode != 0, run.output
    said(run, "ROLLED BACK: the desired server failed", "the previous server serves again, verified")
    assert health(lab) == 200 and main_pid(lab) != serving_pid
    assert "--kv-cache-dtype" not in running_argv(lab) and "/opt/models/broken" not in running_argv(lab)
    server = observed(lab)
    assert server["transition"]["outcome"] == "rolled_back" and not server["lock"]["held"]
    assert server["history"]["good"][0]["argv_hash"] == server["main"]["argv_hash"]  # what runs: the restored spec
    assert server["history"]["failed"][0]["argv_hash"] != server["main"]["argv_hash"]  # what failed
    rerun = deploy(lab, FLAGS)  # what runs is what is desired again: nothing to do
    assert rerun.returncode == 0 and "No changes" in rerun.output, rerun.output


def test_new_spec_crashes_at_start_rollback_serves_again(lab, serving):
    sh(lab, "pve1", 129, "mkdir -p /opt/models/broken")  # no config.json: SGLang's own OSError
    # started after the stop (ungated): the crash is after the stop, the rollback brings the old one back
    run = deploy(lab, FLAGS, data={"sglang_model_path": "/opt/models/broken", "sglang_gated_launch": False})
    said(run, "the server crashed (exit code 1)", "log tail of the failed start:", "config.json")
    assert_rolled_back(lab, run, serving)


def test_a_gated_launch_that_crashes_before_its_gate_stops_nothing(lab, serving):
    # the default: the new engine imports and initialises while the old one serves; it dies there
    sh(lab, "pve1", 129, "mkdir -p /opt/models/broken")
    before = main_pid(lab)
    run = deploy(lab, FLAGS, data={"sglang_model_path": "/opt/models/broken"})
    assert run.returncode != 0, run
    said(run, "the server crashed (exit code 1)", "config.json", "refused by the agent, nothing touched: the new "
         "server failed before its gated launch: the server exited", "the old server was never stopped")
    assert "stopping :30000" not in run.output and "ROLLED BACK" not in run.output, run
    assert main_pid(lab) == before and "/opt/models/broken" not in running_argv(lab)


def test_new_spec_never_healthy_rollback_serves_again(lab, serving):
    # the new spec loads for 60 s, longer than start_timeout_s (8 s here); the previous one loads at once
    run = deploy(lab, FP8, env={"SGLANG_STANDIN_LOAD_S": "60"})
    said(run, "was not healthy in time", "not healthy within 8")
    assert_rolled_back(lab, run, serving)


def test_rollback_failing_too_ends_in_nothing_serves_with_both_reasons(lab, serving):
    lab.fault("pve1", 129, "never-healthy")  # kept: the previous spec fails as well
    # ungated: a gated engine must first reach its gate within the 2 s, which a busy machine may not
    # give it (then nothing is stopped at all: test_a_gated_launch_that_crashes_before_its_gate_stops_nothing)
    run = deploy(lab, FP8, data={"start_timeout_s": 2, "sglang_gated_launch": False})
    assert run.returncode != 0, run.output
    said(run, "NOTHING SERVES on :30000", "the desired server failed: ", "the rollback: rollback failed")
    assert sglang_processes(lab) == [] and gpu_used(lab) == [0] * 4  # nothing half-started holds the GPUs
    server = observed(lab)
    assert server["transition"]["outcome"] == "nothing_serves" and set(server["transition"]["reasons"]) == {
        "desired", "rollback"}
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


def test_ssh_drop_mid_transition_the_container_finishes_and_a_rerun_reports_it(lab, serving):
    lab.fault("pve1", 129, "ignore-sigterm")  # the drain lasts until the drop has landed inside it

    def drop_in_the_drain():
        # as the agent journals the drain's begin (not once the console says "stopping", up to 3 s later);
        # the drain then ends (ignore-sigterm cleared: the stand-in reads it every tick), not at its budget
        drop_ssh(lab)
        lab.fault("pve1", 129, "ignore-sigterm", clear=True)

    starts = log_starts(lab)
    try:
        with OnJournal(lab, "drain", "begin", drop_in_the_drain) as dropped:
            run = deploy(lab, FP8, data={"drain_timeout_s": 3})
    finally:
        lab.fault("pve1", 129, "ignore-sigterm", clear=True)
    assert dropped.fired.is_set()
    assert run.returncode != 0 or "verified" in run.output, run.output  # never a silent success
    # the transition runs to its end in the container (its agent owes nothing to the SSH session)
    assert wait_until(lambda: not observed(lab)["lock"]["held"], 30)
    assert observed(lab)["transition"]["outcome"] == "verified"
    rerun = deploy(lab, FP8)
    assert rerun.returncode == 0, rerun.output
    said(rerun, "ended: verified", "No changes")
    assert flag_value(running_argv(lab), "--kv-cache-dtype") == "fp8_e4m3" and health(lab) == 200
    assert log_starts(lab) == starts + 1  # one start, by the agent of the dropped run


def test_two_operators_at_once_one_restart(lab, serving):
    lab.fault("pve1", 129, "ignore-sigterm")  # a 3 s stop: both others arrive while the first runs
    starts = log_starts(lab)
    others = {}
    pool = ThreadPoolExecutor(2)

    def arrive():
        others["a"] = pool.submit(deploy, lab, FP8)
        others["b"] = pool.submit(deploy, lab, FP8)

    # they set out as the agent journals the drain's begin (the console's "stopping" may come 3 s later)
    with OnJournal(lab, "drain", "begin", arrive):
        first = deploy(lab, FP8, data={"drain_timeout_s": 3})
    second, third = others["a"].result(timeout=120), others["b"].result(timeout=120)
    pool.shutdown()
    assert first.returncode == 0, first.output
    for other in (second, third):  # each attached to the running transition (or found it done)
        assert other.returncode == 0, other.output
        assert "following it instead of starting another" in other.output or "No changes" in other.output
    assert log_starts(lab) == starts + 1  # exactly one restart
    assert flag_value(running_argv(lab), "--kv-cache-dtype") == "fp8_e4m3" and health(lab) == 200
