"""vLLM's launch rules: from the engine-neutral ServerInputs to the exact command, once.

What is vLLM's here, each with where vLLM makes it so:

- the command: ``python -m vllm.entrypoints.cli.main serve --model M --host H --port P`` then the
  flags (what the ``vllm`` console script runs; ``vllm.entrypoints.openai.api_server`` is
  deprecated in 0.33.0);
- ``--shutdown-timeout`` always set, from the drain budget: vLLM's default 0 **aborts** every
  request in flight at SIGTERM (``vllm/engine/arg_utils.py``, ``v1/engine/core.py``); the operator
  sets the budget (``drain_timeout_s``), never the flag;
- the GPU set: ``tensor x pipeline x local data parallel`` ranks from device 0 of what
  ``CUDA_VISIBLE_DEVICES`` shows (vLLM has no base GPU id: a server on GPUs 4-7 sets
  ``CUDA_VISIBLE_DEVICES: "4,5,6,7"``);
- the weight cache (0.33.0 and later; weight_cache.py): the daemons ``vllm preload --model M`` with
  the flags that shape the weights (the operator's ``--load-format`` and
  ``--model-loader-extra-config`` are theirs: the daemon loads from disk), the engine
  ``--load-format ipc_cache`` with gpugate's loader config (no silent disk fallback).

Example::

    >>> from gpugate.engine import ServerInputs
    >>> launch = build(ServerInputs(engine="vllm", model_path="/m", port=8001, flags={"tensor-parallel-size": 2},
    ...                             env={"CUDA_VISIBLE_DEVICES": "4,5"}, drain_timeout_s=30), "0.33.0")
    >>> launch.argv[1:5], launch.argv[-4:], launch.gpus
    (('-m', 'vllm.entrypoints.cli.main', 'serve', '--model'), ('--shutdown-timeout', '30', '--tensor-parallel-size', '2'), (4, 5))
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from gpugate.engine import FlagError, Launch, ServerInputs
from gpugate.engine import gpus as rules_gpus
from gpugate.engine.vllm import flags as vllm_flags
from gpugate.engine.vllm import live, weight_cache

# What gpugate sets itself, never the operator (the setting that says it instead)
GPUGATE_SETS = {"shutdown-timeout": "drain_timeout_s (the stop's drain budget sets it)"}


def _int(flags: Mapping[str, Any], name: str, default: int) -> int:
    value = flags.get(name, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def gpu_set(normal: Mapping[str, Any], env: Mapping[str, Any] | None = None) -> tuple[int, ...]:
    """The GPUs a vLLM server with these validated flags and this environment uses.

    >>> gpu_set({"tensor-parallel-size": 2, "pipeline-parallel-size": 2})
    (0, 1, 2, 3)
    """
    dp = _int(normal, "data-parallel-size-local", 0) or _int(normal, "data-parallel-size", 1)
    return tuple(rules_gpus.gpu_set(tp=_int(normal, "tensor-parallel-size", 1), pp=_int(normal, "pipeline-parallel-size", 1),
                                    dp=dp, visible=(env or {}).get("CUDA_VISIBLE_DEVICES")))


redact_flags = vllm_flags.FLAGS.redact_flags


def _release(table: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in str(getattr(table, "version", "") or "").split(".")[:2])
    except ValueError:
        return None


def with_weight_cache(normal: dict[str, Any], wanted: bool, extras: Any, table: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the engine's flags, the daemons' flags) for ``weight_cache``; FlagError for what vLLM refuses
    with it, or what would make the daemons hold other weights than the engine maps.

    >>> engine, daemons = with_weight_cache({"tensor-parallel-size": 2, "enable-prefix-caching": False,
    ...                                      "load-format": "safetensors"}, True, None, None)
    >>> engine["load-format"], "enable-prefix-caching" in daemons, daemons["load-format"]
    ('ipc_cache', False, 'safetensors')
    """
    if normal.get("load-format") == weight_cache.LOAD_FORMAT:
        raise FlagError("load-format", "gpugate sets it: write weight_cache: true (gpugate runs vllm preload and "
                        "the engine maps its weights)" if not wanted else "the weight cache's daemons load from "
                        "disk (vLLM refuses --load-format ipc_cache for them); gpugate gives the engine ipc_cache")
    if not wanted:
        return normal, {}
    for name, why in weight_cache.REFUSED.items():
        if normal.get(name):
            raise FlagError(name, f"not with weight_cache: true ({why}): set weight_cache: false")
    shaping = sorted(set(extras.flags) & set(weight_cache.WEIGHT_FLAGS)) if extras is not None else []
    if shaping:
        raise FlagError(shaping[0], "shapes the weights: with weight_cache: true give it in flags, not "
                        "extra_args (the daemons must get it too)")
    release = _release(table)
    if release and release < weight_cache.FIRST_RELEASE:
        raise FlagError("load-format", f"vLLM {table.version} has no weight cache (vllm preload: 0.33.0 and "
                        "later): set weight_cache: false")
    daemons = {name: value for name, value in normal.items() if name in weight_cache.WEIGHT_FLAGS}
    engine = {name: value for name, value in normal.items() if name not in weight_cache.DAEMON_ONLY}
    engine.update({"load-format": weight_cache.LOAD_FORMAT, "model-loader-extra-config": weight_cache.LOADER_CONFIG})
    return dict(sorted(engine.items())), daemons


