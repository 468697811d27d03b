"""The container agent driven directly (no pyinfra): its commands through `pct exec` in a lab container
with the SGLang stand-in, real signals and processes, faults at the awkward moments.

Every transition must end in exactly one of verified / rolled_back / nothing_serves, say which in the
journal, the history and observe, and never signal what the server does not own. One lab for the
module (one host, container 129, 4 GPUs: what it proves does not depend on the rank count, and each rank is
a process to start); the tests run in order, each from the state the previous left.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time

import pytest

from gpugate import agentcmd
from tests.conftest import module_lab

pytestmark = [pytest.mark.lab]

PY = "/usr/bin/python3"
PORT = 30000
MODEL = "/opt/models/lab-model"
FAST = {"SGLANG_STANDIN_LOAD_S": "0.3"}
SHORT = {"drain_timeout_s": 5, "kill_grace_s": 5, "gate_timeout_s": 30, "start_timeout_s": 60}  # generous: only failures wait them out
API_KEY = "sk-canary-7f3a9b"
TOKEN = "hf-canary-c0ffee"
OUTCOMES = ("verified", "rolled_back", "nothing_serves")
TP = 4  # the server's ranks, one per GPU of the container


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-agent", hosts=1, gpus=TP)


# ------------------------------------------------------------------------------------------ helpers
def ct(lab, script: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """A shell script in container 129 (lab host's namespaces + pct exec, no SSH)."""
    from gpugate_lab import core

    argv = core.host_exec_argv(lab.dir, "pve1") + ["pct", "exec", "129", "--", "sh", "-c", script]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout,
                          stdin=None if stdin is not None else subprocess.DEVNULL)


def run_agent(lab, command: str, stdin: str | None = None) -> dict:
    out = ct(lab, command, stdin)
    return agentcmd.parse_output(out.stdout.splitlines())


def argv(*flags: str, port: int = PORT, model: str = MODEL) -> list[str]:
    return [PY, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port), "--tp-size", str(TP), *flags]


def spec(*flags: str, env=None, port: int = PORT, model: str = MODEL, gpus=tuple(range(TP))) -> dict:
    return {"argv": argv(*flags, port=port, model=model), "env": dict(FAST if env is None else env), "port": port,
            "gpus": list(gpus), "supervisor": "process", "record": {"flags": {"tp-size": TP, "extra": list(flags)}}}


RUNS = iter(range(1, 10_000))


def start(lab, desired, rollback_to="auto", budgets=None, **extra) -> dict:
    doc = {"run": f"t{next(RUNS)}-{int(time.time())}", "operator": "test@lab", "desired": desired,
           "rollback_to": rollback_to, "budgets": {**SHORT, **(budgets or {})}, **extra}
    answer = run_agent(lab, agentcmd.start_command(PY), agentcmd.start_stdin(doc, include_source=True))
    assert answer.get("ok"), answer
    return answer


def follow(lab, run: str, timeout: float = 60) -> tuple[dict, list[dict]]:
    """Follow a run to its end: (the last follow answer, every event). As the controller follows (batch):
    one command answers at the end or after its wait with every event since, not one command per event
    (a run journals about 20: each a pct exec and a Python start in the container)."""
    offset, events = 0, []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = run_agent(lab, agentcmd.follow_command(PY, run, offset, 10, batch=True))
        assert "error" not in answer, answer
        events += answer["events"]
        offset = answer["offset"]
        if answer["ended"]:
            return answer, events
    raise AssertionError(f"run {run} did not end within {timeout}s: {events[-3:]}")


def transition(lab, desired, **kwargs) -> tuple[dict, list[dict]]:
    return follow(lab, start(lab, desired, **kwargs)["run"])


def observe(lab, **args) -> dict:
    doc = run_agent(lab, agentcmd.observe_command(PY, {"port": PORT, **args}))
    assert "sglang" in doc, doc
    return doc


