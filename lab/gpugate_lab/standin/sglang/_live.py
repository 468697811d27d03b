"""What the SGLang stand-in changes while it serves: LoRA adapters and the weights (SGLang 0.5.23).

Read from the 0.5.23 wheel (paths under ``sglang/srt/``):

- ``POST /update_weights_from_disk`` (entrypoints/http_server.py; managers/tokenizer_manager.py
  ``update_weights_from_disk``): the body's ``model_path`` (required: FastAPI's 422 without it),
  ``weight_version``, ``load_format``, ``abort_all_requests``, ``flush_cache``. It takes the writer side of
  ``model_update_lock`` (utils/aio_rwlock.py, writers first): it waits for the requests under way, which
  hold the reader side from their lock to their last byte, and every request arriving meanwhile waits
  until the load ends (``generate_request``). The load takes ``$SGLANG_STANDIN_WEIGHT_UPDATE_S`` (default
  0.2 s; real: the disk load of the weights, e.g. ~5 min for Qwen3-235B FP8 in RFC #27052). Answer: 200
  ``{"success": true, "message": "Succeeded to update model weights.", "num_paused_requests": 0}`` (the
  message ends " Weight version updated to V." with a ``weight_version``), 400 with ``success`` false.
  After a success ``/model_info`` (``/get_model_info``) and ``/v1/models`` report the new path: the
  tokenizer manager's ``_update_model_path_info`` sets ``model_path`` and ``served_model_name`` (a
  ``--served-model-name`` included) to it; ``weight_version`` moves only when the body gives one.
  ``/server_info`` reports the launch's configuration, unchanged (its docstring says so). Outputs'
  ``meta_info`` carry ``weight_version``.
- how it fails (model_executor/model_runner_components/weight_updater.py ``update_weights_from_disk``;
  model_loader/loader.py): SGLang reads no config.json of the new path, it loads its weight files into
  the running model. No weight files (or a path that is no directory, not downloadable here): "Failed to
  get weights iterator: Cannot find any model weights with `P`." (400, nothing written, the old weights
  serve). Weights of other shapes (another architecture): ``default_weight_loader``'s AssertionError
  partway; the "rollback" reloads from ``model_config.model_path``, which already names the new path, so
  it raises again, out of the scheduler's event loop: ``run_scheduler_process`` logs "Scheduler hit an
  exception" and SIGQUITs the main process, which kills the whole server (the request gets no answer).
  The same with ``--weight-cache-mode`` client or daemon: ``_assert_weight_cache_inactive`` raises.
- LoRA flags (arg_groups/lora_hook.py ``check_lora_server_args``): ``--lora-paths`` (``P``, ``NAME=P`` or
  JSON) turns ``--enable-lora`` on; without initial adapters ``--max-lora-rank`` and
  ``--lora-target-modules`` are both needed (else the start fails with SGLang's AssertionError); the
  pool's rank and target modules are those flags, or inferred from the initial adapters
  (lora/lora_manager.py ``init_lora_shapes``; ``q_proj`` counts as ``qkv_proj``, lora/utils.py).
- ``POST /load_lora_adapter`` ``{"lora_name", "lora_path", "pinned"}`` and ``/unload_lora_adapter``
  ``{"lora_name"}`` (managers/tokenizer_control_mixin.py; lora/lora_manager.py, lora_config.py,
  lora_registry.py): 200 or 400 with ``{"rid": null, "http_worker_ipc": null, "success", "error_message",
  "loaded_adapters": {name: path}}``. No model lock: requests keep running while an adapter loads
  (``$SGLANG_STANDIN_LORA_LOAD_S``, default 0). Refusals: LoRA not enabled; adapter_config.json missing;
  a name already loaded; a rank above the pool's or a target module outside it; too many pinned; an
  unknown name to unload. An unload first unregisters the name, then waits for the requests using it.
  ``--max-loaded-loras``: the least recently used unpinned adapter is unloaded past it.
- a generation through an adapter (managers/tokenizer_manager.py ``_validate_and_resolve_lora``;
  entrypoints/openai/serving_base.py ``_parse_model_parameter``): /generate ``"lora_path": NAME``, the
  OpenAI endpoints ``"model": "<served name>:NAME"`` (or ``lora_path``). Unknown: 400 "Got LoRA adapter
  that has never been loaded: ..."; an adapter unloaded before is loaded again, silently ("Reloading
  evicted adapter"): the tokenizer manager never forgets a name it loaded (``lora_ref_cache``).
- ``/v1/models``: the served model, then each adapter ``{"id": NAME, "root": PATH, "parent": <served>}``.
- NaN weights (fault ``weights-cannot-generate``): managers/schedule_batch.py
  ``_check_vocab_boundary_finish``: the sampled id is out of the vocabulary, the request ends at once
  with EOS and ``finish_reason`` ``{"type": "stop", "matched": "NaN happened"}``, 200, empty text.

Generation text: " lab" per token on the base model, " <adapter dir name>" through an adapter.
"""

