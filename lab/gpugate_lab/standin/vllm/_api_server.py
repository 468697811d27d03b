"""The API server of the lab's vLLM stand-in: what ``vllm serve`` runs in its own process (the
command line unchanged), as vLLM 0.33.0 does it (vllm/entrypoints/launchers/api_server/entry.py
``run_server``, launchers/launcher.py ``setup_server`` and ``serve_http``, vllm/v1/engine/utils.py and
core_client.py for the engine process, vllm/v1/utils.py ``shutdown``). Stdlib only.

What it copies:

- the parser: the snapshot of one release's ``vllm serve`` parser (vllm/engine/arg_utils.py here; the
  lab's ``vllm-version``), a bad flag exits 2 with argparse's message; ``--kv-cache-dtype`` must be
  one vLLM knows ("ValueError: Invalid kv_cache_dtype: ..."); the model a local dir with config.json
  or an HF repo id ("Invalid repository ID or local directory specified: ...");
- "vLLM server version V, serving model M" and "non-default args: {...}" (``api_key``, ``hf_token``
  and ``watermark_config`` as ``***``: vllm/entrypoints/common/startup.py);
- the port is bound BEFORE the engine is built (``setup_server``: "make sure that we bind the port
  before the engine is set up"), not listened on: from the first moment a plain bind fails
  (EADDRINUSE) while a connect is refused and no LISTEN socket shows; uvicorn listens once the engine
  is up, so ``/health`` answers nothing during the load and 200 from its first answer (vLLM has no 503
  for loading). The socket has SO_REUSEADDR, so a second vLLM binds the same port during the first
  one's load and fails only at its listen, after its own load ("ERROR:    [Errno 98] Address already
  in use", exit 1);
- the engine: ``VLLM::EngineCore`` (vllm/_engine_core.py; ``EngineCore_DP<n>`` is not served:
  ``--data-parallel-size`` must be 1), its failure to start: "RuntimeError: Engine core
  initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}", exit 1;
- SIGTERM while loading: ``_interrupt_init`` raises ``KeyboardInterrupt("terminated")``; the engine's
  process manager sends SIGTERM and gives it ``$VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5) before it
  kills the tree; the process then dies of SIGINT (Python's end for an unhandled KeyboardInterrupt);
- SIGTERM when serving (``serve_http``'s handler): "[shutdown] API server: shutdown triggered",
  "stopping engine client mode=abort|drain timeout=Ns"; the process manager sends EngineCore SIGTERM
  and waits up to ``--shutdown-timeout`` s, then "force killing remaining processes" (its tree);
  meanwhile the HTTP server keeps serving: ``/health`` stays 200 (it fails only on a dead engine) and
  a new request is answered with an abort output (``finish_reason: "abort"``, no text). With 0 (the
  default) EngineCore aborts every request in flight: each client gets its answer so far with
  ``finish_reason: "abort"`` (a stream: a last chunk saying so, then ``[DONE]``). Then uvicorn's
  shutdown, exit 0. One departure, on purpose: with 0, vLLM 0.33.0's process manager gives EngineCore
  a window of 0 s unless ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` is set
  (``get_engine_process_shutdown_timeout``), so on CUDA the real EngineCore is SIGKILLed right after
  its SIGTERM, and by our reading of uvicorn's shutdown (no graceful timeout) its clients then get no
  answer until the API server itself is killed; the stand-in gives EngineCore that variable's window
  (default 5 s) so the aborts vLLM's "0 = abort" names reach the clients. Requests still unanswered
  when the window ends (a drain cut short) get their connection closed;
- EngineCore dying on its own: "[shutdown] MPClient: engine core exited unexpectedly; starting
  cleanup", ``/health`` 503 (EngineDeadError), requests 500, and the watchdog (``watchdog_loop``,
  every 5 s; ``$VLLM_STANDIN_WATCHDOG_S``, default 0.5) ends the server, exit 0;
- endpoints: ``/health``, ``/ping``, ``/version``, ``/v1/models`` (id = the served model name, ``root``
  = the model, ``max_model_len``), ``/metrics`` (``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:request_success_total``,
  the requests' counters and histograms (vllm/_stats.py),
  ``vllm:cache_config_info`` with the cache config's fields as labels: ``block_size``,
  ``num_gpu_blocks``, ``kv_cache_size_tokens``, ...; vllm/v1/metrics/loggers.py), ``POST
  /v1/completions`` and ``/v1/chat/completions`` (``--api-key``: the ``/v1`` paths want ``Authorization:
  Bearer``, else 401 ``{"error": "Unauthorized"}``; another model: 404 "The model `x` does not
  exist."); ``"stream": true`` answers with server-sent events (the lab's shared writer,
  standin/_sse.py): a chunk per token at ``$VLLM_STANDIN_TOKEN_S`` (default 0.002 s) per token, the
  last with its ``finish_reason``, the usage chunk with ``stream_options.include_usage``, then ``data:
  [DONE]``. ``max_tokens`` defaults to 16 (vLLM's chat default is the rest of the context).
- LoRA (vllm/_lora.py, after vllm/entrypoints/openai/models/serving.py and serve/lora/api_router.py):
  ``--enable-lora``, ``--max-lora-rank``, ``--lora-modules NAME=PATH`` loaded before serving (one that
  fails ends the start, exit 1); ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` only
  with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (else 404); each adapter in ``/v1/models`` (``parent``: the
  served model name); a generation whose ``model`` names an adapter answers " <adapter dir>" per token
  and names the adapter as its ``model``.

Lab faults ($GPUGATE_LAB_CTL/faults.json): crash-on-start and slow-start (in EngineCore's load),
never-healthy (/health 503), ignore-sigterm (the SIGTERM is logged and nothing else happens: only
SIGKILL ends the API server, and EngineCore outlives it), orphan-worker and stuck-memory (in the
processes holding memory); slow-decode=FACTOR and error-rate=P (EngineCore's: every token FACTOR x as
long; a share P of the requests finished with ``FinishReason.ERROR``, answered 500 "Internal server error"
or an error event in a stream, counted in ``vllm:request_success_total{finished_reason="error"}``), both
of ONE server: the first started since the fault was set (gpugate_standin's ServerFaults).
"""

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid

