"""Two servers of one container and the GPUs each holds when the other's turn comes (issue 32 item 7):
a server whose new GPUs another server of the container still holds at its turn (one not stopped
before it in this run) is refused before anything stops, naming both servers and the GPUs and how
to get there; the moves that can pass their gates (onto GPUs a server this run stops first frees, a
port change) still plan. Plan data fixtures: the observe document of container 129 with a server on
:30000 and one on :30001, the desired servers in the deploy's order, and what the plan says."""

from __future__ import annotations

import pytest

from gpugate.spec import build_spec, desired_states
from tests.unit.plans import plan_of

MODEL = "/opt/models/lab-model"
LOW, HIGH = (0, 1, 2, 3), (4, 5, 6, 7)


def spec(port: int, gpus: tuple[int, ...]):
    return build_spec(MODEL, port, {"tp": len(gpus), "base-gpu-id": gpus[0]})


def observation(port: int, running: dict[int, tuple[int, ...]]):
    """What observe of ``port`` answers in a container where ``running`` (port -> GPUs) serve: the
    server of ``port`` (its GPUs) and the others as mains of other ports (their GPUs read there)."""
    mine = running.get(port)
    server = {"port": port, "running": mine is not None, "main": None, "tree": [], "clients": [], "env_hashes": {},
              "listening": False, "listener_pids": [], "health": {"health": 200}, "server_info": None,
              "serving": False, "workers": None, "model_path_exists": True, "transition": None,
              "history": {"good": [], "failed": [], "last": None}, "sglang_version": "0.5.5",
              "gpus": list(mine) if mine is not None else None,
              "strays": [{"pid": 300 + other % 10, "port": other, "main": True, "managed": True, "gpus": list(gpus),
                          "cmdline": " ".join(spec(other, gpus).argv)}
                         for other, gpus in running.items() if other != port]}
    if mine is not None:
        argv = list(spec(port, mine).argv)
        server["main"] = {"pid": 200 + port % 10, "argv": argv, "argv_hash": "running", "supervisor": "process"}
    worker = {gpu: 400 + other % 10 * 10 + gpu for other, gpus in running.items() for gpu in gpus}  # a TP worker per GPU
    gpus_doc = [{"index": i, "used_mib": 40_000 if i in worker else 0,
                 "processes": [{"pid": worker[i], "used_mib": 40_000}] if i in worker else []} for i in range(8)]
    return {"sglang": server, "gpu": {"source": "nvml", "holders": [], "gpus": gpus_doc},
            "container": {"free_mib": {"/var/log/gpugate": 50_000, "/var/lib/gpugate": 50_000}, "pid1": "init",
                          "port_holders": [], "gpu_holders": []}}


def plan_in_order(port, wanted, running, order, executing=False):
    """The plan of the server on ``port`` moving to ``wanted`` GPUs, the container's desired servers
    of this run being ``order`` ((port, GPUs it takes: () for present: false), in the deploy's order;
    None: only this one, ``--data only_port``)."""
    if order is None:  # --data only_port: the container's other server is not of this run
        siblings, order = tuple(other for other in running if other != port), ()
    else:
        siblings = tuple(other for other, _ in order if other != port)
    return plan_of(observation(port, running), spec(port, wanted), port=port, siblings=siblings,
                   run_order=tuple(order), executing=executing)


SWAP = [(30000, HIGH), (30001, LOW)]
NOW = {30000: LOW, 30001: HIGH}

# (case, port, its new GPUs, what runs now, the run's order, executing, refused?, words the refusal holds)
CASES = [
    ("the swap: the first cannot pass its gate on the second's memory", 30000, HIGH, NOW, SWAP, False, True,
     ("the server on :30001 holds GPU 4-7", "in two deploys", "(1) :30001 present: false")),
    ("the swap: the second, as the first is refused and keeps its GPUs", 30001, LOW, NOW, SWAP, False, True,
     ("the server on :30000 holds GPU 0-3", "cannot move off first")),
    ("the swap, as the deploy runs it (the first was refused)", 30001, LOW, NOW, SWAP, True, True,
     ("the server on :30000 holds GPU 0-3")),
    ("onto the GPUs a server stopped before it frees", 30000, HIGH, NOW, [(30001, ()), (30000, HIGH)], False, False, ()),
    ("onto the GPUs a server stopped after it still holds", 30000, HIGH, NOW, [(30000, HIGH), (30001, ())], False,
     True, ("stops (present: false) after :30000", "list it before :30000")),
    ("the stop before it did not free them (what the deploy sees at its turn)", 30000, HIGH, NOW,
     [(30001, ()), (30000, HIGH)], True, True, ("the server on :30001 holds GPU 4-7",)),
    ("onto the GPUs a server that moves first leaves", 30000, (2, 3), {30000: (0, 1), 30001: (2, 3)},
     [(30001, (4, 5)), (30000, (2, 3))], False, False, ()),
    ("onto the GPUs a server that moves after it still holds", 30000, (2, 3), {30000: (0, 1), 30001: (2, 3)},
     [(30000, (2, 3)), (30001, (4, 5))], False, True, ("moves to GPU 4-5 after :30000", "moves off first")),
    ("onto the GPUs of a server this run does not change (only_port)", 30000, HIGH, NOW, None, False, True,
     ("the server on :30001 holds GPU 4-7", "not changed by this run")),
    ("a flag change on its own GPUs beside the other", 30000, LOW, NOW, [(30000, LOW), (30001, HIGH)], False, False, ()),
    ("a first start beside the other", 30000, LOW, {30001: HIGH}, [(30000, LOW), (30001, HIGH)], False, False, ()),
]


@pytest.mark.parametrize("case, port, wanted, running, order, executing, refused, words", CASES,
                         ids=[case[0] for case in CASES])
def test_a_server_never_stops_for_gpus_another_keeps(case, port, wanted, running, order, executing, refused, words):
    plan = plan_in_order(port, wanted, running, order, executing)
    kept = [problem for problem in plan.problems if "keeps them through the turn" in problem]
    assert bool(kept) == refused, plan.problems
    assert not refused or plan.problems == tuple(kept)  # nothing else refused these fixtures
    for word in words:
        assert word in kept[0], (word, kept[0])
    if not refused:
        assert plan.action in ("start", "restart", "noop") and plan.touches in (True, False)


def test_a_port_change_stops_the_server_it_replaces_first():
    # one desired server (no siblings): the server of the old port on its GPUs is replaced (stopped
    # by this transition first), never a server that keeps them
    plan = plan_of(observation(30001, {30000: LOW}), spec(30001, LOW), port=30001)
    assert plan.replaces is not None and plan.replaces["port"] == 30000 and not plan.problems, plan.problems


def test_the_deploy_order_of_a_fleets_servers_is_each_servers_run_order():
    data = {"sglang_servers": [
        {"sglang_model_path": MODEL, "sglang_flags": {"tp": 4, "base-gpu-id": 4}},
        {"sglang_model_path": MODEL, "sglang_port": 30001, "sglang_flags": {"tp": 4}},
        {"sglang_model_path": MODEL, "sglang_port": 30002, "sglang_present": False}]}
    order = ((30000, HIGH), (30001, LOW), (30002, ()))
    assert [d.run_order for d in desired_states(data)] == [order] * 3
    # --data only_port: the others are not of this run (they keep what they hold)
    assert [d.run_order for d in desired_states({**data, "only_port": 30001})] == [()]
