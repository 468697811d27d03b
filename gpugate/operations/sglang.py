"""Operations for the SGLang server in a container.

``sglang.server``: the desired server, applied idempotently and gated on the GPUs (shared/DESIGN.md,
"The transition"; docs/transition.md for the steps, the lock, the rollback, the audit events and
the progress lines).
"""

from __future__ import annotations

import base64
import contextlib
import time
import uuid
from typing import Any, Callable, Iterator, Mapping

from pyinfra import logger
from pyinfra.api import FunctionCommand, OperationError, operation
from pyinfra.context import host, state

from gpugate import transition as tr
from gpugate.facts.sglang import SglangObservation, probe_kwargs, with_command
from gpugate.remote import sglang_probe
from gpugate.sglang_args import server_info_mismatches

WAIT_CHUNK_S = 10.0      # one remote poll loop of the load: a progress line between chunks
PROGRESS_EVERY_S = 3.0   # the drain and the gate: one remote command (and one progress line) per chunk
LOCK_MARGIN_S = 60.0     # a step's lease = its own deadline + this


def emit(step: str, **fields: Any) -> None:
    """The one hook every transition step reports through (the audit log, gpugate.audit; ``path``
    among the fields picks the file). Never fails the operation."""
    try:
        from gpugate import audit
        audit.emit(step, **fields)
    except Exception:  # an audit problem must not break a restart
        logger.debug("audit emit failed for %s", step, exc_info=True)


class TransitionFailed(Exception):
    """A step could not complete; the message is what the operator reads. ``step``: the step that
    failed when it ran within another step's command (prepare or start in the gate's)."""

    def __init__(self, message: str, step: str | None = None):
        super().__init__(message)
        self.step = step


def _operator() -> str:
    try:
        from gpugate.audit import operator
        return operator()
    except Exception:
        return "unknown"


def _compact(values) -> str:
    from gpugate.runbooks import compact_mib
    return compact_mib(list(values or []))


