"""The server probe: what SGLang process runs in this container, and in what state.

Runs INSIDE the container, sent inline (stdlib only, no relative imports, Python 3.8+).
``collect(port)`` returns one JSON-able dict and never raises for a missing thing:
a server that is not there is ``{"running": false, ...}``, an endpoint that does not
answer has its error text instead of a status code.

Example (in a container)::

    >>> doc = collect(30000, pid_file="/run/gpugate/sglang-30000.pid")
    >>> doc["running"], doc["main"]["pid"], doc["health"]["health"]
    (True, 412, 200)
"""

import hashlib
import json
import os
import socket
import time

DEFAULT_PORT = 30000
# sglang's own process match (python/sglang/cli/killall.py), applied to argv elements so that a
# script that merely *mentions* these names (this probe, sh -c wrappers) never matches.
PYTHON_MODULE_PREFIXES = ("sglang.launch_server", "sglang.bench", "sglang.data_parallel", "sglang.srt")
TITLE_PREFIXES = ("sglang::", "sgl_diffusion::")
SHM_PREFIXES = ("psm_", "sgl_shm_", "multi_tokenizer_args_")
# /get_server_info holds every resolved server arg; we return only the ones we may have set.
DEFAULT_INFO_KEYS = (
    "model_path", "port", "host", "tp_size", "dp_size", "kv_cache_dtype", "disable_radix_cache",
    "disable_cuda_graph", "disable_custom_all_reduce", "enable_hierarchical_cache", "hicache_size",
    "mem_fraction_static", "max_running_requests", "context_length", "version",
)
SECRET_KEYS = ("env", "api_key", "admin_api_key")


def _read(path, mode="r"):
    try:
        with open(path, mode) as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError):
        return None


def _proc_table():
    """Every process in this PID namespace: pid -> {ppid, pgid, state, argv, start_ticks}."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _read("/proc/%s/stat" % name)
        raw = _read("/proc/%s/cmdline" % name, "rb")
        if stat is None or raw is None:
            continue  # exited while we looked
        # comm may hold spaces and parentheses: split after the last ')'
        fields = stat[stat.rfind(")") + 2:].split()
        argv = [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]
        table[int(name)] = {
            "pid": int(name),
            "ppid": int(fields[1]),
            "pgid": int(fields[2]),
            "state": fields[0],
            "start_ticks": int(fields[19]),
            "argv": argv,
        }
    return table


def is_sglang_argv(argv):
    """True for SGLang's main process (`python -m sglang.launch_server`, `sglang serve`) and workers."""
    if not argv:
        return False
    if argv[0].startswith(TITLE_PREFIXES):
        return True
    if os.path.basename(argv[0]) == "sglang" and len(argv) > 1 and argv[1] == "serve":
        return True
    if os.path.basename(argv[0]).startswith("python"):
        for index, part in enumerate(argv[1:4], start=1):
            if part == "-m" and index + 1 < len(argv) and argv[index + 1].startswith(PYTHON_MODULE_PREFIXES):
                return True
    return False


def is_main_argv(argv):
    if not is_sglang_argv(argv) or argv[0].startswith(TITLE_PREFIXES):
        return False
    return "sglang.launch_server" in argv or (os.path.basename(argv[0]) == "sglang" and argv[1:2] == ["serve"])


def argv_port(argv):
    for index, part in enumerate(argv):
        if part == "--port" and index + 1 < len(argv):
            try:
                return int(argv[index + 1])
            except ValueError:
                return None
        if part.startswith("--port="):
            try:
                return int(part.split("=", 1)[1])
            except ValueError:
                return None
    return DEFAULT_PORT


def _ancestors(table, pid):
    seen = set()
    while pid in table and pid not in seen:
        seen.add(pid)
        pid = table[pid]["ppid"]
    return seen


def _descendants(table, root):
    children = {}
    for proc in table.values():
        children.setdefault(proc["ppid"], []).append(proc["pid"])
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        for child in sorted(children.get(pid, ())):
            out.append(child)
            stack.append(child)
    return out


