"""``VLLM::EngineCore``: the engine process of the vLLM stand-in (vllm/v1/engine/core.py
``EngineCoreProc.run_engine_core``), started by the API server (vllm/v1/engine/utils.py
``CoreEngineProcManager``) with a channel (a socket pair) for requests and outputs.

- it sets its title and installs its SIGTERM/SIGINT handler first; a signal during the load is only
  recorded ("[shutdown] EngineCore: trigger received signal=SIGTERM") and applied once the engine
  is built: the load goes on (the API server's process manager kills it when its window ends);
- the executor: one GPU, the uniprocess executor: the model and its memory are in this process;
  more, the multiprocess executor: one ``VLLM::Worker[_PP<p>][_TP<t>]`` per rank (vllm/_worker.py),
  each with a death pipe from this process; a worker that dies fails the engine;
- the load: the ranks' memory (vllm/_model.py), then ``$VLLM_STANDIN_LOAD_S`` (default 1.0; 0 in real
  mode) from the API server's start with all of it held (lab fault slow-start read again while
  loading; crash-on-start: "EngineCore failed to start." halfway, exit 1); KV offload's CPU region
  (below); then "GPU KV cache size: N tokens, Maximum concurrency for M tokens per request: Cx"
  (vllm/v1/core/kv_cache_utils.py, N with thousands separators) and "init engine (profile, create kv
  cache, warmup model) took T s", and READY to the API server with the cache's figures;
- NO parent-death watch (0.33.0, vllm#55510): the API server gone (SIGKILL), EngineCore and its
  workers keep every GPU; the channel's end goes unread;
- the busy loop (``run_busy_loop``, ``_handle_shutdown``): every running request advances one token per
  ``$VLLM_STANDIN_TOKEN_S`` (default 0.002 s). SIGTERM: "[shutdown] EngineCore: start mode=abort|drain
  timeout=Ns"; abort (``--shutdown-timeout 0``): every unfinished request is finished with an abort
  output ("aborting in-flight requests count=N"); drain: they run on ("draining in-flight requests
  count=N timeout=Ns"); either way a new request is rejected with an abort output
  (``_reject_add_in_shutdown``); with no work left: "request processing complete; starting resource
  teardown", the workers' death pipes closed (they exit), exit 0. The deadline is the API server's
  (its process manager kills this tree when the window ends);
- KV offload (``--kv-offloading-size GiB``, native backend, or ``--kv-transfer-config`` with the
  OffloadingConnector): ``/dev/shm/vllm_offload_<engine_id>.mmap`` (vllm/v1/kv_offload/cpu/
  shared_offload_region.py; the engine id a new uuid4 unless the transfer config names one), created
  O_EXCL (an existing one is joined: its size awaited up to 30 s), after vLLM's free-space check
  (vllm/distributed/device_communicators/shm_broadcast.py ``check_shm_free_space``: "Insufficient space
  in /dev/shm for CPU KV offload shared region in /dev/shm: X MiB required, Y MiB free. ..."). The
  default CPUOffloadingSpec unlinks it once every worker has mapped it (PR #52596's barrier); the
  TieringOffloadingSpec (``"spec_name": "TieringOffloadingSpec"``) passes no barrier (vllm#57303): the
  file stays while the engine runs, a clean teardown removes it ("Removed mmap file ..."), a crash or
  SIGKILL leaves it, and it takes /dev/shm's room from every later start: with a /dev/shm too small for
  two, each start fails the check (vllm#54002's crash loop). The stand-in's file is sparse (nothing
  written); the check counts it at its full size, as the real one is pre-faulted.
  ``$VLLM_STANDIN_SHM_DIR`` (default /dev/shm) and ``$VLLM_STANDIN_SHM_MIB`` (a size for it) for tests.
"""

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from vllm import _lab, _model
from vllm._lab import common, gpusim, real

MIB = 1 << 20
GIB = 1 << 30


class Shutdown:
    RUNNING, REQUESTED, SHUTTING_DOWN = "running", "requested", "shutting_down"


# ---------------------------------------------------------------- KV offload's region in /dev/shm
def shm_dir():
    return os.environ.get("VLLM_STANDIN_SHM_DIR") or "/dev/shm"


