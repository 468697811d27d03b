"""Live changes end to end (issue 34): LoRA adapters and a new checkpoint of the same model applied
while the server serves, through the real pyinfra CLI, deploy.py, the @pct connector and the
container's agent, against the lab's SGLang stand-in (SGLang 0.5.23's /load_lora_adapter,
/unload_lora_adapter and /update_weights_from_disk: lab/gpugate_lab/standin/sglang/_live.py).

One lab (tp 2 on 2 simulated GPUs); the tests run in order, each from the state the previous one
left, as an operator's successive runs would. Each proves several things of one change: ``--dry``
said its path, the main pid stayed, the server lists the new state and answers through it, the
status says as desired and a re-run changes nothing.
"""

from __future__ import annotations

import base64
import json
import shlex

import pytest

from tests.conftest import module_lab
from tests.e2e.lab_processes import start_in_container
from tests.faults.conftest import OnJournal, Run, deploy_args, main_pid, observed, pyinfra, running_argv, said, sh, wait_until

pytestmark = [pytest.mark.lab, pytest.mark.slow]

FLAGS = {"tp": 2}
MODEL, V2, QWEN2 = "/opt/models/lab-model", "/opt/models/lab-model-v2", "/opt/models/lab-model-qwen2"
A, B = "/opt/models/lab-lora-a", "/opt/models/lab-lora-b"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-live", hosts=1, gpus=2)


def run(lab, adapters: dict | None, model: str = MODEL, dry: bool = False, playbook: str = "deploy.py",
        data: dict | None = None) -> Run:
    data = {"sglang_model_path": model, **(data or {})}
    if adapters is not None:
        data["sglang_lora_adapters"] = adapters
    args = deploy_args(FLAGS, data=data)
    if playbook != "deploy.py":
        args[1] = playbook
    return pyinfra(lab, args, extra=("--dry",) if dry else ("-y",))


def served(lab) -> dict:
    """What the server itself lists: its model path (/model_info) and adapters (/v1/models)."""
    out = sh(lab, "pve1", 129, "python3 -c \"import json, urllib.request as u\n"
                               "get = lambda p: json.load(u.urlopen('http://127.0.0.1:30000' + p, timeout=5))\n"
                               "cards = get('/v1/models')['data']\n"
                               "print(json.dumps({'model_path': get('/model_info')['model_path'],"
                               " 'adapters': sorted(c['id'] for c in cards if c.get('parent'))}))\"")
    return json.loads(out.stdout)


def generate(lab, adapter: str | None = None) -> str:
    """A 2-token generation's text (the stand-in answers " lab" per token, " <adapter dir>" through one)."""
    body = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2}, **({"lora_path": adapter} if adapter else {})})
    out = sh(lab, "pve1", 129, "python3 -c \"import base64, json, urllib.request as u\n"
                               f"r = u.Request('http://127.0.0.1:30000/generate', data=base64.b64decode('{base64.b64encode(body.encode()).decode()}'),"
                               " headers={'content-type': 'application/json'})\n"
                               "print(json.load(u.urlopen(r, timeout=10))['text'])\"")
    return out.stdout.strip()


# a client of the server during a live change: requests through adapter a and the base model, back to back
CLIENT = """
import json, time, urllib.request as u
end = time.time() + 60
while time.time() < end:
    for body in ({"text": "hi", "sampling_params": {"max_new_tokens": 1}, "lora_path": "a"},
                 {"text": "hi", "sampling_params": {"max_new_tokens": 1}}):
        try:
            r = u.urlopen(u.Request("http://127.0.0.1:30000/generate", data=json.dumps(body).encode(),
                                    headers={"content-type": "application/json"}), timeout=10)
            print("ok" if r.status == 200 and json.load(r)["text"] else "fail", flush=True)
        except Exception as error:
            print("fail", error, flush=True)
"""


def status_kind(lab, adapters: dict, model: str) -> str:
    """The status runbook's verdict on the server (its JSON row), for this desired state."""
    result = run(lab, adapters, model, playbook="runbooks/status.py", data={"format": "json"})
    assert "{" in result.output, result.output
    (row,) = json.loads(result.output[result.output.index("{"):result.output.rindex("}") + 1])["servers"]
    return row["kind"]


def history_head(lab) -> dict:
    """The newest good spec's record in the container's history (what a rollback or restart runs)."""
    record = observed(lab)["history"]["good"][0]
    return {"model_path": record["model_path"], "lora_adapters": record.get("lora_adapters")}


