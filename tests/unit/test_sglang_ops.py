"""sglang.server without a network: the operation's decisions from mocked observations
(list(op._inner(...)) under pyinfra's context objects), and the pure transition logic."""

from __future__ import annotations

import json
from unittest.mock import MagicMock

import pytest
from pyinfra.api import Config, FunctionCommand
from pyinfra.api.exceptions import OperationError
from pyinfra.context import ctx_host, ctx_state

from gpugate import audit
from gpugate import transition as tr
from gpugate.operations import sglang
from gpugate.remote import sglang_probe, transition_actions
from gpugate.sglang_args import render_argv

MODEL = "/opt/models/lab-model"


def gpus(used=0, processes=()):
    return {"source": "nvml", "memory_api": "v2", "errors": [], "holders": [],
            "gpus": [{"index": i, "used_mib": used, "reserved_mib": 615, "processes": list(processes)}
                     for i in range(8)]}


def running(flags, env_hashes=None, health=200, port=30000):
    argv = ["/usr/bin/python3"] + render_argv(MODEL, port, flags)
    return {"port": port, "running": True, "main": {"pid": 41, "pgid": 41, "argv": argv, "state": "S"},
            "tree": [{"pid": 41}], "strays": [], "listening": True, "listener_pids": [41],
            "health": {"health": health}, "env_hashes": env_hashes or {}, "state": None,
            "model_path_exists": True, "memory_limit_bytes": 512 * 10**9}


def stopped(port=30000):
    return {"port": port, "running": False, "main": None, "tree": [], "strays": [], "listening": False,
            "listener_pids": [], "health": {"health": None}, "env_hashes": {}, "state": None,
            "model_path_exists": True, "memory_limit_bytes": 512 * 10**9}


def run_op(observation, executing=False, **kwargs):
    state = MagicMock(config=Config(), is_executing=executing, check_for_changes=True)
    host = MagicMock()
    host.get_fact.return_value = observation
    kwargs.setdefault("model_path", MODEL)
    with ctx_state.use(state), ctx_host.use(host):
        commands = list(sglang.server._inner(**kwargs))
    return commands, host


def step_names(commands):
    return [c.function.__name__ for c in commands]


def logged(host):
    return "\n".join(call.args[0] for call in host.log.call_args_list)


def test_same_flags_and_healthy_is_a_noop():
    commands, host = run_op({"sglang": running({"tp": 8}), "gpu": gpus(80000)}, flags={"tp": 8})
    assert commands == []
    host.noop.assert_called_once_with("sglang on :30000 already runs with the desired flags")


def test_first_start_plans_the_whole_transition():
    commands, host = run_op({"sglang": stopped(), "gpu": gpus()}, flags={"tp": 8})
    # record travels with the stop's first chunk, prepare and start with the gate's passing chunk
    assert step_names(commands) == ["sglang_lock", "sglang_stop", "sglang_gate", "sglang_wait_healthy",
                                    "sglang_verify", "sglang_unlock"]
    assert "will start" in logged(host) and "+ --tp-size 8" in logged(host)


def test_flag_change_prints_the_diff_once_and_restarts():
    commands, host = run_op({"sglang": running({"tp": 8}), "gpu": gpus(80000, [{"pid": 50, "used_mib": 80000}])},
                            flags={"tp": 8, "kv-cache-dtype": "fp8_e4m3"})
    assert "sglang_stop" in step_names(commands)
    assert "+ --kv-cache-dtype fp8_e4m3" in logged(host)
    # executing after a prepare that already printed it: no second copy
    _, host = run_op({"sglang": running({"tp": 8}), "gpu": gpus(80000, [{"pid": 50, "used_mib": 80000}])},
                     executing=True, flags={"tp": 8, "kv-cache-dtype": "fp8_e4m3"})
    assert "+ --kv-cache-dtype" not in logged(host)


def test_env_only_change_restarts_without_showing_the_value():
    commands, host = run_op({"sglang": running({"tp": 8}), "gpu": gpus()}, flags={"tp": 8},
                            env={"HF_TOKEN": "hf_secret"})
    assert "sglang_stop" in step_names(commands)
    assert "+ env HF_TOKEN=***" in logged(host) and "hf_secret" not in logged(host)


def test_env_with_the_same_value_is_a_noop():
    server = running({"tp": 8}, env_hashes={"HF_TOKEN": sglang_probe.env_hash("hf_secret")})
    commands, _ = run_op({"sglang": server, "gpu": gpus()}, flags={"tp": 8}, env={"HF_TOKEN": "hf_secret"})
    assert commands == []


