"""Fleet-wide faults and bad input, through the real pyinfra CLI against a lab of 5 hosts (2 GPUs each,
container 129 on every host, tp 2): a rolling restart while one host fails, a stopped container and an
unknown vmid beside a healthy one, malformed fleet.yaml, and shell-injection strings in every field that
reaches a shell (checked with canary files that must never appear).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex

import pytest

from tests.conftest import module_lab
from tests.faults.conftest import (FAST_ENV, deploy, flag_value, health, main_pid, pyinfra,
                                   observed, running_argv, said, sh)

pytestmark = [pytest.mark.faults, pytest.mark.lab]

HOSTS = [f"pve{i}" for i in range(1, 6)]  # two before the failure, two after
TP2 = {"tp": 2}
TP2_FP8 = {"tp": 2, "kv-cache-dtype": "fp8_e4m3"}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "faults-fleet", hosts=len(HOSTS), gpus=2)


@pytest.fixture(scope="module")
def fleet_serving(lab):
    """Every host's container 129 serves tp 2 (one parallel run)."""
    run = deploy(lab, TP2, limit=None)
    assert run.returncode == 0, run.output
    return {host: main_pid(lab, host) for host in HOSTS}


def with_fleet(lab, tmp_path, text: str):
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return dataclasses.replace(lab, fleet_path=path)


def ssh_line(lab, host: str) -> str:
    """The `ssh: {...}` line of `host` in the lab's own fleet file."""
    text = lab.fleet_path.read_text()
    return re.search(rf"^  {host}:\n(    ssh: .*)$", text, re.M).group(1)


def test_rolling_restart_of_a_fleet_stops_at_the_first_failure(lab, fleet_serving):
    # Every start on pve3 and pve4 crashes (the new spec and the rollback). The rolling restart visits the
    # containers in fleet order (pyinfra keeps its hosts in a set; sglang.server orders them): pve1-2
    # restart, pve3 fails, pve4-5 are never touched.
    faulty = ("pve3", "pve4")
    for host in faulty:
        lab.fault(host, 129, "crash-on-start")
    try:
        run = deploy(lab, TP2_FP8, data={"rolling": True}, limit=None, timeout=300)
    finally:
        for host in faulty:
            lab.fault(host, 129, "crash-on-start", clear=True)
    assert run.returncode != 0, run.output  # the run's exit status says one host failed
    said(run, "crash-on-start")
    lines = run.output.splitlines()

    def first_line(host: str, text: str) -> int | None:
        found = [i for i, line in enumerate(lines) if f"[@pct/{host}:129] sglang :30000 {text}" in line]
        return found[0] if found else None

    failed = [host for host in faulty if first_line(host, "!! NOTHING SERVES on :30000") is not None]
    assert failed == ["pve3"], run.output
    failed_at = first_line(failed[0], "started pid")
    assert failed_at is not None, run.output
    for host in HOSTS:
        if host == failed[0]:
            continue
        argv = running_argv(lab, host)
        assert health(lab, host) == 200, host  # every other container serves
        if first_line(host, "not touched") is not None:  # after the failure: untouched, old flags
            assert first_line(host, "not touched") > failed_at and first_line(host, "stopping") is None, host
            assert flag_value(argv, "--kv-cache-dtype") is None and main_pid(lab, host) == fleet_serving[host]
        else:  # before it: restarted onto the new flags, one at a time
            assert first_line(host, "done in") < failed_at, host
            assert flag_value(argv, "--kv-cache-dtype") == "fp8_e4m3", host
    untouched = [host for host in HOSTS if first_line(host, "not touched") is not None]
    assert untouched == list(HOSTS[HOSTS.index("pve3") + 1:]), untouched
    said(run, "not touched (the rolling restart stopped after 1 failed container(s)")
    summary = run.output.split("not touched (the rolling restart stopped after 1 failed container(s)", 1)[1]
    assert all(f"@pct/{host}:129" in summary.splitlines()[0] for host in untouched), summary
    # the failed one serves again once the cause is gone
    run = deploy(lab, TP2, limit=f"pve_{failed[0]}")
    assert run.returncode == 0, run.output


def test_stopped_container_and_unknown_vmid_fail_alone(lab, fleet_serving, tmp_path):
    from gpugate_lab import core

    core.add_container(lab.dir, "pve1", 131, start=False)
    ssh = ssh_line(lab, "pve1")
    sglang = "sglang: {model_path: /opt/models/lab-model, port: 30000, flags: {tp: 2}}"
    # 131 and 999 want no server: three servers on the same two GPUs would be refused, each of them, as
    # overlapping GPU claims (tests/e2e/test_claims_lab.py), before any container is reached
    absent = "sglang: {model_path: /opt/models/lab-model, port: 30000, flags: {tp: 2}, present: false}"
    fleet = with_fleet(lab, tmp_path, f"hosts:\n  pve1:\n{ssh}\n    containers:\n"
                                      f"      129: {{{sglang}}}\n      131: {{{absent}}}\n      999: {{{absent}}}\n")
    before = main_pid(lab, "pve1")
    run = deploy(fleet, dict(TP2, **{"disable-radix-cache": True}), limit=None)
    assert run.returncode != 0, run.output
    said(run, "[@pct/pve1:131] pct error: container 131 on pve1 is not running: status: stopped",
         "[@pct/pve1:999] pct error: no container 999 on pve1: "
         "Configuration file 'nodes/pve1/lxc/999.conf' does not exist")
    assert "could not load fact" not in run.output
    assert "--disable-radix-cache" in running_argv(lab, "pve1")  # the healthy one went on
    assert main_pid(lab, "pve1") != before and health(lab, "pve1") == 200
    assert "stopped" in lab.host_exec("pve1", "pct", "status", "131").stdout  # not started behind our back


