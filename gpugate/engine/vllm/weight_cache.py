"""vLLM's weight cache as the container sees it (docs/weight-cache.md, "vLLM"): the daemons'
command (``vllm preload``), how the engine maps them (``--load-format ipc_cache``), the daemon of a
GPU (its socket, and the holder of the socket's lock), its request, and the key gpugate compares
before it lets an engine map them. Stdlib only: bundled into the agent, imported by the controller
for the same key. Read in vLLM 0.33.0 (vllm/entrypoints/cli/preload.py,
vllm/model_executor/model_loader/weight_cache/{daemon,protocol,ipc_loader}.py):

- ``vllm preload --model M <engine args>``: one daemon per local rank (``multiprocessing`` spawn
  children of the launcher), each holding its rank's post-quantized TP/PP shard; it binds its Unix
  socket only once the weights are cached, at ``{tempdir}/vllm_weight_cache_{uid}/
  vllm_weight_cache_{md5(NVML UUID)}.sock`` (tempdir: ``$TMPDIR``, else /tmp), holding an exclusive
  ``flock`` on ``<socket>.lock`` for its life. No ready file: a GPU's daemon serves when its socket
  exists and a live process holds that lock. SIGTERM to the launcher terminates the children.
- vLLM's key (``WeightCacheKey``, compared field by field) holds the checkpoint (its safetensors
  headers), architecture, tp/pp/dp sizes and ranks, dtype, quantization and its config, the RoPE
  parameters, **the KV cache dtype**, revision, vLLM's version, expert parallelism and the kernel
  backends: unlike SGLang, ``--kv-cache-dtype`` is part of the weights' key (fp8 KV scales are
  processed into the attention layers), so an fp8 KV change restarts the daemons.
- The engine (``--load-format ipc_cache``): by default (``fallback: true``) a missing daemon or a
  key mismatch falls back to a disk load *beside* the daemon's copy; gpugate passes
  ``--model-loader-extra-config '{"fallback": false, "mode": "zero_copy"}'``, so a mismatch is the
  engine's hard error (rolled back), never a silent second copy of the weights the gate did not
  budget for. A daemon that exits leaves a zero-copy engine serving (the driver keeps the mapping).

gpugate's key is made of what vLLM's is computed from (gpugate.engine.weightkey): the daemons'
command, ``CUDA_VISIBLE_DEVICES``, the model's config.json and safetensors headers, vLLM's and
torch's versions.

Example::

    >>> is_daemon_argv(["/usr/bin/python3", "-m", "vllm.entrypoints.cli.main", "preload", "--model", "/m"])
    True
    >>> file_paths("GPU-4a00f856", {"TMPDIR": "/run/t"})[0].startswith("/run/t/vllm_weight_cache_")
    True
"""

from __future__ import annotations

import glob
import json
import os
import struct

from gpugate.engine import weightkey
from gpugate.engine.argv import python_module

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Dict, List, Mapping, Sequence

CLI_MODULE = "vllm.entrypoints.cli.main"
PRELOAD = ("-m", CLI_MODULE, "preload")
LOAD_FORMAT = "ipc_cache"
# the engine's loader config: no silent disk fallback beside the daemons' copy (see the docstring)
LOADER_CONFIG = json.dumps({"fallback": False, "mode": "zero_copy"}, sort_keys=True)
# vLLM reads the temp dir through tempfile.gettempdir(): $TMPDIR first
SOCKET_TEMPLATE_ENV = READY_TEMPLATE_ENV = "TMPDIR"
DAEMON_NOT_READY = "its socket is not served yet"
# The engine flags that shape the weights a rank holds (WeightCacheKey's fields, what they are
# computed from, and where each rank sits); the daemons get these and only these, so that a change
# outside them (prefix caching, max-num-seqs, CUDA graphs, the memory share...) keeps the daemons.
WEIGHT_FLAGS = ("tensor-parallel-size", "pipeline-parallel-size", "data-parallel-size", "data-parallel-size-local",
                "data-parallel-start-rank", "data-parallel-address", "nnodes", "node-rank", "master-addr",
                "enable-expert-parallel", "expert-placement-strategy", "dtype", "quantization", "revision",
                "code-revision", "hf-overrides", "hf-config-path", "config-format", "trust-remote-code",
                "kv-cache-dtype", "kv-cache-dtype-skip-layers", "moe-backend", "linear-backend",
                "speculative-config", "load-format", "model-loader-extra-config", "download-dir")
# what the daemons need and the engine gets from gpugate instead (its own load is the map)
DAEMON_ONLY = ("load-format", "model-loader-extra-config")
# what vLLM refuses beside a zero-copy weight cache (ipc_loader.py; docstring of IpcModelLoader)
REFUSED = {"enable-sleep-mode": "sleep mode offloads weights the engine does not own (zero-copy maps the daemons')",
           "enable-eplb": "vLLM's weight cache does not support EPLB"}
FIRST_RELEASE = (0, 33)


def is_daemon_argv(argv: Sequence[str] | None) -> bool:
    """``vllm preload ...`` or ``python -m vllm.entrypoints.cli.main preload ...``.

    >>> is_daemon_argv(["vllm", "preload", "--model", "/m"]), is_daemon_argv(["vllm", "serve", "/m"])
    (True, False)
    """
    argv = list(argv or [])
    if not argv:
        return False
    if os.path.basename(argv[0]) == "vllm":
        return len(argv) > 1 and argv[1] == "preload"
    if python_module(argv) == CLI_MODULE:
        return any(token == "preload" for token in argv[:6])
    return False


