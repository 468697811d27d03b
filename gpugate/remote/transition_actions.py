"""The transition's steps as they run INSIDE the container (stdlib only, sent inline).

Each public function takes JSON-able keyword arguments, does one step, polls locally (no
round trip per poll) and returns a JSON-able dict. The operator side
(``gpugate.operations.sglang``) runs them with :func:`gpugate.transition.remote_call`.

Every step that runs under the transition lock takes ``lock={"path", "token", "lease_s"}``
and renews the lease first: a step whose lock was taken over by someone else refuses to act.
"""

import base64
import fcntl
import json
import os
import signal
import subprocess
import sys
import time

try:  # inlined: the command registers the probe as a top-level module first
    import sglang_probe as probe
except ImportError:  # imported from the package (tests)
    from gpugate.remote import sglang_probe as probe

POLL_S = 0.1
DRAIN_POLL_S = 0.02  # the main process's exit: one /proc read per poll; every poll interval is downtime
SECRET_FLAGS = ("--api-key", "--admin-api-key")  # their values never reach the server log's header
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# ---------------------------------------------------------------- the lock (a lease in a file)
def _locked_file(path):
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    handle = open(path, "a+")
    fcntl.flock(handle, fcntl.LOCK_EX)  # serialises read-modify-write between operators
    handle.seek(0)
    return handle


def _read_holder(handle):
    try:
        holder = json.loads(handle.read() or "null")
    except ValueError:
        holder = {"unreadable": True, "expires": 0}
    return holder if isinstance(holder, dict) else None


def _write_holder(handle, holder):
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps(holder))
    handle.flush()
    os.fsync(handle.fileno())


def lock_acquire(path, token, owner, lease_s, wait_s=0, step="lock"):
    """Take the lease unless someone else holds a live one; a lapsed lease is taken over.

    The lease (not a process) proves the holder alive: the operator's run renews it at every
    step, so a run that died (SSH dropped, laptop closed) stops renewing and its lock lapses
    after at most one step's lease; a re-run then takes over and converges.
    """
    deadline = time.time() + float(wait_s)
    while True:
        handle = _locked_file(path)
        try:
            holder = _read_holder(handle)
            now = time.time()
            if holder is None or holder.get("token") == token or float(holder.get("expires", 0)) < now:
                mine = {"token": token, "owner": owner, "since": now, "expires": now + float(lease_s),
                        "step": step, "container_pid": os.getpid()}
                _write_holder(handle, mine)
                taken = holder if holder and holder.get("token") != token else None
                return {"acquired": True, "taken_over": taken, "clock": now}
        finally:
            handle.close()
        if time.time() >= deadline:
            return {"acquired": False, "pending": True, "holder": holder, "clock": time.time()}
        time.sleep(min(1.0, max(0.05, deadline - time.time())))


def lock_renew(lock, step):
    """Extend our lease for `step`; {"ok": False, "holder": ...} when it is no longer ours."""
    if not lock:
        return {"ok": True}
    handle = _locked_file(lock["path"])
    try:
        holder = _read_holder(handle)
        if holder is None or holder.get("token") != lock["token"]:
            return {"ok": False, "holder": holder}
        holder["expires"] = time.time() + float(lock["lease_s"])
        holder["step"] = step
        _write_holder(handle, holder)
        return {"ok": True}
    finally:
        handle.close()


def lock_release(path, token):
    handle = _locked_file(path)
    try:
        holder = _read_holder(handle)
        if holder is not None and holder.get("token") == token:
            os.unlink(path)
            return {"released": True}
        return {"released": False, "holder": holder}
    finally:
        handle.close()


def _guard(lock, step):
    renewed = lock_renew(lock, step)
    if not renewed["ok"]:
        return {"ok": False, "error": "lock lost", "holder": renewed.get("holder")}
    return None


# ---------------------------------------------------------------- recorded state
def _cmdline(pid):
    raw = probe._read("/proc/%d/cmdline" % int(pid), "rb") if pid else None
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part] if raw else None


