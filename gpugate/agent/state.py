"""The agent's files: its state directories, private (0600, atomic) writes, the per-port paths, the
server's pid file and env file, and what the bootstrap told this process (``RUNTIME``).

The directories are module attributes read at call time (``state.STATE_DIR``), so a test can point
them elsewhere by setting them here.
"""

from __future__ import annotations

import json
import os
import sys
import time

from gpugate.rules.procfs import CLEAN_PATH
from gpugate.rules.procfs import read_file

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, BinaryIO, Dict, List

# What the bootstrap (gpugate.agentcmd) knows and the agent asks: its own sha256, the installed
# file, whether this command may write the code caches (start, install), whether it installed the
# agent just now, and whether it runs inline (read-only, nothing installed).
RUNTIME: Dict[str, Any] = {"sha256": None, "file": None, "write_cache": False, "installed_now": False, "inline": False}

SCHEMA = 1
STATE_DIR = "/var/lib/gpugate"
RUNS_DIR = STATE_DIR + "/runs"
RUN_DIR = "/run/gpugate"
LOG_DIR = "/var/log/gpugate"
ETC_DIR = "/etc/gpugate"
LOCK_PATH = RUN_DIR + "/transition.lock"
BASE_ENV = {"PATH": CLEAN_PATH, "HOME": "/root", "LANG": "C.UTF-8"}


def program() -> str:
    """The file that runs this agent as a program again (the log pump's): the installed artifact
    in a container; from the package (tests, a checkout), gpugate/agent/loader.py, which imports it.

    >>> program().endswith("loader.py")
    True
    """
    if RUNTIME["file"] and os.path.isfile(RUNTIME["file"]):
        return os.path.abspath(RUNTIME["file"])
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "loader.py")


class Failure(Exception):
    """A step did not reach its goal; the message is what the operator reads (no secret in it)."""


def add_site_dirs() -> None:
    """Commands run with ``python -S`` (site and sitecustomize cost ~10-25 ms): put the site
    directories (and the plain directory lines of their .pth files) on sys.path ourselves, without
    executing anything, so pynvml and the SGLang metadata are found as usual."""
    if not sys.flags.no_site:
        return
    import site

    dirs: List[str] = []
    try:
        dirs = list(site.getsitepackages())
    except AttributeError:
        pass
    for directory in dirs:
        if not os.path.isdir(directory) or directory in sys.path:
            continue
        sys.path.append(directory)
        for name in sorted(listdir(directory)):
            if name.endswith(".pth"):
                for line in (read_file(os.path.join(directory, name)) or "").splitlines():
                    line = line.strip()
                    if line and not line.startswith(("#", "import ", "import\t")):
                        path = os.path.join(directory, line)
                        if os.path.isdir(path) and path not in sys.path:
                            sys.path.append(path)


def json_file(path: str) -> Dict[str, Any] | None:
    """A state file's JSON object, or None when it is gone, unreadable, not JSON or not an object
    (every state file holds an object; anything else must not reach a ``.get`` as a traceback).

    >>> import tempfile; path = os.path.join(tempfile.mkdtemp(), "lock"); _ = open(path, "w").write("[1]")
    >>> json_file(path) is None
    True
    """
    text = read_file(path)
    if text is None:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def makedirs(path: str, mode: int = 0o755) -> None:
    if not os.path.isdir(path):
        os.makedirs(path, mode=mode, exist_ok=True)


