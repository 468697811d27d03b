"""SGLang's server flags as data: the table, validation, argv render/parse, diffs.

Stdlib only: this module is also copied into lab containers, where the SGLang stand-in uses
``build_parser()`` as its own argument parser, so bad flags fail there exactly as they would
in SGLang (argparse's message, exit status 2).

The table mirrors ``ServerArgs.add_cli_args`` in sgl-project/sglang
(``python/sglang/srt/server_args.py``, 0.5.x) and ``docs/advanced_features/server_arguments.md``:
option strings, aliases, types, choices, store_true flags and defaults.

Vocabulary
----------
- *canonical name*: the hyphenated ServerArgs field name without dashes (``tp-size``,
  ``kv-cache-dtype``). Aliases (``tp``, ``--tensor-parallel-size``, ``tp_size``) map onto it.
- *normalised flags*: ``dict[canonical name, typed value]``; a store_true flag that is set is
  ``True``, one that is not set is absent (``disable-radix-cache: false`` == not given).

Example::

    >>> flags = validate_flags({"tp": 8, "kv-cache-dtype": "fp8_e4m3", "disable-radix-cache": True})
    >>> flags
    {'disable-radix-cache': True, 'kv-cache-dtype': 'fp8_e4m3', 'tp-size': 8}
    >>> render_argv("/opt/models/m", 30000, flags)[:4]
    ['-m', 'sglang.launch_server', '--model-path', '/opt/models/m']
    >>> diff_flags({"kv-cache-dtype": "auto"}, flags).lines()
    ['+ --disable-radix-cache', '- --kv-cache-dtype auto', '+ --kv-cache-dtype fp8_e4m3', '+ --tp-size 8']
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import shlex
from typing import Any, Mapping, Sequence

__all__ = [
    "FlagError",
    "FlagSpec",
    "SPECS",
    "SEPARATE_FIELDS",
    "canonical_name",
    "validate_flags",
    "render_argv",
    "render_flag_args",
    "parse_argv",
    "ParsedCommand",
    "diff_flags",
    "FlagDiff",
    "build_parser",
    "server_info_view",
    "server_info_mismatches",
    "redact_argv",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
SECRET_MASK = "***"


class FlagError(ValueError):
    """A flag that SGLang (or gpugate) would reject. ``str()`` names the flag and the problem.

    Example::

        >>> str(FlagError("kv-cache-dtype", "'fp9' is not one of auto, fp8_e5m2, ..."))
        "--kv-cache-dtype: 'fp9' is not one of auto, fp8_e5m2, ..."
    """

    def __init__(self, flag: str, message: str):
        self.flag = flag
        self.message = message
        super().__init__(f"--{flag}: {message}" if flag else message)


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """One SGLang server argument.

    kind: ``bool`` (store_true), ``int``, ``float``, ``str``, ``choice`` (one of ``choices``,
    each of type ``item``), ``list`` (``nargs="+"`` of ``item``), ``json`` (a JSON document
    passed as one string; YAML mappings/lists are accepted and serialised canonically).
    """

    name: str
    kind: str
    default: Any = None
    help: str = ""
    aliases: tuple[str, ...] = ()
    dest: str = ""
    choices: tuple[Any, ...] = ()
    item: str = "str"
    secret: bool = False

    @property
    def option_strings(self) -> list[str]:
        """The option strings SGLang's parser declares, canonical first."""
        return [f"--{self.name}"] + [f"--{a}" for a in self.aliases if not a.startswith("_")]


# --------------------------------------------------------------------------------------
# The table. Choices are copied from SGLang's server_args.py; lists that grow with every
# release (quantization, attention backends, parsers) hold the union of recent releases.
# --------------------------------------------------------------------------------------

_LOAD_FORMATS = ("auto", "pt", "safetensors", "npcache", "dummy", "sharded_state", "gguf",
                 "bitsandbytes", "layered", "flash_rl", "remote", "remote_instance",
                 "fastsafetensors", "private", "runai_streamer", "mistral", "presharded")
_QUANTIZATIONS = ("awq", "fp8", "mxfp8", "gptq", "marlin", "gptq_marlin", "awq_marlin",
                  "bitsandbytes", "gguf", "modelopt", "modelopt_fp8", "modelopt_fp4",
                  "modelopt_mixed", "petit_nvfp4", "w8a8_int8", "w8a8_fp8", "moe_wna16", "qoq",
                  "w4afp8", "mxfp4", "auto-round", "compressed-tensors", "modelslim",
                  "quark", "quark_int4fp8_moe", "quark_mxfp4")
_ATTENTION_BACKENDS = ("triton", "torch_native", "flex_attention", "dsa", "nsa", "cutlass_mla",
                       "fa3", "fa4", "flashinfer", "flashmla", "trtllm_mla", "trtllm_mha",
                       "dual_chunk_flash_attn", "aiter", "wave", "intel_amx", "ascend",
                       "intel_xpu", "hpc_ops")
_MOE_RUNNERS = ("auto", "deep_gemm", "triton", "triton_kernel", "flashinfer_trtllm",
                "flashinfer_trtllm_routed", "flashinfer_cutlass", "flashinfer_mxfp4",
                "flashinfer_cutedsl", "cutlass", "aiter", "marlin")
_MOE_A2A = ("none", "deepep", "mooncake", "mori", "nixl", "ascend_fuseep", "flashinfer")
_REASONING_PARSERS = ("deepseek-r1", "deepseek-v3", "glm45", "gpt-oss", "kimi", "kimi_k2",
                      "minimax", "minimax-append-think", "qwen3", "qwen3-thinking", "step3",
                      "interns1", "nano_v3")
_TOOL_CALL_PARSERS = ("deepseekv3", "deepseekv31", "deepseekv32", "glm", "glm45", "glm47",
                      "gpt-oss", "kimi_k2", "llama3", "mistral", "pythonic", "qwen", "qwen25",
                      "qwen3_coder", "step3", "gigachat3", "minimax-m2", "interns1")

