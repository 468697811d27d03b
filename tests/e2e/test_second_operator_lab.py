"""Two operators, one container, through the REAL pyinfra CLI: the second run finds the first's
transition running and attaches to it. When the first run applies another spec, the second must not
report that spec's verify as its own: it names the other run, then plans again and applies its own
desired state (exit 0 only once its own spec serves). Also: SIGTERM/SIGHUP after the hand-off say
what continues in the container, as Ctrl-C does."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from tests.conftest import REPO_ROOT, module_lab
from tests.e2e.test_transition_lab import (argv_of, deploy_args, observe, pyinfra_argv, read_until, start,
                                           wait_idle)

pytestmark = [pytest.mark.lab, pytest.mark.slow]

FAST = {"SGLANG_STANDIN_LOAD_S": "0.3"}  # the load a test needs to act in is held (lab.load_held), not long
A = {"tp": 4, "kv-cache-dtype": "fp8_e4m3"}
B = {"tp": 4, "mem-fraction-static": 0.8}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-second-operator", hosts=1, gpus=4)


def attach_while_loading(lab, first_flags: dict, *extra: str, flags: dict) -> tuple[subprocess.Popen, int, str]:
    """A first run starts ``first_flags`` and its server is held in its load; a second run (``extra``,
    ``flags``) starts then and finds that transition running; the load ends once the second has said it
    attaches. -> (the first run, still to be read; the second's exit status and whole output)."""
    with lab.load_held():
        first = start(lab, flags=first_flags, env=FAST)
        read_until(first, "started pid")
        second = start(lab, *extra, flags=flags, env=FAST)
        head = read_until(second, "will attach")
    rest, _ = second.communicate(timeout=120)
    return first, second.returncode, head + rest


def test_a_second_operator_attached_to_another_spec_applies_its_own_afterwards(lab, tmp_path):
    audit = tmp_path / "audit.jsonl"
    first, code, out = attach_while_loading(lab, A, "--data", f"audit_log={audit}", flags=B)
    rest, _ = first.communicate(timeout=120)
    assert first.returncode == 0, rest
    assert "will attach" in out and "not this run's desired state" in out, out
    assert "another operator's run applied a different spec" in out and "will restart" in out, out
    assert code == 0, out
    server = observe(lab)
    assert "--mem-fraction-static" in argv_of(server) and "--kv-cache-dtype" not in argv_of(server)
    outcomes = [json.loads(line) for line in audit.read_text().splitlines() if '"outcome"' in line]
    attached = [o for o in outcomes if o.get("attached") and o.get("step") == "outcome"]
    assert attached and attached[0]["flags_after"].get("kv-cache-dtype") == "fp8_e4m3", outcomes


def test_a_stop_attached_to_a_start_stops_afterwards(lab):
    first, code, out = attach_while_loading(lab, A, "--data", "sglang_present=false", flags=A)
    first.communicate(timeout=120)
    assert "another operator's run applied a different spec" in out and "will stop" in out, out
    assert code == 0, out
    assert not observe(lab)["running"]
    wait_idle(lab)


def dry_run(lab, yes: bool, *extra: str, **kwargs) -> tuple[int, str]:
    argv = pyinfra_argv(*deploy_args("--dry", *extra, **kwargs))
    if not yes:
        argv.remove("-y")
    result = subprocess.run(argv, cwd=REPO_ROOT, env=lab.env(), capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("yes", [True, False], ids=["-y", "no -y"])
def test_dry_prints_the_plan_and_a_refusal_exits_non_zero_with_or_without_yes(lab, yes):
    code, out = dry_run(lab, yes, flags=A, env=FAST)
    assert code == 0 and "sglang :30000 will " in out and "+ --kv-cache-dtype fp8_e4m3" in out, out
    code, out = dry_run(lab, yes, "--data", "sglang_version=0.0.1", flags=A, env=FAST)
    assert code != 0 and "REFUSED, nothing touched" in out and "0.0.1" in out, out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_or_sighup_after_the_hand_off_says_what_continues(lab, signum):
    with lab.load_held():
        process = start(lab, flags=B if signum == signal.SIGTERM else A, env=FAST)
        read_until(process, "started pid")  # the follow has seen the start's end: the step named is the load's
        process.send_signal(signum)
        rest, _ = process.communicate(timeout=60)
    last = wait_idle(lab)
    assert process.returncode == 128 + signum, rest
    assert "the transition continues in the container: loading" in rest and "runbooks/status.py" in rest, rest
    assert last["outcome"] == "verified"  # the container ran it to its end