class Transition:
    """One host's transition: the steps run as FunctionCommands, in order, sharing this context.

    Each step renews the lock's lease for its own deadline; a failing step releases the lock,
    records the phase and fails the operation with a message that says what happened. Every step
    (and the drain, kill and sweep inside the stop) writes a ``begin`` and an ``end`` event to the
    audit log.

    ``target``: for ``restore_previous``, the recorded previous server (the state file's
    ``previous``); its exact argv and env file are kept in the container and never cross.
    """

    def __init__(self, spec: tr.Spec | None, change: tr.Change, observation: Mapping[str, Any], *,
                 port: int, max_used_mib: int, gate_timeout: float, drain_timeout: float, kill_grace: float,
                 start_timeout: float, lock_wait: float, python: str, restarted: bool = False,
                 target: dict[str, Any] | None = None, audit_log: str | None = None, vmid: Any = None):
        self.spec = spec
        self.target = target
        self.change = change
        self.server = dict(observation.get("sglang") or {})
        self.port = port
        self.files = tr.paths(port)
        self.max_used_mib = max_used_mib
        self.gate_timeout = float(gate_timeout)
        self.drain_timeout = float(drain_timeout)
        self.kill_grace = float(kill_grace)
        self.start_timeout = float(start_timeout)
        self.lock_wait = float(lock_wait)
        self.python = python
        self.restarted = restarted  # asked to restart: re-deciding under the lock must not drop it
        self.audit_log = audit_log
        self.vmid = vmid
        self.token = uuid.uuid4().hex
        self.lock: dict[str, Any] | None = None
        self.done = False         # converged (e.g. by another operator while we waited)
        self.timings: dict[str, float] = {}
        self.began = time.monotonic()
        self.started: dict[str, Any] | None = None
        # What a failed start rolls back to: a record (redacted) and the 0600 slot in the container
        # holding its exact argv and env file ("previous" normally; "undo" for restore_previous).
        self.undo: dict[str, Any] | None = None
        self.previous_record: dict[str, Any] | None = None  # the spec that ran before (state file)
        self.replaced: dict[str, Any] | None = None         # restore_previous: the spec it replaced
        self.outcome_recorded = False  # the rollback wrote the final state itself: _abandon keeps it
        self.state_before: dict[str, Any] = dict(self.server.get("state") or {})  # the state file as found
        self.host_name = "?"
        self.planned = False
        self.story: dict[str, Any] = {}
        # (call, on_result): a step sent with the next remote command (the record, after the lock)
        self.queued: list[tuple[dict[str, Any], Callable[[Mapping[str, Any]], None]]] = []
        self.first_wait: dict[str, Any] | None = None   # the load's reading taken in the start's command
        self.looked_after_start: dict[str, Any] | None = None  # the probe taken there when it was ready
        self.verify_server: dict[str, Any] | None = None  # the probe verify compares (taken when ready)

    # ------------------------------------------------------------ plumbing
    def _call(self, host, function: str, **kwargs: Any) -> dict[str, Any]:
        _status, output = tr.run_remote(host, tr.remote_call(function, python=self.python, **kwargs))
        return tr.parse_result(output.stdout_lines)

    def _run(self, host, calls: list[dict[str, Any]], *, budget_s: float | None = None,
             gpu: bool = False, gate: bool = False) -> list[dict[str, Any]]:
        """Run ``calls`` (tr.step_call) in ONE remote command, each after the one before completed;
        -> one result per step that ran, each with ``step_s`` (its duration, measured in the
        container). A record queued by the lock step goes first and is reported here. Secret
        arguments (tr.step_call's ``secret``) go on the command's stdin."""
        queued, self.queued = self.queued, []
        calls = [entry[0] for entry in queued] + calls
        remote = tr.sequence_call(calls, python=self.python, budget_s=budget_s, with_gpu_probe=gpu, with_gate=gate)
        _status, output = tr.run_remote(host, remote)
        results = tr.sequence_results(tr.parse_result(output.stdout_lines), len(calls))
        for _call, on_result in queued:
            on_result(results.pop(0) if results else {"ok": False, "error": "not run: an earlier step failed"})
        return results

    def _lease(self, seconds: float) -> dict[str, Any] | None:
        if self.lock is None:
            return None
        return dict(self.lock, lease_s=float(seconds) + LOCK_MARGIN_S)

    def _say(self, host, message: str) -> None:
        host.log(f"sglang :{self.port} {message}")

    def _event(self, step: str, phase: str, **fields: Any) -> None:
        emit(step, path=self.audit_log, host=self.host_name, vmid=self.vmid, port=self.port, phase=phase, **fields)

    @contextlib.contextmanager
    def _span(self, step: str, began: float | None = None, **begin: Any) -> Iterator[dict[str, Any]]:
        """``begin`` and ``end`` events around a step; the body fills the end event's fields
        (``outcome`` defaults to ok; a TransitionFailed ends it as failed with the message;
        ``duration_s`` set by the body replaces the controller's own figure). ``began``: the step
        began earlier (time.monotonic()), before a command whose results came first."""
        began = time.monotonic() if began is None else began
        self._event(step, "begin", **begin)
        end: dict[str, Any] = {}
        try:
            yield end
        except TransitionFailed as error:
            outcome = end.pop("outcome", "failed")
            duration = end.pop("duration_s", round(time.monotonic() - began, 3))
            self._event(step, "end", outcome=outcome, duration_s=duration, error=str(error)[:2000], **end)
            raise
        outcome = end.pop("outcome", "ok")
        duration = end.pop("duration_s", round(time.monotonic() - began, 3))
        self._event(step, "end", outcome=outcome, duration_s=duration, **end)

    def _measured(self, step: str, result: Mapping[str, Any], begin: Mapping[str, Any] | None = None
                  ) -> contextlib.AbstractContextManager:
        """A span for a step that already ran in the container within a merged command: its events
        are written now, with the duration measured there (``step_s``)."""
        self.timings[step] = float(result.get("step_s") or 0.0)
        span = self._span(step, **dict(begin or {}))

        @contextlib.contextmanager
        def measured() -> Iterator[dict[str, Any]]:
            with span as end:
                end["duration_s"] = self.timings[step]
                yield end
        return measured()

    def _flags_story(self) -> dict[str, Any]:
        """Flags before and after and the diff lines, redacted (the plan and done events)."""
        main = self.server.get("main")
        command = tr.running_command(self.server) if main else None
        if self.target is not None:
            after, after_flags = self.target.get("argv"), self.target.get("flags")
        elif self.spec is not None:
            after, after_flags = tr.redact_argv(self.spec.argv), tr.redact_flags(self.spec.flags)
        else:
            after, after_flags = None, None
        return {"action": self.change.action, "reasons": self.change.reasons,
                "argv_before": tr.redact_argv(main["argv"]) if main else None,
                "flags_before": tr.redact_flags(command["flags"]) if command else None,
                "argv_after": after, "flags_after": after_flags,
                "diff": self.change.flag_lines + self.change.env_lines}

    def _step(self, name: str, body: Callable[[Any], None]) -> Callable:
        def run(state, host):
            if self.done:
                return True
            self.host_name = host.name
            if not self.planned:
                self.planned = True
                self.story = self._flags_story()
                self._event("plan", "begin", restore_previous=self.target is not None, **self.story)
            began = time.monotonic()
            try:
                body(host)
            except TransitionFailed as error:
                failed = error.step or name  # a step merged into this command may be the one that failed
                self.timings.setdefault(name, round(time.monotonic() - began, 3))
                host.log_styled(f"sglang :{self.port} {failed} failed: {error}", fg="red", log_func=logger.error)
                self._abandon(host, failed)
                self._event("done", "end", outcome=f"failed at {failed}", error=str(error)[:2000],
                            timings=self.timings, **self.story)
                return False
            self.timings.setdefault(name, round(time.monotonic() - began, 3))
            return True
        run.__name__ = f"sglang_{name.replace(' ', '_')}"
        return run

    def _abandon(self, host, step: str) -> None:
        """After a failure: leave a record of where it stopped and free the lock for a re-run
        (one command: the record, then the release even when the record failed)."""
        self.queued = []
        if self.lock is None:
            return
        try:
            calls = [] if self.outcome_recorded else [self._record_call(phase=f"failed at {step}")]
            calls.append(tr.step_call("lock_release", path=self.files["lock"], token=self.token, always=True))
            self._run(host, calls)
        except Exception:
            logger.debug("could not release the lock", exc_info=True)
        self.lock = None

    def _decide(self, server: Mapping[str, Any]) -> tr.Change:
        if self.target is None:
            return tr.decide(server, self.spec, self.restarted)
        try:
            self.target = tr.previous_target(server, self.files["state"])
        except tr.SpecError as error:
            raise TransitionFailed(str(error)) from error
        change = tr.compare_previous(server, self.target)
        if self.restarted and change.action in ("noop", "wait"):
            return tr.Change("restart", ["restarted=True"], running=change.running)
        return change

    def _probe_kwargs(self, model_path: bool = True) -> dict[str, Any]:
        """The server probe's arguments, as the observe fact sends them (same env names and model path,
        so that a look under the lock reads what the first look read)."""
        spec = self.spec
        return probe_kwargs(self.port, env_names=sorted(spec.env) if spec else (),
                            model_path=spec.model_path if spec and model_path else None)

    # ------------------------------------------------------------ steps
    def commands(self) -> list[FunctionCommand]:
        """The steps as FunctionCommands. Steps that share a remote command (docs/transition.md,
        "Remote commands per restart"): record goes with the stop's first chunk (or, with nothing
        to stop, with the gate); prepare, start and the load's first reading with the gate's
        passing chunk; verify reads the probe taken when the load turned ready; unlock records
        and releases in one command."""
        steps: list[tuple[str, Callable]] = []
        action = self.change.action
        if action == "wait":
            steps = [("wait healthy", self.wait_healthy), ("verify", self.verify)]
        elif action in ("start", "restart"):
            steps = [("lock", self.take_lock), ("stop", self.stop), ("gate", self.gate_and_start),
                     ("wait healthy", self.wait_healthy), ("verify", self.verify), ("unlock", self.unlock)]
        elif action in ("stop", "sweep"):
            steps = [("lock", self.take_lock), ("stop", self.stop), ("gate", self.gate), ("unlock", self.unlock)]
        return [FunctionCommand(self._step(name, body), (), {}) for name, body in steps]

    def take_lock(self, host) -> None:
        """Take the lease and look again under it, in one command; then queue the record."""
        with self._span("lock", owner=_operator()) as end:
            lease = max(self.drain_timeout + self.kill_grace, self.gate_timeout) + LOCK_MARGIN_S
            calls = [tr.step_call("lock_acquire", path=self.files["lock"], token=self.token, owner=_operator(),
                                  lease_s=lease, wait_s=self.lock_wait)]
            staging = self.target is None and self.spec is not None
            if staging:
                # The env values go on this short command's stdin (never in an argv), staged 0600
                # under the lock for prepare to move into place.
                env_b64 = base64.b64encode(tr.env_file_text(self.spec.env).encode()).decode()
                calls.append(tr.step_call("stage_env", lock={"path": self.files["lock"], "token": self.token, "lease_s": lease},
                                          staged_file=self.files["staged_env"], secret={"env_b64": env_b64}))
            # Look again under the lock: another operator may have just converged this server.
            calls.append(tr.step_call("observe", **self._probe_kwargs()))
            results = self._run(host, calls)
            staged = results.pop(1) if staging and len(results) > 1 else None
            result = results[0]
            if not result.get("acquired"):
                if "holder" not in result:
                    raise TransitionFailed(f"could not take the lock {self.files['lock']}: {result.get('error')}. "
                                           f"Nothing was touched.")
                holder = result.get("holder") or {}
                left = float(holder.get("expires", 0)) - float(result.get("clock", 0))
                end["holder"] = holder.get("owner")
                raise TransitionFailed(
                    f"another transition holds the lock {self.files['lock']}: {holder.get('owner', '?')} "
                    f"(step {holder.get('step', '?')}), lease ends in {max(0, left):.0f} s. "
                    f"Nothing was touched; re-run when it is done (a dead run's lock lapses by itself).")
            self.lock = {"path": self.files["lock"], "token": self.token}
            if result.get("taken_over"):
                old = result["taken_over"]
                self._say(host, f"took over a lapsed lock from {old.get('owner', '?')} (step {old.get('step', '?')})")
                end.update(outcome="taken over", previous_owner=old.get("owner"), previous_step=old.get("step"))
            if staged is not None and not staged.get("ok"):
                raise TransitionFailed(f"could not write {self.files['staged_env']}: {staged.get('error')}. "
                                       f"Nothing was stopped.")
            looked = results[1] if len(results) > 1 else {}
            server = looked.get("server")
            if not isinstance(server, dict) or "error" in server:
                raise TransitionFailed("the server probe failed under the lock: "
                                       f"{(server or {}).get('error') if isinstance(server, dict) else looked.get('error')}")
            with_command(server)
            change = self._decide(server)
            if change.action == "noop":
                self._say(host, "already converged (by another run) when the lock was taken: nothing to do")
                self._call(host, "lock_release", path=self.files["lock"], token=self.token)
                self.lock = None
                self.done = True
                end["outcome"] = "already converged: released"
                return
            self.server, self.change = server, change
            self.state_before = dict(server.get("state") or {})
            self.story = self._flags_story()  # what is really replaced, as seen under the lock
            end["action"] = change.action
        self._queue_record()

    _DEFAULT = object()  # sentinel: "the default" for _record's current and previous

    def _record_call(self, phase: str, previous: Any = _DEFAULT, current: Any = _DEFAULT,
                     attempted: dict[str, Any] | None = None, save: dict[str, Any] | None = None) -> dict[str, Any]:
        """The call that writes the state file (no secret value in it). ``current`` is what runs (or
        should run) now: the desired spec by default (the recorded previous one for
        restore_previous), the restored one after a rollback, None when nothing runs; ``attempted``
        the spec whose start failed; ``save``: keep the running server's argv and env file in a
        0600 slot."""
        if previous is self._DEFAULT:  # default: the spec that ran before this transition
            previous = self.state_before.get("previous") if self.target is not None else (
                self.previous_record or self.state_before.get("previous"))
        if current is self._DEFAULT:
            current = self.target if self.target is not None else (self.spec.record() if self.spec else None)
        document = {"schema": 1, "port": self.port, "phase": phase, "by": _operator(),
                    "current": current, "previous": previous, "attempted": attempted,
                    "replaced": self.replaced, "timings": self.timings}
        return tr.step_call("record", lock=self._lease(self.gate_timeout), state_file=self.files["state"],
                            env_file=self.files["env"], document=document, save=save)

    def _record_result(self, result: Mapping[str, Any]) -> None:
        if not result.get("ok"):
            raise TransitionFailed(f"could not write {self.files['state']}: {result.get('error')}", step="record")

    def _record(self, host, phase: str, **kwargs: Any) -> dict[str, Any]:
        """Write the state file now, in a command of its own (see _record_call)."""
        result = self._run(host, [self._record_call(phase, **kwargs)])[0]
        self._record_result(result)
        return result

    def _queue_record(self) -> None:
        """The record of the server that runs now (and its 0600 slot), sent with the next command
        (the stop's first chunk, or the gate): it must come before anything is stopped, and it
        does, since a sequence stops at a step that failed."""
        main = self.server.get("main")
        running = tr.running_record(self.server)
        slot = "undo" if self.target is not None else "previous"
        save = None
        if main:
            key = "replaced" if self.target is not None else "previous"
            save = {"main_pid": main["pid"], "argv_file": self.files[f"{slot}_argv"],
                    "env_file": self.files[f"{slot}_env"], "key": key}
            if self.target is not None:
                self.replaced = running
            else:
                self.previous_record = running
        call = self._record_call(phase="changing", save=save)

        def on_result(result: Mapping[str, Any]) -> None:
            with self._measured("record", result) as end:
                self._record_result(result)
                if result.get("saved"):
                    entry = result.get("entry")
                    if self.target is not None:
                        self.replaced = entry or self.replaced
                    else:
                        self.previous_record = entry or self.previous_record
                    self.undo = {"record": self.replaced if self.target is not None else self.previous_record,
                                 "argv_file": save["argv_file"], "env_file": save["env_file"]}
                end.update(saved_slot=slot if result.get("saved") else None, state_file=self.files["state"])

        self.queued.append((call, on_result))

    def stop(self, host) -> None:
        """SIGTERM (SGLang's drain) in chunks of PROGRESS_EVERY_S with a progress line each, then
        SIGKILL of the group and tree and the sweep, in the container."""
        began = time.monotonic()
        main = self.server.get("main")
        strays = self.server.get("strays") or []
        if not main and not strays:
            with self._span("stop") as end:
                end["outcome"] = "nothing to stop"
            return
        if main:
            self._say(host, f"stopping pid {main['pid']} (SIGTERM: drain, deadline {self.drain_timeout:g} s)")
        else:
            self._say(host, f"sweeping {len(strays)} stray sglang process(es)")
        waited, tree, pgid = 0.0, None, None

        def drain_chunk() -> dict[str, Any]:
            chunk = PROGRESS_EVERY_S
            return self._run(host, [tr.step_call(
                "drain", lock=self._lease(chunk + self.kill_grace), main_pid=main["pid"] if main else None,
                chunk_s=chunk, deadline_s=max(0.0, self.drain_timeout - waited), kill_grace=self.kill_grace,
                tree=tree, pgid=pgid, pid_file=self.files["pid"])], gpu=bool(main))[0]

        # The first chunk carries the queued record: its events come first, then the stop's.
        result: dict[str, Any] | None = drain_chunk()
        with self._span("stop", began=began) as end:
            if main:
                self._event("drain", "begin", pid=main["pid"], deadline_s=self.drain_timeout)
            while True:
                if result is None:
                    result = drain_chunk()
                if result.get("error") == "lock lost":
                    raise TransitionFailed(f"the lock was taken over by {(result.get('holder') or {}).get('owner')}")
                if "tree" not in result:
                    raise TransitionFailed(f"the stop failed in the container: {result.get('error')}")
                waited += float(result.get("waited_s") or 0.0)
                tree, pgid = result["tree"], result["pgid"]
                if "kill_s" in result:
                    break
                self._say(host, f"draining pid {main['pid']}: {waited:.0f} s of {self.drain_timeout:g} s, "
                                f"{len(result.get('alive') or [])} of {len(tree)} processes left, "
                                f"GPU MiB {_compact(result.get('gpu_used_mib'))}")
                result = None
            self.timings["drain"] = round(waited, 3) if main else 0.0
            self.timings["kill"] = result.get("kill_s", 0.0)
            if main:
                self._event("drain", "end", outcome="drained" if result.get("drained") else "deadline passed",
                            duration_s=round(time.monotonic() - began, 3), drain_s=self.timings["drain"],
                            processes=len(tree or {}))
            self._event("kill", "begin", targets=sorted(int(pid) for pid in result.get("alive") or []))
            self._event("kill", "end", outcome="killed" if result.get("killed") else "nothing left",
                        duration_s=self.timings["kill"], killed=result.get("killed"))
            self._event("sweep", "begin")
            self._event("sweep", "end", outcome="swept" if result.get("swept") else "nothing found",
                        duration_s=result.get("sweep_s"), swept=result.get("swept"),
                        survivors=result.get("survivors"))
            if result.get("drained") is False:
                self._say(host, f"drain deadline ({self.drain_timeout:g} s) passed: SIGKILLed the process group "
                                f"and tree ({len(result.get('killed', []))} processes)")
            elif main:
                self._say(host, f"drained and exited in {self.timings['drain']:.1f} s")
            if result.get("swept"):
                self._say(host, f"swept {len(result['swept'])} sglang process(es) outside the tree: {result['swept']}")
            if result.get("survivors"):
                self._say(host, f"processes outlived SIGKILL: {result['survivors']} (the gate will tell)")
            end.update(outcome="drained" if result.get("drained") else ("killed" if main else "swept"),
                       drain_s=self.timings["drain"], kill_s=self.timings["kill"])

    def gate(self, host) -> None:
        """Every GPU at or under max_used_mib and no holder left in the container (nothing started)."""
        self._gate(host, [])

    def _gate(self, host, then: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The gate, polled in the container in chunks of PROGRESS_EVERY_S with a progress line per
        chunk (what it sees); ``then``: the steps that run in the same command as soon as it passes
        (no round trip, and no window, between the gate and the start). -> their results."""
        from gpugate import gate as gate_logic
        from gpugate.operations.gpu import decision_from_wait, progress_text

        began = time.monotonic()

        def gate_chunk() -> list[dict[str, Any]]:
            chunk = min(PROGRESS_EVERY_S, max(0.0, self.gate_timeout - (time.monotonic() - began)))
            # The lease covers this chunk and what follows it in the same command (the start, the
            # load's first reading), then a step's margin.
            calls = [tr.step_call("gate_wait", lock=self._lease(PROGRESS_EVERY_S + 60),
                                  max_used_mib=self.max_used_mib, timeout_s=chunk)] + then
            return self._run(host, calls, budget_s=PROGRESS_EVERY_S, gate=True)

        # With nothing to stop, the first chunk carries the queued record: its events come first.
        results: list[dict[str, Any]] | None = gate_chunk()
        with self._span("gate", began=began, max_used_mib=self.max_used_mib, timeout_s=self.gate_timeout) as end:
            while True:
                if results is None:
                    results = gate_chunk()
                waited = time.monotonic() - began
                reading = results[0]
                if reading.get("error") == "lock lost":
                    raise TransitionFailed(f"the lock was taken over by {(reading.get('holder') or {}).get('owner')}")
                decision = decision_from_wait(reading, self.max_used_mib)
                if decision.passed or decision.permanent or waited >= self.gate_timeout:
                    break
                self._say(host, progress_text(waited, self.gate_timeout, decision))
                results = None
            after = results[1:]
            timing = decision.timing or {}
            end.update(gpu_used_mib=timing.get("used_mib"), polls=timing.get("polls"),
                       holders=[{"pid": h.get("pid"), "cmdline": h.get("cmdline")} for h in decision.holders])
            if not decision.passed:
                end["reasons"] = decision.reasons
                raise TransitionFailed(gate_logic.format_failure(decision, host.name, self.gate_timeout)
                                       + "\n  the new server was NOT started")
            # until the controller knew it passed, less the steps that ran after it in the same command
            self.timings["gate"] = round(waited - sum(float(r.get("step_s") or 0.0) for r in after), 3)
            end["outcome"] = "passed"
            end["duration_s"] = self.timings["gate"]
            self._say(host, f"gate passed in {self.timings['gate']:.2f} s: every GPU <= {self.max_used_mib} MiB, "
                            f"no holder (GPU MiB {_compact(timing.get('used_mib'))})")
        return after

    def gate_and_start(self, host, restore_env_from: str | None = None, argv_file: str | None = None,
                       shown: list[str] | None = None, rollback: bool = False) -> None:
        """Gate, then in the same command as the passing reading: clean /dev/shm, check the port,
        write the env file, start, and read the load until the chunk is over (and the probe for
        verify when it is ready already). ``argv_file`` (a rollback or restore_previous): the exact
        argv kept in the container; ``restore_env_from``: the env file kept with it."""
        if argv_file is None and self.target is not None:
            argv_file, shown = self.files["previous_argv"], self.target.get("argv")
        if restore_env_from is None and self.target is not None:
            restore_env_from = self.files["previous_env"]
        if restore_env_from is not None:
            prepare_kwargs = {"restore_env_from": restore_env_from}
        else:  # the desired env file, staged (0600) with the lock
            prepare_kwargs = {"staged_env": self.files["staged_env"]}
        lease = self._lease(PROGRESS_EVERY_S + 60)
        then = [tr.step_call("prepare_start", lock=lease, port=self.port, env_file=self.files["env"],
                             **prepare_kwargs)]
        if argv_file is None and self.spec.supervisor == "systemd":
            unit_text = render_unit(self.spec, self.files, self.drain_timeout + self.kill_grace)
            # The unit's ExecStart and the argv may hold a secret flag (--api-key): on stdin.
            then.append(tr.step_call("start_systemd", lock=lease, unit=self.files["unit_name"],
                                     secret={"unit_text_b64": base64.b64encode(unit_text.encode()).decode()},
                                     unit_path=self.files["unit"]))
        else:
            then.append(tr.step_call("start_process", lock=lease, secret={"argv": None if argv_file else self.spec.argv},
                                     argv_file=argv_file, env_file=self.files["env"], log_file=self.files["log"],
                                     pid_file=self.files["pid"]))
        # The load's first reading (the new pid from the start's result) for what is left of the chunk,
        # and, once it is ready, the probe that verify compares.
        then.append(tr.step_call("wait_healthy", lock=self._lease(PROGRESS_EVERY_S + 60), port=self.port,
                                 chunk_s=PROGRESS_EVERY_S, log_file=self.files["log"], budget_kwarg="chunk_s",
                                 inputs={"pid": "pid", "log_offset": "log_offset"}))
        then.append(tr.step_call("observe", **self._probe_kwargs(model_path=False)))
        after = self._gate(host, then)
        prepared = after[0] if after else {"ok": False, "error": "not run"}
        with self._measured("prepare", prepared) as end:
            if restore_env_from is not None:
                end["env_from"] = restore_env_from
            if not prepared.get("ok"):
                raise TransitionFailed(f"before the start: {prepared.get('error')}", step="prepare")
            if prepared.get("removed_shm"):
                self._say(host, f"removed stale /dev/shm segments: {', '.join(prepared['removed_shm'])}")
            end["removed_shm"] = prepared.get("removed_shm")
        started = after[1] if len(after) > 1 else {"ok": False, "error": "not run"}
        with self._measured("start", started, {"argv": shown if argv_file else tr.redact_argv(self.spec.argv)}) as end:
            if not started.get("ok"):
                raise TransitionFailed(f"start failed: {started.get('error')}", step="start")
            self.started = started
            end["pid"] = started["pid"]
            text = " ".join(shown or []) if argv_file else " ".join(tr.redact_argv(self.spec.argv))
            self._say(host, f"started pid {started['pid']}: {text}")
        self.first_wait = after[2] if len(after) > 2 else None
        self.looked_after_start = (after[3].get("server") if len(after) > 3 else None)

    def _wait(self, host, pid: int, log_offset: int | None, first: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Poll (inside the container, in chunks) until ready, crashed, or start_timeout. ``first``:
        the reading taken in the start's own command (its ``step_s`` counts into the load). When
        ready, ``server`` is the probe taken right then in the same command (for verify)."""
        began = time.monotonic() - (float(first.get("step_s") or 0.0) if first else 0.0)
        last_phase = None
        result = dict(first) if first else None
        while True:
            if result is None:
                elapsed = time.monotonic() - began
                chunk = max(0.5, min(WAIT_CHUNK_S, self.start_timeout - elapsed))
                results = self._run(host, [
                    tr.step_call("wait_healthy", lock=self._lease(chunk + 30), port=self.port, pid=pid, chunk_s=chunk,
                                 log_file=self.files["log"], log_offset=log_offset or 0),
                    tr.step_call("observe", **self._probe_kwargs(model_path=False))])
                result = results[0]
                if len(results) > 1:
                    result["server"] = results[1].get("server")
            else:
                chunk = float(result.get("step_s") or 0.0)
            if result.get("error") == "lock lost":
                raise TransitionFailed(f"the lock was taken over by {(result.get('holder') or {}).get('owner')}")
            phase = result.get("phase", "unknown")
            elapsed = time.monotonic() - began
            if phase in ("ready", "crashed"):
                result["elapsed"] = elapsed
                return result
            if elapsed >= self.start_timeout:
                return {"phase": "timeout", "last_phase": phase, "elapsed": elapsed}
            if phase != last_phase or chunk >= WAIT_CHUNK_S:
                what = {"loading": "loading (port closed)", "starting": "starting (/health 503)",
                        "generating": "healthy, waiting for a generation"}.get(phase, phase)
                self._say(host, f"{what}, {elapsed:.0f} s since the start")
            last_phase = phase
            result = None

    def _first_wait(self) -> dict[str, Any] | None:
        """The load's reading taken in the start's command (with the probe when ready), once."""
        first, self.first_wait = self.first_wait, None
        if first is not None and self.looked_after_start is not None:
            first["server"], self.looked_after_start = self.looked_after_start, None
        return first

    def wait_healthy(self, host) -> None:
        if self.started is None:  # action "wait": a load already in progress
            main = self.server["main"]
            self.started = {"pid": main["pid"], "log_offset": None}
        with self._span("load", pid=self.started["pid"]) as end:
            result = self._wait(host, self.started["pid"], self.started.get("log_offset"), self._first_wait())
            self.timings["load"] = round(result["elapsed"], 3)
            end["duration_s"] = self.timings["load"]  # since the start, the part read in the start's command included
            if result["phase"] == "ready":
                self.verify_server = result.get("server")
                self._say(host, f"healthy and generating after {result['elapsed']:.1f} s")
                end["outcome"] = "ready"
                return
            why = ("crashed during start" if result["phase"] == "crashed"
                   else f"not healthy within {self.start_timeout:g} s (last phase: {result.get('last_phase')})")
            end.update(outcome="crashed" if result["phase"] == "crashed" else "timeout", error=why)
        tail = result.get("log_tail")
        if tail is None:
            tail = self._call(host, "log_tail", log_file=self.files["log"],
                              offset=self.started.get("log_offset") or 0).get("log_tail", [])
        if self.lock is None:
            # Action "wait": this run did not start the server and holds no lock (the run that
            # started it may still be at work); stopping it here could cut into that run. Report only.
            raise TransitionFailed(
                f"the server on :{self.port} (pid {self.started['pid']}) runs the desired flags but {why}; "
                f"this run did not start it and left it as it is. Stop it with sglang_present=false or "
                f"deploy other flags (the previous spec is in {self.files['state']}). Log tail:\n"
                f"{_tail_text(tail)}")
        with self._span("rollback", error=why, to=(self.undo or {}).get("argv_file")) as end:
            self._rollback(host, why, tail, end)

    def _rollback(self, host, why: str, tail: list[str], end: dict[str, Any]) -> None:
        """The new server failed: stop it, gate, start the exact previous argv (kept in the
        container) with its env file, and wait for it.

        The state file then records what runs (the restored spec as ``current``) and what was tried
        (``attempted``). A rollback that does not turn healthy either is stopped too and the GPUs
        gated free: the previous flags ran before, so their failure now points at the machine or the
        container (driver, memory, disk), not at the flags; a half-started server would keep every
        GPU's memory and answer 503 (or hang) to clients and health checks. Stopped and gated is a
        known state that a re-run starts from cleanly; the operator is told exactly that.
        """
        tail_text = _tail_text(tail)
        attempted = self.target if self.target is not None else (self.spec.record() if self.spec else None)
        failed_pid = self.started["pid"]
        self._say(host, f"the new server {why}: stopping it")
        self.server = {"main": {"pid": failed_pid}, "strays": []}
        self.stop(host)
        if not self.undo:
            self.gate(host)
            self.outcome_recorded = True
            self._record(host, phase="failed: new server did not start; nothing ran before", current=None,
                         attempted=attempted)
            end["outcome"] = "nothing to roll back to: stopped, GPUs gated free"
            raise TransitionFailed(f"the new server {why}; there was no server before, so nothing to roll back "
                                   f"to: it was stopped and the GPUs gated free. Log tail:\n{tail_text}")
        self._say(host, "rolling back to the previous flags")
        self.gate_and_start(host, restore_env_from=self.undo["env_file"], argv_file=self.undo["argv_file"],
                            shown=(self.undo.get("record") or {}).get("argv"))
        with self._span("load", pid=self.started["pid"], rollback=True) as load_end:
            result = self._wait(host, self.started["pid"], self.started.get("log_offset"), self._first_wait())
            load_end.update(outcome=result["phase"], duration_s=round(result["elapsed"], 3))
        if result["phase"] == "ready":
            self.outcome_recorded = True
            self._record(host, phase="rolled back", current=self.undo.get("record"), attempted=attempted,
                         previous=self.state_before.get("previous"))
            end.update(outcome="rolled back: the previous server serves", pid=self.started["pid"])
            raise TransitionFailed(f"the new server {why}; rolled back: the previous server serves again "
                                   f"(pid {self.started['pid']}, previous flags). Log tail of the failed "
                                   f"start:\n{tail_text}")
        # The rollback failed too: leave nothing half-started holding the GPUs.
        rollback_tail = result.get("log_tail")
        if rollback_tail is None:
            rollback_tail = self._call(host, "log_tail", log_file=self.files["log"],
                                       offset=self.started.get("log_offset") or 0).get("log_tail", [])
        rollback_why = ("crashed during start" if result["phase"] == "crashed"
                        else f"was not healthy within {self.start_timeout:g} s (last phase: {result.get('last_phase')})")
        self._say(host, f"the rollback server {rollback_why}: stopping it too")
        self.server = {"main": {"pid": self.started["pid"]}, "strays": []}
        self.stop(host)
        self.gate(host)
        self.outcome_recorded = True
        self._record(host, phase="stopped: the rollback failed too", current=None, attempted=attempted)
        end["outcome"] = "the rollback failed too: stopped, GPUs gated free"
        raise TransitionFailed(
            f"the new server {why}; the rollback to the previous flags {rollback_why} as well, so it was "
            f"stopped and the GPUs gated free: NOTHING SERVES on :{self.port} now. The previous flags ran "
            f"before, so this points at the container or the machine, not (only) the new flags; a "
            f"half-started server would hold every GPU and answer 503. Fix the cause, then re-run (the "
            f"state file {self.files['state']} keeps the previous spec under 'previous').\n"
            f"  log tail of the failed start:\n{tail_text}\n  log tail of the rollback:\n{_tail_text(rollback_tail)}")

    def verify(self, host) -> None:
        """Compare what runs with what was asked for, from the probe taken in the same command that
        saw the server ready (no command of its own)."""
        with self._span("verify") as end:
            server, self.verify_server = self.verify_server, None
            if not isinstance(server, dict) or "error" in server:
                observation = host.get_fact(SglangObservation, port=self.port,
                                            env_names=sorted(self.spec.env) if self.spec else (), python=self.python)
                server = observation.get("sglang") or {}
            else:
                with_command(server)
            if not server.get("running"):
                raise TransitionFailed("the server is not running after it turned healthy")
            end["pid"] = server["main"]["pid"]
            if self.target is not None:
                if sglang_probe.argv_hash(server["main"]["argv"]) != self.target.get("argv_hash"):
                    raise TransitionFailed("the running command is not the recorded previous one: "
                                           f"{tr.redact_argv(server['main']['argv'])}")
                change = tr.compare_previous(server, self.target)
                what = "the running command is the recorded previous one (argv and env hashes)"
            else:
                if server["main"]["argv"] != self.spec.argv:
                    raise TransitionFailed(
                        f"the running argv is not the desired one: {tr.redact_argv(server['main']['argv'])}")
                info = ((server.get("server_info") or {}).get("args")) or {}
                mismatches = server_info_mismatches(self.spec.flags, info) if info else {}
                if mismatches:
                    raise TransitionFailed(f"/get_server_info disagrees with the desired flags: {mismatches}")
                change = tr.compare(server, self.spec)
                what = "the running argv and /get_server_info match the desired flags"
            if change.action != "noop":
                raise TransitionFailed(f"after the start the server still differs: {'; '.join(change.reasons)}")
            self._say(host, f"verified: {what}")

    def unlock(self, host) -> None:
        """Record the outcome and release the lock, in one command."""
        with self._span("unlock") as end:
            phase = "running" if (self.spec or self.target is not None) else "absent"
            self.timings["total"] = round(time.monotonic() - self.began, 3)
            results = self._run(host, [self._record_call(phase=phase),
                                       tr.step_call("lock_release", path=self.files["lock"], token=self.token)])
            self._record_result(results[0])
            self.lock = None
            end["phase_recorded"] = phase
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in self.timings.items() if k in ("drain", "kill", "gate", "load"))
        self._say(host, f"done in {self.timings['total']:.1f} s ({parts})")
        self._event("done", "end", outcome=phase, timings=self.timings, **self.story)


