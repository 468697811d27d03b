"""vLLM in the container (gpugate/engine/container.py says what a container module is): its
processes, endpoints, /dev/shm segments, the installed release and how an adopted server's
environment is kept. Stdlib only: the agent loads it by name and its artifact bundles it. What is
vLLM's here, with where vLLM 0.33.0 makes it so (shared/reference/anchors-2026-12-04.md §3):

- the server main: ``vllm serve ...`` (``vllm.entrypoints.cli.main``), or the deprecated
  ``python -m vllm.entrypoints.openai.api_server``; its children carry titles
  ``VLLM::<name>`` (``vllm/utils/system_utils.py`` set_process_title, prefix
  ``$VLLM_PROCESS_NAME_PREFIX``): ``EngineCore``/``EngineCore_DP<n>`` (v1/engine/core.py),
  ``Worker`` with ``_TP<r>``/``_PP<r>``/``_DP<r>`` parts where that size is above 1
  (v1/executor/multiproc_executor.py), ``DPCoordinator``, ``APIServer_<i>``;
- rank workers: one ``Worker`` per GPU where the server spans more than one (the multiprocess
  executor); with one GPU the model runs inside EngineCore (the uniprocess executor);
- EngineCore watches no parent (0.33.0, vllm#55510): a SIGKILLed API server leaves it and its
  workers holding the GPUs, so they are this server's own to sweep (by their titles);
- endpoints: ``/health`` (200 while the engine lives, also while it shuts down), ``/v1/models``
  (the model, ``root`` its path, ``max_model_len``), ``/version``, ``/metrics``
  (``vllm:cache_config_info`` carries ``num_gpu_blocks`` and ``block_size``: the KV capacity in
  tokens); a real generation is a 1-token ``POST /v1/completions`` (``/health`` proves none);
- ``/dev/shm/vllm_offload_*.mmap`` (KV offload's CPU tier) and kvcached's segments, left by an
  unclean exit (vllm#54002, #57303);
- the weight cache (``vllm preload``; weight_cache.py): its daemons are the server's, never its clients.

Example::

    >>> is_main_argv(["vllm", "serve", "/models/m", "--port", "8001"]), argv_port(["vllm", "serve", "--port=8001"])
    (True, 8001)
    >>> is_worker_argv(["VLLM::EngineCore"]), is_scheduler_argv(["VLLM::Worker_TP1"])
    (True, True)
"""

from __future__ import annotations

import json
import os

from gpugate.engine import gpus as rules_gpus
from gpugate.engine import installed
from gpugate.engine.argv import adopt_env, flag_int, flag_value, python_module
from gpugate.engine.installed import torch_version
from gpugate.engine.vllm.weight_cache import (
    DAEMON_NOT_READY, READY_TEMPLATE_ENV, SOCKET_TEMPLATE_ENV, cache_key, config_summary, daemon_answers, file_paths,
    is_daemon_argv, key_changes, model_config_sha256, parse_ready, read_ready)

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

ENGINE_NAME = "vllm"
LABEL = "vLLM"
MAIN_TEXT = "a vLLM server (vllm serve / python -m vllm.entrypoints.cli.main serve)"
DEFAULT_PORT = 8000
HEALTH_PATH = "/health"
GENERATE_PATH = None  # type: Optional[str]
INFO_PATHS = ("/v1/models", "/version", "/metrics")
INFO_KEYS = ("model_path", "served_model_name", "max_model_len", "version", "num_gpu_blocks", "block_size",
             "kv_cache_tokens")
CAPACITY_KEYS = ("kv_cache_tokens", "max_model_len", "version")
SHM_PREFIXES = ("vllm_offload_", "kvcached_vLLM_")
MAIN_MODULES = ("vllm.entrypoints.cli.main", "vllm.entrypoints.openai.api_server")
TITLE_PREFIX = (os.environ.get("VLLM_PROCESS_NAME_PREFIX") or "VLLM") + "::"
WORKER_TITLE = TITLE_PREFIX + "Worker"
TABLE_SOURCE = "vllm/engine/arg_utils.py"
TABLE_DIR = "/var/lib/gpugate/vllm-flags"
ADOPT_ENV_PREFIXES = ("VLLM_", "CUDA_", "NCCL_", "NVIDIA_", "HF_", "HUGGING_FACE_", "TORCH", "PYTORCH_",
                      "TRANSFORMERS_", "TOKENIZERS_", "OMP_", "MKL_", "TRITON_", "FLASHINFER_", "UCX_", "GLOO_",
                      "MASTER_", "RAY_")
