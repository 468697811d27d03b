"""vLLM behind the engine seam, as an operator meets it: flags from vLLM's own parser (the shipped
snapshots, made from the real wheels), the command it runs, how its processes and endpoints are
read. Pure: no container, no network (the endpoints are answered by a dict)."""

from __future__ import annotations

import json

import pytest

from gpugate.engine import FlagError, ServerInputs, get
from gpugate.engine.vllm import container, flags
from gpugate.fleet import FleetError, load_fleet
from gpugate.spec import desired_states

VLLM = get("vllm")
NEWEST = flags.snapshot_versions()[-1]


def test_snapshots_are_vllms_own_parser_of_real_releases():
    assert "0.33.0" in flags.snapshot_versions() and len(flags.snapshot_versions()) >= 2
    table = flags.load_snapshot("0.33.0")
    # names vLLM's parser declares, with its own choices: nothing gpugate wrote
    assert {"tensor-parallel-size", "kv-cache-dtype", "enable-prefix-caching", "shutdown-timeout",
            "gpu-memory-utilization", "max-model-len"} <= set(table.specs)
    assert table.specs["dtype"].choices == ("auto", "bfloat16", "float", "float16", "float32", "half")
    # vLLM's EnableDisableAction: --enable-prefix-caching / --disable-prefix-caching, read from the parser
    spec = table.specs["enable-prefix-caching"]
    assert (spec.kind, spec.negative) == ("switch", "disable-prefix-caching")


def test_prefix_caching_off_renders_vllms_own_disable_option_and_reads_back():
    """For hidden-state extraction users turn prefix caching off: the argv carries what vLLM parses."""
    launch = VLLM.launch(ServerInputs(engine="vllm", model_path="/m", port=8001,
                                      flags={"enable-prefix-caching": False}), "0.33.0")
    assert "--disable-prefix-caching" in launch.argv and "--no-enable-prefix-caching" not in launch.argv
    assert VLLM.read_running(launch.argv, "0.33.0").flags["enable-prefix-caching"] is False
    assert VLLM.validate_flags({"disable-prefix-caching": True}, "0.33.0") == {"enable-prefix-caching": False}


@pytest.mark.parametrize("written, message", [
    ({"kv-cache-dtyp": "fp8"}, "--kv-cache-dtyp: not a flag of vLLM 0.33.0 (did you mean --kv-cache-dtype?)"),
    ({"dtype": "fp9"}, "--dtype: 'fp9' is not one of auto, bfloat16, float, float16, float32, half in vLLM 0.33.0"),
    ({"tensor-parallel-size": "two"}, "--tensor-parallel-size: expects an integer"),
    ({"gpu-memory-utilization": 1.5}, "--gpu-memory-utilization: must be in (0, 1], got 1.5"),
    ({"model": "/other"}, "--model: set the model as the server's model_path"),
    ({"shutdown-timeout": 5}, "--shutdown-timeout: gpugate sets it: write drain_timeout_s"),
])
def test_a_bad_flag_is_refused_naming_it_and_the_choices(written, message):
    with pytest.raises(FlagError) as refused:
        VLLM.launch(ServerInputs(engine="vllm", model_path="/m", port=8001, flags=written), "0.33.0")
    assert message in str(refused.value)


def test_the_launch_always_sets_the_drain_and_places_ranks_through_cuda_visible_devices():
    launch = VLLM.launch(ServerInputs(engine="vllm", model_path="/models/m", port=8001, python="/usr/bin/python3",
                                      flags={"tp": 4, "kv-cache-dtype": "fp8", "api-key": "sk-secret"},
                                      env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, drain_timeout_s=42.5), "0.33.0")
    assert launch.argv[:8] == ("/usr/bin/python3", "-m", "vllm.entrypoints.cli.main", "serve", "--model",
                               "/models/m", "--host", "127.0.0.1")
    assert ("--shutdown-timeout", "43") == launch.argv[launch.argv.index("--shutdown-timeout"):][:2]
    assert launch.gpus == (4, 5, 6, 7)
    assert "sk-secret" not in " ".join(launch.shown_argv) and "sk-secret" not in json.dumps(launch.shown_flags)
    # what runs reads back as what was launched: the plan and the status compare the same flags
    running = VLLM.read_running(launch.argv, "0.33.0")
    assert (running.model_path, running.port, running.flags) == ("/models/m", 8001, dict(launch.flags))
    assert VLLM.flag_lines(running.flags, {**launch.flags, "kv-cache-dtype": "auto"}, "0.33.0") == [
        "- --kv-cache-dtype fp8", "+ --kv-cache-dtype auto"]


def test_a_positional_model_of_vllm_serve_is_read_as_the_model():
    running = VLLM.read_running(["vllm", "serve", "/models/m", "--port", "8002", "-tp", "2"], NEWEST)
    assert (running.model_path, running.port, running.flags) == ("/models/m", 8002, {"tensor-parallel-size": 2})