def test_adapters_added_and_removed_live(lab):
    first = run(lab, {"a": A})  # a first start: its launch carries the adapter
    assert first.returncode == 0, first
    pid = main_pid(lab)
    assert served(lab) == {"model_path": MODEL, "adapters": ["a"]}
    said(run(lab, {"a": A, "b": B}, dry=True), "live: load adapter b", "path: live (no restart)")
    client = start_in_container(lab, "pve1", 129, f"python3 -c {shlex.quote(CLIENT)}", "live-client")
    wait_until(lambda: "ok" in client.log(), timeout=10)
    try:
        added = run(lab, {"a": A, "b": B})
    finally:
        client.kill()
    answers = client.log().split()
    assert added.returncode == 0, added
    assert "fail" not in answers and answers.count("ok") >= 2, client.log()  # no client saw the change
    said(added, "applied live: load adapter b", f"changed live and verified: pid {pid} kept serving")
    assert main_pid(lab) == pid
    assert served(lab) == {"model_path": MODEL, "adapters": ["a", "b"]}
    assert generate(lab, "b") == "lab-lora-b lab-lora-b"  # a real generation through the new adapter
    assert history_head(lab) == {"model_path": MODEL, "lora_adapters": {"a": A, "b": B}}
    assert status_kind(lab, {"a": A, "b": B}, MODEL) == "serving"  # as desired: the status agrees
    again = run(lab, {"a": A, "b": B})
    assert again.returncode == 0 and "No changes" in again.output and main_pid(lab) == pid, again
    said(run(lab, {"b": B}, dry=True), "live: unload adapter a", "path: live (no restart)")
    removed = run(lab, {"b": B})
    assert removed.returncode == 0, removed
    assert main_pid(lab) == pid and served(lab) == {"model_path": MODEL, "adapters": ["b"]}
    assert status_kind(lab, {"a": A, "b": B}, MODEL) != "serving"  # the adapters differ: never as desired


def test_new_weights_of_the_same_model_live(lab):
    pid = main_pid(lab)
    said(run(lab, {"b": B}, V2, dry=True), f"live: weights {MODEL} -> {V2} (update_weights_from_disk)",
         "path: live (no restart)")
    moved = run(lab, {"b": B}, V2)
    assert moved.returncode == 0, moved
    assert main_pid(lab) == pid and served(lab) == {"model_path": V2, "adapters": ["b"]}
    assert generate(lab) == "lab lab"
    again = run(lab, {"b": B}, V2)  # the argv still names lab-model: what serves is what counts
    assert again.returncode == 0 and "No changes" in again.output and main_pid(lab) == pid, again
    assert status_kind(lab, {"b": B}, V2) == "serving"


def test_a_failed_live_change_is_undone_and_said(lab):
    pid = main_pid(lab)
    before = history_head(lab)
    with lab.faulted("pve1", 129, f"weights-load-fails={MODEL}"):
        refused = run(lab, {"a": A, "b": B}, MODEL)
    assert refused.returncode != 0, refused
    said(refused, "LIVE CHANGE FAILED, UNDONE", "the engine refused it", "the history is unchanged")
    assert main_pid(lab) == pid and served(lab) == {"model_path": V2, "adapters": ["b"]}
    with lab.faulted("pve1", 129, f"weights-cannot-generate={MODEL}"):
        nan = run(lab, {"a": A, "b": B}, MODEL)
    assert nan.returncode != 0, nan
    said(nan, "LIVE CHANGE FAILED, UNDONE", "NaN happened", "undone: the previous state serves")
    assert main_pid(lab) == pid and served(lab) == {"model_path": V2, "adapters": ["b"]}
    assert generate(lab) == "lab lab" and history_head(lab) == before
    # the engine dies under the change (SIGKILL of its main while the weights load): the last good spec
    # starts again as a transition of its own, so the change does not end in NOTHING SERVES
    # the load lasts until the kill, however busy the machine
    with lab.faulted("pve1", 129, "slow-weight-update=60"), \
            OnJournal(lab, "live_apply", "begin", lambda: sh(lab, "pve1", 129, f"kill -9 {pid}")):
        died = run(lab, {"a": A, "b": B}, MODEL)
    assert died.returncode != 0, died
    said(died, "LIVE CHANGE FAILED", f"the server (pid {pid}) died during the live change",
         "starting the last good spec again", "verified")
    assert main_pid(lab) not in (None, pid) and served(lab) == {"model_path": V2, "adapters": ["b"]}
    assert history_head(lab) == before


def test_another_architecture_restarts_with_the_live_state_in_its_launch(lab):
    pid = main_pid(lab)
    dry = run(lab, {"b": B}, QWEN2, dry=True)
    said(dry, f"restart: weights {V2} -> {QWEN2} (another architecture", "path: restart")
    restarted = run(lab, {"b": B}, QWEN2)
    assert restarted.returncode == 0, restarted
    assert main_pid(lab) not in (None, pid)
    assert served(lab) == {"model_path": QWEN2, "adapters": ["b"]}
    argv = running_argv(lab)  # the launch carries the new model and the adapters that served
    assert argv[argv.index("--model-path") + 1] == QWEN2 and argv[argv.index("--lora-paths") + 1] == f"b={B}"
