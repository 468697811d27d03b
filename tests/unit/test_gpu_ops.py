"""gpu.idle: what it yields for a given GpuState, and how its wait and kill steps report."""

from __future__ import annotations

import json
from unittest.mock import MagicMock

import pytest
from pyinfra.api import Config, FunctionCommand, OperationError
from pyinfra.connectors.util import CommandOutput, OutputLine
from pyinfra.context import ctx_host, ctx_state

from gpugate.facts.gpu import GpuState
from gpugate.operations import gpu
from gpugate.remote import PROBE_MARKER


def gpu_doc(used=(0, 0), holders=(), source="nvml", memory_api="v2", errors=(), processes=None):
    return {"schema": 1, "source": source, "memory_api": memory_api, "errors": list(errors),
            "gpus": [{"index": i, "name": "NVIDIA H200", "total_mib": 143771, "used_mib": mib,
                      "reserved_mib": 615, "error": None,
                      "processes": (processes or {}).get(i, [])} for i, mib in enumerate(used)],
            "holders": list(holders), "read_at": 100.0}


SCHEDULER = {"pid": 31, "state": "S", "cmdline": "sglang::scheduler_TP0", "devices": ["/dev/nvidia0"]}


def fake_host(fact, outputs=()):
    """A host whose GpuState is ``fact`` and whose remote commands print ``outputs`` in turn."""
    host = MagicMock(name="host")
    host.name = "@pct/pve1:129"
    host.get_fact.side_effect = lambda cls, **kw: fact if cls is GpuState else pytest.fail(cls)
    answers = list(outputs)

    def run_shell_command(command, **kwargs):
        document = answers.pop(0)
        lines = [OutputLine("stdout", json.dumps(document))] if document is not None else []
        return True, CommandOutput(lines)

    host.run_shell_command.side_effect = run_shell_command
    return host


def run_idle(host, executing=False, **kwargs):
    state = MagicMock(is_executing=executing, check_for_changes=True, config=Config())
    with ctx_state.use(state), ctx_host.use(host):
        return list(gpu.idle._inner(**kwargs))


def test_no_change_when_idle():
    host = fake_host(gpu_doc())
    assert run_idle(host) == []
    host.noop.assert_called_once()
    assert "at or under 64 MiB" in host.noop.call_args[0][0]


def test_waits_when_memory_is_held():
    host = fake_host(gpu_doc(used=(0, 86000), holders=[SCHEDULER]))
    (command,) = run_idle(host, max_used_mib=64, timeout=30, poll_interval_s=0.1)
    assert isinstance(command, FunctionCommand)
    assert command.function.__name__ == "_wait_for_idle_command"
    assert command.args == (64, 30, 0.1, ())
    host.noop.assert_not_called()


def test_kill_ends_holders_before_waiting_and_says_so_at_prepare():
    host = fake_host(gpu_doc(used=(86000, 0), holders=[SCHEDULER]))
    commands = run_idle(host, kill=True, kill_grace_s=5)
    assert [c.function.__name__ for c in commands] == ["_end_gpu_holders_command",
                                                       "_wait_for_idle_command"]
    assert commands[0].args == (5, ())
    (plan,) = [c.args[0] for c in host.log.call_args_list]
    assert "end 1 GPU process(es) in the container (31 sglang::scheduler_TP0)" in plan
    assert "wait up to 120s" in plan


def test_kill_with_only_foreign_memory_kills_nothing():
    host = fake_host(gpu_doc(used=(40960, 0)))
    commands = run_idle(host, kill=True)
    assert [c.function.__name__ for c in commands] == ["_wait_for_idle_command"]


def test_plan_is_printed_once_when_prepare_already_printed_it():
    host = fake_host(gpu_doc(used=(1000, 0)))
    run_idle(host, executing=True)
    host.log.assert_not_called()


def test_fails_at_once_when_waiting_cannot_help():
    host = fake_host(gpu_doc(used=(None,), memory_api="v1"))
    with pytest.raises(OperationError, match="v1 API"):
        run_idle(host)


def wait_output(document, passed, polls=3):
    return {"gpu": document, "wait": {"passed": passed, "timed_out": not passed, "polls": polls,
                                      "started_at": 99.0, "passed_at": 100.0 if passed else None,
                                      "elapsed_s": 1.0}}


def test_wait_for_idle_runs_one_remote_loop_and_keeps_timing():
    host = fake_host(None, [wait_output(gpu_doc(), True, polls=7)])
    decision = gpu.wait_for_idle(host, max_used_mib=64, timeout=30, poll_interval_s=0.05)
    assert decision.passed
    assert decision.timing["polls"] == 7 and decision.timing["passed_at"] == 100.0
    assert decision.timing["returned_at"] >= decision.timing["began_at"]
    (call,) = host.run_shell_command.call_args_list
    assert PROBE_MARKER in call.args[0] and call.kwargs["_timeout"] == 30 + gpu.WAIT_TRANSPORT_MARGIN_S


