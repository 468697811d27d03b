"""The GPU lock holder: runs on the Proxmox HOST (not in a container), stdlib only, Python >= 3.8.

Sent inline by ``PctConnector.hold_gpu_locks`` as ``python3 -c <packed source> '<json args>'``:

1. takes ``/run/gpugate/gpu-<i>.lock`` for each GPU of the transition, in index order (so two
   holders that wait never deadlock), each an exclusive kernel flock: a dead holder frees it;
2. a GPU held by another transition: releases what it took, prints
   ``{"ok": false, "gpu": i, "owner": <that holder's record>}`` and exits (after ``wait_s``);
3. all held: forks a detached child (new session, stdio on /dev/null) that keeps the locks, writes
   its record ``{"vmid", "run", "gpus", "pid", "since"}`` into each lock file, and runs
   ``pct exec <vmid> -- sh -c '<command>'``, the container agent's ``wait`` for the run
   (gpugate.agentcmd.wait_command: returns when that run has ended, or when it did not begin within
   grace_s); when that returns the locks go, and a line (with the wait's answer) is appended to
   /run/gpugate/holders.log;
4. the parent prints ``{"ok": true, "pid": <holder>}`` once the records are written, and exits,
   so the SSH command returns at once while the holder lives on.
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
    """([fd, ...], None) with every lock held, or ([], {"gpu": i, "owner": ...}) when one is busy."""
    os.makedirs(lock_dir, mode=0o755, exist_ok=True)
    deadline = time.monotonic() + max(0.0, float(wait_s))
    held = []
    for gpu in sorted(set(int(g) for g in gpus)):
        fd = os.open(os.path.join(lock_dir, "gpu-%d.lock" % gpu), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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


def _hold(args, held, ready_w):
    """The detached holder (a child): record, tell the parent, wait for the run's end, release."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(null, std)
    record = {"vmid": args["vmid"], "run": args["run"], "gpus": sorted(set(args["gpus"])), "pid": os.getpid(),
              "since": time.time()}
    _record(held, record)
    os.write(ready_w, b"1")
    os.close(ready_w)
    started = time.monotonic()
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


def main(argv):
    args = json.loads(argv[-1])
    held, busy = acquire(args["lock_dir"], args["gpus"], args.get("wait_s", 0))
    if busy is not None:
        print(json.dumps(dict(busy, ok=False)))
        return 0
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        try:
            _hold(args, held, ready_w)
        finally:
            os._exit(1)
    os.close(ready_w)
    for fd in held:
        os.close(fd)  # the child's copies keep the locks
    ready = os.read(ready_r, 1)
    print(json.dumps({"ok": bool(ready), "pid": pid} if ready else {"ok": False, "error": "the holder died"}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
