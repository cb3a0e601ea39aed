"""Split-KV flash-decoding over the paged cache: one new query token per request.

One kernel, one program per (request b, KV head, split of the context): it reads each K/V
token of its split once for the KV head's whole group of H_q / H_kv query heads (padded to
the 16 rows tl.dot needs) and leaves that split's normalized output and log2-sum-exp (a lone
split writes its output directly). The last split of a (request, KV head) to finish merges them
all, counted by an atomic arrival counter: no second kernel, so no second launch and no round
trip between them (results/logs/h200_decode_splits.txt, section 2). Splitting the context is
what keeps all SMs busy when B * H_kv is small.

Decodes whose block tables begin with the same blocks (a request's n completions, prompts with a
cached prefix in common) can be read as a group (`prefix_groups`): a first kernel walks the shared
blocks once per group, each member's query heads in its rows, and leaves each member's partial output;
the split kernel then reads each member's own tokens only, its first split starting from that partial.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weft.attention.kernels.tiles import LOG2E, MIN_DOT, lanes, padded_head_dim, softmax_step, token_offsets
from weft.layers.fused import dependent_launch, follow

# 4, not 2: 2 warps are no faster in 16 bits (results/logs/h200_decode_splits.txt, sections 3 and 7b)
# and much slower in float32, likely from register spills: a float32 K or V tile alone is 128
# registers per thread over 64 threads (e5 in results/logs/h200_run_c_189dfda.log). 8 warps are
# slower too (section 9g).
NUM_WARPS = 4
MERGE_ELEMENTS = 2048  # float32 values of the splits' outputs the merge reads at a time


# The block table's width and the number of splits change from step to step: the strides and the
# row length they set are not specialized on (those of o stay multiples of D_PAD, a power of two
# >= 16, whatever the split count), so a serving run compiles the kernel once per shape, not again mid-run.
@triton.jit(do_not_specialize=[
    "stride_table", "stride_lb", "stride_lh", "stride_sb", "stride_ss", "stride_tb", "stride_th", "table_tokens",
    "shared_splits",
])
def _split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, context_lens_ptr, o_ptr, lse_ptr, arrivals_ptr, out_ptr, counts_ptr,
    shared_lens_ptr, shared_o_ptr, shared_lse_ptr, shared_splits,
    scale_log2, table_tokens,
    stride_qb, stride_qh, stride_qd,
    stride_kn, stride_kp, stride_kh, stride_kd,
    stride_table,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_xb, stride_xh, stride_xd,
    stride_sb, stride_sh, stride_ss, stride_sd,
    stride_tb, stride_th, stride_ts,
    GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, GROUP_P2: tl.constexpr, MERGE_TILE: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
    SHARED: tl.constexpr, COUNTED: tl.constexpr, PDL: tl.constexpr,
):
    follow(PDL)
    # Splits vary fastest in the grid, so that the programs dispatched last (which the memory serves
    # last) are all of the last few (request, KV head) pairs rather than one split of every pair: a
    # pair's merge then waits on fewer late programs (results/logs/h200_decode_splits.txt, section 8).
    h_kv = tl.program_id(1)
    if COUNTED:  # a mixed steps' CUDA graph: the step's decodes and their splits are counts[0] and counts[2], its
        num_splits = tl.maximum(tl.load(counts_ptr + 2), 1)  # grid (request and split, KV head); the programs past
        # them exit (all of them where the counts are 0: a capture's warm-up)
        b = tl.program_id(0) // num_splits
        split = tl.program_id(0) % num_splits
        if b >= tl.load(counts_ptr):
            return
        o_b = o_ptr + b * num_splits * stride_os  # the scratch's splits: the step's requests' splits, back to back
        lse_b = lse_ptr + b * num_splits * stride_ls
    else:
        split = tl.program_id(0)
        b = tl.program_id(2)
        num_splits = tl.num_programs(0)
        o_b = o_ptr + b * stride_ob
        lse_b = lse_ptr + b * stride_lb
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
    lo = 0  # the first key the query sees
    if WINDOW:  # its last WINDOW: the splits deal the tiles from the one that holds the first of them
        lo = tl.maximum(context_len - WINDOW, 0)
        first += lo // BLOCK_N * BLOCK_N
        offs = token_offsets(table, first, table_tokens, stride_kn, stride_kp, P, BLOCK_N)
    elif SHARED:  # a group's shared tokens (a multiple of BLOCK_N, 0 outside groups) are the shared kernel's
        lo = tl.load(shared_lens_ptr + b)
        first += lo
        offs = token_offsets(table, first, table_tokens, stride_kn, stride_kp, P, BLOCK_N)

    rows = tl.arange(0, GROUP_ROWS)
    row_ok = rows < GROUP
    heads = h_kv * GROUP + rows
    d = tl.arange(0, D_PAD)
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_rows, mask=lanes(row_ok, D, D_PAD), other=0.0)

    m = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, D_PAD], tl.float32)
    if SHARED:  # the first split of a group's member goes on from the shared tokens' partials
        if (split == 0) & (lo > 0):
            m, row_sum, acc = _fold_shared(
                shared_o_ptr + b * stride_sb, shared_lse_ptr + b * stride_tb, heads, row_ok,
                tl.minimum(shared_splits, lo // BLOCK_N),
                stride_sh, stride_ss, stride_sd, stride_th, stride_ts, GROUP_ROWS, D_PAD,
            )
    head_k = k_ptr + h_kv * stride_kh
    head_v = v_ptr + h_kv * stride_kh
    for start in range(first, context_len, step):
        pos = start + tl.arange(0, BLOCK_N)
        ok = (pos < context_len) & (pos >= lo)
        kv_ok = lanes(ok, D, D_PAD)
        k = tl.load(head_k + offs[:, None] + d[None, :] * stride_kd, mask=kv_ok, other=0.0)
        v = tl.load(head_v + offs[:, None] + d[None, :] * stride_kd, mask=kv_ok, other=0.0)
        offs = token_offsets(table, start + step, table_tokens, stride_kn, stride_kp, P, BLOCK_N)
        m, row_sum, acc = softmax_step(q, k, v, m, row_sum, acc, scale_log2, ok[None, :])

    # Splits from `used` on hold no tile (a short request's, where the grid was planned for the longest context): they
    # store nothing, and the merge reads only the others. Its sums are the same bits as over all splits: an empty
    # split's output would be 0 and its log-sum-exp -inf, weighed 0, and the merge's tiles of splits start at 0 either
    # way.
    used = tl.minimum(num_splits, tl.cdiv(context_len, BLOCK_N) - lo // BLOCK_N)
    row_sum = tl.where(row_sum > 0, row_sum, 1.0)
    if num_splits == 1:
        # The whole context in one program: its output is final, with no counter or scratch round
        # trip, which would be much of a short decode's time (results/logs/h200_decode_splits.txt,
        # sections 5a and 5e).
        out = out_ptr + b * stride_xb + heads[:, None] * stride_xh + d[None, :] * stride_xd
        tl.store(out, (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty), mask=lanes(row_ok, D, D_PAD))
    else:
        # The scratch holds all D_PAD lanes (the padding ones 0): its loads and stores need no lane mask.
        if split < used:
            o_rows = o_b + heads[:, None] * stride_oh + split * stride_os
            tl.store(o_rows + d[None, :] * stride_od, acc / row_sum[:, None], mask=row_ok[:, None])
            lse_rows = lse_b + heads * stride_lh + split * stride_ls
            tl.store(lse_rows, m + tl.log2(row_sum), mask=row_ok)

        # Every thread's stores are issued before the arrival counts (bar.sync), and the counter's
        # acquire-release makes the last arrival see all of them.
        tl.debug_barrier()
        arrivals = arrivals_ptr + b * tl.num_programs(1) + h_kv
        if tl.atomic_add(arrivals, 1, sem="acq_rel") == num_splits - 1:
            _merge(
                o_b, lse_b, out_ptr + b * stride_xb, h_kv * GROUP, used,
                stride_oh, stride_os, stride_od, stride_lh, stride_ls, stride_xh, stride_xd,
                GROUP, GROUP_P2, MERGE_TILE, D, D_PAD,
            )
            tl.store(arrivals, 0)  # ready for the next layer's launch


@triton.jit
def _fold_shared(
    o_ptr, lse_ptr, heads, row_ok, num_splits, stride_sh, stride_ss, stride_sd, stride_th, stride_ts,
    GROUP_ROWS: tl.constexpr, D_PAD: tl.constexpr,
):
    """The online-softmax state (m, row_sum, acc) of one member's shared tokens, from the shared kernel's
    num_splits partials that hold tiles (normalized o [D_PAD] and log2-sum-exp each, per head): o weighed by
    exp2(lse - m). One partial after another: there are at most MAX_SHARED_SPLITS."""
    d = tl.arange(0, D_PAD)
    m = tl.full([GROUP_ROWS], -1e30, tl.float32)  # finite: an empty split (lse -inf) weighs 0, not NaN
    row_sum = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, D_PAD], tl.float32)
    for s in range(num_splits):
        lse = tl.load(lse_ptr + heads * stride_th + s * stride_ts, mask=row_ok, other=float("-inf"))
        o = tl.load(o_ptr + heads[:, None] * stride_sh + s * stride_ss + d[None, :] * stride_sd, mask=row_ok[:, None],
                    other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + w[:, None] * o
        row_sum = row_sum * alpha + w
        m = m_new
    return m, row_sum, acc


# The shared kernel's rows: each member's H_q / H_kv query heads, one member after another.
SHARED_ROWS = MIN_DOT
# The most splits of a group's shared tokens. Each member's first split folds them in one after another before it
# reads its own tokens, so more would hold it up; a step with few groups reads their shared tokens more slowly than
# the split kernel alone would (it reads them once, not once per member).
MAX_SHARED_SPLITS = 4


@triton.jit(do_not_specialize=["stride_table", "stride_sb", "stride_ss", "stride_tb", "stride_th", "table_tokens"])
def _shared_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, groups_ptr, o_ptr, lse_ptr,
    scale_log2, table_tokens,
    stride_qb, stride_qh, stride_qd,
    stride_kn, stride_kp, stride_kh, stride_kd,
    stride_table,
    stride_sb, stride_sh, stride_ss, stride_sd,
    stride_tb, stride_th, stride_ts,
    GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, P: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (split, KV head, group): the group's shared tokens, read once for every member's queries
    in its rows; tiles dealt over the splits as in the split kernel. Each member's rows leave this split's
    normalized output and log2-sum-exp (a split with no tile: -inf). An empty slot (0 members, 0 tokens) reads
    nothing."""
    follow(PDL)
    split = tl.program_id(0)
    h_kv = tl.program_id(1)
    g = tl.program_id(2)
    num_splits = tl.num_programs(0)
    first_b = tl.load(groups_ptr + 3 * g)
    size = tl.load(groups_ptr + 3 * g + 1)
    length = tl.load(groups_ptr + 3 * g + 2)  # a multiple of BLOCK_N
    table = table_ptr + first_b.to(tl.int64) * stride_table  # the first member's row: the shared blocks are its

    rows = tl.arange(0, ROWS)
    member = rows // GROUP
    row_ok = member < size  # an empty slot has no members
    heads = h_kv * GROUP + rows % GROUP
    member_b = first_b + member
    d = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + member_b[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=lanes(row_ok, D, D_PAD), other=0.0)

    m = tl.full([ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    head_k = k_ptr + h_kv * stride_kh
    head_v = v_ptr + h_kv * stride_kh
    step = num_splits * BLOCK_N
    offs = token_offsets(table, split * BLOCK_N, table_tokens, stride_kn, stride_kp, P, BLOCK_N)
    for start in range(split * BLOCK_N, length, step):
        ok = start + tl.arange(0, BLOCK_N) < length  # all: tiles are whole
        kv_ok = lanes(ok, D, D_PAD)
        k = tl.load(head_k + offs[:, None] + d[None, :] * stride_kd, mask=kv_ok, other=0.0)
        v = tl.load(head_v + offs[:, None] + d[None, :] * stride_kd, mask=kv_ok, other=0.0)
        offs = token_offsets(table, start + step, length, stride_kn, stride_kp, P, BLOCK_N)
        m, row_sum, acc = softmax_step(q, k, v, m, row_sum, acc, scale_log2, ok[None, :])

    lse = tl.where(row_sum > 0, m + tl.log2(row_sum), float("-inf"))
    row_sum = tl.where(row_sum > 0, row_sum, 1.0)
    o_rows = o_ptr + member_b * stride_sb + heads * stride_sh + split * stride_ss
    tl.store(o_rows[:, None] + d[None, :] * stride_sd, acc / row_sum[:, None], mask=row_ok[:, None])
    tl.store(lse_ptr + member_b * stride_tb + heads * stride_th + split * stride_ts, lse, mask=row_ok)


@triton.jit
def _merge(
    o_ptr, lse_ptr, out_ptr, first_head, num_splits,
    stride_oh, stride_os, stride_od, stride_lh, stride_ls, stride_xh, stride_xd,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, MERGE_TILE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
):
    """out[h] = the splits' outputs o [h, s, :] weighed by exp2(lse[h, s]), s < num_splits (those that hold
    tiles), for one request's GROUP heads from first_head; MERGE_TILE splits at a time, rescaled online."""
    g = tl.arange(0, GROUP_P2)
    heads = first_head + g
    d = tl.arange(0, D_PAD)
    # finite, not -inf: a tile of empty splits (lse -inf) then weighs 0 instead of making NaN
    m = tl.full([GROUP_P2], -1e30, tl.float32)
    weights = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, D_PAD], tl.float32)
    # The next tile's loads go out before this one is folded in: two tiles' round trips to L2 overlap
    # instead of queueing. That is worth the registers it takes, even where they cost a program per SM
    # (results/logs/h200_decode_splits.txt, section 6d).
    lse_next, o_next = _splits_tile(
        o_ptr, lse_ptr, heads, 0, num_splits, stride_oh, stride_os, stride_od, stride_lh, stride_ls,
        GROUP, GROUP_P2, MERGE_TILE, D_PAD,
    )
    for first in range(0, num_splits, MERGE_TILE):
        lse, o = lse_next, o_next
        lse_next, o_next = _splits_tile(
            o_ptr, lse_ptr, heads, first + MERGE_TILE, num_splits, stride_oh, stride_os, stride_od, stride_lh,
            stride_ls, GROUP, GROUP_P2, MERGE_TILE, D_PAD,
        )
        m_new = tl.maximum(m, tl.max(lse, 1))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new[:, None])  # [GROUP_P2, MERGE_TILE]
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
        weights = weights * alpha + tl.sum(w, 1)
        m = m_new
    weights = tl.where(g < GROUP, weights, 1.0)  # the padding rows' 0: no 0 / 0 computed
    out = out_ptr + heads[:, None] * stride_xh + d[None, :] * stride_xd
    tl.store(out, (acc / weights[:, None]).to(out_ptr.dtype.element_ty), mask=lanes(g < GROUP, D, D_PAD))


