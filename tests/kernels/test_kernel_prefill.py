"""Causal prefill/extend kernel over the paged cache against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.paged_case import (
    assert_in_bounds,
    assert_matches,
    interpreter_only,
    make_case,
    padded_view,
    poison_outside,
    recorded_accesses,
    reference,
)
from weft.attention.kernels import prefill_attention
from weft.attention.kernels.prefill import KV_TILE_BYTES, kv_tile_tokens
from weft.attention.kernels.tiles import padded_head_dim

pytestmark = pytest.mark.kernels
gpu = pytest.mark.gpu

# (H_q / H_kv, D, P, q_lens, context_lens): pure prefills (T == context), extends over a cached
# prefix, single tokens beside long prompts, more than one tile of queries; head dims that are not
# a power of two (padded to 64 or 128 lanes), with unmasked K/V tiles before the diagonal.
CPU_CASES = [
    (1, 64, 1, [1, 20, 7], [1, 20, 40]),
    (2, 128, 8, [130, 3], [150, 3]),
    (4, 64, 256, [5, 70], [200, 70]),
    (8, 64, 12, [1, 65], [90, 65]),
    (2, 48, 8, [5, 30], [200, 30]),
    (1, 80, 16, [3, 70], [130, 70]),
    (4, 96, 12, [1, 20], [70, 20]),
]
GPU_Q_LENS = [1, 700, 1000, 57, 1, 300]
GPU_CTX_LENS = [1, 700, 3000, 2100, 900, 301]
GPU_CASES = [(g, d, p, torch.bfloat16) for g in (1, 2, 4, 8) for d in (64, 128) for p in (8, 256)]
GPU_CASES += [(2, 128, p, torch.bfloat16) for p in (1, 16, 64)]
GPU_CASES += [(4, 128, 16, torch.float16), (4, 128, 16, torch.float32), (1, 64, 256, torch.float32)]
# Head dims that are not a power of two, and the widest served (MAX_HEAD_DIM).
GPU_CASES += [(2, d, 16, torch.bfloat16) for d in (40, 48, 80, 96, 160, 192, 256)]
GPU_CASES += [(8, 80, 256, torch.bfloat16), (4, 96, 8, torch.float16), (4, 80, 16, torch.float32)]


def run_prefill(case, window: int | None = None) -> torch.Tensor:
    D = case.q.shape[2]
    out = torch.full_like(case.q, float("nan"))
    max_query_len = int(case.query_start_loc.diff().max())
    return prefill_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc, case.context_lens,
        max_query_len, D**-0.5, out, window=window,
    )


@pytest.mark.parametrize(("group", "D", "P", "q_lens", "context_lens"), CPU_CASES)
def test_prefill_fp32(device, group, D, P, q_lens, context_lens):
    H_kv = 2
    case = make_case(group * H_kv, H_kv, D, P, q_lens, context_lens, torch.float32, device, 0)
    assert_matches(run_prefill(case), reference(case, D**-0.5))


@gpu
@pytest.mark.parametrize(("group", "D", "P", "dtype"), GPU_CASES)
def test_prefill_gpu(device, group, D, P, dtype):
    H_kv = 4
    case = make_case(group * H_kv, H_kv, D, P, GPU_Q_LENS, GPU_CTX_LENS, dtype, device, P + D + group)
    assert_matches(run_prefill(case), reference(case, D**-0.5))


# windows shorter and longer than a key tile (64 here) and the query tile (128), a window past every context
@pytest.mark.parametrize("window", [1, 16, 100, 300, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu)])
def test_prefill_within_a_sliding_window(device, window, dtype):
    """Each query sees the window's keys up to itself; the keys no query of its request sees are never read."""
    case = make_case(4, 2, 64, 16, [1, 150, 40, 7], [90, 150, 400, 7], dtype, device, window)
    poison_outside(case, window)
    assert_matches(run_prefill(case, window), reference(case, 64**-0.5, window))


@interpreter_only
@pytest.mark.parametrize("D", [80, 40])
def test_prefill_touches_only_lanes_below_D(D):
    """Padded lanes are masked in every load and store, the unmasked K/V tiles before the diagonal
    included: q, the caches and out are views of wider tensors, whose gaps show a stray lane."""
    H_kv, D_PAD = 2, padded_head_dim(D)
    case = make_case(2 * H_kv, H_kv, D, 8, [4, 9], [140, 9], torch.float32, "cpu", D)
    q, k_cache, v_cache = (padded_view(x, D_PAD) for x in (case.q, case.k_cache, case.v_cache))
    out = padded_view(torch.full_like(case.q, float("nan")), D_PAD)
    with recorded_accesses() as accesses:
        prefill_attention(
            q, k_cache, v_cache, case.block_tables, case.query_start_loc, case.context_lens, 9, D**-0.5, out
        )
    metadata = [case.block_tables, case.query_start_loc, case.context_lens]
    assert_in_bounds(accesses, metadata, [q, k_cache, v_cache, out])
    assert_matches(out, reference(case, D**-0.5))


@pytest.mark.parametrize(
    ("D", "element_size", "tokens"),
    [(128, 2, 128), (64, 4, 128), (128, 4, 64), (80, 2, 128), (80, 4, 64), (48, 4, 128), (192, 2, 64), (256, 4, 32)],
)
def test_kv_tile_tokens(D, element_size, tokens):
    """Tiles are sized by the padded width, which is what takes registers and shared memory."""
    D_PAD = padded_head_dim(D)
    assert kv_tile_tokens(D_PAD, element_size) == tokens
    assert tokens * D_PAD * element_size <= KV_TILE_BYTES
