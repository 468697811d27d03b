"""One run of the transition's state machine (started by ``start``, detached, holding the lock):
stop -> gate -> prepare -> start -> healthy -> verify -> commit; from the stop on, any failure ->
rollback -> NOTHING SERVES with both reasons. Its steps are objects over the run's Context
(gpugate.agent.context): the stop (gpugate.agent.stop.Stop), the start (gpugate.agent.start.Start),
the weight cache's daemons (gpugate.agent.weight_cache.WeightCache), the history's records (Records,
here); this module holds the run's course.
"""

from __future__ import annotations

import os

from gpugate.agent.context import DEFAULT_BUDGETS, Context, budgets  # noqa: F401 - the budgets' home was here
from gpugate.agent.engine import engine
from gpugate.agent import history, server, state, weight_cache
from gpugate.agent.start import Start, read_gpus
from gpugate.agent.stop import Stop
from gpugate.agent.weight_cache import WeightCache
from gpugate.rules import procfs, redact
from gpugate.rules.procfs import read_file

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Dict, List, Optional, Set, Tuple

    from gpugate.agent.context import Doc
    from gpugate.agent.journal import Journal

    Outcome = Tuple[str, Optional[Dict[str, Any]], str]  # (outcome, reasons, message)


class Transition(object):
    """One run of the state machine, to exactly one outcome (verified | rolled_back |
    nothing_serves; ``refused`` only when nothing was touched): its course over the steps."""

    def __init__(self, doc: Doc, journal: Journal, recovered: Doc | None = None) -> None:
        self.ctx = Context(doc, journal, recovered)
        self.records = Records(self.ctx)
        self.cache = WeightCache(self.ctx, read_gpus)
        self.stop = Stop(self.ctx)
        self.start = Start(self.ctx, self.cache)

    # ------------------------------------------------------------------ entry
    def execute(self) -> str:
        ctx = self.ctx
        try:
            result = self._execute()
        except BaseException as error:  # noqa: BLE001 - every path must end in an outcome
            reason = "agent error: %s: %s" % (type(error).__name__, error)
            try:
                if ctx.touched:
                    result = self._cleanup_outcome(reason, None)
                else:
                    result = ("refused", {"desired": reason}, "nothing was touched: " + reason)
            except BaseException as second:  # noqa: BLE001
                result = ("nothing_serves", {"desired": reason, "rollback": "cleanup failed: %s" % second},
                          "NOTHING SERVES")
        try:
            self.start.end_gated()  # never activated: it ends with the run
        except Exception as error:  # noqa: BLE001
            ctx.warnings.append("gated engine: %s" % error)
        outcome, reasons, message = result
        self.records.last(outcome, reasons, message)
        ctx.event("outcome", "end", outcome=outcome, reasons=reasons, message=message,
                  warnings=ctx.warnings + ([("journal: " + ctx.journal.failed)] if ctx.journal.failed else []))
        return outcome

    def _execute(self) -> Outcome:
        ctx = self.ctx
        desired = ctx.desired
        capture = self._capture_running()
        ctx.rollback = self._resolve_rollback(capture)
        if ctx.rollback is not None:
            ctx.redactor.add(redact.spec_secrets(ctx.rollback, ctx.secret_env))
        ctx.event("plan", "end", rollback=history.make_record(ctx.rollback) if ctx.rollback else None)
        refusal = self._precheck()
        if refusal:
            return "refused", {"desired": refusal}, "refused before anything was touched: %s" % refusal
        # Converge: the desired server already runs (a recovered run left it loading, or a re-run).
        if desired and not ctx.doc.get("restart") and not ctx.replaces:
            running = self._running_exactly(desired)
            if running is not None:
                ctx.event("adopt", "end", pid=running, message="the desired server already runs; waiting for it")
                try:
                    ctx.touched = True
                    self.start.wait_ready(desired, running, "desired", log_offset=None)
                    info = self.start.verify(desired, running, "desired")
                    self.records.commit(desired, info)
                    return "verified", None, "the desired server serves (already running), verified"
                except Exception as error:  # noqa: BLE001 - ours too: every path after the stop ends in an outcome
                    return self._after_failure(failure_reason(error))
        try:
            if desired and desired.get("gated_launch") and desired.get("supervisor") != "systemd":
                # its imports and dist init while the old server still serves: the stop waits for its gate
                self.start.launch_gated(desired, "desired")
                if ctx.gated:
                    try:
                        self.start.wait_for_gate(desired, "desired")
                    except state.Failure as failure:  # nothing was stopped: the old server still serves
                        self.start.end_gated()
                        self.records.failed(str(failure))
                        why = "the new server failed before its gated launch: %s; the old server was never stopped" % failure
                        return "refused", {"desired": why}, "nothing was touched: " + why
            if ctx.replaces:
                self.stop.server(ctx.replaces["port"], "replaces", ctx.budget("drain_timeout_s"))
                self.cache.stop(ctx.replaces["port"], "replaces", "its server moves to :%d" % ctx.port)
            self.stop.server(ctx.port, "desired", ctx.budget("drain_timeout_s"))
            self.stop.gpu_holders()
            if desired is None:
                self.cache.stop(ctx.port, "desired", "present: false")
                return "verified", None, "no server on :%d, as desired" % ctx.port
            self._start_verified(desired, "desired")
            return "verified", None, "the desired server serves, verified"
        except Exception as error:  # noqa: BLE001 - a state.Failure, or an exception of our own: both roll back
            if not ctx.touched:
                raise
            return self._after_failure(failure_reason(error))

    def _after_failure(self, reason: str) -> Outcome:
        ctx = self.ctx
        self.start.end_gated()
        ctx.event("failed", "end", target="desired", reason=reason)
        self.records.failed(reason)
        if ctx.rollback is None:
            return self._cleanup_outcome(reason, "nothing to roll back to (no good server recorded)")
        target = ctx.rollback
        ctx.event("rollback", "begin", reason=reason, to=history.make_record(target))
        try:
            self.stop.server(ctx.port, "rollback", ctx.budget("kill_grace_s"))
            if target["port"] != ctx.port:
                self.stop.server(target["port"], "rollback", ctx.budget("kill_grace_s"))
            self._start_verified(target, "rollback")
            ctx.event("rollback", "end", ok=True)
            return ("rolled_back", {"desired": reason},
                    "the desired server failed (%s); the previous server serves again, verified" % reason)
        except Exception as error:  # noqa: BLE001
            ctx.event("rollback", "end", ok=False, reason=failure_reason(error))
            return self._cleanup_outcome(reason, "rollback failed: %s" % failure_reason(error))

    def _cleanup_outcome(self, reason: str, rollback_reason: str | None) -> Outcome:
        ctx = self.ctx
        notes: List[str] = []
        try:
            self.start.end_gated()
        except Exception as error:  # noqa: BLE001
            notes.append("gated engine: %s" % error)
        ports = sorted(set([ctx.port] + [s["port"] for s in (ctx.replaces, ctx.rollback) if s]))
        for port in ports:
            try:
                self.stop.server(port, "cleanup", ctx.budget("kill_grace_s"))
                self.cache.stop(port, "cleanup", "nothing serves")
            except state.Failure as failure:
                notes.append(str(failure))
            except Exception as error:  # noqa: BLE001
                notes.append("cleanup of :%d: %s" % (port, error))
        reasons = {"desired": reason, "rollback": rollback_reason or "no rollback"}
        message = "NOTHING SERVES: the desired server failed (%s); %s" % (reason, reasons["rollback"])
        if notes:
            message += "; cleanup: " + "; ".join(notes)
        return "nothing_serves", reasons, message

    # ------------------------------------------------------------------ before the stop
    def _precheck(self) -> str | None:
        """What can be refused before anything is touched (the controller checked too; this
        catches what changed in between)."""
        ctx = self.ctx
        desired = ctx.desired
        if desired is None:
            return None
        if desired.get("supervisor") == "systemd" and server.pid1_comm() != "systemd":
            return "supervisor systemd, but PID 1 is %s, not systemd" % server.pid1_comm()
        model = engine.argv_model(desired["argv"])
        if model and model.startswith("/") and not os.path.exists(model):
            return "the model path %s does not exist" % model
        table = procfs.table()
        inodes = server.listeners(desired["port"])
        if inodes:
            replaced: Set[int] = set()
            for port in set([desired["port"]] + ([ctx.replaces["port"]] if ctx.replaces else [])):
                main, tree = server.find_server(table, port)
                replaced.update(tree)
            others = [pid for pid in server.socket_owners(inodes) if pid not in replaced and not engine.is_server_part(table.get(pid, {}).get("argv"))]
            if others:
                return "port %d is taken by %s" % (desired["port"], ", ".join(
                    "%d (%s)" % (pid, ctx.redactor.text(" ".join(table.get(pid, {}).get("argv") or []))[:80]) for pid in others))
        return None

    def _running_exactly(self, spec: Doc) -> int | None:
        """The pid of a main process that runs exactly ``spec`` (argv and env), else None."""
        table = procfs.table()
        main, _ = server.find_server(table, spec["port"])
        if main is None or main["argv"] != spec["argv"]:
            return None  # a gated engine (--gated-launch-port) of a run whose agent is gone: never adopted
        if spec.get("weight_cache") and self.cache.state(spec)[0] != "keep":
            return None  # its daemons are gone or of another key: restart, never wait for it
        environ = procfs.read_environ(main["pid"]) or {}
        for name, value in (spec.get("env") or {}).items():
            if environ.get(name) != value:
                return None
        # and none that the spec drops: what we gave it (our env file), what a good spec of this port had
        given = self._env_we_gave(spec["port"], main, environ) or {}
        had = set(given) | set(name for entry in history.load_history(spec["port"]).get("good") or []
                               for name in (entry.get("spec") or {}).get("env") or {})
        if any(name in environ for name in had - set(spec.get("env") or {})):
            return None
        engine.use_for(spec["argv"])  # the desired server's engine: its health, its workers
        gpus = spec.get("gpus") if spec.get("gpus") is not None else engine.server_gpus(spec["argv"], spec.get("env"))
        tree = [main["pid"]] + procfs.descendants(table, main["pid"])
        workers = server.workers_of(table, tree, engine.expected_workers(gpus))
        if workers["zombies"] or (workers["alive"] and workers["dead"]):
            return None  # it loaded once and lost a worker: restart it, do not wait for it
        if server.listeners(spec["port"]) and server.health(engine.argv_host(spec["argv"]), spec["port"], token=engine.argv_token(spec["argv"]))["health"] != 200:
            return None  # bound but not healthy: draining (a SIGTERM of an earlier run) or broken, not loading
        return main["pid"]

    def _capture_running(self) -> Doc | None:
        """The exact spec of the server that runs now on the port being replaced (argv from /proc,
        env from the history entry it matches, else from its environment), before we stop it."""
        ctx = self.ctx
        port = (ctx.replaces or {}).get("port") or ctx.port
        table = procfs.table()
        main, tree = server.find_server(table, port)
        if main is None:
            return None
        engine.use_for(main["argv"])  # the running server's engine (it may be another than the desired one)
        environ = procfs.read_environ(main["pid"]) or {}
        past = history.load_history(port)
        for entry in past.get("good") or []:
            spec = entry.get("spec") or {}
            if spec.get("argv") == engine.steady_argv(main["argv"]) and all(environ.get(k) == v for k, v in (spec.get("env") or {}).items()):
                return dict(spec, _history=True)
        env = self._env_we_gave(port, main, environ)
        source = "captured from the running server"
        if env is None:
            # Not started by us (e.g. by hand over SSH): its environment is a login session's; keep
            # only what SGLang reads, so neither the record's secrets nor a rollback get USER, SSH_*...
            env = engine.adopted_env(environ, list((ctx.desired or {}).get("env") or ()), main["argv"])
            source = "adopted: a server gpugate did not start"
        supervisor = server.supervisor_of(main["pid"], port)
        spec = {"argv": engine.steady_argv(main["argv"]), "env": env, "port": port, "supervisor": supervisor,
                "gpus": engine.server_gpus(main["argv"], environ), "record": {"source": source}}
        if ctx.secret_env:  # the operator's secret names hold for the server that runs now too (its record, its log)
            spec["secret_env"] = list(ctx.secret_env)
        if supervisor == "systemd":
            spec["unit_text"] = read_file(state.paths(port)["unit"]) or ""
        # A server that serves when we find it was good: keep it as such (it may be all there is to
        # roll back to, e.g. a server started by hand before gpugate).
        gpus = spec["gpus"]
        workers = server.workers_of(table, tree, engine.expected_workers(gpus))
        if server.health(engine.argv_host(main["argv"]), port, token=engine.argv_token(main["argv"]))["health"] == 200 and workers["dead"] == 0:
            spec["_serving"] = True
            self.records.add_good(spec, None, by="observed serving")
        return spec

    @staticmethod
    def _env_we_gave(port: int, main: Dict[str, Any], environ: Dict[str, str]) -> Dict[str, str] | None:
        """The env of a server we started (our pid file names it and every value of our env file is
        in its environment): the env file's, exactly. None for a server we did not start."""
        recorded = state.read_pid_file(port) or {}
        if recorded.get("pid") != main["pid"] or recorded.get("start_ticks") not in (None, main["start_ticks"]):
            return None
        text = read_file(state.paths(port)["env"])
        if text is None:
            return None
        env = state.parse_env_file(text)
        if any(environ.get(name) != value for name, value in env.items()):
            return None
        return env

    def _resolve_rollback(self, capture: Doc | None) -> Doc | None:
        ctx = self.ctx
        choice = ctx.doc.get("rollback_to")
        if choice is None:
            return None
        if isinstance(choice, dict) and "argv" in choice:
            return choice
        if isinstance(choice, dict) and choice.get("running"):
            return history.clean_spec(capture)
        port = (ctx.replaces or {}).get("port") or ctx.port
        good = history.load_history(port).get("good") or []
        if isinstance(choice, dict) and "history" in choice:
            want = choice["history"]
            for index, entry in enumerate(good):
                if want == index or want == (entry.get("record") or {}).get("key") or want == entry.get("key"):
                    return history.clean_spec(entry.get("spec"))
            return None
        # "auto": the server that runs now if it served, else the newest good spec unlike the desired one
        if capture is not None and capture.get("_serving"):
            return history.clean_spec(capture)
        desired_key = history.spec_key(ctx.desired) if ctx.desired else None
        for entry in good:
            if entry.get("key") != desired_key:
                return history.clean_spec(entry.get("spec"))
        if ctx.recovered and ctx.recovered.get("rollback"):
            return history.clean_spec(ctx.recovered["rollback"])
        return None

    def _start_verified(self, spec: Doc, target: str) -> None:
        """The start of ``spec`` from a stopped server (the Start step), then its commit."""
        capacity = self.start.verified(spec, target)
        self.records.commit(spec, capacity, rollback=target == "rollback")


