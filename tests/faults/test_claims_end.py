"""Claims end with their run (issue 20, item 5), through the real pyinfra CLI on a lab host: a GPU
claim on the Proxmox host whose run never began is released by the next deploy that meets it (once
its hand-off window is over and its container says no such run began); a lock file that is a
directory is refused naming it, and leaves no claim behind."""

from __future__ import annotations

import re
import time

import pytest

from gpugate.claims import hold_gpu_locks
from tests.conftest import module_lab
from tests.e2e.test_claims_lab import connectors
from tests.faults.conftest import deploy, main_pid, said

pytestmark = [pytest.mark.faults, pytest.mark.lab]

TP2 = {"tp": 2}
TP2_FP8 = {"tp": 2, "kv-cache-dtype": "fp8_e4m3"}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "faults-claims-end", hosts=1, gpus=2)


def host_alive(lab, pid: int) -> bool:
    return lab.host_exec("pve1", "sh", "-c", f"test -d /proc/{pid}").returncode == 0


def test_a_claim_whose_run_never_began_is_released_by_the_next_deploy(lab):
    run = deploy(lab, TP2)
    assert run.returncode == 0, run
    [ct] = connectors(lab, 129)
    try:
        # a claim taken for a hand-off that never came (the SSH session cut right after the plan)
        claim = hold_gpu_locks(ct.connector, [0, 1], "ghost-run", python="/usr/bin/python3", grace_s=2)
        assert claim.locked and isinstance(claim.until, (int, float)), claim
    finally:
        ct.disconnect()
    holder = int(re.search(r"holder pid (\d+)", claim.message).group(1))
    lab.host_exec("pve1", "kill", "-STOP", str(holder))  # a wedged holder: its own grace never ends it
    try:
        # past the claim's hand-off window as the claim recorded it, and the 1 s more that makes it stale
        # (host_gpu_lock.stale), not a fixed wait
        time.sleep(max(0.0, claim.until + 1.0 - time.time()) + 0.1)
        run = deploy(lab, TP2_FP8)
        said(run, "released a stale GPU claim: run ghost-run of container 129 never began "
                  "(no run ghost-run began in container 129)", "verified")
        assert "is claimed by container 129 (run ghost-run" not in run.output, run
        assert run.returncode == 0, run
        assert not host_alive(lab, holder)
    finally:
        lab.host_exec("pve1", "kill", "-KILL", str(holder))


def test_a_lock_file_that_is_a_directory_is_refused_naming_it_and_leaves_no_claim(lab):
    run = deploy(lab, TP2)
    assert run.returncode == 0, run
    pid = main_pid(lab)
    made = lab.host_exec("pve1", "sh", "-c", "rm -f /run/gpugate/gpu-1.lock && mkdir /run/gpugate/gpu-1.lock")
    assert made.returncode == 0, made.stderr
    try:
        run = deploy(lab, TP2_FP8)
        assert run.returncode != 0, run
        said(run, "REFUSED, nothing touched: could not take the locks of GPU 0-1 of pve1",
             "/run/gpugate/gpu-1.lock is a directory, not a lock file: remove it on the Proxmox host")
        assert "Traceback" not in run.output, run
        assert main_pid(lab) == pid
    finally:
        lab.host_exec("pve1", "rmdir", "/run/gpugate/gpu-1.lock")
    began = time.monotonic()
    run = deploy(lab, TP2_FP8)  # no claim was left behind: it goes ahead at once
    assert run.returncode == 0, run
    assert time.monotonic() - began < 15
