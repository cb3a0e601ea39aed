"""Conversations into prompt token ids through the model's own chat template (LLM.chat, the server)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


def is_conversation(messages: object) -> bool:
    """One conversation (a list of message dicts) rather than a list of conversations."""
    return isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], Mapping)


def chat_prompt(tokenizer: Any | None, messages: object, model_name: str) -> list[int]:
    """messages [{"role": ..., "content": str or [{"type": "text", "text": ...}]}, ...] -> token ids that
    end with the assistant's turn opened. ValueError / TypeError naming what is wrong."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"model {model_name!r} has no chat template: send token ids or text as a completion instead")
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise TypeError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.60}")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r:.40}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]['role'] must be one of {', '.join(ROLES)}, got {role!r}")
        turns.append({"role": role, "content": _text(content, i)})
    return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False))


def _text(content: object, i: int) -> str:
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, Sequence) and not isinstance(content, str | bytes) else None
    if parts is None or not all(isinstance(p, Mapping) and p.get("type") == "text" for p in parts):
        raise TypeError(f"messages[{i}]['content'] must be text or a list of {{'type': 'text', 'text': ...}} parts")
    return "".join(str(p.get("text", "")) for p in parts)
