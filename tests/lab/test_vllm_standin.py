"""The vLLM stand-in as an operator sees it (vLLM 0.33.0's behaviour, lab/gpugate_lab/standin/vllm/):
its parser, the port bound before the engine loads, ``VLLM::EngineCore`` and ``VLLM::Worker_TP<r>`` holding
the GPUs, an EngineCore that outlives a SIGKILLed API server, SIGTERM's abort and drain, streaming,
metrics, and the /dev/shm region a crash leaves. Run directly against a simulated driver, no SSH lab."""

from __future__ import annotations

import errno
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpusim_helpers import (GPU_COUNT, SYSTEM_PYTHON, cmdline, free_port, http_json, http_status,  # noqa: F401
                            installed, pid_alive, sim, wait_until)
from gpugate_lab import container_files

UTIL = "0.8"  # a 10000 MiB lab GPU with 615 MiB reserved cannot give vLLM its default 0.92 of the total
HELD_MIB = 8000  # what a rank holds: gpu_memory_utilization x total, its CUDA context included


@dataclass
class Vllm:
    proc: subprocess.Popen
    port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout_s: float = 15.0) -> None:
        wait_until(lambda: self.proc.poll() is None and http_status(self.port) == 200, timeout_s, "/health 200")

    def children(self, pid: int | None = None) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(pid or self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


@pytest.fixture
def model(tmp_path) -> Path:
    d = tmp_path / "models" / "tiny-llama"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "num_hidden_layers": 4,
        "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8, "torch_dtype": "bfloat16"}))
    return d


@pytest.fixture
def start_vllm(sim, installed, tmp_path, model):
    """start_vllm(*flags, env={...}) -> a ``python3 -m vllm.entrypoints.cli.main serve`` as gpugate launches it."""
    started: list[Vllm] = []
    shm = tmp_path / "shm"
    shm.mkdir()

    def start(*flags: str, env: dict | None = None) -> Vllm:
        port = free_port()
        log_path = tmp_path / f"vllm-{len(started)}.log"
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SGLANG", "VLLM", "CUDA"))}
        environ.update({"PYTHONPATH": str(container_files.dist_packages(installed)), "GPUGATE_SIM_DIR": str(sim.gpu_dir),
                        "GPUGATE_LAB_CTL": str(sim.ctl_dir), "VLLM_STANDIN_LOAD_S": "0.1",
                        "VLLM_STANDIN_SHM_DIR": str(shm), **(env or {})})
        argv = [SYSTEM_PYTHON, "-m", "vllm.entrypoints.cli.main", "serve", "--model", str(model), "--host",
                "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", UTIL, *flags]
        with open(log_path, "wb") as log:
            # its own session: EngineCore and the workers stay in its process group when orphaned
            proc = subprocess.Popen(argv, cwd=tmp_path, env=environ, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        started.append(Vllm(proc, port, log_path))
        return started[-1]

    start.shm = shm
    yield start
    for s in started:
        try:
            os.killpg(s.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        s.proc.wait(timeout=10)


def post(port: int, path: str, body: dict, timeout: float = 30.0) -> dict:
    return http_json(port, path, body, timeout=timeout)


def stream_events(port: int, path: str, body: dict) -> list[str]:
    """The ``data:`` payloads of a streamed answer, in order (``[DONE]`` included)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, json.dumps(dict(body, stream=True)), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = [line[len(b"data: "):].decode() for line in resp.read().split(b"\n") if line.startswith(b"data: ")]
    conn.close()
    return events


def post_answer(port: int, path: str, body: dict) -> tuple[int, str]:
    """(status, body text) of a POST, whatever the status."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    answer = resp.status, resp.read().decode()
    conn.close()
    return answer


def running(port: int) -> float:
    text = urlopen_text(port, "/metrics")
    return float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1))


def urlopen_text(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def test_a_bad_flag_exits_2_with_argparse_message_and_an_unknown_kv_cache_dtype_fails_the_start(start_vllm, sim):
    s = start_vllm("--kv-cach-dtype", "fp8")
    assert s.proc.wait(timeout=30) == 2
    assert "main.py: error: unrecognized arguments: --kv-cach-dtype fp8" in s.log()
    s = start_vllm("-tp", "two")
    assert s.proc.wait(timeout=30) == 2
    assert "main.py serve: error: argument --tensor-parallel-size/-tp: invalid int value: 'two'" in s.log()
    # vLLM's parser takes any --kv-cache-dtype; its CacheConfig refuses it once the port is bound
    s = start_vllm("--kv-cache-dtype", "fp9")
    assert s.proc.wait(timeout=30) == 1
    assert "ValueError: Invalid kv_cache_dtype: 'fp9'. Valid values are: ['auto'," in s.log()
    assert sim.all_used() == [0] * GPU_COUNT


def test_one_gpu_binds_the_port_first_loads_in_engine_core_then_serves_and_streams(sim, start_vllm, model):
    # held in its load until the fault is cleared; the third request fails (error-rate: this server's)
    error_rate = {"error-rate": {"value": 0.34, "set_at": time.time()}}
    sim.set_faults({"slow-start": 60, **error_rate})
    s = start_vllm("--kv-cache-dtype", "fp8")
    wait_until(lambda: sim.all_used() == [HELD_MIB, 0, 0, 0], what="EngineCore holding GPU 0")
    # the port is vLLM's from before the load (setup_server binds, uvicorn listens later): taken, yet refused
    assert http_status(s.port) == "refused"
    with socket.socket() as probe, pytest.raises(OSError) as taken:
        probe.bind(("127.0.0.1", s.port))
    assert taken.value.errno == errno.EADDRINUSE
    [core] = s.children()
    assert cmdline(core)[0] == "VLLM::EngineCore" and s.children(core) == []  # one GPU: the uniprocess executor
    assert Path(f"/proc/{core}/comm").read_text().strip() == "VLLM::EngineCor"
    assert "vllm.entrypoints.cli.main" in cmdline(s.proc.pid)
    sim.set_faults(error_rate)
    s.wait_healthy()
    tokens = int(re.search(r"GPU KV cache size: ([\d,]+) tokens", s.log()).group(1).replace(",", ""))
    metrics = urlopen_text(s.port, "/metrics")
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:request_success_total", "vllm:cache_config_info"):
        assert f"\n{name}{{" in metrics, name
    info = re.search(r'^vllm:cache_config_info\{(.*)\} 1\.0$', metrics, re.M).group(1)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info))
    assert int(labels["num_gpu_blocks"]) * int(labels["block_size"]) == tokens and labels["cache_dtype"] == "fp8"
    assert http_json(s.port, "/v1/models")["data"][0] | {"created": 0, "permission": []} == {
        "id": str(model), "object": "model", "created": 0, "owned_by": "vllm", "root": str(model), "parent": None,
        "max_model_len": 4096, "permission": []}
    assert http_json(s.port, "/version") == {"version": "0.33.0"}
    # a streamed completion: a chunk per token, the last with its finish reason, the usage, then [DONE]
    events = stream_events(s.port, "/v1/completions", {"model": str(model), "prompt": "hi", "max_tokens": 5,
                                                       "stream_options": {"include_usage": True}})
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and [c["choices"][0]["text"] for c in chunks[:-1]] == [" lab"] * 5
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * 4 + ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    chat = post(s.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat["choices"][0]["message"]["content"] == " lab lab"
    # without VLLM_ALLOW_RUNTIME_LORA_UPDATING vLLM mounts no adapter route
    assert post_answer(s.port, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}) == (
        404, '{"detail": "Not Found"}')
    assert post_answer(s.port, "/v1/completions", {"prompt": "hi", "max_tokens": 2}) == (500, json.dumps(
        {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}))
    metrics = urlopen_text(s.port, "/metrics")
    assert re.search(r'^vllm:request_success_total\{[^}]*finished_reason="length"\} 2\.0$', metrics, re.M)
    assert re.search(r'^vllm:request_success_total\{[^}]*finished_reason="error"\} 1\.0$', metrics, re.M)
    # the requests' histograms (vllm/v1/metrics/loggers.py): a first token each, then a latency per token
    for name, count in (("time_to_first_token_seconds", 2), ("inter_token_latency_seconds", 4 + 1),
                        ("e2e_request_latency_seconds", 3)):
        assert re.search(r'^vllm:%s_count\{model_name="%s",engine="0"\} %d\.0$' % (name, model, count), metrics,
                         re.M), name
    assert re.search(r'^vllm:generation_tokens_total\{[^}]*\} 7\.0$', metrics, re.M)


