"""Issue 34: what the engine changes live (LoRA adapters, a new checkpoint of the same model), the
controller's half: the desired adapters as one setting, the launch flags LoRA needs derived and
checked before anything stops, and which path each difference takes (docs/live-changes.md)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gpugate.engine import Engine, LiveState, get as engine
from gpugate.engine import container
from gpugate.engine.sglang import live_server
from gpugate.fleet import fleet_to_inventory, load_fleet
from gpugate.plan import Narrator, make_plan, outcome_lines, plan_lines, rollback_choice
from gpugate.report.status import status_row
from gpugate.rules.redact import argv_hash, env_hash
from gpugate.settings import SettingsError, validated_settings
from gpugate.spec import desired_state

BASE = {"sglang_model_path": "/opt/models/lab-model", "sglang_flags": {"tp": 2}}


def test_adapters_derive_the_launch_flags_and_a_start_carries_them():
    desired = desired_state({**BASE, "sglang_lora_adapters": {"b": "/opt/models/lab-lora-b",
                                                              "a": "/opt/models/lab-lora-a"}})
    argv = list(desired.spec.argv)
    # SGLang needs rank and modules when no adapter is loaded at the start: written always, so that the
    # pool takes any adapter up to the rank whatever was loaded first
    for option in ("--enable-lora", "--max-lora-rank", "--lora-target-modules", "--max-loras-per-batch"):
        assert option in argv
    at = argv.index("--lora-paths")
    assert argv[at:at + 3] == ["--lora-paths", "a=/opt/models/lab-lora-a", "b=/opt/models/lab-lora-b"]
    assert desired.spec.record()["lora_adapters"] == {"a": "/opt/models/lab-lora-a", "b": "/opt/models/lab-lora-b"}
    # the operator's own values win over the derived ones; {} is LoRA on with no adapter (no --lora-paths)
    own = desired_state({**BASE, "sglang_flags": {"tp": 2, "max-lora-rank": 16}, "sglang_lora_adapters": {}}).spec
    assert own.flags["max-lora-rank"] == 16 and "--lora-paths" not in own.argv and own.flags["enable-lora"] is True
    # none declared: no LoRA flag at all
    assert not any("lora" in arg for arg in desired_state(BASE).spec.argv)


@pytest.mark.parametrize("data, problem", [
    ({"sglang_flags": {"tp": 2, "lora-paths": ["a=/a"]}, "sglang_lora_adapters": {}},
     "--lora-paths: gpugate sets it: write lora_adapters: {name: path} instead"),
    ({"sglang_flags": {"tp": 2, "max-lora-rank": 8}},
     "--max-lora-rank: a LoRA flag without lora_adapters: declare lora_adapters ({} for none yet)"),
    ({"sglang_flags": {"tp": 2, "max-loaded-loras": 1, "max-loras-per-batch": 1},
      "sglang_lora_adapters": {"a": "/a", "b": "/b"}},
     "--max-loaded-loras: 1 holds fewer than the 2 adapters declared (SGLang would evict one)"),
    ({"sglang_flags": {"tp": 2, "max-loaded-loras": 2}, "sglang_lora_adapters": {"a": "/a"}},
     "--max-loaded-loras: 2 is less than --max-loras-per-batch 8 (SGLang refuses it)"),
    ({"sglang_flags": {"tp": 2, "max-lora-rank": 0}, "sglang_lora_adapters": {"a": "/a"}},
     "--max-lora-rank: must be 1 or more"),
])
def test_a_lora_setting_that_cannot_run_is_refused_before_anything_stops(data, problem):
    desired = desired_state({**BASE, **data})
    assert desired.spec is None and desired.problem.startswith(problem), desired.problem


@pytest.mark.parametrize("value, problem", [
    (["a"], "expected a mapping of adapter name: path"),
    ({"a b": "/a"}, "adapter name 'a b'"),
    ({"a": ""}, "expected the path of adapter a"),
    ({"a": "/a\n/b"}, "expected the path of adapter a on one line"),
])
def test_the_setting_itself_is_checked_for_every_source(value, problem):
    with pytest.raises(SettingsError, match="^setting sglang_lora_adapters=") as error:
        validated_settings({"sglang_lora_adapters": value})
    assert problem in str(error.value)


def test_fleet_yaml_writes_it_in_the_server_section(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(textwrap.dedent("""
        hosts:
          pve1:
            containers:
              129:
                sglang:
                  model_path: /opt/models/lab-model
                  lora_adapters: {a: /opt/models/lab-lora-a}
        """))
    hosts = dict(fleet_to_inventory(load_fleet(path))["pve_pve1"][0])
    assert hosts["@pct/pve1:129"]["sglang_lora_adapters"] == {"a": "/opt/models/lab-lora-a"}


# ---------------------------------------------------------------- which path each difference takes
CASES = json.loads((Path(__file__).parent / "data" / "live_changes.json").read_text())


@pytest.mark.parametrize("case", CASES, ids=[case["case"] for case in CASES])
def test_each_difference_is_classified_live_or_restart(case):
    have, want = (LiveState(case[side]["model_path"], case[side]["lora_adapters"]) for side in ("have", "want"))
    changes = engine(case.get("engine", "sglang")).live_changes(have, want, same_shape=case.get("same_shape"),
                                                                weight_cache=case.get("weight_cache", False))
    assert [change.line for change in changes] == case["lines"]
    # every live change carries what the agent sends, and its undo puts back what it changed
    for change in changes:
        if change.path == "live":
            sends = engine(case.get("engine", "sglang")).container.live_request
            assert sends(container.undo_of(container.undo_of(dict(change.op)))) == sends(dict(change.op))


def test_an_engine_without_live_changes_restarts_for_each():
    class Plain(Engine):
        label = "Plain"
        choose_table = validate_flags = canonical_name = launch = read_running = flag_lines = redact_argv = None

    changes = Plain().live_changes(LiveState("/m", {"a": "/a"}), LiveState("/m2", {}))
    assert [change.path for change in changes] == ["restart", "restart"]


def observed(data: dict, live: dict | None, shapes: dict | None = None) -> dict:
    """The agent's observe of a server started from ``data`` that serves ``live`` now."""
    argv = list(desired_state(data).spec.argv)
    return {"sglang": {"running": True, "serving": True, "port": 30000, "env_hashes": {}, "live": live,
                       "model_shapes": shapes or {}, "workers": {"expected": 2, "alive": 2, "dead": 0},
                       "main": {"pid": 5, "argv": argv, "argv_hash": argv_hash(argv), "supervisor": "process"}},
            "gpu": {"source": "nvml", "memory_api": "v2", "holders": [], "gpus": [
                {"index": i, "used_mib": 70000, "processes": [{"pid": 5, "used_mib": 70000}]} for i in range(2)]},
            "container": {"pid1": "init"}}


