"""SGLang behind the engine seam (gpugate.engine.Engine): its flags as data per release
(flags.py, with the snapshots of real releases in flagtables/, built in the container by
table_builder.py), its launch rules (launch.py: the GPU set, the weight cache, the gated launch),
its capacity figures (capacity.py), and, bundled into the container's agent, how its processes are
recognised, which endpoints answer for health and verification, and how it drains (container.py).

Example::

    >>> ENGINE.validate_flags({"tp": 8, "disable-radix-cache": True})
    {'disable-radix-cache': True, 'tp-size': 8}
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpugate.engine import Change, Launch, LiveState, Running, ServerInputs
from gpugate.engine.argflags import ArgparseEngine
from gpugate.engine.sglang import capacity, flags, launch, live


class SGLang(ArgparseEngine):
    """The SGLang engine (https://github.com/sgl-project/sglang)."""

    name = "sglang"
    label = "SGLang"
    model_option = "--model-path"
    host_option = "--host"
    info_endpoint = "/get_server_info"
    # /ready (0.5.23: 200 iff not paused and healthy, no generation), else /health_generate (a real
    # one-token generation) on a release without it
    ready_paths = ("/ready", "/health_generate")
    router_runtime = "sglang"
    # with --enable-metrics; per TP/DP rank
    in_flight_gauges = ("sglang:num_running_reqs", "sglang:num_queue_reqs")
    # sglang/srt/metrics/collector.py (TokenizerMetricsCollector, SchedulerMetricsCollector), with
    # --enable-metrics: SGLang counts no error apart from its aborts (a failed request is aborted)
    canary_metrics = {
        "ttft": ("sglang:time_to_first_token_seconds",),
        "itl": ("sglang:inter_token_latency_seconds",),
        "e2e": ("sglang:e2e_request_latency_seconds",),
        # num_requests_total counts the requests that finished, num_aborted_requests_total the others
        "requests": ("sglang:num_requests_total", "sglang:num_aborted_requests_total"),
        "errors": (),
        "aborts": ("sglang:num_aborted_requests_total",),
        "preemptions": ("sglang:num_retracted_requests_total",),
        "tokens": ("sglang:generation_tokens_total",),
        "running": ("sglang:num_running_reqs",),
    }
    metrics_flag = "--enable-metrics"
    drain_words = "SGLang's drain"
    has_weight_cache = True
    gated_option = "--gated-launch-port"
    gate_activate = "POST /gate/activate"
    container_module = "gpugate.engine.sglang.container"
    flags = flags.FLAGS

    def launch(self, inputs: ServerInputs, table: Any = None) -> Launch:
        return launch.build(inputs, table)

    def read_running(self, argv: Sequence[str], table: Any = None) -> Running:
        parsed = self.flags.parse_argv(argv, table)
        return Running(model_path=parsed.model_path, host=parsed.host, port=parsed.port, flags=parsed.flags,
                       unknown=list(parsed.unknown), args_start=self.flags.server_args_start(argv))

    def launched_live(self, running: Running) -> LiveState:
        """The model path and the ``--lora-paths`` a running command was started with (LoRA on: its
        adapters, ``{}`` for none).

        >>> ENGINE.launched_live(ENGINE.read_running(["python3", "-m", "sglang.launch_server", "--model-path", "/m",
        ...     "--enable-lora", "--lora-paths", "a=/a"]))
        LiveState(model_path='/m', lora_adapters={'a': '/a'})
        """
        lora = running.flags.get("enable-lora") or "lora-paths" in running.flags
        return LiveState(running.model_path, live.parse_lora_paths(running.flags.get("lora-paths")) if lora else None)

    def live_changes(self, have: LiveState, want: LiveState, *, same_shape: bool | None = None,
                     weight_cache: bool = False) -> list[Change]:
        return live.live_changes(have, want, same_shape=same_shape, weight_cache=weight_cache)

    def in_flight(self, get: Callable[[str], tuple[int, bytes]]) -> int | None:
        """The gauges on /metrics, else ``/get_load`` (``num_reqs`` + ``num_waiting_reqs`` per DP
        rank), which SGLang serves without ``--enable-metrics``.

        >>> ENGINE.in_flight(lambda path: (404, b"") if path == "/metrics" else (200, b'[{"num_reqs": 2, "num_waiting_reqs": 1}]'))
        3
        """
        count = super().in_flight(get)
        if count is not None:
            return count
        status, body = get("/get_load")
        if status != 200:
            return None
        loads = json.loads(body or b"[]")
        loads = loads if isinstance(loads, list) else [loads]
        return int(sum(int(item.get("num_reqs") or 0) + int(item.get("num_waiting_reqs") or 0)
                       for item in loads if isinstance(item, Mapping)))

    def preflight(self, observation: Mapping[str, Any], planned: Launch) -> list[str]:
        # host memory for the hierarchical cache (--hicache-size is GB per TP rank)
        hicache = planned.flags.get("hicache-size")
        limit = (observation.get("container") or {}).get("memory_limit_bytes")
        ranks = len(planned.gpus) if planned.gpus is not None else 1
        if hicache and limit and float(hicache) * 1e9 * ranks > 0.9 * limit:
            return [f"--hicache-size {hicache} GB x {ranks} ranks = {float(hicache) * ranks:.0f} GB of host memory; "
                    f"the container has {limit / 1e9:.0f} GB (limit at 90%)"]
        return []

    def capacity(self, info: Mapping[str, Any] | None) -> dict[str, Any]:
        return capacity.capacity_from_server_info(info)

    def capacity_line(self, before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> str | None:
        return capacity.capacity_line(before, after)


ENGINE = SGLang()
