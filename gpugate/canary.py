"""The canary's judgement (docs/canary.md), as small pure functions: the engine's own /metrics read
twice per server (at the start and the end of the soak), the window's figures of the canary and of
the unchanged replicas pooled, and a verdict with its reasons.

The metric names are the engine's (``Engine.canary_metrics``: a role -> selectors mapping); nothing
here names an engine. The quantiles are Prometheus' ``histogram_quantile`` over the window's bucket
deltas (linear interpolation inside the bucket), so a p95 is of the requests served in the soak,
not since the server started.

Example::

    >>> roles = {"ttft": ("t",), "requests": ("r_total",), "aborts": ("a_total",)}
    >>> def page(n, slow):
    ...     return (f't_bucket{{le="0.1"}} {n - slow}\\nt_bucket{{le="1.0"}} {n}\\nt_bucket{{le="+Inf"}} {n}\\n'
    ...             f't_count {n}\\nr_total {n}\\na_total 0\\n')
    >>> canary = window(parse(page(0, 0)), parse(page(200, 40)), roles, seconds=60)
    >>> others = window(parse(page(0, 0)), parse(page(400, 0)), roles, seconds=60)
    >>> round(canary.quantile("ttft", 0.95), 3), round(others.quantile("ttft", 0.95), 3)
    (0.775, 0.095)
    >>> verdict = judge(canary, others, policy({"min_requests": 100}))
    >>> verdict.kind, verdict.reasons[0]
    ('regression', "TTFT p95 0.775 s is 8.16x the others' 0.095 s (limit 1.25x)")
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Page", "Window", "Policy", "Verdict", "Row", "parse", "histogram", "counter", "quantile", "window",
           "pooled", "judge", "policy", "side_by_side", "progress_line", "soak"]

# sample name -> [(labels, value)]: one page of /metrics, as the parser read it
Page = dict[str, list[tuple[dict[str, str], float]]]

HISTOGRAM_ROLES = ("ttft", "itl", "e2e")
COUNTER_ROLES = ("requests", "errors", "aborts", "preemptions", "tokens")
_SELECTOR = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def parse(text: str) -> Page:
    """A Prometheus text page (what /metrics answers), by sample name. A page the parser refuses is
    ValueError (the caller says which server answered it).

    >>> parse('# TYPE x counter\\nx_total{a="1"} 2\\nx_total{a="2"} 3\\n')["x_total"]
    [({'a': '1'}, 2.0), ({'a': '2'}, 3.0)]
    """
    page: Page = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                page.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    except Exception as error:  # the parser raises ValueError, and others on odd input
        raise ValueError(f"not a Prometheus text page: {type(error).__name__}: {str(error)[:120]}") from None
    return page


def _selector(text: str) -> tuple[str, dict[str, str]]:
    """``name`` or ``name{label="value",...}``.

    >>> _selector('v:x_total{reason="abort"}')
    ('v:x_total', {'reason': 'abort'})
    """
    match = _SELECTOR.match(text.strip())
    if not match:
        raise ValueError(f"not a metric selector: {text!r}")
    return match.group(1), dict(_LABEL.findall(match.group(2) or ""))


def counter(page: Page, selectors: Iterable[str]) -> float | None:
    """The sum of every sample the selectors match (every label set: one per rank or model); None
    when the page has none of them (the engine does not serve it, or metrics are off).

    >>> counter(parse('r_total{x="a"} 2\\nr_total{x="b"} 3\\n'), ['r_total{x="b"}']), counter({}, ["r"])
    (3.0, None)
    """
    total, seen = 0.0, False
    for text in selectors:
        name, wanted = _selector(text)
        for labels, value in page.get(name, ()):
            if all(labels.get(key) == item for key, item in wanted.items()) and not math.isnan(value):
                total += value
                seen = True
    return total if seen else None


def histogram(page: Page, name: str) -> dict[float, float] | None:
    """A histogram's cumulative buckets ``{upper bound: count}`` summed over its label sets (ranks,
    models), ``+Inf`` as ``math.inf``; None when the page does not have it.

    >>> histogram(parse('h_bucket{le="0.5",r="0"} 1\\nh_bucket{le="+Inf",r="0"} 2\\nh_bucket{le="+Inf",r="1"} 1\\n'), "h")
    {0.5: 1.0, inf: 3.0}
    """
    samples = page.get(name + "_bucket")
    if not samples:
        return None
    buckets: dict[float, float] = {}
    for labels, value in samples:
        try:
            bound = float(labels.get("le", "nan"))
        except ValueError:
            continue
        if not math.isnan(bound) and not math.isnan(value):
            buckets[bound] = buckets.get(bound, 0.0) + value
    return dict(sorted(buckets.items())) or None


def delta(start: Mapping[float, float] | None, end: Mapping[float, float] | None) -> dict[float, float] | None:
    """The window's buckets: end minus start. A counter that went down (the server restarted in
    between) counts from zero: the end alone.

    >>> delta({1.0: 2, math.inf: 3}, {1.0: 5, math.inf: 9}), delta({1.0: 5}, {1.0: 1})
    ({1.0: 3.0, inf: 6.0}, {1.0: 1.0})
    """
    if end is None:
        return None
    start = start or {}
    if any(end.get(bound, 0.0) < count for bound, count in start.items()):
        return {bound: float(count) for bound, count in end.items()}
    return {bound: float(count - start.get(bound, 0.0)) for bound, count in end.items()}


def quantile(q: float, buckets: Mapping[float, float] | None) -> float | None:
    """Prometheus' ``histogram_quantile(q, ...)`` of cumulative ``buckets``: the bucket the q-th
    observation falls in, linearly interpolated between its bounds (the first bucket from 0); in
    the ``+Inf`` bucket, the highest finite bound. None without observations.

    >>> round(quantile(0.5, {0.1: 0, 0.2: 10, math.inf: 10}), 6), quantile(0.95, {0.1: 10, math.inf: 20})
    (0.15, 0.1)
    >>> quantile(0.95, {0.1: 0, math.inf: 0}) is None
    True
    """
    if not buckets:
        return None
    bounds = sorted(buckets)
    if bounds[-1] != math.inf or len(bounds) < 2:
        return None  # Prometheus: NaN without a +Inf bucket and another
    total = buckets[math.inf]
    if total <= 0 or not 0 <= q <= 1:
        return None
    rank = q * total
    # the first finite bucket holding the rank-th observation (Go's sort.Search over all but +Inf)
    index = next((i for i, bound in enumerate(bounds[:-1]) if buckets[bound] >= rank), len(bounds) - 1)
    if index == len(bounds) - 1:
        return bounds[-2]
    if index == 0 and bounds[0] <= 0:
        return bounds[0]
    start, count = 0.0, buckets[bounds[index]]
    if index > 0:
        start = bounds[index - 1]
        count -= buckets[start]
        rank -= buckets[start]
    if count <= 0:
        return start
    return start + (bounds[index] - start) * (rank / count)


@dataclasses.dataclass
class Window:
    """One side's figures over the soak: the histograms' bucket deltas, the counters' deltas, the
    running gauge's mean (sampled at each look) and the window's length. Pool several with
    :func:`pooled`."""

    seconds: float
    histograms: dict[str, dict[float, float] | None] = dataclasses.field(default_factory=dict)
    counters: dict[str, float | None] = dataclasses.field(default_factory=dict)
    running: float | None = None   # mean requests running (summed over the servers pooled)
    servers: int = 1

    def quantile(self, role: str, q: float) -> float | None:
        return quantile(q, self.histograms.get(role))

    def count(self, role: str) -> float:
        return self.counters.get(role) or 0.0

    @property
    def requests(self) -> int:
        """The requests that ended in the window (at least the failed ones)."""
        return int(max(self.count("requests"), self.failed))

    @property
    def failed(self) -> int:
        return int(self.count("errors") + self.count("aborts"))

    def percent(self, role: str) -> float | None:
        """``errors+aborts`` (role ``failed``) or ``preemptions`` per 100 requests; None without any."""
        value = self.failed if role == "failed" else self.count(role)
        return 100.0 * value / self.requests if self.requests else None

    @property
    def per_running(self) -> float | None:
        """Generated tokens per second per running request (None: nothing ran, or not served)."""
        tokens = self.counters.get("tokens")
        if tokens is None or not self.running or self.seconds <= 0:
            return None
        return tokens / self.seconds / self.running

    def figures(self) -> dict[str, Any]:
        """As the audit log and the status keep them (plain JSON).

        >>> Window(10.0, counters={"requests": 4.0}).figures()["requests"]
        4
        """
        def r(value: float | None, digits: int = 4) -> float | None:
            return None if value is None else round(value, digits)
        return {"seconds": round(self.seconds, 1), "servers": self.servers, "requests": self.requests,
                "failed": self.failed, "failed_pct": r(self.percent("failed"), 2),
                "ttft_p50_s": r(self.quantile("ttft", 0.5)), "ttft_p95_s": r(self.quantile("ttft", 0.95)),
                "itl_p50_s": r(self.quantile("itl", 0.5)), "itl_p95_s": r(self.quantile("itl", 0.95)),
                "e2e_p95_s": r(self.quantile("e2e", 0.95)),
                # not "tokens_...": the audit log masks a key that names a token (gpugate.rules.redact)
                "throughput_per_running": r(self.per_running, 2),
                "preempted_pct": r(self.percent("preemptions"), 2)}


def window(start: Page, end: Page, roles: Mapping[str, Sequence[str]], seconds: float,
           running: Sequence[float] = ()) -> Window:
    """One server's window from its two pages; ``running``: its running gauge at each look."""
    histograms = {role: delta(*(histogram(page, name) for page in (start, end)))
                  for role in HISTOGRAM_ROLES for name in roles.get(role, ())[:1]}
    counters: dict[str, float | None] = {}
    for role in COUNTER_ROLES:
        selectors = roles.get(role, ())
        before, after = counter(start, selectors), counter(end, selectors)
        counters[role] = None if after is None else (after if before is None or after < before else after - before)
    return Window(seconds, histograms, counters, sum(running) / len(running) if running else None)