# (name, kind, default, help, extras) -- extras: aliases, choices, item, secret, dest
_TABLE: list[tuple[str, str, Any, str, dict]] = [
    # Model and tokenizer
    ("tokenizer-path", "str", None, "The path of the tokenizer.", {}),
    ("tokenizer-mode", "choice", "auto", "Tokenizer mode.", {"choices": ("auto", "slow")}),
    ("tokenizer-worker-num", "int", 1, "The worker num of the tokenizer manager.", {}),
    ("skip-tokenizer-init", "bool", False, "Skip init tokenizer; pass input_ids in generate request.", {}),
    ("load-format", "choice", "auto", "The format of the model weights to load.", {"choices": _LOAD_FORMATS}),
    ("model-loader-extra-config", "json", "{}", "Extra config for the model loader (JSON).", {}),
    ("trust-remote-code", "bool", False, "Allow custom models defined on the Hub in their own modeling files.", {}),
    ("context-length", "int", None, "The model's maximum context length.", {}),
    ("is-embedding", "bool", False, "Use a CausalLM as an embedding model.", {}),
    ("enable-multimodal", "bool", None, "Enable the multimodal functionality for the served model.", {}),
    ("revision", "str", None, "The specific model version to use (branch, tag or commit id).", {}),
    ("model-impl", "str", "auto", "Which implementation of the model to use (auto, sglang, transformers).", {}),
    # HTTP server
    ("fastapi-root-path", "str", "", "App is behind a path based routing proxy.", {}),
    ("skip-server-warmup", "bool", False, "Skip warmup.", {}),
    ("warmups", "str", None, "Custom warmup functions (csv) to run before the server starts.", {}),
    ("nccl-port", "int", None, "The port for NCCL distributed environment setup.", {}),
    # Quantization and data type
    ("dtype", "choice", "auto", "Data type for model weights and activations.",
     {"choices": ("auto", "half", "float16", "bfloat16", "float", "float32")}),
    ("quantization", "choice", None, "The quantization method.", {"choices": _QUANTIZATIONS}),
    ("quantization-param-path", "str", None, "JSON file with the KV cache scaling factors.", {}),
    ("kv-cache-dtype", "choice", "auto", "Data type for kv cache storage.",
     {"choices": ("auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1")}),
    ("enable-fp32-lm-head", "bool", False, "LM head outputs (logits) in FP32.", {}),
    ("modelopt-quant", "str", None, "The ModelOpt quantization configuration.", {}),
    # Memory and scheduling
    ("mem-fraction-static", "float", None, "Fraction of the memory used for static allocation (weights and KV pool).", {}),
    ("max-running-requests", "int", None, "The maximum number of running requests.", {}),
    ("max-queued-requests", "int", None, "The maximum number of queued requests.", {}),
    ("max-total-tokens", "int", None, "The maximum number of tokens in the memory pool.", {}),
    ("chunked-prefill-size", "int", None, "Max tokens in a chunk for chunked prefill; -1 disables it.", {}),
    ("max-prefill-tokens", "int", 16384, "The maximum number of tokens in a prefill batch.", {}),
    ("schedule-policy", "choice", "fcfs", "The scheduling policy of the requests.",
     {"choices": ("lpm", "random", "fcfs", "dfs-weight", "lof", "priority", "routing-key")}),
    ("enable-priority-scheduling", "bool", False, "Enable priority scheduling.", {}),
    ("schedule-conservativeness", "float", 1.0, "How conservative the schedule policy is.", {}),
    ("page-size", "int", 1, "The number of tokens in a page.", {}),
    ("swa-full-tokens-ratio", "float", 0.8, "Ratio of SWA layer KV tokens to full layer KV tokens.", {}),
    ("disable-hybrid-swa-memory", "bool", False, "Disable the hybrid SWA memory pool.", {}),
    ("radix-eviction-policy", "choice", "lru", "The eviction policy of radix trees.", {"choices": ("lru", "lfu")}),
    # Runtime options
    ("device", "str", None, "The device to use ('cuda', 'xpu', 'hpu', 'npu', 'cpu').", {}),
    ("tp-size", "int", 1, "The tensor parallelism size.", {"aliases": ("tensor-parallel-size", "_tp")}),
    ("pp-size", "int", 1, "The pipeline parallelism size.", {"aliases": ("pipeline-parallel-size",)}),
    ("pp-max-micro-batch-size", "int", None, "The maximum micro batch size in pipeline parallelism.", {}),
    ("stream-interval", "int", 1, "The interval (in tokens) for streaming.", {}),
    ("stream-output", "bool", False, "Output as a sequence of disjoint segments.", {}),
    ("random-seed", "int", None, "The random seed.", {}),
    ("watchdog-timeout", "float", 300.0, "Watchdog timeout in seconds for a forward batch.", {}),
    ("dist-timeout", "int", None, "Timeout for torch.distributed initialization.", {}),
    ("download-dir", "str", None, "Model download directory for huggingface.", {}),
    ("base-gpu-id", "int", 0, "The base GPU ID to start allocating GPUs from.", {}),
    ("gpu-id-step", "int", 1, "The delta between consecutive GPU IDs that are used.", {}),
    ("sleep-on-idle", "bool", False, "Reduce CPU usage when sglang is idle.", {}),
    # Logging
    ("log-level", "str", "info", "The logging level of all loggers.", {}),
    ("log-level-http", "str", None, "The logging level of the HTTP server.", {}),
    ("log-requests", "bool", False, "Log metadata, inputs, outputs of all requests.", {}),
    ("log-requests-level", "choice", 2, "Verbosity of --log-requests (0-3).", {"choices": (0, 1, 2, 3), "item": "int"}),
    ("crash-dump-folder", "str", None, "Folder to dump requests from the last 5 min before a crash.", {}),
    ("show-time-cost", "bool", False, "Show time cost of custom marks.", {}),
    ("enable-metrics", "bool", False, "Enable prometheus metrics.", {}),
    ("enable-metrics-for-all-schedulers", "bool", False, "Record request metrics on all TP ranks.", {}),
    ("tokenizer-metrics-custom-labels-header", "str", "x-custom-labels", "HTTP header for custom metric labels.", {}),
    ("tokenizer-metrics-allowed-custom-labels", "list", None, "Custom labels allowed for tokenizer metrics.", {}),
    ("bucket-time-to-first-token", "list", None, "Buckets of time to first token.", {"item": "float"}),
    ("bucket-inter-token-latency", "list", None, "Buckets of inter-token latency.", {"item": "float"}),
    ("bucket-e2e-request-latency", "list", None, "Buckets of end-to-end request latency.", {"item": "float"}),
    ("collect-tokens-histogram", "bool", False, "Collect prompt/generation tokens histogram.", {}),
    ("decode-log-interval", "int", 40, "The log interval of decode batch.", {}),
    ("enable-request-time-stats-logging", "bool", False, "Per request time stats logging.", {}),
    ("kv-events-config", "json", None, "Config (JSON) for NVIDIA dynamo KV event publishing.", {}),
    ("enable-trace", "bool", False, "Enable opentelemetry trace.", {}),
    ("otlp-traces-endpoint", "str", "localhost:4317", "Opentelemetry collector endpoint.", {}),
    # API related
    ("api-key", "str", None, "API key of the server (also for the OpenAI-compatible API).", {"secret": True}),
    ("admin-api-key", "str", None, "Admin API key for administrative endpoints.", {"secret": True}),
    ("served-model-name", "str", None, "Model name returned by the v1/models endpoint.", {}),
    ("weight-version", "str", "default", "Version identifier for the model weights.", {}),
    ("chat-template", "str", None, "Builtin chat template name or chat template file path.", {}),
    ("hf-chat-template-name", "str", None, "Named HuggingFace chat template to use.", {}),
    ("completion-template", "str", None, "Builtin completion template name or file path.", {}),
    ("file-storage-path", "str", "sglang_storage", "The path of the file storage in backend.", {}),
    ("enable-cache-report", "bool", False, "Return number of cached tokens in usage.", {}),
    ("reasoning-parser", "choice", None, "The parser for reasoning models.", {"choices": _REASONING_PARSERS}),
    ("tool-call-parser", "choice", None, "The parser for tool-call interactions.", {"choices": _TOOL_CALL_PARSERS}),
    ("tool-server", "str", None, "'demo' or a comma-separated list of tool server urls.", {}),
    ("sampling-defaults", "choice", "model", "Where to get default sampling parameters.", {"choices": ("openai", "model")}),
    # Data parallelism
    ("dp-size", "int", 1, "The data parallelism size.", {"aliases": ("data-parallel-size", "_dp")}),
    ("load-balance-method", "choice", "auto", "The load balancing strategy for data parallelism.",
     {"choices": ("auto", "round_robin", "follow_bootstrap_room", "total_requests", "total_tokens",
                  "shortest_queue", "minimum_tokens")}),
    # Multi-node distributed serving
    ("dist-init-addr", "str", None, "Host address for initializing the distributed backend.", {"aliases": ("nccl-init-addr",)}),
    ("nnodes", "int", 1, "The number of nodes.", {}),
    ("node-rank", "int", 0, "The node rank.", {}),
    # Model override args
    ("json-model-override-args", "json", "{}", "JSON dict overriding default model configurations.", {}),
    ("preferred-sampling-params", "json", None, "JSON sampling settings returned in /get_model_info.", {}),
    # LoRA
    ("enable-lora", "bool", None, "Enable LoRA support for the model.", {}),
    ("max-lora-rank", "int", None, "The maximum LoRA rank that should be supported.", {}),
    ("lora-paths", "list", None, "The list of LoRA adapters to load.", {}),
    ("max-loras-per-batch", "int", 8, "Maximum number of adapters for a running batch.", {}),
    ("lora-backend", "choice", "csgmv", "Kernel backend for multi-LoRA serving.",
     {"choices": ("triton", "csgmv", "ascend", "torch_native")}),
    # Kernel backends
    ("attention-backend", "choice", None, "The kernels for attention layers.", {"choices": _ATTENTION_BACKENDS}),
    ("prefill-attention-backend", "choice", None, "The kernels for prefill attention layers.", {"choices": _ATTENTION_BACKENDS}),
    ("decode-attention-backend", "choice", None, "The kernels for decode attention layers.", {"choices": _ATTENTION_BACKENDS}),
    ("sampling-backend", "choice", None, "The kernels for sampling layers.", {"choices": ("flashinfer", "pytorch", "ascend")}),
    ("grammar-backend", "choice", None, "The backend for grammar-guided decoding.",
     {"choices": ("xgrammar", "outlines", "llguidance", "none")}),
    ("mm-attention-backend", "choice", None, "Multimodal attention backend.",
     {"choices": ("sdpa", "fa3", "fa4", "triton_attn", "ascend_attn", "aiter_attn")}),
    ("fp8-gemm-backend", "choice", "auto", "Runner backend for blockwise FP8 GEMM.",
     {"choices": ("auto", "deep_gemm", "flashinfer_trtllm", "flashinfer_cutlass", "flashinfer_deepgemm",
                  "cutlass", "triton", "aiter")}),
    # Speculative decoding
    ("speculative-algorithm", "choice", None, "Speculative algorithm.",
     {"choices": ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")}),
    ("speculative-draft-model-path", "str", None, "The path of the draft model weights.", {"aliases": ("speculative-draft-model",)}),
    ("speculative-draft-model-revision", "str", None, "The draft model version to use.", {}),
    ("speculative-num-steps", "int", None, "Steps sampled from the draft model.", {}),
    ("speculative-eagle-topk", "int", None, "Tokens sampled from the draft model in eagle2 each step.", {}),
    ("speculative-num-draft-tokens", "int", None, "Tokens sampled from the draft model.", {}),
    ("speculative-accept-threshold-single", "float", 1.0, "Accept a draft token above this target probability.", {}),
    ("speculative-accept-threshold-acc", "float", 1.0, "Accept probability raise threshold.", {}),
    ("speculative-token-map", "str", None, "The path of the draft model's small vocab table.", {}),
    ("speculative-attention-mode", "choice", "prefill", "Attention backend mode for speculative decoding.",
     {"choices": ("prefill", "decode")}),
    ("speculative-draft-attention-backend", "choice", None, "Attention backend for speculative drafting.",
     {"choices": _ATTENTION_BACKENDS}),
    # MoE
    ("ep-size", "int", 1, "The expert parallelism size.", {"aliases": ("expert-parallel-size", "ep")}),
    ("moe-a2a-backend", "choice", "none", "All-to-all backend for expert parallelism.", {"choices": _MOE_A2A}),
    ("moe-runner-backend", "choice", "auto", "The runner backend for MoE.", {"choices": _MOE_RUNNERS}),
    ("deepep-mode", "choice", "auto", "DeepEP MoE mode.", {"choices": ("normal", "low_latency", "auto")}),
    ("ep-num-redundant-experts", "int", 0, "Redundant experts in expert parallel.", {}),
    ("enable-eplb", "bool", False, "Enable the EPLB algorithm.", {}),
    ("moe-dense-tp-size", "int", None, "TP size for MoE dense MLP layers.", {}),
    # Mamba cache
    ("max-mamba-cache-size", "int", None, "The maximum size of the mamba cache.", {}),
    ("mamba-ssm-dtype", "choice", "float32", "Data type of the SSM states in mamba cache.",
     {"choices": ("float32", "bfloat16", "float16")}),
    # Hierarchical cache
    ("enable-hierarchical-cache", "bool", False, "Enable hierarchical cache.", {}),
    ("hicache-ratio", "float", 2.0, "Host KV cache pool size / device pool size.", {}),
    ("hicache-size", "int", 0, "Host KV cache pool size in GB, per TP rank (overrides --hicache-ratio).", {}),
    ("hicache-write-policy", "choice", "write_through", "The write policy of hierarchical cache.",
     {"choices": ("write_back", "write_through", "write_through_selective")}),
    ("hicache-io-backend", "choice", "kernel", "IO backend for KV cache transfer between CPU and GPU.",
     {"choices": ("direct", "kernel", "kernel_ascend")}),
    ("hicache-mem-layout", "choice", "layer_first", "Layout of the host memory pool.",
     {"choices": ("layer_first", "page_first", "page_first_direct", "page_first_kv_split", "page_head")}),
    ("hicache-storage-backend", "choice", None, "Storage backend for hierarchical KV cache.",
     {"choices": ("file", "mooncake", "hf3fs", "nixl", "aibrix", "dynamic", "eic")}),
    ("hicache-storage-prefetch-policy", "choice", "best_effort", "When prefetching from storage stops.",
     {"choices": ("best_effort", "wait_complete", "timeout")}),
    ("hicache-storage-backend-extra-config", "str", None, "Extra config (JSON or @file) for the storage backend.", {}),
    ("enable-lmcache", "bool", False, "Use LMCache as hierarchical cache.", {}),
    # Offloading
    ("cpu-offload-gb", "int", 0, "GBs of RAM to reserve for CPU offloading.", {}),
    # Optimization/debug options
    ("disable-radix-cache", "bool", False, "Disable RadixAttention for prefix caching.", {}),
    ("cuda-graph-max-bs", "int", None, "The maximum batch size for cuda graph.", {}),
    ("cuda-graph-bs", "list", None, "The list of batch sizes for cuda graph.", {"item": "int"}),
    ("disable-cuda-graph", "bool", False, "Disable cuda graph.", {}),
    ("disable-cuda-graph-padding", "bool", False, "Disable cuda graph when padding is needed.", {}),
    ("enable-profile-cuda-graph", "bool", False, "Profile cuda graph capture.", {}),
    ("enable-nccl-nvls", "bool", False, "Enable NCCL NVLS for prefill heavy requests.", {}),
    ("enable-symm-mem", "bool", False, "Enable NCCL symmetric memory for fast collectives.", {}),
    ("enable-tokenizer-batch-encode", "bool", False, "Batch tokenization of multiple text inputs.", {}),
    ("disable-outlines-disk-cache", "bool", False, "Disable disk cache of outlines.", {}),
    ("disable-custom-all-reduce", "bool", False, "Disable the custom all-reduce kernel; fall back to NCCL.", {}),
    ("enable-mscclpp", "bool", False, "Use mscclpp for small all-reduce messages.", {}),
    ("disable-overlap-schedule", "bool", False, "Disable the overlap scheduler.", {}),
    ("enable-mixed-chunk", "bool", False, "Mix prefill and decode in a batch with chunked prefill.", {}),
    ("enable-dp-attention", "bool", False, "Data parallelism for attention, tensor parallelism for FFN.", {}),
    ("enable-dp-lm-head", "bool", False, "Vocabulary parallel across the attention TP group.", {}),
    ("enable-two-batch-overlap", "bool", False, "Overlap two micro batches.", {}),
    ("enable-torch-compile", "bool", False, "Optimize the model with torch.compile.", {}),
    ("disable-piecewise-cuda-graph", "bool", False, "Disable piecewise cuda graph for extend/prefill.", {}),
    ("torch-compile-max-bs", "int", 32, "Maximum batch size when using torch compile.", {}),
    ("torchao-config", "str", "", "Optimize the model with torchao.", {}),
    ("enable-nan-detection", "bool", False, "NaN detection for debugging.", {}),
    ("enable-p2p-check", "bool", False, "P2P check for GPU access.", {}),
    ("triton-attention-reduce-in-fp32", "bool", False, "Cast intermediate triton attention results to fp32.", {}),
    ("triton-attention-num-kv-splits", "int", 8, "KV splits in the flash decoding Triton kernel.", {}),
    ("num-continuous-decode-steps", "int", 1, "Continuous decoding steps per scheduling step.", {}),
    ("delete-ckpt-after-loading", "bool", False, "Delete the model checkpoint after loading.", {}),
    ("enable-memory-saver", "bool", False, "Allow release/resume of memory occupation.", {}),
    ("allow-auto-truncate", "bool", False, "Truncate over-long requests instead of failing them.", {}),
    ("enable-custom-logit-processor", "bool", False, "Allow custom logit processors.", {}),
    ("disable-shared-experts-fusion", "bool", False, "Disable shared experts fusion for deepseek v3/r1.", {}),
    ("disable-chunked-prefix-cache", "bool", False, "Disable chunked prefix cache for deepseek.", {}),
    ("disable-fast-image-processor", "bool", False, "Use the base image processor.", {}),
    ("enable-return-hidden-states", "bool", False, "Enable returning hidden states with responses.", {}),
    ("scheduler-recv-interval", "int", 1, "The interval to poll requests in the scheduler.", {}),
    ("numa-node", "list", None, "NUMA node per subprocess.", {"item": "int"}),
    ("enable-deterministic-inference", "bool", False, "Deterministic inference with batch invariant ops.", {}),
    ("enable-dynamic-batch-tokenizer", "bool", False, "Async dynamic batch tokenizer.", {}),
    # PD disaggregation
    ("disaggregation-mode", "choice", "null", "PD disaggregation role.", {"choices": ("null", "prefill", "decode")}),
    ("disaggregation-transfer-backend", "choice", "mooncake", "Backend for disaggregation transfer.",
     {"choices": ("mooncake", "nixl", "ascend", "fake", "mori")}),
    ("disaggregation-bootstrap-port", "int", 8998, "Bootstrap server port on the prefill server.", {}),
    ("disaggregation-ib-device", "str", None, "InfiniBand devices for disaggregation transfer.", {}),
    ("disaggregation-decode-enable-offload-kvcache", "bool", False, "Async KV cache offloading on the decode server.", {}),
    ("num-reserved-decode-tokens", "int", 512, "Decode tokens reserved per new request.", {}),
    # Weight loading
    ("weight-loader-disable-mmap", "bool", False, "Disable mmap while loading safetensors weights.", {}),
    ("enable-weights-cpu-backup", "bool", False, "Save model weights to CPU memory on release.", {}),
]

SPECS: dict[str, FlagSpec] = {}
for _name, _kind, _default, _help, _extra in _TABLE:
    SPECS[_name] = FlagSpec(
        name=_name,
        kind=_kind,
        default=_default,
        help=_help,
        aliases=tuple(_extra.get("aliases", ())),
        dest=_extra.get("dest", _name.replace("-", "_")),
        choices=tuple(_extra.get("choices", ())),
        item=_extra.get("item", "int" if _kind == "int" else "float" if _kind == "float" else "str"),
        secret=bool(_extra.get("secret", False)),
    )
del _name, _kind, _default, _help, _extra

# Fields of the fleet entry, not flags: given as flags they would be rendered twice (and the
# port is what gpugate uses to find and health-check the server). `config` would hide the real
# flags from gpugate in a file it does not read.
SEPARATE_FIELDS: dict[str, str] = {
    "model-path": "set the model as sglang.model_path, not as a flag",
    "model": "set the model as sglang.model_path, not as a flag",
    "port": "set the port as sglang.port, not as a flag",
    "host": "set the host as sglang.host, not as a flag",
    "config": "gpugate must see every flag to compare it with the running server; "
              "write the flags themselves instead of --config",
}

# Alias -> canonical. Aliases starting with "_" are gpugate spellings that SGLang accepts only
# through argparse's prefix abbreviation (`--tp 8` abbreviates `--tp-size`): they are accepted
# everywhere here but not declared as option strings in build_parser().
_ALIASES: dict[str, str] = {}
for _spec in SPECS.values():
    _ALIASES[_spec.name] = _spec.name
    for _alias in _spec.aliases:
        _ALIASES[_alias.lstrip("_")] = _spec.name
del _spec, _alias


def _strip_name(name: str) -> str:
    bare = name.strip()
    if bare.startswith("--"):
        bare = bare[2:]
    elif bare.startswith("-"):
        bare = bare[1:]
    return bare.replace("_", "-")


def canonical_name(name: str) -> str:
    """The canonical flag name for ``name`` (with or without dashes, snake or kebab case, alias).

    Raises FlagError for an unknown flag, suggesting the closest known names.

    Example::

        >>> canonical_name("--tp"), canonical_name("tp_size"), canonical_name("tensor-parallel-size")
        ('tp-size', 'tp-size', 'tp-size')
        >>> canonical_name("kv-cache-dtyp")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        FlagError: --kv-cache-dtyp: unknown SGLang flag; did you mean --kv-cache-dtype?
    """
    if not isinstance(name, str):
        raise FlagError(str(name), f"flag names are strings, got {type(name).__name__}")
    bare = _strip_name(name)
    if bare in _ALIASES:
        return _ALIASES[bare]
    if bare in SEPARATE_FIELDS:
        return bare
    close = difflib.get_close_matches(bare, list(_ALIASES), n=3, cutoff=0.6)
    hint = ""
    if close:
        hint = "; did you mean " + " or ".join(f"--{_ALIASES[c]}" for c in dict.fromkeys(close)) + "?"
    raise FlagError(bare or name, f"unknown SGLang flag{hint}")


# --------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------

def _check_token(flag: str, text: str) -> str:
    """A string must survive the trip into argv unchanged: no NUL, encodable."""
    if "\x00" in text:
        raise FlagError(flag, "a value cannot contain a NUL character (argv items end at NUL)")
    try:
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise FlagError(flag, f"{text!r} cannot be encoded as a command-line argument") from None
    return text


def _type_label(value: object) -> str:
    return type(value).__name__


def _coerce_scalar(flag: str, item: str, value: object) -> Any:
    if item == "int":
        if isinstance(value, bool):
            raise FlagError(flag, f"expects an integer, got {value!r} ({_type_label(value)})")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise FlagError(flag, f"expects an integer, got {value!r} ({_type_label(value)})")
    if item == "float":
        if isinstance(value, bool):
            raise FlagError(flag, f"expects a number, got {value!r} ({_type_label(value)})")
        number: float | None = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                number = None
        if number is None:
            raise FlagError(flag, f"expects a number, got {value!r} ({_type_label(value)})")
        if not math.isfinite(number):
            raise FlagError(flag, f"expects a finite number, got {value!r}")
        return number
    # str
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise FlagError(flag, f"expects a string, got {value!r} ({_type_label(value)})")
    if isinstance(value, float) and not math.isfinite(value):
        raise FlagError(flag, f"expects a string, got {value!r}")
    return _check_token(flag, value if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value))


def _normalise_value(spec: FlagSpec, value: object) -> Any:
    """The typed value of ``spec`` for ``value``; ``None`` means "not set" (dropped)."""
    flag = spec.name
    if spec.kind == "bool":
        if isinstance(value, bool):
            return True if value else None
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return True if value.strip().lower() == "true" else None
        raise FlagError(flag, f"is a switch: write true or false, got {value!r} ({_type_label(value)})")
    if value is None:
        raise FlagError(flag, "has no value; remove the flag to use SGLang's default")
    if spec.kind in ("int", "float", "str"):
        return _coerce_scalar(flag, spec.kind, value)
    if spec.kind == "choice":
        typed = _coerce_scalar(flag, spec.item, value)
        if typed not in spec.choices:
            close = difflib.get_close_matches(str(typed), [str(c) for c in spec.choices], n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise FlagError(
                flag, f"{value!r} is not one of {', '.join(str(c) for c in spec.choices)}{hint}")
        return typed
    if spec.kind == "list":
        items = value if isinstance(value, (list, tuple)) else [value]
        if not items:
            raise FlagError(flag, "needs at least one item; remove the flag to use SGLang's default")
        typed_items = [_coerce_scalar(flag, spec.item, v) for v in items]
        for item in typed_items:
            if spec.item == "str" and item.startswith("-"):
                raise FlagError(flag, f"list item {item!r} starts with '-' and would be read as a flag")
        return typed_items
    if spec.kind == "json":
        if isinstance(value, str):
            try:
                document = json.loads(value)
            except ValueError as error:
                raise FlagError(flag, f"expects JSON text, got {value!r} ({error})") from None
        elif isinstance(value, (dict, list)):
            document = value
        else:
            raise FlagError(flag, f"expects a JSON object (a mapping or JSON text), got {value!r}")
        try:
            text = json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise FlagError(flag, f"cannot be written as JSON: {error}") from None
        return _check_token(flag, text)
    raise AssertionError(f"unknown kind {spec.kind!r}")  # the table is wrong


# --------------------------------------------------------------------------------------
# Known conflicts (from SGLang's ServerArgs._handle_* checks), given normalised flags
# --------------------------------------------------------------------------------------

def _check_conflicts(flags: Mapping[str, Any]) -> None:
    def on(name: str) -> bool:
        return bool(flags.get(name))

    if on("enable-hierarchical-cache") and on("disable-radix-cache"):
        # Same words as SGLang's _handle_cache_compatibility.
        raise FlagError("enable-hierarchical-cache",
                        "enable-hierarchical-cache and disable-radix-cache are mutually exclusive "
                        "and cannot be used at the same time (SGLang refuses to start); use only one")
    if on("enable-tokenizer-batch-encode") and on("enable-dynamic-batch-tokenizer"):
        raise FlagError("enable-tokenizer-batch-encode",
                        "cannot be combined with --enable-dynamic-batch-tokenizer (SGLang refuses to start)")
    if on("disaggregation-decode-enable-offload-kvcache") and flags.get("disaggregation-mode") != "decode":
        raise FlagError("disaggregation-decode-enable-offload-kvcache",
                        "is only supported with --disaggregation-mode decode")
    if flags.get("speculative-algorithm") == "NGRAM" and on("enable-dp-attention"):
        raise FlagError("speculative-algorithm",
                        "NGRAM speculative decoding does not support --enable-dp-attention")
    if flags.get("tokenizer-metrics-custom-labels-header") == "" and flags.get(
            "tokenizer-metrics-allowed-custom-labels"):
        raise FlagError("tokenizer-metrics-allowed-custom-labels",
                        "needs --tokenizer-metrics-custom-labels-header to be set")
    # Sanity bounds that SGLang only discovers after loading for minutes.
    for name in ("tp-size", "dp-size", "pp-size", "ep-size", "nnodes", "page-size", "tokenizer-worker-num"):
        if name in flags and flags[name] < 1:
            raise FlagError(name, f"must be at least 1, got {flags[name]}")
    if "mem-fraction-static" in flags and not 0.0 < flags["mem-fraction-static"] <= 1.0:
        raise FlagError("mem-fraction-static", f"must be in (0, 1], got {flags['mem-fraction-static']}")
    if "node-rank" in flags and not 0 <= flags["node-rank"] < flags.get("nnodes", 1):
        raise FlagError("node-rank", f"must be in [0, nnodes={flags.get('nnodes', 1)}), got {flags['node-rank']}")
    for name in ("hicache-size", "cpu-offload-gb", "base-gpu-id"):
        if name in flags and flags[name] < 0:
            raise FlagError(name, f"must not be negative, got {flags[name]}")


def validate_flags(flags: Mapping[str, object] | None) -> dict[str, Any]:
    """Validate flags as written in fleet.yaml and return them normalised.

    Keys: any spelling ``canonical_name`` accepts. Values: YAML scalars/lists (or strings that
    parse as the declared type). ``True`` sets a switch, ``False`` leaves it out. Raises
    FlagError naming the flag for unknown flags, fields given as flags (model-path, port, host,
    config), wrong types, bad choices, values that cannot be one argv item, the same flag given
    twice under two spellings, and SGLang's known conflicts.

    Example::

        >>> validate_flags({"tp": 8, "mem-fraction-static": 0.88, "disable-cuda-graph": False})
        {'mem-fraction-static': 0.88, 'tp-size': 8}
    """
    if flags is None:
        return {}
    if not isinstance(flags, Mapping):
        raise FlagError("", f"flags must be a mapping of flag name to value, got {_type_label(flags)}")
    normalised: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for raw_name, value in flags.items():
        name = canonical_name(raw_name)
        if name in SEPARATE_FIELDS:
            raise FlagError(name, SEPARATE_FIELDS[name])
        if name in spelled:
            raise FlagError(name, f"given twice (as {spelled[name]!r} and {raw_name!r})")
        spelled[name] = str(raw_name)
        typed = _normalise_value(SPECS[name], value)
        if typed is not None:
            normalised[name] = typed
    _check_conflicts(normalised)
    return dict(sorted(normalised.items()))


# --------------------------------------------------------------------------------------
# argv
# --------------------------------------------------------------------------------------

def _value_text(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _option(flag: str, value: str) -> list[str]:
    # argparse reads a separate token that starts with '-' as another option; `--flag=value`
    # is always read as one value, whatever it holds.
    if value.startswith("-"):
        return [f"--{flag}={value}"]
    return [f"--{flag}", value]


def render_flag_args(flags: Mapping[str, Any]) -> list[str]:
    """argv items for normalised flags, sorted by canonical name (stable, diff-friendly).

    Unknown names (kept by parse_argv) are rendered as given.
    """
    argv: list[str] = []
    for name in sorted(flags):
        value = flags[name]
        if value is True:
            argv.append(f"--{name}")
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv.append(f"--{name}")
            argv.extend(_value_text(v) for v in value)
        else:
            argv.extend(_option(name, _value_text(value)))
    return argv


def render_argv(model_path: str, port: int, flags: Mapping[str, Any], host: str = DEFAULT_HOST) -> list[str]:
    """The arguments after the Python interpreter that start SGLang with these flags.

    ``[python3] + render_argv(...)`` is the full command:
    ``-m sglang.launch_server --model-path P --host H --port N`` then the flags, validated and
    sorted by canonical name. Values are separate argv items (never through a shell), written as
    ``--flag=value`` when they start with '-'.

    Example::

        >>> render_argv("/m", 30000, {"tp": 2, "disable-radix-cache": True})
        ['-m', 'sglang.launch_server', '--model-path', '/m', '--host', '127.0.0.1', '--port', '30000', '--disable-radix-cache', '--tp-size', '2']
    """
    if not isinstance(model_path, str) or not model_path:
        raise FlagError("model-path", f"needs a non-empty path or repo id, got {model_path!r}")
    _check_token("model-path", model_path)
    if not isinstance(host, str) or not host:
        raise FlagError("host", f"needs a host name or address, got {host!r}")
    _check_token("host", host)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise FlagError("port", f"must be an integer in 1..65535, got {port!r}")
    normalised = validate_flags(flags)
    return (["-m", "sglang.launch_server"]
            + _option("model-path", model_path)
            + _option("host", host)
            + ["--port", str(port)]
            + render_flag_args(normalised))


@dataclasses.dataclass
class ParsedCommand:
    """What a running server's command line says.

    ``flags`` is normalised like validate_flags; flags gpugate does not know are kept under
    their name as written (value: a string, a list of strings, or True), so that diffs show
    them. ``problems`` lists values that did not parse (kept raw in ``flags``).
    """

    model_path: str | None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    flags: dict[str, Any] = dataclasses.field(default_factory=dict)
    unknown: list[str] = dataclasses.field(default_factory=list)
    positionals: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)


_ENTRY_TOKENS = ("sglang.launch_server", "-msglang.launch_server")


def _server_args_start(argv: Sequence[str]) -> int:
    """Index of the first server argument in a full cmdline (python -m sglang.launch_server ...,
    sglang serve ..., or bare arguments)."""
    for index, token in enumerate(argv):
        if token.startswith("--"):
            break  # server arguments began: a later "sglang.launch_server" is a flag's value
        if token in _ENTRY_TOKENS or token.endswith("/sglang/launch_server.py"):
            return index + 1
        if token == "serve" and index > 0 and argv[index - 1].rsplit("/", 1)[-1] == "sglang":
            return index + 1
    return 0


def _all_option_names() -> dict[str, str]:
    names = {alias: canonical for alias, canonical in _ALIASES.items()}
    for field in SEPARATE_FIELDS:
        names.setdefault(field, field)
    return names


def _resolve_option(bare: str) -> str | None:
    """argparse's rules: exact match, else a unique prefix of a declared option string."""
    names = _all_option_names()
    if bare in names:
        return names[bare]
    declared = {o[2:]: s.name for s in SPECS.values() for o in s.option_strings}
    declared.update({f: f for f in ("model-path", "model", "port", "host", "config")})
    matches = {canonical for option, canonical in declared.items() if option.startswith(bare)}
    if len(matches) == 1 and bare:
        return matches.pop()
    return None


def _is_option_token(token: str) -> bool:
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)
        return False  # a negative number is a value, as argparse reads it
    except ValueError:
        return True


def parse_argv(argv: Sequence[str]) -> ParsedCommand:
    """Parse a server's command line (e.g. /proc/PID/cmdline split at NUL). Never raises.

    Accepts the full command (``python3 -m sglang.launch_server ...``, ``sglang serve ...``)
    or only the arguments, aliases and argparse abbreviations (``--tp 8``), and ``--flag=value``.

    Example::

        >>> p = parse_argv(["python3", "-m", "sglang.launch_server", "--model-path", "/m",
        ...                 "--port=31000", "--tp", "8", "--disable-radix-cache", "--new-flag", "x"])
        >>> p.model_path, p.port, p.flags
        ('/m', 31000, {'disable-radix-cache': True, 'new-flag': 'x', 'tp-size': 8})
    """
    tokens = list(argv)[_server_args_start(argv):]
    result = ParsedCommand(model_path=None)
    raw: dict[str, Any] = {}
    index = 0
    while index < len(tokens):
        token = tokens[index]
        index += 1
        if token == "--":
            result.positionals.extend(tokens[index:])
            break
        if not _is_option_token(token):
            result.positionals.append(token)
            continue
        bare, has_inline, inline = token.lstrip("-").partition("=")
        name = _resolve_option(bare)
        spec = SPECS.get(name) if name else None
        if name in SEPARATE_FIELDS or spec is not None and spec.kind != "bool" and spec.kind != "list":
            if has_inline:
                value: Any = inline
            elif index < len(tokens):
                value = tokens[index]
                index += 1
            else:
                result.problems.append(f"--{name}: no value at the end of the command line")
                continue
        elif spec is not None and spec.kind == "bool":
            value = True
        else:  # a list flag, or an unknown flag: take every following non-option token
            values = [inline] if has_inline else []
            while index < len(tokens) and not _is_option_token(tokens[index]):
                values.append(tokens[index])
                index += 1
            if spec is None:
                name = bare
                if name not in result.unknown:
                    result.unknown.append(name)
                value = True if not values else values[0] if len(values) == 1 else values
            else:
                value = values
        raw[name or bare] = value  # the last occurrence wins, as with argparse

    for field in ("model-path", "model"):
        if field in raw:
            result.model_path = raw.pop(field)
    if "host" in raw:
        result.host = raw.pop("host")
    if "port" in raw:
        port = raw.pop("port")
        try:
            result.port = int(port)
        except ValueError:
            result.problems.append(f"--port: {port!r} is not an integer")
    flags: dict[str, Any] = {}
    for name, value in raw.items():
        spec = SPECS.get(name)
        if spec is None:
            flags[name] = value
            continue
        try:
            typed = _normalise_value(spec, value)
        except FlagError as error:
            result.problems.append(str(error))
            typed = value
        if typed is not None:
            flags[name] = typed
    result.flags = dict(sorted(flags.items()))
    return result


# --------------------------------------------------------------------------------------
# Diff
# --------------------------------------------------------------------------------------

def _is_secret(name: str) -> bool:
    spec = SPECS.get(name)
    return bool(spec and spec.secret)


def _flag_display(name: str, value: Any, redact: bool) -> str:
    if value is True:
        return f"--{name}"
    if redact and _is_secret(name):
        return f"--{name} {SECRET_MASK}"
    if isinstance(value, (list, tuple)):
        return f"--{name} " + " ".join(shlex.quote(_value_text(v)) for v in value)
    return f"--{name} {shlex.quote(_value_text(value))}"


@dataclasses.dataclass
class FlagDiff:
    """Differences between running and desired flags (both normalised, canonical names).

    ``added``: only desired has them; ``removed``: only running has them; ``changed``:
    ``name -> (running value, desired value)``.
    """

    added: dict[str, Any] = dataclasses.field(default_factory=dict)
    removed: dict[str, Any] = dataclasses.field(default_factory=dict)
    changed: dict[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (self.added or self.removed or self.changed)

    def __bool__(self) -> bool:
        return not self.is_empty

    def lines(self, redact: bool = True) -> list[str]:
        """One line per argv change, sorted by flag name; a change is a '-' then a '+' line.

        Example: ``['- --kv-cache-dtype auto', '+ --kv-cache-dtype fp8_e4m3', '+ --disable-radix-cache']``
        (sorted, so ``--disable-radix-cache`` comes first). Secrets read ``***`` unless redact=False.
        """
        out: list[str] = []
        for name in sorted(set(self.added) | set(self.removed) | set(self.changed)):
            if name in self.changed:
                before, after = self.changed[name]
                out.append("- " + _flag_display(name, before, redact))
                out.append("+ " + _flag_display(name, after, redact))
            elif name in self.removed:
                out.append("- " + _flag_display(name, self.removed[name], redact))
            else:
                out.append("+ " + _flag_display(name, self.added[name], redact))
        return out


def _canonical_keys(flags: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in flags.items():
        try:
            key = canonical_name(name)
        except FlagError:
            key = _strip_name(name)
        if value is False or value is None:
            continue
        spec = SPECS.get(key)
        if spec is not None:
            # Compare typed values (8 == "8", a YAML mapping == its JSON text); a value that
            # does not validate is compared as it is, so it still shows in the diff.
            try:
                value = _normalise_value(spec, value)
            except FlagError:
                pass
            if value is None:
                continue
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


def diff_flags(running: Mapping[str, Any], desired: Mapping[str, Any]) -> FlagDiff:
    """What changes from the running flags to the desired flags.

    Explicit comparison, by decision: a flag written on one side and absent on the other is a
    difference even when the value is SGLang's default (``--kv-cache-dtype auto`` vs nothing),
    because SGLang's defaults change between releases and a table cannot know the installed
    one. Switches set to false and absent switches are the same (identical argv). Numbers
    compare by value (``8`` == ``8.0``).

    Example::

        >>> diff_flags({"kv-cache-dtype": "auto"}, {"kv-cache-dtype": "fp8_e4m3"}).lines()
        ['- --kv-cache-dtype auto', '+ --kv-cache-dtype fp8_e4m3']
    """
    before = _canonical_keys(running)
    after = _canonical_keys(desired)
    diff = FlagDiff()
    for name in sorted(set(before) | set(after)):
        if name not in after:
            diff.removed[name] = before[name]
        elif name not in before:
            diff.added[name] = after[name]
        elif before[name] != after[name]:
            diff.changed[name] = (before[name], after[name])
    return diff


def redact_argv(argv: Sequence[str]) -> list[str]:
    """argv with the values of secret flags replaced by ``***`` (for logs and messages)."""
    out: list[str] = []
    hide_next = False
    for token in argv:
        if hide_next:
            out.append(SECRET_MASK)
            hide_next = False
            continue
        if token.startswith("--"):
            bare, has_inline, _ = token[2:].partition("=")
            name = _resolve_option(bare)
            if name and _is_secret(name):
                if has_inline:
                    out.append(f"--{bare}={SECRET_MASK}")
                else:
                    out.append(token)
                    hide_next = True
                continue
        out.append(token)
    return out


# --------------------------------------------------------------------------------------
# SGLang's own parser (for the lab's stand-in) and /get_server_info
# --------------------------------------------------------------------------------------

_ITEM_TYPES = {"int": int, "float": float, "str": str}


def build_parser(prog: str = "launch_server.py") -> argparse.ArgumentParser:
    """An argparse parser with SGLang's option strings, types, choices and store_true flags.

    ``python -m sglang.launch_server`` runs SGLang's parser with prog ``launch_server.py``, so a
    bad choice exits 2 with the same message, e.g.
    ``launch_server.py: error: argument --kv-cache-dtype: invalid choice: 'fp9' (choose from ...)``.
    Namespace attributes are the ServerArgs field names (``args.tp_size``). Like SGLang's, it
    keeps argparse's prefix abbreviations on, so ``--tp 8`` means ``--tp-size 8``.
    """
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--model-path", "--model", dest="model_path", type=str, required=True,
                        help="The path of the model weights (local folder or Hugging Face repo ID).")
    parser.add_argument("--host", type=str, default=DEFAULT_HOST, help="The host of the HTTP server.")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="The port of the HTTP server.")
    parser.add_argument("--config", type=str, default=None, help="Read CLI options from a YAML config file.")
    for spec in SPECS.values():
        options = spec.option_strings
        if spec.kind == "bool":
            parser.add_argument(*options, dest=spec.dest, action="store_true",
                                default=bool(spec.default), help=spec.help)
        elif spec.kind == "list":
            parser.add_argument(*options, dest=spec.dest, type=_ITEM_TYPES[spec.item], nargs="+",
                                default=spec.default, help=spec.help)
        elif spec.kind == "choice":
            parser.add_argument(*options, dest=spec.dest, type=_ITEM_TYPES[spec.item],
                                choices=list(spec.choices), default=spec.default, help=spec.help)
        else:
            kind = {"int": int, "float": float}.get(spec.kind, str)
            parser.add_argument(*options, dest=spec.dest, type=kind, default=spec.default, help=spec.help)
    return parser


def server_info_view(flags: Mapping[str, Any]) -> dict[str, Any]:
    """The /get_server_info (``/server_info``) keys and values that these flags should produce.

    Example::

        >>> server_info_view({"tp": 8, "kv-cache-dtype": "fp8_e4m3", "disable-radix-cache": True})
        {'disable_radix_cache': True, 'kv_cache_dtype': 'fp8_e4m3', 'tp_size': 8}
    """
    view: dict[str, Any] = {}
    for name, value in _canonical_keys(flags).items():
        spec = SPECS.get(name)
        if spec is None:
            continue
        if spec.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        view[spec.dest] = value
    return dict(sorted(view.items()))


def server_info_mismatches(flags: Mapping[str, Any], server_info: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{canonical name: (desired, reported)}`` for the flags the server reports differently.

    Only keys present in ``server_info`` are compared (SGLang resolves and adds many others);
    secret flags are never compared by value (newer SGLang hides them).
    """
    mismatches: dict[str, tuple[Any, Any]] = {}
    for name, value in _canonical_keys(flags).items():
        spec = SPECS.get(name)
        if spec is None or spec.secret or spec.dest not in server_info:
            continue
        desired = server_info_view({name: value})[spec.dest]
        reported = server_info[spec.dest]
        if isinstance(reported, str) and spec.kind == "json":
            try:
                reported = json.loads(reported)
            except ValueError:
                pass
        if desired != reported and not (isinstance(desired, list) and list(reported or []) == desired):
            mismatches[name] = (desired, reported)
    return mismatches
