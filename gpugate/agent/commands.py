"""``start`` and ``install``: the start document checked, the transition lock taken by a detached
agent (own session, stdio on /dev/null) that answers once it holds it and then runs the transition;
old agents and journals pruned.
"""

from __future__ import annotations

import json
import os
import signal
import time

from gpugate.agent.engine import engine
from gpugate.agent import history, journal, state
from gpugate.agent.transition import Transition
from gpugate.rules import procfs

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Dict, Iterable, List, Tuple

    Doc = Dict[str, Any]  # a start document, a SpecDoc, an answer


def validate_spec(spec: Any, what: str) -> str | None:
    """None or why a SpecDoc cannot be run."""
    if not isinstance(spec, dict):
        return "%s: not an object" % what
    argv = spec.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        return "%s: argv must be a non-empty list of strings" % what
    if not engine.is_main_argv(argv):
        return "%s: argv is not %s" % (what, engine.MAIN_TEXT)
    port = spec.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        return "%s: port must be an integer 1..65535" % what
    if engine.argv_port(argv) != port:
        return "%s: the argv's --port %s differs from port %d" % (what, engine.argv_port(argv), port)
    env = spec.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return "%s: env must map names to strings" % what
    if spec.get("supervisor", "process") not in ("process", "systemd"):
        return "%s: supervisor must be process or systemd" % what
    if spec.get("supervisor") == "systemd" and not spec.get("unit_text"):
        return "%s: supervisor systemd needs unit_text" % what
    gpus = spec.get("gpus")
    if gpus is not None and (not isinstance(gpus, list) or not all(isinstance(g, int) for g in gpus)):
        return "%s: gpus must be a list of GPU indices or null" % what
    return None


def validate_start(doc: Any) -> str | None:
    if not isinstance(doc, dict):
        return "the start document is not a JSON object"
    if not journal.RUN_ID.match(str(doc.get("run") or "")):
        return "run must match %s" % journal.RUN_ID.pattern
    for key in ("desired", "replaces"):
        if doc.get(key) is not None:
            problem = validate_spec(doc[key], key)
            if problem:
                return problem
    rollback = doc.get("rollback_to")
    if isinstance(rollback, dict) and "argv" in rollback:
        problem = validate_spec(rollback, "rollback_to")
        if problem:
            return problem
    elif rollback not in (None, "auto") and not (isinstance(rollback, dict) and
                                                 ("history" in rollback or rollback.get("running"))):
        return "rollback_to must be a SpecDoc, {\"history\": key|index}, {\"running\": true}, \"auto\" or null"
    if doc.get("desired") is None and doc.get("replaces") is not None:
        return "replaces needs a desired server"
    holders = doc.get("end_gpu_holders") or []
    if not isinstance(holders, list) or not all(
            isinstance(h.get("pid") if isinstance(h, dict) else h, int)
            and not isinstance(h.get("pid") if isinstance(h, dict) else h, bool) for h in holders):
        return "end_gpu_holders must be a list of pids or {\"pid\": n, \"start_ticks\": n}"
    return None


def take_lock() -> int | None:
    """The transition lock as an open file holding a kernel flock (None when another holds it)."""
    import fcntl

    state.makedirs(state.RUN_DIR, 0o755)
    fd = os.open(state.LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def write_lock_info(fd: int, run: str) -> None:
    stat = procfs.read_stat(os.getpid())
    info = json.dumps({"run": run, "pid": os.getpid(), "start_ticks": stat[4] if stat else None, "since": time.time()})
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, 0)
    os.write(fd, info.encode())


