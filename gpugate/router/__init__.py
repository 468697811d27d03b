"""A routed server's side of the transition, run by the controller around the agent's hand-off
(docs/transition.md, "Routed servers"):

    preflight   GET /workers: the router answers, lists this server, and enough other healthy workers
                of its model stay (``min_serving``): else REFUSED, nothing touched
    leave       DELETE /workers/{id} (not again while a removal is under way: smg ends one by URL, so a
                second would take the re-added entry out); wait until smg no longer lists it ready,
                then until the server's own in-flight count (SGLang's /metrics gauges) is 0, both
                within the drain budget
    (the agent: stop, gate, start, healthy + a generation, verify; or its rollback)
    rejoin      /ready; POST /workers with what it had (model id, labels, priority, cost); wait until
                smg lists it healthy and ready: only then the next container of a rolling change

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
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from gpugate.router.smg import (RouterError, SmgClient, healthy_peers, in_flight, rejoin_body, same_url,
                                server_ready)
from gpugate.spec import Routing

__all__ = ["Preflight", "RouterError", "client_for", "preflight", "leave", "rejoin", "membership"]

POLL_S = 0.25


def client_for(routing: Routing) -> SmgClient:
    """The client of the router a server names (smg is the one kind)."""
    return SmgClient(routing.endpoint, routing.api_key_env)


PreflightKind = Literal["no-answer", "not-listed", "min-serving"]


@dataclasses.dataclass
class Preflight:
    """What the router says before anything stops: this server's worker entry (None: not listed),
    the other healthy workers of its model, and the refusal (None: it may leave), with its kind
    for code to decide on (never the refusal's words)."""

    worker: dict[str, Any] | None
    peers: list[str]
    problem: str | None
    kind: PreflightKind | None = None

    def lines(self, routing: Routing, drain_s: float) -> list[str]:
        """The router steps, as ``--dry`` and the plan print them."""
        where = f"router {routing.router}"
        if self.worker is None:
            return [f"{where}: not listed there: the restart goes on without leaving it",
                    f"{where}: add it after the verify (POST /workers url {routing.worker_url}; "
                    f"--data router_register=true) and wait until it is listed healthy"]
        model = self.worker.get("model_id") or "its model"
        how = ("already leaving it (listed draining: a removal under way, no second DELETE"
               if self.worker.get("status") == "draining" else f"leave it (DELETE /workers/{self.worker.get('id')}")
        return [f"{where}: {how}; {len(self.peers)} other healthy worker(s) of {model} keep serving)",
                f"{where}: wait until its in-flight requests are 0 (/metrics num_running_reqs + num_queue_reqs, "
                f"at most {drain_s:g} s)",
                f"{where}: after the verify (or a rollback): /ready, re-add it as it was (model {model}, "
                f"priority {self.worker.get('priority', '-')}, {len(self.worker.get('labels') or {})} label(s)) "
                f"and wait until it is listed healthy"]


def preflight(routing: Routing, client: SmgClient | None = None) -> Preflight:
    """Read-only: may this server leave its router now? A refusal names the router and the reason
    (never its key)."""
    client = client or client_for(routing)
    where = f"router {routing.router} ({routing.endpoint})"
    try:
        workers = client.workers()
    except RouterError as error:
        return Preflight(None, [], f"{where} did not answer ({error}): a routed server restarts only when its "
                                   f"router can take it out and put it back", "no-answer")
    worker = next((w for w in workers if same_url(w.get("url"), routing.worker_url)), None)
    if worker is None:
        if routing.register:
            return Preflight(None, [], None)
        return Preflight(None, [], f"{where} does not list this server (no worker at {routing.worker_url}); "
                                   f"`--data router_register=true` adds it after the restart", "not-listed")
    peers = healthy_peers(workers, worker.get("model_id"), routing.worker_url)
    serving_now = bool(worker.get("is_healthy")) and worker.get("status", "ready") == "ready"
    if serving_now and len(peers) < routing.min_serving:
        return Preflight(worker, peers, f"taking it out of {where} would leave {len(peers)} healthy worker(s) "
                                        f"of {worker.get('model_id') or 'its model'} (min_serving "
                                        f"{routing.min_serving})", "min-serving")
    return Preflight(worker, peers, None)


def leave(routing: Routing, client: SmgClient, budget_s: float,
          say: Callable[[str], None], now: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> None:
    """Take the server out (its entry as smg lists it now, not as the preflight saw it) and wait for
    its work to end, within ``budget_s`` (the drain budget): past it the stop goes on (the agent's
    SIGTERM drains what is left, bounded by the same budget). RouterError when smg does not answer or
    refuses the removal (nothing stopped yet)."""
    start = now()
    # a router that does not answer now cannot take it out: RouterError, as a refused DELETE (nothing stopped)
    current = client.find(routing.worker_url)
    # smg removes by URL at the end of a removal (its workflow finds the workers to remove by URL): a
    # second DELETE while one is under way would end after the re-add and take the new entry out again
    if current is not None and current.get("status") != "draining":
        client.remove(str(current.get("id")))
    # smg excludes a draining worker from selection at once and drops it after its settle time
    # (drain_workers.rs): draining (or gone) is enough, waiting for gone would cost that time
    while now() - start < budget_s:
        try:
            found = client.find(routing.worker_url)
        except RouterError:
            break  # the router went away: it sends nothing more either
        if found is None or found.get("status") != "ready":
            break
        sleep(POLL_S)
    left, zeros, unread = None, 0, 0
    while now() - start < budget_s:
        left = in_flight(routing.worker_url)
        # twice 0, a poll apart: a request smg picked just before the removal has arrived by then
        zeros = zeros + 1 if left == 0 else 0
        if zeros >= 2:
            say(f"router {routing.router}: left it; 0 requests in flight after {now() - start:.1f} s")
            return
        # twice unreadable (not running, or neither gauge nor load endpoint): waiting cannot tell more,
        # and SGLang's own SIGTERM drain waits for what a running server still holds
        unread = unread + 1 if left is None else 0
        if unread >= 2:
            break
        sleep(POLL_S)
    if left is None:
        say(f"router {routing.router}: left it; its in-flight count cannot be read (/metrics, /get_load): "
            f"the stop's drain takes what is left")
    else:
        say(f"router {routing.router}: left it; still {left} request(s) in flight after {budget_s:g} s: the "
            f"stop's drain takes them")


def rejoin(routing: Routing, client: SmgClient, worker: Mapping[str, Any] | None, timeout_s: float,
           say: Callable[[str], None], now: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> tuple[bool, str]:
    """Put the server back: /ready, ``POST /workers`` with what it had, then until smg lists it
    healthy and ready, within ``timeout_s``. (ok, what happened) — never raises."""
    start = now()
    while not server_ready(routing.worker_url, routing.ready_paths):
        if now() - start >= timeout_s:
            return False, (f"not ready at {routing.worker_url} after {timeout_s:g} s ({routing.ready_paths[0]}): "
                           f"not re-added")
        sleep(POLL_S)
    try:
        # smg keeps a removed worker listed as draining for its settle time (5 s): a POST for its URL
        # meanwhile answers "already exists" and the entry then disappears; add it once it is gone
        while True:
            found = client.find(routing.worker_url)
            if found is None:
                client.add(rejoin_body(worker, routing.worker_url))
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


def membership(routing: Routing, workers: list[dict[str, Any]] | None, error: str | None = None) -> dict[str, Any]:
    """The status's view of one routed server: listed or not, healthy or not, as the router says.

    >>> r = Routing("gw", "http://g:1", "http://a:1")
    >>> membership(r, [{"url": "http://a:1", "id": "w", "is_healthy": True, "status": "ready"}])["state"]
    'healthy'
    >>> membership(r, [])["state"], membership(r, None, "refused")["state"]
    ('missing', 'unknown')
    """
    view: dict[str, Any] = {"router": routing.router, "url": routing.worker_url}
    if workers is None:
        return {**view, "state": "unknown", "listed": None, "healthy": None, "error": error}
    worker = next((w for w in workers if same_url(w.get("url"), routing.worker_url)), None)
    if worker is None:
        return {**view, "state": "missing", "listed": False, "healthy": False}
    healthy = bool(worker.get("is_healthy")) and worker.get("status", "ready") == "ready"
    return {**view, "state": "healthy" if healthy else str(worker.get("status") or "unhealthy"), "listed": True,
            "healthy": healthy, "worker_id": worker.get("id")}
