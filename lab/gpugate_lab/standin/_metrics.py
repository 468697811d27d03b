"""Prometheus counters and cumulative histograms for the lab's engine stand-ins (stdlib only; installed
into a lab container as ``gpugate_metrics``): what the engines' ``prometheus_client`` writes, without it.

Each engine declares its metrics with its own names, help texts, label sets and bucket boundaries (the
stand-ins' docstrings say from which of the engine's files); this module only keeps the figures of the
requests the stand-in served and writes them in the text format (version 0.0.4) as
``prometheus_client.generate_latest`` does:

- a counter: ``# HELP``, ``# TYPE <name> counter``, one ``<name>_total{labels} value`` line per label set;
- a histogram: ``# TYPE <name> histogram``, per label set one ``<name>_bucket{labels,le="B"}`` line per
  boundary (cumulative counts, ``+Inf`` last), ``<name>_count`` and ``<name>_sum``;
- values as Python's ``repr`` of a float (``1.0``, ``0.25``), as ``prometheus_client`` writes them;
- label values escaped (backslash, double quote, newline).

:meth:`Histogram.observe` takes a count: SGLang's ``observe_inter_token_latency`` adds an interval to the
sum once and its token count to the bucket of the interval per token (one batch output of several
tokens); with count 1 it is the ordinary observation.

>>> h = Histogram("x:ttft_seconds", "TTFT.", (0.1, 1.0))
>>> h.observe({"model_name": "m"}, 0.05); h.observe({"model_name": "m"}, 0.5)
>>> print(h.text(), end="")
# HELP x:ttft_seconds TTFT.
# TYPE x:ttft_seconds histogram
x:ttft_seconds_bucket{model_name="m",le="0.1"} 1.0
x:ttft_seconds_bucket{model_name="m",le="1.0"} 2.0
x:ttft_seconds_bucket{model_name="m",le="+Inf"} 2.0
x:ttft_seconds_count{model_name="m"} 2.0
x:ttft_seconds_sum{model_name="m"} 0.55
"""

import threading

_LOCK = threading.Lock()  # the HTTP handler's threads observe; /metrics reads


def _escape(value):
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def labels_text(labels):
    """``{a="1",b="2"}`` in the given order; "" for none.

    >>> labels_text({"model_name": 'a"b', "le": "+Inf"})
    '{model_name="a\\\\"b",le="+Inf"}'
    """
    if not labels:
        return ""
    return "{" + ",".join('%s="%s"' % (k, _escape(v)) for k, v in labels.items()) + "}"


def _number(value):
    value = float(value)
    if value == float("inf"):
        return "+Inf"
    return repr(value)


class _Metric:
    kind = ""

    def __init__(self, name, documentation):
        self.name, self.documentation = name, documentation
        self.series = {}  # tuple(label items) -> state

    def _head(self, name=None):
        name = name or self.name
        return "# HELP %s %s\n# TYPE %s %s\n" % (name, self.documentation.replace("\\", "\\\\").replace(
            "\n", "\\n"), name, self.kind)


class Counter(_Metric):
    """A counter; its samples are ``<name>_total`` (``name`` without the suffix, as prometheus_client
    takes it)."""

    kind = "counter"

    def inc(self, labels, amount=1.0):
        key = tuple(labels.items())
        with _LOCK:
            self.series[key] = self.series.get(key, 0.0) + float(amount)

    def touch(self, labels):
        """Show the series at 0 before anything is counted (as ``.labels(...)`` does)."""
        self.inc(labels, 0.0)

    def value(self, labels):
        return self.series.get(tuple(labels.items()), 0.0)

    def text(self):
        with _LOCK:
            items = list(self.series.items())
        # HELP and TYPE name the sample, ``<name>_total``, as prometheus_client's text format writes a counter
        return self._head(self.name + "_total") + "".join("%s_total%s %s\n" % (self.name, labels_text(dict(k)), _number(v))
                                      for k, v in items)


class Histogram(_Metric):
    """A cumulative histogram with the engine's bucket boundaries (``+Inf`` added)."""

    kind = "histogram"

    def __init__(self, name, documentation, buckets):
        _Metric.__init__(self, name, documentation)
        self.bounds = [float(b) for b in buckets] + [float("inf")]

    def observe(self, labels, value, count=1):
        """``count`` observations of ``value`` (the sum grows by ``value`` once when count > 1: SGLang's
        batched inter-token latency, whose ``value`` is the interval of ``count`` tokens; pass the interval
        per token as ``value / count`` to the bucket, as it does)."""
        key = tuple(labels.items())
        per = float(value) / count if count > 1 else float(value)
        with _LOCK:
            state = self.series.setdefault(key, {"buckets": [0.0] * len(self.bounds), "sum": 0.0})
            state["sum"] += float(value)
            for i, bound in enumerate(self.bounds):
                if per <= bound:
                    state["buckets"][i] += count
                    break

    def touch(self, labels):
        key = tuple(labels.items())
        with _LOCK:
            self.series.setdefault(key, {"buckets": [0.0] * len(self.bounds), "sum": 0.0})

    def text(self):
        with _LOCK:
            items = [(k, list(v["buckets"]), v["sum"]) for k, v in self.series.items()]
        out = [self._head()]
        for key, buckets, total in items:
            labels, cumulative = dict(key), 0.0
            for bound, n in zip(self.bounds, buckets):
                cumulative += n
                out.append("%s_bucket%s %s\n" % (self.name, labels_text(dict(labels, le=_number(bound))),
                                                 _number(cumulative)))
            out.append("%s_count%s %s\n" % (self.name, labels_text(labels), _number(cumulative)))
            out.append("%s_sum%s %s\n" % (self.name, labels_text(labels), _number(total)))
        return "".join(out)


def render(metrics):
    """The exposition of ``metrics`` (counters and histograms), in their order."""
    return "".join(m.text() for m in metrics)
