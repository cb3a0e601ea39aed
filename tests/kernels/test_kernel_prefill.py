"""Causal prefill/extend kernel over the paged cache against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.paged_case import assert_matches, make_case, reference
from weft.attention.kernels import prefill_attention

pytestmark = pytest.mark.kernels
gpu = pytest.mark.gpu

# (H_q / H_kv, D, P, q_lens, context_lens): pure prefills (T == context), extends over a cached
# prefix, single tokens beside long prompts, more than one tile of queries.
CPU_CASES = [
    (1, 64, 1, [1, 20, 7], [1, 20, 40]),
    (2, 128, 8, [130, 3], [150, 3]),
    (4, 64, 256, [5, 70], [200, 70]),
    (8, 64, 12, [1, 65], [90, 65]),
]
GPU_Q_LENS = [1, 700, 1000, 57, 1, 300]
GPU_CTX_LENS = [1, 700, 3000, 2100, 900, 301]
GPU_CASES = [(g, d, p, torch.bfloat16) for g in (1, 2, 4, 8) for d in (64, 128) for p in (8, 256)]
GPU_CASES += [(2, 128, p, torch.bfloat16) for p in (1, 16, 64)]
GPU_CASES += [(4, 128, 16, torch.float16), (4, 128, 16, torch.float32), (1, 64, 256, torch.float32)]


def run_prefill(case) -> torch.Tensor:
    D = case.q.shape[2]
    out = torch.full_like(case.q, float("nan"))
    max_query_len = int(case.query_start_loc.diff().max())
    return prefill_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc, case.context_lens,
        max_query_len, D**-0.5, out,
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
