"""Issue 34: what the engine changes live (LoRA adapters, a new checkpoint of the same model), the
controller's half: the desired adapters as one setting, the launch flags LoRA needs derived and
checked before anything stops, and which path each difference takes (docs/live-changes.md)."""

from __future__ import annotations

import textwrap

import pytest

from gpugate.fleet import fleet_to_inventory, load_fleet
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
    assert argv[argv.index("--lora-paths"):] == ["--lora-paths", "a=/opt/models/lab-lora-a", "b=/opt/models/lab-lora-b"]
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