def test_removal_stops_and_gates_and_absent_is_a_noop():
    commands, _ = run_op({"sglang": running({"tp": 8}), "gpu": gpus()}, present=False)
    assert step_names(commands) == ["sglang_lock", "sglang_stop", "sglang_gate", "sglang_unlock"]
    commands, host = run_op({"sglang": stopped(), "gpu": gpus()}, present=False)
    assert commands == [] and host.noop.called


def test_bad_flag_fails_before_any_fact_or_command():
    with pytest.raises(OperationError, match="fp9"):
        run_op({"sglang": running({"tp": 8}), "gpu": gpus()}, flags={"kv-cache-dtype": "fp9"})
    # while executing (-y): one failing command for this host only, nothing remote
    commands, host = run_op({"sglang": running({"tp": 8}), "gpu": gpus()}, executing=True,
                            flags={"kv-cache-dtype": "fp9"})
    assert len(commands) == 1 and commands[0].function.__name__ == "_fail_with"
    host.get_fact.assert_not_called()


@pytest.mark.parametrize("bad", [{"port": 0}, {"port": "30000; rm -rf /"}, {"model_path": ""},
                                 {"env": {"A B": "x"}}, {"env": {"A": "x\nB=y"}}, {"supervisor": "docker"}])
def test_bad_input_is_refused(bad):
    with pytest.raises(OperationError):
        run_op({"sglang": stopped(), "gpu": gpus()}, **dict({"flags": {"tp": 8}}, **bad))


def test_foreign_memory_refuses_before_the_stop():
    # 4096 MiB per GPU with no process of this container: held from outside
    observation = {"sglang": running({"tp": 8}), "gpu": gpus(4096)}
    with pytest.raises(OperationError, match="outside the container") as error:
        run_op(observation, flags={"tp": 8, "kv-cache-dtype": "fp8_e4m3"})
    assert "keeps running" in str(error.value)


def test_checks_before_the_stop_tp_gpus_hicache_model():
    server = running({"tp": 8})
    server["model_path_exists"] = False
    server["memory_limit_bytes"] = 100 * 10**9
    problems = tr.preflight({"sglang": server, "gpu": gpus()},
                            tr.desired_spec(MODEL, 30000, {"tp": 16, "enable-hierarchical-cache": True,
                                                           "hicache-size": 48}, {}), 64)
    text = "\n".join(problems)
    assert "does not exist" in text and "needs 16 GPUs" in text and "hicache-size 48" in text


def test_loading_server_with_desired_flags_is_waited_for_not_restarted():
    commands, _ = run_op({"sglang": running({"tp": 8}, health=503), "gpu": gpus()}, flags={"tp": 8})
    assert step_names(commands) == ["sglang_wait_healthy", "sglang_verify"]


def test_restarted_forces_a_restart():
    commands, _ = run_op({"sglang": running({"tp": 8}), "gpu": gpus()}, flags={"tp": 8}, restarted=True)
    assert "sglang_stop" in step_names(commands)


