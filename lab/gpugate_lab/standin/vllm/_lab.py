"""Where the vLLM stand-in finds the lab's shared parts (the simulated driver, the streamed answers'
writer, what every stand-in shares, real-GPU mode): the stdlib copies installed beside it in a lab
container (gpugate_gpusim, gpugate_sse, gpugate_standin, gpugate_standin_real), else the lab package
(development). And vLLM's log line (vllm/logger.py ``_FORMAT``, ``_DATE_FORMAT``)::

    (APIServer pid=4242) INFO 12-04 19:00:00 [launcher.py:212] Starting vLLM server on http://127.0.0.1:8000
"""

import os
import time
import traceback

try:
    import gpugate_standin as common
except ImportError:
    from gpugate_lab.standin import _common as common  # type: ignore[no-redef]

gpusim, sse, real, metrics = common.gpusim, common.sse, common.real, common.metrics

# vllm/utils/system_utils.py set_process_title: "{VLLM_PROCESS_NAME_PREFIX}::{name}"
TITLE_PREFIX = os.environ.get("VLLM_PROCESS_NAME_PREFIX") or "VLLM"
_process = ["APIServer"]  # decorate_logs(): the name in every log line of this process


def title(name):
    return "%s::%s" % (TITLE_PREFIX, name)


def decorate_logs(name):
    _process[0] = name


def log(level, where, message):
    common.emit("(%s pid=%d) %s %s [%s] %s\n" % (_process[0], os.getpid(), level, time.strftime("%m-%d %H:%M:%S"),
                                                 where, message))


def info(where, message):
    log("INFO", where, message)


def warning(where, message):
    log("WARNING", where, message)


def error(where, message):
    log("ERROR", where, message)


def exception(where, message, exc):
    """``logger.exception``: the message, then the traceback of ``exc``."""
    log("ERROR", where, message)
    common.emit("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def lab_mode():
    """Real GPUs (``{"device": "cuda"|"cpu"}``) or None (the simulated driver): ``$VLLM_STANDIN_GPU``
    (real|cpu|sim), else the lab's marker."""
    return real.lab_mode(os.environ.get("VLLM_STANDIN_GPU", ""))


def seconds(name, default):
    """A stand-in's time from ``$name`` (seconds, never negative)."""
    try:
        return max(0.0, float(os.environ.get(name) or default))
    except ValueError:
        return float(default)


__all__ = ["common", "error", "exception", "gpusim", "info", "log", "real", "sse", "title", "warning"]