def socket_dir(env: Mapping[str, str] | None = None) -> str:
    """vLLM's default socket directory (protocol.py get_socket_dir): ``{tempdir}/vllm_weight_cache_{uid}``."""
    env = env if env is not None else os.environ
    return os.path.join(env.get("TMPDIR") or "/tmp", "vllm_weight_cache_%d" % os.getuid())


def file_paths(uuid: str, env: Mapping[str, str] | None = None) -> tuple:
    """(socket, lock) of the daemon of the GPU with this UUID (NVML's, ``GPU-`` included: vLLM's
    ``get_device_uuid`` is ``nvmlDeviceGetUUID``), the name's hash md5 as vLLM's ``safe_hash``."""
    import hashlib  # imported where used: every observe imports this module, few hash (~2.5 ms an agent command)

    name = "vllm_weight_cache_%s.sock" % hashlib.md5(str(uuid).encode(), usedforsecurity=False).hexdigest()
    path = os.path.join(socket_dir(env), name)
    return path, path + ".lock"


def lock_holder(lock_path: str) -> int | None:
    """The pid holding the exclusive flock on ``lock_path`` (/proc/locks, confirmed by the holder's
    open files), or None."""
    try:
        inode = os.stat(lock_path).st_ino
        with open("/proc/locks") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK" or parts[3] != "WRITE":
            continue  # a waiter, or another kind of lock
        if parts[5].rsplit(":", 1)[-1] != str(inode) or not parts[4].isdigit():
            continue
        pid = int(parts[4])
        try:
            if any(os.readlink("/proc/%d/fd/%s" % (pid, fd)) == lock_path for fd in os.listdir("/proc/%d/fd" % pid)):
                return pid
        except OSError:
            continue
    return None


def read_ready(uuid: str, env: Mapping[str, str] | None = None) -> Dict[str, Any] | None:
    """The daemon of this GPU once it serves (its socket bound, its lock held): ``{"pid", "config"}``."""
    sock, lock = file_paths(uuid, env)
    if not os.path.exists(sock):
        return None
    pid = lock_holder(lock)
    return {"pid": pid, "config": {"role": "target", "socket": os.path.basename(sock)}} if pid else None


def parse_ready(text: str | None) -> Dict[str, Any] | None:
    return None  # vLLM's daemons write no ready file (read_ready)


def config_summary(config: Mapping[str, Any] | None) -> str:
    """A daemon in one short line: ``target, vllm_weight_cache_9f3c.sock``."""
    if not isinstance(config, dict):
        return "?"
    return "%s, %s" % (config.get("role"), config.get("socket"))


def daemon_answers(socket_path: str, timeout: float = 2.0) -> bool:
    """Whether the daemon answers vLLM's ``get_memory`` (protocol.py: an 8-byte length, then a
    pickle) within ``timeout``."""
    return weightkey.daemon_answers(socket_path, {"cmd": "get_memory"}, "!Q", timeout)


def model_config_sha256(model_path: str | None) -> str | None:
    """A fingerprint of the model's files as vLLM keys them: config.json (architecture, quantization,
    RoPE) and every safetensors shard's header (protocol.py hash_checkpoint: names, dtypes, shapes,
    offsets; no weight bytes read). None where nothing can be read (a repo id)."""
    if not model_path or not model_path.startswith("/"):
        return None
    import hashlib  # imported where used: every observe imports this module, few hash (~2.5 ms an agent command)

    digest = hashlib.sha256()
    found = False
    try:
        with open(os.path.join(model_path, "config.json"), "rb") as handle:
            digest.update(handle.read())
            found = True
    except OSError:
        pass
    for path in sorted(glob.glob(os.path.join(model_path, "*.safetensors")), key=os.path.basename):
        try:
            with open(path, "rb") as handle:
                size = handle.read(8)
                length = struct.unpack("<Q", size)[0] if len(size) == 8 else 0
                digest.update(os.path.basename(path).encode() + size + handle.read(min(length, 1 << 28)))
                found = True
        except OSError:
            continue
    return digest.hexdigest() if found else None


def cache_key(daemon_argv: Sequence[str] | None, env: Mapping[str, str] | None, model_sha: str | None,
              vllm_version: str | None, torch_version: str | None) -> Dict[str, Any]:
    """gpugate's key of the cache daemons with this command hold (gpugate.engine.weightkey)."""
    return weightkey.cache_key(daemon_argv, env, model_sha, "vllm_version", vllm_version, torch_version)


def key_changes(have: Mapping[str, Any] | None, want: Mapping[str, Any] | None) -> List[str]:
    """What differs between two keys' inputs, in words.

    >>> have = cache_key(["python3", "-m", CLI_MODULE, "preload", "--model", "/m"], {}, "a", "0.33.0", "2.14")
    >>> want = cache_key(["python3", "-m", CLI_MODULE, "preload", "--model", "/m", "--kv-cache-dtype", "fp8"], {}, "a", "0.33.0", "2.14")
    >>> key_changes(have["inputs"], want["inputs"])
    ['--kv-cache-dtype (not set) -> fp8']
    """
    return weightkey.key_changes(have, want, {"vllm_version": "vLLM"},
                                 "the model's config.json or safetensors headers changed")
