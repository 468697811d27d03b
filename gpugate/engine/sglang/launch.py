"""SGLang's launch rules: from the engine-neutral ServerInputs to the exact command, once.

What is SGLang's here, each with where SGLang makes it so:

- the GPU set: ``tp x pp x dp`` ranks as SGLang assigns them (gpugate/engine/sglang/gpus.py),
  counting what ``extra_args`` say too (``--tp 8`` there is still tp 8 for the gate and the claims);
- the weight cache (``--weight-cache-mode client``, 0.5.23 and later): SGLang shares only
  unquantized or block-wise FP8 weights over CUDA IPC (weight_cache/protocol.py
  IPC_QUANT_ALLOWLIST); the flags that shape the weights must reach the daemons too;
- the gated launch (``--gated-launch-port``, 0.5.23 and later): never where the new engine's own
  ports are the old one's (with DP attention on one node SGLang derives its ZMQ ports from
  ``--port``: server_args.py PortArgs, ``port + 233``; an explicit ``--nccl-port`` is fixed).

Example::

    >>> from gpugate.engine import ServerInputs
    >>> launch = build(ServerInputs(engine="sglang", model_path="/m", port=30000, flags={"tp": 4, "base-gpu-id": 4}))
    >>> launch.argv[:5], launch.gpus
    (('/usr/bin/python3', '-m', 'sglang.launch_server', '--model-path', '/m'), (4, 5, 6, 7))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpugate.engine import FlagError, Launch, ServerInputs
from gpugate.engine.sglang import flags as sglang_flags
from gpugate.engine import gpus as sglang_gpus
from gpugate.engine.sglang import live, weight_cache

# the flags the GPU set is made of (gpu_set)
GPU_SET_FLAGS = ("tp-size", "pp-size", "dp-size", "enable-dp-attention", "nnodes", "base-gpu-id", "gpu-id-step")
SEPARATE_FIELD_TEXT = {"model-path": "set the model as sglang.model_path", "port": "set the port as sglang.port",
                       "host": "set the host as sglang.host"}
# What gpugate sets itself, never the operator (the setting that says it instead): a gated launch's
# port is chosen per start, the weight cache's mode follows weight_cache
GPUGATE_SETS = {"gated-launch-port": "gated_launch: true (or false)", "weight-cache-mode": "weight_cache: true (or false)",
                "lora-paths": "lora_adapters: {name: path}"}
# SGLang's IPC allowlist (weight_cache/protocol.py IPC_QUANT_ALLOWLIST): unquantized, or block-wise
# FP8; any other method is a hard error of the daemon and the engine
WEIGHT_CACHE_QUANTIZATION = (None, "fp8")
ARGS_START = 3  # python, -m, sglang.launch_server


def _int_flag(flags: Mapping[str, Any], name: str, default: int) -> int:
    value = flags.get(name, default)
    if isinstance(value, bool) or value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise FlagError(name, f"must be an integer, got {value!r}") from None


def gpu_set(normal: Mapping[str, Any], env: Mapping[str, Any] | None = None) -> tuple[int, ...]:
    """The GPUs (as the container numbers them) a server with these validated flags and this
    environment uses, as SGLang assigns them: ``tp x pp x dp`` ranks (dp only without
    ``--enable-dp-attention``: with it the DP ranks share the TP GPUs), divided over ``--nnodes``,
    from ``--base-gpu-id`` every ``--gpu-id-step``, then mapped through ``CUDA_VISIBLE_DEVICES``.
    The one rule the agent uses too (processes.server_gpus). Raises GpuSetError when the set
    cannot be told.

    >>> gpu_set({"tp-size": 8})
    (0, 1, 2, 3, 4, 5, 6, 7)
    >>> gpu_set({"tp-size": 2, "dp-size": 2}), gpu_set({"tp-size": 2, "dp-size": 2, "enable-dp-attention": True})
    ((0, 1, 2, 3), (0, 1))
    >>> gpu_set({"tp-size": 2, "gpu-id-step": 2}, {"CUDA_VISIBLE_DEVICES": "3,4,5,6"})
    (3, 5)
    """
    return tuple(sglang_gpus.gpu_set(
        tp=_int_flag(normal, "tp-size", 1), pp=_int_flag(normal, "pp-size", 1),
        dp=_int_flag(normal, "dp-size", 1), dp_attention=bool(normal.get("enable-dp-attention")),
        nnodes=_int_flag(normal, "nnodes", 1), base_gpu_id=_int_flag(normal, "base-gpu-id", 0),
        gpu_id_step=_int_flag(normal, "gpu-id-step", 1), visible=(env or {}).get("CUDA_VISIBLE_DEVICES")))


def _parsed_extras(extras: Sequence[str], table: Any = None) -> sglang_flags.ParsedCommand | None:
    try:
        return sglang_flags.parse_argv(["python3", "-m", "sglang.launch_server", *extras], table) if extras else None
    except ValueError:
        return None


def extra_flags(extras: Sequence[str], parsed: sglang_flags.ParsedCommand | None = None) -> dict[str, Any]:
    """What SGLang would read from extra_args (they are passed verbatim, after the flags: argparse
    takes the last of a flag given twice) that gpugate must know: the fields it owns, and the GPU
    set's flags; {} when it cannot tell.

    >>> extra_flags(["--tp", "8", "--some-new-flag", "1"]), extra_flags(["--port=31000"])
    ({'tp-size': 8}, {'port': True})
    """
    found: dict[str, Any] = {}
    for token in extras:
        name = token[2:].split("=", 1)[0] if token.startswith("--") else ""
        if name in ("model-path", "model", "port", "host"):
            found["model-path" if name == "model" else name] = True
    parsed = parsed if parsed is not None else _parsed_extras(extras)
    if parsed is not None:
        found.update((name, value) for name, value in parsed.flags.items() if name in GPU_SET_FLAGS)
    return found


def _with_weight_cache(normal: dict[str, Any], wanted: bool, parsed_extras: sglang_flags.ParsedCommand | None,
                       table: Any) -> dict[str, Any]:
    """The flags with ``--weight-cache-mode client`` where the weight cache is wanted; FlagError for
    what would make SGLang refuse it, or make the daemons hold other weights than the engine maps."""
    if not wanted:
        return normal
    if normal.get("quantization") not in WEIGHT_CACHE_QUANTIZATION:
        raise FlagError("quantization", f"{normal['quantization']!r} cannot use the weight cache (SGLang shares "
                        f"only unquantized or block-wise fp8 weights over CUDA IPC): set weight_cache: false")
    shaping = sorted(set(parsed_extras.flags) & set(weight_cache.WEIGHT_FLAGS)) if parsed_extras is not None else []
    if shaping:
        raise FlagError(shaping[0], "shapes the weights: with weight_cache: true give it in flags, not "
                        "extra_args (the daemons must get it too)")
    if not sglang_flags.supports("weight-cache-mode", table):
        raise FlagError("weight-cache-mode", "this SGLang has no weight cache (0.5.23 and later): set "
                        "weight_cache: false")
    return {**normal, "weight-cache-mode": "client"}


def _gated_launch(wanted: bool | None, supervisor: str, table: Any, flags: Mapping[str, Any]) -> bool:
    """Whether the engine is started gated (None: where it can be); see the module's docstring."""
    has = sglang_flags.supports("gated-launch-port", table)
    clash = ("--enable-dp-attention" if flags.get("enable-dp-attention") and not flags.get("dist-init-addr")
             else "--nccl-port" if flags.get("nccl-port") else None)
    if wanted is None:
        return has and supervisor != "systemd" and clash is None
    if wanted and clash:
        raise FlagError("", f"gated_launch: not with {clash} (the new engine would need the old one's ports while it "
                        f"drains): set gated_launch: false")
    if wanted and not has:
        raise FlagError("", "gated_launch: this SGLang has no --gated-launch-port (0.5.23 and later): set "
                        "gated_launch: false")
    if wanted and supervisor == "systemd":
        raise FlagError("", "gated_launch: not with the systemd supervisor (the unit's command is fixed): use "
                        "supervisor: process, or gated_launch: false")
    return bool(wanted)


