"""The effect of a change, as SGLang reports it: capacity figures from ``/get_server_info``.

SGLang's ``/get_server_info`` (``/server_info`` on newer releases) is ``{**server_args,
**scheduler_info, "internal_states": [scheduler.get_internal_state() per DP rank], "version"}``:

- ``max_total_num_tokens`` (scheduler handshake, ``Scheduler.get_init_info``): the KV cache's size in
  tokens, what ``--kv-cache-dtype fp8_e4m3`` doubles and ``--mem-fraction-static`` grows;
- ``max_req_input_len``: the longest prompt a request may have;
- ``internal_states[0].effective_max_running_requests_per_dp``: the running-request limit the
  scheduler resolved (``--max-running-requests`` only caps it; ``server_args.max_running_requests``
  is None unless set);
- ``internal_states[0].memory_usage``: GB per GPU of ``weight``, ``kvcache``, ``graph`` (CUDA graphs),
  and ``token_capacity``;
- the resolved server args an operator compares beside them: ``context_length``, ``kv_cache_dtype``,
  ``mem_fraction_static``, ``chunked_prefill_size``, ``max_prefill_tokens``, ``page_size``.

Pure functions, no I/O: the controller reads the document before and after a transition and prints
``capacity_line(before, after)`` with the outcome.

Example:
    >>> before = capacity_from_server_info({"max_total_num_tokens": 159744, "kv_cache_dtype": "auto"})
    >>> after = capacity_from_server_info({"max_total_num_tokens": 319488, "kv_cache_dtype": "fp8_e4m3"})
    >>> capacity_line(before, after)
    'KV cache 159,744 -> 319,488 tokens (x2.00)'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# (key in the capacity dict, label, unit) in the order the line prints them; the KV cache first.
FIGURES: tuple[tuple[str, str, str], ...] = (
    ("max_total_num_tokens", "KV cache", "tokens"),
    ("max_running_requests", "max running requests", ""),
    ("max_req_input_len", "max input", "tokens"),
    ("context_length", "context", "tokens"),
    ("kv_cache_gb", "KV cache memory", "GB/GPU"),
    ("weight_gb", "weights", "GB/GPU"),
    ("graph_gb", "CUDA graphs", "GB/GPU"),
    ("chunked_prefill_size", "chunked prefill", "tokens"),
    ("max_prefill_tokens", "max prefill", "tokens"),
)
SERVER_ARGS = ("context_length", "kv_cache_dtype", "mem_fraction_static", "chunked_prefill_size",
               "max_prefill_tokens", "page_size")


def _number(value: Any) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def _internal_state(info: Mapping[str, Any]) -> Mapping[str, Any]:
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], Mapping):
        return states[0]
    if isinstance(states, Mapping):
        return states
    return {}


def capacity_from_server_info(info: Mapping[str, Any] | None) -> dict[str, Any]:
    """The capacity figures of a ``/get_server_info`` document; keys only for what it reports.

    >>> capacity_from_server_info({"max_total_num_tokens": 5338815, "max_req_input_len": 131066,
    ...     "max_running_requests": None, "kv_cache_dtype": "auto", "internal_states": [
    ...     {"effective_max_running_requests_per_dp": 4096, "memory_usage": {"kvcache": 81.46}}]})
    {'max_total_num_tokens': 5338815, 'max_req_input_len': 131066, 'max_running_requests': 4096, 'kv_cache_gb': 81.46, 'kv_cache_dtype': 'auto'}
    """
    if not isinstance(info, Mapping):
        return {}
    internal = _internal_state(info)
    usage = internal.get("memory_usage")
    memory: Mapping[str, Any] = usage if isinstance(usage, Mapping) else {}
    out: dict[str, Any] = {}
    tokens = _number(info.get("max_total_num_tokens"))
    if tokens is None:
        tokens = _number(memory.get("token_capacity"))
    if tokens is not None:
        out["max_total_num_tokens"] = int(tokens)
    if _number(info.get("max_req_input_len")) is not None:
        out["max_req_input_len"] = int(info["max_req_input_len"])
    running = _number(internal.get("effective_max_running_requests_per_dp"))
    if running is None:
        running = _number(info.get("max_running_requests"))
    if running is not None:
        out["max_running_requests"] = int(running)
    for key, name in (("kvcache", "kv_cache_gb"), ("weight", "weight_gb"), ("graph", "graph_gb")):
        if _number(memory.get(key)) is not None:
            out[name] = memory[key]
    for key in SERVER_ARGS:
        if info.get(key) is not None:
            out[key] = info[key]
    return out


def _format(value: Any, unit: str) -> str:
    if isinstance(value, float) and not value.is_integer():
        text = f"{value:,.2f}"
    else:
        text = f"{int(value):,}"
    return f"{text} {unit}".rstrip()


def capacity_line(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> str | None:
    """One line for the outcome: the figures that changed, the KV cache first with its ratio;
    ``None`` when nothing comparable changed. With no ``before`` (a first start), the new figures.

    >>> capacity_line({"max_total_num_tokens": 100, "max_running_requests": 2048},
    ...               {"max_total_num_tokens": 150, "max_running_requests": 4096})
    'KV cache 100 -> 150 tokens (x1.50); max running requests 2,048 -> 4,096'
    >>> capacity_line({"max_total_num_tokens": 100}, {"max_total_num_tokens": 100}) is None
    True
    >>> capacity_line(None, {"max_total_num_tokens": 319488, "max_running_requests": 4096})
    'KV cache 319,488 tokens; max running requests 4,096'
    """
    after = after or {}
    before = before or {}
    parts = []
    for key, label, unit in FIGURES:
        new, old = _number(after.get(key)), _number(before.get(key))
        if new is None:
            continue
        if not before:
            if key in ("max_total_num_tokens", "max_running_requests"):
                parts.append(f"{label} {_format(new, unit)}")
            continue
        if old is None or old == new:
            continue
        ratio = f" (x{new / old:.2f})" if key == "max_total_num_tokens" and old else ""
        parts.append(f"{label} {_format(old, '')} -> {_format(new, unit)}{ratio}")
    return "; ".join(parts) or None