def shm_free_bytes(folder):
    """What vLLM's check sees free, the stand-in's sparse regions counted as the populated ones they
    stand for (and ``$VLLM_STANDIN_SHM_MIB``, a size for the folder, when set)."""
    ours = []
    for name in os.listdir(folder):
        if name.startswith("vllm_offload_"):
            try:
                ours.append(os.stat(os.path.join(folder, name)))
            except OSError:
                pass
    free = shutil.disk_usage(folder).free - sum(max(0, s.st_size - s.st_blocks * 512) for s in ours)
    cap = os.environ.get("VLLM_STANDIN_SHM_MIB")
    if cap:
        free = min(free, int(float(cap) * MIB) - sum(s.st_size for s in ours))
    return max(0, free)


class OffloadRegion:
    def __init__(self, settings):
        self.path = os.path.join(shm_dir(), "vllm_offload_%s.mmap" % settings["engine_id"])
        self.size = int(settings["bytes"])
        self.creator = False
        try:
            self.fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            self.fd = os.open(self.path, os.O_RDWR)
            deadline = time.monotonic() + 30.0
            while os.fstat(self.fd).st_size < self.size:
                if time.monotonic() > deadline:
                    raise TimeoutError("Timed out waiting for mmap file to reach %d bytes" % self.size)
                time.sleep(0.005)
            _lab.info("shared_offload_region.py:160", "Opened existing mmap file %s" % self.path)
        else:
            self.creator = True
            try:
                free = shm_free_bytes(shm_dir())
                if self.size > free:
                    raise RuntimeError("Insufficient space in %s for CPU KV offload shared region in /dev/shm: "
                                       "%.0f MiB required, %.0f MiB free. Increase %s (e.g. --shm-size or "
                                       "--ipc=host)." % (shm_dir(), self.size / MIB, free / MIB, shm_dir()))
                os.ftruncate(self.fd, self.size)
            except BaseException:
                self.unlink()
                raise
            _lab.info("shared_offload_region.py:182", "Created mmap file %s (%.2f GB)" % (self.path, self.size / 1e9))
        if settings["spec"] == "CPUOffloadingSpec" and self.creator:  # the workers' barrier, then unlink
            self.unlink()
            _lab.info("shared_offload_region.py:198", "Unlinked mmap file %s" % self.path)

    def unlink(self):
        self.creator = False
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def cleanup(self):
        if self.creator:
            self.unlink()
            _lab.info("shared_offload_region.py:450", "Removed mmap file %s" % self.path)


# ---------------------------------------------------------------- the executor
class Executor:
    """The ranks: in this process (one GPU) or one worker process each."""

    def __init__(self, job):
        self.job = job
        self.plan, self.ranks, self.mode = job["plan"], job["ranks"], job.get("real")
        self.local = None  # uniprocess: (memory or RealRank)
        self.workers = common.Children()
        self.workers.died = "Worker failed to start"
        self.death_writers = []
        self.reports = []
        self.failed = threading.Event()

    def start(self):
        log = lambda m: _lab.info("gpu_worker.py:310", m)  # noqa: E731
        if len(self.ranks) == 1:
            if self.mode:
                self.local = _model.RealRank(self.ranks[0], self.plan, self.mode, log)
                self.reports = [self.local.report]
            else:
                self.local, report = _model.load_sim(self.ranks[0], self.plan, log)
                self.reports = [report]
            return
        for rank in self.ranks:
            reader, writer = os.pipe()
            job = {"title": rank["title"], "rank": rank, "plan": self.plan, "death_fd": reader, "real": self.mode}
            self.workers.start(rank["title"], "vllm._worker", job, "VLLM_STANDIN_WORKER", pass_fds=(reader,),
                               stdin=subprocess.PIPE if self.mode else subprocess.DEVNULL)
            os.close(reader)
            self.death_writers.append(writer)
        error = self.workers.wait_ready()
        if error:
            raise RuntimeError(error)
        self.reports = self.workers.reports
        common.thread(self._monitor, name="MultiprocWorkerMonitor")

    def _monitor(self):
        while not self.workers.stopping:
            for index, proc in enumerate(self.workers.procs):
                if proc.poll() is not None and not self.workers.stopping:
                    _lab.error("multiproc_executor.py:316", "Worker proc VllmWorker-%d died unexpectedly, "
                               "shutting down executor." % index)
                    self.failed.set()
                    return
            time.sleep(0.1)

    def generate(self, ids, n):
        if isinstance(self.local, _model.RealRank):
            return self.local.generate(ids, n)
        out = real.RealWorkers(self.workers.procs).generate(real.decode(ids), n)
        return out["ids"]

    def shutdown(self):
        """Close the death pipes (the workers exit on their EOF), then SIGKILL what is left."""
        self.workers.stopping = True
        for fd in self.death_writers:
            os.close(fd)
        self.death_writers = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(p.poll() is None for p in self.workers.procs):
            time.sleep(0.02)
        if any(p.poll() is None for p in self.workers.procs) and not gpusim.read_faults().get("orphan-worker"):
            _lab.warning("multiproc_executor.py:600", "[shutdown] Executor: workers still running after SIGTERM; "
                         "sending SIGKILL count=%d" % sum(p.poll() is None for p in self.workers.procs))
            self.workers.kill()


