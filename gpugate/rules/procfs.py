"""/proc readers and ending processes: what the agent and the GPU probe know of processes.

Every reader takes the pid first and ``root`` (the /proc to read, a fake one in tests) last, and
answers None / [] / {} for a process that is gone or not ours to read: processes come and go
between two reads, so a missing file is an answer, never an error.
"""

from __future__ import annotations

import os
import signal
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Callable, Dict, Iterable, Optional, Set, Tuple

# argv[-1] of every gpugate process in a container (agent commands, inline probes): GPU scans never
# count it as a holder, and probes tell each other apart from real GPU users by it.
PROBE_MARKER = "gpugate-probe"
PROC = "/proc"
GONE_STATES = ("Z", "X")  # a zombie or a dead task: exited, holds nothing new

# The PATH every server and command gpugate starts gets: never the login session's or the host's.
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def read_file(path: str, mode: str = "r", limit: int | None = None) -> Any:
    """The file's content, or None when it cannot be read (gone, not ours, not text)."""
    try:
        with open(path, mode) as handle:
            return handle.read() if limit is None else handle.read(limit)
    except (OSError, UnicodeDecodeError):
        return None


def read_stat(pid: int, root: str = PROC) -> Tuple[str, str, int, int, Optional[int]] | None:
    """-> (comm, state, ppid, pgid, start_ticks) or None when gone (start_ticks None when the
    stat line is short, as a test's fake /proc may write it).

    >>> read_stat(os.getpid())[1] in ("R", "S")
    True
    """
    text = read_file("%s/%d/stat" % (root, pid), "rb")
    if text is None:
        return None
    text = text.decode("utf-8", "replace")
    close = text.rfind(")")
    fields = text[close + 2:].split()
    try:
        ticks = int(fields[19]) if len(fields) > 19 else None
        return text[text.find("(") + 1:close], fields[0], int(fields[1]), int(fields[2]), ticks
    except (IndexError, ValueError):
        return None


def read_argv(pid: int, root: str = PROC) -> list[str]:
    """The process's argv ([] when gone or a kernel thread)."""
    raw = read_file("%s/%d/cmdline" % (root, pid), "rb")
    if not raw:
        return []
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


def read_cmdline(pid: int, root: str = PROC) -> str:
    """The argv as one line, as ps shows it ("" when gone)."""
    raw = read_file("%s/%d/cmdline" % (root, pid), "rb")
    if not raw:
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()


def read_environ(pid: int, root: str = PROC) -> Dict[str, str] | None:
    """The process's environment (None when it cannot be read)."""
    raw = read_file("%s/%d/environ" % (root, pid), "rb")
    if raw is None:
        return None
    env = {}
    for part in raw.split(b"\0"):
        if b"=" in part:
            key, _, value = part.partition(b"=")
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def pids(root: str = PROC) -> list[int]:
    """Every pid of this PID namespace's /proc."""
    try:
        return [int(name) for name in os.listdir(root) if name.isdigit()]
    except OSError:
        return []


def table(root: str = PROC) -> Dict[int, Dict[str, Any]]:
    """Every process: pid -> {pid, ppid, pgid, state, start_ticks, comm, argv}."""
    out = {}
    for pid in pids(root):
        stat = read_stat(pid, root)
        if stat is None:
            continue
        out[pid] = {"pid": pid, "comm": stat[0], "state": stat[1], "ppid": stat[2], "pgid": stat[3],
                    "start_ticks": stat[4], "argv": read_argv(pid, root)}
    return out


def alive(pid: int | None, start_ticks: int | None = None, root: str = PROC) -> bool:
    """Running (not a zombie) and, when given, the same process (not a reused pid).

    >>> alive(os.getpid()), alive(os.getpid(), -1)
    (True, False)
    """
    stat = read_stat(int(pid), root) if pid else None
    if stat is None or stat[1] in GONE_STATES:
        return False
    return start_ticks is None or stat[4] == int(start_ticks)


def ancestors(procs: Dict[int, Dict[str, Any]], pid: int) -> Set[int]:
    """``pid`` and its ancestors in a :func:`table`."""
    seen = set()
    while pid in procs and pid not in seen:
        seen.add(pid)
        pid = procs[pid]["ppid"]
    seen.add(pid)
    return seen


def lineage(pid: int, root: str = PROC) -> Set[int]:
    """``pid`` and its ancestors, read from /proc one stat at a time (no table needed: the probe
    leaves out itself and the shells and pct/ssh session that run it)."""
    seen = set()
    while pid > 0 and pid not in seen:
        seen.add(pid)
        stat = read_stat(pid, root)
        if stat is None:
            break
        pid = stat[2]
    return seen


def descendants(procs: Dict[int, Dict[str, Any]], root_pid: int) -> list[int]:
    """Every descendant of ``root_pid`` in a :func:`table`, parents before children."""
    children: dict[int, list[int]] = {}
    for proc in procs.values():
        children.setdefault(proc["ppid"], []).append(proc["pid"])
    out: list[int] = []
    stack = [root_pid]
    while stack:
        for child in sorted(children.get(stack.pop(), ())):
            if child not in out and child != root_pid:
                out.append(child)
                stack.append(child)
    return out


def set_comm(name: str) -> None:
    """Name this process for ps and ``pgrep -x`` (/proc/self/comm: 15 characters); best-effort."""
    try:
        with open("/proc/self/comm", "w") as handle:
            handle.write(name)
    except OSError:
        pass


def kill(pid: int, start_ticks: int | None = None) -> None:
    """SIGKILL ``pid`` if it is still the same live process (never a reused pid)."""
    if alive(pid, start_ticks):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def end_processes(targets: Dict[int, Optional[int]], grace_s: float, poll_s: float = 0.02,
                  settle_s: float = 0.0, send: Callable[[int, int], None] = os.kill,
                  root: str = PROC) -> Dict[str, Any]:
    """SIGTERM each live target (pid -> start ticks, None: any), ``grace_s`` for them to exit,
    SIGKILL those left, then up to ``settle_s`` for those to go.

    -> {"terminated": [gone after SIGTERM], "killed": [sent SIGKILL], "survivors": [alive after
    settle_s], "errors": ["pid N: ..." for a signal that could not be sent]}
    """
    report: dict[str, Any] = {"terminated": [], "killed": [], "survivors": [], "errors": []}

    def signal_all(chosen: Iterable[int], signum: int) -> None:
        for pid in chosen:
            if not alive(pid, targets[pid], root):
                continue
            try:
                send(pid, signum)
            except ProcessLookupError:
                pass
            except OSError as exc:
                report["errors"].append("pid %d: %s" % (pid, exc))

    def still_running(chosen: Iterable[int], seconds: float) -> list[int]:
        deadline = time.monotonic() + seconds
        running = [pid for pid in chosen if alive(pid, targets[pid], root)]
        while running and time.monotonic() < deadline:
            time.sleep(poll_s)
            running = [pid for pid in running if alive(pid, targets[pid], root)]
        return running

    signal_all(targets, signal.SIGTERM)
    remaining = still_running(targets, grace_s)
    report["terminated"] = [pid for pid in targets if pid not in remaining]
    if remaining:
        signal_all(remaining, signal.SIGKILL)
        report["killed"] = list(remaining)
        report["survivors"] = still_running(remaining, settle_s)
    return report
