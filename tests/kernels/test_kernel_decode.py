"""The split-KV decode kernel (its merge included) against a float64 reference, and how it plans splits."""

from __future__ import annotations

import numpy as np
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
from weft.attention.kernels import DecodeSplits, decode, decode_attention
from weft.attention.kernels.decode import (
    DEEP_TILES,
    MERGE_ELEMENTS,
    SHALLOW_TILES,
    Tiles,
    _constexprs,
    best_num_splits,
    compiled_kernel,
    resident_programs,
    tile_options,
    tiles_for,
)
from weft.attention.kernels.tiles import padded_head_dim

pytestmark = pytest.mark.kernels
gpu = pytest.mark.gpu

# (H_q / H_kv, D, P, context_lens, num_splits): tiny enough for the interpreter; lengths 1, ragged,
# splits that end up empty for short requests, P = 1, P not a power of two, P above the tile, a
# group that is not a power of two, merges of several passes (MERGE_TILE splits each), head dims
# that are not a power of two (padded to 64 or 128 lanes) through the merge and the lone split.
CPU_CASES = [
    (1, 64, 1, [1, 70, 33], 4),
    (2, 128, 8, [130, 1, 64, 5], 3),
    (4, 64, 256, [200, 17], 2),
    (8, 64, 12, [1, 150], 8),
    (2, 64, 64, [64, 128], 1),
    (1, 64, 16, [1100, 3], 20),  # 18 tiles of 64 over 20 splits: some empty even for the long request
    (3, 64, 8, [40, 200, 7], 40),  # 5 merge passes of 8 splits, some of them all empty
    (2, 80, 16, [70, 1, 33], 3),
    (1, 48, 8, [40, 130], 1),
    (4, 96, 12, [100, 5], 5),  # 2 merge passes of 4 splits
]
# Realistic sizes on the GPU: every group size at D 64/128 and small/large P, the rest of P at one shape.
GPU_LENS = [1, 4097, 2500, 17, 1000, 3333, 64, 800]
GPU_SHAPES = [(g, d, p, torch.bfloat16) for g in (1, 2, 4, 8) for d in (64, 128) for p in (8, 256)]
GPU_SHAPES += [(2, 128, p, torch.bfloat16) for p in (1, 16, 32, 64, 128)]
GPU_SHAPES += [(4, 128, 16, torch.float16), (4, 128, 16, torch.float32), (1, 64, 256, torch.float32)]
# Head dims that are not a power of two, and the widest served (MAX_HEAD_DIM).
GPU_SHAPES += [(2, d, 16, torch.bfloat16) for d in (40, 48, 80, 96, 160, 192, 256)]
GPU_SHAPES += [(8, 80, 256, torch.bfloat16), (4, 96, 8, torch.float16), (4, 80, 16, torch.float32)]
GPU_CASES = [(*shape, tiles) for shape in GPU_SHAPES for tiles in tile_options(shape[-1])]


def use_tiles(monkeypatch, tiles: Tiles) -> None:
    """Every plan from here on walks `tiles`, whatever the step."""
    monkeypatch.setattr(decode, "tiles_for", lambda *args: tiles)


def assert_decodes(case, num_splits: int | None, ref: torch.Tensor, window: int | None = None) -> None:
    """Two launches over one plan, as a step's layers use it, each on NaN-poisoned scratch: a merge
    that read a split's part before it was stored, or counters not ready again, fail here."""
    B, H_q, D = case.q.shape
    _, P, H_kv, _ = case.k_cache.shape
    splits = DecodeSplits.plan(
        B, H_q, H_kv, D, P, case.q.dtype, int(case.context_lens.max()), case.q.device, num_splits
    )
    for _ in range(2):
        splits.o.fill_(float("nan"))
        splits.lse.fill_(float("nan"))
        out = torch.full_like(case.q, float("nan"))
        decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, D**-0.5, splits, out,
                         window)
        assert_matches(out, ref)
        assert not splits.arrivals.any(), "arrival counters not reset after the launch"


