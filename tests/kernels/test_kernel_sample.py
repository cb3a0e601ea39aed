"""The draw kernels (weft/layers/sampler.py) against `sample`'s PyTorch ops: a seeded row's token is the same one,
with and without ranking, with penalties too; an unseeded row draws from what its filters keep, at the softmax's
rates; `group_top` ranks as a stable sort does (equal values by id), penalties applied as it reads."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_kernel_penalize import rules_for
from weft.layers import sampler
from weft.layers.sampler import (
    GROUP,
    GROUP_TOP_MAX_K,
    GUMBEL_CHUNK,
    LogitRules,
    SamplingTensors,
    adjust,
    group_top,
    sample,
)

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


def both(logits: torch.Tensor, t: SamplingTensors, monkeypatch, rules: LogitRules | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` through PyTorch's ops, then through the kernels (in the interpreter on the CPU)."""
    monkeypatch.setattr(sampler, "on_kernels", lambda x: False)
    want = sample(logits, t, rules)
    monkeypatch.setattr(sampler, "on_kernels", lambda x: True)
    return want, sample(logits, t, rules)


def on(rules: LogitRules, device) -> LogitRules:
    return LogitRules(**{f: getattr(rules, f).to(device) for f in rules.__dataclass_fields__})


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


def test_a_draw_with_nothing_filtered_takes_the_first_of_equal_maxima_across_chunks(device, monkeypatch):
    """Greedy rows through the Gumbel-max kernel (nothing filtered), their largest logit in two chunks: the first
    column, as torch.argmax takes, unless the later one is larger."""
    V = GUMBEL_CHUNK + 100
    logits = torch.zeros(2, V, device=device)
    logits[:, 7] = logits[:, GUMBEL_CHUNK + 3] = 5.0
    logits[1, 7] = 4.0
    t = settings(2, V, None, device)
    t.temperature.zero_()
    monkeypatch.setattr(sampler, "on_kernels", lambda x: True)
    assert sample(logits, t).tolist() == [7, GUMBEL_CHUNK + 3]


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


@pytest.mark.parametrize(("B", "V", "K"), [(6, 3000, 50), (4, 2 * GROUP + 300, 7)])
def test_a_seeded_row_draws_the_pytorch_ops_token_under_penalties(device, monkeypatch, B, V, K):
    """The kernels penalize as group_top reads the logits (no adjusted copy): the tokens of adjust's ops."""
    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(B, V, generator=g) * 3).to(device)
    rules = rules_for(B, V, 2 * B, g)  # row 0 penalized: its likeliest token, said 3 times, no longer is
    rules.counts[rules.count_rows[0], logits[0].argmax()] = 3
    rules.frequency[0] = 5.0
    rules = on(rules, device)
    t = settings(B, V, K, device, seed=V)
    want, got = both(logits, t, monkeypatch, rules)
    assert got.tolist() == want.tolist()
    assert got[0] == adjust(logits, rules)[0].argmax() != logits[0].argmax()  # the greedy row, penalized
    assert want.tolist() != sample(logits, t).tolist()  # the penalties changed the draws


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("B", "V", "K"), [(3, 300, 1), (5, 2 * GROUP + 77, 64), (2, GROUP, GROUP_TOP_MAX_K)])
@pytest.mark.parametrize("penalized", [False, True])
def test_group_top_ranks_as_a_stable_sort(device, dtype, B, V, K, penalized):
    """Each row's K largest in descending order, equal values by ascending id, across groups (the last one
    partial) and with many ties (values on a coarse grid, -inf among them; -0.0 equal to 0.0)."""
    g = torch.Generator().manual_seed(V + K)
    logits = (torch.randint(-6, 7, (B, V), generator=g) / 2).to(dtype)
    logits[torch.rand(B, V, generator=g) < 0.1] = float("-inf")
    logits[0, 5], logits[0, 3] = -0.0, 0.0
    rules = rules_for(B, V, B + 1, g) if penalized else None
    want = adjust(logits, rules) if penalized else logits.float()
    want_top, want_ids = (x[:, :K] for x in want.sort(dim=-1, descending=True, stable=True))
    top, ids = group_top(logits.to(device), K, on(rules, device) if penalized else None)
    assert torch.equal(top.cpu(), want_top) and torch.equal(ids.cpu(), want_ids)
    assert torch.equal(ids[:, 0].cpu(), want.argmax(-1))
