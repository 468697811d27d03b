"""Lab faults: each one makes the stand-in / driver fail the way real servers do, and clears."""

from __future__ import annotations

import json
import os
import signal

import pytest
from gpusim_helpers import (GPU_COUNT, HOST, TOTAL_MIB, VMID, free_port, http_status, installed,  # noqa: F401
                            model_dir, pid_alive, sim, start_standin, wait_until)

from gpugate_lab import faults, gpusim


def apply(sim, name, clear=False):
    return faults.apply_fault(sim.lab_dir, HOST, VMID, name, clear=clear)


def test_parse_fault_validates_names():
    assert faults.parse_fault("slow-start=2.5") == ("slow-start", 2.5)
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