@pytest.mark.parametrize(("group", "D", "P", "context_lens", "num_splits"), CPU_CASES)
def test_decode_fp32(device, group, D, P, context_lens, num_splits):
    H_kv, q_lens = 2, [1] * len(context_lens)
    case = make_case(group * H_kv, H_kv, D, P, q_lens, context_lens, torch.float32, device, 0)
    assert_decodes(case, num_splits, reference(case, D**-0.5))


# windows within a tile (64 here), across tiles, past every context; splits more and fewer than the window's tiles
@pytest.mark.parametrize(("window", "num_splits"), [(1, 1), (40, 3), (130, 2), (130, 7), (2000, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu)])
def test_decode_within_a_sliding_window(device, window, num_splits, dtype):
    """The query sees the last `window` keys of its context; the ones before are never read."""
    case = make_case(4, 2, 64, 16, [1] * 4, [1, 300, 64, 129], dtype, device, window)
    poison_outside(case, window)
    assert_decodes(case, num_splits, reference(case, 64**-0.5, window), window)


@gpu
@pytest.mark.parametrize(("group", "D", "P", "dtype", "tiles"), GPU_CASES)
def test_decode_gpu(device, monkeypatch, group, D, P, dtype, tiles):
    H_kv = 8
    case = make_case(group * H_kv, H_kv, D, P, [1] * len(GPU_LENS), GPU_LENS, dtype, device, P + D + group)
    use_tiles(monkeypatch, tiles)
    assert_decodes(case, None, reference(case, D**-0.5))


