"""A vLLM server end to end (issue 33): the real pyinfra CLI, deploy.py and the runbooks, the @pct
connector, against a lab host whose fleet serves vLLM (``gpugate lab up --engine vllm``: real sshd,
namespaces and signals; simulated GPUs and the lab's vLLM stand-in, which follows vLLM 0.33.0's source).
Tensor parallel over 2 GPUs, so the server has vLLM's whole tree: the API server, ``VLLM::EngineCore``
and a ``VLLM::Worker_TP<r>`` per GPU.

One lab for this module; the tests run in order, each from the state the previous one left, as an
operator's successive runs would.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests import warm_pyinfra
from tests.conftest import REPO_ROOT, module_lab, pyinfra_exe
from tests.e2e.lab_processes import ct_sh, start_in_container, wait_for

pytestmark = [pytest.mark.lab, pytest.mark.slow]

PORT = 8000
FLAGS = {"tensor-parallel-size": 2}
FP8 = {"tensor-parallel-size": 2, "kv-cache-dtype": "fp8"}
FAST = {"VLLM_STANDIN_LOAD_S": "0.3"}
LORA_A, LORA_B = "/opt/models/lab-lora-a", "/opt/models/lab-lora-b"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-vllm", hosts=1, gpus=2, engines=("vllm",))


def deploy(lab, *extra: str, flags=None, env=None, dry=False, playbook="deploy.py"):
    args = ["inventory.py", playbook, "--data", f"sglang_flags={json.dumps(flags or FP8)}",
            "--data", f"sglang_env={json.dumps(FAST if env is None else env)}", *extra]
    if dry:  # as an operator previews: --dry without -y
        result = warm_pyinfra.run([pyinfra_exe(), *args, "--dry"], cwd=REPO_ROOT, env=lab.env(), capture_output=True,
                                text=True, timeout=300, stdin=subprocess.DEVNULL)
    else:
        result = lab.pyinfra(*args)
    return result, result.stdout + result.stderr


def in_ct(lab, script: str) -> str:
    return ct_sh(lab, "pve1", 129, script).stdout


def processes(lab) -> dict[int, str]:
    """pid -> command line of every vLLM process in the container."""
    return {pid: cmd for pid, _ppid, cmd, _argv in lab.ps("pve1", 129) if "VLLM::" in cmd or "vllm.entrypoints" in cmd}


def server_pid(lab) -> int | None:
    """The API server's pid (vLLM's CLI; its children carry VLLM:: titles)."""
    return next((pid for pid, cmd in processes(lab).items() if "vllm.entrypoints.cli.main serve" in cmd), None)


def running_argv(lab) -> list[str]:
    pid = server_pid(lab)
    return [a for a in in_ct(lab, f"tr '\\0' '\\n' < /proc/{pid}/cmdline").splitlines() if a] if pid else []


def gpu_used(lab) -> list[int]:
    out = lab.host_exec("pve1", "nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits")
    return [int(x) for x in out.stdout.split()]


def status_row(lab, **desired) -> dict:
    result, out = deploy(lab, "--data", "format=json", playbook="runbooks/status.py", **desired)
    (row,) = json.loads(result.stdout[result.stdout.index("{"):])["servers"]
    return row


def running_requests(lab) -> int | None:
    """What the server's own gauges say it holds (vllm:num_requests_running + _waiting)."""
    from gpugate.engine import prometheus_sum

    page = in_ct(lab, f"python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{PORT}/metrics')"
                      ".read().decode())\"")
    return prometheus_sum(page, ("vllm:num_requests_running", "vllm:num_requests_waiting"))


def health(lab) -> str:
    return in_ct(lab, "python3 -c \"import urllib.request as u; "
                      f"print(u.urlopen('http://127.0.0.1:{PORT}/health').status)\"").strip()


