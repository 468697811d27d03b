"""gpugate.spec: the desired server as one frozen value (defaults, validation, the argv rendered once,
host: honoured, the GPU set), without a host."""

from __future__ import annotations

import dataclasses

import pytest

from gpugate import spec as spec_mod
from gpugate.settings import SETTINGS
from gpugate.spec import SpecError, build_spec, gpu_set


def test_the_argv_is_rendered_once_with_the_host_and_the_flags_sorted():
    spec = build_spec("/opt/models/m", 30001, {"tp": 8, "kv-cache-dtype": "fp8_e4m3"}, host="0.0.0.0")
    assert spec.argv == ("/usr/bin/python3", "-m", "sglang.launch_server", "--model-path", "/opt/models/m",
                         "--host", "0.0.0.0", "--port", "30001", "--kv-cache-dtype", "fp8_e4m3", "--tp-size", "8")
    assert spec.flags == {"kv-cache-dtype": "fp8_e4m3", "tp-size": 8}


def test_each_flag_is_validated_once(monkeypatch):
    calls = []
    from gpugate.engine.sglang import flags as sglang_flags  # where SGLang's launch validates

    real = sglang_flags.FLAGS.validate_flags  # every validation of SGLang's flags goes through it

    def counting(flags, *args, **kwargs):
        calls.append(dict(flags))
        return real(flags, *args, **kwargs)

    monkeypatch.setattr(sglang_flags.FLAGS, "validate_flags", counting)
    build_spec("/m", 30000, {"tp": 8, "disable-radix-cache": True})
    # once for the flags; gpu_set re-reads the normalised ones (cheap, no new input)
    assert calls[0] == {"tp": 8, "disable-radix-cache": True}
    assert all(call == calls[1] for call in calls[1:])


