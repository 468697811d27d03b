"""sglang.server's controller side without a host: the plan from recorded observe documents (the
agent's answers, docs/agent-protocol.md, shaped as a lab container printed them), the checks before
the stop, the rollback runbook's choice, the lines printed while following a journal, the outcome,
and how a stopped container is recognised."""

from __future__ import annotations

import copy

import pytest

from gpugate import agentcmd
from gpugate.operations.sglang import _pct_trouble
from gpugate.plan import Narrator, outcome_lines, plan_lines, rollback_choice
from tests.unit.plans import plan_of
from gpugate.spec import build_spec, resolve_supervisor

MODEL = "/opt/models/lab-model"
PORT = 30000


def spec(flags=None, env=None, **kwargs):
    return build_spec(MODEL, kwargs.pop("port", PORT), {"tp": 8} if flags is None else flags,
                      {"HF_TOKEN": "hf_x"} if env is None else env, **kwargs)


def record(desired, at="2026-11-30T22:25:54Z", by="alice@laptop"):
    """A good-history record as the agent keeps it (redacted)."""
    return dict(desired.record(by=by), argv_hash=agentcmd.argv_hash(list(desired.argv)), at=at,
                env_hashes={name: agentcmd.env_hash(value) for name, value in desired.env.items()},
                key="k" + agentcmd.argv_hash(list(desired.argv))[:8])


def observation(running=None, *, serving=True, good=(), transition=None, gpu_holders=(), port_holders=(),
                strays=(), free_mib=50_000, pid1="init", model_exists=True, foreign_mib=0, workers_dead=0):
    """An observe document; ``running``: the Spec that runs (None: nothing)."""
    server = {"port": PORT, "running": running is not None, "main": None, "tree": [], "strays": list(strays),
              "clients": [], "listening": running is not None, "listener_pids": [], "env_hashes": {},
              "health": {"health": 200 if serving else 503}, "server_info": None, "serving": False,
              "workers": None, "model_path_exists": model_exists, "transition": transition,
              "history": {"good": list(good), "failed": [], "last": None}, "sglang_version": "0.5.5"}
    if running is not None:
        server["main"] = {"pid": 218, "argv": list(running.argv), "argv_hash": agentcmd.argv_hash(list(running.argv)),
                          "supervisor": resolve_supervisor(running.supervisor, {"pid1": pid1})}  # as the agent reports it
        server["env_hashes"] = {name: agentcmd.env_hash(value) for name, value in running.env.items()}
        server["workers"] = {"expected": 8, "alive": 8 - workers_dead, "dead": workers_dead, "zombies": []}
        server["serving"] = serving and not workers_dead
        server["server_info"] = {"args": {"max_total_num_tokens": 159744}}
    used = 86658 if running is not None else 0
    gpus = [{"index": i, "used_mib": used + foreign_mib,
             "processes": [{"pid": 221 + i, "used_mib": used}] if used else []} for i in range(8)]
    return {"sglang": server, "gpu": {"source": "nvml", "gpus": gpus, "holders": []},
            "container": {"free_mib": {"/var/log/gpugate": free_mib, "/var/lib/gpugate": free_mib}, "pid1": pid1,
                          "port_holders": list(port_holders), "gpu_holders": list(gpu_holders)}}


# ---------------------------------------------------------------- the plan
def test_the_desired_spec_serving_is_no_change():
    desired = spec()
    plan = plan_of(observation(desired), desired, port=PORT)
    assert plan.action == "noop" and not plan.touches


def test_a_flag_change_restarts_and_shows_the_diff_without_secrets():
    running = spec(flags={"tp": 8, "api-key": "sk-old-1234"})
    desired = spec(flags={"tp": 8, "kv-cache-dtype": "fp8_e4m3", "api-key": "sk-new-5678"})
    plan = plan_of(observation(running, good=[record(running)]), desired, port=PORT)
    assert plan.action == "restart" and plan.rollback_to == "auto"
    assert "+ --kv-cache-dtype fp8_e4m3" in plan.lines
    text = "\n".join(plan_lines(plan, PORT))
    assert "sk-old" not in text and "sk-new" not in text
    assert "steps: hand off" in text and "roll back" in text


def test_only_the_host_differs_the_server_restarts_onto_it():
    plan = plan_of(observation(spec()), spec(host="0.0.0.0"), port=PORT)
    assert plan.action == "restart" and plan.lines == ("- --host 127.0.0.1", "+ --host 0.0.0.0")


