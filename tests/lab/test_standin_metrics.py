"""The stand-ins' /metrics text as a Prometheus scraper reads it (prometheus_client's own parser): the
engines' names, labels and bucket boundaries, cumulative buckets, SGLang's batched inter-token latency.
No process: the stand-ins' metric modules from the container copies, imported here."""

from __future__ import annotations

import importlib
import sys

import pytest
from gpusim_helpers import installed  # noqa: F401

from gpugate_lab import container_files

parser = pytest.importorskip("prometheus_client.parser")


@pytest.fixture
def standin_module(installed, monkeypatch):  # noqa: F811
    """import_module("sglang._collector") from the container copies, forgotten afterwards."""
    monkeypatch.syspath_prepend(str(container_files.dist_packages(installed)))
    yield importlib.import_module
    for name in [n for n in sys.modules if n.split(".")[0] in ("sglang", "vllm")]:
        del sys.modules[name]


def families(text: str) -> dict:
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def samples(family, suffix: str) -> list:
    return [s for s in family.samples if s.name == family.name + suffix]


def test_sglang_metrics_carry_its_names_labels_buckets_and_the_requests_served(standin_module):
    collector = standin_module("sglang._collector")
    m = collector.TokenizerMetrics("/opt/models/lab-model")
    streamed = m.arrived(10.0)
    for tokens, at in ((1, 10.25), (2, 10.26), (3, 10.27)):  # an output per token
        m.output(streamed, tokens, at)
    m.finished(streamed, 4, 3, 10.27)
    whole = m.arrived(20.0)
    m.output(whole, 50, 21.0)   # without stream: an output every 50 tokens, then the end
    m.output(whole, 60, 21.2)
    m.finished(whole, 2, 60, 21.2)
    m.abort()
    m.http_response("/generate", 500, "POST")
    got = families(m.text(running=1))

    labels = {"model_name": "/opt/models/lab-model", "engine_type": "unified"}
    ttft = got["sglang:time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    bounds = [s.labels["le"] for s in samples(ttft, "_bucket")]
    assert bounds == [repr(float(b)) for b in collector.TTFT_BUCKETS] + ["+Inf"]  # SGLang's defaults
    counts = [s.value for s in samples(ttft, "_bucket")]
    assert counts == sorted(counts) and counts[-1] == 2  # cumulative
    assert {s.labels["le"]: s.value for s in samples(ttft, "_bucket")}["0.4"] == 1.0  # 0.25 s; the other 1 s
    assert samples(ttft, "_sum")[0].value == pytest.approx(1.25)
    assert samples(ttft, "_count")[0].labels == labels

    itl = got["sglang:inter_token_latency_seconds"]
    # SGLang's observe_inter_token_latency: the count is tokens, the sum the intervals
    assert samples(itl, "_count")[0].value == 2 + 10
    assert samples(itl, "_sum")[0].value == pytest.approx(0.02 + 0.2)
    by_bound = {s.labels["le"]: s.value for s in samples(itl, "_bucket")}
    assert by_bound["0.01"] == 2 + 0 and by_bound["0.02"] == 12  # 10 ms per token, then 20 ms per token

    assert samples(got["sglang:e2e_request_latency_seconds"], "_count")[0].value == 2
    assert samples(got["sglang:num_requests"], "_total")[0].value == 2
    assert samples(got["sglang:generation_tokens"], "_total")[0].value == 63
    assert samples(got["sglang:prompt_tokens"], "_total")[0].value == 6
    assert samples(got["sglang:num_aborted_requests"], "_total")[0].value == 1
    assert samples(got["sglang:num_retracted_requests"], "_total")[0].value == 0
    [http] = samples(got["sglang:http_responses"], "_total")
    assert http.labels == {"endpoint": "/generate", "status_code": "500", "method": "POST"} and http.value == 1
    [running] = got["sglang:num_running_reqs"].samples
    assert running.value == 1 and running.labels["tp_rank"] == "0"


def test_vllm_metrics_carry_its_names_labels_buckets_and_finish_reasons(standin_module):
    stats = standin_module("vllm._stats")
    s = stats.RequestStats("lab-model")
    ok = s.arrived(0.0)
    for at in (0.05, 0.1, 0.15):
        s.output(ok, at)
    s.finished(ok, "length", 3, 3, 0.15)
    failed = s.arrived(1.0)
    s.finished(failed, "error", 3, 0, 1.0)
    got = families(s.text())

    labels = {"model_name": "lab-model", "engine": "0"}
    success = {x.labels["finished_reason"]: x.value for x in samples(got["vllm:request_success"], "_total")}
    assert success == {"stop": 0, "length": 1, "abort": 0, "error": 1, "repetition": 0}
    ttft = got["vllm:time_to_first_token_seconds"]
    assert [x.labels["le"] for x in samples(ttft, "_bucket")][:3] == ["0.001", "0.005", "0.01"]
    assert samples(ttft, "_count")[0].value == 1 and samples(ttft, "_count")[0].labels == labels
    itl = got["vllm:inter_token_latency_seconds"]
    assert samples(itl, "_count")[0].value == 2 and samples(itl, "_sum")[0].value == pytest.approx(0.1)
    assert {x.labels["le"]: x.value for x in samples(itl, "_bucket")}["0.05"] == 2
    assert samples(got["vllm:e2e_request_latency_seconds"], "_count")[0].value == 2
    assert samples(got["vllm:num_preemptions"], "_total")[0].value == 0
    assert samples(got["vllm:generation_tokens"], "_total")[0].value == 3


def test_label_values_are_escaped_as_the_text_format_wants(standin_module):
    collector = standin_module("sglang._collector")
    m = collector.TokenizerMetrics('odd "name"\\ with\nnewline')
    [count] = samples(families(m.text(0))["sglang:num_requests"], "_total")
    assert count.labels["model_name"] == 'odd "name"\\ with\nnewline'
