"""Routed servers behind a real smg (issue 21), through the REAL pyinfra CLI: 3 replicas in one lab
host (containers 129, 130, 131, one GPU each: tp 1), smg on loopback (``gpugate lab up --router``), a client
sending requests through smg for the whole run. The tests run in order, each from the state the
previous one left (as an operator's successive runs would).

The stand-in loads in 0.4 s and drains with SGLang's shape at a 0.5 s tick (SGLang's is 5 s: the
watchdog's first look, its polls, then the schedulers), so every test stays well under a minute.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import Lab, pyinfra_exe, routed_lab

pytestmark = [pytest.mark.lab, pytest.mark.slow]

VMIDS = (129, 130, 131)
ENV = {"SGLANG_STANDIN_LOAD_S": "0.4", "SGLANG_STANDIN_DRAIN_TICK_S": "0.5", "SGLANG_STANDIN_SCHEDULER_EXIT_S": "0.3",
       "SGLANG_STANDIN_TOKEN_S": "0.01"}  # 100 tokens a second per request: a stream of 300 lasts 3 s
MODEL = "/opt/models/lab-model"  # the lab's servers' model (their served model name)


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    yield from routed_lab(tmp_path_factory, "lab-router", hosts=1, gpus=3, vmids=VMIDS)


def write_fleet(lab: Lab, router: dict, extra_flags: dict | None = None, router_url: str | None = None,
                worker_urls: dict[int, str] | None = None, vmids: tuple[int, ...] = VMIDS,
                cordoned: tuple[int, ...] = ()) -> None:
    """The lab's fleet with ``extra_flags`` on every server (a fleet-wide flag change); ``worker_urls``:
    a container's ``router_url`` other than its own published port; ``vmids``: the containers it lists;
    ``cordoned``: the containers declared out of the router (``router_cordon: true``)."""
    from gpugate_lab import core

    doc = core.fleet_document(lab.dir, [(h.name, h.port) for h in lab.hosts], {"pve1": list(VMIDS)},
                              router=router)
    if router_url:
        doc["routers"]["lab"]["url"] = router_url
    for vmid, url in (worker_urls or {}).items():
        doc["hosts"]["pve1"]["containers"][vmid]["sglang"]["router_url"] = url
    for vmid in cordoned:
        doc["hosts"]["pve1"]["containers"][vmid]["sglang"]["router_cordon"] = True
    for vmid in set(VMIDS) - set(vmids):
        del doc["hosts"]["pve1"]["containers"][vmid]
    for container in doc["hosts"]["pve1"]["containers"].values():
        container["sglang"]["flags"].update(extra_flags or {})
    path = lab.dir / "fleet.test.yaml"
    path.write_text(core.render_fleet_yaml(doc))
    lab.fleet_path = path


def deploy(lab: Lab, *extra: str) -> tuple[int, str]:
    result = lab.pyinfra("inventory.py", "deploy.py", "--data", f"sglang_env={json.dumps(ENV)}",
                         "--data", "router_join_timeout_s=20", *extra, timeout=240)
    with open(lab.dir / "deploys.log", "a") as log:  # every run's output, for a failure's post-mortem
        log.write(f"=== {time.strftime('%H:%M:%S')} deploy {' '.join(extra)}\n{result.stdout}{result.stderr}")
    return result.returncode, result.stdout + result.stderr


def workers(router: dict) -> list[dict]:
    with urllib.request.urlopen(router["url"] + "/workers", timeout=5) as response:
        return json.load(response)["workers"]


def server_info(router: dict, vmid: int) -> dict:
    url = f"http://127.0.0.1:{router['ports'][f'pve1:{vmid}']}/server_info"
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def Client(url: str, streams: int = 2, stream_tokens: int = 60):
    """Requests through smg, continuously, bounded in count and in time, as real clients send them (the
    lab's client, gpugate_lab/traffic.py): 2 threads of SGLang's /generate and 1 of the real OpenAI
    client's chat completions, whole answers; ``streams`` threads of the OpenAI client streaming chat
    completions of ``stream_tokens`` tokens each (issue 32 item 3: most real clients stream, and a stream
    is the request a drain can cut). A stream counts as served only when it is whole. Prompts differ, so
    smg spreads them over its workers. 0.1 s between an answer and the next request: a few requests a
    second per thread are enough to cross every leave and drain, without the loops taking a core of the
    2-core machine the whole suite shares."""
    from gpugate_lab.traffic import Traffic

    return Traffic(url, seconds=120.0, max_requests=20000, generate_threads=2, chat_threads=1,
                   stream_threads=streams, stream_tokens=stream_tokens, answer_tokens=20, model=MODEL, pause_s=0.1)


def listed_healthy(router: dict) -> set[str]:
    return {w["url"] for w in workers(router) if w.get("is_healthy") and w.get("status") == "ready"}


def published(router: dict) -> set[str]:
    return {f"http://127.0.0.1:{port}" for port in router["ports"].values()}


def wait_listed(router: dict, timeout_s: float = 10.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and listed_healthy(router) != published(router):
        time.sleep(0.2)
    return listed_healthy(router)


def test_first_deploy_adds_the_declared_servers_to_the_router(routed):
    """Issue 32 item 8: membership is declared, no flag: a first deploy of servers declared behind a
    router starts them and adds each once it is verified (before: REFUSED, "`--data
    router_register=true` adds it")."""
    lab, router = routed
    write_fleet(lab, router)
    code, out = deploy(lab, "--dry")
    assert code == 0, out
    assert out.count("router lab: add it after the verify (POST /workers url http://127.0.0.1:") == 3, out
    assert "router_register" not in out and "REFUSED" not in out, out
    code, out = deploy(lab)
    assert code == 0, out
    assert out.count("router lab: verified: adding it") == 3, out
    assert wait_listed(router) == published(router), workers(router)


def test_dry_shows_the_router_steps(routed):
    lab, router = routed
    write_fleet(lab, router, {"disable-radix-cache": True})
    code, out = deploy(lab, "--dry", "--data", "rolling=true")
    assert code == 0, out
    assert out.count("router lab: leave it (DELETE /workers/") == 3, out
    assert "wait until its in-flight requests are 0" in out and "re-add it" in out, out
    # a stream longer than the drain budget is cut by the stop: said before anything stops (issue 32 item 3)
    assert out.count("what is still open then (a stream longer than that) has the stop's drain, at most 60 s "
                     "more, then is CUT by its SIGKILL") == 3, out
    assert "SIGTERM drain <= 60 s, SIGKILL of the tree: it cuts a request or stream still open" in out, out


def test_ctrl_c_while_a_left_server_drains_puts_it_back_and_the_next_deploy_is_not_refused(routed):
    """Issue 32 item 5: a real Ctrl-C (SIGINT to the real CLI's process group) while the controller
    waits for 129's in-flight requests after smg's DELETE. 129 was not stopped: it is put back into
    smg (its URL answering as 129 first) and the run exits 130 saying so (before: "interrupted before
    any hand-off: nothing was touched", 129 out of smg, the next deploy refused). A request in flight
    at 129 completes, no request through smg fails, and the next deploy is planned as any other (the
    next test's rolling deploy, no flag, is that re-run: it converges)."""
    import subprocess

    lab, router = routed
    write_fleet(lab, router, {"disable-radix-cache": True})
    before = server_info(router, 129)
    tokens = int(8.0 / float(ENV.get("SGLANG_STANDIN_TOKEN_S", "0.002")))  # a request 8 s long
    long_answer: dict = {}

    def long_request() -> None:  # smg had sent it to 129 before the DELETE
        body = json.dumps({"text": "long", "sampling_params": {"max_new_tokens": tokens}}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{router['ports']['pve1:129']}/generate", data=body,
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                long_answer["status"] = response.status
        except OSError as error:
            long_answer["error"] = repr(error)

    in_flight = threading.Thread(target=long_request, daemon=True)
    lines: list[str] = []
    with Client(router["url"]) as client:
        in_flight.start()
        proc = subprocess.Popen([pyinfra_exe(), "-y", "inventory.py", "deploy.py", "--data", f"sglang_env={json.dumps(ENV)}",
                                 "--data", "router_join_timeout_s=20", "--limit", "@pct/pve1:129"],
                                cwd=Path(__file__).resolve().parents[2], env=lab.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL, start_new_session=True)
        interrupted_while_in_flight = None
        try:
            for line in proc.stdout:
                lines.append(line)
                if "router lab: taken out (DELETE /workers/" in line and interrupted_while_in_flight is None:
                    interrupted_while_in_flight = in_flight.is_alive()
                    os.killpg(proc.pid, signal.SIGINT)  # what the terminal's Ctrl-C sends
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        in_flight.join(timeout=30)
    out = "".join(lines)
    with open(lab.dir / "deploys.log", "a") as log:
        log.write(f"=== {time.strftime('%H:%M:%S')} deploy, Ctrl-C after the leave\n{out}")
    assert interrupted_while_in_flight, out
    assert proc.returncode == 130, out
    assert "nothing was touched" not in out, out
    assert "sglang :30000 interrupted after it left router lab, before its hand-off (the server was not " \
           "stopped): putting it back into router lab" in out, out
    assert "[@pct/pve1:129] sglang :30000 interrupted before its hand-off: back in router lab, listed healthy" in out, out
    assert "stopping" not in out, out
    assert long_answer == {"status": 200}, long_answer
    assert client.failed == 0 and client.ok > 0, (client.failed, client.errors[:5], out)
    assert server_info(router, 129)["random_seed"] == before["random_seed"]  # the same process, never stopped
    assert listed_healthy(router) == published(router), workers(router)
    code, out = deploy(lab, "--dry", "--limit", "@pct/pve1:129")
    assert code == 0 and "router lab: leave it (DELETE /workers/" in out, out


def test_rolling_flag_change_behind_smg_fails_no_request(routed):
    """Every request through smg is served, whole answers and streams (issue 32 item 3): streams of
    3 s (300 tokens at the stand-ins' 100 a second) from the real OpenAI client are in flight as a
    server leaves; the leave waits for them, within the drain budget (2 s here), and one still open
    past it is said and left to the stop's drain (as long again), where it ends: all complete."""
    lab, router = routed
    write_fleet(lab, router, {"disable-radix-cache": True})
    with Client(router["url"], streams=3, stream_tokens=300) as client:
        code, out = deploy(lab, "--data", "rolling=true", "--data", "drain_timeout_s=2")
    assert code == 0, out
    assert client.failed == 0 and client.ok > 50, (client.failed, client.ok, client.errors[:5], out)
    assert client.streams_ok >= 6 and min(client.stream_s) >= 3.0, (client.streams_ok, client.stream_s)
    # a leave waited for streams in flight (the whole answers take 0.2 s, a leave with none about 0.5 s)
    waited = [float(s) for s in re.findall(r"router lab: left it; 0 requests in flight after ([0-9.]+) s", out)]
    still = re.findall(r"router lab: left it; (\d+) request\(s\) or stream\(s\) still open after 2 s: the stop's "
                       r"SIGTERM drain gives them at most 2 s more, then its SIGKILL CUTS what is still open", out)
    assert still or max(waited, default=0) >= 1.0, out
    for vmid in VMIDS:
        assert server_info(router, vmid)["disable_radix_cache"] is True
    assert listed_healthy(router) == published(router), workers(router)
    # one at a time: each rejoined before the next one left
    order = [line for line in out.splitlines() if "router lab: left it" in line or "back in router lab" in line]
    assert [("left" in line) for line in order] == [True, False] * 3, order


def test_refused_when_the_router_does_not_answer(routed):
    lab, router = routed
    write_fleet(lab, router, {"disable-radix-cache": False}, router_url="http://127.0.0.1:9")
    before = {vmid: server_info(router, vmid)["disable_radix_cache"] for vmid in VMIDS}
    code, out = deploy(lab, "--data", "rolling=true")
    assert code != 0, out
    # the first refusal stops the rolling change: the others are not even asked
    assert out.count("REFUSED, nothing touched: router lab (http://127.0.0.1:9) did not answer") == 1, out
    assert "not touched: the rolling restart stopped after the failure of @pct/pve1:129" in out, out
    assert {vmid: server_info(router, vmid)["disable_radix_cache"] for vmid in VMIDS} == before


def test_refused_when_fewer_than_min_serving_would_stay(routed):
    lab, router = routed
    write_fleet(lab, router, {"disable-radix-cache": False})
    code, out = deploy(lab, "--data", "rolling=true", "--data", "min_serving=3", "--limit", "@pct/pve1:129")
    assert code != 0, out
    assert "would leave 2 healthy worker(s)" in out and "min_serving 3" in out, out
    assert server_info(router, 129)["disable_radix_cache"] is True
    assert listed_healthy(router) == published(router)


def test_a_worker_url_that_answers_as_another_server_is_refused_before_anything_stops(routed):
    """Issue 32 item 2: one worker URL, one server. The fleet refuses two servers naming one URL; a
    --data override that makes one URL of several is refused at plan time; a URL another server
    registered (131, outside this fleet) answers as that server, not as 130: refused before the
    leave, nothing stops, 131 stays in smg, and no client through smg sees a failure."""
    lab, router = routed
    url = {vmid: f"http://127.0.0.1:{router['ports'][f'pve1:{vmid}']}" for vmid in VMIDS}
    before = {vmid: server_info(router, vmid) for vmid in VMIDS}
    change = {"disable-radix-cache": not before[130]["disable_radix_cache"]}  # a change for 130, whatever it runs
    write_fleet(lab, router, change, worker_urls={130: url[129] + "/"})
    code, out = deploy(lab, "--dry")
    assert code != 0 and f"sglang.router_url: {url[129]} is also the router_url of hosts.pve1.containers.129" \
                         f".sglang behind router lab" in out, out
    write_fleet(lab, router, change)
    code, out = deploy(lab, "--dry", "--limit", "@pct/pve1:130", "--data", f"sglang_router_url={url[129]}")
    assert code != 0 and "REFUSED, nothing touched: another desired server names its worker URL: " \
                         f"@pct/pve1:129 :30000 and @pct/pve1:130 :30000 both name worker URL {url[129]}" in out, out
    write_fleet(lab, router, change, worker_urls={130: url[131]}, vmids=(129, 130))
    with Client(router["url"]) as client:
        code, out = deploy(lab, "--limit", "@pct/pve1:130")
    assert code != 0, out
    assert f"REFUSED, nothing touched: router lab ({router['url']}) lists worker" in out, out
    assert f"at {url[131]}, but {url[131]}/get_server_info answers as a server of model_path " \
           f'"/opt/models/lab-model", port 30000 that is not this server: random_seed ' \
           f"{before[131]['random_seed']} (this server: {before[130]['random_seed']})" in out, out
    assert "left it" not in out and "stopping" not in out, out
    assert client.failed == 0 and client.ok > 0, (client.failed, client.errors[:5], out)
    assert {vmid: server_info(router, vmid) for vmid in VMIDS} == before  # the same processes, untouched
    assert listed_healthy(router) == published(router), workers(router)


def test_crash_mid_rolling_change_stops_there_leaves_it_out_and_says_so(routed):
    """The lab's crash-on-start fault crashes every start, the rollback's too: NOTHING SERVES on 130,
    which stays out of smg (said so); 129 changed and rejoined, 131 untouched; no client saw it."""
    lab, router = routed
    write_fleet(lab, router, {"disable-radix-cache": False})
    lab.fault("pve1", 130, "crash-on-start")
    try:
        with Client(router["url"]) as client:
            code, out = deploy(lab, "--data", "rolling=true")
    finally:
        lab.fault("pve1", 130, "crash-on-start", clear=True)
    assert code != 0, out
    assert "NOTHING SERVES" in out and "router lab: left out of the router" in out, out
    assert "not touched: the rolling restart stopped after the failure of @pct/pve1:130" in out, out
    assert client.failed == 0, (client.failed, client.errors[:5], out)
    assert server_info(router, 129)["disable_radix_cache"] is False       # changed
    assert server_info(router, 131)["disable_radix_cache"] is True        # untouched
    by_vmid = {vmid: f"http://127.0.0.1:{router['ports'][f'pve1:{vmid}']}" for vmid in VMIDS}
    assert listed_healthy(router) == {by_vmid[129], by_vmid[131]}, workers(router)


def test_after_the_fix_a_rerun_registers_the_left_out_server_and_finishes(routed):
    """The re-run needs no flag: 130, left out after NOTHING SERVES, is added once verified."""
    lab, router = routed
    write_fleet(lab, router, {"disable-radix-cache": False})
    with Client(router["url"]) as client:
        code, out = deploy(lab, "--data", "rolling=true")
    assert code == 0, out
    assert client.failed == 0, (client.failed, client.errors[:5], out)
    for vmid in VMIDS:
        assert server_info(router, vmid)["disable_radix_cache"] is False
    assert wait_listed(router) == published(router), workers(router)


def status(lab: Lab, *extra: str) -> tuple[int, dict]:
    result = lab.pyinfra("inventory.py", "runbooks/status.py", "--data", "format=json",
                         "--data", f"sglang_env={json.dumps(ENV)}", *extra, timeout=120)
    return result.returncode, json.loads(result.stdout.strip().splitlines()[-1])


def test_status_shows_membership_a_cordon_takes_a_server_out_and_keeps_it_out(routed, tmp_path):
    """Issue 32 item 8: membership is declared. A server declared out (router_cordon: true) is not as
    desired while smg still lists it; the deploy takes it out (leave + drain, nothing stopped, no
    client sees it), the status then calls it cordoned (as desired, not a failure), and a re-run keeps
    it out. Declared a member again, it is missing from smg (not as desired, "the deploy adds it") and
    the deploy adds it, without a restart and without a flag."""
    lab, router = routed
    url = f"http://127.0.0.1:{router['ports']['pve1:131']}"
    write_fleet(lab, router, {"disable-radix-cache": False})
    code, doc = status(lab)
    assert code == 0 and doc["ok"], doc
    assert {s["router_text"] for s in doc["servers"]} == {"lab: healthy"}, doc
    before = server_info(router, 131)

    write_fleet(lab, router, {"disable-radix-cache": False}, cordoned=(131,))
    code, doc = status(lab)
    row = next(s for s in doc["servers"] if s["vmid"] == 131)
    assert code != 0 and row["kind"] == "cordon_pending" and row["router_text"] == "lab: cordoned, still listed", row
    with Client(router["url"]) as client:
        code, out = deploy(lab, "--limit", "@pct/pve1:131")
    assert code == 0, out
    assert "serves as desired; router lab: cordoned (router_cordon: true): leave it (DELETE /workers/" in out, out
    assert "router lab: cordoned (router_cordon: true): out of the router, as declared" in out, out
    assert "stopping" not in out, out
    assert client.failed == 0 and client.ok > 0, (client.failed, client.errors[:5], out)
    assert url not in listed_healthy(router), workers(router)
    prom = tmp_path / "gpugate.prom"
    code, doc = status(lab, "--data", f"prom={prom}")
    row = next(s for s in doc["servers"] if s["vmid"] == 131)
    assert code == 0 and doc["ok"] and row["kind"] == "cordoned" and row["router_text"] == "lab: cordoned", row
    assert row["verdict"].startswith("serving as desired, cordoned: out of its router"), row
    assert 'gpugate_sglang_router_cordoned{host="pve1",vmid="131",port="30000",engine="sglang",router="lab"} 1' in prom.read_text()
    code, out = deploy(lab, "--limit", "@pct/pve1:131")
    assert code == 0 and "router lab: cordoned (router_cordon: true), out of it as declared" in out and "DELETE" not in out, out
    assert url not in listed_healthy(router), workers(router)
    assert server_info(router, 131)["random_seed"] == before["random_seed"]  # never stopped

    write_fleet(lab, router, {"disable-radix-cache": False})  # declared a member again
    deadline = time.monotonic() + 15  # smg drops the draining entry after its settle time
    while time.monotonic() < deadline and any(w["url"] == url for w in workers(router)):
        time.sleep(0.2)
    code, doc = status(lab, "--data", f"prom={prom}")
    row = next(s for s in doc["servers"] if s["vmid"] == 131)
    assert code != 0 and not doc["ok"] and row["kind"] == "unrouted" and row["router_text"] == "lab: missing", row
    assert row["verdict"].endswith("(the deploy adds it)"), row
    assert 'gpugate_sglang_router_listed{host="pve1",vmid="131",port="30000",engine="sglang",router="lab"} 0' in prom.read_text()
    code, out = deploy(lab, "--limit", "@pct/pve1:131")
    assert code == 0 and "router lab: serves as desired, not listed: adding it" in out, out
    assert "back in router lab" in out and "stopping" not in out, out
    code, doc = status(lab)
    assert code == 0 and doc["ok"], doc
    assert server_info(router, 131)["random_seed"] == before["random_seed"]


def test_router_that_goes_away_mid_run_stops_the_rolling_change(routed):
    """smg is killed while the first container is out: that container restarts and verifies (the
    transition is not interrupted), cannot rejoin and says so; the rolling change stops there."""
    import subprocess

    from gpugate_lab import core
    from gpugate_lab import router as lab_router

    lab, router = routed
    write_fleet(lab, router, {"disable-radix-cache": True})
    exe = pyinfra_exe()
    proc = subprocess.Popen([exe, "-y", "inventory.py", "deploy.py", "--data", f"sglang_env={json.dumps(ENV)}",
                             "--data", "router_join_timeout_s=5", "--data", "rolling=true"],
                            cwd=Path(__file__).resolve().parents[2], env=lab.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "router lab: left it" in line:
                os.kill(lab_router.read_state(lab.dir)["smg_pid"], signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        state = lab_router.start(lab.dir, [("pve1", vmid, 30000) for vmid in VMIDS], core.pick_port)
        router.update(url=state["url"], ports=state["ports"])
    out = "".join(lines)
    assert proc.returncode != 0, out
    assert "verified" in out and "could not re-add it to router lab" in out, out
    assert out.count("not touched: the rolling restart stopped after the failure of @pct/pve1:129") == 2, out
    assert server_info(router, 129)["disable_radix_cache"] is True
    assert server_info(router, 131)["disable_radix_cache"] is False
