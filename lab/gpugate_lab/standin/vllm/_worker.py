"""``VLLM::Worker_TP<r>``: one rank of the multiprocess executor (vllm/v1/executor/multiproc_executor.py
``WorkerProc``), started by EngineCore when the model spans more than one GPU.

Its title: ``Worker`` with ``_PP<p>`` and ``_TP<t>`` where that size is above 1 (``argv[0]``, and
``/proc/self/comm`` as setproctitle leaves it). It holds its rank's memory (vllm/_model.py), says
``READY`` to EngineCore on stdout, then waits. It watches its parent through a death pipe
(``monitor_death_pipe``): when EngineCore is gone, however it went, the pipe's EOF makes it log
"Parent process exited, terminating worker queues" and exit, unless lab fault ``orphan-worker`` is
set then (it stays, holding its memory). SIGTERM (EngineCore's executor shutdown) raises SystemExit.
In real mode it answers generation requests on stdin (the lab's shared real-mode loop).
"""

import json
import os
import signal
import sys

from vllm import _lab, _model
from vllm._lab import common, real


def watch_parent(fd, title):
    def wait():
        with os.fdopen(fd, "rb") as pipe:
            pipe.read()  # blocks until EngineCore (the write end's holder) is gone
        if common.stays_orphaned(title):
            return
        _lab.info("multiproc_executor.py:941", "Parent process exited, terminating worker queues")
        os._exit(0)
    common.thread(wait, name="DeathPipeMonitor")


def main():
    job = json.loads(os.environ.pop("VLLM_STANDIN_WORKER"))
    title = job["title"]
    common.set_comm(title)
    _lab.decorate_logs(title.split("::", 1)[-1])

    def on_signal(signum, frame):
        raise SystemExit()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server handles ^C
    watch_parent(int(job["death_fd"]), title)
    mode = job.get("real")
    try:
        if mode:
            real.own_pipe_stdout()
            held = _model.RealRank(job["rank"], job["plan"], mode, lambda m: _lab.info("gpu_worker.py:310", m))
            report = held.report
        else:
            held, report = _model.load_sim(job["rank"], job["plan"], lambda m: _lab.info("gpu_worker.py:310", m))
    except Exception as exc:  # noqa: BLE001 -- said to EngineCore, which fails the start
        _lab.exception("multiproc_executor.py:1057", "WorkerProc failed to start.", exc)
        common.say_error("%s: %s" % (type(exc).__name__, exc))
        return 1
    common.say("READY " + json.dumps(report))
    if mode:
        real.serve_requests(held.torch, held.logits_of, held.device, common.say, sys.stdin)
    while True:
        signal.pause()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (KeyboardInterrupt, SystemExit):
        sys.exit(0)
