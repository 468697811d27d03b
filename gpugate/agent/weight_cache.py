"""A server's weight-cache daemons (docs/weight-cache.md): SGLang's standalone daemon, started by
the agent before the engine, one launcher per server and one child per GPU, recorded with the key
they hold in ``/run/gpugate/weight-cache-<port>.json``; what observe reports of them; and the
transition's steps around them (WeightCache, a step of gpugate.agent.transition.Transition over its
Context): keep them when
the key holds, stop them when it changes or no cache is wanted, start them and wait for every
GPU's ``.ready``.

Only the daemons of this server's record are ever signalled: a daemon gpugate did not start, or
of another server, is a GPU holder like any other.
"""

from __future__ import annotations

import json
import os
import time

from gpugate.agent.engine import engine
from gpugate.agent import logs, server, state, supervise
from gpugate.rules import procfs, redact
from gpugate.rules.procfs import read_file

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, BinaryIO, Callable, Dict, Iterable, List, Optional, Tuple, Union

    from gpugate.agent.context import Context, Doc, Table

READY_POLL_S = 0.05


def read_record(port: int) -> Doc | None:
    """The agent's record of the server's daemons, or None."""
    text = read_file(state.paths(port)["cache"])
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance((doc.get("launcher") or {}).get("pid"), int) else None


def tree(table: Table, record: Doc | None) -> Tuple[Dict[str, Any] | None, List[int]]:
    """(the launcher's proc or None, the pids of its live tree) of a record: a launcher whose pid
    is now another process (start time differs) is gone."""
    launcher: Doc = (record or {}).get("launcher") or {}
    proc = table.get(launcher.get("pid"))  # type: ignore[arg-type]  # None: no such pid
    if proc is None or proc["state"] in ("Z", "X") or launcher.get("start_ticks") not in (None, proc["start_ticks"]):
        return None, []
    return proc, [proc["pid"]] + [pid for pid in procfs.descendants(table, proc["pid"])
                                  if table.get(pid, {}).get("state") not in ("Z", "X")]


def daemon_ports(table: Table) -> Dict[int, int]:
    """pid -> the port whose recorded daemons it is, for every server of the container."""
    out: Dict[int, int] = {}
    for name in state.listdir(state.RUN_DIR):
        if name.startswith("weight-cache-") and name.endswith(".json") and name[13:-5].isdigit():
            port = int(name[13:-5])
            for pid in tree(table, read_record(port))[1]:
                out[pid] = port
    return out


def uuid_of(gpu_doc: Doc | None, index: int) -> str | None:
    for gpu in (gpu_doc or {}).get("gpus") or []:
        if gpu.get("index") == index:
            return gpu.get("uuid")
    return None


def used_by(gpu_doc: Doc | None, pids: Iterable[int]) -> Dict[int, int]:
    """GPU index -> MiB that ``pids`` hold there (the driver's per-process figures)."""
    out: Dict[int, int] = {}
    for holder in (gpu_doc or {}).get("holders") or []:
        if holder.get("pid") in pids and holder.get("used_mib"):
            for index in holder.get("gpus") or []:
                out[index] = out.get(index, 0) + (holder["used_mib"] if len(holder.get("gpus") or []) == 1 else 0)
    for gpu in (gpu_doc or {}).get("gpus") or []:  # the per-GPU process list is exact where it exists
        figures = [p.get("used_mib") or 0 for p in gpu.get("processes") or [] if p.get("pid") in pids]
        if figures:
            out[gpu.get("index")] = sum(figures)
    return out


