"""The logit rules' kernels (weft/layers/sampler.py: the penalties, the allowed tokens' bitmask) against the PyTorch
ops `adjust` runs off CUDA: the same bits, on the rows they are given and nowhere else."""

from __future__ import annotations

import pytest
import torch

from weft.layers.sampler import LogitRules, adjust, ban_unset, penalize
from weft.utils import cdiv

pytestmark = pytest.mark.kernels


def rules_for(B: int, V: int, C: int, g: torch.Generator) -> LogitRules:
    """Penalties on every other row of B, their counts in random rows of a slab of C."""
    rows = torch.arange(0, B, 2)
    R = rows.numel()
    empty = torch.zeros(0, dtype=torch.int64)
    return LogitRules(
        allowed_rows=empty, allowed=torch.zeros(0, cdiv(V, 32), dtype=torch.int32), bias_rows=empty, bias_tokens=empty,
        bias=torch.zeros(0), penalty_rows=rows, count_rows=torch.randperm(C, generator=g)[:R],
        counts=torch.randint(0, 4, (C, V), generator=g, dtype=torch.int32) * (torch.rand(C, V, generator=g) < 0.2),
        in_prompt=torch.rand(C, V, generator=g) < 0.1,
        presence=torch.rand(R, generator=g) * 2 - 1, frequency=torch.rand(R, generator=g) * 2 - 1,
        repetition=torch.rand(R, generator=g) * 1.5 + 0.25,
    )  # fmt: skip


@pytest.mark.parametrize(("B", "V", "C"), [(1, 37, 1), (5, 4096, 4), (8, 10_007, 12)])
def test_penalize_is_the_pytorch_penalties_bit_for_bit(device, B, V, C):
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(B, V, generator=g) * 4
    rules = rules_for(B, V, C, g)
    want = adjust(logits, rules)  # on the CPU: the PyTorch ops
    on = {f: getattr(rules, f).to(device) for f in rules.__dataclass_fields__}
    got = logits.to(device, copy=True)
    penalize(got, LogitRules(**on))
    assert torch.equal(got.cpu(), want)
    assert not torch.equal(want, logits)  # the penalties changed something
    assert torch.equal(want[1::2], logits[1::2])  # and only on the penalized rows


@pytest.mark.parametrize(("B", "V"), [(4, 37), (6, 10_007)])
def test_ban_unset_is_the_pytorch_mask_bit_for_bit(device, B, V):
    """Rows 0, 3 and 5 (of those there are) under random bitmasks, one of them all set; -inf exactly where a bit is
    0 (bit 31, the sign, included), every other logit and row as it was."""
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(B, V, generator=g)
    rows = torch.tensor([r for r in (5, 0, 3) if r < B])
    bitmask = torch.randint(-(2**31), 2**31, (rows.numel(), cdiv(V, 32)), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[1] = -1
    empty = torch.zeros(0, dtype=torch.int64)
    rules = LogitRules(allowed_rows=rows, allowed=bitmask, bias_rows=empty, bias_tokens=empty, bias=torch.zeros(0),
                       penalty_rows=empty, count_rows=empty, counts=torch.zeros(0, V, dtype=torch.int32),
                       in_prompt=torch.zeros(0, V, dtype=torch.bool), presence=torch.zeros(0),
                       frequency=torch.zeros(0), repetition=torch.zeros(0))
    want = adjust(logits, rules)  # on the CPU: the PyTorch ops
    got = logits.to(device, copy=True)
    ban_unset(got, rows.to(device), bitmask.to(device))
    assert torch.equal(got.cpu(), want)
    banned = torch.isinf(want).sum(1)
    assert banned[rows[0]] > V // 4 and banned[rows[1]] == 0  # a random row bans, the full one does not
    untouched = [r for r in range(B) if r not in rows.tolist()]
    assert torch.equal(want[untouched], logits[untouched])
