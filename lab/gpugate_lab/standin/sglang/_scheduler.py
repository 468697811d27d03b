"""A stand-in worker process: ``sglang::scheduler_TP<i>`` (holds GPU memory) or ``sglang::detokenizer``.

Started by launch_server with argv[0] set to the title, so /proc/PID/cmdline begins with it, and with
its job in $SGLANG_STANDIN_WORKER (JSON). Reports ``READY`` or ``ERROR`` on stdout, then sleeps until
killed. Like SGLang's ``kill_itself_when_parent_died`` it asks for a signal when its parent dies
(PR_SET_PDEATHSIG); unless fault ``orphan-worker`` is set at that moment, it then SIGKILLs itself.
"""

import ctypes
import json
import os
import signal
import sys
import time
import traceback

from sglang._sim import gpusim

PR_SET_PDEATHSIG = 1
CONTEXT_MIB = 518  # a CUDA context on an H200, measured (shared/reference/nvml-and-containers.md)


_title = ""


def _set_comm(title: str) -> None:
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(title[:15])
    except OSError:
        pass


def _log(prefix: str, message: str) -> None:
    try:
        sys.stderr.write("[%s %s] %s\n" % (time.strftime("%Y-%m-%d %H:%M:%S"), prefix, message))
        sys.stderr.flush()
    except (OSError, ValueError):
        # the reader of the server's log (the agent's log pump) ends with the main process: an
        # orphaned worker that says so into a pipe nobody reads must not die of EPIPE for it (a worker
        # of a killed parent keeps its memory, as SGLang's do; the fault test saw 7 of 8 survive)
        pass


def _say(line: str) -> None:
    """One line to the parent (READY, ERROR ..., or a generation's answer in real mode)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _on_parent_death(signum, frame) -> None:
    if gpusim.read_faults().get("orphan-worker"):
        # fault: survive the parent, keep the memory
        _log(_title, "parent process died; staying alive (lab fault orphan-worker)")
        return
    os.kill(os.getpid(), signal.SIGKILL)


def _die_with_parent(parent_pid: int) -> None:
    signal.signal(signal.SIGUSR2, _on_parent_death)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGUSR2, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        _on_parent_death(signal.SIGUSR2, None)


def main() -> int:
    global _title
    job = json.loads(os.environ.pop("SGLANG_STANDIN_WORKER"))
    _title = job["title"]
    _set_comm(job["title"])
    _die_with_parent(int(job["parent_pid"]))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles ^C and kills the tree
    holdings = []
    if job["kind"] == "scheduler" and job.get("real"):
        # `lab up --gpus real`: real memory and a real model (sglang/_real.py)
        try:
            from sglang._real import run_scheduler

            holdings.append(run_scheduler(job, _log, _say))
        except Exception as exc:
            _log(job["log_prefix"], "Scheduler hit an exception: %s" % traceback.format_exc().rstrip())
            _say("ERROR %s: %s" % (type(exc).__name__, exc))
            return 1
        while True:  # it said READY and served until its parent closed the pipe; it holds on to the pool
            signal.pause()
    elif job["kind"] == "scheduler":
        gpu, prefix = int(job["gpu"]), job["log_prefix"]
        stuck = bool(gpusim.read_faults().get("stuck-memory"))
        try:
            config = gpusim.load_config()
            if not 0 <= gpu < int(config["count"]):
                raise RuntimeError("CUDA error: invalid device ordinal")
            free = gpusim.memory_info(gpu).free_mib
            _log(prefix, "Load weight begin. avail mem=%.2f GB" % (free / 1024))
            holdings.append(gpusim.allocate(gpu, CONTEXT_MIB, stuck=stuck, require_free=True))
            try:
                holdings.append(gpusim.allocate(gpu, int(job["mib"]), stuck=stuck, require_free=True))
            except gpusim.NotEnoughMemory:
                raise RuntimeError("Not enough memory. Please try to increase --mem-fraction-static.")
            _log(prefix, "KV Cache is allocated. avail mem=%.2f GB" % (gpusim.memory_info(gpu).free_mib / 1024))
        except Exception as exc:
            if isinstance(exc, gpusim.NotEnoughMemory):
                exc = RuntimeError("CUDA out of memory.")
            _log(prefix, "Scheduler hit an exception: Traceback (most recent call last):\n"
                 '  File "/usr/lib/python3/dist-packages/sglang/srt/managers/scheduler.py", line 2960, '
                 "in run_scheduler_process\n    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, "
                 "moe_ep_rank, pp_rank, dp_rank)\n%s: %s" % (type(exc).__name__, exc))
            sys.stdout.write("ERROR %s\n" % exc)
            sys.stdout.flush()
            return 1
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    while True:
        signal.pause()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(1)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