def test_an_env_value_change_restarts_and_never_shows_the_value():
    plan = plan_of(observation(spec()), spec(env={"HF_TOKEN": "hf_new"}), port=PORT)
    assert plan.action == "restart" and plan.lines == ("~ env HF_TOKEN=*** (value changed)",)
    assert "environment differs" in plan.reasons[0]


def test_dead_workers_are_not_serving_even_with_health_200():
    desired = spec()
    plan = plan_of(observation(desired, workers_dead=2), desired, port=PORT)
    assert plan.action == "restart" and "does not serve" in plan.reasons[0]


def test_restart_of_the_same_spec_is_asked_for_explicitly():
    desired = spec()
    plan = plan_of(observation(desired), desired, port=PORT, restart=True)
    assert plan.action == "restart" and plan.restart and "same spec" in plan.reasons[0]


def test_a_running_transition_is_attached_to_not_started_again():
    running = {"run": "20261130T222547-129-a14e2f", "active": True, "step": "load", "by": "bob@desk"}
    plan = plan_of(observation(spec(), transition=running), spec(flags={"tp": 8, "kv-cache-dtype": "fp8_e4m3"}),
                     port=PORT)
    assert plan.action == "attach" and plan.attach_run == running["run"] and "bob@desk" in plan.reasons[0]


def test_an_attached_run_of_another_spec_is_told_from_this_runs_spec():
    """The journal's run event carries the agent's make_record of the desired SpecDoc: a second
    operator's spec differing only in one flag (or only an env value) is another spec; a stop
    attaching to a start is too; a stop attached to a stop is the same."""
    from gpugate.plan import same_desired
    from gpugate.agent import history

    a = spec(flags={"tp": 8, "kv-cache-dtype": "fp8_e4m3"})
    b = spec(flags={"tp": 8, "mem-fraction-static": 0.8})
    record_a = history.make_record(a.doc(by="alice"), by="alice")
    assert same_desired(record_a, a, PORT)
    assert not same_desired(record_a, b, PORT)
    assert not same_desired(history.make_record(spec(env={"HF_TOKEN": "hf_other"}).doc()), spec(), PORT)
    assert not same_desired(record_a, None, PORT) and not same_desired(None, a, PORT)
    assert same_desired(None, None, PORT)


def test_only_the_interpreter_changes_shows_an_interpreter_pair():
    running, desired = spec(python="/usr/bin/python3"), spec(python="/opt/venv/bin/python3")
    lines = plan_lines(plan_of(observation(running), desired, port=PORT), PORT)
    assert "    - interpreter /usr/bin/python3" in lines and "    + interpreter /opt/venv/bin/python3" in lines
    assert not [line for line in lines if line.strip() in ("- python3", "- /usr/bin/python3")]
    plan = plan_of(observation(desired, good=[record(desired), record(running)]), None, port=PORT, rollback_k=1)
    assert "+ interpreter /usr/bin/python3" in plan.lines, plan.lines


def test_the_last_run_is_reported_when_it_ended_unwatched():
    ended = {"run": "r1", "active": False, "outcome": "verified", "by": "bob@desk", "message": "the desired server serves"}
    plan = plan_of(observation(spec(), transition=ended), spec(), port=PORT)
    assert plan.action == "noop" and plan.last.startswith("the last transition (run r1 by bob@desk) ended: verified")


def test_absent_stops_a_running_server_and_nothing_when_none_runs():
    assert plan_of(observation(spec()), None, port=PORT).action == "stop"
    assert plan_of(observation(None), None, port=PORT).action == "noop"


# ---------------------------------------------------------------- checks before the stop
@pytest.mark.parametrize("kwargs, expected", [
    ({"gpu_holders": [{"pid": 700, "cmdline": "python3 train.py", "gpus": [3], "used_mib": 4096, "memory": True,
                       "server_part": False}]}, "pid 700 (python3 train.py) holds 4096 MiB on GPU 3"),
    ({"foreign_mib": 2048}, "held from outside the container"),
    ({"pid1": "init", "_supervisor": "systemd"}, "PID 1 of the container is init"),
    ({"free_mib": 10}, "10 MiB free"),
    ({"port_holders": [{"pid": 99, "cmdline": "python3 -m http.server 30000", "server": False}]},
     "port 30000 is taken by pid 99"),
    ({"model_exists": False}, "does not exist in the container"),
])
def test_checks_refuse_before_anything_stops(kwargs, expected):
    supervisor = kwargs.pop("_supervisor", "process")
    plan = plan_of(observation(spec(), **kwargs), spec(flags={"tp": 8, "kv-cache-dtype": "fp8_e4m3"},
                                                         supervisor=supervisor), port=PORT)
    assert any(expected in problem for problem in plan.problems), plan.problems
    text = "\n".join(plan_lines(plan, PORT))
    assert "REFUSED, nothing touched" in text and "steps:" not in text


