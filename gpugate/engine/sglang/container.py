"""SGLang in the container (gpugate/engine/container.py says what a container module is): its
processes, endpoints, /dev/shm segments and adoption (processes.py), the installed release
(installed.py) and the weight cache (weight_cache.py). Stdlib only: the agent loads it by name and
its artifact bundles it.

SGLang's endpoints: ``/health`` (200 once the scheduler answers), ``/health_generate`` (a real
one-token generation), ``/get_server_info`` (the resolved ServerArgs; renamed ``/server_info`` in
newer releases: the first that answers is read).

Example::

    >>> is_main_argv(["python3", "-m", "sglang.launch_server"]), GENERATE_PATH
    (True, '/health_generate')
"""

from __future__ import annotations

from gpugate.engine import installed
from gpugate.engine.installed import torch_version
from gpugate.engine.sglang.processes import (
    CAPACITY_KEYS, DEFAULT_PORT, INFO_KEYS, SHM_PREFIXES, adopted_env, argv_host, argv_model, argv_port, argv_token,
    is_client_argv, is_main_argv, is_scheduler_argv, is_server_part, is_worker_argv, server_gpus)
from gpugate.engine.sglang.live_server import (
    answer_problem, generation_problem, generation_through, live_request, read_live)
from gpugate.engine.sglang.weight_cache import (
    DAEMON_NOT_READY, READY_TEMPLATE_ENV, SOCKET_TEMPLATE_ENV, cache_key, config_summary, daemon_answers, file_paths, gated_argv,
    is_daemon_argv, key_changes, model_config_sha256, parse_ready, read_ready, steady_argv)

def engine_version():
    """The installed SGLang's release, read without importing it."""
    return installed.package_version("sglang")


def flag_table_key():
    """The key of the container's own SGLang flag table (gpugate/engine/sglang/table_builder.py)."""
    return installed.flag_table_key("sglang", "sglang/srt/server_args.py", "/var/lib/gpugate/sglang-flags")


def expected_workers(gpus):
    """One scheduler per rank: one per GPU the server uses (None: the GPUs cannot be told)."""
    return len(gpus) if gpus is not None else None


ENGINE_NAME = "sglang"
LABEL = "SGLang"
MAIN_TEXT = "an SGLang server (python -m sglang.launch_server / sglang serve)"
HEALTH_PATH = "/health"
GENERATE_PATH = "/health_generate"
INFO_PATHS = ("/get_server_info", "/server_info")

__all__ = ["answer_problem", "generation_problem", "generation_through", "live_request", "read_live",
           "CAPACITY_KEYS", "DAEMON_NOT_READY", "DEFAULT_PORT", "ENGINE_NAME", "GENERATE_PATH", "HEALTH_PATH", "INFO_KEYS", "INFO_PATHS",
           "LABEL", "MAIN_TEXT", "READY_TEMPLATE_ENV", "SHM_PREFIXES", "SOCKET_TEMPLATE_ENV", "adopted_env",
           "argv_host", "argv_model", "argv_port", "argv_token", "cache_key", "config_summary", "daemon_answers", "engine_version",
           "file_paths", "flag_table_key", "gated_argv", "is_client_argv", "is_daemon_argv", "is_main_argv",
           "is_scheduler_argv", "is_server_part", "is_worker_argv", "key_changes", "model_config_sha256",
           "parse_ready", "read_ready", "server_gpus", "steady_argv", "torch_version"]
