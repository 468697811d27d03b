"""The audit log: JSON lines a user can read with jq, secrets never written."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from gpugate import audit
from gpugate.audit import read_events

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_each_event_is_one_json_line_with_step_run_and_operator(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUGATE_OPERATOR", "alice")
    log = tmp_path / "audit.jsonl"
    audit.emit("drain", path=log, host="@pct/pve1:129", vmid=129, phase="begin")
    audit.emit("drain", path=log, host="@pct/pve1:129", vmid=129, phase="end", duration_s=1.5)

    lines = log.read_text().splitlines()
    assert len(lines) == 2
    events = [json.loads(line) for line in lines]
    assert [e["phase"] for e in events] == ["begin", "end"]
    assert all(e["step"] == "drain" and e["operator"] == "alice" and e["vmid"] == 129 for e in events)
    assert events[0]["run"] == events[1]["run"]
    assert "ts" in events[0]


def test_secret_values_never_reach_the_file(tmp_path):
    log = tmp_path / "audit.jsonl"
    audit.emit(
        "start",
        path=log,
        env={"HF_TOKEN": "hf_very_secret", "CUDA_VISIBLE_DEVICES": "0,1"},
        flags_after={"api-key": "sk-also-secret", "tp": 8},
        token="plain-secret",
    )
    text = log.read_text()
    for secret in ("hf_very_secret", "sk-also-secret", "plain-secret"):
        assert secret not in text
    event = audit.read_events(log)[0]
    # an env value is masked when its name names a secret; the others are shown (issue 32 item 10)
    assert event["env"] == {"HF_TOKEN": "***", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert event["flags_after"] == {"api-key": "***", "tp": 8}


def test_default_path_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUGATE_AUDIT_LOG", str(tmp_path / "custom.jsonl"))
    audit.emit("gate", outcome="passed")
    assert audit.read_events(tmp_path / "custom.jsonl")[0]["outcome"] == "passed"


def test_the_test_session_never_writes_the_repository_audit_log():
    """tests/conftest.py points $GPUGATE_AUDIT_LOG at a temporary file for the whole session, so the
    events of every test (and of the pyinfra runs they start) stay out of ./audit.jsonl."""
    import os
    from pathlib import Path

    from gpugate import audit

    repo = Path(__file__).resolve().parents[2]
    target = audit.audit_log_path(None).resolve()
    assert os.environ.get("GPUGATE_AUDIT_LOG"), "conftest did not set GPUGATE_AUDIT_LOG"
    assert repo not in target.parents, target


def test_ctrl_c_while_the_audit_log_is_being_written_still_exits_non_zero(tmp_path):
    """CI saw a run print "interrupted: the transition continues" and then hang: the signal came while
    the main thread was writing an audit event, and the handler's own event waited for the lock the
    interrupted write held. Here SIGINT lands again and again in the middle of audit writes."""
    child = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        import pyinfra
        pyinfra.is_cli = True
        from gpugate.operations import sglang
        sglang.Run().catch_interrupts()  # as the run's first sglang.server call makes it
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
        while True:
            sglang.emit("follow", note="x" * 200_000)  # a long write: the signal lands inside it
    """)
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=15,
                            cwd=REPO_ROOT, env=dict(os.environ, GPUGATE_AUDIT_LOG=str(tmp_path / "audit.jsonl")))
    assert result.returncode == 130, result.stderr
    assert "interrupted before any hand-off: nothing was touched" in result.stderr
    assert read_events(tmp_path / "audit.jsonl")[-1]["step"] == "interrupted"
