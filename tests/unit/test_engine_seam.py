"""The engine seam as an operator meets it: engines found by entry point, one engine's trouble is
its own servers' alone, and what an engine lacks is refused by name (tests/engines/echo_engine is
an engine of the tests' own)."""

from __future__ import annotations

import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import gpugate.engine as seam
from gpugate import bundle
from gpugate.report.status import _record_flags
from gpugate.spec import SpecError, build_spec, desired_states
from tests.unit.plans import plan_of

ENGINES = Path(__file__).resolve().parents[1] / "engines"


@pytest.fixture
def installed(monkeypatch, tmp_path):
    """Engines by entry point: sglang, the tests' echo, and ``broken`` (a plug-in that does not load)."""
    monkeypatch.syspath_prepend(str(ENGINES))
    entries = {"sglang": EntryPoint("sglang", "gpugate.engine.sglang:ENGINE", seam.ENTRY_POINT_GROUP),
               "echo": EntryPoint("echo", "echo_engine:ENGINE", seam.ENTRY_POINT_GROUP),
               "broken": EntryPoint("broken", "no_such_plugin:ENGINE", seam.ENTRY_POINT_GROUP)}
    monkeypatch.setattr(seam, "_entry_points", lambda: entries)
    seam.get.cache_clear()
    bundle.engine_sources.cache_clear()
    yield entries
    seam.get.cache_clear()
    bundle.engine_sources.cache_clear()


def test_an_engine_is_found_by_its_entry_point(installed):
    assert seam.names() == ["broken", "echo", "sglang"]
    assert seam.get("echo").label == "Echo"
    with pytest.raises(KeyError, match="no engine 'tgi'; engines: broken, echo, sglang"):
        seam.get("tgi")


def test_a_broken_plugin_refuses_its_own_servers_only(installed):
    with pytest.raises(seam.EngineError, match="the engine 'broken' .* cannot be loaded: ModuleNotFoundError"):
        seam.get("broken")
    broken, fine = (desired_states({"engine": name, "sglang_model_path": "/m"})[0] for name in ("broken", "sglang"))
    assert broken.spec is None and "cannot be loaded" in broken.problem
    assert fine.problem is None and fine.spec is not None
    # the agent's artifact carries the engines that load, and says which
    assert "echo_engine.container" in bundle.agent_source() and "no_such_plugin" not in bundle.agent_source()


def test_what_an_engine_lacks_is_refused_by_name(installed):
    with pytest.raises(SpecError, match="weight_cache: Echo has no weight cache: set weight_cache: false"):
        build_spec("/m", 8000, {}, engine_name="echo", weight_cache=True)
    with pytest.raises(SpecError, match="gated_launch: Echo has no gated launch"):
        build_spec("/m", 8000, {}, engine_name="echo", gated_launch=True)
    with pytest.raises(SpecError, match="--tp: not a flag of Echo"):
        build_spec("/m", 8000, {"tp": 2}, engine_name="echo")


def test_the_bundle_follows_a_plugins_own_modules(installed, tmp_path, monkeypatch):
    plugin = tmp_path / "plug"
    plugin.mkdir()
    (plugin / "__init__.py").write_text("")
    (plugin / "helpers.py").write_text("def port(argv):\n    return 1\n")
    (plugin / "container.py").write_text("from plug.helpers import port\nfrom gpugate.rules import procfs\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert bundle.with_imports(("plug.container",)) >= ("gpugate.rules.procfs", "plug.container", "plug.helpers")
    sys.modules.pop("plug", None)


def test_a_record_of_an_engine_this_controller_lacks(installed):
    record = {"engine": "vanished", "argv": ["python3", "-m", "vanished", "--x", "1"], "flags": {"x": 1},
              "gpus": [0], "port": 30000}
    assert _record_flags(record) == {"x": 1}  # the status shows it as recorded, never a traceback
    observation = {"sglang": {"port": 30000, "running": False, "history": {"good": [record]}},
                   "container": {"pid1": "init"}, "gpu": {}}
    plan = plan_of(observation, None, port=30000, rollback_k=1)
    assert plan.action == "refuse" and "engine 'vanished', which this controller does not have" in plan.problems[0]


def test_the_agent_recognises_every_engines_servers(installed, monkeypatch):
    """A switch of engines on a port: the agent, working for one engine, still sees the other's
    server as a server (to stop, sweep and roll back to), read by that engine's own rules."""
    from gpugate.agent import engine as agent_engine

    monkeypatch.setattr(agent_engine, "_LOADED", {})
    monkeypatch.setattr(agent_engine, "_current", None)
    monkeypatch.setattr(agent_engine, "_ALL", [])
    sglang_main = ["python3", "-m", "sglang.launch_server", "--model-path", "/m", "--port", "31000"]
    echo_main = ["python3", "-m", "echo_server", "--model", "/m", "--port", "8000"]
    agent_engine.use("echo")
    engine = agent_engine.engine
    assert engine.is_server_part(sglang_main) and engine.is_worker_argv(["sglang::scheduler_TP0"])
    assert engine.argv_port(sglang_main) == 31000 and engine.argv_port(echo_main) == 8000
    assert not engine.is_server_part(["python3", "-m", "http.server"])
    assert engine.HEALTH_PATH == "/health" and engine.GENERATE_PATH == "/generate"
    assert agent_engine.use_for(sglang_main).LABEL == "SGLang" and engine.GENERATE_PATH == "/health_generate"
    assert "sgl_shm_" in engine.SHM_PREFIXES  # what any engine's killed server leaves behind
