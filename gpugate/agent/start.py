"""The start of a server by a transition (a step of gpugate.agent.transition.Transition, over its
Context): the GPU
gate (gpugate.rules.gate), prepare (/dev/shm, port, env file, unit), the start under its supervisor
(a process with its log pump, or a systemd unit), the wait until it serves a real generation, and
the verify of what runs against what was asked.
"""

from __future__ import annotations

import errno
import json
import os
import time

from gpugate.agent.engine import engine
from gpugate.agent import logs, observe, server, state, supervise, weight_cache
from gpugate.rules import gate as rules_gate
from gpugate.rules import procfs, redact

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, BinaryIO, Dict, Iterable, List, Optional, Set, Tuple, Union

    from gpugate.agent.context import Context, Doc

GATE_POLL_S = 0.05
LOAD_POLL_S = 0.05  # the moment it turns ready is downtime; a look is /proc + netlink (+ one local GET)


def gate_decision(doc: Doc, gpus: Iterable[int] | None, max_used_mib: int, expected_mib: Dict[int, int] | None = None,
                  ignore_pids: Iterable[int] = ()) -> Tuple[bool, List[str], Dict[str, Any], bool]:
    """(passed, problems, used MiB per GPU, permanent) for this server's GPUs (None: every GPU), by
    gpugate.rules.gate.decide: a holder with memory on one of them blocks; one that only holds the
    device files (an NVML monitor at 0 MiB) does not.

    >>> reading = {"source": "nvml", "memory_api": "v2", "gpus": [{"index": 0, "used_mib": 0}], "holders": []}
    >>> gate_decision(reading, [0], 64)[0], gate_decision(reading, [0, 5], 64)[1:]
    (True, (['GPU 5 is not visible'], {'0': 0}, True))
    """
    verdict = rules_gate.decide(doc, max_used_mib, gpus, ignore_pids=ignore_pids, expected_mib=expected_mib,
                                idle_holders_block=False)
    if doc.get("source") in (None, "none"):
        errors = doc.get("errors") or []
        problems = ["no GPU reading: %s" % "; ".join(str(e.get("message"))[:120] for e in errors)]
        return False, problems, verdict["used_mib"], verdict["permanent"]
    # the reading's own problems; for v1 the GPU lines below say it
    problems = verdict["reading_problems"][:-1 if doc.get("memory_api") != "v2" else None]
    problems += ["GPU %d is not visible" % index for index in verdict["missing"]]
    for index, error in verdict["unknown"]:
        problems.append("GPU %d: %s" % (index, error) if error else "GPU %d: memory use unknown (%s)" % (
            index, "v1 API: reserved memory counted in" if doc.get("memory_api") == "v1" else "no reading"))
    for index, used, limit in verdict["over"]:
        ours = limit - max_used_mib  # what the kept weight cache and the gated engine hold there
        problems.append("GPU %d: %d MiB used (> %d)%s" % (index, used - ours, max_used_mib,
                                                         ", besides %d MiB of this server's own" % ours if ours else ""))
    for holder, on in verdict["blocking"]:
        problems.append("pid %d (%s) holds memory on GPU %s" % (holder["pid"], (holder.get("cmdline") or "")[:60],
                                                               ",".join(str(i) for i in on)))
    return verdict["passed"], problems, verdict["used_mib"], verdict["permanent"]


def read_gpus() -> Doc:
    """A GPU reading for the start's steps and the weight cache's (the NVML session kept open)."""
    return observe.read_gpus(keep_open=True)