def pooled(windows: Sequence[Window]) -> Window:
    """The unchanged replicas as one: buckets and counters summed (a pooled histogram's quantile is
    the quantile of every request they served), running summed.

    >>> both = pooled([Window(10, counters={"requests": 3.0}), Window(10, counters={"requests": 4.0})])
    >>> both.requests, both.servers
    (7, 2)
    """
    histograms: dict[str, dict[float, float] | None] = {}
    counters: dict[str, float | None] = {}
    for one in windows:
        for role, buckets in one.histograms.items():
            if buckets is None:
                histograms.setdefault(role, None)
                continue
            into = histograms.get(role) or {}
            for bound, count in buckets.items():
                into[bound] = into.get(bound, 0.0) + count
            histograms[role] = dict(sorted(into.items()))
        for role, value in one.counters.items():
            if value is not None or role not in counters:
                counters[role] = (counters.get(role) or 0.0) + value if value is not None else counters.get(role)
    running = [one.running for one in windows if one.running is not None]
    return Window(max((one.seconds for one in windows), default=0.0), histograms, counters,
                  sum(running) if running else None, servers=len(windows))


@dataclasses.dataclass(frozen=True)
class Policy:
    """The thresholds (gpugate.settings.CANARY_DEFAULTS says each default and why)."""

    soak_s: float = 120.0
    min_requests: int = 100
    ttft_p95_ratio: float = 1.25
    itl_p95_ratio: float = 1.25
    error_ratio_points: float = 0.5
    throughput_ratio: float = 0.8
    preemption_ratio_points: float = 1.0
    proceed_on_low_traffic: bool = False