ADOPT_ENV_NAMES = ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "VIRTUAL_ENV")


def _serve_index(argv: Sequence[str]) -> int | None:
    """The index of ``serve`` in a ``vllm serve`` command (console script or the CLI's module)."""
    if not argv:
        return None
    program = os.path.basename(argv[0])
    if program == "vllm" and len(argv) > 1 and argv[1] == "serve":
        return 1
    if program.startswith("python"):
        module = python_module(argv)
        if module == "vllm.entrypoints.cli.main":
            for index, token in enumerate(argv[:6]):
                if token == "serve":
                    return index
        if len(argv) > 2 and os.path.basename(argv[1]) == "vllm" and argv[2] == "serve":
            return 2
    return None


def is_main_argv(argv: Sequence[str] | None) -> bool:
    """vLLM's API server main: ``vllm serve``, ``python -m vllm.entrypoints.cli.main serve`` or
    ``python -m vllm.entrypoints.openai.api_server`` (the bench and other subcommands are not)."""
    if not argv:
        return False
    return _serve_index(argv) is not None or python_module(argv) == "vllm.entrypoints.openai.api_server"


def is_worker_argv(argv: Sequence[str] | None) -> bool:
    """A vLLM server's child by its title: EngineCore, Worker_*, DPCoordinator, APIServer_*."""
    return bool(argv and argv[0].startswith(TITLE_PREFIX))


def is_scheduler_argv(argv: Sequence[str] | None) -> bool:
    """One rank's worker (the multiprocess executor's): what the server must keep alive."""
    return bool(argv and argv[0].startswith(WORKER_TITLE))


def is_server_part(argv: Sequence[str] | None) -> bool:
    return is_main_argv(argv) or is_worker_argv(argv)


def is_client_argv(argv: Sequence[str] | None) -> bool:
    """vLLM's own clients (``vllm bench``, ``vllm chat``...): reported, never signalled.

    >>> is_client_argv(["vllm", "bench", "serve"]), is_client_argv(["vllm", "serve", "/m"])
    (True, False)
    """
    if not argv or is_main_argv(argv) or is_daemon_argv(argv):  # its weight cache's daemons are the server's
        return False
    if os.path.basename(argv[0]) == "vllm":
        return True
    return (python_module(argv) or "").startswith("vllm.")


def expected_workers(gpus: Sequence[int] | None) -> int | None:
    """One Worker per GPU where the server spans more than one; none on one GPU (uniprocess)."""
    if gpus is None:
        return None
    return len(gpus) if len(gpus) > 1 else 0


def argv_port(argv: Sequence[str]) -> int:
    return flag_int(argv, DEFAULT_PORT, "--port")


def argv_host(argv: Sequence[str]) -> str:
    return flag_value(argv, "--host") or "127.0.0.1"


def argv_model(argv: Sequence[str]) -> str | None:
    """``--model``, else the positional model tag after ``serve``."""
    model = flag_value(argv, "--model")
    if model:
        return model
    index = _serve_index(argv)
    if index is not None and index + 1 < len(argv) and not argv[index + 1].startswith("-"):
        return argv[index + 1]
    return None


def argv_token(argv: Sequence[str], admin: bool = False) -> str | None:
    """The key a request needs: ``--api-key`` (vLLM has no separate admin key)."""
    return flag_value(argv, "--api-key")


def served_model_name(argv: Sequence[str]) -> str | None:
    """The name requests give as ``model``: the first ``--served-model-name``, else the model."""
    named = flag_value(argv, "--served-model-name")
    return named or argv_model(argv)


def server_gpus(argv: Sequence[str], env: Mapping[str, str] | None = None,
                uuids: Sequence[str | None] | None = None) -> List[int] | None:
    """The GPUs a vLLM server uses: ``tp x pp x local dp`` ranks from device 0 of what
    CUDA_VISIBLE_DEVICES shows (vLLM has no base GPU id). None when they cannot be told.

    >>> server_gpus(["vllm", "serve", "/m", "-tp", "2"], {"CUDA_VISIBLE_DEVICES": "4,5"})
    [4, 5]
    """
    dp = flag_int(argv, 0, "--data-parallel-size-local", "-dpl") or flag_int(argv, 1, "--data-parallel-size", "-dp")
    try:
        return rules_gpus.gpu_set(
            tp=flag_int(argv, 1, "--tensor-parallel-size", "-tp"), pp=flag_int(argv, 1, "--pipeline-parallel-size", "-pp"),
            dp=dp, visible=(env or {}).get("CUDA_VISIBLE_DEVICES"), uuids=uuids)
    except rules_gpus.GpuSetError:
        return None


