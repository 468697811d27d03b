"""gpugate's container-side agent: everything that runs inside a container, in one stdlib-only file.

Installed once per container, content-addressed (``/var/lib/gpugate/agent-<sha256>.py``, see
gpugate.agentcmd, which bundles gpugate/remote/gpu_probe.py into the same file). Python >= 3.8.
The contract with the controller is docs/agent-protocol.md. Commands (each prints ONE JSON document
on stdout and exits 0; errors are fields, never a traceback):

- ``observe '<json>'``: read-only picture of the server on a port, the GPUs, the container, the
  transition and the history.
- ``start`` (JSON on stdin: it holds secrets): takes the container's transition lock (a kernel
  flock held for the agent's whole life), detaches (own session, stdio on /dev/null, SIGHUP
  ignored) and runs the transition to its end: stop -> gate -> prepare -> start -> healthy ->
  verify -> commit; from the stop on any failure -> rollback -> NOTHING SERVES with both reasons.
- ``follow '<json>'``: the journal's new events of a run, waiting up to wait_s.
- ``wait '<json>'``: blocks until a run has ended (the host-side GPU lock holder uses it).

What may be signalled: the server's own tree (the recorded main pid checked by its start time, and
its descendants) and stray SGLang *server* parts of this port or holding this server's GPUs. Never
a process group, never a client (``sglang.bench_*``), a notebook or a monitor.

Example (in a container)::

    python3 agent.py observe '{"port": 30000}'
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import sys
import time

SCHEMA = 1
_BUNDLE = {}  # filled by gpugate.agentcmd.agent_source(): {"gpu_probe": "<source>"}

STATE_DIR = "/var/lib/gpugate"
RUNS_DIR = STATE_DIR + "/runs"
RUN_DIR = "/run/gpugate"
LOG_DIR = "/var/log/gpugate"
ETC_DIR = "/etc/gpugate"
LOCK_PATH = RUN_DIR + "/transition.lock"
DEFAULT_PORT = 30000
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BASE_ENV = {"PATH": CLEAN_PATH, "HOME": "/root", "LANG": "C.UTF-8"}
PROBE_MARKER = "gpugate-probe"  # argv[-1] of every agent process: GPU scans never count it as a holder
MASK = "***"
SECRET_FLAGS = ("--api-key", "--admin-api-key")
SECRET_WORDS = ("api_key", "admin_api_key", "token", "password", "secret")
MIN_SECRET_TEXT = 6  # shorter values are never masked as secrets: "root", "1", "true" would mangle every line
# Values that are words of everyday text, never masked as secrets even when long enough (a "secret"
# "ubuntu" would mask every path and hostname that holds it).
COMMON_VALUES = frozenset(("true", "false", "enabled", "disabled", "default", "ubuntu", "debian",
                           "python", "python3", "localhost", "127.0.0.1", "0.0.0.0", "C.UTF-8", "en_US.UTF-8",
                           "/root", "/bin/bash", "/bin/sh", "xterm-256color", "info", "debug", "warning"))
# What an adopted server's (one we did not start: no pid file of ours) environment keeps for its
# history record and a rollback to it: what SGLang and its libraries read, never the login session.
ADOPT_ENV_PREFIXES = ("SGLANG_", "SGL_", "CUDA_", "NCCL_", "NVIDIA_", "HF_", "HUGGING_FACE_", "TORCH",
                      "PYTORCH_", "TRANSFORMERS_", "TOKENIZERS_", "OMP_", "MKL_", "TRITON_", "FLASHINFER_",
                      "NVSHMEM_", "UCX_", "GLOO_", "MASTER_")
ADOPT_ENV_NAMES = ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "VIRTUAL_ENV")
SESSION_ENV_NAMES = ("USER", "HOME", "LOGNAME", "SHELL", "TERM", "PWD", "OLDPWD", "SHLVL", "MAIL", "LANG",
                     "LANGUAGE", "_", "MOTD_SHOWN", "HOSTNAME", "DISPLAY", "COLORTERM", "LS_COLORS", "EDITOR")
SESSION_ENV_PREFIXES = ("SSH_", "XDG_", "GPUGATE_", "LC_", "DBUS_", "TMUX", "STY", "WINDOW", "LESS")
HISTORY_GOOD = 5
HISTORY_FAILED = 10
LOG_MAX_BYTES = 64 * 1024 * 1024
LOG_KEEP = 3
PROGRESS_S = 1.5
DRAIN_POLL_S = 0.02
GATE_POLL_S = 0.05
LOAD_POLL_S = 0.05  # the moment it turns ready is downtime; a look is /proc + netlink (+ one local GET)
DEFAULT_BUDGETS = {"drain_timeout_s": 60.0, "kill_grace_s": 10.0, "gate_timeout_s": 120.0,
                   "start_timeout_s": 2700.0, "max_used_mib": 64, "generate_timeout_s": 30.0,
                   "rollback_start_timeout_s": None}  # None: start_timeout_s
SHM_PREFIXES = ("psm_", "sgl_shm_", "multi_tokenizer_args_")
TITLE_PREFIXES = ("sglang::scheduler", "sglang::detokenizer", "sglang::data_parallel_controller",
                  "sglang::tokenizer_worker")
INFO_KEYS = ("model_path", "port", "host", "tp_size", "dp_size", "pp_size", "version", "max_total_num_tokens",
             "max_running_requests", "context_length", "kv_cache_dtype")
PERMANENT_GPU_ERRORS = ("DriverNotLoaded", "LibRmVersionMismatch", "NoPython")
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,95}$")


def sha256(data):
    """hashlib.sha256 without hashlib: its OpenSSL import costs ~8 ms of every command."""
    try:
        from _sha256 import sha256 as implementation  # CPython <= 3.11
    except ImportError:
        try:
            from _sha2 import sha256 as implementation  # CPython >= 3.12
        except ImportError:
            from hashlib import sha256 as implementation
    return implementation(data)


def add_site_dirs():
    """Commands run with ``python -S`` (site and sitecustomize cost ~10-25 ms): put the site
    directories (and the plain directory lines of their .pth files) on sys.path ourselves, without
    executing anything, so pynvml and the SGLang metadata are found as usual."""
    if not sys.flags.no_site:
        return
    import site

    dirs = []
    try:
        dirs = list(site.getsitepackages())
    except AttributeError:
        pass
    for directory in dirs:
        if not os.path.isdir(directory) or directory in sys.path:
            continue
        sys.path.append(directory)
        for name in sorted(_listdir(directory)):
            if name.endswith(".pth"):
                for line in (_read(os.path.join(directory, name)) or "").splitlines():
                    line = line.strip()
                    if line and not line.startswith(("#", "import ", "import\t")):
                        path = os.path.join(directory, line)
                        if os.path.isdir(path) and path not in sys.path:
                            sys.path.append(path)


class Failure(Exception):
    """A step did not reach its goal; the message is what the operator reads (no secret in it)."""


# ==================================================================================== small I/O
def _read(path, mode="r", limit=None):
    try:
        with open(path, mode) as handle:
            return handle.read() if limit is None else handle.read(limit)
    except (OSError, UnicodeDecodeError):
        return None


def _json_file(path):
    text = _read(path)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def _makedirs(path, mode=0o755):
    if not os.path.isdir(path):
        os.makedirs(path, mode=mode, exist_ok=True)


def write_private(path, data, mode=0o600):
    """Atomically replace ``path`` with ``data`` (temp file, fsync, rename), mode 0600.

    >>> import tempfile; path = os.path.join(tempfile.mkdtemp(), "state.json"); write_private(path, b"{}")
    >>> oct(os.stat(path).st_mode & 0o777), open(path).read()
    ('0o600', '{}')
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    _makedirs(os.path.dirname(path))
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


def free_mib(path):
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize // (1024 * 1024)


def _now_iso(t=None):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t if t is not None else time.time()))


# ==================================================================================== /proc
def proc_stat(pid):
    """-> (comm, state, ppid, pgid, start_ticks) or None when gone."""
    text = _read("/proc/%d/stat" % pid)
    if text is None:
        return None
    close = text.rfind(")")
    fields = text[close + 2:].split()
    try:
        return text[text.find("(") + 1:close], fields[0], int(fields[1]), int(fields[2]), int(fields[19])
    except (IndexError, ValueError):
        return None


def proc_argv(pid):
    raw = _read("/proc/%d/cmdline" % pid, "rb")
    if not raw:
        return []
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


