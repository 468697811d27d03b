"""vLLM replicas behind a real smg (issue 33), through the real pyinfra CLI: two containers of a lab
host serving vLLM (``gpugate lab up --engine vllm --router``), a client sending requests through smg
for the whole run (the real ``openai`` package, whole answers and streams). A rolling flag change
takes each replica out of smg, waits for its in-flight requests by vLLM's own gauges
(``vllm:num_requests_running`` + ``_waiting``), restarts it and puts it back as a vLLM worker, one at
a time: no request fails.
"""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from tests.conftest import routed_lab
from gpugate_lab.traffic import Traffic
from tests.e2e.test_router_lab import MODEL, listed_healthy, published, workers

pytestmark = [pytest.mark.lab, pytest.mark.slow]

VMIDS = (129, 130)
ENV = {"VLLM_STANDIN_LOAD_S": "0.4", "VLLM_STANDIN_TOKEN_S": "0.01"}  # 100 tokens a second: 300 last 3 s


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    yield from routed_lab(tmp_path_factory, "lab-vllm-router", hosts=1, gpus=4, vmids=VMIDS, engines=("vllm",))


class VllmClient(Traffic):
    """The router lab's client (tests/e2e/test_router_lab.py ``Client``) with vLLM's endpoints: whole
    answers from /v1/completions (vLLM has no /generate), chat completions and streams through the
    openai package as there."""

    def __init__(self, url: str, streams: int = 2, stream_tokens: int = 60):
        super().__init__(url, seconds=120.0, max_requests=20000, generate_threads=2, chat_threads=1,
                         stream_threads=streams, stream_tokens=stream_tokens, answer_tokens=20, model=MODEL,
                         pause_s=0.1)

    def _generate(self, prompt: str) -> str | None:
        answer = self.openai.completions.create(model="/opt/models/lab-model", prompt=prompt, max_tokens=20)
        return None if answer.choices[0].finish_reason == "length" else f"completion {answer.choices[0]!r}"


def deploy(lab, router: dict, *extra: str, flags: dict | None = None) -> tuple[int, str]:
    """The lab's fleet (each replica on its own GPUs through CUDA_VISIBLE_DEVICES) with ENV and
    ``flags`` added to every server, applied."""
    from gpugate_lab import core

    doc = core.fleet_document(lab.dir, [(h.name, h.port) for h in lab.hosts], {"pve1": list(VMIDS)},
                              router=router, engines=("vllm",))
    for container in doc["hosts"]["pve1"]["containers"].values():
        container["vllm"]["env"] = {**container["vllm"].get("env", {}), **ENV}
        container["vllm"]["flags"].update(flags or {})
    lab.fleet_path = lab.dir / "fleet.test.yaml"
    lab.fleet_path.write_text(core.render_fleet_yaml(doc))
    result = lab.pyinfra("inventory.py", "deploy.py", "--data", "router_join_timeout_s=20", *extra, timeout=240)
    return result.returncode, result.stdout + result.stderr


def model_len(router: dict, vmid: int) -> int:
    url = f"http://127.0.0.1:{router['ports'][f'pve1:{vmid}']}/v1/models"
    with urllib.request.urlopen(url, timeout=5) as response:
        return int(json.load(response)["data"][0]["max_model_len"])


def test_vllm_replicas_join_smg_as_vllm_workers(routed):
    lab, router = routed
    code, out = deploy(lab, router)
    assert code == 0, out
    assert out.count("back in router lab, listed healthy") + out.count("added to router lab") >= 2 \
        or listed_healthy(router) == published(router), out
    assert listed_healthy(router) == published(router), workers(router)
    assert {w.get("runtime_type") or w.get("runtime") for w in workers(router)} == {"vllm"}, workers(router)


def test_a_rolling_change_of_vllm_replicas_behind_smg_fails_no_request(routed):
    lab, router = routed
    with VllmClient(router["url"], streams=2, stream_tokens=300) as client:
        code, out = deploy(lab, router, "--data", "rolling=true", "--data", "drain_timeout_s=4", flags={"max-model-len": 4096})
    assert code == 0, out
    assert client.failed == 0 and client.ok > 20, (client.failed, client.ok, client.errors[:5], out)
    assert client.streams_ok >= 2 and min(client.stream_s) >= 3.0, (client.streams_ok, client.stream_s)
    # each leave read vLLM's own gauges to 0 (or said what was still open), one replica at a time
    assert re.search(r"router lab: left it; (0 requests in flight|\d+ request\(s\) or stream\(s\) still open)", out), out
    order = [line for line in out.splitlines() if "router lab: left it" in line or "back in router lab" in line]
    assert [("left" in line) for line in order] == [True, False] * 2, order
    assert {model_len(router, vmid) for vmid in VMIDS} == {4096}
    assert listed_healthy(router) == published(router), workers(router)


def test_after_a_rename_smg_routes_the_new_model_name_to_every_replica(routed):
    """A restart can change what smg reads off a server (its served model name, its context
    length): each replica goes back with what the operator gave it and smg reads the rest anew (it
    went back with its old model id and labels, so every request through smg failed after a
    rename, and the deploy said Success)."""
    import openai

    lab, router = routed
    # both at once (no client here: one that names the old model has no server of it afterwards, and
    # min_serving would keep the last replica of the old name in, as a rolling change shows)
    code, out = deploy(lab, router, "--data", "drain_timeout_s=4", "--data", "min_serving=0",
                       flags={"max-model-len": 2048, "served-model-name": "lab-chat"})
    assert code == 0, out
    assert listed_healthy(router) == published(router), workers(router)
    listed = workers(router)
    assert {w.get("model_id") for w in listed} == {"lab-chat"}, listed
    assert {(w.get("labels") or {}).get("max_model_len") for w in listed} <= {"2048", None}, listed
    client = openai.OpenAI(base_url=router["url"] + "/v1", api_key="lab", max_retries=0, timeout=30)
    for _ in range(4):  # spread over both replicas
        answer = client.completions.create(model="lab-chat", prompt="hi", max_tokens=4)
        assert answer.choices[0].finish_reason == "length", answer
