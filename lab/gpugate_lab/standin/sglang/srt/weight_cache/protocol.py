"""The stand-in's ``sglang.srt.weight_cache.protocol``: SGLang 0.5.23's weight_cache/protocol.py.

What it copies (stdlib only):

- ``CacheConfig``: the key a daemon and an engine rank compare for equality, its 22 fields in SGLang's
  order (``to_dict`` is what the ``.ready`` file's ``config=`` line holds, as a Python dict repr);
  ``build_cache_config`` fills it as the daemon (``WeightCacheDaemon.load``) and the client
  (``IpcModelLoader._fetch_from_cache``) do, from the resolved server args, the model's config.json
  (the stand-in's ``ModelConfig``: ``model_config``) and ``compute_env_stamp``;
- ``hash_quant_config``, ``get_quant_method_name``, the IPC quantization allowlist
  (``check_ipc_quant_support``: unquantized, or FP8 with ``weight_block_size``; anything else raises
  ``UnsupportedQuantForIPCError`` with SGLang's words);
- the wire: one message = 4-byte big-endian length + pickle (``send_msg``/``recv_msg``, 256 MiB cap);
- the paths: ``$SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE`` (default ``/tmp/sglang_weight_cache_{device_uuid}.sock``)
  and ``$SGLANG_WEIGHT_CACHE_READY_TEMPLATE`` (``....ready``); a template without ``{device_uuid}`` raises
  SGLang's ValueError. ``device_uuid`` is torch's form of the GPU's UUID (no ``GPU-``: sglang/_platform.py);
- ``cleanup_stale_daemon_files``: a ``.ready`` naming a live pid refuses (RuntimeError) unless ``force``,
  which SIGKILLs that pid; the files of a dead daemon are removed.

Simplified: ``model_config`` reads config.json only (an HF id without a local dir gives an empty
architecture and no quantization config); the CLI's ``--quantization`` wins over the checkpoint's
``quant_method`` without SGLang's compatibility table.
"""

import hashlib
import json
import logging
import os
import pickle
import signal
import struct

logger = logging.getLogger(__name__)

SOCKET_TEMPLATE_ENV = "SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE"
READY_TEMPLATE_ENV = "SGLANG_WEIGHT_CACHE_READY_TEMPLATE"
DEFAULT_SOCKET_TEMPLATE = "/tmp/sglang_weight_cache_{device_uuid}.sock"
DEFAULT_READY_TEMPLATE = "/tmp/sglang_weight_cache_{device_uuid}.ready"
MAX_MSG_SIZE = 256 * 1024 * 1024  # 256 MiB


class CacheConfig:
    """Fingerprint of the cached weights (SGLang: a msgspec Struct, compared with ``==``)."""

    FIELDS = ("model_path", "model_arch", "tp_size", "tp_rank", "pp_size", "pp_rank", "dp_size", "ep_size",
              "moe_dp_size", "moe_dp_rank", "moe_ep_rank", "attn_dp_size", "enable_dp_lm_head", "attn_cp_size",
              "moe_dense_tp_size", "moe_a2a_backend", "quant_method", "quant_config_hash", "dtype", "revision",
              "device_capability", "torch_version")

    def __init__(self, **values):
        for name in values:
            if name not in self.FIELDS:
                raise TypeError("Unexpected keyword argument '%s'" % name)
        for name in self.FIELDS:
            if name not in values:
                raise TypeError("Missing required argument '%s'" % name)
            setattr(self, name, values[name])

    def matches(self, other):
        return self == other

    def __eq__(self, other):
        return isinstance(other, CacheConfig) and self.to_dict() == other.to_dict()

    def __ne__(self, other):
        return not self == other

    __hash__ = None

    def __repr__(self):
        return "CacheConfig(%s)" % ", ".join("%s=%r" % (f, getattr(self, f)) for f in self.FIELDS)

    def to_dict(self):
        return {f: getattr(self, f) for f in self.FIELDS}

    @classmethod
    def from_dict(cls, d):
        return cls(**d)


