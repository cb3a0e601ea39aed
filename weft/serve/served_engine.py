"""The engine behind `weft serve`: LLMEngine with the limit vLLM's OpenAI server adds to its offline engine's.

Offline, a request's max_tokens is capped by the context its prompt leaves; vLLM's server refuses a larger one with a
400 before any work (a client that asks for 10,000 tokens of a 2,048-token context is told so, not served less). The
check needs the prompt's token count, which the engine process has (it renders and tokenizes the prompt), so it runs
here.
"""

from __future__ import annotations

from weft.errors import ParamValueError
from weft.inference.engine import LLMEngine
from weft.inference.sequence import Sequence


class ServedEngine(LLMEngine):
    """LLMEngine that also refuses (ParamValueError, before anything is queued) a max_tokens larger than the context
    the prompt leaves, as vLLM's server does."""

    def _sequences(self, request_id, prompt, params, label, now) -> list[Sequence]:
        group = super()._sequences(request_id, prompt, params, label, now)
        first = group[0]
        max_tokens, prompt_tokens, context = first.params.max_tokens, first.num_prompt_tokens, self.config.max_model_len
        if max_tokens is not None and max_tokens > context - prompt_tokens:
            raise ParamValueError(  # vLLM's words
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
                f"length is {context} tokens and your request has {prompt_tokens} input tokens ({max_tokens} > "
                f"{context} - {prompt_tokens})", "max_tokens",
            )
        return group