def test_two_gpus_a_sigkilled_api_server_leaves_engine_core_and_workers_holding_them(sim, start_vllm):
    tiering = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 30}}
    env = {"CUDA_VISIBLE_DEVICES": "2,3", "VLLM_STANDIN_SHM_MIB": "1536"}  # room for one region, not two
    s = start_vllm("-tp", "2", "--kv-transfer-config", json.dumps(tiering), env=env)
    s.wait_healthy()
    [core] = s.children()
    workers = s.children(core)
    assert cmdline(core)[0] == "VLLM::EngineCore"
    assert sorted(cmdline(w)[0] for w in workers) == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    assert sim.all_used() == [0, 0, HELD_MIB, HELD_MIB]
    [region] = list(start_vllm.shm.glob("vllm_offload_*.mmap"))
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait()
    # no parent-death watch in EngineCore (vllm#55510): the port is free, the GPUs are not
    assert http_status(s.port) == "refused"
    with socket.socket() as probe:  # as the next server binds it (its closed connections linger in TIME_WAIT)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", s.port))
        probe.listen()
    assert all(pid_alive(p) for p in [core, *workers]) and sim.all_used() == [0, 0, HELD_MIB, HELD_MIB]
    # the workers watch EngineCore (their death pipe): they go with it
    os.kill(core, signal.SIGKILL)
    wait_until(lambda: not any(pid_alive(w) for w in workers), what="workers gone with EngineCore")
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="memory released")
    # the tiering spec's region outlives the crash (vllm#57303) and leaves no room for the next one (#54002)
    assert region.exists()
    again = start_vllm("-tp", "2", "--kv-transfer-config", json.dumps(tiering), env=env)
    assert again.proc.wait(timeout=30) == 1
    assert "Insufficient space in" in again.log() and "1024 MiB required, 512 MiB free" in again.log()
    assert "Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}" in again.log()
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="the failed start's memory released")


