"""``python3 -m sglang.launch_server``: the lab's SGLang stand-in (stdlib only).

What it copies from SGLang (shared/reference/sglang-lifecycle.md):

- SGLang's parser (``sglang/srt/server_args.py``, from a snapshot of one release's flag table,
  ``gpugate lab up --sglang-version``): a bad flag exits 2 with
  argparse's message. The model path must be a local dir with config.json or an HF id ``org/name``.
- process tree: this process (cmdline unchanged) spawns ``sglang::scheduler_TP<i>`` per TP rank (plain
  ``sglang::scheduler`` when tp=1) and ``sglang::detokenizer``; each scheduler holds context +
  ``mem_fraction_static`` x total MiB (its weights, then its KV pool) on device ``base_gpu_id +
  i*gpu_id_step`` (a physical GPU through ``CUDA_VISIBLE_DEVICES``) and fails with
  "RuntimeError: Not enough memory..." when that is not free. Workers die with their parent.
- each scheduler's start in SGLang's order (sglang/_scheduler.py): CUDA context on its GPU (through
  ``CUDA_VISIBLE_DEVICES`` as CUDA maps it), distributed init, the gated launch's wait, weights (the
  disk load, or the weight-cache daemon's mapped), KV pool, CUDA graphs; each phase's time an env var
  (sglang/_timing.py: ``SGLANG_STANDIN_IMPORT_S``, ``_DIST_INIT_S``, ``_WEIGHT_LOAD_S``, ``_IPC_MAP_S``,
  ``_KV_ALLOC_S``, ``_GRAPH_CAPTURE_S``, all 0 by default, with the real figures they stand for);
- ``--weight-cache-mode client`` (srt/weight_cache/ipc_loader.py): each rank asks the daemon on its GPU
  (``python3 -m sglang.srt.weight_cache.daemon``, srt/weight_cache/daemon.py) for its weights: no socket
  -> "[IpcModelLoader] Daemon socket not found at P." and the disk load; a refused socket, another
  CacheConfig, a quantization not verified for IPC -> the start fails with SGLang's RuntimeError; mapped
  -> the rank holds context + KV only and SIGKILLs itself the moment the daemon's pid is gone (the
  SubprocessWatchdog below then takes the tree down). ``--weight-cache-mode daemon``: this process
  first spawns its own daemons (engine.py's ``_launch_weight_cache_daemons``), which die with it;
- ``--gated-launch-port P`` (srt/distributed/gated_launch.py): after the distributed init the rank-0
  scheduler serves ``GET /health`` and ``POST /gate/activate`` on --host:P and every rank waits, holding
  only its CUDA context, until activated; SIGTERM meanwhile: the default action, as during any load;
- loading (``$SGLANG_STANDIN_LOAD_S``, default 1.0: the least time from the start to the port's bind,
  a gate's wait not counted, whatever the phases above leave of it spent with all the memory held;
  fault ``slow-start=S``, read again while loading: its clearing ends the load) with the port closed, then
  HTTP: /health 503 until a warmup /generate succeeded, then 200 ("The server is fired up and ready
  to roll!"); /health_generate; /get_server_info and /server_info (resolved args + version);
  /get_model_info; /v1/models; POST /generate, /v1/completions, /v1/chat/completions, /flush_cache.
- SIGTERM during load: default action (dies; SGLang's handler is installed only with the tokenizer
  manager's event loop). SIGTERM when serving: SGLang 0.5.23's graceful drain
  (tokenizer_manager.py ``sigterm_watchdog``): "SIGTERM received. signum=None frame=None. Draining
  requests and shutting down..." (``loop.add_signal_handler`` calls the handler without arguments);
  /health turns 503 at once, but new requests are still admitted (``generate_request`` has no check
  on the drain flag); the watchdog notices the SIGTERM on its next tick (every
  ``$SGLANG_STANDIN_DRAIN_TICK_S``, SGLang's 5 s; default 0.05 here so the suite stays fast), then looks
  at the remaining requests every tick ("Gracefully exiting... Remaining number of requests N.
  Remaining requests remaining_rids=[...]." on each look in SGLang, at most every 5 s here, and the
  last one with 0) until none is left, then the schedulers take ``$SGLANG_STANDIN_SCHEDULER_EXIT_S``
  (default 0; SGLang waits up to ``_SCHEDULER_EXIT_TIMEOUT_SECS`` = 15 s for them) before the tree is
  killed (an engine's own weight-cache daemons with it) and it exits 0.
- /metrics (with ``--enable-metrics``, as SGLang mounts it; sglang/_collector.py): the scheduler's
  gauges, the tokenizer's counters and histograms of the requests served (time to first token,
  inter-token latency, end-to-end latency, requests, tokens, aborts) timed as the answers are really
  sent, and ``sglang:http_responses_total``; /get_load; /ready (200 iff healthy, no generation); /version.
- a dead child (a scheduler SIGKILLed, ``fuser -k`` of the GPU device files from the Proxmox host):
  SGLang's SubprocessWatchdog notices within 1 s ("Subprocess scheduler_0 (pid=N) crashed with exit
  code -9. Triggering SIGQUIT for cleanup..."), the SIGQUIT handler ("It usually means one child
  failed.") runs kill_process_tree: every child and the main process are SIGKILLed, so /health
  stops answering instead of saying 200 over dead workers.
- live changes (sglang/_live.py, from 0.5.23's http_server.py, tokenizer_manager.py,
  tokenizer_control_mixin.py, lora/ and model_runner_components/weight_updater.py):
  ``POST /update_weights_from_disk`` under the writer side of the model lock (the requests under way
  finish first, new ones wait while it loads, ``$SGLANG_STANDIN_WEIGHT_UPDATE_S``), 400 and the old
  weights on a load that fails before writing, the whole server killed by a scheduler exception on
  weights of other shapes or with the weight cache on; ``/load_lora_adapter``, ``/unload_lora_adapter``
  with the ``--enable-lora``/``--max-lora-rank``/``--lora-target-modules``/``--lora-paths`` rules; adapters
  in ``/v1/models``; generation through ``lora_path`` or ``model: "<served>:<adapter>"``; the moved
  ``model_path``/``served_model_name``/``weight_version`` in ``/model_info`` and ``/v1/models``.
- the start logs ``server_args=ServerArgs(...)`` with every argument, ``api_key`` included, as SGLang
  does (what gpugate's log redaction has to handle).

Lab faults ($GPUGATE_LAB_CTL/faults.json): ignore-sigterm (drains forever), crash-on-start (exit 1 with
a traceback during load), never-healthy (/health stays 503), slow-start=S, orphan-worker and
stuck-memory (in the workers), weights-load-fails[=PATH] and weights-cannot-generate[=PATH] (a live
weight update's, sglang/_live.py); slow-decode=FACTOR (every token, the first too, takes FACTOR x as
long) and error-rate=P (a share P of the generations, the warmup's never, fail with SGLang's 500 of a
scheduler abort), both of ONE server: the first started since the fault was set (gpugate_standin's
ServerFaults).

Generation takes ``max_new_tokens x $SGLANG_STANDIN_TOKEN_S`` (default 0.002 s), so tests can keep a
request in flight across a SIGTERM. ``"stream": true`` (http_server.py ``generate_request``,
openai/serving_chat.py, serving_completions.py) answers with server-sent events (the lab's shared
writer, standin/_sse.py), one per decoded token at that rate: on /generate ``data: {"text": <the text
so far>, "meta_info": {...}}``, on the OpenAI endpoints their ``chat.completion.chunk`` (``delta``) and
``text_completion`` chunks, the usage chunk with ``stream_options.include_usage``; then ``data:
[DONE]``. A stream is in flight (the drain waits for it) until its last byte is sent; a server killed
mid-stream leaves its chunked body unfinished, which a client reads as an error; a client gone
mid-stream aborts its request.
"""

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import sglang
from sglang import _capacity, _collector, _live, _real, _timing, _weights
from sglang._sim import common, gpusim, sse

