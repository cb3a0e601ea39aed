"""The batched sampler: greedy rows exact, draws from the filtered softmax, seeded rows the same
whatever shares their batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from weft import LLM, SamplingParams
from weft.layers.sampler import SamplingTensors, hashed_uniform, sample

pytestmark = pytest.mark.correctness


def settings(B: int, temperature=1.0, top_k=None, top_p=1.0, seeds=None, position=0, min_p=0.0) -> SamplingTensors:
    def col(v, dtype):
        return torch.as_tensor(v if isinstance(v, list) else [v] * B, dtype=dtype)

    seeds = seeds if seeds is not None else [None] * B
    return SamplingTensors(
        temperature=col(temperature, torch.float32), top_k=col(top_k if top_k is not None else 10**9, torch.int64),
        top_p=col(top_p, torch.float32), min_p=col(min_p, torch.float32),
        seeded=torch.tensor([s is not None for s in seeds]),
        seed=torch.tensor([[(s or 0) & 0xFFFFFFFF, ((s or 0) >> 32) & 0xFFFFFFFF] for s in seeds]),
        position=col(position, torch.int64), max_top_k=max(top_k) if isinstance(top_k, list) else top_k or 10**9,
        filtered=True,
    )  # fmt: skip


def test_greedy_rows_take_the_argmax_beside_sampled_ones():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    t = settings(6, temperature=[0.0, 1.0, 0.0, 2.0, 0.0, 0.5])
    tokens = sample(logits, t)
    assert tokens[[0, 2, 4]].tolist() == logits.argmax(-1)[[0, 2, 4]].tolist()
    assert sample(logits, None).tolist() == logits.argmax(-1).tolist()


def test_16_bit_logits_sample_as_their_float32_copy():
    """The runner hands the sampler the logits in the model's dtype: a greedy row's argmax (ties to the first
    maximum) and a seeded row's draw are those of the float32 copy HF takes."""
    logits = (4 * torch.randn(6, 300, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16)
    logits[0, [7, 250]] = logits[0].max() + 1  # a tie: the first maximum wins
    t = settings(6, temperature=[0.0, 1.0, 0.0, 0.7, 0.0, 1.3], top_k=[10**9, 50, 10**9, 10**9, 10**9, 5],
                 top_p=[1.0, 0.9, 1.0, 1.0, 1.0, 0.5], seeds=[None, 1, None, 2, None, 3], position=4)
    assert sample(logits, t).tolist() == sample(logits.float(), t).tolist()
    assert sample(logits, None).tolist() == logits.float().argmax(-1).tolist()
    assert sample(logits, None)[0] == 7


def test_draws_follow_the_softmax_of_the_kept_tokens():
    torch.manual_seed(0)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40_000
    logits = base.repeat(n, 1)
    for temperature, top_k, top_p in ((1.0, 6, 1.0), (0.5, 6, 1.0), (1.0, 3, 1.0), (1.0, 6, 0.8)):
        got = torch.bincount(sample(logits, settings(n, temperature, top_k, top_p)), minlength=6).float() / n
        probs = (base / temperature).softmax(-1)
        kept = torch.zeros(6, dtype=torch.bool)
        kept[:top_k] = True
        mass = probs.masked_fill(~kept, 0) / probs.masked_fill(~kept, 0).sum()
        kept &= mass.cumsum(0) - mass < top_p
        want = probs.masked_fill(~kept, 0)
        want /= want.sum()
        assert torch.allclose(got, want, atol=0.01), (temperature, top_k, top_p, got, want)
        assert got[~kept].sum() == 0


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch():
    g = torch.Generator().manual_seed(1)
    row = torch.randn(1, 1000, generator=g)
    alone = sample(row, settings(1, seeds=[42], position=7))
    others = torch.randn(9, 1000, generator=g)
    batch = torch.cat([others[:4], row, others[4:]])
    seeds = [None, 3, None, 5, 42, None, 2**63 + 9, None, 11, None]
    together = sample(batch, settings(10, temperature=[1.0] * 10, seeds=seeds, position=[7] * 10))
    assert together[4] == alone[0]
    draws = {sample(row, settings(1, seeds=[42], position=p)).item() for p in range(40)}
    assert len(draws) > 10  # positions change the draw: a seeded request is not one token repeated


def test_hashed_uniforms_are_uniform_and_depend_on_every_argument():
    token = torch.arange(100_000).repeat(2, 1)
    u = hashed_uniform(torch.tensor([[1, 0], [2, 0]]), torch.tensor([0, 0]), token)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert not torch.equal(u[0], u[1])
    again = hashed_uniform(torch.tensor([[1, 0]]), torch.tensor([0]), token[:1])
    assert torch.equal(again[0], u[0])
    moved = hashed_uniform(torch.tensor([[1, 0]]), torch.tensor([1]), token[:1])
    assert (moved[0] != u[0]).float().mean() > 0.99


def test_seeded_requests_repeat_across_calls_and_batches(device):
    llm = LLM("tiny-llama", num_blocks=64, block_size=4, device=device)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_k=40, top_p=0.95, seed=7, ignore_eos=True)
    noise = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)
    alone = llm.generate([[3, 4, 5]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate([[9, 9], [3, 4, 5], [1]], [noise, seeded, noise], use_tqdm=False)[1].outputs[0].token_ids
    assert crowd == alone


def test_ranking_only_the_largest_top_k_draws_what_ranking_all_does():
    """With every row's top_k below V the sampler ranks only the largest K: a seeded row draws the same token."""
    B, V = 64, 300
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(5)) * 2
    t = settings(B, temperature=0.9, top_k=[20 + i % 7 for i in range(B)], top_p=0.9, seeds=list(range(B)),
                 position=3, min_p=0.02)
    everything = dataclasses.replace(t, max_top_k=V)
    assert sample(logits, t).tolist() == sample(logits, everything).tolist()


def test_a_draw_with_nothing_filtered_skips_the_ranking_and_draws_the_same():
    B, V = 32, 200
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(6)) * 2
    t = settings(B, temperature=[0.0] + [0.7] * (B - 1), seeds=list(range(B)), position=9)
    unfiltered = dataclasses.replace(t, filtered=False, max_top_k=V)
    assert sample(logits, unfiltered).tolist() == sample(logits, t).tolist()
