"""sglang.server end to end: the real pyinfra CLI, deploy.py, the @pct connector, against a lab
host (real sshd, real namespaces and signals; simulated GPUs and the SGLang stand-in), tp 4 on 4 GPUs (what it proves does not depend on the rank count; each rank is an interpreter to start).

One lab for this module (its own directory, one host, container 129); the tests run in order,
each starting from the state the previous one left (as an operator's successive runs would).
"""

from __future__ import annotations

import json

import pytest

from gpugate.engine.sglang.weight_cache import steady_argv
from tests import warm_pyinfra
from tests.conftest import module_lab, pyinfra_exe

pytestmark = [pytest.mark.lab, pytest.mark.slow]

FLAGS = {"tp": 4}
FP8 = {"tp": 4, "kv-cache-dtype": "fp8_e4m3"}
EXTRACTION = {"tp": 4, "kv-cache-dtype": "fp8_e4m3", "disable-radix-cache": True, "disable-cuda-graph": True,
              "disable-custom-all-reduce": True}
FAST = {"SGLANG_STANDIN_LOAD_S": "0.5"}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-server", hosts=1, gpus=4)


def deploy(lab, *extra: str, flags=None, env=None, dry=False):
    args = ["inventory.py", "deploy.py", "--data", f"sglang_flags={json.dumps(flags or FLAGS)}",
            "--data", f"sglang_env={json.dumps(FAST if env is None else env)}"]
    if dry:  # as an operator previews: --dry without -y (lab.pyinfra adds -y)
        import subprocess

        from tests.conftest import REPO_ROOT
        result = warm_pyinfra.run([pyinfra_exe(), *args, *extra, "--dry"], cwd=REPO_ROOT, env=lab.env(), capture_output=True,
                                text=True, timeout=300, stdin=subprocess.DEVNULL)
        return result, result.stdout + result.stderr
    result = lab.pyinfra(*args, *extra)
    return result, result.stdout + result.stderr


def in_ct(lab, script: str) -> str:
    out = lab.pct("pve1", "exec", "129", "--", "sh", "-c", script)
    return out.stdout


def server_pid(lab) -> str:
    """The main pid from the agent's pid file (JSON: pid, start_ticks, log, ...)."""
    text = in_ct(lab, "cat /run/gpugate/sglang-30000.pid 2>/dev/null").strip()
    return str(json.loads(text)["pid"]) if text else ""


def running_argv(lab) -> list[str]:
    pid = server_pid(lab)
    if not pid:
        return []
    return steady_argv([a for a in in_ct(lab, f"tr '\\0' '\\n' < /proc/{pid}/cmdline").splitlines() if a])


def gpu_used(lab) -> list[int]:
    out = lab.host_exec("pve1", "nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits")
    return [int(x) for x in out.stdout.split()]


def test_first_start_runs_the_desired_flags_on_8_gpus(lab):
    result, out = deploy(lab)
    assert result.returncode == 0, out
    assert "will start" in out and "healthy and generating" in out
    argv = running_argv(lab)
    assert argv[:3] == ["/usr/bin/python3", "-m", "sglang.launch_server"] and "--tp-size" in argv
    assert all(used > 0 for used in gpu_used(lab))  # 4 TP workers hold memory


def test_rerun_reports_no_changes(lab):
    result, out = deploy(lab)
    assert result.returncode == 0, out
    assert "No changes" in out and "stopping" not in out


def test_dry_run_shows_the_diff_and_touches_nothing(lab):
    before = running_argv(lab)
    # an env value is shown as it will be applied, a secret one (HF_TOKEN: the pattern list) never (issue 32 item 10)
    env = dict(FAST, SGLANG_STANDIN_LOAD_S="0.25", HF_TOKEN="hf_dry_s3cr3t_value")
    result, out = deploy(lab, flags=FP8, env=env, dry=True)
    assert result.returncode == 0, out
    assert "+ --kv-cache-dtype fp8_e4m3" in out and "steps: hand off" in out
    assert out.count("+ --kv-cache-dtype fp8_e4m3") == 1  # printed once
    assert "~ env SGLANG_STANDIN_LOAD_S=0.25 (value changed)" in out and "+ env HF_TOKEN=***" in out, out
    assert "hf_dry_s3cr3t_value" not in out
    assert running_argv(lab) == before


def test_fp8_kv_cache_change_restarts_with_the_new_flags(lab):
    result, out = deploy(lab, flags=FP8)
    assert result.returncode == 0, out
    assert "drained and exited" in out and "gate passed" in out and "verified" in out
    argv = running_argv(lab)
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    result, out = deploy(lab, flags=FP8)
    assert "No changes" in out


def test_extraction_flags_change(lab):
    result, out = deploy(lab, flags=EXTRACTION)
    assert result.returncode == 0, out
    for line in ("+ --disable-radix-cache", "+ --disable-cuda-graph", "+ --disable-custom-all-reduce"):
        assert line in out
    argv = running_argv(lab)
    assert {"--disable-radix-cache", "--disable-cuda-graph", "--disable-custom-all-reduce"} <= set(argv)