def server(lab, **args) -> dict:
    return observe(lab, **args)["sglang"]


def step_events(events, step, phase=None):
    return [e for e in events if e.get("step") == step and (phase is None or e.get("phase") == phase)]


def ensure_serving(lab, desired) -> None:
    doc = server(lab)
    if not doc["serving"] or doc["main"]["argv_hash"] != agentcmd.argv_hash(desired["argv"]):
        answer, _ = transition(lab, desired)
        assert answer["outcome"] == "verified", answer
    assert server(lab)["serving"]


def pids_alive(lab, pids) -> list[int]:
    out = ct(lab, " ".join(f"[ -d /proc/{pid} ] && echo {pid};" for pid in pids))
    return sorted(int(x) for x in out.stdout.split())


def pid_of(lab, pattern: str) -> list[int]:
    out = ct(lab, f"pgrep -f {shlex.quote(pattern)}")
    return sorted(int(x) for x in out.stdout.split())


def wait_for_event(lab, run, step, phase="begin", timeout=20.0) -> dict:
    deadline = time.monotonic() + timeout
    offset = 0
    while time.monotonic() < deadline:
        answer = run_agent(lab, agentcmd.follow_command(PY, run, offset, 1))
        offset = answer.get("offset", offset)
        for event in answer.get("events") or []:
            if event.get("step") == step and event.get("phase") == phase:
                return event
        if answer.get("ended"):
            break
    raise AssertionError(f"no {step} {phase} event in run {run}")


# ------------------------------------------------------------------------------------------ tests
def test_first_start_is_verified_and_observe_reports_it(lab):
    missing = run_agent(lab, agentcmd.observe_command(PY, {"port": PORT}))
    assert missing.get("agent_missing") is True
    inline = run_agent(lab, agentcmd.inline_observe_command(PY, {"port": PORT}))
    assert inline["sglang"]["running"] is False and inline["agent"]["sha256"] == agentcmd.agent_sha()
    assert ct(lab, "ls /var/lib/gpugate 2>/dev/null").stdout == ""  # the inline observe wrote nothing

    answer, events = transition(lab, spec(), rollback_to=None)
    assert answer["outcome"] == "verified", events[-3:]
    assert [e["step"] for e in events if e["phase"] == "begin"][:2] == ["run", "stop"]
    for step in ("gate", "prepare", "start", "load", "verify", "commit"):
        assert step_events(events, step), step
    doc = server(lab)
    assert doc["serving"] and doc["workers"] == {"expected": TP, "alive": TP, "dead": 0, "zombies": []}
    assert doc["transition"]["outcome"] == "verified" and doc["transition"]["active"] is False
    assert [r["argv_hash"] for r in doc["history"]["good"]] == [agentcmd.argv_hash(argv())]
    assert doc["sglang_version"]
    mode = ct(lab, f"stat -c %a /var/log/gpugate/sglang-{PORT}.log /etc/gpugate/sglang-{PORT}.env "
                   f"/var/lib/gpugate/sglang-{PORT}.json /var/lib/gpugate/agent-{agentcmd.agent_sha()}.py").stdout
    assert mode.split() == ["600"] * 4


def test_change_with_secrets_then_same_spec_adds_nothing(lab):
    secret = spec("--api-key", API_KEY, env={**FAST, "HF_TOKEN": TOKEN})
    answer, events = transition(lab, secret)
    assert answer["outcome"] == "verified", events[-3:]
    doc = observe(lab, env_names=["HF_TOKEN"], tail_lines=60)
    text = json.dumps(doc) + json.dumps(events)
    assert API_KEY not in text and TOKEN not in text
    assert any("api_key=" in line for line in doc["sglang"]["log_tail"])  # SGLang's ServerArgs line, redacted
    assert doc["sglang"]["env_hashes"]["HF_TOKEN"] == agentcmd.env_hash(TOKEN)
    good = doc["sglang"]["history"]["good"]
    assert [r["argv_hash"] for r in good] == [agentcmd.argv_hash(secret["argv"]), agentcmd.argv_hash(argv())]
    journal = ct(lab, "cat /var/lib/gpugate/runs/*.jsonl").stdout
    assert journal and API_KEY not in journal and TOKEN not in journal
    log = ct(lab, f"cat /var/log/gpugate/sglang-{PORT}.log").stdout  # written through the log pump
    assert "api_key='***'" in log and API_KEY not in log and TOKEN not in log
    answer, _ = transition(lab, secret, restart=True)
    assert answer["outcome"] == "verified"
    assert len(server(lab)["history"]["good"]) == 2  # a same-spec restart adds nothing


