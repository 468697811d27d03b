"""``python3 -m sglang.srt.weight_cache.daemon``: the stand-in of SGLang 0.5.23's weight-cache daemon
(weight_cache/daemon.py), stdlib only in a simulated lab.

Arguments, as SGLang parses them: the daemon's own first (``--gpu-id``, ``--tp-rank``, ``--pp-rank``,
``--dist-init-method``, ``--timeout`` (1800), ``--force``; ``parse_known_args`` of a parser with
abbreviations allowed, so ``--tp 2`` is taken as ``--tp-rank 2``, exactly as SGLang takes it), the rest
through the stand-in's server-args parser (the same flag table as launch_server; ``prepare_server_args``,
whose prog in 0.5.23 is ``sglang serve``: a bad flag exits 2 with argparse's message). It configures
logging as SGLang's ``prepare_server_args`` does (``[%(asctime)s] %(message)s``).

Launcher (neither ``--gpu-id`` nor ``--tp-rank``), ``launch_weight_cache_daemons``:

- the local ranks as the engine counts them (``pp x tp`` on one node; ``--nnodes``/``--node-rank`` split
  them), GPU ``compute_local_gpu_id(...)`` (``--base-gpu-id``, ``--gpu-id-step``);
  ``--dist-init-method`` default ``tcp://127.0.0.1:<a free port>`` (multi-node without it: ValueError);
- ``cleanup_stale_daemon_files`` for every rank's GPU first (protocol.py: a live daemon's ``.ready``
  refuses with RuntimeError, ``--force`` SIGKILLs it; stale files are removed);
- one child per rank with ``multiprocessing``'s ``spawn`` context (``spawn_weight_cache_daemon``), so a
  child's /proc cmdline is ``<python> -c "from multiprocessing.spawn import spawn_main;
  spawn_main(tracker_fd=N, pipe_handle=M)" --multiprocessing-fork``, and the spawn starts
  multiprocessing's resource tracker beside them (``<python> -c "from multiprocessing.resource_tracker
  import main;main(N)"``), as it does under SGLang;
- waits for each rank's ``.ready`` in turn, looking every ``check_interval`` (SGLang: 2 s;
  ``$SGLANG_STANDIN_DAEMON_CHECK_S``, default 0.05) up to ``--timeout`` (TimeoutError); a child that
  exited meanwhile: RuntimeError "Weight cache daemon exited prematurely with code C", the others
  terminated;
- then monitors (SGLang: every 1 s; ``$SGLANG_STANDIN_DAEMON_MONITOR_S``, default 0.1): the moment one
  child exits, SIGTERM to the rest, join 5 s, SIGKILL, "All weight cache daemons have been terminated",
  and RuntimeError "Weight cache daemon (pid=P) exited with code C; terminated the remaining daemons."
  (a traceback, exit 1). Ctrl-C (KeyboardInterrupt): the same teardown, exit 0. SIGTERM: Python's default,
  the launcher dies at once; its children die with it (``PR_SET_PDEATHSIG`` = SIGKILL), leaving their
  ``.sock``/``.ready`` files behind (the next launch removes them: their pid is dead).

Single rank (``--gpu-id`` and/or ``--tp-rank``; the missing one defaults to the other): the stale-file
cleanup for that GPU, then the child's work in this process.

A child (``run_weight_cache_daemon``): logging as SGLang's (``%(asctime)s [Daemon gpu=G tp_rank=R]
%(levelname)s %(message)s``), ``PR_SET_PDEATHSIG`` = SIGKILL, then ``WeightCacheDaemon.load``:
the platform check (CPU torch: SGLang's RuntimeError), ``PYTORCH_CUDA_ALLOC_CONF`` with
``expandable_segments:True``: RuntimeError; its CUDA context (518 MiB in the simulated driver); the quant
allowlist (``where="daemon"``); the distributed init (a rendezvous of all ranks at ``--dist-init-method``:
rank 0 listens there, as torch's TCPStore does); the CacheConfig; the disk load
(``$SGLANG_STANDIN_WEIGHT_LOAD_S``; the rank's weights held on its GPU: sglang/_weights.py; real mode:
the bytes of ``$SGLANG_STANDIN_WEIGHTS_FILE`` read into CUDA memory); the export (torch IPC handles,
transport.py). Then a barrier of all ranks (``--weight-cache-timeout``; failed: "[weight_cache] cluster
readiness barrier failed; exiting without serving.", exit 1), then ``serve``: binds its Unix socket
(umask 0177; an existing path fails the bind), writes the ``.ready`` (``pid=<pid>\\nconfig=<dict>\\n``),
serves one connection at a time (``query_config``, ``fetch_state`` (a CacheConfig mismatch answers
``{"status": "mismatch", "daemon_config"}``), ``ping``; anything else an error reply; 30 s per
connection). SIGTERM/SIGINT: stop serving (within the 1 s accept timeout,
``$SGLANG_STANDIN_DAEMON_ACCEPT_S``), remove both files, exit 0.
"""

