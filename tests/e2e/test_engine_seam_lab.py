"""The engine seam, end to end: an engine that only the tests register (tests/engines/echo_engine,
found through the ``gpugate.engines`` entry point of tests/engines/echo_engine-0.1.dist-info on
PYTHONPATH) deploys, restarts and rolls back through the real pyinfra CLI, deploy.py and the @pct
connector in the lab, with no change to gpugate: its launch, its process recognition and its
endpoints are its own, and the agent loads its container module by the name the start document
carries. In order, as an operator's successive runs."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests import warm_pyinfra
from tests.conftest import REPO_ROOT, module_lab, pyinfra_exe

pytestmark = [pytest.mark.lab, pytest.mark.slow]

ENGINES = REPO_ROOT / "tests" / "engines"
PORT = 8000


IN_CT = "/opt/echo"  # where the container has the echo server: it sees none of this checkout (/tmp is its own)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    for lab in module_lab(tmp_path_factory, "lab-engine-seam", hosts=1, gpus=2):
        lab.pct("pve1", "exec", "129", "--", "mkdir", "-p", IN_CT)
        pushed = lab.pct("pve1", "push", "129", str(ENGINES / "echo_server.py"), f"{IN_CT}/echo_server.py")
        assert pushed.returncode == 0, pushed.stderr
        yield lab


def deploy(lab, flags, *extra: str, engine: str = "echo") -> subprocess.CompletedProcess:
    env = lab.env()
    env["PYTHONPATH"] = os.pathsep.join([str(ENGINES), env.get("PYTHONPATH", "")])  # registers the engine
    server_env = {"PYTHONPATH": IN_CT} if engine == "echo" else {"SGLANG_STANDIN_LOAD_S": "0.3"}
    model = "/tmp" if engine == "echo" else "/opt/models/lab-model"
    args = ["inventory.py", "deploy.py", "--data", f"engine={engine}", "--data", f"sglang_port={PORT}",
            "--data", f"sglang_model_path={model}",
            "--data", f"sglang_flags={json.dumps(flags)}", "--data", "sglang_supervisor=process",
            "--data", f"sglang_env={json.dumps(server_env)}", "--data", "start_timeout_s=20"]
    return warm_pyinfra.run([pyinfra_exe(), "-y", *args, *extra], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)


def served(lab, path: str) -> str:
    out = lab.pct("pve1", "exec", "129", "--", "python3", "-c",
                  f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{PORT}{path}', timeout=5).read().decode())")
    return out.stdout.strip()


def main_pid(lab) -> str:
    out = lab.pct("pve1", "exec", "129", "--", "sh", "-c", f"cat /run/gpugate/sglang-{PORT}.pid 2>/dev/null")
    return str(json.loads(out.stdout)["pid"]) if out.stdout.strip() else ""


def test_the_test_engine_starts_verified(lab):
    result = deploy(lab, {"greeting": "hi"})
    said = result.stdout + result.stderr
    assert result.returncode == 0, said
    assert "echo :8000 verified: the running argv and /info match the desired flags" in said, said
    assert "Echo on :8000" in said and "sglang" not in said.lower().replace("sglang_", ""), said  # its own name
    assert json.loads(served(lab, "/generate")) == {"text": "hi"}


def test_a_flag_change_restarts_it_and_a_rerun_changes_nothing(lab):
    before = main_pid(lab)
    result = deploy(lab, {"greeting": "hello there"})
    said = result.stdout + result.stderr
    assert result.returncode == 0, said
    assert "- --greeting hi" in said and "+ --greeting hello there" in said, said
    assert main_pid(lab) != before and json.loads(served(lab, "/info"))["greeting"] == "hello there"
    again = deploy(lab, {"greeting": "hello there"})
    assert again.returncode == 0 and "No changes" in again.stdout + again.stderr and "stopping" not in again.stdout, \
        again.stdout + again.stderr


def test_a_start_that_fails_rolls_back_to_the_last_good_one(lab):
    result = deploy(lab, {"greeting": "broken", "fail-at-start": True})
    said = result.stdout + result.stderr
    assert result.returncode != 0, said
    assert "rolled back" in said.lower() or "roll" in said.lower(), said
    assert json.loads(served(lab, "/info"))["greeting"] == "hello there"


def test_a_flag_the_engine_does_not_have_is_refused_and_touches_nothing(lab):
    before = main_pid(lab)
    result = deploy(lab, {"greting": "typo"})
    said = result.stdout + result.stderr
    assert result.returncode != 0 and "greting" in said and "not a flag of Echo" in said, said
    assert main_pid(lab) == before


def processes(lab) -> str:
    return lab.pct("pve1", "exec", "129", "--", "sh", "-c", "ps -eo args").stdout


def test_switching_the_port_to_another_engine_replaces_the_server(lab):
    result = deploy(lab, {"tp": 1}, engine="sglang")
    said = result.stdout + result.stderr
    assert result.returncode == 0 and "sglang :8000 verified" in said, said
    assert "echo_server" not in processes(lab)  # the echo server was this port's: stopped, not left behind
    assert json.loads(served(lab, "/get_server_info"))["port"] == PORT


def test_a_failed_switch_rolls_back_to_the_other_engines_server(lab):
    result = deploy(lab, {"greeting": "new", "fail-at-start": True})
    said = result.stdout + result.stderr
    assert result.returncode != 0 and "NOTHING SERVES" not in said, said
    assert "rolled back" in said.lower(), said
    running = processes(lab)
    assert "sglang.launch_server" in running and "echo_server" not in running, running
    assert json.loads(served(lab, "/get_server_info"))["port"] == PORT  # SGLang's own endpoint answers again
    status = warm_pyinfra.run([pyinfra_exe(), "-y", "inventory.py", "runbooks/status.py", "--data", "engine=sglang",
                             "--data", f"sglang_port={PORT}", "--data", "sglang_model_path=/opt/models/lab-model",
                             "--data", 'sglang_flags={"tp": 1}', "--data", "sglang_supervisor=process",
                             "--data", 'sglang_env={"SGLANG_STANDIN_LOAD_S": "0.3"}'],
                            cwd=REPO_ROOT, env=lab.env(), capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    # the status says what happened and what serves: the failed switch, the SGLang server back
    assert "transition failed: rolled_back" in status.stdout and "serving pid" in status.stdout, status.stdout
