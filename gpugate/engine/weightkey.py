"""gpugate's key of a weight cache, engine-neutral (docs/weight-cache.md): what the daemons an engine
maps its weights from were started with, hashed, and what differs between two such keys in words.
An engine cannot tell its own key without importing itself (SGLang's ``CacheConfig``, vLLM's
``WeightCacheKey``), so gpugate's key is made of what the engine's key is computed from: the
daemons' command (the flags that shape the weights), the GPUs (``CUDA_VISIBLE_DEVICES``), a
fingerprint of the model's files, the engine's and torch's releases. Equal inputs give equal keys;
any difference restarts the daemons (at worst once too often, never a mismatched start). Stdlib
only: the engines' container modules bundle it into the agent.

Example::

    >>> key = cache_key(["python3", "-m", "d", "--tp", "2"], {}, "c0ffee", "engine_version", "1.0", "2.9")
    >>> key_changes(key["inputs"], dict(key["inputs"], engine_version="1.1"), {"engine_version": "E"})
    ['E 1.0 -> 1.1']
"""

from __future__ import annotations

import json

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Dict, List, Mapping, Sequence


def cache_key(daemon_argv: Sequence[str] | None, env: Mapping[str, str] | None, model_sha: str | None,
              version_field: str, version: str | None, torch_version: str | None) -> Dict[str, Any]:
    """``{"id", "inputs"}``: the id a hash of the inputs; ``version_field`` names the engine's release
    among them (``sglang_version``, ``vllm_version``)."""
    inputs = {"argv": list(daemon_argv or []), "cuda_visible_devices": (env or {}).get("CUDA_VISIBLE_DEVICES"),
              "model_config_sha256": model_sha, version_field: version, "torch_version": torch_version}
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    import hashlib  # imported where used: every observe imports this module, few hash (~2.5 ms an agent command)

    return {"id": hashlib.sha256(text.encode("utf-8")).hexdigest()[:16], "inputs": inputs}


def options(argv: Sequence[str] | None) -> Dict[str, Any]:
    """An argv's long options and their values (True for a switch); what precedes the first option
    (the interpreter, ``-m module``, a subcommand) is not an option.

    >>> options(["python3", "-m", "vllm.entrypoints.cli.main", "preload", "--model", "/m", "--trust-remote-code"])
    {'--model': '/m', '--trust-remote-code': True}
    """
    out: Dict[str, Any] = {}
    name = None
    for arg in list(argv or [])[1:]:
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            out[name] = value if value else True
            if value:
                name = None
        elif name is not None:
            out[name] = arg if out[name] is True else "%s %s" % (out[name], arg)
    return out


def key_changes(have: Mapping[str, Any] | None, want: Mapping[str, Any] | None, labels: Mapping[str, str],
                model_words: str = "the model's config.json changed") -> List[str]:
    """What differs between two keys' inputs, in words (``labels``: a release field -> its name);
    [] when they are the same."""
    have, want = have or {}, want or {}
    changes = []
    old_argv, new_argv = list(have.get("argv") or []), list(want.get("argv") or [])
    if old_argv[:1] != new_argv[:1]:
        changes.append("interpreter %s -> %s" % ((old_argv or ["?"])[0], (new_argv or ["?"])[0]))
    old, new = options(old_argv), options(new_argv)
    for name in sorted(set(old) | set(new)):
        if old.get(name) != new.get(name):
            before = "(not set)" if name not in old else ("on" if old[name] is True else old[name])
            after = "(not set)" if name not in new else ("on" if new[name] is True else new[name])
            changes.append("%s %s -> %s" % (name, before, after))
    if have.get("cuda_visible_devices") != want.get("cuda_visible_devices"):
        changes.append("CUDA_VISIBLE_DEVICES %s -> %s" % (have.get("cuda_visible_devices"), want.get("cuda_visible_devices")))
    if have.get("model_config_sha256") != want.get("model_config_sha256"):
        changes.append(model_words)
    for field in list(labels) + ["torch_version"]:
        if have.get(field) != want.get(field):
            changes.append("%s %s -> %s" % (labels.get(field, "torch"), have.get(field), want.get(field)))
    return changes


def daemon_answers(socket_path: str, message: Mapping[str, Any], length_format: str, timeout: float) -> bool:
    """Whether the daemon behind the Unix socket ``socket_path`` answers ``message`` (pickled, after
    its length packed as ``length_format``: the engines' weight-cache protocols differ only there)
    within ``timeout``: a hung daemon is no cache. Only the reply's length is read (nothing is
    unpickled), in full even when it comes in pieces.

    >>> daemon_answers("/nonexistent.sock", {"type": "ping"}, "!I", 0.1)
    False
    """
    import pickle
    import socket
    import struct

    size = struct.calcsize(length_format)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(socket_path)
            data = pickle.dumps(dict(message), protocol=2)
            sock.sendall(struct.pack(length_format, len(data)) + data)
            header = b""
            while len(header) < size:
                chunk = sock.recv(size - len(header))
                if not chunk:
                    return False
                header += chunk
            return bool(struct.unpack(length_format, header)[0] < 1 << 16)
    except (OSError, ValueError):
        return False