@pytest.mark.parametrize("argv, main, worker, rank", [
    (["vllm", "serve", "/m"], True, False, False),
    (["/usr/bin/python3", "-m", "vllm.entrypoints.cli.main", "serve", "--model", "/m"], True, False, False),
    (["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"], True, False, False),
    (["VLLM::EngineCore"], False, True, False),
    (["VLLM::EngineCore_DP1"], False, True, False),
    (["VLLM::Worker_TP3"], False, True, True),
    (["VLLM::Worker_PP1_TP0"], False, True, True),
    (["VLLM::DPCoordinator"], False, True, False),
    (["vllm", "bench", "serve"], False, False, False),
    (["python3", "-m", "sglang.launch_server"], False, False, False),
])
def test_processes_are_recognised_by_vllms_titles(argv, main, worker, rank):
    assert (container.is_main_argv(argv), container.is_worker_argv(argv), container.is_scheduler_argv(argv)) == \
        (main, worker, rank)


def test_the_info_and_the_kv_capacity_come_from_what_vllm_serves():
    answers = {
        "/v1/models": (200, json.dumps({"object": "list", "data": [
            {"id": "m", "root": "/models/m", "max_model_len": 32768}]})),
        "/version": (200, json.dumps({"version": "0.33.0"})),
        "/metrics": (200, '# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
                          'vllm:cache_config_info{block_size="16",cache_dtype="fp8",num_gpu_blocks="8192"} 1.0\n'),
    }
    info = container.read_info(lambda path: answers.get(path, (404, "")))
    assert info["args"] == {"served_model_name": "m", "model_path": "/models/m", "max_model_len": 32768,
                            "version": "0.33.0", "num_gpu_blocks": 8192, "block_size": 16, "kv_cache_tokens": 131072}
    assert VLLM.capacity_line({"kv_cache_tokens": 65536}, VLLM.capacity(info["args"])) == "KV cache 65,536 -> 131,072 tokens (x2.00)"
    assert container.read_info(lambda path: (401, ""))["error"] == "unauthorized (401)"


def test_a_generation_is_a_one_token_completion_to_the_served_model():
    method, path, body = container.generation_request(["vllm", "serve", "/m", "--served-model-name", "chat"])
    assert (method, path, json.loads(body)["model"], json.loads(body)["max_tokens"]) == ("POST", "/v1/completions",
                                                                                          "chat", 1)