# ---------------------------------------------------------------- the engine
class Engine:
    def __init__(self, channel, executor, token_s, faults=None):
        self.channel, self.executor, self.base_token_s = channel, executor, token_s
        self.faults = faults if faults is not None else common.ServerFaults(owned={})  # slow-decode, error-rate
        self.state = Shutdown.RUNNING
        self.inputs = queue.Queue()
        self.running = {}
        self.lock = threading.Lock()
        self.shutdown_timeout = int(executor.plan["shutdown_timeout"])

    def send(self, message):
        with self.lock:
            try:
                self.channel.sendall((json.dumps(message) + "\n").encode())
            except OSError:
                pass  # the API server is gone: nobody reads, the engine goes on (no parent watch)

    def read_channel(self):
        with self.channel.makefile("rb") as lines:
            for line in lines:
                try:
                    self.inputs.put(json.loads(line))
                except ValueError:
                    continue

    def abort_output(self, rid, done):
        self.send({"type": "out", "rid": rid, "n": done, "delta": "", "finished": True, "finish_reason": "abort"})

    def handle_shutdown(self):
        if self.state == Shutdown.RUNNING:
            return True
        if self.state == Shutdown.REQUESTED:
            mode = "abort" if self.shutdown_timeout == 0 else "drain"
            _lab.info("core.py:1712", "[shutdown] EngineCore: start mode=%s timeout=%ds" % (mode, self.shutdown_timeout))
            if self.running:
                if mode == "abort":
                    _lab.info("core.py:1721", "[shutdown] EngineCore: aborting in-flight requests count=%d"
                              % len(self.running))
                    for rid, request in list(self.running.items()):
                        self.abort_output(rid, request["done"])
                    self.running.clear()
                else:
                    _lab.info("core.py:1732", "[shutdown] EngineCore: draining in-flight requests count=%d "
                              "timeout=%ds" % (len(self.running), self.shutdown_timeout))
            self.state = Shutdown.SHUTTING_DOWN
        if not self.running:
            _lab.info("core.py:1743", "[shutdown] EngineCore: request processing complete; starting resource teardown")
            return False
        return True

    def handle(self, message):
        if message.get("type") == "add":
            rid = message["rid"]
            if self.state != Shutdown.RUNNING:  # _reject_add_in_shutdown
                self.abort_output(rid, 0)
                return
            if self.faults.fails_next():  # lab fault error-rate: the request fails in the engine
                self.send({"type": "out", "rid": rid, "n": 0, "delta": "", "finished": True, "finish_reason": "error"})
                return
            n = max(0, int(message.get("max_tokens") or 0))
            ids = self.executor.generate(real.encode(message.get("prompt") or ""), n) if self.executor.mode else None
            self.running[rid] = {"n": len(ids) if ids is not None else n, "done": 0, "ids": ids,
                                 "due": time.monotonic(), "piece": message.get("piece")}
            if self.running[rid]["n"] == 0:
                self.send({"type": "out", "rid": rid, "n": 0, "delta": "", "finished": True, "finish_reason": "length"})
                del self.running[rid]
        elif message.get("type") == "abort":
            self.running.pop(message.get("rid"), None)

    @property
    def token_s(self):
        """The decode time of one token: ``$VLLM_STANDIN_TOKEN_S`` x lab fault slow-decode's factor."""
        return self.base_token_s * self.faults.slowdown()

    def step(self):
        """One token for every running request, at its due time."""
        now = time.monotonic()
        due = min(r["due"] for r in self.running.values()) + self.token_s
        if due > now:
            time.sleep(min(due - now, 0.05))
        now = time.monotonic()
        for rid, request in list(self.running.items()):
            if request["due"] + self.token_s > now:
                continue
            request["due"] += self.token_s
            request["done"] += 1
            ids = request["ids"]
            # through an adapter: its dir's name per token (the API server's _lora.py), so a client can tell
            delta = request["piece"] or (real.decode(ids[request["done"] - 1:request["done"]]) if ids is not None
                                         else " lab")
            finished = request["done"] >= request["n"]
            self.send({"type": "out", "rid": rid, "n": request["done"], "delta": delta, "finished": finished,
                       "finish_reason": "length" if finished else None})
            if finished:
                del self.running[rid]

    def run_busy_loop(self):
        while self.handle_shutdown():
            if self.executor.failed.is_set():
                raise RuntimeError("Executor failed.")
            try:
                block = not self.running
                message = self.inputs.get(timeout=0.05) if block else self.inputs.get_nowait()
                self.handle(message)
                while not self.inputs.empty():
                    self.handle(self.inputs.get_nowait())
            except queue.Empty:
                pass
            if self.running:
                self.step()