import argparse
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import struct
import sys
import time

from sglang import _platform, _real, _timing, _weights
from sglang._sim import gpusim
from sglang.srt.weight_cache.protocol import (CacheConfig, build_cache_config, check_ipc_quant_support,
                                              cleanup_stale_daemon_files, compute_env_stamp, compute_global_rank,
                                              compute_local_gpu_id, get_ready_path, get_socket_path, model_config,
                                              recv_msg, resolve_quant, send_msg)
from sglang.srt.weight_cache.transport import choose_daemon_transport_backend

logger = logging.getLogger(__name__)

CLIENT_CONNECTION_TIMEOUT = 30.0
CONTEXT_MIB = 518  # a CUDA context on an H200, measured (shared/reference/nvml-and-containers.md)
PR_SET_PDEATHSIG = 1


class WeightCacheDaemonArgs:
    """Daemon-private worker identity and standalone launcher controls."""

    def __init__(self, gpu_id=None, tp_rank=None, pp_rank=0, dist_init_method=None, timeout=1800, force=False):
        self.gpu_id, self.tp_rank, self.pp_rank = gpu_id, tp_rank, pp_rank
        self.dist_init_method, self.timeout, self.force = dist_init_method, timeout, force

    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--gpu-id", type=int, default=None,
                            help="GPU device ID for a single daemon. If omitted, launches all local ranks.")
        parser.add_argument("--tp-rank", type=int, default=None,
                            help="TP rank for a single daemon. If omitted, launches all local ranks.")
        parser.add_argument("--pp-rank", type=int, default=0)
        parser.add_argument("--dist-init-method", default=None,
                            help="Daemon distributed init method (for example tcp://host:29500).")
        parser.add_argument("--timeout", type=int, default=1800)
        parser.add_argument("--force", action="store_true")

    @classmethod
    def from_cli_args(cls, args):
        return cls(gpu_id=args.gpu_id, tp_rank=args.tp_rank, pp_rank=args.pp_rank,
                   dist_init_method=args.dist_init_method, timeout=args.timeout, force=args.force)


