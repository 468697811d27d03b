"""The stand-in's SGLang 0.5.23 weight cache and gated launch (issue 22, item 5), driven as an operator
drives them: ``python3 -m sglang.srt.weight_cache.daemon`` and ``python3 -m sglang.launch_server
--weight-cache-mode client|daemon`` / ``--gated-launch-port``, real processes, signals, Unix sockets and
the simulated GPUs (4 x 10000 MiB, 615 reserved). Each test points SGLang's socket and ready templates
into a short temporary directory of its own.

    python -m pytest -q tests/lab/test_weight_cache_standin.py
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import signal
import socket
import stat
import struct
import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from gpusim_helpers import (GPU_COUNT, SYSTEM_PYTHON, TOTAL_MIB, cmdline, container_env, free_port,  # noqa: F401
                            http_status, installed, model_dir, pid_alive, sim, start_standin, wait_until)

from gpugate_lab import gpusim
from gpugate_lab.standin._common import descendants  # the stand-ins' own walk of a process tree

CONTEXT = 518
POOL = int(TOTAL_MIB * 0.88)  # the static pool at the default --mem-fraction-static
WEIGHTS = POOL // 2  # the test model's weights per rank: the capacity model, capped at half the pool


@dataclass
class Daemon:
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> List[int]:
        """The spawned daemon children (not multiprocessing's resource tracker)."""
        return sorted(p for p in descendants(self.proc.pid) if "--multiprocessing-fork" in cmdline(p))


@pytest.fixture
def wc(sim):
    """SGLang's socket and ready templates in a short directory of this test's own (a Unix socket's
    path has at most 107 bytes; /tmp/pytest-of-... test dirs can be longer)."""
    directory = Path(tempfile.mkdtemp(prefix="wc", dir="/tmp"))
    env = {"SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE": str(directory / "sglang_weight_cache_{device_uuid}.sock"),
           "SGLANG_WEIGHT_CACHE_READY_TEMPLATE": str(directory / "sglang_weight_cache_{device_uuid}.ready")}
    yield directory, env
    shutil.rmtree(directory, ignore_errors=True)


def uuid_of(sim, gpu: int) -> str:
    """The GPU's UUID as SGLang names it in the paths: torch's form, no ``GPU-``."""
    return json.loads((sim.gpu_dir / "config.json").read_text())["uuids"][gpu][len("GPU-"):]


def paths(wc, sim, gpu: int):
    directory, _ = wc
    return (directory / f"sglang_weight_cache_{uuid_of(sim, gpu)}.sock",
            directory / f"sglang_weight_cache_{uuid_of(sim, gpu)}.ready")


@pytest.fixture
def start_daemon(sim, installed, tmp_path, wc):
    started: List[Daemon] = []

    def start(*flags: str, env: Optional[dict] = None) -> Daemon:
        log_path = tmp_path / f"daemon-{len(started)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([SYSTEM_PYTHON, "-m", "sglang.srt.weight_cache.daemon", *flags], cwd=tmp_path,
                                    env=container_env(sim, installed, **{**wc[1], **(env or {})}),
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        d = Daemon(proc, log_path)
        started.append(d)
        return d

    yield start
    for d in started:
        kids = descendants(d.proc.pid) if d.proc.poll() is None else []
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(timeout=10)
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def engine(start_standin, wc, *flags, env=None, port=None):
    return start_standin(*flags, env={**wc[1], **(env or {})}, port=port)


def ask(sock_path: Path, request: dict) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(sock_path))
        data = pickle.dumps(request)
        s.sendall(struct.pack("!I", len(data)) + data)
        header = s.recv(4, socket.MSG_WAITALL)
        body = b""
        length = struct.unpack("!I", header)[0]
        while len(body) < length:
            body += s.recv(length - len(body))
        return pickle.loads(body)


def ready_config(ready: Path) -> tuple:
    lines = ready.read_text().splitlines()
    assert lines[0].startswith("pid=") and lines[1].startswith("config=") and len(lines) == 2
    return int(lines[0][4:]), ast.literal_eval(lines[1][len("config="):])


def held_by(sim, pids) -> Dict[int, int]:
    """MiB held per GPU by the given processes."""
    out: Dict[int, int] = {}
    for a in gpusim.list_allocations(sim.gpu_dir):
        if int(a["pid"]) in pids:
            out[int(a["gpu"])] = out.get(int(a["gpu"]), 0) + int(a["mib"])
    return out


