"""A small client of smg's worker API (the Shepherd Model Gateway, PyPI ``smg`` 1.13.0), stdlib only.

What it uses, as smg serves it (lightseekorg/smg ``model_gateway/src/server.rs``, worker_routes;
``crates/protocols/src/worker.rs`` for the bodies):

- ``GET /workers`` -> ``{"workers": [{id, url, model_id, labels, priority, is_healthy, status, ...}], ...}``
- ``DELETE /workers/{id}`` -> 202; smg marks the worker ``draining`` (no new requests), waits its
  settle time and drops it; it does not wait for the worker's in-flight work (drain_workers.rs),
  which is why gpugate reads the server's own gauges before the stop (:func:`in_flight`).
- ``POST /workers {"url", "model_id", "labels", "priority", "runtime"}`` -> 202 with ``worker_id``;
  the worker stays pending until smg's first health probe passes.

The API key (``Authorization: Bearer``) comes from the control machine's environment variable that
fleet.yaml names (``api_key_env``); it is read per request and never printed: errors name the
router, the path and the status only. A key holding a control character (a key file saved with
CRLF) is refused before anything is sent, naming the variable; every message is masked of the key
(:meth:`SmgClient._error`), an exception's text included. A redirect is never followed: the key
would go wherever it points (the message says where, the host only).

Example::

    >>> client = SmgClient("http://127.0.0.1:9")      # nothing listens there
    >>> try:
    ...     client.workers()
    ... except RouterError as error:
    ...     print(error)                                # doctest: +ELLIPSIS
    router http://127.0.0.1:9 unreachable: GET /workers: ...
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpugate.rules import redact

__all__ = ["RouterError", "SmgClient", "in_flight", "same_url", "worker_url_key",
           "healthy_peers", "rejoin_body", "NO_REDIRECTS"]

REQUEST_TIMEOUT_S = 5.0


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Never follows a redirect (urllib re-sends every header, the key's too, to the host it names):
    the 3xx comes back as an HTTPError, which :meth:`SmgClient._request` turns into a refusal."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None


NO_REDIRECTS = urllib.request.build_opener(_NoRedirect)  # every request to a router or a worker URL
_CONTROL_NAMES = {"\r": "CR", "\n": "LF", "\0": "NUL", "\t": "TAB", "\x7f": "DEL"}


def _where(location: str | None) -> str:
    """Where a redirect points, as much as may be shown: scheme, host and port (never a user, a
    path or a query, which may carry a token).

    >>> _where("https://user:pw@other.example:8443/workers?token=x"), _where("/workers"), _where(None)
    ('https://other.example:8443', 'a path of its own (/workers)', 'nowhere it says')
    """
    if not location:
        return "nowhere it says"
    try:
        parts = urllib.parse.urlsplit(location)
        port = parts.port
    except ValueError:
        return "an URL gpugate cannot read"
    if not parts.netloc:
        return f"a path of its own ({parts.path[:60]})"
    host = parts.hostname or "?"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}" + (f":{port}" if port else "")


class RouterError(RuntimeError):
    """The router did not answer, or answered what gpugate cannot use. ``unreachable`` tells the
    first (a refusal before anything stops) from the second."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


_DEFAULT_PORTS = {"http": 80, "https": 443}


def worker_url_key(url: str) -> str:
    """A URL as a router reaches it, whatever way it is written: scheme and host in lower case, the
    scheme's default port made explicit, no trailing slash (two spellings of one URL reach one server).

    >>> worker_url_key("HTTP://Node-1.example/"), worker_url_key("http://node-1.example:80")
    ('http://node-1.example:80', 'http://node-1.example:80')
    >>> worker_url_key("https://[FD00::5]/v1/"), worker_url_key("http://10.0.0.5:30000")
    ('https://[fd00::5]:443/v1', 'http://10.0.0.5:30000')
    """
    text = str(url or "").strip()
    try:
        parts = urllib.parse.urlsplit(text)
        scheme = parts.scheme.lower()
        host = (parts.hostname or "").lower()
        port = parts.port or _DEFAULT_PORTS.get(scheme)
    except ValueError:  # not a URL the settings let through; compare it as written, in lower case
        return text.rstrip("/").lower()
    where = f"[{host}]" if ":" in host else host
    query = f"?{parts.query}" if parts.query else ""
    return f"{scheme}://{where}{f':{port}' if port else ''}{parts.path.rstrip('/')}{query}"


def same_url(a: str | None, b: str | None) -> bool:
    """Worker URLs compared by :func:`worker_url_key` (smg keeps them as registered: no trailing
    slash, scheme and host in any case, the default port written or not).

    >>> same_url("http://127.0.0.1:31129/", "HTTP://127.0.0.1:31129"), same_url("http://a:1", "http://a:2")
    (True, False)
    """
    return bool(a) and bool(b) and worker_url_key(str(a)) == worker_url_key(str(b))


