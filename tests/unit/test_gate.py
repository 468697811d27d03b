"""The gate's decision (gpugate/gate.py) as pure functions: table-driven over probe documents."""

from __future__ import annotations

import pytest

from gpugate.gate import GateDecision, evaluate, format_failure, poll_until_idle


def gpu(index=0, used=0, processes=(), **extra):
    return {"index": index, "uuid": f"GPU-{index}", "name": "NVIDIA H200", "total_mib": 143771,
            "used_mib": used, "reserved_mib": 615, "error": None,
            "processes": [dict(p) for p in processes], **extra}


def holder(pid, state="S", cmdline="sglang::scheduler_TP0", **extra):
    return {"pid": pid, "state": state, "cmdline": cmdline, "devices": ["/dev/nvidia0"], **extra}


def doc(gpus=None, holders=(), source="nvml", memory_api="v2", errors=()):
    return {"schema": 1, "source": source, "memory_api": memory_api, "errors": list(errors),
            "gpus": [gpu(0), gpu(1)] if gpus is None else gpus, "holders": list(holders)}


NVML_MISSING = {"source": "nvml", "kind": "ModuleNotFound", "message": "No module named 'pynvml'"}

CASES = {
    # name: (document, max_used_mib, ignore_pids, passed, undecidable, permanent)
    "idle": (doc(), 64, (), True, False, False),
    "idle with residue under the threshold": (doc([gpu(0, 8), gpu(1, 64)]), 64, (), True, False, False),
    "one GPU over the threshold": (doc([gpu(0, 0), gpu(1, 65)]), 64, (), False, False, False),
    "holder but no memory yet": (doc(holders=[holder(31)]), 64, (), False, False, False),
    "ignored holder": (doc(holders=[holder(31)]), 64, (31,), True, False, False),
    "nvidia-smi answered after pynvml was missing":
        (doc(source="nvidia-smi", errors=[NVML_MISSING]), 64, (), True, False, False),
    "the answering source has an error":
        (doc(errors=[{"source": "nvml", "kind": "Unknown", "message": "x"}]), 64, (), False, True, False),
    "no source": (doc([], source="none", memory_api=None,
                      errors=[NVML_MISSING, {"source": "nvidia-smi", "kind": "NotFound", "message": ""}]),
                  64, (), False, True, True),
    "no source, transient": (doc([], source="none", memory_api=None,
                                 errors=[{"source": "nvml", "kind": "Timeout", "message": ""}]),
                             64, (), False, True, False),
    "v1 memory only": (doc([gpu(0, None, used_v1_mib=615)], memory_api="v1"), 64, (), False, True, True),
    "used unknown on one GPU": (doc([gpu(0), gpu(1, None, error="GpuIsLost: GPU is lost")]),
                                64, (), False, True, False),
    "no GPU visible": (doc([]), 64, (), False, True, False),
    "no document at all": (None, 64, (), False, True, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_evaluate(name):
    document, max_used, ignore, passed, undecidable, permanent = CASES[name]
    decision = evaluate(document, max_used, ignore)
    assert (decision.passed, decision.undecidable, decision.permanent) == (passed, undecidable, permanent)
    assert bool(decision.reasons) is not passed


@pytest.mark.parametrize("gpu_doc,holders,foreign", [
    # nothing in the container: all used memory comes from outside
    (gpu(0, 20000), [], 20000),
    # the container's process accounts for all of it
    (gpu(0, 20000, [{"pid": 31, "used_mib": 20000}]), [holder(31)], 0),
    # part is the container's, the rest is someone else's
    (gpu(0, 30000, [{"pid": 31, "used_mib": 20000}]), [holder(31)], 10000),
    # holders but the driver gives no per-process figure: cannot tell
    (gpu(0, 30000, [{"pid": 31, "used_mib": None}]), [holder(31)], None),
    # holders, nothing listed (driver before 535.113 lists host pids only): cannot tell
    (gpu(0, 30000), [holder(31)], None),
    # a dead listed process still accounts for its (stuck) memory: not foreign, but stale
    (gpu(0, 5000, [{"pid": 77, "used_mib": 5000, "alive": False}]), [], 0),
])
def test_foreign_memory(gpu_doc, holders, foreign):
    decision = evaluate(doc([gpu_doc], holders=holders))
    assert decision.foreign_mib == {0: foreign}
    assert decision.passed is False


def test_failure_message_names_gpus_holders_and_states():
    document = doc([gpu(0, 86000, [{"pid": 31, "used_mib": 86000}]), gpu(1, 0)],
                   holders=[holder(31, "S", used_mib=86000), holder(44, "D", "python3 worker.py")])
    text = format_failure(evaluate(document), host_name="@pct/pve1:129", timeout_s=120)
    assert text.startswith("GPU gate did not pass on @pct/pve1:129 within 120 s")
    assert "GPU 0 (NVIDIA H200): 86000 MiB used of 143771 (max 64)" in text
    assert "GPU 1 (NVIDIA H200): 0 MiB used" in text
    assert "pid 31 [S] sglang::scheduler_TP0 (86000 MiB)" in text
    assert "pid 44 [D] python3 worker.py -- uninterruptible sleep (D)" in text
    assert "reboot" in text
    assert "OUTSIDE" not in text


@pytest.mark.parametrize("used,reason", [
    ((4096, 4096, 0), "GPU 0, 1 over 64 MiB (4096 MiB used on each)"),
    ((0, 100, 65), "GPU 1, 2 over 64 MiB (100, 65 MiB used)"),
    ((0, 0, 70), "GPU 2 over 64 MiB (70 MiB used)"),
])
def test_one_reason_names_every_gpu_over_the_threshold(used, reason):
    decision = evaluate(doc([gpu(i, mib) for i, mib in enumerate(used)]))
    assert decision.reasons == [reason]


def test_failure_message_for_foreign_memory_points_at_the_host_fact_and_never_at_kill():
    text = format_failure(evaluate(doc([gpu(0, 0), gpu(1, 40960)])))
    assert "memory held from OUTSIDE the container (GPU 1: 40960 MiB)" in text
    assert "pyinfra <pve-host> fact gpugate.facts.gpu.HostGpuProcesses" in text
    assert "runbooks/who_holds_gpus.py" in text
    assert "kill=True" not in text


def test_failure_message_for_stuck_memory_of_a_dead_process():
    document = doc([gpu(0, 5000, [{"pid": 77, "used_mib": 5000, "alive": False}])])
    text = format_failure(evaluate(document))
    assert "processes that no longer exist (GPU 0: pid 77 (5000 MiB))" in text
    assert "(no such process)" in text


def test_failure_message_when_the_gpus_cannot_be_read():
    document = doc([], source="none", memory_api=None, errors=[
        {"source": "nvml", "kind": "DriverNotLoaded", "message": "Driver Not Loaded"}])
    text = format_failure(evaluate(document), host_name="ct")
    assert "cannot read the GPUs: nvml DriverNotLoaded: Driver Not Loaded" in text


def test_failure_message_for_v1_memory_says_why():
    text = format_failure(evaluate(doc([gpu(0, None, used_v1_mib=615)], memory_api="v1")))
    assert "v1 API" in text and "v1 reads 615 MiB" in text


def test_decision_serialises_for_the_audit_log():
    import json

    decision = evaluate(doc([gpu(0, 100)]))
    data = json.loads(json.dumps(decision.to_dict()))
    assert data["passed"] is False and data["foreign_mib"] == {"0": 100}


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.sleeps = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def reads(*documents):
    """A read function returning the documents in turn (the last one repeats)."""
    queue = list(documents)

    def read():
        return queue.pop(0) if len(queue) > 1 else queue[0]

    return read


def test_wait_passes_on_the_first_idle_reading():
    clock = FakeClock()
    busy = doc([gpu(0, 20000)], holders=[holder(31)])
    idle = {**doc(), "read_at": 1234.5}
    result = poll_until_idle(reads(busy, busy, idle), 64, 120, 0.05, clock=clock,
                             wall=lambda: 1000.0, sleep=clock.sleep)
    assert result["wait"]["passed"] is True and result["wait"]["polls"] == 3
    assert result["wait"]["passed_at"] == 1234.5
    assert clock.sleeps == [0.05, 0.05]
    assert result["gpu"] is idle


def test_wait_times_out_with_the_last_reading():
    clock = FakeClock()
    busy = doc([gpu(0, 20000)])
    result = poll_until_idle(reads(busy), 64, 1.0, 0.3, clock=clock, wall=lambda: 0.0,
                             sleep=clock.sleep)
    assert result["wait"]["passed"] is False and result["wait"]["timed_out"] is True
    assert result["wait"]["passed_at"] is None
    assert sum(clock.sleeps) == pytest.approx(1.0)  # never sleeps past the deadline
    assert result["gpu"] is busy


def test_wait_stops_at_once_when_waiting_cannot_help():
    clock = FakeClock()
    v1 = doc([gpu(0, None, used_v1_mib=615)], memory_api="v1")
    result = poll_until_idle(reads(v1), 64, 120, 0.05, clock=clock, sleep=clock.sleep)
    assert result["wait"]["polls"] == 1 and result["wait"]["timed_out"] is False


def test_d_state_pids():
    decision = evaluate(doc(holders=[holder(1, "S"), holder(2, "D")]))
    assert isinstance(decision, GateDecision) and decision.d_state_pids == [2]
