"""``live``: a change the engine applies while it serves (docs/live-changes.md): LoRA adapters loaded
and unloaded, a new checkpoint of the same shapes loaded. Never a stop: the server's main keeps its
pid. Holds the transition lock for its life (no transition runs beside it) and journals each step as
a transition does.

Success is all of: the engine answered success for each change, the server lists the desired state
(its adapters in ``/v1/models``, its model path in ``/model_info``: read again, never taken from the
answers) and a real generation works (through each adapter that changed). Anything else: what was
applied is undone in reverse (an adapter loaded is unloaded, one unloaded loaded again, the previous
weights loaded back), the previous state is verified the same way, the history stays as it was, and
the answer says so (the controller exits non-zero).

The document (stdin): ``{"run", "port", "engine", "changes": [op, ...], "expect": {"model_path",
"lora_adapters"}, "previous": {...}, "desired": SpecDoc, "by"}``; each op as the engine's
``live_request`` takes it (gpugate.engine.Change's ``op``).
"""

from __future__ import annotations

import json
import os
import time

from gpugate.agent.engine import engine
from gpugate.agent import history, journal, server, state
from gpugate.rules import procfs

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Callable, Dict, List, Optional, Tuple

    Doc = Dict[str, Any]
    Post = Callable[[str, Doc], Tuple[Optional[int], str]]


def describe(op: Doc) -> str:
    """One op in words, as the plan said it.

    >>> describe({"op": "unload_adapter", "name": "a"}), describe({"op": "update_weights", "model_path": "/m2"})
    ('unload adapter a', 'weights -> /m2')
    """
    kind = op.get("op")
    if kind == "load_adapter":
        return "load adapter %s" % op.get("name")
    if kind == "unload_adapter":
        return "unload adapter %s" % op.get("name")
    return "weights -> %s" % op.get("model_path")


def validate(doc: Any) -> str | None:
    """None or why a live document cannot be run."""
    if not isinstance(doc, dict):
        return "the live document is not a JSON object"
    if not journal.RUN_ID.match(str(doc.get("run") or "")):
        return "run must match %s" % journal.RUN_ID.pattern
    port = doc.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        return "port must be an integer 1..65535"
    changes = doc.get("changes")
    if not isinstance(changes, list) or not changes:
        return "changes must be a non-empty list"
    for op in changes:
        try:
            engine.live_request(op)
        except (ValueError, KeyError, TypeError) as error:
            return "a change the engine cannot apply live: %s" % error
    if not isinstance(doc.get("expect"), dict) or not isinstance(doc.get("previous"), dict):
        return "expect and previous must be objects"
    return None


def served_problem(served: Doc | None, want: Doc) -> str | None:
    """None when the server lists ``want`` (model path; adapters where LoRA is on), else the difference.

    >>> served_problem({"model_path": "/m", "lora_adapters": {"a": "/a"}}, {"model_path": "/m", "lora_adapters": {}})
    'it lists the adapters a, not none'
    """
    if served is None:
        return "it does not say what it serves (/model_info, /v1/models)"
    if want.get("model_path") and served.get("model_path") != want["model_path"]:
        return "it serves %s, not %s" % (served.get("model_path"), want["model_path"])
    adapters = want.get("lora_adapters")
    if adapters is not None and dict(served.get("lora_adapters") or {}) != dict(adapters):
        return "it lists the adapters %s, not %s" % (", ".join(sorted(served.get("lora_adapters") or {})) or "none",
                                                      ", ".join(sorted(adapters)) or "none")
    return None


