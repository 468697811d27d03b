"""The runbooks' pure parts (gpugate/report/): the status and who-holds tables, the
free_gpus refusal, the rollback spec. No network; documents shaped like the probes' output."""

from __future__ import annotations

from gpugate import agentcmd
from gpugate.spec import desired_state
from tests.unit.report_rows import argv_for, rb



ARGV = argv_for("/opt/models/kimi", None)


def gpu_doc(used=(0,) * 8, holders=(), per_process=True, source="nvml"):
    gpus = []
    for index, mib in enumerate(used):
        procs = [{"pid": h["pid"], "used_mib": mib} for h in holders if index in h.get("gpus", [])]
        if not per_process:
            procs = []
        gpus.append({"index": index, "used_mib": mib, "reserved_mib": 615, "total_mib": 97887,
                     "error": None, "processes": procs})
    return {"schema": 1, "source": source, "errors": [], "gpus": gpus, "holders": list(holders)}


def workers(n=8, mib=86000):
    return [{"pid": 100 + i, "cmdline": f"sglang::scheduler_TP{i} -m x", "state": "S", "gpus": [i],
             "used_mib": mib} for i in range(n)]


def serving(flags=None, health=200, listening=True, argv=None, lock=None):
    argv = argv or argv_for("/opt/models/kimi", flags)
    return {"port": 30000, "engine": "sglang", "running": True, "listening": listening, "lock": lock,
            "serving": health == 200 and listening,
            "main": {"pid": 60, "pgid": 60, "argv": argv, "argv_hash": agentcmd.argv_hash(argv), "state": "S",
                     "age_s": 300},
            "command": {"model_path": "/opt/models/kimi", "host": "127.0.0.1", "port": 30000,
                        "flags": flags or {"tp-size": 8}, "unknown": []},
            "health": {"health": health, "health_error": None}, "strays": []}


STOPPED = {"port": 30000, "running": False, "main": None, "command": None, "strays": [],
           "health": {"health": None, "health_error": "port 30000 not listening"}}


# ------------------------------------------------------------------ tables

def test_table_pads_columns_and_marks_missing_cells():
    text = rb.format_table([("a", "A"), ("b", "B"), ("c", "LAST")],
                           [{"a": "long value", "b": None, "c": "x"}, {"a": "s", "b": [1, 2], "c": ""}])
    assert text.splitlines() == ["A           B     LAST", "long value  -     x", "s           1, 2  -"]


def test_per_gpu_mib_folds_runs_and_keeps_order():
    assert rb.compact_mib([0] * 8) == "0 x8"
    assert rb.compact_mib([86000] * 6 + [0, 0]) == "86000 x6, 0 0"
    assert rb.compact_mib([0, 512, 0]) == "0 512 0"
    assert rb.compact_mib([None] * 8) == "? x8"
    assert rb.compact_mib([]) == "no GPU"


def test_hosts_sort_naturally():
    assert sorted(["pve10", "pve2", "pve1"], key=rb.natural_key) == ["pve1", "pve2", "pve10"]


# ------------------------------------------------------------------ status rows

def test_serving_with_the_desired_flags_reads_equal():
    row = rb.status_row("pve1", 129, {"sglang": serving(), "gpu": gpu_doc([86000] * 8, workers())},
                        {"tp": 8}, "/opt/models/kimi")
    assert row["server"] == "serving pid 60 up 5m" and row["health"] == "/health 200"
    assert row["model"] == "kimi" and row["flags"] == "="
    assert row["gpu_mib"] == "86000 x8"
    assert row["holders"] == "8 in ct (sglang::scheduler_TP0..7)"


def test_flags_that_differ_from_the_desired_ones_are_listed():
    running = {"tp-size": 8, "kv-cache-dtype": "auto", "cuda-graph-max-bs": 8}
    desired = {"tp": 8, "kv-cache-dtype": "fp8_e4m3", "disable-radix-cache": True}
    row = rb.status_row("pve1", 129, {"sglang": serving(running), "gpu": gpu_doc()}, desired, "/opt/models/kimi")
    # one diff format everywhere (issue 20): a sign, a space, the flag as written; a change is - then +
    assert row["flags"] == ("- --cuda-graph-max-bs 8, + --disable-radix-cache, "
                            "- --kv-cache-dtype auto, + --kv-cache-dtype fp8_e4m3")


