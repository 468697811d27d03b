"""The rules both sides share (gpugate/rules/) and the bundle that carries them into containers: one
gate decision for every caller, and the artifact importing only its own modules (their doctests run
in test_doctests.py, with every other module's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpugate import agentcmd
from gpugate.agent.start import gate_decision
from gpugate.gate import evaluate
from gpugate.plan import foreign_memory
from gpugate.rules import gate


def reading(used, holders=(), processes=None):
    return {"source": "nvml", "memory_api": "v2", "errors": [], "holders": list(holders),
            "gpus": [{"index": i, "used_mib": mib, "processes": list((processes or {}).get(i, []))}
                     for i, mib in enumerate(used)]}


@pytest.mark.parametrize("doc", [
    reading([0, 0]), reading([0, 4096]), reading([None, 0]), reading([65, 64]),
    {"source": "none", "errors": [{"source": "nvml", "kind": "DriverNotLoaded", "message": "x"}]},
    reading([0, 0]) | {"memory_api": "v1"},
])
def test_gpu_idle_and_the_agents_gate_decide_alike_without_holders(doc):
    decision = evaluate(doc, 64)
    passed, _, _, permanent = gate_decision(doc, None, 64)
    assert (decision.passed, decision.permanent) == (passed, permanent)


def test_expected_memory_per_gpu_raises_that_gpus_threshold_only():
    doc = reading([30000, 30000])
    assert gate.decide(doc, 64, expected_mib={0: 30000})["over"] == [(1, 30000, 64)]
    assert gate.decide(doc, 64, expected_mib={"0": 30000, "1": 30000})["passed"] is True
    assert evaluate(doc, 64, expected_mib={0: 30000, 1: 30000}).passed is True


def test_one_foreign_memory_rule_for_the_gate_and_the_plan():
    docs = [reading([900]), reading([900], [{"pid": 5}]), reading([900], [{"pid": 5}], {0: [{"pid": 5, "used_mib": 600}]}),
            reading([900], [], {0: [{"pid": 5, "used_mib": None}]}), reading([None])]
    for doc in docs:
        unknown_as_none = evaluate(doc, 64).foreign_mib[0]
        listed = {gpu["index"]: gpu["foreign_mib"] for gpu in foreign_memory(doc)}
        assert listed == ({0: unknown_as_none} if unknown_as_none else {})


def test_the_artifact_imports_the_rules_from_itself_not_from_the_controllers_package():
    script = (
        "import json, sys, types\n"
        "m = types.ModuleType('gpugate_agent')\n"
        f"exec(compile({agentcmd.agent_source()!r}, '<agent>', 'exec'), m.__dict__)\n"
        "m.install(m._BUNDLE, origin='<agent>')\n"
        "from gpugate.rules import gate\n"
        "import gpugate\n"
        "print(json.dumps([gate.__file__, getattr(gpugate, '__version__', None)]))\n")
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=60)
    assert json.loads(done.stdout) == ["<agent>/gpugate/rules/gate.py", None], done.stderr