DEFAULT_MEM_FRACTION_STATIC = 0.88
# what a scheduler needs of the server args for the weight cache's key (weight_cache/protocol.py)
CACHE_ARG_KEYS = ("model_path", "tp_size", "pp_size", "dp_size", "ep_size", "moe_dp_size", "enable_dp_attention",
                  "enable_dp_lm_head", "attn_cp_size", "moe_dense_tp_size", "moe_a2a_backend", "quantization",
                  "dtype", "revision", "weight_cache_timeout")
HF_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


_emit = common.emit  # SGLang and uvicorn log through `logging`, which swallows an OSError


def log(message: str, prefix: str = "") -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    _emit("[%s%s] %s\n" % (stamp, " " + prefix if prefix else "", message))


def uvicorn_log(message: str) -> None:
    _emit("INFO:     %s\n" % message)


def log_traceback(where: str, exc_line: str) -> None:
    sys.stderr.write(
        "Traceback (most recent call last):\n"
        '  File "<frozen runpy>", line 198, in _run_module_as_main\n'
        '  File "/usr/lib/python3/dist-packages/sglang/launch_server.py", line 29, in <module>\n'
        "    launch_server(server_args)\n"
        '  File "/usr/lib/python3/dist-packages/sglang/srt/entrypoints/http_server.py", line 1180, '
        "in launch_server\n"
        "    tokenizer_manager, template_manager, scheduler_info, *_ = _launch_subprocesses(\n"
        '  File "/usr/lib/python3/dist-packages/sglang/srt/entrypoints/engine.py", line 900, in %s\n'
        "%s\n" % (where, exc_line))
    sys.stderr.flush()


def build_parser():
    """SGLang's parser: ``sglang.srt.server_args.ServerArgs.add_cli_args``, rebuilt from the snapshot of
    SGLang's flag table installed with the stand-in (never gpugate's own validation)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="launch_server.py")
    ServerArgs.add_cli_args(parser)
    return parser


def model_path_error(path: str):
    """SGLang's failure for a model path that is neither a local model dir nor an HF repo id; None if ok."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return None
        return ("OSError: %s does not appear to have a file named config.json. Checkout "
                "'https://huggingface.co/%s/tree/None' for available files." % (path, path))
    if os.path.exists(path):
        return "OSError: %s is not a directory" % path
    if HF_REPO_ID.match(path) and ".." not in path:
        return None
    return ("huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name' or "
            "'namespace/repo_name': '%s'. Use `repo_type` argument if needed." % path)


def resolve_server_args(args) -> dict:
    """Like ServerArgs.__post_init__: fill the defaults SGLang computes (what /server_info reports)."""
    d = dict(vars(args))
    # ServerArgs.from_cli_args of releases whose parser stores the long names (0.5.10: the dest of
    # "--tensor-parallel-size", "--tp-size" is tensor_parallel_size): the fields are the short ones.
    for long_name, field in (("tensor_parallel_size", "tp_size"), ("pipeline_parallel_size", "pp_size"),
                             ("attention_context_parallel_size", "attn_cp_size"),
                             ("moe_data_parallel_size", "moe_dp_size"), ("data_parallel_size", "dp_size"),
                             ("expert_parallel_size", "ep_size")):
        if long_name in d:
            d[field] = d.pop(long_name)
    if d.get("mem_fraction_static") is None:
        d["mem_fraction_static"] = DEFAULT_MEM_FRACTION_STATIC
    if d.get("tokenizer_path") is None:
        d["tokenizer_path"] = d["model_path"]
    if d.get("served_model_name") is None:
        d["served_model_name"] = d["model_path"]
    if d.get("random_seed") is None:
        d["random_seed"] = random.randint(0, 1 << 30)
    if "chunked_prefill_size" in d and d["chunked_prefill_size"] is None:
        d["chunked_prefill_size"] = 8192
    if "device" in d and d["device"] is None:
        d["device"] = "cuda"
    d.setdefault("tp_size", 1)
    d.setdefault("dp_size", 1)
    d.setdefault("base_gpu_id", 0)
    d.setdefault("gpu_id_step", 1)
    return d


