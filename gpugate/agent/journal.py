"""The transition's journal (one JSON-lines file per run under /var/lib/gpugate/runs), the
transition lock's state as observe reports it, and a run's summary and outcome.
"""

from __future__ import annotations

import errno
import json
import os
import re
import time

from gpugate.agent import state
from gpugate.rules import procfs
from gpugate.rules.procfs import read_file

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Dict, List, Optional, Tuple

    Doc = Dict[str, Any]  # a journal event, the lock's and the run's documents


PROGRESS_S = 1.5
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,95}$")


def lock_status() -> Doc:
    """{held, run, pid, since} of the container's transition lock, without touching it: /proc/locks
    says whether a flock is on the file, the file says whose (the holder writes it)."""
    info = state.json_file(state.LOCK_PATH) or {}
    try:
        st = os.stat(state.LOCK_PATH)
    except OSError:
        return {"held": False, "run": None, "pid": None}
    held: Optional[bool] = None
    text = read_file("/proc/locks")
    if text is not None:
        held = False
        for line in text.splitlines():
            cols = line.split()
            if "FLOCK" not in cols:
                continue
            for col in cols:
                parts = col.split(":")
                if len(parts) == 3 and parts[2].isdigit() and int(parts[2]) == st.st_ino:
                    try:
                        major, minor = int(parts[0], 16), int(parts[1], 16)
                    except ValueError:
                        continue
                    if (major, minor) == (os.major(st.st_dev), os.minor(st.st_dev)):
                        held = True
    if held is None:  # no /proc/locks: the recorded holder alive is the next best thing
        held = bool(info.get("pid")) and procfs.alive(info["pid"], info.get("start_ticks"))
    if held and info.get("pid") and not procfs.alive(info["pid"], info.get("start_ticks")):
        info = dict(info, run=None)  # held by someone who has not written the file yet
    return {"held": held, "run": info.get("run") if held else None, "pid": info.get("pid") if held else None,
            "since": info.get("since") if held else None}


# /proc/PID/stat's state letters, in the words the operator reads (proc(5))
STATE_NAMES = {"R": "running", "S": "sleeping", "D": "uninterruptible sleep (I/O)", "T": "stopped",
               "t": "stopped by a tracer", "Z": "zombie", "X": "dead", "I": "idle"}


def agent_view(run: str, lock: Doc) -> Doc | None:
    """The agent that holds the lock for ``run``: {pid, state, state_name, silent_s}, where
    ``silent_s`` is how long its journal has not been written. The agent writes it at least every
    PROGRESS_S in every long phase (drain, gate, load: the heartbeat), so a long silence means it
    is stuck (SIGSTOP, I/O on a dead mount), whatever it was doing. None when no agent holds it."""
    if not (lock.get("held") and lock.get("run") == run and lock.get("pid")):
        return None
    stat = procfs.read_stat(lock["pid"])
    letter = stat[1] if stat else None
    try:
        silent = round(max(0.0, time.time() - os.stat(journal_path(run)).st_mtime), 1)
    except OSError:
        silent = None
    _first, last, _outcome = journal_ends(run)
    quiet = (last or {}).get("quiet_s")  # a call that may block this long was announced (a generation)
    return {"pid": lock["pid"], "state": letter, "state_name": STATE_NAMES.get(letter or "", letter),
            "silent_s": silent, "quiet_s": quiet if isinstance(quiet, (int, float)) else 0}


def journal_path(run: str) -> str:
    return "%s/%s.jsonl" % (state.RUNS_DIR, run)