def test_the_spec_is_frozen():
    spec = build_spec("/m", 30000, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.port = 1  # type: ignore[misc]


def test_defaults_live_in_one_place_and_group_data_takes_them():
    import runpy
    from pathlib import Path

    data = runpy.run_path(str(Path(__file__).resolve().parents[2] / "group_data" / "all.py"))
    assert data["sglang_port"] == SETTINGS["sglang_port"].default and data["sglang_host"] == SETTINGS["sglang_host"].default
    assert data["drain_timeout_s"] == SETTINGS["drain_timeout_s"].default
    from gpugate.spec import desired_state

    desired = desired_state({"sglang_model_path": "/m"})
    assert desired.spec.host == SETTINGS["sglang_host"].default
    assert desired.budgets["start_timeout_s"] == SETTINGS["start_timeout_s"].default
    assert desired_state({"sglang_model_path": "/m", "sglang_host": "0.0.0.0"}).spec.host == "0.0.0.0"


@pytest.mark.parametrize("kwargs, expected", [
    ({"model_path": ""}, "model_path is required"),
    ({"port": 70000}, "port must be"),
    ({"flags": {"kv-cache-dtype": "fp9"}}, "kv-cache-dtype"),
    ({"flags": {"port": 1}}, "port"),
    ({"env": {"A": 493}}, "quote it"),
    ({"env": {"1A": "x"}}, "not a valid variable name"),
    ({"env": {"A": "x\ny"}}, "one line"),
    ({"supervisor": "runit"}, "supervisor must be"),
    ({"python": "python3"}, "absolute path"),
    ({"host": "a b"}, "host must be"),
    ({"extra_args": ["--x", ""]}, "extra_args"),
    ({"flags": {"tp": 8}, "env": {"CUDA_VISIBLE_DEVICES": "0,1"}}, "lists 2 GPU"),
])
def test_bad_input_is_refused_naming_the_problem(kwargs, expected):
    args = dict(model_path="/m", port=30000, flags={}, env={})
    args.update(kwargs)
    with pytest.raises(SpecError, match=expected):
        build_spec(args.pop("model_path"), args.pop("port"), args.pop("flags"), args.pop("env"), **args)


def test_extra_args_pass_verbatim_with_a_warning_and_secrets_never_show():
    spec = build_spec("/m", 30000, {"api-key": "sk-secret-1"}, {"HF_TOKEN": "hf_value"},
                      extra_args=["--enable-something", "x"])
    assert spec.argv[-2:] == ("--enable-something", "x")
    assert any("unchecked" in warning for warning in spec.warnings)
    record = spec.record(by="alice@laptop")
    text = repr(record) + repr(spec.display_args())
    assert "sk-secret-1" not in text and "hf_value" not in text
    assert record["env_names"] == ["HF_TOKEN"] and record["by"] == "alice@laptop"
    doc = spec.doc()
    assert doc["argv"] == list(spec.argv) and doc["env"] == {"HF_TOKEN": "hf_value"}  # the exact spec, for stdin
    assert "sk-secret-1" not in repr(doc["record"]) and doc["gpus"] == [0]


def test_systemd_doc_carries_the_unit():
    spec = build_spec("/m", 30000, {}, supervisor="systemd")
    assert spec.doc(unit_text="[Service]\n")["unit_text"] == "[Service]\n"


@pytest.mark.parametrize("flags, env, expected", [
    ({}, {}, (0,)),
    ({"tp": 8}, {}, tuple(range(8))),
    ({"tp": 4, "base-gpu-id": 4}, {}, (4, 5, 6, 7)),
    ({"tp": 2, "pp-size": 2}, {}, (0, 1, 2, 3)),
    ({"tp": 2, "dp": 2}, {}, (0, 1, 2, 3)),
    ({"tp": 4, "dp": 4, "enable-dp-attention": True}, {}, (0, 1, 2, 3)),
    ({"tp": 2, "gpu-id-step": 2, "base-gpu-id": 1}, {}, (1, 3)),
    ({"tp": 2}, {"CUDA_VISIBLE_DEVICES": "6,7"}, (6, 7)),
    ({"tp": 2, "base-gpu-id": 1}, {"CUDA_VISIBLE_DEVICES": "4,5,6"}, (5, 6)),
    ({"tp": 16, "nnodes": 2}, {}, tuple(range(8))),
])
def test_gpu_set_follows_sglang(flags, env, expected):
    assert gpu_set(flags, env) == expected


def test_gpu_set_matches_the_agents_rule():
    from gpugate.engine.sglang.processes import server_gpus

    for flags, env in [({"tp": 4, "base-gpu-id": 4}, {}), ({"tp": 2, "dp": 2}, {}),
                       ({"tp": 2, "dp": 2, "enable-dp-attention": True}, {}),
                       ({"tp": 2, "gpu-id-step": 2}, {"CUDA_VISIBLE_DEVICES": "3,4,5,6"})]:
        spec = build_spec("/m", 30000, flags, env)
        assert tuple(server_gpus(list(spec.argv), env)) == spec.gpus


def test_uuid_visible_devices_leave_the_set_open():
    spec = build_spec("/m", 30000, {"tp": 1}, {"CUDA_VISIBLE_DEVICES": "GPU-1234"})
    assert spec.gpus is None and any("every GPU" in warning for warning in spec.warnings)


@pytest.mark.parametrize("options", [{"flags": {"gated-launch-port": 41000}},
                                     {"extra_args": ["--gated-launch-port", "41000"]},
                                     {"extra_args": ["--weight-cache-mode=client"]},
                                     {"flags": {"weight-cache-mode": "client"}}])
def test_what_gpugate_sets_is_refused_before_anything_stops(options):
    """Issue 32 item 6: a gate port or a weight-cache mode of the operator's own clashes with the
    agent's; each is refused naming the setting that says it instead."""
    flags = options.get("flags", {})
    with pytest.raises(SpecError, match="gpugate sets it: write (gated_launch|weight_cache): true"):
        build_spec("/m", 30000, flags, extra_args=options.get("extra_args"))