def _written_off(flags: Any, name: str, table: Any) -> bool:
    """The operator wrote this boolean flag as false (validation drops a false switch: it is no argv)."""
    for written, value in (flags or {}).items():
        try:
            same = sglang_flags.FLAGS.canonical_name(str(written), table) == name
        except FlagError:
            continue
        if same and value in (False, "false", "False", 0):
            return True
    return False


def with_metrics(normal: dict[str, Any], wanted: bool, written_off: bool = False) -> dict[str, Any]:
    """The flags with ``--enable-metrics`` where a canary reads the server's /metrics (off by default
    in SGLang: http_server.py mounts /metrics only with it); FlagError where the operator turned it off.

    >>> with_metrics({"tp-size": 2}, True)
    {'tp-size': 2, 'enable-metrics': True}
    >>> with_metrics({}, True, written_off=True)
    Traceback (most recent call last):
    ...
    gpugate.engine.FlagError: --enable-metrics: a canary judges this server by its /metrics: leave enable-metrics out (gpugate adds it) or turn the canary off (canary: off)
    """
    if not wanted:
        return normal
    if written_off:
        raise FlagError("enable-metrics", "a canary judges this server by its /metrics: leave enable-metrics out "
                                          "(gpugate adds it) or turn the canary off (canary: off)")
    return {**normal, "enable-metrics": True}


