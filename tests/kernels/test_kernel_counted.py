"""The attention kernels launched for a mixed steps' CUDA graph (weft.inference.cuda_graphs.MixedGraphs): planned
for more tokens, decodes and requests than the step has, they read the step's own decodes and requests from
`counts` on the device, compute what launches for the step's own ints compute, to the bit, and leave every other
row alone."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.paged_case import make_case
from weft.attention.kernels import DecodeSplits, decode_attention, prefill_attention

pytestmark = pytest.mark.kernels


def stale(x: torch.Tensor, rows: int, fill: int) -> torch.Tensor:
    """x with `rows` more rows of `fill`, as a graph's static buffers hold past a step's."""
    return torch.cat([x, torch.full((rows, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)])


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("decodes", "num_splits"), [(3, 1), (3, 2), (0, 2)])
def test_a_graphs_bounds_compute_only_the_counted_requests(device, dtype, decodes, num_splits):
    H_q, H_kv, D, P = 4, 2, 64, 8
    prefills = [(20, 20), (7, 40)]  # (new tokens, context)
    q_lens = [1] * decodes + [t for t, _ in prefills]
    contexts = [30, 45, 12][:decodes] + [c for _, c in prefills]
    case = make_case(H_q, H_kv, D, P, q_lens, contexts, dtype, device, decodes + num_splits)
    T, R, scale = case.q.shape[0], len(q_lens), D**-0.5
    q = stale(case.q, 10, 1)  # padding token rows, never read
    nan = float("nan")

    want = torch.full_like(q, nan)
    if decodes:
        splits = DecodeSplits.plan(decodes, H_q, H_kv, D, P, dtype, max(contexts), device, num_splits)
        decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, scale, splits, want)
    prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc, case.context_lens,
                      max(q_lens), scale, want, first_request=decodes)

    # a graph of T + 10 tokens: planned for 6 decodes and 4 more requests, its buffers stale past the step's rows
    B, extra = 6, 4
    tables = stale(case.block_tables, B + extra - R, 0)
    contexts_b = stale(case.context_lens, B + extra - R, 1)
    starts = stale(case.query_start_loc, B + extra - R, T)
    counts = torch.tensor([decodes, R], dtype=torch.int32, device=device)
    got = torch.full_like(q, nan)
    splits = DecodeSplits.plan(B, H_q, H_kv, D, P, dtype, tables.shape[1] * P, device, num_splits)
    splits.o.fill_(nan)
    decode_attention(q, case.k_cache, case.v_cache, tables, contexts_b, scale, splits, got, counts=counts)
    assert got[decodes:].isnan().all()  # the programs past the step's decodes stored nothing
    assert not splits.arrivals.any()
    prefill_attention(q, case.k_cache, case.v_cache, tables, starts, contexts_b, T + 10, scale, got, first_request=B,
                      counts=counts)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert not got[:T].isnan().any() and got[T:].isnan().all()


def test_a_graph_serves_only_steps_it_splits_as_finely_as_their_own_plans(monkeypatch):
    """A mixed graph of 512 tokens is planned for 256 decodes, so one split each (on the H200's 528 slots): it serves
    a step of 200 decodes (one split of its own too), not one of 4 decodes of long contexts (whose own plan splits
    them over most of the GPU)."""
    from weft.attention import get_backend
    from weft.attention.base import AttentionMetadata
    from weft.attention.kernels import decode
    from weft.config import ModelConfig

    monkeypatch.setattr(decode, "resident_programs", lambda *args: 528)
    cfg = ModelConfig(arch="qwen3", V=64, E=64, L=1, H_q=16, H_kv=8, D=128, intermediate=64, rms_eps=1e-6,
                      rope_theta=1e4, max_model_len=4096, tie_word_embeddings=True)
    attn = get_backend("triton")(cfg, 64, 16, torch.float32, torch.device("cpu"))

    def meta(decodes: int, context: int, counts: torch.Tensor | None = None) -> AttentionMetadata:
        B = decodes + 1  # and one prompt
        return AttentionMetadata(torch.zeros(512, dtype=torch.int64), torch.zeros(B + 1, dtype=torch.int32),
                                 torch.full((B,), context, dtype=torch.int32), torch.zeros(B, 4, dtype=torch.int32),
                                 300, context, decodes, counts=counts)

    graph = attn.plan(meta(256, 4096, torch.zeros(2, dtype=torch.int32)))
    assert graph.splits.num_splits == 1
    assert attn.plans_within(meta(200, 3000), graph)
    assert not attn.plans_within(meta(4, 3000), graph)
    assert attn.plans_within(meta(0, 3000), graph)
