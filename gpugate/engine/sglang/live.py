"""What SGLang changes while it serves (docs/live-changes.md), the controller's half: the launch
flags LoRA needs, derived from ``lora_adapters`` and checked as SGLang's parser checks them, and
which difference between what serves and what is desired SGLang applies live.

Read from SGLang 0.5.23 (paths under ``sglang/srt/``):

- arg_groups/lora_hook.py ``check_lora_server_args``: ``--lora-paths`` turns ``--enable-lora`` on;
  without initial adapters ``--max-lora-rank`` and ``--lora-target-modules`` are both needed; the
  pool's rank and modules are those flags, else inferred from the initial adapters only (an adapter
  of a higher rank loaded later is refused). So gpugate always writes both (default rank 64, modules
  ``all``): the pool then takes any adapter up to that rank, whichever were loaded at the start.
  ``--max-loaded-loras`` must be at least ``--max-loras-per-batch``; past it the least recently
  used adapter is evicted (and a request naming it loads it again, silently): more declared
  adapters than that is refused here.
- ``POST /load_lora_adapter {lora_name, lora_path}``, ``POST /unload_lora_adapter {lora_name}``
  (managers/tokenizer_control_mixin.py): no model lock, requests keep running.
- ``POST /update_weights_from_disk {model_path}`` (managers/tokenizer_manager.py): the writer lock
  waits for the requests under way, the old weights stay on a failed load. SGLang reads no
  config.json of the new path: weights of other shapes kill the server (the "rollback" reloads from
  the new path), and so does an active weight cache (``_assert_weight_cache_inactive``): both are
  restarts here.

Example::

    >>> lora_flags({"tp-size": 2}, {"a": "/opt/models/lab-lora-a"})
    {'tp-size': 2, 'enable-lora': True, 'max-lora-rank': 64, 'lora-target-modules': ['all'], 'max-loras-per-batch': 8}
    >>> [c.line for c in live_changes(LiveState("/m", {"a": "/a"}), LiveState("/m", {"b": "/b"}))]
    ['live: unload adapter a', 'live: load adapter b']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpugate.engine import Change, FlagError, LiveState, adapter_changes, lora_switch

# the flags gpugate derives from lora_adapters, with the value it writes when the operator gives none
LORA_DEFAULTS = {"enable-lora": True, "max-lora-rank": 64, "lora-target-modules": ["all"], "max-loras-per-batch": 8}
LORA_FLAGS = tuple(LORA_DEFAULTS) + ("max-loaded-loras", "lora-backend", "lora-eviction-policy")
WEIGHTS_ENDPOINT = "update_weights_from_disk"


def lora_flags(normal: Mapping[str, Any], adapters: Mapping[str, str] | None,
               supports: Any = lambda name: True) -> dict[str, Any]:
    """The validated flags with what LoRA needs where ``adapters`` are declared (``{}`` too: LoRA on,
    none loaded); FlagError for what SGLang's parser refuses or what would evict a declared adapter.
    ``supports(name)``: the release has the flag.

    >>> lora_flags({"max-loaded-loras": 1, "max-loras-per-batch": 1}, {"a": "/a", "b": "/b"})
    Traceback (most recent call last):
    ...
    gpugate.engine.FlagError: --max-loaded-loras: 1 holds fewer than the 2 adapters declared (SGLang would evict one): raise it or drop an adapter
    >>> lora_flags({"max-lora-rank": 8}, None)
    Traceback (most recent call last):
    ...
    gpugate.engine.FlagError: --max-lora-rank: a LoRA flag without lora_adapters: declare lora_adapters ({} for none yet)
    """
    if "lora-paths" in normal:
        raise FlagError("lora-paths", "gpugate sets it: write lora_adapters: {name: path} instead")
    if adapters is None:
        given = sorted(name for name in LORA_FLAGS if name in normal)
        if given:
            raise FlagError(given[0], "a LoRA flag without lora_adapters: declare lora_adapters ({} for none yet)")
        return dict(normal)
    if not supports("enable-lora"):
        raise FlagError("enable-lora", "this SGLang has no LoRA: remove lora_adapters")
    flags = {**normal, **{name: value for name, value in LORA_DEFAULTS.items() if name not in normal}}
    if int(flags["max-lora-rank"]) < 1:
        raise FlagError("max-lora-rank", f"must be 1 or more, got {flags['max-lora-rank']}")
    if int(flags["max-loras-per-batch"]) < 1:
        raise FlagError("max-loras-per-batch", f"must be 1 or more, got {flags['max-loras-per-batch']}")
    loaded = flags.get("max-loaded-loras")
    if loaded is not None:
        if int(loaded) < int(flags["max-loras-per-batch"]):
            raise FlagError("max-loaded-loras", f"{loaded} is less than --max-loras-per-batch "
                            f"{flags['max-loras-per-batch']} (SGLang refuses it)")
        if int(loaded) < len(adapters):
            raise FlagError("max-loaded-loras", f"{loaded} holds fewer than the {len(adapters)} adapters declared "
                            f"(SGLang would evict one): raise it or drop an adapter")
    return flags


def lora_paths_flag(adapters: Mapping[str, str] | None) -> dict[str, list[str]]:
    """``--lora-paths NAME=PATH ...`` (sorted by name) as a flag: a start carries the adapters it serves.

    >>> lora_paths_flag({"b": "/b", "a": "/a"}), lora_paths_flag({})
    ({'lora-paths': ['a=/a', 'b=/b']}, {})
    """
    if not adapters:
        return {}
    return {"lora-paths": [f"{name}={path}" for name, path in sorted(adapters.items())]}


def parse_lora_paths(values: Sequence[str] | str | None) -> dict[str, str]:
    """``--lora-paths`` items as SGLang's LoRAPathAction reads them: ``NAME=PATH``, or ``PATH`` (its
    own name); JSON items by their ``lora_name``.

    >>> parse_lora_paths(["a=/m/a", "/m/b", '{"lora_name": "c", "lora_path": "/m/c"}'])
    {'a': '/m/a', '/m/b': '/m/b', 'c': '/m/c'}
    """
    import json  # noqa: PLC0415 -- only for a JSON item

    out: dict[str, str] = {}
    for item in [values] if isinstance(values, str) else values or []:
        text = str(item).strip()
        if text.startswith("{") and text.endswith("}"):
            try:
                doc = json.loads(text)
                out[str(doc["lora_name"])] = str(doc["lora_path"])
            except (ValueError, KeyError, TypeError):
                continue
        elif "=" in text:
            name, path = text.split("=", 1)
            out[name] = path
        elif text:
            out[text] = text
    return out


def live_changes(have: LiveState, want: LiveState, *, same_shape: bool | None = None,
                 weight_cache: bool = False) -> list[Change]:
    """Every difference from what serves to what is desired, each live or restart: adapters unloaded
    (first: a slot freed before a load), then loaded, a changed path as both; the weights live only
    when both config.json describe the same architecture and shapes and no weight cache is active.

    >>> [c.line for c in live_changes(LiveState("/m", {}), LiveState("/m2", {}), same_shape=True)]
    ['live: weights /m -> /m2 (update_weights_from_disk)']
    >>> [c.line for c in live_changes(LiveState("/m", {}), LiveState("/q", {}), same_shape=False)]
    ['restart: weights /m -> /q (another architecture or other shapes: SGLang would die loading them live)']
    >>> [c.line for c in live_changes(LiveState("/m", None), LiveState("/m", {"a": "/a"}))]
    ['restart: LoRA on (--enable-lora is a launch flag)']
    """
    changes: list[Change] = []
    if have.model_path != want.model_path:
        text = f"weights {have.model_path} -> {want.model_path}"
        why = ("the weight cache is active: SGLang refuses a live load then, and dies" if weight_cache else
               "another architecture or other shapes: SGLang would die loading them live" if same_shape is False else
               "the config.json of either model could not be read in the container" if same_shape is None else None)
        if why:
            changes.append(Change("restart", f"{text} ({why})"))
        else:
            changes.append(Change("live", f"{text} ({WEIGHTS_ENDPOINT})",
                                  {"op": "update_weights", "model_path": want.model_path,
                                   "previous": have.model_path}))
    switch = lora_switch(have, want)
    if switch is not None:
        return changes + [Change(switch.path, switch.text.replace("(a launch flag)", "(--enable-lora is a launch flag)"))]
    return changes + adapter_changes(have.lora_adapters or {}, want.lora_adapters or {})