def healthy_peers(workers: Sequence[Mapping[str, Any]], model_id: str | None, url: str) -> list[str]:
    """The URLs of the other workers of the same model that smg lists healthy and ready: those that
    serve while ``url`` is out (``min_serving``).

    >>> ws = [{"url": "http://a:1", "model_id": "m", "is_healthy": True, "status": "ready"},
    ...       {"url": "http://b:1", "model_id": "m", "is_healthy": True, "status": "draining"},
    ...       {"url": "http://c:1", "model_id": "x", "is_healthy": True, "status": "ready"}]
    >>> healthy_peers(ws, "m", "http://z:1")
    ['http://a:1']
    """
    return [str(w.get("url")) for w in workers
            if not same_url(w.get("url"), url) and w.get("is_healthy") and w.get("status", "ready") == "ready"
            and (model_id is None or w.get("model_id") == model_id)]


# The labels smg reads off a worker itself when it adds one (model_gateway/src/workflow/steps/local/
# discover_metadata.rs: SGLang's /server_info and /model_info fields, /v1/models' id, root and
# max_model_len, vLLM's /version): a rejoin leaves them to smg, which reads the NEW server's (smg
# merges discovered labels first and a body's labels over them, so old ones sent back would win)
SMG_DISCOVERED_LABELS = frozenset({
    "model_id", "model_path", "served_model_name", "tp_size", "dp_size", "pp_size", "load_balance_method",
    "disaggregation_mode", "version", "is_embedding", "context_length", "max_total_tokens", "max_running_requests",
    "weight_version", "tokenizer_path", "is_generation", "has_image_understanding", "has_audio_understanding",
    "model_type", "architectures", "max_model_len"})


