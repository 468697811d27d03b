"""gpugate.router without a network: the fleet's routers: section, the settings, the preflight's
refusals and the leave/rejoin steps against a recorded fake client (the lab tests use the real smg)."""

from __future__ import annotations

import pytest

from gpugate import router
from gpugate.fleet import FleetError, fleet_to_inventory, parse_fleet
from gpugate.engine import get as engine_named
from gpugate.router.smg import RouterError, rejoin_body
from gpugate.spec import Routing, desired_state

GW = {"gw": {"url": "http://127.0.0.1:30080", "api_key_env": "GW_KEY"}}


def fleet(sglang: dict, routers: dict | None = GW) -> dict:
    doc = {"hosts": {"pve1": {"containers": {129: {"sglang": {"model_path": "/m", **sglang}}}}}}
    if routers is not None:
        doc["routers"] = routers
    return doc


def test_a_routed_server_carries_its_router_to_the_desired_state():
    groups = fleet_to_inventory(parse_fleet(fleet({"router": "gw", "router_url": "http://127.0.0.1:31129"})))
    data = groups["pve_pve1"][0][0][1]
    routing = desired_state(data).routing
    assert routing == Routing("gw", "http://127.0.0.1:30080", "http://127.0.0.1:31129", api_key_env="GW_KEY")
    assert "GW_KEY" not in str(data.get("router_endpoint"))


@pytest.mark.parametrize("sglang, routers, where", [
    ({"router": "gx", "router_url": "http://127.0.0.1:1"}, GW, "sglang.router: no router 'gx'"),
    ({"router": "gw"}, GW, "sglang.router_url: missing"),
    ({"router_url": "http://127.0.0.1:1"}, GW, "sglang.router_url: given without router"),
    ({"router": "gw", "router_url": "http://u:p@h:1"}, GW, "sglang.router_url: expected an URL"),
    ({}, {"gw": {"url": "http://h:1", "kind": "nginx"}}, "routers.gw.kind: unknown router kind"),
    ({}, {"gw": {}}, "routers.gw.url: missing"),
    ({}, {"gw": {"url": "http://h:1", "api_key": "sk-1"}}, "routers.gw.api_key: unknown key"),
])
def test_the_fleet_refuses_what_cannot_route(sglang, routers, where):
    with pytest.raises(FleetError) as error:
        parse_fleet(fleet(sglang, routers))
    assert where in str(error.value)
    assert "sk-1" not in str(error.value)


def test_router_register_is_refused_saying_what_the_deploy_does_now_and_the_cordon_needs_a_router():
    """Issue 32 item 8: the flag is no more (a declared member is added unasked); a command line or
    fleet that sets it learns why and what to write instead, before anything is touched."""
    from gpugate.settings import SettingsError, validated_settings

    with pytest.raises(SettingsError) as error:
        validated_settings({"router_register": "true"})
    assert str(error.value).startswith("setting router_register='true': no longer a setting: a server declared "
                                       "behind a router is added to it once it serves and is verified"), error.value
    assert "router_cordon: true" in str(error.value)
    with pytest.raises(FleetError) as error:
        parse_fleet(fleet({"router": "gw", "router_url": "http://127.0.0.1:1", "router_register": True}))
    assert "sglang.router_register: no longer a setting" in str(error.value)
    with pytest.raises(FleetError) as error:
        parse_fleet(fleet({"router_cordon": True}))
    assert "sglang.router_cordon: given without router" in str(error.value)
    groups = fleet_to_inventory(parse_fleet(fleet({"router": "gw", "router_url": "http://127.0.0.1:1",
                                                   "router_cordon": True})))
    assert desired_state(groups["pve_pve1"][0][0][1]).routing.cordon is True


def test_a_router_named_by_data_alone_is_the_containers_problem():
    desired = desired_state({"sglang_model_path": "/m", "sglang_router": "gw"})
    assert desired.problem and "its URL is not known" in desired.problem


