"""One run of the transition's state machine (started by ``start``, detached, holding the lock):
stop -> gate -> prepare -> start -> healthy -> verify -> commit; from the stop on, any failure ->
rollback -> NOTHING SERVES with both reasons. The steps of the stop are gpugate.agent.stop's, those of
a start gpugate.agent.start's; this module holds the run's course and its history.
"""

from __future__ import annotations

import os

from gpugate.agent.engine import engine
from gpugate.agent import history, server, state, weight_cache
from gpugate.agent.start import StartSteps
from gpugate.agent.stop import StopSteps
from gpugate.agent.weight_cache import CacheSteps
from gpugate.rules import procfs, redact
from gpugate.rules.procfs import read_file

DEFAULT_BUDGETS = {"drain_timeout_s": 60.0, "kill_grace_s": 10.0, "gate_timeout_s": 120.0,
                   "start_timeout_s": 2700.0, "max_used_mib": 64, "generate_timeout_s": 30.0,
                   "rollback_start_timeout_s": None}  # None: start_timeout_s


def budgets(doc):
    """DEFAULT_BUDGETS with the start document's numbers where it gives them.

    >>> budgets({"budgets": {"drain_timeout_s": 5, "bogus": 1}})["drain_timeout_s"]
    5.0
    """
    chosen = dict(DEFAULT_BUDGETS)
    for key, value in (doc.get("budgets") or {}).items():
        if key in chosen and isinstance(value, (int, float)) and not isinstance(value, bool):
            chosen[key] = float(value)
    return chosen


