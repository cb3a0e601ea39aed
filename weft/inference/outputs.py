"""What `LLM.generate` returns: per request tokens, text, why it stopped, and when things happened."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Wall-clock instants (time.perf_counter seconds, taken after the device finished) of one request."""

    arrival_tick: int  # engine step at which the request was admitted to the queue
    arrival_time: float  # when it entered the queue
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
class RequestOutput:
    request_id: int  # index of the prompt in the `generate` call
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str  # token_ids decoded ("" for a model without a tokenizer)
    finish_reason: str  # "stop" (EOS or a stop token) or "length" (max_tokens or the model's context)
    metrics: RequestMetrics


@dataclass
class EngineStats:
    """Counters of one `generate` call."""

    steps: int = 0
    prefill_tokens: int = 0  # tokens computed in a request's first step after (re-)admission
    decode_tokens: int = 0
    num_preemptions: int = 0
    recomputed_tokens: int = 0  # tokens whose K/V was computed again after a preemption
