"""The OpenAI-compatible request and response bodies, as pydantic models, with vLLM's extensions (`top_k`,
`min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`allowed_token_ids`, `bad_words`, `prompt_logprobs`, `truncate_prompt_tokens`, `structured_outputs`,
`return_token_ids`), and vLLM's /tokenize and /detokenize bodies.

Sampling fields are taken as sent and checked by `SamplingParams` itself, so the server refuses
exactly what the engine refuses, in the engine's words. OpenAI fields weft does not implement
are refused unless they are left at what means "off".
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictStr,
    model_serializer,
    model_validator,
)

from weft.errors import ParamTypeError, ParamValueError
from weft.inference.chat import MESSAGES
from weft.inference.inputs import PROMPT
from weft.inference.params import RequestOutputKind, SamplingParams
from weft.inference.structured import StructuredOutputsParams

# field -> the values that mean it is not used
# OpenAI's and vLLM's fields that change what is generated and weft does not implement: refused unless set to what
# means "off" (a field ignored would answer other tokens than the client asked for); any other field is ignored,
# as OpenAI's own server ignores fields it does not know
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1.0),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    # vLLM's older names for structured outputs (structured_outputs and response_format are weft's)
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "guided_whitespace_pattern": (None,), "guided_decoding_backend": (None, "xgrammar", "auto"),
    "logits_processors": (None, []), "return_tokens_as_token_ids": (None, False), "prompt_embeds": (None,),
    "priority": (None, 0), "vllm_xargs": (None, {}), "kv_transfer_params": (None,),
    "truncation_side": (None, "left"),  # truncate_prompt_tokens keeps a prompt's last tokens
    "cache_salt": (None,),  # the prefix cache is shared by every request
    "logprob_token_ids": (None, []), "watermarking": (None, False), "repetition_detection": (None,),
    "thinking_token_budget": (None,),
}  # fmt: skip
COMPLETION_UNSUPPORTED = {  # max_completion_tokens is the chat API's name
    **UNSUPPORTED, "suffix": (None, ""), "add_special_tokens": (None, True), "max_completion_tokens": (None,),
}  # fmt: skip
CHAT_UNSUPPORTED = {  # the conversation is rendered by the model's own template
    **UNSUPPORTED, "echo": (None, False), "chat_template": (None,), "documents": (None, []),
    "mm_processor_kwargs": (None, {}), "reasoning_effort": (None,), "modalities": (None, ["text"]), "audio": (None,),
}  # fmt: skip
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's bounds; vLLM clamps to them too
# OpenAI's bound on a prompt's completions (each a sequence the engine queues: memory a client chooses); a list of
# prompts multiplies it, as in vLLM, and --max-request-body-bytes bounds the list
MAX_N = 128


def without_nulls(body: Any) -> Any:
    """A body's fields sent as null left out, so that each takes its default (as OpenAI's server reads them)."""
    return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # with include_usage: every chunk carries the usage so far (vLLM's)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, body: Any) -> Any:
        return without_nulls(body)


class Refusing(BaseModel):
    """A body whose unimplemented OpenAI or vLLM fields (`refused`: each one's values that mean "off") are refused."""

    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI's own server does
    refused: ClassVar[dict[str, tuple[Any, ...]]] = UNSUPPORTED

    def unsupported(self) -> str | None:
        """The first OpenAI or vLLM field set to something weft does not do, if any."""
        values = {**(self.model_extra or {})}
        return next((k for k, off in self.refused.items() if k in values and values[k] not in off), None)


class GenerationRequest(Refusing):
    """What completions and chat completions share."""

    model: str | None = None  # None: the one model this server serves (vLLM's)
    n: Any = 1
    max_tokens: Any = None
    min_tokens: Any = 0
    temperature: Any = 1.0
    top_p: Any = 1.0
    top_k: Any = -1
    min_p: Any = 0.0
    presence_penalty: Any = 0.0
    frequency_penalty: Any = 0.0
    repetition_penalty: Any = 1.0
    logit_bias: Any = None  # {token id (a string in JSON): bias in [-100, 100]}
    allowed_token_ids: Any = None
    bad_words: Any = None
    seed: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    include_stop_str_in_output: Any = False
    ignore_eos: Any = False
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None
    response_format: Any = None  # {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}
    structured_outputs: Any = None  # vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool = False  # each choice carries its token ids (and the prompt's)
    request_id: StrictStr | None = None  # vLLM's: the response's id (else a random one); one in flight at a time

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, body: Any) -> Any:
        """Nulls take the defaults; but a max_tokens sent as null means until the context is full (vLLM's)."""
        if isinstance(body, dict) and "max_tokens" in body and body["max_tokens"] is None:
            return {**without_nulls(body), "max_tokens": None}
        return without_nulls(body)

    def sampling_params(self) -> SamplingParams:
        """The request's SamplingParams: deltas for a stream, else the final output alone; ValueError / TypeError
        from SamplingParams' own checks for a bad value."""
        return SamplingParams(
            n=self.n,
            max_tokens=self.requested_max_tokens(),
            min_tokens=self.min_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=clamped_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs(),
            prompt_logprobs=self.num_prompt_logprobs(),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=structured(self.response_format, self.structured_outputs),
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )

    def requested_max_tokens(self) -> Any:
        """The max_tokens the request asks for (None: until the context is full), unchecked."""
        return self.max_tokens

    def field_names(self) -> dict[str, str]:
        """The request's own name for each SamplingParams field a refusal may name, where they differ."""
        return {"structured_outputs": "response_format"} if self.response_format is not None else {}

    def num_logprobs(self) -> int | None:
        """The alternatives each token's logprobs list, or None for no logprobs."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


def clamped_bias(bias: Any) -> Any:
    """logit_bias with each value clamped to OpenAI's [-100, 100] (what is not a number is left to SamplingParams
    to refuse)."""
    if not isinstance(bias, dict):
        return bias
    low, high = LOGIT_BIAS_RANGE
    return {k: min(high, max(low, v)) if isinstance(v, int | float) and not isinstance(v, bool) else v
            for k, v in bias.items()}


def structured(response_format: Any, outputs: Any) -> StructuredOutputsParams | None:
    """OpenAI's response_format or vLLM's structured_outputs (not both) as StructuredOutputsParams; a malformed one
    is a ParamValueError / ParamTypeError naming its field."""
    if response_format is not None and outputs is not None:
        raise ParamValueError("send response_format or structured_outputs, not both", "response_format")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise ParamTypeError(f"structured_outputs must be an object, got {outputs!r:.60}", "structured_outputs")
        try:
            return StructuredOutputsParams(**outputs)
        except TypeError as e:  # an unknown key
            raise ParamValueError(f"structured_outputs: {e}", "structured_outputs") from None
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        schema = response_format.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
            raise ParamValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": '
                                  '{...}}}', "response_format")
        return StructuredOutputsParams(json=schema["schema"])
    raise ParamValueError(f'response_format type must be "text", "json_object" or "json_schema", got '
                          f"{response_format!r:.80}", "response_format")


class CompletionRequest(GenerationRequest):
    refused: ClassVar[dict[str, tuple[Any, ...]]] = COMPLETION_UNSUPPORTED
    prompt: Any  # text, token ids, or a list of either (checked by weft.inference.inputs)
    logprobs: Any = None  # the legacy API's: how many alternatives each token's logprobs list
    echo: StrictBool = False  # each choice begins with its prompt (and, with logprobs, the prompt's logprobs)
    max_tokens: Any = 16  # OpenAI's default for completions; null: until the context is full

    def scores_prompt(self) -> bool:
        """echo with max_tokens 0 (vLLM's prompt scoring): the prompt, and with logprobs its logprobs, alone; the
        engine runs it for one token, which the response leaves out."""
        return self.echo and type(self.max_tokens) is int and self.max_tokens == 0

    def requested_max_tokens(self) -> Any:
        return 1 if self.scores_prompt() else self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """An echoed prompt's logprobs list as many alternatives as the completion's (vLLM's)."""
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            return self.logprobs
        return self.prompt_logprobs


class ChatTemplateOptions(BaseModel):
    """vLLM's options for rendering a conversation through the model's chat template (weft.inference.chat)."""

    add_generation_prompt: StrictBool = True  # the assistant's turn opened after the messages
    continue_final_message: StrictBool = False  # the last message left open, for the model to go on with
    add_special_tokens: StrictBool = False  # the tokenizer's own (BOS), on top of what the template writes
    chat_template_kwargs: Any = None  # the template's own variables (Qwen3's enable_thinking, ...)

    def template_options(self) -> dict[str, Any]:
        return dict(add_generation_prompt=self.add_generation_prompt, add_special_tokens=self.add_special_tokens,
                    continue_final_message=self.continue_final_message, chat_template_kwargs=self.chat_template_kwargs)


class ChatCompletionRequest(GenerationRequest, ChatTemplateOptions):
    refused: ClassVar[dict[str, tuple[Any, ...]]] = CHAT_UNSUPPORTED
    messages: Any  # [{"role", "content"}, ...], checked by weft.inference.chat
    max_completion_tokens: Any = None  # OpenAI's newer name for max_tokens
    logprobs: StrictBool = False  # the chat API's: whether to return logprobs at all
    top_logprobs: Any = None  # and then how many alternatives each token lists

    def requested_max_tokens(self) -> Any:
        """max_completion_tokens (OpenAI's newer name) over max_tokens, as vLLM reads them; neither: until the context
        is full, as OpenAI's chat does."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def field_names(self) -> dict[str, str]:
        """As the base's; and a chat request's prompt is its messages, its alternatives per token top_logprobs."""
        names = {**super().field_names(), PROMPT: MESSAGES, "logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs not in (None, 0):
                raise ParamValueError("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return 0 if self.top_logprobs is None else self.top_logprobs


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens read from the prefix cache, not computed


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions API's: per token its text, logprob, top alternatives, and offset in the text (an echoed
    prompt's first token has no logprob: None)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


PromptLogprobs = list[dict[int, dict[str, Any]] | None]  # vLLM's: per prompt token {id: {logprob, rank, decoded_token}}


class Choice(BaseModel):
    """A choice whose finish_reason and logprobs are always written, null until set, also in a stream's chunks
    (which leave out the fields not set): OpenAI's chunks require both, and clients test finish_reason against
    null to find a choice's last chunk."""

    @model_serializer(mode="wrap")
    def _finish_reason_and_logprobs_always(self, write: SerializerFunctionWrapHandler) -> dict[str, Any]:
        body = write(self)
        body.setdefault("finish_reason", None)
        body.setdefault("logprobs", None)
        return body


class CompletionChoice(Choice):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


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
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(Choice):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
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


class TokenizeCompletionRequest(BaseModel):
    """vLLM's /tokenize body for a text prompt."""

    model_config = ConfigDict(extra="allow")  # as the generation requests: unknown fields are ignored

    model: str | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True  # the tokenizer's own (BOS), as a completion's text prompt gets them
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(Refusing, ChatTemplateOptions):
    """vLLM's /tokenize body for a conversation, through the model's chat template; the template options weft does
    not implement are refused as chat completions refuses them (ignoring one would answer other tokens)."""

    refused: ClassVar[dict[str, tuple[Any, ...]]] = {
        name: CHAT_UNSUPPORTED[name] for name in ("chat_template", "tools", "documents", "mm_processor_kwargs")
    }
    model: str | None = None
    messages: Any  # checked by weft.inference.chat
    return_token_strs: StrictBool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: Any  # token ids within the vocabulary, checked by the server


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
