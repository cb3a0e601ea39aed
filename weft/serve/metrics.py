"""The server's Prometheus metrics (GET /metrics): vLLM's metric set under a `weft:` prefix.

Names after the prefix, types, label names and histogram buckets are those of vLLM's v1 engine as its
vllm/v1/metrics/loggers.py (PrometheusStatLogger), buckets.py and stats.py have them in vLLM v0.34.0
(commit 62d4bc3c7), so a dashboard made for vLLM reads weft's once `vllm:` reads `weft:`. Every series carries
vLLM's labels model_name (the served name) and engine ("0": weft runs one engine); counters end in `_total`.

The gauges and counters are read from the engine process's latest snapshot when scraped (EngineCollector); the
per-request histograms and request_success are fed as each request finishes (ServerMetrics.finished).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from weft.inference.outputs import EngineSnapshot, RequestOutput
from weft.inference.params import SamplingParams

LABELS = ("model_name", "engine")
ENGINE = "0"
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason: all shown, zeros too

# vLLM's bucket families (buckets.py)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    return [m * 10**e for e in range(len(str(max_model_len))) for m in (1, 2, 5) if m * 10**e <= max_model_len]


class EngineCollector(Collector):
    """The engine's gauges and counters, from its latest snapshot at each scrape."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self.snapshot = snapshot
        self.labels = [model_name, ENGINE]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap = self.snapshot()
        s = snap.stats
        gauges = {
            "num_requests_running": ("Requests in the running batch.", snap.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled (preempted ones included).", snap.num_waiting),
            "kv_cache_usage_perc": ("KV-cache usage: KV pool blocks held by requests / all (1 is 100 percent).",
                                    snap.blocks_used / snap.blocks_total if snap.blocks_total else 0.0),
            # weft's own
            "kv_blocks_used": ("KV pool blocks held by requests.", snap.blocks_used),
            "kv_blocks_total": ("KV pool blocks (N).", snap.blocks_total),
        }  # fmt: skip
        counters = {
            "num_preemptions": ("Requests preempted (recomputed later).", s.num_preemptions),
            "prompt_tokens": ("Prompt tokens of requests that got their first token.", s.prompt_tokens),
            "generation_tokens": ("Tokens generated.", s.generation_tokens),
            "prefix_cache_queries": ("Prompt tokens of admitted requests.", s.prefix_cache_queries),
            "prefix_cache_hits": ("Of those, tokens found in the prefix cache.", s.prefix_cache_hits),
            # weft's own
            "recomputed_tokens": ("Tokens computed again after a preemption.", s.recomputed_tokens),
            "engine_steps": ("Engine steps run.", s.steps),
        }
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(f"weft:{name}", doc, labels=LABELS)
            gauge.add_metric(self.labels, value)
            yield gauge
        for name, (doc, value) in counters.items():
            counter = CounterMetricFamily(f"weft:{name}", doc, labels=LABELS)
            counter.add_metric(self.labels, value)
            yield counter


class ServerMetrics:
    """The registry /metrics exposes: the engine's snapshot and what the server sees of finished requests."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(snapshot, model_name))
        self.labels = (model_name, ENGINE)
        self.success = Counter("weft:request_success", "Requests finished, by finish reason.",
                               [*LABELS, "finished_reason"], registry=self.registry)  # fmt: skip
        for reason in FINISH_REASONS:
            self.success.labels(*self.labels, reason)
        tokens = token_buckets(max_model_len)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[int]) -> Histogram:
            return Histogram(f"weft:{name}", doc, LABELS, buckets=buckets, registry=self.registry).labels(*self.labels)

        latency = REQUEST_LATENCY_BUCKETS
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Between a request's successive tokens.",
                             INTER_TOKEN_LATENCY_BUCKETS)  # fmt: skip
        self.tpot = histogram("request_time_per_output_token_seconds", "A request's decode time per token after "
                              "its first (0 for one token).", INTER_TOKEN_LATENCY_BUCKETS)  # fmt: skip
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", latency)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled (WAITING).", latency)
        self.inference = histogram("request_inference_time_seconds", "First scheduled to last token (RUNNING).",
                                   latency)  # fmt: skip
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token (PREFILL).", latency)
        self.decode = histogram("request_decode_time_seconds", "First token to last token (DECODE).", latency)
        self.prompt_tokens = histogram("request_prompt_tokens", "A request's prompt tokens.", tokens)
        self.generation_tokens = histogram("request_generation_tokens", "A request's generated tokens.", tokens)
        self.prefill_kv_computed = histogram("request_prefill_kv_computed_tokens", "A request's prompt tokens not "
                                             "found in the prefix cache.", tokens)  # fmt: skip
        self.preemptions = histogram("request_num_preemptions", "Times a request was preempted.",
                                     REQUEST_NUM_PREEMPTIONS_BUCKETS)  # fmt: skip
        self.n = histogram("request_params_n", "The n request parameter.", REQUEST_PARAMS_N_BUCKETS)
        self.max_tokens = histogram("request_params_max_tokens", "The max_tokens request parameter.", tokens)

    def finished(self, out: RequestOutput, params: SamplingParams, reasons: list[str]) -> None:
        """A request's last output and its completions' finish `reasons` (a stream's last output holds only the
        completions still running): request_success once per completion, the histograms once per request from its
        engine metrics (its first completion's), with the intervals vLLM's IterationStats.update_from_finished_request
        takes; request_params_* from its `params`. An output that is not finished (an aborted request's, the client
        gone) counts nowhere, as vLLM counts aborts nowhere."""
        if not out.finished:
            return
        for reason in reasons:
            self.success.labels(*self.labels, reason).inc()
        m = out.metrics
        if m is None or not m.token_times or m.first_scheduled_time is None:
            return
        first, last, scheduled = m.token_times[0], m.token_times[-1], m.first_scheduled_time
        self.ttft.observe(first - m.arrival_time)
        for gap in m.itls:
            self.itl.observe(gap)
        generated = len(m.token_times)
        self.tpot.observe((last - first) / (generated - 1) if generated > 1 else 0.0)
        self.e2e.observe(last - m.arrival_time)
        self.queue.observe(scheduled - m.arrival_time)  # arrival: when the engine queued it
        self.inference.observe(last - scheduled)
        self.prefill.observe(first - scheduled)  # preemptions before the first token included, as in vLLM
        self.decode.observe(last - first)
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.generation_tokens.observe(generated)
        self.prefill_kv_computed.observe(len(out.prompt_token_ids) - (out.num_cached_tokens or 0))
        self.preemptions.observe(m.num_preemptions)
        self.n.observe(params.n)
        if params.max_tokens:  # None: up to the context, which vLLM leaves out too
            self.max_tokens.observe(params.max_tokens)
