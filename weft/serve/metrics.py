"""The server's Prometheus metrics (GET /metrics), vLLM's names under a `weft:` prefix.

Gauges and counters are read from the engine when scraped; the latency histograms are fed as
each request finishes, from the instants its RequestMetrics holds.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from weft.inference.engine import LLMEngine
from weft.inference.outputs import RequestOutput

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class EngineCollector(Collector):
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        scheduler, stats = self.engine.scheduler, self.engine.stats
        blocks = scheduler.blocks
        gauges = {
            "num_requests_running": ("Requests in the running batch.", len(scheduler.running)),
            "num_requests_waiting": ("Requests waiting to be scheduled.", len(scheduler.waiting)),
            "kv_blocks_used": ("KV pool blocks held by requests.", blocks.num_blocks - blocks.num_free),
            "kv_blocks_total": ("KV pool blocks (N).", blocks.num_blocks),
        }
        counters = {
            "num_preemptions": ("Requests preempted (recomputed later).", stats.num_preemptions),
            "prompt_tokens": ("Prefill tokens computed.", stats.prefill_tokens),
            "generation_tokens": ("Decode tokens computed.", stats.decode_tokens),
            "engine_steps": ("Engine steps run.", stats.steps),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"weft:{name}", doc, value)
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"weft:{name}", doc, value)


class ServerMetrics:
    def __init__(self, engine: LLMEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        hist = {"buckets": LATENCY_BUCKETS_S, "registry": self.registry}
        self.ttft = Histogram("weft:time_to_first_token_seconds", "Arrival to first token.", **hist)
        self.itl = Histogram("weft:inter_token_latency_seconds", "Between a request's tokens.", **hist)
        self.e2e = Histogram("weft:e2e_request_latency_seconds", "Arrival to last token.", **hist)

    def finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if not m.token_times:
            return
        self.ttft.observe(m.ttft)
        self.e2e.observe(m.e2e)
        for gap in m.itls:
            self.itl.observe(gap)
