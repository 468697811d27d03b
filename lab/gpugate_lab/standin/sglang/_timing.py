"""How long the stand-in's start phases take, and how often its loops look: env vars, short by default.

The phases of a start, in SGLang's order, each ``$SGLANG_STANDIN_<PHASE>_S`` seconds (default 0):

============================  =================================================================
``SGLANG_STANDIN_IMPORT_S``   the main process's imports before it parses its flags (SGLang's
                              ``launch_server`` imports ``sglang.srt.server_args`` first). Real:
                              10.4-13.5 s for ``import sglang.srt.server_args`` of 0.5.23 on the
                              H200 machine (docs/results/h200_server_args_import.json), 4.4-5.3 s on
                              the 2-core dev VM with CPU torch (docs/flags.md).
``SGLANG_STANDIN_DIST_INIT_S``  each scheduler from its spawn to the end of the distributed init
                              (imports, CUDA context, NCCL groups), i.e. up to the gated-launch
                              point. Real: ~1.9 s of imports before the first CUDA allocation for
                              the tiny real-mode stand-in on the H200 (this project's measurement);
                              real SGLang adds its own imports and NCCL init on top.
``SGLANG_STANDIN_WEIGHT_LOAD_S``  the disk load of one rank's weights (an engine without the cache,
                              a client that fell back, and every weight-cache daemon child). Real:
                              RFC sgl-project/sglang#27052: reloading Qwen3-235B FP8 ~5 min; restarts
                              of large models 3-6.5 min with weights, NCCL init and CUDA graphs
                              (shared/reference/gateway-and-fast-restart.md).
``SGLANG_STANDIN_IPC_MAP_S``  a client's zero-copy map of the daemon's tensors instead of the disk
                              load (the RFC's target for the whole restart: < 10 s).
``SGLANG_STANDIN_KV_ALLOC_S``  the KV pool's allocation (``init_memory_pool``).
``SGLANG_STANDIN_GRAPH_CAPTURE_S``  CUDA graph capture (part of the RFC's 3-6.5 min).
============================  =================================================================

``SGLANG_STANDIN_LOAD_S`` (default 1.0; 0 in real mode) keeps its meaning from before these phases: the
least time from the main process's start to the HTTP port's bind, not counting a gated launch's wait.
Whatever the phases above leave of it is spent after the schedulers are ready, with all their memory
held (the phases left at 0, it is the whole load, as before; lab fault ``slow-start`` reads it again
while loading). So the phases add up to the load when they are set, and LOAD_S is their total when
they are not.

The loops' intervals, SGLang's value first, then the stand-in's default (short so the suite stays fast):

- ``SGLANG_STANDIN_GATE_POLL_S``: gated launch's poll of the activation flag (``POLL_INTERVAL_SECONDS``
  = 1 s in distributed/gated_launch.py); default 0.05.
- ``SGLANG_STANDIN_GATE_LOG_S``: its "still waiting" line (``LOG_INTERVAL_SECONDS`` = 10 s); default 10.
- ``SGLANG_STANDIN_DAEMON_CHECK_S``: the weight-cache launcher's look for each ``.ready`` file
  (``check_interval = 2`` in weight_cache/daemon.py and entrypoints/engine.py); default 0.05.
- ``SGLANG_STANDIN_DAEMON_MONITOR_S``: the launcher's look at its children once all are ready
  (``time.sleep(1)``); default 0.1.
- ``SGLANG_STANDIN_DAEMON_LIVENESS_S``: a client's look at the daemon's pid
  (``_DAEMON_LIVENESS_POLL_INTERVAL`` = 5 s in weight_cache/ipc_loader.py); default 0.1.
- ``SGLANG_STANDIN_DAEMON_ACCEPT_S``: a daemon child's accept timeout, how soon it sees a SIGTERM
  (``sock.settimeout(1.0)``); default 1.0, as SGLang.

Example: ``SGLANG_STANDIN_WEIGHT_LOAD_S=300 SGLANG_STANDIN_IPC_MAP_S=2`` makes a cold start take five
minutes longer than a start against a weight-cache daemon.
"""

import os
import time

PHASES = ("IMPORT", "DIST_INIT", "WEIGHT_LOAD", "IPC_MAP", "KV_ALLOC", "GRAPH_CAPTURE")
INTERVALS = {  # name: (SGLang's, the stand-in's default)
    "GATE_POLL": (1.0, 0.05), "GATE_LOG": (10.0, 10.0), "DAEMON_CHECK": (2.0, 0.05),
    "DAEMON_MONITOR": (1.0, 0.1), "DAEMON_LIVENESS": (5.0, 0.1), "DAEMON_ACCEPT": (1.0, 1.0),
}


def _number(name, default):
    try:
        return max(0.0, float(os.environ.get(name) or default))
    except ValueError:
        return float(default)


def phase_s(phase):
    """Seconds of one start phase (``$SGLANG_STANDIN_<PHASE>_S``, default 0).

    >>> phase_s("GRAPH_CAPTURE") >= 0
    True
    """
    assert phase in PHASES, phase
    return _number("SGLANG_STANDIN_%s_S" % phase, 0.0)


def interval_s(name):
    """One loop's interval (``$SGLANG_STANDIN_<NAME>_S``, default the stand-in's, at least 1 ms)."""
    return max(0.001, _number("SGLANG_STANDIN_%s_S" % name, INTERVALS[name][1]))


def spend(phase):
    """Sleep for one phase; returns the seconds spent."""
    seconds = phase_s(phase)
    if seconds:
        time.sleep(seconds)
    return seconds
