"""Split-KV decode kernel + merge kernel against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.paged_case import assert_matches, make_case, reference
from weft.attention.kernels import DecodeSplits, decode_attention

pytestmark = pytest.mark.kernels
gpu = pytest.mark.gpu

# (H_q / H_kv, D, P, context_lens, num_splits): tiny enough for the interpreter; lengths 1, ragged,
# splits that end up empty for short requests, P = 1, P not a power of two, P above the tile.
CPU_CASES = [
    (1, 64, 1, [1, 70, 33], 4),
    (2, 128, 8, [130, 1, 64, 5], 3),
    (4, 64, 256, [200, 17], 2),
    (8, 64, 12, [1, 150], 8),
    (2, 64, 64, [64, 128], 1),
    (1, 64, 16, [1100, 3], 20),  # more splits than the merge kernel reads at a time
]
# Realistic sizes on the GPU: every group size at D 64/128 and small/large P, the rest of P at one shape.
GPU_LENS = [1, 4097, 2500, 17, 1000, 3333, 64, 800]
GPU_CASES = [(g, d, p, torch.bfloat16) for g in (1, 2, 4, 8) for d in (64, 128) for p in (8, 256)]
GPU_CASES += [(2, 128, p, torch.bfloat16) for p in (1, 16, 32, 64, 128)]
GPU_CASES += [(4, 128, 16, torch.float16), (4, 128, 16, torch.float32), (1, 64, 256, torch.float32)]


def run_decode(case, num_splits: int | None) -> torch.Tensor:
    B, H_q, D = case.q.shape
    splits = DecodeSplits.plan(
        B, H_q, case.k_cache.shape[2], D, int(case.context_lens.max()), case.q.device, num_splits
    )
    splits.o.fill_(float("nan"))
    splits.lse.fill_(float("nan"))
    out = torch.full_like(case.q, float("nan"))
    return decode_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, D**-0.5, splits, out
    )


@pytest.mark.parametrize(("group", "D", "P", "context_lens", "num_splits"), CPU_CASES)
def test_decode_fp32(device, group, D, P, context_lens, num_splits):
    H_kv, q_lens = 2, [1] * len(context_lens)
    case = make_case(group * H_kv, H_kv, D, P, q_lens, context_lens, torch.float32, device, 0)
    assert_matches(run_decode(case, num_splits), reference(case, D**-0.5))


@gpu
@pytest.mark.parametrize(("group", "D", "P", "dtype"), GPU_CASES)
def test_decode_gpu(device, group, D, P, dtype):
    H_kv = 8
    case = make_case(group * H_kv, H_kv, D, P, [1] * len(GPU_LENS), GPU_LENS, dtype, device, P + D + group)
    assert_matches(run_decode(case, None), reference(case, D**-0.5))


@gpu
def test_decode_single_request_splits(device):
    """B = 1 has to split its context widely to fill the GPU; the result must not change."""
    case = make_case(16, 8, 128, 16, [1], [32768], torch.bfloat16, device, 1)
    ref = reference(case, 128**-0.5)
    for num_splits in (None, 1, 7, 1000):
        assert_matches(run_decode(case, num_splits), ref)
