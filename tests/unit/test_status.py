"""The status to page on (gpugate/report/): verdicts from recorded agent observations, the JSON
document, the Prometheus textfile, unreachable hosts. No network."""

from __future__ import annotations

import json
import os
import stat
import threading
import time

from gpugate import agentcmd
from gpugate.spec import desired_state
from tests.unit.report_rows import argv_for, rb, status_row_for



ARGV = ["/usr/bin/python3", "-m", "sglang.launch_server", "--model-path", "/opt/models/lab-model",
        "--port", "30000", "--tp-size", "8"]
FP8_ARGV = ARGV + ["--kv-cache-dtype", "fp8_e4m3"]


def gpu_doc(used=(0,) * 8, holders=()):
    return {"schema": 1, "source": "nvml", "errors": [], "holders": list(holders),
            "gpus": [{"index": i, "used_mib": mib, "reserved_mib": 615, "total_mib": 97887, "error": None,
                      "processes": [{"pid": 100 + i, "used_mib": mib}] if holders and mib else []}
                     for i, mib in enumerate(used)]}


def schedulers(mib=86000):
    return [{"pid": 100 + i, "cmdline": f"sglang::scheduler_TP{i}", "state": "S", "gpus": [i], "used_mib": mib}
            for i in range(8)]


def record(argv, at, by="ana@ops", tokens=None):
    out = {"argv": argv, "at": at, "by": by, "port": 30000}
    if tokens:
        out["capacity"] = {"max_total_num_tokens": tokens}
    return out


def observation(running=True, serving=True, flags=None, transition=None, history=None, used=None, holders=None,
                dead=0):
    """An observe document as the agent prints it (docs/agent-protocol.md), `command` added by the fact."""
    server = {"port": 30000, "running": running, "serving": running and serving and not dead, "strays": [],
              "health": {"health": 200 if running and serving else None, "health_error": None if running
                         else "port 30000 not listening"},
              "listening": running, "transition": transition, "history": history or {"good": [], "failed": []},
              "lock": {"held": bool(transition and transition.get("active")), "run": None}}
    if running:
        argv = argv_for("/opt/models/lab-model", flags)
        server["main"] = {"pid": 60, "pgid": 60, "state": "S", "age_s": 300, "argv": argv,
                          "argv_hash": agentcmd.argv_hash(argv)}
        server["command"] = {"model_path": "/opt/models/lab-model", "host": "127.0.0.1", "port": 30000,
                             "flags": flags or {"tp-size": 8}, "unknown": []}
        server["workers"] = {"expected": 8, "alive": 8 - dead, "dead": dead}
    else:
        server["main"] = None
        server["command"] = None
    if used is None:
        used = [86000] * 8 if running else [0] * 8
    if holders is None:
        holders = schedulers() if running else []
    return {"sglang": server, "gpu": gpu_doc(used, holders), "container": {}}


def row_for(doc, desired=None, present=True):
    return status_row_for("pve1", 129, doc, {"tp": 8} if desired is None else desired, "/opt/models/lab-model",
                       present=present)


