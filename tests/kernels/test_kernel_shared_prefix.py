"""Decodes grouped by the blocks they share: the shared kernel reads a group's shared tokens once, the split kernel
each member's own; together against the float64 reference, and how the groups are found."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.paged_case import (
    assert_matches,
    interpreter_only,
    make_case,
    recorded_accesses,
    reference,
)
from weft.attention.kernels import DecodeSplits, decode_attention
from weft.attention.kernels.decode import (
    TILE_TOKENS,
    SharedPrefixes,
    _common_blocks,
    max_group_members,
    prefix_groups,
)

pytestmark = pytest.mark.kernels
gpu = pytest.mark.gpu


def shared_case(H_q, H_kv, D, P, context_lens, groups, dtype, device, seed):
    """`make_case` whose groups' members begin with their first's blocks (as many as its shared tokens take)."""
    case = make_case(H_q, H_kv, D, P, [1] * len(context_lens), context_lens, dtype, device, seed)
    for first, members, shared in groups:
        blocks = -(-shared // P)
        case.block_tables[first + 1 : first + members, :blocks] = case.block_tables[first, :blocks]
    return case


def grouped_decode(case, groups, empty_slots=0, num_splits=None, shared_splits=None):
    """Two launches over one plan, on NaN-poisoned scratch and output; `empty_slots` group slots of 0 tokens after
    the groups, as a CUDA graph holds them."""
    B, H_q, D = case.q.shape
    _, P, H_kv, _ = case.k_cache.shape
    device, dtype = case.q.device, case.q.dtype
    lens = [0] * B
    for first, members, shared in groups:
        lens[first : first + members] = [shared] * members
    table = torch.tensor([*groups, *[(0, 0, 0)] * empty_slots], dtype=torch.int32, device=device).view(-1, 3)
    max_len = int(case.context_lens.max())
    splits = DecodeSplits.plan(B, H_q, H_kv, D, P, dtype, max_len, device, num_splits)
    shared = SharedPrefixes.plan(table, torch.tensor(lens, dtype=torch.int32, device=device), B, H_q, H_kv, D, P,
                                 dtype, max_len, splits.tiles, shared_splits)
    for _ in range(2):
        for t in (splits.o, splits.lse, shared.o, shared.lse):
            t.fill_(float("nan"))
        out = torch.full_like(case.q, float("nan"))
        decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, D**-0.5, splits,
                         out, shared=shared)
        yield out
        assert not splits.arrivals.any(), "arrival counters not reset after the launch"


# (H_q / H_kv, D, P, context_lens, groups, splits, shared splits): groups of 2 .. max members, shared tokens that end
# inside a block (P = 12), members whose own part is one token or several tiles, lone splits and merges, decodes
# outside any group before, between and after them, more shared splits than shared tiles.
CPU_CASES = [
    (2, 64, 16, [200, 150, 300, 90, 5], [(0, 3, 128)], 3, 2),
    (2, 64, 16, [129, 65, 300, 70, 200], [(0, 2, 64), (2, 3, 64)], 1, 1),
    (2, 64, 12, [5, 100, 65, 200], [(1, 3, 64)], 2, 3),  # more shared splits than its tile
    (4, 64, 16, [1, 260, 257, 300, 400, 3], [(1, 4, 256)], 4, 5),
    (2, 64, 8, [70, 80, 90, 100, 110, 120, 130, 140], [(0, 8, 64)], 2, 1),
    (2, 80, 16, [140, 200], [(0, 2, 128)], 3, 2),  # a padded head
]


@pytest.mark.parametrize(("group", "D", "P", "context_lens", "groups", "num_splits", "shared_splits"), CPU_CASES)
def test_grouped_decode_fp32(device, group, D, P, context_lens, groups, num_splits, shared_splits):
    H_kv = 2
    case = shared_case(group * H_kv, H_kv, D, P, context_lens, groups, torch.float32, device, 0)
    ref = reference(case, D**-0.5)
    for out in grouped_decode(case, groups, empty_slots=2, num_splits=num_splits, shared_splits=shared_splits):
        assert_matches(out, ref)


@gpu
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_decode_gpu(device, group, dtype):
    """A step of siblings as n = 4 makes them, at realistic lengths, beside decodes of their own."""
    H_kv, members = 8, max_group_members(8 * group, 8)
    lens = [3000, 1, 900, 17] + [1100 + 37 * i for i in range(2 * members)] + [2000, 640]
    groups = [(4, members, 1024), (4 + members, members, 1024)]
    case = shared_case(group * H_kv, H_kv, 128, 16, lens, groups, dtype, device, group)
    ref = reference(case, 128**-0.5)
    for out in grouped_decode(case, groups, empty_slots=5):
        assert_matches(out, ref)


@interpreter_only
def test_shared_tokens_are_read_once_per_group():
    """Each K/V element of a group's shared blocks is loaded once (per group, not per member), and the members'
    own tokens once each."""
    H_kv, D, P = 2, 16, 16
    lens, groups = [150, 200, 170], [(0, 3, 128)]
    case = shared_case(2 * H_kv, H_kv, D, P, lens, groups, torch.float32, "cpu", 3)
    with recorded_accesses() as accesses:
        next(grouped_decode(case, groups, num_splits=2, shared_splits=2))
    loads = np.concatenate(accesses).astype(np.int64)
    size = case.k_cache.element_size()
    for cache in (case.k_cache, case.v_cache):
        start = cache.data_ptr()
        flat = cache.view(-1, H_kv, D)
        for b, c in enumerate(lens):
            pos = torch.arange(c)
            blocks = case.block_tables[b].long()[pos // P]
            rows = (blocks * P + pos % P).tolist()
            counts = [np.count_nonzero((loads >= start + r * flat.stride(0) * size)
                                       & (loads < start + (r + 1) * flat.stride(0) * size)) for r in rows]
            own = counts[128:] if b else counts
            assert all(n == H_kv * D for n in own), (b, sorted(set(own)))


def test_prefix_groups():
    """Runs of consecutive decodes whose tables begin alike, at least one whole tile before every member's new token,
    at most max_members; the second member sets the shared tokens, and one sharing fewer starts again."""
    T = TILE_TOKENS
    a = list(range(100, 120))  # 20 blocks of 16 tokens
    b = a[:8] + list(range(200, 212))  # a's first 8 blocks (two tiles), then its own
    c = a[:3] + list(range(300, 317))  # under a tile in common with a
    other = list(range(400, 420))
    assert prefix_groups([a, a[:], a[:]], [300, 310, 320], 16, 8) == [0, 3, 320 // T * T - T]  # 256: before 300-1
    assert prefix_groups([a, b, a[:], other], [300, 300, 300, 300], 16, 8) == [0, 3, 2 * T]
    assert prefix_groups([a, a[:], b, b[:]], [300, 300, 300, 300], 16, 8) == [0, 2, 4 * T, 2, 2, 4 * T]
    # c shares < a tile with a: a goes alone; c and the last a share 3 blocks, also < a tile: no group
    assert prefix_groups([a, c, a[:]], [300, 300, 300], 16, 8) == []
    assert prefix_groups([a, a[:], a[:], a[:], a[:]], [300] * 5, 16, 2) == [0, 2, 256, 2, 2, 256]
    assert prefix_groups([a, a[:]], [65, 300], 16, 8) == [0, 2, 64]  # blocks wholly before token 64: four
    assert prefix_groups([a, a[:]], [64, 300], 16, 8) == []  # token 63 new: three whole blocks, under a tile
    assert prefix_groups([a, b, b[:]], [300, 300, 100], 16, 8) == [0, 2, 128]  # the third's new token is in them
    assert prefix_groups([a, a[:]], [300, 300], 16, 1) == []  # a group's heads would not fit the rows
    assert prefix_groups([a], [300], 16, 8) == []


def test_max_group_members():
    assert [max_group_members(h, 8) for h in (8, 16, 32, 64, 128, 256)] == [16, 8, 4, 2, 1, 0]


@pytest.mark.parametrize(("a", "b", "most", "expected"), [
    ([1, 2, 3, 4], [1, 2, 3, 4], 4, 4),
    ([1, 2, 3, 4], [1, 2, 3, 4], 2, 2),  # capped
    ([1, 2, 3, 4], [1, 2, 9, 4], 4, 2),  # a block alike after the first that differs
    ([1, 2, 3, 4, 5], [1, 9, 3, 4, 5], 5, 1),  # ...which the search by positions lands past: the slices set it right
    ([1, 2, 3, 4], [9, 2, 3, 4], 4, 0),
    ([1, 2, 3, 4], [1, 2, 3, 4], 0, 0),
])  # fmt: skip
def test_common_blocks_is_the_longest_common_prefix(a, b, most, expected):
    assert _common_blocks(a, b, most) == expected
