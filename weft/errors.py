"""Refusals that name the field they concern: OpenAI's `param`, which the server puts in its 400.

Each is a ValueError (a bad value) or a TypeError (a wrong type), so callers that catch those catch
these; `param` is the request field at fault ("max_tokens", "prompt", "messages"), or None where the
refusal concerns no one field.
"""

from __future__ import annotations


class ParamError(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ParamValueError(ParamError, ValueError):
    """A value out of range, named by its field."""


class ParamTypeError(ParamError, TypeError):
    """A value of the wrong type, named by its field."""