def test_each_verdict_from_a_recorded_observation():
    assert row_for(observation())["verdict"] == "serving as desired"
    drifted = row_for(observation(), {"tp": 8, "kv-cache-dtype": "fp8_e4m3"})
    assert drifted["verdict"] == "drifted: + --kv-cache-dtype fp8_e4m3" and drifted["drifted"]
    assert row_for(observation(), present=False)["verdict"] == "drifted: runs but should not"
    assert row_for(observation(running=False))["verdict"] == "down but desired: no server runs"
    assert row_for(observation(running=False), present=False)["verdict"] == "stopped as desired"
    dead = row_for(observation(dead=1))
    assert dead["verdict"].startswith("down but desired: unhealthy (1 of 8 schedulers dead)")
    loading = row_for(observation(serving=False))
    assert loading["kind"] == "down" and not loading["up"]

    # the memory a killed server left in the driver: no holder in the container
    stuck = row_for(observation(running=False, used=[86658] * 8, holders=[]))
    assert stuck["verdict"] == "GPU memory held with no holder in the container: 693264 MiB on GPU 0-7"
    assert stuck["gpu_mib"] == "86658 x8" and not stuck["ok"]

    running = {"run": "r7", "active": True, "step": "gate", "began": 1_800_000_000, "updated": 1_800_000_004}
    assert row_for(observation(running=False, transition=running))["verdict"].startswith(
        "transition running: gate (run r7, since 2027-01-15 08:00Z)")
    failed = {"run": "r8", "active": False, "outcome": "rolled_back", "began": 1_800_000_000,
              "updated": 1_800_000_042.5, "reasons": {"desired": "crashed: exit 1"}, "by": "ana@ops"}
    row = row_for(observation(transition=failed))
    assert row["verdict"] == "transition failed: rolled_back (run r8): desired: crashed: exit 1"
    assert row["transition"]["duration_s"] == 42.5 and row["last_change"].startswith("rolled_back 2027-01-15")

    ok = [row_for(observation())["ok"], row_for(observation(running=False), present=False)["ok"]]
    assert ok == [True, True]


def test_a_verified_transition_after_a_failed_one_reads_as_desired():
    verified = {"run": "r9", "active": False, "outcome": "verified", "began": 1, "updated": 2}
    assert row_for(observation(transition=verified))["verdict"] == "serving as desired"


def test_history_shows_the_newest_entries_with_what_changed_and_the_capacity():
    history = {"good": [record(FP8_ARGV, "2026-11-30T21:58:00Z", tokens=319488),
                        record(ARGV, "2026-11-29T10:00:00Z", tokens=159744)],
               "failed": [dict(record(ARGV + ["--kv-cache-dtype", "fp9"], "2026-11-30T21:00:00Z"),
                               reason="invalid choice: 'fp9'")]}
    lines = row_for(observation(history=history))["history"]
    assert lines == [
        "2026-11-30 21:58Z good 0 (newest) by ana@ops: + --kv-cache-dtype fp8_e4m3 against good 1 "
        "(KV cache 319,488 tokens)",
        "2026-11-30 21:00Z FAILED by ana@ops: invalid choice: 'fp9'",
        "2026-11-29 10:00Z good 1 (oldest kept) by ana@ops: nothing older kept (KV cache 159,744 tokens)",
    ]
    text = rb.render_status([row_for(observation(history=history))])
    assert "history (newest first):\n  pve1:129  2026-11-30 21:58Z good 0 (newest)" in text


def test_history_labels_follow_the_historys_order_after_a_rollback_in_the_text_and_the_json():
    """A (tp 8) verified, then B (+ fp8), then the rollback runbook back to A: the agent moves A to the
    front of the good list (a new record, verified now). The labels follow the list: A is good 0, B
    good 1; B is no "first good spec" (A was verified before it). The JSON says the same."""
    a_first, b, a_again = "2026-11-29T10:00:00Z", "2026-11-30T21:58:00Z", "2026-11-30T23:10:00Z"
    before = {"good": [dict(record(FP8_ARGV, b), key="b" * 16, argv_hash="B"),
                       dict(record(ARGV, a_first), key="a" * 16, argv_hash="A")], "failed": []}
    after = {"good": [dict(record(ARGV, a_again, by="bo@ops"), key="a" * 16, argv_hash="A"),
                      dict(record(FP8_ARGV, b), key="b" * 16, argv_hash="B")], "failed": []}
    assert row_for(observation(history=before))["history"][1].startswith("2026-11-29 10:00Z good 1 (oldest kept)")
    row = row_for(observation(history=after))
    assert row["history"] == [
        "2026-11-30 23:10Z good 0 (newest) by bo@ops: - --kv-cache-dtype fp8_e4m3 against good 1",
        "2026-11-30 21:58Z good 1 (oldest kept) by ana@ops: nothing older kept",
    ]
    document = json.loads(json.dumps(rb.status_document([row]), default=str))
    specs = document["servers"][0]["good_specs"]
    assert [(s["label"], s["key"], s["at"], s["against"], s["changes"]) for s in specs] == [
        ("good 0 (newest)", "a" * 16, a_again, "good 1", ["- --kv-cache-dtype fp8_e4m3"]),
        ("good 1 (oldest kept)", "b" * 16, b, None, []),
    ]
    assert [line.split(" by ")[0][18:] for line in row["history"]] == [s["label"] for s in specs]
    # the order is the list's even where the times disagree (a hand-edited file, a clock set back)
    skewed = {"good": [dict(record(ARGV, a_first), key="a" * 16), dict(record(FP8_ARGV, b), key="b" * 16)],
              "failed": []}
    assert [line[18:24] for line in row_for(observation(history=skewed))["history"]] == ["good 0", "good 1"]
    # good K is what the rollback runbook's rollback_to=K restores while good 0 runs, and it says so
    from gpugate.plan import rollback_choice

    server = dict(observation(history=after)["sglang"], main={"argv_hash": "A"})
    target, _why = rollback_choice(server, 1)
    assert rb.history_spec_text(target, server) == (
        f"good 1 (oldest kept) of :30000's history (key {'b' * 16}, verified 2026-11-30 21:58Z by ana@ops)")


