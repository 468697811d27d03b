"""The GPU lock holder: runs on the Proxmox HOST (not in a container), stdlib only, Python >= 3.8.

Sent inline by ``gpugate.claims.hold_gpu_locks`` as ``python3 -S -c <packed source> '<json args>'`` (over
the pct connector's ``run_on_proxmox_host``, as root where pct needs sudo):

1. takes ``/run/gpugate/gpu-<i>.lock`` for each GPU of the transition, in index order (so two
   holders that wait never deadlock), each an exclusive kernel flock: a dead holder frees it;
2. a GPU held by another transition: when that claim's hand-off window is over and its container
   says no such run began (``check_command``: the agent's ``wait`` with no grace), its holder is
   ended and the lock taken (``released`` says so); otherwise releases what it took, prints
   ``{"ok": false, "gpu": i, "owner": <that holder's record>, "began": <does that run exist>}``
   and exits (after ``wait_s``); a lock file that cannot be opened (a directory):
   ``{"ok": false, "gpu": i, "error": ...}``;
3. all held: forks a detached child (new session, stdio on /dev/null) that keeps the locks, writes
   its record ``{"vmid", "run", "gpus", "pid", "since", "handoff_until"}`` into each lock file, and runs
   ``pct exec <vmid> -- sh -c '<command>'``, the container agent's ``wait`` for the run
   (gpugate.agentcmd.wait_command: returns when that run has ended, or when it did not begin within
   grace_s); when that returns the locks go, and a line (with the wait's answer) is appended to
   /run/gpugate/holders.log;
4. the parent prints ``{"ok": true, "pid": <holder>}`` once the records are written, and exits,
   so the SSH command returns at once while the holder lives on.

With ``start`` in the arguments (``gpugate.claims.hand_off_holding_gpu_locks``: the locks and the
hand-off in ONE round trip), the parent reads the start document on its stdin before anything else,
and once the holder holds the locks it runs the hand-off itself: ``pct exec <vmid> -- sh -c
'<start["command"]>'`` (the agent's ``start``) with that document on its stdin, ``claim_until`` set
to this claim's hand-off window (the agent refuses a hand-off after it); pct's stderr goes to its
own, and its answer becomes ``"start": {"rc": <pct's exit code>, "stdout": <its output>}`` in the
line it prints. The holder begins its ``wait`` only when the hand-off has returned (or the parent
is gone): the agent is installed by then, and the two do not compete for the host's CPU. A claim
that is busy or cannot be taken runs no hand-off (``start`` is absent from the answer).
"""

import fcntl
import json
import os
import subprocess
import sys
import time


def _read_owner(fd):
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return None


def acquire(lock_dir, gpus, wait_s):
    """([fd, ...], None) with every lock held, or ([], {"gpu": i, "owner": ...}) when one is busy,
    or ([], {"gpu": i, "error": why}) when a lock file cannot be opened (a directory in its place)."""
    try:
        os.makedirs(lock_dir, mode=0o755, exist_ok=True)
    except OSError as exc:
        return [], {"gpu": None, "error": "the lock directory %s cannot be made (%s)" % (lock_dir, exc.strerror or exc)}
    deadline = time.monotonic() + max(0.0, float(wait_s))
    held = []
    for gpu in sorted(set(int(g) for g in gpus)):
        path = os.path.join(lock_dir, "gpu-%d.lock" % gpu)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:  # a directory (or anything not a file) where the lock file should be
            for other in held:
                os.close(other)
            what = "is a directory, not a lock file" if os.path.isdir(path) else "cannot be opened (%s)" % (exc.strerror or exc)
            return [], {"gpu": gpu, "error": "%s %s: remove it on the Proxmox host" % (path, what)}
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    owner = _read_owner(fd)
                    for other in held + [fd]:
                        os.close(other)
                    return [], {"gpu": gpu, "owner": owner}
                time.sleep(0.05)
        held.append(fd)
    return held, None


RUN_ID_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")