def main():
    job = json.loads(os.environ.pop("VLLM_STANDIN_ENGINE"))
    title = job["title"]
    common.set_comm(title)
    _lab.decorate_logs(title.split("::", 1)[-1])
    channel = socket.socket(fileno=int(job["channel_fd"]))
    engine = None
    requested = []

    def on_signal(signum, frame):
        _lab.info("core.py:1525", "[shutdown] EngineCore: trigger received signal=%s" % signal.Signals(signum).name)
        requested.append(signum)
        if engine is not None:
            engine.state = Shutdown.REQUESTED

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    executor = Executor(job)
    region = None
    try:
        began = time.monotonic()
        executor.start()
        faults = gpusim.read_faults()
        load_s = float(faults.get("slow-start") or job["load_s"])
        if faults.get("crash-on-start"):
            if job.get("offload"):
                region = OffloadRegion(job["offload"])
            time.sleep(max(0.0, load_s / 2 - (time.monotonic() - job["started"])))
            raise RuntimeError("CUDA error: an illegal memory access was encountered (lab fault crash-on-start)")
        common.wait_load(job["started"], load_s, bool(faults.get("slow-start")), "VLLM_STANDIN_LOAD_S")
        if job.get("offload"):
            region = OffloadRegion(job["offload"])
        plan = executor.plan
        blocks = min(r["kv_bytes"] // (plan["block_size"] * r["token_bytes"]) for r in executor.reports)
        tokens = blocks * plan["block_size"]
        _lab.info("kv_cache_utils.py:1148", "GPU KV cache size: %s tokens, Maximum concurrency for %s tokens per "
                  "request: %.2fx" % (format(tokens, ","), format(plan["max_model_len"], ","),
                                      tokens / float(plan["max_model_len"])))
        _lab.info("core.py:413", "init engine (profile, create kv cache, warmup model) took %.2f s"
                  % (time.monotonic() - began))
    except Exception as exc:  # noqa: BLE001 -- vLLM logs it and the process exits 1
        _lab.exception("core.py:1586", "EngineCore failed to start.", exc)
        executor.workers.kill()
        sys.exit(1)
    engine = Engine(channel, executor, _lab.seconds("VLLM_STANDIN_TOKEN_S", 0.002),
                    common.ServerFaults(owned=job.get("server_faults") or {}))
    if requested:
        engine.state = Shutdown.REQUESTED
    engine.send({"type": "ready", "num_gpu_blocks": blocks, "block_size": plan["block_size"], "kv_cache_tokens": tokens,
                 "max_concurrency": round(tokens / float(plan["max_model_len"]), 2)})
    common.thread(engine.read_channel, name="EngineCoreInput")
    try:
        engine.run_busy_loop()
    except Exception as exc:  # noqa: BLE001
        _lab.exception("core.py:1592", "EngineCore encountered a fatal error.", exc)
        executor.workers.kill()
        sys.exit(1)
    _lab.info("core.py:1573", "[shutdown] EngineCore: exiting busy loop")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    executor.shutdown()
    if region is not None:
        region.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