def record(lock, state_file, env_file, document, save=None):
    """Write the recorded state atomically (no secret in it: flags redacted, hashes only).

    ``save`` = {"main_pid", "argv_file", "env_file", "key"}: keep the running server's exact argv
    (read here from /proc, never sent from the operator's side) and its env file in 0600 files
    (the slot a rollback starts from), and complete ``document[key]`` with the argv hash and the
    env names and value hashes of that env file."""
    refused = _guard(lock, "record")
    if refused:
        return refused
    os.makedirs(os.path.dirname(state_file), exist_ok=True)
    saved, entry = False, None
    if save:
        argv = _cmdline(save.get("main_pid"))
        if argv:
            _write_private(save["argv_file"], json.dumps(argv).encode())
            env = {}
            if env_file and os.path.exists(env_file):
                with open(env_file, "rb") as source:
                    data = source.read()
                _write_private(save["env_file"], data)
                env = parse_env_file(data.decode("utf-8", "replace"))
            elif os.path.exists(save["env_file"]):
                os.unlink(save["env_file"])  # the server ran without one
            entry = document.get(save.get("key") or "previous")
            if isinstance(entry, dict):
                entry["argv_hash"] = probe.argv_hash(argv)
                entry["env_names"] = sorted(env)
                entry["env_hashes"] = dict((name, probe.env_hash(value)) for name, value in sorted(env.items()))
            saved = True
    document["updated"] = time.time()
    tmp = state_file + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(document, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, state_file)
    return {"ok": True, "saved": saved, "entry": entry}