def adopted_env(environ: Mapping[str, str] | None, keep_names: Sequence[str] = (),
                argv: Sequence[str] | None = None) -> Dict[str, str]:
    """What an adopted vLLM server's environment keeps: the names vLLM and its libraries read."""
    return adopt_env(environ, keep_names, argv, ADOPT_ENV_PREFIXES, ADOPT_ENV_NAMES)


def engine_version() -> str | None:
    return installed.package_version("vllm")


def flag_table_key() -> dict | None:
    """The key of the container's own vLLM flag table (gpugate/engine/vllm/table_builder.py)."""
    return installed.flag_table_key("vllm", TABLE_SOURCE, TABLE_DIR)


def generation_request(argv: Sequence[str] | None) -> Tuple[str, str, Optional[bytes]]:
    """A real one-token generation: ``POST /v1/completions`` to the served model (vLLM has no GET
    that generates; ``/health`` proves none)."""
    body = {"model": served_model_name(argv or []) or "", "prompt": "ping", "max_tokens": 1, "temperature": 0}
    return "POST", "/v1/completions", json.dumps(body).encode()


# ---------------------------------------------------------------- live changes (docs/live-changes.md)
# vLLM 0.33.0 vllm/entrypoints/serve/lora/: mounted with VLLM_ALLOW_RUNTIME_LORA_UPDATING; success is a
# 200 with a plain text, a failure an ErrorResponse ({"error": {"message"}}) with 400 or 404.
def read_live(get: Callable[[str], Tuple[int | None, str]]) -> Dict[str, Any] | None:
    """What the server serves: the base card's ``root`` (the model path) and each adapter's card
    (``parent``: the base) of ``/v1/models``.

    >>> read_live(lambda path: (200, '{"data": [{"id": "m", "root": "/m", "parent": null}, {"id": "a", "root": "/a", "parent": "m"}]}'))
    {'model_path': '/m', 'lora_adapters': {'a': '/a'}}
    """
    status, body = get("/v1/models")
    try:
        cards = json.loads(body).get("data") if status == 200 else None
    except (ValueError, AttributeError):
        cards = None
    if not isinstance(cards, list):
        return None
    base = [card for card in cards if isinstance(card, dict) and not card.get("parent")]
    adapters = dict((str(card.get("id")), str(card.get("root"))) for card in cards
                    if isinstance(card, dict) and card.get("parent"))
    return {"model_path": base[0].get("root") if base else None, "lora_adapters": adapters}