def worker_plan(server_args: dict, total_mib: int) -> list:
    """One entry per scheduler (title, log prefix, gpu, MiB) plus the detokenizer, named as SGLang names them."""
    tp, dp = int(server_args["tp_size"]), int(server_args.get("dp_size") or 1)
    mib = int(total_mib * float(server_args["mem_fraction_static"]))
    weights = _weights.weight_mib(server_args, total_mib)
    cache_args = {k: server_args.get(k) for k in CACHE_ARG_KEYS}
    mode = server_args.get("weight_cache_mode") or "off"
    plan = []
    for d in range(dp):
        for t in range(tp):
            parts = ([f"DP{d}"] if dp > 1 else []) + ([f"TP{t}"] if tp > 1 else [])
            rank = d * tp + t
            job = {
                "kind": "scheduler",
                "title": "sglang::scheduler" + ("_" + "_".join(parts) if parts else ""),
                "log_prefix": " ".join(parts) if parts else "TP0",
                "gpu": int(server_args["base_gpu_id"]) + rank * int(server_args["gpu_id_step"]),
                "mib": mib,
                "weight_mib": weights,
                "mem_fraction_static": float(server_args["mem_fraction_static"]),
                "rank": rank,
                "tp_size": tp,
                "tp_rank": t,
                "pp_rank": 0,
            }
            if mode != "off":
                job["weight_cache"] = {"mode": mode, "socket": server_args.get("weight_cache_socket")}
                job["cache_args"] = cache_args
            plan.append(job)
    plan.append({"kind": "detokenizer", "title": "sglang::detokenizer", "log_prefix": "", "gpu": None, "mib": 0})
    return plan


class Workers(common.Children):
    """The child processes; killed with SIGKILL as SGLang's kill_process_tree does."""

    died = "scheduler died during initialization"

    def __init__(self):
        common.Children.__init__(self)
        self.names = []
        self.daemons = []  # --weight-cache-mode daemon: the engine's own weight-cache daemons

    def watch(self, interval: float = 1.0) -> None:
        """SGLang's SubprocessWatchdog (srt/utils/watchdog.py): a daemon thread polls every child
        once a second; one that exited non-zero (a scheduler SIGKILLed, `fuser -k` of the GPU
        device files, an NCCL abort) makes it log the crash and SIGQUIT this process, whose
        handler kills the whole tree (on_sigquit): the server dies instead of answering /health
        200 with dead workers."""
        def loop() -> None:
            while not self.stopping:
                time.sleep(interval)
                for proc, name in zip(self.procs, self.names):
                    code = proc.poll()  # reaps: no zombie
                    if code is None or code == 0 or self.stopping:
                        continue
                    log("Subprocess %s (pid=%d) crashed with exit code %d. Triggering SIGQUIT for cleanup..."
                        % (name, proc.pid, code))
                    os.kill(os.getpid(), signal.SIGQUIT)
                    return
        threading.Thread(target=loop, daemon=True, name="subprocess-watchdog").start()

    def spawn(self, plan: list) -> None:
        for job in plan:
            # the names SGLang's engine gives its children in the watchdog: scheduler_<rank>, detokenizer
            self.names.append("scheduler_%d" % len(self.names) if job["kind"] == "scheduler" else job["kind"])
            self.start(job["title"], "sglang._scheduler", dict(job, parent_pid=os.getpid()), "SGLANG_STANDIN_WORKER",
                       pass_fds=tuple(job.get("pass_fds") or ()),
                       # real mode: generation requests go to the scheduler on its stdin (sglang/_real.py)
                       stdin=subprocess.PIPE if job.get("real") else subprocess.DEVNULL)
        for job in plan:  # the gate's pipe ends now live in the schedulers
            for fd in job.get("pass_fds") or ():
                os.close(fd)

    def kill(self) -> None:
        self.stopping = True  # our own SIGKILLs are no crash for the watchdog
        self.signal_all()
        for daemon in self.daemons:  # kill_process_tree reaches the engine's own daemons too (no cleanup)
            try:
                daemon.kill()
            except (OSError, ValueError, AttributeError):
                pass
        self.reap()


descendants = common.descendants


def kill_process_tree(parent_pid: int, include_parent: bool = True) -> None:
    """SGLang's kill_process_tree (srt/utils/common.py): SIGKILL every descendant, then the parent."""
    log("kill_process_tree called: parent_pid=%d, include_parent=%s, pid=%d"
        % (parent_pid, include_parent, os.getpid()))
    for child in descendants(parent_pid):
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass
    if include_parent:
        os.kill(parent_pid, signal.SIGKILL)