def test_restarted_survives_the_second_look_under_the_lock(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUGATE_AUDIT_LOG", str(tmp_path / "audit.jsonl"))  # not the project's log
    observation = {"sglang": running({"tp": 8}), "gpu": gpus()}
    spec = tr.desired_spec(MODEL, 30000, {"tp": 8}, {})
    transition = sglang.Transition(spec, tr.decide(observation["sglang"], spec, True), observation, port=30000,
                                   max_used_mib=64, gate_timeout=5, drain_timeout=5, kill_grace=1,
                                   start_timeout=5, lock_wait=0, python="/usr/bin/python3", restarted=True)
    # the lock and the look under it in one command: unchanged, healthy, desired flags
    monkeypatch.setattr(transition, "_run", lambda host, calls, **kw: (
        [{"acquired": True}] + [{"ok": True}] * (len(calls) - 2) + [{"ok": True, "server": observation["sglang"]}]))
    host = MagicMock()
    transition.take_lock(host)
    assert not transition.done and transition.change.action == "restart"
    assert "already converged" not in logged(host)
    lock_events = [e for e in audit.read_events(tmp_path / "audit.jsonl") if e["step"] == "lock"]
    assert [(e["phase"], e.get("action")) for e in lock_events] == [("begin", None), ("end", "restart")]


def test_env_file_round_trips_quotes_and_backslashes():
    env = {"A": 'x"; rm -rf / $(id) \\ \'q\'', "B": ""}
    assert transition_actions.parse_env_file(tr.env_file_text(env)) == env


def test_a_secret_argument_travels_on_stdin_never_in_the_command_line():
    call = tr.remote_call("prepare_start", secret={"env_b64": "c2VjcmV0"}, lock=None, port=1, env_file="/x")
    assert "c2VjcmV0" not in call.command.get_raw_value() and "c2VjcmV0" not in str(call.command)
    assert json.loads(call.stdin) == {"env_b64": "c2VjcmV0"}
    assert tr.remote_call("lock_release", path="/x", token="t").stdin is None  # nothing to read: stdin untouched


def test_lock_lease_blocks_a_second_operator_and_lapses(tmp_path, monkeypatch):
    path = str(tmp_path / "sglang.lock")
    assert transition_actions.lock_acquire(path, "a", "alice@x", lease_s=60)["acquired"]
    second = transition_actions.lock_acquire(path, "b", "bob@y", lease_s=60)
    assert not second["acquired"] and second["holder"]["owner"] == "alice@x"
    assert transition_actions.lock_renew({"path": path, "token": "b", "lease_s": 5}, "stop")["ok"] is False
    now = transition_actions.time.time()
    monkeypatch.setattr(transition_actions.time, "time", lambda: now + 61)  # alice's run died
    taken = transition_actions.lock_acquire(path, "b", "bob@y", lease_s=60)
    assert taken["acquired"] and taken["taken_over"]["owner"] == "alice@x"
    assert transition_actions.lock_release(path, "a")["released"] is False
    assert transition_actions.lock_release(path, "b")["released"] is True


def test_sglang_process_match_is_on_argv_not_text():
    assert sglang_probe.is_main_argv(["/usr/bin/python3", "-m", "sglang.launch_server", "--port", "1"])
    assert sglang_probe.is_main_argv(["/usr/local/bin/sglang", "serve", "--model-path", "m"])
    assert sglang_probe.is_sglang_argv(["sglang::scheduler_TP3"])
    assert not sglang_probe.is_sglang_argv(["sh", "-c", "python3 -m sglang.launch_server"])
    assert not sglang_probe.is_sglang_argv(["vim", "sglang.launch_server"])
    assert sglang_probe.argv_port(["python3", "-m", "sglang.launch_server", "--port=30001"]) == 30001


def test_the_state_file_record_holds_no_secret_value():
    spec = tr.desired_spec(MODEL, 30000, {"tp": 8, "api-key": "sk-canary"}, {"HF_TOKEN": "hf-canary"})
    text = str(spec.record())
    assert "sk-canary" not in text and "hf-canary" not in text
    assert spec.record()["flags"] == {"tp-size": 8, "api-key": "***"}
    assert spec.record()["argv_hash"] == sglang_probe.argv_hash(spec.argv)  # the exact argv, by hash


def test_record_keeps_the_running_argv_and_env_in_0600_files(tmp_path):
    import json as _json, os, subprocess, sys, time
    env_file = tmp_path / "sglang.env"
    env_file.write_text(tr.env_file_text({"HF_TOKEN": "hf-canary"}))
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "--api-key", "sk-canary"])
    for _ in range(500):  # until the child has exec'd (before that /proc shows the parent's argv)
        if b"sk-canary" in open(f"/proc/{server.pid}/cmdline", "rb").read():
            break
        time.sleep(0.01)
    try:
        document = {"previous": {"flags": {"api-key": "***"}}}
        result = transition_actions.record(None, str(tmp_path / "state.json"), str(env_file), document,
                                           save={"main_pid": server.pid, "argv_file": str(tmp_path / "prev.argv"),
                                                 "env_file": str(tmp_path / "prev.env"), "key": "previous"})
    finally:
        server.kill()
    assert result["saved"] and _json.loads((tmp_path / "prev.argv").read_text())[-1] == "sk-canary"
    assert "hf-canary" in (tmp_path / "prev.env").read_text()
    assert oct(os.stat(tmp_path / "prev.argv").st_mode & 0o777) == "0o600"
    assert oct(os.stat(tmp_path / "prev.env").st_mode & 0o777) == "0o600"
    state = (tmp_path / "state.json").read_text()
    assert "canary" not in state and result["entry"]["env_names"] == ["HF_TOKEN"]


def test_restore_previous_compares_by_hash_and_refuses_without_a_record():
    previous_spec = tr.desired_spec(MODEL, 30000, {"tp": 8, "api-key": "sk-1"}, {})
    server = running({"tp": 8, "api-key": "sk-1"})
    server["state"] = {"current": None, "previous": previous_spec.record()}
    server["previous_argv_saved"] = True
    target = tr.previous_target(server, "/s.json")
    assert tr.compare_previous(server, target).action == "noop"
    other = running({"tp": 8, "api-key": "sk-2"})  # only the secret differs
    other["state"], other["previous_argv_saved"] = server["state"], True
    assert tr.compare_previous(other, target).action == "restart"
    with pytest.raises(tr.SpecError, match="is missing"):
        tr.previous_target(stopped(), "/s.json")
    commands, host = run_op({"sglang": other, "gpu": gpus()}, restore_previous=True, model_path=None)
    assert "sglang_stop" in step_names(commands) and "sk-" not in logged(host)