def policy(values: Mapping[str, Any] | None) -> Policy:
    """The Policy of a checked ``canary`` setting (gpugate.settings.to_canary).

    >>> policy({"soak_s": 5.0}).soak_s, policy({}).ttft_p95_ratio
    (5.0, 1.25)
    """
    fields = {field.name for field in dataclasses.fields(Policy)}
    return Policy(**{key: value for key, value in (values or {}).items() if key in fields})


@dataclasses.dataclass(frozen=True)
class Row:
    """One figure side by side: the canary's, the others', the limit in words, and whether it holds
    (None: not judged, a side has no figure)."""

    figure: str
    canary: str
    others: str
    limit: str
    ok: bool | None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """``pass``, ``regression`` (reasons say which figures), ``low-traffic`` (too few requests for
    any verdict) or ``no-baseline`` (nothing to compare with: no other replica, or its metrics
    cannot be read)."""

    kind: str
    reasons: list[str]
    rows: list[Row]
    canary: dict[str, Any]
    others: dict[str, Any]

    def doc(self) -> dict[str, Any]:
        return {"verdict": self.kind, "reasons": list(self.reasons), "canary": self.canary, "others": self.others}


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}%"


def _ratio_row(name: str, canary: float | None, others: float | None, limit: float) -> tuple[Row, str | None]:
    if canary is None or others is None:
        return Row(name, _s(canary), _s(others), f"at most {limit:g}x", None), None
    # a bucket's lower edge of 0 makes a p95 of 0 possible: compare at a floor of 1 ms
    ok = canary <= max(others, 0.001) * limit
    reason = None if ok else (f"{name} {canary:.3f} s is {canary / max(others, 1e-9):.2f}x the others' "
                              f"{others:.3f} s (limit {limit:g}x)")
    return Row(name, _s(canary), _s(others), f"at most {limit:g}x", ok), reason