def hash_quant_config(quant_config):
    """SHA-256 of the quantization config (a dict: its sorted JSON); "" for none.

    >>> hash_quant_config(None)
    ''
    >>> hash_quant_config({"b": 1, "a": 2}) == hashlib.sha256(b'{"a": 2, "b": 1}').hexdigest()
    True
    """
    if quant_config is None:
        return ""
    try:
        if hasattr(quant_config, "to_dict"):
            config_str = json.dumps(quant_config.to_dict(), sort_keys=True)
        elif isinstance(quant_config, dict):
            config_str = json.dumps(quant_config, sort_keys=True)
        elif hasattr(quant_config, "__dict__"):
            config_str = type(quant_config).__name__ + ":" + json.dumps(
                {k: v for k, v in sorted(quant_config.__dict__.items())
                 if not k.startswith("_") and isinstance(v, (str, int, float, bool, type(None), list, dict))},
                sort_keys=True)
        else:
            config_str = type(quant_config).__name__
        return hashlib.sha256(config_str.encode()).hexdigest()
    except Exception:
        return hashlib.sha256(type(quant_config).__name__.encode()).hexdigest()


def get_quant_method_name(quant_config):
    """The method's name: a str as is; SGLang's fallback for anything else is the type's name (so a
    checkpoint's quantization_config dict without a resolved method is ``"dict"``)."""
    if quant_config is None:
        return ""
    if isinstance(quant_config, str):
        return quant_config
    if hasattr(quant_config, "get_name"):
        return quant_config.get_name()
    if hasattr(quant_config, "name"):
        return quant_config.name
    return type(quant_config).__name__


class UnsupportedQuantForIPCError(RuntimeError):
    """A quantization method not on the verified allowlist for CUDA IPC zero-copy weight sharing."""


def _get_quant_field(quant_config, key):
    if quant_config is None:
        return None
    if isinstance(quant_config, dict):
        return quant_config.get(key)
    return getattr(quant_config, key, None)


def _fp8_round_trips_via_ipc(quant_config):
    return _get_quant_field(quant_config, "weight_block_size") is not None


IPC_QUANT_ALLOWLIST = {
    "": lambda _quant_config: True,  # unquantized
    "fp8": _fp8_round_trips_via_ipc,  # only block-wise FP8 verified
}


def is_ipc_quant_supported(quant_method, quant_config):
    predicate = IPC_QUANT_ALLOWLIST.get(quant_method)
    return bool(predicate(quant_config)) if predicate is not None else False


def check_ipc_quant_support(quant_method, quant_config, where):
    """Raise UnsupportedQuantForIPCError (SGLang's text) unless the method is verified for IPC.

    >>> check_ipc_quant_support("fp8", {"weight_block_size": [128, 128]}, where="daemon")
    >>> [is_ipc_quant_supported(m, c) for m, c in (("", None), ("fp8", {}), ("awq", None))]
    [True, False, False]
    """
    if is_ipc_quant_supported(quant_method, quant_config):
        return
    verified = ", ".join((repr(m) if m else "'' (unquantized)") for m in IPC_QUANT_ALLOWLIST)
    raise UnsupportedQuantForIPCError(
        "[weight_cache:%s] quantization method %r is not verified for CUDA IPC zero-copy weight sharing. Its "
        "process_weights_after_loading may stamp Python-side metadata (e.g. format_ue8m0) or repack/transpose "
        "weights into shapes the meta-initialized client cannot reproduce, which would silently serve "
        "wrong-numerics weights. Verified methods: %s. Note: FP8 is only verified for block-wise configs "
        "(weight_block_size set), not per-tensor FP8. Disable the weight cache (--weight-cache-mode off) for "
        "this model." % (where, quant_method, verified))


# ---------------------------------------------------------------- the wire


