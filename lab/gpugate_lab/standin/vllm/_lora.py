"""LoRA adapters in the lab's vLLM stand-in, as vLLM 0.33.0 serves them. Stdlib only.

Read from vLLM 0.33.0:

- vllm/entrypoints/openai/models/serving.py ``OpenAIServingModels``: ``load_lora_adapter`` (its
  ``_check_load_lora_adapter_request``: 400 InvalidUserInput "Both 'lora_name' and 'lora_path' must be
  provided." and "The lora adapter 'NAME' has already been loaded. If you want to load the adapter in
  place, set 'load_inplace' to True."; the engine's ``add_lora`` failing: 404 NotFoundError for
  ``LoRAAdapterNotFoundError`` (vllm/exceptions.py: "Loading lora NAME failed: No adapter found for
  PATH"), else 500 InternalServerError with the exception's text; success: "Success: LoRA adapter
  'NAME' added successfully."), ``unload_lora_adapter`` (400 "'lora_name' needs to be provided to unload
  a LoRA adapter.", 404 "The lora adapter 'NAME' cannot be found.", success "Success: LoRA adapter
  'NAME' removed successfully."), ``init_static_loras`` (``--lora-modules``, loaded at the start; one
  that fails raises ValueError and the server does not start), ``show_available_models`` (each
  adapter's card: ``id`` its name, ``root`` its path, ``parent`` the first served model name);
- vllm/entrypoints/serve/lora/api_router.py ``attach_router``: the two POST routes exist only with
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` ("1" or "true", any case: vllm/envs.py), with the warning
  "LoRA dynamic loading & unloading is enabled in the API server. This should ONLY be used for local
  development!"; success is a 200 whose body is the plain text, a failure the ErrorResponse JSON;
- the engine's ``add_lora``: vllm/v1/worker/lora_model_runner_mixin.py "LoRA is not enabled." without
  ``--enable-lora``; vllm/lora/worker_manager.py ``_load_adapter`` (no adapter_config.json:
  LoRAAdapterNotFoundError) and vllm/lora/peft_helper.py ``validate_legal`` ("LoRA rank R is greater
  than max_lora_rank M.");
- vllm/entrypoints/openai/cli_args.py ``LoRAParserAction``: ``--lora-modules`` items ``NAME=PATH`` or
  JSON ``{"name", "path", "base_model_name"}``;
- vllm/entrypoints/openai/engine/serving.py ``_check_model`` / ``_maybe_get_adapters``: a request whose
  ``model`` names a loaded adapter runs through it, and its answer's ``model`` is the adapter's name.

Departures: the request body is not validated by pydantic (a missing field reads as empty, so it gets
the check's 400 rather than FastAPI's 400 validation error); no LoRA resolver plugins; the adapter's
weights are not read. Generation text through an adapter: " <adapter dir name>" per token, as the
SGLang stand-in does (standin/sglang/_live.py), so a test can tell which adapter answered.

Example::

    >>> models = ServingModels(["m"], enable_lora=True, max_lora_rank=16)
    >>> status, answer = models.load({"lora_name": "a", "lora_path": "/nowhere"})
    >>> status, answer["error"]["message"], answer["error"]["type"]
    (404, 'Loading lora a failed: No adapter found for /nowhere', 'NotFoundError')
    >>> models.unload({"lora_name": "a"})[0]
    404
"""

import json
import os
import threading

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
RUNTIME_WARNING = ("LoRA dynamic loading & unloading is enabled in the API server. This should ONLY be used for local "
                   "development!")


def runtime_updating(environ=None) -> bool:
    """vllm/envs.py: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is "1" or "true" (any case).

    >>> runtime_updating({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}), runtime_updating({})
    (True, False)
    """
    value = (os.environ if environ is None else environ).get(RUNTIME_LORA_ENV, "0")
    return value.strip().lower() in ("1", "true")