def test_table_has_a_row_for_an_unreachable_host_and_says_how_many_are_not_as_desired():
    rows = [row_for(observation()), row_for(observation(), {"tp": 8, "disable-radix-cache": True}),
            rb.unreachable_row("pve2", 129, "Unable to connect to port 22 on 10.0.0.2", desired_state({}))]
    text = rb.render_status(rows)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["HOST", "VMID", "PORT", "VERDICT"]
    assert "unreachable: Unable to connect to port 22 on 10.0.0.2" in lines[3]
    assert "3 server(s): 1 as desired, 2 NOT (drifted 1, unreachable 1)" in text
    assert rows[2]["gpu_mib"] == "-"  # a host that cannot be reached has no GPU figures


def test_json_is_one_document_and_publish_says_whether_all_is_well(tmp_path):
    printed = []
    all_well = rb.publish_status([row_for(observation()), rb.unreachable_row("pve2", 129, "timed out", desired_state({}))],
                                 output_format="json", out=printed.append)
    assert all_well is False and len(printed) == 1
    doc = json.loads(printed[0])
    assert doc["ok"] is False and doc["summary"] == {"serving": 1, "unreachable": 1}
    assert [s["kind"] for s in doc["servers"]] == ["serving", "unreachable"]
    assert rb.publish_status([row_for(observation())], out=printed.append) is True


def test_prometheus_textfile_is_written_atomically_with_every_series(tmp_path):
    path = tmp_path / "gpugate.prom"
    failed = {"run": "r8", "outcome": "rolled_back", "began": 10, "updated": 52.5, "active": False}
    rows = [row_for(observation(transition=failed)), rb.unreachable_row("pve2", 129, 'say "why"', desired_state({}))]
    rb.publish_status(rows, prom_path=str(path), out=lambda text: None)
    text = path.read_text()
    labels = 'host="pve1",vmid="129",port="30000",engine="sglang"'
    for line in (f"gpugate_sglang_up{{{labels}}} 1", f"gpugate_sglang_desired{{{labels}}} 1",
                 f"gpugate_sglang_drifted{{{labels}}} 0", f"gpugate_sglang_as_desired{{{labels}}} 0",
                 f'gpugate_sglang_last_transition{{{labels},outcome="rolled_back"}} 1',
                 f"gpugate_sglang_last_transition_duration_seconds{{{labels}}} 42.5",
                 f'gpugate_gpu_used_mib{{{labels},gpu="7"}} 86000',
                 'gpugate_sglang_reachable{host="pve2",vmid="129",port="30000",engine="sglang"} 0'):
        assert line in text.splitlines(), line
    assert "# TYPE gpugate_sglang_up gauge" in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["gpugate.prom"]  # no temporary file left


