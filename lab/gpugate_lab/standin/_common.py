"""What the lab's engine stand-ins share (stdlib only; installed into a lab container as
``gpugate_standin``, beside ``gpugate_gpusim`` and ``gpugate_sse``): nothing here is one engine's.

- process titles: a child started with ``argv[0]`` = its title (``sglang::scheduler_TP0``,
  ``VLLM::EngineCore``) and ``/proc/self/comm`` set to its first 15 characters, as
  ``setproctitle`` leaves a real engine's processes (:func:`spawn`, :func:`set_comm`);
- dying with the parent (``PR_SET_PDEATHSIG``), unless lab fault ``orphan-worker`` is set at that
  moment (:func:`die_with_parent`, :func:`stays_orphaned`);
- GPU memory held in the simulated driver (gpusim): the device a process's index names through
  ``CUDA_VISIBLE_DEVICES`` (:func:`physical_gpu`), allocations that lab fault ``stuck-memory`` keeps
  when it names this process (:class:`Memory`);
- a load that lab fault ``slow-start`` lengthens, read again while loading (:func:`wait_load`);
- the faults of ONE server, ``slow-decode=FACTOR`` and ``error-rate=P``: the first server started in the
  container after the fault was set claims it, a later start (a rollback) runs healthy
  (:class:`ServerFaults`);
- the engines' Prometheus counters and histograms, without ``prometheus_client`` (``metrics``:
  standin/_metrics.py, installed as ``gpugate_metrics``);
- children that report ``READY``/``ERROR`` on stdout (:class:`Children`), the descendants of a
  process as psutil finds them (:func:`descendants`);
- the HTTP plumbing: a threading server that can bind before it listens, a handler with uvicorn's
  access log line and JSON answers (:class:`Server`, :class:`Handler`);
- a model's shape from its ``config.json`` (:func:`model_config`, :func:`model_shape`,
  :func:`parameter_count`), which sizes the weights and the KV cache;
- an engine's parser rebuilt from the snapshot of its flag table (gpugate/engine/<engine>/flagtables,
  made by gpugate/engine/argparse_table.py from the real release): :func:`add_table_action` declares
  one row as the engine declared it, its converters and action classes carrying the engine's module
  and name, so that table builder reads back the table it was built from. Never gpugate's own
  validation: the stand-in and gpugate read the same snapshot through different code.

Example (a stand-in's worker)::

    set_comm(job["title"])
    die_with_parent(job["parent_pid"], job["title"])
    memory = Memory()
    memory.hold(physical_gpu(job["gpu"]), CONTEXT_MIB)

>>> parameter_count(model_shape({})) > 6 * 10**9      # config.json's absent: a 7B-class Llama
True
"""

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

# the lab's other shared parts, for every stand-in: the stdlib copies installed beside this file in a lab
# container, else the lab package (development)
try:
    import gpugate_gpusim as gpusim
except ImportError:
    from gpugate_lab import gpusim  # type: ignore[no-redef]
try:
    import gpugate_sse as sse
except ImportError:
    from gpugate_lab.standin import _sse as sse  # type: ignore[no-redef]  # noqa: F401 -- for the stand-ins
try:
    import gpugate_metrics as metrics
except ImportError:
    from gpugate_lab.standin import _metrics as metrics  # type: ignore[no-redef]  # noqa: F401 -- for the stand-ins
try:
    import gpugate_standin_real as real
except ImportError:
    from gpugate_lab.standin import _realgpu as real  # type: ignore[no-redef]  # noqa: F401 -- for the stand-ins

PR_SET_PDEATHSIG = 1
CONTEXT_MIB = 518  # a CUDA context on an H200, measured (shared/reference/nvml-and-containers.md)
STARTED = time.time()  # this process's start, as a fault that names processes compares it
MODEL_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


