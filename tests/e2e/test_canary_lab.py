"""The canary that judges itself (issue 35, docs/canary.md), through the REAL pyinfra CLI: 3 replicas in
one lab host (containers 129, 130, 131, one GPU each: tp 1) behind a real smg, the lab's client
(gpugate_lab/traffic.py: streamed and whole chat completions through smg) sending requests during each
change, a soak of a few seconds and the thresholds passed as data. The tests run in order, each from the
state the previous one left.

The stand-ins decode a token in 10 ms (SGLANG_STANDIN_TOKEN_S): inter-token latencies land in SGLang's
fine buckets (2-5 ms steps below 40 ms), so the lab's ``slow-decode=4`` fault (40 ms a token) is a
regression the engine's own histograms show; TTFT stays in SGLang's first bucket (0.1 s) either way.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from tests.conftest import Lab, routed_lab

pytestmark = [pytest.mark.lab, pytest.mark.slow]

VMIDS = (129, 130, 131)
ENV = {"SGLANG_STANDIN_LOAD_S": "0.3", "SGLANG_STANDIN_DRAIN_TICK_S": "0.3", "SGLANG_STANDIN_SCHEDULER_EXIT_S": "0.2",
       "SGLANG_STANDIN_TOKEN_S": "0.01"}
MODEL = "/opt/models/lab-model"
SOAK_S = 3
# the thresholds as data: ITL p95 at most 2x the others' (the fault makes it 4x), 8 requests a side (smg
# sends a slower server fewer: the slow canary gets about a ninth of the requests, not a third); tokens/s
# per running request at least 0.5x: over a 3 s soak's 4 looks at the running gauge, two like servers
# differ by up to 20% (0.82x seen), the slow canary reads 0.2x
CANARY = f"canary=soak_s={SOAK_S},min_requests=8,itl_p95_ratio=2,ttft_p95_ratio=2,throughput_ratio=0.5"
CHANGE = {"disable-radix-cache": True}


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    yield from routed_lab(tmp_path_factory, "lab-canary", hosts=1, gpus=3, vmids=VMIDS)


def write_fleet(lab: Lab, router: dict, flags: dict | None = None) -> None:
    from gpugate_lab import core

    doc = core.fleet_document(lab.dir, [(h.name, h.port) for h in lab.hosts], {"pve1": list(VMIDS)}, router=router)
    for container in doc["hosts"]["pve1"]["containers"].values():
        container["sglang"]["flags"].update(flags or {})
    path = lab.dir / "fleet.test.yaml"
    path.write_text(core.render_fleet_yaml(doc))
    lab.fleet_path = path


def deploy(lab: Lab, *extra: str, canary: str = CANARY) -> tuple[int, str]:
    result = lab.pyinfra("inventory.py", "deploy.py", "--data", f"sglang_env={json.dumps(ENV)}",
                         "--data", "router_join_timeout_s=20", "--data", "drain_timeout_s=2", "--data", canary,
                         *extra, timeout=240)
    with open(lab.dir / "deploys.log", "a") as log:  # every run's output, for a failure's post-mortem
        log.write(f"=== {time.strftime('%H:%M:%S')} deploy {' '.join(extra)}\n{result.stdout}{result.stderr}")
    return result.returncode, result.stdout + result.stderr


def status(lab: Lab) -> tuple[int, dict]:
    result = lab.pyinfra("inventory.py", "runbooks/status.py", "--data", "format=json", "--data", CANARY,
                         "--data", f"sglang_env={json.dumps(ENV)}", timeout=120)
    return result.returncode, json.loads(result.stdout.strip().splitlines()[-1])


def server_info(router: dict, vmid: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{router['ports'][f'pve1:{vmid}']}/server_info", timeout=5) as r:
        return json.load(r)


def pids(lab: Lab) -> dict[int, int | None]:
    from tests.faults.conftest import main_pid

    return {vmid: main_pid(lab, "pve1", vmid) for vmid in VMIDS}


def Client(url: str):
    """About 45 requests a second through smg, half of them streamed (TTFT and ITL are only seen in
    streams), the rest whole chat completions: each side of a soak sees over 8 requests."""
    from gpugate_lab.traffic import Traffic

    return Traffic(url, rate=45, seconds=120.0, stream_share=0.5, stream_tokens=20, answer_tokens=10, model=MODEL)


def canary_row(doc: dict, vmid: int) -> dict:
    return next(s for s in doc["servers"] if s["vmid"] == vmid)


def test_first_deploy_starts_three_with_metrics_and_dry_names_the_canary_plan(routed):
    """A first start soaks nothing (no canary on a first start); the canary adds SGLang's
    --enable-metrics to every launch. --dry of the change names the canary and its limits."""
    lab, router = routed
    write_fleet(lab, router)
    code, out = deploy(lab)
    assert code == 0, out
    assert "soaking" not in out, out
    for vmid in VMIDS:
        assert server_info(router, vmid)["enable_metrics"] is True
    write_fleet(lab, router, CHANGE)
    code, out = deploy(lab, "--dry")
    assert code == 0, out
    assert (f"router lab: CANARY: this replica changes first and soaks {SOAK_S} s under traffic, judged against "
            "the unchanged replicas") in out, out
    assert "canary limits: TTFT p95 at most 2x, ITL p95 at most 2x" in out and "at least 8 requests each side" in out
    assert out.count("router lab: canary @pct/pve1:129 soaks first (the next in the fleet's order if it has nothing to change); this replica changes after it passes") == 2, out


def test_a_slower_spec_is_rolled_back_on_the_canary_alone(routed):
    """slow-decode on the NEXT start of all three containers: the verdict, not the fault's placement,
    stops it. 129 changes, soaks, is judged a regression from its ITL, goes back to its last good spec
    (healthy: the fault was its first start's only) and rejoins; 130 and 131 are never restarted; the
    exit is non-zero, the figures side by side; the status shows the verdict. No request fails."""
    lab, router = routed
    before = pids(lab)
    for vmid in VMIDS:
        lab.fault("pve1", vmid, "slow-decode=4")
    with Client(router["url"]) as client:
        code, out = deploy(lab)
    result = client.result()
    assert code != 0, out
    assert result.failed == 0 and result.ok > 50, (result.failed, result.errors[:5], out)
    assert re.search(r"canary soak \d+/3 s: canary \d+ requests, 0 failed, TTFT p95 [0-9.]+ s, ITL p95 [0-9.]+ s; "
                     r"others \d+ requests", out), out
    assert "canary REGRESSION" in out, out
    itl = re.search(r"ITL p95 +([0-9.]+) s +([0-9.]+) s +at most 2x +REGRESSION", out)
    assert itl and float(itl.group(1)) > 2 * float(itl.group(2)), out  # the figures side by side
    assert re.search(r"figure +canary +2 others +limit", out), out
    assert "canary: rolling it back to its last good spec" in out, out
    assert "not touched" in out, out
    after = pids(lab)
    assert after[129] != before[129] and {v: after[v] for v in (130, 131)} == {v: before[v] for v in (130, 131)}
    for vmid in VMIDS:
        assert server_info(router, vmid)["disable_radix_cache"] is False  # the canary back on its last good spec
    code, doc = status(lab)
    row = canary_row(doc, 129)
    assert row["canary"]["verdict"] == "regression" and row["canary"]["rolled_back"] is True, row
    assert row["canary_text"].startswith("REGRESSION, rolled back"), row


def test_the_same_change_without_the_fault_passes_and_all_three_run_it(routed):
    """The faults cleared (130 and 131 still had theirs pending): the canary passes its soak and the
    rest roll; a re-run changes nothing. No request fails."""
    lab, router = routed
    for vmid in VMIDS:
        lab.fault("pve1", vmid, "slow-decode", clear=True)
    with Client(router["url"]) as client:
        code, out = deploy(lab)
    result = client.result()
    assert code == 0, out
    assert result.failed == 0 and result.ok > 50 and result.streams_ok > 10, (result.failed, result.errors[:5], out)
    assert f"canary PASSED its {SOAK_S} s soak" in out, out
    for vmid in VMIDS:
        assert server_info(router, vmid)["disable_radix_cache"] is True
    before = pids(lab)
    code, out = deploy(lab)
    assert code == 0 and "soaking" not in out and "stopping" not in out, out
    assert pids(lab) == before


def test_a_soak_with_too_little_traffic_says_so_and_touches_nothing_else(routed):
    """No client: fewer than min_requests on either side. Said, with what to do; the canary goes back
    to its last good spec; the others are not touched; exit non-zero."""
    lab, router = routed
    before = pids(lab)
    write_fleet(lab, router, {**CHANGE, "schedule-policy": "lpm"})
    code, out = deploy(lab)
    assert code != 0, out
    assert "canary: TOO LITTLE TRAFFIC for a verdict (min_requests 8)" in out, out
    assert "send more traffic through the router during the soak" in out, out
    after = pids(lab)
    assert {v: after[v] for v in (130, 131)} == {v: before[v] for v in (130, 131)}, out
    for vmid in VMIDS:
        assert server_info(router, vmid).get("schedule_policy") != "lpm"