def view(port: int, table: Table, gpu_doc: Doc | None, record: Doc | None = None, probe: bool = True) -> Doc | None:
    """What runs of the server's daemons: ``{"running", "launcher", "pids", "key", "gpus": [{index,
    uuid, pid, ready, used_mib, config}], "problems", "supervisor", "started"}``; None without a
    record. ``running``: the launcher lives and every GPU's daemon as the engine tells it
    (``read_ready``: SGLang's ``.ready`` file, vLLM's socket and its lock's holder) is a live daemon
    of its tree that is not stopped and (``probe``) answers on its socket (``daemon_answers``, the
    engine's own request): an engine may map them.
    The key's inputs are shown with the command's secrets masked."""
    record = record if record is not None else read_record(port)
    if record is None:
        return None
    launcher, pids = tree(table, record)
    live = set(pids)
    used = used_by(gpu_doc, live)
    gpus: List[Doc] = []
    problems: List[str] = []
    for index in record.get("gpus") or []:
        uuid = uuid_of(gpu_doc, index) or (record.get("uuids") or {}).get(str(index))
        ready: Any = None
        if uuid:
            ready = engine.read_ready(uuid, record.get("env") or {})
        pid: Any = (ready or {}).get("pid")
        entry = {"index": index, "uuid": uuid, "pid": pid, "ready": bool(ready and pid in live),
                 "used_mib": used.get(index), "config": engine.config_summary((ready or {}).get("config"))}
        why = None
        if launcher is not None and not entry["ready"]:
            why = engine.DAEMON_NOT_READY if ready is None else "its daemon is pid %s, not a daemon of this server" % pid
        elif entry["ready"] and table.get(pid, {}).get("state") in STOPPED_STATES:
            why = "daemon pid %d is stopped (state %s)" % (pid, table[pid]["state"])
        elif entry["ready"] and probe and not engine.daemon_answers(engine.file_paths(uuid, record.get("env") or {})[0],
                                                                    PING_TIMEOUT_S):
            why = "daemon pid %d does not answer on its socket within %gs" % (pid, PING_TIMEOUT_S)
        if why:
            entry["ready"] = False
            problems.append("GPU %d: %s" % (index, why))
        gpus.append(entry)
    if launcher is None:
        problems.insert(0, "the daemons are gone (launcher pid %s)" % (record.get("launcher") or {}).get("pid"))
    key = dict(record.get("key") or {})
    if key.get("inputs"):  # what may be shown: the command as recorded with its secrets masked
        key["inputs"] = dict(key["inputs"], argv=list(record.get("argv_shown") or []))
    return {"running": launcher is not None and not problems, "launcher": launcher["pid"] if launcher else None,
            "pids": sorted(live), "key": key, "gpus": gpus, "problems": problems,
            "supervisor": record.get("supervisor") or "process", "started": record.get("started"),
            "argv": record.get("argv_shown")}


STOPPED_STATES = ("T", "t")  # SIGSTOPped or traced: its socket never answers an engine
PING_TIMEOUT_S = 2.0


def desired_key(spec: Doc) -> Doc:
    """The key of the cache ``spec`` (a SpecDoc with ``weight_cache``) wants, from what the
    container has now: its config.json, its SGLang and torch."""
    wanted = (spec or {}).get("weight_cache") or {}
    return engine.cache_key(wanted.get("argv"), spec.get("env") or {},
                           engine.model_config_sha256(procs_model(spec)), engine.engine_version(),
                           engine.torch_version())


def procs_model(spec: Doc | None) -> str | None:
    return engine.argv_model((spec or {}).get("argv") or [])


def is_daemon(pid: int) -> bool:
    """A weight-cache daemon: a launcher, or a spawned child of one (SGLang's single-rank mode is
    the launcher's command itself)."""
    argv = procfs.read_argv(pid)
    if engine.is_daemon_argv(argv):
        return True
    stat = procfs.read_stat(pid)
    return stat is not None and "spawn_main" in " ".join(argv) and engine.is_daemon_argv(procfs.read_argv(stat[2]))


def stale_files(gpu_doc: Doc | None, gpus: Iterable[int] | None, env: Dict[str, str] | None = None,
                keep: Iterable[int] = ()) -> List[str]:
    """The socket and .ready files of these GPUs whose daemon is gone (SGLang's
    cleanup_stale_daemon_files: a client start against a socket nobody listens on is a hard
    error), or that name a live process that is no daemon (SGLang would refuse them as "already
    running"); those of a pid in ``keep`` or of a live daemon are left."""
    out: List[str] = []
    for index in gpus or []:
        uuid = uuid_of(gpu_doc, index)
        if not uuid:
            continue
        sock, ready_path = engine.file_paths(uuid, env)
        ready = engine.read_ready(uuid, env)
        if ready and (ready["pid"] in keep or (procfs.alive(ready["pid"]) and is_daemon(ready["pid"]))):
            continue  # a live daemon's files: its own (another's daemon is a holder the gate sees)
        out += [path for path in (sock, ready_path) if os.path.lexists(path)]
    return out


def key_record(spec: Doc) -> Dict[str, Any] | None:
    """The key the server's daemons hold, for its history record (None without a cache)."""
    if not spec.get("weight_cache"):
        return None
    key = (read_record(spec["port"]) or {}).get("key") or {}
    return {"weight_cache_key": key.get("id")} if key else None