def on_sigquit(signum, frame) -> None:
    """The main process's SIGQUIT handler (engine.py / tokenizer_manager.py): a child failed, so
    the whole server goes (SGLang logs signum=None, frame=None: its handler is called directly)."""
    log("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
    kill_process_tree(os.getpid())


class State:
    def __init__(self, server_args: dict, live=None, faults=None):
        self.server_args = server_args
        self.faults = faults if faults is not None else common.ServerFaults(owned={})  # slow-decode, error-rate
        self.metrics = _collector.TokenizerMetrics(server_args["served_model_name"])
        self.live = live or _live.Live(server_args, log)  # adapters and weights, changed while serving
        self.up = False
        self.draining = False
        self.inflight = 0
        self.lock = threading.Lock()
        self.token_s = float(os.environ.get("SGLANG_STANDIN_TOKEN_S", "0.002"))
        self.rid = 0
        self.rids = set()  # the in-flight requests' ids (tokenizer_manager's rid_to_state)
        self.real = None  # _real.RealWorkers in a real-GPU lab: generation is a real forward pass

    def metrics_text(self) -> str:
        """SGLang's /metrics (sglang/_collector.py): the scheduler's gauges (the stand-in runs every
        request at once, so the queue is always empty), the tokenizer's counters and histograms of the
        requests served, the HTTP answers."""
        return self.metrics.text(self.live.running)

    def token_s_now(self) -> float:
        """The decode time of one token now: ``$SGLANG_STANDIN_TOKEN_S`` x lab fault slow-decode's factor."""
        return self.token_s * self.faults.slowdown()

    def healthy(self) -> bool:
        if self.draining or not self.up:
            return False
        return not gpusim.read_faults().get("never-healthy")

    @contextlib.contextmanager
    def admitted(self):
        """One request in flight (tokenizer_manager's ``rid_to_state``), its rid: what /get_load,
        /metrics and the drain count. Held until the answer's last byte is written, so the drain never
        takes the server down under a request it already answered but has not finished sending (SGLang's
        5 s drain tick leaves that moment no chance; the stand-in's short one would)."""
        with self.lock:
            self.inflight += 1
            self.rid += 1
            rid = "%032x" % self.rid
            self.rids.add(rid)
        try:
            yield rid
        finally:
            with self.lock:
                self.inflight -= 1
                self.rids.discard(rid)

    def _output(self, rid: str, text: str, produced: int, max_new_tokens: int, began: float,
                real=None, adapter=None) -> dict:
        """What the tokenizer manager yields after ``produced`` tokens (the text so far, as SGLang's
        /generate stream sends it: not the increment); ``finish_reason`` only on the last. NaN weights
        (sglang/_live.py): one token, EOS, "NaN happened"."""
        done = produced >= max_new_tokens
        nan = self.live.nan and produced > 0
        meta = {"id": rid, "finish_reason": ({"type": "length", "length": produced} if done else None),
                "prompt_tokens": len(_real.encode(text)) if real else len(text.split()),
                "weight_version": self.live.weight_version,
                "completion_tokens": produced, "cached_tokens": 0,
                "e2e_latency": round(time.monotonic() - began, 6)}
        if nan:
            meta.update({"finish_reason": dict(_live.NAN_FINISH), "completion_tokens": 1})
            return {"text": "", "meta_info": meta}
        if real:
            meta.update({"forward_s": real["forward_s"], "device": real["device"]})
            return {"text": _real.decode(real["ids"][:produced]), "meta_info": meta}
        piece = " " + os.path.basename(adapter["lora_path"].rstrip("/")) if adapter else " lab"
        return {"text": piece * produced, "meta_info": meta}

    def _finish(self, clock, out: dict) -> dict:
        if clock is not None:
            meta = out["meta_info"]
            self.metrics.finished(clock, meta["prompt_tokens"], meta["completion_tokens"], time.monotonic())
        return out

    def _observe(self, clock, produced: int) -> None:
        if clock is not None:
            self.metrics.output(clock, produced, time.monotonic())

    def generate(self, rid: str, text: str, max_new_tokens: int, adapter=None, log_metrics: bool = True) -> dict:
        """The whole answer at once (a request without ``stream``): ``max_new_tokens`` x the decode
        time per token ($SGLANG_STANDIN_TOKEN_S); through ``adapter`` (sglang/_live.py) when given.
        Observed as SGLang sees it: an output every 50 tokens and at the end (sglang/_collector.py)."""
        began = time.monotonic()
        clock = self.metrics.arrived(began) if log_metrics else None
        n = max(0, max_new_tokens)
        if self.live.nan and n:  # the first sample is out of the vocabulary: the request ends there
            time.sleep(self.token_s_now())
            self._observe(clock, 1)
            return self._finish(clock, self._output(rid, text, 1, 1, began, adapter=adapter))
        if self.real is not None:
            out = self.real.generate(text, n)
            self._observe(clock, len(out["ids"]))
            return self._finish(clock, self._output(rid, text, len(out["ids"]), len(out["ids"]), began, out))
        produced = 0
        while produced < n:
            step = min(_collector.FORCE_STREAM_INTERVAL, n - produced)
            time.sleep(step * self.token_s_now())
            produced += step
            self._observe(clock, produced)
        if n == 0:
            self._observe(clock, 0)
        return self._finish(clock, self._output(rid, text, n, n, began, adapter=adapter))

    def decode(self, rid: str, text: str, max_new_tokens: int, adapter=None):
        """The answer token by token (a request with ``stream``): one output per decoded token at the
        decode rate (SGLang's default ``stream_interval`` 1), the last one with its finish reason; one
        output when nothing is to be decoded. In real mode the real generation runs first and its
        tokens follow at once."""
        began = time.monotonic()
        clock = self.metrics.arrived(began)
        n = max(0, max_new_tokens)
        if self.live.nan and n:
            n = 1
        real = self.real.generate(text, n) if self.real is not None and not self.live.nan else None
        if real is not None:
            n = len(real["ids"])
        if n == 0:
            self.metrics.output(clock, 0, time.monotonic())
            yield self._finish(clock, self._output(rid, text, 0, 0, began, real))
            return
        due = began
        for produced in range(1, n + 1):
            if real is None:
                # to the token's due time, not a sleep per token: the rate holds whatever a write costs
                due += self.token_s_now()
                time.sleep(max(0.0, due - time.monotonic()))
            self.metrics.output(clock, produced, time.monotonic())
            out = self._output(rid, text, produced, n, began, real, adapter)
            yield self._finish(clock, out) if produced == n else out


_CAPACITY = {}


def _server_capacity(server_args: dict) -> dict:
    """The scheduler's capacity figures (sglang._capacity), computed once per server."""
    if "figures" not in _CAPACITY:
        try:
            config = gpusim.load_config()
        except gpusim.DriverUnavailable:
            config = {}
        _CAPACITY["figures"] = _capacity.figures(server_args, _capacity.model_config(server_args["model_path"]),
                                                 int(config.get("total_mib") or 0), int(config.get("reserved_mib") or 0))
    return _CAPACITY["figures"]


def usage_of(meta: dict) -> dict:
    """OpenAI's usage from an output's meta_info."""
    return {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": meta["completion_tokens"],
            "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"]}


def openai_response(path: str, model: str, out: dict) -> dict:
    """The OpenAI answer to a request without ``stream`` (serving_chat / serving_completions)."""
    meta = out["meta_info"]
    finish = (meta.get("finish_reason") or {}).get("type")
    if path == "/v1/completions":
        choice = {"index": 0, "text": out["text"], "finish_reason": finish, "logprobs": None}
        kind = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": out["text"]}, "finish_reason": finish}
        kind = "chat.completion"
    return {"id": meta["id"], "object": kind, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage_of(meta)}


