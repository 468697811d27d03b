"""One rank of the vLLM stand-in on its GPU, in vLLM 0.33.0's order (the process that holds it:
``VLLM::EngineCore`` on one GPU, the uniprocess executor; ``VLLM::Worker_TP<r>`` per GPU otherwise):

1. the CUDA context on device ``rank`` of what ``CUDA_VISIBLE_DEVICES`` shows (518 MiB);
2. the startup check (vllm/v1/worker/utils.py): the free memory must be at least
   ``--gpu-memory-utilization`` x the GPU's total (the budget is per instance and counts everything
   the process holds, its context included), else ``ValueError: Free memory on device cuda:N (F/T GiB)
   on startup is less than desired GPU memory utilization (U, R GiB). ...``;
3. the weights: this rank's share of the parameters config.json counts (x dtype bytes / tp / pp;
   ``$VLLM_STANDIN_WEIGHT_MIB`` overrides), at most half the budget so a lab GPU of any size keeps
   room for a KV cache, read for ``$VLLM_STANDIN_WEIGHT_LOAD_S`` (default 0; a part of the engine's
   ``$VLLM_STANDIN_LOAD_S``, after it); "Model loading took X GiB memory and Y seconds". With
   ``--load-format ipc_cache`` (vllm/_weight_cache.py): the daemon's weights count in the budget and
   are mapped (``$VLLM_STANDIN_IPC_MAP_S``, default 0), this process holds none of them (zero-copy);
   no daemon or another key: the disk load (fallback) or the error;
4. the KV cache: the rest of the budget, "Available KV cache memory: X GiB" (vllm/v1/worker/
   gpu_worker.py); none left: vLLM's "No available memory for the cache blocks. ..."
   (vllm/v1/core/kv_cache_planning.py). Its blocks: ``--block-size`` (16) tokens of
   ``2 x layers/pp x max(1, kv_heads/tp) x head_dim x bytes(--kv-cache-dtype)`` each (``auto``: the
   model's dtype; the fp8 kinds 1 byte), so ``--kv-cache-dtype fp8`` doubles the KV cache.

So a rank holds ``gpu_memory_utilization x total`` in all. ``--kv-cache-dtype`` must be one of vLLM's
(vllm/config/cache.py ``CacheDType``: the parser takes any text, the config refuses it).

Real mode (``gpugate lab up --gpus real``, or ``$VLLM_STANDIN_GPU=real|cpu``): the same order on the
device with torch (the lab's shared real-mode module: a tiny random Llama, greedy decoding), the KV
cache a real ``torch.empty`` of the rest of the budget.

>>> token_bytes({"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}, "auto", 1, 1)
131072
>>> token_bytes({"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}, "fp8", 2, 1)
32768
"""

import os
import time

from vllm import _lab
from vllm._lab import common, real

GIB = float(1 << 30)
MIB = 1 << 20
KV_CACHE_DTYPES = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                   "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
                   "octave_k3v4", "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit", "int4_per_token_head",
                   "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6"]
KV_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "nvfp4": 0.5, "nvfp4_4over6": 0.5, "nvfp4_ds_mla": 0.5,
                  "int4_per_token_head": 0.5, "ultraquant_4bit": 0.5, "turboquant_4bit_nc": 0.5,
                  "turboquant_3bit_nc": 0.5}  # the rest (fp8 kinds, int8, k8v4...) 1 byte


def kv_cache_dtype_error(dtype):
    """vLLM's refusal of a ``--kv-cache-dtype`` it does not know (CacheConfig's validator), or None."""
    if dtype in KV_CACHE_DTYPES:
        return None
    return "Invalid kv_cache_dtype: %r. Valid values are: %s" % (dtype, KV_CACHE_DTYPES)


