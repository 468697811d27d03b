"""The SGLang stand-in as an operator sees it: flags, process tree, memory, health sequence, drain."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request

import pytest

from gpusim_helpers import (GPU_COUNT, TOTAL_MIB, cmdline, hold, http_json, http_status,  # noqa: F401
                            installed, model_dir, pid_alive, sim, start_standin, wait_until)


def test_bad_choice_exits_2_with_argparse_message(start_standin, model_dir):
    s = start_standin("--model-path", str(model_dir), "--kv-cache-dtype", "fp9")
    assert s.proc.wait(timeout=30) == 2
    assert "launch_server.py: error: argument --kv-cache-dtype: invalid choice: 'fp9'" in s.log()


def test_unknown_flag_exits_2(start_standin, model_dir):
    s = start_standin("--model-path", str(model_dir), "--no-such-flag")
    assert s.proc.wait(timeout=30) == 2
    assert "unrecognized arguments: --no-such-flag" in s.log()


def test_model_path_must_be_a_model_dir_or_hf_id(start_standin, tmp_path):
    s = start_standin("--model-path", str(tmp_path / "nope"))
    assert s.proc.wait(timeout=30) == 1
    assert "HFValidationError: Repo id must be in the form" in s.log()
    empty = tmp_path / "empty-model"
    empty.mkdir()
    s = start_standin("--model-path", str(empty))
    assert s.proc.wait(timeout=30) == 1
    assert "does not appear to have a file named config.json" in s.log()


def test_port_closed_and_memory_held_while_loading_then_sigkill_frees_it(sim, start_standin, model_dir):
    s = start_standin("--model-path", str(model_dir), "--tp", "4", env={"SGLANG_STANDIN_LOAD_S": "60"})
    per_gpu = int(TOTAL_MIB * 0.88) + 518
    wait_until(lambda: sim.all_used() == [per_gpu] * GPU_COUNT, what="schedulers holding memory")
    assert http_status(s.port) == "refused"
    workers = s.child_pids()
    assert sorted(cmdline(p)[0] for p in workers) == [
        "sglang::detokenizer"] + [f"sglang::scheduler_TP{i}" for i in range(4)]
    assert "sglang.launch_server" in cmdline(s.proc.pid)
    assert open(f"/proc/{workers[0]}/comm").read().startswith("sglang::")
    s.proc.kill()
    s.proc.wait()
    wait_until(lambda: not any(pid_alive(p) for p in workers), what="workers die with their parent")
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="memory released")


def test_health_sequence_server_info_and_graceful_drain(sim, start_standin, model_dir):
    s = start_standin("--model-path", str(model_dir), "--tp", "2", "--kv-cache-dtype", "fp8_e4m3",
                      "--disable-radix-cache", "--base-gpu-id", "1", env={"SGLANG_STANDIN_TOKEN_S": "0.01"})
    seen = []
    wait_until(lambda: seen.append(http_status(s.port)) or seen[-1] == 200, what="/health 200")
    assert set(seen) <= {"refused", 503, 200}
    assert "The server is fired up and ready to roll!" in s.log()
    assert sim.all_used()[0] == 0 and sim.all_used()[1] > 0 and sim.all_used()[2] > 0

    info = http_json(s.port, "/get_server_info")
    assert (info["tp_size"], info["kv_cache_dtype"], info["disable_radix_cache"]) == (2, "fp8_e4m3", True)
    assert info["mem_fraction_static"] == 0.88 and "version" in info
    assert http_json(s.port, "/server_info")["tp_size"] == 2
    assert http_json(s.port, "/v1/models")["data"][0]["id"] == str(model_dir)
    assert http_json(s.port, "/get_model_info")["model_path"] == str(model_dir)
    assert http_status(s.port, "/health_generate") == 200
    out = http_json(s.port, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    assert out["meta_info"]["completion_tokens"] == 3 and out["text"]

    # a long request in flight, then SIGTERM: /health goes 503, the request finishes, exit 0
    result = {}
    req = threading.Thread(target=lambda: result.update(http_json(
        s.port, "/generate", {"text": "long", "sampling_params": {"max_new_tokens": 300}})))
    req.start()
    wait_until(lambda: http_json(s.port, "/get_load")[0]["num_reqs"] == 1, what="request in flight")
    workers = s.child_pids()
    s.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: http_status(s.port) == 503, what="/health 503 while draining")
    req.join(timeout=30)
    assert result["meta_info"]["completion_tokens"] == 300
    assert s.proc.wait(timeout=30) == 0
    assert not any(pid_alive(p) for p in workers)
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="memory released")


def test_tp1_scheduler_is_named_without_rank(sim, start_standin, model_dir):
    s = start_standin("--model-path", str(model_dir), env={"SGLANG_STANDIN_LOAD_S": "60"})
    wait_until(lambda: sim.used(0) > 0, what="scheduler memory")
    assert sorted(cmdline(p)[0] for p in s.child_pids()) == ["sglang::detokenizer", "sglang::scheduler"]


def test_start_fails_when_gpu_memory_is_not_free(sim, start_standin, model_dir):
    holder = hold(sim, gpu="0", mib=3000)
    try:
        s = start_standin("--model-path", str(model_dir), "--tp", "2")
        assert s.proc.wait(timeout=30) == 1
        log = s.log()
        assert "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static." in log
        assert "Initialization failed" in log
        wait_until(lambda: sim.all_used() == [3000, 0, 0, 0], what="the failed start's memory released")
    finally:
        holder.kill()
        holder.wait()


def test_tp_beyond_the_gpus_fails(sim, start_standin, model_dir):
    s = start_standin("--model-path", str(model_dir), "--tp", str(GPU_COUNT + 1))
    assert s.proc.wait(timeout=30) == 1
    assert "invalid device ordinal" in s.log()
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="memory released")


def test_hf_repo_id_is_accepted(sim, start_standin):
    s = start_standin("--model-path", "org/some-model", env={"SGLANG_STANDIN_LOAD_S": "0"})
    s.wait_healthy()
    assert http_json(s.port, "/v1/models")["data"][0]["id"] == "org/some-model"
    assert json.loads(json.dumps(http_json(s.port, "/get_server_info")))["model_path"] == "org/some-model"
    os.kill(s.proc.pid, signal.SIGTERM)
    assert s.proc.wait(timeout=30) == 0


def test_a_dead_scheduler_takes_the_server_down_as_sglang_does(sim, start_standin, model_dir):
    # SGLang's SubprocessWatchdog notices a child that exited non-zero within ~1 s and SIGQUITs the main
    # process, whose handler kills the whole tree: /health does not keep answering 200 over dead workers.
    s = start_standin("--model-path", str(model_dir), "--tp", "2", "--api-key", "sk-lab-canary",
                      env={"SGLANG_STANDIN_LOAD_S": "0"})
    s.wait_healthy()
    workers = s.child_pids()
    scheduler = next(p for p in workers if cmdline(p)[0] == "sglang::scheduler_TP1")
    os.kill(scheduler, signal.SIGKILL)
    assert s.proc.wait(timeout=10) == -signal.SIGKILL  # kill_process_tree(include_parent=True)
    assert http_status(s.port) == "refused"
    # the detokenizer and TP0 went with it: SIGKILLed by the main before it killed itself, and gone
    # once the kernel has run their exits (the main does not wait for them, nor does SGLang's
    # kill_process_tree; under load that takes a moment after the main's own exit)
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(pid_alive(p) for p in workers)
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="memory released")
    log = s.log()
    assert re.search(rf"Subprocess scheduler_1 \(pid={scheduler}\) crashed with exit code -9\. "
                     r"Triggering SIGQUIT for cleanup\.\.\.", log)
    assert "SIGQUIT received. signum=None, frame=None. It usually means one child failed." in log
    assert f"kill_process_tree called: parent_pid={s.proc.pid}, include_parent=True" in log
    # the start logs its arguments as SGLang does, api_key in the clear (what gpugate must redact)
    assert re.search(r"^\[[0-9-]+ [0-9:]+\] server_args=ServerArgs\(model_path='[^']+', .*"
                     r"api_key='sk-lab-canary'", log, re.M)


def test_a_drain_ending_in_its_own_worker_kills_is_no_crash(sim, start_standin, model_dir):
    # the drain SIGKILLs the workers itself: the watchdog must not read that as a dead child
    s = start_standin("--model-path", str(model_dir), "--tp", "2", env={"SGLANG_STANDIN_LOAD_S": "0"})
    s.wait_healthy()
    os.kill(s.proc.pid, signal.SIGTERM)
    assert s.proc.wait(timeout=30) == 0
    assert "SIGQUIT received" not in s.log()


def test_slow_start_is_read_while_loading_so_clearing_it_ends_the_load(sim, start_standin, model_dir):
    """lab.load_held (tests/conftest.py) rests on this: a server held in its load by slow-start serves
    once the fault is cleared, long before the fault's own length."""
    sim.set_faults({"slow-start": 600})
    s = start_standin("--model-path", str(model_dir), "--tp", "1")
    wait_until(lambda: sim.used(0) > 0, what="the scheduler holding memory (the load began)")
    assert http_status(s.port) == "refused"  # still loading: the port stays closed
    sim.set_faults({})
    wait_until(lambda: http_status(s.port) == 200, what="/health 200 once slow-start is cleared")