def test_first_deploy_starts_vllms_whole_tree_and_a_rerun_changes_nothing(lab):
    result, out = deploy(lab, flags=FLAGS)
    assert result.returncode == 0, out
    assert f"vllm :{PORT} will start" in out and "healthy and generating" in out, out
    assert "verified: the running argv and /v1/models match the desired flags" in out
    argv = running_argv(lab)
    # vLLM's CLI, and the drain budget as --shutdown-timeout (vLLM's default 0 aborts every request)
    assert argv[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "--model"], argv
    assert argv[argv.index("--shutdown-timeout") + 1] == "60", argv
    titles = sorted(cmd.split()[0] for cmd in processes(lab).values() if cmd.startswith("VLLM::"))
    assert titles == ["VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"], titles
    assert all(used > 0 for used in gpu_used(lab))
    result, out = deploy(lab, flags=FLAGS)
    assert result.returncode == 0 and "No changes" in out, out


def test_the_fp8_change_is_previewed_then_applied_with_the_kv_capacity_before_and_after(lab):
    before = running_argv(lab)
    result, out = deploy(lab, dry=True)
    assert result.returncode == 0, out
    assert out.count("+ --kv-cache-dtype fp8") == 1 and "steps: hand off" in out, out
    assert "stop (SIGTERM drain <= 60 s" in out
    assert running_argv(lab) == before
    result, out = deploy(lab)
    assert result.returncode == 0, out
    assert "drained and exited" in out and "gate passed" in out and "verified" in out, out
    kv = re.search(rf"vllm :{PORT} KV cache ([\d,]+) -> ([\d,]+) tokens \(x2.00\)", out)
    assert kv and int(kv.group(2).replace(",", "")) == 2 * int(kv.group(1).replace(",", "")), out  # fp8 halves the bytes per token
    assert "fp8" in running_argv(lab)
    result, out = deploy(lab)
    assert "No changes" in out, out
    # the status agrees with the deploy, and names the engine
    row = status_row(lab)
    assert (row["kind"], row["engine"], row["ok"]) == ("serving", "vllm", True), row


def test_a_flag_typo_is_refused_before_anything_stops(lab):
    pid = server_pid(lab)
    result, out = deploy(lab, flags={"tensor-parallel-size": 2, "kv-cache-dtyp": "fp8"})
    assert result.returncode != 0
    assert "REFUSED, nothing touched: --kv-cache-dtyp" in out and "did you mean --kv-cache-dtype?" in out, out
    assert server_pid(lab) == pid


def test_a_request_in_flight_at_the_stop_finishes_within_the_drain_budget(lab):
    # a streamed completion of 1500 tokens at the stand-in's 2 ms each (3 s), under way at a restart:
    # the stop's SIGTERM drains it (--shutdown-timeout), where vLLM's default would abort it
    client = start_in_container(lab, "pve1", 129, (
        "python3 -c \"import json, urllib.request as u; "
        f"r = u.urlopen(u.Request('http://127.0.0.1:{PORT}/v1/completions', data=json.dumps({{'model': "
        "'/opt/models/lab-model', 'prompt': 'hi', 'max_tokens': 1500, 'stream': True}).encode(), "
        "headers={'content-type': 'application/json'})); "
        "chunks = [line for line in r.read().decode().splitlines() if line.startswith('data: {')]; "
        "print('finish', json.loads(chunks[-1][6:])['choices'][0]['finish_reason'], len(chunks))\""),
        name="stream")
    wait_for(lambda: running_requests(lab) == 1, what="the stream under way")
    result, out = deploy(lab, env={**FAST, "VLLM_STANDIN_TOKEN_S": "0.01"})
    assert result.returncode == 0, out
    assert "drained and exited" in out, out
    wait_for(lambda: not client.alive(), timeout_s=30, what="the client's end")
    assert "finish length 1500" in client.log(), client.log()