def recover_previous(run: str) -> Doc | None:
    """The latest run, if it has no outcome (its agent died: we now hold the lock): mark it
    interrupted, recovered by ``run``; -> what we know of it."""
    previous = journal.latest_run()
    if not previous or previous == run:
        return None
    first, last, outcome = journal.journal_ends(previous)
    if outcome is not None or first is None:
        return None
    info: Doc = {"run": previous, "last_step": (last or {}).get("step"), "last_phase": (last or {}).get("phase"),
            "target": (last or {}).get("target")}
    sidecar = state.json_file("%s/%s.rollback.json" % (state.RUNS_DIR, previous))
    if isinstance(sidecar, dict) and sidecar.get("argv"):
        info["rollback"] = sidecar
    journal.Journal(previous).write({"step": "outcome", "phase": "end", "outcome": "interrupted", "recovered_by": run,
                             "reasons": None, "message": "the agent ended during %s; recovered by run %s"
                             % (info["last_step"], run)})
    return info


def prune_agents(keep: int = 3) -> None:
    """Installed agents beyond the ``keep`` newest (this one always kept), with their bytecode (the
    bootstrap's ``agent-<sha>.*.code`` and the loader's ``bundle-<sha16>-*.marshal``): each
    controller version installs its own, content-addressed."""
    mine = state.RUNTIME["sha256"]
    found: List[Tuple[float, str]] = []
    for name in state.listdir(state.STATE_DIR):
        if name.startswith("agent-") and name.endswith(".py"):
            try:
                found.append((os.stat(os.path.join(state.STATE_DIR, name)).st_mtime, name))
            except OSError:
                continue
    for _, name in sorted(found, reverse=True)[keep:]:
        if mine and name == "agent-%s.py" % mine:
            continue
        for path in [os.path.join(state.STATE_DIR, name)] + [os.path.join(state.STATE_DIR, "__pycache__", cached) for cached in
                                                        state.listdir(state.STATE_DIR + "/__pycache__")
                                                        if cached.startswith((name[:-3] + ".", "bundle-%s-" % name[6:22]))]:
            try:
                os.unlink(path)
            except OSError:
                pass


def resolve_history_desired(doc: Any) -> Tuple[Any, str | None]:
    """``desired: {"history": key | index, "port": n}`` (the rollback runbook): the exact spec of
    that good entry of the port's history, which never left the container -> (doc, problem)."""
    desired = doc.get("desired") if isinstance(doc, dict) else None
    if not (isinstance(desired, dict) and "history" in desired and "argv" not in desired):
        return doc, None
    port = int(desired.get("port") or doc.get("port") or engine.DEFAULT_PORT)
    want = desired["history"]
    for index, entry in enumerate(history.load_history(port).get("good") or []):
        if want == index or (want and want in (entry.get("key"), (entry.get("record") or {}).get("key"))):
            return dict(doc, desired=history.clean_spec(entry.get("spec"))), None
    return doc, "desired: no good spec %r in the history of :%d" % (want, port)


def prune_journals(keep: int = 50, protect: Iterable[str | None] = ()) -> None:
    """The oldest journals beyond ``keep`` (by mtime), never one named in ``protect``."""
    found: List[Tuple[float, str]] = []
    for name in state.listdir(state.RUNS_DIR):
        if name.endswith(".jsonl") and name[:-6] not in protect:
            try:
                found.append((os.stat(os.path.join(state.RUNS_DIR, name)).st_mtime, name))
            except OSError:
                continue
    for _, name in sorted(found, reverse=True)[keep:]:
        try:
            os.unlink(os.path.join(state.RUNS_DIR, name))
        except OSError:
            pass


def claim_lapsed(doc: Doc, now: float | None = None) -> str | None:
    """A hand-off that came after its GPU claim's window (``claim_until``, the Proxmox host's clock,
    which an LXC container shares) is refused: the claim's holder lets go then, so the run would
    run unclaimed. 2 s of margin: the holder looks 1 s after the window.

    >>> claim_lapsed({"run": "r1", "claim_until": 100.0}, now=99.0)[:40], claim_lapsed({"claim_until": 100.0}, now=97.0)
    ('the hand-off of run r1 came after its GP', None)
    """
    until = doc.get("claim_until")
    now = time.time() if now is None else now
    if isinstance(until, (int, float)) and now > until - 2.0:
        return ("the hand-off of run %s came after its GPU claim on the Proxmox host lapsed (%.0f s late): "
                "nothing was touched; re-run" % (doc.get("run"), now - until + 2.0))
    return None


