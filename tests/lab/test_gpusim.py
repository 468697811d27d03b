"""The simulated GPU driver: memory accounting (v1/v2, reserved), release after death, PID namespaces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from gpusim_helpers import GPU_COUNT, RESERVED_MIB, TOTAL_MIB, hold, pid_alive, sim, wait_until  # noqa: F401

from gpugate_lab import gpusim


def test_setup_host_writes_driver_layout_with_stable_uuids(tmp_path):
    gpu_dir = tmp_path / "gpu"
    gpusim.setup_host(gpu_dir, count=8, total_mib=97887)
    config = json.loads((gpu_dir / "config.json").read_text())
    assert config["count"] == 8 and config["total_mib"] == 97887 and config["reserved_mib"] == 615
    assert len(set(config["uuids"])) == 8 and all(u.startswith("GPU-") for u in config["uuids"])
    nodes = sorted(p.name for p in (gpu_dir / "dev").iterdir())
    assert nodes == sorted([f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm"])
    assert (gpu_dir / "alloc").is_dir()

    gpusim.setup_host(gpu_dir, count=8, total_mib=97887)
    assert json.loads((gpu_dir / "config.json").read_text())["uuids"] == config["uuids"]


def test_idle_gpu_v2_used_is_zero_and_v1_counts_reserved(sim):
    mem = gpusim.memory_info(0, sim.gpu_dir)
    assert (mem.used_mib, mem.reserved_mib, mem.total_mib) == (0, RESERVED_MIB, TOTAL_MIB)
    assert mem.v1_used_mib == RESERVED_MIB
    assert mem.free_mib == TOTAL_MIB - RESERVED_MIB


def test_allocation_counts_on_its_gpu_only(sim):
    holding = gpusim.allocate(1, 3000, sim.gpu_dir)
    assert sim.all_used() == [0, 3000, 0, 0]
    m = gpusim.memory_info(1, sim.gpu_dir)
    assert m.v1_used_mib == 3000 + RESERVED_MIB and m.free_mib == TOTAL_MIB - RESERVED_MIB - 3000
    holding.free()
    assert sim.all_used() == [0, 0, 0, 0]


def test_require_free_refuses_what_does_not_fit(sim):
    gpusim.allocate(0, 6000, sim.gpu_dir)
    with pytest.raises(gpusim.NotEnoughMemory):
        gpusim.allocate(0, 4000, sim.gpu_dir, require_free=True)
    assert sim.used(0) == 6000


def test_sigkilled_holder_memory_is_released_by_the_driver(sim):
    proc = hold(sim, gpu="all", mib=2500)
    assert sim.all_used() == [2500] * GPU_COUNT
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    wait_until(lambda: sim.all_used() == [0] * GPU_COUNT, what="memory released")
    released = [json.loads(line) for line in (sim.gpu_dir / "released.jsonl").read_text().splitlines()]
    assert sorted(r["gpu"] for r in released) == list(range(GPU_COUNT))
    assert all(r["mib"] == 2500 and r["freed_at"] > 0 for r in released)


def test_release_waits_for_the_delay_after_the_holder_is_gone(sim):
    holding = gpusim.allocate(2, 700, sim.gpu_dir)
    sim.driver.terminate()  # drive release_step by hand, with our own clock
    sim.driver.wait()
    pending: dict = {}
    assert gpusim.release_step(sim.gpu_dir, pending, now=100.0, delay_s=0.15) == []  # held
    holding.close()  # the holder exits: the lock is gone, the file stays
    assert gpusim.release_step(sim.gpu_dir, pending, now=101.0, delay_s=0.15) == []
    assert sim.used(2) == 700
    freed = gpusim.release_step(sim.gpu_dir, pending, now=101.2, delay_s=0.15)
    assert [(r["gpu"], r["mib"]) for r in freed] == [(2, 700)]
    assert sim.used(2) == 0


def test_stuck_allocation_is_never_freed_until_unstuck(sim):
    holding = gpusim.allocate(0, 900, sim.gpu_dir)
    sim.driver.terminate()
    sim.driver.wait()
    assert gpusim.set_stuck(sim.gpu_dir, True, tag=None, pidns=[gpusim.own_pidns()]) == [holding.id]
    holding.close()
    pending: dict = {}
    gpusim.release_step(sim.gpu_dir, pending, now=0.0, delay_s=0.1)
    assert gpusim.release_step(sim.gpu_dir, pending, now=1000.0, delay_s=0.1) == []
    assert sim.used(0) == 900
    gpusim.set_stuck(sim.gpu_dir, False, pidns=[gpusim.own_pidns()])
    assert len(gpusim.release_step(sim.gpu_dir, pending, now=1001.0, delay_s=0.1)) == 1
    assert sim.used(0) == 0


def test_mark_stuck_keeps_the_holders_lock(sim):
    proc = hold(sim, gpu="0", mib=400)
    gpusim.set_stuck(sim.gpu_dir, True, pidns=[gpusim.own_pidns()])
    gpusim.set_stuck(sim.gpu_dir, False, pidns=[gpusim.own_pidns()])
    (alloc,) = gpusim.list_allocations(sim.gpu_dir)
    assert alloc["stuck"] is False
    assert gpusim._holder_alive(sim.gpu_dir / "alloc" / f"{alloc['id']}.json") is True
    proc.kill()
    proc.wait()


def test_holder_keeps_every_device_node_open_like_cuda(sim):
    proc = hold(sim, gpu="1", mib=100)
    fds = {os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")}
    dev = sim.gpu_dir / "dev"
    expected = {str(dev / n) for n in ["nvidiactl", "nvidia-uvm"] + [f"nvidia{i}" for i in range(GPU_COUNT)]}
    assert expected <= fds
    proc.kill()
    proc.wait()


def test_forked_child_keeps_memory_after_its_parent_is_killed(sim):
    """A worker that inherited the allocation (an orphan) keeps the memory, as a real device fd does."""
    code = textwrap.dedent("""
        import os, sys, time
        from gpugate_lab import gpusim
        gpusim.allocate(3, 1234, sys.argv[1])
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        print(child, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code, str(sim.gpu_dir)], stdout=subprocess.PIPE)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    assert pid_alive(child)
    # the driver polls every 20 ms and waits 50 ms: the orphan's lock must keep the memory through that
    pending: dict = {}
    assert gpusim.release_step(sim.gpu_dir, pending, now=0.0, delay_s=0.0) == []
    assert sim.used(3) == 1234
    os.kill(child, signal.SIGKILL)
    wait_until(lambda: sim.used(3) == 0, what="orphan's memory released")