class FakeClient:
    """The SmgClient surface, answering from a list and recording the calls."""

    def __init__(self, workers=None, error=None):
        self.list, self.error, self.calls = list(workers or []), error, []

    def workers(self):
        if self.error:
            raise RouterError(self.error, unreachable=True)
        return [dict(w) for w in self.list]

    def find(self, url):
        return next((w for w in self.workers() if w["url"] == url), None)

    def remove(self, worker_id):
        self.calls.append(("DELETE", worker_id))
        self.list = [dict(w, status="draining") if w["id"] == worker_id else w for w in self.list]

    def add(self, body):
        self.calls.append(("POST", body))
        self.list.append({"id": "new", "url": body["url"], "model_id": body.get("model_id"), "is_healthy": True,
                          "status": "ready"})
        return "new"


ROUTING = Routing("gw", "http://g:1", "http://a:1", min_serving=1)
A = {"id": "wa", "url": "http://a:1", "model_id": "m", "is_healthy": True, "status": "ready", "priority": 7,
     "labels": {"zone": "x"}}
B = {"id": "wb", "url": "http://b:1", "model_id": "m", "is_healthy": True, "status": "ready"}


def test_preflight_refuses_an_unreachable_router_and_too_few_peers():
    assert "did not answer" in router.preflight(ROUTING, FakeClient(error="refused")).problem
    assert "would leave 0 healthy worker(s) of m (min_serving 1)" in router.preflight(ROUTING, FakeClient([A])).problem
    ok = router.preflight(ROUTING, FakeClient([A, B]))
    assert ok.problem is None and ok.worker["id"] == "wa" and ok.peers == ["http://b:1"]


def test_a_declared_member_the_router_does_not_list_is_no_refusal_it_is_added_after_the_verify():
    """Issue 32 item 8: membership is declared; before, a first deploy was refused ('does not list
    this server; `--data router_register=true` adds it')."""
    pre = router.preflight(ROUTING, FakeClient([B]))
    assert pre.problem is None and pre.worker is None, pre
    assert pre.lines(ROUTING, 60) == [
        "router gw: not listed there: the restart goes on without leaving it",
        "router gw: add it after the verify (POST /workers url http://a:1) and wait until it is listed healthy"]
    assert "router_register" not in " ".join(pre.lines(ROUTING, 60))


def test_a_cordoned_server_leaves_and_its_steps_say_it_stays_out():
    cordoned = Routing("gw", "http://g:1", "http://a:1", cordon=True)
    listed = router.preflight(cordoned, FakeClient([A, B]))
    assert listed.problem is None
    lines = listed.lines(cordoned, 60, restart=False)
    assert lines[0].startswith("router gw: cordoned (router_cordon: true): leave it (DELETE /workers/wa;"), lines
    assert "wait until its in-flight requests are 0" in lines[1] and "re-add" not in " ".join(lines), lines
    assert "the server is not stopped" in lines[1] and "SIGKILL" not in lines[1], lines
    assert lines[2] == "router gw: it stays out (router_cordon: false puts it back)"
    assert listed.lines(cordoned, 60)[2] == "router gw: it stays out after the verify (router_cordon: false puts it back)"
    out = router.preflight(cordoned, FakeClient([B]))
    assert out.lines(cordoned, 60) == ["router gw: cordoned (router_cordon: true) and not listed there: it stays out"]
    # the min_serving guard holds for a cordon too: it never takes out the last healthy worker
    assert "min_serving 1" in router.preflight(cordoned, FakeClient([A])).problem


def test_membership_shows_a_cordoned_server_as_such():
    cordoned = Routing("gw", "http://g:1", "http://a:1", cordon=True)
    assert router.membership(cordoned, [B])["state"] == "cordoned"
    assert router.membership(cordoned, [dict(A, status="draining")])["state"] == "cordoned"
    assert router.membership(cordoned, [A])["state"] == "cordoned, still listed"
    assert router.membership(ROUTING, [B])["state"] == "missing"


def test_the_preflights_refusal_carries_its_kind_for_code_to_decide_on():
    """The operation tells the refusals apart by ``kind``, never by words."""
    assert router.preflight(ROUTING, FakeClient(error="refused")).kind == "no-answer"
    assert router.preflight(ROUTING, FakeClient([A])).kind == "min-serving"
    assert router.preflight(ROUTING, FakeClient([A, B])).kind is None


