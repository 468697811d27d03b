"""vLLM 0.33.0's weight cache in the lab's stand-in (simulated GPUs; stdlib only): ``vllm preload`` (the
launcher and its daemons, vllm/entrypoints/cli/preload.py and model_loader/weight_cache/daemon.py) and
the engine's ``--load-format ipc_cache`` (model_loader/weight_cache/ipc_loader.py), on vLLM's socket
protocol (protocol.py: an 8-byte big-endian length, then a pickle).

The launcher (``vllm preload --model M [engine args] [--weight-cache-socket-dir D]``): refuses
``--load-format ipc_cache`` ("The weight cache daemon itself must load from disk; use the default
--load-format"), spawns one daemon per local rank (``tp x pp``; ``multiprocessing`` spawn children,
no title, no parent-death signal: a SIGKILLed launcher leaves them), waits for each to say it serves
(a child that exits first: "Weight cache daemon rank(s) exited during startup (exitcodes=[...]);
shutting down.", the others terminated, exit with the largest code), logs "===== Weight cache daemon
READY: ... =====", then joins them. SIGTERM/SIGINT: each child terminated (SIGTERM: Python's default,
it dies at once and leaves its socket; its lock goes with it), exit.

A daemon (rank r on device r of ``CUDA_VISIBLE_DEVICES``): its CUDA context, the rank's weights (the
same share an engine's rank loads: vllm/_model.py ``weight_mib``), read for ``$VLLM_STANDIN_WEIGHT_LOAD_S``
(default 0, as an engine's disk load), its key (``WeightCacheKey``'s fields, from its own flags: the KV cache dtype
included), then ``serve_forever``: the socket dir ``{tempdir}/vllm_weight_cache_{uid}`` (0700; or
``--weight-cache-socket-dir``), an exclusive ``flock`` on ``<socket>.lock`` for its life (held: "Another
weight cache daemon already owns ..."), a stale socket removed, bound (0600), "Weight cache target
daemon rank R serving on P". Requests: ``get_state`` (key mismatch: ``{"status": "mismatch", "fields"}``),
``get_memory`` (the weights' bytes), ``watch`` (held open for the daemon's life), ``release``.

The engine (``--load-format ipc_cache``, extra config ``mode``/``fallback``/``socket_dir``/
``socket_path``/``connect_timeout_s``/``state_timeout_s``; another key: "Unexpected extra config
keys ..."): the daemon's memory counts in its budget (``get_external_weight_memory``, gpu_worker.py
``request_memory``), then ``get_state`` with its own key: mapped (zero-copy: it holds no weights of its
own; copy: it clones them and asks the daemon to ``release``) and watched; unreachable or another key:
``fallback`` (the default) "Weight cache unusable (...); falling back to disk loading", else the
error (without fallback an unreachable daemon is retried every 0.5 s up to ``state_timeout_s``).
"""

import fcntl
import hashlib
import json
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import struct
import tempfile
import time

from vllm import _lab, _model
from vllm._lab import common

MIB = 1 << 20
LEN = struct.Struct("!Q")
STARTUP_RETRY_INTERVAL_S = 0.5


class WeightCacheUnavailableError(Exception):
    pass


class CacheConfigMismatchError(Exception):
    pass


# ---------------------------------------------------------------- protocol.py
def send_msg(sock, obj):
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(LEN.pack(len(payload)) + payload)


def _recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("Socket closed while receiving message")
        buf += chunk
    return buf


def recv_msg(sock):
    (length,) = LEN.unpack(_recv_exact(sock, LEN.size))
    if length > 1 << 34:
        raise ValueError("Message size %d exceeds limit %d" % (length, 1 << 34))
    return pickle.loads(_recv_exact(sock, length))


def get_socket_dir(socket_dir=None):
    return socket_dir or os.path.join(tempfile.gettempdir(), "vllm_weight_cache_%d" % os.getuid())


def get_socket_path(gpu_uuid, socket_dir=None):
    """``vllm_weight_cache_{md5(uuid)}.sock`` (safe_hash keeps the name under the AF_UNIX limit)."""
    return os.path.join(get_socket_dir(socket_dir), "vllm_weight_cache_%s.sock"
                        % hashlib.md5(gpu_uuid.encode(), usedforsecurity=False).hexdigest())


def device_uuid(device):
    """The NVML UUID of device ``device`` of what CUDA_VISIBLE_DEVICES shows (platforms/cuda.py)."""
    config = common.load_gpu_config()
    return list(config.get("uuids") or [])[common.physical_gpu(device, config)]