def send_msg(sock, obj):
    """Send a length-prefixed pickled message over a socket."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("!I", len(data)) + data)


def recv_msg(sock):
    """Receive a length-prefixed pickled message from a socket."""
    header = _recv_exact(sock, 4)
    if header is None:
        raise ConnectionError("Connection closed while reading message header")
    length = struct.unpack("!I", header)[0]
    if length > MAX_MSG_SIZE:
        raise ValueError("Message size %d exceeds %d byte cap" % (length, MAX_MSG_SIZE))
    data = _recv_exact(sock, length)
    if data is None:
        raise ConnectionError("Connection closed while reading message body")
    return pickle.loads(data)  # SGLang: safe_pickle_loads (an allowlisting Unpickler)


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf.extend(chunk)
    return bytes(buf)


# ---------------------------------------------------------------- the key's parts


def compute_env_stamp():
    """The local compute capability (of device 0, as SGLang asks it) and torch version."""
    from sglang import _platform

    device_capability = torch_version = ""
    try:
        torch_version = _platform.torch_version()
    except Exception:
        pass
    try:
        device_capability = _platform.get_device_capability()
    except Exception:
        pass
    return {"device_capability": device_capability, "torch_version": torch_version}


def compute_global_rank(tp_size, pp_rank, tp_rank):
    return tp_size * pp_rank + tp_rank


def compute_local_gpu_id(pp_rank, tp_rank, pp_size_per_node, tp_size_per_node, base_gpu_id=0, gpu_id_step=1):
    """The local GPU id a daemon rank runs on (the engine's own device assignment).

    >>> compute_local_gpu_id(0, 1, 1, 2, base_gpu_id=2, gpu_id_step=2)
    4
    """
    return base_gpu_id + (pp_rank % pp_size_per_node) * tp_size_per_node + (tp_rank % tp_size_per_node) * gpu_id_step


_STR_DTYPE = {"half": "float16", "float16": "float16", "float": "float32", "float32": "float32",
              "bfloat16": "bfloat16"}


def model_config(server_args):
    """What SGLang's ModelConfig says of the model that the key needs: architecture, resolved
    quantization, the checkpoint's quantization_config, dtype (``torch.<dtype>``)."""
    config = {}
    try:
        with open(os.path.join(server_args["model_path"], "config.json")) as handle:
            config = json.load(handle)
    except (OSError, ValueError, TypeError):
        config = {}
    if not isinstance(config, dict):
        config = {}
    architectures = config.get("architectures") or []
    quant_config = config.get("quantization_config")
    quantization = server_args.get("quantization")
    quantization = quantization.lower() if quantization else None
    if quant_config is not None and quantization is None:
        method = quant_config.get("quant_method", "") if isinstance(quant_config, dict) else ""
        quantization = str(method).lower() or None
    # _get_and_verify_dtype: "auto" takes config.json's dtype, float32 (also a missing one) -> float16
    config_dtype = _STR_DTYPE.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), "float32")
    wanted = str(server_args.get("dtype") or "auto").lower()
    if wanted == "auto":
        dtype = "float16" if config_dtype == "float32" else config_dtype
    else:
        if wanted not in _STR_DTYPE:
            raise ValueError("Unknown dtype: %s" % wanted)
        dtype = _STR_DTYPE[wanted]
    return {"architectures": list(architectures), "quantization": quantization, "quant_config": quant_config,
            "dtype": "torch." + dtype, "revision": server_args.get("revision")}


def resolve_quant(server_args, model=None):
    """(quant_method, quant_config) as ``IpcModelLoader._resolve_engine_quant`` and the daemon take them."""
    model = model or model_config(server_args)
    quant_config = model["quant_config"]
    quant_method = get_quant_method_name(server_args.get("quantization") or model["quantization"])
    if not quant_method and quant_config is not None:
        quant_method = get_quant_method_name(quant_config)
    return quant_method, quant_config