class Journal:
    """Append-only JSON lines, fsync'd. Writing is best-effort: ENOSPC (or any OSError) keeps the
    line in memory and retries with the next event; the state machine never stops for it."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.path = journal_path(run)
        self.pending: List[str] = []
        self.failed: Optional[str] = None
        self.events: List[Doc] = []
        self.last_progress: Dict[str, float] = {}

    def write(self, event: Doc) -> None:
        event = dict(event)
        event.setdefault("t", round(time.time(), 3))
        self.events.append(event)
        self.pending.append(json.dumps(event, separators=(",", ":"), default=str) + "\n")
        try:
            state.makedirs(state.RUNS_DIR, 0o700)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    os.write(fd, b"\n")  # a line torn by a killed writer: ours start on a line of their own
                while self.pending:
                    data = self.pending[0].encode("utf-8")
                    written = os.write(fd, data)
                    if written != len(data):  # a torn line: end it, so the reader skips it
                        os.write(fd, b"\n")
                        raise OSError(errno.ENOSPC, "short write")
                    self.pending.pop(0)
                os.fsync(fd)
            finally:
                os.close(fd)
            self.failed = None
        except OSError as error:
            self.failed = "%s" % error

    def progress(self, step: str, every: float = PROGRESS_S, **fields: Any) -> None:
        now = time.time()
        if now - self.last_progress.get(step, 0.0) >= every:
            self.last_progress[step] = now
            self.write(dict(step=step, phase="progress", **fields))


def read_journal(run: str, offset: int = 0, limit: int | None = None) -> Tuple[List[Doc] | None, int]:
    """(events, new offset): whole lines from byte ``offset``; a torn line is skipped."""
    try:
        with open(journal_path(run), "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except OSError:
        return None, offset
    end = data.rfind(b"\n") + 1
    events: List[Doc] = []
    consumed = 0
    for line in data[:end].split(b"\n")[:-1]:
        if limit is not None and len(events) >= limit:
            break
        consumed += len(line) + 1
        try:
            event = json.loads(line.decode("utf-8"))
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events, offset + consumed


def journal_ends(run: str) -> Tuple[Doc | None, Doc | None, Doc | None]:
    """(first event, last step event, outcome event) from the head and tail of a journal."""
    try:
        with open(journal_path(run), "rb") as handle:
            head = handle.readline()
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - 65536))
            tail = handle.read()
    except OSError:
        return None, None, None
    first: Any = None
    try:
        first = json.loads(head.decode("utf-8"))
    except ValueError:
        pass
    if not isinstance(first, dict):  # a journal whose first line is not an event: as if unreadable
        first = None
    last: Optional[Doc] = None
    outcome: Optional[Doc] = None
    for line in reversed(tail.split(b"\n")):
        try:
            event = json.loads(line.decode("utf-8"))
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if event.get("step") == "outcome" and outcome is None:
            outcome = event
        elif last is None and event.get("step") not in ("outcome", None):
            last = event
        if last is not None and outcome is not None:
            break
    return first, last, outcome


def latest_run() -> str | None:
    text = (read_file(state.RUNS_DIR + "/latest") or "").strip()
    return text if RUN_ID.match(text or "") else None


def outcome_from_history(run: str) -> Doc | None:
    """The outcome of ``run`` as the history files record it (``last``): the journal may have lost
    it (ENOSPC in runs/), the history is written separately. None when no history names it."""
    for name in state.listdir(state.STATE_DIR):
        if name.startswith("sglang-") and name.endswith(".json"):
            doc = state.json_file(os.path.join(state.STATE_DIR, name))
            last = doc.get("last") if isinstance(doc, dict) else None
            if isinstance(last, dict) and last.get("run") == run and last.get("outcome"):
                return {"step": "outcome", "phase": "end", "outcome": last["outcome"], "reasons": last.get("reasons"),
                        "message": last.get("message"), "from_history": True}
    return None


def transition_summary(run: str | None = None, lock: Doc | None = None) -> Doc | None:
    """The run's state for observe: active (a live agent holds the lock for it), step, outcome
    (``interrupted`` when it has none and no agent holds it)."""
    run = run or latest_run()
    if not run:
        return None
    first, last, outcome = journal_ends(run)
    lock = lock if lock is not None else lock_status()
    active = bool(lock.get("held") and lock.get("run") == run)
    if first is None and not active:
        recorded = outcome_from_history(run)
        if recorded:
            return {"run": run, "active": False, "step": None, "outcome": recorded["outcome"],
                    "reasons": recorded["reasons"], "message": recorded["message"], "journal_incomplete": True}
        return {"run": run, "active": False, "step": None, "outcome": "interrupted" if os.path.exists(journal_path(run)) else None,
                "reasons": None, "message": "no journal" if not os.path.exists(journal_path(run)) else "journal unreadable"}
    first = first or {}
    doc: Doc = {"run": run, "active": active, "step": (last or {}).get("step"), "phase": (last or {}).get("phase"),
           "target": (last or {}).get("target"), "began": first.get("t"), "updated": (last or first).get("t"),
           "ports": first.get("ports"), "by": first.get("by"),
           "desired": first.get("desired"), "from": first.get("from"), "outcome": None, "reasons": None,
           "message": None}
    if active:
        doc["agent"] = agent_view(run, lock)
    if outcome is not None:
        doc.update(outcome=outcome.get("outcome"), reasons=outcome.get("reasons"), message=outcome.get("message"),
                   updated=outcome.get("t"), recovered_by=outcome.get("recovered_by"))
    elif not active:
        recorded = outcome_from_history(run)
        if recorded:
            doc.update(outcome=recorded["outcome"], reasons=recorded["reasons"], message=recorded["message"],
                       journal_incomplete=True)
        else:
            doc.update(outcome="interrupted", message="the agent ended during %s without an outcome"
                       % (doc["step"] or "its start"))
    return doc