@triton.jit
def _splits_tile(
    o_ptr, lse_ptr, heads, first, num_splits, stride_oh, stride_os, stride_od, stride_lh, stride_ls,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, MERGE_TILE: tl.constexpr, D_PAD: tl.constexpr,
):
    """lse [GROUP_P2, MERGE_TILE] and o [GROUP_P2, MERGE_TILE, D_PAD] of splits first .. first+MERGE_TILE-1
    (-inf and 0 past num_splits and in the padding rows)."""
    g = tl.arange(0, GROUP_P2)
    t = first + tl.arange(0, MERGE_TILE)
    d = tl.arange(0, D_PAD)
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


# 64-token tiles, loaded one ("shallow") or two ("deep": fewer programs per SM, each with more bytes in
# flight) ahead of the one being computed. float32 walks shallow ones only: they already take 78 KB of shared
# memory at D = 128, two programs per SM on the H200 (results/logs/kernel_notes.md); deep ones were not
# measured, and 32-token ones spill registers (results/logs/h200_decode_splits.txt, section 7b).
TILE_TOKENS = 64
SHALLOW_TILES = Tiles(TILE_TOKENS, 2)
DEEP_TILES = Tiles(TILE_TOKENS, 3)


def tile_options(dtype: torch.dtype) -> tuple[Tiles, ...]:
    """The tile configurations a cache of `dtype` may be walked with."""
    return (SHALLOW_TILES,) if dtype == torch.float32 else (DEEP_TILES, SHALLOW_TILES)


