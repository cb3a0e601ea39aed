"""Sequence: one request's state as it moves through the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from functools import cached_property
from typing import Any

from weft.inference.detokenizer import IncrementalDetokenizer
from weft.inference.outputs import RequestMetrics
from weft.inference.params import SamplingParams


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    request_id: str | int
    token_ids: list[int]  # prompt, then every generated token
    num_prompt_tokens: int
    params: SamplingParams
    max_len: int  # prompt + max_tokens, capped by max_model_len
    metrics: RequestMetrics
    prompt: str | None = None  # the text the prompt came from, if any
    detokenizer: IncrementalDetokenizer | None = None  # streamed outputs, and stop strings, with a tokenizer
    index: int = 0  # which of the request's n completions it is
    first: Sequence | None = None  # completion 0, for the others: they wait for its prompt's blocks to share them
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words, tokenized
    matcher: Any = None  # its structured output's weft.inference.structured.Matcher, if it has one
    allowed: Any = None  # params.allowed_token_ids as a bitmask row, int32 [1, ceil(V / 32)] (weft.layers.bitmask)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    num_returned_tokens: int = 0  # generated tokens already handed out in DELTA outputs
    num_returned_chars: int = 0  # and characters of its text
    num_cached_tokens: int | None = None  # its prompt tokens the prefix cache held when it was first admitted
    num_pending: int = 0  # sampled tokens still on their way to the host (overlap: 0 or 1 when a step is planned)
    pending_row: int = 0  # the newest pending token's row among its step's sampled ids
    block_table: list[int] = field(default_factory=list)
    num_dropped_blocks: int = 0  # its leading blocks given back behind a sliding window (their entries: 0)
    block_hashes: list[int] = field(default_factory=list)  # of its full, computed blocks (prefix caching)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict] | None = None  # with params.logprobs: one {token id: Logprob} per generated token
    prompt_logprobs: list[dict | None] | None = None  # with params.prompt_logprobs: per prompt token so far

    @property
    def num_tokens(self) -> int:
        """Its tokens, those still in flight included (what the scheduler plans with)."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Its generated tokens, those in flight included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def needs_host_tokens(self) -> bool:
        """Whether its next logits' rules depend on its tokens on the host (a grammar, a bad word of several
        tokens): the steps before one it samples in land before that one's sampling is queued."""
        return self.matcher is not None or any(len(w) > 1 for w in self.bad_words_ids)

    @cached_property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's ids, one list for every output of the request (a prompt never changes)."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def max_kv_tokens(self) -> int:
        """Cache slots the request can ever need: every token but the last generated one."""
        return self.max_len - 1