def token_bytes(shape, kv_cache_dtype, tp, pp):
    """KV bytes of one token on one rank."""
    element = shape["dtype_bytes"] if kv_cache_dtype == "auto" else KV_DTYPE_BYTES.get(kv_cache_dtype, 1)
    layers = max(1, shape["layers"] // max(1, pp))
    return int(2 * layers * max(1, shape["kv_heads"] // max(1, tp)) * shape["head_dim"] * element)


def weight_mib(shape, tp, pp, requested_mib):
    forced = os.environ.get("VLLM_STANDIN_WEIGHT_MIB")
    if forced:
        return max(0, int(float(forced)))
    counted = int(common.parameter_count(shape) * shape["dtype_bytes"] / max(1, tp) / max(1, pp) / MIB)
    return max(0, min(counted, requested_mib // 2))


def startup_error(device, free, total, util, requested):
    return ("Free memory on device cuda:%d (%.2f/%.2f GiB) on startup is less than desired GPU memory "
            "utilization (%s, %.2f GiB). Decrease GPU memory utilization or reduce GPU memory used by other "
            "processes." % (device, free / GIB, total / GIB, util, requested / GIB))


NO_KV_MEMORY = ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, "
                "despite its name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for "
                "more details.")


def load_sim(rank, plan, log):
    """Hold rank ``rank``'s memory in the simulated driver; -> (Memory, report)."""
    config = common.load_gpu_config()
    physical = common.physical_gpu(rank["device"], config)
    memory = common.Memory()
    total_mib = int(config["total_mib"])
    try:
        memory.hold(physical, common.CONTEXT_MIB)
    except common.gpusim.NotEnoughMemory:
        raise RuntimeError("CUDA error: out of memory")
    util = float(plan["gpu_memory_utilization"])
    requested_mib = int(total_mib * util)
    free_mib = memory.free_mib(physical)
    if free_mib < requested_mib and plan.get("load_format") != "ipc_cache":  # checked against the rest below
        raise ValueError(startup_error(rank["device"], free_mib * MIB, total_mib * MIB, util, requested_mib * MIB))
    shape = common.model_shape(common.model_config(plan["model"]))
    tic = time.monotonic()
    weights = None
    if plan.get("load_format") == "ipc_cache":  # the weight cache's daemon of this GPU (vllm/_weight_cache.py)
        from vllm import _weight_cache

        loader = _weight_cache.IpcLoader(plan.get("loader_config"), config["uuids"][physical])
        external = loader.external_weight_bytes() // MIB
        if external:
            requested_mib -= external
            log("Weights are held outside this process: of the %.2f GiB utilization budget, %.2f GiB is externally "
                "held and %.2f GiB remains for the engine's own allocations." % (
                    (requested_mib + external) * MIB / GIB, external * MIB / GIB, requested_mib * MIB / GIB))
        weights = loader.load(_weight_cache.cache_key(plan, rank.get("tp_rank", 0), rank.get("pp_rank", 0)))
        if weights is not None:
            memory.hold(physical, weights)
            time.sleep(_lab.seconds("VLLM_STANDIN_IPC_MAP_S", 0))
            rank["loader"] = loader  # its watch lives as long as the rank
    if weights is None:
        weights = weight_mib(shape, plan["tp"], plan["pp"], int(total_mib * util))
        memory.hold(physical, weights)
        time.sleep(_lab.seconds("VLLM_STANDIN_WEIGHT_LOAD_S", 0))
        log("Model loading took %.4f GiB memory and %.6f seconds" % (weights * MIB / GIB, time.monotonic() - tic))
    if plan.get("load_format") == "ipc_cache" and free_mib < requested_mib:  # request_memory, the daemon's excluded
        raise ValueError(startup_error(rank["device"], free_mib * MIB, total_mib * MIB, util, requested_mib * MIB))
    kv_mib = requested_mib - common.CONTEXT_MIB - weights
    if kv_mib <= 0:
        raise ValueError(NO_KV_MEMORY)
    memory.hold(physical, kv_mib)
    log("Available KV cache memory: %.2f GiB" % (kv_mib * MIB / GIB))
    return memory, {"kv_bytes": kv_mib * MIB, "token_bytes": token_bytes(shape, plan["kv_cache_dtype"], plan["tp"],
                                                                         plan["pp"]), "gpu": physical}


class RealRank:
    """A rank's model on a real device (torch): what it holds, and greedy generation on it."""

    def __init__(self, rank, plan, mode, log):
        torch = real._import_torch()
        self.torch = torch
        dtype = torch.bfloat16 if mode["device"] == "cuda" else torch.float32
        device, free, total, free_now, held = real.open_device(torch, mode["device"], int(rank["device"]),
                                                               "VLLM_STANDIN_CPU_TOTAL_MIB")
        util = float(plan["gpu_memory_utilization"])
        requested = int(total * util)
        if free < requested:
            raise ValueError(startup_error(int(rank["device"]), free, total, util, requested))
        tic = time.monotonic()
        model, self.logits_of, kind = real.build_model(torch, device, dtype, int(plan.get("seed") or 0))
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        if mode["device"] != "cuda":
            held.extend(model.parameters())
        log("Model loading took %.4f GiB memory and %.6f seconds (%s)" % (weights / GIB, time.monotonic() - tic, kind))
        own = common.CONTEXT_MIB * MIB * (mode["device"] == "cuda") + (free - free_now())
        kv = requested - own
        if kv <= 0:
            raise ValueError(NO_KV_MEMORY)
        self.pool = torch.empty(int(kv), dtype=torch.uint8, device=device)
        if mode["device"] != "cuda":
            held.append(self.pool)
        log("Available KV cache memory: %.2f GiB" % (kv / GIB))
        self.device, self.model, self.held = device, model, held
        shape = {"layers": real.MODEL["num_hidden_layers"], "kv_heads": real.MODEL["num_key_value_heads"],
                 "head_dim": real.MODEL["hidden_size"] // real.MODEL["num_attention_heads"],
                 "dtype_bytes": 2 if mode["device"] == "cuda" else 4}
        self.report = {"kv_bytes": int(kv), "token_bytes": token_bytes(shape, plan["kv_cache_dtype"], 1, 1),
                       "gpu": str(device)}
        self.generate(real.encode("The capital city of France is"), 4)  # the warm-up

    def generate(self, ids, max_new_tokens):
        out = real.greedy(self.torch, self.logits_of, ids, max_new_tokens, self.device)
        if str(self.device).startswith("cuda"):
            self.torch.cuda.synchronize(self.device)
        return out