class Start(object):
    """The start's steps over the run's Context (budgets, journal, redactor, the children it starts);
    the server's weight cache through its WeightCache step."""

    def __init__(self, ctx: Context, cache: weight_cache.WeightCache) -> None:
        self.ctx = ctx
        self.cache = cache

    # ------------------------------------------------------------------ gate, prepare, start, load, verify
    def verified(self, spec: Doc, target: str) -> Dict[str, Any]:
        """The start of ``spec`` from a stopped server: its weight cache kept, stopped or started
        (gpugate.agent.weight_cache), the gate, prepare, the engine (started now, or the gated
        engine launched before the stop, activated now), ready, verify: -> the capacity it reports
        (the transition commits it)."""
        ctx = self.ctx
        mode, why = self.cache.state(spec)
        ctx.event("cache", "end", target=target, port=spec["port"], mode=mode, why=why)
        if mode != "keep":
            self.cache.stop(spec["port"], target, why)
        gated = ctx.gated if ctx.gated and ctx.gated["target"] == target else None
        self._gate(spec, target, keep_cache=mode == "keep", gated=gated)
        self._prepare(spec, target)
        if mode == "start":
            self.cache.start(spec, target)
        if gated:
            pid, offset = self._activate_gated(spec, target)
        else:
            pid, offset = self._start(spec, target)
        self.wait_ready(spec, pid, target, offset)
        return self.verify(spec, pid, target)

    def _gate(self, spec: Doc, target: str, keep_cache: bool = False, gated: Doc | None = None) -> None:
        """Until this server's GPUs are free: at most ``max_used_mib`` each, no holder; a kept
        weight cache's daemons and a gated engine of ours hold what they hold there (expected),
        and are no holders. Anything else blocks."""
        ctx = self.ctx
        gpus = spec.get("gpus")
        max_used = int(ctx.budget("max_used_mib"))
        began = time.time()
        deadline = began + ctx.budget("gate_timeout_s")
        ctx.event("gate", "begin", target=target, gpus=gpus, max_used_mib=max_used)
        polls = 0
        while True:
            table = procfs.table()
            ours: Set[int] = set()
            if keep_cache:
                ours.update(weight_cache.tree(table, weight_cache.read_record(spec["port"]))[1])
            if gated:
                ours.update(ctx.gated_tree(table))
            doc = observe.read_gpus(keep_open=True, exclude=server.own_pids(table))
            expected = weight_cache.used_by(doc, ours) if ours else None
            polls += 1
            passed, problems, used, permanent = gate_decision(doc, gpus, max_used, expected, ours)
            if expected:  # the figures shown are the others' (ours are expected): what must go
                used = dict((k, v - expected.get(int(k), 0) if v is not None else v) for k, v in used.items())
            if passed:
                ctx.event("gate", "end", target=target, passed=True, used_mib=used, polls=polls,
                           elapsed_s=round(time.time() - began, 3),
                           expected_mib=dict((str(k), v) for k, v in (expected or {}).items()) or None,
                           own=[what for what, on in (("its weight cache", keep_cache), ("its gated engine", gated)) if on],
                           monitors=[h["pid"] for h in doc.get("holders") or [] if not h.get("gpus")])
                return
            if permanent or time.time() >= deadline:
                ctx.event("gate", "end", target=target, passed=False, used_mib=used, problems=problems,
                          elapsed_s=round(time.time() - began, 3))
                raise state.Failure("GPU gate did not pass within %gs: %s" % (ctx.budget("gate_timeout_s"), "; ".join(problems)))
            ctx.progress("gate", target=target, elapsed_s=round(time.time() - began, 1), used_mib=used,
                         problems=problems[:4])
            time.sleep(GATE_POLL_S)

    def _prepare(self, spec: Doc, target: str) -> None:
        ctx = self.ctx
        port = spec["port"]
        ctx.event("prepare", "begin", target=target, port=port)
        removed = supervise.remove_stale_shm()
        inodes = server.listeners(port)
        if inodes:
            table = procfs.table()
            owners = server.socket_owners(inodes)
            raise state.Failure("port %d is taken by %s" % (port, ", ".join(
                "%d (%s)" % (pid, ctx.redactor.text(" ".join(table.get(pid, {}).get("argv") or []))[:80])
                for pid in owners) or "a process outside this container's view"))
        try:
            state.makedirs(state.ETC_DIR, 0o700)
            state.write_private(state.paths(port)["env"], state.env_file_text(spec.get("env") or {}))
        except OSError as error:
            text = "cannot write the env file %s: %s" % (state.paths(port)["env"], error.strerror or error)
            if target != "rollback" or spec.get("supervisor") == "systemd":
                raise state.Failure(text)
            # the process supervisor passes the environment itself: the previous server can come back
            ctx.warnings.append(text)
        if spec.get("supervisor") == "systemd":
            if server.pid1_comm() != "systemd":
                raise state.Failure("supervisor systemd, but PID 1 is %s, not systemd" % server.pid1_comm())
            try:
                state.write_private(state.paths(port)["unit"], spec["unit_text"], 0o600)
            except OSError as error:
                raise state.Failure("cannot write the unit %s: %s" % (state.paths(port)["unit"], error.strerror or error))
        elif server.pid1_comm() == "systemd" and os.path.exists(state.paths(port)["unit"]):
            supervise.systemctl("disable", state.paths(port)["unit_name"])  # a unit of ours would restart an old server
        ctx.event("prepare", "end", target=target, port=port, removed_shm=removed)

    def _start(self, spec: Doc, target: str) -> Tuple[int, int | None]:
        ctx = self.ctx
        port = spec["port"]
        ctx.touched = True
        offset: Optional[int]
        ctx.event("start", "begin", target=target, port=port, supervisor=spec.get("supervisor") or "process",
                  argv=redact.redact_argv(spec["argv"], tuple(redact.ALWAYS_MASKED_OPTIONS) + tuple(spec.get("secret_flags") or ())))
        if spec.get("supervisor") == "systemd":
            pid = self._start_systemd(spec, target)
            offset = None
        else:
            pid, offset, _ = self._start_process(spec, target)
        ctx.event("start", "end", target=target, port=port, pid=pid)
        return pid, offset

    def _open_log(self, port: int, target: str) -> Tuple[BinaryIO, str]:
        """The server's log (0600, rotated by size); on ENOSPC the rotated files go first, and a
        rollback may fall back to /run so that a full /var/log cannot keep the old server down."""
        log_path = state.paths(port)["log"]
        header = None
        try:
            state.makedirs(state.LOG_DIR, 0o750)
            logs.rotate_log(log_path)
            handle = state.open_private_append(log_path)
            return handle, log_path
        except OSError as error:
            header = error
            if error.errno == errno.ENOSPC:
                for index in range(logs.LOG_KEEP, 0, -1):
                    try:
                        os.unlink("%s.%d" % (log_path, index))
                    except OSError:
                        pass
        if target == "rollback":
            fallback = state.paths(port)["fallback_log"]
            try:
                state.makedirs(state.RUN_DIR, 0o755)
                self.ctx.warnings.append("server log on %s (%s: %s)" % (fallback, log_path, header))
                return state.open_private_append(fallback), fallback
            except OSError:
                pass
        raise state.Failure("cannot write the server log %s: %s" % (log_path, getattr(header, "strerror", None) or header))

    def _start_process(self, spec: Doc, target: str, write_pid: bool = True) -> Tuple[int, int, Doc]:
        """-> (pid, log offset, the pid file's record); the pid file written unless ``write_pid``
        is False (a gated engine: the stop of the old server reads the pid file first)."""
        engine.use_for(spec["argv"])  # this server's engine: its paths, its workers
        import subprocess

        ctx = self.ctx
        port = spec["port"]
        handle, log_path = self._open_log(port, target)
        flags = tuple(redact.ALWAYS_MASKED_OPTIONS) + tuple(spec.get("secret_flags") or ())
        try:
            offset = handle.seek(0, 2)
            line = "\n=== gpugate start %s run %s (%s): %s\n" % (state.now_iso(), ctx.run, target,
                                                               ctx.redactor.text(" ".join(redact.redact_argv(spec["argv"], flags))))
            handle.write(line.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        except OSError as error:
            handle.close()
            if target == "rollback" and log_path != state.paths(port)["fallback_log"]:
                handle = state.open_private_append(state.paths(port)["fallback_log"])
                log_path = state.paths(port)["fallback_log"]
                offset = handle.seek(0, 2)
                ctx.warnings.append("server log on %s (%s)" % (log_path, error))
            else:
                raise state.Failure("cannot write the server log %s: %s" % (log_path, error.strerror or error))
        env = dict(state.BASE_ENV)
        env.update(spec.get("env") or {})
        output: Union[int, BinaryIO] = ctx.log_pump(log_path, spec) or handle
        try:
            child = subprocess.Popen(spec["argv"], stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                     env=env, cwd="/", start_new_session=True, close_fds=True)
        except OSError as error:
            raise state.Failure("cannot start %s: %s" % (spec["argv"][0], error))
        finally:
            handle.close()
            if isinstance(output, int):  # the pump's pipe (else the log file itself)
                os.close(output)
        ctx.children[child.pid] = child
        stat = procfs.read_stat(child.pid)
        record = {"pid": child.pid, "start_ticks": stat[4] if stat else None, "port": port, "log": log_path,
                  "supervisor": "process", "run": ctx.run, "started": time.time()}
        pump = ctx.pumps.get(port) if output is not handle else None
        if pump is not None:  # observe warns when it is gone while the server runs (pump_warnings)
            pump_stat = procfs.read_stat(pump.pid)
            record["pump"] = {"pid": pump.pid, "start_ticks": pump_stat[4] if pump_stat else None}
        if write_pid:
            self._write_pid_file(port, record)
        return child.pid, offset, record

    @staticmethod
    def _write_pid_file(port: int, record: Doc) -> None:
        try:
            state.makedirs(state.RUN_DIR, 0o755)
            state.write_private(state.paths(port)["pid"], json.dumps(record), 0o644)
        except OSError as error:
            raise state.Failure("cannot write the pid file %s: %s" % (state.paths(port)["pid"], error))

    # ------------------------------------------------------------------ gated launch
    def launch_gated(self, spec: Doc, target: str) -> None:
        """Start the engine with ``--gated-launch-port`` while the old server still serves: its
        imports and distributed init happen before the old server's stop (the transition waits
        for its gate first), and it blocks there (before any sizable GPU allocation, its CUDA
        contexts only) until its activation (the start, ``_activate_gated``). A launch that fails here costs only the overlap:
        the start is then an ordinary one."""
        ctx = self.ctx
        host = engine.argv_host(spec["argv"])
        # the server it overlaps (None on a first start, or after NOTHING SERVES): said with its launch
        table = procfs.table()
        old = [main["pid"] for main in (server.find_server(table, port)[0] for port in sorted(set(
            [spec["port"]] + ([ctx.replaces["port"]] if ctx.replaces else [])))) if main is not None]
        try:
            gate_port = free_port(host)
            pid, offset, record = self._start_process(dict(spec, argv=engine.gated_argv(spec["argv"], gate_port)),
                                                      target, write_pid=False)
        except (state.Failure, OSError) as error:
            ctx.warnings.append("gated launch not used: %s" % error)
            return
        ctx.gated = {"pid": pid, "start_ticks": record["start_ticks"], "gate_port": gate_port, "host": host,
                      "target": target, "offset": offset, "record": record, "began": time.time(), "activated": False,
                      "reached": False}
        ctx.event("gated", "begin", target=target, port=spec["port"], pid=pid, gate_port=gate_port, old=old)

    def wait_for_gate(self, spec: Doc, target: str) -> str:
        """Until the gated engine serves its gate's /health (it has imported and initialised its
        distributed environment): "reached"; "taken" when another process holds its gate's port
        (its gate could not bind: it can never be activated; it is ended). Failure when it exits
        first, or at the start timeout."""
        ctx = self.ctx
        gated = ctx.gated
        assert gated is not None  # launched, and not ended
        pid, port = gated["pid"], spec["port"]
        deadline = gated["began"] + float(ctx.budget("start_timeout_s"))
        while True:
            ctx.reap()
            if not procfs.alive(pid, gated["start_ticks"]):
                # to the operator it is the start's crash, as for an engine started after the gate; one
                # that reached its gate may die there while the old server drains (looked at again
                # before its activation: else the activation's refused connection is all that is said)
                raise self._crashed(spec, pid, target, gated["offset"], gated["began"], "at its gate (not yet "
                                    "activated)" if gated.get("reached") else "before its gated launch",
                                    gated=True)
            if gated.get("reached"):
                return "reached"
            owners = set(server.socket_owners(server.listeners(gated["gate_port"]) or []))
            if owners and not owners & set(ctx.gated_tree(procfs.table())):
                # the port was taken since free_port chose it: what this cost is the overlap
                ctx.warnings.append("gated launch not used: its port %d is taken by pid %s" % (
                    gated["gate_port"], ", ".join(str(p) for p in sorted(owners))))
                ctx.event("gated", "end", target=target, port=port, reached=False, taken_by=sorted(owners))
                self.end_gated()
                return "taken"
            status, _ = server.http_get(gated["host"], gated["gate_port"], "/health", 2.0) if owners else (None, "")
            if status == 200:
                gated["reached"] = True
                ctx.event("gated", "end", target=target, port=port, reached=True,
                          elapsed_s=round(time.time() - gated["began"], 2))
                return "reached"
            if time.time() >= deadline:
                ctx.event("gated", "end", target=target, port=port, reached=False, state="timeout")
                raise state.Failure("the server did not reach its gated launch within %gs" % ctx.budget("start_timeout_s"))
            ctx.progress("gated", target=target, port=port, elapsed_s=round(time.time() - gated["began"], 1))
            time.sleep(LOAD_POLL_S)

    def _activate_gated(self, spec: Doc, target: str) -> Tuple[int, int | None]:
        """``POST /gate/activate`` to the gated engine (once it has reached its gate): from here it
        loads and allocates, and it is the server of its port (its pid file is written). A gate
        that turned out to be unusable gives an ordinary start."""
        ctx = self.ctx
        gated = ctx.gated
        assert gated is not None  # launched, and not ended: the start activates it
        pid, port = gated["pid"], spec["port"]
        if self.wait_for_gate(spec, target) == "taken":
            return self._start(spec, target)
        # the start of this server is its activation: from here it loads (the journal's order stays
        # stop -> gate -> prepare -> start -> load, whichever way it was launched)
        ctx.touched = True
        ctx.event("start", "begin", target=target, port=port, supervisor="process", gated=True,
                  argv=redact.redact_argv(spec["argv"], tuple(redact.ALWAYS_MASKED_OPTIONS) + tuple(spec.get("secret_flags") or ())))
        status, body = server.http_get(gated["host"], gated["gate_port"], "/gate/activate", 5.0, method="POST")
        if status != 200:
            raise state.Failure("the gated engine (pid %d) did not take its activation: POST /gate/activate on :%d: %s"
                                % (pid, gated["gate_port"], status or body))
        gated["activated"] = True
        self._write_pid_file(port, gated["record"])
        ctx.event("start", "end", target=target, port=port, pid=pid, gated=True, gate_port=gated["gate_port"])
        return pid, gated["offset"]

    def end_gated(self) -> None:
        """A gated engine that was never activated ends with the run (any path that does not
        activate it: a refusal, a failure, the rollback)."""
        ctx = self.ctx
        gated = ctx.gated
        if not gated or gated["activated"]:
            return
        table = procfs.table()
        pids = ctx.gated_tree(table)
        ctx.gated = None
        if pids:  # it serves nothing and holds no more than its contexts: no grace before the SIGKILL
            ctx.event("gated", "end", target=gated["target"], ended=pids)
            procfs.end_processes(dict((pid, table.get(pid, {}).get("start_ticks")) for pid in pids), 0.0, 0.02,
                                 settle_s=float(ctx.budget("kill_grace_s")))
            ctx.reap()

    def _start_systemd(self, spec: Doc, target: str) -> int:
        ctx = self.ctx
        unit = state.paths(spec["port"])["unit_name"]
        handle, _ = self._open_log(spec["port"], target)  # 0600 before systemd appends to it
        handle.close()
        started = time.time()  # the unit logs to journald: its tail is read from here on (journal_tail)
        pid = supervise.start_unit(unit, ctx.redactor)
        if pid <= 0:
            logs.journal_sync()  # journald stores what the unit printed
            tail = [ctx.redactor.text(line) for line in logs.journal_tail(unit, 20, started)]
            raise state.Failure("%s has no main process after systemctl start%s" % (
                unit, ": " + logs.crash_line(tail, spec["port"]) if tail else ""))
        stat = procfs.read_stat(pid)
        state.write_private(state.paths(spec["port"])["pid"], json.dumps({"pid": pid, "start_ticks": stat[4] if stat else None,
                                                              "port": spec["port"], "supervisor": "systemd",
                                                              "log": state.paths(spec["port"])["log"], "run": ctx.run,
                                                              "started": started}), 0o644)
        return pid

    def wait_ready(self, spec: Doc, pid: int, target: str, log_offset: int | None) -> None:
        """loading (port closed) -> starting (health 503) -> ready (health 200 and a real
        generation through the engine's GENERATE_PATH). Fails when the main process exits, or at the
        start timeout."""
        engine.use_for(spec["argv"])  # this server's engine: its paths, its workers
        ctx = self.ctx
        port, host = spec["port"], engine.argv_host(spec["argv"])
        began = time.time()
        timeout = ctx.budget("start_timeout_s")
        if target == "rollback" and ctx.budgets.get("rollback_start_timeout_s"):
            timeout = ctx.budget("rollback_start_timeout_s")
        deadline = began + timeout
        ticks = (procfs.read_stat(pid) or (None,) * 5)[4]
        phase = "loading"
        quiet_at = 0.0  # when the last announcement of a blocking generation was written
        ctx.event("load", "begin", target=target, port=port, pid=pid, timeout_s=timeout)
        while True:
            ctx.reap()
            if not procfs.alive(pid, ticks):
                raise self._crashed(spec, pid, target, log_offset, began, "during " + phase)
            if server.listeners(port):
                status, _ = server.http_get(host, port, engine.HEALTH_PATH, 5.0, engine.argv_token(spec["argv"]))
                phase = "starting" if status != 200 else "generating"
                if status == 200:
                    # the generation may block up to its timeout: say so first, so that this silence
                    # is not taken for a stuck agent (quiet_s: the controller's bound grows by it)
                    if time.time() - quiet_at >= 1.0:  # at most once a second, when generations fail fast
                        quiet_at = time.time()
                        ctx.event("load", "progress", target=target, port=port, state="generating",
                                  elapsed_s=round(time.time() - began, 1), quiet_s=ctx.budget("generate_timeout_s"))
                    generated, error = server.generation(host, port, ctx.budget("generate_timeout_s"),
                                                        engine.argv_token(spec["argv"]), spec["argv"])
                    if generated == 200:
                        ctx.event("load", "end", target=target, port=port, state="ready",
                                  elapsed_s=round(time.time() - began, 2))
                        return
            else:
                phase = "loading"
            if time.time() >= deadline:
                tail = self._tail(port, log_offset)
                ctx.event("load", "end", target=target, port=port, state="timeout", last_state=phase,
                          elapsed_s=round(time.time() - began, 2), log_tail=tail)
                raise state.Failure("the server was not healthy within %gs (still %s)" % (timeout, phase))
            ctx.progress("load", target=target, port=port, state=phase, elapsed_s=round(time.time() - began, 1))
            time.sleep(LOAD_POLL_S)

    def _crashed(self, spec: Doc, pid: int, target: str, log_offset: int | None, began: float, when: str,
                 **fields: Any) -> state.Failure:
        """The Failure of a server whose main process ended during its start (``when``: "during
        loading", "before its gated launch"), after journalling its exit code and log tail."""
        ctx = self.ctx
        port = spec["port"]
        code = ctx.exit_codes.get(pid)
        if code is None and spec.get("supervisor") == "systemd":
            code = supervise.unit_exit_code(port)
        self._settle_log(port)
        tail = self._tail(port, log_offset)
        ctx.event("load", "end", target=target, port=port, state="crashed", exit_code=code,
                  elapsed_s=round(time.time() - began, 2), log_tail=tail, **fields)
        if code == -9:  # SIGKILLed, it wrote no last word; the log's last line may be another's (an old
            why = ": killed by SIGKILL (signal 9)"  # server drains into the same log while a gated one waits)
        else:
            why = ": " + logs.crash_line(tail, port) if tail else ""
        return state.Failure("the server exited %s%s%s" % (when, " with code %s" % code if code is not None else "", why))

    def _settle_log(self, port: int, timeout: float = 1.0) -> None:
        """Give the log pump up to ``timeout`` to write what a crashed server printed last (it ends
        at EOF, once the server's tree has closed the pipe); for a unit, give journald as long to
        store it (its tail unchanged over 0.2 s)."""
        pump = self.ctx.pumps.get(port)
        deadline = time.time() + timeout
        while pump is not None and pump.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        if pump is None and (state.read_pid_file(port) or {}).get("supervisor") == "systemd":
            if logs.journal_sync():
                return
            last = None  # no sync (journalctl refused it): until the tail stays the same for 0.3 s
            deadline = time.time() + 3 * timeout
            while time.time() < deadline:
                tail = logs.server_log_tail(port, 5)
                if tail and tail == last:
                    break
                last = tail
                time.sleep(0.3)

    def _tail(self, port: int, offset: int | None, lines: int = 20) -> List[str]:
        return [self.ctx.redactor.text(line) for line in logs.server_log_tail(port, lines, offset)]

    def verify(self, spec: Doc, pid: int, target: str) -> Dict[str, Any]:
        engine.use_for(spec["argv"])  # this server's engine: its paths, its workers
        ctx = self.ctx
        ctx.event("verify", "begin", target=target, port=spec["port"])
        problems = []
        argv = engine.steady_argv(procfs.read_argv(pid))
        if argv != spec["argv"]:
            problems.append("the running argv differs from the desired argv")
        table = procfs.table()
        tree = [pid] + procfs.descendants(table, pid)
        gpus = spec.get("gpus")
        if gpus is None:
            gpus = engine.server_gpus(spec["argv"], spec.get("env"))
        workers = server.workers_of(table, tree, engine.expected_workers(gpus))
        if workers["expected"] is not None and (workers["alive"] < workers["expected"] or workers["zombies"]):
            problems.append("%d of %d scheduler workers alive" % (workers["alive"], workers["expected"]))
        info = server.server_info(engine.argv_host(spec["argv"]), spec["port"], timeout=10.0, token=engine.argv_token(spec["argv"], True))
        args = info.get("args") or {}
        if info.get("status") in (401, 403):
            ctx.warnings.append("verify: %s %s; the argv was verified from /proc" % (info.get("path"), info["error"]))
        elif info.get("error"):
            problems.append("server info: %s" % info["error"])
        else:
            expect = {"port": spec["port"]}
            model = engine.argv_model(spec["argv"])
            if model:
                expect["model_path"] = model
            expect.update(spec.get("expect_info") or {})
            for key, value in sorted(expect.items()):
                if key in args and args[key] != value:
                    problems.append("%s: the server reports %r, expected %r" % (key, args[key], value))
        capacity = dict((key, args[key]) for key in engine.CAPACITY_KEYS if key in args)
        ctx.event("verify", "end", target=target, port=spec["port"], ok=not problems, problems=problems,
                  workers=workers, capacity=capacity)
        if problems:
            raise state.Failure("verify: " + "; ".join(problems))
        return capacity


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the gated launch's control port)."""
    import socket

    bind = "" if server.connect_host(host) == "127.0.0.1" and host != "127.0.0.1" else server.connect_host(host)
    with socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((bind, 0))
        return sock.getsockname()[1]