def parse_lora_modules(values) -> list:
    """``--lora-modules`` items -> [(name, path)] (LoRAParserAction); ValueError for a bad item.

    >>> parse_lora_modules(["a=/m/a", '{"name": "b", "path": "/m/b"}'])
    [('a', '/m/a'), ('b', '/m/b')]
    """
    out = []
    for item in values or []:
        if item in (None, ""):
            continue
        if "=" in item and "," not in item:  # the old format: name=path
            name, path = item.split("=")
            out.append((name, path))
            continue
        try:
            doc = json.loads(item)
        except ValueError:
            raise ValueError("Invalid JSON format for --lora-modules: %s" % item)
        try:
            out.append((str(doc["name"]), str(doc["path"])))
        except (KeyError, TypeError) as exc:
            raise ValueError("Invalid fields for --lora-modules: %s - %s" % (item, exc))
    return out


def error_body(message, kind, code):
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class AdapterNotFound(Exception):
    """vllm/exceptions.py LoRAAdapterNotFoundError."""

    def __init__(self, name, path):
        super().__init__("Loading lora %s failed: No adapter found for %s" % (name, path))


class ServingModels:
    """The served model names and the adapters loaded (``lora_requests``: name -> path, in load order)."""

    def __init__(self, names, enable_lora, max_lora_rank):
        self.names = list(names)
        self.enable_lora = bool(enable_lora)
        self.max_lora_rank = int(max_lora_rank or 16)
        self.lora_requests = {}
        self.lock = threading.Lock()  # the per-name lock of vLLM, one for all: loads are quick here

    def add_lora(self, name, path):
        """The engine's side: refuse as vLLM's worker does, else nothing (the weights are not read)."""
        if not self.enable_lora:
            raise RuntimeError("LoRA is not enabled.")
        try:
            with open(os.path.join(path, "adapter_config.json")) as handle:
                config = json.load(handle)
        except (FileNotFoundError, NotADirectoryError):
            raise AdapterNotFound(name, path)
        rank = int(config.get("r") or 8)
        if rank > self.max_lora_rank:
            raise ValueError("LoRA rank %d is greater than max_lora_rank %d." % (rank, self.max_lora_rank))

    def load(self, body):
        """``POST /v1/load_lora_adapter`` -> (status, text or ErrorResponse)."""
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return 400, error_body("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        with self.lock:
            if not body.get("load_inplace") and name in self.lora_requests:
                return 400, error_body("The lora adapter '%s' has already been loaded. If you want to load the "
                                       "adapter in place, set 'load_inplace' to True." % name, "InvalidUserInput", 400)
            try:
                self.add_lora(name, path)
            except AdapterNotFound as exc:
                return 404, error_body(str(exc), "NotFoundError", 404)
            except Exception as exc:  # noqa: BLE001 -- vLLM answers any other failure with its text
                return 500, error_body(str(exc), "InternalServerError", 500)
            self.lora_requests[name] = path
        return 200, "Success: LoRA adapter '%s' added successfully." % name

    def unload(self, body):
        """``POST /v1/unload_lora_adapter`` -> (status, text or ErrorResponse)."""
        name = body.get("lora_name")
        if not name:
            return 400, error_body("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput",
                                   400)
        with self.lock:
            if name not in self.lora_requests:
                return 404, error_body("The lora adapter '%s' cannot be found." % name, "NotFoundError", 404)
            del self.lora_requests[name]
        return 200, "Success: LoRA adapter '%s' removed successfully." % name

    def init_static_loras(self, values):
        """``--lora-modules`` loaded at the start; ValueError (the load's message) for one that fails."""
        for name, path in parse_lora_modules(values):
            status, answer = self.load({"lora_name": name, "lora_path": path})
            if status != 200:
                raise ValueError(answer["error"]["message"])

    def adapter_cards(self):
        """The adapters' ``/v1/models`` cards (without the fields every card has)."""
        with self.lock:
            loaded = list(self.lora_requests.items())
        return [{"id": name, "root": path, "parent": self.names[0], "max_model_len": None} for name, path in loaded]

    def adapter_piece(self, model):
        """The generated text per token through the adapter ``model`` names, None for the base model."""
        with self.lock:
            path = self.lora_requests.get(model)
        return " " + os.path.basename(path.rstrip("/")) if path else None