def _write_private(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


# ---------------------------------------------------------------- stop
def _alive(pid, start_ticks=None):
    """Alive and not a zombie, and (when given) the same process, not a reused PID."""
    stat = probe._read("/proc/%d/stat" % pid)
    if stat is None:
        return False
    fields = stat[stat.rfind(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return False
    return start_ticks is None or int(fields[19]) == start_ticks


def _sglang_processes():
    table = probe._proc_table()
    mine = probe._ancestors(table, os.getpid())
    return {pid: proc for pid, proc in table.items() if pid not in mine and probe.is_sglang_argv(proc["argv"])}


def _gpu_used_mib():
    """Per-GPU used MiB (NVML v2) when the GPU probe travelled with this call, else None."""
    try:
        import gpu_probe
        return [gpu.get("used_mib") for gpu in gpu_probe.collect().get("gpus") or []]
    except Exception:
        return None


def drain(lock, main_pid, chunk_s, deadline_s, kill_grace, tree=None, pgid=None, pid_file=None):
    """One chunk of the stop. The first call (``tree`` None) snapshots the main process's tree and
    sends SIGTERM (SGLang's graceful drain); every call then polls the main process for up to
    ``chunk_s``. When it has exited, or ``deadline_s`` (the drain time left) is over, the same call
    goes on to :func:`kill_and_sweep`. Otherwise it returns what the operator is shown while
    waiting: the tree's processes still alive and the per-GPU used MiB.
    """
    refused = _guard(lock, "stop")
    if refused:
        return refused
    began = time.time()
    if tree is None:
        tree = {}
        table = probe._proc_table()
        main = table.get(main_pid) if main_pid else None
        if main is not None:
            for pid in [main_pid] + probe._descendants(table, main_pid):
                tree[str(pid)] = table[pid]["start_ticks"]
            pgid = main["pgid"]
            try:
                os.kill(main_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    main_ticks = tree.get(str(main_pid)) if main_pid else None
    wait_s = max(0.0, min(float(chunk_s), float(deadline_s)))
    while main_ticks is not None and _alive(main_pid, main_ticks) and time.time() - began < wait_s:
        time.sleep(DRAIN_POLL_S)
    exited = main_ticks is None or not _alive(main_pid, main_ticks)
    result = {"ok": True, "exited": exited, "waited_s": round(time.time() - began, 3), "tree": tree, "pgid": pgid,
              "alive": sorted(int(pid) for pid, ticks in tree.items() if _alive(int(pid), ticks))}
    if exited or float(deadline_s) <= float(chunk_s):
        result.update(kill_and_sweep(None, tree, pgid, kill_grace, pid_file))
        result["drained"] = exited if main_ticks is not None else None
    else:
        result["gpu_used_mib"] = _gpu_used_mib()
        result["pending"] = True  # still draining: a sequence goes no further in this command
    return result


def kill_and_sweep(lock, tree, pgid, kill_grace, pid_file=None):
    """SIGKILL the process group and whatever of the tree is alive, then sweep the container for
    any SGLang process left (orphaned TP workers) and SIGKILL it; wait ``kill_grace`` for them.

    ``survivors`` are processes that outlived SIGKILL (D state): the gate will then refuse and
    name them."""
    refused = _guard(lock, "stop")
    if refused:
        return refused
    kill_began = time.time()
    targets = dict((int(pid), ticks) for pid, ticks in (tree or {}).items() if _alive(int(pid), ticks))
    if pgid and pgid > 1 and pgid != os.getpgrp():
        try:
            os.killpg(pgid, signal.SIGKILL)  # the whole group: workers that re-parented too
        except (ProcessLookupError, PermissionError):
            pass
    for pid in targets:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sweep_began = time.time()
    swept = {}
    for pid, proc in _sglang_processes().items():
        if _alive(pid, proc["start_ticks"]):
            swept[pid] = proc["start_ticks"]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    sweep_s = time.time() - sweep_began
    waiting = dict(targets)
    waiting.update(swept)
    deadline = time.time() + float(kill_grace)
    while time.time() < deadline:
        waiting = dict((pid, t) for pid, t in waiting.items() if _alive(pid, t))
        if not waiting:
            break
        time.sleep(DRAIN_POLL_S)
    table = probe._proc_table()
    survivors = [{"pid": pid, "state": table.get(pid, {}).get("state"),
                  "cmdline": " ".join(table.get(pid, {}).get("argv", []))[:200]}
                 for pid in sorted(waiting) if _alive(pid, waiting[pid])]
    if pid_file:
        try:
            os.unlink(pid_file)
        except FileNotFoundError:
            pass
    result = {"ok": not survivors, "killed": sorted(targets), "swept": sorted(set(swept) - set(targets)),
              "survivors": survivors, "kill_s": round(time.time() - kill_began, 3) if (targets or swept) else 0.0,
              "sweep_s": round(sweep_s, 3)}
    if survivors:
        result["error"] = "processes outlived SIGKILL"
    return result


def stop(lock, port, main_pid, drain_timeout, kill_grace, pid_file=None):
    """The whole stop in one call (drain until ``drain_timeout``, then kill and sweep); the
    transition runs :func:`drain` in chunks instead, to show progress."""
    began = time.time()
    result = drain(lock, main_pid, drain_timeout, drain_timeout, kill_grace, pid_file=pid_file)
    result["drain_s"] = round(result.get("waited_s", 0.0), 3) if main_pid else 0.0
    result.setdefault("drained", None)
    result["elapsed_s"] = round(time.time() - began, 3)
    return result


# ---------------------------------------------------------------- before the start
def stage_env(lock, staged_file, env_b64):
    """Write the desired env file's text to a 0600 staging file, for :func:`prepare_start` to move
    into place. ``env_b64`` comes on the lock command's stdin (never an argv); staged once under
    the lock, it need not travel again with each of the gate's chunks."""
    refused = _guard(lock, "lock")
    if refused:
        return refused
    _write_private(staged_file, base64.b64decode(env_b64))
    return {"ok": True}


def prepare_start(lock, port, env_file, env_b64=None, restore_env_from=None, staged_env=None):
    """Remove stale /dev/shm segments (only with no SGLang process alive), check the port is
    free, write the env file (0600) from env_b64, move the staged one into place (``staged_env``,
    from :func:`stage_env`; missing is an error, never a start without its environment), or put a
    saved copy back (``restore_env_from``: the previous server's, for a rollback; no copy means
    it ran without one). Never kills anything that is not SGLang's."""
    refused = _guard(lock, "prepare")
    if refused:
        return refused
    result = {"ok": True, "removed_shm": []}
    alive = _sglang_processes()
    if alive:
        return {"ok": False, "error": "SGLang processes still alive: %s" % sorted(alive)}
    if os.path.isdir("/dev/shm"):
        for name in sorted(os.listdir("/dev/shm")):
            if name.startswith(probe.SHM_PREFIXES):
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                    result["removed_shm"].append(name)
                except OSError:
                    pass
    listening, pids = probe._listeners(int(port))
    if listening:
        table = probe._proc_table()
        owners = ["%d (%s)" % (pid, " ".join(table.get(pid, {}).get("argv", []))[:80]) for pid in pids]
        return {"ok": False, "error": "port %d is in use by %s" % (int(port), ", ".join(owners) or "an unknown process")}
    if staged_env:
        if not os.path.exists(staged_env):
            return {"ok": False, "error": "the desired env file staged at the lock (%s) is missing" % staged_env}
        os.chmod(staged_env, 0o600)
        os.replace(staged_env, env_file)
    elif restore_env_from:
        previous = restore_env_from
        if os.path.exists(previous):
            with open(previous, "rb") as handle:
                _write_private(env_file, handle.read())
        elif os.path.exists(env_file):
            os.unlink(env_file)  # the previous server ran without one
    elif env_b64 is not None:
        _write_private(env_file, base64.b64decode(env_b64))
    return result


# ---------------------------------------------------------------- start and wait
def parse_env_file(text):
    """KEY="value" lines as written by gpugate (systemd EnvironmentFile syntax, double quotes)."""
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
            out, index = [], 0
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


def redacted(argv):
    """argv with the values of secret flags masked (the log header; the log's tail is shown)."""
    out, hide = [], False
    for arg in argv:
        if hide:
            out.append("***")
            hide = False
        elif arg in SECRET_FLAGS:
            out.append(arg)
            hide = True
        elif arg.split("=", 1)[0] in SECRET_FLAGS and "=" in arg:
            out.append(arg.split("=", 1)[0] + "=***")
        else:
            out.append(arg)
    return out


def start_process(lock, argv, env_file, log_file, pid_file, argv_file=None):
    """Start the server in its own session/process group, detached, with a clean environment
    (pct exec leaks the host's) plus the env file; write the pid file. ``argv`` None: the argv
    saved in ``argv_file`` (0600) by :func:`record` (a rollback: secrets never leave the container)."""
    refused = _guard(lock, "start")
    if refused:
        return refused
    if argv is None:
        text = probe._read(argv_file) if argv_file else None
        if text is None:
            return {"ok": False, "error": "no saved argv to start from (%s is missing)" % argv_file}
        argv = json.loads(text)
    env = {"PATH": CLEAN_PATH, "HOME": "/root", "LANG": "C.UTF-8"}
    if env_file and os.path.exists(env_file):
        with open(env_file) as handle:
            env.update(parse_env_file(handle.read()))
    os.makedirs(os.path.dirname(log_file), exist_ok=True)
    os.makedirs(os.path.dirname(pid_file), exist_ok=True)
    log = open(log_file, "ab")
    offset = log.tell()
    log.write(("\n=== gpugate start %s: %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), " ".join(redacted(argv)))).encode())
    log.flush()
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             env=env, cwd="/", start_new_session=True, close_fds=True)
    log.close()
    with open(pid_file + ".tmp", "w") as handle:
        handle.write("%d\n" % child.pid)
    os.replace(pid_file + ".tmp", pid_file)
    return {"ok": True, "pid": child.pid, "log_offset": offset, "started": time.time()}


def start_systemd(lock, unit, unit_text_b64, unit_path):
    refused = _guard(lock, "start")
    if refused:
        return refused
    text = base64.b64decode(unit_text_b64)
    with open(unit_path + ".tmp", "wb") as handle:
        handle.write(text)
    os.replace(unit_path + ".tmp", unit_path)
    for cmd in (["systemctl", "daemon-reload"], ["systemctl", "reset-failed", unit], ["systemctl", "start", unit]):
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if done.returncode != 0 and cmd[1] != "reset-failed":
            return {"ok": False, "error": "%s: %s" % (" ".join(cmd), done.stdout.decode("utf-8", "replace")[-400:])}
    shown = subprocess.run(["systemctl", "show", "-p", "MainPID", "--value", unit], stdout=subprocess.PIPE)
    pid = int((shown.stdout or b"0").strip() or 0)
    return {"ok": pid > 0, "pid": pid, "log_offset": None, "started": time.time(),
            "error": None if pid > 0 else "unit has no main pid"}


def _log_since(log_file, offset, lines=40):
    data = probe._read(log_file, "rb") if log_file else None
    if data is None:
        return []
    return data[offset or 0:][-65536:].decode("utf-8", "replace").splitlines()[-lines:]


def wait_healthy(lock, port, pid, chunk_s, log_file=None, log_offset=0, generate_timeout=20.0):
    """Poll for up to chunk_s: phase 'loading' (port closed) -> 'starting' (/health 503) ->
    'ready' (/health 200 and /health_generate 200: a real generation). 'crashed' when the main
    process is gone (with the log's tail)."""
    refused = _guard(lock, "wait")
    if refused:
        return refused
    deadline = time.time() + float(chunk_s)
    phase = "loading"
    while True:
        if not _alive(int(pid)):
            return {"ok": True, "phase": "crashed", "pending": True, "log_tail": _log_since(log_file, log_offset)}
        listening, _ = probe._listeners(int(port))
        if listening:
            status, _ = probe.http_get(int(port), "/health", 3.0)
            phase = "starting" if status != 200 else "generating"
            if status == 200:
                gen, _ = probe.http_get(int(port), "/health_generate", generate_timeout)
                if gen == 200:
                    return {"ok": True, "phase": "ready"}
        else:
            phase = "loading"
        if time.time() >= deadline:
            return {"ok": True, "phase": phase, "pending": True}
        time.sleep(POLL_S)  # the moment it turns ready counts: a cheap look (/proc, one local GET)


def log_tail(log_file, offset=0, lines=40):
    return {"ok": True, "log_tail": _log_since(log_file, offset, lines)}


# ---------------------------------------------------------------- observe and gate (for sequences)
def observe(**probe_kwargs):
    """The server probe (the SglangServer fact's document), e.g. under the lock just taken, or
    right after the server turned healthy (what verify compares)."""
    return {"ok": True, "server": probe.collect(**probe_kwargs)}


def _gate_modules():
    try:  # inlined: the command registers them as top-level modules first
        import gate as gate_logic
        import gpu_probe
    except ImportError:  # imported from the package (tests)
        from gpugate import gate as gate_logic
        from gpugate.remote import gpu_probe
    return gate_logic, gpu_probe


def gate_wait(lock, max_used_mib, timeout_s, poll_interval_s=0.05):
    """The GPU gate polled here for up to ``timeout_s`` (gpugate.gate.poll_until_idle: every GPU
    at or under ``max_used_mib``, no holder); ``pending`` while it has not passed."""
    refused = _guard(lock, "gate")
    if refused:
        return refused
    gate_logic, gpu_probe = _gate_modules()
    out = gate_logic.poll_until_idle(lambda: gpu_probe.collect(keep_nvml_open=True), max_used_mib=int(max_used_mib),
                                     timeout_s=max(0.0, float(timeout_s)), poll_interval_s=float(poll_interval_s))
    passed = bool((out.get("wait") or {}).get("passed"))
    return {"ok": True, "gpu": out.get("gpu"), "wait": out.get("wait"), "pending": not passed}


# ---------------------------------------------------------------- several steps in one command
SEQUENCE_STEPS = ("lock_acquire", "lock_renew", "lock_release", "stage_env", "record", "observe", "drain",
                  "kill_and_sweep",
                  "gate_wait", "prepare_start", "start_process", "start_systemd", "wait_healthy", "log_tail")


def _completed(result):
    return result.get("ok") is not False and not result.get("pending")


def sequence(calls, budget_s=None, secrets=None):
    """Run steps in order in ONE remote command (one SSH + pct exec round trip for all of them),
    each only once the one before it has completed: a step that fails (``ok`` false), or has not
    reached its goal yet (``pending``: the lock is held by someone else, the drain or the gate or
    the load goes on), ends the sequence and the operator's side decides what comes next. A call
    with ``always`` runs even then (releasing the lock after a failure).

    Each call: ``{"function", "kwargs", "budget_kwarg"?, "inputs"?, "always"?}``; ``secrets``
    (read from stdin by :func:`main`, never on the command line) maps a call's position ("0", "1"...)
    to more arguments for it: env values, an argv that may hold ``--api-key``;
    ``inputs`` maps an argument to a key of the previous step's result (the new server's pid, from
    the start, for the load's first reading).
    ``budget_kwarg`` names a wait's length argument, cut to what is left of ``budget_s`` (counted
    from the command's start) so that the command returns within one progress chunk; the wait
    still reads at least once. Each result gets ``step_s``: the step's duration measured here.
    """
    began = time.time()
    results = []
    stopped = False
    for index, call in enumerate(calls):
        if stopped and not call.get("always"):
            continue
        name = call["function"]
        kwargs = dict(call.get("kwargs") or {})
        kwargs.update((secrets or {}).get(str(index)) or {})
        for argument, key in (call.get("inputs") or {}).items():
            kwargs[argument] = results[-1].get(key) if results else None
        if call.get("budget_kwarg") and budget_s is not None:
            left = float(budget_s) - (time.time() - began)
            kwargs[call["budget_kwarg"]] = max(0.0, min(float(kwargs.get(call["budget_kwarg"], left)), left))
        step_began = time.time()
        try:
            if name not in SEQUENCE_STEPS:
                raise ValueError("not a step: %r" % name)
            result = globals()[name](**kwargs)
        except Exception as error:  # report, never a traceback on the operator's screen
            result = {"ok": False, "error": "%s: %s" % (type(error).__name__, error)}
        result["step_s"] = round(time.time() - step_began, 3)
        result["function"] = name
        results.append(result)
        if not _completed(result):
            stopped = True
    return {"ok": True, "results": results, "elapsed_s": round(time.time() - began, 3)}


def main(source_args):  # pragma: no cover - the inline entry point
    """``source_args[0]``: the call (base64 JSON). Its secret arguments, if it has any, come as
    one JSON document on stdin: values on a command line are readable in ``ps`` on the host."""
    try:
        call = json.loads(base64.b64decode(source_args[0]).decode())
        kwargs = call["kwargs"]
        if call.get("secret_on_stdin"):
            kwargs.update(json.loads(sys.stdin.read()))
        result = globals()[call["function"]](**kwargs)
    except Exception as error:  # report, never a traceback on the operator's screen
        result = {"ok": False, "error": "%s: %s" % (type(error).__name__, error)}
    print(json.dumps(result))
