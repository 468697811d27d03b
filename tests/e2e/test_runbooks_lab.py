"""The runbooks end to end: the real pyinfra CLI against a lab of two Proxmox hosts (container 129
on each, 4 GPUs each), as an operator runs them: `pyinfra -y inventory.py runbooks/<name>.py`.

One lab for this module; the tests run in order, each from the state the previous one left.
Run: pytest -m lab tests/e2e/test_runbooks_lab.py
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from gpugate.engine.sglang.weight_cache import steady_argv
from tests import warm_pyinfra
from tests.conftest import REPO_ROOT, module_lab, poll, pyinfra_exe

pytestmark = [pytest.mark.lab]

FAST = {"SGLANG_STANDIN_LOAD_S": "0.3"}
TP8 = {"tp": 4}  # the module's server (the name kept: the tests name it)
FP8 = {"tp": 4, "kv-cache-dtype": "fp8_e4m3"}
# Secrets that must never leave the container's 0600 files (nor reach the audit log or the console).
CANARY_ENV = dict(FAST, HF_TOKEN="secret-canary")
API = {"tp": 4, "api-key": "sk-canary-key"}
CANARIES = ("secret-canary", "sk-canary-key")
HOLD = ("setsid nohup python3 -m gpugate_gpusim hold --gpu all --mib 4096 >/tmp/hold.log 2>&1 "
        "</dev/null & echo $!")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-runbooks", hosts=2, gpus=4)


def run(lab, runbook: str, *extra: str, flags=None, env=None, yes: bool = True):
    """pyinfra [-y] inventory.py runbooks/<runbook>.py ... -> (result, stdout, stdout+stderr).
    yes=False: the operator's preview, ``--dry`` without -y (the plan is printed while preparing)."""
    args = ["inventory.py", runbook if runbook.endswith(".py") else f"runbooks/{runbook}.py",
            "--data", f"sglang_env={json.dumps(env or FAST)}", "--data", f"sglang_flags={json.dumps(flags or TP8)}",
            *extra]
    exe = pyinfra_exe()
    env = dict(lab.env(), GPUGATE_AUDIT_LOG=str(lab.dir / "audit.jsonl"))  # not the project's audit log
    result = warm_pyinfra.run([exe, *(["-y"] if yes else ["--dry"]), *args], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    return result, result.stdout, result.stdout + result.stderr


def in_ct(lab, host: str, script: str) -> str:
    return lab.pct(host, "exec", "129", "--", "sh", "-c", script).stdout


def main_pid(lab, host: str = "pve1") -> str:
    """The main pid from the agent's pid file (JSON: pid, start_ticks, log, ...); "" when none."""
    text = in_ct(lab, host, "cat /run/gpugate/sglang-30000.pid 2>/dev/null").strip()
    return str(json.loads(text)["pid"]) if text else ""


def running_argv(lab, host: str = "pve1") -> list[str]:
    pid = main_pid(lab, host)
    return steady_argv([a for a in in_ct(lab, host, f"tr '\\0' '\\n' < /proc/{pid}/cmdline").splitlines() if a]) if pid else []


def gpu_used(lab, host: str) -> list[int]:
    out = lab.host_exec(host, "nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits")
    return [int(x) for x in out.stdout.split()]


def wait_until(predicate, timeout_s: float):
    return poll(predicate, timeout_s)


def table(stdout: str) -> dict[str, str]:
    """The status/who_holds table on stdout: host -> its row (the first row per host)."""
    rows: dict[str, str] = {}
    for line in stdout.splitlines()[1:]:
        rows.setdefault(line.split(" ", 1)[0], line)
    return rows


def set_previous(lab, flags: dict) -> None:
    """Write a 'previous' spec into pve1's recorded state, as sglang.server records it before a change."""
    script = ("import json; p = '/var/lib/gpugate/sglang-30000.json'; d = json.load(open(p)); "
              f"d['previous'] = {{'model_path': '/opt/models/lab-model', 'port': 30000, 'flags': {flags!r}, "
              "'python': '/usr/bin/python3', 'env_names': ['SGLANG_STANDIN_LOAD_S'], 'supervisor': 'process'}; "
              "json.dump(d, open(p, 'w'))")
    in_ct(lab, "pve1", "python3 -c " + shlex.quote(script))


# ------------------------------------------------------------------------------------------ status

def test_status_prints_one_table_for_the_fleet_and_changes_nothing(lab):
    result, stdout, out = run(lab, "status")
    assert result.returncode == 1, out  # nothing serves where a server is desired: not as desired
    lines = stdout.splitlines()
    # MAPPED GPUS: the lab's nodes answer pvesh, so each container's map is shown (issue 36)
    assert lines[0].split() == ["HOST", "VMID", "PORT", "VERDICT", "SERVER", "MAPPED", "GPUS", "MODEL", "GPU", "MiB",
                                "GPU", "HOLDERS", "LAST", "CHANGE"]
    rows = table(stdout)
    assert [lines[1].split()[0], lines[2].split()[0]] == ["pve1", "pve2"]  # the table, printed once
    assert lines[3] == "2 server(s): 0 as desired, 2 NOT (down but desired 2)"
    assert rows["pve1"].split()[:4] == ["pve1", "129", "30000", "down"] and "0 x4" in rows["pve1"]
    assert re.search(r"Grand total\s+-\s+-\s+-\s+-", out)  # read-only: no operation ran


def test_status_shows_the_server_and_flags_that_differ(lab):
    result, _stdout, out = run(lab, "deploy.py", "--limit", "pve_pve1")
    assert result.returncode == 0, out
    result, stdout, out = run(lab, "status", flags=FP8)
    rows = table(stdout)
    assert "drifted: + --kv-cache-dtype fp8_e4m3" in rows["pve1"] and "serving pid" in rows["pve1"]
    assert "4 in ct (sglang::scheduler_TP0..3)" in rows["pve1"]
    result, stdout, _out = run(lab, "status", "--limit", "pve1")
    assert result.returncode == 0
    assert list(table(stdout))[:2] == ["pve1", "1"] and "serving as desired" in table(stdout)["pve1"]


# ------------------------------------------------------------------------------------------ who holds

def test_who_holds_gpus_lists_every_gpu_process_with_its_container(lab):
    result, stdout, out = run(lab, "who_holds_gpus")
    assert result.returncode == 0, out
    schedulers = [line for line in stdout.splitlines() if "sglang::scheduler_TP" in line]
    assert len(schedulers) == 4 and all(line.split()[:3] == ["pve1", "ct", "129"] for line in schedulers)
    assert "pve1: GPU MiB" in stdout and "; 4 GPU process(es)" in stdout
    assert "pve2: GPU MiB 0 x4; 0 GPU process(es)" in stdout


# ------------------------------------------------------------------------------------------ free_gpus

def test_free_gpus_refuses_to_end_a_running_managed_server(lab):
    pid = main_pid(lab)
    result, _stdout, out = run(lab, "free_gpus", "--limit", "pve_pve1")
    assert result.returncode != 0
    assert "sglang on :30000 runs" in out and "Nothing was touched" in out
    assert main_pid(lab) == pid and all(used > 0 for used in gpu_used(lab, "pve1"))


def test_free_gpus_ends_the_containers_own_gpu_processes(lab):
    in_ct(lab, "pve2", HOLD)
    assert wait_until(lambda: all(used > 0 for used in gpu_used(lab, "pve2")), 10)
    result, _stdout, out = run(lab, "free_gpus", "--limit", "pve_pve2", yes=False)  # the preview
    assert "will end 1 GPU process(es)" in out and all(used > 0 for used in gpu_used(lab, "pve2"))
    result, _stdout, out = run(lab, "free_gpus", "--limit", "pve_pve2")
    assert result.returncode == 0, out
    assert "GPU processes: 1 ended on SIGTERM" in out and gpu_used(lab, "pve2") == [0] * 4


def test_free_gpus_never_touches_memory_held_from_outside(lab):
    lab.fault("pve2", 129, "foreign-holder")
    try:
        assert wait_until(lambda: all(used > 0 for used in gpu_used(lab, "pve2")), 10)
        # the refusal comes from the plan, before any gate: pve2 never had a deploy, so no agent is installed
        # there and the observation goes inline (a gate budget as data: a regression fails in seconds, not 120 s)
        result, _stdout, out = run(lab, "free_gpus", "--limit", "pve_pve2", "--data", "gpu_gate_timeout_s=3")
        assert result.returncode != 0
        assert "held from OUTSIDE the container" in out and "runbooks/who_holds_gpus.py" in out
        assert "Nothing was touched" in out and "gpu.idle will wait" not in out, out
        assert all(used > 0 for used in gpu_used(lab, "pve2"))
        _result, stdout, _out = run(lab, "who_holds_gpus", "--limit", "pve_pve2")
        assert [line.split()[:2] for line in stdout.splitlines()[1:2]] == [["pve2", "host"]]
    finally:
        lab.fault("pve2", 129, "foreign-holder", clear=True)


# ------------------------------------------------------------------------------------------ restart

def test_restart_restarts_an_unchanged_server_through_the_gate(lab):
    before = main_pid(lab)
    argv_before = running_argv(lab)
    result, _stdout, out = run(lab, "restart", "--limit", "pve_pve1")
    assert result.returncode == 0, out
    assert "will restart: restart requested (same spec)" in out and "gate passed" in out and "verified" in out
    assert main_pid(lab) not in ("", before) and running_argv(lab) == argv_before  # new pid, same flags


def events_of_last_run(path: Path) -> list[dict]:
    events = [json.loads(line) for line in path.read_text().splitlines()]
    run_id = [e for e in events if e["step"] == "plan"][-1]["run"]
    return [e for e in events if e.get("run") == run_id]


def test_audit_log_alone_tells_the_story_of_one_restart(lab, tmp_path):
    result, _stdout, out = run(lab, "deploy.py", "--limit", "pve_pve1", flags=API, env=CANARY_ENV)
    assert result.returncode == 0, out
    audit_file = tmp_path / "ops-audit.jsonl"  # the audit_log data setting picks the file
    result, _stdout, out = run(lab, "restart", "--limit", "pve_pve1", "--data", f"audit_log={audit_file}",
                               flags=API, env=CANARY_ENV)
    assert result.returncode == 0, out
    events = events_of_last_run(audit_file)
    assert {(e["host"], e["vmid"], e["port"]) for e in events} == {("@pct/pve1:129", 129, 30000)}
    steps = [(e["step"], e["phase"]) for e in events]
    # the controller's plan and hand-off, then the agent's journal, in its order, then the outcome
    assert steps[0] == ("plan", "begin") and steps[1] == ("handoff", "end") and steps[-1] == ("outcome", "end")
    order = ["stop", "drain", "gate", "prepare", "start", "load", "verify"]
    begun = [step for step, phase in steps if phase == "begin" and step in order]
    assert begun == order, steps
    for step in order:  # each step began, then ended
        assert steps.index((step, "begin")) < steps.index((step, "end")), step
    gate_end = events[steps.index(("gate", "end"))]
    assert gate_end["passed"] is True and list(gate_end["used_mib"].values()) == [0] * 4
    plan, done = events[0], events[-1]
    assert done["outcome"] == "verified" and done["total_s"] > 0 and done["capacity_after"]
    assert plan["argv_before"] == plan["argv_after"] and "--api-key" in plan["argv_after"]
    assert plan["argv_after"][plan["argv_after"].index("--api-key") + 1] == "***"
    assert plan["flags_after"]["api-key"] == "***"
    assert events[steps.index(("drain", "end"))]["drained"] is True
    history = in_ct(lab, "pve1", "cat /var/lib/gpugate/sglang-30000.json")
    for canary in CANARIES:  # in the container's 0600 files and the process only
        assert canary not in audit_file.read_text() and canary not in out
    assert history and in_ct(lab, "pve1", "stat -c %a /var/lib/gpugate/sglang-30000.json").strip() == "600"


# ------------------------------------------------------------------------------------------ rollback

def test_rollback_without_a_recorded_change_touches_nothing(lab):
    before = main_pid(lab, "pve2")
    result, _stdout, out = run(lab, "rollback", "--limit", "pve_pve2")
    assert result.returncode != 0
    assert "cannot roll back: nothing to roll back to" in out and "nothing touched" in out
    assert main_pid(lab, "pve2") == before


def test_rollback_after_a_change_returns_to_the_previous_server(lab):
    before = running_argv(lab)  # the api-key server of the audit test, HF_TOKEN in its environment
    result, _stdout, out = run(lab, "deploy.py", "--limit", "pve_pve1", flags=FP8)
    assert result.returncode == 0, out
    assert "fp8_e4m3" in running_argv(lab)
    result, _stdout, out = run(lab, "rollback", "--limit", "pve_pve1", yes=False)  # the preview
    assert "- --kv-cache-dtype fp8_e4m3" in out and "+ --api-key ***" in out and "+ env HF_TOKEN=***" in out, out
    # which spec (its history label and key, when, who) and what the desired state (here: tp 4, the
    # FAST env) changes from it, in the one diff format (issue 20)
    spec_text = r"good 1( \(oldest kept\))? of :30000's history \(key ([0-9a-f]{16}), verified \S+ \S+ by \S+\)"
    assert re.search(r"note: that is " + spec_text + r"; the desired state differs from it: - --api-key \*\*\*, "
                     r"- env HF_TOKEN \(the next deploy.py applies it\)", out), out
    assert "fp8_e4m3" in running_argv(lab)
    result, _stdout, out = run(lab, "rollback", "--limit", "pve_pve1")
    assert result.returncode == 0, out
    assert "gate passed" in out and "verified: the running argv and /get_server_info match the restored spec" in out
    restored = re.search(r"restored " + spec_text + r", which its commit makes good 0 \(newest\); the desired "
                         r"state differs from it: - --api-key \*\*\*, - env HF_TOKEN", out)
    assert restored, out
    # the status's history follows the history's order: the restored spec is good 0 now, the fp8 one good 1
    result, stdout, out = run(lab, "status", "--limit", "pve_pve1", "--data", "format=json")
    (row,) = json.loads(stdout)["servers"]
    assert [s["label"] for s in row["good_specs"]][:2] == ["good 0 (newest)", "good 1"]
    assert row["good_specs"][0]["key"] == restored.group(2)
    assert row["good_specs"][0]["changes"] == ["+ --api-key ***", "- --kv-cache-dtype fp8_e4m3"]
    assert row["history"][0].split(" by ")[0].endswith(" good 0 (newest)")
    assert running_argv(lab) == before  # the exact argv, the api key included, from the container's history
    environ = in_ct(lab, "pve1", f"tr '\\0' '\\n' < /proc/{main_pid(lab)}/environ")
    assert "HF_TOKEN=secret-canary" in environ
    assert not any(canary in out for canary in CANARIES)
    events = events_of_last_run(lab.dir / "audit.jsonl") if (lab.dir / "audit.jsonl").exists() else []
    if events:
        assert events[0]["restore_previous"] is True and "- --kv-cache-dtype fp8_e4m3" in events[0]["diff"]
        assert events[-1]["step"] == "outcome" and events[-1]["outcome"] == "verified"
    # the newest good spec unlike the running one is now the fp8 one: a second rollback would go there
    result, _stdout, out = run(lab, "rollback", "--limit", "pve_pve1", yes=False)
    assert "+ --kv-cache-dtype fp8_e4m3" in out and "stopping" not in out, out


# ------------------------------------------------------------------------------------------ progress

def test_drain_and_gate_show_progress_while_waiting(lab):
    """A server that ignores SIGTERM (a drain that runs to its deadline) and a GPU process of the
    container that appears during the drain (after the checks) and holds memory until the operator
    ends it: the console shows, while it waits, what it waits for and what it sees."""
    from gpugate.plan import PROGRESS_EVERY_S
    from tests.faults.conftest import OnJournal
    from tests.faults.conftest import pyinfra as streamed

    holder: list[str] = []
    lab.fault("pve1", 129, "ignore-sigterm")
    start_holder = ("stopping :30000 pid", lambda _process: holder.append(in_ct(lab, "pve1", HOLD).strip()))
    # the holder goes once the agent has journalled a gate progress the console prints (one as old as a
    # progress line's interval), not once the console printed it: that comes with the next follow, up to 3 s later
    end_holder = OnJournal(lab, "gate", "progress", lambda: in_ct(lab, "pve1", f"kill {' '.join(holder)}"),
                           when=lambda event: event.get("elapsed_s", 0) >= PROGRESS_EVERY_S)
    try:
        with end_holder:
            result = streamed(lab, ["inventory.py", "runbooks/restart.py", "--limit", "pve_pve1",
                                    "--data", f"sglang_env={json.dumps(CANARY_ENV)}",
                                    "--data", f"sglang_flags={json.dumps(API)}",
                                    "--data", "drain_timeout_s=7", "--data", "kill_grace_s=2"],
                              when=[start_holder])
    finally:
        lab.fault("pve1", 129, "ignore-sigterm", clear=True)
        for pid in holder:
            in_ct(lab, "pve1", f"kill {pid} 2>/dev/null")
    out = result.output
    assert result.returncode == 0, out
    drained = re.findall(r"draining: (\d+) s, (\d+) process\(es\) left", out)
    assert len(drained) >= 2 and [int(line[0]) for line in drained] == sorted(int(line[0]) for line in drained)
    assert "drain deadline passed after 7" in out
    gate = re.findall(r"gate: (\d+) s: GPU MiB (\S+ x4); (.+)", out)
    assert gate and gate[0][1] == "4096 x4" and "4096 MiB used" in gate[0][2], out
    assert "gate passed" in out
