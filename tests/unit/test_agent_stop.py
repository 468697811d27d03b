"""The agent's stop on real local processes in a PID namespace of their own (as a container's): what it
signals (the server's own tree, stray server parts of its port) and what it never touches (a process
in the server's process group that is not in its tree, a benchmark client, another port's server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PORT = 39871
ROOT = Path(__file__).resolve().parents[2]

PRELUDE = r'''
import json, os, shlex, subprocess, sys, tempfile, time
from gpugate.agent import journal as agent_journal, server, state, transition as agent_transition
from gpugate.rules import procfs
tmp = tempfile.mkdtemp()
state.STATE_DIR, state.RUNS_DIR, state.RUN_DIR = tmp + "/lib", tmp + "/lib/runs", tmp + "/run"
state.LOCK_PATH = tmp + "/run/transition.lock"
PY = sys.executable
def spawn(argv, **kw):
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
def titled(title):  # a process whose argv[0] is an SGLang title, as setproctitle leaves it
    return [PY, "-c", "import os, sys; os.execv(sys.executable, [%r, '-c', 'import time; time.sleep(60)'])" % title]
def wait_for(predicate, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline and not predicate():
        time.sleep(0.02)
    return predicate()
def transition(**doc):
    base = {"run": "t", "desired": None, "budgets": {"drain_timeout_s": 5, "kill_grace_s": 5}}
    base.update(doc)
    return agent_transition.Transition(base, agent_journal.Journal("t"))
'''


def in_own_pid_namespace(code: str) -> dict:
    """Run ``code`` (which sets ``result``) as PID 1's child in a new PID namespace with its own /proc,
    so the stop's sweep sees only the test's processes, never this machine's (other labs' stand-ins)."""
    if os.geteuid() != 0:
        pytest.skip("needs root for unshare")
    script = PRELUDE + code + "\nprint(json.dumps(result))\n"
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=90, cwd=str(ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_stop_drains_kills_the_tree_and_sweeps_only_server_parts_of_its_port():
    result = in_own_pid_namespace(f"""
# the server: a main whose child is a scheduler; started with a daemon in ONE process group
group = spawn(["sh", "-c", "%s & %s & wait" % (
    " ".join(shlex.quote(a) for a in [PY, "-c", "import subprocess, sys, time; subprocess.Popen(" + repr(titled("sglang::scheduler_TP0")) + "); time.sleep(60)",
                                  "-m", "sglang.launch_server", "--port", "{PORT}"]),
    " ".join(shlex.quote(a) for a in [PY, "-c", "import time; time.sleep(60)", "neighbour"]))], start_new_session=True)
assert wait_for(lambda: len(server.find_server(procfs.table(), {PORT})[1]) == 2)
stray = spawn(titled("sglang::scheduler_TP1"))  # a worker title outside any tree, holding no GPU: kept
second = spawn([PY, "-c", "import time; time.sleep(60)", "-m", "sglang.launch_server", "--port", "{PORT}"])
bench = spawn([PY, "-c", "import time; time.sleep(60)", "-m", "sglang.bench_serving", "--port", "{PORT}"])
other = spawn([PY, "-c", "import subprocess, time; subprocess.Popen(" + repr(titled("sglang::scheduler_TP0")) + "); time.sleep(60)",
               "-m", "sglang.launch_server", "--port", "{PORT + 1}"])
assert wait_for(lambda: len(server.find_server(procfs.table(), {PORT + 1})[1]) == 2)
table = procfs.table()
main, tree = server.find_server(table, {PORT})
neighbour = [p["pid"] for p in table.values() if p["argv"][-1:] == ["neighbour"]][0]
other_tree = server.find_server(table, {PORT + 1})[1]
t = transition()
t.stop.server({PORT}, "desired", 5)
after = procfs.table()
alive = lambda pid: procfs.alive(pid)
result = {{"tree": tree, "main_pgid": main["pgid"], "neighbour_pgid": table[neighbour]["pgid"],
          "tree_alive": [p for p in tree if alive(p)], "second_alive": alive(second.pid),
          "neighbour_alive": alive(neighbour), "bench_alive": alive(bench.pid), "stray_alive": alive(stray.pid),
          "other_alive": [p for p in other_tree if alive(p)], "other_tree": other_tree,
          "events": [e for e in t.ctx.journal.events if e["step"] in ("drain", "kill", "sweep")]}}
""")
    assert result["main_pgid"] == result["neighbour_pgid"]  # the trap: one process group
    assert result["tree_alive"] == [] and result["second_alive"] is False
    assert result["neighbour_alive"] and result["bench_alive"] and result["stray_alive"]
    assert result["other_alive"] == result["other_tree"]
    drained = [e for e in result["events"] if e["step"] == "drain" and e["phase"] == "end"]
    assert drained and drained[0]["drained"] is True
    sweep = [e for e in result["events"] if e["step"] == "sweep"]
    assert [p["why"] for p in sweep[0]["pids"]] == ["a server main configured for :%d" % PORT]


def test_a_drain_past_its_deadline_ends_in_sigkill_of_the_tree():
    result = in_own_pid_namespace(f"""
ignorer = subprocess.Popen([PY, "-c", "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                            "subprocess.Popen(" + repr(titled("sglang::detokenizer")) + "); print('ready', flush=True); time.sleep(60)",
                            "-m", "sglang.launch_server", "--port", "{PORT}"], start_new_session=True, stdout=subprocess.PIPE)
ignorer.stdout.readline()
assert wait_for(lambda: len(server.find_server(procfs.table(), {PORT})[1]) == 2)
tree = server.find_server(procfs.table(), {PORT})[1]
t = transition()
began = time.time()
t.stop.server({PORT}, "desired", 0.3)
result = {{"took": time.time() - began, "code": ignorer.wait(), "alive": [p for p in tree if procfs.alive(p)],
          "drain": [e for e in t.ctx.journal.events if e["step"] == "drain" and e["phase"] == "end"][0]}}
""")
    assert result["drain"]["drained"] is False and result["code"] == -9 and result["alive"] == []
    assert result["took"] < 3
