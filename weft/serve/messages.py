"""What the server and its engine process say to each other, over two pipes: one frozen dataclass each.

Down (server -> engine process): `AddRequest`, `AbortRequest`, `Shutdown`. Up: `EngineReady` once the
engine is built (or `EngineFailed` and nothing more), then after every round of commands and a step one
`StepMessage` (each request's new `Piece`, the requests refused, the engine's snapshot), and `EngineFailed`
if a step raised. A request's prompt ids travel once, with its first piece; its timings with its last.
"""

from __future__ import annotations

from dataclasses import dataclass

from weft.errors import ParamError, ParamTypeError, ParamValueError
from weft.inference.outputs import CompletionOutput, EngineSnapshot, Logprob, RequestMetrics
from weft.inference.params import SamplingParams


@dataclass(frozen=True)
class Conversation:
    """A chat's messages, rendered through the chat template in the engine process (the tokenizer's home)."""

    messages: object


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: object  # what LLMEngine.add_request takes, or a Conversation
    params: SamplingParams
    label: str  # the prompt's name in errors ("prompt", "prompt 1", "messages")


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


Command = AddRequest | AbortRequest | Shutdown


@dataclass(frozen=True)
class EngineReady:
    """The engine is built and serving."""

    model_name: str
    max_model_len: int
    num_blocks: int


@dataclass(frozen=True)
class EngineFailed:
    """The engine could not be built, or a step raised: the engine process has stopped."""

    reason: str  # "ErrorType: message"


@dataclass(frozen=True)
class Refusal:
    """A request the engine's checks refused before any work: its error, and the request field at fault."""

    request_id: str
    message: str
    param: str | None
    wrong_type: bool  # a TypeError (else a ValueError)

    @classmethod
    def of(cls, request_id: str, error: ValueError | TypeError) -> Refusal:
        return cls(request_id, str(error), error.param if isinstance(error, ParamError) else None,
                   isinstance(error, TypeError))

    def error(self) -> ParamError:
        """The refusal as the error the engine raised (ParamTypeError or ParamValueError, with its param)."""
        return (ParamTypeError if self.wrong_type else ParamValueError)(self.message, self.param)


@dataclass(frozen=True)
class Piece:
    """What one request produced in one step (its output kind's share: a delta of the completions that took a
    token, or all of them when final)."""

    request_id: str
    completions: list[CompletionOutput]
    finished: bool
    prompt: str | None  # with its first piece: the prompt's text, when it was sent as text
    prompt_token_ids: list[int] | None  # with the request's first piece only
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # with its first piece, if it asked for them
    num_cached_tokens: int | None  # with its first piece: its prompt tokens found in the prefix cache
    metrics: RequestMetrics | None  # with its last piece only


@dataclass(frozen=True)
class StepMessage:
    pieces: list[Piece]
    refusals: list[Refusal]
    snapshot: EngineSnapshot  # after the step
    admitted: int  # AddRequests taken from the pipe since the last message (refused ones included)