def openai_events(path: str, model: str, outputs, include_usage: bool):
    """SGLang's OpenAI stream from the tokenizer manager's outputs (each the text so far): the chat
    (serving_chat ``_generate_chat_stream``): a first chunk with ``delta`` role ``assistant`` and
    content "", a chunk per output with the text's increment in ``delta.content``, a chunk with an
    empty delta and the finish reason; the completions (serving_completions): a chunk per output with
    the increment in ``text`` and the finish reason on the last. Then, with ``stream_options``
    ``include_usage``, a chunk with no choices and the usage. ``[DONE]`` is the writer's.

    >>> outs = [{"text": " a", "meta_info": {"id": "r", "finish_reason": None, "prompt_tokens": 1, "completion_tokens": 1}},
    ...         {"text": " a b", "meta_info": {"id": "r", "finish_reason": {"type": "length"}, "prompt_tokens": 1,
    ...                                        "completion_tokens": 2}}]
    >>> [c["choices"][0]["delta"] for c in openai_events("/v1/chat/completions", "m", outs, False)]
    [{'role': 'assistant', 'content': ''}, {'content': ' a'}, {'content': ' b'}, {}]
    >>> [(c["choices"] or [{}])[0].get("text") for c in openai_events("/v1/completions", "m", outs, True)]
    [' a', ' b', None]
    """
    chat = path == "/v1/chat/completions"
    kind = "chat.completion.chunk" if chat else "text_completion"
    created, offset, meta = int(time.time()), 0, None

    def chunk(choices, usage=None):
        doc = {"id": meta["id"], "object": kind, "created": created, "model": model, "choices": choices}
        if usage is not None:
            doc["usage"] = usage
        return doc

    for out in outputs:
        first, meta = meta is None, out["meta_info"]
        finish = (meta.get("finish_reason") or {}).get("type")
        delta, offset = out["text"][offset:], len(out["text"])
        if not chat:
            yield chunk([{"index": 0, "text": delta, "logprobs": None, "finish_reason": finish, "matched_stop": None}])
            continue
        if first:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None, "matched_stop": None}])
        if delta:
            yield chunk([{"index": 0, "delta": {"content": delta}, "logprobs": None, "finish_reason": None,
                          "matched_stop": None}])
    if meta is None:
        return
    if chat:
        yield chunk([{"index": 0, "delta": {}, "logprobs": None,
                      "finish_reason": (meta.get("finish_reason") or {}).get("type"), "matched_stop": None}])
    if include_usage:
        yield chunk([], usage_of(meta))


LIVE_ENDPOINTS = ("/update_weights_from_disk", "/load_lora_adapter", "/unload_lora_adapter")


def adapter_of(model: str, served: str):
    """The adapter an OpenAI request's ``model`` names (serving_base.py ``_parse_model_parameter``):
    ``<served name>:<adapter>``, else the part after the first colon; None for the base model.

    >>> adapter_of("/opt/models/lab-model:lab-lora-a", "/opt/models/lab-model"), adapter_of("m", "m")
    ('lab-lora-a', None)
    >>> adapter_of("s3://bucket/m:a", "s3://bucket/m"), adapter_of("base:b", "other")
    ('a', 'b')
    """
    if ":" not in model or model == served:
        return None
    if model.startswith(served + ":"):
        return model[len(served) + 1:].strip() or None
    return model.split(":", 1)[1].strip() or None


INTERNAL_ERROR = "Internal server error: the request failed in the scheduler (lab fault error-rate)."


