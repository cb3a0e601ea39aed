"""Split-KV decode kernel + merge kernel against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.paged_case import assert_matches, make_case, reference
from weft.attention.kernels import DecodeSplits, decode_attention
from weft.attention.kernels.decode import best_num_splits, resident_programs

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
    _, P, H_kv, _ = case.k_cache.shape
    splits = DecodeSplits.plan(
        B, H_q, H_kv, D, P, case.q.dtype, int(case.context_lens.max()), case.q.device, num_splits
    )
    splits.o.fill_(float("nan"))
    splits.lse.fill_(float("nan"))
    # Twice over one plan, as a step's layers use it: the arrival counters must be ready again.
    for _ in range(2):
        out = torch.full_like(case.q, float("nan"))
        decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, D**-0.5, splits, out)
        assert not splits.arrivals.any(), "arrival counters not reset after the launch"
    return out


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


@pytest.mark.parametrize(
    ("pairs", "tiles", "slots", "expected"),
    [
        (64, 64, 660, 10),  # B=8, S=4096 on the H200 (5 programs per SM): one wave of 640, 7 tiles each
        (64, 128, 660, 10),  # S=8192: 13 tiles each
        (64, 32, 660, 8),  # S=2048: 8 and 10 splits both take 4 tiles; fewer splits win the tie
        (512, 32, 660, 1),  # B=64: one split per program already fills the GPU about once
        (8, 3, 660, 3),  # never more splits than tiles
        (64, 64, 1, 1),  # the interpreter: one program at a time, splitting gains nothing
    ],
)
def test_best_num_splits(pairs, tiles, slots, expected):
    assert best_num_splits(pairs, tiles, slots) == expected


@gpu
def test_resident_programs(device):
    """The split kernel's occupancy comes from its compiled resources: whole programs on every SM."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    slots = resident_programs(device, torch.bfloat16, 16, 8, 128, 16)
    assert slots % sms == 0 and 1 <= slots // sms <= 64
    # float32 tiles take twice the shared memory: never more programs fit than in bfloat16
    assert resident_programs(device, torch.float32, 16, 8, 128, 16) <= slots