def _points_row(name: str, canary: float | None, others: float | None, points: float) -> tuple[Row, str | None]:
    if canary is None or others is None:
        return Row(name, _pct(canary), _pct(others), f"at most +{points:g} points", None), None
    ok = canary <= others + points
    reason = None if ok else (f"{name} {canary:.2f}% against the others' {others:.2f}% "
                              f"(limit +{points:g} points)")
    return Row(name, _pct(canary), _pct(others), f"at most +{points:g} points", ok), reason


def judge(canary: Window, others: Window | None, rule: Policy) -> Verdict:
    """The verdict on the canary's window against the unchanged replicas' (pooled).

    >>> judge(Window(5, counters={"requests": 3.0}), Window(5, counters={"requests": 300.0}), Policy()).reasons
    ['the canary served 3 request(s) in 5 s, under min_requests 100']
    """
    mine = canary.figures()
    theirs = others.figures() if others is not None else {}
    rows: list[Row] = []
    reasons: list[str] = []
    rows.append(Row("requests", str(canary.requests), str(others.requests) if others else "-",
                    f"at least {rule.min_requests} each", None))
    if others is None:
        return Verdict("no-baseline", ["no unchanged replica's metrics to compare with"], rows, mine, theirs)
    low = [f"the {side} served {window.requests} request(s) in {window.seconds:.0f} s, under min_requests "
           f"{rule.min_requests}" for side, window in (("canary", canary), ("others", others))
           if window.requests < rule.min_requests]
    checks = [
        _points_row("failed", canary.percent("failed"), others.percent("failed"), rule.error_ratio_points),
        _ratio_row("TTFT p95", canary.quantile("ttft", 0.95), others.quantile("ttft", 0.95), rule.ttft_p95_ratio),
        _ratio_row("ITL p95", canary.quantile("itl", 0.95), others.quantile("itl", 0.95), rule.itl_p95_ratio),
        _points_row("preempted", canary.percent("preemptions"), others.percent("preemptions"),
                    rule.preemption_ratio_points),
    ]
    c_tput, o_tput = canary.per_running, others.per_running
    if c_tput is None or o_tput is None or o_tput <= 0:
        tput = Row("tokens/s per running", "-" if c_tput is None else f"{c_tput:.1f}",
                   "-" if o_tput is None else f"{o_tput:.1f}", f"at least {rule.throughput_ratio:g}x", None)
        checks.append((tput, None))
    else:
        ok = c_tput >= o_tput * rule.throughput_ratio
        checks.append((Row("tokens/s per running", f"{c_tput:.1f}", f"{o_tput:.1f}",
                           f"at least {rule.throughput_ratio:g}x", ok),
                       None if ok else f"tokens/s per running request {c_tput:.1f} is {c_tput / o_tput:.2f}x "
                                       f"the others' {o_tput:.1f} (limit {rule.throughput_ratio:g}x)"))
    rows += [row for row, _ in checks]
    rows.insert(2, Row("TTFT p50", _s(canary.quantile("ttft", 0.5)), _s(others.quantile("ttft", 0.5)), "", None))
    rows.insert(4, Row("ITL p50", _s(canary.quantile("itl", 0.5)), _s(others.quantile("itl", 0.5)), "", None))
    reasons = [reason for _, reason in checks if reason]
    if low:
        if reasons and others.requests >= rule.min_requests:
            # a router that balances by load sends a slower server fewer requests: "send more traffic"
            # alone would hide what the few it served already show
            low.append(f"the router sent it fewer than the others (a load-aware router does so to a slower server), "
                       f"and what it served already breaks a limit: {'; '.join(reasons)}")
        return Verdict("low-traffic", low, rows, mine, theirs)
    return Verdict("regression" if reasons else "pass", reasons, rows, mine, theirs)