def stale(owner, now):
    """Whether a busy lock's ``owner`` record may be a claim whose run never began: its hand-off
    window is over (``handoff_until``, plus 1 s: the container's agent refuses a hand-off within
    2 s of it), so that run can no longer begin; the container is asked next.

    >>> stale({"run": "r1", "vmid": 129, "pid": 7, "handoff_until": 10.0}, 11.5), stale({"handoff_until": 10.0}, 10.5)
    (True, False)
    """
    if not isinstance(owner, dict) or not owner.get("pid") or not owner.get("run"):
        return False
    until = owner.get("handoff_until")
    return isinstance(until, (int, float)) and now > until + 1.0


def run_began(args, owner):
    """Ask the owner's container whether its run began: the agent's ``wait`` for that run with no
    grace and no wait (``check_command``: its shell text with ``@RUN@`` for the run id). -> True,
    False, or None when the container gives no clear answer (then nothing is released)."""
    run = str(owner.get("run") or "")
    template = args.get("check_command") or ""
    if "@RUN@" not in template or not run or not set(run) <= RUN_ID_CHARS or not str(owner.get("vmid", "")).isdigit():
        return None
    wait_args = dict(args, vmid=owner["vmid"], command=template.replace("@RUN@", run))
    try:
        done = subprocess.run(_wait_argv(wait_args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in reversed(done.stdout.decode("utf-8", "replace").splitlines()):
        try:
            answer = json.loads(line.strip())
        except ValueError:
            continue
        if isinstance(answer, dict) and answer.get("run") == run and "appeared" in answer:
            return bool(answer["appeared"])
    return None


def release_stale(args, owner):
    """End the holder of a claim whose run never began (its container says so, and the run can no
    longer begin): a SIGKILL of the holder recorded in the lock, whose kernel flocks then go.
    -> what was released, or None."""
    if not stale(owner, time.time()) or run_began(args, owner) is not False:
        return None
    pid = int(owner["pid"])
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as handle:
            if b"python" not in handle.read():  # the recorded pid is no longer a holder: nothing to end
                return None
        os.kill(pid, 9)  # SIGKILL: a wedged holder (stopped, stuck in pct) would not act on a SIGTERM
    except (OSError, ValueError):
        return None
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and os.path.exists("/proc/%d" % pid):
        time.sleep(0.05)
    return {"vmid": owner.get("vmid"), "run": owner.get("run"), "pid": pid, "gpus": owner.get("gpus"),
            "why": "no run %s began in container %s" % (owner.get("run"), owner.get("vmid"))}


def _record(held, record):
    text = (json.dumps(record, sort_keys=True) + "\n").encode()
    for fd in held:
        os.ftruncate(fd, 0)
        os.pwrite(fd, text, 0)


def _wait_argv(args):
    """pct exec of the container agent's wait (``command``: gpugate.agentcmd.wait_command's shell text)."""
    argv = list(args["pct"]) + ["exec", str(args["vmid"]), "--"]
    if args.get("clear_env", True):
        argv += ["env", "-i", "PATH=" + args["path"], "HOME=/root", "container=lxc"]
    return argv + ["sh", "-c", args["command"]]


def _hold(args, held, ready_w, go_r=None):
    """The detached holder (a child): record, tell the parent, wait for the run's end, release.
    ``go_r``: the parent runs the hand-off; the wait begins once it closes this pipe (done, or gone)."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(null, std)
    now = time.time()
    record = {"vmid": args["vmid"], "run": args["run"], "gpus": sorted(set(args["gpus"])), "pid": os.getpid(),
              "since": now, "handoff_until": now + float(args.get("grace_s", 30))}
    _record(held, record)
    os.write(ready_w, b"1")
    os.close(ready_w)
    started = time.monotonic()
    if go_r is not None:
        try:
            while os.read(go_r, 64):
                pass
        except OSError:
            pass
        os.close(go_r)
    while True:
        try:
            done = subprocess.run(_wait_argv(args), stdin=null, stdout=subprocess.PIPE, stderr=null)
            rc, answer = done.returncode, done.stdout.decode("utf-8", "replace").strip()[-500:]
        except OSError as exc:  # no pct: the run cannot be followed; release at once
            rc, answer = "%s: %s" % (type(exc).__name__, exc), ""
        # The locks are taken before the hand-off, and the hand-off installs the agent: until it is
        # there (agent_missing), ask again, for as long as the run may take to appear.
        if '"agent_missing"' not in answer or time.monotonic() - started > float(args.get("grace_s", 30)):
            break
        time.sleep(0.25)
    for fd in held:
        os.close(fd)  # the locks go here (the parent closed its copies already)
    line = dict(record, released=time.time(), held_s=round(time.monotonic() - started, 3), wait_rc=rc,
                wait_answer=answer)
    try:
        with open(os.path.join(args["lock_dir"], "holders.log"), "a") as log:
            log.write(json.dumps(line, sort_keys=True) + "\n")
    except OSError:
        pass
    os._exit(0)


def _with_claim_until(document, until):
    """The start document with ``claim_until`` (this claim's hand-off window) set; a document that
    is not a JSON object goes as it is (the agent refuses it with its own error).

    >>> _with_claim_until(b'{"run": "r1"}', 10.5), _with_claim_until(b'nonsense', 10.5)
    (b'{"run": "r1", "claim_until": 10.5}', b'nonsense')
    """
    try:
        doc = json.loads(document.decode("utf-8"))
    except ValueError:
        return document
    if not isinstance(doc, dict):
        return document
    doc["claim_until"] = until
    return json.dumps(doc, separators=(", ", ": ")).encode("utf-8")


def _hand_off(args, document, until):
    """The container agent's ``start`` through pct, its stdin the start document -> what the line
    printed says of it; pct's own stderr (a stopped container, ...) goes to this program's."""
    start = args["start"]
    try:
        done = subprocess.run(_wait_argv(dict(args, command=start["command"])), input=_with_claim_until(document, until),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:  # no pct: the hand-off cannot run
        sys.stderr.write("%s: %s\n" % (type(exc).__name__, exc))
        return {"rc": 127, "stdout": ""}
    if done.stderr:
        sys.stderr.write(done.stderr.decode("utf-8", "replace"))
        sys.stderr.flush()
    return {"rc": done.returncode, "stdout": done.stdout.decode("utf-8", "replace")}


def main(argv):
    args = json.loads(argv[-1])
    # the hand-off's document first: all of it is on stdin (the holder must not keep the session's stdin)
    document = sys.stdin.buffer.read() if args.get("start") else None
    held, busy = acquire(args["lock_dir"], args["gpus"], args.get("wait_s", 0))
    released = []
    while busy is not None and busy.get("owner") and len(released) < 8:
        # a claim whose run never began ends here, not after its holder's own grace
        gone = release_stale(args, busy["owner"])
        if gone is None:
            break
        released.append(gone)
        held, busy = acquire(args["lock_dir"], args["gpus"], 1.0)
    if busy is not None:
        if busy.get("owner"):  # whether the claiming run exists: a deploy of that same container attaches to it
            busy["began"] = run_began(args, busy["owner"])
        print(json.dumps(dict(busy, ok=False, released=released)))
        return 0
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe() if document is not None else (None, None)
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        if go_w is not None:
            os.close(go_w)
        try:
            _hold(args, held, ready_w, go_r)
        finally:
            os._exit(1)
    os.close(ready_w)
    if go_r is not None:
        os.close(go_r)
    for fd in held:
        os.close(fd)  # the child's copies keep the locks
    ready = os.read(ready_r, 1)
    until = time.time() + float(args.get("grace_s", 30))
    answer = ({"ok": True, "pid": pid, "released": released, "handoff_until": until} if ready
              else {"ok": False, "error": "the holder died"})
    if ready and document is not None:
        answer["start"] = _hand_off(args, document, until)
    if go_w is not None:
        os.close(go_w)  # the holder's wait begins
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