def _tail_text(tail: list[str], lines: int = 30) -> str:
    return "\n".join("    | " + line for line in tail[-lines:])


def render_unit(spec: tr.Spec, files: Mapping[str, str], stop_timeout_s: float) -> str:
    """The systemd unit (gpugate/templates/sglang.service.j2, package data) for this spec."""
    import shlex

    from gpugate.resources import render_template

    def systemd_quote(arg: str) -> str:
        # systemd's ExecStart splits like a shell with double quotes; '%' and '$' are its specifiers
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$") + '"'

    return render_template(
        "sglang.service.j2", port=spec.port, exec_start=" ".join(systemd_quote(a) for a in spec.argv), env_file=files["env"],
        stop_timeout_s=int(stop_timeout_s), argv_comment=shlex.join(tr.redact_argv(spec.argv)))


def _print_plan(host_obj, change: tr.Change, spec: tr.Spec | None, port: int) -> None:
    lines = [f"sglang :{port} will {change.action}: {'; '.join(change.reasons)}"]
    lines += ["    " + line for line in change.flag_lines + change.env_lines]
    lines += ["    steps: " + " -> ".join(tr.steps_for(change.action, spec.supervisor if spec else "process"))]
    for line in lines:
        host_obj.log(line)


def _fail_with(state, host, message: str) -> bool:
    host.log_styled(message, fg="red", log_func=logger.error)
    return False


