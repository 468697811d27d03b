"""The stand-in's /metrics as SGLang 0.5.23 writes them with ``--enable-metrics`` (stdlib only).

From SGLang's source:

- ``python/sglang/srt/observability/metrics_collector.py`` (``srt/metrics/collector.py`` in older
  releases) ``TokenizerMetricsCollector``, labels ``{model_name, engine_type}`` (tokenizer_manager.py:
  the served model name and ``DisaggregationMode.to_engine_type``, "unified" without disaggregation):
  counters ``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total``,
  ``sglang:num_requests_total``, ``sglang:num_aborted_requests_total``; histograms
  ``sglang:time_to_first_token_seconds``, ``sglang:inter_token_latency_seconds``,
  ``sglang:e2e_request_latency_seconds`` with its default buckets (no ``--bucket-*`` flag here).
  SGLang has no ``time_per_output_token_seconds`` (only ``inter_token_latency``).
- ``SchedulerMetricsCollector``, labels ``{engine_type, model_name, pp_rank, tp_rank}``: the gauges
  ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:num_retracted_reqs`` and the counter
  ``sglang:num_retracted_requests_total`` (the stand-in never retracts: 0).
- ``srt/utils/common.py`` ``add_prometheus_track_response_middleware``: ``sglang:http_responses_total``
  labelled ``{endpoint, status_code, method}``, one per answer of every route.

How SGLang observes a request (tokenizer_manager.py ``collect_metrics`` on each batch output the
detokenizer sends): the first output gives the time to first token (from the request's arrival), each
later one an inter-token latency of its interval over its new tokens (its interval added to the sum
once, its token count to the bucket of the interval per token); the finish counts the request, its
tokens and its end-to-end latency. A streamed request gets an output per token (``stream_interval``
1); one without ``stream`` an output every ``DEFAULT_FORCE_STREAM_INTERVAL`` = 50 tokens and at its end
(scheduler_output_processor_mixin.py), so for an answer of at most 50 tokens its time to first token is
its whole time. ``num_aborted_requests_total`` counts ``TokenizerManager.abort_request``: a client gone
mid-request, and here the lab fault error-rate's failures too.

>>> m = TokenizerMetrics("m")
>>> clock = m.arrived(0.0); m.output(clock, 1, 0.25); m.output(clock, 3, 0.35); m.finished(clock, 2, 3, 0.35)
>>> [line for line in m.text(0).splitlines() if line.startswith("sglang:inter_token_latency_seconds_count")]
['sglang:inter_token_latency_seconds_count{model_name="m",engine_type="unified"} 2.0']
"""

from sglang._sim import metrics

FORCE_STREAM_INTERVAL = 50  # scheduler.py DEFAULT_FORCE_STREAM_INTERVAL: a request without stream
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800,
               2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
               0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)


class Clock:
    """One request's times (tokenizer_manager's ReqState): arrival, last output, tokens so far."""

    def __init__(self, arrived):
        self.arrived, self.last, self.tokens, self.first_seen = arrived, arrived, 0, False


class TokenizerMetrics:
    def __init__(self, served_model_name):
        self.labels = {"model_name": served_model_name, "engine_type": "unified"}
        self.scheduler_labels = {"engine_type": "unified", "model_name": served_model_name, "pp_rank": "0",
                                 "tp_rank": "0"}
        self.prompt_tokens = metrics.Counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = metrics.Counter("sglang:generation_tokens", "Number of generation tokens processed.")
        self.requests = metrics.Counter("sglang:num_requests", "Number of requests processed.")
        self.aborted = metrics.Counter("sglang:num_aborted_requests", "Number of requests aborted.")
        self.ttft = metrics.Histogram("sglang:time_to_first_token_seconds",
                                      "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = metrics.Histogram("sglang:inter_token_latency_seconds",
                                     "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = metrics.Histogram("sglang:e2e_request_latency_seconds",
                                     "Histogram of End-to-end request latency in seconds", E2E_BUCKETS)
        self.retracted = metrics.Counter("sglang:num_retracted_requests", "Total number of retracted requests.")
        self.http = metrics.Counter("sglang:http_responses",
                                    "Total number of HTTP responses by endpoint and status code")
        for metric in (self.prompt_tokens, self.generation_tokens, self.requests, self.aborted, self.ttft,
                       self.itl, self.e2e):
            metric.touch(self.labels)
        self.retracted.touch(self.scheduler_labels)

    def arrived(self, now):
        return Clock(now)

    def output(self, clock, tokens, now):
        """A batch output with ``tokens`` generated so far, at ``now``."""
        if not clock.first_seen:
            clock.first_seen, clock.last, clock.tokens = True, now, tokens
            self.ttft.observe(self.labels, now - clock.arrived)
            return
        new = tokens - clock.tokens
        if new > 0:
            self.itl.observe(self.labels, now - clock.last, new)
            clock.last, clock.tokens = now, tokens

    def finished(self, clock, prompt_tokens, tokens, now):
        self.prompt_tokens.inc(self.labels, prompt_tokens)
        self.generation_tokens.inc(self.labels, tokens)
        self.requests.inc(self.labels)
        self.e2e.observe(self.labels, now - clock.arrived)

    def abort(self):
        self.aborted.inc(self.labels)

    def http_response(self, endpoint, status, method):
        self.http.inc({"endpoint": endpoint, "status_code": str(status), "method": method})

    def text(self, running):
        labels = metrics.labels_text(self.scheduler_labels)
        gauges = ("# HELP sglang:num_running_reqs The number of running requests.\n"
                  "# TYPE sglang:num_running_reqs gauge\n"
                  "sglang:num_running_reqs%s %.1f\n"
                  "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n"
                  "# TYPE sglang:num_queue_reqs gauge\n"
                  "sglang:num_queue_reqs%s 0.0\n"
                  "# HELP sglang:num_retracted_reqs The number of retracted requests.\n"
                  "# TYPE sglang:num_retracted_reqs gauge\n"
                  "sglang:num_retracted_reqs%s 0.0\n" % (labels, running, labels, labels))
        return gauges + metrics.render([self.retracted, self.prompt_tokens, self.generation_tokens, self.requests,
                                        self.aborted, self.ttft, self.itl, self.e2e, self.http])
