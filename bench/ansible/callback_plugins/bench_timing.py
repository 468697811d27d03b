"""Ansible callback (bench only): one JSON line per task start and per host result, with wall time.

Written to $BENCH_ANSIBLE_LOG. A result of a command/shell task (ok, failed, or one until-retry) is one
remote command: with pipelining on, each module run is exactly one SSH exec on the Proxmox host.
"""

import json
import os
import time

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
    name: bench_timing
    type: aggregate
    short_description: wall-clock times of tasks and results for gpugate's benchmark
    description: writes JSON lines to $BENCH_ANSIBLE_LOG
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "bench_timing"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        path = os.environ.get("BENCH_ANSIBLE_LOG")
        self._out = open(path, "a", buffering=1) if path else None

    def _write(self, **record):
        if self._out:
            record["t"] = time.time()
            self._out.write(json.dumps(record) + "\n")

    def _result(self, event, result):
        task = result._task
        self._write(event=event, task=task.get_name(), action=task.action,
                    host=result._host.get_name(), attempts=result._result.get("attempts"),
                    stdout=str(result._result.get("stdout", ""))[:200])

    def v2_playbook_on_start(self, playbook):
        self._write(event="playbook_start")

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._write(event="task_start", task=task.get_name(), action=task.action)

    def v2_runner_on_ok(self, result):
        self._result("ok", result)

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._result("failed", result)

    def v2_runner_on_unreachable(self, result):
        self._result("unreachable", result)

    def v2_runner_on_skipped(self, result):
        self._result("skipped", result)

    def v2_runner_retry(self, result):
        self._result("retry", result)

    def v2_playbook_on_stats(self, stats):
        self._write(event="playbook_end")