class Records(object):
    """The run's entries in the history of its ports (gpugate.agent.history): the good specs it
    verified (or found serving), the failed one, the last outcome."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def commit(self, spec: Doc, capacity: Dict[str, Any] | None, rollback: bool = False) -> None:
        ctx = self.ctx
        added = self.add_good(spec, capacity, by=ctx.by)
        ctx.event("commit", "end", target="rollback" if rollback else "desired", port=spec["port"], added=added,
                  key=history.spec_key(spec))

    def add_good(self, spec: Doc, capacity: Dict[str, Any] | None, by: str | None) -> bool:
        """Newest first, at most history.HISTORY_GOOD; the same spec again moves to the front without
        adding (a same-spec restart adds nothing). Best-effort: a full disk is a warning."""
        ctx = self.ctx
        spec = history.clean_spec(spec)  # type: ignore[assignment]  # a spec gives a spec
        port = spec["port"]
        try:
            doc = history.load_history(port)
            key = history.spec_key(spec)
            good = doc.get("good") or []
            same = [entry for entry in good if entry.get("key") == key]
            if good and good[0].get("key") == key:
                if capacity:
                    good[0]["record"]["capacity"] = capacity
                    history.save_history(port, doc)
                return False
            record = history.make_record(spec, by=by, capacity=capacity, extra=weight_cache.key_record(spec))
            rest = [entry for entry in good if entry.get("key") != key]
            doc["good"] = ([{"key": key, "spec": spec, "record": record}] + rest)[:history.HISTORY_GOOD]
            history.save_history(port, doc)
            return not same
        except OSError as error:
            ctx.warnings.append("history not written: %s" % error)
            return False

    def failed(self, reason: str) -> None:
        ctx = self.ctx
        if not ctx.desired:
            return
        port = ctx.desired["port"]
        try:
            doc = history.load_history(port)
            record = history.make_record(ctx.desired, by=ctx.by)
            record.update({"reason": ctx.redactor.text(reason), "run": ctx.run})
            doc["failed"] = ([record] + (doc.get("failed") or []))[:history.HISTORY_FAILED]
            history.save_history(port, doc)
        except OSError as error:
            ctx.warnings.append("history not written: %s" % error)

    def last(self, outcome: str, reasons: Dict[str, Any] | None, message: str) -> None:
        ctx = self.ctx
        ports = sorted(set([ctx.port] + [s["port"] for s in (ctx.replaces, ctx.rollback) if s]))
        for port in ports:
            try:
                doc = history.load_history(port)
                doc["last"] = ctx.redactor.deep({"run": ctx.run, "outcome": outcome, "reasons": reasons,
                                                 "message": message, "at": state.now_iso(), "by": ctx.by})
                history.save_history(port, doc)
            except OSError as error:
                ctx.warnings.append("history not written: %s" % error)


def failure_reason(error: BaseException) -> str:
    """What the operator reads for a failure: a Failure's own text, else the exception named."""
    if isinstance(error, state.Failure):
        return str(error)
    if isinstance(error, OSError) and error.strerror:
        return "agent error: %s (%s)" % (error.strerror, error.filename or type(error).__name__)
    return "agent error: %s: %s" % (type(error).__name__, error)