def _step_tiles(B: int, H_q: int, H_kv: int, D: int, P: int, dtype: torch.dtype, device: torch.device) -> Tiles:
    """`tiles_for` a step of B decodes on `device`."""
    return tiles_for(dtype, B * H_kv, lambda: resident_programs(device, dtype, H_q, H_kv, D, P, DEEP_TILES))


def tiles_for(dtype: torch.dtype, pairs: int, deep_slots: Callable[[], int]) -> Tiles:
    """The tiles for a step of `pairs` (request, KV head) pairs; `deep_slots()`: how many deep
    programs the GPU holds at once.

    Deep tiles while the pairs fill at most two thirds of a wave of them, shallow ones beyond; a GPU
    that cannot hold a deep program (0 slots) always gets shallow ones. A deep program has twice the
    bytes in flight, so a small step splits into fewer programs, whose merges have fewer partials to
    read, or none left. Past two thirds, the shallow tiles' extra program per SM wins (4 against 3 on
    the H200 in 16 bits at D = 128), and keeps up with more work per program than 32-token tiles
    did (results/logs/h200_decode_tiles_8b48ee4.txt; results/logs/kernel_notes.md, "Deep or shallow tiles").
    """
    options = tile_options(dtype)
    if len(options) == 1:
        return options[0]
    deep, shallow = options
    return deep if 3 * pairs <= 2 * deep_slots() else shallow