import vllm
from vllm import _lab, _lora, _model, _stats
from vllm._lab import common, gpusim, sse

SENSITIVE = frozenset({"api_key", "hf_token", "watermark_config"})
HF_REPO_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def log_traceback(where, line, function, exc_line):
    """vLLM's traceback of a failed start, its last frame ``vllm/<where>:<line>`` in ``function``."""
    common.emit("Traceback (most recent call last):\n"
                '  File "/usr/lib/python3/dist-packages/vllm/entrypoints/launchers/api_server/entry.py", line 176, '
                "in run_server\n    await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)\n"
                '  File "/usr/lib/python3/dist-packages/vllm/%s", line %d, in %s\n%s\n' % (where, line, function, exc_line))


def uvicorn_log(message):
    common.emit("INFO:     %s\n" % message)


# ---------------------------------------------------------------- the engine's config
def model_error(model):
    """vLLM's refusal of a model that is neither a local dir with config.json nor an HF repo id."""
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
        return None
    parts = model.split("/")
    if not os.path.exists(model) and len(parts) == 2 and all(parts) and set(model) <= HF_REPO_ID_CHARS | {"/"} \
            and ".." not in model:
        return None
    return ("Invalid repository ID or local directory specified: '%s'.\nPlease verify the following requirements:\n"
            "1. Provide a valid Hugging Face repository ID.\n2. Specify a local directory that contains a recognized "
            "configuration file.\n   - For Hugging Face models: ensure the presence of a 'config.json'.\n"
            "   - For Mistral models: ensure the presence of a 'params.json'." % model)


def non_default_args(args):
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    defaults = vars(make_arg_parser(FlexibleArgumentParser()).parse_args([]))
    changed = {k: v for k, v in vars(args).items() if k in defaults and defaults[k] != v}
    return {k: ("***" if k in SENSITIVE else v) for k, v in changed.items()}


