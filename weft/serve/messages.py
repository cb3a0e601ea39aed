"""What the server and its engine process say to each other, over two pipes: one frozen dataclass each.

Down (server -> engine process): `AddRequest`, `AbortRequest`, `Shutdown`. Up: `EngineReady` once the
engine is built (or `EngineFailed` and nothing more), then after every round of commands and a step one
`StepMessage` (each request's new `Piece`, packed as a tuple, the requests refused, the engine's snapshot; those of
several steps in one where they queued while the server read late), and `EngineFailed` if a step raised. A
request's prompt ids travel once, with its first piece; its timings with its last.
"""

from __future__ import annotations

from dataclasses import dataclass

from weft.errors import ParamError, ParamTypeError, ParamValueError
from weft.inference.outputs import CompletionOutput, EngineSnapshot, Logprob, RequestMetrics, RequestOutput
from weft.inference.params import SamplingParams


@dataclass(frozen=True)
class Conversation:
    """A chat's messages, for AsyncEngine.generate to render through the chat template (on its tokenizer's thread)."""

    messages: object
    options: dict  # weft.inference.chat.chat_prompt's keyword arguments: the request's template options


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: object  # what LLMEngine.add_request takes (token ids, for text the server has tokenized)
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
    sampling_defaults: dict  # LLMEngine.sampling_defaults: what a request's unset sampling fields take


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


# What one request produced in one step (its output kind's share: a delta of the completions that took a token, or
# all of them when final), as a plain tuple: the pipe's pickle takes tuples of builtins several times faster than
# dataclasses, and a step's message is made on the engine process's critical path (256 pieces on the CPU here: 57
# against 362 us to pickle, 78 against 777 us to unpickle). `pack` makes one, `unpack` reads it back:
#   (request_id, completions, finished, opening, metrics)
# completions: each CompletionOutput's fields in order; opening: with the request's first piece only, its (prompt
# text or None, prompt_token_ids, prompt_logprobs, num_cached_tokens); metrics: with its last piece only.
Opening = tuple[str | None, list[int], list[dict[int, Logprob] | None] | None, int | None]
Piece = tuple[str, list[tuple], bool, Opening | None, RequestMetrics | None]


def pack(out: RequestOutput, first: bool) -> Piece:
    """`out` as its piece; `first`: the request's first, which carries its prompt. The piece is pickled later, on
    the engine process's sender thread, while the engine steps on: it holds nothing the engine changes after the
    step (each step's outputs are lists of their own)."""
    completions = [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in out.outputs]
    opening = (out.prompt, out.prompt_token_ids, out.prompt_logprobs, out.num_cached_tokens) if first else None
    return out.request_id, completions, out.finished, opening, out.metrics if out.finished else None


def unpack(piece: Piece, prompts: dict[str, list[int]]) -> RequestOutput:
    """The piece as a RequestOutput; `prompts`: each request's prompt ids, which its first piece adds."""
    request_id, completions, finished, opening, metrics = piece
    prompt, prompt_logprobs, cached = None, None, None
    if opening is not None:
        prompt, prompts[request_id], prompt_logprobs, cached = opening
    return RequestOutput(request_id, prompt, prompts[request_id], [CompletionOutput(*c) for c in completions],
                         finished, metrics, prompt_logprobs, cached)


@dataclass(frozen=True)
class StepMessage:
    pieces: list[Piece]
    refusals: list[Refusal]
    snapshot: EngineSnapshot  # after the step
    admitted: int  # AddRequests the engine took since the last message (refused ones included)

    @staticmethod
    def joined(messages: list[StepMessage]) -> StepMessage:
        """Successive messages as one: their pieces and refusals in order, the last snapshot, the admissions summed."""
        return StepMessage([p for m in messages for p in m.pieces], [r for m in messages for r in m.refusals],
                           messages[-1].snapshot, sum(m.admitted for m in messages))
