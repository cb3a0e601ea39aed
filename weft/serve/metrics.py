"""The server's Prometheus metrics (GET /metrics), vLLM's names under a `weft:` prefix.

Gauges and counters come from the engine process's latest snapshot (LLMEngine.snapshot) when scraped;
the latency histograms are fed as each request finishes, from the instants its RequestMetrics holds.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from weft.inference.outputs import RequestOutput
from weft.serve.async_engine import AsyncEngine

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap = self.engine.snapshot
        s = snap.stats
        gauges = {
            "num_requests_running": ("Requests in the running batch.", snap.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", snap.num_waiting),
            "kv_blocks_used": ("KV pool blocks held by requests.", snap.blocks_used),
            "kv_blocks_total": ("KV pool blocks (N).", snap.blocks_total),
        }
        counters = {
            "num_preemptions": ("Requests preempted (recomputed later).", s.num_preemptions),
            "prompt_tokens": ("Prompt tokens of requests that got their first token.", s.prompt_tokens),
            "generation_tokens": ("Tokens generated.", s.generation_tokens),
            "recomputed_tokens": ("Tokens computed again after a preemption.", s.recomputed_tokens),
            "engine_steps": ("Engine steps run.", s.steps),
            "prefix_cache_queries": ("Prompt tokens of admitted requests.", s.prefix_cache_queries),
            "prefix_cache_hits": ("Of those, tokens found in the prefix cache.", s.prefix_cache_hits),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"weft:{name}", doc, value)
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"weft:{name}", doc, value)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        hist = {"buckets": LATENCY_BUCKETS_S, "registry": self.registry}
        self.ttft = Histogram("weft:time_to_first_token_seconds", "Arrival to first token.", **hist)
        self.itl = Histogram("weft:inter_token_latency_seconds", "Between a request's tokens.", **hist)
        self.e2e = Histogram("weft:e2e_request_latency_seconds", "Arrival to last token.", **hist)

    def finished(self, out: RequestOutput) -> None:
        """A finished request's latencies into the histograms."""
        m = out.metrics
        if m is None or not m.token_times:
            return
        self.ttft.observe(m.ttft)
        self.e2e.observe(m.e2e)
        for gap in m.itls:
            self.itl.observe(gap)