def test_a_good_spec_of_the_history_is_started_by_its_key(lab):
    ensure_serving(lab, spec())
    good = server(lab)["history"]["good"]
    older = next(r for r in good if r["argv_hash"] != agentcmd.argv_hash(argv()))
    answer, events = transition(lab, {"history": older["key"], "port": PORT}, rollback_to={"running": True})
    assert answer["outcome"] == "verified", events[-4:]
    doc = server(lab, env_names=["HF_TOKEN"])
    assert doc["main"]["argv_hash"] == older["argv_hash"] and doc["env_hashes"]["HF_TOKEN"] == agentcmd.env_hash(TOKEN)
    bad = run_agent(lab, agentcmd.start_command(PY), agentcmd.start_stdin(
        {"run": "bad-ref", "desired": {"history": "nope", "port": PORT}}, include_source=False))
    assert bad["ok"] is False and "no good spec 'nope'" in bad["error"]


def test_crash_at_start_rolls_back_to_the_previous_server(lab):
    ensure_serving(lab, spec())
    ct(lab, "mkdir -p /opt/models/broken")  # no config.json: the stand-in exits 1 with SGLang's traceback
    answer, events = transition(lab, spec(model="/opt/models/broken"))
    assert answer["outcome"] == "rolled_back", events[-4:]
    assert "config.json" in answer["reasons"]["desired"]
    doc = server(lab)
    assert doc["serving"] and doc["main"]["argv_hash"] == agentcmd.argv_hash(argv())
    assert doc["history"]["good"][0]["argv_hash"] == agentcmd.argv_hash(argv())  # never recorded as good
    assert "config.json" in doc["history"]["failed"][0]["reason"]
    assert doc["history"]["last"]["outcome"] == "rolled_back"


def test_never_healthy_rolls_back(lab):
    ensure_serving(lab, spec())
    answer, events = transition(lab, spec(env={"SGLANG_STANDIN_LOAD_S": "60"}), budgets={"start_timeout_s": 2, "rollback_start_timeout_s": 30})
    assert answer["outcome"] == "rolled_back", events[-4:]
    assert "not healthy within 2s" in answer["reasons"]["desired"]
    assert server(lab)["serving"]


def test_a_never_healthy_starts_tail_is_the_servers_own_words_not_our_polls(lab):
    # /health answers 503 for the whole budget: the agent polls it every 50 ms and the server's access
    # log writes each poll; the tail the failure shows must still be what the server itself said last.
    lab.fault("pve1", 129, "never-healthy")
    try:
        # 6 s: the server must get as far as its 503s within the budget (CI, loaded: 3 s ended it while
        # it still started, and its tail had no /health line to leave out)
        answer, events = transition(lab, spec(), rollback_to=None, restart=True, budgets={"start_timeout_s": 6})
    finally:
        lab.fault("pve1", 129, "never-healthy", clear=True)
    assert answer["outcome"] == "nothing_serves", events[-4:]
    tail = [e for e in step_events(events, "load", "end") if e.get("state") == "timeout"][0]["log_tail"]
    assert not any("127.0.0.1" in line and '"GET /health' in line for line in tail), tail
    assert any("/health stays 503" in line for line in tail), tail
    polls = ct(lab, "grep -c 'GET /health HTTP' /var/log/gpugate/sglang-%d.log" % PORT).stdout.strip()
    assert int(polls or 0) > 20  # the polls are in the log itself; only the tail leaves them out


