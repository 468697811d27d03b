"""sglang.server's keyword form end to end: a deploy file of one's own (not deploy.py) that names the
server by its settings, ``sglang.server(model_path=..., port=..., flags={...}, env={...})``, run
through the real pyinfra CLI and the @pct connector against a lab host: it starts the server, a
changed flag restarts it, a rerun changes nothing; a mistyped argument stops the run at its line.

One lab for this module (one host, two GPUs, container 129); the tests run in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import module_lab

pytestmark = [pytest.mark.lab, pytest.mark.slow]

PORT = 30002  # not the lab fleet's 30000: the keywords, not the host data, name the server

DEPLOY = '''\
from gpugate.operations import sglang

sglang.server(
    name="SGLang of my own deploy",
    model_path="/opt/models/lab-model",
    port={port},
    {flags_argument}={flags!r},
    env={{"SGLANG_STANDIN_LOAD_S": "0.3"}},
)
'''


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-server-keywords", hosts=1, gpus=2)


@pytest.fixture(scope="module")
def deploy_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("own-deploy") / "my_deploy.py"


def run(lab, deploy_file: Path, flags: dict, flags_argument: str = "flags") -> tuple[int, str]:
    deploy_file.write_text(DEPLOY.format(port=PORT, flags=flags, flags_argument=flags_argument))
    result = lab.pyinfra("inventory.py", str(deploy_file))
    return result.returncode, result.stdout + result.stderr


def main_pid(lab) -> str:
    out = lab.pct("pve1", "exec", "129", "--", "sh", "-c", f"cat /run/gpugate/sglang-{PORT}.pid 2>/dev/null")
    return str(json.loads(out.stdout)["pid"]) if out.stdout.strip() else ""


def running_argv(lab) -> list[str]:
    pid = main_pid(lab)
    out = lab.pct("pve1", "exec", "129", "--", "sh", "-c", f"tr '\\0' '\\n' < /proc/{pid}/cmdline")
    return out.stdout.splitlines()


def test_the_keyword_form_starts_the_server(lab, deploy_file):
    rc, said = run(lab, deploy_file, {"tp": 2})
    assert rc == 0, said
    assert "SGLang of my own deploy" in said and "healthy and generating" in said, said
    argv = running_argv(lab)
    assert argv[argv.index("--port") + 1] == str(PORT) and argv[argv.index("--tp-size") + 1] == "2", argv


def test_a_changed_flag_restarts_it_and_a_rerun_changes_nothing(lab, deploy_file):
    before = main_pid(lab)
    rc, said = run(lab, deploy_file, {"tp": 2, "kv-cache-dtype": "fp8_e4m3"})
    assert rc == 0, said
    assert "+ --kv-cache-dtype fp8_e4m3" in said, said
    assert main_pid(lab) != before and "fp8_e4m3" in running_argv(lab)
    rc, said = run(lab, deploy_file, {"tp": 2, "kv-cache-dtype": "fp8_e4m3"})
    assert rc == 0 and "No changes" in said and "stopping" not in said, said


def test_a_mistyped_argument_stops_the_run_at_its_line_and_touches_nothing(lab, deploy_file):
    before = main_pid(lab)
    rc, said = run(lab, deploy_file, {"tp": 1}, flags_argument="flag")
    assert rc != 0, said
    assert "my_deploy.py line 3" in said and "unknown argument 'flag' (did you mean flags?)" in said, said
    assert "Traceback" not in said and main_pid(lab) == before
