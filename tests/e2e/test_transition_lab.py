"""The rebuilt transition through the REAL pyinfra CLI against a lab (issue 11's "Why", issue 12's
port change and rolling restart): each test kills, interrupts or breaks something at the named
moment and checks that the run ends in verified / rolled_back / nothing_serves with the right exit
status and message, and that the container says the same.

One lab for the module (2 Proxmox hosts, container 129 on each, 4 GPUs); the tests run in order, each
from the state the previous one left (as an operator's successive runs would). The stand-in loads in
0.4 s, or 4 s where a test must act during the load.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from gpugate import agentcmd
from tests.conftest import REPO_ROOT, module_lab, pyinfra_exe

pytestmark = [pytest.mark.lab, pytest.mark.slow]

FAST = {"SGLANG_STANDIN_LOAD_S": "0.4"}
# A test that acts while a server loads holds the load (lab.load_held: fault slow-start, cleared when
# the test has done what it does in the load) instead of a long load that must outlast a busy machine.
PVE1 = "@pct/pve1:129"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-transition", hosts=2, gpus=4)


def pyinfra_argv(*args: str) -> list[str]:
    exe = pyinfra_exe()
    return [exe, "-y", *args]


def deploy_args(*extra: str, flags=None, env=None, limit: str | None = PVE1, runbook: str = "deploy.py") -> list[str]:
    args = ["inventory.py", runbook, "--data", f"sglang_flags={json.dumps(flags or {'tp': 4})}",
            "--data", f"sglang_env={json.dumps(FAST if env is None else env)}", *extra]
    if limit:
        args += ["--limit", limit]
    return args


def run(lab, *extra: str, **kwargs) -> tuple[int, str]:
    result = lab.pyinfra(*deploy_args(*extra, **kwargs), timeout=240)
    return result.returncode, result.stdout + result.stderr


def _default_hangup() -> None:
    # as from a terminal: a test run under nohup would hand its ignored SIGHUP down to the controller
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def start(lab, *extra: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(pyinfra_argv(*deploy_args(*extra, **kwargs)), cwd=REPO_ROOT, env=lab.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
                            preexec_fn=_default_hangup)


def read_until(process: subprocess.Popen, needle: str, timeout_s: float = 120) -> str:
    """The output up to and including the first line holding ``needle``."""
    out = ""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        out += line
        if needle in line:
            return out
    raise AssertionError(f"{needle!r} never came:\n{out}")


def observe(lab, port: int = 30000, host: str = "pve1") -> dict:
    """The agent's own view of the container (sent inline: installed or not)."""
    out = lab.pct(host, "exec", "129", "--", "sh", "-c", agentcmd.inline_observe_command("/usr/bin/python3", {"port": port}))
    doc = agentcmd.parse_output(out.stdout.splitlines())
    assert "sglang" in doc, (out.stdout, out.stderr)
    return doc["sglang"]


def observe_full(lab, port: int = 30000, host: str = "pve1") -> dict:
    out = lab.pct(host, "exec", "129", "--", "sh", "-c", agentcmd.inline_observe_command("/usr/bin/python3", {"port": port}))
    return agentcmd.parse_output(out.stdout.splitlines())


