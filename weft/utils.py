"""Small helpers that several layers of weft share (models, attention and inference alike)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import numbers
import operator
from collections.abc import Iterator

from weft.errors import ParamTypeError, ParamValueError


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative a and positive b: blocks of b that hold a tokens."""
    return -(-a // b)


def as_int(name: str, value: object, param: str | None = None) -> int:
    """`value` as a Python int (ints, numpy and 0-dim torch integers); a TypeError naming `name` otherwise,
    whose `param` is the field it concerns (`name` by default).

    bool is refused: True is an int to Python, never a count or a token id to weft.
    """
    if _is_bool(value):
        raise ParamTypeError(f"{name} must be an integer, got the bool {value!r}", param or name)
    try:
        return operator.index(value)
    except TypeError:
        message = f"{name} must be an integer, got {type(value).__name__} {value!r}"
        raise ParamTypeError(message, param or name) from None


def as_real(name: str, value: object) -> float:
    """`value` as a finite float; TypeError for non-numbers (None, str, bool), ValueError for NaN or inf (each
    with `name` as its param)."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise ParamTypeError(f"{name} must be a number, got {type(value).__name__} {value!r}", name)
    x = float(value)
    if x != x or x in (float("inf"), float("-inf")):
        raise ParamValueError(f"{name} must be finite, got {x}", name)
    return x


def _is_bool(value: object) -> bool:
    """Python, numpy and torch booleans (numpy's and 0-dim torch's pass operator.index as 0 / 1)."""
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def freeze_heap() -> None:
    """Collect, then freeze what the process holds now (gc.freeze), so that a full collection walks only what
    comes after: the modules alone are some 350,000 objects, and a walk of them took 150-250 ms, stalling whatever
    ran (results/logs/h100_gc_freeze_c2500dd.log). Frozen objects are still freed when their last reference goes,
    but those in reference cycles only once unfrozen (gc.unfreeze). The interpreter's last collection at exit
    skips frozen ones, and Triton (a nanobind extension) reports what it left as leaked: the first call has the
    heap unfrozen at exit."""
    _unfreeze_at_exit()
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """`freeze_heap` for a block (a timed run), unfrozen after it: what it froze may be freed again."""
    freeze_heap()
    try:
        yield
    finally:
        gc.unfreeze()


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)
