"""The attention kernels launched for a mixed steps' CUDA graph (weft.inference.cuda_graphs.MixedGraphs): planned
for more tokens, decodes and requests than the step has, they read the step's own decodes and requests from
`counts` on the device, compute what launches for the step's own ints compute, to the bit, and leave every other
row alone."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.paged_case import make_case
from tests.kernels.test_gpu_compile import H100_SHARED
from weft.attention.kernels import DecodeSplits, decode_attention, prefill_attention

pytestmark = pytest.mark.kernels


def stale(x: torch.Tensor, rows: int, fill: int) -> torch.Tensor:
    """x with `rows` more rows of `fill`, as a graph's static buffers hold past a step's."""
    return torch.cat([x, torch.full((rows, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)])


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("decodes", "num_splits", "sms"), [(3, 1, None), (3, 2, None), (0, 2, None), (3, 1, 10)])
def test_a_graphs_bounds_compute_only_the_counted_requests(device, dtype, decodes, num_splits, sms, monkeypatch):
    """sms=10: the step's own prefill grid (4 programs of 128 rows) takes the small grids' 64-row programs, the
    graph's bounds (8) the 128-row ones: a row's bits are its own whatever its tile."""
    from weft.attention.kernels import prefill

    launches, choose = [], prefill.prefill_launch
    if sms is not None:
        monkeypatch.setattr(prefill, "gpu_limits", lambda device: (sms, H100_SHARED))
        monkeypatch.setattr(prefill, "prefill_launch", lambda *args: launches.append(choose(*args)) or launches[-1])
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
    counts = torch.tensor([decodes, R, num_splits], dtype=torch.int32, device=device)
    got = torch.full_like(q, nan)
    splits = DecodeSplits.plan_counted(B, H_q, H_kv, D, P, dtype, device)  # room for 6 splits here, or more
    assert splits.num_splits >= decodes * num_splits
    splits.o.fill_(nan)
    decode_attention(q, case.k_cache, case.v_cache, tables, contexts_b, scale, splits, got, counts=counts)
    assert got[decodes:].isnan().all()  # the programs past the step's decodes stored nothing
    assert not splits.arrivals.any()
    prefill_attention(q, case.k_cache, case.v_cache, tables, starts, contexts_b, T + 10, scale, got, first_request=B,
                      counts=counts)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert not got[:T].isnan().any() and got[T:].isnan().all()
    assert sms is None or [launch.block_m for launch in launches] == [prefill.SMALL_BLOCK_M, prefill.BLOCK_M]


def test_a_graphs_steps_take_their_own_split_counts_within_its_grid(monkeypatch):
    """A mixed graph of 512 tokens is planned for 256 decodes: a program (and a scratch slot) per decode, or per split
    of fewer (at most a wave of programs over the KV heads: 528 // 8 splits on the H200's slots). A step of 200
    decodes takes one split each, one of 4 decodes of long contexts more, one decode more still, as their own plans
    would, and each fits the graph's grid."""
    from weft.attention import get_backend
    from weft.attention.base import AttentionMetadata
    from weft.attention.kernels import decode
    from weft.config import ModelConfig

    monkeypatch.setattr(decode, "resident_programs", lambda *args: 528)
    cfg = ModelConfig(arch="qwen3", V=64, E=64, L=1, H_q=16, H_kv=8, D=128, intermediate=64, rms_eps=1e-6,
                      rope_theta=1e4, max_model_len=9000, tie_word_embeddings=True)
    attn = get_backend("triton")(cfg, 64, 16, torch.float32, torch.device("cpu"))

    def meta(decodes: int, context: int, counts: torch.Tensor | None = None) -> AttentionMetadata:
        B = decodes + 1  # and one prompt
        return AttentionMetadata(torch.zeros(512, dtype=torch.int64), torch.zeros(B + 1, dtype=torch.int32),
                                 torch.full((B,), context, dtype=torch.int32), torch.zeros(B, 4, dtype=torch.int32),
                                 300, context, decodes, counts=counts)

    graph = attn.plan(meta(256, 4096, torch.zeros(4, dtype=torch.int32)))
    assert graph.splits.num_splits == 256  # programs: one per decode, or 66 splits of one
    taken = []
    for decodes in (200, 4, 1):
        own = attn.plan(meta(decodes, 9000)).splits.num_splits
        assert attn.step_counts(meta(decodes, 9000), graph) == [decodes, decodes + 1, own]
        assert decodes * own <= graph.splits.num_splits
        taken.append(own)
    assert taken[0] == 1 < taken[1] < taken[2] <= 66
    assert attn.step_counts(meta(0, 3000), graph) == [0, 1, 1]