def make_handler(state: State):
    class Handler(common.Handler):
        def access_log(self, code):
            # the HTTP middleware's count of every answer (add_prometheus_track_response_middleware)
            state.metrics.http_response(self.path.split("?")[0], code, self.command)
            common.Handler.access_log(self, code)

        def do_GET(self):
            path = self.path.split("?")[0]
            sa = state.server_args
            if path in ("/health", "/health_generate"):
                if not state.healthy():
                    return self._send(503, b"", "text/plain")
                if path == "/health_generate":
                    with state.admitted() as rid, state.live.request(None):
                        state.generate(rid, "health", 1, log_metrics=False)  # SGLang's log_metrics=False
                return self._send(200, b"", "text/plain")
            if path in ("/get_server_info", "/server_info"):
                info = dict(sa)
                # SGLang: {**server_args, **scheduler_info, "internal_states": [...], "version"}; the figures
                # from the memory fraction, the KV dtype, the GPU and config.json as SGLang computes them
                capacity = _server_capacity(sa)
                internal = {"last_gen_throughput": 0.0, "load": state.inflight}
                internal.update({k: capacity[k] for k in ("effective_max_running_requests_per_dp", "memory_usage")
                                 if k in capacity})
                info.update({"status": "ready",
                             "max_total_num_tokens": capacity.get("max_total_num_tokens", 1048576),
                             "max_req_input_len": capacity.get("max_req_input_len", 262136),
                             "internal_states": [internal], "version": sglang.__version__})
                return self._send(200, info)
            if path in ("/get_model_info", "/model_info"):
                # model_path, served_model_name, weight_version: the tokenizer manager's, moved by a
                # weight update (sglang/_live.py); /server_info keeps the launch's
                info = {"tokenizer_path": sa["tokenizer_path"], "is_generation": True,
                        "preferred_sampling_params": None, "reasoning_parser": sa.get("reasoning_parser"),
                        "tool_call_parser": sa.get("tool_call_parser"),
                        "disaggregation_mode": sa.get("disaggregation_mode") or "null",
                        "has_image_understanding": False, "has_audio_understanding": False}
                info.update(state.live.model_info())
                return self._send(200, info)
            if path == "/v1/models":
                served = state.live.served_model_name
                return self._send(200, {"object": "list", "data": [{
                    "id": served, "object": "model", "created": int(time.time()), "owned_by": "sglang",
                    "root": served, "parent": None, "max_model_len": sa.get("context_length") or 32768}]
                    + state.live.adapter_cards()})
            if path == "/ready":  # SGLang 0.5.23 http_server.py: not paused and healthy, no generation
                return self._send(200 if state.healthy() else 503, b"", "text/plain")
            if path == "/version":
                return self._send(200, {"version": sglang.__version__})
            if path == "/metrics" and sa.get("enable_metrics"):
                return self._send(200, state.metrics_text(), "text/plain; version=0.0.4")
            if path == "/get_load":
                return self._send(200, [{"dp_rank": 0, "num_reqs": state.live.running, "num_waiting_reqs": 0}])
            return self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            path = self.path.split("?")[0]
            body = self._body()
            if path == "/flush_cache":
                return self._send(200, "Cache flushed.\nPlease check backend logs for more details.", "text/plain")
            if path in LIVE_ENDPOINTS:
                return self._live(path, body)
            if path not in ("/generate", "/v1/completions", "/v1/chat/completions"):
                return self._send(404, {"detail": "Not Found"})
            # no check of state.draining here: SGLang's generate_request admits while it drains
            if path == "/generate":
                params = body.get("sampling_params") or {}
                text, n = str(body.get("text", "")), int(params.get("max_new_tokens", 128))
                adapter = body.get("lora_path")
            else:
                n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
                text = str(body.get("prompt") or " ".join(str(m.get("content", "")) for m in body.get("messages", [])))
                adapter = adapter_of(str(body.get("model") or ""), state.live.served_model_name) or body.get("lora_path")
            with state.admitted() as rid:
                if state.up and state.faults.fails_next():  # not the warmup: it would leave /health 503
                    return self._internal_error(path, rid, bool(body.get("stream")))
                # the reader side of the model lock from here to the last byte (a weight update waits)
                try:
                    held = state.live.request(adapter)
                    ref = held.__enter__()
                except ValueError as exc:
                    return self._refuse(path, str(exc), bool(body.get("stream")))
                try:
                    if body.get("stream"):
                        return self._stream(path, body, rid, text, n, ref)
                    out = state.generate(rid, text, n, ref)
                    if path == "/generate":
                        return self._send(200, out)
                    return self._send(200, openai_response(path, body.get("model") or state.live.served_model_name,
                                                           out))
                finally:
                    held.__exit__(None, None, None)

        def _internal_error(self, path: str, rid: str, stream: bool) -> None:
            """Lab fault error-rate: the scheduler aborts the request with 500 (a ``FINISH_ABORT`` of
            INTERNAL_SERVER_ERROR, tokenizer_manager.py ``_wait_one_response``): without ``stream``
            FastAPI's ``{"detail"}`` on /generate and the OpenAI ErrorResponse, 500; a stream gets that
            last output (/generate) or the OpenAI error event, then [DONE]. Counted as a finished
            request with no token and as an aborted one; /health stays 200."""
            clock = state.metrics.arrived(time.monotonic())
            state.metrics.finished(clock, 0, 0, time.monotonic())
            state.metrics.abort()
            log("Abort request %s: %s" % (rid, INTERNAL_ERROR))
            error = {"object": "error", "message": INTERNAL_ERROR, "type": "InternalServerError", "param": None,
                     "code": 500}
            if not stream:
                return self._send(500, {"detail": INTERNAL_ERROR} if path == "/generate" else error)
            events = sse.EventStream(self)
            events.start()
            self.access_log(200)
            finish = {"type": "abort", "message": INTERNAL_ERROR, "status_code": 500, "err_type": "InternalServerError"}
            with contextlib.suppress(sse.ClientGone):
                events.data({"text": "", "meta_info": {"id": rid, "finish_reason": finish, "prompt_tokens": 0,
                                                       "completion_tokens": 0}}
                            if path == "/generate" else {"error": error})
                events.done()
            return None

        def _refuse(self, path: str, message: str, stream: bool) -> None:
            """A request SGLang refuses (its ValueError): /generate's ``{"error": {"message"}}``, the
            OpenAI endpoints' ErrorResponse, 400; in a stream already begun, one ``data:`` error event."""
            if path == "/generate":
                error = {"message": message}
                if stream:
                    error.update({"type": "invalid_request_error", "code": 400, "retryable": False})
            else:
                error = {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}
            if not stream:
                return self._send(400, {"error": error} if path == "/generate" else error)
            events = sse.EventStream(self)
            events.start()
            self.access_log(200)
            with contextlib.suppress(sse.ClientGone):
                events.data({"error": error})
                events.done()
            return None

        def _live(self, path: str, body: dict) -> None:
            """The live changes (sglang/_live.py): FastAPI's 422 for a body without its required field."""
            required = {"/update_weights_from_disk": ("model_path",),
                        "/load_lora_adapter": ("lora_name", "lora_path"), "/unload_lora_adapter": ("lora_name",)}[path]
            missing = [key for key in required if not isinstance(body.get(key), str)]
            if missing:
                return self._send(422, {"detail": [{"type": "missing", "loc": ["body", key], "msg": "Field required",
                                                    "input": body} for key in missing]})
            if path == "/update_weights_from_disk":
                status, answer = state.live.update_weights(
                    body, lambda line: _live.scheduler_crash(log, line))
            elif path == "/load_lora_adapter":
                if int(state.server_args.get("dp_size") or 1) != 1:  # an AssertionError: FastAPI's 500
                    return self._send(500, "Internal Server Error", "text/plain")
                status, answer = state.live.load_adapter(body)
            else:
                status, answer = state.live.unload_adapter(body)
            return self._send(status, answer)

        def _stream(self, path: str, body: dict, rid: str, text: str, n: int, adapter=None) -> None:
            """``"stream": true``: SGLang's StreamingResponse (sglang/_sim.sse), an event per decoded
            token, then ``data: [DONE]``. The client gone: the request is aborted, as SGLang's
            ``create_abort_task`` does on the disconnect."""
            stream = sse.EventStream(self)
            stream.start()
            self.access_log(200)
            outputs = state.decode(rid, text, n, adapter)
            if path != "/generate":
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                outputs = openai_events(path, body.get("model") or state.live.served_model_name,
                                        outputs, usage)
            try:
                for item in outputs:
                    stream.data(item)
                stream.done()
            except sse.ClientGone:
                state.metrics.abort()  # TokenizerManager.abort_request
                log("Abort request %s: the client disconnected mid-stream." % rid)

    return Handler


Server = common.Server