def complete(ready: Path) -> bool:
    try:
        return ready.read_text().count("\n") >= 2
    except OSError:
        return False


def daemon_up(sim, wc, d: Daemon, gpus, launcher: bool = True) -> Dict[int, int]:
    """Wait until a daemon serves on every GPU of ``gpus`` (and a launcher says so: it then monitors
    its children); {gpu: child pid}."""
    for gpu in gpus:
        # SGLang writes the .ready in two writes (pid, then config): wait for both, as a reader must
        wait_until(lambda: complete(paths(wc, sim, gpu)[1]) or d.proc.poll() is not None, 15,
                   f"the daemon's .ready for GPU {gpu}")
        assert d.proc.poll() is None, d.log()
    if launcher:
        wait_until(lambda: "weight cache daemons on node 0 are ready" in d.log() or d.proc.poll() is not None,
                   15, "the launcher's all-ready line")
        assert d.proc.poll() is None, d.log()
    return {gpu: ready_config(paths(wc, sim, gpu)[1])[0] for gpu in gpus}


# ---------------------------------------------------------------- the standalone daemon


def test_launcher_spawns_one_child_per_gpu_with_sglangs_cmdline_socket_and_ready(sim, wc, start_daemon, model_dir):
    d = start_daemon("--model-path", str(model_dir), "--tp-size", "2", "--base-gpu-id", "1")
    pids = daemon_up(sim, wc, d, [1, 2])
    assert sorted(pids.values()) == d.children()
    for gpu, pid in pids.items():
        argv = cmdline(pid)
        # multiprocessing's spawn: <python> [interpreter flags] -c "from multiprocessing.spawn import ..."
        assert argv[0] == SYSTEM_PYTHON and argv[-1] == "--multiprocessing-fork", argv
        assert argv[-2].startswith("from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=")
        assert argv[-3] == "-c"
        sock, ready = paths(wc, sim, gpu)
        assert stat.S_ISSOCK(sock.lstat().st_mode) and stat.S_IMODE(sock.lstat().st_mode) == 0o600
        ready_pid, config = ready_config(ready)
        assert ready_pid == pid
        assert config == {
            "model_path": str(model_dir), "model_arch": "LlamaForCausalLM", "tp_size": 2, "tp_rank": gpu - 1,
            "pp_size": 1, "pp_rank": 0, "dp_size": 1, "ep_size": 1, "moe_dp_size": 1, "moe_dp_rank": 0,
            "moe_ep_rank": 0, "attn_dp_size": 1, "enable_dp_lm_head": False, "attn_cp_size": 1,
            "moe_dense_tp_size": None, "moe_a2a_backend": "none", "quant_method": "", "quant_config_hash": "",
            "dtype": "torch.float16", "revision": "", "device_capability": "12.0", "torch_version": "2.14.1+cu130"}
        assert ask(sock, {"type": "query_config"}) == {"status": "ok", "config": config}
        assert ask(sock, {"type": "ping"}) == {"status": "ok"}
        assert ask(sock, {"type": "nope"})["status"] == "error"
    assert held_by(sim, set(pids.values())) == {1: CONTEXT + WEIGHTS, 2: CONTEXT + WEIGHTS}
    # the spawn started multiprocessing's resource tracker beside the children, as under SGLang
    assert any("multiprocessing.resource_tracker" in " ".join(cmdline(p)) for p in descendants(d.proc.pid))
    log = d.log()
    assert f"Launched weight cache daemon gpu=1 pp_rank=0 tp_rank=0 pid={pids[1]}" in log
    assert "All 2 weight cache daemons on node 0 are ready (pp_ranks=0..0, tp_ranks=0..1" in log
    assert "[Daemon gpu=2 tp_rank=1] INFO [WeightCacheDaemon gpu=2] Listening on " in log