def cache_key(plan, tp_rank, pp_rank):
    """``WeightCacheKey.from_model_config`` from a server's flags (plan: vllm/_api_server.py ``weights_plan``)."""
    config = common.model_config(plan["model"])
    quant = config.get("quantization_config")
    return {"checkpoint": plan["model"], "model_arch": ",".join(config.get("architectures") or []),
            "tp_size": plan["tp"], "tp_rank": tp_rank, "pp_size": plan["pp"], "pp_rank": pp_rank,
            "dtype": plan["dtype"], "quantization": plan["quantization"],
            "quant_config_hash": hashlib.md5(json.dumps(quant, sort_keys=True).encode(), usedforsecurity=False).hexdigest(),
            "rope_parameters_hash": json.dumps([config.get("rope_parameters") or config.get("rope_scaling"),
                                                config.get("max_position_embeddings")], sort_keys=True),
            "kv_cache_dtype": plan["kv_cache_dtype"], "revision": plan["revision"], "vllm_version": plan["version"],
            "is_draft": False, "dp_size": 1, "dp_rank": 0, "enable_expert_parallel": plan["enable_expert_parallel"],
            "expert_placement_strategy": plan["expert_placement_strategy"], "moe_backend": plan["moe_backend"],
            "linear_backend": plan["linear_backend"]}


def mismatched_fields(mine, other):
    return [name for name in mine if mine.get(name) != (other or {}).get(name)]


# ---------------------------------------------------------------- the daemon (daemon.py)
def _run_daemon(global_rank, local_rank, plan, socket_dir, ready_queue):
    _lab.decorate_logs("WeightCacheDaemon")
    rank = {"device": local_rank, "tp_rank": global_rank % plan["tp"], "pp_rank": global_rank // plan["tp"]}
    key = cache_key(plan, rank["tp_rank"], rank["pp_rank"])
    memory = common.Memory()
    config = common.load_gpu_config()
    physical = common.physical_gpu(local_rank, config)
    memory.hold(physical, common.CONTEXT_MIB)
    weights = _model.weight_mib(common.model_shape(common.model_config(plan["model"])), plan["tp"], plan["pp"],
                                int(int(config["total_mib"]) * plan["gpu_memory_utilization"]))
    memory.hold(physical, weights)
    time.sleep(_lab.seconds("VLLM_STANDIN_WEIGHT_LOAD_S", 0))
    _lab.info("daemon.py:395", "Weight cache target daemon rank %d loaded model (%.2f GiB allocated, %.2f GiB reserved)"
              % (global_rank, weights / 1024.0, weights / 1024.0))
    state = {"weights": weights, "watchers": [], "uuid": device_uuid(local_rank)}
    path = get_socket_path(state["uuid"], socket_dir)
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if socket_dir is None:
        os.chmod(directory, 0o700)
    lock_fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise WeightCacheUnavailableError("Another weight cache daemon already owns %s" % path)
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o600)
    server.listen()
    _lab.info("daemon.py:484", "Weight cache target daemon rank %d serving on %s" % (global_rank, path))
    ready_queue.put(("target", global_rank))
    try:
        while True:
            conn, _ = server.accept()
            with conn:
                try:
                    _handle(conn, key, state, memory)
                except (ConnectionError, EOFError):
                    _lab.warning("daemon.py:500", "Client disconnected mid-request")
                except Exception as exc:  # noqa: BLE001 -- reported back, the daemon goes on
                    _lab.exception("daemon.py:505", "Error handling weight cache client; continuing", exc)
                    try:
                        send_msg(conn, {"status": "error", "message": str(exc)})
                    except OSError:
                        pass
    finally:
        server.close()
        if os.path.exists(path):
            os.unlink(path)
        os.close(lock_fd)


def _handle(conn, key, state, memory):
    request = recv_msg(conn)
    cmd = request.get("cmd")
    if cmd == "get_state":
        client = request.get("cache_key")
        if not isinstance(client, dict):
            send_msg(conn, {"status": "error", "message": "Missing cache_key"})
            return
        fields = mismatched_fields(key, client)
        if fields:
            _lab.warning("daemon.py:560", "WeightCacheKey mismatch on fields: %s" % fields)
            send_msg(conn, {"status": "mismatch", "fields": fields})
            return
        if state["weights"] is None:
            send_msg(conn, {"status": "error", "message": "Weights were released"})
            return
        send_msg(conn, {"status": "ok", "entries": {"weights": state["weights"]}, "aliases": {}, "attrs": {},
                        "gpu_uuid": state["uuid"]})
        _lab.info("daemon.py:580", "Weight cache target daemon rank %d sent 1 tensors (+0 aliases) to engine"
                  % (key["pp_rank"] * key["tp_size"] + key["tp_rank"]))
    elif cmd == "get_memory":
        send_msg(conn, {"status": "ok", "memory_bytes": (state["weights"] or 0) * MIB})
    elif cmd == "release":
        state["weights"] = None
        for holding in memory.holdings[1:]:  # the weights (the context stays)
            holding.free()
        send_msg(conn, {"status": "ok"})
    elif cmd == "watch":
        state["watchers"].append(conn.dup())
        send_msg(conn, {"status": "ok"})
    else:
        send_msg(conn, {"status": "error", "message": "Unknown command %r" % (cmd,)})


