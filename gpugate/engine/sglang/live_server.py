"""SGLang's live changes in the container (stdlib only: bundled into the agent): what the server
serves now, the request of each live change (its undo: the interface's ``undo_of``), and the generation that proves an
adapter works. The controller's half (which change is live) is gpugate/engine/sglang/live.py.

Read from SGLang 0.5.23 (paths under ``sglang/srt/``): ``/model_info`` (``/get_model_info`` on older
releases) reports the model path the tokenizer manager serves, moved by a weight update
(``_update_model_path_info``), while ``/server_info`` keeps the launch's; ``/v1/models`` lists the
served model, then each adapter ``{"id": NAME, "root": PATH, "parent": <served>}``; an unloaded
adapter is loaded again, silently, when a request names it (``lora_ref_cache``): an unload is
verified through ``/v1/models``, never by a request. A NaN checkpoint answers 200 with an empty text
and ``finish_reason.matched`` "NaN happened" (managers/schedule_batch.py).

Example::

    >>> live_request({"op": "load_adapter", "name": "b", "path": "/m/b"})
    ('/load_lora_adapter', {'lora_name': 'b', 'lora_path': '/m/b'})
"""

from __future__ import annotations

import json

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Callable, Dict, Optional, Sequence, Tuple

    Get = Callable[[str], Tuple[Optional[int], str]]

MODEL_INFO_PATHS = ("/model_info", "/get_model_info")
NAN_HAPPENED = "NaN happened"


def _json(status: int | None, body: str) -> Any:
    if status != 200:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def read_live(get: Get) -> Dict[str, Any] | None:
    """What the server serves now: ``{"model_path", "lora_adapters": {name: path}}`` (None where it
    does not answer); ``get(path) -> (status, body)``.

    >>> pages = {"/model_info": (200, '{"model_path": "/m2"}'), "/v1/models": (200, '{"data": [{"id": "/m2", "parent": null},'
    ...          ' {"id": "a", "root": "/m/a", "parent": "/m2"}]}')}
    >>> read_live(lambda path: pages.get(path, (404, "")))
    {'model_path': '/m2', 'lora_adapters': {'a': '/m/a'}}
    """
    info = None
    for path in MODEL_INFO_PATHS:
        info = _json(*get(path))
        if isinstance(info, dict):
            break
    models = _json(*get("/v1/models"))
    if not isinstance(info, dict) or not isinstance(models, dict):
        return None
    adapters = dict((str(card.get("id")), str(card.get("root")))
                    for card in models.get("data") or [] if isinstance(card, dict) and card.get("parent"))
    return {"model_path": info.get("model_path"), "lora_adapters": adapters}


def live_request(change: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """The POST (path, JSON body) that applies one live change (gpugate.engine.Change's ``op``)."""
    op = change.get("op")
    if op == "load_adapter":
        return "/load_lora_adapter", {"lora_name": change["name"], "lora_path": change["path"]}
    if op == "unload_adapter":
        return "/unload_lora_adapter", {"lora_name": change["name"]}
    if op == "update_weights":
        return "/update_weights_from_disk", {"model_path": change["model_path"]}
    raise ValueError("no live change %r" % (op,))


def answer_problem(status: int | None, body: str) -> str | None:
    """None when the engine answered success, else what it said (SGLang: 200 with ``success`` true;
    400 with ``success`` false and ``message`` or ``error_message``).

    >>> answer_problem(400, '{"success": false, "error_message": "LoRA is not enabled."}')
    'HTTP 400: LoRA is not enabled.'
    """
    doc = _json(200, body) if status is not None else None
    if status == 200 and isinstance(doc, dict) and doc.get("success") is not False:
        return None
    said = (doc.get("message") or doc.get("error_message")) if isinstance(doc, dict) else None
    return "HTTP %s: %s" % (status, (said or body or "no answer")[:300])


def generation_through(adapter: str | None, argv: Sequence[str] | None = None) -> Tuple[str, str, bytes]:
    """(method, path, body) of a short real generation, through ``adapter`` when given."""
    body = {"text": "gpugate live check", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    if adapter:
        body["lora_path"] = adapter
    return "POST", "/generate", json.dumps(body).encode()


def generation_problem(status: int | None, body: str) -> str | None:
    """None for a real generation, else why not (an error, a NaN checkpoint's empty answer).

    >>> generation_problem(200, '{"text": "", "meta_info": {"finish_reason": {"matched": "NaN happened"}}}')
    'the generation ended at once: NaN happened (the weights cannot generate)'
    >>> generation_problem(200, '{"text": " lab lab", "meta_info": {}}') is None
    True
    """
    doc = _json(status, body)
    if not isinstance(doc, dict):
        return "HTTP %s: %s" % (status, (body or "no answer")[:200])
    finish = (doc.get("meta_info") or {}).get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("matched") == NAN_HAPPENED:
        return "the generation ended at once: NaN happened (the weights cannot generate)"
    if not doc.get("text"):
        return "the generation produced no text"
    return None
