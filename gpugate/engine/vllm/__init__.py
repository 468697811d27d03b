"""vLLM behind the engine seam (gpugate.engine.Engine): its flags as data per release (flags.py, with
snapshots of real releases in flagtables/, built in the container by table_builder.py), its launch
rules (launch.py: ``--shutdown-timeout`` from the drain budget, the GPU set) and, bundled into the
container's agent, how its processes are recognised (titles ``VLLM::EngineCore``,
``VLLM::Worker_TP<r>``), which requests prove health and a generation, its info and KV capacity
(container.py).

Example::

    >>> ENGINE.validate_flags({"tp": 2, "enable-prefix-caching": False}, "0.33.0")
    {'enable-prefix-caching': False, 'tensor-parallel-size': 2}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpugate.engine import Change, Launch, LiveState, Running, ServerInputs
from gpugate.engine.argflags import ArgparseEngine
from gpugate.engine.vllm import container as vllm_container
from gpugate.engine.vllm import flags, launch, live


class VLLM(ArgparseEngine):
    """The vLLM engine (https://github.com/vllm-project/vllm)."""

    name = "vllm"
    label = "vLLM"
    model_option = "--model"
    host_option = "--host"
    info_endpoint = "/v1/models"
    # vLLM has no readiness endpoint on its API server (/ready is the DP supervisor's only): /health
    # is 200 while the engine lives; the rejoin's own verify proves a generation
    ready_paths = ("/health",)
    router_runtime = "vllm"
    # a dead EngineCore ends the API server through its watchdog with exit 0 (vllm/entrypoints/
    # launchers: "engine core exited unexpectedly", then the server's shutdown): on-failure would leave it down
    systemd_restart = ("always", "vLLM's API server exits 0 when its EngineCore dies")
    # vllm/v1/metrics/loggers.py: per engine (label engine="0"...), always on
    in_flight_gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    # vllm/v1/metrics/loggers.py (PrometheusStatLogger), always on: request_success_total counts every
    # finished request by finished_reason (stop, length, abort, error)
    canary_metrics = {
        "ttft": ("vllm:time_to_first_token_seconds",),
        "itl": ("vllm:inter_token_latency_seconds",),
        "e2e": ("vllm:e2e_request_latency_seconds",),
        "requests": ("vllm:request_success_total",),
        "errors": ('vllm:request_success_total{finished_reason="error"}',),
        "aborts": ('vllm:request_success_total{finished_reason="abort"}',),
        "preemptions": ("vllm:num_preemptions_total",),
        "tokens": ("vllm:generation_tokens_total",),
        "running": ("vllm:num_requests_running",),
    }
    drain_words = "vLLM's drain (--shutdown-timeout)"
    has_weight_cache = True
    container_module = "gpugate.engine.vllm.container"
    flags = flags.FLAGS

    def launch(self, inputs: ServerInputs, table: Any = None) -> Launch:
        return launch.build(inputs, table)

    def read_running(self, argv: Sequence[str], table: Any = None) -> Running:
        parsed = self.flags.parse_argv(argv, table)
        model = parsed.model_path or (parsed.positionals[0] if parsed.positionals else None)
        return Running(model_path=model, host=parsed.host, port=parsed.port, flags=parsed.flags,
                       unknown=list(parsed.unknown), args_start=self.flags.server_args_start(argv))

    def launched_live(self, running: Running) -> LiveState:
        lora = bool(running.flags.get("enable-lora")) or "lora-modules" in running.flags
        return LiveState(running.model_path, live.parse_lora_modules(running.flags.get("lora-modules")) if lora else None)

    def live_changes(self, have: LiveState, want: LiveState, *, same_shape: bool | None = None,
                     weight_cache: bool = False) -> list[Change]:
        return live.live_changes(have, want, same_shape=same_shape, weight_cache=weight_cache)

    def capacity(self, info: Mapping[str, Any] | None) -> dict[str, Any]:
        return {key: (info or {})[key] for key in vllm_container.CAPACITY_KEYS if key in (info or {})}

    def capacity_line(self, before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> str | None:
        """The KV capacity vLLM reports (``vllm:cache_config_info``), as SGLang's line says it: the
        new figure on a first start, before and after with the ratio on a change, None when unchanged.

        >>> ENGINE.capacity_line({"kv_cache_tokens": 1297792}, {"kv_cache_tokens": 2595584})
        'KV cache 1,297,792 -> 2,595,584 tokens (x2.00)'
        >>> ENGINE.capacity_line(None, {"kv_cache_tokens": 2595584}), ENGINE.capacity_line({"kv_cache_tokens": 5}, {"kv_cache_tokens": 5})
        ('KV cache 2,595,584 tokens', None)
        """
        old, new = (before or {}).get("kv_cache_tokens"), (after or {}).get("kv_cache_tokens")
        if not isinstance(new, int):
            return None
        if not isinstance(old, int) or not old:
            return f"KV cache {new:,} tokens"
        return None if old == new else f"KV cache {old:,} -> {new:,} tokens (x{new / old:.2f})"


ENGINE = VLLM()
