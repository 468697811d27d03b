"""The container's state files broken for real (issue 20, item 1): a history truncated mid-JSON or
of the wrong shape is set aside under a name that says so, the last copy that reads is used, and
observe, the plan, the status and the audit log say what happened; garbage in the other state
files (journal, pid file, lock, env file) never ends in a traceback. The real pyinfra CLI."""

from __future__ import annotations

import json

import pytest

from tests.conftest import module_lab
from tests.faults.conftest import FAST_ENV, deploy, main_pid, observed, pyinfra, said, sh

pytestmark = [pytest.mark.faults, pytest.mark.lab]

TP2 = {"tp": 2}
TP2_FP8 = {"tp": 2, "kv-cache-dtype": "fp8_e4m3"}
HISTORY = "/var/lib/gpugate/sglang-30000.json"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "faults-state-files", hosts=1, gpus=2)


def status(lab, flags, env=None, data=None):
    extra = [word for key, value in (data or {}).items() for word in ("--data", f"{key}={value}")]
    return pyinfra(lab, ["inventory.py", "runbooks/status.py", "--data", f"sglang_flags={json.dumps(flags)}",
                         "--data", f"sglang_env={json.dumps(env or FAST_ENV)}", *extra, "--limit", "pve_pve1"])


def good_keys(lab):
    return [record["key"] for record in observed(lab)["history"]["good"]]


def two_good_specs(lab):
    """A then B verified: the history holds both (B newest) -> their keys."""
    for flags in (TP2, TP2_FP8):
        run = deploy(lab, flags)
        assert run.returncode == 0, run
    keys = good_keys(lab)
    assert len(keys) >= 2, keys
    return keys


def test_a_truncated_history_is_set_aside_and_its_last_copy_is_used(lab, tmp_path):
    keys = two_good_specs(lab)
    size = int(sh(lab, "pve1", 129, f"stat -c %s {HISTORY}").stdout)
    sh(lab, "pve1", 129, f"truncate -s {size // 2} {HISTORY}")  # cut mid-JSON, for real

    seen = status(lab, TP2_FP8)
    said(seen, "the history of :30000 is unreadable (truncated JSON)", "using the copy of")
    assert "Traceback" not in seen.output, seen

    audit = tmp_path / "audit.jsonl"
    run = deploy(lab, TP2, data={"audit_log": str(audit)})  # back to A: a change, so a plan with notes
    assert run.returncode == 0, run
    said(run, "note: the history of :30000 is unreadable (truncated JSON)")
    kept = sh(lab, "pve1", 129, f"ls {HISTORY}.unreadable-*").stdout.split()
    assert len(kept) == 1, kept
    after = observed(lab)["history"]
    # the older good specs survived: A (moved to the front) and B are both there
    assert [key for key in good_keys(lab)][:2] == [keys[1], keys[0]], after
    assert after["problem"].startswith(f"the history of :30000 was unreadable (truncated JSON): kept as {kept[0]}; "
                                       f"using the copy of "), after
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    assert any(e.get("step") == "history" and "truncated JSON" in e.get("message", "") for e in events), events
    said(status(lab, TP2), f"kept as {kept[0]}")
    sh(lab, "pve1", 129, f"rm -f {kept[0]}")  # looked at: the note goes
    assert observed(lab)["history"]["problem"] is None


def test_a_history_of_the_wrong_shape_is_set_aside_and_nothing_tracebacks(lab):
    keys = two_good_specs(lab)
    sh(lab, "pve1", 129, f"printf '%s' '{{\"schema\": 2, \"port\": 30000, \"good\": [1, \"x\"], \"failed\": []}}' > {HISTORY}")
    seen = status(lab, TP2_FP8)
    said(seen, "the history of :30000 is unreadable (wrong shape: good[0] is int, not an object)")
    assert "Traceback" not in seen.output and "AttributeError" not in seen.output, seen
    run = deploy(lab, TP2)
    assert run.returncode == 0, run
    assert "AttributeError" not in run.output, run
    assert sh(lab, "pve1", 129, f"ls {HISTORY}.wrong-shape-*").stdout.strip(), "not set aside"
    assert good_keys(lab)[:2] == [keys[1], keys[0]]


def test_garbage_in_the_other_state_files_is_no_traceback(lab):
    run = deploy(lab, TP2)
    assert run.returncode == 0, run
    # the lock holds a list, the latest run's journal starts with a list, the pid file is garbage
    sh(lab, "pve1", 129, "echo '[1]' > /run/gpugate/transition.lock; run=$(cat /var/lib/gpugate/runs/latest); "
                         "printf '[1]\\n' | cat - /var/lib/gpugate/runs/$run.jsonl > /tmp/j && "
                         "cat /tmp/j > /var/lib/gpugate/runs/$run.jsonl; echo '{\"pid\": \"x\"' > /run/gpugate/sglang-30000.pid")
    seen = status(lab, TP2)
    assert "Traceback" not in seen.output and "Error:" not in seen.output, seen
    run = deploy(lab, TP2_FP8)
    assert "Traceback" not in run.output, run
    assert run.returncode == 0, run