LORA_A = {**BASE, "sglang_lora_adapters": {"a": "/opt/models/lab-lora-a"}}
SERVES_A = {"model_path": "/opt/models/lab-model", "lora_adapters": {"a": "/opt/models/lab-lora-a"}}
A, B = "/opt/models/lab-lora-a", "/opt/models/lab-lora-b"
SAME = {"/opt/models/lab-model": {"architectures": ["LlamaForCausalLM"]},
        "/opt/models/lab-model-v2": {"architectures": ["LlamaForCausalLM"]},
        "/opt/models/lab-model-qwen2": {"architectures": ["Qwen2ForCausalLM"]}}


def plan_and_status(data: dict, observation: dict) -> tuple[Any, str, list[str]]:
    desired = desired_state(data)
    made = make_plan(observation, desired)
    return made, status_row("pve1", 129, observation, desired)["kind"], plan_lines(made, 30000)


def test_the_plan_and_the_status_agree_on_live_state():
    # adapters added: live, and the status is never "as desired" while they differ
    made, kind, lines = plan_and_status({**LORA_A, "sglang_lora_adapters": {"a": "/opt/models/lab-lora-a",
                                                                            "b": "/opt/models/lab-lora-b"}},
                                        observed(LORA_A, SERVES_A, SAME))
    assert made.action == "live" and kind == "drifted"
    assert lines[1:3] == ["    live: load adapter b", "    path: live (no restart)"]
    assert "pid 5 keeps serving" in lines[0]
    # a server changed live since its start (its argv still names the launch's model and adapters) is as
    # desired once it serves the desired state: a converged re-run does nothing
    v2 = {**LORA_A, "sglang_model_path": "/opt/models/lab-model-v2", "sglang_lora_adapters": {"b": "/opt/models/lab-lora-b"}}
    moved = observed(LORA_A, {"model_path": "/opt/models/lab-model-v2", "lora_adapters": {"b": "/opt/models/lab-lora-b"}}, SAME)
    made, kind, _ = plan_and_status(v2, moved)
    assert made.action == "noop" and kind == "serving"
    # ... and a weight update of the same shapes is live, one of another architecture a restart
    made, _, lines = plan_and_status({**LORA_A, "sglang_model_path": "/opt/models/lab-model-v2"},
                                     observed(LORA_A, SERVES_A, SAME))
    assert made.action == "live" and made.lines == (
        "live: weights /opt/models/lab-model -> /opt/models/lab-model-v2 (update_weights_from_disk)",)
    made, _, lines = plan_and_status({**LORA_A, "sglang_model_path": "/opt/models/lab-model-qwen2",
                                      "sglang_lora_adapters": {"b": "/opt/models/lab-lora-b"}},
                                     observed(LORA_A, SERVES_A, SAME))
    assert made.action == "restart"
    assert "    restart: weights /opt/models/lab-model -> /opt/models/lab-model-qwen2 (another architecture or other " \
           "shapes: SGLang would die loading them live)" in lines
    assert "    restart (its launch carries it): load adapter b" in lines
    assert "    path: restart (its launch carries the adapters and the model path)" in lines
    assert "--lora-paths" in made.lines[-4] or any(line.startswith("+ --lora-paths") for line in made.lines)