@pytest.mark.parametrize("text, expected", [
    ("hosts:\n  pve1: {ssh: {hostname: 127.0.0.1\n", "invalid fleet file"),
    ("hosts:\n  pve1:\n{ssh}\n    containers:\n      129:\n        sglang: {{model_path: /m, flags: {{kv-cache-dtype: fp9}}}}\n",
     "hosts.pve1.containers.129.sglang.flags.kv-cache-dtype"),
    ("hosts:\n  pve1:\n{ssh}\n    containers:\n      twelve: {{}}\n", "twelve"),
    ("hosts: [pve1, pve2]\n", "hosts"),
])
def test_malformed_fleet_file_touches_nothing(lab, fleet_serving, tmp_path, text, expected):
    before = main_pid(lab, "pve1")
    fleet = with_fleet(lab, tmp_path, text.format(ssh=ssh_line(lab, "pve1")) if "{ssh}" in text else text)
    run = pyinfra(fleet, ["inventory.py", "deploy.py"])
    assert run.returncode != 0, run.output
    said(run, "gpugate: invalid fleet file:", expected)
    assert "Traceback" not in run.output
    assert main_pid(lab, "pve1") == before


# --------------------------------------------------------------------------- shell injection
CANARY = "/tmp/gpugate-canary"
MODEL_CANARY = "/tmp/c-model"  # in the model path as ../../tmp/c-model-... (a short name: path parts <= 255 bytes)
INJECTIONS = ["; touch {c}-semi", "$(touch {c}-subst)", "`touch {c}-tick`", "' ; touch {c}-squote ; '",
              '" ; touch {c}-dquote ; "', "| touch {c}-pipe", "&& touch {c}-and"]


def injection(tag: str, pieces: int = len(INJECTIONS)) -> str:
    return " ".join(s.format(c=f"{CANARY}-{tag}") for s in INJECTIONS[:pieces])


def no_canary(lab, host="pve1") -> None:
    """No canary anywhere a command could have run: this machine (and the lab hosts' shared /tmp),
    the container's own /tmp."""
    import glob

    for pattern in (CANARY + "*", MODEL_CANARY + "*"):
        assert glob.glob(pattern) == []
        assert sh(lab, host, 129, f"ls {pattern} 2>/dev/null || true").stdout.strip() == ""


def test_injection_in_flag_env_and_model_path_is_passed_literally(lab, fleet_serving):
    # every part of the path at most 255 bytes; the ".." parts keep it a literal, existing path
    model = "/opt/models/m" + injection("model", 5).replace(CANARY + "-model", ".." + MODEL_CANARY.replace("/", "/../", 1))
    made = sh(lab, "pve2", 129, f"mkdir -p {shlex.quote(model)} && cp /opt/models/lab-model/config.json "
                                f"{shlex.quote(model)}/ && echo made")
    assert made.stdout.strip() == "made", made.stderr
    flags = dict(TP2, **{"served-model-name": injection("flag")})
    env = dict(FAST_ENV, GPUGATE_INJECT_TOKEN=injection("env"))  # a secret by its name: never printed
    run = deploy(lab, flags, env, data={"sglang_model_path": model}, limit="pve_pve2")
    assert run.returncode == 0, run.output
    no_canary(lab, "pve2")
    argv = running_argv(lab, "pve2")
    assert flag_value(argv, "--served-model-name") == injection("flag")
    assert flag_value(argv, "--model-path") == model
    environ = sh(lab, "pve2", 129, f"tr '\\0' '\\n' < /proc/{main_pid(lab, 'pve2')}/environ").stdout
    assert f"GPUGATE_INJECT_TOKEN={injection('env')}" in environ.splitlines()
    assert injection("env") not in run.output  # a secret env value is never printed
    assert observed(lab, "pve2")["history"]["good"][0]["model_path"] == model


@pytest.mark.parametrize("data, expected", [
    # refused by gpugate.fleet.validated_settings before any operation (issue 12: --data checked like fleet.yaml)
    ({"sglang_port": f"30000{injection('port')}"}, "setting sglang_port='30000; touch"),
    ({"sglang_python": f"/usr/bin/python3{injection('python')}"},
     "expected the absolute path of a Python 3 interpreter in the container"),
    ({"sglang_env": {"X": "a\ntouch " + CANARY + "-envnl"}}, "X: values cannot contain NUL or line breaks"),
    ({"sglang_env": {"X; touch " + CANARY + "-envname": "1"}}, "environment variable names are letters"),
    ({"sglang_flags": {"tp": 2, "served-model-name": "a\ntouch " + CANARY + "-flagnl"}},
     "--served-model-name: value must be one line"),
    ({"sglang_model_path": "/opt/models/lab-model\ntouch " + CANARY + "-modelnl"},
     "expected a path or Hugging Face repo id on one line"),
    ({"sglang_flags": {"tp": 2, "log-level; touch " + CANARY + "-flagname": "x"}}, "log-level; touch"),
])
def test_injection_rejected_before_anything_runs(lab, fleet_serving, data, expected):
    before = main_pid(lab, "pve3")
    args = ["inventory.py", "deploy.py", "--limit", "pve_pve3"]
    for key, value in {"sglang_env": FAST_ENV, "sglang_flags": TP2, **data}.items():
        args += ["--data", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    run = pyinfra(lab, args)
    assert run.returncode != 0, run.output
    said(run, expected)
    assert "Traceback" not in run.output
    no_canary(lab, "pve3")
    assert main_pid(lab, "pve3") == before and health(lab, "pve3") == 200
