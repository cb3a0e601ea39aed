"""The OpenAI-compatible request and response bodies, as pydantic models (with vLLM's extensions:
`top_k`, `ignore_eos`, `stop_token_ids`, `return_token_ids`).

Sampling fields are taken as sent and checked by `SamplingParams` itself, so the server refuses
exactly what the engine refuses, in the engine's words. OpenAI fields weft does not implement
are refused unless they are left at what means "off".
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from weft.errors import ParamTypeError, ParamValueError
from weft.inference.params import RequestOutputKind, SamplingParams

# field -> the values that mean it is not used
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "stop": (None, [], ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class GenerationRequest(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI's own server does

    model: str
    max_tokens: Any = None
    temperature: Any = 1.0
    top_p: Any = 1.0
    top_k: Any = -1
    seed: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool = False  # each choice carries its token ids (and the prompt's)

    def unsupported(self) -> str | None:
        """The first OpenAI field set to something weft does not do, if any."""
        values = {**(self.model_extra or {})}
        return next((k for k, off in UNSUPPORTED.items() if k in values and values[k] not in off), None)

    def sampling_params(self) -> SamplingParams:
        """The request's SamplingParams: deltas for a stream, else the final output alone; ValueError / TypeError
        from SamplingParams' own checks for a bad value."""
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else self.default_max_tokens(),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs(),
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )

    def default_max_tokens(self) -> int | None:
        return None

    def num_logprobs(self) -> int | None:
        """The alternatives each token's logprobs list, or None for no logprobs."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    prompt: Any  # text, token ids, or a list of either (checked by weft.inference.inputs)
    logprobs: Any = None  # the legacy API's: how many alternatives each token's logprobs list

    def default_max_tokens(self) -> int | None:
        return 16  # OpenAI's default for completions

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(GenerationRequest):
    messages: Any  # [{"role", "content"}, ...], checked by weft.inference.chat
    max_completion_tokens: Any = None  # OpenAI's newer name for max_tokens
    logprobs: Any = False  # the chat API's: whether to return logprobs at all
    top_logprobs: Any = None  # and then how many alternatives each token lists

    def default_max_tokens(self) -> int | None:
        return self.max_completion_tokens  # None: until the context is full, as OpenAI's chat does

    def num_logprobs(self) -> int | None:
        if not isinstance(self.logprobs, bool):
            raise ParamTypeError(f"logprobs must be a bool in a chat request, got {self.logprobs!r}", "logprobs")
        if not self.logprobs:
            if self.top_logprobs not in (None, 0):
                raise ParamValueError("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return 0 if self.top_logprobs is None else self.top_logprobs


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions API's: per token its text, logprob, top alternatives, and offset in the text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "weft"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
