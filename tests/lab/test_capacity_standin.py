"""The stand-in's /get_server_info capacity figures follow SGLang's formula, and gpugate.engine.sglang.capacity reads them
(real stand-in processes on the simulated driver)."""

from __future__ import annotations

import json

from gpusim_helpers import (RESERVED_MIB, TOTAL_MIB, http_json, http_status, installed, model_dir,  # noqa: F401
                            sim, start_standin, wait_until)

from gpugate.engine.sglang.capacity import capacity_from_server_info, capacity_line

# a TinyLlama-sized model: fits a 10000 MiB simulated GPU at tp 2
SMALL_MODEL = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 16, "num_attention_heads": 16,
               "num_key_value_heads": 4, "hidden_size": 2048, "intermediate_size": 5632, "vocab_size": 32000,
               "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}


def test_fp8_kv_doubles_the_kv_cache_and_the_line_says_so(sim, start_standin, tmp_path):
    model = tmp_path / "small-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMALL_MODEL))
    auto = start_standin("--model-path", str(model), "--tp", "2", env={"SGLANG_STANDIN_LOAD_S": "0.2"})
    fp8 = start_standin("--model-path", str(model), "--tp", "2", "--base-gpu-id", "2", "--kv-cache-dtype", "fp8_e4m3",
                        env={"SGLANG_STANDIN_LOAD_S": "0.2"})
    for server in (auto, fp8):
        wait_until(lambda: http_status(server.port) == 200, what="/health 200")
    before = capacity_from_server_info(http_json(auto.port, "/get_server_info"))
    after = capacity_from_server_info(http_json(fp8.port, "/get_server_info"))

    # SGLang's profile_max_num_token by hand: kv heads per rank 4/2, head dim 2048/16, 16 layers, K and V
    weights_gb = (32000 * 2048 * 2 + 16 * (2048 * 128 * 16 * 2 + 2048 * 128 * 4 * 2 + 3 * 2048 * 5632 + 2 * 2048)) * 2 / 2 / 2**30
    available_gb = (TOTAL_MIB - RESERVED_MIB) / 1024 - weights_gb
    for figures, fraction, element in ((before, 0.88, 2), (after, 0.88, 1)):
        rest_gb = available_gb - TOTAL_MIB / 1024 * (1 - fraction)
        tokens = int(rest_gb * 2**30 // (2 * 128 * 16 * 2 * element))
        assert figures["max_total_num_tokens"] == tokens
        assert figures["max_req_input_len"] == min(2047, tokens - 1) - 5
        assert figures["max_running_requests"] == min(max(min(int(tokens / 2048 * 512), 4096), 2048), tokens // 2)
    assert before["kv_cache_dtype"] == "auto" and after["kv_cache_dtype"] == "fp8_e4m3"

    line = capacity_line(before, after)
    ratio = after["max_total_num_tokens"] / before["max_total_num_tokens"]
    assert abs(ratio - 2) < 1e-5  # one byte per element instead of two (the floor may drop a token)
    assert line.startswith(f"KV cache {before['max_total_num_tokens']:,} -> {after['max_total_num_tokens']:,} "
                           "tokens (x2.00)")