class Transition(StopSteps, StartSteps, CacheSteps):
    """One run of the state machine, to exactly one outcome (verified | rolled_back |
    nothing_serves; ``refused`` only when nothing was touched)."""

    def __init__(self, doc, journal, recovered=None):
        self.doc = doc
        self.run = doc["run"]
        self.by = doc.get("operator")
        self.journal = journal
        self.budgets = budgets(doc)
        self.desired = doc.get("desired")
        self.replaces = doc.get("replaces")
        self.recovered = recovered
        self.redactor = redact.Redactor(redact.spec_secrets(self.desired) + redact.spec_secrets(self.replaces)
                                 + (redact.spec_secrets(doc.get("rollback_to")) if isinstance(doc.get("rollback_to"), dict) else []))
        self.port = (self.desired or {}).get("port") or int(doc.get("port") or engine.DEFAULT_PORT)
        self.children = {}  # pid -> Popen of servers we started (reaped by us while we live)
        self.touched = False
        self.warnings = []
        self.rollback = None
        self.exit_codes = {}
        self.pumps = {}  # port -> the log pump of the server we started there
        self.gated = None  # the engine launched with --gated-launch-port before the stop, until activated

    # ------------------------------------------------------------------ journal helpers
    def event(self, step, phase, **fields):
        self.journal.write(self.redactor.deep(dict(step=step, phase=phase, **fields)))

    def progress(self, step, **fields):
        self.journal.progress(step, **self.redactor.deep(fields))

    # ------------------------------------------------------------------ entry
    def execute(self):
        try:
            result = self._execute()
        except BaseException as error:  # noqa: BLE001 - every path must end in an outcome
            reason = "agent error: %s: %s" % (type(error).__name__, error)
            try:
                if self.touched:
                    result = self._cleanup_outcome(reason, None)
                else:
                    result = ("refused", {"desired": reason}, "nothing was touched: " + reason)
            except BaseException as second:  # noqa: BLE001
                result = ("nothing_serves", {"desired": reason, "rollback": "cleanup failed: %s" % second},
                          "NOTHING SERVES")
        try:
            self._end_gated()  # never activated: it ends with the run
        except Exception as error:  # noqa: BLE001
            self.warnings.append("gated engine: %s" % error)
        outcome, reasons, message = result
        self._record_last(outcome, reasons, message)
        self.event("outcome", "end", outcome=outcome, reasons=reasons, message=message,
                   warnings=self.warnings + ([("journal: " + self.journal.failed)] if self.journal.failed else []))
        return outcome

    def _execute(self):
        desired = self.desired
        capture = self._capture_running()
        self.rollback = self._resolve_rollback(capture)
        if self.rollback is not None:
            self.redactor.add(redact.spec_secrets(self.rollback))
        self.event("plan", "end", rollback=history.make_record(self.rollback) if self.rollback else None)
        refusal = self._precheck()
        if refusal:
            return "refused", {"desired": refusal}, "refused before anything was touched: %s" % refusal
        # Converge: the desired server already runs (a recovered run left it loading, or a re-run).
        if desired and not self.doc.get("restart") and not self.replaces:
            running = self._running_exactly(desired)
            if running is not None:
                self.event("adopt", "end", pid=running, message="the desired server already runs; waiting for it")
                try:
                    self.touched = True
                    self._wait_ready(desired, running, "desired", log_offset=None)
                    info = self._verify(desired, running, "desired")
                    self._commit(desired, info)
                    return "verified", None, "the desired server serves (already running), verified"
                except Exception as error:  # noqa: BLE001 - ours too: every path after the stop ends in an outcome
                    return self._after_failure(failure_reason(error))
        try:
            if desired and desired.get("gated_launch") and desired.get("supervisor") != "systemd":
                # its imports and dist init while the old server still serves: the stop waits for its gate
                self._launch_gated(desired, "desired")
                if self.gated:
                    try:
                        self._wait_for_gate(desired, "desired")
                    except state.Failure as failure:  # nothing was stopped: the old server still serves
                        self._end_gated()
                        self._record_failed(str(failure))
                        why = "the new server failed before its gated launch: %s; the old server was never stopped" % failure
                        return "refused", {"desired": why}, "nothing was touched: " + why
            if self.replaces:
                self._stop(self.replaces["port"], "replaces", self.budgets["drain_timeout_s"])
                self._stop_cache(self.replaces["port"], "replaces", "its server moves to :%d" % self.port)
            self._stop(self.port, "desired", self.budgets["drain_timeout_s"])
            self._end_gpu_holders()
            if desired is None:
                self._stop_cache(self.port, "desired", "present: false")
                return "verified", None, "no server on :%d, as desired" % self.port
            self._start_verified(desired, "desired")
            return "verified", None, "the desired server serves, verified"
        except Exception as error:  # noqa: BLE001 - a state.Failure, or an exception of our own: both roll back
            if not self.touched:
                raise
            return self._after_failure(failure_reason(error))

    def _after_failure(self, reason):
        self._end_gated()
        self.event("failed", "end", target="desired", reason=reason)
        self._record_failed(reason)
        if self.rollback is None:
            return self._cleanup_outcome(reason, "nothing to roll back to (no good server recorded)")
        target = self.rollback
        self.event("rollback", "begin", reason=reason, to=history.make_record(target))
        try:
            self._stop(self.port, "rollback", self.budgets["kill_grace_s"])
            if target["port"] != self.port:
                self._stop(target["port"], "rollback", self.budgets["kill_grace_s"])
            self._start_verified(target, "rollback")
            self.event("rollback", "end", ok=True)
            return ("rolled_back", {"desired": reason},
                    "the desired server failed (%s); the previous server serves again, verified" % reason)
        except Exception as error:  # noqa: BLE001
            self.event("rollback", "end", ok=False, reason=failure_reason(error))
            return self._cleanup_outcome(reason, "rollback failed: %s" % failure_reason(error))

    def _cleanup_outcome(self, reason, rollback_reason):
        notes = []
        try:
            self._end_gated()
        except Exception as error:  # noqa: BLE001
            notes.append("gated engine: %s" % error)
        ports = sorted(set([self.port] + [s["port"] for s in (self.replaces, self.rollback) if s]))
        for port in ports:
            try:
                self._stop(port, "cleanup", self.budgets["kill_grace_s"])
                self._stop_cache(port, "cleanup", "nothing serves")
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
    def _precheck(self):
        """What can be refused before anything is touched (the controller checked too; this
        catches what changed in between)."""
        desired = self.desired
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
            replaced = set()
            for port in set([desired["port"]] + ([self.replaces["port"]] if self.replaces else [])):
                main, tree = server.find_server(table, port)
                replaced.update(tree)
            others = [pid for pid in server.socket_owners(inodes) if pid not in replaced and not engine.is_server_part(table.get(pid, {}).get("argv"))]
            if others:
                return "port %d is taken by %s" % (desired["port"], ", ".join(
                    "%d (%s)" % (pid, self.redactor.text(" ".join(table.get(pid, {}).get("argv") or []))[:80]) for pid in others))
        return None

    def _running_exactly(self, spec):
        """The pid of a main process that runs exactly ``spec`` (argv and env), else None."""
        table = procfs.table()
        main, _ = server.find_server(table, spec["port"])
        if main is None or main["argv"] != spec["argv"]:
            return None  # a gated engine (--gated-launch-port) of a run whose agent is gone: never adopted
        if spec.get("weight_cache") and self._cache_state(spec)[0] != "keep":
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
        gpus = spec.get("gpus") if spec.get("gpus") is not None else engine.server_gpus(spec["argv"], spec.get("env"))
        tree = [main["pid"]] + procfs.descendants(table, main["pid"])
        workers = server.workers_of(table, tree, engine.expected_workers(gpus))
        if workers["zombies"] or (workers["alive"] and workers["dead"]):
            return None  # it loaded once and lost a worker: restart it, do not wait for it
        if server.listeners(spec["port"]) and server.health(engine.argv_host(spec["argv"]), spec["port"], token=engine.argv_token(spec["argv"]))["health"] != 200:
            return None  # bound but not healthy: draining (a SIGTERM of an earlier run) or broken, not loading
        return main["pid"]

    def _capture_running(self):
        """The exact spec of the server that runs now on the port being replaced (argv from /proc,
        env from the history entry it matches, else from its environment), before we stop it."""
        port = (self.replaces or {}).get("port") or self.port
        table = procfs.table()
        main, tree = server.find_server(table, port)
        if main is None:
            return None
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
            env = engine.adopted_env(environ, list((self.desired or {}).get("env") or ()), main["argv"])
            source = "adopted: a server gpugate did not start"
        supervisor = server.supervisor_of(main["pid"], port)
        spec = {"argv": engine.steady_argv(main["argv"]), "env": env, "port": port, "supervisor": supervisor,
                "gpus": engine.server_gpus(main["argv"], environ), "record": {"source": source}}
        if supervisor == "systemd":
            spec["unit_text"] = read_file(state.paths(port)["unit"]) or ""
        # A server that serves when we find it was good: keep it as such (it may be all there is to
        # roll back to, e.g. a server started by hand before gpugate).
        gpus = spec["gpus"]
        workers = server.workers_of(table, tree, engine.expected_workers(gpus))
        if server.health(engine.argv_host(main["argv"]), port, token=engine.argv_token(main["argv"]))["health"] == 200 and workers["dead"] == 0:
            spec["_serving"] = True
            self._add_good(spec, None, by="observed serving")
        return spec

    @staticmethod
    def _env_we_gave(port, main, environ):
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

    def _resolve_rollback(self, capture):
        choice = self.doc.get("rollback_to")
        if choice is None:
            return None
        if isinstance(choice, dict) and "argv" in choice:
            return choice
        if isinstance(choice, dict) and choice.get("running"):
            return history.clean_spec(capture)
        port = (self.replaces or {}).get("port") or self.port
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
        desired_key = history.spec_key(self.desired) if self.desired else None
        for entry in good:
            if entry.get("key") != desired_key:
                return history.clean_spec(entry.get("spec"))
        if self.recovered and self.recovered.get("rollback"):
            return history.clean_spec(self.recovered["rollback"])
        return None

    # ------------------------------------------------------------------ history
    def _commit(self, spec, capacity, rollback=False):
        added = self._add_good(spec, capacity, by=self.by)
        self.event("commit", "end", target="rollback" if rollback else "desired", port=spec["port"], added=added,
                   key=history.spec_key(spec))

    def _add_good(self, spec, capacity, by):
        """Newest first, at most history.HISTORY_GOOD; the same spec again moves to the front without
        adding (a same-spec restart adds nothing). Best-effort: a full disk is a warning."""
        spec = history.clean_spec(spec)
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
            record = history.make_record(spec, by=by, capacity=capacity, extra=self._cache_key_record(spec))
            rest = [entry for entry in good if entry.get("key") != key]
            doc["good"] = ([{"key": key, "spec": spec, "record": record}] + rest)[:history.HISTORY_GOOD]
            history.save_history(port, doc)
            return not same
        except OSError as error:
            self.warnings.append("history not written: %s" % error)
            return False

    @staticmethod
    def _cache_key_record(spec):
        """The key the server's daemons hold, for its history record (None without a cache)."""
        if not spec.get("weight_cache"):
            return None
        key = (weight_cache.read_record(spec["port"]) or {}).get("key") or {}
        return {"weight_cache_key": key.get("id")} if key else None

    def _record_failed(self, reason):
        if not self.desired:
            return
        port = self.desired["port"]
        try:
            doc = history.load_history(port)
            record = history.make_record(self.desired, by=self.by)
            record.update({"reason": self.redactor.text(reason), "run": self.run})
            doc["failed"] = ([record] + (doc.get("failed") or []))[:history.HISTORY_FAILED]
            history.save_history(port, doc)
        except OSError as error:
            self.warnings.append("history not written: %s" % error)

    def _record_last(self, outcome, reasons, message):
        ports = sorted(set([self.port] + [s["port"] for s in (self.replaces, self.rollback) if s]))
        for port in ports:
            try:
                doc = history.load_history(port)
                doc["last"] = self.redactor.deep({"run": self.run, "outcome": outcome, "reasons": reasons,
                                                  "message": message, "at": state.now_iso(), "by": self.by})
                history.save_history(port, doc)
            except OSError as error:
                self.warnings.append("history not written: %s" % error)


def failure_reason(error):
    """What the operator reads for a failure: a Failure's own text, else the exception named."""
    if isinstance(error, state.Failure):
        return str(error)
    if isinstance(error, OSError) and error.strerror:
        return "agent error: %s (%s)" % (error.strerror, error.filename or type(error).__name__)
    return "agent error: %s: %s" % (type(error).__name__, error)