class Live(object):
    """One live change of the server on ``port``, from its lock to its answer."""

    def __init__(self, doc: Doc, main: Doc, log: journal.Journal) -> None:
        self.doc = doc
        self.port = int(doc["port"])
        self.main = main
        self.host = engine.argv_host(main["argv"])
        self.token = engine.argv_token(main["argv"])
        self.journal = log
        self.timeout = float(doc.get("timeout_s") or 600.0)

    def event(self, step: str, phase: str, **fields: Any) -> None:
        self.journal.write(dict(step=step, phase=phase, **fields))

    def post(self, path: str, body: Doc) -> Tuple[int | None, str]:
        return server.http_get(self.host, self.port, path, self.timeout, self.token, method="POST",
                               body=json.dumps(body).encode())

    def apply(self, op: Doc) -> str | None:
        """One change sent; None when the engine answered success, else what it said."""
        path, body = engine.live_request(op)
        status, text = self.post(path, body)
        return engine.answer_problem(status, text)

    def verify(self, want: Doc, adapters: List[str], generate_base: bool) -> str | None:
        """None when the server lists ``want`` and generates (through each of ``adapters``)."""
        if not procfs.alive(self.main["pid"], self.main.get("start_ticks")):
            return "the server's main (pid %s) is gone" % self.main["pid"]
        served = engine.read_live(lambda path: server.http_get(self.host, self.port, path, 10.0, self.token))
        problem = served_problem(served, want)
        if problem:
            return problem
        for adapter in ([None] if generate_base or not adapters else []) + list(adapters):
            method, path, body = engine.generation_through(adapter, self.main["argv"])
            status, text = server.http_get(self.host, self.port, path, self.timeout, self.token, method=method, body=body)
            problem = engine.generation_problem(status, text)
            if problem:
                return "a generation%s failed: %s" % (" through adapter %s" % adapter if adapter else "", problem)
        return None

    def run(self) -> Doc:
        changes = list(self.doc["changes"])
        applied = []  # type: List[Doc]
        self.event("live", "begin", pid=self.main["pid"], changes=[describe(op) for op in changes])
        failure = None
        for op in changes:
            self.event("live_apply", "begin", change=describe(op))
            problem = self.apply(op)
            if problem:
                failure = "%s: the engine refused it (%s)" % (describe(op), problem)
                self.event("live_apply", "end", change=describe(op), ok=False, error=problem)
                break
            applied.append(op)
            self.event("live_apply", "end", change=describe(op), ok=True)
        if failure is None:
            loaded = [str(op["name"]) for op in changes if op.get("op") == "load_adapter"]
            weights = any(op.get("op") == "update_weights" for op in changes)
            self.event("live_verify", "begin")
            problem = self.verify(self.doc["expect"], loaded, weights)
            self.event("live_verify", "end", ok=problem is None, error=problem)
            if problem is None:
                return self.commit()
            failure = "the verify failed: %s" % problem
        return self.undo(applied, failure)

    def commit(self) -> Doc:
        """The desired spec (its launch carries the live state: a restart comes back with it) is the
        newest good one; its record says it was reached live."""
        desired = history.clean_spec(self.doc.get("desired"))
        added = False
        warnings = []  # type: List[str]
        if desired:
            try:
                doc = history.load_history(self.port)
                key = history.spec_key(desired)
                record = history.make_record(desired, by=self.doc.get("by"), extra={
                    "live": dict(self.doc["expect"]), "changed_live": {"pid": self.main["pid"], "start_ticks": self.main.get("start_ticks"),
                                                "at": state.now_iso()}})
                rest = [entry for entry in doc.get("good") or [] if entry.get("key") != key]
                doc["good"] = ([{"key": key, "spec": desired, "record": record}] + rest)[:history.HISTORY_GOOD]
                doc["last"] = {"run": self.journal.run, "outcome": "verified", "at": state.now_iso(), "live": True}
                history.save_history(self.port, doc)
                added = True
            except OSError as error:
                warnings.append("history not written: %s" % error)
            if desired.get("supervisor") == "systemd" and desired.get("unit_text"):
                # the unit's command carries the live state too: systemd's restart after a crash serves it
                try:
                    state.write_private(state.paths(self.port)["unit"], desired["unit_text"], 0o600)
                    from gpugate.agent import supervise

                    supervise.systemctl("daemon-reload")
                except OSError as error:
                    warnings.append("unit not rewritten: %s" % error)
        self.event("commit", "end", target="desired", port=self.port, added=added, live=True)
        self.event("outcome", "end", outcome="verified", reasons=None, live=True, pid=self.main["pid"],
                   message="changed live; pid %s kept serving" % self.main["pid"])
        return {"ok": True, "run": self.journal.run, "pid": self.main["pid"], "outcome": "verified",
                "warnings": warnings}

    def undo(self, applied: List[Doc], failure: str) -> Doc:
        """What was applied, undone in reverse; the previous state verified; the history unchanged."""
        if not procfs.alive(self.main["pid"], self.main.get("start_ticks")):
            # the engine died under the change: nothing to undo in it; the caller starts the last good spec
            message = "%s; the server (pid %s) died during the live change" % (failure, self.main["pid"])
            self.event("outcome", "end", outcome="live_engine_died", reasons={"live": failure, "undo": None},
                       message=message, live=True, pid=self.main["pid"])
            return {"ok": False, "run": self.journal.run, "pid": self.main["pid"], "outcome": "live_engine_died",
                    "error": message, "undone": [], "engine_died": True}
        self.event("live_undo", "begin", reason=failure, changes=[describe(op) for op in applied])
        problems = []  # type: List[str]
        for op in reversed(applied):
            back = engine.undo_of(op)
            problem = self.apply(back)
            if problem:
                problems.append("%s: %s" % (describe(back), problem))
        back_adapters = [str(op["name"]) for op in applied if op.get("op") == "unload_adapter"]
        problem = self.verify(self.doc["previous"], back_adapters, True)
        if problem:
            problems.append("the previous state does not verify: %s" % problem)
        outcome = "live_undone" if not problems else "live_undo_failed"
        message = ("%s; undone: the previous state serves (pid %s)" % (failure, self.main["pid"]) if not problems else
                   "%s; the undo failed too: %s (pid %s)" % (failure, "; ".join(problems), self.main["pid"]))
        self.event("live_undo", "end", ok=not problems, problems=problems)
        self.event("outcome", "end", outcome=outcome, reasons={"live": failure, "undo": problems or None},
                   message=message, live=True, pid=self.main["pid"])
        return {"ok": False, "run": self.journal.run, "pid": self.main["pid"], "outcome": outcome, "error": message,
                "undone": [describe(op) for op in reversed(applied)]}