# ---------------------------------------------------------------- the launcher (preload.py)
def weights_plan(args):
    """What shapes a rank's weights, from the parsed flags (the daemons' and an engine's alike)."""
    import vllm

    return {"model": args.model, "tp": int(args.tensor_parallel_size or 1), "pp": int(args.pipeline_parallel_size or 1),
            "dtype": args.dtype or "auto", "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype or "auto",
            "revision": args.revision, "version": vllm.__version__,
            "enable_expert_parallel": bool(args.enable_expert_parallel),
            "expert_placement_strategy": args.expert_placement_strategy or "linear",
            "moe_backend": args.moe_backend or "auto", "linear_backend": args.linear_backend or "auto",
            "gpu_memory_utilization": float(args.gpu_memory_utilization)}


def add_preload_args(parser):
    parser.add_argument("--weight-cache-socket-dir", type=str, default=None,
                        help="Directory for the daemon Unix sockets (default: tempdir).")
    parser.add_argument("--weight-cache-master-port", type=int, default=None)
    parser.add_argument("--weight-cache-draft-master-port", type=int, default=None)
    parser.add_argument("--weight-cache-health-port", type=int, default=None)
    parser.add_argument("--weight-cache-health-host", type=str, default="0.0.0.0")
    for name in ("--seed-listen-host", "--seed-source-host", "--seed-token"):
        parser.add_argument(name, type=str, default=None)
    for name in ("--seed-listen-port", "--seed-source-port"):
        parser.add_argument(name, type=int, default=None)


def preload(args):
    """``PreloadSubcommand.cmd``."""
    from vllm import _api_server

    problem = _api_server.model_error(args.model) or _model.kv_cache_dtype_error(args.kv_cache_dtype or "auto")
    if problem is None and args.load_format == "ipc_cache":
        problem = "The weight cache daemon itself must load from disk; use the default --load-format"
    if problem:
        _api_server.log_traceback("preload.py", 233, "cmd", "ValueError: " + problem)
        return 1
    plan = weights_plan(args)
    ctx = multiprocessing.get_context("spawn")
    ready_queue = ctx.Queue()
    procs = [ctx.Process(target=_run_daemon, args=(rank, rank, plan, args.weight_cache_socket_dir, ready_queue),
                         name="vllm-weight-cache-target-%d" % rank) for rank in range(plan["tp"] * plan["pp"])]
    for proc in procs:
        proc.start()

    def shutdown(signum, frame):
        for proc in procs:
            proc.terminate()

    signal.signal(signal.SIGINT, shutdown)
    signal.signal(signal.SIGTERM, shutdown)
    ready = set()
    while len(ready) < len(procs):
        try:
            ready.add(ready_queue.get(timeout=_lab.seconds("VLLM_STANDIN_PRELOAD_POLL_S", 0.05)))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode is not None]
            if dead:
                _lab.error("preload.py:372", "Weight cache daemon rank(s) exited during startup (exitcodes=%s); "
                           "shutting down." % [p.exitcode for p in dead])
                for proc in procs:
                    proc.terminate()
                for proc in procs:
                    proc.join()
                return max(abs(p.exitcode or 0) for p in procs) or 1
    _lab.info("preload.py:391", "===== Weight cache daemon READY: node 0/1 serving %d local rank(s) x 1 role(s) in %s "
              "=====" % (len(procs), args.weight_cache_socket_dir or "the default socket dir"))
    for proc in procs:
        proc.join()
    return max([0] + [proc.exitcode for proc in procs if (proc.exitcode or 0) > 0])