def test_a_live_daemons_files_refuse_a_second_launch_and_force_takes_over(sim, wc, start_daemon, model_dir):
    # a small pool, so the new daemon's load never waits on the memory of the old one it killed
    small = ("--model-path", str(model_dir), "--mem-fraction-static", "0.4")
    first = start_daemon(*small)
    old = daemon_up(sim, wc, first, [0])[0]
    second = start_daemon(*small)
    assert second.proc.wait(timeout=30) == 1
    assert (f"RuntimeError: Weight cache daemon for GPU {uuid_of(sim, 0)} is already running (pid={old}, "
            f"ready={paths(wc, sim, 0)[1]}). Stop the existing daemon before launching a new one, or pass "
            "force=True (--force) to kill it and take over.") in second.log()
    third = start_daemon(*small, "--force")
    wait_until(lambda: not pid_alive(old), what="--force SIGKILLs the old child")
    # the old launcher sees its child gone: it ends the rest and exits 1
    assert first.proc.wait(timeout=30) == 1
    assert f"Weight cache daemon (pid={old}) exited with code -9; terminated the remaining daemons." in first.log()
    new = daemon_up(sim, wc, third, [0])[0]
    assert new != old and "force takeover: killing existing daemon pid=%d" % old in third.log()
    assert ask(paths(wc, sim, 0)[0], {"type": "ping"}) == {"status": "ok"}


def test_one_child_killed_ends_the_others_and_the_launcher_exits_1(sim, wc, start_daemon, model_dir):
    d = start_daemon("--model-path", str(model_dir), "--tp-size", "2")
    pids = daemon_up(sim, wc, d, [0, 1])
    os.kill(pids[1], signal.SIGKILL)
    assert d.proc.wait(timeout=30) == 1
    log = d.log()
    assert log.rstrip().endswith(f"RuntimeError: Weight cache daemon (pid={pids[1]}) exited with code -9; "
                                 "terminated the remaining daemons.")
    assert "All weight cache daemons have been terminated" in log
    assert "[WeightCacheDaemon gpu=0] Received signal 15, shutting down" in log
    # the SIGTERMed child removed its files; the SIGKILLed one's stay (stale: the next launch removes them)
    assert not any(p.exists() for p in paths(wc, sim, 0))
    assert all(p.exists() for p in paths(wc, sim, 1))
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="the daemons' memory released")


def test_sigterm_on_a_child_removes_its_files(sim, wc, start_daemon, model_dir):
    d = start_daemon("--model-path", str(model_dir), "--gpu-id", "3", "--tp-rank", "0")  # single-rank mode
    pid = daemon_up(sim, wc, d, [3], launcher=False)[3]
    assert pid == d.proc.pid  # the work runs in the process itself
    assert held_by(sim, {pid}) == {3: CONTEXT + WEIGHTS}
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=10) == 0
    assert not any(p.exists() for p in paths(wc, sim, 3))
    assert "Shutdown complete" in d.log()


def test_single_rank_daemons_of_one_group_meet_at_their_dist_init_method(sim, wc, start_daemon, model_dir):
    init = f"tcp://127.0.0.1:{free_port()}"
    ranks = [start_daemon("--model-path", str(model_dir), "--tp-size", "2", "--gpu-id", str(r), "--tp-rank", str(r),
                          "--dist-init-method", init) for r in (1, 0)]  # rank 1 first: it waits for rank 0's store
    pids = {gpu: daemon_up(sim, wc, d, [gpu], launcher=False)[gpu] for gpu, d in zip((1, 0), ranks)}
    assert pids == {1: ranks[0].proc.pid, 0: ranks[1].proc.pid}
    assert [ready_config(paths(wc, sim, g)[1])[1]["tp_rank"] for g in (0, 1)] == [0, 1]


def test_an_explicit_weight_cache_socket_is_asked_by_every_rank(sim, wc, start_daemon, start_standin, model_dir):
    d = start_daemon("--model-path", str(model_dir), "--tp-size", "2")
    daemon_up(sim, wc, d, [0, 1])
    s = engine(start_standin, wc, "--model-path", str(model_dir), "--tp-size", "2", "--weight-cache-mode", "client",
               "--weight-cache-socket", str(paths(wc, sim, 0)[0]))
    assert s.proc.wait(timeout=30) == 1  # TP1 asks rank 0's daemon: another tp_rank, a mismatch
    assert "'tp_rank': 1" in s.log() and "Daemon config mismatch!" in s.log()