def test_a_sigkilled_api_server_leaves_enginecore_holding_the_gpus_and_the_deploy_sweeps_it(lab):
    pid = server_pid(lab)
    tree = processes(lab)
    in_ct(lab, f"kill -9 {pid}")
    wait_for(lambda: pid not in processes(lab), what="the API server's end")
    left = processes(lab)
    # vLLM 0.33.0's EngineCore watches no parent (vllm#55510): it and its workers go on, the port is free
    assert sorted(cmd.split()[0] for cmd in left.values()) == ["VLLM::EngineCore", "VLLM::Worker_TP0",
                                                               "VLLM::Worker_TP1"], left
    assert set(left) < set(tree) and all(used > 0 for used in gpu_used(lab))
    row = status_row(lab, env={**FAST, "VLLM_STANDIN_TOKEN_S": "0.01"})
    assert row["kind"] == "down" and "stray server part(s)" in row["server"], row
    result, out = deploy(lab, env={**FAST, "VLLM_STANDIN_TOKEN_S": "0.01"})
    assert result.returncode == 0, out
    assert "stray vllm server part(s) will be swept" in out and "swept" in out and "gate passed" in out, out
    assert not set(left) & set(processes(lab)), "an orphan of the killed server survived the sweep"
    assert health(lab) == "200"


def test_a_start_that_crashes_is_rolled_back_to_the_last_good_server(lab):
    before = running_argv(lab)
    # 0.33.0's parser declares no choices for --kv-cache-dtype: vLLM refuses the value while it
    # starts, after the old server stopped, so the transition rolls back
    result, out = deploy(lab, flags={"tensor-parallel-size": 2, "kv-cache-dtype": "fp9"},
                         env={**FAST, "VLLM_STANDIN_TOKEN_S": "0.01"})
    assert result.returncode != 0
    assert "the server crashed (exit code 1)" in out and "ValueError: Invalid kv_cache_dtype: 'fp9'" in out, out
    assert "ROLLED BACK" in out and "rollback: verified" in out, out
    assert running_argv(lab) == before and health(lab) == "200"


def test_the_rollback_runbook_returns_to_the_previous_server(lab):
    result, out = deploy(lab, flags=FLAGS, env={**FAST, "VLLM_STANDIN_TOKEN_S": "0.01"})
    assert result.returncode == 0 and "fp8" not in running_argv(lab), out
    result, out = deploy(lab, flags=FLAGS, env={**FAST, "VLLM_STANDIN_TOKEN_S": "0.01"}, playbook="runbooks/rollback.py")
    assert result.returncode == 0, out
    assert "gate passed" in out and "verified: the running argv and /v1/models match the restored spec" in out, out
    assert "fp8" in running_argv(lab)
    row = status_row(lab, flags=FLAGS, env={**FAST, "VLLM_STANDIN_TOKEN_S": "0.01"})
    # what the next deploy would change: the fp8 the runbook restored goes
    assert row["kind"] == "drifted" and "- --kv-cache-dtype fp8" in row["verdict"], row


def test_the_kv_offload_region_a_killed_server_left_in_dev_shm_is_removed_before_the_next_start(lab):
    # the tiering spec keeps /dev/shm/vllm_offload_<id>.mmap while the engine runs and never removes it
    # on an unclean exit (vllm#57303); with room for one region only, the next start would fail vLLM's
    # free-space check, and every start after it (vllm#54002's crash loop)
    transfer = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30, "spec_name": "TieringOffloadingSpec"}})
    flags, env = {**FLAGS, "kv-transfer-config": transfer}, {**FAST, "VLLM_STANDIN_SHM_MIB": "1500"}
    result, out = deploy(lab, flags=flags, env=env)
    assert result.returncode == 0, out
    in_ct(lab, "kill -9 " + " ".join(map(str, processes(lab))))
    wait_for(lambda: not processes(lab), what="the whole tree's end")
    left = in_ct(lab, "ls /dev/shm").split()
    assert len(left) == 1 and left[0].startswith("vllm_offload_"), left
    result, out = deploy(lab, flags=flags, env=env)
    assert result.returncode == 0, out
    assert f"removed 1 stale /dev/shm segment(s) no live process holds: {left[0]}" in out, out
    assert left[0] not in in_ct(lab, "ls /dev/shm") and health(lab) == "200"


