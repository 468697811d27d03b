"""The stand-in on real hardware: TP workers that hold real memory and run a real model (torch).

A lab started with ``gpugate lab up --gpus real`` writes ``/run/gpugate-lab/gpu.json`` =
``{"mode": "real", "device": "cuda"}`` in each container (``$SGLANG_STANDIN_GPU=real|cpu|sim`` overrides
it). Then, per TP rank, ``sglang::scheduler_TP<i>``:

1. creates its CUDA context on GPU ``base_gpu_id + rank * gpu_id_step`` (SGLang's numbering, through
   ``CUDA_VISIBLE_DEVICES``) and reads the free memory before loading (``pre_model_load_memory``);
   Then the distributed init's time (``$SGLANG_STANDIN_DIST_INIT_S``) and, with ``--gated-launch-port``,
   the gate (srt/distributed/gated_launch.py; the baseline is read again once it opens, as SGLang
   measures ``pre_model_load_memory`` after it);
2. its weight set (sglang/_weights.py): the bytes of ``$SGLANG_STANDIN_WEIGHTS_FILE`` (this rank's TP
   slice) read in chunks into its own CUDA memory, or, with ``--weight-cache-mode client|daemon``, the
   weight-cache daemon's tensor rebuilt from its CUDA IPC handle (``torch.multiprocessing``'s
   ``rebuild_cuda_tensor``: zero copy, no memory of its own; the baseline then counts the daemon's
   bytes back, ``account_preloaded_weights``); the figures (bytes, read or map seconds, a checksum of the
   bytes, the data pointer, free memory) in the log line "Weight set: {...}" and the READY report;
   then builds a small randomly initialised transformer (transformers' ``LlamaForCausalLM`` from a config
   made in code, no weights downloaded; a few ``torch.nn`` layers when transformers is missing);
3. sizes its KV pool as SGLang does (``model_runner_kv_cache_mixin.profile_max_num_token``):
   ``rest = free after loading - pre_model_load_memory * (1 - mem_fraction_static)``; ``rest <= 0``
   fails with SGLang's "Not enough memory. Please try to increase --mem-fraction-static.";
   else holds ``rest`` bytes with ``torch.empty`` (real device memory, as the pool is), then
   ``$SGLANG_STANDIN_KV_ALLOC_S`` more;
4. warms up with a forward pass, spends ``$SGLANG_STANDIN_GRAPH_CAPTURE_S`` (SGLang's CUDA graph
   capture: sglang/_timing.py, as the simulated scheduler does), reports READY, then serves generation requests from the main process
   (one JSON line each way on its stdin/stdout): greedy decoding with the model, on its device.

On a machine without a GPU the same code runs with ``device: cpu`` (tests): the "device" is this
machine's memory, its size ``$SGLANG_STANDIN_CPU_TOTAL_MIB`` (default 512 MiB).

Example (in the main process)::

    mode = lab_mode()                    # None in a simulated lab
    if mode: job["real"] = real_job(mode, server_args)
"""

import json
import os
import sys
import time

from sglang._sim import real as _shared

MARKER, VOCAB, MAX_CONTEXT, MAX_NEW_TOKENS, MODEL = (_shared.MARKER, _shared.VOCAB, _shared.MAX_CONTEXT,
                                                     _shared.MAX_NEW_TOKENS, _shared.MODEL)
NOT_ENOUGH = "Not enough memory. Please try to increase --mem-fraction-static."
encode, decode, RealWorkers = _shared.encode, _shared.decode, _shared.RealWorkers
_import_torch, build_model, greedy = _shared._import_torch, _shared.build_model, _shared.greedy


# ---------------------------------------------------------------- main process side


def lab_mode(ctl_dir=None):
    """``{"device": "cuda"|"cpu"}`` when the workers run for real, None for the simulation.

    ``$SGLANG_STANDIN_GPU``: ``real`` (cuda), ``cpu``, ``sim``; else the lab's marker file.
    """
    return _shared.lab_mode(os.environ.get("SGLANG_STANDIN_GPU", ""), ctl_dir)


def real_job(mode, server_args):
    """What a scheduler needs to run for real (merged into its job)."""
    return {"device": mode["device"], "mem_fraction_static": float(server_args["mem_fraction_static"]),
            "seed": int(server_args.get("random_seed") or 0) % (1 << 31),
            "dtype": "bfloat16" if mode["device"] == "cuda" else "float32"}


# ---------------------------------------------------------------- scheduler side (imports torch)


def kv_pool_bytes(free_after_load, pre_model_load_memory, mem_fraction_static):
    """SGLang's KV pool budget: what is free after loading, minus the part of the memory free before
    loading that --mem-fraction-static leaves to activations and graphs.

    >>> kv_pool_bytes(120, 140, 0.88)   # GiB in, GiB out
    103.2
    >>> kv_pool_bytes(10, 140, 0.88) <= 0
    True
    """
    return round(free_after_load - pre_model_load_memory * (1 - mem_fraction_static), 6)


