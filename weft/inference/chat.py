"""Conversations into prompt token ids through the model's own chat template (LLM.chat, the server)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from weft.errors import ParamTypeError, ParamValueError

ROLES = ("system", "user", "assistant", "tool")
MESSAGES = "messages"  # the param a refusal of a conversation names (weft.errors)


def is_conversation(messages: object) -> bool:
    """One conversation (a list of message dicts) rather than a list of conversations."""
    return isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], Mapping)


def chat_prompt(tokenizer: Any | None, messages: object, model_name: str) -> list[int]:
    """messages [{"role": ..., "content": str or [{"type": "text", "text": ...}]}, ...] -> token ids that
    end with the assistant's turn opened. ValueError / TypeError naming what is wrong (a model without a chat
    template: no param; a bad message: `messages`)."""
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
        if role not in ROLES:
            raise ParamValueError(f"messages[{i}]['role'] must be one of {', '.join(ROLES)}, got {role!r}", MESSAGES)
        turns.append({"role": role, "content": _text(content, i)})
    return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False))


def _text(content: object, i: int) -> str:
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, Sequence) and not isinstance(content, str | bytes) else None
    if parts is None or not all(isinstance(p, Mapping) and p.get("type") == "text" for p in parts):
        raise ParamTypeError(
            f"messages[{i}]['content'] must be text or a list of {{'type': 'text', 'text': ...}} parts", MESSAGES
        )
    return "".join(str(p.get("text", "")) for p in parts)
