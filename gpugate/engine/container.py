"""The container half of an engine: what the agent needs of the server it runs, as one stdlib-only
module per engine (``gpugate/engine/<name>/container.py`` for the engines gpugate ships), named by
the engine (``Engine.container_module``) and loaded by the agent (gpugate.agent.engine) from the
name the controller's document carries. The agent's artifact bundles the container module of every
installed engine (gpugate.bundle), and the engines' table of them (``MODULES``).

A container module defines the names below; the agent takes this module's value for a name that
the engine's module leaves out, so an engine defines only what is its own. The names:

================== ==========================================================================
``DEFAULT_PORT``   the port a server listens on when its argv says none
``ENGINE_NAME``    the engine's name (its entry point's)
``LABEL``          how the agent's messages name it ("SGLang")
``MAIN_TEXT``      what a server main's argv looks like, for a refusal of another argv
``is_main_argv``   argv -> a server main of this engine?
``is_worker_argv`` argv -> one of a server's own child processes (by its title)?
``is_scheduler_argv`` argv -> a rank's worker that the server must keep alive?
``is_server_part`` argv -> main or worker
``expected_workers(gpus)``: how many rank workers a server on these GPUs keeps alive
``is_client_argv`` argv -> the engine's own clients (benchmarks): reported, never signalled
``argv_port``, ``argv_host``, ``argv_model``, ``argv_token(argv, admin)``: what an argv says
``server_gpus(argv, env, uuids)``: the GPUs a running server uses (None: cannot tell)
``adopted_env(environ, keep_names, argv)``: what a server we did not start keeps of its environment
``SHM_PREFIXES``   the /dev/shm segments its servers leave behind on a SIGKILL
``HEALTH_PATH``, ``GENERATE_PATH``, ``INFO_PATHS``: health, a GET that proves a real generation,
                   the info documents (first that answers) verified after a start
``generation_request(argv)``: (method, path, JSON body or None) of a real generation (default:
                   ``GET GENERATE_PATH``; vLLM: a 1-token ``POST /v1/completions``)
``read_info(get)``: the info document, flat (default: the first of ``INFO_PATHS`` that answers;
                   ``get(path)`` -> (status, body))
``INFO_KEYS``, ``CAPACITY_KEYS``: what observe and the start keep of the info document
``engine_version()``: the installed release, read without importing it (None: not installed)
``flag_table_key()``: the key of the container's own flag table (None: the engine has none)
``steady_argv``, ``gated_argv``: a running engine's argv without its launch-only options
``is_daemon_argv``, ``cache_key``, ``key_changes``, ...: the weight cache, where the engine has one;
                   ``read_ready(uuid, env)``: the daemon of that GPU ({"pid", "config"}) once it
                   serves, else None; ``daemon_answers(socket, timeout)``: it answers the engine's
                   own request; ``DAEMON_NOT_READY``: how a GPU whose daemon does not serve yet is said
``read_live(get)``: what the server serves now, ``{"model_path", "lora_adapters"}`` (None: the
                   engine changes nothing live); ``model_shape(path)``: the architecture and
                   shapes of a model's config.json; ``live_request(op)``, ``undo_of(op)``,
                   ``answer_problem``, ``generation_through(adapter)``, ``generation_problem``: a
                   live change applied, undone and proven (docs/live-changes.md)
================== ==========================================================================

Example::

    >>> from gpugate.engine import container
    >>> container.steady_argv(["python3", "-m", "server"]), container.is_client_argv(["python3"])
    (['python3', '-m', 'server'], False)
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

DEFAULT_PORT = 8000
LABEL = "the server"
MAIN_TEXT = "a server main"
SHM_PREFIXES = ()  # type: tuple
HEALTH_PATH = "/health"
GENERATE_PATH = None  # type: Optional[str]
INFO_PATHS = ()  # type: tuple
INFO_KEYS = None  # type: Optional[tuple]
CAPACITY_KEYS = ()  # type: tuple
# gpugate.engine.container.MODULES: engine name -> its container module. The agent's artifact
# carries the table (gpugate.bundle writes it as gpugate.engine.bundled); from the package it is
# read from the installed entry points (modules()).


def is_worker_argv(argv: Sequence[str] | None) -> bool:
    return False


def is_scheduler_argv(argv: Sequence[str] | None) -> bool:
    return False


def is_client_argv(argv: Sequence[str] | None) -> bool:
    return False


def expected_workers(gpus: Sequence[int] | None) -> int | None:
    """How many rank workers (``is_scheduler_argv``) a server on these GPUs keeps alive: 0 for an
    engine without them; None when it cannot be told."""
    return 0


def argv_token(argv: Sequence[str], admin: bool = False) -> str | None:
    return None


def adopted_env(environ: Mapping[str, str] | None, keep_names: Sequence[str] = (),
                argv: Sequence[str] | None = None) -> Dict[str, str]:
    keep = set(keep_names or ())
    return dict((name, value) for name, value in sorted((environ or {}).items()) if name in keep)


def engine_version() -> str | None:
    return None


def torch_version() -> str | None:
    return None


def flag_table_key() -> dict | None:
    return None


def steady_argv(argv: Sequence[str] | None) -> List[str]:
    return list(argv or [])


def gated_argv(argv: Sequence[str], gate_port: int) -> List[str]:
    raise NotImplementedError("this engine has no gated launch")


def is_daemon_argv(argv: Sequence[str] | None) -> bool:
    return False


def model_config_sha256(model_path: str | None) -> str | None:
    return None


DAEMON_NOT_READY = "its daemon does not serve yet"


def read_ready(uuid: str, env: Mapping[str, str] | None = None) -> Dict[str, Any] | None:
    return None  # an engine without a weight cache has no daemon


def daemon_answers(socket_path: str, timeout: float = 2.0) -> bool:
    """A daemon listens on ``socket_path`` (an engine with a request of its own asks it that)."""
    import socket  # noqa: PLC0415

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(socket_path)
            return True
    except OSError:
        return False


def read_live(get: Callable[[str], Tuple[Optional[int], str]]) -> Dict[str, Any] | None:
    return None  # an engine that changes nothing while it serves


def undo_of(change: Dict[str, Any]) -> Dict[str, Any]:
    """The live change that puts back what ``change`` changed (an adapter unloaded is loaded from its
    path again; the previous weights are loaded back).

    >>> undo_of({"op": "update_weights", "model_path": "/m2", "previous": "/m"})
    {'op': 'update_weights', 'model_path': '/m', 'previous': '/m2'}
    """
    op = change.get("op")
    if op == "load_adapter":
        return {"op": "unload_adapter", "name": change["name"], "path": change["path"]}
    if op == "unload_adapter":
        return {"op": "load_adapter", "name": change["name"], "path": change["path"]}
    return {"op": "update_weights", "model_path": change["previous"], "previous": change["model_path"]}


def live_request(change: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    raise ValueError("this engine changes nothing while it serves")


def answer_problem(status: int | None, body: str) -> str | None:
    return None if status == 200 else "HTTP %s: %s" % (status, (body or "no answer")[:300])


def generation_through(adapter: str | None, argv: Sequence[str] | None = None) -> Tuple[str, str, Optional[bytes]]:
    raise ValueError("this engine changes nothing while it serves")


def generation_problem(status: int | None, body: str) -> str | None:
    return None if status == 200 else "HTTP %s: %s" % (status, (body or "no answer")[:200])


# what decides whether two checkpoints have the same weights' shapes (Hugging Face config.json)
SHAPE_KEYS = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings",
              "torch_dtype", "quantization_config")


def model_shape(path: str | None) -> Dict[str, Any] | None:
    """The architecture and shapes a model directory's config.json gives (SHAPE_KEYS), None where it
    cannot be read (a repo id, no such file): the same dict for two checkpoints of one model.

    >>> model_shape("/no/such/model") is None
    True
    """
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415

    if not path or not path.startswith("/"):
        return None
    try:
        with open(os.path.join(path, "config.json")) as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    return dict((key, config.get(key)) for key in SHAPE_KEYS)


# The defaults of ``generation_request`` and ``read_info`` read the engine's own constants: the agent
# passes the engine's module first (gpugate.agent.engine binds it).
def default_generation_request(module: Any, argv: Sequence[str] | None) -> Tuple[str, str, Optional[bytes]]:
    """``GET GENERATE_PATH`` (an engine without one: its health)."""
    path = getattr(module, "GENERATE_PATH", GENERATE_PATH) or getattr(module, "HEALTH_PATH", HEALTH_PATH)
    return "GET", str(path), None


def default_read_info(module: Any, get: Callable[[str], Tuple[Optional[int], str]]) -> Dict[str, Any]:
    """The first of the engine's ``INFO_PATHS`` that answers, parsed: {"path", "error", "status", "args"}."""
    import json  # noqa: PLC0415

    for path in getattr(module, "INFO_PATHS", INFO_PATHS):
        status, body = get(path)
        if status in (401, 403):
            return {"path": path, "error": "unauthorized (%d)" % status, "status": status, "args": None}
        if status == 200:
            try:
                info = json.loads(body)
            except ValueError:
                return {"path": path, "error": "not JSON", "args": None}
            if not isinstance(info, dict):
                return {"path": path, "error": "not an object", "args": None}
            return {"path": path, "error": None, "args": info}
        if status is None:
            return {"path": path, "error": body, "args": None}
    return {"path": None, "error": "no server info endpoint answered", "args": None}


def modules() -> Dict[str, str]:
    """Engine name -> container module: the bundle's table in a container, else the entry points
    of the installed engines (``gpugate.engines``: each engine object names its module)."""
    try:
        from gpugate.engine import bundled  # type: ignore[attr-defined]  # only in the agent's artifact

        return dict(bundled.MODULES)
    except ImportError:
        from gpugate.engine import EngineError, get, names  # the package: the controller's registry

        out = {}
        for name in names():
            try:
                out[name] = get(name).container_module
            except EngineError:  # a broken plug-in: no engine of this agent's
                continue
        return out


def default_engine() -> str:
    """The engine of a document that names none: the ``engine`` setting's default (the bundle
    carries it; the package has it in gpugate.engine)."""
    try:
        from gpugate.engine import bundled  # type: ignore[attr-defined]

        return str(bundled.DEFAULT)
    except ImportError:
        from gpugate.engine import DEFAULT_ENGINE

        return DEFAULT_ENGINE
