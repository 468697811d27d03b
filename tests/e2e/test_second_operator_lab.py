"""Two operators, one container, through the REAL pyinfra CLI: the second run finds the first's
transition running and attaches to it. When the first run applies another spec, the second must not
report that spec's verify as its own: it names the other run, then plans again and applies its own
desired state (exit 0 only once its own spec serves). Also: SIGTERM/SIGHUP after the hand-off say
what continues in the container, as Ctrl-C does."""

from __future__ import annotations

import json
import signal

import pytest

from tests.conftest import module_lab
from tests.e2e.test_transition_lab import argv_of, observe, read_until, run, start, wait_idle

pytestmark = [pytest.mark.lab, pytest.mark.slow]

SLOW = {"SGLANG_STANDIN_LOAD_S": "6"}
A = {"tp": 8, "kv-cache-dtype": "fp8_e4m3"}
B = {"tp": 8, "mem-fraction-static": 0.8}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-second-operator", hosts=1, gpus=8)


def test_a_second_operator_attached_to_another_spec_applies_its_own_afterwards(lab, tmp_path):
    first = start(lab, flags=A, env=SLOW)
    read_until(first, "started pid")
    audit = tmp_path / "audit.jsonl"
    code, out = run(lab, "--data", f"audit_log={audit}", flags=B, env=SLOW)
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
    first = start(lab, flags=A, env=SLOW)
    read_until(first, "started pid")
    code, out = run(lab, "--data", "sglang_present=false", flags=A, env=SLOW)
    first.communicate(timeout=120)
    assert "another operator's run applied a different spec" in out and "will stop" in out, out
    assert code == 0, out
    assert not observe(lab)["running"]
    wait_idle(lab)
