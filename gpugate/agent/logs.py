"""The server's log: tails (the log file, or journald for a unit), without gpugate's own polls,
the line that says why a server ended, rotation by size, and the log pump (``logpump``) that
writes a server's output with its secrets masked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys

from gpugate.agent import state
from gpugate.agent.engine import engine
from gpugate.rules import procfs, redact


TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, BinaryIO, Dict, List, Optional, Pattern, Sequence, Tuple

LOG_MAX_BYTES = 64 * 1024 * 1024
LOG_KEEP = 3
LOG_TAIL_SCAN = 4 * 1024 * 1024  # at most this much of a log is read backwards for a tail
# gpugate's own polls (the agent's load/verify/observe GETs from the container itself), as the server's
# access log (uvicorn) writes them: a never-healthy start's tail was 30 of 30 "GET /health ... 503".
_OWN_POLLS = {}  # type: Dict[Tuple[str, ...], Pattern[str]]  # the engine's paths -> their pattern


def own_poll() -> Pattern[str]:
    """The pattern of an access-log line of one of our polls of the engine in use (its health,
    generation and info paths, and the OpenAI-compatible /v1/models)."""
    paths = tuple(p for p in (engine.HEALTH_PATH, engine.GENERATE_PATH) + tuple(engine.INFO_PATHS) + ("/v1/models",) if p)
    pattern = _OWN_POLLS.get(paths)
    if pattern is None:
        pattern = _OWN_POLLS[paths] = re.compile(
            r'(?:127\.0\.0\.1|::1|\[::1\]|localhost):\d+ - "GET (?:%s)(?:\?[^ "]*)? HTTP/[0-9.]+" \d{3}'
            % "|".join(re.escape(path) for path in paths))
    return pattern


def without_own_polls(lines: Sequence[str]) -> List[str]:
    """``lines`` less the access-log lines of gpugate's own polls (any status), so a tail shows the
    server's own last words.

    >>> without_own_polls(['INFO:     127.0.0.1:4180 - "GET /health HTTP/1.1" 503', 'ValueError: x',
    ...                    'INFO:     10.0.0.7:5000 - "GET /health HTTP/1.1" 200'])
    ['ValueError: x', 'INFO:     10.0.0.7:5000 - "GET /health HTTP/1.1" 200']
    """
    pattern = own_poll()
    return [line for line in lines if not pattern.search(line)]


def log_tail(path: str | None, lines: int = 40, offset: int | None = 0) -> List[str]:
    """The last ``lines`` lines of the file at ``path`` from byte ``offset`` on, our own polls left
    out (read backwards in chunks, at most LOG_TAIL_SCAN bytes, so a log of polls is no obstacle)."""
    try:
        handle = open(path, "rb") if path else None
    except OSError:
        return []
    if handle is None:
        return []
    with handle:
        end = handle.seek(0, 2)
        start, chunk = end, 65536
        kept: List[str] = []
        while start > (offset or 0) and end - start < LOG_TAIL_SCAN:
            start = max(offset or 0, end - chunk)
            chunk *= 4
            handle.seek(start)
            data = handle.read(end - start)
            text = data.decode("utf-8", "replace").splitlines()
            kept = without_own_polls(text[1:] if start > (offset or 0) else text)  # the first may be cut
            if len(kept) >= lines:
                break
        return kept[-lines:] if lines else []


def journal_tail(unit: str, lines: int = 40, since: float | None = None) -> List[str]:
    """The last ``lines`` lines journald holds for ``unit`` (the systemd supervisor's server logs to
    journald, templates/sglang.service.j2), from ``since`` (epoch seconds: this start's) on; systemd's
    own lines about the unit ("<unit>: Main process exited, ...") included. [] without journalctl.
    Unmasked: every caller masks them (Redactor.text), as every tail.

    ``--reverse``: with ``--since``, ``-n N`` alone gives the FIRST N entries after ``since`` (systemd
    252, Debian 12's); newest first, it gives the last N, put back in order here."""
    import subprocess

    # more than ``lines``: our own polls (the server's access log) are left out afterwards
    argv = ["journalctl", "-u", unit, "-o", "cat", "-n", str(int(lines) + 2000), "--reverse", "--no-pager", "-q"]
    if since:
        argv += ["--since", "@%.6f" % float(since)]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env=state.BASE_ENV, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return without_own_polls(done.stdout[:LOG_TAIL_SCAN].decode("utf-8", "replace").splitlines())[:lines][::-1]


def journal_sync(timeout: float = 5.0) -> bool:
    """``journalctl --sync``: journald stores every message queued to it first (its sync signal is
    handled after the pending stream input), so what a dead server printed is readable afterwards."""
    import subprocess

    try:
        return subprocess.run(["journalctl", "--sync"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=state.BASE_ENV, timeout=timeout).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def server_log_tail(port: int, lines: int = 40, offset: int | None = 0) -> List[str]:
    """The server's last log lines, unmasked: journald's for a unit of ours (the pid file says
    ``supervisor: systemd``; since its recorded start), else the log file from byte ``offset``."""
    recorded = state.read_pid_file(port) or {}
    if recorded.get("supervisor") == "systemd":
        return journal_tail(state.paths(port)["unit_name"], lines, recorded.get("started"))
    return log_tail(recorded.get("log") or state.paths(port)["log"], lines, offset)


def crash_line(tail: Sequence[str], port: int) -> str:
    """The line that says why a server ended: the last of its own, not systemd's about the unit
    (journald's tail may or may not hold "<unit>: Failed with result ..." yet), else the last.

    >>> crash_line(["ValueError: bad", "sglang-30000.service: Main process exited, code=exited"], 30000)
    'ValueError: bad'
    """
    prefix = state.paths(port)["unit_name"] + ": "
    own = [line for line in tail if line.strip() and not line.startswith(prefix)]
    return (own or [line for line in tail if line.strip()] or [""])[-1]


def rotate_log(path: str, max_bytes: int = LOG_MAX_BYTES, keep: int = LOG_KEEP) -> bool:
    """path -> path.1 -> ... path.<keep> when it is over max_bytes (checked at each start)."""
    try:
        if os.path.getsize(path) < max_bytes:
            return False
    except OSError:
        return False
    for index in range(keep - 1, 0, -1):
        if os.path.exists("%s.%d" % (path, index)):
            os.replace("%s.%d" % (path, index), "%s.%d" % (path, index + 1))
    os.replace(path, path + ".1")
    return True


def command_logpump(args: Dict[str, Any]) -> Dict[str, Any]:
    """Copies the server's output (stdin) into its log, line by line: secret values masked
    (GPUGATE_LOG_SECRETS, read once and dropped from the environment), the file rotated when it
    passes ``max_bytes`` (``keep`` old files). Never blocks the server: a line that cannot be
    written (ENOSPC) is dropped and counted. Ends at EOF (the server's tree has exited).
    ``args`` ({path, max_bytes, keep}) come from GPUGATE_LOGPUMP (dropped from the environment
    likewise), over which the command line's wins: the path names sglang, the argv must not."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    procfs.set_comm("gpugate-logpump")
    try:
        args = dict(json.loads(os.environ.pop("GPUGATE_LOGPUMP", "{}")), **args)
    except (ValueError, TypeError):
        pass
    path = args["path"]
    max_bytes = int(args.get("max_bytes") or LOG_MAX_BYTES)
    keep = int(args.get("keep") or LOG_KEEP)
    try:
        secrets = json.loads(os.environ.pop("GPUGATE_LOG_SECRETS", "[]"))
    except ValueError:
        secrets = []
    redactor = redact.Redactor(secrets)
    out: Optional[BinaryIO] = None
    size, dropped = 0, 0
    source = sys.stdin.buffer
    while True:
        line = source.readline(65536)
        if not line:
            break
        data = redactor.text(line.decode("utf-8", "replace")).encode("utf-8")
        try:
            if out is None:
                out = state.open_private_append(path)
                size = out.seek(0, 2)
            if size + len(data) > max_bytes and size > 0:
                out.close()
                out = None
                rotate_log(path, 0, keep)
                out = state.open_private_append(path)
                size = 0
            out.write(data)
            out.flush()
            size += len(data)
        except OSError:
            dropped += 1
            if out is not None:
                try:
                    out.close()
                except OSError:
                    pass
                out = None
    if out is not None:
        if dropped:
            try:
                out.write(("=== gpugate log pump: %d line(s) dropped (could not write)\n" % dropped).encode())
            except OSError:
                pass
        out.close()
    return {"ok": True, "dropped": dropped}
