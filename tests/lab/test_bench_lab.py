"""bench/run.py works on a lab of its own: the user's lab ($GPUGATE_LAB_DIR) keeps running, nothing is left in /tmp."""

from __future__ import annotations

import os

import pytest

from tests.conftest import lab_unavailable_reason, start_lab

pytestmark = pytest.mark.lab


def test_the_benchmark_never_touches_the_users_lab_and_leaves_nothing(tmp_path, monkeypatch):
    reason = lab_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from bench.benchlab import BenchLab
    from bench.run import own_lab
    from gpugate_lab import core

    users = start_lab(tmp_path / "users-lab", hosts=1)
    monkeypatch.setenv("GPUGATE_LAB_DIR", str(users.dir))
    try:
        with pytest.raises(core.LabError, match="already holds a lab"):
            BenchLab.up(users.dir, hosts=1, vmids=(129,))
        with own_lab(1, (129,)) as (lab, workdir):
            assert lab.dir != users.dir and workdir.name.startswith("gpugate-bench-")
            assert os.environ["GPUGATE_LAB_DIR"] == str(lab.dir)
            assert core.host_init_pid(lab.dir, "pve1") is not None
        assert not workdir.exists()
        assert core.host_init_pid(lab.dir, "pve1") is None
        assert os.environ["GPUGATE_LAB_DIR"] == str(users.dir)
        assert core.host_init_pid(users.dir, "pve1") is not None, "the user's lab was stopped"
    finally:
        core.down(users.dir)