def test_sigterm_on_the_launcher_kills_it_and_its_children_leaving_stale_files(sim, wc, start_daemon, model_dir):
    small = ("--model-path", str(model_dir), "--tp-size", "2", "--mem-fraction-static", "0.4")
    d = start_daemon(*small)
    pids = daemon_up(sim, wc, d, [0, 1])
    d.proc.send_signal(signal.SIGTERM)  # Python's default action: no teardown
    assert d.proc.wait(timeout=10) == -signal.SIGTERM
    wait_until(lambda: not any(pid_alive(p) for p in pids.values()), what="PR_SET_PDEATHSIG kills the children")
    assert all(p.exists() for gpu in (0, 1) for p in paths(wc, sim, gpu))
    # SGLang's liveness check is os.kill(pid, 0), which a zombie passes: wait for the orphans' reaper
    # (a container's init at once; this machine's PID 1 within a few seconds)
    wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in pids.values()), 15, "the orphans reaped")
    again = start_daemon(*small)
    daemon_up(sim, wc, again, [0, 1])
    assert again.log().count("Removed stale daemon file: ") == 4


def test_daemon_args_parse_as_sglang_parses_them(sim, wc, start_daemon, model_dir):
    bad = start_daemon("--model-path", str(model_dir), "--kv-cache-dtype", "fp9")
    assert bad.proc.wait(timeout=30) == 2
    assert "sglang serve: error: argument --kv-cache-dtype: invalid choice: 'fp9'" in bad.log()
    # SGLang's parse_known_args allows abbreviations: --tp 2 is the daemon's own --tp-rank 2, so this is a
    # single daemon on GPU 2 with tp_size 1 (and tp_rank 2)
    quirk = start_daemon("--model-path", str(model_dir), "--tp", "2")
    daemon_up(sim, wc, quirk, [2], launcher=False)
    _, config = ready_config(paths(wc, sim, 2)[1])
    assert (config["tp_size"], config["tp_rank"]) == (1, 2)
    template = start_daemon("--model-path", str(model_dir),
                            env={"SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE": str(wc[0] / "one.sock")})
    assert template.proc.wait(timeout=30) == 1
    assert (f"ValueError: SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE='{wc[0] / 'one.sock'}' must contain "
            "'{device_uuid}': each physical GPU needs its own path") in template.log()


def test_the_daemon_refuses_a_quantization_not_verified_for_ipc(sim, wc, start_daemon, model_dir):
    d = start_daemon("--model-path", str(model_dir), "--quantization", "fp8")  # per-tensor (no block size)
    assert d.proc.wait(timeout=30) == 1
    log = d.log()
    assert ("UnsupportedQuantForIPCError: [weight_cache:daemon] quantization method 'fp8' is not verified for "
            "CUDA IPC zero-copy weight sharing.") in log
    assert "RuntimeError: Weight cache daemon exited prematurely with code 1" in log


# ---------------------------------------------------------------- the engine as a client


def test_a_client_maps_the_daemons_weights_and_holds_none_of_its_own(sim, wc, start_daemon, start_standin, model_dir):
    d = start_daemon("--model-path", str(model_dir), "--tp-size", "2")
    daemons = daemon_up(sim, wc, d, [0, 1])
    # a disk load would take ten minutes: serving at once says the weights were mapped
    s = engine(start_standin, wc, "--model-path", str(model_dir), "--tp-size", "2", "--weight-cache-mode", "client",
               env={"SGLANG_STANDIN_WEIGHT_LOAD_S": "600"})
    s.wait_healthy()
    schedulers = [p for p in s.child_pids() if cmdline(p)[0].startswith("sglang::scheduler")]
    held = held_by(sim, set(schedulers))
    assert held_by(sim, set(daemons.values())) == {0: CONTEXT + WEIGHTS, 1: CONTEXT + WEIGHTS}  # unchanged
    # context + a KV pool as SGLang sizes it after a map: free - (free + weights) x (1 - 0.88)
    free = TOTAL_MIB - 615 - (CONTEXT + WEIGHTS) - CONTEXT
    assert held == {g: CONTEXT + int(free - (free + WEIGHTS) * (1 - 0.88)) for g in (0, 1)}
    log = s.log()
    assert "[IpcModelLoader] Loaded model via IPC (mode=client)" in log
    assert f"[IpcModelLoader] Started daemon-liveness watchdog for pid={daemons[0]}" in log
    assert "Serving 1 tensors via torch_ipc transport" in d.log()


def test_a_client_without_a_daemon_loads_from_disk(sim, wc, start_standin, model_dir):
    s = engine(start_standin, wc, "--model-path", str(model_dir), "--weight-cache-mode", "client")
    s.wait_healthy()
    log = s.log()
    assert f"[IpcModelLoader] Daemon socket not found at {paths(wc, sim, 0)[0]}." in log
    assert "[IpcModelLoader] Weight cache not available or config mismatch, falling back to disk load" in log
    assert sim.all_used() == [CONTEXT + POOL, 0, 0, 0]  # weights and KV of its own, as without the cache