def build(inputs: ServerInputs, table: Any = None) -> Launch:
    """The Launch of ``inputs`` against ``table`` (a per-release flag table; None: the union of the
    snapshots): the flags validated once; FlagError naming what vLLM (or gpugate for it) refuses."""
    table = vllm_flags.resolve_table(table)
    normal = vllm_flags.FLAGS.validate_flags(inputs.flags or {}, table)
    extras = vllm_flags.parse_argv(["vllm", "serve", *inputs.extra_args], table) if inputs.extra_args else None
    for name, setting in GPUGATE_SETS.items():
        if name in normal or (extras is not None and name in extras.flags):
            raise FlagError(name, f"gpugate sets it: write {setting} instead")
    if extras is not None:
        for field in ("model", "port", "host"):
            if any(token == f"--{field}" or token.startswith(f"--{field}=") for token in inputs.extra_args):
                raise FlagError("", f"extra_args sets --{field}: {vllm_flags.SEPARATE_FIELDS[field]}")
    for name, value in normal.items():
        for text in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(text, str) and any(c in text for c in "\0\n\r"):
                raise FlagError(name, "value must be one line (no newline, carriage return or NUL)")
    if inputs.metrics and (normal.get("disable-log-stats") or (extras is not None and extras.flags.get("disable-log-stats"))):
        # vLLM v1 makes its stat loggers, Prometheus' among them, only with log stats on (AsyncLLM:
        # ``if self.log_stats``): its /metrics then has no vllm:* series for a canary to judge by
        raise FlagError("disable-log-stats", "a canary judges this server by its /metrics, which has no vllm:* "
                                             "metrics with it: leave disable-log-stats out or turn the canary off "
                                             "(canary: off)")
    normal = live.lora_flags(normal, inputs.lora_adapters)
    normal, daemon_flags = with_weight_cache(normal, inputs.weight_cache, extras, table)
    # in-flight requests may finish within the drain budget; 0 (vLLM's default) would abort them
    normal = dict(sorted({**normal, "shutdown-timeout": max(1, math.ceil(inputs.drain_timeout_s))}.items()))
    argv = (inputs.python, *vllm_flags.render_argv(inputs.model_path, inputs.port, inputs.host),
            *vllm_flags.render_flag_args(normal, table), *inputs.extra_args)
    warnings: list[str] = []
    if inputs.extra_args:
        warnings.append("extra_args passed verbatim, unchecked: "
                        + " ".join(vllm_flags.redact_argv(list(inputs.extra_args), table)))
    from_extras = {k: v for k, v in (extras.flags if extras is not None else {}).items() if k in vllm_flags.GPU_SET_FLAGS}
    gpus: tuple[int, ...] | None
    try:
        gpus = gpu_set({**normal, **from_extras}, inputs.env)
    except rules_gpus.GpuSetError as error:
        if not error.uuid:
            raise FlagError("", str(error)) from None
        gpus = None
        warnings.append(f"{error}; the gate waits for every GPU")
    expect = {"model_path": inputs.model_path}
    if isinstance(normal.get("max-model-len"), int):
        expect["max_model_len"] = normal["max-model-len"]
    daemon = ((inputs.python, *weight_cache.PRELOAD, *argv[4:6],
               *vllm_flags.render_flag_args(daemon_flags, table)) if inputs.weight_cache else ())
    return Launch(flags=normal, argv=argv, args_start=len(vllm_flags.ENTRY) + 1, gpus=gpus, daemon_argv=daemon,
                  shown_argv=tuple(vllm_flags.redact_argv(list(argv), table)), shown_flags=redact_flags(normal),
                  secret_options=tuple(vllm_flags.secret_flag_options(normal, table)), expect_info=expect,
                  warnings=tuple(warnings), env=live.lora_env(inputs.lora_adapters, inputs.env))