def wait_idle(lab, timeout_s: float = 60) -> dict:
    """Until no transition runs in the container; -> the last one's summary."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        transition = observe(lab).get("transition") or {}
        if not transition.get("active"):
            return transition
        time.sleep(0.3)
    raise AssertionError("the transition never ended")


def argv_of(server: dict) -> list[str]:
    return list((server.get("main") or {}).get("argv") or [])


def good_hashes(server: dict) -> list[str]:
    return [record["argv_hash"] for record in server["history"]["good"]]


def test_first_start_then_host_is_honoured(lab):
    code, out = run(lab)
    assert code == 0, out
    assert "will start" in out and "verified" in out
    first = observe(lab)
    assert first["serving"] and "--host" in argv_of(first) and argv_of(first)[argv_of(first).index("--host") + 1] == "127.0.0.1"
    # host: 0.0.0.0 is not validated and dropped: the server restarts onto it
    code, out = run(lab, "--data", "sglang_host=0.0.0.0")
    assert code == 0, out
    assert "- --host 127.0.0.1" in out and "+ --host 0.0.0.0" in out
    server = observe(lab)
    assert argv_of(server)[argv_of(server).index("--host") + 1] == "0.0.0.0" and server["serving"]
    code, out = run(lab, "--data", "sglang_host=0.0.0.0")
    assert code == 0 and "No changes" in out, out


def test_crash_rolls_back_and_the_rollback_runbook_goes_to_the_spec_before(lab):
    # A (host 127.0.0.1) -> B (host 0.0.0.0) ran; C crashes at start
    a_hash, b_hash = good_hashes(observe(lab))[1], good_hashes(observe(lab))[0]
    lab.pct("pve1", "exec", "129", "--", "mkdir", "-p", "/opt/models/broken")  # no config.json: SGLang exits 1
    # ungated: a gated launch's crash at import stops nothing (tests/faults/test_start_and_operators.py)
    code, out = run(lab, "--data", "sglang_host=0.0.0.0", "--data", "sglang_model_path=/opt/models/broken",
                    "--data", "sglang_gated_launch=false")
    assert code != 0, out
    assert "ROLLED BACK" in out and "config.json" in out  # the reason and the failed start's log tail
    server = observe(lab)
    assert server["serving"] and server["main"]["argv_hash"] == b_hash
    assert good_hashes(server)[:2] == [b_hash, a_hash]  # C is never recorded as good
    assert "config.json" in server["history"]["failed"][0]["reason"]
    # what serves again, by the status's label and key, and what C would change from it (issue 20)
    assert (f"serving again: good 0 (newest) of :30000's history (key {server['history']['good'][0]['key']}, "
            f"verified ") in out, out
    assert "the desired state differs from it: - --model-path /opt/models/lab-model, + --model-path " \
           "/opt/models/broken (the next deploy.py applies it)" in out, out
    # the rollback runbook goes to the newest good spec unlike the running one: A, not B again
    result = lab.pyinfra("inventory.py", "runbooks/rollback.py", "--limit", PVE1, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "+ --host 127.0.0.1" not in out or "- --host 0.0.0.0" in out
    server = observe(lab)
    assert server["serving"] and server["main"]["argv_hash"] == a_hash


def test_same_spec_restart_leaves_the_history_alone(lab):
    before = observe(lab)["history"]["good"]
    result = lab.pyinfra(*deploy_args(runbook="runbooks/restart.py"), timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "restart requested (same spec)" in out and "verified" in out
    after = observe(lab)
    assert [r["key"] for r in after["history"]["good"]] == [r["key"] for r in before]
    assert after["main"]["pid"] != None and after["serving"]  # noqa: E711


def test_ctrl_c_before_the_hand_off_touches_nothing_and_exits_non_zero(lab):
    before = observe(lab)["main"]["pid"]
    process = start(lab, flags={"tp": 4, "kv-cache-dtype": "fp8_e4m3"})
    read_until(process, "Starting operation")  # pyinfra begins the run: the plan is being made
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=60)
    assert process.returncode not in (0, None), rest
    assert "interrupted before any hand-off: nothing was touched" in rest
    server = observe(lab)
    assert server["main"]["pid"] == before and not (server.get("transition") or {}).get("active")


def test_ctrl_c_during_the_load_exits_non_zero_and_says_what_continues(lab):
    with lab.load_held():
        process = start(lab, flags={"tp": 4, "mem-fraction-static": 0.8})
        read_until(process, "started pid")
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=60)
    assert process.returncode not in (0, None), rest
    assert "the transition continues in the container: loading" in rest and "runbooks/status.py" in rest
    last = wait_idle(lab)
    assert last["outcome"] == "verified"  # the container ran it to its end


def test_controller_killed_during_the_load_the_rerun_attaches_and_reports(lab):
    with lab.load_held():
        process = start(lab, flags={"tp": 4, "kv-cache-dtype": "fp8_e4m3"})
        read_until(process, "started pid")
        process.kill()  # SIGKILL: no handler, no goodbye
        process.communicate(timeout=30)
        rerun = start(lab, flags={"tp": 4, "kv-cache-dtype": "fp8_e4m3"})
        head = read_until(rerun, "following it instead of starting another")  # it found the run loading
    rest, _ = rerun.communicate(timeout=120)
    code, out = rerun.returncode, head + rest
    assert code == 0, out
    assert "following it instead of starting another" in out and "verified" in out
    code, out = run(lab, flags={"tp": 4, "kv-cache-dtype": "fp8_e4m3"})
    assert code == 0, out
    assert "ended: verified" in out and "No changes" in out


def test_a_container_stopped_mid_run_is_reported_within_one_poll(lab):
    with lab.load_held():
        process = start(lab, flags={"tp": 4, "mem-fraction-static": 0.8})
        read_until(process, "started pid")
        assert lab.pct("pve1", "stop", "129").returncode == 0
        stopped_at = time.time()
        rest, _ = process.communicate(timeout=60)
        took = time.time() - stopped_at
    assert process.returncode != 0, rest
    assert "container 129 on pve1 is stopped" in rest
    assert took < 3.0 + 5.0, took  # one follow poll (3 s) and the exit
    assert lab.pct("pve1", "start", "129").returncode == 0
    code, out = run(lab)  # the next run recovers the interrupted one and converges
    assert code == 0, out
    assert observe(lab)["serving"]


def test_another_gpu_holder_is_refused_before_the_stop_unless_the_operator_lets_the_agent_end_it(lab):
    lab.pct("pve1", "exec", "129", "--", "sh", "-c", "nohup python3 -m gpugate_gpusim hold --gpu 0 --mib 1024 "
            "--tag notebook >/dev/null 2>&1 & echo $! > /tmp/notebook.pid")
    holder = lab.pct("pve1", "exec", "129", "--", "cat", "/tmp/notebook.pid").stdout.strip()
    deadline = time.time() + 20
    while time.time() < deadline and not any(h["pid"] == int(holder) for h in observe_full(lab)["container"]["gpu_holders"]):
        time.sleep(0.2)
    before = observe(lab)["main"]["pid"]
    code, out = run(lab, flags={"tp": 4, "kv-cache-dtype": "fp8_e4m3"})
    assert code != 0, out
    assert "REFUSED, nothing touched" in out and f"pid {holder} (" in out and "end_other_gpu_holders=true" in out
    assert observe(lab)["main"]["pid"] == before  # the server was never stopped
    code, out = run(lab, "--data", "end_other_gpu_holders=true", flags={"tp": 4, "kv-cache-dtype": "fp8_e4m3"})
    assert code == 0, out
    assert "the agent ends it" in out and "verified" in out
    assert lab.pct("pve1", "exec", "129", "--", "kill", "-0", holder).returncode != 0  # ended


def test_port_change_drains_the_old_server_first(lab):
    code, out = run(lab, "--data", "sglang_port=30001")
    assert code == 0, out
    assert "port change: :30000 -> :30001" in out
    assert out.index("old server :30000: stopping") < out.index("started pid")
    assert "drained and exited" in out
    assert observe(lab, 30001)["serving"] and not observe(lab, 30000)["running"]
    code, out = run(lab)  # and back
    assert code == 0, out
    assert observe(lab)["serving"] and not observe(lab, 30001)["running"]


def test_rolling_restart_with_a_crashing_start_stops_after_the_first_container(lab):
    lab.pct("pve2", "exec", "129", "--", "mkdir", "-p", "/opt/models/broken")
    before = {host: (observe(lab, host=host).get("main") or {}).get("pid") for host in ("pve1", "pve2")}
    result = lab.pyinfra(*deploy_args("--data", "rolling=true", "--data", "sglang_model_path=/opt/models/broken",
                                      "--data", "sglang_gated_launch=false", limit=None), timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    # pyinfra picks the order; whichever went first failed (rolled back where a server ran, else
    # NOTHING SERVES), and the other was never touched
    failed = "sglang :30000 the desired server failed"
    first, other = ("pve1", "pve2") if f"[@pct/pve1:129] {failed}" in out else ("pve2", "pve1")
    assert f"[@pct/{first}:129] {failed}" in out, out
    assert ("ROLLED BACK" if before[first] else "NOTHING SERVES") in out, out
    assert f"[@pct/{other}:129] sglang :30000 not touched" in out and f"[@pct/{other}:129] sglang :30000 started" not in out
    summary = out.split("not touched (the rolling restart stopped", 1)[1]
    assert f"@pct/{other}:129" in summary.splitlines()[0], summary
    assert (observe(lab, host=other).get("main") or {}).get("pid") == before[other]