def live_request(change: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """The POST (path, JSON body) of a live change: adapters only (vLLM's weights: a restart)."""
    if change.get("op") == "load_adapter":
        return "/v1/load_lora_adapter", {"lora_name": change["name"], "lora_path": change["path"]}
    if change.get("op") == "unload_adapter":
        return "/v1/unload_lora_adapter", {"lora_name": change["name"]}
    raise ValueError("vLLM changes no %r live" % (change.get("op"),))


def answer_problem(status: int | None, body: str) -> str | None:
    """None for vLLM's success (200), else its error's message.

    >>> answer_problem(404, '{"error": {"message": "The lora adapter \\'a\\' cannot be found."}}')
    "HTTP 404: The lora adapter 'a' cannot be found."
    """
    if status == 200:
        return None
    try:
        doc = json.loads(body)
        said = (doc.get("error") or {}).get("message") if isinstance(doc.get("error"), dict) else doc.get("message")
    except (ValueError, AttributeError):
        said = None
    return "HTTP %s: %s" % (status, (said or body or "no answer")[:300])


def generation_through(adapter: str | None, argv: Sequence[str] | None = None) -> Tuple[str, str, bytes]:
    """A 2-token completion through ``adapter`` (its name is its model id), else the served model."""
    body = {"model": adapter or served_model_name(argv or []) or "", "prompt": "gpugate live check", "max_tokens": 2,
            "temperature": 0}
    return "POST", "/v1/completions", json.dumps(body).encode()


def generation_problem(status: int | None, body: str) -> str | None:
    """None for a completion with text, else why not.

    >>> generation_problem(200, '{"choices": [{"text": " hi"}]}') is None, generation_problem(404, "{}")
    (True, 'HTTP 404: {}')
    """
    try:
        choices = json.loads(body).get("choices") if status == 200 else None
    except (ValueError, AttributeError):
        choices = None
    if not isinstance(choices, list) or not choices:
        return "HTTP %s: %s" % (status, (body or "no answer")[:200])
    return None if (choices[0] or {}).get("text") else "the completion produced no text"


def metric_samples(text: str, name: str) -> List[Dict[str, str]]:
    """The label sets of every sample of metric ``name`` in Prometheus text (values kept as
    ``_value``).

    >>> metric_samples('vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0', "vllm:cache_config_info")
    [{'block_size': '16', 'num_gpu_blocks': '100', '_value': '1.0'}]
    """
    out = []
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
            continue
        labels = {}  # type: Dict[str, str]
        rest = line[len(name):]
        if rest.startswith("{"):
            inner, _, rest = rest[1:].partition("}")
            for part in inner.split('",'):
                key, _, value = part.partition("=")
                labels[key.strip()] = value.strip().strip('"')
        labels["_value"] = rest.strip().split(" ")[0]
        out.append(labels)
    return out


def read_info(get: Callable[[str], Tuple[int | None, str]]) -> Dict[str, Any]:
    """The info document, flat: ``/v1/models`` (model_path, served_model_name, max_model_len),
    ``/version`` and ``/metrics``'s ``vllm:cache_config_info`` (num_gpu_blocks x block_size =
    kv_cache_tokens). ``get(path)`` -> (status, body). -> {"path", "error", "status", "args"}."""
    status, body = get("/v1/models")
    if status in (401, 403):
        return {"path": "/v1/models", "error": "unauthorized (%d)" % status, "status": status, "args": None}
    if status != 200:
        return {"path": "/v1/models", "error": body if status is None else "HTTP %s" % status, "args": None}
    try:
        models = json.loads(body).get("data") or []
    except (ValueError, AttributeError):
        return {"path": "/v1/models", "error": "not JSON", "args": None}
    args = {}  # type: Dict[str, Any]
    if models and isinstance(models[0], dict):
        args["served_model_name"] = models[0].get("id")
        args["model_path"] = models[0].get("root") or models[0].get("id")
        if models[0].get("max_model_len") is not None:
            args["max_model_len"] = models[0]["max_model_len"]
    status, body = get("/version")
    if status == 200:
        try:
            args["version"] = json.loads(body).get("version")
        except (ValueError, AttributeError):
            pass
    status, body = get("/metrics")
    if status == 200:
        for labels in metric_samples(body, "vllm:cache_config_info")[:1]:
            try:
                blocks, size = int(labels.get("num_gpu_blocks") or 0), int(labels.get("block_size") or 0)
            except ValueError:
                continue
            if blocks and size:
                args.update(num_gpu_blocks=blocks, block_size=size, kv_cache_tokens=blocks * size)
    return {"path": "/v1/models", "error": None, "args": args}


__all__ = ["answer_problem", "generation_problem", "generation_through", "live_request", "read_live",
           "ADOPT_ENV_NAMES", "ADOPT_ENV_PREFIXES", "CAPACITY_KEYS", "DAEMON_NOT_READY", "DEFAULT_PORT", "ENGINE_NAME",
           "GENERATE_PATH", "READY_TEMPLATE_ENV", "SOCKET_TEMPLATE_ENV", "cache_key", "config_summary", "daemon_answers",
           "file_paths", "is_daemon_argv", "key_changes", "model_config_sha256", "parse_ready", "read_ready",
           "HEALTH_PATH", "INFO_KEYS", "INFO_PATHS", "LABEL", "MAIN_TEXT", "SHM_PREFIXES", "adopted_env", "argv_host",
           "argv_model", "argv_port", "argv_token", "engine_version", "expected_workers", "flag_table_key",
           "generation_request", "is_client_argv", "is_main_argv", "is_scheduler_argv", "is_server_part",
           "is_worker_argv", "read_info", "server_gpus", "torch_version"]