def _listeners(port):
    """(listening, [pids]) for TCP sockets in LISTEN state on `port` (any address, v4 or v6)."""
    inodes = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        text = _read(path) or ""
        for line in text.splitlines()[1:]:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    pids = []
    if inodes:
        wanted = set("socket:[%s]" % inode for inode in inodes)
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                for fd in os.listdir("/proc/%s/fd" % name):
                    if os.readlink("/proc/%s/fd/%s" % (name, fd)) in wanted:
                        pids.append(int(name))
                        break
            except OSError:
                continue
    return bool(inodes), sorted(pids)


def http_get(port, path, timeout):
    """(status, body) or (None, error text). 503 is an answer, not an error."""
    # Imported here: urllib.request (http.client, email, ssl) is ~12 ms of every command's start,
    # and most transition steps never speak HTTP.
    import urllib.error
    import urllib.request

    url = "http://127.0.0.1:%d%s" % (port, path)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read(65536).decode("utf-8", "replace")
    except urllib.error.HTTPError as error:
        return error.code, ""
    except (urllib.error.URLError, socket.timeout, ConnectionError, OSError) as error:
        reason = getattr(error, "reason", error)
        return None, "%s: %s" % (type(reason).__name__, reason)


def health(port, generate=True, timeout=3.0, generate_timeout=20.0):
    """/health and (when /health is 200 and asked) /health_generate: a real one-token round trip."""
    status, error = http_get(port, "/health", timeout)
    doc = {"health": status, "health_error": error if status is None else None,
           "health_generate": None, "health_generate_error": None}
    if generate and status == 200:
        gen_status, gen_error = http_get(port, "/health_generate", generate_timeout)
        doc["health_generate"] = gen_status
        doc["health_generate_error"] = gen_error if gen_status is None else None
    return doc


def server_info(port, keys=DEFAULT_INFO_KEYS, timeout=3.0):
    for path in ("/get_server_info", "/server_info"):
        status, body = http_get(port, path, timeout)
        if status == 200:
            try:
                info = json.loads(body)
            except ValueError:
                return {"path": path, "error": "not JSON"}
            return {"path": path, "args": {key: info[key] for key in keys if key in info}}
        if status is None:
            return {"path": path, "error": body}
    return {"path": None, "error": "no server info endpoint answered"}


def _json_file(path):
    text = _read(path) if path else None
    if text is None:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return {"unreadable": True}
    if isinstance(doc, dict):
        for key in SECRET_KEYS:
            doc.pop(key, None)
    return doc


def env_hash(value):
    """A value's fingerprint, so that the operator's side can compare env values it never sees."""
    return hashlib.sha256(("gpugate-env:" + value).encode("utf-8")).hexdigest()[:16]


def argv_hash(argv):
    """An argv's fingerprint (secret flag values included), recorded instead of the values."""
    return hashlib.sha256(("gpugate-argv:" + "\0".join(argv)).encode("utf-8")).hexdigest()[:16]


def _environ(pid):
    raw = _read("/proc/%d/environ" % pid, "rb")
    if raw is None:
        return None
    env = {}
    for part in raw.split(b"\0"):
        if b"=" in part:
            key, _, value = part.partition(b"=")
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def memory_limit_bytes():
    """The container's memory: min(MemTotal, cgroup limit)."""
    limits = []
    meminfo = _read("/proc/meminfo") or ""
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            limits.append(int(line.split()[1]) * 1024)
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = (_read(path) or "").strip()
        if text.isdigit() and int(text) < 1 << 60:
            limits.append(int(text))
    return min(limits) if limits else None


def log_tail(path, lines=40):
    data = _read(path, "rb") if path else None
    if data is None:
        return None
    return data[-65536:].decode("utf-8", "replace").splitlines()[-lines:]