def test_a_client_of_a_daemon_with_another_key_fails_to_start(sim, wc, start_daemon, start_standin, model_dir):
    d = start_daemon("--model-path", str(model_dir), "--tp-size", "2")
    daemon_up(sim, wc, d, [0, 1])
    s = engine(start_standin, wc, "--model-path", str(model_dir), "--tp-size", "2", "--weight-cache-mode", "client",
               "--revision", "v2")
    assert s.proc.wait(timeout=30) == 1
    log = s.log()
    assert "RuntimeError: [IpcModelLoader] Daemon config mismatch!" in log
    assert "'revision': 'v2'" in log and "RuntimeError: Initialization failed." in log
    assert "Config mismatch: {'revision': ('', 'v2')}" in d.log()
    assert d.proc.poll() is None  # the daemons keep serving
    # the cache's key holds the quantization too: an unsupported one is refused before the daemon is asked
    s = engine(start_standin, wc, "--model-path", str(model_dir), "--tp-size", "2", "--weight-cache-mode", "client",
               "--quantization", "awq")
    assert s.proc.wait(timeout=30) == 1
    assert "UnsupportedQuantForIPCError: [weight_cache:client] quantization method 'awq' is not verified" in s.log()


def test_a_stale_socket_refuses_and_the_start_fails(sim, wc, start_standin, model_dir):
    sock_path = paths(wc, sim, 0)[0]
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_path))
    stale.close()  # the file stays, nothing listens: connect() is refused
    s = engine(start_standin, wc, "--model-path", str(model_dir), "--weight-cache-mode", "client")
    assert s.proc.wait(timeout=30) == 1
    assert (f"RuntimeError: [IpcModelLoader] Daemon socket exists at {sock_path} but refused the connection. The "
            "daemon may have crashed after creating the socket. Check daemon logs.") in s.log()
    assert http_status(s.port) == "refused"
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="the failed start's memory released")


def test_a_daemon_killed_under_a_serving_engine_takes_the_engine_down(sim, wc, start_daemon, start_standin, model_dir):
    d = start_daemon("--model-path", str(model_dir), "--tp-size", "2")
    daemons = daemon_up(sim, wc, d, [0, 1])
    s = engine(start_standin, wc, "--model-path", str(model_dir), "--tp-size", "2", "--weight-cache-mode", "client")
    s.wait_healthy()
    tree = descendants(s.proc.pid)
    os.kill(daemons[1], signal.SIGKILL)
    assert s.proc.wait(timeout=15) == -signal.SIGKILL  # watchdog SIGKILLs TP1, SubprocessWatchdog the tree
    wait_until(lambda: not any(pid_alive(p) for p in tree), what="the engine's tree gone")
    log = s.log()
    assert (f"[IpcModelLoader] Weight cache daemon (pid={daemons[1]}) died while this engine holds its weights "
            "via CUDA IPC.") in log
    assert "crashed with exit code -9. Triggering SIGQUIT for cleanup..." in log


def test_cuda_visible_devices_maps_ranks_to_physical_gpus(sim, wc, start_daemon, start_standin, model_dir):
    env = {"CUDA_VISIBLE_DEVICES": "3,2"}
    d = start_daemon("--model-path", str(model_dir), "--tp-size", "2", env=env)
    daemons = daemon_up(sim, wc, d, [3, 2])  # device 0 is GPU 3: its socket has GPU 3's UUID
    assert held_by(sim, {daemons[3]}) == {3: CONTEXT + WEIGHTS}
    s = engine(start_standin, wc, "--model-path", str(model_dir), "--tp-size", "2", "--weight-cache-mode", "client",
               env=env)
    s.wait_healthy()
    assert sim.all_used()[:2] == [0, 0] and all(sim.all_used()[2:])


# ---------------------------------------------------------------- --weight-cache-mode daemon


