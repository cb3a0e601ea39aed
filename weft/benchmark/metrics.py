"""Serving metrics of one run: latency percentiles, makespan, token rates, peak memory, preemptions.

Latencies come from each request's `RequestMetrics` (perf_counter instants taken once the
device had finished); whatever engine served the run, its results are expressed that way.
ITL percentiles pool the gaps of all requests, as vLLM's benchmark does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from weft.inference.outputs import RequestOutput

PERCENTILES = (50, 90, 99)


def synchronize(device: torch.device | str) -> None:
    """Wait for the device: host clocks read after this include all queued work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Window:
    """What `measure` saw: when the run started, how long it took, and its peak device memory."""

    start: float  # perf_counter instant: every request of an offline run arrives here
    makespan_s: float = 0.0
    peak_mem_bytes: int | None = None  # torch's peak allocation; None off CUDA (not measured)


@contextmanager
def measure(device: torch.device | str) -> Iterator[Window]:
    """Times the body between two device synchronizations and tracks its peak memory."""
    cuda = torch.device(device).type == "cuda"
    synchronize(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    window = Window(start=time.perf_counter())
    yield window
    synchronize(device)
    window.makespan_s = time.perf_counter() - window.start
    window.peak_mem_bytes = torch.cuda.max_memory_allocated(device) if cuda else None


def percentiles(name: str, values: Sequence[float]) -> dict[str, float | None]:
    """{'<name>_p50_s': ..., '<name>_p90_s': ..., '<name>_p99_s': ...}; None for no values."""
    points = np.percentile(values, PERCENTILES).tolist() if len(values) else [None] * len(PERCENTILES)
    return {f"{name}_p{q}_s": v for q, v in zip(PERCENTILES, points, strict=True)}


@dataclass(frozen=True)
class RunMetrics:
    requests: int
    input_tokens: int
    output_tokens: int  # tokens the requests actually received
    makespan_s: float  # first arrival to last token
    latency: dict[str, float | None]  # ttft/itl/e2e percentiles, see `percentiles`
    peak_mem_bytes: int | None
    preemptions: int | None  # None: the engine does not report it
    recomputed_tokens: int | None

    @property
    def input_tok_s(self) -> float:
        return self.input_tokens / self.makespan_s

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.makespan_s

    def as_record(self) -> dict[str, float | int | None]:
        """The flat dict that goes into `benchmark.extra_info`."""
        return {
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "makespan_s": self.makespan_s,
            "input_tok_s": self.input_tok_s,
            "output_tok_s": self.output_tok_s,
            **self.latency,
            "peak_mem_bytes": self.peak_mem_bytes,
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
        }


def summarize(
    outputs: Sequence[RequestOutput],
    makespan_s: float,
    peak_mem_bytes: int | None,
    preemptions: int | None,
    recomputed_tokens: int | None,
) -> RunMetrics:
    if makespan_s <= 0:
        raise ValueError(f"makespan must be > 0 s, got {makespan_s}")
    served = [o.metrics for o in outputs if o.metrics.token_times]  # a failed request has no latency
    return RunMetrics(
        requests=len(outputs),
        input_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        makespan_s=makespan_s,
        latency={
            **percentiles("ttft", [m.ttft for m in served]),
            **percentiles("itl", [gap for m in served for gap in m.itls]),
            **percentiles("e2e", [m.e2e for m in served]),
        },
        peak_mem_bytes=peak_mem_bytes,
        preemptions=preemptions,
        recomputed_tokens=recomputed_tokens,
    )


@dataclass
class Served:
    """One timed run: each request's output (token ids and timings) and the engine's counters."""

    outputs: list[RequestOutput]
    window: Window
    preemptions: int | None = None  # None: the engine does not report it
    recomputed_tokens: int | None = None
    steps: int | None = None  # engine ticks, where the engine counts them
    prefix_cache_hit_rate: float | None = None  # prompt tokens found in the prefix cache / admitted (weft)

    def metrics(self) -> RunMetrics:
        w, recomputed = self.window, self.recomputed_tokens
        return summarize(self.outputs, w.makespan_s, w.peak_mem_bytes, self.preemptions, recomputed)
