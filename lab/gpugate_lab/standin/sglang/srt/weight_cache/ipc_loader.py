"""The stand-in's ``sglang.srt.weight_cache.ipc_loader``: an engine rank's load with
``--weight-cache-mode client`` (or ``daemon``), as SGLang 0.5.23's ``IpcModelLoader`` does it.

1. ``check_ipc_quant_support(..., where="client")`` first: an unsupported quantization raises whatever
   the daemon's state (``UnsupportedQuantForIPCError``).
2. The socket: ``--weight-cache-socket`` when given (for every rank: SGLang passes the one path to each
   rank's loader), else the template with this rank's GPU UUID. ``lstat`` says missing: log
   "[IpcModelLoader] Daemon socket not found at P." and return None (client: "Weight cache not available
   or config mismatch, falling back to disk load" and the disk load; daemon mode: RuntimeError). Not a
   socket, or not ours: RuntimeError. Connection refused (a stale socket file): RuntimeError "... exists
   at P but refused the connection. The daemon may have crashed after creating the socket. Check daemon
   logs." Any other connect failure, protocol or transfer error: RuntimeError.
3. ``fetch_state`` with this rank's CacheConfig; a reply other than ok: RuntimeError "[IpcModelLoader]
   Daemon config mismatch!" with both configs (never a disk load).
4. Success: the tensors are mapped (zero copy; the stand-in spends ``$SGLANG_STANDIN_IPC_MAP_S`` here
   instead of the disk load's ``$SGLANG_STANDIN_WEIGHT_LOAD_S``) and a watchdog thread polls the daemon's
   pid (SGLang every 5 s; ``$SGLANG_STANDIN_DAEMON_LIVENESS_S``, default 0.1) and SIGKILLs this process
   the moment it is gone, with SGLang's critical line.
"""

import os
import signal
import socket as socket_mod
import stat
import threading
import time

from sglang import _platform, _timing
from sglang.srt.weight_cache.protocol import (build_cache_config, check_ipc_quant_support, get_socket_path,
                                              model_config, recv_msg, resolve_quant, send_msg)
from sglang.srt.weight_cache.transport import TORCH_IPC_BACKEND, get_client_transport_backend

_DAEMON_LIVENESS_POLL_INTERVAL = 5.0  # SGLang's; the stand-in's: _timing.interval_s("DAEMON_LIVENESS")