def test_a_reader_never_sees_half_a_prometheus_file(tmp_path):
    path = tmp_path / "gpugate.prom"
    rows = [row_for(observation()) for _ in range(200)]
    rb.write_atomically(path, rb.status_prometheus(rows))
    whole = path.read_text()
    seen, stop = set(), threading.Event()

    def read():
        # time.sleep(0) yields: when an earlier test imported pyinfra's CLI, gevent has patched
        # threading, this "thread" is a greenlet, and a loop that never yields would never let the
        # writer below run (the suite hung here in CI).
        for _ in range(1_000_000):
            if stop.is_set():
                return
            seen.add(len(path.read_text()))
            time.sleep(0)

    reader = threading.Thread(target=read)
    reader.start()
    for _ in range(50):
        rb.write_atomically(path, rb.status_prometheus(rows))
    stop.set()
    reader.join()
    assert seen == {len(whole)}


class _Data(dict):
    pass


class _Host:
    def __init__(self, name, **data):
        self.name = name
        self.data = _Data(data)


class _State:
    def __init__(self, hosts, active):
        self.inventory = hosts
        self.activated_hosts = [h for h in hosts if h.name in active]
        self.callback_handlers = [rb.ConnectErrors()]  # as watch_connections registers it

    def is_host_in_limit(self, host):
        return True


def test_the_report_gets_a_row_for_each_host_that_never_connected():
    hosts = [_Host("@pct/pve1:129", pve_host="pve1", pct_vmid=129), _Host("@pct/pve2:129", pve_host="pve2",
                                                                          pct_vmid=129)]
    state = _State(hosts, active={"@pct/pve1:129"})
    state.callback_handlers[0].host_connect_error(state, hosts[1], OSError("Unable to connect to port 22"))
    printed = []
    report = rb.FleetReport(lambda rows: rb.render_status(rows), out=printed.append,
                            missing=lambda host, why: rb.unreachable_row(host.data["pve_host"], 129, why, desired_state({})))
    report.add("@pct/pve1:129", row_for(observation()))
    report.host_disconnect(state, hosts[0])
    assert len(printed) == 1
    assert "pve2  129   30000  unreachable: Unable to connect to port 22" in printed[0]


def test_when_every_host_fails_the_status_rows_still_print(capsys):
    hosts = [_Host("@pct/pve1:129", pve_host="pve1", pct_vmid=129, format="json")]
    state = _State(hosts, active=set())
    recorder = state.callback_handlers[0]
    recorder.on_all_failed = rb.status_when_unreachable
    recorder.host_connect_error(state, hosts[0], OSError("No route to host"))
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["servers"][0]["verdict"] == "unreachable: No route to host"


def test_an_unwritable_prometheus_path_still_prints_the_status_and_fails(tmp_path):
    # a cron job's typo in --data prom=PATH cost the whole table (and the run ended in greenlet tracebacks)
    printed: list[str] = []
    rows = [row_for(observation())]
    ok = rb.publish_status(rows, prom_path=str(tmp_path / "missing-dir" / "gpugate.prom"), out=printed.append)
    assert ok is False
    assert len(printed) == 1 and "serving as desired" in printed[0]
    assert not (tmp_path / "missing-dir").exists()


def test_serving_behind_a_router_that_does_not_answer_is_not_as_desired():
    """Issue 32 item 9: a router that does not answer left membership `unknown`, yet the row said
    "serving as desired" (status exit 0): a replica that dropped out because its router died must page."""
    from gpugate.report.status import status_row

    data = {"sglang_flags": {"tp": 8}, "sglang_model_path": "/opt/models/lab-model"}
    desired = desired_state(data)
    view = {"router": "gw", "url": "http://10.0.0.5:30000", "state": "unknown", "listed": None,
            "error": "unreachable: GET /workers: connection refused"}
    row = status_row("pve1", 129, observation(), desired, router=view)
    assert row["kind"] == "router_unknown" and not row["ok"], row
    assert "connection refused" in row["verdict"]
    healthy = status_row("pve1", 129, observation(), desired, router=dict(view, state="healthy", listed=True))
    assert healthy["kind"] == "serving" and healthy["ok"]