def kill_itself_when_parent_died():
    """SGLang's (srt/utils/common.py): SIGKILL this process when its parent dies."""
    if sys.platform == "linux":
        libc = ctypes.CDLL("libc.so.6")
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class _WorldGroup:
    """The daemons' world group (SGLang: torch.distributed over gloo at ``dist_init_method``): a
    rendezvous at init and ``barrier()``; rank 0 holds the store (listens on the init method's port)."""

    def __init__(self, init_method, world_size, rank, timeout):
        self.world_size, self.rank, self.timeout = int(world_size), int(rank), float(timeout)
        self.peers = []
        self.conn = None
        if self.world_size <= 1:
            return
        if not str(init_method).startswith("tcp://"):
            raise ValueError("dist_init_method must be tcp://host:port, got %r" % (init_method,))
        host, _, port = str(init_method)[len("tcp://"):].rpartition(":")
        deadline = time.monotonic() + self.timeout
        if self.rank == 0:
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                server.bind((host, int(port)))
            except OSError as exc:
                raise RuntimeError(
                    "The server socket has failed to listen on any local network address. port: %s, useIpv6: "
                    "false, code: -%d, name: EADDRINUSE, message: %s" % (port, exc.errno or 98,
                                                                         (exc.strerror or "").lower()))
            server.listen(self.world_size)
            while len(self.peers) < self.world_size - 1:
                server.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    raise RuntimeError("Timed out after %ds waiting for %d of %d ranks to join at %s"
                                       % (self.timeout, self.world_size - 1 - len(self.peers), self.world_size,
                                          init_method))
                conn.settimeout(None)
                _recv_exactly(conn, 4)  # the peer's rank
                self.peers.append(conn)
            server.close()
        else:
            while True:
                try:
                    self.conn = socket.create_connection((host, int(port)), timeout=1.0)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("Timed out after %ds connecting to the store at %s"
                                           % (self.timeout, init_method))
                    time.sleep(0.05)
            self.conn.settimeout(None)
            self.conn.sendall(struct.pack("!I", self.rank))

    def barrier(self, timeout):
        if self.world_size <= 1:
            return
        deadline = time.monotonic() + timeout
        try:
            if self.rank == 0:
                for conn in self.peers:
                    conn.settimeout(max(0.01, deadline - time.monotonic()))
                    if _recv_exactly(conn, 1) != b"B":
                        raise RuntimeError("a rank left the world group")
                for conn in self.peers:
                    conn.sendall(b"G")
            else:
                self.conn.sendall(b"B")
                self.conn.settimeout(max(0.01, deadline - time.monotonic()))
                if _recv_exactly(self.conn, 1) != b"G":
                    raise RuntimeError("rank 0 left the world group")
        except socket.timeout:
            raise RuntimeError("Rank %d timed out in monitoredBarrier after %ds" % (self.rank, timeout))

    def destroy(self):
        for conn in self.peers + ([self.conn] if self.conn else []):
            try:
                conn.close()
            except OSError:
                pass


def _recv_exactly(conn, n):
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return data
        data += chunk
    return data


_WORLD = []


