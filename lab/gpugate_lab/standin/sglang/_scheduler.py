"""A stand-in worker process: ``sglang::scheduler_TP<i>`` (holds GPU memory) or ``sglang::detokenizer``.

Started by launch_server with argv[0] set to the title, so /proc/PID/cmdline begins with it, and with
its job in $SGLANG_STANDIN_WORKER (JSON). Reports ``READY`` or ``ERROR`` on stdout, then sleeps until
killed. Like SGLang's ``kill_itself_when_parent_died`` it asks for a signal when its parent dies
(PR_SET_PDEATHSIG); unless fault ``orphan-worker`` is set at that moment, it then SIGKILLs itself.
"""

import json
import os
import signal
import sys
import time

from sglang._sim import common, gpusim

CONTEXT_MIB = common.CONTEXT_MIB


def _log(prefix: str, message: str) -> None:
    try:
        sys.stderr.write("[%s %s] %s\n" % (time.strftime("%Y-%m-%d %H:%M:%S"), prefix, message))
        sys.stderr.flush()
    except (OSError, ValueError):
        # the reader of the server's log (the agent's log pump) ends with the main process: an
        # orphaned worker that says so into a pipe nobody reads must not die of EPIPE for it (a worker
        # of a killed parent keeps its memory, as SGLang's do; the fault test saw 7 of 8 survive)
        pass


_say = common.say