import collections
import contextlib
import glob
import json
import os
import re
import signal
import threading
import time
import uuid

from sglang._sim import common, gpusim

HF_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")  # DefaultModelLoader's, auto load format
# lora/utils.py get_normalized_target_modules: the fused modules LoRA targets
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj", "vocab_emb": "embed_tokens", "embeddings": "embed_tokens",
         "word_embeddings": "embed_tokens", "output": "lm_head", "unembed_tokens": "lm_head"}
# what ``all`` resolves to on a Llama (auto_detect_lora_target_modules + EMBEDDING_NAMES)
LLAMA_ALL = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head"}
NAN_FINISH = {"type": "stop", "matched": "NaN happened"}
ENABLE_HINT = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class StartError(Exception):
    """The server cannot start with these LoRA settings; str() is SGLang's exception line."""


def normalized_modules(target_modules) -> set:
    """SGLang's get_normalized_target_modules.

    >>> sorted(normalized_modules(["q_proj", "v_proj", "model.layers.0.mlp.up_proj", "o_proj"]))
    ['gate_up_proj', 'o_proj', 'qkv_proj']
    >>> normalized_modules("all-linear")
    {'all'}
    """
    if isinstance(target_modules, str):
        if target_modules not in ("all", "all-linear"):
            raise ValueError("Only 'all' or 'all-linear' can be used as the string for target module")
        return {"all"}
    return {FUSED.get(name.split(".")[-1], name.split(".")[-1]) for name in target_modules}


def read_adapter_config(path: str) -> dict:
    """lora_config.py's LoRAConfig: adapter_config.json of a local dir (an HF id would be downloaded:
    the lab is offline), raising what SGLang raises."""
    if not os.path.isdir(path):
        if HF_REPO_ID.match(path):
            raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find "
                          "them in the cached files.")
        raise ValueError("Repo id must be in the form 'repo_name' or 'namespace/repo_name': '%s'. Use `repo_type` "
                         "argument if needed." % path)
    with open(os.path.join(path, "adapter_config.json")) as handle:
        config = json.load(handle)
    for key in ("target_modules", "r", "lora_alpha"):
        if key not in config:
            raise KeyError(key)
    return config


def parse_lora_paths(values) -> list:
    """``--lora-paths`` items (LoRAPathAction, lora_hook.py) -> [(name, path, pinned)].

    >>> parse_lora_paths(["a=/m/a", "/m/b", '{"lora_name": "c", "lora_path": "/m/c", "pinned": true}'])
    [('a', '/m/a', False), ('/m/b', '/m/b', False), ('c', '/m/c', True)]
    """
    refs = []
    for item in values or []:
        item = item.strip() if isinstance(item, str) else item
        if isinstance(item, str) and item.startswith("{") and item.endswith("}"):
            item = json.loads(item)
        if isinstance(item, dict):
            refs.append((item["lora_name"], item["lora_path"], bool(item.get("pinned", False))))
        elif "=" in item:
            name, path = item.split("=", 1)
            refs.append((name, path, False))
        else:
            refs.append((item, item, False))
    return refs