class WeightCacheDaemon:
    """Persistent GPU weight cache for a single TP rank."""

    def __init__(self, server_args, gpu_id, tp_rank, pp_rank, dist_init_method=None):
        self.server_args = server_args
        self.model_path = server_args["model_path"]
        self.gpu_id = int(gpu_id)
        self.tp_size = int(server_args.get("tp_size") or 1)
        self.tp_rank = int(tp_rank)
        self.pp_size = int(server_args.get("pp_size") or 1)
        self.pp_rank = int(pp_rank)
        self.dist_init_method = dist_init_method
        device_uuid = _platform.get_device_uuid(self.gpu_id)
        self.socket_path = get_socket_path(device_uuid)
        self.ready_path = get_ready_path(device_uuid)
        self.config = None
        self.state_entries = {}
        self.preloaded_weights_bytes = 0
        self.transport_backend = None
        self.holdings = []  # simulated allocations (or real tensors) kept for the daemon's life
        self._running = False

    def _tag(self, with_rank=True):
        return "[WeightCacheDaemon gpu=%d%s]" % (self.gpu_id, " tp_rank=%d" % self.tp_rank if with_rank else "")

    def _init_distributed(self):
        if self.dist_init_method is None:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                self.dist_init_method = "tcp://127.0.0.1:%d" % s.getsockname()[1]
        world = _WorldGroup(self.dist_init_method, self.tp_size * self.pp_size,
                            compute_global_rank(self.tp_size, self.pp_rank, self.tp_rank),
                            int(self.server_args.get("weight_cache_timeout") or 1800))
        _WORLD[:] = [world]
        logger.info("%s Distributed backend initialized (tp_size=%d, pp_size=%d, world_size=%d)"
                    % (self._tag(), self.tp_size, self.pp_size, self.tp_size * self.pp_size))

    def load(self):
        """Full loading pipeline: disk -> TP shard -> (quantize) -> export IPC handles."""
        kind = _platform.device_type()
        if kind == "cpu":
            raise RuntimeError(
                "[WeightCacheDaemon] the weight cache daemon requires a CUDA-alike platform (CUDA or ROCm) for "
                "CUDA IPC weight sharing, but the active platform device type is 'cpu'. Disable the weight cache "
                "(--weight-cache-mode off).")
        self._assert_ipc_compatible_allocator()
        torch = device = None
        if kind == "cuda":
            torch = _real._import_torch()
            torch.cuda.set_device(self.gpu_id)
            device = torch.device("cuda", self.gpu_id)
            torch.zeros(1, device=device)  # the CUDA context
        else:
            physical = _platform.physical_gpu(self.gpu_id)
            try:
                self.holdings.append(gpusim.allocate(physical, CONTEXT_MIB, require_free=True))
            except gpusim.NotEnoughMemory:
                raise RuntimeError("CUDA error: out of memory")
        model = model_config(self.server_args)
        quant_method, quant_config = resolve_quant(self.server_args, model)
        check_ipc_quant_support(quant_method, quant_config, where="daemon")
        self._init_distributed()
        self.config = build_cache_config(self.server_args, self.tp_rank, self.pp_rank, model, compute_env_stamp())
        logger.info("%s Loading model from disk: %s" % (self._tag(), self.model_path))
        tic = time.perf_counter()
        state_tensors = {}
        if kind == "cuda":
            before = torch.cuda.memory_reserved(self.gpu_id)
            tensor, figures = _weights.load_real(torch, device, self.tp_rank, self.tp_size,
                                                 lambda m: logger.info("%s %s" % (self._tag(), m)))
            _timing.spend("WEIGHT_LOAD")
            if tensor is not None:
                self.holdings.append(tensor)
                state_tensors["lab.weights"] = (tensor, True)
                logger.info("%s Weights checksum=%d" % (self._tag(), _weights.checksum(torch, tensor)))
            torch.cuda.synchronize(device)
            self.preloaded_weights_bytes = max(0, torch.cuda.memory_reserved(self.gpu_id) - before)
        else:
            mib = _weights.weight_mib(self.server_args, int(gpusim.load_config()["total_mib"]))
            physical = _platform.physical_gpu(self.gpu_id)
            try:
                holding = gpusim.allocate(physical, mib, require_free=True)
            except gpusim.NotEnoughMemory:
                raise RuntimeError("CUDA out of memory. Tried to allocate %.2f GiB. GPU %d has a total capacity of "
                                   "%.2f GiB" % (mib / 1024.0, self.gpu_id,
                                                 int(gpusim.load_config()["total_mib"]) / 1024.0))
            self.holdings.append(holding)
            _timing.spend("WEIGHT_LOAD")
            state_tensors["lab.weights"] = ({"sim_alloc": holding.id, "gpu": physical, "bytes": mib << 20}, True)
            self.preloaded_weights_bytes = mib << 20
        logger.info("%s Model loaded from disk in %.2fs" % (self._tag(), time.perf_counter() - tic))
        self._export_state(state_tensors)
        logger.info("%s Exported %d tensors as IPC handles." % (self._tag(), len(self.state_entries)))

    @staticmethod
    def _assert_ipc_compatible_allocator():
        for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            conf = os.environ.get(var, "")
            for field in conf.split(","):
                key, _, value = field.partition(":")
                if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                    raise RuntimeError(
                        "[WeightCacheDaemon] %s sets expandable_segments:True, which is incompatible with CUDA IPC "
                        "weight sharing: the expandable-segments allocator hands out memory that cannot be exported "
                        "via _share_cuda_, so the IPC handle export would fail mid-way. Unset expandable_segments "
                        "for the weight cache daemon process (it can stay enabled for the engine itself)." % var)

    def _export_state(self, state_tensors):
        self.transport_backend = choose_daemon_transport_backend(state_tensors)
        self.state_entries = self.transport_backend.prepare_export(state_tensors)
        total = sum(len(e["handle"]) for e in self.state_entries.values() if isinstance(e.get("handle"), str))
        logger.info("%s Exported %d tensors (0 non-persistent buffers), transport=%s, metadata size ~%.1f MB"
                    % (self._tag(False), len(self.state_entries), self.transport_backend.name, total / 1024 / 1024))

    def serve(self):
        """Block and serve IPC handles over the Unix socket."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            sock.bind(self.socket_path)
        finally:
            os.umask(old_umask)
        sock.listen(8)
        sock.settimeout(_timing.interval_s("DAEMON_ACCEPT"))
        with open(self.ready_path, "w") as f:
            f.write("pid=%d\n" % os.getpid())
            f.write("config=%s\n" % (self.config.to_dict(),))
        logger.info("%s Listening on %s" % (self._tag(False), self.socket_path))
        self._running = True

        def _signal_handler(signum, frame):
            logger.info("%s Received signal %d, shutting down" % (self._tag(False), signum))
            self._running = False

        signal.signal(signal.SIGTERM, _signal_handler)
        signal.signal(signal.SIGINT, _signal_handler)
        try:
            while self._running:
                try:
                    conn, _ = sock.accept()
                    conn.settimeout(CLIENT_CONNECTION_TIMEOUT)
                    try:
                        self._handle_connection(conn)
                    except Exception as e:
                        logger.error("%s Error handling connection: %s" % (self._tag(False), e), exc_info=True)
                    finally:
                        conn.close()
                except socket.timeout:
                    continue
        finally:
            sock.close()
            if os.path.exists(self.socket_path):
                os.unlink(self.socket_path)
            if os.path.exists(self.ready_path):
                os.unlink(self.ready_path)
            logger.info("%s Shutdown complete" % self._tag(False))

    def _handle_connection(self, conn):
        req = recv_msg(conn)
        kind = req.get("type") if isinstance(req, dict) else None
        if kind == "query_config":
            send_msg(conn, {"status": "ok", "config": self.config.to_dict()})
        elif kind == "fetch_state":
            engine_config = CacheConfig.from_dict(req["config"])
            if not self.config.matches(engine_config):
                daemon_dict, engine_dict = self.config.to_dict(), engine_config.to_dict()
                mismatches = {k: (daemon_dict.get(k), engine_dict.get(k)) for k in daemon_dict
                              if daemon_dict.get(k) != engine_dict.get(k)}
                logger.warning("%s Config mismatch: %s" % (self._tag(False), mismatches))
                send_msg(conn, {"status": "mismatch", "daemon_config": self.config.to_dict()})
                return
            logger.info("%s Serving %d tensors via %s transport"
                        % (self._tag(False), len(self.state_entries), self.transport_backend.name))
            self.transport_backend.send_fetch_state_response(
                conn, config=self.config.to_dict(), entries=self.state_entries, pid=os.getpid(),
                preloaded_weights_bytes=self.preloaded_weights_bytes)
        elif kind == "ping":
            send_msg(conn, {"status": "ok"})
        else:
            send_msg(conn, {"status": "error", "message": "Unknown request type: %s" % (kind,)})


def run_weight_cache_daemon(server_args, gpu_id, tp_rank, pp_rank, dist_init_method=None):
    """Entry point for running a weight cache daemon process."""
    logging.basicConfig(level=logging.INFO,
                        format="%%(asctime)s [Daemon gpu=%s tp_rank=%s] %%(levelname)s %%(message)s" % (gpu_id, tp_rank))
    kill_itself_when_parent_died()
    _model_path_check(server_args)
    daemon = WeightCacheDaemon(server_args=server_args, gpu_id=gpu_id, tp_rank=tp_rank, pp_rank=pp_rank,
                               dist_init_method=dist_init_method)
    daemon.load()
    _await_cluster_ready_to_serve(timeout=int(server_args.get("weight_cache_timeout") or 1800))
    daemon.serve()


class HFValidationError(ValueError):
    pass


HFValidationError.__module__ = "huggingface_hub.errors"


def _model_path_check(server_args):
    """SGLang's ModelConfig fails on a path that is neither a model dir nor an HF id (as the engine)."""
    from sglang.launch_server import model_path_error  # noqa: PLC0415

    error = model_path_error(server_args["model_path"])
    if error:
        name, _, message = error.partition(": ")
        raise (OSError if name == "OSError" else HFValidationError)(message)


