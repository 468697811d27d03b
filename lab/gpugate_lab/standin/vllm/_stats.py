"""The stand-in's request metrics as vLLM 0.33 writes them on /metrics (stdlib only).

From vLLM's ``vllm/v1/metrics/loggers.py`` ``PrometheusStatLogger``, labels ``{model_name, engine}`` (the
served model name, the engine index "0"): counters ``vllm:num_preemptions_total`` (the stand-in never
preempts: 0), ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:request_success_total{finished_reason}`` (one series per ``FinishReason``: stop, length, abort,
error, repetition); histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``
(``vllm:time_per_output_token_seconds`` was its name until 0.11 and is gone since 0.12) and
``vllm:e2e_request_latency_seconds``, with vLLM's buckets.

How vLLM observes a request (vllm/v1/metrics/stats.py ``IterationStats``, in the API server's output
processor): the first output gives the time to first token from the arrival, for every request, streamed
or not; each later engine step one inter-token latency (the interval since the previous output); the
finish counts the request by its finish reason, its tokens and its end-to-end latency. A request the
engine fails (``FinishReason.ERROR``: the lab fault error-rate) is counted under ``error``.

>>> s = RequestStats("m")
>>> clock = s.arrived(0.0); s.output(clock, 0.5); s.output(clock, 0.75); s.finished(clock, "length", 1, 2, 0.75)
>>> [line for line in s.text().splitlines() if "finished_reason=\\"length\\"" in line]
['vllm:request_success_total{model_name="m",engine="0",finished_reason="length"} 1.0']
"""

from vllm._lab import metrics

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Clock:
    def __init__(self, arrived):
        self.arrived, self.last, self.first_seen = arrived, arrived, False


class RequestStats:
    def __init__(self, served_model_name):
        self.labels = {"model_name": served_model_name, "engine": "0"}
        self.preemptions = metrics.Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = metrics.Counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = metrics.Counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = metrics.Counter("vllm:request_success", "Count of successfully processed requests.")
        self.ttft = metrics.Histogram("vllm:time_to_first_token_seconds",
                                      "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = metrics.Histogram("vllm:inter_token_latency_seconds",
                                     "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = metrics.Histogram("vllm:e2e_request_latency_seconds",
                                     "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        for metric in (self.preemptions, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e):
            metric.touch(self.labels)
        for reason in FINISH_REASONS:
            self.success.touch(dict(self.labels, finished_reason=reason))

    def arrived(self, now):
        return Clock(now)

    def output(self, clock, now):
        """An engine step's output of one token for the request, at ``now``."""
        if not clock.first_seen:
            clock.first_seen = True
            self.ttft.observe(self.labels, now - clock.arrived)
        else:
            self.itl.observe(self.labels, now - clock.last)
        clock.last = now

    def finished(self, clock, reason, prompt_tokens, tokens, now):
        self.success.inc(dict(self.labels, finished_reason=reason or "stop"))
        self.prompt_tokens.inc(self.labels, prompt_tokens)
        self.generation_tokens.inc(self.labels, tokens)
        self.e2e.observe(self.labels, now - clock.arrived)

    def text(self):
        return metrics.render([self.preemptions, self.prompt_tokens, self.generation_tokens, self.success,
                               self.ttft, self.itl, self.e2e])
