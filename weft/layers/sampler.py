"""Sampler: the next token of every row of logits at once, greedy or with temperature / top-k / top-p.

No loop over rows: each row's settings are a tensor. A sampled row draws by the Gumbel-max trick
(argmax of its filtered, scaled logits plus Gumbel noise is a draw from their softmax). A seeded
row's noise is a hash of (seed, the position it samples, the token id), so its tokens are the same
whatever shares its batch and however the engine stepped there; an unseeded row's is torch.rand.
A batch of greedy rows only takes the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
HASH_MUL = 0x45D9F3B  # < 2**31: a 32-bit value times it never overflows int64


@dataclass
class SamplingTensors:
    """The per-row settings of one step's B sampled rows (all on the logits' device)."""

    temperature: torch.Tensor  # [B] float32; 0: greedy
    top_k: torch.Tensor  # [B] int64; V keeps every token
    top_p: torch.Tensor  # [B] float32; 1 keeps every token
    seeded: torch.Tensor  # [B] bool
    seed: torch.Tensor  # [B, 2] int64: a seeded row's seed, low and high 32 bits
    position: torch.Tensor  # [B] int64: the position of the token each row samples


def sample(logits: torch.Tensor, t: SamplingTensors | None) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> token ids [B] int64; `t` None: every row is greedy.

    Greedy rows take the argmax of the logits as they are: converting them to float32 first (as HF
    does) changes no value, so no argmax; the draws are computed in float32."""
    greedy = logits.argmax(dim=-1)
    if t is None:
        return greedy
    logits = logits.float()
    B, V = logits.shape
    scaled = logits / t.temperature.clamp_min(1e-6)[:, None]
    ordered, order = scaled.sort(dim=-1, descending=True)  # [B, V], and the token id at each rank
    rank = torch.arange(V, device=logits.device)
    drop = rank[None, :] >= t.top_k[:, None]
    probs = ordered.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # top-p keeps the smallest prefix whose mass reaches top_p (the token crossing it included)
    drop |= probs.cumsum(dim=-1) - probs >= t.top_p[:, None]
    u = torch.where(t.seeded[:, None], hashed_uniform(t.seed, t.position, order), torch.rand_like(scaled))
    gumbel = -torch.log(-torch.log(u))
    pick = (ordered.masked_fill(drop, float("-inf")) + gumbel).argmax(dim=-1, keepdim=True)
    sampled = order.gather(1, pick)[:, 0]
    return torch.where(t.temperature == 0, greedy, sampled)


def hashed_uniform(seed: torch.Tensor, position: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """seed [B, 2], position [B], token ids [B, V] (int64) -> uniforms in (0, 1) [B, V] float32, a hash of
    all three: the same arguments give the same values on any device."""
    x = _mix(seed[:, 0] ^ _mix(seed[:, 1]))
    x = _mix(x ^ (position & MASK32))[:, None]
    x = _mix(x ^ (token & MASK32))
    return (x.to(torch.float64) + 0.5).div_(2.0**32).to(torch.float32).clamp_(1e-7, 1 - 1e-7)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of int64 values in [0, 2**32)."""
    x = ((x >> 16) ^ x) * HASH_MUL & MASK32
    x = ((x >> 16) ^ x) * HASH_MUL & MASK32
    return (x >> 16) ^ x
