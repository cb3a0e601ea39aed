"""Split-KV flash-decoding over the paged cache: one new query token per request.

One kernel, one program per (request b, KV head, split of the context): it reads each K/V
token of its split once for the KV head's whole group of H_q / H_kv query heads (padded to
the 16 rows tl.dot needs) and leaves that split's normalized output and log2-sum-exp (a lone
split writes its output directly). The last split of a (request, KV head) to finish merges them
all, counted by an atomic arrival counter: no second kernel, whose launch and round trips cost
1.4 to 2.7 points of the copy bandwidth at S = 4096 on the H200
(results/logs/h200_decode_splits.txt). Splitting the context is what keeps all SMs busy when
B * H_kv is small.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weft.attention.kernels.tiles import LOG2E, softmax_step, token_offsets

# 4, not 2: 2 warps measured the same in bf16 (results/logs/h200_decode_splits.txt), while e5 in
# float32 fell from 1197 to 494 output tok/s with them (likely register spills: a float32 K or V
# tile is 128 registers per thread over 64 threads).
NUM_WARPS = 4
MIN_GROUP_ROWS = 16  # tl.dot needs at least 16 rows
MERGE_ELEMENTS = 2048  # float32 values of the splits' outputs the merge reads at a time


# The block table's width and the number of splits change from step to step: the strides and the
# row length they set are not specialized on (those of o stay multiples of D, a power of two >= 16,
# whatever the split count), so a serving run compiles the kernel once per shape, not again mid-run.
@triton.jit(do_not_specialize=["stride_table", "stride_lb", "stride_lh", "table_tokens"])
def _split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, context_lens_ptr, o_ptr, lse_ptr, arrivals_ptr, out_ptr,
    scale_log2, table_tokens,
    stride_qb, stride_qh, stride_qd,
    stride_kn, stride_kp, stride_kh, stride_kd,
    stride_table,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_xb, stride_xh, stride_xd,
    GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, GROUP_P2: tl.constexpr, MERGE_TILE: tl.constexpr,
    D: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Splits vary fastest in the grid, so that the programs dispatched last (which the memory serves
    # last) are all of the last few (request, KV head) pairs rather than one split of every pair.
    # Measured with wide tiles against the request varying fastest: +0.1 to +0.8 points of copy at
    # B=8 S=4096 in three calls, -0.3 to +0.5 at other S, +1.1 to +1.7 at B=40, -0.3 to -0.9 at B=1
    # and 2, where deep tiles run now (results/logs/h200_decode_splits.txt, section 8).
    split = tl.program_id(0)
    h_kv = tl.program_id(1)
    b = tl.program_id(2)
    num_splits = tl.num_programs(0)
    # Split s takes tiles s, s + num_splits, s + 2 * num_splits, ... of its request's context: no
    # split gets more than one tile over another, a short request's programs finish early, and the
    # grid need not depend on this step's longest context (a CUDA graph fixes the grid at capture).
    # A split's first tile is known before its context length: its block table entries are fetched
    # alongside the length instead of after it, and each tile's entries one tile ahead (the table
    # row, `table_tokens` long, is read only inside its bounds).
    first = split * BLOCK_N
    step = num_splits * BLOCK_N
    table = table_ptr + b * stride_table
    offs = token_offsets(table, first, table_tokens, stride_kn, stride_kp, P, BLOCK_N)
    context_len = tl.load(context_lens_ptr + b)

    rows = tl.arange(0, GROUP_ROWS)
    row_ok = rows < GROUP
    heads = h_kv * GROUP + rows
    d = tl.arange(0, D)
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_rows, mask=row_ok[:, None], other=0.0)

    m = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, D], tl.float32)
    head_k = k_ptr + h_kv * stride_kh
    head_v = v_ptr + h_kv * stride_kh
    for start in range(first, context_len, step):
        ok = start + tl.arange(0, BLOCK_N) < context_len
        k = tl.load(head_k + offs[:, None] + d[None, :] * stride_kd, mask=ok[:, None], other=0.0)
        v = tl.load(head_v + offs[:, None] + d[None, :] * stride_kd, mask=ok[:, None], other=0.0)
        offs = token_offsets(table, start + step, table_tokens, stride_kn, stride_kp, P, BLOCK_N)
        m, row_sum, acc = softmax_step(q, k, v, m, row_sum, acc, scale_log2, ok[None, :])

    # An empty split (past a short request's end) has acc = 0, row_sum = 0, m = -inf: it stores
    # output 0 and log-sum-exp -inf, which the merge weighs 0.
    row_sum = tl.where(row_sum > 0, row_sum, 1.0)
    if num_splits == 1:
        # The whole context in one program: its output is final, with no counter or scratch round
        # trip (1.5 us of a one-tile decode on the H200, results/logs/h200_decode_splits.txt).
        out = out_ptr + b * stride_xb + heads[:, None] * stride_xh + d[None, :] * stride_xd
        tl.store(out, (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        o_rows = o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
        tl.store(o_rows + d[None, :] * stride_od, acc / row_sum[:, None], mask=row_ok[:, None])
        lse_rows = lse_ptr + b * stride_lb + heads * stride_lh + split * stride_ls
        tl.store(lse_rows, m + tl.log2(row_sum), mask=row_ok)

        # Every thread's stores are issued before the arrival counts (bar.sync), and the counter's
        # acquire-release makes the last arrival see all of them.
        tl.debug_barrier()
        arrivals = arrivals_ptr + b * tl.num_programs(1) + h_kv
        if tl.atomic_add(arrivals, 1, sem="acq_rel") == num_splits - 1:
            _merge(
                o_ptr + b * stride_ob, lse_ptr + b * stride_lb, out_ptr + b * stride_xb, h_kv * GROUP, num_splits,
                stride_oh, stride_os, stride_od, stride_lh, stride_ls, stride_xh, stride_xd,
                GROUP, GROUP_P2, MERGE_TILE, D,
            )
            tl.store(arrivals, 0)  # ready for the next layer's launch


@triton.jit
def _merge(
    o_ptr, lse_ptr, out_ptr, first_head, num_splits,
    stride_oh, stride_os, stride_od, stride_lh, stride_ls, stride_xh, stride_xd,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, MERGE_TILE: tl.constexpr, D: tl.constexpr,
):
    """out[h] = the splits' outputs o [h, s, :] weighed by exp2(lse[h, s]), for one request's
    GROUP heads from first_head; MERGE_TILE splits at a time, rescaled online."""
    g = tl.arange(0, GROUP_P2)
    heads = first_head + g
    d = tl.arange(0, D)
    # finite, not -inf: a tile of empty splits (lse -inf) then weighs 0 instead of making NaN
    m = tl.full([GROUP_P2], -1e30, tl.float32)
    weights = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, D], tl.float32)
    # The next tile's loads go out before this one is folded in: two tiles' round trips to L2 overlap
    # instead of queueing. Measured with 64-token K/V tiles, where it took the kernel from 96 to 126
    # registers (5 programs per SM to 4) and was faster all the same, at one merge tile as at eight
    # (B=8 S=4096: 84.6 -> 85.5% of copy; B=1 S=32768, 64 splits: 75.6 -> 76.9%;
    # results/logs/h200_decode_splits.txt, section 6).
    lse_next, o_next = _splits_tile(
        o_ptr, lse_ptr, heads, 0, num_splits, stride_oh, stride_os, stride_od, stride_lh, stride_ls,
        GROUP, GROUP_P2, MERGE_TILE, D,
    )
    for first in range(0, num_splits, MERGE_TILE):
        lse, o = lse_next, o_next
        lse_next, o_next = _splits_tile(
            o_ptr, lse_ptr, heads, first + MERGE_TILE, num_splits, stride_oh, stride_os, stride_od, stride_lh,
            stride_ls, GROUP, GROUP_P2, MERGE_TILE, D,
        )
        m_new = tl.maximum(m, tl.max(lse, 1))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new[:, None])  # [GROUP_P2, MERGE_TILE]
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
        weights = weights * alpha + tl.sum(w, 1)
        m = m_new
    weights = tl.where(g < GROUP, weights, 1.0)  # the padding rows' 0: no 0 / 0 computed
    out = out_ptr + heads[:, None] * stride_xh + d[None, :] * stride_xd
    tl.store(out, (acc / weights[:, None]).to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])


@triton.jit
def _splits_tile(
    o_ptr, lse_ptr, heads, first, num_splits, stride_oh, stride_os, stride_od, stride_lh, stride_ls,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, MERGE_TILE: tl.constexpr, D: tl.constexpr,
):
    """lse [GROUP_P2, MERGE_TILE] and o [GROUP_P2, MERGE_TILE, D] of splits first .. first+MERGE_TILE-1
    (-inf and 0 past num_splits and in the padding rows)."""
    g = tl.arange(0, GROUP_P2)
    t = first + tl.arange(0, MERGE_TILE)
    d = tl.arange(0, D)
    ok = (g < GROUP)[:, None] & (t < num_splits)[None, :]
    # .cg: straight from L2, where the other programs' stores land; nothing here is read twice
    lse = tl.load(
        lse_ptr + heads[:, None] * stride_lh + t[None, :] * stride_ls, mask=ok, other=float("-inf"),
        cache_modifier=".cg",
    )
    o_part = o_ptr + heads[:, None, None] * stride_oh + t[None, :, None] * stride_os + d[None, None, :] * stride_od
    o = tl.load(o_part, mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
    return lse, o


@dataclass(frozen=True)
class Tiles:
    """How a program walks its split: block_n context tokens per tile, num_stages - 1 tiles loaded
    while the one before them is computed."""

    block_n: int
    num_stages: int


# float32: 64-token tiles one at a time (with 32-token ones Triton 3.6 spills: 255 registers and
# ~300 bytes of stack per thread). 16-bit: two tiles in flight, of 64 tokens ("deep": 3 programs
# per SM on the H200) or of 32 ("wide": 5 per SM).
FLOAT32_TILES = Tiles(64, 2)
DEEP_TILES = Tiles(64, 3)
WIDE_TILES = Tiles(32, 3)


def tile_options(dtype: torch.dtype) -> tuple[Tiles, ...]:
    """The tile configurations a cache of `dtype` may be walked with."""
    return (FLOAT32_TILES,) if dtype == torch.float32 else (DEEP_TILES, WIDE_TILES)


def tiles_for(dtype: torch.dtype, pairs: int, deep_slots: Callable[[], int]) -> Tiles:
    """The tiles for a step of `pairs` (request, KV head) pairs; `deep_slots()`: how many deep
    programs the GPU holds at once.

    Deep tiles while the pairs fill at most two thirds of a wave of them, wide ones beyond; a GPU
    that cannot hold a deep program (0 slots) always gets wide ones. A deep program holds 64 tokens
    in flight where a wide one holds 32, so a small step splits into half as many programs, whose
    merges have half as many partials to read (one L2 round trip per 8), or none left. Past two
    thirds, the wide tiles' extra programs per SM win. On the H200 (H_kv = 8, S = 4096, P = 16;
    results/logs/h200_decode_splits.txt, section 8), deep against wide in % of copy, each pair from
    one call: B=1 33.7 / 26.9 (32 splits against 64), B=2 54.6 / 48.4, B=4 72.1 / 69.9, B=24 96.2 /
    95.0, B=32 102.7 / 100.9 (one split against two); B=8 alike at P = 8 and 16 (deep -1.1 to +0.7
    over the calls that measured both, -0.2 on average), ahead at P = 64 and 256 (+0.7 to +1.8), and
    B=16 alike at P = 16. Past two thirds: B=40 98.3 / 100.7 and 96.0 / 97.0, B=48 99.0 / 101.1.
    """
    options = tile_options(dtype)
    if len(options) == 1:
        return options[0]
    deep, wide = options
    return deep if 3 * pairs <= 2 * deep_slots() else wide


@dataclass
class DecodeSplits:
    """How many splits one decode step cuts each request's context into, and the scratch they use.

    Built once per step (or once per CUDA graph) and shared by all L layers.
    """

    tiles: Tiles
    o: torch.Tensor  # [B, H_q, num_splits, D] float32: each split's normalized output (a lone split skips it)
    lse: torch.Tensor  # [B, H_q, num_splits] float32: log2-sum-exp of each split's scaled scores
    arrivals: torch.Tensor  # [B, H_kv] int32: splits finished so far; 0 between launches

    @classmethod
    def plan(
        cls, B: int, H_q: int, H_kv: int, D: int, P: int, dtype: torch.dtype, max_context_len: int,
        device: torch.device, num_splits: int | None = None,
    ) -> DecodeSplits:
        """`num_splits` defaults to `best_num_splits` for this GPU's occupancy under the step's tiles."""
        tiles = tiles_for(dtype, B * H_kv, lambda: resident_programs(device, dtype, H_q, H_kv, D, P, DEEP_TILES))
        if num_splits is None:
            slots = resident_programs(device, dtype, H_q, H_kv, D, P, tiles)
            num_splits = best_num_splits(B * H_kv, triton.cdiv(max_context_len, tiles.block_n), slots)
        o = torch.empty(B, H_q, num_splits, D, dtype=torch.float32, device=device)
        lse = torch.empty(B, H_q, num_splits, dtype=torch.float32, device=device)
        return cls(tiles, o, lse, torch.zeros(B, H_kv, dtype=torch.int32, device=device))


def best_num_splits(pairs: int, tiles: int, slots: int) -> int:
    """Splits per (request, KV head) for `pairs` of them, `tiles` tiles long, when the GPU runs
    `slots` programs at once.

    Enough programs to keep the memory busy (at least half a wave: on the H200 256 programs read at
    75% of copy, 384 to 640 at 80-81%), never more than one wave (a second costs a whole program's
    time: 768 programs ran at 69%; and a CUDA graph plans for the longest context its table holds),
    and within that the count that deals the tiles most evenly: a split with a tile more than the
    rest reads it when few programs are left, at the memory's latency rather than its bandwidth
    (64 tiles over 9 splits ran 2.5-3.5 points of copy below 8 splits, over 10 splits 1.5-4 below;
    results/logs/h200_decode_splits.txt, sections 1 and 4d). Ties go to more splits.
    On the H200 with H_kv = 8 and bf16: 4 splits at B=8 for S = 2048 ... 32768 and 32 at B=1, S=4096
    (deep tiles, 396 slots); one at B=64 (wide tiles, 660 slots).
    """
    most = max(1, min(tiles, slots // pairs))
    least = min(most, -(-slots // (2 * pairs)))
    return max(range(least, most + 1), key=lambda n: (tiles / (n * -(-tiles // n)), n))


def _constexprs(H_q: int, H_kv: int, D: int, P: int, tiles: Tiles) -> dict[str, int]:
    """The kernel's compile-time parameters for one shape (the same whatever the split count)."""
    group = H_q // H_kv
    group_p2 = triton.next_power_of_2(group)
    return dict(
        GROUP=group, GROUP_ROWS=max(MIN_GROUP_ROWS, group_p2), GROUP_P2=group_p2,
        MERGE_TILE=max(1, MERGE_ELEMENTS // (group_p2 * D)), D=D, P=P, BLOCK_N=tiles.block_n,
        num_warps=NUM_WARPS, num_stages=tiles.num_stages,
    )


@functools.cache
def compiled_kernel(device: torch.device, dtype: torch.dtype, H_q: int, H_kv: int, D: int, P: int, tiles: Tiles):
    """The kernel as compiled and loaded for one shape and tiles on a CUDA device (Triton's CompiledKernel)."""
    # Placeholders with the real strides' divisibility (all that Triton specializes on here): a
    # contiguous q [B, H_q, D], cache [N, P, H_kv, D], scratch and output.
    f32, i32 = torch.float32, torch.int32
    with torch.cuda.device(device):  # Triton compiles and loads for the current device
        kernel = _split_kernel.warmup(
            dtype, dtype, dtype, i32, i32, f32, f32, i32, dtype, 1.0, 1,
            H_q * D, D, 1, P * H_kv * D, H_kv * D, D, 1, 1, 16 * D, 16 * D, D, 1, 16, 16, 1, H_q * D, D, 1,
            grid=(1,), **_constexprs(H_q, H_kv, D, P, tiles),
        )
        kernel._init_handles()  # loads the binary: its register count is known from here
    return kernel


@functools.cache
def resident_programs(
    device: torch.device, dtype: torch.dtype, H_q: int, H_kv: int, D: int, P: int, tiles: Tiles
) -> int:
    """How many programs of the kernel the GPU holds at once: SMs x programs per SM, as the compiled
    kernel's shared memory and registers allow. 1 under Triton's interpreter (one at a time); 0 where
    one program needs more shared memory than this GPU gives a block (deep tiles take ~72 KB)."""
    if device.type != "cuda":
        return 1
    try:
        kernel = compiled_kernel(device, dtype, H_q, H_kv, D, P, tiles)
    except triton.runtime.errors.OutOfResources:
        return 0
    props = torch.cuda.get_device_properties(device)
    threads = 32 * NUM_WARPS
    regs = -(-kernel.n_regs // 8) * 8  # registers are allocated 256 per warp at a time
    per_sm = min(
        props.shared_memory_per_multiprocessor // (kernel.metadata.shared + 1024),  # CUDA keeps 1 KB per block
        props.regs_per_multiprocessor // (regs * threads),
        props.max_threads_per_multi_processor // threads,
    )
    return max(1, per_sm) * props.multi_processor_count


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, splits: DecodeSplits, out: torch.Tensor,
) -> torch.Tensor:
    """Attention of q [T_total, H_q, D] over k_cache/v_cache [N, P, H_kv, D] -> out [T_total, H_q, D].

    Computes the first B requests, B being the number `splits` was planned for: request b's
    one new token is q row b, and its tokens 0 .. context_lens[b]-1 (int32 [>= B]) sit in
    blocks block_tables[b] (int32 [>= B, max_blocks]). Rows from B on are left alone (a mixed
    step's prefills); inputs are trusted (the backend's `check` validates them).
    """
    B, H_kv = splits.arrivals.shape
    _, H_q, D = q.shape
    _, P, _, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.shape[2] == H_kv and splits.arrivals.is_contiguous()
    _split_kernel[(splits.lse.shape[2], H_kv, B)](
        q, k_cache, v_cache, block_tables, context_lens, splits.o, splits.lse, splits.arrivals, out,
        scale * LOG2E, block_tables.shape[1] * P,
        *q.stride(), *k_cache.stride(), block_tables.stride(0), *splits.o.stride(), *splits.lse.stride(),
        *out.stride(), **_constexprs(H_q, H_kv, D, P, splits.tiles),
    )
    return out
