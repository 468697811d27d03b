"""A routed server's side of the transition, run by the controller around the agent's hand-off
(docs/transition.md, "Routed servers"):

    preflight   GET /workers: the router answers, and where it lists this server, enough other healthy
                workers of its model stay (``min_serving``); the worker URL answers as THIS server (its
                info endpoint through the URL says what the container's observe read of it: the engine's
                info keys, SGLang's per-process ``random_seed`` among them) before it leaves, and before
                a server that serves as desired is added: else REFUSED, nothing touched
    leave       DELETE /workers/{id} (not again while a removal is under way: smg ends one by URL, so a
                second would take the re-added entry out); wait until smg no longer lists it ready,
                then until the server's own in-flight count (its engine's gauges) is 0, both
                within the drain budget
    (the agent: stop, gate, start, healthy + a generation, verify; or its rollback)
    rejoin      the engine's readiness; POST /workers with what the operator gave it (labels,
                priority, cost, a model id of its own: smg reads the rest off the new server), or as
                new where it was not listed; wait until smg lists it healthy and ready: only then the next
                container of a rolling change
    put_back    an interrupted run whose server left but was not handed off (so still serves): its URL
                must still answer as this server, then rejoin (issue 32 item 5)

Membership is declared (issue 32 item 8): a routed server is a member, added once it serves and is
verified (no flag), unless ``router_cordon: true`` declares it out: then it leaves (and drains) and
stays out.

smg's own removal drains on a timer and its health checks need minutes to notice a dead worker
(shared/reference/gateway-and-fast-restart.md section 1a); this waits on what the server and the
router say instead.

Example::

    >>> pre = Preflight(worker={"id": "w1", "model_id": "m"}, peers=["http://b:1"], problem=None)
    >>> pre.lines(Routing("gw", "http://127.0.0.1:30080", "http://a:1"), drain_s=60)[0]
    'router gw: leave it (DELETE /workers/w1; 1 other healthy worker(s) of m keep serving)'
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, Literal

from gpugate.router.smg import (NO_REDIRECTS, RouterError, SmgClient, _get, healthy_peers, in_flight, rejoin_body,
                                same_url, server_ready)
from gpugate.engine import get as engine_named
from gpugate.rules import redact
from gpugate.spec import Routing

__all__ = ["Preflight", "RouterError", "client_for", "preflight", "identity_problem", "leave", "rejoin", "put_back",
           "membership", "peers_of", "metrics_page"]

POLL_S = 0.25
IDENTITY_TIMEOUT_S = 10.0  # an info endpoint that asks the scheduler answers slowly under load


def client_for(routing: Routing) -> SmgClient:
    """The client of the router a server names (smg is the one kind)."""
    return SmgClient(routing.endpoint, routing.api_key_env)


PreflightKind = Literal["no-answer", "min-serving", "not-this-server"]


@dataclasses.dataclass
class Preflight:
    """What the router says before anything stops: this server's worker entry (None: not listed),
    the other healthy workers of its model, and the refusal (None: it may leave), with its kind
    for code to decide on (never the refusal's words)."""

    worker: dict[str, Any] | None
    peers: list[str]
    problem: str | None
    kind: PreflightKind | None = None

    def lines(self, routing: Routing, drain_s: float, restart: bool = True) -> list[str]:
        """The router steps, as ``--dry`` and the plan print them (``restart``: around a restart;
        else a cordoned server that only leaves).

        >>> Preflight(None, [], None).lines(Routing("gw", "http://g:1", "http://a:1"), 60)[1]
        'router gw: add it after the verify (POST /workers url http://a:1) and wait until it is listed healthy'
        """
        where = f"router {routing.router}"
        if self.worker is None:
            if routing.cordon:
                return [f"{where}: cordoned (router_cordon: true) and not listed there: it stays out"]
            return [f"{where}: not listed there: the restart goes on without leaving it",
                    f"{where}: add it after the verify (POST /workers url {routing.worker_url}) "
                    f"and wait until it is listed healthy"]
        model = self.worker.get("model_id") or "its model"
        how = ("already leaving it (listed draining: a removal under way, no second DELETE"
               if self.worker.get("status") == "draining" else f"leave it (DELETE /workers/{self.worker.get('id')}")
        if routing.cordon:
            how = "cordoned (router_cordon: true): " + how
        steps = [f"{where}: {how}; {len(self.peers)} other healthy worker(s) of {model} keep serving)",
                f"{where}: wait until its in-flight requests are 0 (its engine's gauges on /metrics, "
                f"at most {drain_s:g} s); what is still open then (a stream longer than that) has the stop's "
                f"drain, at most {drain_s:g} s more, then is CUT by its SIGKILL (said before the stop)",
                f"{where}: after the verify (or a rollback): ready, re-add it with what was given to it "
                f"({_given(rejoin_body(self.worker, routing.worker_url))}; what smg reads off the server, its "
                f"model name among them, read anew) and wait until it is listed healthy"]
        if not routing.cordon:
            return steps
        if restart:
            return steps[:2] + [f"{where}: it stays out after the verify (router_cordon: false puts it back)"]
        return [steps[0], f"{where}: wait until its in-flight requests are 0 (at most {drain_s:g} s); the server "
                          f"is not stopped (what is still open then ends on its own)",
                f"{where}: it stays out (router_cordon: false puts it back)"]


def preflight(routing: Routing, client: SmgClient | None = None, observed: Mapping[str, Any] | None = None,
              adding_as_it_runs: bool = False) -> Preflight:
    """Read-only: may this server leave its router now, or be added to it? A refusal names the
    router and the reason (never its key). ``observed``: the container's observe document of this
    server (its ``server_info``, ``health``): given, the worker URL must answer as this server
    (:func:`identity_problem`, read by the engine's rule) before it may leave; and
    with ``adding_as_it_runs`` (a member that serves as desired, not listed: added without a
    restart) before it is added. Before a restart, an unlisted URL is not asked: the restart may be
    what makes it answer (a new ``host``), and the rejoin waits until it is ready through it."""
    client = client or client_for(routing)
    where = f"router {routing.router} ({routing.endpoint})"
    try:
        workers = client.workers()
    except RouterError as error:
        return Preflight(None, [], f"{where} did not answer ({error}): a routed server restarts only when its "
                                   f"router can take it out and put it back", "no-answer")
    worker = next((w for w in workers if same_url(w.get("url"), routing.worker_url)), None)
    if worker is None:
        wrong = (identity_problem(routing.worker_url, observed, engine_named(routing.engine).read_info)
                 if adding_as_it_runs and observed is not None and not routing.cordon else None)
        if wrong is not None:  # adding it would send this server's share of the requests elsewhere
            return Preflight(None, [], f"{where} does not list this server, and it cannot be added at "
                                       f"{routing.worker_url}: {wrong}; fix this server's router_url (the URL "
                                       f"the router reaches THIS server at)", "not-this-server")
        return Preflight(None, [], None)
    if observed is not None:
        # the leave takes out whatever serves at this URL: it must be this server (a URL another server
        # registered, a copy-paste slip in fleet.yaml), else the leave takes the OTHER out and this one
        # is stopped while the router still sends it requests
        wrong = identity_problem(routing.worker_url, observed, engine_named(routing.engine).read_info)
        if wrong is not None:
            return Preflight(worker, [], f"{where} lists worker {worker.get('id')} at {routing.worker_url}, but {wrong}; "
                                         f"fix this server's router_url (the URL the router reaches THIS server at)",
                             "not-this-server")
    peers = healthy_peers(workers, worker.get("model_id"), routing.worker_url)
    serving_now = bool(worker.get("is_healthy")) and worker.get("status", "ready") == "ready"
    if serving_now and len(peers) < routing.min_serving:
        return Preflight(worker, peers, f"taking it out of {where} would leave {len(peers)} healthy worker(s) "
                                        f"of {worker.get('model_id') or 'its model'} (min_serving "
                                        f"{routing.min_serving})", "min-serving")
    return Preflight(worker, peers, None)


def _given(body: Mapping[str, Any]) -> str:
    """What a rejoin sends beyond the URL, in words: ``model m, priority 7, 1 label(s)``."""
    said = [f"model {body['model_id']}"] if body.get("model_id") else []
    said += [f"priority {body['priority']}"] if body.get("priority") is not None else []
    said += [f"{len(body['labels'])} label(s)"] if body.get("labels") else []
    return ", ".join(said) or "nothing but its URL"


_ABSENT = object()


class _NoAnswer(Exception):
    pass


def _read_info(url: str, read_info: Callable[..., Mapping[str, Any]], timeout: float) -> tuple[str, Any]:
    """What the server at ``url`` answers as its info, read by its engine's rule (``read_info``,
    the one the container's agent uses): ``("info", (path, document))``, ``("locked", status)``
    (it asks for a key), ``("status", (path, status))``, ``("no-answer", reason)`` or ``("none",
    None)`` (every path 404)."""
    answered: list[tuple[str, int]] = []

    def get(path: str) -> tuple[int, str]:
        request = urllib.request.Request(url.rstrip("/") + path, method="GET", headers={"accept": "application/json"})
        try:
            # what answers at the worker URL itself, never where a redirect points
            with NO_REDIRECTS.open(request, timeout=timeout) as response:
                status, body = response.status, response.read(1 << 22)
        except urllib.error.HTTPError as error:
            status, body = error.code, b""
        except (OSError, ValueError) as error:
            raise _NoAnswer(str(getattr(error, "reason", None) or error)[:200]) from None
        answered.append((path, status))
        return status, body.decode(errors="replace")

    try:
        document = read_info(get)
    except _NoAnswer as error:
        return "no-answer", str(error)
    if isinstance(document.get("args"), Mapping):
        return "info", (document.get("path"), document["args"])
    for path, status in answered:
        if status in (401, 403):
            return "locked", status
    for path, status in answered:
        if status != 404:
            return "status", (path, status if status != 200 else "200 without a JSON object")
    return "none", None


def _shown(key: str, value: Any) -> str:
    if value is _ABSENT:
        return "none"
    return "***" if redact.names_a_secret(key) else json.dumps(value)[:80]


def _what(document: Mapping[str, Any]) -> str:
    """A server as its info document says (model and port, where it says them)."""
    said = [f"{key} {_shown(key, document[key])}" for key in ("model_path", "port") if key in document]
    return f"a server of {', '.join(said)}" if said else "a server"


def identity_problem(url: str, observed: Mapping[str, Any], read_info: Callable[..., Mapping[str, Any]],
                     timeout: float = IDENTITY_TIMEOUT_S) -> str | None:
    """None when ``url`` answers as the server the container's observe saw (``observed``: its
    observe document), else what answers there instead. Engine-neutral: the URL is read by the
    engine's own rule (``read_info``: its ``Engine.read_info``, as the container's agent read it);
    every plain value the observe read (the engine's info keys: port, model path, its parallelism,
    SGLang's ``random_seed``, drawn per process unless pinned) must be what the URL answers. A
    server that asks for a key neither side has cannot be told: not refused.

    - this server answers in the container: the URL must answer, and with its values;
    - it does not (not serving, no info): the URL must not answer with a server's info either."""
    info = observed.get("server_info") or {}
    mine = info.get("args") if isinstance(info.get("args"), Mapping) else None
    kind, answer = _read_info(url, read_info, timeout)
    if kind == "locked" or (mine is None and str(info.get("error") or "").startswith("unauthorized")):
        return None
    if mine is None:
        if kind == "info":
            path, document = answer
            return (f"{url}{path} answers as {_what(document)} while this server does not serve there "
                    f"(its observe read no info: {info.get('error') or 'not serving'}): another server answers at "
                    f"that URL")
        return None  # neither answers: the URL may well be this server's, down with it
    if kind == "no-answer":
        return f"{url} does not answer ({answer}) while this server serves: it cannot be told that the URL reaches it"
    if kind == "status":
        path, status = answer
        return f"{url}{path} answers {status} while this server answers its info: another server answers there?"
    if kind == "none":
        return f"{url} has no info endpoint (404) while this server answers {info.get('path') or 'its info'}"
    path, document = answer
    differ = []
    for key, value in mine.items():
        if isinstance(value, (dict, list)) or (isinstance(value, str) and "***" in value):
            continue  # a structure may hold what changes by the second; a masked value compares nothing
        theirs = document.get(key, _ABSENT)
        if theirs != value:
            differ.append(f"{key} {_shown(key, theirs)} (this server: {_shown(key, value)})")
    if not differ:
        return None
    return (f"{url}{path} answers as {_what(document)} that is not this server: {'; '.join(differ[:4])}"
            f"{f' and {len(differ) - 4} more' if len(differ) > 4 else ''}")


def leave(routing: Routing, client: SmgClient, budget_s: float,
          say: Callable[[str], None], now: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep, stop: Callable[[], bool] = lambda: False) -> None:
    """Take the server out (its entry as smg lists it now, not as the preflight saw it) and wait for
    its work to end, within ``budget_s`` (the drain budget): past it the stop goes on (the agent's
    SIGTERM drains what is left, bounded by the same budget). RouterError when smg does not answer or
    refuses the removal (nothing stopped yet). ``stop()`` true (the run was interrupted): return at
    the next look, whatever is still in flight (the caller puts it back)."""
    start = now()
    # a router that does not answer now cannot take it out: RouterError, as a refused DELETE (nothing stopped)
    current = client.find(routing.worker_url)
    # smg removes by URL at the end of a removal (its workflow finds the workers to remove by URL): a
    # second DELETE while one is under way would end after the re-add and take the new entry out again
    if current is not None and current.get("status") != "draining":
        client.remove(str(current.get("id")))
        say(f"router {routing.router}: taken out (DELETE /workers/{current.get('id')}); waiting until its "
            f"in-flight requests are 0 (at most {budget_s:g} s)")
    # smg excludes a draining worker from selection at once and drops it after its settle time
    # (drain_workers.rs): draining (or gone) is enough, waiting for gone would cost that time
    while now() - start < budget_s and not stop():
        try:
            found = client.find(routing.worker_url)
        except RouterError:
            break  # the router went away: it sends nothing more either
        if found is None or found.get("status") != "ready":
            break
        sleep(POLL_S)
    left, zeros, unread = None, 0, 0
    while now() - start < budget_s:
        if stop():
            return
        left = in_flight(routing.worker_url, engine_named(routing.engine).in_flight)
        # twice 0, a poll apart: a request smg picked just before the removal has arrived by then
        zeros = zeros + 1 if left == 0 else 0
        if zeros >= 2:
            say(left_line(routing.router, 0, budget_s, now() - start))
            return
        # twice unreadable (not running, or its gauges not served): waiting cannot tell more, and the
        # engine's own SIGTERM drain waits for what a running server still holds
        unread = unread + 1 if left is None else 0
        if unread >= 2:
            break
        sleep(POLL_S)
    say(left_line(routing.router, left, budget_s, now() - start))


def left_line(router: str, left: int | None, budget_s: float, elapsed_s: float) -> str:
    """What the leave says as it ends its wait, right before the stop: how many requests (streams
    counted with them) are still open, and what the stop does to them (issue 32 item 3: a stream
    longer than the drain budget is cut by the stop, never silently).

    >>> left_line("gw", 2, 60, 60.2)
    "router gw: left it; 2 request(s) or stream(s) still open after 60 s: the stop's SIGTERM drain gives them at most 60 s more, then its SIGKILL CUTS what is still open"
    >>> left_line("gw", 0, 60, 0.5)
    'router gw: left it; 0 requests in flight after 0.5 s'
    """
    if left == 0:
        return f"router {router}: left it; 0 requests in flight after {elapsed_s:.1f} s"
    cut = (f"the stop's SIGTERM drain gives {'them' if left else 'what is open'} at most {budget_s:g} s more, then "
           f"its SIGKILL CUTS what is still open")
    if left is None:
        return f"router {router}: left it; its in-flight count cannot be read from the server: {cut}"
    return f"router {router}: left it; {left} request(s) or stream(s) still open after {budget_s:g} s: {cut}"


def rejoin(routing: Routing, client: SmgClient, worker: Mapping[str, Any] | None, timeout_s: float,
           say: Callable[[str], None], now: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> tuple[bool, str]:
    """Put the server back: the engine's readiness, ``POST /workers`` with what was given to it
    (:func:`rejoin_body`), then until smg lists it healthy and ready, within ``timeout_s``. (ok, what
    happened) — never raises."""
    start = now()
    worker_engine = engine_named(routing.engine)
    while not server_ready(routing.worker_url, worker_engine.ready_paths):
        if now() - start >= timeout_s:
            return False, (f"not ready at {routing.worker_url} after {timeout_s:g} s ({worker_engine.ready_paths[0]}): "
                           f"not re-added")
        sleep(POLL_S)
    try:
        # smg keeps a removed worker listed as draining for its settle time (5 s): a POST for its URL
        # meanwhile answers "already exists" and the entry then disappears; add it once it is gone
        while True:
            found = client.find(routing.worker_url)
            if found is None:
                client.add(rejoin_body(worker, routing.worker_url, worker_engine.router_runtime))
                break
            if found.get("status") != "draining":
                break  # listed again already (another operator, or never removed)
            if now() - start >= timeout_s:
                return False, f"router {routing.router} still lists its old entry as draining after {timeout_s:g} s"
            sleep(POLL_S)
        while True:
            found = client.find(routing.worker_url)
            if found and found.get("is_healthy") and found.get("status", "ready") == "ready":
                return True, (f"back in router {routing.router}, listed healthy after {now() - start:.1f} s "
                              f"(worker {found.get('id')})")
            if now() - start >= timeout_s:
                state = f"listed {found.get('status')}" if found else "not listed"
                return False, f"re-added to router {routing.router} but {state} after {timeout_s:g} s"
            sleep(POLL_S)
    except RouterError as error:
        return False, f"could not re-add it to router {routing.router}: {error}"


def put_back(routing: Routing, client: SmgClient, worker: Mapping[str, Any] | None, observed: Mapping[str, Any],
             timeout_s: float, say: Callable[[str], None],
             now: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
             ) -> tuple[bool, str]:
    """An interrupted run's server that left its router but was never handed off (so never
    stopped): back in, as it was, once its URL still answers as THIS server (the container's observe
    of it: :func:`identity_problem`). (ok, what happened) — never raises; not ok leaves it out."""
    wrong = identity_problem(routing.worker_url, observed, engine_named(routing.engine).read_info)
    if wrong is not None:
        return False, f"not put back into router {routing.router}: {wrong}"
    return rejoin(routing, client, worker, timeout_s, say, now=now, sleep=sleep)


def membership(routing: Routing, workers: list[dict[str, Any]] | None, error: str | None = None) -> dict[str, Any]:
    """The status's view of one routed server: listed or not, healthy or not, as the router says,
    and whether it is declared out (``cordoned``: then out of selection, missing or draining, is
    ``cordoned``, and listed ready is ``cordoned, still listed``).

    >>> r = Routing("gw", "http://g:1", "http://a:1")
    >>> membership(r, [{"url": "http://a:1", "id": "w", "is_healthy": True, "status": "ready"}])["state"]
    'healthy'
    >>> membership(r, [])["state"], membership(r, None, "refused")["state"]
    ('missing', 'unknown')
    >>> membership(Routing("gw", "http://g:1", "http://a:1", cordon=True), [])["state"]
    'cordoned'
    """
    view: dict[str, Any] = {"router": routing.router, "url": routing.worker_url, "cordoned": routing.cordon}
    if workers is None:
        return {**view, "state": "unknown", "listed": None, "healthy": None, "error": error}
    worker = next((w for w in workers if same_url(w.get("url"), routing.worker_url)), None)
    if worker is None:
        return {**view, "state": "cordoned" if routing.cordon else "missing", "listed": False, "healthy": False}
    healthy = bool(worker.get("is_healthy")) and worker.get("status", "ready") == "ready"
    state = "healthy" if healthy else str(worker.get("status") or "unhealthy")
    if routing.cordon:  # smg sends a draining worker nothing: out, as declared
        state = "cordoned" if worker.get("status") == "draining" else "cordoned, still listed"
    return {**view, "state": state, "listed": True, "healthy": healthy, "worker_id": worker.get("id")}


def peers_of(routing: Routing, client: SmgClient | None = None) -> list[str]:
    """The worker URLs of the other healthy workers of this server's model in its router (a
    canary's unchanged replicas); RouterError when the router does not answer."""
    client = client or client_for(routing)
    workers = client.workers()
    mine = next((w for w in workers if same_url(w.get("url"), routing.worker_url)), None)
    if mine is None:  # its model unknown: every model's workers would be pooled into its baseline
        raise RouterError(f"{routing.worker_url} is not listed, so which model's replicas it is judged against is "
                          f"unknown")
    return healthy_peers(workers, mine.get("model_id"), routing.worker_url)


def metrics_page(server_url: str, timeout: float = 5.0) -> str | None:
    """The server's /metrics page (its engine's Prometheus text), None when it does not answer 200."""
    try:
        status, body = _get(server_url.rstrip("/") + "/metrics", timeout)
    except (OSError, ValueError):
        return None
    return body.decode(errors="replace") if status == 200 else None