@dataclass
class DecodeSplits:
    """How many splits one decode step cuts each request's context into, and the scratch they use.

    Built once per step (or once per CUDA graph) and shared by all L layers.
    """

    tiles: Tiles
    # [B, H_q, num_splits, D_PAD] float32: each split's normalized output (a lone split skips it); `plan_counted`'s
    # [1, H_q, W, D_PAD], each decode's splits back to back (num_splits is then W)
    o: torch.Tensor
    lse: torch.Tensor  # [B, H_q, num_splits] float32: log2-sum-exp of each split's scaled scores (or [1, H_q, W])
    arrivals: torch.Tensor  # [B, H_kv] int32: splits finished so far; 0 between launches

    @classmethod
    def plan(
        cls, B: int, H_q: int, H_kv: int, D: int, P: int, dtype: torch.dtype, max_context_len: int,
        device: torch.device, num_splits: int | None = None,
    ) -> DecodeSplits:
        """`num_splits` defaults to `best_num_splits` for this GPU's occupancy under the step's tiles."""
        tiles = _step_tiles(B, H_q, H_kv, D, P, dtype, device)
        if num_splits is None:
            slots = resident_programs(device, dtype, H_q, H_kv, D, P, tiles)
            num_splits = best_num_splits(B * H_kv, triton.cdiv(max_context_len, tiles.block_n), slots)
        o = torch.empty(B, H_q, num_splits, padded_head_dim(D), dtype=torch.float32, device=device)
        lse = torch.empty(B, H_q, num_splits, dtype=torch.float32, device=device)
        return cls(tiles, o, lse, torch.zeros(B, H_kv, dtype=torch.int32, device=device))

    @classmethod
    def plan_counted(cls, B: int, H_q: int, H_kv: int, D: int, P: int, dtype: torch.dtype, device: torch.device
                     ) -> DecodeSplits:
        """For a mixed steps' CUDA graph of up to B decodes, which reads each step's decodes and split count from the
        device (`step_splits`): a program per split of the step's decodes, W = max(B, a wave over the KV heads) of
        them, each decode's splits back to back in the scratch's W (o [1, H_q, W, D_PAD], lse [1, H_q, W])."""
        tiles = _step_tiles(B, H_q, H_kv, D, P, dtype, device)
        W = max(B, resident_programs(device, dtype, H_q, H_kv, D, P, tiles) // H_kv)
        o = torch.empty(1, H_q, W, padded_head_dim(D), dtype=torch.float32, device=device)
        lse = torch.empty(1, H_q, W, dtype=torch.float32, device=device)
        return cls(tiles, o, lse, torch.zeros(B, H_kv, dtype=torch.int32, device=device))

    @property
    def num_splits(self) -> int:
        return self.lse.shape[2]

    def step_splits(self, B: int, H_q: int, H_kv: int, D: int, P: int, dtype: torch.dtype, max_context_len: int
                    ) -> int:
        """The splits each of a step's B decodes, its longest context max_context_len, takes in `plan_counted`'s:
        `best_num_splits` under their tiles. One each, or at most a wave of programs in all: within their W."""
        slots = resident_programs(self.o.device, dtype, H_q, H_kv, D, P, self.tiles)
        return best_num_splits(B * H_kv, triton.cdiv(max_context_len, self.tiles.block_n), slots)


@dataclass
class SharedPrefixes:
    """A decode step's groups of decodes whose block tables begin with the same blocks (`prefix_groups`), and the
    scratch of the shared kernel, which reads each group's shared tokens once. Built with the step's `DecodeSplits`."""

    groups: torch.Tensor  # [G, 3] int32: each group's first decode, its members (the decodes after it), its shared
    # tokens (a multiple of TILE_TOKENS below each member's context; 0: an empty slot, read by no program)
    lens: torch.Tensor  # [>= B] int32: each decode's shared tokens, 0 outside groups
    o: torch.Tensor  # [B, H_q, num_splits, D_PAD] float32: each split's normalized output, per member
    lse: torch.Tensor  # [B, H_q, num_splits] float32: its log2-sum-exp (-inf for a split with no tile)

    @classmethod
    def plan(
        cls, groups: torch.Tensor, lens: torch.Tensor, B: int, H_q: int, H_kv: int, D: int, P: int,
        dtype: torch.dtype, max_shared_len: int, tiles: Tiles, num_splits: int | None = None,
    ) -> SharedPrefixes:
        """`num_splits` of the shared tokens defaults to what `DecodeSplits.plan` picks for a step of G * H_kv pairs
        whose longest shared part is max_shared_len, at most MAX_SHARED_SPLITS."""
        device = groups.device
        if num_splits is None:
            slots = resident_programs(device, dtype, H_q, H_kv, D, P, tiles)
            tiles_long = triton.cdiv(max_shared_len, tiles.block_n)
            num_splits = min(MAX_SHARED_SPLITS, best_num_splits(groups.shape[0] * H_kv, tiles_long, slots))
        o = torch.empty(B, H_q, num_splits, padded_head_dim(D), dtype=torch.float32, device=device)
        return cls(groups, lens, o, torch.empty(B, H_q, num_splits, dtype=torch.float32, device=device))

    @property
    def num_splits(self) -> int:
        return self.lse.shape[2]


def fills_half_a_wave(num_groups: int, H_kv: int, slots: int) -> bool:
    """Whether a step's `num_groups` groups are worth the shared kernel on a GPU of `slots` programs (the split
    kernel's, shallow tiles): its programs, at most MAX_SHARED_SPLITS per (group, KV head), fill at least half a
    wave, as `best_num_splits` asks of the split kernel's. Fewer would leave the memory idle while they walk the
    shared tokens, which the split kernel alone reads in parallel (once per member, the repeats mostly from the L2
    where the members sit side by side)."""
    return 2 * num_groups * H_kv * MAX_SHARED_SPLITS >= slots


def max_group_members(H_q: int, H_kv: int) -> int:
    """The most decodes one group holds: as many as the shared kernel's rows hold their query heads."""
    return SHARED_ROWS // (H_q // H_kv)


def prefix_groups(tables: list[list[int]], context_lens: list[int], P: int, max_members: int) -> list[int]:
    """Groups of consecutive decodes (block tables `tables`, contexts `context_lens` with their new tokens) whose
    tables begin with the same blocks -> [first, members, shared tokens] of each group, flat.

    The second member sets a group's shared tokens: the blocks it has in common with the first, wholly before both
    their new tokens, in whole tiles (TILE_TOKENS); a later decode joins only if it has those too. A group holds at
    least one tile and 2 .. max_members decodes; a decode sharing less goes on alone or starts the next group."""
    groups: list[int] = []
    b, B = 0, len(tables)
    while b + 1 < B and max_members > 1:
        lead, end, shared = tables[b], b + 1, 0
        while end < B and end - b < max_members and tables[end][0] == lead[0]:
            other = tables[end]
            if not shared:
                blocks = _common_blocks(lead, other, (min(context_lens[b], context_lens[end]) - 1) // P)
                shared = blocks * P // TILE_TOKENS * TILE_TOKENS
                if not shared:
                    break
            elif context_lens[end] <= shared or other[: -(-shared // P)] != lead[: -(-shared // P)]:
                break
            end += 1
        if end - b > 1 and shared:
            groups += [b, end - b, shared]
            b = end
        else:
            b += 1
    return groups


def _common_blocks(a: list[int], b: list[int], most: int) -> int:
    """How many leading blocks of `a` and `b`, at most `most`, are the same.

    Two tables hold one block at one position only where both took it, and all before it, from the prefix cache:
    a binary search of single positions finds where they part, and one comparison of the slices before confirms it
    (else a binary search of slices)."""
    lo, hi = 0, most + 1  # a[lo - 1] == b[lo - 1] (or lo = 0), a[hi - 1] != b[hi - 1] (or hi = most + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid
    if a[:lo] == b[:lo]:
        return lo
    lo, hi = 0, lo  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def best_num_splits(pairs: int, tiles: int, slots: int) -> int:
    """Splits per (request, KV head) for `pairs` of them, `tiles` tiles long, when the GPU runs
    `slots` programs at once.

    Enough programs to keep the memory busy (at least half a wave: fewer leave bandwidth unused),
    never more than one wave (a second costs a whole program's time; and a CUDA graph plans for the
    longest context its table holds), and within that the count that deals the tiles most evenly: a
    split with a tile more than the rest reads it when few programs are left, at the memory's latency
    rather than its bandwidth (results/logs/h200_decode_splits.txt, sections 1 and 4d;
    results/logs/kernel_notes.md, "Split counts"). Ties go to more splits. test_best_num_splits
    lists what it picks at the H200's occupancies.
    """
    most = max(1, min(tiles, slots // pairs))
    least = min(most, -(-slots // (2 * pairs)))
    return max(range(least, most + 1), key=lambda n: (tiles / (n * -(-tiles // n)), n))


@functools.cache  # every layer of every step asks (never mutated: its callers unpack it)
def _constexprs(H_q: int, H_kv: int, D: int, P: int, tiles: Tiles, window: int = 0, shared: bool = False,
                counted: bool = False) -> dict[str, int]:
    """The kernel's compile-time parameters for one shape (the same whatever the split count); `window`: the
    sliding window's keys (0: none); `shared`: its decodes' groups' shared tokens are the shared kernel's;
    `counted`: the step's decodes are counted on the device."""
    group = H_q // H_kv
    group_p2 = triton.next_power_of_2(group)
    D_PAD = padded_head_dim(D)
    return dict(
        GROUP=group, GROUP_ROWS=max(MIN_DOT, group_p2), GROUP_P2=group_p2,
        MERGE_TILE=max(1, MERGE_ELEMENTS // (group_p2 * D_PAD)), D=D, D_PAD=D_PAD, P=P, BLOCK_N=tiles.block_n,
        WINDOW=window, SHARED=shared, COUNTED=counted, num_warps=NUM_WARPS, num_stages=tiles.num_stages,
    )


@functools.cache
def compiled_kernel(device: torch.device, dtype: torch.dtype, H_q: int, H_kv: int, D: int, P: int, tiles: Tiles):
    """The kernel as compiled and loaded for one shape and tiles on a CUDA device (Triton's CompiledKernel)."""
    # Placeholders with the real strides' divisibility (all that Triton specializes on here): a
    # contiguous q [B, H_q, D], cache [N, P, H_kv, D], scratch and output.
    f32, i32, D_PAD = torch.float32, torch.int32, padded_head_dim(D)
    with torch.cuda.device(device):  # Triton compiles and loads for the current device
        kernel = _split_kernel.warmup(
            dtype, dtype, dtype, i32, i32, f32, f32, i32, dtype, i32, i32, f32, f32, 0, 1.0, 1,
            H_q * D, D, 1, P * H_kv * D, H_kv * D, D, 1, 1, 16 * D_PAD, 16 * D_PAD, D_PAD, 1, 16, 16, 1, H_q * D, D, 1,
            16 * D_PAD, 16 * D_PAD, D_PAD, 1, 16, 16, 1,
            grid=(1,), **_constexprs(H_q, H_kv, D, P, tiles), **dependent_launch(device),
        )
        kernel._init_handles()  # loads the binary: its register count is known from here
    return kernel


@functools.cache
def resident_programs(
    device: torch.device, dtype: torch.dtype, H_q: int, H_kv: int, D: int, P: int, tiles: Tiles
) -> int:
    """How many programs of the kernel the GPU holds at once: SMs x programs per SM, as the compiled
    kernel's shared memory and registers allow. 1 under Triton's interpreter (one at a time); 0 where
    one program needs more shared memory than this GPU gives a block (deep tiles take the most)."""
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
    context_lens: torch.Tensor, scale: float, splits: DecodeSplits, out: torch.Tensor, window: int | None = None,
    shared: SharedPrefixes | None = None, counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [T_total, H_q, D] over k_cache/v_cache [N, P, H_kv, D] -> out [T_total, H_q, D].

    Computes the first B requests, B being the number `splits` was planned for (with `counts`, int32 [3] on the
    device, and `splits` from `DecodeSplits.plan_counted`: the first counts[0] of them, in counts[2] splits each):
    request b's one new token is q row b, and its tokens 0 ..
    context_lens[b]-1 (int32 [>= B]) sit in blocks block_tables[b] (int32 [>= B, max_blocks]). Rows from B on are
    left alone (a mixed step's prefills); `window`: the query sees only the last `window` of them (a sliding
    window). Inputs are trusted (the backend's `check` validates them).
    """
    B, H_kv = splits.arrivals.shape
    _, H_q, D = q.shape
    _, P, _, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.shape[2] == H_kv and splits.arrivals.is_contiguous()
    table_tokens, pdl = block_tables.shape[1] * P, dependent_launch(q.device)
    if window:
        shared = None
    if shared is not None:
        D_PAD, tiles = padded_head_dim(D), splits.tiles
        _shared_kernel[(shared.num_splits, H_kv, shared.groups.shape[0])](
            q, k_cache, v_cache, block_tables, shared.groups, shared.o, shared.lse, scale * LOG2E, table_tokens,
            *q.stride(), *k_cache.stride(), block_tables.stride(0), *shared.o.stride(), *shared.lse.stride(),
            GROUP=H_q // H_kv, ROWS=SHARED_ROWS, D=D, D_PAD=D_PAD, P=P, BLOCK_N=tiles.block_n, num_warps=NUM_WARPS,
            num_stages=tiles.num_stages, **pdl,
        )
    # without groups the shared arguments are the splits' own scratch, never read
    lens, o, lse = (shared.lens, shared.o, shared.lse) if shared is not None else (context_lens, splits.o, splits.lse)
    S = splits.num_splits
    _split_kernel[(S, H_kv, B) if counts is None else (S, H_kv)](
        q, k_cache, v_cache, block_tables, context_lens, splits.o, splits.lse, splits.arrivals, out,
        counts if counts is not None else context_lens, lens, o, lse, lse.shape[2] if shared is not None else 0,
        scale * LOG2E, table_tokens,
        *q.stride(), *k_cache.stride(), block_tables.stride(0), *splits.o.stride(), *splits.lse.stride(),
        *out.stride(), *o.stride(), *lse.stride(),
        **_constexprs(H_q, H_kv, D, P, splits.tiles, window or 0, shared is not None, counts is not None), **pdl,
    )
    return out