def build(inputs: ServerInputs, table: Any = None) -> Launch:
    """The Launch of ``inputs`` against ``table`` (a per-release flag table; None: the built-in
    one): the flags validated ONCE and rendered from the values validated; FlagError naming what
    SGLang (or gpugate for it) refuses."""
    table = sglang_flags.resolve_table(table)
    normal = sglang_flags.FLAGS.validate_flags(inputs.flags or {}, table)
    parsed_extras = _parsed_extras(inputs.extra_args, table)
    for name, setting in GPUGATE_SETS.items():  # in flags or extra_args: the agent's own would clash with it
        if name in normal or (parsed_extras is not None and name in parsed_extras.flags):
            raise FlagError(name, f"gpugate sets it: write {setting} instead")
    normal = _with_weight_cache(normal, inputs.weight_cache, parsed_extras, table)
    normal = live.lora_flags(normal, inputs.lora_adapters, lambda name: sglang_flags.supports(name, table))
    normal = with_metrics(normal, inputs.metrics, _written_off(inputs.flags, "enable-metrics", table))
    for name, value in normal.items():
        # argv carries any byte but NUL; a line break would still end a line of the systemd unit
        for text in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(text, str) and any(c in text for c in "\0\n\r"):
                raise FlagError(name, "value must be one line (no newline, carriage return or NUL)")
    header = sglang_flags.render_argv(inputs.model_path, inputs.port, {}, host=inputs.host)
    # a start (a restart, a crash's) serves the adapters declared: --lora-paths is one of its flags (the
    # diff shows it), never one /server_info is verified on (a live change moves what SGLang serves)
    launched = {**normal, **live.lora_paths_flag(inputs.lora_adapters)}
    argv = (inputs.python, *header, *sglang_flags.render_flag_args(launched, table), *inputs.extra_args)
    warnings: list[str] = []
    if inputs.extra_args:
        warnings.append("extra_args passed verbatim, unchecked: "
                        + " ".join(sglang_flags.redact_argv(list(inputs.extra_args), table)))
    from_extras = extra_flags(inputs.extra_args, parsed_extras)
    hidden = sorted(set(from_extras) & {"model-path", "port", "host"})
    if hidden:
        raise FlagError("", f"extra_args sets --{hidden[0]}: {SEPARATE_FIELD_TEXT[hidden[0]]}")
    gpus: tuple[int, ...] | None
    try:
        gpus = gpu_set({**normal, **{k: v for k, v in from_extras.items() if k in GPU_SET_FLAGS}}, inputs.env)
    except sglang_gpus.GpuSetError as error:
        if not error.uuid:
            raise FlagError("", str(error)) from None
        gpus = None
        warnings.append(f"{error}; the gate waits for every GPU")
    gated = _gated_launch(inputs.gated_launch, inputs.supervisor, table, normal)
    daemon = (tuple(sglang_flags.weight_cache_argv(inputs.python, inputs.model_path, normal, table))
              if inputs.weight_cache else ())
    # secret values are never expected by value (a failed verify's message would show them); a
    # JSON-text flag is expected as the exact text SGLang keeps (server_info_view)
    secret = {name.replace("-", "_") for name, value in normal.items() if sglang_flags.is_secret_value(name, value)}
    expect = {key: value for key, value in sglang_flags.server_info_view(normal, table).items() if key not in secret}
    expect["host"] = inputs.host
    return Launch(flags=dict(launched), argv=argv, args_start=ARGS_START, gpus=gpus,
                  shown_argv=tuple(sglang_flags.redact_argv(list(argv), table)),
                  shown_flags=redact_flags(normal), secret_options=tuple(sglang_flags.secret_flag_options(normal, table)),
                  expect_info=expect, warnings=tuple(warnings), daemon_argv=daemon, gated=gated)


redact_flags = sglang_flags.FLAGS.redact_flags