def test_sigterm_with_shutdown_timeout_0_aborts_the_request_in_flight(sim, start_vllm, model):
    s = start_vllm(env={"VLLM_STANDIN_TOKEN_S": "0.01"})
    s.wait_healthy()
    result: dict = {}
    req = threading.Thread(target=lambda: result.update(post(s.port, "/v1/completions", {
        "model": str(model), "prompt": "long", "max_tokens": 3000})))
    req.start()
    wait_until(lambda: running(s.port) == 1.0, what="the request in flight")
    s.proc.send_signal(signal.SIGTERM)
    req.join(timeout=15)
    assert result["choices"][0]["finish_reason"] == "abort" and result["usage"]["completion_tokens"] < 3000
    assert s.proc.wait(timeout=15) == 0
    assert "[shutdown] EngineCore: aborting in-flight requests count=1" in s.log()
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="memory released")


def test_sigterm_with_a_shutdown_timeout_drains_while_health_stays_200(sim, start_vllm, model):
    s = start_vllm("--shutdown-timeout", "30", env={"VLLM_STANDIN_TOKEN_S": "0.01"})
    s.wait_healthy()
    events: list[str] = []
    req = threading.Thread(target=lambda: events.extend(stream_events(s.port, "/v1/chat/completions", {
        "model": str(model), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 150})))
    req.start()
    wait_until(lambda: running(s.port) == 1.0, what="the request in flight")
    s.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "draining in-flight requests count=1 timeout=30s" in s.log(), what="the drain")
    assert http_status(s.port) == 200  # /health has no shutdown check
    late = post(s.port, "/v1/completions", {"model": str(model), "prompt": "late", "max_tokens": 5})
    assert (late["choices"][0]["finish_reason"], late["choices"][0]["text"]) == ("abort", "")
    req.join(timeout=15)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and len(chunks) == 151  # the role's chunk, then one per token
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert s.proc.wait(timeout=15) == 0
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="memory released")


