"""SamplingParams: how to pick and when to stop, as in vLLM."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from functools import cached_property

from weft.errors import ParamTypeError, ParamValueError
from weft.inference.structured import StructuredOutputsParams
from weft.utils import as_int, as_real

SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties (OpenAI's and vLLM's bounds)


class RequestOutputKind(Enum):
    """What `LLMEngine.step` returns for a request (vLLM's names)."""

    CUMULATIVE = 0  # every step: all tokens and text so far
    DELTA = 1  # every step: only this step's new tokens and text
    FINAL_ONLY = 2  # once, when the request finishes


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping, vLLM's fields and meanings. Every field is checked at construction: a
    wrong type is a TypeError, a value out of range a ValueError, each naming the field (its `param`,
    weft.errors); numbers are normalized (numpy and torch scalars become Python ints and floats), lists become
    tuples. What needs the model (token ids within its vocabulary, logprobs within the engine's max_logprobs)
    is checked when the engine takes the request.

    The logits a token is drawn from are processed in vLLM's order: allowed_token_ids, bad_words, min_tokens
    (stop tokens banned) and logit_bias, then the repetition, frequency and presence penalties (greedy requests
    included), then temperature, min_p, top_k and top_p. Logprobs are the raw model's."""

    n: int = 1  # completions of the prompt, sharing its K/V; a seeded request's i-th is seeded seed + i
    max_tokens: int | None = 16  # None: until the model's context (max_model_len) is full
    min_tokens: int = 0  # no stop token (EOS, stop_token_ids) and no stop string before this many tokens
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) keeps every token
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest (after temperature)
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # a token of the prompt or output: logit / penalty if > 0, else * penalty
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: Sequence[int] | None = None  # only these may be sampled
    bad_words: Sequence[str] | None = None  # words never generated (each with and without a leading space)
    seed: int | None = None  # a fixed seed makes a sampled request reproducible on its own
    ignore_eos: bool = False
    stop: str | Sequence[str] | None = None  # strings that end the output (not included unless asked)
    stop_token_ids: Sequence[int] = ()
    include_stop_str_in_output: bool = False
    detokenize: bool = True  # False: the outputs carry token ids and no text (stop strings need the text)
    logprobs: int | None = None  # each generated token's logprob and this many alternatives (0: its own only)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (its cached prefix is recomputed)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: max_model_len)
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "n", as_int("n", self.n))
        if self.n < 1:
            raise ParamValueError(f"n must be an integer >= 1, got {self.n}", "n")
        if self.max_tokens is not None:
            set_(self, "max_tokens", as_int("max_tokens", self.max_tokens))
            if self.max_tokens < 1:
                raise ParamValueError(f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens}",
                                      "max_tokens")
        set_(self, "min_tokens", as_int("min_tokens", self.min_tokens))
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ParamValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
                                  "min_tokens")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            set_(self, name, as_real(name, getattr(self, name)))
        if self.temperature < 0:
            raise ParamValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise ParamValueError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not 0 <= self.min_p <= 1:
            raise ParamValueError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not PENALTY_RANGE[0] <= getattr(self, name) <= PENALTY_RANGE[1]:
                raise ParamValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if self.repetition_penalty <= 0:
            raise ParamValueError(f"repetition_penalty must be > 0 (1 is none), got {self.repetition_penalty}",
                                  "repetition_penalty")
        set_(self, "top_k", as_int("top_k", self.top_k))
        if self.top_k < -1:
            raise ParamValueError(f"top_k must be -1, 0 (both: every token) or positive, got {self.top_k}", "top_k")
        if self.seed is not None:
            set_(self, "seed", as_int("seed", self.seed))
            if not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
                raise ParamValueError(f"seed must fit in 64 bits ([-2**63, 2**64)), got {self.seed}", "seed")
        for name in ("ignore_eos", "include_stop_str_in_output", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ParamTypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__} "
                                     f"{getattr(self, name)!r}", name)
        set_(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        if self.allowed_token_ids is not None:
            set_(self, "allowed_token_ids", _token_ids("allowed_token_ids", self.allowed_token_ids))
            if not self.allowed_token_ids:
                raise ParamValueError("allowed_token_ids must not be empty (None allows every token)",
                                      "allowed_token_ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ParamTypeError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r:.60}",
                                     "logit_bias")
            set_(self, "logit_bias", {as_int(f"logit_bias key {k!r}", _key(k), "logit_bias"):
                                      as_real("logit_bias", v) for k, v in self.logit_bias.items()})
        set_(self, "stop", _strings("stop", self.stop))
        if self.stop and not self.detokenize:
            raise ParamValueError("stop strings need detokenize=True: they are found in the text", "detokenize")
        set_(self, "bad_words", _strings("bad_words", self.bad_words))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                set_(self, name, as_int(name, value))
                if getattr(self, name) < 0:
                    raise ParamValueError(f"{name} must be >= 0 (or None), got {value}", name)
        if self.truncate_prompt_tokens is not None:
            set_(self, "truncate_prompt_tokens", as_int("truncate_prompt_tokens", self.truncate_prompt_tokens))
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ParamValueError("truncate_prompt_tokens must be >= 1, or -1 (max_model_len), got "
                                      f"{self.truncate_prompt_tokens}", "truncate_prompt_tokens")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ParamTypeError(f"structured_outputs must be a StructuredOutputsParams, got "
                                 f"{self.structured_outputs!r:.60}", "structured_outputs")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ParamTypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}", "output_kind")

    @cached_property  # read for every request every step; the fields never change
    def greedy(self) -> bool:
        return self.temperature == 0

    @cached_property
    def penalized(self) -> bool:
        """Whether any of the three penalties is on (each needs the request's token counts)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @cached_property
    def plain(self) -> bool:
        """Whether no rule changes its logits before sampling (no penalty, bias, allowed set, ban or grammar)."""
        return (not self.penalized and not self.logit_bias and self.allowed_token_ids is None and not self.bad_words
                and self.min_tokens == 0 and self.structured_outputs is None)

    def child(self, index: int) -> SamplingParams:
        """The params of completion `index` of n: one completion, seeded seed + index (within 64 bits), and the
        prompt's logprobs only on the first (they are the request's, not a completion's)."""
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed >= SEED_RANGE[1]:
            seed -= 2**64  # the same low 64 bits, still a valid seed
        return replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None)


def _key(k: object) -> object:
    """A logit_bias key: JSON sends token ids as strings of digits."""
    return int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k


def _token_ids(name: str, ids: object) -> tuple[int, ...]:
    ids = () if ids is None else ids
    if hasattr(ids, "tolist") and hasattr(ids, "shape"):  # a numpy array or torch tensor
        ids = ids.tolist()
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise ParamTypeError(f"{name} must be a list of token ids, got {type(ids).__name__} {ids!r:.60}", name)
    return tuple(as_int(f"{name}[{i}]", t, name) for i, t in enumerate(ids))


def _strings(name: str, value: object) -> tuple[str, ...]:
    """A string or a list of them, as a tuple (None: none); an empty string is refused (it would match anywhere)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, Sequence) or not all(isinstance(s, str) for s in items):
        raise ParamTypeError(f"{name} must be a string or a list of strings, got {value!r:.60}", name)
    if any(s == "" for s in items):
        raise ParamValueError(f"{name} must not hold an empty string", name)
    return tuple(items)


def check_sampling_params(params: object, label: str) -> SamplingParams:
    """`params` itself, or SamplingParams() for None; a TypeError naming `label` for anything else."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"{label}: expected SamplingParams, got {type(params).__name__} {params!r:.60}")
    return params
