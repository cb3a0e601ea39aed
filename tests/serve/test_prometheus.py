"""/metrics has vLLM's metric set under `weft:`: vLLM v0.34.0's names, types, labels and buckets (the values
below are copied from its vllm/v1/metrics/loggers.py and buckets.py, not from weft), and a finished request's
intervals land in the buckets vLLM's definitions put them in. Hand-built outputs and snapshots, and build_app
over a fake engine for the server's wiring: no engine process, no model."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from weft.inference.outputs import CompletionOutput, EngineSnapshot, EngineStats, RequestMetrics, RequestOutput
from weft.inference.params import SamplingParams
from weft.serve.api_server import build_app
from weft.serve.messages import EngineReady
from weft.serve.metrics import ServerMetrics

MODEL = "some/model"
LABELS = {"model_name": MODEL, "engine": "0"}
TOKENS_2048 = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]  # vLLM's build_1_2_5_buckets(2048)
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0]  # fmt: skip
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0]  # fmt: skip
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
HISTOGRAMS = {
    "time_to_first_token_seconds": TTFT,
    "inter_token_latency_seconds": ITL,
    "request_time_per_output_token_seconds": ITL,
    "e2e_request_latency_seconds": LATENCY,
    "request_queue_time_seconds": LATENCY,
    "request_inference_time_seconds": LATENCY,
    "request_prefill_time_seconds": LATENCY,
    "request_decode_time_seconds": LATENCY,
    "request_prompt_tokens": TOKENS_2048,
    "request_generation_tokens": TOKENS_2048,
    "request_prefill_kv_computed_tokens": TOKENS_2048,
    "request_num_preemptions": [1, 2, 3, 4, 5, 10, 20],
    "request_params_n": [1, 2, 5, 10, 20],
    "request_params_max_tokens": TOKENS_2048,
}


def snapshot() -> EngineSnapshot:
    stats = EngineStats(steps=7, prompt_tokens=11, generation_tokens=13, num_preemptions=2, recomputed_tokens=5,
                        prefix_cache_queries=40, prefix_cache_hits=16)  # fmt: skip
    return EngineSnapshot(num_running=3, num_waiting=4, blocks_used=30, blocks_total=120, stats=stats)


def scrape(metrics: ServerMetrics) -> dict[str, object]:
    """The registry's exposition, parsed as Prometheus would: family name -> family."""
    text = generate_latest(metrics.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, suffix: str = "", **labels: str) -> float:
    (got,) = [s.value for s in families[f"weft:{name}"].samples
              if s.name == f"weft:{name}{suffix}" and s.labels == {**LABELS, **labels}]  # fmt: skip
    return got