def test_gpugate_reads_the_snapshot_back_from_the_stand_in_parser(installed, tmp_path):
    """The flag table gpugate builds in a lab container (gpugate/engine/vllm/table_builder.py, as its
    EngineFlagTable fact runs it) is the snapshot the stand-in was made from: same options, kinds, types,
    defaults and switches, so gpugate refuses there exactly what that vLLM refuses."""
    from gpugate.engine.vllm import table_builder

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VLLM"))}
    env["PYTHONPATH"] = str(container_files.dist_packages(installed))
    out = subprocess.run([sys.executable, table_builder.__file__, "--no-cache", "--help-text"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, check=True)
    built = json.loads(out.stdout)
    snapshot = json.loads(container_files.snapshot_file("0.33.0", "vllm").read_text())
    assert built["vllm_version"] == "0.33.0" and built["actions"] == snapshot["actions"]


def test_preload_daemons_hold_the_weights_and_an_ipc_cache_engine_maps_them_on_its_key_only(
        sim, installed, start_vllm, tmp_path, model):
    """vLLM 0.33.0's weight cache (vllm/_weight_cache.py): ``vllm preload`` holds each rank's weights on its
    GPU behind a socket gpugate finds where vLLM puts it; an engine with ``--load-format ipc_cache`` maps
    them (its own memory is context + KV: the weights are on the GPU once), another KV cache dtype is
    another key (vLLM's WeightCacheKey has it): the engine without fallback fails, with it loads from disk."""
    from gpugate.engine.vllm import weight_cache as product

    import tempfile

    short = tempfile.mkdtemp(prefix="vwc", dir="/tmp")  # a socket path must stay under AF_UNIX's 108 bytes
    env = {"CUDA_VISIBLE_DEVICES": "2,3", "TMPDIR": short}
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SGLANG", "VLLM", "CUDA"))}
    environ.update({"PYTHONPATH": str(container_files.dist_packages(installed)), "GPUGATE_SIM_DIR": str(sim.gpu_dir),
                    "GPUGATE_LAB_CTL": str(sim.ctl_dir), **env})
    log_path = tmp_path / "preload.log"
    with open(log_path, "wb") as log:
        launcher = subprocess.Popen(
            [SYSTEM_PYTHON, "-m", "vllm.entrypoints.cli.main", "preload", "--model", str(model), "-tp", "2",
             "--gpu-memory-utilization", UTIL], env=environ, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=tmp_path)
    try:
        wait_until(lambda: "===== Weight cache daemon READY" in log_path.read_text(), 20, "the daemons ready")
        config = json.loads((sim.gpu_dir / "config.json").read_text())
        daemons = []
        for gpu in (2, 3):
            ready = product.read_ready(config["uuids"][gpu], env)
            children = [int(p) for p in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                                       text=True).stdout.split()]
            assert ready and ready["pid"] in children, (ready, children)
            assert product.daemon_answers(product.file_paths(config["uuids"][gpu], env)[0])
            daemons.append(ready["pid"])
        held = sim.all_used()
        weights = held[2] - 518
        assert held == [0, 0, 518 + weights, 518 + weights] and weights > 0
        mapped = start_vllm("-tp", "2", "--load-format", "ipc_cache", "--model-loader-extra-config",
                            product.LOADER_CONFIG, env=env)
        mapped.wait_healthy()
        assert "Mapped 1 tensors from the weight cache daemon (zero_copy mode)" in mapped.log()
        assert sim.all_used() == [0, 0, HELD_MIB + 518, HELD_MIB + 518]  # the weights once: the daemon's
        other = start_vllm("-tp", "2", "--kv-cache-dtype", "fp8", "--load-format", "ipc_cache",
                           "--model-loader-extra-config", product.LOADER_CONFIG,
                           env=dict(env, CUDA_VISIBLE_DEVICES="2,3"))
        assert other.proc.wait(timeout=30) == 1
        assert "WeightCacheKey mismatch on fields: ['kv_cache_dtype']" in other.log()
        # SIGTERM ends the daemons; their sockets stay (Python's default death), nobody holds their locks
        os.kill(launcher.pid, signal.SIGTERM)
        assert launcher.wait(timeout=10) in (0, -15, 1)
        assert all(product.read_ready(config["uuids"][gpu], env) is None for gpu in (2, 3))
        assert not any(pid_alive(p) for p in daemons)
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except OSError:
            pass
        import shutil

        shutil.rmtree(short, ignore_errors=True)