# ---------------------------------------------------------------- logs and titles
def emit(text):
    """Write to stderr; an engine's logging swallows an OSError (``Handler.handleError``): with the
    log pipe's reader gone (EPIPE; Python ignores SIGPIPE) the server keeps running, silent."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def set_comm(title):
    """``/proc/self/comm`` = the title's first 15 characters (what setproctitle's prctl leaves)."""
    try:
        with open("/proc/self/comm", "w") as handle:
            handle.write(title[:15])
    except OSError:
        pass


def spawn(title, module, job, env_var, pass_fds=(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE):
    """``python3 -m module`` with ``argv[0]`` = ``title`` (so /proc/PID/cmdline begins with it) and
    ``job`` as JSON in ``$env_var``. A real-mode job (``job["real"]``) gets this interpreter's
    sys.path: argv[0] is the title, so a venv's interpreter could not find its pyvenv.cfg from it."""
    env = dict(os.environ)
    env[env_var] = json.dumps(job)
    if job.get("real"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    # a titled process has no sys.executable (argv[0] is no path): its own children use /proc/self/exe
    python = sys.executable or os.readlink("/proc/self/exe")
    return subprocess.Popen([title, "-m", module], executable=python, env=env, pass_fds=tuple(pass_fds),
                            stdin=stdin, stdout=stdout)


def descendants(pid):
    """Every descendant of ``pid`` (children first), read from /proc as psutil's children(recursive=True)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as handle:
                ppid = int(handle.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def kill_quietly(pid, sig=signal.SIGKILL):
    try:
        os.kill(pid, sig)
    except OSError:
        pass


# ---------------------------------------------------------------- a worker's parent
def stays_orphaned(title):
    """Lab fault ``orphan-worker``, read when the parent is found dead: True (and said on stderr,
    unbuffered: this may run in a signal handler) when the worker is to live on with its memory."""
    if not gpusim.read_faults().get("orphan-worker"):
        return False
    try:
        os.write(2, ("[%s %s] parent process died; staying alive (lab fault orphan-worker)\n"
                     % (time.strftime("%Y-%m-%d %H:%M:%S"), title)).encode())
    except OSError:
        pass
    return True


_orphaned = []


def die_with_parent(parent_pid, title):
    """Ask for a signal when the parent dies (``PR_SET_PDEATHSIG``, as SGLang's
    ``kill_itself_when_parent_died``), then SIGKILL this process, unless :func:`stays_orphaned`."""
    def on_parent_death(signum, frame):
        # The signal can come twice (the parent's threads exit one by one), the second inside the first
        # one's write: handled once, and unbuffered (a buffered stderr write re-entered raises RuntimeError).
        if _orphaned:
            return
        _orphaned.append(True)
        if not stays_orphaned(title):
            os.kill(os.getpid(), signal.SIGKILL)

    signal.signal(signal.SIGUSR2, on_parent_death)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGUSR2, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        on_parent_death(signal.SIGUSR2, None)


# ---------------------------------------------------------------- GPU memory
def visible_devices():
    """The entries of ``$CUDA_VISIBLE_DEVICES`` (None when unset: every device, in index order)."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return None
    return [part.strip() for part in text.split(",") if part.strip()]


def load_gpu_config():
    """The simulated driver's config; RuntimeError("No CUDA GPUs are available") without one."""
    try:
        return gpusim.load_config()
    except gpusim.DriverUnavailable:
        raise RuntimeError("No CUDA GPUs are available")


def physical_gpu(index, config=None):
    """The simulated GPU that device ``index`` of this process is, through ``CUDA_VISIBLE_DEVICES``
    as CUDA maps it (an integer entry is an index, else a UUID or a UUID's prefix); raises
    RuntimeError("CUDA error: invalid device ordinal") when there is no such device.

    >>> physical_gpu(1, {"count": 4, "uuids": ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]}) in (1, 3)
    True
    """
    config = config if config is not None else load_gpu_config()
    count = int(config["count"])
    uuids = list(config.get("uuids") or [])
    visible = visible_devices()
    if visible is None:
        physical = int(index)
    else:
        if not 0 <= int(index) < len(visible):
            raise RuntimeError("CUDA error: invalid device ordinal")
        entry = visible[int(index)]
        if entry.lstrip("-").isdigit():
            physical = int(entry)
        else:
            matches = [i for i, u in enumerate(uuids) if u == entry or u.startswith(entry)]
            if len(matches) != 1:
                raise RuntimeError("CUDA error: invalid device ordinal")
            physical = matches[0]
    if not 0 <= physical < count:
        raise RuntimeError("CUDA error: invalid device ordinal")
    return physical


def stuck(started=STARTED):
    """Lab fault ``stuck-memory`` applies to the processes it names (those holding memory when it
    was set), read at each allocation; never to one started since (issue 32 item 14)."""
    return gpusim.named_by_fault("stuck-memory", started)


class Memory:
    """What one process holds on the simulated GPUs, for as long as it lives."""

    def __init__(self):
        self.holdings = []

    def hold(self, physical, mib):
        """Hold ``mib`` MiB on GPU ``physical``; gpusim.NotEnoughMemory unless that much is free."""
        holding = gpusim.allocate(physical, int(mib), stuck=stuck(), require_free=True)
        self.holdings.append(holding)
        return holding

    @staticmethod
    def free_mib(physical):
        return gpusim.memory_info(physical).free_mib


# ---------------------------------------------------------------- loading
def wait_load(started, load_s, slow_start, default_env):
    """Load until ``load_s`` after ``started``. Under the fault slow-start the length is read again while
    loading, as every fault applies to a server that already runs: clearing the fault (or setting
    another length) ends the load at ``$default_env`` (default 1.0) instead, so a test can hold a
    server in its load for exactly as long as it needs (issue 19: no fixed load outlasting a busy machine)."""
    if not slow_start:
        time.sleep(max(0.0, load_s - (time.monotonic() - started)))
        return
    while True:
        current = gpusim.read_faults().get("slow-start")
        length = float(current) if current else float(os.environ.get(default_env, "1.0"))
        left = length - (time.monotonic() - started)
        if left <= 0:
            return
        time.sleep(min(left, 0.05))


# ---------------------------------------------------------------- one server's faults
SERVER_FAULTS = ("slow-decode", "error-rate")


def _claim_dir():
    # the container's own /tmp (a tmpfs of its own); outside a container the ctl dir's id keeps labs apart
    import tempfile

    return os.path.join(tempfile.gettempdir(), "gpugate-lab-claims")


class ServerFaults:
    """Lab faults ``slow-decode=FACTOR`` and ``error-rate=P`` (faults.json: ``{"value": V, "set_at":
    epoch}``) apply to ONE server: the first started in the container after the fault was set. That
    server claims it at its start (a file created once per fault and ``set_at`` in the container's
    /tmp, so a claim ends with the container), and a later start, e.g. the rollback to the old spec,
    finds it claimed and runs healthy: "the new spec is slower". The owner reads the fault again
    (every 0.1 s at most), so clearing it ends it in the running server too; setting it again is a new
    fault, for the next start.

    ``owned``: {fault: set_at} a parent claimed for this server (vLLM's EngineCore gets its API
    server's); None: claim now, as a server's main process.

    >>> ServerFaults(owned={}).value("slow-decode") is None
    True
    """

    def __init__(self, owned=None, started=STARTED):
        self.owned = dict(owned) if owned is not None else self.claim(started)
        self.lock = threading.Lock()
        self.read_at, self.faults = 0.0, {}
        self.share = 0.0  # error-rate: the share of failures owed so far

    @staticmethod
    def claim(started):
        faults, owned = gpusim.read_faults(), {}
        for name in SERVER_FAULTS:
            fault = faults.get(name)
            if not isinstance(fault, dict) or float(fault.get("set_at") or 0) > started:
                continue
            folder = _claim_dir()
            os.makedirs(folder, exist_ok=True)
            ctl = gpusim._ctl_id() or "noctl"
            path = os.path.join(folder, "%s-%s-%r" % (ctl.replace(":", "_"), name, float(fault["set_at"])))
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            except FileExistsError:
                continue  # an earlier server of this container had it
            owned[name] = float(fault["set_at"])
        return owned

    def value(self, name):
        """The fault's value while it is set and this server's; else None."""
        if name not in self.owned:
            return None
        now = time.monotonic()
        with self.lock:
            if now - self.read_at > 0.1:
                self.read_at, self.faults = now, gpusim.read_faults()
            fault = self.faults.get(name)
        if isinstance(fault, dict) and float(fault.get("set_at") or 0) == self.owned[name]:
            return float(fault["value"])
        return None

    def slowdown(self):
        """slow-decode's factor, 1.0 without it."""
        return self.value("slow-decode") or 1.0

    def fails_next(self):
        """Does error-rate fail this request? Exactly a share P of the requests, spread evenly: the
        failures owed so far grow by P per request and one is due at each whole number, so the first
        request passes for P < 1 (a start's verify) and P = 0.5 fails every second one."""
        p = self.value("error-rate")
        if not p:
            return False
        with self.lock:
            self.share += p
            if self.share >= 1.0 - 1e-9:
                self.share -= 1.0
                return True
        return False


# ---------------------------------------------------------------- children
class Children:
    """Child processes that each say ``READY [json]`` or ``ERROR <text>`` on stdout once started."""

    died = "a child died during initialization"  # what wait_ready says of a child gone without a word

    def __init__(self):
        self.procs = []
        self.reports = []
        self.stopping = False

    def start(self, title, module, job, env_var, **kwargs):
        proc = spawn(title, module, job, env_var, **kwargs)
        self.procs.append(proc)
        return proc

    def wait_ready(self):
        """'' when all reported READY, else the first error (whichever child fails first). Each READY
        may carry a JSON report (``self.reports``, in the children's order)."""
        import selectors

        self.reports = []
        pending = {proc.stdout.fileno(): proc for proc in self.procs}
        lines = {}
        with selectors.DefaultSelector() as sel:
            for fd in pending:
                sel.register(fd, selectors.EVENT_READ)
            while pending:
                for key, _ in sel.select():
                    proc = pending.pop(key.fd)
                    sel.unregister(key.fd)
                    line = proc.stdout.readline().decode(errors="replace").strip()
                    if line != "READY" and not line.startswith("READY "):
                        return line[len("ERROR "):] if line.startswith("ERROR ") else self.died
                    lines[proc.pid] = line
        for proc in self.procs:
            extra = lines[proc.pid][len("READY"):].strip()
            try:
                self.reports.append(json.loads(extra) if extra else {})
            except ValueError:
                self.reports.append({})
        return ""

    def signal_all(self, sig=signal.SIGKILL):
        for proc in self.procs:
            try:
                proc.send_signal(sig)
            except OSError:
                pass

    def reap(self, timeout=5):
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass

    def kill(self):
        self.stopping = True  # our own SIGKILLs are no crash for a watchdog
        self.signal_all()
        self.reap()


def say(line):
    """One line to the parent on stdout (READY, ERROR ..., or a generation's answer in real mode)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def say_error(exc):
    say("ERROR %s" % str(exc).replace("\n", " "))


# ---------------------------------------------------------------- HTTP
def __getattr__(name):
    # ``Server`` and ``Handler`` are made on first use: http.server costs a process ~30 ms of imports,
    # and the processes that never serve HTTP (every rank, the detokenizer) are most of a server's tree.
    if name in ("Server", "Handler"):
        _define_http()
        return globals()[name]
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def _define_http():
    global Server, Handler
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        allow_reuse_address = True

    class Handler(BaseHTTPRequestHandler):
        """An engine's HTTP handler under uvicorn: HTTP/1.1, ``server: uvicorn``, JSON answers, the
        access log line ``INFO:     <client> - "<method> <path> HTTP/1.1" <status>``."""

        protocol_version = "HTTP/1.1"
        server_version = "uvicorn"
        sys_version = ""

        def log_message(self, fmt, *args):  # uvicorn's access log instead (access_log)
            pass

        def access_log(self, code):
            emit('INFO:     %s:%s - "%s %s HTTP/1.1" %d\n' % (
                self.client_address[0], self.client_address[1], self.command, self.path, code))

        def _send(self, code, body, content_type="application/json", headers=()):
            data = body if isinstance(body, bytes) else (
                json.dumps(body).encode() if content_type == "application/json" else str(body).encode())
            self.send_response(code)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(data)))
            for name, value in headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
            self.access_log(code)

        def _body(self):
            length = int(self.headers.get("content-length") or 0)
            if not length:
                return {}
            try:
                return json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                return {}


# ---------------------------------------------------------------- the model
def model_config(model_path):
    """config.json of the model directory, {} when it has none (an HF id, say)."""
    try:
        with open(os.path.join(model_path, "config.json")) as handle:
            return json.load(handle)
    except (OSError, ValueError, TypeError):
        return {}


def model_shape(config):
    """The figures of a decoder-only transformer's config.json that size its weights and KV cache
    (a 7B-class Llama where one is missing)."""
    heads = int(config.get("num_attention_heads") or 32)
    hidden = int(config.get("hidden_size") or 4096)
    return {
        "layers": int(config.get("num_hidden_layers") or 32),
        "heads": heads,
        "kv_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or hidden // heads),
        "hidden": hidden,
        "intermediate": int(config.get("intermediate_size") or 4 * hidden),
        "vocab": int(config.get("vocab_size") or 32000),
        "tied": bool(config.get("tie_word_embeddings")),
        "context": int(config.get("max_position_embeddings") or 4096),
        "dtype_bytes": MODEL_DTYPE_BYTES.get(str(config.get("torch_dtype") or "bfloat16"), 2),
    }


def parameter_count(shape):
    """Decoder-only transformer parameters: embeddings (and the LM head unless tied) + per layer
    attention (q, k, v, o) and a gated MLP (gate, up, down) and two norms."""
    h, d = shape["hidden"], shape["head_dim"]
    attention = h * shape["heads"] * d * 2 + h * shape["kv_heads"] * d * 2
    mlp = 3 * h * shape["intermediate"]
    embeddings = shape["vocab"] * h * (1 if shape["tied"] else 2)
    return embeddings + shape["layers"] * (attention + mlp + 2 * h)


def thread(target, *args, name=None):
    """A daemon thread, started."""
    worker = threading.Thread(target=target, args=args, daemon=True, name=name)
    worker.start()
    return worker


# ---------------------------------------------------------------- an engine's parser from its flag table
_made = {}


def table_converter(name, bodies=None):
    """The callable for a table's type name (``int``, ``json``, ``<module>.<qualname>``), carrying the
    engine's module and qualified name; ``bodies`` maps a converter's last name to what it does (the
    engine's own converters), any other one takes the text as it is."""
    if name in (None, "str"):
        return None if name is None else str
    if name == "int":
        return int
    if name == "float":
        return float
    if name == "json":
        return json.loads
    if name not in _made:
        module, _, qualname = name.rpartition(".")
        body = (bodies or {}).get(qualname.rsplit(".", 1)[-1], lambda text: text)

        def convert(text, _body=body):
            return _body(text)

        convert.__module__, convert.__qualname__, convert.__name__ = module, qualname, qualname.rsplit(".", 1)[-1]
        _made[name] = convert
    return _made[name]


def _log_warning(message):
    import logging  # noqa: PLC0415 -- only a deprecated flag logs

    # before logging is configured: Python's last-resort handler writes the bare message to stderr
    logging.getLogger("engine.argparse_actions").warning(message)


class DeprecatedAction(argparse.Action):
    """A deprecated flag: the engine's words (recorded in the table), then what it stores."""

    row = {}
    warn = staticmethod(_log_warning)

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.setdefault("nargs", self.row.get("nargs"))
        argparse.Action.__init__(self, option_strings, dest, **kwargs)
        info = self.row.get("deprecated") or {}
        self.new_flag = info.get("new_flag")
        self.error_message = info.get("error_message")
        self.const_value = info.get("const_value")

    def __call__(self, parser, namespace, values, option_string=None):
        info = self.row.get("deprecated") or {}
        if info.get("stops"):
            parser.error(self.error_message or info.get("message") or "%s was removed" % option_string)
        self.warn(info.get("message") or "%s is deprecated" % option_string)
        if self.nargs == 0:
            value = True if self.row.get("kind") == "store_true" else self.const_value
        else:
            value = self.const_value if self.const_value is not None else values
        setattr(namespace, self.dest, value)


class StoredAction(argparse.Action):
    """The engine's other custom actions (LoRA parsers...): store the values as parsed."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)


def _action_class(row, warn):
    module, _, name = row["action_class"].rpartition(".")
    base = DeprecatedAction if row.get("deprecated") else StoredAction
    attrs = {"__module__": module, "row": row}
    if warn is not None:
        attrs["warn"] = staticmethod(warn)
    return type(name, (base,), attrs)


class ReprDefault:
    """A default JSON could not carry (a config object), as the table recorded it: its repr."""

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return self.text

    def __eq__(self, other):
        return isinstance(other, ReprDefault) and other.text == self.text

    def __hash__(self):
        return hash(self.text)


def add_table_action(parser, row, bodies=None, classes=None, warn=None, repr_defaults=False):
    """Declare one table row on ``parser`` as the engine declared it. ``bodies``: the engine's
    converters by name (:func:`table_converter`); ``classes``: the engine's own action classes by the
    table's ``action_class`` (a switch class such as vLLM's EnableDisableAction, or a deprecated flag's
    own class); ``warn``: how a deprecated flag of the engine warns; ``repr_defaults``: a default the
    table kept as its repr becomes a :class:`ReprDefault` (else no default: None)."""
    options = list(row["options"])
    kind = row.get("kind")
    kwargs = {"dest": row["dest"], "help": row.get("help")}
    if row.get("required"):
        kwargs["required"] = True
    default = row.get("default")
    if default == argparse.SUPPRESS:
        kwargs["default"] = argparse.SUPPRESS  # argparse tests it by identity: not set, never converted
    elif not (isinstance(default, dict) and set(default) == {"repr"}):
        kwargs["default"] = default
    elif repr_defaults:
        kwargs["default"] = ReprDefault(default["repr"])
    own = (classes or {}).get(row["action_class"])
    if kind == "boolean_optional":
        if "negatives" in row:  # the options that store False are the switch's own (--no-x, --disable-x)
            positive = [o for o in options if o not in row["negatives"]]
        else:
            positive = [o for o in options if not (o.startswith("--no-") and "--" + o[5:] in options)]
        return parser.add_argument(*positive, action=own or argparse.BooleanOptionalAction, **kwargs)
    custom = bool(row.get("deprecated")) or kind == "custom" or not row["action_class"].startswith("argparse.")
    if "const" in row and (custom or kind not in ("store_true", "store_false", "store_const")):
        kwargs["const"] = row["const"]
    if custom:
        kwargs["action"] = own or _action_class(row, warn)
        return parser.add_argument(*options, **_values(row, kwargs, bodies))
    if kind == "store_true":
        return parser.add_argument(*options, action="store_true", **kwargs)
    if kind == "store_false":
        return parser.add_argument(*options, action="store_false", **kwargs)
    if kind == "store_const":
        return parser.add_argument(*options, action="store_const", const=row.get("const"), **kwargs)
    if kind == "append":
        kwargs["action"] = "append"
    return parser.add_argument(*options, **_values(row, kwargs, bodies))


def _values(row, kwargs, bodies):
    """An action's nargs, choices and converter, as the row has them (a custom action's nargs 0 is its own)."""
    if row.get("nargs") not in (None, 0) or (row.get("nargs") == 0 and "action" not in kwargs):
        kwargs["nargs"] = row["nargs"]
    if row.get("choices") is not None:
        kwargs["choices"] = row["choices"]
    converter = table_converter(row.get("type"), bodies)
    if converter is not None:
        kwargs["type"] = converter
    return kwargs
