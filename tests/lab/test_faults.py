"""Lab faults: each one makes the stand-in / driver fail the way real servers do, and clears."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request

import pytest
from gpusim_helpers import (GPU_COUNT, HOST, TOTAL_MIB, VMID, free_port, http_status, installed,  # noqa: F401
                            model_dir, pid_alive, sim, start_standin, wait_until)

from gpugate_lab import faults, gpusim


def apply(sim, name, clear=False):
    return faults.apply_fault(sim.lab_dir, HOST, VMID, name, clear=clear)


def test_parse_fault_validates_names():
    assert faults.parse_fault("slow-start=2.5") == ("slow-start", 2.5)
    assert faults.parse_fault("slow-decode=3") == ("slow-decode", 3.0)
    assert faults.parse_fault("error-rate=0.25") == ("error-rate", 0.25)
    assert faults.parse_fault("error-rate", clear=True) == ("error-rate", None)
    for bad, said in (("slow-decode", "slow-decode=FACTOR"), ("slow-decode=0", "greater than 0"),
                      ("slow-decode=fast", "slow-decode=FACTOR"), ("error-rate=0", "at most 1"),
                      ("error-rate=1.5", "at most 1"), ("error-rate=nan", "error-rate=P")):
        with pytest.raises(ValueError, match=said):
            faults.parse_fault(bad)
    assert faults.parse_fault("orphan-worker") == ("orphan-worker", True)
    with pytest.raises(ValueError, match="valid faults: ignore-sigterm, orphan-worker"):
        faults.parse_fault("explode")
    with pytest.raises(ValueError, match="slow-start=SECONDS"):
        faults.parse_fault("slow-start=soon")
    with pytest.raises(ValueError):
        faults.parse_fault("orphan-worker=1")


def test_apply_and_clear_write_the_containers_faults_file(sim):
    assert "fault slow-start=7 set" in apply(sim, "slow-start=7")
    apply(sim, "never-healthy")
    assert json.loads((sim.ctl_dir / "faults.json").read_text()) == {"slow-start": 7.0, "never-healthy": True}
    assert "cleared" in apply(sim, "slow-start", clear=True)
    assert gpusim.read_faults(sim.ctl_dir) == {"never-healthy": True}
    apply(sim, "slow-decode=2.5")
    assert gpusim.read_faults(sim.ctl_dir)["slow-decode"]["value"] == 2.5  # with its set_at: the next server's
    apply(sim, "all", clear=True)
    assert gpusim.read_faults(sim.ctl_dir) == {}
    with pytest.raises(ValueError):
        faults.apply_fault(sim.lab_dir, HOST, 999, "never-healthy")


def test_ignore_sigterm_drains_forever(sim, start_standin, model_dir):
    s = start_standin("--model-path", str(model_dir), "--tp", "2")
    s.wait_healthy()
    apply(sim, "ignore-sigterm")
    s.proc.send_signal(signal.SIGTERM)
    s.wait_log(r"Gracefully exiting\.\.\. Remaining number of requests 0")  # only logged while held back
    assert s.proc.poll() is None and http_status(s.port) == 503
    workers = s.child_pids()
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait()
    wait_until(lambda: not any(pid_alive(p) for p in workers), what="workers gone after SIGKILL")
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="memory released")


def test_orphan_worker_keeps_memory_after_sigkill_of_main(sim, start_standin, model_dir):
    s = start_standin("--model-path", str(model_dir), "--tp", "2")
    s.wait_healthy()
    apply(sim, "orphan-worker")
    workers = s.child_pids()
    s.children += workers  # the fixture kills them at the end
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait()
    s.wait_log(r"sglang::scheduler_TP1\] parent process died; staying alive")
    s.wait_log(r"sglang::scheduler_TP0\] parent process died; staying alive")
    used = sim.all_used()
    assert used[0] > 0 and used[1] > 0
    apply(sim, "orphan-worker", clear=True)
    for pid in workers:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="memory released once orphans are killed")


def test_stuck_memory_stays_after_the_holders_die_until_cleared(sim, start_standin, model_dir):
    s = start_standin("--model-path", str(model_dir))
    s.wait_healthy()
    message = apply(sim, "stuck-memory")
    assert "3 current allocation(s) now stuck" in message  # context, weights and KV of the one scheduler
    held = sim.used(0)
    workers = s.child_pids()
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait()
    wait_until(lambda: not any(pid_alive(p) for p in workers), what="workers gone")
    pending: dict = {}
    gpusim.release_step(sim.gpu_dir, pending, now=0.0, delay_s=0.0)
    assert gpusim.release_step(sim.gpu_dir, pending, now=1e6, delay_s=0.0) == []
    assert sim.used(0) == held > 0
    assert "released to the driver" in apply(sim, "stuck-memory", clear=True)
    wait_until(lambda: sim.used(0) == 0, what="memory released after clear")


def test_stuck_memory_sticks_to_the_server_it_was_set_for_never_to_a_gated_engine_started_later(
        sim, start_standin, model_dir):
    """Issue 32 item 14: the fault names the processes holding memory when it is set (the old server);
    a gated engine started after it, before the stop, on the same GPU (it holds its CUDA context while
    it waits at its gate) allocates and frees as usual, as on real hardware: it used to take the fault
    up, and its context stayed on the GPU after it died."""
    old = start_standin("--model-path", str(model_dir), "--mem-fraction-static", "0.5", env={"SGLANG_STANDIN_LOAD_S": "0"})
    old.wait_healthy()
    assert "3 current allocation(s) now stuck, of 1 process(es)" in apply(sim, "stuck-memory")
    held = sim.used(0)
    gated = start_standin("--model-path", str(model_dir), "--gated-launch-port", str(free_port()))
    new = wait_until(lambda: [a for a in gpusim.list_allocations(sim.gpu_dir) if a["pid"] in gated.child_pids()],
                     what="the gated engine's context on GPU 0")
    assert [a["stuck"] for a in new] == [False] and sim.used(0) == held + new[0]["mib"]
    assert all(a["stuck"] for a in gpusim.list_allocations(sim.gpu_dir) if a["pid"] not in gated.child_pids())
    gated.kill()
    wait_until(lambda: sim.used(0) == held, what="the gated engine's context released when it dies")
    old.kill()
    pending: dict = {}
    gpusim.release_step(sim.gpu_dir, pending, now=0.0, delay_s=0.0)
    assert gpusim.release_step(sim.gpu_dir, pending, now=1e6, delay_s=0.0) == [] and sim.used(0) == held
    # a fault set while nothing holds memory names nothing: the next server's memory is its own
    apply(sim, "stuck-memory", clear=True)
    wait_until(lambda: sim.used(0) == 0, what="memory released after clear")
    assert "it names none" in apply(sim, "stuck-memory")
    later = start_standin("--model-path", str(model_dir), env={"SGLANG_STANDIN_LOAD_S": "0"})
    later.wait_healthy()
    assert not any(a["stuck"] for a in gpusim.list_allocations(sim.gpu_dir))
    later.kill()
    wait_until(lambda: sim.used(0) == 0, what="the later server's memory released")
    apply(sim, "stuck-memory", clear=True)


def test_foreign_holder_holds_memory_outside_and_blocks_a_start(sim, start_standin, model_dir, monkeypatch):
    # no lab host here: run the holder directly (the lab prefixes the host's nsenter)
    monkeypatch.setattr(faults, "_host_exec_argv", lambda lab_dir, host: [])
    message = apply(sim, "foreign-holder")
    assert "outside the container" in message
    assert sim.all_used() == [faults.FOREIGN_HOLDER_MIB] * GPU_COUNT
    s = start_standin("--model-path", str(model_dir), "--tp", str(GPU_COUNT))
    assert s.proc.wait(timeout=30) == 1
    assert "Not enough memory" in s.log()
    assert "foreign holder killed" in apply(sim, "foreign-holder", clear=True)
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="foreign memory released")


def test_crash_on_start_exits_1_with_traceback_and_frees_memory(sim, start_standin, model_dir):
    apply(sim, "crash-on-start")
    s = start_standin("--model-path", str(model_dir), "--tp", "2")
    assert s.proc.wait(timeout=30) == 1
    log = s.log()
    assert "Traceback (most recent call last):" in log and "RuntimeError" in log
    assert "fired up" not in log
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="memory released")


def test_never_healthy_keeps_health_503(sim, start_standin, model_dir):
    apply(sim, "never-healthy")
    s = start_standin("--model-path", str(model_dir))
    s.wait_log("Warmup did not complete")
    assert http_status(s.port) == 503
    assert http_status(s.port, "/health_generate") == 503
    assert "fired up" not in s.log()


def test_slow_start_keeps_the_port_closed_while_loading(sim, start_standin, model_dir):
    apply(sim, "slow-start=60")
    s = start_standin("--model-path", str(model_dir), "--tp", "2")
    per_gpu = int(TOTAL_MIB * 0.88) + 518
    wait_until(lambda: sim.all_used()[:2] == [per_gpu, per_gpu], what="schedulers loaded")
    assert http_status(s.port) == "refused"


def _metrics(port: int) -> dict:
    """SGLang's /metrics as prometheus_client's parser reads them: {(sample name, label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, items), v in samples.items() if n == name and set(labels.items()) <= set(items))


