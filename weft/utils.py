"""Small helpers that several layers of weft share (models, attention and inference alike)."""

from __future__ import annotations

import numbers
import operator


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative a and positive b: blocks of b that hold a tokens."""
    return -(-a // b)


def as_int(name: str, value: object) -> int:
    """`value` as a Python int (ints, numpy and 0-dim torch integers); TypeError naming `name` otherwise.

    bool is refused: True is an int to Python, never a count or a token id to weft.
    """
    if _is_bool(value):
        raise TypeError(f"{name} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


def as_real(name: str, value: object) -> float:
    """`value` as a finite float; TypeError for non-numbers (None, str, bool), ValueError for NaN or inf."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    x = float(value)
    if x != x or x in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {x}")
    return x


def _is_bool(value: object) -> bool:
    """Python, numpy and torch booleans (numpy's and 0-dim torch's pass operator.index as 0 / 1)."""
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")