def test_leave_removes_then_waits_for_zero_in_flight(monkeypatch):
    reads = iter([3, 1, 0, 0])
    monkeypatch.setattr(router, "in_flight", lambda url, read: next(reads))
    client, said = FakeClient([A, B]), []
    router.leave(ROUTING, client, 60, said.append, sleep=lambda s: None)
    assert client.calls == [("DELETE", "wa")]
    assert said[0] == ("router gw: taken out (DELETE /workers/wa); waiting until its in-flight requests are 0 "
                       "(at most 60 s)")
    assert "0 requests in flight" in said[-1]


def test_leave_never_deletes_a_worker_whose_removal_is_under_way(monkeypatch):
    # smg removes by URL when a removal ends: a second DELETE of an entry already draining (an earlier
    # run's, NOTHING SERVES) ended after the re-add and took the new entry out (CI, test_router_lab)
    monkeypatch.setattr(router, "in_flight", lambda url, read: None)
    draining = dict(A, status="draining")
    client, said = FakeClient([draining, B]), []
    router.leave(ROUTING, client, 60, said.append, sleep=lambda s: None)
    assert client.calls == []
    pre = router.preflight(ROUTING, FakeClient([draining, B]))
    assert "already leaving it" in pre.lines(ROUTING, 60)[0] and "DELETE /workers" not in pre.lines(ROUTING, 60)[0]
    gone = FakeClient([B])
    router.leave(ROUTING, gone, 60, said.append, sleep=lambda s: None)  # removed since the preflight
    assert gone.calls == []
    with pytest.raises(RouterError):  # unreachable now: refused, never a stop on a stale 'draining'
        router.leave(ROUTING, FakeClient([draining, B], error="refused"), 60, said.append,
                     sleep=lambda s: None)


def test_leave_does_not_wait_out_the_budget_for_a_count_it_cannot_read(monkeypatch):
    # a routed server that is not running (left out after NOTHING SERVES) answers nothing: the
    # leave waited out the whole 60 s drain budget on it before the start
    reads = []
    monkeypatch.setattr(router, "in_flight", lambda url, read: reads.append(url))
    clock = iter(range(1000))
    said = []
    router.leave(ROUTING, FakeClient([A, B]), 60, said.append, now=lambda: next(clock), sleep=lambda s: None)
    assert len(reads) == 2 and "cannot be read" in said[-1]


def test_a_stream_longer_than_the_drain_budget_is_said_before_the_stop(monkeypatch):
    """Issue 32 item 3: the drain budget runs out with requests still open (a long stream): the leave
    says, right before the stop, how many are open and that what outlasts the stop's drain is cut by
    its SIGKILL, never silently; --dry named the same budget for them before anything stopped."""
    monkeypatch.setattr(router, "in_flight", lambda url, read: 2)
    clock = iter(range(1000))
    said = []
    router.leave(ROUTING, FakeClient([A, B]), 5, said.append, now=lambda: next(clock), sleep=lambda s: None)
    assert said[-1] == ("router gw: left it; 2 request(s) or stream(s) still open after 5 s: the stop's SIGTERM "
                        "drain gives them at most 5 s more, then its SIGKILL CUTS what is still open")
    dry = router.preflight(ROUTING, FakeClient([A, B])).lines(ROUTING, 5)[1]
    assert "at most 5 s); what is still open then (a stream longer than that) has the stop's drain, at most 5 s " \
           "more, then is CUT by its SIGKILL" in dry, dry


def test_an_interrupted_leave_stops_waiting_at_its_next_look(monkeypatch):
    """Issue 32 item 5: the run was interrupted while the server's requests were still in flight:
    the leave returns (the caller puts it back) instead of waiting out the drain budget."""
    reads = []
    monkeypatch.setattr(router, "in_flight", lambda url, read: reads.append(url) or 3)
    interrupted = iter([False, False, False, True])
    client, said = FakeClient([A, B]), []
    router.leave(ROUTING, client, 60, said.append, sleep=lambda s: None, stop=lambda: next(interrupted))
    assert client.calls == [("DELETE", "wa")] and len(reads) == 2
    assert len(said) == 1 and "taken out" in said[0]  # no "left it; 0 requests in flight"