def rejoin_body(worker: Mapping[str, Any] | None, url: str, runtime: str = "") -> dict[str, Any]:
    """The ``POST /workers`` body that adds ``url`` back with what the operator gave it: its labels,
    priority and cost, and a model id that was the operator's (one smg derived from the server's
    own served model name or path is derived again: a restart may have changed it); never the
    labels smg reads off the server itself (SMG_DISCOVERED_LABELS: the new server's, not the old
    one's); its engine's ``runtime`` (smg's ``RuntimeType``; "": left to smg's detection).

    >>> rejoin_body({"id": "w1", "model_id": "m", "labels": {"zone": "a"}, "priority": 7, "cost": 1.0,
    ...              "is_healthy": True}, "http://a:1", "vllm")
    {'url': 'http://a:1', 'runtime': 'vllm', 'model_id': 'm', 'labels': {'zone': 'a'}, 'priority': 7, 'cost': 1.0}
    >>> rejoin_body({"model_id": "old-name", "labels": {"served_model_name": "old-name", "max_model_len": "4096"}}, "http://a:1")
    {'url': 'http://a:1'}
    """
    body: dict[str, Any] = {"url": url, **({"runtime": runtime} if runtime else {})}
    labels = dict((worker or {}).get("labels") or {})
    model_id = (worker or {}).get("model_id")
    if model_id is not None and model_id not in (labels.get("served_model_name"), labels.get("model_path"),
                                                 labels.get("model_id")):
        body["model_id"] = model_id
    kept = {key: value for key, value in labels.items() if key not in SMG_DISCOVERED_LABELS}
    if kept:
        body["labels"] = kept
    for key in ("priority", "cost"):
        if worker and worker.get(key) is not None:
            body[key] = worker[key]
    return body


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    request = urllib.request.Request(url, method="GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 -- http(s) from settings
            return response.status, response.read(1 << 22)
    except urllib.error.HTTPError as error:
        return error.code, b""


def in_flight(server_url: str, read: Callable[[Callable[[str], tuple[int, bytes]]], int | None],
              timeout: float = REQUEST_TIMEOUT_S) -> int | None:
    """The server's in-flight requests, read from the server itself by ``read`` (its engine's
    ``Engine.in_flight``, given a GET of the server's paths). None when it cannot tell (not running,
    or the engine's gauges are not served)."""
    try:
        return read(lambda path: _get(server_url.rstrip("/") + path, timeout))
    except (OSError, ValueError):
        return None


def server_ready(server_url: str, paths: Sequence[str] = ("/health",), timeout: float = REQUEST_TIMEOUT_S) -> bool:
    """The engine's readiness (``paths``: its ``Engine.ready_paths``, the first that the server
    has: a 404 moves on to the next, which may be a real generation and gets a longer timeout)."""
    try:
        status = None
        for index, path in enumerate(paths):
            status, _body = _get(server_url.rstrip("/") + path, timeout if index == 0 else max(timeout, 20.0))
            if status != 404:
                break
        return status == 200
    except OSError:
        return False


class SmgClient:
    """smg's worker API at ``endpoint``; ``api_key_env``: the variable holding its key (or None)."""

    def __init__(self, endpoint: str, api_key_env: str | None = None, timeout: float = REQUEST_TIMEOUT_S):
        self.endpoint = endpoint.rstrip("/")
        self.api_key_env = api_key_env
        self.timeout = timeout

    def _key(self) -> str | None:
        """The key from ``$api_key_env``, checked before any use: a control character (a key file
        saved with CRLF; Python's HTTP client would quote the whole header in its error) or a
        character a header cannot carry is refused naming the variable, never the value."""
        if not self.api_key_env:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise RouterError(f"router {self.endpoint}: ${self.api_key_env} (its API key) is not set on this "
                              f"machine", unreachable=True)
        bad = next((c for c in key if c < " " or c == "\x7f"), None)
        if bad is not None:
            name = _CONTROL_NAMES.get(bad, f"0x{ord(bad):02x}")
            raise RouterError(f"router {self.endpoint}: the key in ${self.api_key_env} holds a control character "
                              f"({name}; a key file saved with CRLF?): nothing sent", unreachable=True)
        if any(ord(c) > 0xFF for c in key):
            raise RouterError(f"router {self.endpoint}: the key in ${self.api_key_env} holds a character an HTTP "
                              f"header cannot carry (beyond Latin-1): nothing sent", unreachable=True)
        return key

    def _error(self, message: str, unreachable: bool = False) -> RouterError:
        """Every RouterError of a request: the one place its text is masked of the key (and so of
        ``Bearer <key>``), whatever an exception or the router's answer put in it."""
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        return RouterError(redact.mask_values(message, [key]), unreachable=unreachable)

    def _open(self, request: urllib.request.Request, timeout: float) -> Any:
        return NO_REDIRECTS.open(request, timeout=timeout)

    def _request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> tuple[int, Any]:
        headers = {"accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["content-type"] = "application/json"
        key = self._key()
        if key:
            headers["authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self.endpoint + path, data=data, method=method, headers=headers)
        shown = path.split("?")[0]
        try:
            with self._open(request, timeout=self.timeout) as response:
                status, raw = response.status, response.read(1 << 24)
        except urllib.error.HTTPError as error:
            status, raw = error.code, error.read(1 << 16)
            if 300 <= status < 400:
                raise self._error(f"router {self.endpoint} redirected {method} {shown} ({status}) to "
                                  f"{_where(error.headers.get('location'))}: gpugate does not follow redirects "
                                  f"with its key (name the URL it serves at in fleet.yaml routers:)",
                                  unreachable=True) from None
        except (OSError, ValueError) as error:
            reason = getattr(error, "reason", None) or error
            raise self._error(f"router {self.endpoint} unreachable: {method} {shown}: {reason}",
                              unreachable=True) from None
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, None

    def workers(self) -> list[dict[str, Any]]:
        """Every worker smg lists (``GET /workers``)."""
        status, doc = self._request("GET", "/workers")
        if status == 401 or status == 403:
            raise self._error(f"router {self.endpoint}: GET /workers refused ({status}): check the API key "
                              f"(${self.api_key_env or '(none configured)'})", unreachable=True)
        if status != 200 or not isinstance(doc, Mapping) or not isinstance(doc.get("workers"), list):
            raise self._error(f"router {self.endpoint}: GET /workers answered {status}, not a worker list",
                              unreachable=True)
        return [dict(w) for w in doc["workers"] if isinstance(w, Mapping)]

    def find(self, url: str) -> dict[str, Any] | None:
        """The worker smg lists at ``url`` (or None)."""
        return next((w for w in self.workers() if same_url(w.get("url"), url)), None)

    def remove(self, worker_id: str) -> None:
        """``DELETE /workers/{id}``: smg stops sending it requests at once (draining), drops it later."""
        status, doc = self._request("DELETE", "/workers/" + urllib.parse.quote(str(worker_id), safe=""))
        if status not in (200, 202, 204, 404):
            raise self._error(f"router {self.endpoint}: DELETE /workers/{worker_id} answered {status}: "
                              f"{_message(doc)}")

    def add(self, body: Mapping[str, Any]) -> str | None:
        """``POST /workers``: the worker id smg gives (202); an existing worker of that URL is fine."""
        status, doc = self._request("POST", "/workers", body)
        if status in (200, 201, 202):
            return (doc or {}).get("worker_id") if isinstance(doc, Mapping) else None
        if isinstance(doc, Mapping) and doc.get("code") == "WORKER_ALREADY_EXISTS":
            found = self.find(str(body.get("url")))
            return found.get("id") if found else None
        raise self._error(f"router {self.endpoint}: POST /workers answered {status}: {_message(doc)}")


def _message(doc: Any) -> str:
    if isinstance(doc, Mapping):
        return str(doc.get("error") or doc.get("message") or doc)[:200]
    return "no JSON body"