def _sse_events(port: int, path: str, body: dict) -> tuple[dict, list[str]]:
    """The raw answer to a streamed request: its headers and its ``data:`` lines, in order."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        headers = {k.lower(): v for k, v in response.getheaders()}
        lines = [line.decode().rstrip("\n") for line in response]
    assert all(line.startswith("data: ") or line == "" for line in lines), lines[:6]
    return headers, [line[len("data: "):] for line in lines if line]


def test_streams_as_sglang_does_token_by_token_and_a_kill_mid_stream_is_an_error(sim, start_standin, model_dir):
    """issue 32 item 3: ``stream: true`` answers with server-sent events, one per decoded token at the
    decode rate, then [DONE] (the real OpenAI client reads them); a stream in flight holds the drain;
    a server killed mid-stream leaves the client an error, never a short answer that looks whole."""
    import openai

    token_s = 0.01
    s = start_standin("--model-path", str(model_dir), env={"SGLANG_STANDIN_LOAD_S": "0",
                                                           "SGLANG_STANDIN_TOKEN_S": str(token_s)})
    s.wait_healthy()
    # /generate: an event per token with the text so far, finish_reason on the last, then [DONE]
    headers, events = _sse_events(s.port, "/generate", {"text": "hi", "stream": True,
                                                         "sampling_params": {"max_new_tokens": 5}})
    assert headers["content-type"].startswith("text/event-stream") and headers["transfer-encoding"] == "chunked"
    assert events[-1] == "[DONE]" and len(events) == 6
    outs = [json.loads(e) for e in events[:-1]]
    assert [o["text"] for o in outs] == [" lab" * k for k in range(1, 6)]
    assert [o["meta_info"]["finish_reason"] for o in outs][-2:] == [None, {"type": "length", "length": 5}]

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none", max_retries=0)
    arrived, chunks = [], []
    for chunk in client.chat.completions.create(model="lab-model", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=30, stream=True, stream_options={"include_usage": True}):
        arrived.append(time.monotonic())
        chunks.append(chunk)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert content == [" lab"] * 30  # one chunk per decoded token
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 30 and not chunks[-1].choices
    assert arrived[-1] - arrived[1] >= 20 * token_s  # at the decode rate (29 tokens apart), not all at the end
    text = "".join(c.choices[0].text for c in client.completions.create(model="lab-model", prompt="hi",
                                                                         max_tokens=7, stream=True))
    assert text == " lab" * 7

    # SIGTERM while a stream runs: the drain waits for it, it ends with its [DONE], then exit 0
    second = start_standin("--model-path", str(model_dir), "--base-gpu-id", "1",
                           env={"SGLANG_STANDIN_LOAD_S": "0", "SGLANG_STANDIN_TOKEN_S": str(token_s)})
    second.wait_healthy()
    got = []
    stream = openai.OpenAI(base_url=f"http://127.0.0.1:{second.port}/v1", api_key="none",
                           max_retries=0).chat.completions.create(
        model="lab-model", messages=[{"role": "user", "content": "hi"}], max_tokens=60, stream=True)
    for chunk in stream:
        got.append(chunk.choices[0].delta.content or "")
        if len(got) == 2:
            second.proc.send_signal(signal.SIGTERM)
    assert "".join(got) == " lab" * 60
    assert second.proc.wait(timeout=30) == 0

    # SIGKILL mid-stream: the chunked body never ends, and the client says so
    stream = client.chat.completions.create(model="lab-model", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=3000, stream=True)
    got = []
    with pytest.raises(openai.APIConnectionError) as cut:
        for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                s.proc.kill()
    assert 3 <= len(got) < 3000
    assert "incomplete chunked read" in repr(cut.value.__cause__), repr(cut.value.__cause__)