def test_put_back_adds_it_as_it_was_only_when_its_url_still_answers_as_this_server(monkeypatch):
    monkeypatch.setattr(router, "server_ready", lambda url, paths: True)
    seen = {"server_info": {"path": "/get_server_info", "args": {"port": 30000, "random_seed": 811}}}
    monkeypatch.setattr(router, "identity_problem", lambda url, observed, read_info: None)
    client = FakeClient([B])  # smg dropped the draining entry already
    ok, message = router.put_back(ROUTING, client, A, seen, 30, lambda line: None,
                                  sleep=lambda s: None)
    assert ok and "back in router gw, listed healthy" in message, message
    assert client.calls == [("POST", rejoin_body(A, "http://a:1", "sglang"))]
    # another server answers there now (the container was changed by hand meanwhile): not added
    monkeypatch.setattr(router, "identity_problem", lambda url, observed, read_info: "http://a:1 answers as another")
    client = FakeClient([B])
    ok, message = router.put_back(ROUTING, client, A, seen, 30, lambda line: None,
                                  sleep=lambda s: None)
    assert not ok and message == "not put back into router gw: http://a:1 answers as another", message
    assert client.calls == []


def test_rejoin_waits_out_the_draining_entry_then_adds_it_back_as_it_was(monkeypatch):
    monkeypatch.setattr(router, "server_ready", lambda url, paths: True)
    client = FakeClient([dict(A, status="draining"), B])
    ticks = iter(range(100))

    def sleep(_s):  # smg drops the draining entry after its settle time
        if next(ticks) == 2:
            client.list = [B]
    ok, message = router.rejoin(ROUTING, client, A, 30, lambda line: None, sleep=sleep)
    assert ok and "listed healthy" in message
    assert client.calls == [("POST", rejoin_body(A, "http://a:1", "sglang"))]
    assert client.calls[0][1]["priority"] == 7 and client.calls[0][1]["labels"] == {"zone": "x"}


def routed_controller(monkeypatch, listed: dict | None):
    """The controller's side of one routed container, without pyinfra's run nor a router: its lines
    (``said``), the worker entries it re-added or added (``rejoined``), smg listing ``listed``."""
    from types import SimpleNamespace

    from gpugate.operations import sglang as ops

    book = ops.Run()  # this run's book, without its interrupt handlers
    monkeypatch.setattr(ops, "state", SimpleNamespace(callback_handlers=[book]))
    said: list[str] = []
    host = SimpleNamespace(name="@pct/pve1:129", data={"pct_vmid": 129}, log=said.append,
                           log_styled=lambda text, **_: said.append(text))
    rejoined: list = []
    monkeypatch.setattr(ops, "emit", lambda *args, **fields: None)
    monkeypatch.setattr(router, "preflight", lambda routing, *args, **kw: router.Preflight(listed, [], None))
    monkeypatch.setattr(router, "rejoin", lambda routing, client, worker, timeout_s, say, **kw: (
        rejoined.append(worker), (True, "back in router gw, listed healthy after 5.2 s (worker wc)"))[1])
    job = SimpleNamespace(rolling=False, plan=SimpleNamespace(action="attach", attach_run="R1", target=None),
                          observation={}, routing=ROUTING, router_worker=None, port=30000, audit_log=None, spec=None)
    return SimpleNamespace(ops=ops, book=book, host=host, job=job, said=said, rejoined=rejoined)


