"""What the engine returns, in vLLM's shape: a RequestOutput per request, its completion in
`outputs[0]`, and when things happened; plus the engine's lifetime counters and gauges."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class RequestMetrics:
    """Instants of one request on time.perf_counter's clock (seconds); token times are taken once the
    step's sampled ids reached the host, so the device had finished them."""

    arrival_time: float  # when `add_request` took it (or the instant its caller gave)
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float:
        """Time to first token, from arrival (s)."""
        return self.token_times[0] - self.arrival_time

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies (s), one fewer than tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def e2e(self) -> float:
        """Arrival to last token (s)."""
        return self.token_times[-1] - self.arrival_time


@dataclass
class Logprob:
    """vLLM's: a token's log-probability under the model, its rank (1: the likeliest), its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a request: index i of its SamplingParams.n."""

    index: int
    text: str  # token_ids decoded ("" for a model without a tokenizer)
    token_ids: list[int]  # generated tokens only (this step's alone for RequestOutputKind.DELTA)
    finish_reason: str | None  # "stop" (EOS, a stop token or string, a grammar's end), "length"; None: running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if one did
    logprobs: list[dict[int, Logprob]] | None = None  # with SamplingParams.logprobs: one per token of token_ids


@dataclass
class RequestOutput:
    request_id: str | int
    prompt: str | None  # the prompt's text, when it was given as text
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None  # the engine's are always set; the server's pieces carry them when finished
    # with SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None  # its prompt tokens found in the prefix cache when it was first admitted


@dataclass
class EngineStats:
    """Counters over the engine's lifetime; `since` gives those of a stretch of it."""

    steps: int = 0
    prompt_tokens: int = 0  # the prompts of requests that got their first token (vLLM's), cached tokens included
    generation_tokens: int = 0  # tokens generated and handed out
    prefill_tokens: int = 0  # tokens computed as prefill: prompts, in one step or in chunks, and recomputations
    decode_tokens: int = 0  # tokens computed as decode: each step's newest ones, sampled the step before
    num_preemptions: int = 0
    recomputed_tokens: int = 0  # tokens whose K/V was computed again after a preemption
    prefix_cache_queries: int = 0  # known tokens of requests at their admissions
    prefix_cache_hits: int = 0  # of those, the ones found in the prefix cache

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Tokens served from the prefix cache / tokens of admitted requests (0 before any)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def since(self, earlier: EngineStats) -> EngineStats:
        return EngineStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})


@dataclass(frozen=True)
class EngineSnapshot:
    """One reading of the engine (LLMEngine.snapshot): its gauges now and its counters so far."""

    num_running: int  # requests in the running batch
    num_waiting: int  # requests queued, not admitted (preempted ones included)
    blocks_used: int  # KV pool blocks held by requests
    blocks_total: int  # N
    stats: EngineStats