def offload_settings(args):
    """KV offload's CPU region (vllm/config/vllm.py ``_post_init_kv_transfer_config``), or None."""
    transfer = args.kv_transfer_config
    if isinstance(transfer, str):
        transfer = json.loads(transfer)
    transfer = transfer if isinstance(transfer, dict) else {}
    extra = dict(transfer.get("kv_connector_extra_config") or {})
    size = args.kv_offloading_size
    if size not in (None, "") and (args.kv_offloading_backend or "native") == "native":
        extra["cpu_bytes_to_use"] = float(size) * (1 << 30)
    elif transfer.get("kv_connector") != "OffloadingConnector":
        return None
    if not extra.get("cpu_bytes_to_use"):
        return None
    return {"engine_id": transfer.get("engine_id") or str(uuid.uuid4()), "bytes": int(float(extra["cpu_bytes_to_use"])),
            "spec": extra.get("spec_name") or "CPUOffloadingSpec"}


def engine_job(args, started, mode):
    """What EngineCore needs: the plan every rank shares, one entry per rank (title, device index)."""
    config = common.model_config(args.model)
    tp, pp = int(args.tensor_parallel_size or 1), int(args.pipeline_parallel_size or 1)
    max_model_len = args.max_model_len
    if max_model_len in (None, -1):
        max_model_len = int(config.get("max_position_embeddings") or 32768)
    from vllm import _weight_cache

    plan = _weight_cache.weights_plan(args)  # what shapes the weights: an ipc_cache load's key
    extra = args.model_loader_extra_config
    plan.update({"model": args.model, "gpu_memory_utilization": float(args.gpu_memory_utilization),
                 "kv_cache_dtype": args.kv_cache_dtype or "auto", "tp": tp, "pp": pp,
                 "block_size": int(args.block_size or 16), "max_model_len": int(max_model_len),
                 "seed": int(args.seed or 0), "shutdown_timeout": int(args.shutdown_timeout),
                 "load_format": args.load_format or "auto",
                 "loader_config": json.loads(extra) if isinstance(extra, str) and extra.strip() else dict(extra or {})})
    ranks = []
    for p in range(pp):
        for t in range(tp):
            name = "Worker" + ("_PP%d" % p if pp > 1 else "") + ("_TP%d" % t if tp > 1 else "")
            ranks.append({"title": _lab.title(name), "device": p * tp + t, "tp_rank": t, "pp_rank": p})
    return {"title": _lab.title("EngineCore"), "plan": plan, "ranks": ranks, "real": mode, "started": started,
            "load_s": _lab.seconds("VLLM_STANDIN_LOAD_S", 0 if mode else 1.0), "offload": offload_settings(args)}


# ---------------------------------------------------------------- the engine client
class EngineDead(Exception):
    pass


class EngineClient:
    """The API server's side of EngineCore: its process, the channel, one queue per request."""

    def __init__(self, job):
        ours, theirs = socket.socketpair()
        self.proc = common.spawn(job["title"], "vllm._engine_core", dict(job, channel_fd=theirs.fileno()),
                                 "VLLM_STANDIN_ENGINE", pass_fds=(theirs.fileno(),), stdout=None)
        theirs.close()
        self.channel = ours
        self.lines = ours.makefile("rb")
        self.lock = threading.Lock()
        self.queues = {}
        self.dead = False
        self.stopping = False
        self.info = None
        self.reader = None

    def wait_ready(self):
        """The ready message, or RuntimeError naming the failed engine process."""
        line = self.lines.readline()
        if line:
            self.info = json.loads(line)
            self.reader = common.thread(self._read, name="EngineCoreOutputs")
            common.thread(self._monitor, name="MPClientEngineMonitor")
            return self.info
        code = self.proc.wait()
        raise RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): "
                           "{'EngineCore': %d}" % code)

    def _read(self):
        for line in self.lines:
            try:
                out = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                q = self.queues.get(out.get("rid"))
            if q is not None:
                q.put(out)

    def _monitor(self):
        self.proc.wait()
        if self.stopping:
            return
        _lab.warning("core_client.py:839", "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup")
        self.dead = True
        self.close_all({"dead": True})

    def close_all(self, message):
        with self.lock:
            queues = list(self.queues.values())
        for q in queues:
            q.put(message)

    def add(self, rid, prompt, max_tokens, piece=None):
        import queue

        if self.dead:
            raise EngineDead()
        q = queue.Queue()
        with self.lock:
            self.queues[rid] = q
        self._send({"type": "add", "rid": rid, "prompt": prompt, "max_tokens": max_tokens, "piece": piece})
        return q

    def forget(self, rid, abort=False):
        with self.lock:
            self.queues.pop(rid, None)
        if abort:
            self._send({"type": "abort", "rid": rid})

    def _send(self, message):
        try:
            with self.lock:
                self.channel.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            pass

    def stop(self, timeout):
        """vllm/v1/utils.py ``shutdown``: SIGTERM, wait up to ``timeout`` s, then kill the tree."""
        self.stopping = True
        if self.proc.poll() is None:
            _lab.info("utils.py:628", "[shutdown] Process manager: send sigterm to process EngineCore")
            self.proc.terminate()
        try:
            self.proc.wait(timeout=max(0.0, timeout))
        except Exception:  # noqa: BLE001 -- TimeoutExpired: the window is over
            _lab.warning("utils.py:648", "[shutdown] Process manager: force killing remaining processes count=1")
            _lab.warning("utils.py:652", "[shutdown] Process manager: force killing remaining process EngineCore pid %d"
                         % self.proc.pid)
            for pid in common.descendants(self.proc.pid) + [self.proc.pid]:
                common.kill_quietly(pid)
            self.proc.wait()
        if self.reader is not None:
            self.reader.join(timeout=2)  # the outputs EngineCore sent before it went
        self.close_all({"closed": True})