def _spec_server(flags, api_key_seen="***"):
    """The observe document of a server started from the desired Spec of ``flags`` (the agent
    reports secret values as *** and the exact argv by its hash)."""
    from gpugate.agentcmd import argv_hash
    from gpugate.spec import build_spec

    spec = build_spec("/opt/models/kimi", 30000, flags)
    server = serving({"tp-size": 4, "api-key": api_key_seen})
    server["main"]["argv_hash"] = argv_hash(list(spec.argv))
    return server


def test_secret_flag_values_never_reach_the_table():
    desired = {"tp": 4, "api-key": "sk-live-s3cret"}
    # after a verified deploy of these flags (deploy says "No changes"): serving as desired
    same = rb.status_row("pve1", 129, {"sglang": _spec_server(desired), "gpu": gpu_doc()}, desired,
                         "/opt/models/kimi")
    assert (same["verdict"], same["flags"], same["ok"]) == ("serving as desired", "=", True)
    # the api key changed in the fleet: drifted, told by the argv's hash, never by the value
    changed = rb.status_row("pve1", 129, {"sglang": _spec_server({"tp": 4, "api-key": "sk-old-hunter2"}),
                                          "gpu": gpu_doc()}, desired, "/opt/models/kimi")
    assert changed["verdict"] == "drifted: a secret flag value differs (by the argv's hash)"
    # a running value seen in clear (an older agent) is still masked
    clear = rb.status_row("pve1", 129, {"sglang": serving({"tp-size": 4, "api-key": "hunter2"}), "gpu": gpu_doc()},
                          {"tp": 4, "api-key": "s3cret", "model-loader-extra-config": {"hf_token": "hf_s3cret"}},
                          "/opt/models/kimi")
    for row in (same, changed, clear):
        assert not any(text in str(row) for text in ("hunter2", "s3cret"))
    assert clear["flags"] == "+ --model-loader-extra-config ***"