def test_a_hand_started_server_is_adopted_without_its_login_environment(lab):
    # an operator started the server over SSH in the container (no pid file, no env file of ours)
    answer, _ = transition(lab, None, port=PORT)  # nothing on the port (the desired state: no server)
    assert answer["outcome"] == "verified", answer
    session = ("USER=root LOGNAME=root HOME=/root SHELL=/bin/bash SSH_CLIENT='10.0.0.9 51000 22' "
               "GPUGATE_LAB_HOST=pve2 SGLANG_STANDIN_LOAD_S=0.3 HF_TOKEN=hf-hand-7e11a2")
    hand = argv("--log-level", "warning")  # an argv of no history entry
    ct(lab, f"cd /root && env {session} setsid {shlex.join(hand)} >/root/hand.log 2>&1 < /dev/null &")
    deadline = time.monotonic() + 30
    while not server(lab)["serving"] and time.monotonic() < deadline:
        time.sleep(0.3)
    assert server(lab)["serving"], ct(lab, "cat /root/hand.log").stdout[-2000:]
    answer, _ = transition(lab, spec())
    assert answer["outcome"] == "verified", answer
    doc = server(lab)
    adopted = [r for r in doc["history"]["good"] if r.get("source", "").startswith("adopted")]
    assert adopted, doc["history"]["good"]
    adopted = adopted[0]
    assert adopted["env_names"] == ["HF_TOKEN", "SGLANG_STANDIN_LOAD_S"], adopted
    assert doc["history"]["last"]["by"] == "test@lab"  # no "***" for a session value that is a word
    assert "hf-hand-7e11a2" not in json.dumps(doc)
    # the rollback to it starts it with that env only
    answer, _ = transition(lab, {"history": adopted["key"], "port": PORT})
    assert answer["outcome"] == "verified", answer
    environ = ct(lab, f"tr '\\0' '\\n' < /proc/{server(lab)['main']['pid']}/environ").stdout.split()
    assert "HF_TOKEN=hf-hand-7e11a2" in environ and not [e for e in environ if e.startswith(("USER=", "SSH_", "GPUGATE_"))]


def test_a_killed_log_pump_is_reported_and_the_server_keeps_serving(lab):
    ensure_serving(lab, spec())
    recorded = json.loads(ct(lab, f"cat /run/gpugate/sglang-{PORT}.pid").stdout)
    pump, main = recorded["pump"]["pid"], recorded["pid"]
    assert server(lab)["warnings"] == []
    assert ct(lab, f"kill -KILL {pump}").returncode == 0
    # the server writes (its access log of these polls) into a pipe nobody reads: EPIPE, never SIGPIPE
    for _ in range(3):
        doc = server(lab, generate=True)
    assert doc["serving"] and doc["main"]["pid"] == main and pids_alive(lab, [main]) == [main]
    assert doc["health"]["health_generate"] == 200
    assert any(f"log pump (pid {pump}) is gone" in w for w in doc["warnings"]), doc["warnings"]
    answer, events = transition(lab, spec(), restart=True)  # a restart brings a new pump
    assert answer["outcome"] == "verified" and server(lab)["warnings"] == []
    # its graceful drain still works with nowhere to log: it exits by itself, nothing left to kill
    assert step_events(events, "drain", "end")[0]["drained"]
    assert not [e for e in step_events(events, "kill", "end") if e.get("killed")], step_events(events, "kill")