@pytest.fixture
def chunk_clock(monkeypatch):
    """The controller's clock, advanced by one 3 s chunk per remote command (the fake host answers at once)."""
    clock = {"now": 0.0}
    monkeypatch.setattr(gpu.time, "monotonic", lambda: clock["now"])
    return clock


def chunked_host(fact, outputs, clock):
    host = fake_host(fact, outputs)
    answer = host.run_shell_command.side_effect

    def run_shell_command(command, **kwargs):
        clock["now"] += gpu.PROGRESS_EVERY_S
        return answer(command, **kwargs)

    host.run_shell_command.side_effect = run_shell_command
    return host


def test_wait_command_fails_the_operation_with_the_operator_message(chunk_clock):
    busy = gpu_doc(used=(0, 20000), holders=[{**SCHEDULER, "state": "D"}])
    host = chunked_host(None, [wait_output(busy, False)] * 10, chunk_clock)
    assert gpu._wait_for_idle_command(None, host, 64, 30, 0.05, ()) is False
    assert host.run_shell_command.call_count == 10  # 30 s in 3 s chunks
    message = host.log_styled.call_args[0][0]
    assert message.startswith("GPU gate did not pass on @pct/pve1:129 within 30 s")
    assert "pid 31 [D] sglang::scheduler_TP0" in message


def test_a_long_wait_prints_what_it_sees_after_each_chunk_then_passes(chunk_clock):
    draining = gpu_doc(used=(4096,) * 8, holders=[SCHEDULER])
    host = chunked_host(None, [wait_output(draining, False), wait_output(draining, False),
                               wait_output(gpu_doc(), True)], chunk_clock)
    assert gpu._wait_for_idle_command(None, host, 64, 120, 0.05, ()) is True
    lines = [call.args[0] for call in host.log.call_args_list]
    assert lines[:2] == ["gate: 3 s of 120 s: GPU MiB 4096 x8; 1 holder(s) left: 31 sglang::scheduler_TP0",
                         "gate: 6 s of 120 s: GPU MiB 4096 x8; 1 holder(s) left: 31 sglang::scheduler_TP0"]
    assert lines[2].startswith("GPUs idle after 9.00s") and len(lines) == 3
    for call in host.run_shell_command.call_args_list:  # each chunk's in-container wait is at most 3 s
        assert call.kwargs["_timeout"] == gpu.PROGRESS_EVERY_S + gpu.WAIT_TRANSPORT_MARGIN_S


def test_a_gate_that_passes_at_once_is_one_remote_command_and_no_progress_line(chunk_clock):
    host = chunked_host(None, [wait_output(gpu_doc(), True)], chunk_clock)
    assert gpu._wait_for_idle_command(None, host, 64, 120, 0.05, ()) is True
    assert host.run_shell_command.call_count == 1 and host.log.call_count == 1


def test_no_answer_from_the_container_fails_without_asking_again(chunk_clock):
    host = chunked_host(None, [None, None], chunk_clock)
    assert gpu._wait_for_idle_command(None, host, 64, 120, 0.05, ()) is False
    assert host.run_shell_command.call_count == 1


def test_wait_with_no_answer_is_a_failure_not_a_pass():
    host = fake_host(None, [None])
    decision = gpu.wait_for_idle(host, timeout=1)
    assert decision.passed is False and decision.undecidable
    assert "ValueError" in decision.reasons[0]


def test_end_holders_reports_survivors():
    report = {"targets": [31, 32], "terminated": [31], "killed": [], "errors": [],
              "survivors": [{"pid": 32, "state": "D", "cmdline": "stuck"}], "elapsed_s": 10.0}
    host = fake_host(None, [{"kill": report}])
    assert gpu._end_gpu_holders_command(None, host, 10, ()) is True  # the wait decides
    assert "still running: 32 [D] stuck" in host.log_styled.call_args[0][0]
    (call,) = host.run_shell_command.call_args_list
    assert PROBE_MARKER in call.args[0]


def test_kill_command_is_one_quoted_shell_command():
    command = gpu.kill_gpu_holders_command(grace_s=3, ignore_pids=[7])
    assert command.startswith("if command -v python3") and command.count("'") == 4


def test_a_wait_answer_without_a_gpu_reading_never_passes():
    from gpugate.operations.gpu import decision_from_wait

    lost = decision_from_wait({"ok": False, "error": "lock lost"})
    assert not lost.passed and lost.undecidable
    idle = {"source": "nvml", "memory_api": "v2", "errors": [], "holders": [],
            "gpus": [{"index": i, "used_mib": 0, "reserved_mib": 615, "processes": []} for i in range(2)]}
    passed = decision_from_wait({"gpu": idle, "wait": {"passed": True, "polls": 3}})
    assert passed.passed and passed.timing["used_mib"] == [0, 0] and passed.timing["polls"] == 3