def test_lora_adapters_start_from_lora_modules_load_and_unload_live_and_answer_through_their_name(
        start_vllm, tmp_path):
    """vLLM 0.33.0's LoRA (vllm/_lora.py): --lora-modules served from the start, the runtime routes with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING, vLLM's refusals with their status codes and texts, each adapter in
    /v1/models with the served model as its parent, a completion naming it answering through it."""
    for name, rank in (("lora-a", 8), ("lora-b", 16)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank}))
    a, b = str(tmp_path / "lora-a"), str(tmp_path / "lora-b")
    s = start_vllm("--enable-lora", "--max-lora-rank", "8", "--served-model-name", "m", "--lora-modules", f"a={a}",
                   env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    s.wait_healthy()
    assert "LoRA dynamic loading & unloading is enabled in the API server" in s.log()

    def cards():
        return [(c["id"], c["root"], c["parent"]) for c in http_json(s.port, "/v1/models")["data"]][1:]

    assert cards() == [("a", a, "m")]
    done = post(s.port, "/v1/completions", {"model": "a", "prompt": "hi", "max_tokens": 2})
    assert (done["model"], done["choices"][0]["text"]) == ("a", " lora-a lora-a")
    nowhere = str(tmp_path / "nowhere")
    refused = {path: post_answer(s.port, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path})
               for path in (b, nowhere)}
    assert refused[b][0] == 500 and "LoRA rank 16 is greater than max_lora_rank 8." in refused[b][1]
    assert refused[nowhere][0] == 404 and f"Loading lora x failed: No adapter found for {nowhere}" in refused[nowhere][1]
    status, text = post_answer(s.port, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": a})
    assert status == 400 and "The lora adapter 'a' has already been loaded." in text
    assert post_answer(s.port, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": a}) == (
        200, "Success: LoRA adapter 'c' added successfully.")
    assert post_answer(s.port, "/v1/unload_lora_adapter", {"lora_name": "a"}) == (
        200, "Success: LoRA adapter 'a' removed successfully.")
    assert cards() == [("c", a, "m")]
    status, text = post_answer(s.port, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert status == 404 and "The lora adapter 'a' cannot be found." in text
    status, text = post_answer(s.port, "/v1/completions", {"model": "a", "prompt": "hi", "max_tokens": 1})
    assert status == 404 and "The model `a` does not exist." in text
    chat = post(s.port, "/v1/chat/completions", {"model": "c", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 1})
    assert chat["model"] == "c" and chat["choices"][0]["message"]["content"] == " lora-a"
    # an adapter of --lora-modules that cannot load ends the start (init_static_loras): LoRA is off
    bad = start_vllm("--lora-modules", f"a={a}", env={"CUDA_VISIBLE_DEVICES": "1"})
    assert bad.proc.wait(timeout=30) == 1
    assert "in init_static_loras\nValueError: LoRA is not enabled." in bad.log()