def _warmup(state: State, host: str, port: int) -> None:
    url = "http://%s:%d/generate" % ("127.0.0.1" if host in ("0.0.0.0", "") else host, port)
    req = urllib.request.Request(url, data=json.dumps({"text": "The capital city of France is",
                                                       "sampling_params": {"max_new_tokens": 8}}).encode(),
                                 headers={"content-type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=600).read()
    except Exception as exc:  # noqa: BLE001 - SGLang logs the warmup failure and stays unhealthy
        log("Initialization failed. warmup error: %r" % (exc,))
        return
    if gpusim.read_faults().get("never-healthy"):
        log("Warmup did not complete (lab fault never-healthy); /health stays 503.")
        return
    state.up = True
    log("The server is fired up and ready to roll!")


SCHEDULER_EXIT_TIMEOUT_S = 15.0  # SGLang's _SCHEDULER_EXIT_TIMEOUT_SECS


def drain_timings() -> tuple:
    """(tick, scheduler exit) in seconds from the env: SGLang's are (5, up to 15)."""
    tick = max(0.01, float(os.environ.get("SGLANG_STANDIN_DRAIN_TICK_S", "0.05")))
    schedulers = min(SCHEDULER_EXIT_TIMEOUT_S, max(0.0, float(os.environ.get("SGLANG_STANDIN_SCHEDULER_EXIT_S", "0"))))
    return tick, schedulers


def _drain_and_exit(state: State, workers: Workers, started: float) -> None:
    tick, schedulers = drain_timings()
    # the watchdog loop runs since the start and sleeps a tick between looks at the drain flag
    time.sleep(tick - (time.monotonic() - started) % tick)
    last_report = None
    while True:
        # SGLang logs this on every look (every 5 s), the last one with 0; at the stand-in's short tick,
        # at most once per 5 s while requests remain, and always the last one
        with state.lock:
            remain, rids = state.inflight, sorted(state.rids)
        done = remain == 0 and not gpusim.read_faults().get("ignore-sigterm")
        now = time.monotonic()
        if done or last_report is None or now - last_report >= 5:
            log("Gracefully exiting... Remaining number of requests %d. Remaining requests remaining_rids=%r."
                % (remain, rids))
            last_report = now
        if done:
            break
        time.sleep(tick)
    time.sleep(schedulers)  # ShutdownReq sent; the schedulers release their memory and exit
    workers.kill()
    log("Gracefully exited.")
    os._exit(0)


def _load(started: float, load_s: float, slow_start: bool) -> None:
    """Load until ``load_s`` after ``started`` (fault slow-start read again while loading)."""
    common.wait_load(started, load_s, slow_start, "SGLANG_STANDIN_LOAD_S")


def gate_pipes(plan: list, server_args: dict) -> None:
    """``--gated-launch-port``: the rank-0 scheduler serves the gate; a pipe from it to every other
    rank stands for the world group's broadcast of the flag (srt/distributed/gated_launch.py)."""
    port = server_args.get("gated_launch_port")
    schedulers = [job for job in plan if job["kind"] == "scheduler"]
    if port is None or not schedulers:
        return
    first = schedulers[0]
    first["gate"] = {"host": server_args.get("host") or "127.0.0.1", "port": int(port), "notify_fds": []}
    first["pass_fds"] = []
    for job in schedulers[1:]:
        read_fd, write_fd = os.pipe()
        job["gate"] = {"wait_fd": read_fd}
        job["pass_fds"] = [read_fd]
        first["gate"]["notify_fds"].append(write_fd)
        first["pass_fds"].append(write_fd)


def launch_weight_cache_daemons(server_args: dict, workers: Workers) -> None:
    """``--weight-cache-mode daemon``: engine.py's ``_launch_weight_cache_daemons``. The engine's own
    daemons (one per local rank, multiprocessing spawn, children of this process) load before the
    schedulers start; a live daemon's files on one of the GPUs refuse (no --force here); each
    ``.ready`` is awaited every check interval up to ``--weight-cache-timeout``; a daemon that exits
    first fails the start. They die with this process (PR_SET_PDEATHSIG, and the drain's
    kill_process_tree SIGKILLs them: as with SGLang's HTTP server, whose launch path never hands them to
    the graceful ``_terminate_weight_cache_daemons``, their .sock/.ready files are left behind)."""
    from sglang import _platform
    from sglang.srt.weight_cache import daemon as wc
    from sglang.srt.weight_cache.protocol import cleanup_stale_daemon_files, get_ready_path

    pp_range, tp_range, pp_per_node, tp_per_node = wc.local_rank_ranges(server_args)
    if int(server_args.get("nnodes") or 1) > 1 and not server_args.get("dist_init_addr"):
        raise ValueError("Multi-node weight cache daemons (nnodes > 1) require --dist-init-addr so all nodes "
                         "rendezvous at the same endpoint.")
    if server_args.get("dist_init_addr"):
        host, _, port = str(server_args["dist_init_addr"]).rpartition(":")
        dist_init_method = "tcp://%s:%s" % (host, port)
    else:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            dist_init_method = "tcp://127.0.0.1:%d" % probe.getsockname()[1]
    ranks = [(pp, tp) for pp in pp_range for tp in tp_range]
    log("Launching %d weight cache daemon(s) on node %d for model=%s, pp_ranks=%d..%d, tp_ranks=%d..%d, "
        "dist_init_method=%s" % (len(ranks), int(server_args.get("node_rank") or 0), server_args["model_path"],
                                 pp_range.start, pp_range.stop - 1, tp_range.start, tp_range.stop - 1,
                                 dist_init_method))
    gpus = {rank: wc._gpu_of(server_args, rank[0], rank[1], pp_per_node, tp_per_node) for rank in ranks}
    for rank in ranks:
        cleanup_stale_daemon_files(_platform.get_device_uuid(gpus[rank]))
    for pp_rank, tp_rank in ranks:
        workers.daemons.append(wc.spawn_weight_cache_daemon(server_args, gpu_id=gpus[(pp_rank, tp_rank)],
                                                            tp_rank=tp_rank, pp_rank=pp_rank,
                                                            dist_init_method=dist_init_method))
    timeout = int(server_args.get("weight_cache_timeout") or 1800)
    check_interval = _timing.interval_s("DAEMON_CHECK")
    start_time = time.time()
    for pp_rank, tp_rank in ranks:
        ready_path = get_ready_path(_platform.get_device_uuid(gpus[(pp_rank, tp_rank)]))
        while not os.path.exists(ready_path):
            time.sleep(check_interval)
            if time.time() - start_time > timeout:
                raise TimeoutError("Weight cache daemon for pp_rank=%d tp_rank=%d did not become ready within %ds"
                                   % (pp_rank, tp_rank, timeout))
            for p in workers.daemons:
                if not p.is_alive():
                    raise RuntimeError("Weight cache daemon (pid=%d) exited prematurely with code %s"
                                       % (p.pid, p.exitcode))
        log("Weight cache daemon for pp_rank=%d tp_rank=%d is ready" % (pp_rank, tp_rank))
    log("All %d weight cache daemons on node %d are ready" % (len(ranks), int(server_args.get("node_rank") or 0)))


def terminate_weight_cache_daemons(procs: list, timeout: float = 10.0) -> None:
    """engine.py's ``_terminate_weight_cache_daemons``: SIGTERM (their handlers remove the files), join,
    SIGKILL stragglers. SGLang calls it when the engine's own start fails after the daemons came up."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            log("Weight cache daemon (pid=%d) did not exit within %ss of SIGTERM; sending SIGKILL." % (p.pid, timeout))
            p.kill()
            p.join()


def main(argv=None) -> int:
    started = time.monotonic()
    _timing.spend("IMPORT")  # SGLang's launch_server imports sglang.srt.server_args before it parses
    args = build_parser().parse_args(argv)  # exits 2 on a bad flag, as SGLang's parser does
    error = model_path_error(args.model_path)
    if error:
        log_traceback("_launch_subprocesses", error)
        return 1
    server_args = resolve_server_args(args)
    log("server_args=ServerArgs(%s)" % ", ".join("%s=%r" % kv for kv in server_args.items()))
    live = _live.Live(server_args, log)
    try:
        live.start()  # check_lora_server_args, then the initial adapters as the LoRA manager reads them
    except _live.StartError as exc:
        log_traceback("_launch_subprocesses", str(exc))
        return 1
    faults = gpusim.read_faults()
    server_faults = common.ServerFaults()  # slow-decode and error-rate: this start's, if it is the first since
    real = _real.lab_mode()  # None: the simulated GPUs; else real memory and a real model per rank
    try:
        config = gpusim.load_config()
    except gpusim.DriverUnavailable:
        if not real:
            log_traceback("_launch_subprocesses", "RuntimeError: No CUDA GPUs are available")
            return 1
        config = {"total_mib": 0}  # the workers size their pools from the real device

    workers = Workers()
    try:
        plan = worker_plan(server_args, int(config["total_mib"]))
        if real:
            for job in plan:
                if job["kind"] == "scheduler":
                    job["real"] = _real.real_job(real, server_args)
        if server_args.get("weight_cache_mode") == "daemon":
            try:
                launch_weight_cache_daemons(server_args, workers)
            except Exception as exc:  # SGLang: the exception leaves _launch_subprocesses, the tree is killed
                terminate_weight_cache_daemons(workers.daemons)
                log_traceback("_launch_weight_cache_daemons", "%s: %s" % (type(exc).__name__, exc))
                return 1
        gate_pipes(plan, server_args)
        workers.spawn(plan)
        error = workers.wait_ready()
        if error:
            log("Rank 0 scheduler is dead. Please check if there are relevant logs.")
            log_traceback("_launch_subprocesses",
                          "RuntimeError: Initialization failed. Please see the error messages above.")
            workers.kill()
            return 1
        # the load's clock leaves out a gated launch's wait (SGLANG_STANDIN_LOAD_S: sglang/_timing.py)
        load_started = started + max([float(r.get("gate_s") or 0) for r in workers.reports] + [0.0])
        # real mode: the load is the real one (CUDA context, allocation, model, warm-up); no sleep added
        load_s = float(faults.get("slow-start") or os.environ.get("SGLANG_STANDIN_LOAD_S", "0" if real else "1.0"))
        if faults.get("crash-on-start"):
            time.sleep(max(0.0, load_s / 2 - (time.monotonic() - load_started)))
            log_traceback("_launch_subprocesses",
                          "RuntimeError: CUDA error: an illegal memory access was encountered (lab fault "
                          "crash-on-start)")
            workers.kill()
            return 1
        # after wait_for_ready, as SGLang's engine starts its SubprocessWatchdog
        signal.signal(signal.SIGQUIT, on_sigquit)
        workers.watch()
        _load(load_started, load_s, bool(faults.get("slow-start")) and not real)
    except KeyboardInterrupt:
        workers.kill()
        return 1

    state = State(server_args, live, server_faults)
    if real:
        state.real = _real.RealWorkers([p for p, job in zip(workers.procs, plan) if job.get("real")])
    host, port = server_args["host"], int(server_args["port"])
    try:
        httpd = Server((host, port), make_handler(state))
    except OSError as exc:
        sys.stderr.write("ERROR:    [Errno %d] error while attempting to bind on address ('%s', %d): %s\n"
                         % (exc.errno or 98, host, port, (exc.strerror or "address already in use").lower()))
        workers.kill()
        return 1
    uvicorn_log("Started server process [%d]" % os.getpid())
    uvicorn_log("Waiting for application startup.")
    uvicorn_log("Application startup complete.")
    uvicorn_log("Uvicorn running on http://%s:%d (Press CTRL+C to quit)" % (host, port))

    def on_sigterm(signum, frame):
        if state.draining:
            return
        state.draining = True
        # 0.5.23 installs it with loop.add_signal_handler, which calls it without arguments
        log("SIGTERM received. signum=None frame=None. Draining requests and shutting down...")
        threading.Thread(target=_drain_and_exit, args=(state, workers, started), daemon=True).start()

    signal.signal(signal.SIGTERM, on_sigterm)
    threading.Thread(target=_warmup, args=(state, host, port), daemon=True).start()
    try:
        httpd.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    workers.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