def run_scheduler(job, log, say):
    """The scheduler's life in real mode: load, size and hold the pool, warm up, READY, serve.

    ``log(prefix, message)`` writes the server log; ``say(line)`` writes one line to the parent.
    Raises on a failed start (the caller reports ERROR).
    """
    real, gpu, prefix = job["real"], int(job["gpu"]), job["log_prefix"]
    _shared.own_pipe_stdout()  # the pipe to the parent carries only our lines
    torch = _import_torch()
    dtype = getattr(torch, real.get("dtype") or "float32")
    gib = float(1 << 30)
    device, pre_free, total, free_now, held = _shared.open_device(torch, real["device"], gpu,
                                                                  "SGLANG_STANDIN_CPU_TOTAL_MIB")
    from sglang import _timing  # noqa: PLC0415
    from sglang.srt.distributed import gated_launch  # noqa: PLC0415

    def logline(message, bare=False):
        if bare:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
        else:
            log(prefix, message)

    _timing.spend("DIST_INIT")
    gate_s = gated_launch.maybe_wait_for_gated_launch(job.get("gate"), int(job.get("rank") or 0), logline)
    if job.get("gate"):  # SGLang measures pre_model_load_memory after the gate: the old server is gone by now
        pre_free = torch.cuda.mem_get_info(device)[0] if real["device"] == "cuda" else pre_free
    log(prefix, "Load weight begin. avail mem=%.2f GB" % (pre_free / gib))
    began = time.monotonic()
    weight_set, weight_report = load_weight_set(torch, job, device, logline)
    if weight_set is not None and real["device"] != "cuda":
        held.append(weight_set)
    # ModelRunner.account_preloaded_weights: the baseline was taken with the daemon's weights in place
    pre_free += int(weight_report.get("preloaded_weights_bytes") or 0)
    model, logits_of, kind = build_model(torch, device, dtype, int(real.get("seed") or 0))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if weight_set is not None and weight_report.get("weights") == "disk":  # a mapped set is the daemon's
        weights += int(weight_set.numel())
    if real["device"] != "cuda":
        held.extend(model.parameters())
    log(prefix, "Load weight end. type=%s, dtype=%s, avail mem=%.2f GB, mem usage=%.2f GB." % (
        kind, dtype, free_now() / gib, weights / gib))
    rest = kv_pool_bytes(free_now(), pre_free, float(real["mem_fraction_static"]))
    if rest <= 0:
        raise RuntimeError(NOT_ENOUGH)
    pool = torch.empty(int(rest), dtype=torch.uint8, device=device)
    if real["device"] != "cuda":
        held.append(pool)
    cell = MODEL["num_key_value_heads"] * (MODEL["hidden_size"] // MODEL["num_attention_heads"]) \
        * MODEL["num_hidden_layers"] * 2 * pool.element_size() * 2
    _timing.spend("KV_ALLOC")  # the pool itself is real (torch.empty); this adds SGLang's time, if set
    log(prefix, "KV Cache is allocated. #tokens: %d, K size: %.2f GB, V size: %.2f GB" % (
        int(rest) // cell, rest / 2 / gib, rest / 2 / gib))
    warm = greedy(torch, logits_of, encode("The capital city of France is"), 4, device)
    if real["device"] == "cuda":
        torch.cuda.synchronize(device)
    if _timing.phase_s("GRAPH_CAPTURE"):  # as the simulated scheduler: SGLang's capture time, when set
        log(prefix, "Capture decode CUDA graph begin. avail mem=%.2f GB" % (free_now() / gib))
        log(prefix, "Capture decode CUDA graph end. elapsed=%.2f s, mem usage=0.00 GB, avail mem=%.2f GB." % (
            _timing.spend("GRAPH_CAPTURE"), free_now() / gib))
    log(prefix, "Memory pool end. avail mem=%.2f GB (warm-up %d tokens, load %.2f s)" % (
        free_now() / gib, len(warm), time.monotonic() - began))
    weight_report["gate_s"] = round(gate_s, 3)
    say("READY " + json.dumps(weight_report))
    _shared.serve_requests(torch, logits_of, device, say, sys.stdin)
    # stdin closed: the parent is gone. Its death signal decides (orphan-worker keeps the memory).
    return pool, weight_set


def load_weight_set(torch, job, device, log):
    """This rank's weight set (sglang/_weights.py): read from ``$SGLANG_STANDIN_WEIGHTS_FILE`` into its
    own device memory (cold, or a client's fallback), or, with ``--weight-cache-mode client|daemon``,
    the daemon's tensors rebuilt from their CUDA IPC handles (zero copy: no memory of its own). Returns
    (tensor or None, the figures for the READY report and the log)."""
    from sglang import _timing, _weights  # noqa: PLC0415

    tp_rank, tp_size = int(job.get("tp_rank") or 0), int(job.get("tp_size") or 1)
    cache = job.get("weight_cache") or {}

    def disk_load():
        tensor, figures = _weights.load_real(torch, device, tp_rank, tp_size, log)
        _timing.spend("WEIGHT_LOAD")
        return {"via": "disk", "tensor": tensor, "figures": figures}

    if cache.get("mode") in ("client", "daemon"):
        from sglang.srt.weight_cache.ipc_loader import IpcModelLoader  # noqa: PLC0415

        loaded = IpcModelLoader(socket_path=cache.get("socket"), weight_cache_mode=cache["mode"]).load_model(
            job["cache_args"], int(job["gpu"]), tp_rank, int(job.get("pp_rank") or 0), log, disk_load)
    else:
        loaded = disk_load()
    if loaded["via"] == "ipc":
        tensor = next(iter(loaded["tensors"].values()), None)
        report = {"weights": "ipc", "bytes": int(tensor.numel()) if tensor is not None else 0,
                  "map_s": loaded.get("map_s"), "daemon_pid": loaded.get("pid"),
                  "preloaded_weights_bytes": int(loaded.get("preloaded_weights_bytes") or 0)}
    else:
        tensor = loaded["tensor"]
        report = dict(loaded["figures"], weights="disk")
    if tensor is not None:
        report["checksum"] = _weights.checksum(torch, tensor)
        report["data_ptr"] = int(tensor.data_ptr())
    if str(device).startswith("cuda"):
        report["mem_get_info_free"] = int(torch.cuda.mem_get_info(device)[0])
    log("Weight set: %s" % json.dumps(report, sort_keys=True))
    return tensor, report