def _run_sim_scheduler(job, holdings):
    """A scheduler's start in the simulated lab, in SGLang's order; returns what READY reports.

    CUDA context on its GPU (``CUDA_VISIBLE_DEVICES`` mapped as CUDA maps it) -> distributed init
    (``$SGLANG_STANDIN_DIST_INIT_S``) -> gated launch (``--gated-launch-port``: only the context is
    held while it waits) -> weights: the disk load (its weights held, ``$SGLANG_STANDIN_WEIGHT_LOAD_S``)
    or, with ``--weight-cache-mode client|daemon``, the daemon's mapped (nothing held,
    ``$SGLANG_STANDIN_IPC_MAP_S``) -> the KV pool (``$SGLANG_STANDIN_KV_ALLOC_S``: the static pool
    ``mem_fraction_static`` x total less the weights, all of it required free, as the stand-in always
    sized it; after a map, SGLang's own rule from the free memory, see below) -> CUDA graphs
    (``$SGLANG_STANDIN_GRAPH_CAPTURE_S``)."""
    from sglang import _platform, _timing  # noqa: PLC0415
    from sglang.srt.distributed import gated_launch  # noqa: PLC0415

    gpu, prefix = int(job["gpu"]), job["log_prefix"]
    stuck = common.stuck  # never to a gated engine started before the stop (issue 32 item 14)

    def log(message, bare=False):
        if bare:
            try:
                sys.stderr.write(message + "\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
        else:
            _log(prefix, message)

    config = gpusim.load_config()
    physical = _platform.physical_gpu(gpu, config)
    holdings.append(gpusim.allocate(physical, CONTEXT_MIB, stuck=stuck(), require_free=True))
    _timing.spend("DIST_INIT")
    gate_s = gated_launch.maybe_wait_for_gated_launch(job.get("gate"), int(job.get("rank") or 0), log)

    gib = 1024.0
    before = gpusim.memory_info(physical).free_mib
    log("Load weight begin. avail mem=%.2f GB" % (before / gib))
    tic = time.monotonic()
    weight_mib = min(int(job.get("weight_mib") or 0), int(job["mib"]))
    cache = job.get("weight_cache") or {}

    def disk_load():
        try:
            holdings.append(gpusim.allocate(physical, weight_mib, stuck=stuck(), require_free=True))
        except gpusim.NotEnoughMemory:
            raise RuntimeError("CUDA out of memory. Tried to allocate %.2f GiB." % (weight_mib / gib))
        _timing.spend("WEIGHT_LOAD")
        return {"via": "disk"}

    if cache.get("mode") in ("client", "daemon"):
        from sglang.srt.weight_cache.ipc_loader import IpcModelLoader  # noqa: PLC0415

        loaded = IpcModelLoader(socket_path=cache.get("socket"), weight_cache_mode=cache["mode"]).load_model(
            job["cache_args"], gpu, int(job.get("tp_rank") or 0), int(job.get("pp_rank") or 0), log, disk_load)
        holdings.append(loaded)  # the mapped tensors live as long as the scheduler
    else:
        loaded = disk_load()
    after = gpusim.memory_info(physical).free_mib
    log("Load weight end. elapsed=%.2f s, type=%s, avail mem=%.2f GB, mem usage=%.2f GB." % (
        time.monotonic() - tic, job.get("model_type") or "LlamaForCausalLM", after / gib, (before - after) / gib))
    kv_mib = int(job["mib"]) - weight_mib
    if loaded["via"] == "ipc":
        # SGLang sizes this pool from what is free (profile_max_num_token), its baseline taken with the
        # daemon's weights already on the GPU and given back (ModelRunner.account_preloaded_weights):
        # rest = free after the load - (free before + the daemon's weights) x (1 - mem_fraction_static)
        pre = before + int(loaded.get("preloaded_weights_bytes") or 0) / float(1 << 20)
        kv_mib = int(after - pre * (1 - float(job.get("mem_fraction_static") or 0.88)))
        if kv_mib <= 0:
            raise RuntimeError("Not enough memory. Please try to increase --mem-fraction-static.")
    try:
        holdings.append(gpusim.allocate(physical, kv_mib, stuck=stuck(), require_free=True))
    except gpusim.NotEnoughMemory:
        raise RuntimeError("Not enough memory. Please try to increase --mem-fraction-static.")
    _timing.spend("KV_ALLOC")
    log("KV Cache is allocated. avail mem=%.2f GB" % (gpusim.memory_info(physical).free_mib / gib))
    log("Memory pool end. avail mem=%.2f GB" % (gpusim.memory_info(physical).free_mib / gib))
    if _timing.phase_s("GRAPH_CAPTURE"):
        log("Capture decode CUDA graph begin. avail mem=%.2f GB" % (gpusim.memory_info(physical).free_mib / gib))
        log("Capture decode CUDA graph end. elapsed=%.2f s, mem usage=0.00 GB, avail mem=%.2f GB." % (
            _timing.spend("GRAPH_CAPTURE"), gpusim.memory_info(physical).free_mib / gib))
    return {"gate_s": round(gate_s, 3), "weights": loaded["via"], "gpu": physical}


def main() -> int:
    job = json.loads(os.environ.pop("SGLANG_STANDIN_WORKER"))
    common.set_comm(job["title"])
    common.die_with_parent(int(job["parent_pid"]), job["title"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles ^C and kills the tree
    holdings = []
    if job["kind"] == "scheduler" and job.get("real"):
        # `lab up --gpus real`: real memory and a real model (sglang/_real.py)
        try:
            from sglang._real import run_scheduler

            holdings.append(run_scheduler(job, _log, _say))
        except Exception as exc:
            import traceback  # noqa: PLC0415 -- a failed start only: every scheduler imports this module

            _log(job["log_prefix"], "Scheduler hit an exception: %s" % traceback.format_exc().rstrip())
            _say("ERROR %s: %s" % (type(exc).__name__, exc))
            return 1
        while True:  # it said READY and served until its parent closed the pipe; it holds on to the pool
            signal.pause()
    elif job["kind"] == "scheduler":
        try:
            ready = _run_sim_scheduler(job, holdings)
        except Exception as exc:
            if isinstance(exc, gpusim.NotEnoughMemory):
                exc = RuntimeError("CUDA out of memory.")
            _log(job["log_prefix"], "Scheduler hit an exception: Traceback (most recent call last):\n"
                 '  File "/usr/lib/python3/dist-packages/sglang/srt/managers/scheduler.py", line 2960, '
                 "in run_scheduler_process\n    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, "
                 "moe_ep_rank, pp_rank, dp_rank)\n%s: %s" % (type(exc).__name__, exc))
            sys.stdout.write("ERROR %s\n" % str(exc).replace("\n", " "))
            sys.stdout.flush()
            return 1
        _say("READY " + json.dumps(ready))
        while True:
            signal.pause()
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    while True:
        signal.pause()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(1)
    except Exception:
        import traceback  # noqa: PLC0415

        traceback.print_exc()
        sys.exit(1)
