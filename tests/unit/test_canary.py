"""The canary's judgement (gpugate.canary, docs/canary.md): SGLang's /metrics pages of a canary and
its unchanged replicas at the start and end of a soak (tests/unit/data/canary_sglang.json: the
pages as SGLang's collector.py writes them, with its default buckets) give the verdict an operator
expects; the quantiles are Prometheus' histogram_quantile; the setting is checked before anything."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from gpugate import canary
from gpugate.engine import get as engine
from gpugate.fleet import FleetError, fleet_to_inventory, parse_fleet
from gpugate.settings import SettingsError, validated_settings
from gpugate.spec import desired_state

DATA = json.loads((Path(__file__).parent / "data" / "canary_sglang.json").read_text())
SGLANG = engine("sglang").canary_metrics


def verdict_of(case):
    seconds = DATA["soak_s"]
    mine = canary.window(canary.parse(case["canary"]["start"]), canary.parse(case["canary"]["end"]), SGLANG, seconds)
    others = canary.pooled([canary.window(canary.parse(side["start"]), canary.parse(side["end"]), SGLANG, seconds)
                            for side in case["others"]])
    return canary.judge(mine, others, canary.policy(DATA["policy"]))


@pytest.mark.parametrize("name", sorted(DATA["cases"]))
def test_the_verdict_on_sglang_pages(name):
    case = DATA["cases"][name]
    verdict = verdict_of(case)
    assert verdict.kind == case["expect"]["kind"], (verdict.kind, verdict.reasons)
    for words in case["expect"].get("reasons", []):
        assert any(words in reason for reason in verdict.reasons), verdict.reasons
    if verdict.kind == "pass":
        assert not verdict.reasons


def test_a_regression_shows_the_figures_side_by_side():
    verdict = verdict_of(DATA["cases"]["a slow decode on the canary (3x inter-token latency) is a regression"])
    table = "\n".join(canary.side_by_side(verdict, "2 others"))
    itl = next(line for line in table.splitlines() if line.strip().startswith("ITL p95"))
    assert "REGRESSION" in itl and "at most 1.25x" in itl
    # the canary's p95 and the others' are both shown: 3x the decode time, as the buckets resolve it
    c, o = (float(word) for word in itl.split() if word.replace(".", "").isdigit())
    assert 2.5 < c / o < 4.5
    assert "requests" in table and "150" in table
    assert verdict.canary["itl_p95_s"] and verdict.others["requests"] == 300


def test_a_slower_canary_the_router_sent_fewer_requests_says_what_they_show():
    """A load-aware router (smg) sends a slower server fewer requests: in the lab a 4x slower canary got
    11 requests where each other got 38. Too few for a verdict, but the answer says that the others had
    enough and what the few already show, not only "send more traffic"."""
    slow = DATA["cases"]["a slow decode on the canary (3x inter-token latency) is a regression"]  # 150 vs 300
    seconds = DATA["soak_s"]
    mine = canary.window(canary.parse(slow["canary"]["start"]), canary.parse(slow["canary"]["end"]), SGLANG, seconds)
    others = canary.pooled([canary.window(canary.parse(side["start"]), canary.parse(side["end"]), SGLANG, seconds)
                            for side in slow["others"]])
    verdict = canary.judge(mine, others, canary.policy({"soak_s": 60, "min_requests": 200}))
    assert verdict.kind == "low-traffic", verdict
    assert verdict.reasons[0] == "the canary served 150 request(s) in 60 s, under min_requests 200"
    assert "the router sent it fewer than the others" in verdict.reasons[-1] and "ITL p95" in verdict.reasons[-1]
    like = DATA["cases"]["a canary like the others passes"]
    mine = canary.window(canary.parse(like["canary"]["start"]), canary.parse(like["canary"]["end"]), SGLANG, seconds)
    others = canary.pooled([canary.window(canary.parse(side["start"]), canary.parse(side["end"]), SGLANG, seconds)
                            for side in like["others"]])
    alike = canary.judge(mine, others, canary.policy({"soak_s": 60, "min_requests": mine.requests + 1}))
    assert alike.kind == "low-traffic" and others.requests > mine.requests, alike
    assert not any("breaks a limit" in reason for reason in alike.reasons), alike.reasons


def test_the_window_counts_only_the_soak():
    """A canary whose history before the soak was slow (5 s to the first token) is judged on the
    window: the bucket deltas, not the counters since its start."""
    case = DATA["cases"]["a slow history before the soak does not count against the canary"]
    whole = canary.histogram(canary.parse(case["canary"]["end"]), "sglang:time_to_first_token_seconds")
    assert canary.quantile(0.5, whole) > 4  # since start: the slow history dominates
    assert verdict_of(case).canary["ttft_p95_s"] <= 0.4  # the window: 0.15-0.225 s, in the (0.2, 0.4] bucket


def test_a_server_restarted_in_the_window_counts_from_zero():
    start = canary.parse('r_total 500\nh_bucket{le="1.0"} 500\nh_bucket{le="+Inf"} 500\n')
    end = canary.parse('r_total 20\nh_bucket{le="1.0"} 20\nh_bucket{le="+Inf"} 20\n')
    window = canary.window(start, end, {"requests": ("r_total",), "ttft": ("h",)}, 10)
    assert window.requests == 20 and window.histograms["ttft"] == {1.0: 20.0, math.inf: 20.0}


def test_vllm_errors_and_aborts_are_read_by_their_finished_reason():
    roles = engine("vllm").canary_metrics
    page = canary.parse('vllm:request_success_total{engine="0",finished_reason="stop"} 90\n'
                        'vllm:request_success_total{engine="0",finished_reason="length"} 4\n'
                        'vllm:request_success_total{engine="0",finished_reason="abort"} 4\n'
                        'vllm:request_success_total{engine="0",finished_reason="error"} 2\n')
    window = canary.window({}, page, roles, 10)
    assert (window.requests, window.failed, window.percent("failed")) == (100, 6, 6.0)


def test_no_other_replica_is_no_baseline_and_a_page_that_is_no_page_is_refused():
    assert canary.judge(canary.Window(5), None, canary.Policy()).kind == "no-baseline"
    verdict = canary.soak("http://c", [], SGLANG, canary.Policy(soak_s=1), lambda url: "r 1\n", lambda line: None)
    assert verdict.kind == "no-baseline" and "no other replica" in verdict.reasons[0]
    with pytest.raises(ValueError, match="not a Prometheus text page"):
        canary.parse("x{ 1\n")


def test_a_soak_says_its_figures_at_each_look_and_never_more_than_10_s_apart():
    clock = [0.0]
    said: list[str] = []
    looks: list[float] = []

    def sleep(seconds):
        looks.append(seconds)
        clock[0] += seconds

    canary.soak("http://c", ["http://o"], SGLANG, canary.Policy(soak_s=45, min_requests=0),
                lambda url: DATA["cases"]["a canary like the others passes"]["canary"]["end"], said.append,
                now=lambda: clock[0], sleep=sleep)
    assert max(looks) <= canary.PROGRESS_EVERY_S and sum(looks) == pytest.approx(45)
    assert len(said) == len(looks) and all(line.startswith("canary soak ") for line in said)
    assert said[-1].startswith("canary soak 45/45 s")


def _soak_where(silent: dict[str, int], urls=("http://c", "http://o1", "http://o2")):
    """A soak of 45 s in which each server in ``silent`` stops answering from its Nth read on;
    -> (verdict, lines said)."""
    clock, reads, said = [0.0], {url: 0 for url in urls}, []
    page = DATA["cases"]["a canary like the others passes"]["canary"]["end"]

    def read(url):
        reads[url] += 1
        return None if reads[url] >= silent.get(url, 10 ** 6) else page

    def sleep(seconds):
        clock[0] += seconds

    verdict = canary.soak(urls[0], list(urls[1:]), SGLANG, canary.Policy(soak_s=45, min_requests=0), read,
                          said.append, now=lambda: clock[0], sleep=sleep)
    return verdict, said


def test_a_replica_that_goes_silent_leaves_the_baseline_and_a_silent_canary_is_a_regression():
    verdict, said = _soak_where({"http://o2": 3})  # the third read: the second look
    assert verdict.kind == "pass"
    assert [line for line in said if "stopped answering" in line] == [
        "canary soak: http://o2 stopped answering its /metrics 20 s into the soak: it leaves the baseline "
        "(1 unchanged replica(s) left)"]
    verdict, said = _soak_where({"http://o1": 2, "http://o2": 2})
    assert verdict.kind == "no-baseline" and "every unchanged replica stopped answering" in verdict.reasons[0]
    verdict, said = _soak_where({"http://c": 3})
    assert verdict.kind == "regression" and verdict.reasons == [
        "the canary stopped answering its /metrics at http://c 20 s into the soak (its figures until then below)"]
    assert verdict.rows  # the figures it had, side by side


def test_the_unchanged_replicas_are_those_of_the_canarys_model_and_an_unlisted_canary_has_none():
    from gpugate import router
    from gpugate.spec import Routing

    class Listing:
        def __init__(self, workers):
            self.listed = workers

        def workers(self):
            return self.listed

    def worker(url, model):
        return {"url": url, "model_id": model, "is_healthy": True, "status": "ready"}

    routing = Routing("gw", "http://gw:1", "http://c:1")
    others = [worker("http://a:1", "m"), worker("http://b:1", "other-model")]
    assert router.peers_of(routing, Listing([worker("http://c:1", "m"), *others])) == ["http://a:1"]
    with pytest.raises(router.RouterError, match="http://c:1 is not listed"):
        router.peers_of(routing, Listing(others))


# ---------------------------------------------------------------- quantiles, for any histogram
buckets = st.lists(st.floats(min_value=0.001, max_value=1e4, allow_nan=False), min_size=1, max_size=12, unique=True)


@settings(max_examples=200, deadline=None)
@given(bounds=buckets, counts=st.lists(st.integers(min_value=0, max_value=1000), min_size=13, max_size=13),
       q=st.floats(min_value=0.01, max_value=1.0), r=st.floats(min_value=0.01, max_value=1.0))
def test_a_quantile_lies_in_the_buckets_and_grows_with_q(bounds, counts, q, r):
    bounds = sorted(bounds)
    cumulative, total = {}, 0
    for bound, count in zip(bounds + [math.inf], counts):
        total += count
        cumulative[bound] = float(total)
    low, high = sorted((q, r))
    a, b = canary.quantile(low, cumulative), canary.quantile(high, cumulative)
    if total == 0:
        assert a is None and b is None
        return
    assert 0 <= a <= b <= bounds[-1]


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(min_value=0.0005, max_value=7.9), min_size=1, max_size=200))
def test_the_quantile_of_a_histogram_brackets_the_true_one(values):
    """The estimate lies in the bucket that holds the true quantile (Prometheus' promise)."""
    bounds = [0.002, 0.004, 0.008, 0.02, 0.04, 0.1, 0.2, 0.4, 1.0, 2.0, 4.0, 8.0]
    cumulative = {bound: float(sum(1 for v in values if v <= bound)) for bound in bounds}
    cumulative[math.inf] = float(len(values))
    ordered = sorted(values)
    true = ordered[max(0, math.ceil(0.95 * len(values)) - 1)]
    upper = next(bound for bound in bounds if true <= bound)
    lower = max([0.0] + [bound for bound in bounds if bound < true])
    assert lower - 1e-9 <= canary.quantile(0.95, cumulative) <= upper + 1e-9


@settings(max_examples=100, deadline=None)
@given(requests=st.integers(min_value=0, max_value=10_000), failed=st.integers(min_value=0, max_value=100),
       spread=st.floats(min_value=0.001, max_value=5.0))
def test_a_canary_that_behaves_as_the_others_never_regresses(requests, failed, spread):
    page = canary.parse(f'r_total {requests}\na_total {min(failed, requests)}\n'
                        f'h_bucket{{le="{spread}"}} {requests // 2}\nh_bucket{{le="{spread * 2}"}} {requests}\n'
                        f'h_bucket{{le="+Inf"}} {requests}\n')
    roles = {"requests": ("r_total",), "aborts": ("a_total",), "ttft": ("h",), "itl": ("h",)}
    side = canary.window({}, page, roles, 60)
    verdict = canary.judge(side, canary.pooled([side, side]), canary.Policy(min_requests=0))
    assert verdict.kind == "pass", verdict.reasons


# ---------------------------------------------------------------- the setting
def test_the_setting_is_off_by_default_and_checked_before_anything():
    assert desired_state({"sglang_model_path": "/m"}).routing is None
    assert validated_settings({"canary": "off"}) == {"canary": None}
    for value, words in (({"soak_s": 0}, "canary.soak_s: must be more than 0"),
                         ({"ttft_p95_ratio": 0.9}, "canary.ttft_p95_ratio: a ratio"),
                         ({"min_requests": -1}, "canary.min_requests: must not be negative"),
                         # 0 passed a soak that served no request at all, judged on nothing
                         ({"min_requests": 0}, "canary.min_requests: at least 1 request a side"),
                         # the run waits the soak out: 1e9 s is a typo, never a soak
                         ({"soak_s": 1e9}, "canary.soak_s: must be more than 0 seconds and at most a day"),
                         ({"soak": 5}, "did you mean soak_s"),
                         ("soak_s", "key=value pairs"), ([1], "expected a mapping")):
        with pytest.raises(SettingsError, match=words):
            validated_settings({"canary": value})


@settings(max_examples=100, deadline=None)
@given(key=st.text(min_size=1, max_size=20).filter(lambda k: k not in canary.Policy.__dataclass_fields__))
def test_an_unknown_canary_key_is_refused_by_name(key):
    with pytest.raises(SettingsError, match="canary"):
        validated_settings({"canary": {key: 1}})


ROUTED = {"sglang_model_path": "/m", "sglang_router": "gw", "router_endpoint": "http://127.0.0.1:1",
          "sglang_router_url": "http://127.0.0.1:2"}


def test_a_canary_adds_the_metrics_flag_makes_the_change_rolling_and_refuses_metrics_off():
    desired = desired_state({**ROUTED, "canary": "soak_s=5,min_requests=10"})
    assert desired.rolling and desired.routing.canary["soak_s"] == 5.0 and desired.routing.canary["min_requests"] == 10
    assert "--enable-metrics" in desired.spec.argv
    assert "--enable-metrics" not in desired_state(ROUTED).spec.argv
    # cordoning a replica (out of its router, kept out) must not restart it to drop its metrics
    cordoned = desired_state({**ROUTED, "canary": True, "sglang_router_cordon": True})
    assert cordoned.spec.argv == desired_state({**ROUTED, "canary": True}).spec.argv
    refused = desired_state({**ROUTED, "canary": True, "sglang_flags": {"enable-metrics": False}})
    assert refused.spec is None and "--enable-metrics: a canary judges this server by its /metrics" in refused.problem


def test_vllm_with_its_stats_off_is_refused_with_a_canary():
    """vLLM v1 makes its Prometheus stat logger only with log stats on: --disable-log-stats leaves no
    vllm:* metric to judge by. Refused with a canary (in flags or extra_args), kept without one."""
    from gpugate.engine import FlagError, ServerInputs

    vllm = engine("vllm")
    for written in ({"flags": {"disable-log-stats": True}}, {"extra_args": ("--disable-log-stats",)}):
        with pytest.raises(FlagError, match="--disable-log-stats: a canary judges this server by its /metrics"):
            vllm.launch(ServerInputs(engine="vllm", model_path="/m", port=8001, metrics=True, **written), "0.33.0")
    kept = vllm.launch(ServerInputs(engine="vllm", model_path="/m", port=8001, flags={"disable-log-stats": True}),
                       "0.33.0")
    assert "--disable-log-stats" in kept.argv


def fleet(router=None, **top):
    return {**top, "routers": {"gw": {"url": "http://127.0.0.1:30080", **(router or {})}},
            "hosts": {"pve1": {"ssh": {"hostname": "10.0.0.5"}, "containers": {
                129: {"sglang": {"model_path": "/m", "router": "gw", "router_url": "http://10.0.0.9:30000"}},
                130: {"sglang": {"model_path": "/m", "port": 30001}}}}}}


def test_fleet_yaml_top_level_and_a_routers_entry():
    top = fleet_to_inventory(parse_fleet(fleet(canary={"soak_s": 30})))["pve_pve1"][0]
    assert top[0][1]["canary"]["soak_s"] == 30.0 and top[1][1]["canary"]["soak_s"] == 30.0
    routed = fleet_to_inventory(parse_fleet(fleet(canary={"soak_s": 30}, router={"canary": {"soak_s": 10}})))
    data = dict(routed["pve_pve1"][0])
    assert data["@pct/pve1:129"]["canary"]["soak_s"] == 10.0  # the router's entry over the top level
    assert data["@pct/pve1:130"]["canary"]["soak_s"] == 30.0
    assert desired_state(data["@pct/pve1:130"]).rolling is False  # not routed: no canary, no rolling of its own
    with pytest.raises(FleetError, match=r"canary.*canary\.soak_s: expected a number"):
        parse_fleet(fleet(canary={"soak_s": "two minutes"}))
    with pytest.raises(FleetError, match=r"routers\.gw\.canary.*did you mean itl_p95_ratio"):
        parse_fleet(fleet(router={"canary": {"itl_p95_ration": 2}}))


def controller_canary(monkeypatch, case: str, **policy):
    """The controller's canary step (gpugate.operations.sglang._canary) for one container, without
    pyinfra's run, a router or a container: the router lists ``case``'s others, /metrics answers its
    pages (the start, then the end), the rollback is recorded, not run."""
    from types import SimpleNamespace

    from gpugate import router
    from gpugate.operations import sglang as ops
    from gpugate.spec import Routing

    pages = DATA["cases"][case]
    book = ops.Run()  # this run's book, without its interrupt handlers
    monkeypatch.setattr(ops, "state", SimpleNamespace(callback_handlers=[book]))
    others = [f"http://o{i}:1" for i in range(len(pages["others"]))]
    sides = {"http://a:1": pages["canary"], **dict(zip(others, pages["others"]))}
    reads: dict[str, int] = {}

    def metrics_page(url, *args, **kwargs):
        reads[url] = reads.get(url, 0) + 1
        return sides[url]["start" if reads[url] == 1 else "end"]

    monkeypatch.setattr(router, "peers_of", lambda routing: others)
    monkeypatch.setattr(router, "metrics_page", metrics_page)
    out = SimpleNamespace(said=[], records=[], audit=[], restored=[], ops=ops, book=book)
    monkeypatch.setattr(ops, "emit", lambda step, **fields: out.audit.append((step, fields)))
    monkeypatch.setattr(ops, "_record_canary", lambda host_obj, job, record: out.records.append(dict(record)))

    def restore(state, host_obj, job):
        out.restored.append(host_obj.name)
        book.outcomes[host_obj.name] = "verified"
        return True

    monkeypatch.setattr(ops, "_restore_canary", restore)
    rule = {**canary.policy({}).__dict__, "soak_s": 0.01, **policy}  # one look: no waiting in a unit test
    routing = Routing("gw", "http://g:1", "http://a:1", canary=rule)
    out.host = SimpleNamespace(name="@pct/pve1:129", data={"pct_vmid": 129}, log=out.said.append,
                               log_styled=lambda text, **_: out.said.append(text))
    out.job = SimpleNamespace(routing=routing, port=30000, audit_log=None)
    out.ok = ops._canary(ops.state, out.host, out.job, "R1")
    return out


def test_a_regression_rolls_the_canary_back_and_stops_the_rolling_change(monkeypatch):
    run = controller_canary(monkeypatch, "a slow decode on the canary (3x inter-token latency) is a regression")
    assert run.ok is False and run.restored == ["@pct/pve1:129"]
    assert run.book.failed == ["@pct/pve1:129"]  # the rolling change stops on it (Run.stop_rolling)
    assert run.book.outcomes["@pct/pve1:129"] == ("canary REGRESSION: rolled back to its last good spec (verified, "
                                                  "back in the router)")
    assert any(line.startswith("sglang :30000 canary REGRESSION: ITL p95") for line in run.said), run.said
    assert any(line.strip().startswith("ITL p95") and line.rstrip().endswith("REGRESSION") for line in run.said)
    assert run.records[0]["state"] == "soaking" and run.records[-1]["verdict"] == "regression"
    assert run.records[-1]["rolled_back"] is True
    event = next(fields for step, fields in run.audit if step == "canary")
    assert event["verdict"] == "regression" and event["canary"]["requests"] == 150 and event["others"]["requests"] == 300


def test_the_audit_log_keeps_every_figure_of_a_canary(monkeypatch):
    """The audit log masks what names a secret (a key that names a token among them): none of the
    canary's figures, the throughput included, is masked."""
    from gpugate.audit import REDACTED, redact

    run = controller_canary(monkeypatch, "a canary like the others passes")
    event = next(fields for step, fields in run.audit if step == "canary")
    logged = redact(event)
    for side in ("canary", "others"):
        assert REDACTED not in logged[side].values(), logged[side]
        assert logged[side] == event[side]


def test_an_interrupt_during_the_soak_says_the_canary_runs_the_new_spec_unjudged(monkeypatch):
    """Ctrl-C while the canary soaks exits at once: the controller says that the canary was changed
    and has no verdict (never "nothing was touched"), and that the next deploy will not soak it."""
    import signal

    from gpugate import router
    from gpugate.operations import sglang as ops

    said: list[list[str]] = []

    def canary_run(*args, **kwargs):  # inside the harness: its book and its /metrics pages
        book, pages = ops.Run.of(ops.state), router.metrics_page

        def interrupted_read(url, *args, **kwargs):
            if not said:
                book.on_interrupt(signal.SIGINT, None)  # its exit (os._exit) recorded, not taken
            return pages(url, *args, **kwargs)

        monkeypatch.setattr(book, "_exit", lambda signum, lines: said.append(lines))
        monkeypatch.setattr(router, "metrics_page", interrupted_read)
        return real(*args, **kwargs)

    real = ops._canary
    monkeypatch.setattr(ops, "_canary", canary_run)
    controller_canary(monkeypatch, "a canary like the others passes")
    lines = said[0]
    assert not any("nothing was touched" in line for line in lines), lines
    assert any(line.startswith("[@pct/pve1:129] sglang :30000 interrupted during its canary soak") and
               "runs the new spec" in line and "NO verdict" in line and "does not soak it again" in line
               for line in lines), lines


def test_a_pass_lets_the_rest_roll_and_too_little_traffic_goes_on_only_when_told(monkeypatch):
    run = controller_canary(monkeypatch, "a canary like the others passes")
    assert run.ok is True and run.restored == [] and run.book.failed == [] and run.records[-1]["verdict"] == "pass"
    assert any("canary PASSED its 0.01 s soak" in line for line in run.said), run.said
    low = "too few requests on the canary is too little traffic"
    run = controller_canary(monkeypatch, low, proceed_on_low_traffic=True)
    assert run.ok is True and run.restored == [] and run.records[-1]["verdict"] == "low-traffic"
    run = controller_canary(monkeypatch, low)
    assert run.ok is False and run.restored == ["@pct/pve1:129"]
    assert run.book.outcomes["@pct/pve1:129"].startswith("canary too little traffic: rolled back")


def test_a_soak_looks_at_least_once_after_its_start():
    """Reading the first pages (a slow peer) may outlast a short soak: the verdict still comes from
    a look after the start, not from the start's pages twice (which read as no traffic at all)."""
    import itertools

    pages = {"c": iter(["r_total 0", "r_total 120"]), "o": iter(["r_total 0", "r_total 240"])}
    clock = itertools.chain([0.0], itertools.repeat(10.0))  # the start's reads took 10 s of a 5 s soak
    verdict = canary.soak("c", ["o"], {"requests": ("r_total",)}, canary.Policy(soak_s=5), lambda url: next(pages[url]),
                          lambda line: None, now=lambda: next(clock), sleep=lambda s: None)
    assert verdict.kind == "pass" and verdict.canary["requests"] == 120, verdict