@interpreter_only
@pytest.mark.parametrize(
    ("D", "P", "context_lens", "extra_columns", "num_splits"),
    [
        (16, 64, [64, 128], 0, 3),  # rows exactly full, whole blocks per tile: the look-ahead runs past both ends
        (16, 8, [40, 1, 17], 0, 4),
        (16, 96, [200, 1, 97], 0, 2),  # P neither a power of two nor under a tile
        (16, 16, [100, 3], 7, 20),  # a CUDA graph's wide table, junk past each context; more splits than tiles
        (80, 8, [40, 1, 17], 3, 4),  # a padded head (test_decode_touches_only_lanes_below_D checks its lanes)
    ],
)
def test_decode_reads_table_in_bounds(monkeypatch, D, P, context_lens, extra_columns, num_splits):
    """The kernel reads the block table a tile ahead, but never past a row's end. The table here is
    a view into a wider tensor, so such a read would land in memory that exists and change nothing
    in the output: only the addresses the interpreter loads from can show it."""
    from triton.runtime import interpreter

    H_kv = 2
    case = make_case(2 * H_kv, H_kv, D, P, [1] * len(context_lens), context_lens, torch.float32, "cpu", P)
    blocks = [-(-c // P) for c in context_lens]
    width = max(blocks) + extra_columns
    g = torch.Generator().manual_seed(P)
    wider = torch.randint(0, case.k_cache.shape[0], (len(blocks), width + 5), generator=g, dtype=torch.int32)
    for b, n in enumerate(blocks):
        wider[b, :n] = case.block_tables[b, :n]
    table = wider[:, :width]

    reads = []
    load = interpreter.InterpreterBuilder.create_masked_load

    def recording_load(self, ptrs, mask, *args):
        reads.append(ptrs.data[mask.data].ravel())
        return load(self, ptrs, mask, *args)

    splits = DecodeSplits.plan(len(blocks), 2 * H_kv, H_kv, D, P, torch.float32, max(context_lens), "cpu", num_splits)
    out = torch.full_like(case.q, float("nan"))
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", recording_load)
    decode_attention(case.q, case.k_cache, case.v_cache, table, case.context_lens, D**-0.5, splits, out)
    monkeypatch.undo()

    addresses = np.concatenate(reads).astype(np.int64)
    base, end = wider.data_ptr(), wider.data_ptr() + wider.numel() * wider.element_size()
    entries = (addresses[(addresses >= base) & (addresses < end)] - base) // wider.element_size()
    assert entries.size, "no block table reads recorded"
    columns = entries % wider.stride(0)
    beyond = np.unique(columns[columns >= width]).tolist()
    assert not beyond, f"read columns {beyond} of a {width}-wide table"
    assert_matches(out, reference(case, D**-0.5))


@interpreter_only
@pytest.mark.parametrize(("D", "num_splits"), [(80, 1), (80, 3), (40, 4)])
def test_decode_touches_only_lanes_below_D(D, num_splits):
    """Padded lanes (D .. D_PAD-1) are masked in every load and store: q, the caches and out are views
    of tensors D_PAD wide here, so a lane touched past D would show up in their gaps (in a contiguous
    tensor it would read the next head, or past the end of the last one)."""
    H_kv, D_PAD = 2, padded_head_dim(D)
    case = make_case(3 * H_kv, H_kv, D, 8, [1, 1], [50, 9], torch.float32, "cpu", D)
    q, k_cache, v_cache = (padded_view(x, D_PAD) for x in (case.q, case.k_cache, case.v_cache))
    out = padded_view(torch.full_like(case.q, float("nan")), D_PAD)
    splits = DecodeSplits.plan(2, 3 * H_kv, H_kv, D, 8, torch.float32, 50, "cpu", num_splits)
    with recorded_accesses() as accesses:
        decode_attention(q, k_cache, v_cache, case.block_tables, case.context_lens, D**-0.5, splits, out)
    scratch = [splits.o, splits.lse, splits.arrivals]
    assert_in_bounds(accesses, [case.block_tables, case.context_lens, *scratch], [q, k_cache, v_cache, out])
    assert_matches(out, reference(case, D**-0.5))


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("D", [8, 48, 80, 96, 128, 256])
def test_padded_head_shapes(group, D):
    """Registers and scratch are sized by the padded width: the merge reads a power-of-two tile of at
    most MERGE_ELEMENTS (or one split), and the splits' scratch holds all D_PAD lanes."""
    D_PAD = padded_head_dim(D)
    assert D_PAD >= max(16, D) and D_PAD & (D_PAD - 1) == 0 and (D_PAD == D or D_PAD < 2 * max(16, D))
    consts = _constexprs(2 * group, 2, D, 16, SHALLOW_TILES)
    assert (consts["D"], consts["D_PAD"]) == (D, D_PAD)
    tile = consts["MERGE_TILE"]
    assert tile & (tile - 1) == 0 and (tile == 1 or tile * consts["GROUP_P2"] * D_PAD <= MERGE_ELEMENTS)
    splits = DecodeSplits.plan(3, 2 * group, 2, D, 16, torch.float32, 100, "cpu", 2)
    assert splits.o.shape == (3, 2 * group, 2, D_PAD)


@gpu
def test_decode_single_request_splits(device):
    """B = 1 has to split its context widely to fill the GPU; the result must not change."""
    case = make_case(16, 8, 128, 16, [1], [32768], torch.bfloat16, device, 1)
    ref = reference(case, 128**-0.5)
    for num_splits in (None, 1, 7, 1000):
        assert_decodes(case, num_splits, ref)


@pytest.mark.parametrize(
    ("pairs", "tiles", "slots", "expected"),
    [
        (64, 128, 660, 8),  # 5 programs per SM (32-token tiles before 66c8f6d): 6..10 splits fit, 8 deal 16 each
        (64, 256, 660, 8),  # 256 tiles (S=16384): 32 each
        (64, 67, 660, 10),  # no count deals 67 evenly: 7 and 10 splits waste as little; more splits win the tie
        (64, 67, 528, 7),  # with 4 programs per SM (bf16 shallow tiles) 10 no longer fit: 5 or 7
        (8, 128, 660, 64),  # B=1 at 660 slots: 42..82 splits fill half a wave to one; 64 deal 2 tiles each
        (512, 64, 660, 1),  # B=64: one split per program already fills the GPU about once
        (512, 1280, 660, 1),  # a CUDA graph's plan for a table of 81,920 tokens: still never past one wave
        (8, 3, 660, 3),  # never more splits than tiles
        (64, 64, 1, 1),  # the interpreter: one program at a time, splitting gains nothing
        (64, 64, 396, 4),  # B=8, S=4096 under deep tiles (3 programs per SM): 4..6 splits fit, 4 deal 16 each
        (8, 64, 396, 32),  # B=1 under deep tiles: 32 splits of 2 tiles
    ],
)
def test_best_num_splits(pairs, tiles, slots, expected):
    assert best_num_splits(pairs, tiles, slots) == expected


def no_slots() -> int:
    raise AssertionError("float32 has one tile configuration: nothing to weigh")


@pytest.mark.parametrize(
    ("dtype", "pairs", "deep_slots", "expected"),
    [
        (torch.bfloat16, 8, 396, DEEP_TILES),  # B=1 at H_kv=8 on the H200
        (torch.bfloat16, 64, 396, DEEP_TILES),  # B=8
        (torch.bfloat16, 264, 396, DEEP_TILES),  # B=33: two thirds of a deep wave, the largest batch still deep
        (torch.bfloat16, 265, 396, SHALLOW_TILES),
        (torch.float16, 512, 396, SHALLOW_TILES),  # B=64: a deep wave would not hold it
        (torch.bfloat16, 2048, 396, SHALLOW_TILES),  # B=256
        (torch.bfloat16, 1, 1, SHALLOW_TILES),  # the interpreter: one program at a time
        (torch.bfloat16, 1, 0, SHALLOW_TILES),  # a GPU that cannot hold a deep program at all
        (torch.float32, 8, no_slots, SHALLOW_TILES),
        (torch.float32, 512, no_slots, SHALLOW_TILES),
    ],
)
def test_tiles_for(dtype, pairs, deep_slots, expected):
    slots = deep_slots if callable(deep_slots) else lambda: deep_slots
    assert tiles_for(dtype, pairs, slots) == expected


@pytest.mark.parametrize(
    ("B", "dtype", "tiles", "num_splits"),
    [
        (1, torch.bfloat16, DEEP_TILES, 32),
        (8, torch.bfloat16, DEEP_TILES, 4),
        (64, torch.bfloat16, SHALLOW_TILES, 1),
        (8, torch.float32, SHALLOW_TILES, 4),  # float32 asks only for its own tiles' slots
    ],
)
def test_plan_takes_slots_of_its_tiles(monkeypatch, B, dtype, tiles, num_splits):
    """The plan weighs the deep tiles' occupancy and splits by the chosen tiles' own. Occupancy is the
    GPU's answer (test_resident_programs); here the H200's, so that the wiring runs on the CPU too."""
    occupancy = {(torch.bfloat16, DEEP_TILES): 396, (torch.bfloat16, SHALLOW_TILES): 528,
                 (torch.float32, SHALLOW_TILES): 264}
    asked = []

    def resident(device, dtype, H_q, H_kv, D, P, tiles):
        asked.append(tiles)
        return occupancy[dtype, tiles]

    monkeypatch.setattr(decode, "resident_programs", resident)
    splits = DecodeSplits.plan(B, 16, 8, 128, 16, dtype, 4096, "cpu")
    assert splits.tiles == tiles
    assert splits.lse.shape[2] == num_splits
    assert asked[-1] == tiles and set(asked) <= set(tile_options(dtype))


@gpu
@pytest.mark.parametrize(
    ("dtype", "tiles"), [(dtype, tiles) for dtype in (torch.bfloat16, torch.float32) for tiles in tile_options(dtype)]
)
def test_resident_programs(device, dtype, tiles):
    """The occupancy weft computes from the compiled kernel's resources is the CUDA driver's own."""
    import ctypes

    kernel = compiled_kernel(device, dtype, 16, 8, 128, 16, tiles)
    per_sm = ctypes.c_int()
    status = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(per_sm), ctypes.c_void_p(kernel.function), ctypes.c_int(32 * kernel.metadata.num_warps),
        ctypes.c_size_t(kernel.metadata.shared),
    )
    assert status == 0, f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUresult {status}"
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    assert resident_programs(device, dtype, 16, 8, 128, 16, tiles) == per_sm.value * sms


@gpu
def test_resident_programs_of_tiles_too_big(device):
    """Tiles whose program needs more shared memory than a block may have hold no slots (so the plan
    never picks them; test_tiles_for) instead of failing: float32 at 256 tokens, three stages, is ~0.5 MB."""
    assert resident_programs(device, torch.float32, 16, 8, 128, 16, Tiles(256, 3)) == 0