def write_private(path: str, data: str | bytes, mode: int = 0o600) -> None:
    """Atomically replace ``path`` with ``data`` (temp file, fsync, rename), mode 0600.

    >>> import tempfile; path = os.path.join(tempfile.mkdtemp(), "state.json"); write_private(path, b"{}")
    >>> oct(os.stat(path).st_mode & 0o777), open(path).read()
    ('0o600', '{}')
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    makedirs(os.path.dirname(path))
    tmp = "%s.tmp.%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    os.replace(tmp, path)


def unwritable(path: str) -> str | None:
    """Why the agent could not write in the directory ``path`` (None when it can): checked on the
    directory, or on its nearest existing parent where the agent would create it. access(2) answers
    for a read-only mount even as root, which ignores the mode bits.

    >>> import tempfile; unwritable(os.path.join(tempfile.mkdtemp(), "not", "yet")) is None
    True
    >>> unwritable("/proc/self/stat")
    'a file, not a directory'
    """
    probe = path
    while probe and not os.path.lexists(probe):
        probe = os.path.dirname(probe.rstrip("/")) or "/"
        if probe == "/":
            break
    if not os.path.isdir(probe):
        return "a file, not a directory" if probe == path else "%s is not a directory" % probe
    if os.access(probe, os.W_OK):
        return None
    try:
        if os.statvfs(probe).f_flag & os.ST_RDONLY:
            return "read-only file system"
    except OSError:
        pass
    return "not writable"


def unwritable_state_dirs() -> Dict[str, str]:
    """{directory: why} for each state directory a transition writes that it could not: checked
    before anything stops (a journal that cannot be written leaves nobody knowing what runs; the
    server log's fallback to RUN_DIR serves a rollback only)."""
    found: Dict[str, str] = {}
    for path in (STATE_DIR, RUNS_DIR, RUN_DIR, ETC_DIR, LOG_DIR):
        why = unwritable(path)
        if why:
            found[path] = why
    return found


def free_mib(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize // (1024 * 1024)


def now_iso(t: float | None = None) -> str:
    """UTC, to the second, as records carry it.

    >>> now_iso(0)
    '1970-01-01T00:00:00Z'
    """
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t if t is not None else time.time()))


def listdir(path: str) -> List[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def paths(port: int | str) -> Dict[str, str]:
    """The files of the server on ``port``.

    >>> paths(30000)["history"], paths(30000)["unit_name"]
    ('/var/lib/gpugate/sglang-30000.json', 'sglang-30000.service')
    """
    port = int(port)
    return {"env": "%s/sglang-%d.env" % (ETC_DIR, port), "history": "%s/sglang-%d.json" % (STATE_DIR, port),
            "log": "%s/sglang-%d.log" % (LOG_DIR, port), "pid": "%s/sglang-%d.pid" % (RUN_DIR, port),
            "fallback_log": "%s/sglang-%d.log" % (RUN_DIR, port),
            "unit": "/etc/systemd/system/sglang-%d.service" % port, "unit_name": "sglang-%d.service" % port,
            # the server's weight-cache daemons (gpugate.agent.weight_cache)
            "cache": "%s/weight-cache-%d.json" % (RUN_DIR, port), "cache_log": "%s/weight-cache-%d.log" % (LOG_DIR, port),
            "cache_unit": "/etc/systemd/system/sglang-weight-cache-%d.service" % port,
            "cache_unit_name": "sglang-weight-cache-%d.service" % port,
            # the controller's canary of a rolling change on this server: under way, or its verdict (docs/canary.md)
            "canary": "%s/canary-%d.json" % (STATE_DIR, port)}


def read_pid_file(port: int) -> Dict[str, Any] | None:
    """The supervisor's record of the main process: {pid, start_ticks, log, supervisor} or None."""
    text = (read_file(paths(port)["pid"]) or "").strip()
    if not text:
        return None
    if text.isdigit():
        return {"pid": int(text), "start_ticks": None}
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("pid"), int) else None


def env_file_text(env: Dict[str, str]) -> str:
    """systemd EnvironmentFile syntax, double-quoted (read back by parse_env_file)."""
    lines = ["# written by gpugate; secrets live only here (mode 0600)"]
    for name, value in sorted(env.items()):
        lines.append('%s="%s"' % (name, value.replace("\\", "\\\\").replace('"', '\\"')))
    return "\n".join(lines) + "\n"


def parse_env_file(text: str) -> Dict[str, str]:
    """An env file written by env_file_text, read back.

    >>> parse_env_file(env_file_text({"HF_TOKEN": 'a "quoted" \\\\ value'}))
    {'HF_TOKEN': 'a "quoted" \\\\ value'}
    """
    env: Dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        if len(value) >= 2 and value[0] == value[-1] == '"':
            out: List[str] = []
            index, value = 0, value[1:-1]
            while index < len(value):
                char = value[index]
                if char == "\\" and index + 1 < len(value):
                    index += 1
                    char = value[index]
                out.append(char)
                index += 1
            value = "".join(out)
        env[key.strip()] = value
    return env


def open_private_append(path: str) -> BinaryIO:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)  # an older log may be 0644, and it holds what the server prints
    return os.fdopen(fd, "ab")