def test_other_gpu_holders_offer_the_switch_and_monitors_are_only_noted():
    holders = [{"pid": 700, "cmdline": "python3 train.py", "gpus": [0], "used_mib": 512, "memory": True,
                "server_part": False},
               {"pid": 701, "cmdline": "python3 -m gpustat -i 1", "gpus": [], "used_mib": 0, "memory": False,
                "server_part": False},
               {"pid": 702, "cmdline": "sglang::scheduler_TP0", "gpus": [1], "used_mib": 9000, "memory": True,
                "server_part": True}]
    plan = plan_of(observation(spec(), gpu_holders=holders), spec(flags={"tp": 8, "kv-cache-dtype": "fp8_e4m3"}),
                     port=PORT)
    assert len(plan.problems) == 1 and "end_other_gpu_holders=true" in plan.problems[0]
    assert any("monitor" in note and "701" in note for note in plan.notes)
    allowed = plan_of(observation(spec(), gpu_holders=holders), spec(flags={"tp": 8, "kv-cache-dtype": "fp8_e4m3"}),
                        port=PORT, end_other_gpu_holders=True)
    assert not allowed.problems and any("the agent ends it" in note for note in allowed.notes)


def test_a_holder_on_other_gpus_is_no_obstacle():
    holders = [{"pid": 700, "cmdline": "python3 train.py", "gpus": [6, 7], "used_mib": 512, "memory": True,
                "server_part": False}]
    plan = plan_of(observation(None, gpu_holders=holders), spec(flags={"tp": 4}), port=PORT)
    assert plan.action == "start" and not plan.problems and plan.gpus == (0, 1, 2, 3)


def test_a_pinned_version_that_differs_is_refused():
    plan = plan_of(observation(spec()), spec(flags={"tp": 8, "kv-cache-dtype": "fp8_e4m3"}, sglang_version="0.5.9"),
                     port=PORT)
    assert any("0.5.5" in problem and "0.5.9" in problem for problem in plan.problems)


# ---------------------------------------------------------------- port change
def test_a_port_change_replaces_the_server_on_the_same_gpus():
    old = spec()
    stray = {"pid": 218, "cmdline": " ".join(old.argv), "port": 30000}
    desired = spec(port=30001)
    doc = observation(None, strays=[stray])
    doc["sglang"]["port"] = 30001
    plan = plan_of(doc, desired, port=30001)
    assert plan.action == "start" and plan.replaces["port"] == 30000 and plan.replaces["gpus"] == list(range(8))
    assert "port change: :30000 -> :30001" in plan.reasons and plan.rollback_to == "auto"
    assert any("stop :30000 first" in step for step in plan.steps)
    # a server on other GPUs is left alone (two servers on disjoint halves)
    other = dict(stray, cmdline=" ".join(spec(flags={"tp": 4, "base-gpu-id": 4}).argv))
    doc = observation(None, strays=[other])
    assert plan_of(doc, spec(flags={"tp": 4}, port=30001), port=30001).replaces is None


# ---------------------------------------------------------------- the rollback runbook's choice
def test_rollback_goes_to_the_newest_good_spec_unlike_the_running_one():
    a, b = spec(), spec(host="0.0.0.0")
    good = [record(b, at="2"), record(a, at="1")]
    chosen, why = rollback_choice(observation(b, good=good)["sglang"])
    assert chosen["argv_hash"] == agentcmd.argv_hash(list(a.argv)) and "#1" in why
    assert rollback_choice(observation(b, good=good)["sglang"], 2)[0] is None
    plan = plan_of(observation(b, good=good), None, port=PORT, rollback_k=1)
    assert plan.action == "restart" and plan.target["key"] == good[1]["key"]
    assert plan.rollback_to == {"running": True} and "- --host 0.0.0.0" in plan.lines


def test_rollback_with_nothing_to_go_to_is_refused():
    only = spec()
    plan = plan_of(observation(only, good=[record(only)]), None, port=PORT, rollback_k=1)
    assert plan.problems and "nothing to roll back to" in plan.problems[0]