def build_cache_config(server_args, tp_rank, pp_rank, model=None, env_stamp=None):
    """The CacheConfig of one rank, as both sides compute it (the parallel state's ranks from
    runtime_context.derive_spawn_ranks)."""
    model = model or model_config(server_args)
    tp_size = int(server_args.get("tp_size") or 1)
    ep_size = int(server_args.get("ep_size") or 1)
    moe_dp_size = int(server_args.get("moe_dp_size") or 1)
    dp_size = int(server_args.get("dp_size") or 1)
    per_moe_dp = max(1, tp_size // moe_dp_size)
    quant_method, quant_config = resolve_quant(server_args, model)
    return CacheConfig(
        model_path=server_args["model_path"],
        model_arch=model["architectures"][0] if model["architectures"] else "",
        tp_size=tp_size,
        tp_rank=int(tp_rank),
        pp_size=int(server_args.get("pp_size") or 1),
        pp_rank=int(pp_rank),
        dp_size=dp_size,
        ep_size=ep_size,
        moe_dp_size=moe_dp_size,
        moe_dp_rank=int(tp_rank) // per_moe_dp,
        moe_ep_rank=int(tp_rank) % per_moe_dp // max(1, per_moe_dp // ep_size),
        attn_dp_size=dp_size if server_args.get("enable_dp_attention") else 1,
        enable_dp_lm_head=bool(server_args.get("enable_dp_lm_head")),
        attn_cp_size=int(server_args.get("attn_cp_size") or 1),
        moe_dense_tp_size=server_args.get("moe_dense_tp_size"),
        moe_a2a_backend=str(server_args.get("moe_a2a_backend") or "none"),
        quant_method=quant_method,
        quant_config_hash=hash_quant_config(quant_config),
        dtype=model["dtype"],
        revision=model["revision"] or "",
        **(env_stamp if env_stamp is not None else compute_env_stamp()),
    )


# ---------------------------------------------------------------- the files


def _format_daemon_path(env_name, default, device_uuid):
    template = os.environ.get(env_name) or default
    if "{device_uuid}" not in template:
        raise ValueError(
            "%s=%r must contain '{device_uuid}': each physical GPU needs its own path, and a GPU-independent "
            "one would point every caller at a single daemon." % (env_name, template))
    return template.format(device_uuid=device_uuid)


def get_socket_path(device_uuid):
    return _format_daemon_path(SOCKET_TEMPLATE_ENV, DEFAULT_SOCKET_TEMPLATE, device_uuid)


def get_ready_path(device_uuid):
    return _format_daemon_path(READY_TEMPLATE_ENV, DEFAULT_READY_TEMPLATE, device_uuid)


def _read_ready_pid(ready_path):
    try:
        with open(ready_path) as f:
            for line in f:
                if line.startswith("pid="):
                    return int(line.strip().split("=", 1)[1])
    except (OSError, ValueError):
        pass
    return None


def _is_pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def cleanup_stale_daemon_files(device_uuid, force=False):
    """Refuse a live daemon's files (unless ``force``: SIGKILL it), remove stale ones."""
    ready_path = get_ready_path(device_uuid)
    socket_path = get_socket_path(device_uuid)
    if not os.path.exists(ready_path) and not os.path.exists(socket_path):
        return
    pid = _read_ready_pid(ready_path) if os.path.exists(ready_path) else None
    if pid is not None and _is_pid_alive(pid):
        if not force:
            raise RuntimeError(
                "Weight cache daemon for GPU %s is already running (pid=%d, ready=%s). Stop the existing daemon "
                "before launching a new one, or pass force=True (--force) to kill it and take over."
                % (device_uuid, pid, ready_path))
        logger.warning("[weight_cache] force takeover: killing existing daemon pid=%d for GPU %s and reclaiming "
                       "its socket/ready files." % (pid, device_uuid))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for path in (ready_path, socket_path):
        if os.path.exists(path):
            os.unlink(path)
            logger.info("Removed stale daemon file: %s" % path)