def _await_cluster_ready_to_serve(timeout):
    if timeout <= 0:
        raise ValueError("--weight-cache-timeout must be positive, got %s" % timeout)
    try:
        for world in _WORLD:
            world.barrier(timeout)
    except RuntimeError:
        logger.exception("[weight_cache] cluster readiness barrier failed; exiting without serving.")
        os._exit(1)


def spawn_weight_cache_daemon(server_args, gpu_id, tp_rank, pp_rank, dist_init_method):
    """Start one daemon (multiprocessing's spawn: a fresh interpreter gets the server args by pickle)."""
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=run_weight_cache_daemon, args=(server_args, gpu_id, tp_rank, pp_rank, dist_init_method))
    proc.start()
    return proc


def local_rank_ranges(server_args):
    """(pp_rank_range, tp_rank_range, pp_size_per_node, tp_size_per_node): engine.py's _calculate_rank_ranges."""
    pp_size, tp_size = int(server_args.get("pp_size") or 1), int(server_args.get("tp_size") or 1)
    nnodes, node_rank = int(server_args.get("nnodes") or 1), int(server_args.get("node_rank") or 0)
    pp_size_per_node = max(pp_size // nnodes, 1)
    nnodes_per_pp_rank = max(nnodes // pp_size, 1)
    pp_rank_range = range(pp_size_per_node * (node_rank // nnodes_per_pp_rank),
                          pp_size_per_node * (node_rank // nnodes_per_pp_rank + 1))
    tp_size_per_node = tp_size // nnodes_per_pp_rank
    tp_rank_range = range(tp_size_per_node * (node_rank % nnodes_per_pp_rank),
                          tp_size_per_node * (node_rank % nnodes_per_pp_rank + 1))
    return pp_rank_range, tp_rank_range, pp_size_per_node, tp_size_per_node


def _gpu_of(server_args, pp_rank, tp_rank, pp_size_per_node, tp_size_per_node):
    return compute_local_gpu_id(pp_rank, tp_rank, pp_size_per_node, tp_size_per_node,
                                base_gpu_id=int(server_args.get("base_gpu_id") or 0),
                                gpu_id_step=int(server_args.get("gpu_id_step") or 1))


def launch_weight_cache_daemons(server_args, dist_init_method=None, timeout=1800, force=False):
    """Launch weight cache daemon processes for this node's PP x TP ranks, then monitor them."""
    pp_rank_range, tp_rank_range, pp_per_node, tp_per_node = local_rank_ranges(server_args)
    if int(server_args.get("nnodes") or 1) > 1 and dist_init_method is None:
        raise ValueError("dist_init_method is required for multi-node weight cache daemons. Use --dist-init-method "
                         "tcp://<node0-ip>:<port> to specify the rendezvous address accessible from all nodes.")
    if dist_init_method is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            dist_init_method = "tcp://127.0.0.1:%d" % s.getsockname()[1]
    ranks = [(pp, tp) for pp in pp_rank_range for tp in tp_rank_range]
    for pp_rank, tp_rank in ranks:
        gpu_id = _gpu_of(server_args, pp_rank, tp_rank, pp_per_node, tp_per_node)
        cleanup_stale_daemon_files(_platform.get_device_uuid(gpu_id), force=force)
    procs = []
    for pp_rank, tp_rank in ranks:
        gpu_id = _gpu_of(server_args, pp_rank, tp_rank, pp_per_node, tp_per_node)
        proc = spawn_weight_cache_daemon(server_args, gpu_id=gpu_id, tp_rank=tp_rank, pp_rank=pp_rank,
                                         dist_init_method=dist_init_method)
        procs.append(proc)
        logger.info("Launched weight cache daemon gpu=%d pp_rank=%d tp_rank=%d pid=%d" % (gpu_id, pp_rank, tp_rank, proc.pid))

    check_interval = _timing.interval_s("DAEMON_CHECK")
    start_time = time.time()
    for pp_rank, tp_rank in ranks:
        gpu_id = _gpu_of(server_args, pp_rank, tp_rank, pp_per_node, tp_per_node)
        ready_path = get_ready_path(_platform.get_device_uuid(gpu_id))
        while not os.path.exists(ready_path):
            time.sleep(check_interval)
            if time.time() - start_time > timeout:
                logger.error("Weight cache daemon pp_rank=%d tp_rank=%d did not become ready within %ss"
                             % (pp_rank, tp_rank, timeout))
                for p in procs:
                    p.terminate()
                raise TimeoutError("Weight cache daemon pp_rank=%d tp_rank=%d did not become ready within %ss"
                                   % (pp_rank, tp_rank, timeout))
            for p in procs:
                if not p.is_alive():
                    logger.error("Weight cache daemon exited prematurely with code %s" % p.exitcode)
                    for other in procs:
                        if other.is_alive():
                            other.terminate()
                    raise RuntimeError("Weight cache daemon exited prematurely with code %s" % p.exitcode)
        logger.info("Weight cache daemon pp_rank=%d tp_rank=%d is ready" % (pp_rank, tp_rank))
    logger.info("All %d weight cache daemons on node %d are ready (pp_ranks=%d..%d, tp_ranks=%d..%d, "
                "dist_init_method=%s)" % (len(procs), int(server_args.get("node_rank") or 0), pp_rank_range.start,
                                          pp_rank_range.stop - 1, tp_rank_range.start, tp_rank_range.stop - 1,
                                          dist_init_method))

    monitor = _timing.interval_s("DAEMON_MONITOR")
    exited = None
    try:
        while exited is None:
            for proc in procs:
                if not proc.is_alive():
                    exited = proc
                    break
            else:
                time.sleep(monitor)
                continue
    except KeyboardInterrupt:
        logger.info("Received KeyboardInterrupt, shutting down daemons")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        logger.info("All weight cache daemons have been terminated")
    if exited is not None:
        raise RuntimeError("Weight cache daemon (pid=%d) exited with code %s; terminated the remaining daemons."
                           % (exited.pid, exited.exitcode))


def main(argv=None):
    _timing.spend("IMPORT")  # SGLang's daemon imports torch and the model loader before it parses
    worker_parser = argparse.ArgumentParser(add_help=False)
    WeightCacheDaemonArgs.add_cli_args(worker_parser)
    worker_ns, server_argv = worker_parser.parse_known_args(sys.argv[1:] if argv is None else argv)

    from sglang.launch_server import resolve_server_args  # noqa: PLC0415
    from sglang.srt.server_args import prepare_server_args  # noqa: PLC0415

    server_args = resolve_server_args(prepare_server_args(server_argv, prog="sglang serve"))
    daemon_args = WeightCacheDaemonArgs.from_cli_args(worker_ns)
    if daemon_args.gpu_id is not None or daemon_args.tp_rank is not None:
        gpu_id = daemon_args.gpu_id if daemon_args.gpu_id is not None else daemon_args.tp_rank
        tp_rank = daemon_args.tp_rank if daemon_args.tp_rank is not None else daemon_args.gpu_id
        cleanup_stale_daemon_files(_platform.get_device_uuid(gpu_id), force=daemon_args.force)
        run_weight_cache_daemon(server_args, gpu_id=gpu_id, tp_rank=tp_rank, pp_rank=daemon_args.pp_rank,
                                dist_init_method=daemon_args.dist_init_method)
    else:
        launch_weight_cache_daemons(server_args, dist_init_method=daemon_args.dist_init_method,
                                    timeout=daemon_args.timeout, force=daemon_args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
