"""The engine behind `weft serve`: LLMEngine with the limit vLLM's OpenAI server adds to its offline engine's.

Offline, a request's max_tokens is capped by the context its prompt leaves; vLLM's server refuses a larger one with a
400 before any work (a client that asks for 10,000 tokens of a 2,048-token context is told so, not served less). The
check needs the prompt's token count, which the engine process has (it renders and tokenizes the prompt), so it runs
here.
"""

from __future__ import annotations

from weft.errors import ParamValueError
from weft.inference.engine import LLMEngine
from weft.inference.params import SamplingParams


class ServedEngine(LLMEngine):
    """LLMEngine that refuses (ParamValueError naming max_tokens, before anything is queued) a max_tokens larger than
    the context the prompt leaves, as vLLM's server does."""

    def _check_room(self, num_prompt_tokens: int, params: SamplingParams, label: str) -> None:
        max_tokens, context = params.max_tokens, self.config.max_model_len
        if max_tokens is not None and max_tokens > context - num_prompt_tokens:
            raise ParamValueError(  # vLLM's words
                f"{label}: 'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                f"context length is {context} tokens and your request has {num_prompt_tokens} input tokens "
                f"({max_tokens} > {context} - {num_prompt_tokens})", "max_tokens",
            )