class WeightCache(object):
    """The transition's steps for the daemons, over the run's Context; ``read_gpus`` gives a GPU
    reading (gpugate.agent.observe's, which reads this module's ``view``)."""

    def __init__(self, ctx: Context, read_gpus: Callable[[], Doc]) -> None:
        self.ctx = ctx
        self.read_gpus = read_gpus

    def state(self, spec: Doc) -> Tuple[str, str]:
        """``("none"|"keep"|"start", why)`` for starting ``spec``: none wanted (and the daemons
        of this port, if any, are stopped), the running daemons hold its key, or they must
        (re)start."""
        port = spec["port"]
        if not spec.get("weight_cache"):
            return "none", "no weight cache"
        record = read_record(port)
        table = procfs.table()
        want = desired_key(spec)
        if record is None:
            return "start", "no weight cache runs"
        info = view(port, table, self.read_gpus())
        if info is None:  # the record went in between (it was read a moment ago)
            return "start", "no weight cache runs"
        if not info["running"]:
            return "start", "; ".join(info["problems"])
        if (record.get("key") or {}).get("id") != want["id"]:
            flags = tuple(redact.ALWAYS_MASKED_OPTIONS) + tuple(spec.get("secret_flags") or ())
            changes = engine.key_changes(  # what the journal may say: the commands with their secrets masked
                dict((record.get("key") or {}).get("inputs") or {}, argv=record.get("argv_shown") or []),
                dict(want["inputs"], argv=redact.redact_argv(want["inputs"]["argv"], flags)))
            return "start", "the key changes (%s)" % (", ".join(changes) or "a secret value of the daemons' command")
        return "keep", "the key is unchanged"

    def stop(self, port: int, target: str, why: str) -> None:
        """End the daemons of this server's record (SIGTERM to each daemon and the launcher, the
        kill grace, SIGKILL), then their stale files. Nothing when no record."""
        ctx = self.ctx
        record = read_record(port)
        if record is None:
            return
        table = procfs.table()
        launcher, pids = tree(table, record)
        ctx.event("cache_stop", "begin", target=target, port=port, pids=pids, why=why)
        if pids:
            ctx.touched = True
        if record.get("supervisor") == "systemd" and server.pid1_comm() == "systemd":
            supervise.systemctl("stop", "--no-block", state.paths(port)["cache_unit_name"])
        targets = dict((pid, table[pid]["start_ticks"]) for pid in pids if pid in table)
        ended = procfs.end_processes(targets, float(ctx.budget("kill_grace_s")), 0.02,
                                     settle_s=float(ctx.budget("kill_grace_s")))
        ctx.reap()
        removed = []
        for path in stale_files(self.read_gpus(), record.get("gpus"), record.get("env") or {}):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
        try:
            os.unlink(state.paths(port)["cache"])
        except OSError:
            pass
        ctx.event("cache_stop", "end", target=target, port=port, terminated=ended["terminated"],
                   killed=ended["killed"], survivors=ended["survivors"], removed=removed)
        if ended["survivors"]:
            raise state.Failure("weight-cache daemons outlived SIGKILL on :%d: %s" % (
                port, ", ".join(str(pid) for pid in ended["survivors"])))

    def start(self, spec: Doc, target: str) -> Doc:
        """Start the daemons (the launcher under the server's supervisor), record them with the key
        they will hold, and wait until every GPU's ``.ready`` names a daemon of theirs."""
        ctx = self.ctx
        port = spec["port"]
        wanted = spec["weight_cache"]
        key = desired_key(spec)
        gpu_doc = self.read_gpus()
        gpus = spec.get("gpus") or []
        for path in stale_files(gpu_doc, gpus, spec.get("env") or {}):
            try:
                os.unlink(path)
            except OSError:
                pass
        ctx.touched = True
        argv = list(wanted["argv"])
        flags = tuple(redact.ALWAYS_MASKED_OPTIONS) + tuple(spec.get("secret_flags") or ())
        shown = redact.redact_argv(argv, flags)
        ctx.event("cache_start", "begin", target=target, port=port, argv=shown, key=key["id"])
        began = time.time()
        log_path: Optional[str]
        since: float
        if wanted.get("unit_text") and server.pid1_comm() == "systemd":
            launcher, since = self._start_unit(port, wanted["unit_text"])
            supervisor, log_path = "systemd", None
        else:
            launcher, log_path, since = self._start_process(spec, target, argv, shown)
            supervisor = "process"
        record = {"launcher": launcher, "port": port,
                  "gpus": gpus, "uuids": dict((str(i), uuid_of(gpu_doc, i)) for i in gpus),
                  "key": key, "argv_shown": shown, "supervisor": supervisor, "log": log_path, "run": ctx.run,
                  "started": state.now_iso(),
                  "env": dict((k, v) for k, v in (spec.get("env") or {}).items()
                              if k in (engine.SOCKET_TEMPLATE_ENV, engine.READY_TEMPLATE_ENV))}
        try:
            state.makedirs(state.RUN_DIR, 0o755)
            state.write_private(state.paths(port)["cache"], json.dumps(record), 0o600)  # the key's argv: secrets
        except OSError as error:
            raise state.Failure("cannot write the weight cache's record %s: %s" % (state.paths(port)["cache"], error))
        deadline = began + float(ctx.budget("start_timeout_s"))
        while True:
            ctx.reap()
            info = view(port, procfs.table(), self.read_gpus(), record)
            assert info is not None  # a record is given
            if info["running"]:
                ctx.event("cache_start", "end", target=target, port=port, ok=True, launcher=launcher["pid"],
                           daemons=[g["pid"] for g in info["gpus"]], elapsed_s=round(time.time() - began, 2))
                return info
            if info["launcher"] is None:
                code = ctx.exit_codes.get(launcher["pid"])
                tail = self._tail(port, log_path, since)
                ctx.event("cache_start", "end", target=target, port=port, ok=False, exit_code=code, log_tail=tail)
                raise state.Failure("the weight cache exited during its load%s%s" % (
                    " with code %s" % code if code is not None else "",
                    ": " + logs.crash_line(tail, port) if tail else ""))
            if time.time() >= deadline:
                ctx.event("cache_start", "end", target=target, port=port, ok=False, problems=info["problems"])
                raise state.Failure("the weight cache was not ready within %gs: %s" % (
                    ctx.budget("start_timeout_s"), "; ".join(info["problems"])))
            ctx.progress("cache_start", target=target, port=port, elapsed_s=round(time.time() - began, 1),
                          ready=sum(1 for g in info["gpus"] if g["ready"]), of=len(info["gpus"]))
            time.sleep(READY_POLL_S)

    def _start_unit(self, port: int, unit_text: str) -> Tuple[Doc, float]:
        """The daemons as the unit sglang-weight-cache-<port>.service: -> (the launcher's {pid,
        start_ticks}, when the unit was started: its journal's tail is read from then)."""
        path, unit = state.paths(port)["cache_unit"], state.paths(port)["cache_unit_name"]
        try:
            state.write_private(path, unit_text, 0o600)
        except OSError as error:
            raise state.Failure("cannot write the unit %s: %s" % (path, error.strerror or error))
        started = time.time()
        pid = supervise.start_unit(unit, self.ctx.redactor)
        if pid <= 0:
            raise state.Failure("%s has no main process after systemctl start" % unit)
        stat = procfs.read_stat(pid)
        return {"pid": pid, "start_ticks": stat[4] if stat else None}, started

    def _tail(self, port: int, log_path: str | None, since: float) -> List[str]:
        """The last lines the daemons printed: their log file from byte ``since``, or (``log_path``
        None) the unit's journal from the time ``since``."""
        if log_path is None:
            logs.journal_sync()
            unit = state.paths(port)["cache_unit_name"]
            return [self.ctx.redactor.text(line) for line in logs.journal_tail(unit, 20, since)]
        pump = self.ctx.pumps.get("cache-%d" % port)
        settle = time.time() + 1.0  # the pump writes what the launcher printed last
        while pump is not None and pump.poll() is None and time.time() < settle:
            time.sleep(0.02)
        return [self.ctx.redactor.text(line) for line in logs.log_tail(log_path, 20, int(since))]

    def _start_process(self, spec: Doc, target: str, argv: List[str], shown: List[str]) -> Tuple[Doc, str, int]:
        """The launcher as a detached process with its log pump: -> ({pid, start_ticks}, its log, the
        log's offset where its output begins)."""
        ctx = self.ctx
        port = spec["port"]
        log_path = state.paths(port)["cache_log"]
        try:
            state.makedirs(state.LOG_DIR, 0o750)
            logs.rotate_log(log_path)
            handle = state.open_private_append(log_path)
        except OSError as error:
            raise state.Failure("cannot write the weight cache's log %s: %s" % (log_path, error.strerror or error))
        import subprocess

        env = dict(state.BASE_ENV)
        env.update(spec.get("env") or {})
        output: Optional[Union[int, BinaryIO]] = None
        try:
            handle.write(("\n=== gpugate start %s run %s (%s): %s\n" % (
                state.now_iso(), ctx.run, target, ctx.redactor.text(" ".join(shown)))).encode("utf-8"))
            handle.flush()
            offset = handle.tell()
            output = ctx.log_pump(log_path, dict(spec, port="cache-%d" % port)) or handle
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                     env=env, cwd="/", start_new_session=True, close_fds=True)
        except OSError as error:
            raise state.Failure("cannot start the weight cache %s: %s" % (argv[0], error))
        finally:
            handle.close()
            if isinstance(output, int):  # the pump's pipe (else None, or the log file itself)
                os.close(output)
        ctx.children[child.pid] = child
        stat = procfs.read_stat(child.pid)
        return {"pid": child.pid, "start_ticks": stat[4] if stat else None}, log_path, offset