def worker_shutdown_window(default=5.0):
    """``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (vllm/envs.py, default 5)."""
    return _lab.seconds("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", default)


# ---------------------------------------------------------------- HTTP
class State:
    def __init__(self, args, engine, info):
        self.args, self.engine, self.info = args, engine, info
        names = args.served_model_name or [args.model]
        self.names = names if isinstance(names, list) else [names]
        self.models = _lora.ServingModels(self.names, args.enable_lora, args.max_lora_rank)
        self.runtime_lora = _lora.runtime_updating()
        self.lock = threading.Lock()
        self.active = 0
        self.stats = _stats.RequestStats(self.names[0])  # the requests' counters and histograms
        self.shutting_down = False

    def healthy(self):
        return not self.engine.dead and not gpusim.read_faults().get("never-healthy")

    def metrics_text(self):
        labels = 'model_name="%s",engine="0"' % self.names[0]
        a, info = self.args, self.info
        cache = [("block_size", info["block_size"]), ("gpu_memory_utilization", a.gpu_memory_utilization),
                 ("cache_dtype", a.kv_cache_dtype or "auto"),
                 ("enable_prefix_caching", a.enable_prefix_caching if a.enable_prefix_caching is not None else True),
                 ("num_gpu_blocks", info["num_gpu_blocks"]), ("num_cpu_blocks", None),
                 ("kv_cache_size_tokens", info["kv_cache_tokens"]), ("kv_cache_max_concurrency", info["max_concurrency"]),
                 ("kv_offloading_size", a.kv_offloading_size), ("kv_offloading_backend", a.kv_offloading_backend),
                 ("engine", "0")]
        lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
                 "# TYPE vllm:num_requests_running gauge", "vllm:num_requests_running{%s} %.1f" % (labels, self.active),
                 "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
                 "# TYPE vllm:num_requests_waiting gauge", "vllm:num_requests_waiting{%s} 0.0" % labels,
                 "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
                 "# TYPE vllm:kv_cache_usage_perc gauge", "vllm:kv_cache_usage_perc{%s} 0.0" % labels,
                 self.stats.text().rstrip("\n")]
        lines += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                  "# TYPE vllm:cache_config_info gauge",
                  "vllm:cache_config_info{%s} 1.0" % ",".join('%s="%s"' % (k, v) for k, v in cache)]
        return "\n".join(lines) + "\n"


def error_body(message, kind, code):
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
GENERATION_ERROR = "Internal server error"  # GenerationError of a request finished with FinishReason.ERROR