# ---------------------------------------------------------------- the engine's load (ipc_loader.py)
class IpcLoader:
    def __init__(self, extra, socket_uuid):
        extra = dict(extra or {})
        self.socket_path = extra.pop("socket_path", None)
        self.socket_dir = extra.pop("socket_dir", None)
        self.mode = extra.pop("mode", "zero_copy")
        self.fallback = extra.pop("fallback", True)
        self.connect_timeout_s = float(extra.pop("connect_timeout_s", 5.0))
        self.state_timeout_s = float(extra.pop("state_timeout_s", 300.0))
        if self.mode not in ("zero_copy", "copy"):
            raise ValueError("Invalid weight cache mode %r, expected 'zero_copy' or 'copy'" % (self.mode,))
        if extra:
            raise ValueError("Unexpected extra config keys for load format ipc_cache: %s" % sorted(extra))
        self.uuid = socket_uuid
        self.watch_conn = None

    def path(self):
        return self.socket_path or get_socket_path(self.uuid, self.socket_dir)

    def _connect(self, timeout):
        path = self.path()
        if not os.path.exists(path):
            raise WeightCacheUnavailableError("Weight cache socket %s is unavailable: [Errno 2] No such file or "
                                              "directory: '%s'" % (path, path))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise WeightCacheUnavailableError("Cannot connect to weight cache daemon at %s: %s" % (path, exc))
        return sock

    def _request(self, message, timeout):
        with self._connect(timeout) as conn:
            send_msg(conn, message)
            return recv_msg(conn)

    def _with_startup_wait(self, op):
        deadline = time.monotonic() + self.state_timeout_s
        said = False
        while True:
            try:
                return op()
            except (WeightCacheUnavailableError, ConnectionError, OSError) as exc:
                if time.monotonic() >= deadline:
                    raise WeightCacheUnavailableError("Weight cache daemon did not become ready within %.1fs: %s"
                                                      % (self.state_timeout_s, exc))
                if not said:
                    _lab.info("ipc_loader.py:398", "Waiting up to %.1fs for the weight cache daemon to start"
                              % self.state_timeout_s)
                    said = True
                time.sleep(max(0.0, min(STARTUP_RETRY_INTERVAL_S, deadline - time.monotonic())))

    def external_weight_bytes(self):
        """``get_external_weight_memory``: the daemon's weights (zero-copy), 0 in copy mode."""
        if self.mode != "zero_copy":
            return 0

        def query():
            response = self._request({"cmd": "get_memory"}, self.connect_timeout_s)
            if response.get("status") != "ok":
                raise WeightCacheUnavailableError("Weight cache daemon rejected the memory query: %s"
                                                  % response.get("message"))
            return int(response.get("memory_bytes", 0))

        if not self.fallback:
            return self._with_startup_wait(query)
        try:
            return query()
        except (WeightCacheUnavailableError, ConnectionError, OSError) as exc:
            _lab.warning("ipc_loader.py:160", "Cannot query weight cache daemon memory (%s); assuming the weights are "
                         "not externally held" % exc)
            return 0

    def load(self, key):
        """-> the MiB of weights this process holds itself (0 zero-copy), or None: load from disk."""
        def fetch():
            response = self._request({"cmd": "get_state", "cache_key": key, "is_reload": False}, self.state_timeout_s)
            if response.get("status") == "mismatch":
                raise CacheConfigMismatchError("WeightCacheKey mismatch on fields: %s" % response.get("fields"))
            if response.get("status") != "ok":
                raise WeightCacheUnavailableError("Weight cache daemon error: %s" % response.get("message"))
            if response.get("gpu_uuid") not in (None, self.uuid):
                raise CacheConfigMismatchError("Daemon GPU %s != engine GPU %s; check the socket path / GPU mapping"
                                               % (response.get("gpu_uuid"), self.uuid))
            return response

        try:
            state = self._with_startup_wait(fetch) if not self.fallback else fetch()
        except (WeightCacheUnavailableError, CacheConfigMismatchError) as exc:
            if not self.fallback:
                raise
            _lab.warning("ipc_loader.py:253", "Weight cache unusable (%s); falling back to disk loading" % exc)
            return None
        own = int(state["entries"]["weights"]) if self.mode == "copy" else 0
        if self.mode == "copy":
            self._request({"cmd": "release"}, self.connect_timeout_s)
        else:
            self._watch()
        _lab.info("ipc_loader.py:318", "Mapped %d tensors from the weight cache daemon (%s mode)"
                  % (len(state["entries"]), self.mode))
        return own

    def _watch(self):
        try:
            conn = self._connect(self.connect_timeout_s)
            send_msg(conn, {"cmd": "watch"})
            if recv_msg(conn).get("status") != "ok":
                conn.close()
                return
        except (WeightCacheUnavailableError, ConnectionError, OSError) as exc:
            _lab.warning("ipc_loader.py:560", "Cannot watch the weight cache daemon: %s" % exc)
            return
        conn.settimeout(None)
        self.watch_conn = conn
        path = self.path()

        def wait():
            try:
                while conn.recv(1):
                    pass
            except OSError:
                pass
            _lab.warning("ipc_loader.py:597", "Weight cache daemon at %s exited. This engine keeps serving: the CUDA "
                         "driver keeps its mapped weights alive until the engine exits. A restarted daemon holds a "
                         "second copy of the weights on this GPU, and engine restarts miss the cache until a daemon "
                         "serves again." % path)
        common.thread(wait, name="WeightCacheDaemonWatch")


__all__ = ["IpcLoader", "add_preload_args", "cache_key", "preload", "weights_plan"]
