"""The weight cache's and the gated launch's rules without a lab (docs/weight-cache.md): which engine
flags reach the daemons, the key and what changed in it, which restart the plan announces, what a
server with a cache may not be, and where a gated launch cannot be used."""

from __future__ import annotations

import pytest

from gpugate.engine.sglang import weight_cache as cache
from gpugate.match import cache_verdict, compare
from gpugate.plan import plan_lines
from tests.unit.plans import plan_of
from gpugate.spec import SpecError, build_spec

MODEL = "/opt/models/m"


def spec(flags=None, **options):
    return build_spec(MODEL, 30000, {"tp": 2, **(flags or {})}, {"HF_TOKEN": "hf-1"}, supervisor="process",
                      weight_cache=True, **options)


def observation(spec_now, running_spec=None, ready=True, **server):
    """An observe document: the engine running ``spec_now`` exactly, its daemons holding the key of
    ``running_spec`` (None: no daemons)."""
    from gpugate.rules.redact import argv_hash, env_hash

    doc = {"running": True, "serving": True, "main": {"argv_hash": argv_hash(list(spec_now.argv)), "argv": list(spec_now.argv),
                                                      "supervisor": "process"},
           "env_hashes": {name: env_hash(value) for name, value in spec_now.env.items()},
           "model_config_sha256": "c0ffee", "sglang_version": "0.5.23", "torch_version": "2.9.1", **server}
    if running_spec is not None:
        key = cache.cache_key(list(running_spec.daemon_argv), running_spec.env, "c0ffee", "0.5.23", "2.9.1")
        doc["weight_cache"] = {"running": ready, "pids": [41, 42, 43], "key": key,
                               "problems": [] if ready else ["GPU 1: no .ready yet"],
                               "gpus": [{"index": 0, "pid": 42, "used_mib": 900}, {"index": 1, "pid": 43, "used_mib": 900}]}
    return {"sglang": doc}


def test_the_daemons_get_only_the_flags_that_shape_the_weights():
    wanted = spec({"kv-cache-dtype": "fp8_e4m3", "disable-radix-cache": True, "dtype": "bfloat16"})
    assert wanted.daemon_argv == ("/usr/bin/python3", "-m", "sglang.srt.weight_cache.daemon", "--model-path", MODEL,
                                  "--dtype", "bfloat16", "--tp-size", "2")
    assert wanted.argv[-2:] == ("--weight-cache-mode", "client")
    assert spec({"kv-cache-dtype": "fp8_e4m3"}).daemon_argv == spec().daemon_argv  # an engine-only change


@pytest.mark.parametrize("running, desired, mode, words", [
    (None, {}, "start", "no weight cache runs"),
    ({}, {"kv-cache-dtype": "fp8_e4m3"}, "keep", "the weight cache's key is unchanged"),
    ({}, {"tp": 4}, "start", "the weight cache's key changes (--tp-size 2 -> 4)"),
    ({}, {"quantization": "fp8"}, "start", "--quantization (not set) -> fp8"),
])
def test_the_verdict_on_the_cache_names_the_restart(running, desired, mode, words):
    now = spec(running) if running is not None else None
    verdict = cache_verdict(observation(spec(), now), spec(desired))
    assert verdict.mode == mode and words in verdict.why, verdict


def test_daemons_not_ready_or_of_another_version_are_started_again():
    assert cache_verdict(observation(spec(), spec(), ready=False), spec()).why.startswith(
        "the weight cache is not ready: GPU 1: no .ready yet")
    newer = dict(observation(spec(), spec())["sglang"], torch_version="2.10.0")
    assert cache_verdict({"sglang": newer}, spec()).changes == ("torch 2.9.1 -> 2.10.0",)


def test_an_engine_as_desired_over_daemons_of_another_key_is_not_as_desired():
    match = compare(observation(spec(), spec({"dtype": "float16"})), spec())
    assert match.verdict == "differs" and "the weight cache's key changes (--dtype float16 -> (not set))" in match.why[0]
    assert compare(observation(spec(), spec()), spec()).verdict == "as_desired"
    unwanted = build_spec(MODEL, 30000, {"tp": 2}, {"HF_TOKEN": "hf-1"}, supervisor="process")
    assert cache_verdict(observation(unwanted, spec()), unwanted).mode == "stop"