def side_by_side(verdict: Verdict, others_label: str) -> list[str]:
    """The figures as a small table: the canary, the others, the limit, and whether it held.

    >>> print("\\n".join(side_by_side(Verdict("pass", [], [Row("TTFT p95", "0.100 s", "0.090 s", "at most 1.25x", True)],
    ...                                        {}, {}), "2 others")))
        figure                canary        2 others      limit                   
        TTFT p95              0.100 s       0.090 s       at most 1.25x           ok
    """
    lines = [f"    {'figure':<22}{'canary':<14}{others_label:<14}{'limit':<24}"]
    for row in verdict.rows:
        mark = "" if row.ok is None else "ok" if row.ok else "REGRESSION"
        lines.append(f"    {row.figure:<22}{row.canary:<14}{row.others:<14}{row.limit:<24}{mark}")
    return lines


def progress_line(elapsed_s: float, soak_s: float, canary: Window, others: Window | None) -> str:
    """The line a soak prints at each look (at least every 10 s): the figures so far.

    >>> progress_line(10, 60, Window(10, counters={"requests": 12.0}), None)
    'canary soak 10/60 s: canary 12 requests, 0 failed, TTFT p95 -, ITL p95 -; others -'
    """
    def side(window: Window) -> str:
        return (f"{window.requests} requests, {window.failed} failed, TTFT p95 {_s(window.quantile('ttft', 0.95))}, "
                f"ITL p95 {_s(window.quantile('itl', 0.95))}")
    return (f"canary soak {elapsed_s:.0f}/{soak_s:g} s: canary {side(canary)}; others "
            + (side(others) if others is not None else "-"))


PROGRESS_EVERY_S = 10.0  # the bound: a line with the figures so far at least this often


def _page(text: str | None) -> Page | None:
    if text is None:
        return None
    try:
        return parse(text)
    except ValueError:
        return None