def make_handler(state):
    class Handler(common.Handler):
        def _authorized(self, path):
            keys = state.args.api_key
            if not keys or not path.startswith("/v1"):
                return True
            keys = keys if isinstance(keys, list) else [keys]
            return self.headers.get("authorization", "") in ["Bearer %s" % k for k in keys]

        def do_GET(self):
            path = self.path.split("?")[0]
            if not self._authorized(path):
                return self._send(401, {"error": "Unauthorized"})
            if path in ("/health", "/ping"):
                return self._send(200 if state.healthy() else 503, b"", "application/json")
            if path == "/version":
                return self._send(200, {"version": vllm.__version__})
            if path == "/v1/models":  # the served names, then each adapter (_lora.py)
                cards = [{"id": name, "root": state.args.model, "parent": None,
                          "max_model_len": state.info["max_model_len"]} for name in state.names]
                return self._send(200, {"object": "list", "data": [{
                    "id": card["id"], "object": "model", "created": int(time.time()), "owned_by": "vllm",
                    "root": card["root"], "parent": card["parent"], "max_model_len": card["max_model_len"],
                    "permission": [{"id": "modelperm-%s" % uuid.uuid4().hex, "object": "model_permission",
                                    "created": int(time.time()), "allow_create_engine": False,
                                    "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
                                    "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                                    "group": None, "is_blocking": False}]}
                    for card in cards + state.models.adapter_cards()]})
            if path == "/metrics":
                return self._send(200, state.metrics_text(), "text/plain; version=1.0.0; charset=utf-8")
            return self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            path = self.path.split("?")[0]
            body = self._body()
            if not self._authorized(path):
                return self._send(401, {"error": "Unauthorized"})
            if path == "/ping":
                return self._send(200 if state.healthy() else 503, b"", "application/json")
            if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and state.runtime_lora:
                return self._lora(path, body)
            if path not in ("/v1/completions", "/v1/chat/completions"):
                return self._send(404, {"detail": "Not Found"})
            model = body.get("model")
            piece = state.models.adapter_piece(model) if model else None
            if model and model not in state.names and piece is None:
                return self._send(404, error_body("The model `%s` does not exist." % model, "NotFoundError", 404))
            served = model if piece is not None else state.names[0]  # the answer's model: the adapter's name
            chat = path == "/v1/chat/completions"
            prompt = (" ".join(str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict))
                      if chat else str(body.get("prompt") or ""))
            n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            try:
                q = state.engine.add(rid, prompt, n, piece)
            except EngineDead:
                return self._send(500, error_body(ENGINE_DEAD, "InternalServerError", 500))
            with state.lock:
                state.active += 1
            try:
                if body.get("stream"):
                    return self._stream(rid, q, chat, body, len(prompt.split()), served)
                return self._complete(rid, q, chat, len(prompt.split()), served)
            finally:
                state.engine.forget(rid)
                with state.lock:
                    state.active -= 1

        def _lora(self, path, body):
            """api_router.py's two routes: the plain text with 200, else vLLM's ErrorResponse."""
            load = path == "/v1/load_lora_adapter"
            status, answer = (state.models.load if load else state.models.unload)(body)
            if status == 200:
                if load:
                    _lab.info("serving.py:199", "Loaded new LoRA adapter: name '%s', path '%s'"
                              % (body["lora_name"], body["lora_path"]))
                else:
                    _lab.info("serving.py:225", "Removed LoRA adapter: name '%s'" % body["lora_name"])
                return self._send(200, answer, "text/plain; charset=utf-8")
            return self._send(status, answer)

        def _outputs(self, q, prompt_tokens=0):
            """The engine's outputs for one request, observed as vLLM's output processor does
            (vllm/_stats.py): an output per engine step, the finish by its reason."""
            clock = state.stats.arrived(time.monotonic())
            while True:
                out = q.get()
                now = time.monotonic()
                if out.get("n") and out.get("finish_reason") not in ("error", "abort"):
                    state.stats.output(clock, now)
                if out.get("finished"):
                    state.stats.finished(clock, out.get("finish_reason"), prompt_tokens, out.get("n") or 0, now)
                yield out
                if out.get("finished") or out.get("dead") or out.get("closed"):
                    return

        def _chunk(self, rid, chat, choices, usage=None, served=None):
            doc = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": int(time.time()), "model": served or state.names[0], "choices": choices}
            if usage is not None:
                doc["usage"] = usage
            return doc

        def _complete(self, rid, q, chat, prompt_tokens, served):
            text, done, reason = "", 0, None
            for out in self._outputs(q, prompt_tokens):
                if out.get("dead"):
                    return self._send(500, error_body(ENGINE_DEAD, "InternalServerError", 500))
                if out.get("closed"):  # the engine is gone with the server: no answer
                    self.close_connection = True
                    return None
                text, done, reason = text + out["delta"], out["n"], out.get("finish_reason")
            if reason == "error":  # FinishReason.ERROR: serving.py raises GenerationError, a 500
                return self._send(500, error_body(GENERATION_ERROR, "InternalServerError", 500))
            usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + done, "completion_tokens": done,
                     "prompt_tokens_details": None}
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                                  "tool_calls": []},
                          "logprobs": None, "finish_reason": reason, "stop_reason": None}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None,
                          "prompt_logprobs": None}
            doc = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                   "model": served, "choices": [choice], "usage": usage}
            return self._send(200, doc)

        def _stream(self, rid, q, chat, body, prompt_tokens, served):
            """vLLM's StreamingResponse (serving.py ``completion_stream_generator`` and the chat's): a chunk
            per output, the last with its finish reason; the usage chunk on request; ``data: [DONE]``. The
            client gone: the request is aborted."""
            stream = sse.EventStream(self)
            chunk = lambda *a: self._chunk(*a, served=served)  # noqa: E731 -- every chunk names the served model
            stream.start()
            self.access_log(200)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            done = 0
            try:
                if chat:
                    stream.data(chunk(rid, chat, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]))
                for out in self._outputs(q, prompt_tokens):
                    if out.get("closed"):
                        self.close_connection = True  # the chunked body never ends: the client reads an error
                        return
                    if out.get("dead"):
                        stream.data(error_body(ENGINE_DEAD, "InternalServerError", 500))
                        break
                    if out.get("finish_reason") == "error":  # GenerationError in a stream: an error event
                        stream.data(error_body(GENERATION_ERROR, "InternalServerError", 500))
                        break
                    done, reason = out["n"], out.get("finish_reason")
                    if chat:
                        delta = {"content": out["delta"]}
                        stream.data(chunk(rid, chat, [{"index": 0, "delta": delta, "logprobs": None,
                                                       "finish_reason": reason}]))
                    else:
                        stream.data(chunk(rid, chat, [{"index": 0, "text": out["delta"], "logprobs": None,
                                                       "finish_reason": reason, "stop_reason": None}]))
                if include_usage:
                    stream.data(chunk(rid, chat, [], {"prompt_tokens": prompt_tokens,
                                                      "total_tokens": prompt_tokens + done,
                                                      "completion_tokens": done}))
                stream.done()
            except sse.ClientGone:
                state.engine.forget(rid, abort=True)

    return Handler