def test_dry_says_which_restart_it_is():
    kept = plan_of(observation(spec(), spec()), spec({"kv-cache-dtype": "fp8_e4m3"}), port=30000)
    assert "    restart: engine only: the weights stay on GPU 0-1 (the weight cache's key is unchanged)" in \
        plan_lines(kept, 30000)
    moved = plan_of(observation(spec(), spec()), spec({"tp": 4}), port=30000)
    assert "    restart: engine and weight cache: the weight cache's key changes (--tp-size 2 -> 4)" in \
        plan_lines(moved, 30000)
    assert any("start the weight-cache daemons" in step for step in moved.steps)
    assert not any("start the weight-cache daemons" in step for step in kept.steps)


@pytest.mark.parametrize("flags, extra, problem", [
    ({"quantization": "awq"}, (), "--quantization: 'awq' cannot use the weight cache"),
    ({"weight-cache-mode": "daemon"}, (), "--weight-cache-mode: gpugate sets it"),
    ({}, ("--tp-size", "4"), "--tp-size: shapes the weights: with weight_cache: true give it in flags"),
])
def test_a_server_the_cache_cannot_serve_is_refused_with_what_to_do(flags, extra, problem):
    with pytest.raises(SpecError, match="^" + problem.replace("(", r"\(").replace(")", r"\)")):
        build_spec(MODEL, 30000, {"tp": 2, **flags}, weight_cache=True, extra_args=extra)


def test_no_weight_cache_on_a_release_without_one():
    with pytest.raises(SpecError, match="no weight cache"):
        build_spec(MODEL, 30000, {"tp": 2}, weight_cache=True, table="0.5.10")


@pytest.mark.parametrize("flags, supervisor, table, gated", [
    ({}, "process", None, True),
    ({}, "systemd", None, False),
    ({}, "process", "0.5.10", False),
    ({"enable-dp-attention": True, "dp": 2}, "process", None, False),
    ({"nccl-port": 29000}, "process", None, False),
])
def test_gated_launch_is_the_default_only_where_it_can_work(flags, supervisor, table, gated):
    assert build_spec(MODEL, 30000, {"tp": 2, **flags}, supervisor=supervisor, table=table).gated_launch is gated


@pytest.mark.parametrize("flags, supervisor, table, words", [
    ({}, "systemd", None, "not with the systemd supervisor"),
    ({}, "process", "0.5.10", "no --gated-launch-port"),
    ({"nccl-port": 29000}, "process", None, "not with --nccl-port"),
])
def test_gated_launch_asked_where_it_cannot_work_is_refused(flags, supervisor, table, words):
    with pytest.raises(SpecError, match=words):
        build_spec(MODEL, 30000, {"tp": 2, **flags}, supervisor=supervisor, table=table, gated_launch=True)


def test_the_gated_port_is_how_it_was_started_not_what_runs():
    desired = build_spec(MODEL, 30000, {"tp": 2})
    launched = cache.gated_argv(list(desired.argv), 41000)
    assert launched[-2:] == ["--gated-launch-port", "41000"] and cache.steady_argv(launched) == list(desired.argv)
    assert cache.steady_argv(list(desired.argv) + ["--gated-launch-port=41000"]) == list(desired.argv)


@pytest.mark.parametrize("text, parsed", [
    ("pid=41\nconfig={'tp_size': 2, 'model_path': '/m'}\n", {"pid": 41, "config": {"tp_size": 2, "model_path": "/m"}}),
    ("pid=41\nconfig=__import__('os')\n", {"pid": 41, "config": None}),  # never evaluated
    ("config={}\n", None),
    ("", None),
])
def test_a_ready_file_is_read_without_evaluating_it(text, parsed):
    assert cache.parse_ready(text) == parsed


def test_the_files_are_named_by_torch_s_uuid_and_sglang_s_templates():
    assert cache.file_paths("GPU-abc", {}) == ("/tmp/sglang_weight_cache_abc.sock", "/tmp/sglang_weight_cache_abc.ready")
    env = {cache.SOCKET_TEMPLATE_ENV: "/run/wc/{device_uuid}.s", cache.READY_TEMPLATE_ENV: "/run/wc/{device_uuid}.r"}
    assert cache.file_paths("GPU-abc", env) == ("/run/wc/abc.s", "/run/wc/abc.r")