def test_fleet_yaml_takes_a_vllm_section_beside_sglang(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text("""
hosts:
  pve1:
    containers:
      129:
        sglang: {model_path: /m, port: 30000, flags: {tp: 4}}
        vllm:
          model_path: /m2
          port: 8001
          flags: {tensor-parallel-size: 4, kv-cache-dtype: fp8}
          env: {CUDA_VISIBLE_DEVICES: "4,5,6,7"}
""")
    servers = load_fleet(str(path)).hosts[0].containers[0].sglang["sglang_servers"]
    assert [(s.get("engine", "sglang"), s["sglang_port"]) for s in servers] == [("sglang", 30000), ("vllm", 8001)]
    desired = desired_states({"sglang_servers": servers})
    assert [(d.engine, d.spec.gpus) for d in desired] == [("sglang", (0, 1, 2, 3)), ("vllm", (4, 5, 6, 7))]
    path.write_text(path.read_text().replace("kv-cache-dtype: fp8", "kv-cache-dtyp: fp8"))
    with pytest.raises(FleetError, match=r"129\.vllm\.flags\.kv-cache-dtyp: not a flag of any vLLM release"):
        load_fleet(str(path))
    path.write_text(path.read_text().replace("kv-cache-dtyp: fp8}", "kv-cache-dtype: fp8}\n          engine: sglang"))
    with pytest.raises(FleetError, match=r"129\.vllm\.engine: 'sglang' in a vllm: section"):
        load_fleet(str(path))


def test_a_vllm_unit_is_restarted_after_its_engine_dies_though_the_server_exits_0():
    from gpugate.operations.sglang import render_unit
    from gpugate.spec import desired_state

    units = {}
    for name, flags in (("vllm", {"tensor-parallel-size": 2}), ("sglang", {"tp": 2})):
        spec = desired_state({"engine": name, "sglang_model_path": "/m", "sglang_port": 8000, "sglang_flags": flags}).spec
        units[name] = render_unit(spec, 70)
    assert "Restart=always" in units["vllm"] and "Description=vLLM server on port 8000" in units["vllm"]
    assert "Restart=on-failure" in units["sglang"] and "Description=SGLang server on port 8000" in units["sglang"]


@pytest.mark.parametrize("first", ["vllm", "sglang"])
def test_a_containers_servers_run_in_the_order_written_engine_sections_included(tmp_path, first):
    from gpugate.fleet import fleet_to_inventory, load_fleet
    from gpugate.spec import desired_states

    sections = {"vllm": '        vllm: {model_path: /m, port: 8000, flags: {tensor-parallel-size: 1}, '
                        'env: {CUDA_VISIBLE_DEVICES: "0"}}\n',
                "sglang": "        sglang: {model_path: /m, port: 30000, flags: {tp: 1, base-gpu-id: 1}}\n"}
    second = "sglang" if first == "vllm" else "vllm"
    path = tmp_path / "fleet.yaml"
    path.write_text("hosts:\n  pve1:\n    containers:\n      129:\n" + sections[first] + sections[second])
    ((_name, data),), _group = fleet_to_inventory(load_fleet(path))["pve_pve1"]
    assert [d.engine for d in desired_states(data)] == [first, second]
    assert [port for port, _gpus in desired_states(data)[0].run_order] == [8000, 30000][::1 if first == "vllm" else -1]


def test_weight_cache_daemons_get_the_weight_shaping_flags_and_what_vllm_refuses_with_it_is_refused():
    from gpugate.engine import FlagError, ServerInputs
    from gpugate.engine.vllm import launch

    def build(flags, version="0.33.0", **kw):
        return launch.build(ServerInputs(engine="vllm", model_path="/m", port=8000, flags=flags, weight_cache=True,
                                         **kw), version)

    planned = build({"tensor-parallel-size": 2, "kv-cache-dtype": "fp8", "enable-prefix-caching": False,
                     "load-format": "safetensors"})
    assert planned.daemon_argv[1:] == ("-m", "vllm.entrypoints.cli.main", "preload", "--model", "/m", "--kv-cache-dtype",
                                       "fp8", "--load-format", "safetensors", "--tensor-parallel-size", "2")
    assert "--load-format" in planned.argv and planned.argv[planned.argv.index("--load-format") + 1] == "ipc_cache"
    assert '{"fallback": false, "mode": "zero_copy"}' in planned.argv
    for flags, version, words in (({"enable-sleep-mode": True}, "0.33.0", "--enable-sleep-mode: not with weight_cache"),
                                  ({"load-format": "ipc_cache"}, "0.33.0", "daemons load from disk"),
                                  ({}, "0.32.0", "vLLM 0.32.0 has no weight cache")):
        with pytest.raises(FlagError, match=words):
            build(flags, version)
    with pytest.raises(FlagError, match="shapes the weights"):
        build({}, extra_args=("--tensor-parallel-size", "2"))
    with pytest.raises(FlagError, match="write weight_cache: true"):
        launch.build(ServerInputs(engine="vllm", model_path="/m", port=8000, flags={"load-format": "ipc_cache"}), "0.33.0")


def test_vllms_secret_flags_and_secrets_inside_its_json_options_are_never_shown():
    vllm = get("vllm")
    flags = vllm.validate_flags({"tensor-parallel-size": 1, "hf-token": "hf_SEKRIT1",
                                 # a config option written as a YAML mapping: vLLM reads it as JSON text
                                 "kv-transfer-config": {"kv_connector": "X", "kv_connector_extra_config": {"api_key": "SEKRITJSON"}},
                                 "compilation-config": {"mode": 3}}, "0.33.0")
    assert flags["compilation-config"] == '{"mode":3}'
    shown = "\n".join(vllm.flag_lines({}, flags)) + repr(vllm.redact_flags(flags))
    launch = vllm.launch(ServerInputs(engine="vllm", model_path="/m", port=8000, flags=flags))
    shown += " ".join(launch.shown_argv) + repr(dict(launch.shown_flags))
    assert "SEKRIT" not in shown and "+ --hf-token ***" in shown and "+ --compilation-config '{\"mode\":3}'" in shown, shown
    # what the agent masks in the argv it logs and the log tails: its own list (--hf-token among them,
    # for a server it adopts too) and what the launch adds
    from gpugate.rules.redact import ALWAYS_MASKED_OPTIONS
    assert "--kv-transfer-config" in launch.secret_options and "--hf-token" in ALWAYS_MASKED_OPTIONS


def test_a_server_written_without_a_port_gets_its_engines_own(tmp_path):
    from gpugate.fleet import fleet_to_inventory

    path = tmp_path / "fleet.yaml"
    path.write_text("hosts:\n  pve1:\n    containers:\n      129:\n        vllm: {model_path: /m, flags: {tp: 1}}\n"
                    "      130:\n        sglang: {model_path: /m, flags: {tp: 1}}\n")
    hosts, _group = fleet_to_inventory(load_fleet(path))["pve_pve1"]
    assert [(d.engine, d.port) for _name, data in hosts for d in desired_states(data)] == [("vllm", 8000), ("sglang", 30000)]
