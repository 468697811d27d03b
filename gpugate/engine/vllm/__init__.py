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

from gpugate.engine import Launch, Running, ServerInputs
from gpugate.engine.argflags import ArgparseEngine
from gpugate.engine.vllm import container as vllm_container
from gpugate.engine.vllm import flags, launch


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
    drain_words = "vLLM's drain (--shutdown-timeout)"
    has_weight_cache = False
    container_module = "gpugate.engine.vllm.container"
    flags = flags.FLAGS

    def launch(self, inputs: ServerInputs, table: Any = None) -> Launch:
        return launch.build(inputs, table)

    def read_running(self, argv: Sequence[str], table: Any = None) -> Running:
        parsed = self.flags.parse_argv(argv, table)
        model = parsed.model_path or (parsed.positionals[0] if parsed.positionals else None)
        return Running(model_path=model, host=parsed.host, port=parsed.port, flags=parsed.flags,
                       unknown=list(parsed.unknown), args_start=self.flags.server_args_start(argv))

    def capacity(self, info: Mapping[str, Any] | None) -> dict[str, Any]:
        return {key: (info or {})[key] for key in vllm_container.CAPACITY_KEYS if key in (info or {})}

    def capacity_line(self, before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> str | None:
        """``KV cache N -> M tokens`` from what vLLM reports (``vllm:cache_config_info``).

        >>> ENGINE.capacity_line({"kv_cache_tokens": 100}, {"kv_cache_tokens": 200})
        'KV cache 100 -> 200 tokens'
        """
        old, new = (before or {}).get("kv_cache_tokens"), (after or {}).get("kv_cache_tokens")
        if old is None and new is None:
            return None
        return f"KV cache {old if old is not None else '?'} -> {new if new is not None else '?'} tokens"


ENGINE = VLLM()