def test_the_rollback_runbook_says_which_spec_it_restored_and_how_the_desired_state_differs():
    """Issue 20: A verified, then B (+ fp8, fleet.yaml's), then the rollback runbook: it names the
    spec it restores by its history label, key, time and operator, and says what the desired state
    (fleet.yaml: B) changes from it, in the one diff format; its verify is the restored spec's."""
    from gpugate.operations.sglang import Job, _narrator, _restored_lines

    a, b = spec(), spec({"tp": 8, "kv-cache-dtype": "fp8_e4m3"})
    good = [record(b, at="2026-11-30T22:25:54Z"), record(a, at="2026-11-29T10:00:00Z", by="bo@ops")]
    seen = observation(b, good=good)
    plan = plan_of(seen, None, port=PORT, rollback_k=1)
    job = Job(plan, None, PORT, "python3", {}, seen, None, False, 0, True, [], {}, restoring=True, desired_spec=b)
    key = good[1]["key"]
    assert _restored_lines(job, "verified", None) == [
        f"restored good 1 (oldest kept) of :30000's history (key {key}, verified 2026-11-29 10:00Z by bo@ops), "
        f"which its commit makes good 0 (newest); the desired state differs from it: + --kv-cache-dtype fp8_e4m3 "
        f"(the next deploy.py applies it)"]
    assert _restored_lines(job, "rolled_back", None) == []  # the restore failed: what runs is what ran
    verify = {"t": 1, "step": "verify", "phase": "end", "target": "desired", "ok": True}
    assert _narrator(job).lines(verify) == ["verified: the running argv and /get_server_info match the restored spec"]
    # the desired state IS the restored spec: said so (the status then reads serving as desired)
    same = Job(plan, None, PORT, "python3", {}, seen, None, False, 0, True, [], {}, restoring=True, desired_spec=a)
    assert _restored_lines(same, "verified", None)[0].endswith("; it is the desired state")
    # no server desired here: said so too
    none = Job(plan, None, PORT, "python3", {}, seen, None, False, 0, True, [], {}, restoring=True)
    assert "the desired state has no server here (sglang_present: false)" in _restored_lines(none, "verified", None)[0]

    # a deploy of C that failed and rolled back: what serves again, and what C would have changed
    c = spec({"tp": 8, "kv-cache-dtype": "fp8_e4m3", "disable-radix-cache": True})
    deploy = Job(plan_of(seen, c, port=PORT), c, PORT, "python3", {}, seen, None, False, 0, False, [], {})
    to = dict(record(b), at="2026-12-01T00:00:00Z")  # the agent's rollback event: a fresh record of the target
    assert _restored_lines(deploy, "rolled_back", to) == [
        f"serving again: good 0 (newest) of :30000's history (key {good[0]['key']}, verified 2026-11-30 22:25Z by "
        f"alice@laptop); the desired state differs from it: + --disable-radix-cache (the next deploy.py applies it)"]
    assert _narrator(deploy).lines(verify) == ["verified: the running argv and /get_server_info match the desired flags"]


# ---------------------------------------------------------------- following the journal
JOURNAL = [
    {"t": 100.0, "step": "run", "phase": "begin"},
    {"t": 100.1, "step": "stop", "phase": "begin", "target": "desired", "port": 30000, "main": 218, "tree": 10},
    {"t": 100.1, "step": "drain", "phase": "progress", "target": "desired", "elapsed_s": 0.02, "alive": 10},
    {"t": 100.2, "step": "drain", "phase": "end", "target": "desired", "drained": True, "elapsed_s": 0.13},
    {"t": 100.3, "step": "gate", "phase": "end", "target": "desired", "passed": True, "elapsed_s": 0.19,
     "used_mib": {str(i): 0 for i in range(8)}},
    {"t": 100.4, "step": "start", "phase": "end", "target": "desired", "pid": 300},
    {"t": 104.5, "step": "load", "phase": "progress", "target": "desired", "state": "loading", "elapsed_s": 4.1},
    {"t": 104.6, "step": "load", "phase": "progress", "target": "desired", "state": "loading", "elapsed_s": 4.2},
    {"t": 105.5, "step": "load", "phase": "end", "target": "desired", "state": "ready", "elapsed_s": 5.1},
    {"t": 105.6, "step": "verify", "phase": "end", "target": "desired", "ok": True,
     "capacity": {"max_total_num_tokens": 319488}},
    {"t": 105.7, "step": "outcome", "phase": "end", "outcome": "verified"},
]


def test_the_journal_reads_as_the_progress_lines():
    narrator = Narrator()
    lines = [line for event in JOURNAL for line in narrator.lines(event)]
    assert lines == ["stopping :30000 pid 218 (10 processes): SIGTERM, SGLang's drain",
                     "drained and exited in 0.13 s", "gate passed in 0.19 s: GPU MiB 0 x8, no holder",
                     "started pid 300", "loading (port closed), 4 s since the start",
                     "healthy and generating after 5.10 s",
                     "verified: the running argv and /get_server_info match the desired flags"]
    ok, done = outcome_lines("verified", None, None, PORT, narrator)
    assert ok and done == ["done in 5.7 s (drain 0.13 s, gate 0.19 s, load 5.10 s)"]
    assert narrator.capacity == {"max_total_num_tokens": 319488}


