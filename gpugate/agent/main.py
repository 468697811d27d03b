"""The agent's commands and their dispatch: ``main(argv, stdin_doc)`` runs one command and prints
ONE JSON document (errors are fields, never a traceback). Commands: observe, start, install,
follow, wait (docs/agent-protocol.md), and logpump (started by a start, never by the controller).
"""

from __future__ import annotations

import json
import os
import sys
import time

from gpugate.agent import journal, state
from gpugate.rules import procfs

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Dict, List, Optional

    Doc = Dict[str, Any]  # a command's arguments and answer


def command_follow(args: Doc) -> Doc:
    """New journal events of a run from ``offset``, waiting up to ``wait_s`` for some or the end."""
    run = str(args.get("run") or "")
    if not journal.RUN_ID.match(run):
        return {"error": "bad run id", "events": [], "offset": 0, "active": False, "ended": False, "outcome": None}
    offset = int(args.get("offset") or 0)
    wait_s = min(float(args.get("wait_s") or 0), 600.0)
    deadline = time.time() + wait_s
    while True:
        # The lock first: an agent that ends after this look wrote its outcome before it let go.
        lock = journal.lock_status()
        active = bool(lock.get("held") and lock.get("run") == run)
        events, new_offset = journal.read_journal(run, offset, limit=int(args.get("limit") or 2000))
        outcome: Optional[Doc] = None
        for event in events or []:
            if event.get("step") == "outcome":
                outcome = event
        if outcome is None and not active:
            _, _, outcome = journal.journal_ends(run)
            outcome = outcome or journal.outcome_from_history(run)
        if events is None and not active and outcome is None:
            return {"events": [], "offset": offset, "active": False, "ended": False, "outcome": None,
                    "error": "no journal for run %s" % run}
        if outcome is None and not active:
            # no outcome and no agent: it died (the next start recovers it)
            return {"events": events or [], "offset": new_offset, "active": False, "ended": True,
                    "outcome": "interrupted", "reasons": None,
                    "message": "the agent of run %s ended without an outcome" % run}
        ended = outcome is not None
        # batch: gather the events of up to wait_s in one answer (one command per wait, not per event)
        if (events and not args.get("batch")) or ended or time.time() >= deadline:
            return {"events": events or [], "offset": new_offset, "active": active, "ended": ended,
                    "agent": journal.agent_view(run, lock) if active and not ended else None,
                    "outcome": outcome.get("outcome") if outcome else None,
                    "reasons": outcome.get("reasons") if outcome else None,
                    "message": outcome.get("message") if outcome else None}
        time.sleep(0.05)


def command_wait(args: Doc) -> Doc:
    """Block until run ``run`` has ended (an outcome, or its agent gone), or it did not appear
    within ``grace_s``. -> {run, appeared, ended, outcome}."""
    run = str(args.get("run") or "")
    if not journal.RUN_ID.match(run):
        return {"error": "bad run id", "run": run, "appeared": False, "ended": False, "outcome": None}
    grace = float(args.get("grace_s", 30))
    limit = args.get("timeout_s")
    began = time.time()
    appeared = False
    while True:
        lock = journal.lock_status()
        active = bool(lock.get("held") and lock.get("run") == run)
        exists = os.path.exists(journal.journal_path(run))
        appeared = appeared or active or exists
        if appeared:
            _, _, outcome = journal.journal_ends(run)
            if outcome is not None:
                return {"run": run, "appeared": True, "ended": True, "outcome": outcome.get("outcome")}
            if not active and not journal.lock_status().get("held"):
                _, _, outcome = journal.journal_ends(run)
                outcome = outcome or journal.outcome_from_history(run)
                return {"run": run, "appeared": True, "ended": True,
                        "outcome": outcome.get("outcome") if outcome else "interrupted"}
        elif time.time() - began >= grace:
            return {"run": run, "appeared": False, "ended": False, "outcome": None}
        if limit is not None and time.time() - began >= float(limit):
            return {"run": run, "appeared": appeared, "ended": False, "outcome": None, "timed_out": True}
        time.sleep(0.1)


def decode_args(word: str) -> str:
    """A command's JSON argument as agentcmd wrote it: plain, or ``b64:<base64>`` when the text names
    sglang (a model path, an env name), so that no gpugate command line matches ``pkill -f sglang``.

    >>> decode_args('{"port": 1}'), decode_args("b64:eyJwb3J0IjogMX0=")
    ('{"port": 1}', '{"port": 1}')
    """
    if word.startswith("b64:"):
        import binascii

        return binascii.a2b_base64(word[4:]).decode("utf-8")
    return word


def main(argv: List[str], stdin_doc: Any = None) -> int:
    """``argv``: [command, json args?, ...]; ``stdin_doc``: the start document (already read)."""
    command = argv[0] if argv else ""
    state.add_site_dirs()
    try:
        args: Doc = {}
        if len(argv) > 1 and argv[1] != procfs.PROBE_MARKER:
            args = json.loads(decode_args(argv[1]))
        # the engine the document names (none: the default), for every command's recognition of
        # its processes and endpoints
        from gpugate.agent import engine

        if command in ("start", "live") and stdin_doc is None:
            stdin_doc = json.loads(sys.stdin.read() or "null")
        engine.use(((stdin_doc if command in ("start", "live") else args) or {}).get("engine"))
        # each command imports only what it runs: observe, the converged re-run's only command,
        # never loads the transition's modules
        if command == "observe":
            from gpugate.agent.observe import observe

            result = observe(args)
        elif command == "start":
            from gpugate.agent.commands import command_start

            result = command_start(stdin_doc)
        elif command == "live":  # a change the engine applies while it serves (docs/live-changes.md)
            from gpugate.agent.live import command_live

            result = command_live(stdin_doc)
        elif command == "install":
            from gpugate.agent.commands import command_install

            result = command_install(stdin_doc)
        elif command == "follow":
            result = command_follow(args)
        elif command == "wait":
            result = command_wait(args)
        elif command == "logpump":
            from gpugate.agent.logs import command_logpump

            result = command_logpump(args)
        else:
            result = {"error": "unknown command %r (observe, start, live, install, follow, wait)" % command}
    except Exception as error:  # noqa: BLE001 - a field, never a traceback
        result = {"error": "%s: %s" % (type(error).__name__, error)}
    sys.stdout.write(json.dumps(result, separators=(",", ":"), default=str) + "\n")
    sys.stdout.flush()
    return 0