def buckets(families: dict, name: str) -> dict[float, float]:
    """A histogram's cumulative counts by upper edge (+Inf left out)."""
    return {float(s.labels["le"]): s.value for s in families[f"weft:{name}"].samples
            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"}  # fmt: skip


def landed_in(families: dict, name: str) -> list[float]:
    """The upper edge of the bucket each observation fell in."""
    edges, before, out = buckets(families, name), 0.0, []
    for edge, count in sorted(edges.items()):
        out += [edge] * int(count - before)
        before = count
    return out


def finished_output(finished: bool = True) -> RequestOutput:
    """Two completions of a 300-token prompt, 100 of it cached; its first completion's instants: queued 3 s,
    prefill 0.4 s, four tokens 0.03, 0.12 and 1.55 s apart, preempted once."""
    m = RequestMetrics(arrival_time=100.0, first_scheduled_time=103.0, token_times=[103.4, 103.43, 103.55, 105.1],
                       finished_time=105.1, num_preemptions=1)  # fmt: skip
    completions = [CompletionOutput(0, "", [1, 2, 3, 4], "stop" if finished else None),
                   CompletionOutput(1, "", [5, 6], "length" if finished else None)]  # fmt: skip
    return RequestOutput("r", None, list(range(300)), completions, finished, m, num_cached_tokens=100)


def test_engine_gauges_and_counters_have_vllms_names_types_and_labels():
    families = scrape(ServerMetrics(snapshot, MODEL, 2048))
    expected = {  # vLLM's name: (type, value in the snapshot above)
        "num_requests_running": ("gauge", 3), "num_requests_waiting": ("gauge", 4),
        "kv_cache_usage_perc": ("gauge", 0.25),
        "num_preemptions": ("counter", 2), "prompt_tokens": ("counter", 11), "generation_tokens": ("counter", 13),
        "prefix_cache_queries": ("counter", 40), "prefix_cache_hits": ("counter", 16),
        # weft's own, vLLM has none
        "kv_blocks_used": ("gauge", 30), "kv_blocks_total": ("gauge", 120),
        "recomputed_tokens": ("counter", 5), "engine_steps": ("counter", 7),
    }  # fmt: skip
    for name, (kind, want) in expected.items():
        assert families[f"weft:{name}"].type == kind, name
        assert value(families, name, "_total" if kind == "counter" else "") == want, name


def test_request_histograms_have_vllms_buckets_and_success_every_reason():
    families = scrape(ServerMetrics(snapshot, MODEL, 2048))
    for name, edges in HISTOGRAMS.items():
        assert families[f"weft:{name}"].type == "histogram", name
        assert list(buckets(families, name)) == edges, name
        assert value(families, name, "_count") == 0, name
    assert families["weft:request_success"].type == "counter"
    for reason in ("stop", "length", "abort", "error", "repetition"):  # vLLM's FinishReason, shown at 0
        assert value(families, "request_success", "_total", finished_reason=reason) == 0


def test_a_finished_request_lands_where_vllms_definitions_put_it():
    metrics = ServerMetrics(snapshot, MODEL, 2048)
    metrics.finished(finished_output(), SamplingParams(n=2, max_tokens=64), ["stop", "length"])
    families = scrape(metrics)
    assert value(families, "request_success", "_total", finished_reason="stop") == 1
    assert value(families, "request_success", "_total", finished_reason="length") == 1
    expected = {  # the interval, the bucket it falls in
        "time_to_first_token_seconds": [5.0],  # first token - arrival: 3.4
        "inter_token_latency_seconds": [0.05, 0.15, 2.5],  # 0.03, 0.12, 1.55
        "request_time_per_output_token_seconds": [0.75],  # decode / (4 - 1): 0.567
        "e2e_request_latency_seconds": [10.0],  # last token - arrival: 5.1
        "request_queue_time_seconds": [5.0],  # first scheduled - arrival: 3.0
        "request_prefill_time_seconds": [0.5],  # first token - first scheduled: 0.4
        "request_decode_time_seconds": [2.0],  # last token - first token: 1.7
        "request_inference_time_seconds": [2.5],  # last token - first scheduled: 2.1
        "request_prompt_tokens": [500],  # 300
        "request_generation_tokens": [5],  # 4 (its first completion's)
        "request_prefill_kv_computed_tokens": [200],  # 300 - 100 cached
        "request_num_preemptions": [1],  # 1
        "request_params_n": [2],
        "request_params_max_tokens": [100],  # 64
    }
    for name, edges in expected.items():
        assert landed_in(families, name) == edges, name
    assert value(families, "time_to_first_token_seconds", "_sum") == pytest.approx(3.4)
    assert value(families, "inter_token_latency_seconds", "_sum") == pytest.approx(1.7)


def test_an_aborted_request_counts_nowhere_and_max_tokens_none_is_left_out():
    metrics = ServerMetrics(snapshot, MODEL, 2048)
    metrics.finished(finished_output(finished=False), SamplingParams(), [])
    families = scrape(metrics)
    assert sum(s.value for s in families["weft:request_success"].samples if s.name.endswith("_total")) == 0
    assert all(value(families, name, "_count") == 0 for name in HISTOGRAMS)
    # max_tokens None: until the context, which vLLM leaves out too
    metrics.finished(finished_output(), SamplingParams(max_tokens=None), ["stop", "length"])
    families = scrape(metrics)
    assert value(families, "request_params_n", "_count") == 1
    assert value(families, "request_params_max_tokens", "_count") == 0


class FakeEngine:
    """What build_app uses of an AsyncEngine: each request's one output is `finished_output()`."""

    info = EngineReady("fake", max_model_len=300, num_blocks=120, sampling_defaults={})
    running = True
    tokenizer = None

    def __init__(self) -> None:
        self.snapshot = snapshot()

    def start(self) -> None: ...

    def stop(self) -> None: ...

    async def generate(self, request_id: str, prompt: object, params: SamplingParams, label: str = "prompt"):
        yield finished_output()


def test_the_server_feeds_its_metrics():
    """build_app's wiring, no engine process: the served name, the context length, a streamed request's
    parameters and the finish reasons of a request that is not streamed."""
    with TestClient(build_app(FakeEngine(), MODEL)) as client:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 7}
        assert client.post("/v1/completions", json={**body, "stream": True}).status_code == 200
        streamed = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        assert client.post("/v1/completions", json=body).status_code == 200
        both = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert value(streamed, "num_requests_waiting") == 4
    assert list(buckets(streamed, "request_params_max_tokens")) == [1, 2, 5, 10, 20, 50, 100, 200]  # to 300
    assert landed_in(streamed, "request_params_max_tokens") == [10]
    assert landed_in(streamed, "request_params_n") == [1]
    assert value(both, "request_success", "_total", finished_reason="stop") == 2
    assert value(both, "request_success", "_total", finished_reason="length") == 2
    assert value(both, "e2e_request_latency_seconds", "_count") == 2
