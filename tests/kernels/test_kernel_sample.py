"""The draw kernels (weft/layers/sampler.py) against `sample`'s PyTorch ops: a seeded row's token is the same one,
with and without ranking; an unseeded row draws from what its filters keep, at the softmax's rates."""

from __future__ import annotations

import pytest
import torch

from weft.layers import sampler
from weft.layers.sampler import SamplingTensors, sample

pytestmark = pytest.mark.kernels

DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


def settings(B: int, V: int, K: int | None, device, seeded: bool = True, seed: int = 0) -> SamplingTensors:
    """Row 0 greedy, the others at random temperatures; with K, ragged top_k <= K, top_p and min_p."""
    g = torch.Generator().manual_seed(seed)
    temperature = torch.rand(B, generator=g) + 0.3
    temperature[0] = 0.0
    filtered = K is not None
    t = SamplingTensors(
        temperature=temperature,
        top_k=torch.randint(1, K + 1, (B,), generator=g) if filtered else torch.full((B,), V),
        top_p=torch.rand(B, generator=g) * 0.5 + 0.5 if filtered else torch.ones(B),
        min_p=torch.rand(B, generator=g) * 0.1 if filtered else torch.zeros(B),
        seeded=torch.full((B,), seeded),
        seed=torch.randint(0, 2**32, (B, 2), generator=g),
        position=torch.randint(0, 5000, (B,), generator=g),
        max_top_k=K if filtered else V,
        filtered=filtered,
    )
    return SamplingTensors(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(t).items()})


def both(logits: torch.Tensor, t: SamplingTensors, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` through PyTorch's ops, then through the kernels (in the interpreter on the CPU)."""
    monkeypatch.setattr(sampler, "on_kernels", lambda x: False)
    want = sample(logits, t)
    monkeypatch.setattr(sampler, "on_kernels", lambda x: True)
    return want, sample(logits, t)


@pytest.mark.parametrize("dtype", DTYPES)
# ranked: K below the tile, K = V (a full sort), K not a power of two; unranked: V across several tiles
@pytest.mark.parametrize(("B", "V", "K"), [(7, 3000, 50), (5, 70, 70), (6, 900, 333), (9, 5000, None)])
def test_a_seeded_row_draws_the_pytorch_ops_token(device, monkeypatch, dtype, B, V, K):
    g = torch.Generator().manual_seed(B + V)
    logits = (torch.randn(B, V, generator=g) * 3).to(dtype).to(device)
    t = settings(B, V, K, device, seed=V)
    want, got = both(logits, t, monkeypatch)
    assert got.tolist() == want.tolist()
    assert got[0] == logits[0].argmax()  # the greedy row


@pytest.mark.parametrize("K", [3, None])
def test_an_unseeded_row_draws_at_the_softmax_rates_among_what_it_keeps(device, monkeypatch, K):
    """500 copies of one row of 6 logits, unseeded, at T = 1: each token's share within 0.08 of its probability
    (renormalised over the top 3 with K = 3; 3.6 standard deviations); none outside. The Philox seed comes from
    torch's generator, seeded here: the draws are the same every run."""
    torch.manual_seed(0)
    B, V = 500, 6
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0], device=device).expand(B, V).contiguous()
    t = settings(B, V, K, device, seeded=False)
    t.temperature.fill_(1.0)
    if K is not None:
        t.top_k.fill_(K), t.top_p.fill_(1.0), t.min_p.fill_(0.0)
    monkeypatch.setattr(sampler, "on_kernels", lambda x: True)
    got = sample(logits, t)
    probs = logits[0, : K or V].softmax(-1)
    share = torch.bincount(got, minlength=V).double() / B
    assert (share[: K or V] - probs.double()).abs().max() < 0.08
    assert share[K or V :].sum() == 0