def test_rollback_failing_too_ends_in_nothing_serves_with_both_reasons(lab):
    ensure_serving(lab, spec())
    lab.fault("pve1", 129, "crash-on-start")
    try:
        answer, events = transition(lab, spec("--kv-cache-dtype", "fp8_e4m3"))
    finally:
        lab.fault("pve1", 129, "crash-on-start", clear=True)
    assert answer["outcome"] == "nothing_serves", events[-4:]
    assert "crash-on-start" in answer["reasons"]["desired"] and "crash-on-start" in answer["reasons"]["rollback"]
    assert "NOTHING SERVES" in answer["message"]
    doc = server(lab)
    assert not doc["running"] and not doc["strays"] and doc["transition"]["outcome"] == "nothing_serves"
    assert doc["history"]["last"]["outcome"] == "nothing_serves"


def test_port_taken_after_the_stop_rolls_back_to_the_replaced_server(lab):
    ensure_serving(lab, spec())
    # Waits until :30000 is free (our stop), then takes :30001 at once: the new port is taken only
    # after the stop, as by a process that raced us.
    racer = ("import socket, time\n"
             "def free(p):\n"
             "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
             "    try: s.bind(('127.0.0.1', p)); s.close(); return True\n"
             "    except OSError: return False\n"
             "while not free(30000): time.sleep(0.002)\n"
             "t = socket.socket(); t.bind(('127.0.0.1', 30001)); t.listen(); time.sleep(120)\n")
    ct(lab, f"setsid python3 -c {shlex.quote(racer)} gpugate-test-racer >/dev/null 2>&1 < /dev/null &")
    try:
        answer, events = transition(lab, spec(port=30001), replaces=spec())
    finally:
        ct(lab, "pkill -f gpugate-test-racer")
    assert answer["outcome"] == "rolled_back", events[-4:]
    assert "port 30001 is taken" in answer["reasons"]["desired"]
    assert step_events(events, "stop", "begin")[0]["port"] == PORT  # the replaced server was drained first
    assert server(lab)["serving"]


def test_enospc_in_the_log_dir_never_hangs(lab):
    ensure_serving(lab, spec())
    ct(lab, "mount -t tmpfs -o size=256k tmpfs /var/log/gpugate && "
            "dd if=/dev/zero of=/var/log/gpugate/fill bs=4k count=1000 2>/dev/null; true")
    try:
        began = time.monotonic()
        answer, events = transition(lab, spec("--kv-cache-dtype", "fp8_e4m3"))
        assert time.monotonic() - began < 40
    finally:
        ct(lab, "umount /var/log/gpugate")
    assert answer["outcome"] in ("rolled_back", "nothing_serves"), events[-4:]
    assert "No space left" in answer["reasons"]["desired"]
    if answer["outcome"] == "rolled_back":
        assert server(lab)["serving"]


@pytest.mark.parametrize("moment", ["drain", "load"])
def test_agent_killed_mid_step_is_reported_interrupted_and_recovered(lab, moment):
    ensure_serving(lab, spec())
    if moment == "drain":
        lab.fault("pve1", 129, "ignore-sigterm")  # the drain lasts until our deadline
        desired, budgets = spec("--kv-cache-dtype", "fp8_e4m3"), {"drain_timeout_s": 60}
    else:
        desired, budgets = spec("--kv-cache-dtype", "fp8_e4m3", env={"SGLANG_STANDIN_LOAD_S": "3"}), {}
    try:
        first = start(lab, desired, budgets=budgets)
        wait_for_event(lab, first["run"], moment)
        ct(lab, f"kill -9 {first['pid']}")
        time.sleep(0.2)
        doc = server(lab)
        assert doc["transition"]["run"] == first["run"]
        assert doc["transition"]["outcome"] == "interrupted" and doc["transition"]["step"] == moment
        assert doc["lock"]["held"] is False
        answer = run_agent(lab, agentcmd.follow_command(PY, first["run"], 0, 0))
        assert answer["ended"] and answer["outcome"] == "interrupted" and not answer["active"]
        second = start(lab, desired, budgets={"drain_timeout_s": 1})
        assert second["recovered"] == first["run"]
        answer, events = follow(lab, second["run"])
    finally:
        lab.fault("pve1", 129, "ignore-sigterm", clear=True)
    assert answer["outcome"] in OUTCOMES, events[-4:]
    assert step_events(events, "run")[0]["recovered"]["run"] == first["run"]
    doc = server(lab)
    assert doc["serving"] if answer["outcome"] != "nothing_serves" else not doc["running"]


