"""SamplingParams: how to pick and when to stop, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from weft.errors import ParamTypeError, ParamValueError
from weft.utils import as_int, as_real

SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # the most alternatives a token's logprobs may list (vLLM's default bound)


class RequestOutputKind(Enum):
    """What `LLMEngine.step` returns for a request (vLLM's names)."""

    CUMULATIVE = 0  # every step: all tokens and text so far
    DELTA = 1  # every step: only this step's new tokens and text
    FINAL_ONLY = 2  # once, when the request finishes


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping. Every field is checked at construction: a wrong type is a
    TypeError, a value out of range a ValueError, each naming the field (its `param`, weft.errors); numbers
    are normalized (numpy and torch scalars become Python ints and floats)."""

    max_tokens: int | None = 16  # None: until the model's context (max_model_len) is full
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) keeps every token
    seed: int | None = None  # a fixed seed makes a sampled request reproducible on its own
    ignore_eos: bool = False
    stop_token_ids: Sequence[int] = ()
    logprobs: int | None = None  # each generated token's logprob and this many alternatives (0: none)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (its cached prefix is recomputed)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.max_tokens is not None:
            set_(self, "max_tokens", as_int("max_tokens", self.max_tokens))
            if self.max_tokens < 1:
                raise ParamValueError(f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens}",
                                      "max_tokens")
        set_(self, "temperature", as_real("temperature", self.temperature))
        if self.temperature < 0:
            raise ParamValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}", "temperature")
        set_(self, "top_p", as_real("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ParamValueError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        set_(self, "top_k", as_int("top_k", self.top_k))
        if self.top_k < -1:
            raise ParamValueError(f"top_k must be -1, 0 (both: every token) or positive, got {self.top_k}", "top_k")
        if self.seed is not None:
            set_(self, "seed", as_int("seed", self.seed))
            if not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
                raise ParamValueError(f"seed must fit in 64 bits ([-2**63, 2**64)), got {self.seed}", "seed")
        if not isinstance(self.ignore_eos, bool):
            raise ParamTypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__} {self.ignore_eos!r}",
                                 "ignore_eos")
        stop = () if self.stop_token_ids is None else self.stop_token_ids
        if hasattr(stop, "tolist") and hasattr(stop, "shape"):  # a numpy array or torch tensor
            stop = stop.tolist()
        if isinstance(stop, str | bytes) or not isinstance(stop, Sequence):
            raise ParamTypeError(f"stop_token_ids must be a list of token ids, got {type(stop).__name__} {stop!r}",
                                 "stop_token_ids")
        set_(self, "stop_token_ids", tuple(as_int(f"stop_token_ids[{i}]", t, "stop_token_ids")
                                              for i, t in enumerate(stop)))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                set_(self, name, as_int(name, value))
                if not 0 <= getattr(self, name) <= MAX_LOGPROBS:
                    raise ParamValueError(f"{name} must be in [0, {MAX_LOGPROBS}] (or None), got {value}", name)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ParamTypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}", "output_kind")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_sampling_params(params: object, label: str) -> SamplingParams:
    """`params` itself, or SamplingParams() for None; a TypeError naming `label` for anything else."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"{label}: expected SamplingParams, got {type(params).__name__} {params!r:.60}")
    return params