def test_a_vllm_and_an_sglang_server_share_the_container_on_disjoint_gpus(lab):
    """Both engines in one container, written in the order they must run: vLLM first, moving off
    GPU 1 (tp 2 -> 1 on GPU 0), then SGLang onto GPU 1. Each is its own desired state and history;
    the status names each one's engine and says both serve as desired."""
    import yaml

    doc = yaml.safe_load(lab.fleet_path.read_text())
    doc["hosts"]["pve1"]["containers"][129] = {
        "vllm": {"model_path": "/opt/models/lab-model", "port": PORT, "flags": {"tensor-parallel-size": 1},
                 "env": {**FAST, "CUDA_VISIBLE_DEVICES": "0"}, "lora_adapters": {"a": LORA_A}},
        "sglang": {"model_path": "/opt/models/lab-model", "port": 30000, "flags": {"tp": 1, "base-gpu-id": 1},
                   "env": {"SGLANG_STANDIN_LOAD_S": "0.3"}}}
    lab.fleet_path = lab.dir / "fleet.both.yaml"
    lab.fleet_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    result = lab.pyinfra("inventory.py", "deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert out.index(f"vllm :{PORT} verified") < out.index("sglang :30000 will start"), out  # vLLM moved off first
    # the adapter declared serves from the start: vLLM's --lora-modules, with what runtime loading needs
    argv = running_argv(lab)
    assert argv[argv.index("--lora-modules") + 1] == f"a={LORA_A}" and "--enable-lora" in argv, argv
    result = lab.pyinfra("inventory.py", "runbooks/status.py", "--data", "format=json")
    rows = {row["port"]: row for row in json.loads(result.stdout[result.stdout.index("{"):])["servers"]}
    assert {port: (row["engine"], row["kind"]) for port, row in rows.items()} == {
        PORT: ("vllm", "serving"), 30000: ("sglang", "serving")}, rows


def test_an_adapter_added_to_the_running_vllm_server_is_loaded_live_and_answers_through_it(lab):
    """Issue 34's vLLM path: the server the previous test started with adapter ``a`` (--enable-lora,
    VLLM_ALLOW_RUNTIME_LORA_UPDATING) gets ``b`` through vLLM's POST /v1/load_lora_adapter: --dry says
    live, the API server's pid stays, /v1/models lists both under the served model, a completion naming
    ``b`` answers through it, and a re-run changes nothing."""
    import yaml

    doc = yaml.safe_load(lab.fleet_path.read_text())
    doc["hosts"]["pve1"]["containers"][129]["vllm"]["lora_adapters"] = {"a": LORA_A, "b": LORA_B}
    lab.fleet_path = lab.dir / "fleet.lora.yaml"
    lab.fleet_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    pid = server_pid(lab)
    dry = warm_pyinfra.run([pyinfra_exe(), "inventory.py", "deploy.py", "--dry"], cwd=REPO_ROOT, env=lab.env(),
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    out = dry.stdout + dry.stderr
    assert dry.returncode == 0 and "live: load adapter b" in out and "path: live (no restart)" in out, out
    result = lab.pyinfra("inventory.py", "deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "applied live: load adapter b" in out, out
    assert f"pid {pid} kept serving" in out and server_pid(lab) == pid, out
    cards = json.loads(in_ct(lab, "python3 -c \"import urllib.request as u; "
                                  f"print(u.urlopen('http://127.0.0.1:{PORT}/v1/models').read().decode())\""))["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards[1:]] == [
        ("a", LORA_A, cards[0]["id"]), ("b", LORA_B, cards[0]["id"])], cards
    answer = json.loads(in_ct(lab, "python3 -c \"import json, urllib.request as u; print(u.urlopen(u.Request("
                                   f"'http://127.0.0.1:{PORT}/v1/completions', data=json.dumps({{'model': 'b', "
                                   "'prompt': 'hi', 'max_tokens': 2}).encode(), headers={'content-type': "
                                   "'application/json'})).read().decode())\""))
    assert (answer["model"], answer["choices"][0]["text"]) == ("b", " lab-lora-b lab-lora-b"), answer
    result = lab.pyinfra("inventory.py", "deploy.py")
    assert "No changes" in result.stdout + result.stderr and server_pid(lab) == pid, result.stdout + result.stderr
