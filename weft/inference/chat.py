"""Conversations into prompt token ids through the model's own chat template (LLM.chat, the server)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateError

from weft.errors import ParamTypeError, ParamValueError

MESSAGES = "messages"  # the param a refusal of a conversation names (weft.errors)
TEMPLATE_KWARGS = "chat_template_kwargs"


def is_conversation(messages: object) -> bool:
    """One conversation (a list of message dicts) rather than a list of conversations."""
    return isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], Mapping)


def chat_prompt(tokenizer: Any | None, messages: object, model_name: str, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, add_special_tokens: bool = False,
                chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """messages [{"role": ..., "content": str or [{"type": "text", "text": ...}]}, ...] -> token ids that
    end with the assistant's turn opened (unless not `add_generation_prompt`), or the last message left open for the
    model to go on with (`continue_final_message`), with the tokenizer's special tokens (BOS) on top of the
    template's if `add_special_tokens`, the template given `chat_template_kwargs` as variables of its own (Qwen3's
    `enable_thinking`, ...): vLLM's options. ValueError / TypeError naming what is wrong (a model without a chat
    template: no param; a bad message, or one the template refuses: `messages`; a bad option: its name)."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"model {model_name!r} has no chat template: send token ids or text as a completion instead")
    if add_generation_prompt and continue_final_message:
        raise ParamValueError("continue_final_message and add_generation_prompt cannot both be true: the first goes "
                              "on with the last message, the second opens a new one", "continue_final_message")
    variables = _template_kwargs(tokenizer, chat_template_kwargs)
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ParamTypeError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.60}",
                             MESSAGES)
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ParamTypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r:.40}", MESSAGES)
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:  # which roles it takes is the template's to say (vLLM's rule)
            raise ParamValueError(f"messages[{i}]['role'] must be a non-empty string, got {role!r}", MESSAGES)
        turns.append({**m, "role": role, "content": _text(content, i)})  # its other keys (name, ...): the template's
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             continue_final_message=continue_final_message, **variables)
    except TemplateError as e:  # its raise_exception (roles out of turn, ...): the request's fault, not the engine's
        raise ParamValueError(f"the chat template refused the messages: {e}", MESSAGES) from None
    except ValueError as e:  # continue_final_message: a last message the rendered text does not end with
        raise ParamValueError(f"the chat template cannot continue the last message: {e}", MESSAGES) from None
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))  # vLLM's order: the text, then its ids


def _template_kwargs(tokenizer: Any, kwargs: object) -> dict[str, Any]:
    """The variables a request gives the template; none may be one of apply_chat_template's own parameters
    (`tokenize`, `chat_template`, ...), which would change what weft asks of it."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ParamTypeError(f"{TEMPLATE_KWARGS} must be an object of the template's variables, got {kwargs!r:.60}",
                             TEMPLATE_KWARGS)
    own = [k for k in kwargs if k in inspect.signature(tokenizer.apply_chat_template).parameters]
    if own:
        raise ParamValueError(f"{TEMPLATE_KWARGS} may not set {own[0]!r}: it is apply_chat_template's own parameter, "
                              "not a template variable", TEMPLATE_KWARGS)
    return dict(kwargs)


def _text(content: object, i: int) -> str:
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, Sequence) and not isinstance(content, str | bytes) else None
    if parts is None or not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                for p in parts):
        raise ParamTypeError(
            f"messages[{i}]['content'] must be text or a list of {{'type': 'text', 'text': str}} parts", MESSAGES
        )
    return "\n".join(p["text"] for p in parts)  # vLLM joins a message's text parts by lines
