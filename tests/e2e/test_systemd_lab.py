"""The systemd supervisor end to end: a lab container whose PID 1 is Debian's systemd; the server started
as a unit through the real pyinfra CLI, crash-restarted by systemd with the same spec (logs in journald),
restarted with new flags through the gate, and the status reading it. Tests run in order."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

import pytest

from tests import warm_pyinfra
from tests.conftest import REPO_ROOT, module_lab, poll, pyinfra_exe

pytestmark = [pytest.mark.lab]

FAST = {"SGLANG_STANDIN_LOAD_S": "0.3"}
UNIT = "sglang-30000.service"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not os.path.exists("/lib/systemd/systemd"):
        pytest.skip("no /lib/systemd/systemd on this machine (scripts/bootstrap installs it)")
    for lab in module_lab(tmp_path_factory, "lab-systemd", hosts=1, gpus=4):
        from gpugate_lab import container, core

        assert lab.pct("pve1", "stop", "129").returncode == 0
        container.set_init_flavour(core.host_dir(lab.dir, "pve1"), 129, "systemd")
        assert lab.pct("pve1", "start", "129").returncode == 0
        yield lab


def in_ct(lab, script: str) -> str:
    result = lab.pct("pve1", "exec", "129", "--", "sh", "-c", script)
    return result.stdout


def unit(lab, *props: str) -> dict[str, str]:
    out = in_ct(lab, f"systemctl show {UNIT} " + " ".join(f"-p {shlex.quote(p)}" for p in props))
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def pyinfra(lab, deploy: str, flags: dict, *extra: str) -> subprocess.CompletedProcess:
    exe = pyinfra_exe()
    # no sglang_supervisor: the default (auto) is systemd where the container's PID 1 is systemd
    return warm_pyinfra.run([exe, "-y", "inventory.py", deploy,
                           "--data", f"sglang_env={json.dumps(FAST)}", "--data", f"sglang_flags={json.dumps(flags)}",
                           *extra], cwd=REPO_ROOT, env=lab.env(), capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def wait_for(predicate, timeout_s: float):
    return poll(predicate, timeout_s)


def test_pid_1_is_systemd_and_it_is_running(lab):
    assert in_ct(lab, "cat /proc/1/comm").strip() == "systemd"
    assert wait_for(lambda: in_ct(lab, "systemctl is-system-running").strip() in ("running", "degraded"), 30)


def test_the_server_starts_as_a_unit(lab):
    result = pyinfra(lab, "deploy.py", {"tp": 4})
    assert result.returncode == 0, result.stdout + result.stderr
    props = unit(lab, "ActiveState", "MainPID", "Restart", "KillMode", "TimeoutStopUSec", "StartLimitBurst")
    assert props["ActiveState"] == "active" and int(props["MainPID"]) > 0
    assert (props["Restart"], props["KillMode"], props["StartLimitBurst"]) == ("on-failure", "mixed", "3")
    assert props["TimeoutStopUSec"] == "1min 10s"  # the drain budget (60 s) + the kill grace (10 s)
    # the server's log is in journald
    assert wait_for(lambda: "fired up and ready to roll" in in_ct(lab, f"journalctl -u {UNIT} --no-pager"), 10)


def test_a_crash_is_restarted_with_the_same_spec_and_reported(lab):
    before = unit(lab, "MainPID", "ExecStart")
    in_ct(lab, f"kill -9 {before['MainPID']}")
    restarted = wait_for(lambda: (lambda p: p if p["NRestarts"] == "1" and p["ActiveState"] == "active"
                                  and p["MainPID"] not in ("0", before["MainPID"]) else None)(
        unit(lab, "NRestarts", "ActiveState", "MainPID", "ExecStart")), 30)
    assert restarted, unit(lab, "NRestarts", "ActiveState", "SubState")
    argv = re.compile(r"argv\[\]=([^;]*)")  # ExecStart also says when and as which pid it last ran
    assert argv.search(restarted["ExecStart"]).group(1) == argv.search(before["ExecStart"]).group(1)
    # serving again: the status says so (it reads the server, not systemd's word)
    status = wait_for(lambda: (lambda r: r if "serving as desired" in r.stdout else None)(
        pyinfra(lab, "runbooks/status.py", {"tp": 4})), 30)
    assert status, "the restarted server never served"


def test_new_flags_restart_through_the_gate(lab):
    result = pyinfra(lab, "deploy.py", {"tp": 4, "kv-cache-dtype": "fp8_e4m3"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "KV cache" in result.stdout + result.stderr and "(x2.00)" in result.stdout + result.stderr
    pid = unit(lab, "MainPID")["MainPID"]
    argv = in_ct(lab, f"tr '\\0' ' ' < /proc/{pid}/cmdline")
    assert "--kv-cache-dtype fp8_e4m3" in argv
    assert unit(lab, "NRestarts")["NRestarts"] == "0"  # a deliberate restart is no crash
    status = pyinfra(lab, "runbooks/status.py", {"tp": 4, "kv-cache-dtype": "fp8_e4m3"})
    assert status.returncode == 0 and "serving as desired" in status.stdout


def test_a_start_that_crashes_shows_its_last_lines_from_journald_without_secrets(lab):
    # the crash's own last line quotes a value that is no secret (shown); HF_TOKEN's and the key are
    env = {"SGLANG_STANDIN_LOAD_S": "not-a-number", "HF_TOKEN": "hf-crash-canary"}
    result = pyinfra(lab, "deploy.py", {"tp": 4, "api-key": "sk-crash-canary"},
                     "--data", f"sglang_env={json.dumps(env)}")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "the server crashed (exit code 1)" in out, out  # the unit's ExecMainStatus
    # the crash's last line (the failure's reason) and the tail before it, from the unit's journal, masked
    reason = "the server exited during loading with code 1: ValueError: could not convert string to float: 'not-a-number'"
    assert f"the desired server failed: {reason}" in out, out
    tail = [line.split(" | ", 1)[1] for line in out.split("log tail of the failed start:", 1)[1].splitlines()
            if " sglang :30000     | " in line]
    assert "Traceback (most recent call last):" in tail and tail[-1] == reason.split(": ", 1)[1], tail
    for secret in ("hf-crash-canary", "sk-crash-canary"):
        assert secret not in out, secret
    raw = in_ct(lab, f"journalctl -u {UNIT} --no-pager")
    assert "sk-crash-canary" in raw  # so the mask was needed
    assert "ValueError" not in in_ct(lab, "cat /var/log/gpugate/sglang-30000.log")  # journald, not the file
    journal = in_ct(lab, "cat /var/lib/gpugate/runs/$(cat /var/lib/gpugate/runs/latest).jsonl")
    assert "float: 'not-a-number'" in journal and "hf-crash-canary" not in journal and "sk-crash-canary" not in journal
    # the server of the previous test serves again, started by the rollback at once: not by systemd's
    # restart of the crashed unit RestartSec later, which the rollback's start used to wait for
    assert "the previous server serves again" in out, out
    assert unit(lab, "ActiveState")["ActiveState"] == "active"
    assert unit(lab, "NRestarts")["NRestarts"] == "0"


CACHE_UNIT = "sglang-weight-cache-30000.service"


def cache_unit(lab) -> dict[str, str]:
    out = in_ct(lab, f"systemctl show {CACHE_UNIT} -p ActiveState -p MainPID")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_the_weight_cache_runs_as_its_own_unit_and_outlives_an_engine_only_restart(lab):
    cached = ("--data", f"sglang_env={json.dumps(dict(FAST, SGLANG_STANDIN_WEIGHT_LOAD_S='0.5'))}",
              "--data", "sglang_weight_cache=true")
    first = pyinfra(lab, "deploy.py", {"tp": 4}, *cached)
    out = first.stdout + first.stderr
    assert first.returncode == 0 and "weight cache ready on every GPU" in out, out
    daemons = cache_unit(lab)
    assert daemons["ActiveState"] == "active" and daemons["MainPID"] != "0", daemons
    assert "sglang.srt.weight_cache.daemon" in in_ct(lab, f"tr '\\0' ' ' < /proc/{daemons['MainPID']}/cmdline")

    fp8 = pyinfra(lab, "deploy.py", {"tp": 4, "kv-cache-dtype": "fp8_e4m3"}, *cached)
    out = fp8.stdout + fp8.stderr
    assert fp8.returncode == 0 and "weight cache kept" in out, out
    assert cache_unit(lab) == daemons  # the same daemons, under the same unit
    assert unit(lab, "ActiveState")["ActiveState"] == "active"

    gone = pyinfra(lab, "deploy.py", {"tp": 4, "kv-cache-dtype": "fp8_e4m3"}, *cached, "--data", "sglang_present=false")
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert cache_unit(lab)["ActiveState"] in ("inactive", "failed") and cache_unit(lab)["MainPID"] == "0"
    assert "weight_cache.daemon" not in in_ct(lab, "ps -eo args")
    assert in_ct(lab, "ls /tmp | grep -c sglang_weight_cache || true").strip() == "0"
