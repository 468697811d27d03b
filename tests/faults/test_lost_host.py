"""A rolling change that loses a Proxmox host (issue 20): pve2's SSH server and its sessions are
killed for real while pve1 restarts. pve2 is reported as a lost link (never as a command that
failed in its container), the rolling change stops there, and pve3 is untouched, named as such."""

from __future__ import annotations

import pytest

from tests.conftest import module_lab
from tests.faults.conftest import deploy, flag_value, main_pid, running_argv, said

pytestmark = [pytest.mark.faults, pytest.mark.lab]

HOSTS = ("pve1", "pve2", "pve3")
TP2 = {"tp": 2}
TP2_FP8 = {"tp": 2, "kv-cache-dtype": "fp8_e4m3"}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "faults-lost-host", hosts=3, gpus=2)


def test_a_rolling_change_stops_at_a_lost_host_and_says_it_is_the_link(lab):
    run = deploy(lab, TP2, limit=None)
    assert run.returncode == 0, run
    before = {host: main_pid(lab, host) for host in HOSTS}

    def cut_pve2(_process):
        # the listener and every session sshd of pve2 (its PID namespace: only its own)
        lab.host_exec("pve2", "pkill", "-KILL", "-x", "sshd")

    run = deploy(lab, TP2_FP8, data={"rolling": True}, limit=None,
                 when=[("[@pct/pve1:129] sglang :30000 started pid", cut_pve2)])
    assert run.returncode != 0, run
    said(run, "[@pct/pve1:129] sglang :30000 done in",
         "pve2: the SSH connection was lost (the link to the Proxmox host, not the container)")
    assert "the command failed in the container" not in run.output, run
    # pve1 restarted onto the new flags; pve3 never touched, and named
    assert flag_value(running_argv(lab, "pve1"), "--kv-cache-dtype") == "fp8_e4m3"
    assert flag_value(running_argv(lab, "pve3"), "--kv-cache-dtype") is None
    assert main_pid(lab, "pve3") == before["pve3"]
    said(run, "[@pct/pve3:129] sglang :30000 not touched")
    summary = run.output.split("not touched (the rolling restart stopped after 1 failed container(s): ", 1)[1]
    assert summary.startswith("@pct/pve2:129): @pct/pve3:129"), summary


def test_a_frozen_ssh_link_is_said_while_it_lasts_and_the_run_goes_on(lab):
    import threading

    run = deploy(lab, TP2, limit="pve_pve1")
    assert run.returncode == 0, run
    frozen = []

    def thaw_pve1(_process=None):
        lab.host_exec("pve1", "pkill", "-CONT", "-x", "sshd")

    def freeze_pve1(_process):
        # every sshd of pve1 stopped for real (its listener and the session the follow runs in)
        lab.host_exec("pve1", "pkill", "-STOP", "-x", "sshd")
        frozen.append(threading.Timer(30.0, thaw_pve1))  # only if the silence is never said
        frozen[0].start()

    try:
        # a load long enough for the run to go on during the freeze (budgets and times as data); the link
        # thaws once the controller has said it is silent (after 3 + 5 s), not after a fixed freeze
        run = deploy(lab, TP2_FP8, env={"SGLANG_STANDIN_LOAD_S": "6"}, limit="pve_pve1",
                     when=[("[@pct/pve1:129] sglang :30000 started pid", freeze_pve1),
                           ("the SSH link to pve1 is silent", thaw_pve1)])
    finally:
        for timer in frozen:
            timer.cancel()
        lab.host_exec("pve1", "pkill", "-CONT", "-x", "sshd")
    assert run.returncode == 0, run
    said(run, "no answer from the container for", "the SSH link to pve1 is silent",
         "[@pct/pve1:129] sglang :30000 done in")
    assert run.output.index("is silent") < run.output.index("sglang :30000 done in")
    assert flag_value(running_argv(lab, "pve1"), "--kv-cache-dtype") == "fp8_e4m3"