def shape_mismatch(loaded: dict, new: dict):
    """The first parameter whose shape differs between two config.json (what ``default_weight_loader``
    asserts on), as SGLang's message; None when the new weights fit."""
    a, b = common.model_shape(loaded), common.model_shape(new)
    checks = (("embed_tokens", (a["vocab"], a["hidden"]), (b["vocab"], b["hidden"])),
              ("qkv_proj", ((a["heads"] + 2 * a["kv_heads"]) * a["head_dim"], a["hidden"]),
               ((b["heads"] + 2 * b["kv_heads"]) * b["head_dim"], b["hidden"])),
              ("gate_up_proj", (2 * a["intermediate"], a["hidden"]), (2 * b["intermediate"], b["hidden"])))
    for _name, have, got in checks:
        if have != got:
            return "Attempted to load weight (torch.Size([%d, %d])) into parameter (torch.Size([%d, %d]))" % (got + have)
    if a["layers"] < b["layers"]:
        return "KeyError: 'model.layers.%d.self_attn.qkv_proj.weight'" % a["layers"]
    return None


class RWLock:
    """utils/aio_rwlock.py with threads: many readers or one writer; a waiting writer bars new readers."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextlib.contextmanager
    def reader(self):
        with self._cond:
            while self._writer or self._waiting_writers:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def writer(self, queued=None):
        """The writer side; ``queued()`` runs once it bars new readers (SGLang's log line and its
        ``acquire_writer`` run in one step of the event loop: no request slips between them)."""
        with self._cond:
            self._waiting_writers += 1
            if queued is not None:
                queued()
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._waiting_writers -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class Live:
    """The tokenizer manager's live state (model path, served name, weight version, LoRA registry) and
    the schedulers' (the weights loaded, the adapters in the pool)."""

    def __init__(self, server_args: dict, log):
        self.log = log
        self.args = server_args
        self.model_path = server_args["model_path"]
        self.served_model_name = server_args["served_model_name"]
        self.weight_version = server_args.get("weight_version") or "default"
        self.load_format = server_args.get("load_format") or "auto"
        self.model_config = common.model_config(self.model_path)  # the running model's shapes
        self.nan = False  # the weights loaded are NaN (fault weights-cannot-generate)
        self.model_update_lock = RWLock()
        self.lora_update_lock = threading.Lock()
        self.cond = threading.Condition()  # guards the registry and the per-adapter request counts
        self.registry = collections.OrderedDict()  # name -> ref, least recently used first
        self.ref_cache = {}  # name -> ref: every adapter ever loaded (lora_ref_cache)
        self.in_use = collections.Counter()  # lora_id -> requests using it
        # requests past the model lock: what the schedulers run (/get_load, /metrics); those waiting
        # at the lock are the tokenizer manager's only (the drain still counts them)
        self.running = 0
        self.enable_lora = bool(server_args.get("enable_lora"))
        self.max_lora_rank = 0
        self.target_modules = set()
        self.initial = parse_lora_paths(server_args.get("lora_paths"))

    # ------------------------------------------------------------ start
    def start(self) -> None:
        """check_lora_server_args, then the LoRA manager's init with the initial adapters; raises StartError."""
        args = self.args
        if self.initial and args.get("enable_lora") is None:
            self.enable_lora = True
            self.log("--enable-lora is set to True because --lora-paths is provided.")
        if not self.enable_lora:
            return
        if int(args.get("max_loras_per_batch") or 8) <= 0:
            raise StartError("AssertionError: max_loras_per_batch must be positive")
        modules = args.get("lora_target_modules")
        modules = [modules] if isinstance(modules, str) else modules
        if not self.initial and not (args.get("max_lora_rank") and modules):
            raise StartError("AssertionError: When no initial --lora-paths is provided, you need to specify both "
                             "--max-lora-rank and --lora-target-modules for LoRA initialization.")
        configs = []
        for name, path, pinned in self.initial:
            try:
                configs.append((name, path, pinned, read_adapter_config(path)))
            except (OSError, ValueError, KeyError) as exc:
                raise StartError("%s: %s" % (type(exc).__name__, exc)) from None
        if modules:
            self.target_modules = LLAMA_ALL if "all" in modules else normalized_modules(modules)
        for name, _path, _pinned, config in configs:
            wanted = LLAMA_ALL if normalized_modules(config["target_modules"]) == {"all"} \
                else normalized_modules(config["target_modules"])
            if modules and not wanted <= self.target_modules:
                raise StartError(
                    "ValueError: LoRA adapter '%s' contains target modules %s that are not included in the specified "
                    "--lora-target-modules %s. Please update --lora-target-modules to include all required modules: "
                    "%s, or use 'all' to enable all supported modules."
                    % (name, sorted(wanted - self.target_modules), sorted(self.target_modules),
                       sorted(self.target_modules | wanted)))
            if not modules:
                self.target_modules |= wanted
        self.max_lora_rank = int(args.get("max_lora_rank") or max([int(c["r"]) for *_, c in configs] or [0]))
        for name, path, pinned, config in configs:
            ref = self._ref(name, path, pinned, config)
            self.registry[name] = ref
            self.ref_cache[name] = ref

    @staticmethod
    def _ref(name: str, path: str, pinned: bool, config: dict) -> dict:
        return {"lora_id": uuid.uuid4().hex, "lora_name": name, "lora_path": path, "pinned": pinned,
                "r": int(config["r"])}

    # ------------------------------------------------------------ what the server reports
    def model_info(self) -> dict:
        return {"model_path": self.model_path, "served_model_name": self.served_model_name,
                "weight_version": self.weight_version, "load_format": self.load_format,
                "architectures": self.model_config.get("architectures"),
                "model_type": self.model_config.get("model_type")}

    def adapter_cards(self) -> list:
        if not self.enable_lora:
            return []
        with self.cond:
            return [{"id": ref["lora_name"], "object": "model", "created": int(time.time()), "owned_by": "sglang",
                     "root": ref["lora_path"], "parent": self.served_model_name, "max_model_len": None}
                    for ref in self.registry.values()]

    def _loaded(self) -> dict:
        with self.cond:
            return {ref["lora_name"]: ref["lora_path"] for ref in self.registry.values()}

    def _lora_result(self, success: bool, error: str = "", scheduler: bool = True) -> tuple:
        """The answer's body (LoRAUpdateOutput): ``loaded_adapters`` as the schedulers report them; None
        when the tokenizer manager refused (its ValueError) before asking them."""
        body = {"rid": None, "http_worker_ipc": None, "success": success, "error_message": error,
                "loaded_adapters": self._loaded() if scheduler else None}
        return (200 if success else 400), body

    # ------------------------------------------------------------ a request
    @contextlib.contextmanager
    def request(self, lora_name):
        """A generation's hold on the model (the reader side of ``model_update_lock``) and on its
        adapter; yields the adapter's ref (None: the base model). Raises ValueError as SGLang refuses."""
        with self.model_update_lock.reader():
            ref = self._acquire(lora_name) if lora_name else None
            with self.cond:
                self.running += 1
            try:
                yield ref
            finally:
                with self.cond:
                    self.running -= 1
                    if ref is not None:
                        self.in_use[ref["lora_id"]] -= 1
                    self.cond.notify_all()

    def _acquire(self, name: str) -> dict:
        if not self.enable_lora:
            raise ValueError("LoRA adapter '%s' was requested, but LoRA is not enabled. Please launch the server "
                             "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter "
                             "endpoint." % name)
        with self.cond:
            known = name in self.registry
        if not known:
            if name not in self.ref_cache:
                raise ValueError("Got LoRA adapter that has never been loaded: %s\nAll loaded adapters: dict_keys(%r)."
                                 % (name, list(self.ref_cache)))
            self.log("Reloading evicted adapter: %s" % name)
            cached = self.ref_cache[name]
            status, body = self.load_adapter({"lora_name": name, "lora_path": cached["lora_path"],
                                              "pinned": cached["pinned"]})
            if status != 200 and "already loaded" not in body["error_message"]:
                raise ValueError("Failed to implicitly load LoRA adapter %s: %s" % (name, body["error_message"]))
        with self.cond:
            ref = self.registry.get(name)
            if ref is None:
                raise ValueError("The following requested LoRA adapters are not loaded: %s\nLoaded adapters: "
                                 "odict_keys(%r)." % (name, list(self.registry)))
            self.registry.move_to_end(name)
            self.in_use[ref["lora_id"]] += 1
            return ref

    # ------------------------------------------------------------ adapters
    def load_adapter(self, body: dict) -> tuple:
        """POST /load_lora_adapter -> (status, body)."""
        name, path, pinned = body.get("lora_name"), body.get("lora_path"), bool(body.get("pinned", False))
        if not self.enable_lora:
            return self._lora_result(False, ENABLE_HINT, scheduler=False)
        self.log("Start load Lora adapter. Lora name=%s, path=%s" % (name, path))
        with self.lora_update_lock:
            try:
                config = read_adapter_config(path)
                error = self._refusal(name, path, pinned, config)
            except (OSError, ValueError, KeyError) as exc:
                config, error = None, str(exc)
            if error:
                return self._lora_result(False, error)
            time.sleep(max(0.0, float(os.environ.get("SGLANG_STANDIN_LORA_LOAD_S", "0"))))
            ref = self._ref(name, path, pinned, config)
            with self.cond:
                self.registry[name] = ref
            self.ref_cache[name] = ref
            self.log("LoRA adapter loading completes: LoRARef(lora_id=%s, lora_name=%s, lora_path=%s, pinned=%s)"
                     % (ref["lora_id"], name, path, pinned), prefix="TP0")
            limit = self.args.get("max_loaded_loras")
            while limit is not None and len(self.registry) > int(limit):
                lru = next((n for n, r in self.registry.items() if not r["pinned"]), None)
                if lru is None:
                    return self._lora_result(False, "Didn't find any LoRA adapters when trying to evict LRU LoRA "
                                                    "adapter. LoRA registry is: %r" % dict(self.registry),
                                             scheduler=False)
                self.log("Unloading least recently used LoRA adapter '%s' (current number of adapters: %d, max "
                         "allowed: %s)" % (lru, len(self.registry), limit))
                self._unload_locked(lru)
            return self._lora_result(True)

    def _refusal(self, name: str, path: str, pinned: bool, config: dict):
        """lora_manager.py ``validate_new_adapter``: why the pool cannot take it, or None."""
        with self.cond:
            refs = list(self.registry.values())
        for ref in refs:
            if ref["lora_name"] == name:
                return "Failed to load LoRA adapter %s because it is already loaded" % name
            if ref["lora_path"] == path:
                self.log("%s is already loaded with name: %s, but another copy is being loaded with name: %s"
                         % (path, ref["lora_name"], name))
        wanted = normalized_modules(config["target_modules"])
        if int(config["r"]) > self.max_lora_rank or not ("all" in wanted or wanted <= self.target_modules):
            return ("LoRA adapter %s with rank %s is incompatible with the current LoRA memory pool configuration. "
                    "Please ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` and that "
                    "the target modules are included in `--lora-target-modules`." % (name, config["r"]))
        per_batch = int(self.args.get("max_loras_per_batch") or 8)
        if pinned and sum(r["pinned"] for r in refs) >= per_batch - 1:
            return ("Failed to load LoRA adapter %s as a pinned adapter. It is not allowed to pin all slots in the "
                    "LoRA memory pool to avoid starvation for unpinned adapters and base models. Please increase your "
                    "`--max-loras-per-batch` or load it as unpinned LoRA adapters." % name)
        return None

    def unload_adapter(self, body: dict) -> tuple:
        """POST /unload_lora_adapter -> (status, body)."""
        name = body.get("lora_name")
        if not self.enable_lora:
            return self._lora_result(False, ENABLE_HINT, scheduler=False)
        self.log("Start unload Lora adapter. Lora name=%s" % name)
        with self.lora_update_lock:
            try:
                self._unload_locked(name)
            except ValueError as exc:
                return self._lora_result(False, str(exc), scheduler=False)
        return self._lora_result(True)

    def _unload_locked(self, name: str) -> None:
        with self.cond:
            ref = self.registry.pop(name, None)  # new requests can no longer use it
            if ref is None:
                raise ValueError("LoRA with name %s does not exist. Loaded LoRAs: odict_keys(%r)"
                                 % (name, list(self.registry)))
            while self.in_use[ref["lora_id"]] > 0:  # lora_registry.wait_for_unload
                self.cond.wait()
            del self.in_use[ref["lora_id"]]

    # ------------------------------------------------------------ weights
    def update_weights(self, body: dict, crash) -> tuple:
        """POST /update_weights_from_disk -> (status, body); ``crash(exception line)`` when a scheduler
        raises (it does not return)."""
        path = body.get("model_path")
        load_format = body.get("load_format") or self.load_format
        with self.model_update_lock.writer(lambda: self.log("Start update_weights. Load format=%s" % load_format)):
            success, message, nan = self._load_weights(str(path).rstrip("/") or "/", crash)
            if success:
                self.model_path = self.served_model_name = path
                self.load_format = load_format
                self.model_config = common.model_config(path) or self.model_config
                self.nan = nan
                if body.get("weight_version") is not None:
                    self.weight_version = str(body["weight_version"])
                    message += " Weight version updated to %s." % body["weight_version"]
        return (200 if success else 400), {"success": success, "message": message, "num_paused_requests": 0}

    def _load_weights(self, path: str, crash) -> tuple:
        """The scheduler's update: (success, message, NaN weights)."""
        mode = self.args.get("weight_cache_mode") or "off"
        if mode != "off":
            crash("RuntimeError: [weight_cache] update_weights_from_disk is not supported while the weight cache "
                  "is active (--weight-cache-mode %s): model weights are shared with the daemon via CUDA IPC, so "
                  "mutating them in place would corrupt the daemon's master copy and every co-attached engine. "
                  "Restart with --weight-cache-mode off to use this operation." % mode)
        self.log("Update engine weights online from disk begin. avail mem=%.2f GB" % 0.0, prefix="TP0")
        faults = gpusim.read_faults()
        if _fault_applies(faults.get("weights-load-fails"), path):
            return False, ("Failed to get weights iterator: [Errno 5] Input/output error: '%s' (lab fault "
                           "weights-load-fails)." % path), False
        files = [f for pattern in WEIGHT_PATTERNS for f in glob.glob(os.path.join(path, pattern))] \
            if os.path.isdir(path) else []
        if not files:
            if not os.path.isdir(path) and not HF_REPO_ID.match(path):
                return False, ("Failed to get weights iterator: Repo id must be in the form 'repo_name' or "
                               "'namespace/repo_name': '%s'. Use `repo_type` argument if needed.." % path), False
            return False, "Failed to get weights iterator: Cannot find any model weights with `%s`." % path, False
        held = faults.get("slow-weight-update")  # a lab fault: the load lasts while a test acts
        time.sleep(max(0.0, float(held if held is not None else os.environ.get("SGLANG_STANDIN_WEIGHT_UPDATE_S", "0.2"))))
        mismatch = shape_mismatch(self.model_config, common.model_config(path))
        if mismatch:
            # the rollback reloads model_config.model_path, already the new path: it raises again
            crash(mismatch if mismatch.startswith("KeyError") else "AssertionError: " + mismatch)
        self.log("Update weights end.", prefix="TP0")
        return True, "Succeeded to update model weights.", _fault_applies(faults.get("weights-cannot-generate"), path)


def _fault_applies(value, path: str) -> bool:
    """A checkpoint fault: True (every checkpoint) or the model path it names."""
    return value is True or (isinstance(value, str) and value.rstrip("/") == path)


def scheduler_crash(log, exc_line: str) -> None:
    """run_scheduler_process's end when the event loop raises: the traceback, then SIGQUIT to the main
    process, whose handler kills the whole tree. Never returns."""
    log("Scheduler hit an exception: Traceback (most recent call last):\n"
        '  File "/usr/lib/python3/dist-packages/sglang/srt/managers/scheduler.py", line 6368, in run_scheduler_process\n'
        "    scheduler.run_event_loop()\n"
        '  File "/usr/lib/python3/dist-packages/sglang/srt/managers/scheduler_components/weight_updater.py", '
        "line 143, in update_weights_from_disk\n"
        "    success, message = runner.weight_updater.update_weights_from_disk(\n"
        "%s" % exc_line, prefix="TP0")
    os.kill(os.getpid(), signal.SIGQUIT)
    while True:  # the handler's SIGKILL ends this thread with the process
        time.sleep(1)
