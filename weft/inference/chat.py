"""Conversations into prompt token ids through the model's own chat template (LLM.chat, the server)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateError

from weft.errors import ParamTypeError, ParamValueError

MESSAGES = "messages"  # the param a refusal of a conversation names (weft.errors)


def is_conversation(messages: object) -> bool:
    """One conversation (a list of message dicts) rather than a list of conversations."""
    return isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], Mapping)


def chat_prompt(tokenizer: Any | None, messages: object, model_name: str, *, add_generation_prompt: bool = True,
                add_special_tokens: bool = False) -> list[int]:
    """messages [{"role": ..., "content": str or [{"type": "text", "text": ...}]}, ...] -> token ids that
    end with the assistant's turn opened (unless not `add_generation_prompt`), with the tokenizer's special tokens
    (BOS) on top of the template's if `add_special_tokens` (vLLM's /tokenize options). ValueError / TypeError naming
    what is wrong (a model without a chat template: no param; a bad message, or one the template refuses:
    `messages`)."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"model {model_name!r} has no chat template: send token ids or text as a completion instead")
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
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt, tokenize=False)
    except TemplateError as e:  # its raise_exception (roles out of turn, ...): the request's fault, not the engine's
        raise ParamValueError(f"the chat template refused the messages: {e}", MESSAGES) from None
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))  # vLLM's order: the text, then its ids


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
