"""Token bitmasks: a set of allowed tokens of a vocabulary of V as int32 words [R, ceil(V / 32)], bit j of word w
allowing token 32 w + j (xgrammar's layout; bits past V are never read). The grammars fill them, the sampler
applies them."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from weft.utils import cdiv


def token_bitmask(token_ids: Iterable[int], vocab_size: int) -> torch.Tensor:
    """int32 [1, ceil(V / 32)] on the CPU allowing exactly `token_ids` (each in [0, V))."""
    ids = list(token_ids)
    if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {min(ids)} .. {max(ids)}")
    bits = np.zeros(cdiv(vocab_size, 32) * 32, dtype=bool)
    bits[ids] = True
    # little-endian bytes, low bit first: bit j of word w is bits[32 w + j]
    words = np.frombuffer(np.packbits(bits, bitorder="little").tobytes(), dtype="<i4")
    return torch.from_numpy(words.astype(np.int32)).view(1, -1)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask int32 [R, ceil(V / 32)] -> the tokens it allows [R, V] bool, on the bitmask's device (bit j of
    word w allows token 32 w + j)."""
    rows = bitmask.shape[0]
    if bitmask.shape != (rows, cdiv(vocab_size, 32)) or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32 [{rows}, {cdiv(vocab_size, 32)}] for V = {vocab_size}, got "
                         f"{bitmask.dtype} {list(bitmask.shape)}")
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


def allows(bitmask: torch.Tensor, token: int) -> bool:
    """Whether bitmask row int32 [1, ceil(V / 32)] allows `token`."""
    return bool((int(bitmask[0, token >> 5]) >> (token & 31)) & 1)
