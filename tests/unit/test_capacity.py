"""gpugate.engine.sglang.capacity: the figures an operator compares, read from SGLang's /get_server_info shapes."""

from __future__ import annotations

from gpugate.engine.sglang.capacity import capacity_from_server_info, capacity_line

# the shape of SGLang 0.5's /get_server_info (server args, scheduler handshake, internal states), trimmed
SERVER_INFO = {
    "model_path": "/models/kimi", "tp_size": 8, "kv_cache_dtype": "auto", "mem_fraction_static": 0.88,
    "context_length": None, "max_running_requests": None, "chunked_prefill_size": 8192, "page_size": 1,
    "status": "ready", "max_total_num_tokens": 159744, "max_req_input_len": 131066,
    "internal_states": [{"last_gen_throughput": 0.0, "effective_max_running_requests_per_dp": 2048,
                         "memory_usage": {"weight": 76.3, "kvcache": 10.72, "token_capacity": 159744, "graph": 1.5}}],
    "version": "0.5.5",
}


def test_figures_from_a_server_info_document():
    figures = capacity_from_server_info(SERVER_INFO)
    assert figures == {"max_total_num_tokens": 159744, "max_req_input_len": 131066, "max_running_requests": 2048,
                       "kv_cache_gb": 10.72, "weight_gb": 76.3, "graph_gb": 1.5, "kv_cache_dtype": "auto",
                       "mem_fraction_static": 0.88, "chunked_prefill_size": 8192, "page_size": 1}


def test_older_and_partial_documents():
    # token capacity only in memory_usage; internal_states as a dict; the server arg when no internal state
    assert capacity_from_server_info({"internal_states": {"memory_usage": {"token_capacity": 42}}}) == {
        "max_total_num_tokens": 42}
    assert capacity_from_server_info({"max_running_requests": 64}) == {"max_running_requests": 64}
    assert capacity_from_server_info(None) == {} and capacity_from_server_info({"error": "503"}) == {}


def test_the_fp8_line_and_what_is_left_out():
    before = capacity_from_server_info(SERVER_INFO)
    after_info = dict(SERVER_INFO, kv_cache_dtype="fp8_e4m3", max_total_num_tokens=319488,
                      internal_states=[{"effective_max_running_requests_per_dp": 2048,
                                        "memory_usage": {"weight": 76.3, "kvcache": 10.72, "graph": 1.5}}])
    line = capacity_line(before, capacity_from_server_info(after_info))
    assert line == "KV cache 159,744 -> 319,488 tokens (x2.00)"
    assert capacity_line(before, before) is None
    assert capacity_line(before, {}) is None  # the new server did not answer: nothing to compare
    grown = dict(before, max_running_requests=4096, kv_cache_gb=21.44)
    assert capacity_line(before, grown) == "max running requests 2,048 -> 4,096; KV cache memory 10.72 -> 21.44 GB/GPU"