def soak(canary_url: str, other_urls: Sequence[str], roles: Mapping[str, Sequence[str]], rule: Policy,
         read: Callable[[str], str | None], say: Callable[[str], None],
         now: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
         stop: Callable[[], bool] = lambda: False) -> Verdict:
    """Watch the canary and the unchanged replicas for ``rule.soak_s``: each server's /metrics
    (``read(url)`` -> the page, None when it does not answer) at the start and at each look (at most
    :data:`PROGRESS_EVERY_S` apart, a progress line each), then the verdict on the window. An
    unchanged replica that stops answering leaves the baseline, said once (its window would stop
    where it went silent while the canary's goes on); a canary that stops answering is a regression,
    whatever its figures were (a server that dies under traffic is what a canary is for); ``stop()``
    (an interrupt) ends the soak early.

    >>> pages = {"c": iter(['r_total 0', 'r_total 120']), "o": iter(['r_total 0', 'r_total 240'])}
    >>> clock = iter([0, 0, 5, 5, 5, 5])
    >>> soak("c", ["o"], {"requests": ("r_total",)}, Policy(soak_s=5), lambda url: next(pages[url]), print,
    ...      now=lambda: next(clock), sleep=lambda s: None).kind
    canary soak 5/5 s: canary 120 requests, 0 failed, TTFT p95 -, ITL p95 -; others 240 requests, 0 failed, TTFT p95 -, ITL p95 -
    'pass'
    """
    began = now()
    first = {url: _page(read(url)) for url in [canary_url, *other_urls]}
    if first[canary_url] is None:
        return Verdict("no-baseline", [f"the canary's /metrics at {canary_url} cannot be read"], [], {}, {})
    others = [url for url in other_urls if first[url] is not None]
    if not others:
        why = (f"none of the unchanged replicas' /metrics can be read ({', '.join(other_urls)}): they serve none "
               f"until a change turns them on" if other_urls else "no other replica of its model in the router")
        return Verdict("no-baseline", [why], [], {}, {})
    last = dict(first)
    running: dict[str, list[float]] = {url: [] for url in [canary_url, *others]}
    interval = min(PROGRESS_EVERY_S, max(0.5, rule.soak_s / 4))

    def windows() -> tuple[Window, Window]:
        seconds = now() - began
        sides = {url: window(first[url] or {}, last[url] or {}, roles, seconds, running[url]) for url in running}
        return sides[canary_url], pooled([sides[url] for url in others])

    looked = False
    while not stop():
        elapsed = now() - began
        if elapsed >= rule.soak_s and looked:  # at least one look after the start: reading the first
            break                              # pages may outlast a short soak (a slow peer)
        sleep(max(0.0, min(interval, rule.soak_s - elapsed)))
        looked = True
        for url in list(running):
            page = _page(read(url))
            if page is None and url == canary_url:
                canary, pool = windows()
                seen = judge(canary, pool, rule)
                said = (f"the canary stopped answering its /metrics at {canary_url} "
                        f"{now() - began:.0f} s into the soak (its figures until then below)")
                say("canary soak: " + said)
                return Verdict("regression", [said], seen.rows, seen.canary, seen.others)
            if page is None:
                others.remove(url)
                del running[url]
                say(f"canary soak: {url} stopped answering its /metrics {now() - began:.0f} s into the soak: it "
                    f"leaves the baseline ({len(others)} unchanged replica(s) left)")
                if not others:
                    return Verdict("no-baseline", ["every unchanged replica stopped answering its /metrics "
                                                   "during the soak"], [], {}, {})
                continue
            last[url] = page
            gauge = counter(page, roles.get("running", ()))
            if gauge is not None:
                running[url].append(gauge)
        canary, pool = windows()
        say(progress_line(now() - began, rule.soak_s, canary, pool))
    canary, pool = windows()
    return judge(canary, pool, rule)