def test_a_rerun_that_follows_a_dead_controllers_run_adds_the_server_it_left_draining(monkeypatch):
    """Issue 32, not yet tried: the controller was SIGKILLed after smg's DELETE, while its run's gated
    engine waited at its gate; the re-run follows that run to verified. smg still lists the server
    as draining (the dead controller's removal, within smg's settle time, then dropped): no
    membership, so the re-run re-adds it as it was (before: nothing said, exit 0, and the server out
    of smg for good once the entry went; seen in tests/e2e/test_router_gated_lab.py)."""
    run = routed_controller(monkeypatch, dict(A, status="draining"))

    def follow(host_obj, job, attach_run, depth=0):  # the run it follows ends verified
        run.book.outcomes[host_obj.name] = "verified"
        return True

    monkeypatch.setattr(run.ops, "_attach", follow)
    assert run.ops._execute(run.ops.state, run.host, run.job) is True
    assert run.rejoined == [dict(A, status="draining")]  # re-added as it was: its priority, its labels
    assert ("sglang :30000 router gw: the run it followed ended verified, listed draining (taken out before the "
            "run, by a controller that is gone): re-adding it") in run.said, run.said
    assert "sglang :30000 back in router gw, listed healthy after 5.2 s (worker wc)" in run.said, run.said


@pytest.mark.parametrize("attached", [False, True])
def test_a_rollback_of_a_server_its_router_does_not_list_adds_the_previous_server(monkeypatch, attached):
    """A routed server out of smg (a controller that died after its leave; removed by hand) whose
    run rolls back: the previous server serves again, verified, and is a member as before the run
    (before: left out, nothing said, though the plan had said "add it after the verify"; every
    later rollback too, until the desired server verifies)."""
    run = routed_controller(monkeypatch, None)
    if attached:  # a re-run that follows the run to its rollback
        def follow(host_obj, job, attach_run, depth=0):
            run.book.outcomes[host_obj.name] = "rolled_back"
            return False

        monkeypatch.setattr(run.ops, "_attach", follow)
        assert run.ops._execute(run.ops.state, run.host, run.job) is False  # the change was not made
        why = "the run it followed ended rolled back (the previous server serves again), not listed"
    else:
        assert run.ops._after_transition(run.host, run.job, "R1", "rolled_back") is True
        why = "rolled back: the previous server serves again"
    assert run.rejoined == [None], run.said  # added (no entry to re-add as it was)
    assert f"sglang :30000 router gw: {why}: adding it" in run.said, run.said


# each engine's /metrics page as it serves it (its gauge names, a label set per rank or engine core)
IN_FLIGHT_PAGES = {
    "sglang": ('sglang:num_running_reqs{tp_rank="0"} 2.0\nsglang:num_running_reqs{tp_rank="1"} 1.0\n'
               'sglang:num_queue_reqs{tp_rank="0"} 4.0\nsglang:other 9\n'),
    "vllm": ('# TYPE vllm:num_requests_running gauge\n'
             'vllm:num_requests_running{engine="0",model_name="m"} 5.0\n'
             'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\nvllm:num_preemptions_total 3.0\n'),
}


@pytest.mark.parametrize("name", sorted(IN_FLIGHT_PAGES))
def test_the_in_flight_count_sums_the_engines_own_gauges_over_every_rank(name):
    page = IN_FLIGHT_PAGES[name].encode()
    assert engine_named(name).in_flight(lambda path: (200, page) if path == "/metrics" else (404, b"")) == 7
    # the other engine's page is not this server's count: unknown, never 0
    other = next(p for n, p in IN_FLIGHT_PAGES.items() if n != name).encode()
    assert engine_named(name).in_flight(lambda path: (200, other) if path == "/metrics" else (404, b"")) is None


def test_a_worker_goes_back_with_its_engines_runtime():
    assert rejoin_body(None, "http://a:1", engine_named("vllm").router_runtime) == {"url": "http://a:1", "runtime": "vllm"}
    assert rejoin_body(None, "http://a:1", engine_named("sglang").router_runtime)["runtime"] == "sglang"


def test_the_api_key_is_never_in_a_message(monkeypatch):
    from gpugate.router.smg import SmgClient
    monkeypatch.setenv("GW_KEY", "sk-secret-123")
    with pytest.raises(RouterError) as error:
        SmgClient("http://127.0.0.1:9", "GW_KEY").workers()
    assert "sk-secret-123" not in str(error.value)
    monkeypatch.delenv("GW_KEY")
    with pytest.raises(RouterError) as error:
        SmgClient("http://127.0.0.1:9", "GW_KEY").workers()
    assert "$GW_KEY (its API key) is not set" in str(error.value)