def test_env_only_change_restarts_and_never_prints_the_value(lab):
    env = dict(FAST, HF_TOKEN="hf_s3cr3t_value")
    result, out = deploy(lab, flags=EXTRACTION, env=env)
    assert result.returncode == 0, out
    assert "+ env HF_TOKEN=***" in out and "hf_s3cr3t_value" not in out
    mode = in_ct(lab, "stat -c %a /etc/gpugate/sglang-30000.env").strip()
    assert mode == "600"
    pid = server_pid(lab)
    assert "HF_TOKEN=hf_s3cr3t_value" in in_ct(lab, f"tr '\\0' '\\n' < /proc/{pid}/environ")
    result, out = deploy(lab, flags=EXTRACTION, env=env)
    assert "No changes" in out


def test_bad_flag_touches_nothing_and_says_why(lab):
    before = running_argv(lab)
    result, out = deploy(lab, flags={"tp": 4, "kv-cache-dtype": "fp9"})
    assert result.returncode != 0
    assert "--kv-cache-dtype" in out and "fp9" in out and "nothing touched" in out
    assert running_argv(lab) == before


def test_crash_on_start_rolls_back_to_the_previous_server(lab):
    before = running_argv(lab)
    # the stand-in cannot parse this load time: the new server crashes while loading
    result, out = deploy(lab, flags=FLAGS, env={"SGLANG_STANDIN_LOAD_S": "not-a-number"})
    assert result.returncode != 0
    assert "crashed (exit code" in out and "the previous server serves again" in out
    assert "ValueError" in out  # the failed start's log tail
    # with the value it could not read: SGLANG_STANDIN_LOAD_S names no secret (issue 32 item 10)
    assert "could not convert string to float: 'not-a-number'" in out, out
    assert running_argv(lab) == before
    assert in_ct(lab, "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:30000/health').status)\"").strip() == "200"


# Runs on the lab host, which sees the container's processes too: every few ms, every process's
# cmdline, with every base64 token in it decoded (and unzipped), again and again (our commands nest
# base64 JSON in base64), as anyone on the host could; stops when its stdin closes; prints JSON.
CMDLINE_WATCHER = r"""
import base64, binascii, json, os, re, select, sys, time, zlib
canaries = [c.encode() for c in sys.argv[1:]]
TOKEN = re.compile(rb"[A-Za-z0-9+/]{12,}={0,2}")
def reveal(data, depth=0):
    found = {c for c in canaries if c in data}
    if depth < 4:
        for token in TOKEN.findall(data):
            try:
                decoded = base64.b64decode(token + b"=" * (-len(token) % 4))
            except (binascii.Error, ValueError):
                continue
            try:
                decoded = zlib.decompress(decoded)
            except zlib.error:
                pass
            found |= reveal(decoded, depth + 1)
    return found
known, seen, ours, samples, began = {}, {}, 0, 0, time.time()
while time.time() - began < 300 and not select.select([sys.stdin], [], [], 0)[0]:
    samples += 1
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():  # not the canaries in its own argv
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as handle:
                raw = handle.read()
        except OSError:
            continue
        if b"pct" in raw and b"129" in raw:
            ours += 1  # a pct exec of the run, caught while it ran
        if raw not in known:
            known[raw] = reveal(raw)
        for canary in known[raw]:
            seen.setdefault(canary.decode(), set()).add(raw.replace(b"\0", b" ").decode("utf-8", "replace")[:200])
    time.sleep(0.003)
print(json.dumps({"samples": samples, "ours": ours, "seen": {k: sorted(v) for k, v in seen.items()}}))
"""


def test_secrets_never_appear_in_any_command_line_on_the_host(lab):
    import subprocess
    from gpugate_lab import core

    watcher = subprocess.Popen(core.host_exec_argv(lab.dir, "pve1") + ["python3", "-c", CMDLINE_WATCHER,
                                                                        "secret-canary", "sk-canary-key"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        result, out = deploy(lab, flags={"tp": 4, "api-key": "sk-canary-key"}, env=dict(FAST, HF_TOKEN="secret-canary"))
    finally:
        report, errors = watcher.communicate(input="", timeout=60)
    assert result.returncode == 0, out
    watched = json.loads(report or "{}") if watcher.returncode == 0 else pytest.fail(errors)
    assert watched["ours"] > 0, watched  # the watcher did see the run's commands while they ran
    assert "secret-canary" not in watched["seen"], watched["seen"]
    # --api-key is SGLang's own command line (as the operator asked); none of ours carries it
    assert all("sglang.launch_server" in line and " -c " not in line for line in watched["seen"].get("sk-canary-key", [])), watched
    pid = server_pid(lab)
    assert "HF_TOKEN=secret-canary" in in_ct(lab, f"tr '\\0' '\\n' < /proc/{pid}/environ").splitlines()
    assert "sk-canary-key" in running_argv(lab) and "secret-canary" not in out and "sk-canary-key" not in out


def test_removal_stops_everything_and_frees_the_gpus(lab):
    result = lab.pyinfra("inventory.py", "deploy.py", "--data", "sglang_present=false")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "will stop" in out and "stopping :30000 pid" in out
    assert running_argv(lab) == []
    assert gpu_used(lab) == [0] * 4
    result = lab.pyinfra("inventory.py", "deploy.py", "--data", "sglang_present=false")
    assert "No changes" in result.stdout + result.stderr