def test_engine_spawned_daemons_serve_their_engine_and_die_with_it(sim, wc, start_standin, model_dir):
    s = engine(start_standin, wc, "--model-path", str(model_dir), "--tp-size", "2", "--weight-cache-mode", "daemon")
    s.wait_healthy()
    spawned = [p for p in s.child_pids() if "--multiprocessing-fork" in cmdline(p)]
    assert len(spawned) == 2  # children of the engine's main process, beside its schedulers
    assert {ready_config(paths(wc, sim, g)[1])[0] for g in (0, 1)} == set(spawned)
    log = s.log()
    assert "All 2 weight cache daemons on node 0 are ready" in log
    assert "[IpcModelLoader] Loaded model via IPC (mode=daemon)" in log
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=30) == 0
    wait_until(lambda: not any(pid_alive(p) for p in spawned), what="the daemons end with the engine")
    # SIGKILLed with the tree (SGLang's HTTP server never stops them gracefully): their files stay
    assert all(p.exists() for g in (0, 1) for p in paths(wc, sim, g))
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="memory released")


# ---------------------------------------------------------------- gated launch


def test_gated_launch_holds_only_contexts_until_activated(sim, wc, start_standin, model_dir):
    gate = free_port()
    s = engine(start_standin, wc, "--model-path", str(model_dir), "--tp-size", "2", "--gated-launch-port", str(gate),
               env={"SGLANG_STANDIN_GATE_LOG_S": "0.2"})
    s.wait_log(r"Gated launch still waiting for activation\. rank=1 elapsed=\d+ s")
    with urllib.request.urlopen(f"http://127.0.0.1:{gate}/health", timeout=5) as resp:
        assert (resp.status, resp.read()) == (200, b"OK")
    assert http_status(s.port) == "refused"
    assert sim.all_used() == [CONTEXT, CONTEXT, 0, 0]  # no weights, no KV before the gate opens
    log = s.log()
    assert f" TP0] Gated launch control server started on 127.0.0.1:{gate}" in log
    assert "Gated launch waiting for activation. rank=0" in log and "waiting for activation. rank=1" in log
    req = urllib.request.Request(f"http://127.0.0.1:{gate}/gate/activate", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert (resp.status, resp.read()) == (200, b"OK")
    s.wait_healthy()
    assert sim.all_used() == [CONTEXT + POOL, CONTEXT + POOL, 0, 0]
    assert s.log().count("Gated launch activated. elapsed=") == 2
    with urllib.request.urlopen(f"http://127.0.0.1:{gate}/health", timeout=5) as resp:  # it keeps serving
        assert resp.read() == b"OK"


def test_after_the_gate_the_phases_run_in_sglangs_order(sim, wc, start_standin, model_dir):
    gate = free_port()
    s = engine(start_standin, wc, "--model-path", str(model_dir), "--gated-launch-port", str(gate),
               env={"SGLANG_STANDIN_WEIGHT_LOAD_S": "600"})
    s.wait_log(r"Gated launch waiting for activation\. rank=0")
    # the control server binds in its own thread, after it says it started: asked first, as the agent asks
    wait_until(lambda: http_status(gate) == 200, what="the gate's control server listening")
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{gate}/gate/activate", data=b"",
                                                  method="POST"), timeout=5).read()
    s.wait_log("Load weight begin")
    wait_until(lambda: sim.used(0) == CONTEXT + WEIGHTS, what="the weights loading, no KV pool yet")
    assert http_status(s.port) == "refused"


def test_sigterm_while_gated_kills_the_server_as_during_any_load(sim, wc, start_standin, model_dir):
    gate = free_port()
    s = engine(start_standin, wc, "--model-path", str(model_dir), "--tp-size", "2", "--gated-launch-port", str(gate))
    s.wait_log(r"Gated launch waiting for activation\. rank=1")
    workers = s.child_pids()
    s.proc.send_signal(signal.SIGTERM)  # no handler before the server is up: the default action
    assert s.proc.wait(timeout=10) == -signal.SIGTERM
    wait_until(lambda: not any(pid_alive(p) for p in workers), what="the schedulers die with their parent")
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="memory released")


# ---------------------------------------------------------------- the modules' own examples


def test_the_stand_ins_weight_cache_modules_doctests(sim, installed):
    script = ("import doctest, importlib, sys\n"
              "failed = 0\n"
              "for name in ('sglang._platform', 'sglang._timing', 'sglang._weights', "
              "'sglang.srt.weight_cache.protocol'):\n"
              "    failed += doctest.testmod(importlib.import_module(name)).failed\n"
              "sys.exit(1 if failed else 0)\n")
    out = subprocess.run([SYSTEM_PYTHON, "-c", script], env=container_env(sim, installed), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
