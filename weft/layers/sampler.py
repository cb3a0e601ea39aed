"""Sampler: one next token per row of logits, greedy or with temperature / top-k / top-p."""

from __future__ import annotations

import torch

from weft.inference.params import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] int64.

    Greedy rows take the argmax; the rest sample with their own generator when seeded.
    """
    tokens = logits.argmax(dim=-1)
    for b, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            tokens[b] = _sample_row(logits[b], p, gen)
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """logits [V] -> scalar token id."""
    logits = logits / p.temperature
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=gen)[0]
