"""SGLang's weight cache as the container sees it (docs/weight-cache.md): the standalone daemon's
command, its files (a Unix socket and a ``.ready`` file per physical GPU, named by the GPU's UUID),
what a ``.ready`` file says, and the key gpugate compares before it lets an engine map the cache.
Stdlib only: bundled into the agent, and imported by the controller for the same key.

SGLang keys the cache by ``CacheConfig`` (weight_cache/protocol.py), computed inside the daemon and
the engine; a client whose CacheConfig differs is a hard error. gpugate cannot compute CacheConfig
without SGLang, so its key is made of what CacheConfig is made from: the daemon's command (the
engine flags that shape the weights, the interpreter), the GPUs (CUDA_VISIBLE_DEVICES), the model's
config.json (architecture, quantization config) and the installed SGLang and torch. Equal inputs
give equal CacheConfigs; any difference restarts the daemons (at worst once too often, never a
mismatched start).

Example::

    >>> key = cache_key(["/usr/bin/python3", "-m", DAEMON_MODULE, "--model-path", "/m", "--tp-size", "2"],
    ...                 {"CUDA_VISIBLE_DEVICES": "0,1"}, "c0ffee", "0.5.23", "2.9.1")
    >>> key["id"] == cache_key(key["inputs"]["argv"], {"CUDA_VISIBLE_DEVICES": "0,1"}, "c0ffee", "0.5.23", "2.9.1")["id"]
    True
    >>> key_changes(key["inputs"], dict(key["inputs"], sglang_version="0.5.24"))
    ['SGLang 0.5.23 -> 0.5.24']
"""

from __future__ import annotations

import os

from gpugate.engine import weightkey
from gpugate.engine.sglang import processes

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Dict, List, Mapping, Sequence

DAEMON_MODULE = "sglang.srt.weight_cache.daemon"  # processes.is_client_argv names it too
# SGLang's environ.py: the templates and their defaults; {device_uuid} is the physical GPU's UUID
SOCKET_TEMPLATE_ENV = "SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE"
READY_TEMPLATE_ENV = "SGLANG_WEIGHT_CACHE_READY_TEMPLATE"
SOCKET_TEMPLATE = "/tmp/sglang_weight_cache_{device_uuid}.sock"
READY_TEMPLATE = "/tmp/sglang_weight_cache_{device_uuid}.ready"
CLIENT_FLAGS = ("--weight-cache-mode", "client")
DAEMON_NOT_READY = "no .ready yet"
GATED_LAUNCH_OPTION = "--gated-launch-port"
# The engine flags that shape the weights a rank holds (CacheConfig's fields, and what they are
# computed from); the daemon gets these and only these, so that a flag change outside them (KV
# cache dtype, radix cache, CUDA graphs...) keeps the daemon and its key.
WEIGHT_FLAGS = ("tp-size", "pp-size", "dp-size", "ep-size", "moe-dp-size", "enable-dp-attention",
                "enable-dp-lm-head", "attn-cp-size", "moe-dense-tp-size", "moe-a2a-backend", "quantization",
                "dtype", "revision", "load-format", "trust-remote-code", "model-loader-extra-config",
                "base-gpu-id", "gpu-id-step", "nnodes", "node-rank", "dist-init-addr")


def is_daemon_argv(argv):
    """The standalone daemon's launcher (``python -m sglang.srt.weight_cache.daemon ...``).

    >>> is_daemon_argv(["python3", "-m", "sglang.srt.weight_cache.daemon", "--model-path", "/m"])
    True
    """
    return processes.python_module(argv or []) == DAEMON_MODULE


def steady_argv(argv):
    """An engine's argv without what only its launch needed (``--gated-launch-port N``): what runs
    is compared, recorded and restarted without it.

    >>> steady_argv(["python3", "-m", "sglang.launch_server", "--gated-launch-port", "41000", "--tp-size", "2"])
    ['python3', '-m', 'sglang.launch_server', '--tp-size', '2']
    """
    out = []
    skip = False
    for arg in argv or []:
        if skip:
            skip = False
            continue
        if arg == GATED_LAUNCH_OPTION:
            skip = True
            continue
        if arg.startswith(GATED_LAUNCH_OPTION + "="):
            continue
        out.append(arg)
    return out


def gated_argv(argv, gate_port):
    """The engine's argv for a gated launch: its steady argv and ``--gated-launch-port``."""
    return steady_argv(argv) + [GATED_LAUNCH_OPTION, str(int(gate_port))]


