"""The SGLang facts read through the container agent: the commands run for real through sh on this
machine (the agent observes this machine as it would a container), and their answers are parsed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gpugate import agentcmd
from gpugate.facts.sglang import (SglangObservation, SglangObservationInline, SglangServer, observe_args,
                                  process_observation)

PORT = 39517  # nothing listens here


def sh(command) -> list[str]:
    done = subprocess.run(["sh", "-c", str(command)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_inline_observation_runs_the_agent_and_answers_one_document():
    lines = sh(SglangObservationInline().command(port=PORT, env_names=["HF_TOKEN"], model_path="/no/such/model",
                                                 python=sys.executable))
    doc = SglangObservationInline().process(lines)
    server = doc["sglang"]
    assert server["port"] == PORT and server["running"] is False and server["serving"] is False
    assert server["model_path_exists"] is False and server["command"] is None
    assert set(doc) >= {"sglang", "gpu", "container", "agent"}


def test_an_agent_not_installed_says_so_and_nothing_is_written(tmp_path):
    command = str(SglangObservation().command(port=PORT, python=sys.executable))
    assert len(command) < 2000  # a short invocation, not the agent's source
    doc = SglangObservation().process(sh(command))
    installed = os.path.exists(agentcmd.agent_path())  # normally not on a development machine
    assert bool(doc.get("agent_missing")) is not installed
    assert ("sglang" in doc) is installed


def test_the_running_argv_is_parsed_and_garbage_is_an_error():
    answer = {"sglang": {"running": True, "main": {"pid": 5, "argv": ["/usr/bin/python3", "-m", "sglang.launch_server",
                                                                     "--model-path", "/m", "--tp-size", "8"]}},
              "gpu": {}, "container": {}}
    doc = process_observation(["noise", json.dumps(answer)])
    assert doc["sglang"]["command"]["flags"] == {"tp-size": 8} and doc["sglang"]["command"]["model_path"] == "/m"
    assert SglangServer().process([json.dumps(answer)])["main"]["pid"] == 5
    broken = process_observation(["Traceback (most recent call last):"])
    assert "no JSON" in broken["error"] and broken["sglang"]["running"] is False
    assert SglangServer().process(["Traceback"])["running"] is False


def test_observe_args_are_the_protocols():
    assert observe_args(30001, ["B", "A"], "/m", [4, 5], host="0.0.0.0") == {
        "port": 30001, "env_names": ["A", "B"], "tail_lines": 0, "generate": False, "model_path": "/m",
        "gpus": [4, 5], "host": "0.0.0.0"}