def _ask(port: int, stream: bool) -> str:
    """One 5-token answer: a streamed chat completion or a whole /generate; "ok" or what failed."""
    if stream:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
        path = "/v1/chat/completions"
    else:
        body, path = {"text": "hi", "sampling_params": {"max_new_tokens": 5}}, "/generate"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as exc:
        return f"{exc.code} {exc.read().decode()}"
    return "error event" if '"error"' in text else "ok"


def test_slow_decode_and_error_rate_apply_to_the_next_server_only_and_show_in_its_metrics(sim, start_standin,
                                                                                            model_dir):
    """The next server started after slow-decode=4 and error-rate=0.5 decodes 4x slower (its time to
    first token and inter-token latency histograms, as SGLang's /metrics carry them) and fails every
    second request with SGLang's 500, counted as aborted, while /health stays 200; the server started
    after it (a rollback) is healthy; clearing ends the fault in the running server too."""
    assert "for the next server started in the container only" in apply(sim, "slow-decode=4")
    apply(sim, "error-rate=0.5")
    flags = ("--model-path", str(model_dir), "--enable-metrics")
    env = {"SGLANG_STANDIN_TOKEN_S": "0.01"}
    slow = start_standin(*flags, env=env)
    wait_until(lambda: http_status(slow.port) == 200, what="the faulted server healthy")
    healthy = start_standin(*flags, "--base-gpu-id", "1", env=env)  # started after it: not the fault's
    order = (True, True, False, False) * 2
    answers = [_ask(slow.port, stream) for stream in order]
    assert http_status(slow.port) == 200
    assert answers[0::2] == ["ok"] * 4, answers
    assert answers[1] == answers[5] == "error event" and answers[3].startswith("500 "), answers
    wait_until(lambda: http_status(healthy.port) == 200, what="the later server healthy")
    assert [_ask(healthy.port, stream) for stream in order] == ["ok"] * 8

    slow_m, healthy_m = _metrics(slow.port), _metrics(healthy.port)
    assert _value(slow_m, "sglang:num_aborted_requests_total") == 4
    assert _value(healthy_m, "sglang:num_aborted_requests_total") == 0
    # a failed request is a finished one, with no token (the warmup's 8 tokens on each)
    assert _value(slow_m, "sglang:num_requests_total") == _value(healthy_m, "sglang:num_requests_total") == 9
    assert _value(slow_m, "sglang:http_responses_total", endpoint="/generate", status_code="500") == 2
    assert _value(slow_m, "sglang:generation_tokens_total") == _value(healthy_m, "sglang:generation_tokens_total") - 4 * 5
    for name in ("sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds"):
        mean = {}
        for which, samples in (("slow", slow_m), ("healthy", healthy_m)):
            mean[which] = _value(samples, name + "_sum") / _value(samples, name + "_count")
        assert 2.5 < mean["slow"] / mean["healthy"] < 5.5, (name, mean)
    # SGLang's buckets tell them apart: most of the healthy server's 10 ms tokens fall in the first bucket
    # above 0.01 s, most of the slow one's 40 ms tokens above it (most, not all: a busy machine delays some)
    for samples, most_within in ((healthy_m, True), (slow_m, False)):
        within = _value(samples, "sglang:inter_token_latency_seconds_bucket", le="0.015")
        assert (within > 0.5 * _value(samples, "sglang:inter_token_latency_seconds_count")) is most_within, samples

    apply(sim, "error-rate", clear=True)
    assert [_ask(slow.port, False) for _ in range(2)] == ["ok", "ok"]  # cleared in the running server