def test_a_launch_difference_makes_the_whole_change_a_restart():
    made, _, lines = plan_and_status({**LORA_A, "sglang_flags": {"tp": 2, "kv-cache-dtype": "fp8_e4m3"},
                                      "sglang_lora_adapters": {"b": "/opt/models/lab-lora-b"}},
                                     observed(LORA_A, SERVES_A, SAME))
    assert made.action == "restart"
    assert "    + --kv-cache-dtype fp8_e4m3" in lines and "    + --lora-paths b=/opt/models/lab-lora-b" in lines


def test_a_live_weight_change_to_a_missing_path_or_on_a_server_that_does_not_serve_is_refused():
    observation = observed(LORA_A, SERVES_A, SAME)
    observation["sglang"]["model_path_exists"] = False
    made, _, lines = plan_and_status({**LORA_A, "sglang_model_path": "/opt/models/lab-model-v2"}, observation)
    assert made.problems == ("the model path /opt/models/lab-model-v2 does not exist in the container",)
    assert lines[0].startswith("sglang :30000 REFUSED, nothing touched")


def test_the_rollback_after_a_live_change_returns_to_the_spec_before_it_not_to_what_serves():
    # the history after a live change: the desired spec reached live on this main (newest), then the
    # spec it was launched with; the main still runs the launch's argv but serves the newer state
    server = {"running": True, "port": 30000, "main": {"pid": 5, "start_ticks": 7, "argv_hash": "LAUNCH"},
              "live": {"model_path": "/m2", "lora_adapters": {"b": "/b"}},
              "history": {"good": [
                  {"key": "new", "argv_hash": "NEW", "model_path": "/m2", "lora_adapters": {"b": "/b"},
                   "changed_live": {"pid": 5, "start_ticks": 7}},
                  {"key": "launch", "argv_hash": "LAUNCH", "model_path": "/m", "lora_adapters": {"a": "/a"}}]}}
    assert rollback_choice(server)[0]["key"] == "launch"
    # the same main restarted since (another start_ticks): the live record is no longer what runs
    server["main"]["start_ticks"] = 8
    assert rollback_choice(server)[0]["key"] == "new"


