"""vLLM's server flags, release by release: its overlay on the engine-neutral machinery
(gpugate/engine/argflags.py) and the functions bound to it. The flag set is vLLM's own, read from
its parser (``make_arg_parser(FlexibleArgumentParser())``: what ``vllm serve`` parses) by
gpugate/engine/vllm/table_builder.py, in the container or from a release's wheel
(``scripts/flags_snapshot.py vllm VERSION`` -> gpugate/engine/vllm/flagtables/).

Example::

    >>> validate_flags({"tensor-parallel-size": 2, "kv-cache-dtype": "fp8"}, "0.33.0")
    {'kv-cache-dtype': 'fp8', 'tensor-parallel-size': 2}
    >>> validate_flags({"kv-cache-dtyp": "fp8"}, "0.33.0")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    FlagError: --kv-cache-dtyp: not a flag of vLLM 0.33.0 (did you mean --kv-cache-dtype?)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpugate.engine import FlagError, argflags
from gpugate.engine.vllm import table_builder

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
SNAPSHOT_DIR = Path(__file__).resolve().parent / "flagtables"
# What gpugate sets itself: the server's place in the fleet, and what would hide flags from it
SEPARATE_FIELDS: dict[str, str] = {
    "model": "set the model as the server's model_path, not as a flag",
    "port": "set the port as the server's port, not as a flag",
    "host": "set the host as the server's host, not as a flag",
    "config": "gpugate must see every flag to compare it with the running server; write the flags "
              "themselves instead of --config",
    "headless": "a headless follower serves no API: gpugate runs API servers",
}
# vLLM's own short options (``-tp``, ``-pp``, ``-dp``: declared by its parser as aliases, accepted
# here by their names without dashes too)
SHORT_NAMES = {"tp": "tensor-parallel-size", "pp": "pipeline-parallel-size", "dp": "data-parallel-size"}
# The flags the GPU set is made of (gpugate.engine.vllm.launch)
# Options vLLM reads as JSON (a document the operator may write as a mapping, and whose keys may
# name a secret): its config options say so in their help ("Should either be a valid JSON string or
# JSON keys passed individually", vllm/engine/arg_utils.py); these take a dict or a str without saying it
JSON_TEXT_FLAGS = frozenset({"model-loader-extra-config", "hf-overrides", "additional-config"})
JSON_TEXT_HELP = "valid JSON string"
GPU_SET_FLAGS = ("tensor-parallel-size", "pipeline-parallel-size", "data-parallel-size",
                 "data-parallel-size-local")
ENTRY = ("-m", "vllm.entrypoints.cli.main", "serve")


def _check_conflicts(flags: Mapping[str, Any]) -> None:
    """Sizes vLLM only finds wrong after its import (tens of seconds), checked before anything stops."""
    for name in (*GPU_SET_FLAGS, "max-num-seqs", "block-size"):
        if isinstance(flags.get(name), int) and flags[name] < 1:
            raise FlagError(name, f"must be at least 1, got {flags[name]}")
    utilization = flags.get("gpu-memory-utilization")
    if isinstance(utilization, float) and not 0.0 < utilization <= 1.0:
        raise FlagError("gpu-memory-utilization", f"must be in (0, 1], got {utilization}")
    if isinstance(flags.get("shutdown-timeout"), int) and flags["shutdown-timeout"] < 0:
        raise FlagError("shutdown-timeout", f"must not be negative, got {flags['shutdown-timeout']}")


def server_args_start(argv: Sequence[str]) -> int:
    """Index of the first server argument of a full command (``vllm serve [MODEL] ...``,
    ``python -m vllm.entrypoints.cli.main serve ...``, the api_server module), or 0.

    >>> server_args_start(["python3", "-m", "vllm.entrypoints.cli.main", "serve", "--model", "/m"])
    4
    """
    for index, token in enumerate(argv):
        if token.startswith("--"):
            break
        if token == "serve" or token in ("vllm.entrypoints.openai.api_server", "-mvllm.entrypoints.openai.api_server"):
            return index + 1
    return 0


FLAGS = argflags.ArgparseFlags(argflags.Overlay(
    package="vllm", label="vLLM", version_key=table_builder.VERSION_KEY, snapshot_dir=SNAPSHOT_DIR,
    separate_fields=SEPARATE_FIELDS, field_dests=("model", "model_tag", "host", "port", "config", "headless"),
    model_options=("model",), short_names=SHORT_NAMES, field_names=frozenset(GPU_SET_FLAGS),
    json_text_flags=JSON_TEXT_FLAGS, json_text_help=JSON_TEXT_HELP,
    check_conflicts=_check_conflicts, args_start=server_args_start, default_host=DEFAULT_HOST,
    default_port=DEFAULT_PORT, builder_file=table_builder.__file__, cache_dir=table_builder.CACHE_DIR))
validate_flags = FLAGS.validate_flags
render_flag_args = FLAGS.render_flag_args
parse_argv = FLAGS.parse_argv
redact_argv = FLAGS.redact_argv
secret_flag_options = FLAGS.secret_flag_options
snapshot_versions = FLAGS.snapshot_versions
load_snapshot = FLAGS.load_snapshot
resolve_table = FLAGS.resolve_table


def render_argv(model_path: str, port: int, host: str = DEFAULT_HOST) -> list[str]:
    """The arguments after the interpreter that start vLLM's API server (the flags follow).

    >>> render_argv("/models/m", 8001)
    ['-m', 'vllm.entrypoints.cli.main', 'serve', '--model', '/models/m', '--host', '127.0.0.1', '--port', '8001']
    """
    if not isinstance(model_path, str) or not model_path:
        raise FlagError("model", f"needs a non-empty path or repo id, got {model_path!r}")
    argflags._check_token("model", model_path)
    argflags._check_token("host", host)
    return [*ENTRY, *argflags._option("model", model_path), *argflags._option("host", host), "--port", str(port)]