class IpcModelLoader:
    def __init__(self, socket_path=None, weight_cache_mode="client"):
        self.socket_path = socket_path
        self.weight_cache_mode = weight_cache_mode
        self.preloaded_weights_bytes = 0
        self._transport_backend = get_client_transport_backend(TORCH_IPC_BACKEND)

    def load_model(self, server_args, gpu_id, tp_rank, pp_rank, log, disk_load):
        """The weights of this rank: ``{"via": "ipc", "tensors", "pid", ...}`` from the daemon, or what
        ``disk_load()`` returns on the fallback. ``log(message)`` writes the scheduler's log."""
        self.preloaded_weights_bytes = 0
        tic = time.perf_counter()
        model = model_config(server_args)
        quant_method, quant_config = resolve_quant(server_args, model)
        check_ipc_quant_support(quant_method, quant_config, where="client")
        cache_data = self._fetch_from_cache(server_args, gpu_id, tp_rank, pp_rank, model, log)
        if cache_data is None:
            if self.weight_cache_mode == "daemon":
                raise RuntimeError(
                    "[IpcModelLoader] Weight cache daemon not available at %s. In daemon mode, fallback to disk "
                    "loading is disabled because the daemon process already holds weights on the same GPU — "
                    "loading from disk would cause OOM. Please ensure the weight cache daemon is running and "
                    "the config matches." % self.socket_path)
            log("[IpcModelLoader] Weight cache not available or config mismatch, falling back to disk load")
            return disk_load()
        entries = cache_data["entries"]
        preloaded = cache_data.get("preloaded_weights_bytes", 0)
        if preloaded is None:
            preloaded = 0
        if isinstance(preloaded, bool) or not isinstance(preloaded, int) or preloaded < 0:
            raise RuntimeError("[IpcModelLoader] Daemon returned invalid weight-memory metadata: "
                               "preloaded_weights_bytes=%r" % (preloaded,))
        log("[IpcModelLoader] Fetched %d tensors from daemon (transport=%s) in %.2fs"
            % (len(entries), self._transport_backend.name, time.perf_counter() - tic))
        map_tic = time.perf_counter()
        tensors = {name: self._transport_backend.import_tensor(entry) for name, entry in entries.items()}
        _timing.spend("IPC_MAP")
        map_elapsed = time.perf_counter() - map_tic
        log("[IpcModelLoader] Zero-copy: mapped %d tensors (0 new post-quant), time=%.3fs" % (len(tensors), map_elapsed))
        self.preloaded_weights_bytes = preloaded
        self._start_daemon_liveness_watchdog(cache_data.get("pid"), log)
        log("[IpcModelLoader] Loaded model via IPC (mode=%s), total=%.2fs"
            % (self.weight_cache_mode, time.perf_counter() - tic))
        return {"via": "ipc", "tensors": tensors, "pid": cache_data.get("pid"), "map_s": round(map_elapsed, 3),
                "preloaded_weights_bytes": preloaded, "socket": self.socket_path}

    def _start_daemon_liveness_watchdog(self, daemon_pid, log):
        if not daemon_pid or daemon_pid <= 0:
            log("[IpcModelLoader] Daemon did not report a PID; skipping the daemon-liveness watchdog. A daemon "
                "crash will not be detected.")
            return
        interval = _timing.interval_s("DAEMON_LIVENESS")

        def _daemon_alive(pid):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True

        def _watch():
            while True:
                time.sleep(interval)
                if not _daemon_alive(daemon_pid):
                    log("[IpcModelLoader] Weight cache daemon (pid=%d) died while this engine holds its weights "
                        "via CUDA IPC. The mapped weight pointers are now dangling; continuing would read freed "
                        "GPU memory. Terminating this process." % daemon_pid)
                    os.kill(os.getpid(), signal.SIGKILL)
                    return

        threading.Thread(target=_watch, name="weight-cache-daemon-watchdog", daemon=True).start()
        log("[IpcModelLoader] Started daemon-liveness watchdog for pid=%d" % daemon_pid)

    def _fetch_from_cache(self, server_args, gpu_id, tp_rank, pp_rank, model, log):
        if self.socket_path is None:
            self.socket_path = get_socket_path(_platform.get_device_uuid(int(gpu_id)))
        try:
            st = os.lstat(self.socket_path)
        except FileNotFoundError:
            log("[IpcModelLoader] Daemon socket not found at %s." % self.socket_path)
            return None
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
            raise RuntimeError("[IpcModelLoader] Refusing to connect: %s is not a socket owned by this user."
                               % self.socket_path)
        sock = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM)
        try:
            sock.settimeout(30)
            sock.connect(self.socket_path)
        except FileNotFoundError:
            sock.close()
            return None
        except ConnectionRefusedError:
            sock.close()
            raise RuntimeError(
                "[IpcModelLoader] Daemon socket exists at %s but refused the connection. The daemon may have "
                "crashed after creating the socket. Check daemon logs." % self.socket_path)
        except Exception as e:
            sock.close()
            raise RuntimeError("[IpcModelLoader] Failed to connect to daemon at %s: %s" % (self.socket_path, e))
        try:
            engine_config = build_cache_config(server_args, tp_rank, pp_rank, model)
            log("[IpcModelLoader] Requesting weights from daemon at %s with config: model=%s, arch=%s, tp=%s/%s, "
                "quant=%s, dtype=%s" % (self.socket_path, engine_config.model_path, engine_config.model_arch,
                                        engine_config.tp_size, engine_config.tp_rank, engine_config.quant_method,
                                        engine_config.dtype))
            send_msg(sock, {"type": "fetch_state", "config": engine_config.to_dict()})
            result = recv_msg(sock)
            if result.get("status") != "ok":
                raise RuntimeError("[IpcModelLoader] Daemon config mismatch!\n  Engine config: %s\n  Daemon config: %s"
                                   % (engine_config.to_dict(), result.get("daemon_config", {})))
            self._transport_backend = get_client_transport_backend(result.get("transport_backend", TORCH_IPC_BACKEND))
            return self._transport_backend.recv_fetch_state_response(sock, result)
        except RuntimeError:
            raise
        except Exception as e:
            raise RuntimeError("[IpcModelLoader] Error communicating with daemon at %s: %s" % (self.socket_path, e))
        finally:
            sock.close()