def command_start(doc: Any) -> Doc:
    """Validate, take the lock in a detached child, answer once it holds it."""
    doc, problem = resolve_history_desired(doc)
    problem = problem or validate_start(doc) or claim_lapsed(doc)
    if problem:
        return {"ok": False, "error": problem}
    read_fd, write_fd = os.pipe()
    first = os.fork()
    if first == 0:  # the middle child: a new session, then the agent itself, then gone
        try:
            os.close(read_fd)
            os.setsid()
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            if os.fork() != 0:
                os._exit(0)
            agent_main(doc, write_fd)
        except BaseException:  # noqa: BLE001
            pass
        os._exit(0)
    os.close(write_fd)
    os.waitpid(first, 0)
    data = b""
    deadline = time.time() + 30
    while time.time() < deadline:
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        data += chunk
        if data.endswith(b"\n"):
            break
    os.close(read_fd)
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError:
        return {"ok": False, "error": "the agent did not start (no answer from the detached child)"}


def command_install(doc: Any) -> Doc:
    """The agent is installed (the bootstrap did it from the document's ``agent_source``, checked by
    hash, and wrote its code caches): say so and touch nothing else. No lock, no journal, and no
    pruning of other agents: the controller installs before following a transition that another
    controller version's agent runs, whose file must stay.

    -> ``{"ok": true, "sha256", "path", "installed": true when this command wrote the file}``"""
    del doc  # its only content, the source, was the bootstrap's
    return {"ok": True, "sha256": state.RUNTIME["sha256"], "path": state.RUNTIME["file"],
            "installed": bool(state.RUNTIME["installed_now"])}


def agent_main(doc: Doc, answer_fd: int) -> None:
    """The detached agent: stdio on /dev/null, lock, journal, answer, run, exit."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if null > 2:
        os.close(null)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    procfs.set_comm("gpugate-agent")
    run = doc["run"]

    def answer(document: Doc) -> None:
        try:
            os.write(answer_fd, (json.dumps(document) + "\n").encode())
            os.close(answer_fd)
        except OSError:
            pass

    lock_fd = take_lock()
    if lock_fd is None:
        answer({"ok": False, "busy": journal.transition_summary(lock=journal.lock_status()) or journal.lock_status()})
        return
    write_lock_info(lock_fd, run)
    run_journal = journal.Journal(run)
    recovered = recover_previous(run)
    try:
        state.write_private(state.RUNS_DIR + "/latest", run + "\n", 0o600)
    except OSError:
        pass
    desired = doc.get("desired")
    ports = sorted(set(s["port"] for s in (desired, doc.get("replaces")) if s) or [int(doc.get("port") or engine.DEFAULT_PORT)])
    transition = Transition(doc, run_journal, recovered)
    rollback = doc.get("rollback_to")
    if isinstance(rollback, dict) and rollback.get("argv"):
        try:
            state.write_private("%s/%s.rollback.json" % (state.RUNS_DIR, run), json.dumps(rollback))
        except OSError:
            pass
    transition.ctx.event("run", "begin", run=run, ports=ports, by=doc.get("operator"), pid=os.getpid(),
                         desired=history.make_record(desired) if desired else None,
                         replaces=history.make_record(doc["replaces"]) if doc.get("replaces") else None,
                         restart=bool(doc.get("restart")), budgets=transition.ctx.budgets, recovered=recovered and dict(
                             (k, v) for k, v in recovered.items() if k != "rollback"))
    answer({"ok": True, "run": run, "pid": os.getpid(), "journal": run_journal.path,
            "recovered": recovered and recovered.get("run")})
    prune_agents()
    prune_journals(keep=50, protect=(run, (recovered or {}).get("run")))
    try:
        transition.execute()
    finally:
        try:
            os.unlink("%s/%s.rollback.json" % (state.RUNS_DIR, run))
        except OSError:
            pass
    os._exit(0)
