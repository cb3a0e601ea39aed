"""Prompts as users pass them (vLLM's forms), turned into token ids or refused with a named error.

A prompt is a string, a list of token ids (ints, numpy or torch integers), a 1-D integer array or
tensor, or a dict {"prompt": str} / {"prompt_token_ids": [...]}. `generate` takes one prompt or a
list of them; a bare list of ints is one prompt, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weft.errors import ParamTypeError, ParamValueError
from weft.utils import as_int

PROMPT_KEYS = ("prompt", "prompt_token_ids")
PROMPT = "prompt"  # the param every refusal of a prompt names (weft.errors)


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # the text it came from, if any


def is_single_prompt(prompts: object) -> bool:
    """Whether `prompts` is one prompt rather than a list of them."""
    if isinstance(prompts, str | Mapping):
        return True
    if _is_array(prompts):
        return len(prompts.shape) <= 1
    if isinstance(prompts, Sequence) and prompts and not isinstance(prompts, bytes | bytearray):
        first = prompts[0]
        return not (isinstance(first, str | Mapping | Sequence) or (_is_array(first) and len(first.shape) >= 1))
    return False


def prompt_list(prompts: object) -> list[object]:
    """`generate`'s first argument as a list of prompts (each still to be checked by `parse_prompt`)."""
    if prompts is None or isinstance(prompts, bytes | bytearray) or isinstance(prompts, Iterator):
        raise ParamTypeError(
            "prompts must be a str, a list of token ids, a dict with 'prompt' or 'prompt_token_ids', or a list of "
            f"those; got {_describe(prompts)}" + (": pass list(...)" if isinstance(prompts, Iterator) else ""),
            PROMPT,
        )
    if is_single_prompt(prompts):
        return [prompts]
    if _is_array(prompts):  # a 2-D batch of equal-length prompts
        return list(prompts)
    if not isinstance(prompts, Sequence):
        raise ParamTypeError(f"prompts must be a prompt or a list of prompts, got {_describe(prompts)}", PROMPT)
    return list(prompts)


def parse_prompt(prompt: object, tokenizer: Any | None, vocab_size: int, label: str) -> Prompt:
    """One prompt -> its token ids (every one in [0, vocab_size)), or a TypeError / ValueError naming `label`."""
    if isinstance(prompt, Mapping):
        keys = [k for k in PROMPT_KEYS if k in prompt]
        extra = sorted(set(map(str, prompt)) - set(PROMPT_KEYS))
        if len(keys) != 1 or extra:
            raise ParamValueError(
                f"{label}: a dict prompt holds exactly one of 'prompt' (text) or 'prompt_token_ids'; got keys "
                f"{sorted(map(str, prompt))}",
                PROMPT,
            )
        value = prompt[keys[0]]
        if keys[0] == "prompt" and not isinstance(value, str):
            raise ParamTypeError(f"{label}: 'prompt' must be text, got {_describe(value)}", PROMPT)
        if keys[0] == "prompt_token_ids" and isinstance(value, str):
            raise ParamTypeError(f"{label}: 'prompt_token_ids' must be token ids, got text", PROMPT)
        prompt = value
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ParamValueError(f"{label} is text, but the model has no tokenizer: pass token ids", PROMPT)
        ids = tokenizer.encode(prompt)
        if not ids:
            raise ParamValueError(f"{label} is empty: {prompt!r} tokenizes to no tokens", PROMPT)
        return Prompt(_check_vocab(ids, vocab_size, label), prompt)
    if _is_array(prompt):
        if len(prompt.shape) != 1:
            raise ParamValueError(f"{label}: an array of token ids must be 1-D, got shape {tuple(prompt.shape)}",
                                  PROMPT)
        kind = str(prompt.dtype)
        if kind.replace("torch.", "").rstrip("0123456789") not in ("int", "uint"):
            raise ParamTypeError(f"{label}: token ids must be integers, got an array of {kind}", PROMPT)
        prompt = prompt.tolist()
    if not isinstance(prompt, Sequence) or isinstance(prompt, bytes | bytearray):
        raise ParamTypeError(
            f"{label} must be a str, a list of token ids or a dict with 'prompt' or 'prompt_token_ids', "
            f"got {_describe(prompt)}",
            PROMPT,
        )
    ids = list(prompt)
    if set(map(type, ids)) != {int}:  # in C: a burst of long prompts is checked in its first step's time
        ids = [as_int(f"{label}: token {i}", t, PROMPT) for i, t in enumerate(ids)]
    if not ids:
        raise ParamValueError(f"{label} is empty: it has no token ids", PROMPT)
    return Prompt(_check_vocab(ids, vocab_size, label), None)


def _check_vocab(ids: list[int], vocab_size: int, label: str) -> list[int]:
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise ParamValueError(f"{label} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", PROMPT)
    return ids


def _is_array(x: object) -> bool:
    """numpy arrays and torch tensors (without importing either)."""
    return hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "tolist")


def _describe(x: object) -> str:
    return "None" if x is None else f"{type(x).__name__} {x!r:.40}"