def test_a_read_only_state_directory_is_refused_before_anything_stops(lab):
    run = deploy(lab, TP2)
    assert run.returncode == 0, run
    pid = main_pid(lab)
    # a read-only /var/lib/gpugate, for real: a read-only bind mount in the container's mount namespace
    made = sh(lab, "pve1", 129, "mount --bind /var/lib/gpugate /var/lib/gpugate && "
                                "mount -o remount,bind,ro /var/lib/gpugate /var/lib/gpugate")
    assert made.returncode == 0, made.stderr
    try:
        run = deploy(lab, TP2_FP8)
        assert run.returncode != 0, run
        said(run, "sglang :30000 REFUSED, nothing touched",
             "/var/lib/gpugate cannot be written in the container (read-only file system): the transition could "
             "not keep its history of good specs")
        assert main_pid(lab) == pid  # the server that serves was not stopped
    finally:
        sh(lab, "pve1", 129, "umount /var/lib/gpugate")
    run = deploy(lab, TP2_FP8)
    assert run.returncode == 0, run


def test_a_model_path_that_is_a_file_is_refused_before_anything_stops(lab):
    run = deploy(lab, TP2)
    assert run.returncode == 0, run
    pid = main_pid(lab)
    sh(lab, "pve1", 129, "mkdir -p /opt/models/filemodel && echo '{}' > /opt/models/filemodel/config.json")
    run = deploy(lab, TP2_FP8, data={"sglang_model_path": "/opt/models/filemodel/config.json"})
    assert run.returncode != 0, run
    said(run, "sglang :30000 REFUSED, nothing touched: the model path /opt/models/filemodel/config.json is a file, "
              "not a directory")
    assert main_pid(lab) == pid
    from gpugate import agentcmd

    for path, kind in (("/opt/models/filemodel/config.json", "file"), ("/opt/models/filemodel", "directory"),
                       ("/opt/models/none", "missing")):  # observe says what the path is
        out = sh(lab, "pve1", 129, agentcmd.inline_observe_command("/usr/bin/python3", {"port": 30000, "model_path": path}))
        assert agentcmd.parse_output(out.stdout.splitlines())["sglang"]["model_path_kind"] == kind, out


def agent_pid(lab):
    out = sh(lab, "pve1", 129, "python3 -c \"import json; print(json.load(open('/run/gpugate/transition.lock'))['pid'])\"")
    return int(out.stdout.strip())


def test_a_frozen_agent_is_named_within_the_bound_and_nothing_is_touched(lab):
    import time

    slow = {**FAST_ENV, "SGLANG_STANDIN_LOAD_S": "8"}  # a slow load (budgets as data: the test stays short)
    bound = {"agent_silence_s": 4, "start_timeout_s": 60}
    frozen = {}

    def freeze(_process):
        frozen["pid"] = agent_pid(lab)
        sh(lab, "pve1", 129, f"kill -STOP {frozen['pid']}")  # a real SIGSTOP of the detached agent
        frozen["at"] = time.monotonic()

    flags = {"tp": 2, "kv-cache-dtype": "fp8_e5m2"}
    run = deploy(lab, flags, env=slow, data=bound, when=[("sglang :30000 started pid", freeze)], timeout=60)
    try:
        took = time.monotonic() - frozen["at"]
        assert run.returncode != 0, run
        said(run, f"the agent pid {frozen['pid']} has written nothing for", "(state T: stopped)",
             "is stalled", "nothing was touched")
        assert took < 4 + 3 + 3, took  # the bound, one follow wait, the command's own time
        began = time.monotonic()
        again = deploy(lab, flags, env=slow, data=bound, timeout=30)
        assert again.returncode != 0, again
        said(again, "REFUSED, nothing touched", "is stalled at load",
             f"the agent pid {frozen['pid']} has written nothing for", "(state T: stopped)")
        seen = status(lab, flags, env=slow, data=bound)
        said(seen, "is stalled at load", f"the agent pid {frozen['pid']}", "(state T: stopped)")
        assert time.monotonic() - began < 15
    finally:
        sh(lab, "pve1", 129, f"kill -CONT {frozen['pid']}")
    # let go, the agent runs its transition to its end
    from tests.faults.conftest import wait_until
    assert wait_until(lambda: (observed(lab).get("transition") or {}).get("outcome") == "verified", 30)