# ---------------------------------------------------------------- several steps in one remote command
def test_a_record_that_fails_stops_the_command_before_the_drain(tmp_path):
    import subprocess, sys
    lock = str(tmp_path / "sglang.lock")
    transition_actions.lock_acquire(lock, "other", "bob@y", lease_s=60)  # our lease was taken over
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        mine = {"path": lock, "token": "mine", "lease_s": 60}
        out = transition_actions.sequence([
            tr.step_call("record", lock=mine, state_file=str(tmp_path / "state.json"), env_file=None,
                         document={"phase": "changing"}),
            tr.step_call("drain", lock=mine, main_pid=server.pid, chunk_s=0.1, deadline_s=0.1, kill_grace=0.1),
            tr.step_call("lock_release", path=lock, token="mine", always=True)])
        assert server.poll() is None  # never signalled: the drain did not run
    finally:
        server.kill()
    record, release = out["results"]
    assert record["error"] == "lock lost" and record["function"] == "record"
    assert release["released"] is False and not (tmp_path / "state.json").exists()


def test_the_load_reading_follows_the_start_in_the_same_command(tmp_path):
    import sys
    out = transition_actions.sequence([
        tr.step_call("start_process", lock=None, argv=[sys.executable, "-c", "import time; time.sleep(30)"],
                     env_file=None, log_file=str(tmp_path / "server.log"), pid_file=str(tmp_path / "server.pid")),
        tr.step_call("wait_healthy", lock=None, port=1, chunk_s=60, log_file=str(tmp_path / "server.log"),
                     budget_kwarg="chunk_s", inputs={"pid": "pid", "log_offset": "log_offset"}),
        tr.step_call("observe", port=1)], budget_s=0.2)
    started, load = out["results"]  # still loading (port closed): no probe for verify yet
    try:
        assert started["pid"] == int((tmp_path / "server.pid").read_text())
        assert load["phase"] == "loading" and load["pending"]  # the new pid is alive; the 60 s cut to the budget
    finally:
        transition_actions.os.kill(started["pid"], 9)


def test_a_sequence_sends_each_steps_secrets_on_stdin_and_the_container_applies_them(tmp_path):
    argv = ["/usr/bin/python3", "-m", "sglang.launch_server", "--api-key", "sk-canary"]
    calls = [tr.step_call("observe", port=1),
             tr.step_call("stage_env", lock=None, staged_file="/x", secret={"env_b64": "SEZfVE9LRU49aGY="}),
             tr.step_call("start_process", lock=None, secret={"argv": argv}, env_file="/e", log_file="/l", pid_file="/p")]
    call = tr.sequence_call(calls)
    raw = call.command.get_raw_value()
    assert "SEZfVE9LRU49aGY=" not in raw and "sk-canary" not in raw
    assert json.loads(call.stdin) == {"secrets": {"1": {"env_b64": "SEZfVE9LRU49aGY="}, "2": {"argv": argv}}}
    # the container's side: position "0" gets the argument meant for the first step
    staged = tmp_path / "env.next"
    out = transition_actions.sequence([{"function": "stage_env", "kwargs": {"lock": None, "staged_file": str(staged)}}],
                                      secrets={"0": {"env_b64": "SEZfVE9LRU49aGY="}})
    assert out["results"][0]["ok"] and staged.read_text() == "HF_TOKEN=hf"


def test_the_env_file_is_staged_0600_under_our_lease_only(tmp_path):
    import base64, os
    lock = str(tmp_path / "sglang.lock")
    transition_actions.lock_acquire(lock, "mine", "alice@x", lease_s=60)
    text = base64.b64encode(tr.env_file_text({"HF_TOKEN": "hf-canary"}).encode()).decode()
    staged = tmp_path / "sglang.env.next"
    assert transition_actions.stage_env({"path": lock, "token": "mine", "lease_s": 60}, str(staged), text)["ok"]
    assert oct(os.stat(staged).st_mode & 0o777) == "0o600" and "hf-canary" in staged.read_text()
    other = tmp_path / "other.env.next"
    refused = transition_actions.stage_env({"path": lock, "token": "theirs", "lease_s": 60}, str(other), text)
    assert refused["error"] == "lock lost" and not other.exists()
