"""The SGLang stand-in's live changes as a client sees them (issue 34, the lab): LoRA adapters loaded,
listed, used and unloaded, and new weights loaded, without a restart; SGLang 0.5.23's answers and
failures (lab/gpugate_lab/standin/sglang/_live.py), on the lab's own model files."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from gpugate_lab import container, faults
from gpusim_helpers import http_json, installed, pid_alive, sim, start_standin, wait_until  # noqa: F401

ENABLE_HINT = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


@pytest.fixture
def models(tmp_path):
    """The lab's /opt/models (lab-model, lab-model-v2, lab-model-qwen2, lab-lora-a, lab-lora-b)."""
    container.write_lab_models(tmp_path / "opt-models")
    return tmp_path / "opt-models"


def post(port: int, path: str, body: dict, timeout: float = 30.0):
    """(status, JSON body) of a POST, errors included."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def in_background(fn, *args):
    """Run fn(*args) in a thread; returns (thread, result list: [value, monotonic time of the answer])."""
    out: list = []
    thread = threading.Thread(target=lambda: out.extend([fn(*args), time.monotonic()]))
    thread.start()
    return thread, out


def test_lab_models_are_what_the_engines_read(models):
    base = json.loads((models / "lab-model" / "config.json").read_text())
    v2 = json.loads((models / "lab-model-v2" / "config.json").read_text())
    other = json.loads((models / "lab-model-qwen2" / "config.json").read_text())
    shape = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "vocab_size")
    assert [base[k] for k in shape] == [v2[k] for k in shape] != [other[k] for k in shape]
    assert all((models / m / "model.safetensors").is_file() for m in ("lab-model", "lab-model-v2", "lab-model-qwen2"))
    a = json.loads((models / "lab-lora-a" / "adapter_config.json").read_text())
    b = json.loads((models / "lab-lora-b" / "adapter_config.json").read_text())
    assert (a["peft_type"], a["r"], a["lora_alpha"], b["r"]) == ("LORA", 8, 16, 16)
    assert "gate_proj" in b["target_modules"] and "gate_proj" not in a["target_modules"]
    assert faults.parse_fault("weights-cannot-generate=/opt/models/lab-model-v2/") == (
        "weights-cannot-generate", "/opt/models/lab-model-v2")
    with pytest.raises(ValueError, match="weights-load-fails=MODEL_PATH"):
        faults.parse_fault("weights-load-fails=lab-model-v2")


def test_adapters_load_list_generate_and_unload(start_standin, models):
    base = str(models / "lab-model")
    refused = start_standin("--model-path", base, "--enable-lora")
    assert refused.proc.wait(timeout=30) == 1
    assert "you need to specify both --max-lora-rank and --lora-target-modules" in refused.log()
    s = start_standin("--model-path", base, "--enable-lora", "--max-lora-rank", "8",
                      "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj",
                      env={"SGLANG_STANDIN_TOKEN_S": "0.01"})
    s.wait_healthy()
    lora_a = str(models / "lab-lora-a")
    assert post(s.port, "/load_lora_adapter", {"lora_name": "a", "lora_path": lora_a}) == (200, {
        "rid": None, "http_worker_ipc": None, "success": True, "error_message": "", "loaded_adapters": {"a": lora_a}})
    cards = http_json(s.port, "/v1/models")["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [(base, base, None), ("a", lora_a, base)]

    status, out = post(s.port, "/generate", {"text": "hi", "lora_path": "a", "sampling_params": {"max_new_tokens": 2}})
    assert (status, out["text"]) == (200, " lab-lora-a lab-lora-a")
    status, out = post(s.port, "/v1/chat/completions", {"model": f"{base}:a", "max_tokens": 1,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert (status, out["choices"][0]["message"]["content"]) == (200, " lab-lora-a")
    assert post(s.port, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}})[1]["text"] == " lab"

    # what the pool cannot take, and names it does not know
    status, out = post(s.port, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(models / "lab-lora-b")})
    assert status == 400 and out["error_message"].startswith(
        "LoRA adapter b with rank 16 is incompatible with the current LoRA memory pool configuration.")
    assert out["loaded_adapters"] == {"a": lora_a}
    assert post(s.port, "/load_lora_adapter", {"lora_name": "a", "lora_path": lora_a})[1]["error_message"] == \
        "Failed to load LoRA adapter a because it is already loaded"
    status, out = post(s.port, "/load_lora_adapter", {"lora_name": "c", "lora_path": str(models / "lab-model")})
    assert status == 400 and "adapter_config.json" in out["error_message"]
    status, out = post(s.port, "/generate", {"text": "hi", "lora_path": "nope"})
    assert status == 400 and out["error"]["message"].startswith("Got LoRA adapter that has never been loaded: nope")
    assert post(s.port, "/load_lora_adapter", {"lora_name": "a"})[0] == 422

    # an unload waits for the request under way through the adapter, which finishes
    busy, answer = in_background(post, s.port, "/generate",
                                 {"text": "long", "lora_path": "a", "sampling_params": {"max_new_tokens": 500}})
    wait_until(lambda: http_json(s.port, "/get_load")[0]["num_reqs"] == 1, what="request through a in flight")
    unload, unloaded = in_background(post, s.port, "/unload_lora_adapter", {"lora_name": "a"})
    busy.join(30)
    unload.join(30)
    assert answer[0][0] == 200 and answer[0][1]["meta_info"]["completion_tokens"] == 500
    assert unloaded[0] == (200, {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                                 "loaded_adapters": {}})
    # the unload answered once the request was done: its answer came no earlier than the request's
    # (a 500-token request lasts about 1 s; two client threads read their answers a few ms apart under load)
    assert unloaded[1] >= answer[1] - 0.2
    assert [c["id"] for c in http_json(s.port, "/v1/models")["data"]] == [base]
    status, out = post(s.port, "/unload_lora_adapter", {"lora_name": "a"})
    assert (status, out["error_message"], out["loaded_adapters"]) == (
        400, "LoRA with name a does not exist. Loaded LoRAs: odict_keys([])", None)
    # SGLang never forgets a name it loaded: a request through it loads it again
    assert post(s.port, "/generate", {"text": "hi", "lora_path": "a",
                                      "sampling_params": {"max_new_tokens": 1}})[1]["text"] == " lab-lora-a"
    assert "Reloading evicted adapter: a" in s.log()
    assert [c["id"] for c in http_json(s.port, "/v1/models")["data"]] == [base, "a"]


def test_weight_update_waits_for_requests_keeps_old_weights_on_failure_and_faults(sim, start_standin, models):
    v1, v2 = str(models / "lab-model"), str(models / "lab-model-v2")
    s = start_standin("--model-path", v1, env={"SGLANG_STANDIN_TOKEN_S": "0.01",
                                               "SGLANG_STANDIN_WEIGHT_UPDATE_S": "0.3"})
    s.wait_healthy()
    assert post(s.port, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(models / "lab-lora-a")}) == (
        400, {"rid": None, "http_worker_ipc": None, "success": False, "error_message": ENABLE_HINT,
              "loaded_adapters": None})
    status, out = post(s.port, "/generate", {"text": "hi", "lora_path": "a"})
    assert status == 400 and "but LoRA is not enabled" in out["error"]["message"]

    # a request under way finishes first; one sent during the update waits for its end
    busy, answer = in_background(post, s.port, "/generate", {"text": "long", "sampling_params": {"max_new_tokens": 40}})
    wait_until(lambda: http_json(s.port, "/get_load")[0]["num_reqs"] == 1, what="request in flight")
    update, updated = in_background(post, s.port, "/update_weights_from_disk",
                                    {"model_path": v2, "weight_version": "v2"})
    wait_until(lambda: "Start update_weights" in s.log(), what="the update began")
    late, late_answer = in_background(post, s.port, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}})
    for thread in (busy, update, late):
        thread.join(30)
    assert answer[0][0] == 200 and answer[0][1]["meta_info"]["completion_tokens"] == 40
    assert updated[0] == (200, {"success": True, "message": "Succeeded to update model weights. Weight version "
                                                            "updated to v2.", "num_paused_requests": 0})
    assert answer[1] <= updated[1] <= late_answer[1]
    assert late_answer[0][1]["meta_info"]["weight_version"] == "v2"
    info = http_json(s.port, "/get_model_info")
    assert (info["model_path"], info["served_model_name"], info["weight_version"]) == (v2, v2, "v2")
    assert http_json(s.port, "/v1/models")["data"][0]["id"] == v2
    assert http_json(s.port, "/get_server_info")["model_path"] == v1  # the launch's configuration

    # a failing load answers 400 and the weights stay: a checkpoint without weights, the fault
    empty = models / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text((models / "lab-model" / "config.json").read_text())
    assert post(s.port, "/update_weights_from_disk", {"model_path": str(empty)}) == (400, {
        "success": False, "message": f"Failed to get weights iterator: Cannot find any model weights with `{empty}`.",
        "num_paused_requests": 0})
    sim.set_faults({"weights-load-fails": v1})
    status, out = post(s.port, "/update_weights_from_disk", {"model_path": v1, "weight_version": "v1"})
    assert status == 400 and out["message"].startswith("Failed to get weights iterator: [Errno 5]")
    assert http_json(s.port, "/get_model_info")["weight_version"] == "v2"
    assert post(s.port, "/update_weights_from_disk", {})[0] == 422

    # a checkpoint that loads but cannot generate; loading the previous one back undoes it
    sim.set_faults({"weights-cannot-generate": v2})
    assert post(s.port, "/update_weights_from_disk", {"model_path": v1})[0] == 200
    assert post(s.port, "/update_weights_from_disk", {"model_path": v2})[0] == 200
    out = post(s.port, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 5}})[1]
    assert (out["text"], out["meta_info"]["finish_reason"]) == ("", {"type": "stop", "matched": "NaN happened"})
    assert post(s.port, "/update_weights_from_disk", {"model_path": v1})[0] == 200
    assert post(s.port, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})[1]["text"] == " lab lab"

    # weights of another architecture: SGLang's rollback reloads the new path, the scheduler raises, the
    # whole server goes
    sim.set_faults({})
    workers = s.child_pids()
    update, updated = in_background(unanswered, s.port, {"model_path": str(models / "lab-model-qwen2")})
    assert s.proc.wait(timeout=30) == -9
    update.join(30)
    assert updated[0] == "no answer"
    log = s.log()
    assert "Scheduler hit an exception" in log and "AssertionError: Attempted to load weight" in log
    assert "SIGQUIT received" in log
    wait_until(lambda: not any(pid_alive(p) for p in workers), what="workers gone")


def unanswered(port: int, body: dict):
    """A weight update whose server dies under it: "no answer" (the connection closes unanswered)."""
    try:
        return post(port, "/update_weights_from_disk", body, timeout=20)
    except (OSError, http.client.HTTPException):
        return "no answer"


def test_a_weight_update_with_the_weight_cache_on_kills_the_server(start_standin, models, tmp_path):
    """SGLang refuses to write weights it shares with a cache daemon by raising in the scheduler: the
    server dies, even a client that found no daemon and loaded from disk."""
    where = {f"SGLANG_WEIGHT_CACHE_{kind}_TEMPLATE": str(tmp_path / f"wc_{{device_uuid}}.{kind.lower()}")
             for kind in ("SOCKET", "READY")}
    s = start_standin("--model-path", str(models / "lab-model"), "--weight-cache-mode", "client", env=where)
    s.wait_healthy()
    update, updated = in_background(unanswered, s.port, {"model_path": str(models / "lab-model-v2")})
    assert s.proc.wait(timeout=30) == -9
    update.join(30)
    assert updated[0] == "no answer"
    assert "RuntimeError: [weight_cache] update_weights_from_disk is not supported while the weight cache is " \
           "active (--weight-cache-mode client)" in s.log()


def test_initial_adapters_set_the_pool(start_standin, models):
    """--lora-paths alone enables LoRA; the pool's rank and modules are the initial adapters'."""
    base, lora_b = str(models / "lab-model"), str(models / "lab-lora-b")
    s = start_standin("--model-path", base, "--lora-paths", f"b={lora_b}")
    s.wait_healthy()
    assert "--enable-lora is set to True because --lora-paths is provided." in s.log()
    assert [c["id"] for c in http_json(s.port, "/v1/models")["data"]] == [base, "b"]
    assert post(s.port, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(models / "lab-lora-a")})[1][
        "loaded_adapters"] == {"b": lora_b, "a": str(models / "lab-lora-a")}