def test_ssh_channel_closed_right_after_start_the_run_completes(lab):
    ensure_serving(lab, spec())
    doc = {"run": f"ssh-{int(time.time())}", "operator": "test@lab", "desired": spec("--kv-cache-dtype", "fp8_e4m3"),
           "rollback_to": "auto", "budgets": SHORT}
    remote = "pct exec 129 -- sh -c " + shlex.quote(agentcmd.start_command(PY))
    ssh = subprocess.Popen(lab.ssh_argv("pve1") + [remote], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    ssh.stdin.write(agentcmd.start_stdin(doc, include_source=False))
    ssh.stdin.close()
    answer = json.loads(ssh.stdout.readline())
    ssh.kill()  # the channel goes away at once
    ssh.wait()
    assert answer["ok"], answer
    final, _ = follow(lab, doc["run"])
    assert final["outcome"] == "verified"
    waited = run_agent(lab, agentcmd.wait_command(PY, doc["run"], grace_s=1))
    assert waited == {"run": doc["run"], "appeared": True, "ended": True, "outcome": "verified"}
    never = run_agent(lab, agentcmd.wait_command(PY, "no-such-run", grace_s=0.3))
    assert never["appeared"] is False and never["ended"] is False
    assert server(lab)["main"]["argv_hash"] == agentcmd.argv_hash(spec("--kv-cache-dtype", "fp8_e4m3")["argv"])


def test_what_cannot_run_is_refused_before_anything_is_touched(lab):
    ensure_serving(lab, spec())
    before = server(lab)["main"]["pid"]
    systemd = dict(spec("--kv-cache-dtype", "fp8_e4m3"), supervisor="systemd", unit_text="[Service]\n")
    answer, events = transition(lab, systemd)
    assert answer["outcome"] == "refused" and "not systemd" in answer["reasons"]["desired"]
    assert not step_events(events, "stop") and server(lab)["main"]["pid"] == before
    from tests.e2e.lab_processes import start_in_container

    squatter = start_in_container(lab, "pve1", 129, "python3 -m http.server 30001 --bind 127.0.0.1", "squatter")
    deadline = time.monotonic() + 10
    while not observe(lab, port=30001)["sglang"]["listening"] and time.monotonic() < deadline:
        time.sleep(0.1)
    answer, events = transition(lab, spec(port=30001), replaces=spec())
    squatter.kill()
    assert answer["outcome"] == "refused" and "port 30001 is taken by %d" % squatter.pid in answer["reasons"]["desired"]
    assert not step_events(events, "stop") and server(lab)["main"]["pid"] == before


def test_a_full_journal_dir_does_not_stop_the_transition(lab):
    ensure_serving(lab, spec())
    ct(lab, "mount -t tmpfs -o size=64k,nr_inodes=64 tmpfs /var/lib/gpugate/runs && "
            "dd if=/dev/zero of=/var/lib/gpugate/runs/fill bs=4k count=100 2>/dev/null; true")
    try:
        first = start(lab, spec("--kv-cache-dtype", "fp8_e4m3"))
        answer, _ = follow(lab, first["run"])
    finally:
        ct(lab, "umount /var/lib/gpugate/runs")
    assert answer["outcome"] == "verified"  # read from the history's last outcome: the journal lost it
    doc = server(lab)
    assert doc["serving"] and doc["main"]["argv_hash"] == agentcmd.argv_hash(spec("--kv-cache-dtype", "fp8_e4m3")["argv"])
    assert doc["history"]["last"]["run"] == first["run"]


def test_bench_client_monitor_and_a_process_group_neighbour_survive_a_restart(lab):
    from tests.e2e.lab_processes import start_bench_client, start_gpu_monitor, start_shared_group_server

    answer, _ = transition(lab, None, rollback_to=None, port=PORT)  # nothing on the port
    assert answer["outcome"] == "verified"
    shared = start_shared_group_server(lab, "pve1", 129, port=PORT, http_port=18080,  # by hand, one group
                                      flags=f"--tp {TP}")
    deadline = time.monotonic() + 20
    while not server(lab)["serving"] and time.monotonic() < deadline:
        time.sleep(0.3)
    assert server(lab)["serving"], ct(lab, "cat /root/hand.log").stdout[-2000:]
    bench = start_bench_client(lab, "pve1", 129, port=PORT)
    monitor = start_gpu_monitor(lab, "pve1", 129)
    doc = observe(lab)
    assert doc["sglang"]["serving"] and doc["sglang"]["main"]["pid"] == shared.server_pid
    assert shared.daemon.pgid() == doc["sglang"]["main"]["pgid"]  # the trap: one process group
    assert [c["pid"] for c in doc["sglang"]["clients"]] == [bench.pid]
    holder = [h for h in doc["container"]["gpu_holders"] if h["pid"] == monitor.pid]
    assert holder and holder[0]["memory"] is False  # holds the device files at 0 MiB: reported only
    answer, events = transition(lab, spec(), restart=True)
    assert answer["outcome"] == "verified", events[-4:]
    assert shared.daemon.alive() and bench.alive() and monitor.alive()
    assert monitor.pid in step_events(events, "gate", "end")[0]["monitors"]
    swept = [p["pid"] for e in step_events(events, "sweep") for p in e["pids"]]
    assert not set(swept) & {shared.daemon.pid, bench.pid, monitor.pid}
    for process in (shared.daemon, bench, monitor):
        process.kill()


def test_the_gate_waits_for_this_servers_gpus_only_and_ends_the_holders_it_was_given(lab):
    from tests.e2e.lab_processes import start_in_container

    ensure_serving(lab, spec())
    notebook = start_in_container(lab, "pve1", 129, "python3 -m gpugate_gpusim hold --gpu 1 --mib 1000", "notebook")
    other = start_in_container(lab, "pve1", 129, "python3 -m gpugate_gpusim hold --gpu 3 --mib 1000", "other")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        holders = dict((h["pid"], h) for h in observe(lab)["container"]["gpu_holders"])
        if notebook.pid in holders and other.pid in holders and holders[other.pid]["gpus"]:
            break
        time.sleep(0.2)
    assert holders[notebook.pid]["gpus"] == [1] and holders[notebook.pid]["memory"] is True
    assert holders[other.pid]["gpus"] == [3]
    half = spec("--tp-size", "2", gpus=range(2))  # GPUs 0-1: the holder on GPU 3 is not this server's
    answer, events = transition(lab, half, end_gpu_holders=[
        {"pid": notebook.pid, "start_ticks": holders[notebook.pid]["start_ticks"]}])
    assert answer["outcome"] == "verified", events[-4:]
    assert not notebook.alive() and other.alive()
    assert step_events(events, "end_holders", "end")[0]["terminated"] == [notebook.pid]
    other.kill()


def test_dead_workers_are_not_serving(lab):
    ensure_serving(lab, spec())
    worker = pid_of(lab, "^sglang::scheduler_TP3")
    assert worker
    ct(lab, f"kill -9 {worker[0]}")
    deadline = time.monotonic() + 5
    doc = server(lab)
    while doc["serving"] and time.monotonic() < deadline:
        time.sleep(0.2)
        doc = server(lab)
    assert not doc["serving"]
    if doc["running"]:  # a main that does not react (yet) to its dead scheduler
        assert doc["workers"]["alive"] == TP - 1 and doc["workers"]["dead"] == 1
    answer, _ = transition(lab, spec())  # the same spec: not serving, so it is restarted
    assert answer["outcome"] == "verified" and server(lab)["serving"]
