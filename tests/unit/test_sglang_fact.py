"""The server probe and the stop step on real local processes (no SGLang, no network):
processes whose argv looks like SGLang's, found by the probe and ended by the stop's sweep."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpugate.facts.sglang import SglangObservation, SglangServer
from gpugate.remote import sglang_probe, transition_actions

PORT = 39871
SLEEP = "import time, signal; signal.signal(signal.SIGTERM, signal.SIG_DFL); time.sleep(60)"


def spawn(argv0_and_args, **kw):
    return subprocess.Popen(argv0_and_args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, **kw)


@pytest.fixture
def fake_server():
    """A 'main process' (python -c ... -m sglang.launch_server --port PORT) with a child, and a stray
    worker-titled process (bash exec -a) outside its tree."""
    main = spawn([sys.executable, "-c",
                  "import subprocess,sys,time; subprocess.Popen(['bash','-c','exec -a sglang::scheduler_TP0 sleep 60']);"
                  "time.sleep(60)", "-m", "sglang.launch_server", "--port", str(PORT)], start_new_session=True)
    stray = spawn(["bash", "-c", "exec -a sglang::scheduler_TP1 sleep 60"])
    deadline = time.time() + 5
    while time.time() < deadline:
        doc = sglang_probe.collect(PORT)
        if doc["running"] and len(doc["tree"]) == 2 and doc["strays"]:
            break
        time.sleep(0.05)
    yield main, stray
    for proc in (main, stray):
        proc.kill()
        proc.wait()


def test_probe_finds_main_tree_and_strays(fake_server):
    main, stray = fake_server
    doc = sglang_probe.collect(PORT)
    assert doc["running"] and doc["main"]["pid"] == main.pid
    assert [p["cmdline"].split()[0] for p in doc["tree"][1:]] == ["sglang::scheduler_TP0"]
    assert stray.pid in [p["pid"] for p in doc["strays"]]
    assert doc["listening"] is False and doc["health"]["health"] is None


def in_own_pid_namespace(code: str) -> dict:
    """Run `code` (which sets `result`) in a new PID namespace, as a container would be: the stop's
    sweep must only ever see the test's own processes, never this machine's (other labs' stand-ins)."""
    if os.geteuid() != 0:
        pytest.skip("needs root for unshare")
    script = ("import json, subprocess, sys, time\n"
              "from gpugate.remote import transition_actions, sglang_probe\n" + code + "\nprint(json.dumps(result))")
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(
                              os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr
    return __import__("json").loads(done.stdout.splitlines()[-1])


def test_stop_drains_then_sweeps_every_sglang_process():
    result = in_own_pid_namespace(f"""
main = subprocess.Popen([sys.executable, "-c", "import subprocess,time; subprocess.Popen(['bash','-c','exec -a sglang::scheduler_TP0 sleep 60']); time.sleep(60)", "-m", "sglang.launch_server", "--port", "{PORT}"], start_new_session=True)
stray = subprocess.Popen(["bash", "-c", "exec -a sglang::scheduler_TP1 sleep 60"])
while not (sglang_probe.collect({PORT})["strays"] and len(sglang_probe.collect({PORT})["tree"]) == 2):
    time.sleep(0.05)
stop = transition_actions.stop(None, {PORT}, main.pid, drain_timeout=5, kill_grace=5)
main.wait(); stray.wait()
after = sglang_probe.collect({PORT})
result = {{"stop": stop, "running": after["running"], "strays": after["strays"], "stray_pid": stray.pid}}
""")
    assert result["stop"]["ok"] and result["stop"]["drained"] is True
    assert result["stray_pid"] in result["stop"]["swept"]
    assert result["running"] is False and result["strays"] == []


def test_stop_kills_the_group_when_the_drain_deadline_passes():
    result = in_own_pid_namespace(f"""
ignorer = subprocess.Popen([sys.executable, "-c", "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)", "-m", "sglang.launch_server", "--port", "{PORT}"], start_new_session=True, stdout=subprocess.PIPE)
ignorer.stdout.readline()
stop = transition_actions.stop(None, {PORT}, ignorer.pid, drain_timeout=0.3, kill_grace=5)
result = {{"stop": stop, "pid": ignorer.pid, "code": ignorer.wait()}}
""")
    assert result["stop"]["drained"] is False and result["pid"] in result["stop"]["killed"]
    assert result["code"] == -9


def test_fact_commands_are_one_command_and_parse_probe_output():
    command = SglangObservation().command(port=30000)
    assert str(command).startswith("if command -v /usr/bin/python3 ") and "exec /usr/bin/python3 -c" in str(command)
    doc = SglangServer().process(['noise', '{"sglang": {"running": true, "main": {"pid": 5, "argv": '
                                  '["/usr/bin/python3", "-m", "sglang.launch_server", "--model-path", "/m", "--tp", "8"]}}}'])
    assert doc["command"]["flags"] == {"tp-size": 8} and doc["command"]["model_path"] == "/m"
    assert SglangServer().process(["Traceback ..."])["running"] is False


def test_observation_runs_locally_and_exits_zero():
    command = SglangObservation().command(port=PORT + 2)
    done = subprocess.run(["sh", "-c", str(command)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    doc = SglangObservation().process(done.stdout.splitlines())
    assert doc["sglang"]["running"] is False and "gpus" in doc["gpu"]