def test_a_neighbours_gpus_are_no_verdict_of_this_container():
    """The lab's default layout: 129 on GPU 0-3, 130 on GPU 4-7, each container sees all 8 GPUs;
    a server's memory is held from outside in the other container's view."""
    own_129, own_130 = [86000] * 4 + [0] * 4, [0] * 4 + [86000] * 4
    flags_129, flags_130 = {"tp": 4}, {"tp": 4, "base-gpu-id": 4}
    # 130's server killed: 129 still serves on 0-3, which 130 sees as held from outside
    row_130 = rb.status_row("pve1", 130, {"sglang": STOPPED, "gpu": gpu_doc(own_129, per_process=False)},
                            flags_130, "/opt/models/kimi")
    assert row_130["verdict"] == "down but desired: no server runs"
    # 129 at present: false, 130 serves on 4-7
    row_129 = rb.status_row("pve1", 129, {"sglang": STOPPED, "gpu": gpu_doc(own_130, per_process=False)},
                            flags_129, "/opt/models/kimi", present=False)
    assert (row_129["verdict"], row_129["ok"]) == ("stopped as desired", True)
    # the memory a killed server left on its OWN GPUs is still the verdict
    stuck = rb.status_row("pve1", 130, {"sglang": STOPPED, "gpu": gpu_doc(own_130, per_process=False)},
                          flags_130, "/opt/models/kimi")
    assert stuck["verdict"] == "GPU memory held with no holder in the container: 344000 MiB on GPU 4-7"
    # the GPU set through CUDA_VISIBLE_DEVICES
    mapped = rb.status_row("pve1", 130, {"sglang": STOPPED, "gpu": gpu_doc(own_129, per_process=False)},
                           {"tp": 4}, "/opt/models/kimi", desired_env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert mapped["verdict"] == "down but desired: no server runs"


def test_another_model_is_a_difference():
    row = rb.status_row("pve1", 129, {"sglang": serving(), "gpu": gpu_doc()}, {"tp": 8}, "/opt/models/other")
    assert row["flags"].startswith("- --model-path /opt/models/kimi, + --model-path /opt/models/other")


def test_server_states_while_loading_starting_and_stopped():
    loading = rb.status_row("h", 1, {"sglang": serving(health=None, listening=False), "gpu": gpu_doc()}, {}, None)
    starting = rb.status_row("h", 1, {"sglang": serving(health=503), "gpu": gpu_doc()}, {}, None)
    stopped = rb.status_row("h", 1, {"sglang": STOPPED, "gpu": gpu_doc()}, {"tp": 8}, "/opt/models/kimi")
    assert loading["server"].startswith("loading pid 60")
    assert starting["server"].startswith("starting pid 60") and starting["health"] == "/health 503"
    assert stopped["server"] == "stopped" and stopped["flags"] == "-" and stopped["model"] == "kimi"


def test_a_server_that_should_not_run_says_so():
    row = rb.status_row("h", 1, {"sglang": serving(), "gpu": gpu_doc()}, {}, None, present=False)
    assert row["flags"] == "should not run"


def test_lock_holder_is_shown():
    row = rb.status_row("h", 1, {"sglang": serving(lock={"owner": "ana@ops", "step": "gate"}), "gpu": gpu_doc()},
                        {"tp": 8}, "/opt/models/kimi")
    assert "(locked: ana@ops, gate)" in row["server"]


def test_memory_held_from_outside_the_container_is_called_out():
    row = rb.status_row("h", 1, {"sglang": STOPPED, "gpu": gpu_doc([4096] * 8, per_process=False)}, {}, None)
    assert row["holders"] == "OUTSIDE the ct: 32768 MiB on GPU 0-7"


def test_memory_under_the_gates_threshold_is_driver_overhead_not_memory_from_outside():
    """The H200's 8 MiB per GPU that no process accounts for (NVML v2's device total minus the
    per-process sum) with nothing outside: named driver overhead, by the gate's own threshold (one
    rule: gpugate.rules.gate.outside_memory); over the threshold it is memory from outside."""
    tp2 = workers(2, mib=126172)
    doc = gpu_doc([126180, 126180], tp2)
    for gpu in doc["gpus"]:  # the driver lists each scheduler with 8 MiB less than the GPU's total
        gpu["processes"] = [dict(process, used_mib=126172) for process in gpu["processes"]]
    row = rb.status_row("h", 1, {"sglang": serving({"tp-size": 2}), "gpu": doc}, {"tp": 2}, "/opt/models/kimi")
    assert row["holders"] == ("2 in ct (sglang::scheduler_TP0..1); "
                              "GPU 0-1: 8 MiB each, driver overhead (under the gate's 64 MiB)")
    assert "OUTSIDE" not in row["holders"] and row["verdict"] == "serving as desired"
    # a stopped server, 12 MiB left on GPU 3: down but desired, not "GPU memory held"
    idle = gpu_doc([0, 0, 0, 12], per_process=False)
    row = rb.status_row("h", 1, {"sglang": STOPPED, "gpu": idle}, {"tp": 4}, "/opt/models/kimi")
    assert row["holders"] == "GPU 3: 12 MiB, driver overhead (under the gate's 64 MiB)"
    assert row["verdict"] == "down but desired: no server runs"
    # the threshold is the gate's own (gpu_max_used_mib): under 8 MiB, 12 MiB is held from outside
    row = rb.status_row("h", 1, {"sglang": STOPPED, "gpu": idle}, {"tp": 4}, "/opt/models/kimi", max_used_mib=8)
    assert row["holders"] == "OUTSIDE the ct: 12 MiB on GPU 3"
    assert row["verdict"] == "GPU memory held with no holder in the container: 12 MiB on GPU 3"
    # free_gpus refuses only for memory from outside
    assert rb.free_gpus_refusal(STOPPED, idle, 64, "h", 30000) is None
    assert "GPU 3: 12 MiB" in rb.free_gpus_refusal(STOPPED, idle, 8, "h", 30000)
    # the holders view of a Proxmox host says the same, by the same rule
    host = {"source": "nvml", "errors": [], "processes": [],
            "gpus": [{"index": 0, "used_mib": 900, "processes": []}, {"index": 3, "used_mib": 12, "processes": []}]}
    assert rb.host_summary("pve1", host) == (
        "pve1: GPU MiB 900 12; 0 GPU process(es); memory with no process on GPU 0 (stuck in the driver?); "
        "GPU 3: 12 MiB, driver overhead (under the gate's 64 MiB); read by nvml")
    assert "memory with no process on GPU 0,3" in rb.render_holders([("pve1", host, 8)])


def test_probe_failures_show_and_are_listed_under_the_table():
    failed = {"schema": 1, "source": "none", "gpus": [], "holders": [],
              "errors": [{"source": "nvml", "kind": "DriverNotLoaded", "message": "driver not loaded"}]}
    row = rb.status_row("pve1", 129, {"sglang": {"error": "NoPython: python3 not found"}, "gpu": failed}, {}, None)
    assert row["server"] == "probe failed" and "python3 not found" in row["health"]
    assert "nvml: driver not loaded" in rb.render_status([row])


def test_errors_of_a_fallback_that_answered_are_not_problems():
    doc = gpu_doc()
    doc["source"] = "nvidia-smi"
    doc["errors"] = [{"source": "nvml", "kind": "LibraryNotFound", "message": "NVML Shared Library Not Found"}]
    row = rb.status_row("h", 1, {"sglang": STOPPED, "gpu": doc}, {}, None)
    assert row["problems"] == [] and "problems" not in rb.render_status([row])


# ------------------------------------------------------------------ the fleet report


class _Host:
    def __init__(self, name):
        self.name = name


class _State:
    def __init__(self, names):
        self.activated_hosts = [_Host(n) for n in names]


def test_fleet_report_prints_once_in_host_order_after_the_last_disconnect():
    printed = []
    report = rb.FleetReport(lambda items: "|".join(items), out=printed.append)
    state = _State(["pve10", "pve2"])
    report.add("pve10", "b")
    report.add("pve2", "a")
    report.host_disconnect(state, state.activated_hosts[0])
    assert printed == []
    report.host_disconnect(state, state.activated_hosts[1])
    report.host_disconnect(state, state.activated_hosts[1])
    assert printed == ["a|b"]


# ------------------------------------------------------------------ who holds the GPUs

HOST_DOC = {"source": "nvidia-smi", "errors": [], "gpus": [{"index": i, "used_mib": 86000 if i < 2 else 4096,
                                                            "processes": [{"pid": 1}]} for i in range(3)],
            "processes": [
                {"pid": 5001, "vmid": None, "gpus": [0, 1, 2], "used_mib": 12288, "state": "S",
                 "cmdline": "python3 hold.py"},
                {"pid": 4002, "vmid": 131, "gpus": [1], "used_mib": 86000, "state": "D",
                 "cmdline": "sglang::scheduler_TP1"},
                {"pid": 4001, "vmid": 129, "gpus": [0], "used_mib": 86000, "state": "S",
                 "cmdline": "sglang::scheduler_TP0 " + "x" * 100},
            ]}


def test_holders_are_listed_by_container_then_the_host():
    rows = rb.holder_rows("pve1", HOST_DOC)
    assert [(r["owner"], r["pid"]) for r in rows] == [("ct 129", 4001), ("ct 131", 4002), ("host", 5001)]
    assert rows[2]["gpus"] == "0-2" and rows[1]["state"] == "D"
    assert len(rows[0]["cmdline"]) == 70 and rows[0]["cmdline"].endswith("...")


def test_holders_report_has_one_summary_per_proxmox_host():
    text = rb.render_holders([("pve1", HOST_DOC), ("pve2", {"source": "none", "gpus": [], "processes": [],
                                                            "errors": [{"source": "nvml", "message": "no driver"}]})])
    assert "pve1: GPU MiB 86000 86000 4096; 3 GPU process(es); read by nvidia-smi" in text
    assert "pve2: GPU MiB no GPU; 0 GPU process(es); read by none; errors: nvml: no driver" in text


# ------------------------------------------------------------------ free_gpus

def test_free_gpus_goes_ahead_for_the_containers_own_squatters():
    assert rb.free_gpus_refusal(STOPPED, gpu_doc([4096] * 8, workers(mib=4096)), 64, "h", 30000) is None


def test_free_gpus_refuses_while_the_managed_server_runs():
    reason = rb.free_gpus_refusal(serving(), gpu_doc([86000] * 8, workers()), 64, "@pct/pve1:129", 30000)
    assert "sglang on :30000 runs (pid 60)" in reason and "Nothing was touched" in reason


def test_free_gpus_refuses_memory_held_from_outside_and_points_to_who_holds_gpus():
    reason = rb.free_gpus_refusal(STOPPED, gpu_doc([0, 4096], per_process=False), 64, "@pct/pve1:129", 30000)
    assert "GPU 1: 4096 MiB" in reason and "GPU 0" not in reason
    assert "runbooks/who_holds_gpus.py --limit @pct/pve1:129" in reason


# ------------------------------------------------------------------ shared

def test_the_desired_state_is_deploy_py_s():
    args = desired_state({"sglang_port": 30001, "sglang_flags": {"tp": 8}, "drain_timeout_s": 5,
                          "sglang_model_path": "/m"})
    assert args.port == 30001 and args.flags == {"tp": 8} and args.budgets["drain_timeout_s"] == 5
    assert args.present is True and args.budgets["gate_timeout_s"] == 120 and args.restarted is False
    assert args.audit_log is None  # the audit file: $GPUGATE_AUDIT_LOG or ./audit.jsonl
    assert desired_state({"audit_log": "/srv/audit.jsonl"}).audit_log == "/srv/audit.jsonl"

