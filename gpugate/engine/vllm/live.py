"""What vLLM changes while it serves (docs/live-changes.md), the controller's half: LoRA adapters,
with the launch flags and the environment they need; the weights only by a restart.

Read from vLLM 0.33.0:

- ``POST /v1/load_lora_adapter {lora_name, lora_path}`` and ``/v1/unload_lora_adapter {lora_name}``
  (vllm/entrypoints/serve/lora/): mounted only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` true
  (vllm/envs.py: "1" or "true", any case), which gpugate sets in the server's environment when adapters
  are declared; refused with ``--api-server-count`` above 1 (vllm/entrypoints/cli/serve.py);
- ``--enable-lora``, ``--max-lora-rank`` (default 16: an adapter of a higher rank is refused at its
  load, so gpugate writes 64 unless the operator gives one), ``--lora-modules NAME=PATH ...`` (the
  adapters a start serves);
- new weights in place (``/collective_rpc reload_weights``) are mounted only with
  ``VLLM_SERVER_DEV_MODE`` and restore nothing when they fail: a model change is a restart.

Example::

    >>> lora_flags({"tensor-parallel-size": 2}, {"a": "/a"})
    {'tensor-parallel-size': 2, 'enable-lora': True, 'max-lora-rank': 64, 'lora-modules': ['a=/a']}
    >>> [c.line for c in live_changes(LiveState("/m", {"a": "/a"}), LiveState("/m2", {}))]  # doctest: +NORMALIZE_WHITESPACE
    ['restart: weights /m -> /m2 (vLLM loads other weights in place only in its dev mode, with no undo)',
     'live: unload adapter a']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpugate.engine import Change, FlagError, LiveState, adapter_changes, lora_switch

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LORA_DEFAULTS = {"enable-lora": True, "max-lora-rank": 64}
LORA_FLAGS = ("enable-lora", "max-lora-rank", "max-loras", "max-cpu-loras", "lora-dtype", "lora-target-modules",
              "fully-sharded-loras")


def lora_flags(normal: Mapping[str, Any], adapters: Mapping[str, str] | None) -> dict[str, Any]:
    """The validated flags with what LoRA needs where ``adapters`` are declared; FlagError for what
    gpugate sets itself or a LoRA flag without adapters.

    >>> lora_flags({"api-server-count": 2}, {})
    Traceback (most recent call last):
    ...
    gpugate.engine.FlagError: --api-server-count: vLLM refuses runtime LoRA updates with more than one API server: set it to 1 or remove lora_adapters
    """
    if "lora-modules" in normal:
        raise FlagError("lora-modules", "gpugate sets it: write lora_adapters: {name: path} instead")
    if adapters is None:
        given = sorted(name for name in LORA_FLAGS if name in normal and normal[name] not in (None, False))
        if given:
            raise FlagError(given[0], "a LoRA flag without lora_adapters: declare lora_adapters ({} for none yet)")
        return dict(normal)
    if int(normal.get("api-server-count") or 1) > 1:
        raise FlagError("api-server-count", "vLLM refuses runtime LoRA updates with more than one API server: set "
                        "it to 1 or remove lora_adapters")
    flags = {**normal, **{name: value for name, value in LORA_DEFAULTS.items() if name not in normal}}
    if adapters:
        flags["lora-modules"] = [f"{name}={path}" for name, path in sorted(adapters.items())]
    return flags


def lora_env(adapters: Mapping[str, str] | None, env: Mapping[str, str]) -> dict[str, str]:
    """The server's environment gpugate adds: the runtime LoRA switch where adapters are declared.

    >>> lora_env({}, {}), lora_env(None, {})
    ({'VLLM_ALLOW_RUNTIME_LORA_UPDATING': 'True'}, {})
    """
    if adapters is None:
        return {}
    if env.get(RUNTIME_LORA_ENV, "True").strip().lower() not in ("1", "true"):
        raise FlagError("", f"env {RUNTIME_LORA_ENV}={env[RUNTIME_LORA_ENV]}: gpugate sets it with lora_adapters "
                        "(vLLM loads adapters live only with it): remove it from env")
    return {RUNTIME_LORA_ENV: "True"}


def parse_lora_modules(values: Any) -> dict[str, str]:
    """``--lora-modules`` items (``NAME=PATH`` or JSON ``{"name", "path"}``) -> {name: path}.

    >>> parse_lora_modules(["a=/a", '{"name": "b", "path": "/b"}'])
    {'a': '/a', 'b': '/b'}
    """
    import json  # noqa: PLC0415 -- only for a JSON item

    out: dict[str, str] = {}
    for item in [values] if isinstance(values, str) else values or []:
        text = str(item).strip()
        if text.startswith("{"):
            try:
                doc = json.loads(text)
                out[str(doc["name"])] = str(doc["path"])
            except (ValueError, KeyError, TypeError):
                continue
        elif "=" in text:
            name, path = text.split("=", 1)
            out[name] = path
    return out


def live_changes(have: LiveState, want: LiveState, *, same_shape: bool | None = None,
                 weight_cache: bool = False) -> list[Change]:
    """Adapters live; the model only by a restart (``same_shape`` does not matter: see the module)."""
    changes: list[Change] = []
    if have.model_path != want.model_path:
        changes.append(Change("restart", f"weights {have.model_path} -> {want.model_path} (vLLM loads other weights "
                                         "in place only in its dev mode, with no undo)"))
    switch = lora_switch(have, want)
    if switch is not None:
        return changes + [Change(switch.path, switch.text.replace("(a launch flag)", "(--enable-lora is a launch flag)"))]
    return changes + adapter_changes(have.lora_adapters or {}, want.lora_adapters or {})