def test_vllm_declares_adapters_with_its_runtime_switch_and_changes_them_live():
    vllm = {"engine": "vllm", "sglang_model_path": "/opt/models/lab-model", "sglang_port": 8000,
            "sglang_flags": {"tensor-parallel-size": 2}}
    desired = desired_state({**vllm, "sglang_lora_adapters": {"a": A}})
    argv = list(desired.spec.argv)
    assert argv[argv.index("--lora-modules") + 1] == f"a={A}" and "--enable-lora" in argv
    assert desired.spec.env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # set by gpugate, shown as env
    assert desired_state({**vllm, "sglang_lora_adapters": {"a": A}, "sglang_env": {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"}}).problem.startswith("env VLLM_ALLOW_RUNTIME_LORA_UPDATING=0: gpugate sets it")
    assert desired_state({**vllm, "sglang_flags": {"tensor-parallel-size": 2, "max-lora-rank": 8}}).problem.startswith(
        "--max-lora-rank: a LoRA flag without lora_adapters")
    # what serves, as vLLM's /v1/models lists it: an adapter added is live, a model change a restart saying why
    observation = observed({**vllm, "sglang_lora_adapters": {"a": A}}, {"model_path": "/opt/models/lab-model",
                                                                       "lora_adapters": {"a": A}}, SAME)
    observation["sglang"]["port"] = 8000
    observation["sglang"]["env_hashes"] = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": env_hash("True")}
    added = make_plan(observation, desired_state({**vllm, "sglang_lora_adapters": {"a": A, "b": B}}))
    assert added.action == "live" and added.lines == ("live: load adapter b",)
    moved = make_plan(observation, desired_state({**vllm, "sglang_model_path": "/opt/models/lab-model-v2",
                                                  "sglang_lora_adapters": {"a": A}}))
    assert moved.action == "restart" and "restart: weights /opt/models/lab-model -> /opt/models/lab-model-v2 (vLLM " \
        "loads other weights in place only in its dev mode, with no undo)" in moved.lines


def test_a_controller_following_a_live_run_reads_each_step_and_its_end():
    # the journal of a live change that failed its verify and was undone (gpugate/agent/live.py's events)
    events = [{"step": "live", "phase": "begin", "changes": ["weights -> /m2", "load adapter b"]},
              {"step": "live_apply", "phase": "end", "change": "weights -> /m2", "ok": True},
              {"step": "live_apply", "phase": "end", "change": "load adapter b", "ok": True},
              {"step": "live_verify", "phase": "end", "ok": False, "error": "a generation failed: NaN happened"},
              {"step": "live_undo", "phase": "begin", "reason": "the verify failed",
               "changes": ["load adapter b", "weights -> /m2"]},
              {"step": "live_undo", "phase": "end", "ok": True, "problems": []}]
    narrator = Narrator()
    assert [line for event in events for line in narrator.lines(event)] == [
        "applied live: weights -> /m2", "applied live: load adapter b",
        "the live verify failed: a generation failed: NaN happened",
        "undoing load adapter b, weights -> /m2: the verify failed", "undone: the previous state serves"]
    assert outcome_lines("live_undone", None, "the verify failed; undone", 30000) == (
        False, ["LIVE CHANGE FAILED, UNDONE: the verify failed; undone"])
