"""The capacity figures the stand-in reports in /get_server_info, computed the way SGLang does.

SGLang (python/sglang/srt/model_executor/model_runner.py, ``profile_max_num_token`` and
``init_memory_pool``; managers/tp_worker.py for the request limits), for a model without MLA:

    cell_size   = kv_heads_per_tp_rank * head_dim * num_hidden_layers * 2 (K and V) * bytes(kv dtype)
    rest_gb     = available_gb_after_weights - total_gb * (1 - mem_fraction_static)
    max_total_num_tokens = int(rest_gb * 2**30 // cell_size), then rounded down to a page
    max_running_requests = min(clamp(int(tokens / context_len * 512), 2048, 4096), tokens // 2)
                           (or min(--max-running-requests, tokens // 2) when given)
    max_req_input_len    = min(context_len - 1, tokens - 1) - 5

``bytes(kv dtype)``: ``auto`` is the model's dtype (bfloat16: 2), ``fp8_e4m3``/``fp8_e5m2``: 1.
So ``--kv-cache-dtype fp8_e4m3`` doubles the KV cache, and a larger ``--mem-fraction-static``
grows it by ``total_gb * delta`` worth of cells. ``available_gb_after_weights`` here: the GPU's
memory less the driver's reserved part and this rank's share of the weights (the parameter count
from config.json x 2 bytes / tp). Stdlib only, Python 3.8 (it runs in lab containers).

Example:
    >>> shape = {"num_hidden_layers": 32, "num_key_value_heads": 8, "num_attention_heads": 32,
    ...          "hidden_size": 4096, "vocab_size": 128256, "intermediate_size": 14336}
    >>> a = figures({"tp_size": 8, "mem_fraction_static": 0.88, "kv_cache_dtype": "auto"}, shape, 97887, 615)
    >>> b = figures({"tp_size": 8, "mem_fraction_static": 0.88, "kv_cache_dtype": "fp8_e4m3"}, shape, 97887, 615)
    >>> b["max_total_num_tokens"] // a["max_total_num_tokens"]
    2
"""

from sglang._sim import common

GIB = 1 << 30
KV_DTYPE_BYTES = {"fp8_e4m3": 1, "fp8_e5m2": 1, "fp4_e2m1": 0.5, "bf16": 2, "bfloat16": 2, "fp16": 2,
                  "float16": 2, "fp32": 4, "float32": 4}


model_config = common.model_config
_shape = common.model_shape
parameter_count = common.parameter_count


def figures(server_args, config, total_mib, reserved_mib=0):
    """What SGLang's scheduler reports for this server on a GPU of ``total_mib`` (see the module
    docstring); {} when the GPU's size is unknown."""
    if not total_mib:
        return {}
    shape = _shape(config)
    tp = max(1, int(server_args.get("tp_size") or 1))
    kv_heads_per_rank = max(1, shape["kv_heads"] // tp)  # SGLang replicates KV heads when tp > kv heads
    dtype = str(server_args.get("kv_cache_dtype") or "auto")
    element = shape["dtype_bytes"] if dtype == "auto" else KV_DTYPE_BYTES.get(dtype, shape["dtype_bytes"])
    cell_size = kv_heads_per_rank * shape["head_dim"] * shape["layers"] * 2 * element
    total_gb = total_mib / 1024.0
    weight_gb = parameter_count(shape) * shape["dtype_bytes"] / tp / GIB
    available_gb = (total_mib - reserved_mib) / 1024.0 - weight_gb
    fraction = float(server_args.get("mem_fraction_static") or 0.88)
    rest_gb = available_gb - total_gb * (1 - fraction)
    tokens = int(rest_gb * GIB // cell_size) if rest_gb > 0 else 0
    page = max(1, int(server_args.get("page_size") or 1))
    tokens = tokens // page * page
    context = int(server_args.get("context_length") or shape["context"])
    requested = server_args.get("max_running_requests")
    if requested:
        running = min(int(requested), tokens // 2)
    else:
        running = min(max(min(int(tokens / context * 512), 4096), 2048), tokens // 2)
    return {
        "max_total_num_tokens": tokens,
        "max_req_input_len": min(context - 1, tokens - 1) - 5,
        "effective_max_running_requests_per_dp": running,
        "memory_usage": {"weight": round(weight_gb, 2), "kvcache": round(tokens * cell_size / GIB, 2),
                         "token_capacity": tokens, "graph": 0.0},
    }