def _refuse(message: str):
    """Fail this host only, before anything is touched. While preparing (and under --dry) an
    OperationError stops the run with the message; while executing a failing command fails
    this host alone, so that the other hosts go on."""
    if not state.is_executing:
        raise OperationError(message)
    yield FunctionCommand(_fail_with, (message,), {})


@operation()
def server(
    port: int = 30000,
    model_path: str | None = None,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, Any] | None = None,
    present: bool = True,
    supervisor: str = "process",
    max_used_mib: int = 64,
    gate_timeout: float = 120,
    drain_timeout: float = 60,
    kill_grace: float = 10,
    start_timeout: float = 2700,
    python: str = "/usr/bin/python3",
    restarted: bool = False,
    lock_wait: float = 0,
    restore_previous: bool = False,
    audit_log: str | None = None,
):
    """
    Run (or not) an SGLang server with exactly these flags, gated on the GPUs.

    + port: the server's port (one server per port and container)
    + model_path: ``--model-path`` (a directory in the container, or a repo id)
    + flags: SGLang flags as data, ``{"tp": 8, "kv-cache-dtype": "fp8_e4m3", "disable-radix-cache": True}``
    + env: the server's environment (written 0600 in the container; values never printed)
    + present: False stops the server (drain, kill, sweep, gate)
    + supervisor: ``process`` (own process group, pid file, log) or ``systemd`` (unit from templates/)
    + max_used_mib: the gate: a GPU is free at or under this many MiB (NVML v2)
    + gate_timeout: seconds to wait for every GPU to be free after the stop
    + drain_timeout: seconds of SGLang's SIGTERM drain before SIGKILL of the whole tree
    + kill_grace: seconds for the tree to vanish after SIGKILL
    + start_timeout: seconds until healthy and generating (45 min covers a cold TP8 load)
    + python: the interpreter in the container (``python -m sglang.launch_server``)
    + restarted: restart even when nothing differs
    + lock_wait: seconds to wait for another operator's transition (0: fail at once, clearly)
    + restore_previous: the desired server is the one recorded as ``previous`` (before the last
      change): its exact argv and env file, kept 0600 in the container, are put back through the
      same gated transition; ``model_path``, ``flags``, ``env`` and ``supervisor`` are not used. A
      second run is a no-op.
    + audit_log: the audit file on the control machine (one JSON event per step's begin and end);
      default ``$GPUGATE_AUDIT_LOG`` or ``./audit.jsonl``

    Everything that can be checked before the stop is checked first (flags, model path, port,
    GPUs visible, memory held from outside the container, --hicache-size x TP against the
    container's memory); a failed check touches nothing and the running server keeps running.

    **Example:**

    .. code:: python

        from gpugate.operations import sglang

        sglang.server(
            name="Serve Kimi with an fp8 KV cache",
            model_path="/opt/models/kimi", port=30000,
            flags={"tp": 8, "kv-cache-dtype": "fp8_e4m3", "mem-fraction-static": 0.88},
        )
        sglang.server(name="Back to the flags before the last change", port=30000, restore_previous=True)
    """
    restoring = bool(restore_previous) and present
    try:
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise tr.SpecError(f"port must be an integer in 1..65535, got {port!r}")
        spec = tr.desired_spec(model_path, port, flags, env, supervisor, python) if present and not restoring else None
    except tr.SpecError as error:
        yield from _refuse(f"sglang.server: {error} (nothing was touched)")
        return

    observation = host.get_fact(SglangObservation, port=port, env_names=sorted(spec.env) if spec else (),
                                model_path=spec.model_path if spec else None, python=python)
    server_doc = observation.get("sglang") or {}
    if "error" in server_doc:
        yield from _refuse(f"sglang.server: the server probe failed: {server_doc['error']}")
        return

    target = None
    if restoring:
        try:
            target = tr.previous_target(server_doc, tr.paths(port)["state"])
        except tr.SpecError as error:
            yield from _refuse(f"sglang.server on {host.name}: {error}. Nothing was touched.")
            return
        change = tr.compare_previous(server_doc, target)
        if restarted and change.action in ("noop", "wait"):
            change = tr.Change("restart", ["restarted=True"], running=change.running)
    else:
        change = tr.decide(server_doc, spec, restarted)
    if change.action == "noop":
        host.noop(change.reasons[0])
        return

    checked = spec
    if target is not None:  # the checks read tp/dp/hicache from the recorded (redacted) flags
        checked = tr.Spec(target["model_path"], port, dict(target.get("flags") or {}), {},
                          target.get("supervisor") or "process", target.get("python") or python)
    problems = tr.preflight(observation, checked, max_used_mib) if change.action in ("start", "restart") else []
    if problems:
        yield from _refuse("sglang.server: refusing to begin (nothing was touched"
                           + (", the running server keeps running" if server_doc.get("running") else "")
                           + "):\n  " + "\n  ".join(problems))
        return

    # Print the plan once: at prepare time, or at execute time when prepare was skipped (-y).
    if not state.is_executing or not state.check_for_changes:
        _print_plan(host, change, spec, port)

    transition = Transition(spec, change, observation, port=port, max_used_mib=max_used_mib,
                            gate_timeout=gate_timeout, drain_timeout=drain_timeout, kill_grace=kill_grace,
                            start_timeout=start_timeout, lock_wait=lock_wait, python=python,
                            restarted=restarted, target=target, audit_log=audit_log,
                            vmid=host.data.get("pct_vmid"))
    yield from transition.commands()