def command_live(doc: Any) -> Doc:
    """Validate, take the transition lock (busy: another run holds it), apply, verify, answer."""
    from gpugate.agent.commands import take_lock, write_lock_info

    problem = validate(doc)
    if problem:
        return {"ok": False, "error": problem}
    fd = take_lock()
    if fd is None:
        return {"ok": False, "busy": journal.lock_status()}
    try:
        write_lock_info(fd, doc["run"])
        table = procfs.table()
        main, _tree = server.find_server(table, int(doc["port"]), server.own_pids(table))
        if main is None:
            return {"ok": False, "error": "no server runs on :%s: a live change needs one that serves" % doc["port"]}
        engine.use_for(main["argv"])
        log = journal.Journal(doc["run"])
        log.write({"step": "run", "phase": "begin", "run": doc["run"], "by": doc.get("by"), "live": True,
                   "pid": os.getpid(), "ports": [int(doc["port"])]})
        try:  # the container's latest run (what observe and the status report first), as a transition's is
            state.write_private(state.RUNS_DIR + "/latest", doc["run"] + "\n", 0o600)
        except OSError:
            pass
        began = time.time()
        answer = Live(doc, main, log).run()
        answer["elapsed_s"] = round(time.time() - began, 3)
    finally:
        os.close(fd)
    if answer.get("engine_died") and doc.get("recovery_run"):
        # a live change never ends in NOTHING SERVES: the last good spec (the history is as it was before
        # this change) starts as a transition of its own, with its own lock, journal and invariant
        from gpugate.agent.commands import command_start

        answer["recovery"] = command_start({"run": doc["recovery_run"], "operator": doc.get("by"), "port": doc["port"],
                                            "desired": {"history": 0, "port": doc["port"]}, "rollback_to": None,
                                            "restart": True, "budgets": doc.get("budgets") or {},
                                            "engine": doc.get("engine")})
    return answer