def is_client(argv):
    """An engine that maps its weights from the daemons (``--weight-cache-mode client``)."""
    return processes.flag_value(argv or [], "--weight-cache-mode") == "client"


def file_paths(uuid, env=None):
    """(socket, ready) of the daemon of the GPU with this UUID (as NVML names it), by SGLang's
    templates. SGLang names the GPU by torch's UUID (``get_device_properties(i).uuid``), which is
    NVML's without its ``GPU-`` prefix.

    >>> file_paths("GPU-4a00f856-460a")
    ('/tmp/sglang_weight_cache_4a00f856-460a.sock', '/tmp/sglang_weight_cache_4a00f856-460a.ready')
    """
    env = env if env is not None else os.environ
    device_uuid = str(uuid)[4:] if str(uuid).startswith("GPU-") else str(uuid)
    socket_t = env.get(SOCKET_TEMPLATE_ENV) or SOCKET_TEMPLATE
    ready_t = env.get(READY_TEMPLATE_ENV) or READY_TEMPLATE
    return socket_t.replace("{device_uuid}", device_uuid), ready_t.replace("{device_uuid}", device_uuid)


def parse_ready(text):
    """What a ``.ready`` file says: ``{"pid": int, "config": dict}`` (SGLang writes ``pid=N`` and
    ``config=<dict repr>``); None for an unreadable one.

    >>> parse_ready("pid=41\\nconfig={'model_path': '/m', 'tp_size': 2}\\n")
    {'pid': 41, 'config': {'model_path': '/m', 'tp_size': 2}}
    """
    if not text:
        return None
    out = {"pid": None, "config": None}
    for line in text.splitlines():
        if line.startswith("pid="):
            try:
                out["pid"] = int(line[4:].strip())
            except ValueError:
                return None
        elif line.startswith("config="):
            import ast  # imported where used: every observe imports this module (~2 ms an agent command)

            try:
                config = ast.literal_eval(line[7:].strip())
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                config = None
            out["config"] = config if isinstance(config, dict) else None
    return out if out["pid"] else None


def config_summary(config):
    """A .ready config in one short line: ``tp 0/2, fp8, torch.bfloat16, /m``."""
    if not isinstance(config, dict):
        return "?"
    parts = ["tp %s/%s" % (config.get("tp_rank"), config.get("tp_size"))]
    if config.get("quant_method"):
        parts.append(str(config["quant_method"]))
    if config.get("dtype"):
        parts.append(str(config["dtype"]))
    parts.append(str(config.get("model_path")))
    return ", ".join(parts)


def model_config_sha256(model_path):
    """The sha256 of the model's config.json (its architecture and quantization config are part of
    SGLang's CacheConfig), or None where it cannot be read (a repo id: the daemon resolves it)."""
    if not model_path or not model_path.startswith("/"):
        return None
    import hashlib  # imported where used: every observe imports this module, few hash (~2.5 ms an agent command)

    try:
        with open(os.path.join(model_path, "config.json"), "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()
    except OSError:
        return None


def cache_key(daemon_argv, env, model_sha, sglang_version, torch_version):
    """gpugate's key of the cache a daemon with this command holds: ``{"id", "inputs"}`` (the id a
    hash of the inputs; see the module's docstring for why these inputs)."""
    return weightkey.cache_key(daemon_argv, env, model_sha, "sglang_version", sglang_version, torch_version)


def key_changes(have, want):
    """What differs between two keys' inputs, in words: ``['--tp-size 8 -> 4', 'model config.json
    changed']``; [] when they are the same."""
    return weightkey.key_changes(have, want, {"sglang_version": "SGLang"})


def daemon_answers(socket_path, timeout=2.0):
    """Whether the daemon behind this socket answers SGLang's ``ping`` (protocol.py: a 4-byte length,
    then a pickle, ``{"type": "ping"}`` -> ``{"status": "ok"}``) within ``timeout``."""
    return weightkey.daemon_answers(socket_path, {"type": "ping"}, "!I", timeout)


def read_ready(uuid, env=None):
    """What the ``.ready`` file of the GPU with this UUID says (``{"pid", "config"}``), or None."""
    try:
        with open(file_paths(uuid, env)[1]) as handle:
            return parse_ready(handle.read())
    except (OSError, UnicodeDecodeError):
        return None