def collect(port=DEFAULT_PORT, pid_file=None, state_file=None, lock_file=None, env_names=(),
            model_path=None, log_file=None, tail_lines=0, generate=False, info_keys=DEFAULT_INFO_KEYS,
            previous_argv_file=None):
    """The whole server picture for `port`; see the module docstring. The env hashes cover
    `env_names` and the names the state file records (current and previous), so that a rollback
    can be compared without a second look."""
    started = time.time()
    port = int(port)
    table = _proc_table()
    mine = _ancestors(table, os.getpid())  # this probe and its sh/pct wrappers

    recorded_pid = None
    pid_text = (_read(pid_file) or "").strip() if pid_file else ""
    if pid_text.isdigit():
        recorded_pid = int(pid_text)

    candidates = [p for p in table.values() if p["pid"] not in mine and is_main_argv(p["argv"])
                  and argv_port(p["argv"]) == port]
    main = None
    for proc in candidates:
        if proc["pid"] == recorded_pid:
            main = proc
    if main is None and candidates:
        # the oldest: a stray second launcher on the same port is a child or a later start
        main = sorted(candidates, key=lambda p: (p["start_ticks"], p["pid"]))[0]

    tree = []
    if main is not None:
        tree = [main["pid"]] + _descendants(table, main["pid"])
    in_tree = set(tree)

    def summary(pid):
        proc = table[pid]
        return {"pid": pid, "ppid": proc["ppid"], "pgid": proc["pgid"], "state": proc["state"],
                "cmdline": " ".join(proc["argv"])[:300]}

    strays = [summary(p["pid"]) for p in sorted(table.values(), key=lambda p: p["pid"])
              if p["pid"] not in in_tree and p["pid"] not in mine and is_sglang_argv(p["argv"])]

    listening, listener_pids = _listeners(port)
    state = _json_file(state_file)
    names = set(env_names)
    for key in ("current", "previous"):
        entry = state.get(key) if isinstance(state, dict) else None
        if isinstance(entry, dict):
            names.update(name for name in entry.get("env_names") or [] if isinstance(name, str))
    doc = {
        "schema": 1,
        "port": port,
        "running": main is not None,
        "main": None,
        "tree": [summary(pid) for pid in tree if pid in table],
        "strays": strays,
        "pid_file_pid": recorded_pid,
        "pid_file_alive": recorded_pid in table if recorded_pid else False,
        "listening": listening,
        "listener_pids": listener_pids,
        "health": None,
        "server_info": None,
        "env_hashes": {},
        "state": state,
        "previous_argv_saved": bool(previous_argv_file) and os.path.exists(previous_argv_file),
        "lock": _json_file(lock_file),
        "shm_stale": sorted(name for name in (os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else [])
                            if name.startswith(SHM_PREFIXES)),
        "memory_limit_bytes": memory_limit_bytes(),
        "model_path_exists": (os.path.exists(model_path) if model_path and model_path.startswith("/")
                              else None),
        "log_tail": log_tail(log_file, tail_lines) if tail_lines else None,
        "clock": time.time(),
    }
    if main is not None:
        ticks = os.sysconf("SC_CLK_TCK")
        uptime = float((_read("/proc/uptime") or "0").split()[0])
        doc["main"] = {"pid": main["pid"], "pgid": main["pgid"], "argv": main["argv"],
                       "state": main["state"], "age_s": round(uptime - main["start_ticks"] / ticks, 1)}
        environ = _environ(main["pid"]) or {}
        doc["env_hashes"] = {name: (env_hash(environ[name]) if name in environ else None)
                             for name in sorted(names)}
    if listening:
        doc["health"] = health(port, generate=generate)
        if doc["health"]["health"] == 200:
            doc["server_info"] = server_info(port, info_keys)
    else:
        doc["health"] = {"health": None, "health_error": "port %d not listening" % port,
                         "health_generate": None, "health_generate_error": None}
    doc["elapsed_ms"] = round((time.time() - started) * 1000, 1)
    return doc


if __name__ == "__main__":  # pragma: no cover - handy by hand in a container
    import sys
    print(json.dumps(collect(int(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_PORT), indent=1))