def test_an_interrupt_says_what_the_container_does():
    narrator = Narrator()
    for event in JOURNAL[:6]:
        narrator.lines(event)
    assert narrator.doing(112.4) == "loading, 12 s"


def test_nothing_serves_is_loud_with_both_reasons_and_the_log_tails():
    narrator = Narrator()
    narrator.lines({"t": 1, "step": "load", "phase": "end", "target": "desired", "state": "crashed", "exit_code": 1,
                    "elapsed_s": 0.4, "log_tail": ["OSError: no config.json"]})
    ok, lines = outcome_lines("nothing_serves", {"desired": "crashed at start", "rollback": "gate did not pass"},
                              "NOTHING SERVES", PORT, narrator)
    text = "\n".join(lines)
    assert not ok and "NOTHING SERVES on :30000" in text
    assert "crashed at start" in text and "gate did not pass" in text and "| OSError: no config.json" in text
    assert outcome_lines("rolled_back", {"desired": "x"}, "the previous server serves again", PORT)[0] is False
    assert outcome_lines("interrupted", None, None, PORT)[0] is False


def test_a_stopped_or_vanished_container_is_told_from_pct_errors():
    from gpugate.connectors.pct import classify_pct_error

    def trouble(line):  # the line the operator reads; code reads its kind
        found = _pct_trouble(classify_pct_error([line], 129), "pve1", 129)
        return found.text if found else None

    assert trouble("container '129' not running!") == "container 129 on pve1 is stopped"
    assert "does not exist" in trouble("Configuration file 'nodes/pve1/lxc/129.conf' does not exist")
    assert trouble("grep: x: No such file") is None


def test_following_ends_on_the_kind_of_failure_never_on_its_words():
    """A container stopped or gone ends the follow because pct said so (its kind); an error of the
    command itself that happens to say "does not exist" is one more miss, not a stopped container."""
    from gpugate.connectors.pct import classify_pct_error
    from gpugate.operations.sglang import Trouble

    gone = _pct_trouble(classify_pct_error(["Configuration file 'nodes/pve1/lxc/129.conf' does not exist"], 129),
                        "pve1", 129)
    assert gone.kind == "unknown-vmid" and gone.container_gone and str(gone) == gone.text
    assert not _pct_trouble(classify_pct_error(["sudo: a password is required"], 129), "pve1", 129).container_gone
    assert not Trouble("the command failed in the container: /var/lib/gpugate/runs/r1 does not exist").container_gone


def test_one_run_object_per_pyinfra_run_found_among_its_callback_handlers():
    from pyinfra.api import Config, Inventory, State

    from gpugate.operations.sglang import Run, server

    state = State(Inventory((["@local"], {})), Config())
    run = Run.of(state)
    assert Run.of(state) is run and run in state.callback_handlers
    assert Run.of(State(Inventory((["@local"], {})), Config())) is not run
    assert not [key for key in vars(state) if key.startswith("_gpugate")]
    assert callable(server._inner)  # still a pyinfra operation underneath (``_inner`` reuses its body)


def test_importing_the_operation_installs_no_signal_handler():
    """Ctrl-C becomes the run's when the run's first sglang.server call makes its Run, not at import."""
    import subprocess
    import sys

    child = ("import signal, pyinfra; pyinfra.is_cli = True; before = signal.getsignal(signal.SIGINT); "
             "import gpugate.operations.sglang; assert signal.getsignal(signal.SIGINT) is before")
    subprocess.run([sys.executable, "-c", child], check=True, timeout=60)


def test_recorded_documents_are_not_mutated():
    doc = observation(spec())
    before = copy.deepcopy(doc)
    plan_of(doc, spec(flags={"tp": 8, "kv-cache-dtype": "fp8_e4m3"}), port=PORT)
    assert doc == before


def test_a_first_start_says_nothing_of_a_stop_or_an_old_server():
    """Issue 32 item 11: --dry of a first start listed "while the old one serves" and "stop (SIGTERM
    drain ...)" although nothing runs."""
    first = plan_of(observation(None), spec(), port=PORT)
    steps = " -> ".join(first.steps)
    assert first.action == "start" and "while the old one serves" not in steps and "SIGTERM drain" not in steps
    again = plan_of(observation(spec()), spec(flags={"tp": 8, "kv-cache-dtype": "fp8_e4m3"}), port=PORT)
    assert "SIGTERM drain" in " -> ".join(again.steps)  # a restart does stop the old server
