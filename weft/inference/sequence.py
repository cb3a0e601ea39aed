"""Sequence: one request's state as it moves through the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from weft.inference.outputs import RequestMetrics
from weft.inference.params import SamplingParams


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt, then every generated token
    num_prompt_tokens: int
    params: SamplingParams
    max_len: int  # prompt + max_tokens, capped by max_model_len
    metrics: RequestMetrics
    generator: torch.Generator | None = None  # seeded sampling
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def max_kv_tokens(self) -> int:
        """Cache slots the request can ever need: every token but the last generated one."""
        return self.max_len - 1