# ---------------------------------------------------------------- the server's life
def _die_of_keyboard_interrupt(exc):
    common.emit("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)
    return 130


def run_server(args):
    """``run_server(args)``: bind, build the engine, serve until SIGTERM. Returns the exit status."""
    started = time.monotonic()
    _lab.decorate_logs("APIServer")

    def interrupt_init(*_):
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, interrupt_init)
    _lab.info("launcher.py:385", "vLLM server version %s, serving model %s" % (vllm.__version__, args.model))
    _lab.info("startup.py:96", "non-default args: %s" % non_default_args(args))
    host, port = args.host or "", int(args.port)
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))  # bound, not listening: the port is taken, a connect is refused
    except OSError as exc:
        log_traceback("entrypoints/launchers/launcher.py", 371, "create_server_socket",
                      "OSError: [Errno %d] %s" % (exc.errno or 98, exc.strerror or "Address already in use"))
        return 1
    listen_address = "http://%s:%d" % (host or "0.0.0.0", port)
    mode = _lab.lab_mode()
    engine = None
    try:
        problems = []
        if int(args.data_parallel_size or 1) > 1:
            problems.append("NotImplementedError: the lab's vLLM stand-in serves one data-parallel rank "
                            "(--data-parallel-size 1)")
        error = model_error(args.model)
        if error:
            problems.append("ValueError: " + error)
        dtype_error = _model.kv_cache_dtype_error(args.kv_cache_dtype or "auto")
        if dtype_error:
            problems.append("ValueError: " + dtype_error)
        if not mode:
            try:
                gpusim.load_config()
            except gpusim.DriverUnavailable:
                problems.append("RuntimeError: Failed to infer device type, please set the environment variable "
                                "`VLLM_LOGGING_LEVEL=DEBUG` to turn on verbose logging to help debug the issue.")
        if problems:
            log_traceback("engine/arg_utils.py", 1890, "create_engine_config", problems[0])
            return 1
        job = engine_job(args, started, mode)
        job["server_faults"] = common.ServerFaults().owned  # slow-decode, error-rate: EngineCore applies them
        engine = EngineClient(job)
        info = engine.wait_ready()
    except KeyboardInterrupt as exc:
        if engine is not None:
            engine.stop(worker_shutdown_window())
        return _die_of_keyboard_interrupt(exc)
    except RuntimeError as exc:
        log_traceback("v1/engine/utils.py", 1473, "wait_for_engine_startup", "RuntimeError: %s" % exc)
        return 1
    info["max_model_len"] = engine_job(args, started, mode)["plan"]["max_model_len"]
    state = State(args, engine, info)
    if state.runtime_lora:  # api_router.py attach_router
        _lab.warning("api_router.py:29", _lora.RUNTIME_WARNING)
    try:
        state.models.init_static_loras(args.lora_modules)  # init_app_state: --lora-modules, before serving
    except ValueError as exc:
        log_traceback("entrypoints/openai/models/serving.py", 127, "init_static_loras", "ValueError: %s" % exc)
        engine.stop(worker_shutdown_window())
        return 1
    _lab.info("entry.py:132", "Supported tasks: ['generate']")
    _lab.info("entry.py:137", "Starting vLLM server on %s" % listen_address)
    httpd = common.Server((host, port), make_handler(state), bind_and_activate=False)
    httpd.socket.close()
    httpd.socket = sock
    try:
        httpd.server_activate()  # uvicorn's listen: from now on /health answers
    except OSError as exc:
        # another server listens there: vLLM's SO_REUSEADDR let both bind while neither listened, and
        # uvicorn's startup fails only now, after the whole load (it logs the error and exits 1; leaving
        # the engine client's context shuts the engine down)
        common.emit("ERROR:    [Errno %d] %s\n" % (exc.errno or 98, exc.strerror or "Address already in use"))
        engine.stop(max(int(args.shutdown_timeout), 0) or worker_shutdown_window())
        return 1
    uvicorn_log("Started server process [%d]" % os.getpid())
    uvicorn_log("Waiting for application startup.")
    uvicorn_log("Application startup complete.")
    done = threading.Event()

    def handle_shutdown():
        _lab.info("launcher.py:256", "[shutdown] API server: shutdown triggered")
        if gpusim.read_faults().get("ignore-sigterm"):
            return  # lab fault: the shutdown never proceeds; only SIGKILL ends this process
        timeout = int(args.shutdown_timeout)
        _lab.info("launcher.py:269", "[shutdown] API server: stopping engine client mode=%s timeout=%ss"
                  % ("abort" if timeout == 0 else "drain", timeout))
        _lab.info("core_client.py:792", "[shutdown] MPClient: start timeout=%ss" % timeout)
        _lab.info("core_client.py:794", "[shutdown] MPClient: stopping engine manager")
        engine.stop(timeout if timeout > 0 else worker_shutdown_window())
        _lab.info("core_client.py:796", "[shutdown] MPClient: engine manager stopped")
        _lab.info("core_client.py:799", "[shutdown] MPClient: complete")
        _lab.info("launcher.py:276", "[shutdown] API server: engine client stopped")
        stop_http()

    def stop_http():
        state.shutting_down = True
        _lab.info("launcher.py:279", "[shutdown] API server: signalling HTTP server shutdown")
        _lab.info("launcher.py:301", "[shutdown] API server: shutting down FastAPI HTTP server")
        uvicorn_log("Shutting down")
        deadline = time.monotonic() + 5
        while state.active and time.monotonic() < deadline:  # the answers being written
            time.sleep(0.01)
        uvicorn_log("Waiting for application shutdown.")
        uvicorn_log("Application shutdown complete.")
        uvicorn_log("Finished server process [%d]" % os.getpid())
        done.set()
        httpd.shutdown()

    def watchdog():
        tick = _lab.seconds("VLLM_STANDIN_WATCHDOG_S", 0.5)
        while not done.is_set():
            time.sleep(tick)
            if engine.dead and not engine.stopping:
                stop_http()
                return

    def on_signal(signum, frame):
        if getattr(on_signal, "fired", False):
            return
        on_signal.fired = True
        common.thread(handle_shutdown, name="shutdown")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    common.thread(watchdog, name="watchdog")
    httpd.serve_forever(poll_interval=0.1)
    sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(0)