INNER = textwrap.dedent("""
    import json, sys
    from gpugate_lab import gpusim
    gpusim.allocate(0, 500, sys.argv[1])
    print(json.dumps({"procs": gpusim.list_processes(0, gpu_dir=sys.argv[1]),
                      "used": gpusim.memory_info(0, sys.argv[1]).used_mib, "pid": __import__("os").getpid()}),
          flush=True)
    sys.stdin.readline()
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for unshare --pid")
def test_process_lists_follow_pid_namespaces(sim):
    outside = hold(sim, gpu="0", mib=1000)
    inner = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", INNER,
                              str(sim.gpu_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        seen_inside = json.loads(inner.stdout.readline())
        # inside: only its own process (PID 1 of the new namespace), but device-wide memory
        assert [p["pid"] for p in seen_inside["procs"]] == [seen_inside["pid"]] == [1]
        assert seen_inside["used"] == 1500
        # outside (an ancestor namespace): both, the inner one under the PID this /proc gives it
        seen_outside = {p["pid"]: p["used_mib"] for p in gpusim.list_processes(0, gpu_dir=sim.gpu_dir)}
        inner_host_pid = [pid for pid in seen_outside if pid != outside.pid]
        assert seen_outside[outside.pid] == 1000 and len(inner_host_pid) == 1
        status = open(f"/proc/{inner_host_pid[0]}/status").read()
        assert "\nNSpid:\t%d\t1\n" % inner_host_pid[0] in status
        assert seen_outside[inner_host_pid[0]] == 500
    finally:
        inner.stdin.close()
        inner.wait(timeout=10)
        outside.kill()
        outside.wait()
    wait_until(lambda: sim.used(0) == 0, what="both released")