def proc_table():
    """Every process of this PID namespace: pid -> {pid, ppid, pgid, state, start_ticks, comm, argv}."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        stat = proc_stat(pid)
        if stat is None:
            continue
        table[pid] = {"pid": pid, "comm": stat[0], "state": stat[1], "ppid": stat[2], "pgid": stat[3],
                      "start_ticks": stat[4], "argv": proc_argv(pid)}
    return table


def alive(pid, start_ticks=None):
    """Running (not a zombie) and, when given, the same process (not a reused pid)."""
    stat = proc_stat(int(pid)) if pid else None
    if stat is None or stat[1] in ("Z", "X"):
        return False
    return start_ticks is None or stat[4] == int(start_ticks)


def ancestors(table, pid):
    seen = set()
    while pid in table and pid not in seen:
        seen.add(pid)
        pid = table[pid]["ppid"]
    seen.add(pid)
    return seen


def descendants(table, root):
    children = {}
    for proc in table.values():
        children.setdefault(proc["ppid"], []).append(proc["pid"])
    out, stack = [], [root]
    while stack:
        for child in sorted(children.get(stack.pop(), ())):
            if child not in out and child != root:
                out.append(child)
                stack.append(child)
    return out


def proc_environ(pid):
    raw = _read("/proc/%d/environ" % pid, "rb")
    if raw is None:
        return None
    env = {}
    for part in raw.split(b"\0"):
        if b"=" in part:
            key, _, value = part.partition(b"=")
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def listeners(port):
    """Socket inodes (``socket:[N]``) in LISTEN on TCP ``port`` (v4 and v6, any address): netlink
    sock_diag (walks only the listening sockets: ~0.2 ms), else /proc/net/tcp* (~10-20 ms on a
    busy host, it walks every socket)."""
    try:
        return _listeners_netlink(int(port))
    except (OSError, ValueError, AttributeError):
        pass
    inodes = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in (_read(path) or "").splitlines()[1:]:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == int(port):
                inodes.add("socket:[%s]" % cols[9])
    return inodes


def _listeners_netlink(port):
    import _socket as socket  # the C module: the socket module's import converts its enums (~3-5 ms)
    import struct

    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4)  # NETLINK_SOCK_DIAG
    inodes = set()
    try:
        sock.settimeout(2.0)
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), start=1):
            # inet_diag_req_v2: family, protocol, ext, pad, states (1 << TCP_LISTEN), inet_diag_sockid
            request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << 10) + b"\0" * 48
            # nlmsghdr: len, SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, pid
            sock.send(struct.pack("=IHHII", 16 + len(request), 20, 0x301, seq, 0) + request)
            done = False
            while not done:
                data = sock.recv(65536)
                offset = 0
                while offset + 16 <= len(data):
                    length, kind, _, _, _ = struct.unpack_from("=IHHII", data, offset)
                    if length < 16:
                        raise ValueError("bad netlink message")
                    if kind == 3:  # NLMSG_DONE
                        done = True
                        break
                    if kind == 2:  # NLMSG_ERROR
                        raise OSError("sock_diag refused the request")
                    body = offset + 16
                    sport = struct.unpack_from("!H", data, body + 4)[0]
                    if sport == port:
                        inodes.add("socket:[%d]" % struct.unpack_from("=I", data, body + 68)[0])
                    offset += (length + 3) & ~3
    finally:
        sock.close()
    return inodes


def socket_owners(inodes):
    """pids holding any of the socket ``inodes`` (a /proc/*/fd scan; only when something listens)."""
    pids = []
    if not inodes:
        return pids
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            for fd in os.listdir("/proc/%s/fd" % name):
                if os.readlink("/proc/%s/fd/%s" % (name, fd)) in inodes:
                    pids.append(int(name))
                    break
        except OSError:
            continue
    return sorted(pids)


def pid1_comm():
    return (_read("/proc/1/comm") or "").strip() or None


def memory_limit_bytes():
    limits = []
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            limits.append(int(line.split()[1]) * 1024)
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = (_read(path) or "").strip()
        if text.isdigit() and int(text) < 1 << 60:
            limits.append(int(text))
    return min(limits) if limits else None


# ==================================================================================== argv recognition
def _flag_value(argv, *names):
    """The last value given for any of ``names`` (``--x v`` or ``--x=v``), else None."""
    value = None
    for index, arg in enumerate(argv):
        for name in names:
            if arg == name and index + 1 < len(argv):
                value = argv[index + 1]
            elif arg.startswith(name + "="):
                value = arg[len(name) + 1:]
    return value


def _flag_int(argv, default, *names):
    value = _flag_value(argv, *names)
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def _python_module(argv):
    """``-m <module>`` of a python argv (within its first options), else None."""
    if not argv or not os.path.basename(argv[0]).startswith("python"):
        return None
    for index, part in enumerate(argv[1:5], start=1):
        if part == "-m" and index + 1 < len(argv):
            return argv[index + 1]
        if part.startswith("-m") and len(part) > 2:
            return part[2:]
    return None


def is_main_argv(argv):
    """SGLang's server main: ``python -m sglang.launch_server ...`` or ``sglang serve ...``.

    >>> is_main_argv(["/usr/bin/python3", "-m", "sglang.launch_server", "--port", "30000"])
    True
    >>> is_main_argv(["python3", "-m", "sglang.bench_serving", "--port", "30000"])
    False
    """
    if not argv:
        return False
    if _python_module(argv) == "sglang.launch_server":
        return True
    program = os.path.basename(argv[0])
    if program == "sglang" and argv[1:2] == ["serve"]:
        return True
    if program.startswith("python") and len(argv) > 2 and os.path.basename(argv[1]) == "sglang" \
            and argv[2] == "serve":
        return True
    return False


def is_worker_argv(argv):
    """An SGLang server child by its process title (sglang::scheduler_TP0, sglang::detokenizer...)."""
    return bool(argv) and argv[0].startswith(TITLE_PREFIXES)


def is_server_part(argv):
    return is_main_argv(argv) or is_worker_argv(argv)


def is_client_argv(argv):
    """SGLang clients (benchmarks, one-off scripts): reported, never signalled."""
    module = _python_module(argv) or ""
    return module.startswith("sglang.") and not is_main_argv(argv)


def argv_port(argv):
    return _flag_int(argv, DEFAULT_PORT, "--port")


def argv_token(argv, admin=False):
    """The key a request to this server needs: --admin-api-key first for admin endpoints."""
    if admin:
        return _flag_value(argv, "--admin-api-key") or _flag_value(argv, "--api-key")
    return _flag_value(argv, "--api-key")


def argv_host(argv):
    return _flag_value(argv, "--host") or "127.0.0.1"


def connect_host(host):
    """Where to reach a server bound to ``host`` from inside the container."""
    if not host or host in ("0.0.0.0", "::", "[::]", "*"):
        return "127.0.0.1"
    return host.strip("[]")


def server_gpus(argv, env=None, uuids=None):
    """The GPUs a server uses, from its flags and environment: tp x pp x dp (dp only without
    --enable-dp-attention) ids from --base-gpu-id by --gpu-id-step, mapped through
    CUDA_VISIBLE_DEVICES. None when they cannot be told (a UUID we cannot map).

    >>> server_gpus(["python3", "-m", "sglang.launch_server", "--tp", "4", "--base-gpu-id", "4"])
    [4, 5, 6, 7]
    """
    tp = _flag_int(argv, 1, "--tp-size", "--tp", "--tensor-parallel-size")
    pp = _flag_int(argv, 1, "--pp-size", "--pp", "--pipeline-parallel-size")
    dp = _flag_int(argv, 1, "--dp-size", "--dp", "--data-parallel-size")
    nnodes = max(1, _flag_int(argv, 1, "--nnodes"))
    if "--enable-dp-attention" in argv:
        dp = 1
    base = _flag_int(argv, 0, "--base-gpu-id")
    step = max(1, _flag_int(argv, 1, "--gpu-id-step"))
    count = max(1, tp * pp * dp // nnodes)
    ids = [base + index * step for index in range(count)]
    visible = (env or {}).get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip() == "":
        return ids
    entries = [item.strip() for item in visible.split(",") if item.strip()]
    out = []
    for index in ids:
        if index >= len(entries):
            return None
        entry = entries[index]
        if entry.isdigit():
            out.append(int(entry))
        elif uuids and entry in uuids:
            out.append(uuids.index(entry))
        else:
            return None
    return out


# ==================================================================================== secrets
def env_hash(value):
    """A value's fingerprint: the controller compares env values it never sees.

    >>> env_hash("x")[:4]
    'c365'
    """
    return sha256(("gpugate-env:" + value).encode("utf-8")).hexdigest()[:16]


def argv_hash(argv):
    """An argv's fingerprint (secret values included), recorded instead of the values."""
    return sha256(("gpugate-argv:" + "\0".join(argv)).encode("utf-8")).hexdigest()[:16]


def spec_key(spec):
    """What makes two specs the same server: exact argv, env, supervisor and unit text."""
    material = json.dumps([spec.get("argv") or [], sorted((spec.get("env") or {}).items()),
                           spec.get("supervisor") or "process", spec.get("unit_text") or ""])
    return sha256(material.encode("utf-8")).hexdigest()[:16]


def redact_argv(argv, secret_flags=SECRET_FLAGS):
    """argv with the values of secret flags as ***.

    >>> redact_argv(["x", "--api-key", "sk-1", "--admin-api-key=a"])
    ['x', '--api-key', '***', '--admin-api-key=***']
    """
    out, hide = [], False
    for arg in argv or []:
        if hide:
            out.append(MASK)
            hide = False
        elif arg in secret_flags:
            out.append(arg)
            hide = True
        elif "=" in arg and arg.split("=", 1)[0] in secret_flags:
            out.append(arg.split("=", 1)[0] + "=" + MASK)
        else:
            out.append(arg)
    return out


def secret_flag_values(argv, secret_flags=SECRET_FLAGS):
    values = []
    for index, arg in enumerate(argv or []):
        if arg in secret_flags and index + 1 < len(argv):
            values.append(argv[index + 1])
        elif "=" in arg and arg.split("=", 1)[0] in secret_flags:
            values.append(arg.split("=", 1)[1])
    return values


_SECRET_ASSIGN = re.compile(r"((?:%s)\s*[=:]\s*)('[^']*'|\"[^\"]*\"|[^\s,)]+)" % "|".join(
    re.escape(word) for word in SECRET_WORDS), re.IGNORECASE)
_SECRET_FLAG_TEXT = re.compile(r"(--(?:admin-)?api-key(?:=|\s+))(\S+)")


class Redactor:
    """Masks known secret values (env values, secret flag values) and SGLang's own
    ``api_key='...'`` shapes wherever they appear in text.

    >>> Redactor(["sk-secret-1"]).text("server_args=ServerArgs(api_key='sk-secret-1', port=1)")
    "server_args=ServerArgs(api_key='***', port=1)"
    """

    def __init__(self, values=()):
        self.values = sorted(set(v for v in values if maskable(v)), key=len, reverse=True)

    def add(self, values):
        self.values = sorted(set(self.values) | set(v for v in values if maskable(v)), key=len, reverse=True)

    def text(self, text):
        if not isinstance(text, str):
            return text
        for value in self.values:
            if value in text:
                text = text.replace(value, MASK)

        def assign(match):
            value = match.group(2)
            if value in ("None", "null", "''", '""'):
                return match.group(0)
            quote = value[0] if value[:1] in ("'", '"') else ""
            return match.group(1) + quote + MASK + quote

        text = _SECRET_ASSIGN.sub(assign, text)
        return _SECRET_FLAG_TEXT.sub(lambda m: m.group(1) + (m.group(2) if m.group(2) == MASK else MASK), text)

    def deep(self, value):
        """The same over a JSON-able document (strings anywhere in it)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.deep(item) for item in value]
        if isinstance(value, dict):
            return dict((key, self.deep(item)) for key, item in value.items())
        return value


def maskable(value):
    """Whether ``value`` may be masked as a secret wherever it appears in text: at least
    MIN_SECRET_TEXT characters, not a common word, not only digits and separators (a port, GPU
    ids, a version). A secret "root" would mask every "root" (an operator's ``root@vm``).

    >>> [maskable(v) for v in ("root", "true", "0,1,2,3", "sk-canary-7f3a9b")]
    [False, False, False, True]
    """
    return (isinstance(value, str) and len(value.strip()) >= MIN_SECRET_TEXT and value not in COMMON_VALUES
            and value.lower() not in COMMON_VALUES and not _PLAIN_VALUE.match(value))


_PLAIN_VALUE = re.compile(r"^[\d\s.,:;_/+-]*$")


def adopted_env(environ, keep_names=(), argv=None):
    """The part of a server's environment that a record of a server we did not start keeps (and a
    rollback to it gets): names SGLang and its libraries read (ADOPT_ENV_PREFIXES, ADOPT_ENV_NAMES)
    and ``keep_names`` (the desired spec's env names); never the login session's (USER, SSH_*,
    GPUGATE_*...), and PATH only when argv[0] is found through it (the clean PATH is set anyway).

    >>> adopted_env({"USER": "root", "SSH_CLIENT": "10.0.0.1 5 22", "HF_TOKEN": "hf-x", "FOO": "1"}, ["FOO"])
    {'FOO': '1', 'HF_TOKEN': 'hf-x'}
    """
    keep_names = set(keep_names or ())
    kept = {}
    for name, value in sorted((environ or {}).items()):
        if name.startswith(("SSH_", "GPUGATE_")):
            continue  # the session that started it, and gpugate's own: never what the server needs
        if name in keep_names:
            kept[name] = value
        elif name in SESSION_ENV_NAMES or name.startswith(SESSION_ENV_PREFIXES):
            continue
        elif name.startswith(ADOPT_ENV_PREFIXES) or name in ADOPT_ENV_NAMES:
            kept[name] = value
        elif name == "PATH" and argv and "/" not in argv[0] and value != CLEAN_PATH:
            kept[name] = value  # a relative argv[0] ("python3") is found through it: a venv's python
    return kept


def spec_secrets(spec):
    if not spec:
        return []
    flags = tuple(SECRET_FLAGS) + tuple(spec.get("secret_flags") or ())
    return list((spec.get("env") or {}).values()) + secret_flag_values(spec.get("argv") or [], flags)


# ==================================================================================== package metadata
def _dist_info_version(directory, name):
    """The version an ``sglang-*.dist-info`` (or ``.egg-info``) entry of ``directory`` declares, else None."""
    lower = name.lower()
    if not (lower.startswith("sglang-") and (lower.endswith(".dist-info") or lower.endswith(".egg-info"))):
        return None
    meta = _read(os.path.join(directory, name, "METADATA")) or _read(os.path.join(directory, name, "PKG-INFO"))
    for line in (meta or "").splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


def _path_listings():
    """(directory, its entries) for each readable directory of sys.path, once each, in order."""
    seen = set()
    for entry in sys.path:
        directory = entry or "."
        if directory in seen or not os.path.isdir(directory):
            continue
        seen.add(directory)
        try:
            yield directory, os.listdir(directory)
        except OSError:
            continue


def sglang_version():
    """The installed SGLang's version from its dist-info/egg-info METADATA (never imports sglang)."""
    for directory, names in _path_listings():
        for name in names:
            version = _dist_info_version(directory, name)
            if version is not None:
                return version
        if "sglang" in names:  # a source tree or the lab's stand-in: version.py, without importing
            for candidate in ("version.py", "__init__.py"):
                text = _read(os.path.join(directory, "sglang", candidate)) or ""
                match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
                if match:
                    return match.group(1)
    return None


FLAG_TABLE_DIR = "/var/lib/gpugate/sglang-flags"  # gpugate/remote/flag_table.py's CACHE_DIR


def flag_table_key():
    """The name gpugate/remote/flag_table.py's ``collect`` gives the container's SGLang flag table,
    found the same way (sys.path order: the first ``sglang-*.dist-info`` version, else "unknown"; the
    first ``sglang/srt/server_args.py``, hashed) without importing anything, so that a controller
    that already has that table needs no command of its own for it (issue 13). ->
    ``{"version", "server_args_sha256", "key", "cached"}``, or None without server_args.py.

    >>> flag_table_key()["key"]   # doctest: +SKIP
    '0.5.23-3f2a9c0d1e7b4a55'
    """
    version, server_args = None, None
    for directory, names in _path_listings():
        for name in sorted(names) if version is None else ():
            version = _dist_info_version(directory, name)
            if version is not None:
                break
        if server_args is None and "sglang" in names:
            candidate = os.path.join(directory, "sglang", "srt", "server_args.py")
            if os.path.isfile(candidate):
                server_args = candidate
    if server_args is None:
        return None
    data = _read(server_args, "rb")
    if data is None:
        return None
    digest = sha256(data).hexdigest()
    safe = "".join(c if c.isalnum() or c in ".+-_" else "_" for c in str(version or "unknown"))
    key = "%s-%s" % (safe, digest[:16])
    return {"version": version, "server_args_sha256": digest, "key": key,
            "cached": os.path.isfile(os.path.join(FLAG_TABLE_DIR, key + ".json"))}


# ==================================================================================== HTTP (raw socket: no urllib import)
def _connect(host, port, timeout):
    """socket.create_connection((host, port), timeout) on the C module ``_socket``: the socket
    module's import (its enums) costs ~3-5 ms of every command, and a str host in getaddrinfo
    imports the idna codec; an ASCII host goes as bytes."""
    import _socket

    try:
        name = host.encode("ascii")
    except UnicodeEncodeError:
        name = host
    error = None
    for family, kind, proto, _, address in _socket.getaddrinfo(name, port, 0, _socket.SOCK_STREAM):
        sock = _socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
            return sock
        except OSError as failure:
            error = failure
            sock.close()
    raise error or OSError("getaddrinfo returned no address for %s" % host)


def http_get(host, port, path, timeout=3.0, token=None):
    """(status, body) or (None, error text). 503 is an answer, not an error. ``token``: the
    server's --api-key / --admin-api-key, sent as a bearer token (never printed)."""
    deadline = time.time() + timeout
    try:
        conn = _connect(connect_host(host), int(port), timeout)
    except OSError as error:
        return None, "%s: %s" % (type(error).__name__, error)
    try:
        auth = "Authorization: Bearer %s\r\n" % token if token else ""
        conn.sendall(("GET %s HTTP/1.0\r\nHost: 127.0.0.1:%d\r\n%sConnection: close\r\n\r\n"
                      % (path, int(port), auth)).encode())
        chunks, size = [], 0
        while size < 4 * 1024 * 1024:
            conn.settimeout(max(0.05, deadline - time.time()))
            data = conn.recv(65536)
            if not data:
                break
            chunks.append(data)
            size += len(data)
            head = b"".join(chunks)
            if b"\r\n\r\n" in head:
                header, _, body = head.partition(b"\r\n\r\n")
                match = re.search(rb"(?im)^content-length:\s*(\d+)", header)
                if match and len(body) >= int(match.group(1)):
                    break
    except OSError as error:
        return None, "%s: %s" % (type(error).__name__, error)
    finally:
        conn.close()
    raw = b"".join(chunks)
    header, _, body = raw.partition(b"\r\n\r\n")
    parts = header.split(b"\r\n", 1)[0].split()
    if len(parts) < 2 or not parts[1].isdigit():
        return None, "not an HTTP answer"
    return int(parts[1]), body.decode("utf-8", "replace")


def health(host, port, generate=False, timeout=3.0, generate_timeout=30.0, token=None):
    status, error = http_get(host, port, "/health", timeout, token)
    doc = {"health": status, "health_error": error if status is None else None,
           "health_generate": None, "health_generate_error": None}
    if generate and status == 200:
        code, error = http_get(host, port, "/health_generate", generate_timeout, token)
        doc["health_generate"] = code
        doc["health_generate_error"] = error if code is None else None
    return doc


def server_info(host, port, timeout=3.0, keys=None, token=None):
    """/get_server_info (newer: /server_info): the resolved args, or an error (``status`` 401/403:
    the admin key is needed and we do not have it)."""
    for path in ("/get_server_info", "/server_info"):
        status, body = http_get(host, port, path, timeout, token)
        if status in (401, 403):
            return {"path": path, "error": "unauthorized (%d)" % status, "status": status, "args": None}
        if status == 200:
            try:
                info = json.loads(body)
            except ValueError:
                return {"path": path, "error": "not JSON", "args": None}
            if not isinstance(info, dict):
                return {"path": path, "error": "not an object", "args": None}
            if keys is not None:
                info = dict((key, info[key]) for key in keys if key in info)
            return {"path": path, "error": None, "args": info}
        if status is None:
            return {"path": path, "error": body, "args": None}
    return {"path": None, "error": "no server info endpoint answered", "args": None}


# ==================================================================================== paths of a port
def paths(port):
    port = int(port)
    return {"env": "%s/sglang-%d.env" % (ETC_DIR, port), "history": "%s/sglang-%d.json" % (STATE_DIR, port),
            "log": "%s/sglang-%d.log" % (LOG_DIR, port), "pid": "%s/sglang-%d.pid" % (RUN_DIR, port),
            "fallback_log": "%s/sglang-%d.log" % (RUN_DIR, port),
            "unit": "/etc/systemd/system/sglang-%d.service" % port, "unit_name": "sglang-%d.service" % port}


def read_pid_file(port):
    """The supervisor's record of the main process: {pid, start_ticks, log, supervisor} or None."""
    text = (_read(paths(port)["pid"]) or "").strip()
    if not text:
        return None
    if text.isdigit():
        return {"pid": int(text), "start_ticks": None}
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("pid"), int) else None


# ==================================================================================== the server on a port
def _own_pids(table):
    return ancestors(table, os.getpid())


def find_server(table, port, own=None):
    """The main process serving/configured for ``port`` and its tree (pids with start ticks)."""
    own = own if own is not None else _own_pids(table)
    recorded = read_pid_file(port)
    candidates = [p for p in table.values() if p["pid"] not in own and p["state"] not in ("Z", "X")
                  and is_main_argv(p["argv"]) and argv_port(p["argv"]) == int(port)]
    main = None
    if recorded:
        for proc in candidates:
            if proc["pid"] == recorded["pid"] and recorded.get("start_ticks") in (None, proc["start_ticks"]):
                main = proc
    if main is None and candidates:
        pids = set(p["pid"] for p in candidates)
        top = [p for p in candidates if p["ppid"] not in pids] or candidates
        main = sorted(top, key=lambda p: (p["start_ticks"], p["pid"]))[0]
    tree = [main["pid"]] + descendants(table, main["pid"]) if main else []
    return main, tree


def _summary(proc, redactor):
    return {"pid": proc["pid"], "ppid": proc["ppid"], "pgid": proc["pgid"], "state": proc["state"],
            "cmdline": redactor.text(" ".join(redact_argv(proc["argv"])))[:300]}


def workers_of(table, tree, expected):
    schedulers = [table[pid] for pid in tree if pid in table and table[pid]["argv"][:1]
                  and table[pid]["argv"][0].startswith("sglang::scheduler")]
    live = [p for p in schedulers if p["state"] not in ("Z", "X")]
    return {"expected": expected, "alive": len(live), "dead": max(0, (expected or 0) - len(live)),
            "zombies": [p["pid"] for p in schedulers if p["state"] in ("Z", "X")]}


def gpu_probe():
    """gpugate/remote/gpu_probe.py: bundled in the installed file, imported in the package."""
    module = sys.modules.get("gpugate_gpu_probe")
    if module is not None:
        return module
    source = _BUNDLE.get("gpu_probe")
    if source is None:
        try:
            from gpugate.remote import gpu_probe as module  # the package (tests, the controller)
            return module
        except ImportError:
            source = _read(os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_probe.py"))
    import types

    module = types.ModuleType("gpugate_gpu_probe")
    module.__file__ = "<gpugate:gpu_probe>"
    sys.modules["gpugate_gpu_probe"] = module
    exec(_cached_code(source, module.__file__), module.__dict__)
    return module


def _cached_code(source, name):
    """compile(source), cached as marshal beside the installed agent (its own code is cached by the
    bootstrap, gpugate.agentcmd; the bundled module's would be compiled again by every command:
    ~5 ms). Only a command that may write (``WRITE_CACHE``, set by the bootstrap: ``start``) writes
    the cache; observe reads it, or compiles in memory without it (read-only)."""
    import marshal

    here = globals().get("__file__") or ""
    cache = None
    if here.startswith(STATE_DIR + "/") and not globals().get("INLINE"):
        digest = sha256(source.encode("utf-8")).hexdigest()[:16]
        cache = "%s/__pycache__/bundle-%s-%d%d.marshal" % (STATE_DIR, digest, sys.version_info[0], sys.version_info[1])
        data = _read(cache, "rb")
        if data:
            try:
                return marshal.loads(data)
            except (ValueError, EOFError, TypeError):
                pass
    code = compile(source, name, "exec")
    if cache and globals().get("WRITE_CACHE"):
        try:
            write_private(cache, marshal.dumps(code))
        except OSError:
            pass
    return code


def read_gpus(keep_open=False, exclude=()):
    try:
        return gpu_probe().collect(exclude_pids=exclude, keep_nvml_open=keep_open)
    except Exception as error:  # noqa: BLE001 - a document, never a traceback
        return {"schema": 1, "source": "none", "gpus": [], "holders": [], "memory_api": None,
                "errors": [{"source": "agent", "kind": type(error).__name__, "message": str(error)[:300]}]}


def _gpu_uuids(gpu_doc):
    return [g.get("uuid") for g in (gpu_doc or {}).get("gpus") or []]


def gpu_holders(gpu_doc, skip_pids, redactor):
    """GPU holders that are not ``skip_pids``: with the GPUs where they hold memory (a CUDA
    context) and whether they hold memory at all (an NVML monitor holds the files at 0 MiB)."""
    out = []
    for holder in (gpu_doc or {}).get("holders") or []:
        if holder.get("pid") in skip_pids:
            continue
        gpus = sorted(set(holder.get("gpus") or []))
        memory = bool(gpus) and (holder.get("used_mib") is None or holder.get("used_mib") > 0)
        argv = proc_argv(holder["pid"])
        stat = proc_stat(holder["pid"])
        out.append({"pid": holder["pid"], "start_ticks": stat[4] if stat else None, "cmdline": redactor.text(" ".join(redact_argv(argv)) or holder.get("cmdline", ""))[:300],
                    "state": holder.get("state"), "gpus": gpus, "used_mib": holder.get("used_mib"),
                    "memory": memory, "server_part": is_server_part(argv), "client": is_client_argv(argv)})
    return out


# ==================================================================================== the lock
def lock_status():
    """{held, run, pid, since} of the container's transition lock, without touching it: /proc/locks
    says whether a flock is on the file, the file says whose (the holder writes it)."""
    info = _json_file(LOCK_PATH) or {}
    try:
        st = os.stat(LOCK_PATH)
    except OSError:
        return {"held": False, "run": None, "pid": None}
    held = None
    text = _read("/proc/locks")
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
        held = bool(info.get("pid")) and alive(info["pid"], info.get("start_ticks"))
    if held and info.get("pid") and not alive(info["pid"], info.get("start_ticks")):
        info = dict(info, run=None)  # held by someone who has not written the file yet
    return {"held": held, "run": info.get("run") if held else None, "pid": info.get("pid") if held else None,
            "since": info.get("since") if held else None}


# ==================================================================================== the journal
def journal_path(run):
    return "%s/%s.jsonl" % (RUNS_DIR, run)


class Journal:
    """Append-only JSON lines, fsync'd. Writing is best-effort: ENOSPC (or any OSError) keeps the
    line in memory and retries with the next event; the state machine never stops for it."""

    def __init__(self, run):
        self.run = run
        self.path = journal_path(run)
        self.pending = []
        self.failed = None
        self.events = []
        self.last_progress = {}

    def write(self, event):
        event = dict(event)
        event.setdefault("t", round(time.time(), 3))
        self.events.append(event)
        self.pending.append(json.dumps(event, separators=(",", ":"), default=str) + "\n")
        try:
            _makedirs(RUNS_DIR, 0o700)
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

    def progress(self, step, every=PROGRESS_S, **fields):
        now = time.time()
        if now - self.last_progress.get(step, 0.0) >= every:
            self.last_progress[step] = now
            self.write(dict(step=step, phase="progress", **fields))


def read_journal(run, offset=0, limit=None):
    """(events, new offset): whole lines from byte ``offset``; a torn line is skipped."""
    try:
        with open(journal_path(run), "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except OSError:
        return None, offset
    end = data.rfind(b"\n") + 1
    events, consumed = [], 0
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


def journal_ends(run):
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
    first = None
    try:
        first = json.loads(head.decode("utf-8"))
    except ValueError:
        pass
    last, outcome = None, None
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


def latest_run():
    text = (_read(RUNS_DIR + "/latest") or "").strip()
    return text if RUN_ID.match(text or "") else None


def outcome_from_history(run):
    """The outcome of ``run`` as the history files record it (``last``): the journal may have lost
    it (ENOSPC in runs/), the history is written separately. None when no history names it."""
    for name in _listdir(STATE_DIR):
        if name.startswith("sglang-") and name.endswith(".json"):
            doc = _json_file(os.path.join(STATE_DIR, name))
            last = doc.get("last") if isinstance(doc, dict) else None
            if isinstance(last, dict) and last.get("run") == run and last.get("outcome"):
                return {"step": "outcome", "phase": "end", "outcome": last["outcome"], "reasons": last.get("reasons"),
                        "message": last.get("message"), "from_history": True}
    return None


def transition_summary(run=None, lock=None):
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
    doc = {"run": run, "active": active, "step": (last or {}).get("step"), "phase": (last or {}).get("phase"),
           "target": (last or {}).get("target"), "began": first.get("t"), "updated": (last or first).get("t"),
           "ports": first.get("ports"), "by": first.get("by"),
           "desired": first.get("desired"), "from": first.get("from"), "outcome": None, "reasons": None,
           "message": None}
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


# ==================================================================================== history
def load_history(port):
    doc = _json_file(paths(port)["history"])
    if not isinstance(doc, dict) or doc.get("schema") != 2:
        return {"schema": 2, "port": int(port), "good": [], "failed": [], "last": None}
    doc.setdefault("good", [])
    doc.setdefault("failed", [])
    return doc


def save_history(port, doc):
    write_private(paths(port)["history"], json.dumps(doc, indent=1, sort_keys=True))


def make_record(spec, by=None, capacity=None, extra=None):
    """A history record of a spec: nothing secret (flags and argv redacted, env as names and
    hashes) plus what the controller's own record says (redacted again here)."""
    redactor = Redactor(spec_secrets(spec))
    flags = tuple(SECRET_FLAGS) + tuple(spec.get("secret_flags") or ())
    record = redactor.deep(dict(spec.get("record") or {}))
    env = spec.get("env") or {}
    record.update({"argv": redactor.deep(redact_argv(spec.get("argv") or [], flags)),
                   "argv_hash": argv_hash(spec.get("argv") or []), "env_names": sorted(env),
                   "env_hashes": dict((name, env_hash(value)) for name, value in sorted(env.items())),
                   "port": spec.get("port"), "gpus": spec.get("gpus"), "supervisor": spec.get("supervisor") or "process",
                   "key": spec_key(spec), "at": _now_iso(), "by": by})
    if capacity is not None:
        record["capacity"] = capacity
    if extra:
        record.update(redactor.deep(extra))
    return record


def public_history(doc):
    return {"good": [entry.get("record") for entry in doc.get("good") or []],
            "failed": list(doc.get("failed") or []), "last": doc.get("last")}


# ==================================================================================== observe
def observe(args):
    """Everything the controller plans from, in one read-only pass (docs/agent-protocol.md)."""
    began = time.time()
    port = int(args.get("port") or DEFAULT_PORT)
    files = paths(port)
    table = proc_table()
    own = _own_pids(table)
    history = load_history(port)
    redactor = Redactor()
    for entry in history.get("good") or []:
        redactor.add(spec_secrets(entry.get("spec")))
    env_file = _read(files["env"])
    if env_file:
        redactor.add(parse_env_file(env_file).values())
    secret_flags = tuple(SECRET_FLAGS) + tuple(args.get("secret_flags") or ())

    main, tree = find_server(table, port, own)
    gpu_doc = read_gpus(exclude=own)
    environ = proc_environ(main["pid"]) if main else None
    if main:
        redactor.add(secret_flag_values(main["argv"], secret_flags))
        redactor.add(list((environ or {}).get(name) for name in (args.get("env_names") or []) if environ))
    tree_set = set(tree)
    server = {"schema": SCHEMA, "port": port, "running": main is not None, "main": None,
              "tree": [_summary(table[pid], redactor) for pid in tree if pid in table],
              "strays": [], "clients": [], "listening": False, "listener_pids": [], "health": None,
              "server_info": None, "env_hashes": {}, "workers": None, "serving": False, "gpus": None}
    for proc in sorted(table.values(), key=lambda p: p["pid"]):
        if proc["pid"] in tree_set or proc["pid"] in own:
            continue
        if is_server_part(proc["argv"]):
            entry = _summary(proc, redactor)
            entry["port"] = argv_port(proc["argv"]) if is_main_argv(proc["argv"]) else None
            server["strays"].append(entry)
        elif is_client_argv(proc["argv"]):
            server["clients"].append(_summary(proc, redactor))
    inodes = listeners(port)
    server["listening"] = bool(inodes)
    server["listener_pids"] = socket_owners(inodes)
    host = argv_host(main["argv"]) if main else args.get("host") or "127.0.0.1"
    if main:
        uptime = float((_read("/proc/uptime") or "0").split()[0])
        server["main"] = {"pid": main["pid"], "pgid": main["pgid"], "state": main["state"],
                          "start_ticks": main["start_ticks"], "argv": redactor.deep(redact_argv(main["argv"], secret_flags)),
                          "argv_hash": argv_hash(main["argv"]),
                          "age_s": round(uptime - main["start_ticks"] / float(os.sysconf("SC_CLK_TCK")), 1),
                          "supervisor": _supervisor_of(main["pid"], port)}
        names = set(args.get("env_names") or [])
        names.update(name for entry in history.get("good") or [] for name in (entry.get("record") or {}).get("env_names") or [])
        server["env_hashes"] = dict((name, env_hash(environ[name]) if environ and name in environ else None)
                                    for name in sorted(names))
        gpus = server_gpus(main["argv"], environ, _gpu_uuids(gpu_doc))
        server["gpus"] = gpus
        server["workers"] = workers_of(table, tree, len(gpus) if gpus is not None else None)
    if inodes:
        main_argv = main["argv"] if main else []
        server["health"] = health(host, port, generate=bool(args.get("generate")), token=argv_token(main_argv))
        if server["health"]["health"] == 200:
            info = server_info(host, port, keys=args.get("info_keys") or INFO_KEYS, token=argv_token(main_argv, True))
            server["server_info"] = redactor.deep(info)
    else:
        server["health"] = {"health": None, "health_error": "port %d not listening" % port,
                            "health_generate": None, "health_generate_error": None}
    workers = server["workers"] or {}
    server["serving"] = bool(main and alive(main["pid"]) and (server["health"] or {}).get("health") == 200
                             and workers.get("expected") is not None and workers.get("dead") == 0
                             and not workers.get("zombies"))
    server["shm_stale"] = sorted(name for name in _listdir("/dev/shm") if name.startswith(SHM_PREFIXES))
    model_path = args.get("model_path")
    server["model_path_exists"] = os.path.exists(model_path) if model_path and model_path.startswith("/") else None
    tail = int(args.get("tail_lines") or 0)
    server["log_tail"] = [redactor.text(line) for line in server_log_tail(port, tail)] if tail else None
    lock = lock_status()
    server["lock"] = lock
    server["transition"] = redactor.deep(transition_summary(lock=lock))
    server["history"] = public_history(history)
    server["sglang_version"] = sglang_version()
    try:
        server["flag_table"] = flag_table_key()
    except Exception as error:  # noqa: BLE001 - a field, never a traceback
        server["flag_table"] = {"error": "%s: %s" % (type(error).__name__, error)}
    server["pid_file"] = read_pid_file(port)
    server["warnings"] = pump_warnings(server["pid_file"], main)
    if main is None:
        server["gpus"] = args.get("gpus")
    skip = tree_set | own
    container = {"free_mib": {LOG_DIR: free_mib(LOG_DIR if os.path.isdir(LOG_DIR) else "/var/log"),
                              STATE_DIR: free_mib(STATE_DIR if os.path.isdir(STATE_DIR) else "/var/lib")},
                 "pid1": pid1_comm(), "memory_limit_bytes": memory_limit_bytes(),
                 "port_holders": [{"pid": pid, "cmdline": redactor.text(" ".join(redact_argv(table.get(pid, {}).get("argv") or [])))[:300],
                                   "server": pid in tree_set} for pid in server["listener_pids"]],
                 "gpu_holders": gpu_holders(gpu_doc, skip, redactor)}
    server["elapsed_ms"] = round((time.time() - began) * 1000, 1)
    return {"sglang": server, "gpu": gpu_doc, "container": container,
            "agent": {"sha256": _self_sha(), "schema": SCHEMA, "pid": os.getpid()}}


def pump_warnings(recorded, main):
    """Warnings about the log pump of the server that runs (``recorded``: its pid file): a pump that
    is gone while the server it served runs means the server's output is lost from then on (its
    writes fail with EPIPE; SGLang logs through ``logging``, which drops them, and keeps serving).

    >>> pump_warnings({"pid": 1, "pump": {"pid": 999999999}, "log": "/l"}, {"pid": 1})[0][:38]
    'the log pump (pid 999999999) is gone: '
    """
    pump = (recorded or {}).get("pump")
    if not main or not isinstance(pump, dict) or (recorded or {}).get("pid") != main.get("pid"):
        return []
    if alive(pump.get("pid"), pump.get("start_ticks")):
        return []
    return ["the log pump (pid %s) is gone: the server's output is no longer written to %s (a restart "
            "starts a new one)" % (pump.get("pid"), recorded.get("log"))]


def _listdir(path):
    try:
        return os.listdir(path)
    except OSError:
        return []


def _self_sha():
    return globals().get("AGENT_SHA256")


def _supervisor_of(pid, port):
    cgroup = _read("/proc/%d/cgroup" % pid) or ""
    return "systemd" if paths(port)["unit_name"] in cgroup else "process"


def _current_log(port):
    recorded = read_pid_file(port) or {}
    return recorded.get("log") or paths(port)["log"]


# gpugate's own polls (the agent's load/verify/observe GETs from the container itself), as the server's
# access log (uvicorn) writes them: a never-healthy start's tail was 30 of 30 "GET /health ... 503".
_OWN_POLL = re.compile(r'(?:127\.0\.0\.1|::1|\[::1\]|localhost):\d+ - "GET (?:/health|/health_generate|'
                       r'/get_server_info|/server_info|/v1/models)(?:\?[^ "]*)? HTTP/[0-9.]+" \d{3}')
LOG_TAIL_SCAN = 4 * 1024 * 1024  # at most this much of a log is read backwards for a tail


def without_own_polls(lines):
    """``lines`` less the access-log lines of gpugate's own polls (any status), so a tail shows the
    server's own last words.

    >>> without_own_polls(['INFO:     127.0.0.1:4180 - "GET /health HTTP/1.1" 503', 'ValueError: x',
    ...                    'INFO:     10.0.0.7:5000 - "GET /health HTTP/1.1" 200'])
    ['ValueError: x', 'INFO:     10.0.0.7:5000 - "GET /health HTTP/1.1" 200']
    """
    return [line for line in lines if not _OWN_POLL.search(line)]


def log_tail(path, lines=40, offset=0):
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
        start, chunk, kept = end, 65536, []
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


def journal_tail(unit, lines=40, since=None):
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
                              env=BASE_ENV, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return without_own_polls(done.stdout[:LOG_TAIL_SCAN].decode("utf-8", "replace").splitlines())[:lines][::-1]


def journal_sync(timeout=5.0):
    """``journalctl --sync``: journald stores every message queued to it first (its sync signal is
    handled after the pending stream input), so what a dead server printed is readable afterwards."""
    import subprocess

    try:
        return subprocess.run(["journalctl", "--sync"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=BASE_ENV, timeout=timeout).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def server_log_tail(port, lines=40, offset=0):
    """The server's last log lines, unmasked: journald's for a unit of ours (the pid file says
    ``supervisor: systemd``; since its recorded start), else the log file from byte ``offset``."""
    recorded = read_pid_file(port) or {}
    if recorded.get("supervisor") == "systemd":
        return journal_tail(paths(port)["unit_name"], lines, recorded.get("started"))
    return log_tail(recorded.get("log") or paths(port)["log"], lines, offset)


def unit_exit_code(port):
    """How a unit's main process ended, as Popen.returncode says it (-N: killed by signal N); None
    when systemd does not say (it still runs, or no unit)."""
    ok, output = _systemctl("show", "-p", "ExecMainCode", "-p", "ExecMainStatus", paths(port)["unit_name"])
    shown = dict(line.split("=", 1) for line in output.splitlines() if "=" in line) if ok else {}
    code, status = shown.get("ExecMainCode", ""), shown.get("ExecMainStatus", "")
    if not status.isdigit() or code not in ("1", "2", "3"):  # CLD_EXITED, CLD_KILLED, CLD_DUMPED
        return None
    return int(status) if code == "1" else -int(status)


def crash_line(tail, port):
    """The line that says why a server ended: the last of its own, not systemd's about the unit
    (journald's tail may or may not hold "<unit>: Failed with result ..." yet), else the last.

    >>> crash_line(["ValueError: bad", "sglang-30000.service: Main process exited, code=exited"], 30000)
    'ValueError: bad'
    """
    prefix = paths(port)["unit_name"] + ": "
    own = [line for line in tail if line.strip() and not line.startswith(prefix)]
    return (own or [line for line in tail if line.strip()] or [""])[-1]


# ==================================================================================== env files
def env_file_text(env):
    """systemd EnvironmentFile syntax, double-quoted (read back by parse_env_file)."""
    lines = ["# written by gpugate; secrets live only here (mode 0600)"]
    for name, value in sorted(env.items()):
        lines.append('%s="%s"' % (name, value.replace("\\", "\\\\").replace('"', '\\"')))
    return "\n".join(lines) + "\n"


def parse_env_file(text):
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        if len(value) >= 2 and value[0] == value[-1] == '"':
            out, index, value = [], 0, value[1:-1]
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


# ==================================================================================== the transition
def _budgets(doc):
    budgets = dict(DEFAULT_BUDGETS)
    for key, value in (doc.get("budgets") or {}).items():
        if key in budgets and isinstance(value, (int, float)) and not isinstance(value, bool):
            budgets[key] = float(value)
    return budgets


def validate_spec(spec, what):
    """None or why a SpecDoc cannot be run."""
    if not isinstance(spec, dict):
        return "%s: not an object" % what
    argv = spec.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        return "%s: argv must be a non-empty list of strings" % what
    if not is_main_argv(argv):
        return "%s: argv is not an SGLang server (python -m sglang.launch_server / sglang serve)" % what
    port = spec.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        return "%s: port must be an integer 1..65535" % what
    if argv_port(argv) != port:
        return "%s: the argv's --port %s differs from port %d" % (what, argv_port(argv), port)
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


def validate_start(doc):
    if not isinstance(doc, dict):
        return "the start document is not a JSON object"
    if not RUN_ID.match(str(doc.get("run") or "")):
        return "run must match %s" % RUN_ID.pattern
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


class Transition:
    """One run of the state machine, to exactly one outcome (verified | rolled_back |
    nothing_serves; ``refused`` only when nothing was touched)."""

    def __init__(self, doc, journal, recovered=None):
        self.doc = doc
        self.run = doc["run"]
        self.by = doc.get("operator")
        self.journal = journal
        self.budgets = _budgets(doc)
        self.desired = doc.get("desired")
        self.replaces = doc.get("replaces")
        self.recovered = recovered
        self.redactor = Redactor(spec_secrets(self.desired) + spec_secrets(self.replaces)
                                 + (spec_secrets(doc.get("rollback_to")) if isinstance(doc.get("rollback_to"), dict) else []))
        self.port = (self.desired or {}).get("port") or int(doc.get("port") or DEFAULT_PORT)
        self.children = {}  # pid -> Popen of servers we started (reaped by us while we live)
        self.touched = False
        self.warnings = []
        self.rollback = None
        self.exit_codes = {}
        self.pumps = {}  # port -> the log pump of the server we started there

    # ------------------------------------------------------------------ journal helpers
    def event(self, step, phase, **fields):
        self.journal.write(self.redactor.deep(dict(step=step, phase=phase, **fields)))

    def progress(self, step, **fields):
        self.journal.progress(step, **self.redactor.deep(fields))

    # ------------------------------------------------------------------ entry
    def execute(self):
        try:
            result = self._execute()
        except BaseException as error:  # noqa: BLE001 - every path must end in an outcome
            reason = "agent error: %s: %s" % (type(error).__name__, error)
            try:
                if self.touched:
                    result = self._cleanup_outcome(reason, None)
                else:
                    result = ("refused", {"desired": reason}, "nothing was touched: " + reason)
            except BaseException as second:  # noqa: BLE001
                result = ("nothing_serves", {"desired": reason, "rollback": "cleanup failed: %s" % second},
                          "NOTHING SERVES")
        outcome, reasons, message = result
        self._record_last(outcome, reasons, message)
        self.event("outcome", "end", outcome=outcome, reasons=reasons, message=message,
                   warnings=self.warnings + ([("journal: " + self.journal.failed)] if self.journal.failed else []))
        return outcome

    def _execute(self):
        desired = self.desired
        capture = self._capture_running()
        self.rollback = self._resolve_rollback(capture)
        if self.rollback is not None:
            self.redactor.add(spec_secrets(self.rollback))
        self.event("plan", "end", rollback=make_record(self.rollback) if self.rollback else None)
        refusal = self._precheck()
        if refusal:
            return "refused", {"desired": refusal}, "refused before anything was touched: %s" % refusal
        # Converge: the desired server already runs (a recovered run left it loading, or a re-run).
        if desired and not self.doc.get("restart") and not self.replaces:
            running = self._running_exactly(desired)
            if running is not None:
                self.event("adopt", "end", pid=running, message="the desired server already runs; waiting for it")
                try:
                    self.touched = True
                    self._wait_ready(desired, running, "desired", log_offset=None)
                    info = self._verify(desired, running, "desired")
                    self._commit(desired, info)
                    return "verified", None, "the desired server serves (already running), verified"
                except Exception as error:  # noqa: BLE001 - ours too: every path after the stop ends in an outcome
                    return self._after_failure(_reason(error))
        try:
            if self.replaces:
                self._stop(self.replaces["port"], "replaces", self.budgets["drain_timeout_s"])
            self._stop(self.port, "desired", self.budgets["drain_timeout_s"])
            self._end_gpu_holders()
            if desired is None:
                return "verified", None, "no server on :%d, as desired" % self.port
            self._start_verified(desired, "desired")
            return "verified", None, "the desired server serves, verified"
        except Exception as error:  # noqa: BLE001 - a Failure, or an exception of our own: both roll back
            if not self.touched:
                raise
            return self._after_failure(_reason(error))

    def _after_failure(self, reason):
        self.event("failed", "end", target="desired", reason=reason)
        self._record_failed(reason)
        if self.rollback is None:
            return self._cleanup_outcome(reason, "nothing to roll back to (no good server recorded)")
        target = self.rollback
        self.event("rollback", "begin", reason=reason, to=make_record(target))
        try:
            self._stop(self.port, "rollback", self.budgets["kill_grace_s"])
            if target["port"] != self.port:
                self._stop(target["port"], "rollback", self.budgets["kill_grace_s"])
            self._start_verified(target, "rollback")
            self.event("rollback", "end", ok=True)
            return ("rolled_back", {"desired": reason},
                    "the desired server failed (%s); the previous server serves again, verified" % reason)
        except Exception as error:  # noqa: BLE001
            self.event("rollback", "end", ok=False, reason=_reason(error))
            return self._cleanup_outcome(reason, "rollback failed: %s" % _reason(error))

    def _cleanup_outcome(self, reason, rollback_reason):
        notes = []
        ports = sorted(set([self.port] + [s["port"] for s in (self.replaces, self.rollback) if s]))
        for port in ports:
            try:
                self._stop(port, "cleanup", self.budgets["kill_grace_s"])
            except Failure as failure:
                notes.append(str(failure))
            except Exception as error:  # noqa: BLE001
                notes.append("cleanup of :%d: %s" % (port, error))
        reasons = {"desired": reason, "rollback": rollback_reason or "no rollback"}
        message = "NOTHING SERVES: the desired server failed (%s); %s" % (reason, reasons["rollback"])
        if notes:
            message += "; cleanup: " + "; ".join(notes)
        return "nothing_serves", reasons, message

    # ------------------------------------------------------------------ before the stop
    def _precheck(self):
        """What can be refused before anything is touched (the controller checked too; this
        catches what changed in between)."""
        desired = self.desired
        if desired is None:
            return None
        if desired.get("supervisor") == "systemd" and pid1_comm() != "systemd":
            return "supervisor systemd, but PID 1 is %s, not systemd" % pid1_comm()
        model = _flag_value(desired["argv"], "--model-path", "--model")
        if model and model.startswith("/") and not os.path.exists(model):
            return "the model path %s does not exist" % model
        table = proc_table()
        inodes = listeners(desired["port"])
        if inodes:
            replaced = set()
            for port in set([desired["port"]] + ([self.replaces["port"]] if self.replaces else [])):
                main, tree = find_server(table, port)
                replaced.update(tree)
            others = [pid for pid in socket_owners(inodes) if pid not in replaced and not is_server_part(table.get(pid, {}).get("argv"))]
            if others:
                return "port %d is taken by %s" % (desired["port"], ", ".join(
                    "%d (%s)" % (pid, self.redactor.text(" ".join(table.get(pid, {}).get("argv") or []))[:80]) for pid in others))
        return None

    def _running_exactly(self, spec):
        """The pid of a main process that runs exactly ``spec`` (argv and env), else None."""
        table = proc_table()
        main, _ = find_server(table, spec["port"])
        if main is None or main["argv"] != spec["argv"]:
            return None
        environ = proc_environ(main["pid"]) or {}
        for name, value in (spec.get("env") or {}).items():
            if environ.get(name) != value:
                return None
        gpus = spec.get("gpus") if spec.get("gpus") is not None else server_gpus(spec["argv"], spec.get("env"))
        tree = [main["pid"]] + descendants(table, main["pid"])
        workers = workers_of(table, tree, len(gpus) if gpus is not None else None)
        if workers["zombies"] or (workers["alive"] and workers["dead"]):
            return None  # it loaded once and lost a worker: restart it, do not wait for it
        if listeners(spec["port"]) and health(argv_host(spec["argv"]), spec["port"], token=argv_token(spec["argv"]))["health"] != 200:
            return None  # bound but not healthy: draining (a SIGTERM of an earlier run) or broken, not loading
        return main["pid"]

    def _capture_running(self):
        """The exact spec of the server that runs now on the port being replaced (argv from /proc,
        env from the history entry it matches, else from its environment), before we stop it."""
        port = (self.replaces or {}).get("port") or self.port
        table = proc_table()
        main, tree = find_server(table, port)
        if main is None:
            return None
        environ = proc_environ(main["pid"]) or {}
        history = load_history(port)
        for entry in history.get("good") or []:
            spec = entry.get("spec") or {}
            if spec.get("argv") == main["argv"] and all(environ.get(k) == v for k, v in (spec.get("env") or {}).items()):
                return dict(spec, _history=True)
        env = self._env_we_gave(port, main, environ)
        source = "captured from the running server"
        if env is None:
            # Not started by us (e.g. by hand over SSH): its environment is a login session's; keep
            # only what SGLang reads, so neither the record's secrets nor a rollback get USER, SSH_*...
            env = adopted_env(environ, list((self.desired or {}).get("env") or ()), main["argv"])
            source = "adopted: a server gpugate did not start"
        supervisor = _supervisor_of(main["pid"], port)
        spec = {"argv": list(main["argv"]), "env": env, "port": port, "supervisor": supervisor,
                "gpus": server_gpus(main["argv"], environ), "record": {"source": source}}
        if supervisor == "systemd":
            spec["unit_text"] = _read(paths(port)["unit"]) or ""
        # A server that serves when we find it was good: keep it as such (it may be all there is to
        # roll back to, e.g. a server started by hand before gpugate).
        gpus = spec["gpus"]
        workers = workers_of(table, tree, len(gpus) if gpus is not None else None)
        if health(argv_host(main["argv"]), port, token=argv_token(main["argv"]))["health"] == 200 and workers["dead"] == 0:
            spec["_serving"] = True
            self._add_good(spec, None, by="observed serving")
        return spec

    @staticmethod
    def _env_we_gave(port, main, environ):
        """The env of a server we started (our pid file names it and every value of our env file is
        in its environment): the env file's, exactly. None for a server we did not start."""
        recorded = read_pid_file(port) or {}
        if recorded.get("pid") != main["pid"] or recorded.get("start_ticks") not in (None, main["start_ticks"]):
            return None
        text = _read(paths(port)["env"])
        if text is None:
            return None
        env = parse_env_file(text)
        if any(environ.get(name) != value for name, value in env.items()):
            return None
        return env

    def _resolve_rollback(self, capture):
        choice = self.doc.get("rollback_to")
        if choice is None:
            return None
        if isinstance(choice, dict) and "argv" in choice:
            return choice
        if isinstance(choice, dict) and choice.get("running"):
            return _clean_spec(capture)
        port = (self.replaces or {}).get("port") or self.port
        good = load_history(port).get("good") or []
        if isinstance(choice, dict) and "history" in choice:
            want = choice["history"]
            for index, entry in enumerate(good):
                if want == index or want == (entry.get("record") or {}).get("key") or want == entry.get("key"):
                    return _clean_spec(entry.get("spec"))
            return None
        # "auto": the server that runs now if it served, else the newest good spec unlike the desired one
        if capture is not None and capture.get("_serving"):
            return _clean_spec(capture)
        desired_key = spec_key(self.desired) if self.desired else None
        for entry in good:
            if entry.get("key") != desired_key:
                return _clean_spec(entry.get("spec"))
        if self.recovered and self.recovered.get("rollback"):
            return _clean_spec(self.recovered["rollback"])
        return None

    # ------------------------------------------------------------------ stop
    def _stop(self, port, target, drain_timeout_s):
        """Drain (SIGTERM, up to ``drain_timeout_s``), SIGKILL what is left of the server's own
        tree, sweep stray server parts of this port / holding this server's GPUs."""
        table = proc_table()
        own = _own_pids(table)
        main, tree = find_server(table, port, own)
        snapshot = dict((pid, table[pid]["start_ticks"]) for pid in tree if pid in table)
        spec_gpus = self._gpus_for_port(port)
        began = time.time()
        self.event("stop", "begin", target=target, port=port,
                   main=main["pid"] if main else None, tree=len(snapshot))
        if main is not None:
            self.touched = True
            self._systemd_stop(port)
            try:
                os.kill(main["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass
            self.event("drain", "begin", target=target, port=port, pid=main["pid"], timeout_s=drain_timeout_s)
            deadline = began + float(drain_timeout_s)
            while alive(main["pid"], main["start_ticks"]) and time.time() < deadline:
                self._reap()
                self.progress("drain", target=target, port=port, elapsed_s=round(time.time() - began, 1),
                              alive=sum(1 for pid, t in snapshot.items() if alive(pid, t)))
                time.sleep(DRAIN_POLL_S)
            drained = not alive(main["pid"], main["start_ticks"])
            self.event("drain", "end", target=target, port=port, drained=drained,
                       elapsed_s=round(time.time() - began, 2))
        # Kill: what is left of the tree (children spawned since the snapshot included).
        table = proc_table()
        targets = dict((pid, ticks) for pid, ticks in snapshot.items() if alive(pid, ticks))
        if main is not None and alive(main["pid"], main["start_ticks"]):
            for pid in descendants(table, main["pid"]):
                if pid in table and pid not in own:
                    targets[pid] = table[pid]["start_ticks"]
        if targets:
            self.touched = True
            self.event("kill", "begin", target=target, port=port, pids=sorted(targets))
            for pid in targets:
                _kill(pid, targets[pid])
        # Sweep: stray server parts of this port or on this server's GPUs (never clients).
        strays = self._strays(port, spec_gpus, set(targets) | own)
        if strays:
            self.touched = True
            self.event("sweep", "begin", target=target, port=port,
                       pids=[{"pid": pid, "why": why} for pid, (_, why) in sorted(strays.items())])
            for pid, (ticks, _) in strays.items():
                _kill(pid, ticks)
        waiting = dict(targets)
        waiting.update((pid, ticks) for pid, (ticks, _) in strays.items())
        deadline = time.time() + float(self.budgets["kill_grace_s"])
        while waiting and time.time() < deadline:
            self._reap()
            waiting = dict((pid, t) for pid, t in waiting.items() if alive(pid, t))
            if waiting:
                time.sleep(DRAIN_POLL_S)
        if targets or strays:
            self.event("kill", "end", target=target, port=port, killed=sorted(targets),
                       swept=sorted(strays), survivors=sorted(waiting))
        self._remove_pid_file(port)
        self.event("stop", "end", target=target, port=port, elapsed_s=round(time.time() - began, 2),
                   stopped=main is not None)
        if waiting:
            table = proc_table()
            raise Failure("processes outlived SIGKILL on :%d: %s" % (port, ", ".join(
                "%d (%s, state %s)" % (pid, " ".join(table.get(pid, {}).get("argv") or [])[:60],
                                       table.get(pid, {}).get("state")) for pid in sorted(waiting))))

    def _end_gpu_holders(self):
        """``end_gpu_holders``: the GPU holders the operator was shown and agreed to end
        ([{pid, start_ticks}] from observe's container.gpu_holders): SIGTERM, ``kill_grace_s``,
        SIGKILL. A pid that is now another process (start time differs) is left alone."""
        wanted = [item if isinstance(item, dict) else {"pid": item} for item in self.doc.get("end_gpu_holders") or []]
        if not wanted:
            return
        own = _own_pids(proc_table())
        targets = dict((int(item["pid"]), item.get("start_ticks")) for item in wanted
                       if int(item["pid"]) not in own and int(item["pid"]) > 1 and alive(int(item["pid"]), item.get("start_ticks")))
        targets = dict((pid, ticks if ticks is not None else (proc_stat(pid) or (None,) * 5)[4])
                       for pid, ticks in targets.items())
        self.event("end_holders", "begin", pids=sorted(targets))
        for pid, ticks in targets.items():
            if alive(pid, ticks):
                try:
                    os.kill(pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.time() + float(self.budgets["kill_grace_s"])
        while time.time() < deadline and any(alive(pid, t) for pid, t in targets.items()):
            time.sleep(DRAIN_POLL_S)
        killed = [pid for pid, t in targets.items() if alive(pid, t)]
        for pid in killed:
            _kill(pid, targets[pid])
        self.event("end_holders", "end", terminated=sorted(set(targets) - set(killed)), killed=sorted(killed))

    def _gpus_for_port(self, port):
        for spec in (self.desired, self.replaces, self.rollback):
            if spec and spec.get("port") == port and spec.get("gpus") is not None:
                return set(spec["gpus"])
        return None

    def _strays(self, port, gpus, skip):
        """pid -> (start ticks, why) of server parts outside any live tree we keep: a main of this
        port, a part listening on it, or an orphaned part holding memory on this server's GPUs."""
        table = proc_table()
        own = _own_pids(table)
        out = {}
        inodes = listeners(port)
        holders_on = {}
        orphans = [p for p in table.values() if is_worker_argv(p["argv"]) and p["pid"] not in skip
                   and not any(is_main_argv(table[a]["argv"]) for a in ancestors(table, p["pid"]) if a in table and a != p["pid"])]
        if orphans and (gpus is None or gpus):  # a GPU reading only when an orphaned part might hold ours
            doc = read_gpus(exclude=own)
            for holder in doc.get("holders") or []:
                holders_on[holder["pid"]] = set(holder.get("gpus") or [])
            on_devices = dict((h["pid"], set(int(d[len("/dev/nvidia"):]) for d in h.get("devices") or []
                                             if d[len("/dev/nvidia"):].isdigit())) for h in doc.get("holders") or [])
        else:
            on_devices = {}
        listening = set(socket_owners(inodes)) if inodes else set()
        live_mains = dict((p["pid"], argv_port(p["argv"])) for p in table.values()
                          if is_main_argv(p["argv"]) and p["state"] not in ("Z", "X") and p["pid"] not in skip)
        for proc in table.values():
            pid = proc["pid"]
            if pid in skip or pid in own or pid == 1 or proc["state"] in ("Z", "X") or not is_server_part(proc["argv"]):
                continue
            why = None
            if is_main_argv(proc["argv"]) and argv_port(proc["argv"]) == port:
                why = "a server main configured for :%d" % port
            elif pid in listening:
                why = "listens on :%d" % port
            else:
                owner_ports = [live_mains[a] for a in ancestors(table, pid) if a in live_mains and a != pid]
                if owner_ports and port in owner_ports:
                    why = "a part of the :%d server" % port
                elif not owner_ports and not is_main_argv(proc["argv"]):
                    mem = holders_on.get(pid, set())
                    dev = on_devices.get(pid, set())
                    if gpus is None and (mem or dev):
                        why = "an orphaned server part holding GPUs"
                    elif gpus and (mem & gpus or dev & gpus):
                        why = "an orphaned server part holding GPU(s) %s of this server" % sorted((mem | dev) & gpus)
            if why:
                out[pid] = (proc["start_ticks"], why)
        return out

    def _systemd_stop(self, port):
        if pid1_comm() != "systemd" or not os.path.exists(paths(port)["unit"]):
            return
        import subprocess

        subprocess.run(["systemctl", "stop", "--no-block", paths(port)["unit_name"]], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)

    def _remove_pid_file(self, port):
        try:
            os.unlink(paths(port)["pid"])
        except OSError:
            pass

    def _reap(self):
        for pid, child in list(self.children.items()):
            if child.poll() is not None:
                self.children.pop(pid, None)
                self.exit_codes[pid] = child.returncode

    # ------------------------------------------------------------------ gate, prepare, start, load, verify
    def _start_verified(self, spec, target):
        self._gate(spec, target)
        self._prepare(spec, target)
        pid, offset = self._start(spec, target)
        self._wait_ready(spec, pid, target, offset)
        info = self._verify(spec, pid, target)
        self._commit(spec, info, rollback=target == "rollback")

    def _gate(self, spec, target):
        gpus = spec.get("gpus")
        max_used = int(self.budgets["max_used_mib"])
        began = time.time()
        deadline = began + self.budgets["gate_timeout_s"]
        self.event("gate", "begin", target=target, gpus=gpus, max_used_mib=max_used)
        polls = 0
        while True:
            doc = read_gpus(keep_open=True, exclude=_own_pids(proc_table()))
            polls += 1
            passed, problems, used, permanent = gate_decision(doc, gpus, max_used)
            if passed:
                self.event("gate", "end", target=target, passed=True, used_mib=used, polls=polls,
                           elapsed_s=round(time.time() - began, 3),
                           monitors=[h["pid"] for h in doc.get("holders") or [] if not h.get("gpus")])
                return
            if permanent or time.time() >= deadline:
                self.event("gate", "end", target=target, passed=False, used_mib=used, problems=problems,
                           elapsed_s=round(time.time() - began, 3))
                raise Failure("GPU gate did not pass within %gs: %s" % (self.budgets["gate_timeout_s"], "; ".join(problems)))
            self.progress("gate", target=target, elapsed_s=round(time.time() - began, 1), used_mib=used,
                          problems=problems[:4])
            time.sleep(GATE_POLL_S)

    def _prepare(self, spec, target):
        port = spec["port"]
        self.event("prepare", "begin", target=target, port=port)
        removed = remove_stale_shm()
        inodes = listeners(port)
        if inodes:
            table = proc_table()
            owners = socket_owners(inodes)
            raise Failure("port %d is taken by %s" % (port, ", ".join(
                "%d (%s)" % (pid, self.redactor.text(" ".join(table.get(pid, {}).get("argv") or []))[:80])
                for pid in owners) or "a process outside this container's view"))
        try:
            _makedirs(ETC_DIR, 0o700)
            write_private(paths(port)["env"], env_file_text(spec.get("env") or {}))
        except OSError as error:
            text = "cannot write the env file %s: %s" % (paths(port)["env"], error.strerror or error)
            if target != "rollback" or spec.get("supervisor") == "systemd":
                raise Failure(text)
            # the process supervisor passes the environment itself: the previous server can come back
            self.warnings.append(text)
        if spec.get("supervisor") == "systemd":
            if pid1_comm() != "systemd":
                raise Failure("supervisor systemd, but PID 1 is %s, not systemd" % pid1_comm())
            try:
                write_private(paths(port)["unit"], spec["unit_text"], 0o600)
            except OSError as error:
                raise Failure("cannot write the unit %s: %s" % (paths(port)["unit"], error.strerror or error))
        elif pid1_comm() == "systemd" and os.path.exists(paths(port)["unit"]):
            _systemctl("disable", paths(port)["unit_name"])  # a unit of ours would restart an old server
        self.event("prepare", "end", target=target, port=port, removed_shm=removed)

    def _start(self, spec, target):
        port = spec["port"]
        self.touched = True
        self.event("start", "begin", target=target, port=port, supervisor=spec.get("supervisor") or "process",
                   argv=redact_argv(spec["argv"], tuple(SECRET_FLAGS) + tuple(spec.get("secret_flags") or ())))
        if spec.get("supervisor") == "systemd":
            pid = self._start_systemd(spec, target)
            offset = None
        else:
            pid, offset = self._start_process(spec, target)
        self.event("start", "end", target=target, port=port, pid=pid)
        return pid, offset

    def _open_log(self, port, target):
        """The server's log (0600, rotated by size); on ENOSPC the rotated files go first, and a
        rollback may fall back to /run so that a full /var/log cannot keep the old server down."""
        log_path = paths(port)["log"]
        header = None
        try:
            _makedirs(LOG_DIR, 0o750)
            rotate_log(log_path)
            handle = _open_private_append(log_path)
            return handle, log_path
        except OSError as error:
            header = error
            if error.errno == errno.ENOSPC:
                for index in range(LOG_KEEP, 0, -1):
                    try:
                        os.unlink("%s.%d" % (log_path, index))
                    except OSError:
                        pass
        if target == "rollback":
            fallback = paths(port)["fallback_log"]
            try:
                _makedirs(RUN_DIR, 0o755)
                self.warnings.append("server log on %s (%s: %s)" % (fallback, log_path, header))
                return _open_private_append(fallback), fallback
            except OSError:
                pass
        raise Failure("cannot write the server log %s: %s" % (log_path, getattr(header, "strerror", None) or header))

    def _start_process(self, spec, target):
        import subprocess

        port = spec["port"]
        handle, log_path = self._open_log(port, target)
        flags = tuple(SECRET_FLAGS) + tuple(spec.get("secret_flags") or ())
        try:
            offset = handle.seek(0, 2)
            line = "\n=== gpugate start %s run %s (%s): %s\n" % (_now_iso(), self.run, target,
                                                               self.redactor.text(" ".join(redact_argv(spec["argv"], flags))))
            handle.write(line.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        except OSError as error:
            handle.close()
            if target == "rollback" and log_path != paths(port)["fallback_log"]:
                handle = _open_private_append(paths(port)["fallback_log"])
                log_path = paths(port)["fallback_log"]
                offset = handle.seek(0, 2)
                self.warnings.append("server log on %s (%s)" % (log_path, error))
            else:
                raise Failure("cannot write the server log %s: %s" % (log_path, error.strerror or error))
        env = dict(BASE_ENV)
        env.update(spec.get("env") or {})
        output = self._log_pump(log_path, spec) or handle
        try:
            child = subprocess.Popen(spec["argv"], stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                     env=env, cwd="/", start_new_session=True, close_fds=True)
        except OSError as error:
            raise Failure("cannot start %s: %s" % (spec["argv"][0], error))
        finally:
            handle.close()
            if output is not handle:
                os.close(output)
        self.children[child.pid] = child
        stat = proc_stat(child.pid)
        record = {"pid": child.pid, "start_ticks": stat[4] if stat else None, "port": port, "log": log_path,
                  "supervisor": "process", "run": self.run, "started": time.time()}
        pump = self.pumps.get(port) if output is not handle else None
        if pump is not None:  # observe warns when it is gone while the server runs (pump_warnings)
            pump_stat = proc_stat(pump.pid)
            record["pump"] = {"pid": pump.pid, "start_ticks": pump_stat[4] if pump_stat else None}
        try:
            write_private(paths(port)["pid"], json.dumps(record), 0o644)
        except OSError as error:
            raise Failure("cannot write the pid file %s: %s" % (paths(port)["pid"], error))
        return child.pid, offset

    def _log_pump(self, log_path, spec):
        """The write end of a pipe into a log pump (``logpump``: its own session, outliving us; it
        masks the secret values in every line and rotates the log by size while the server runs).
        None when it cannot start: the server then writes the file itself (rotated only at starts)."""
        import subprocess

        program = os.path.abspath(globals().get("__file__") or "")
        if not os.path.isfile(program):
            return None
        read_fd, write_fd = os.pipe()
        secrets = spec_secrets(spec) + list(self.redactor.values)
        # Its arguments travel in the environment and the interpreter is named /proc/self/exe, so its
        # command line never names sglang (the log path, a venv's path): an operator's `pkill -f sglang`
        # ends the server, never the pump that still has to write the server's last lines.
        env = dict(BASE_ENV, GPUGATE_LOG_SECRETS=json.dumps(sorted(set(secrets))),
                   GPUGATE_LOGPUMP=json.dumps({"path": log_path}))
        try:
            pump = subprocess.Popen(["/proc/self/exe", program, "logpump", PROBE_MARKER],
                                    stdin=read_fd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                    cwd="/", start_new_session=True, close_fds=True)
        except OSError as error:
            self.warnings.append("log pump: %s" % error)
            os.close(write_fd)
            return None
        finally:
            os.close(read_fd)
        self.children[pump.pid] = pump
        self.pumps[spec["port"]] = pump
        return write_fd

    def _start_systemd(self, spec, target):
        unit = paths(spec["port"])["unit_name"]
        handle, _ = self._open_log(spec["port"], target)  # 0600 before systemd appends to it
        handle.close()
        started = time.time()  # the unit logs to journald: its tail is read from here on (journal_tail)
        for command in (["daemon-reload"], ["reset-failed", unit], ["start", unit]):
            ok, output = _systemctl(*command)
            if not ok and command[0] != "reset-failed":
                raise Failure("systemctl %s: %s" % (" ".join(command), self.redactor.text(output)[-300:]))
        ok, output = _systemctl("show", "-p", "MainPID", "--value", unit)
        pid = int(output.strip() or 0) if output.strip().isdigit() else 0
        if pid <= 0:
            journal_sync()  # journald stores what the unit printed
            tail = [self.redactor.text(line) for line in journal_tail(unit, 20, started)]
            raise Failure("%s has no main process after systemctl start%s" % (
                unit, ": " + crash_line(tail, spec["port"]) if tail else ""))
        stat = proc_stat(pid)
        write_private(paths(spec["port"])["pid"], json.dumps({"pid": pid, "start_ticks": stat[4] if stat else None,
                                                              "port": spec["port"], "supervisor": "systemd",
                                                              "log": paths(spec["port"])["log"], "run": self.run,
                                                              "started": started}), 0o644)
        return pid

    def _wait_ready(self, spec, pid, target, log_offset):
        """loading (port closed) -> starting (/health 503) -> ready (/health 200 and a real
        generation through /health_generate). Fails when the main process exits, or at the
        start timeout."""
        port, host = spec["port"], argv_host(spec["argv"])
        began = time.time()
        timeout = self.budgets["start_timeout_s"]
        if target == "rollback" and self.budgets.get("rollback_start_timeout_s"):
            timeout = self.budgets["rollback_start_timeout_s"]
        deadline = began + timeout
        ticks = (proc_stat(pid) or (None,) * 5)[4]
        phase = "loading"
        self.event("load", "begin", target=target, port=port, pid=pid, timeout_s=timeout)
        while True:
            self._reap()
            if not alive(pid, ticks):
                code = self.exit_codes.get(pid)
                if code is None and spec.get("supervisor") == "systemd":
                    code = unit_exit_code(port)
                self._settle_log(port)
                tail = self._tail(port, log_offset)
                self.event("load", "end", target=target, port=port, state="crashed", exit_code=code,
                           elapsed_s=round(time.time() - began, 2), log_tail=tail)
                raise Failure("the server exited during %s%s%s" % (
                    phase, " with code %s" % code if code is not None else "",
                    ": " + crash_line(tail, port) if tail else ""))
            if listeners(port):
                status, _ = http_get(host, port, "/health", 5.0, argv_token(spec["argv"]))
                phase = "starting" if status != 200 else "generating"
                if status == 200:
                    generated, error = http_get(host, port, "/health_generate", self.budgets["generate_timeout_s"],
                                                argv_token(spec["argv"]))
                    if generated == 200:
                        self.event("load", "end", target=target, port=port, state="ready",
                                   elapsed_s=round(time.time() - began, 2))
                        return
            else:
                phase = "loading"
            if time.time() >= deadline:
                tail = self._tail(port, log_offset)
                self.event("load", "end", target=target, port=port, state="timeout", last_state=phase,
                           elapsed_s=round(time.time() - began, 2), log_tail=tail)
                raise Failure("the server was not healthy within %gs (still %s)" % (timeout, phase))
            self.progress("load", target=target, port=port, state=phase, elapsed_s=round(time.time() - began, 1))
            time.sleep(LOAD_POLL_S)

    def _settle_log(self, port, timeout=1.0):
        """Give the log pump up to ``timeout`` to write what a crashed server printed last (it ends
        at EOF, once the server's tree has closed the pipe); for a unit, give journald as long to
        store it (its tail unchanged over 0.2 s)."""
        pump = self.pumps.get(port)
        deadline = time.time() + timeout
        while pump is not None and pump.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        if pump is None and (read_pid_file(port) or {}).get("supervisor") == "systemd":
            if journal_sync():
                return
            last = None  # no sync (journalctl refused it): until the tail stays the same for 0.3 s
            deadline = time.time() + 3 * timeout
            while time.time() < deadline:
                tail = server_log_tail(port, 5)
                if tail and tail == last:
                    break
                last = tail
                time.sleep(0.3)

    def _tail(self, port, offset, lines=20):
        return [self.redactor.text(line) for line in server_log_tail(port, lines, offset)]

    def _verify(self, spec, pid, target):
        self.event("verify", "begin", target=target, port=spec["port"])
        problems = []
        argv = proc_argv(pid)
        if argv != spec["argv"]:
            problems.append("the running argv differs from the desired argv")
        table = proc_table()
        tree = [pid] + descendants(table, pid)
        gpus = spec.get("gpus")
        if gpus is None:
            gpus = server_gpus(spec["argv"], spec.get("env"))
        workers = workers_of(table, tree, len(gpus) if gpus is not None else None)
        if workers["expected"] is not None and (workers["alive"] < workers["expected"] or workers["zombies"]):
            problems.append("%d of %d scheduler workers alive" % (workers["alive"], workers["expected"]))
        info = server_info(argv_host(spec["argv"]), spec["port"], timeout=10.0, token=argv_token(spec["argv"], True))
        args = info.get("args") or {}
        if info.get("status") in (401, 403):
            self.warnings.append("verify: /get_server_info %s; the argv was verified from /proc" % info["error"])
        elif info.get("error"):
            problems.append("server info: %s" % info["error"])
        else:
            expect = {"port": spec["port"]}
            model = _flag_value(spec["argv"], "--model-path", "--model")
            if model:
                expect["model_path"] = model
            expect.update(spec.get("expect_info") or {})
            for key, value in sorted(expect.items()):
                if key in args and args[key] != value:
                    problems.append("%s: the server reports %r, expected %r" % (key, args[key], value))
        capacity = dict((key, args[key]) for key in ("max_total_num_tokens", "max_running_requests", "context_length",
                                                     "version") if key in args)
        self.event("verify", "end", target=target, port=spec["port"], ok=not problems, problems=problems,
                   workers=workers, capacity=capacity)
        if problems:
            raise Failure("verify: " + "; ".join(problems))
        return capacity

    # ------------------------------------------------------------------ history
    def _commit(self, spec, capacity, rollback=False):
        added = self._add_good(spec, capacity, by=self.by)
        self.event("commit", "end", target="rollback" if rollback else "desired", port=spec["port"], added=added,
                   key=spec_key(spec))

    def _add_good(self, spec, capacity, by):
        """Newest first, at most HISTORY_GOOD; the same spec again moves to the front without
        adding (a same-spec restart adds nothing). Best-effort: a full disk is a warning."""
        spec = _clean_spec(spec)
        port = spec["port"]
        try:
            doc = load_history(port)
            key = spec_key(spec)
            good = doc.get("good") or []
            same = [entry for entry in good if entry.get("key") == key]
            if good and good[0].get("key") == key:
                if capacity:
                    good[0]["record"]["capacity"] = capacity
                    save_history(port, doc)
                return False
            record = make_record(spec, by=by, capacity=capacity)
            rest = [entry for entry in good if entry.get("key") != key]
            doc["good"] = ([{"key": key, "spec": spec, "record": record}] + rest)[:HISTORY_GOOD]
            save_history(port, doc)
            return not same
        except OSError as error:
            self.warnings.append("history not written: %s" % error)
            return False

    def _record_failed(self, reason):
        if not self.desired:
            return
        port = self.desired["port"]
        try:
            doc = load_history(port)
            record = make_record(self.desired, by=self.by)
            record.update({"reason": self.redactor.text(reason), "run": self.run})
            doc["failed"] = ([record] + (doc.get("failed") or []))[:HISTORY_FAILED]
            save_history(port, doc)
        except OSError as error:
            self.warnings.append("history not written: %s" % error)

    def _record_last(self, outcome, reasons, message):
        ports = sorted(set([self.port] + [s["port"] for s in (self.replaces, self.rollback) if s]))
        for port in ports:
            try:
                doc = load_history(port)
                doc["last"] = self.redactor.deep({"run": self.run, "outcome": outcome, "reasons": reasons,
                                                  "message": message, "at": _now_iso(), "by": self.by})
                save_history(port, doc)
            except OSError as error:
                self.warnings.append("history not written: %s" % error)


def _reason(error):
    """What the operator reads for a failure: a Failure's own text, else the exception named."""
    if isinstance(error, Failure):
        return str(error)
    if isinstance(error, OSError) and error.strerror:
        return "agent error: %s (%s)" % (error.strerror, error.filename or type(error).__name__)
    return "agent error: %s: %s" % (type(error).__name__, error)


def _clean_spec(spec):
    if not spec:
        return None
    return dict((key, value) for key, value in spec.items() if not key.startswith("_"))


def gate_decision(doc, gpus, max_used_mib):
    """(passed, problems, used MiB per GPU, permanent) for this server's GPUs (None: every GPU).
    A holder with memory on one of them blocks; one that only holds the device files (an NVML
    monitor at 0 MiB) does not.

    >>> gate_decision({"source": "nvml", "gpus": [{"index": 0, "used_mib": 0}], "holders": []}, [0], 64)[0]
    True
    """
    problems, used = [], {}
    errors = doc.get("errors") or []
    permanent = any(error.get("kind") in PERMANENT_GPU_ERRORS for error in errors)
    if doc.get("source") in (None, "none"):
        kinds = set(error.get("kind") for error in errors)
        permanent = permanent or ("ModuleNotFound" in kinds and any(e.get("source") == "nvidia-smi" for e in errors))
        return False, ["no GPU reading: %s" % "; ".join(str(e.get("message"))[:120] for e in errors)], used, permanent
    by_index = dict((gpu.get("index"), gpu) for gpu in doc.get("gpus") or [])
    wanted = sorted(by_index) if gpus is None else sorted(gpus)
    if not wanted:
        return False, ["no GPU visible"], used, True
    for index in wanted:
        gpu = by_index.get(index)
        if gpu is None:
            problems.append("GPU %d is not visible" % index)
            permanent = True
            continue
        used[str(index)] = gpu.get("used_mib")
        if gpu.get("error"):
            problems.append("GPU %d: %s" % (index, gpu["error"]))
        elif gpu.get("used_mib") is None:
            problems.append("GPU %d: memory use unknown (%s)" % (index, "v1 API: reserved memory counted in"
                                                                 if doc.get("memory_api") == "v1" else "no reading"))
            permanent = permanent or doc.get("memory_api") == "v1"
        elif gpu["used_mib"] > max_used_mib:
            problems.append("GPU %d: %d MiB used (> %d)" % (index, gpu["used_mib"], max_used_mib))
    for holder in doc.get("holders") or []:
        on = set(holder.get("gpus") or []) & set(wanted)
        if on and holder.get("state") not in ("Z", "X") and (holder.get("used_mib") is None or holder["used_mib"] > 0):
            problems.append("pid %d (%s) holds memory on GPU %s" % (holder["pid"], (holder.get("cmdline") or "")[:60],
                                                                   ",".join(str(i) for i in sorted(on))))
    return not problems, problems, used, permanent and bool(problems)


def remove_stale_shm():
    """SGLang's /dev/shm segments that no live process maps or holds open (a SIGKILLed server
    leaves them; a live server of another port keeps its own)."""
    names = [name for name in _listdir("/dev/shm") if name.startswith(SHM_PREFIXES)]
    if not names:
        return []
    in_use = set()
    for pid in _listdir("/proc"):
        if not pid.isdigit():
            continue
        for line in (_read("/proc/%s/maps" % pid) or "").splitlines():
            if "/dev/shm/" in line:
                in_use.add(line.rsplit("/dev/shm/", 1)[1].split()[0])
        try:
            for fd in os.listdir("/proc/%s/fd" % pid):
                target = os.readlink("/proc/%s/fd/%s" % (pid, fd))
                if target.startswith("/dev/shm/"):
                    in_use.add(target[len("/dev/shm/"):].split()[0])
        except OSError:
            continue
    removed = []
    for name in names:
        if name not in in_use:
            try:
                os.unlink(os.path.join("/dev/shm", name))
                removed.append(name)
            except OSError:
                pass
    return removed


def rotate_log(path, max_bytes=LOG_MAX_BYTES, keep=LOG_KEEP):
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


def _open_private_append(path):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)  # an older log may be 0644, and it holds what the server prints
    return os.fdopen(fd, "ab")


def _systemctl(*args):
    import subprocess

    try:
        done = subprocess.run(["systemctl"] + list(args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, str(error)
    return done.returncode == 0, done.stdout.decode("utf-8", "replace")


def _kill(pid, start_ticks):
    if alive(pid, start_ticks):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ==================================================================================== start: lock, detach
def _take_lock():
    """The transition lock as an open file holding a kernel flock (None when another holds it)."""
    import fcntl

    _makedirs(RUN_DIR, 0o755)
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _write_lock_info(fd, run):
    stat = proc_stat(os.getpid())
    info = json.dumps({"run": run, "pid": os.getpid(), "start_ticks": stat[4] if stat else None, "since": time.time()})
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, 0)
    os.write(fd, info.encode())


def _recover_previous(run):
    """The latest run, if it has no outcome (its agent died: we now hold the lock): mark it
    interrupted, recovered by ``run``; -> what we know of it."""
    previous = latest_run()
    if not previous or previous == run:
        return None
    first, last, outcome = journal_ends(previous)
    if outcome is not None or first is None:
        return None
    info = {"run": previous, "last_step": (last or {}).get("step"), "last_phase": (last or {}).get("phase"),
            "target": (last or {}).get("target")}
    sidecar = _json_file("%s/%s.rollback.json" % (RUNS_DIR, previous))
    if isinstance(sidecar, dict) and sidecar.get("argv"):
        info["rollback"] = sidecar
    Journal(previous).write({"step": "outcome", "phase": "end", "outcome": "interrupted", "recovered_by": run,
                             "reasons": None, "message": "the agent ended during %s; recovered by run %s"
                             % (info["last_step"], run)})
    return info


def prune_agents(keep=3):
    """Installed agents beyond the ``keep`` newest (this one always kept), with their bytecode:
    each controller version installs its own, content-addressed."""
    mine = globals().get("AGENT_SHA256")
    found = []
    for name in _listdir(STATE_DIR):
        if name.startswith("agent-") and name.endswith(".py"):
            try:
                found.append((os.stat(os.path.join(STATE_DIR, name)).st_mtime, name))
            except OSError:
                continue
    for _, name in sorted(found, reverse=True)[keep:]:
        if mine and name == "agent-%s.py" % mine:
            continue
        for path in [os.path.join(STATE_DIR, name)] + [os.path.join(STATE_DIR, "__pycache__", cached) for cached in
                                                        _listdir(STATE_DIR + "/__pycache__") if cached.startswith(name[:-3] + ".")]:
            try:
                os.unlink(path)
            except OSError:
                pass


def resolve_history_desired(doc):
    """``desired: {"history": key | index, "port": n}`` (the rollback runbook): the exact spec of
    that good entry of the port's history, which never left the container -> (doc, problem)."""
    desired = doc.get("desired") if isinstance(doc, dict) else None
    if not (isinstance(desired, dict) and "history" in desired and "argv" not in desired):
        return doc, None
    port = int(desired.get("port") or doc.get("port") or DEFAULT_PORT)
    want = desired["history"]
    for index, entry in enumerate(load_history(port).get("good") or []):
        if want == index or (want and want in (entry.get("key"), (entry.get("record") or {}).get("key"))):
            return dict(doc, desired=_clean_spec(entry.get("spec"))), None
    return doc, "desired: no good spec %r in the history of :%d" % (want, port)


def prune_journals(keep=50, protect=()):
    """The oldest journals beyond ``keep`` (by mtime), never one named in ``protect``."""
    found = []
    for name in _listdir(RUNS_DIR):
        if name.endswith(".jsonl") and name[:-6] not in protect:
            try:
                found.append((os.stat(os.path.join(RUNS_DIR, name)).st_mtime, name))
            except OSError:
                continue
    for _, name in sorted(found, reverse=True)[keep:]:
        try:
            os.unlink(os.path.join(RUNS_DIR, name))
        except OSError:
            pass


def command_start(doc):
    """Validate, take the lock in a detached child, answer once it holds it."""
    doc, problem = resolve_history_desired(doc)
    problem = problem or validate_start(doc)
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
            _agent_main(doc, write_fd)
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


def command_install(doc):
    """The agent is installed (the bootstrap did it from the document's ``agent_source``, checked by
    hash, and wrote its code caches): say so and touch nothing else. No lock, no journal, and no
    pruning of other agents: the controller installs before following a transition that another
    controller version's agent runs, whose file must stay.

    -> ``{"ok": true, "sha256", "path", "installed": true when this command wrote the file}``"""
    del doc  # its only content, the source, was the bootstrap's
    return {"ok": True, "sha256": globals().get("AGENT_SHA256"), "path": globals().get("__file__"),
            "installed": bool(globals().get("INSTALLED_NOW"))}


def _agent_main(doc, answer_fd):
    """The detached agent: stdio on /dev/null, lock, journal, answer, run, exit."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if null > 2:
        os.close(null)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with open("/proc/self/comm", "w") as handle:
            handle.write("gpugate-agent")
    except OSError:
        pass
    run = doc["run"]

    def answer(document):
        try:
            os.write(answer_fd, (json.dumps(document) + "\n").encode())
            os.close(answer_fd)
        except OSError:
            pass

    lock_fd = _take_lock()
    if lock_fd is None:
        answer({"ok": False, "busy": transition_summary(lock=lock_status()) or lock_status()})
        return
    _write_lock_info(lock_fd, run)
    journal = Journal(run)
    recovered = _recover_previous(run)
    try:
        write_private(RUNS_DIR + "/latest", run + "\n", 0o600)
    except OSError:
        pass
    desired = doc.get("desired")
    ports = sorted(set(s["port"] for s in (desired, doc.get("replaces")) if s) or [int(doc.get("port") or DEFAULT_PORT)])
    transition = Transition(doc, journal, recovered)
    rollback = doc.get("rollback_to")
    if isinstance(rollback, dict) and rollback.get("argv"):
        try:
            write_private("%s/%s.rollback.json" % (RUNS_DIR, run), json.dumps(rollback))
        except OSError:
            pass
    transition.event("run", "begin", run=run, ports=ports, by=doc.get("operator"), pid=os.getpid(),
                     desired=make_record(desired) if desired else None,
                     replaces=make_record(doc["replaces"]) if doc.get("replaces") else None,
                     restart=bool(doc.get("restart")), budgets=transition.budgets, recovered=recovered and dict(
                         (k, v) for k, v in recovered.items() if k != "rollback"))
    answer({"ok": True, "run": run, "pid": os.getpid(), "journal": journal.path,
            "recovered": recovered and recovered.get("run")})
    prune_agents()
    prune_journals(keep=50, protect=(run, (recovered or {}).get("run")))
    try:
        transition.execute()
    finally:
        try:
            os.unlink("%s/%s.rollback.json" % (RUNS_DIR, run))
        except OSError:
            pass
    os._exit(0)


# ==================================================================================== the log pump
def command_logpump(args):
    """Copies the server's output (stdin) into its log, line by line: secret values masked
    (GPUGATE_LOG_SECRETS, read once and dropped from the environment), the file rotated when it
    passes ``max_bytes`` (``keep`` old files). Never blocks the server: a line that cannot be
    written (ENOSPC) is dropped and counted. Ends at EOF (the server's tree has exited).
    ``args`` ({path, max_bytes, keep}) come from GPUGATE_LOGPUMP (dropped from the environment
    likewise), over which the command line's wins: the path names sglang, the argv must not."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with open("/proc/self/comm", "w") as handle:
            handle.write("gpugate-logpump")
    except OSError:
        pass
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
    redactor = Redactor(secrets)
    out, size, dropped = None, 0, 0
    source = sys.stdin.buffer
    while True:
        line = source.readline(65536)
        if not line:
            break
        data = redactor.text(line.decode("utf-8", "replace")).encode("utf-8")
        try:
            if out is None:
                out = _open_private_append(path)
                size = out.seek(0, 2)
            if size + len(data) > max_bytes and size > 0:
                out.close()
                out = None
                rotate_log(path, 0, keep)
                out = _open_private_append(path)
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


# ==================================================================================== follow, wait
def command_follow(args):
    """New journal events of a run from ``offset``, waiting up to ``wait_s`` for some or the end."""
    run = str(args.get("run") or "")
    if not RUN_ID.match(run):
        return {"error": "bad run id", "events": [], "offset": 0, "active": False, "ended": False, "outcome": None}
    offset = int(args.get("offset") or 0)
    wait_s = min(float(args.get("wait_s") or 0), 600.0)
    deadline = time.time() + wait_s
    while True:
        # The lock first: an agent that ends after this look wrote its outcome before it let go.
        lock = lock_status()
        active = bool(lock.get("held") and lock.get("run") == run)
        events, new_offset = read_journal(run, offset, limit=int(args.get("limit") or 2000))
        outcome = None
        for event in events or []:
            if event.get("step") == "outcome":
                outcome = event
        if outcome is None and not active:
            _, _, outcome = journal_ends(run)
            outcome = outcome or outcome_from_history(run)
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
                    "outcome": outcome.get("outcome") if outcome else None,
                    "reasons": outcome.get("reasons") if outcome else None,
                    "message": outcome.get("message") if outcome else None}
        time.sleep(0.05)


def command_wait(args):
    """Block until run ``run`` has ended (an outcome, or its agent gone), or it did not appear
    within ``grace_s``. -> {run, appeared, ended, outcome}."""
    run = str(args.get("run") or "")
    if not RUN_ID.match(run):
        return {"error": "bad run id", "run": run, "appeared": False, "ended": False, "outcome": None}
    grace = float(args.get("grace_s", 30))
    limit = args.get("timeout_s")
    began = time.time()
    appeared = False
    while True:
        lock = lock_status()
        active = bool(lock.get("held") and lock.get("run") == run)
        exists = os.path.exists(journal_path(run))
        appeared = appeared or active or exists
        if appeared:
            _, _, outcome = journal_ends(run)
            if outcome is not None:
                return {"run": run, "appeared": True, "ended": True, "outcome": outcome.get("outcome")}
            if not active and not lock_status().get("held"):
                _, _, outcome = journal_ends(run)
                outcome = outcome or outcome_from_history(run)
                return {"run": run, "appeared": True, "ended": True,
                        "outcome": outcome.get("outcome") if outcome else "interrupted"}
        elif time.time() - began >= grace:
            return {"run": run, "appeared": False, "ended": False, "outcome": None}
        if limit is not None and time.time() - began >= float(limit):
            return {"run": run, "appeared": appeared, "ended": False, "outcome": None, "timed_out": True}
        time.sleep(0.1)


# ==================================================================================== entry
def decode_args(word):
    """A command's JSON argument as agentcmd wrote it: plain, or ``b64:<base64>`` when the text names
    sglang (a model path, an env name), so that no gpugate command line matches ``pkill -f sglang``.

    >>> decode_args('{"port": 1}'), decode_args("b64:eyJwb3J0IjogMX0=")
    ('{"port": 1}', '{"port": 1}')
    """
    if word.startswith("b64:"):
        import binascii

        return binascii.a2b_base64(word[4:]).decode("utf-8")
    return word


def main(argv, stdin_doc=None):
    """``argv``: [command, json args?, ...]; ``stdin_doc``: the start document (already read)."""
    command = argv[0] if argv else ""
    add_site_dirs()
    try:
        args = {}
        if len(argv) > 1 and argv[1] != PROBE_MARKER:
            args = json.loads(decode_args(argv[1]))
        if command == "observe":
            result = observe(args)
        elif command == "start":
            if stdin_doc is None:
                stdin_doc = json.loads(sys.stdin.read() or "null")
            if globals().get("WRITE_CACHE"):
                gpu_probe()  # the hand-off writes the bundled probe's code cache, so observe only reads it
            result = command_start(stdin_doc)
        elif command == "install":
            if globals().get("WRITE_CACHE"):
                gpu_probe()  # as the hand-off does: the bundled probe's code cache, so observe only reads it
            result = command_install(stdin_doc)
        elif command == "follow":
            result = command_follow(args)
        elif command == "wait":
            result = command_wait(args)
        elif command == "logpump":
            result = command_logpump(args)
        else:
            result = {"error": "unknown command %r (observe, start, install, follow, wait)" % command}
    except Exception as error:  # noqa: BLE001 - a field, never a traceback
        result = {"error": "%s: %s" % (type(error).__name__, error)}
    sys.stdout.write(json.dumps(result, separators=(",", ":"), default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":  # pragma: no cover - by hand: python3 agent.py observe '{"port": 30000}'
    sys.exit(main(sys.argv[1:]))
