"""Causal flash attention of ragged new tokens over the paged cache (prefill and extend).

One program per (tile of BLOCK_M // GROUP new tokens of request b, KV head: its GROUP query heads), for requests
first_request .. B-1 (a mixed step's decodes come first and go to the decode kernel).
Request b's T_b new tokens are the last ones of its context, so its query row i sits at
position context_lens[b] - T_b + i and sees cache positions 0 .. that position (within a
sliding window of W keys: the W up to it). Tiles of keys that every row of the query tile
sees skip the causal mask; only the few on the diagonal pay it (with a window, every tile
pays it, and tiles before the tile's first row's window are not read).

`grouped_attention` runs the same tiles' sums for every request of a step, decodes too, with a
KV head's group of query heads in a program's rows: the batch-invariant path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weft.attention.kernels.decode import NUM_WARPS as DECODE_WARPS
from weft.attention.kernels.decode import SHALLOW_TILES
from weft.attention.kernels.tiles import LOG2E, MIN_DOT, lanes, padded_head_dim, softmax_step, token_offsets

BLOCK_M = 128  # query rows per program: BLOCK_M // GROUP new tokens x GROUP query heads
NUM_WARPS = 8
# A grid of BLOCK_M-row programs that would fill at most half the SMs (a lone prompt of a few hundred tokens) runs
# programs of half the rows in half the warps instead, twice as many (results/logs/h100_prefill_launch_bd50157.log)
SMALL_BLOCK_M, SMALL_NUM_WARPS = BLOCK_M // 2, NUM_WARPS // 2
# One K (or V) tile: 128 tokens of D = 128 in bf16, the sweep's fastest (results/logs/h200_kernel_sweep.txt).
KV_TILE_BYTES = 128 * 128 * 2
# 16-bit tiles pipeline DEEP_STAGES deep where the query tile and that many K and V tiles fit a block's shared
# memory, else NUM_STAGES (float32 stays at NUM_STAGES: not measured deeper)
NUM_STAGES, DEEP_STAGES = 2, 3
SHARED_SLACK = 1024  # shared memory Triton's launch takes beyond the tiles (a few hundred bytes measured)
SEARCH = 256  # requests whose first tiles a grouped program compares at once
PROMPT_ROWS = 64  # a grouped program's rows for 16-bit prompt tokens (grouped_rows)


# Values that change from step to step are not specialized on: no recompiling mid-run.
@triton.jit(do_not_specialize=["first_request", "num_m_tiles", "stride_table"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, query_start_loc_ptr, context_lens_ptr, counts_ptr,
    scale_log2, first_request, num_m_tiles,
    stride_qt, stride_qh, stride_qd,
    stride_kn, stride_kp, stride_kh, stride_kd,
    stride_table,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, COUNTED: tl.constexpr,
):
    # A program's rows are a KV head's GROUP query heads of BLOCK_M // GROUP tokens (_attend_tile), so each K/V
    # tile is loaded once for the group, not once per query head.
    TILE_TOKENS: tl.constexpr = BLOCK_M // GROUP
    # Longest-running tiles (the last rows of a request) first, so short ones fill the tail.
    m_tile = num_m_tiles - 1 - tl.program_id(0)
    b = first_request + tl.program_id(1)
    if COUNTED:  # planned for more requests than the step has (a mixed steps' CUDA graph): its decodes, then its
        b = tl.load(counts_ptr) + tl.program_id(1)  # requests, are counts[0] and counts[1]
        if b >= tl.load(counts_ptr + 1):
            return
    h_kv = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    first_token = m_tile * TILE_TOKENS
    if first_token < q_len:
        _attend_tile(
            q_ptr, k_ptr, v_ptr, out_ptr, table_ptr + b * stride_table, tl.load(context_lens_ptr + b), scale_log2,
            q_start, q_len, first_token, h_kv, stride_qt, stride_qh, stride_qd, stride_kn, stride_kp, stride_kh,
            stride_kd, stride_ot, stride_oh, stride_od, GROUP, D, D_PAD, P, BLOCK_M, BLOCK_N, WINDOW,
        )


# The batch's size and the block table's width change from step to step: not specialized on.
@triton.jit(do_not_specialize=["num_requests", "stride_table"])
def _grouped_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, starts_ptr, rows_ptr, ends_ptr,
    scale_log2, num_requests,
    stride_qt, stride_qh, stride_qd,
    stride_kn, stride_kp, stride_kh, stride_kd,
    stride_table,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, SEARCH: tl.constexpr, H_KV: tl.constexpr,
):
    # Request b's tokens of the launch (GroupedRows) are starts[b] .. starts[b+1]-1 of its own count, none
    # or more; its tiles are first_tile(b) = (starts[b] + b * (TILE_TOKENS - 1)) // TILE_TOKENS on (every
    # term >= 0: Triton's integer division truncates on the GPU and floors in the interpreter): they never
    # fall with b, leave each request the tiles it needs (a decode its one), and end below
    # (tokens + B * (TILE_TOKENS - 1)) // TILE_TOKENS, so the grid is fixed by the step's shape (a CUDA
    # graph's) and no program is launched per (request, tile) pair that has no tokens. A tile's KV heads
    # are neighbouring programs: they read neighbouring bytes of each cached token.
    TILE_TOKENS: tl.constexpr = BLOCK_M // GROUP
    tile = tl.program_id(0) // H_KV
    h_kv = tl.program_id(0) % H_KV
    # Tile b is request b's first where every request before it brings one token (decodes first),
    # and tiles past the last request's first are its: checked with a load its tokens need anyway.
    # Else the request is the last whose first tile is not past the tile, counted SEARCH at a time.
    b = tl.minimum(tile, num_requests - 1)
    start = tl.load(starts_ptr + b)
    end = tl.load(starts_ptr + b + 1)
    if (start != b) | (end == start):
        b = tile * 0 - 1
        for first in range(0, num_requests, SEARCH):
            i = first + tl.arange(0, SEARCH)
            starts = (tl.load(starts_ptr + i, mask=i < num_requests, other=0) + i * (TILE_TOKENS - 1)) // TILE_TOKENS
            b += tl.sum(((starts <= tile) & (i < num_requests)).to(tl.int32), 0)
        start = tl.load(starts_ptr + b)
        end = tl.load(starts_ptr + b + 1)
    q_len = end - start
    first_token = (tile - (start + b * (TILE_TOKENS - 1)) // TILE_TOKENS) * TILE_TOKENS
    if first_token < q_len:
        _attend_tile(
            q_ptr, k_ptr, v_ptr, out_ptr, table_ptr + b * stride_table, tl.load(ends_ptr + b), scale_log2,
            tl.load(rows_ptr + b), q_len, first_token, h_kv, stride_qt, stride_qh, stride_qd, stride_kn, stride_kp,
            stride_kh, stride_kd, stride_ot, stride_oh, stride_od, GROUP, D, D_PAD, P, BLOCK_M, BLOCK_N, WINDOW,
        )


@triton.jit
def _attend_tile(
    q_ptr, k_ptr, v_ptr, out_ptr, table, context_len, scale_log2,
    q_start, q_len, first_token, h_kv,
    stride_qt, stride_qh, stride_qd, stride_kn, stride_kp, stride_kh, stride_kd, stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
):
    """One program's BLOCK_M query rows: row r is new token first_token + r // GROUP (of the TILE_TOKENS = BLOCK_M //
    GROUP from first_token) in query head r % GROUP of KV head h_kv's group; stored where that token is the request's.

    A row's sums fold its keys in tiles of BLOCK_N from position 0 (or from its window's first
    tile), in order, never touching another row's: a token's bits do not depend on the tile's other
    rows, nor on whether its tile's keys count as whole or diagonal (a mask of what the row sees;
    tiles past the row add exact zeros).
    """
    TILE_TOKENS: tl.constexpr = BLOCK_M // GROUP
    r = tl.arange(0, BLOCK_M)
    rows = first_token + r // GROUP
    row_ok = (r < TILE_TOKENS * GROUP) & (rows < q_len)
    heads = h_kv * GROUP + r % GROUP
    q_pos = context_len - q_len + rows  # [BLOCK_M] position of each query row
    d = tl.arange(0, D_PAD)
    q_rows = (q_start + rows)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + q_rows, mask=lanes(row_ok, D, D_PAD), other=0.0)

    # finite, not -inf: with a window, a row may see no key of a tile before it sees one, and exp2(m - m_new)
    # must be 0 there, not NaN
    m = tl.full([q.shape[0]], -1e30, tl.float32)
    row_sum = tl.zeros([q.shape[0]], tl.float32)
    acc = tl.zeros([q.shape[0], D_PAD], tl.float32)
    head_k = k_ptr + h_kv * stride_kh
    head_v = v_ptr + h_kv * stride_kh
    first = context_len - q_len + first_token  # position of the tile's first token
    kv_end = tl.minimum(first + TILE_TOKENS, context_len)  # keys from this on: seen by no row
    if WINDOW:  # keys before the first row's window: seen by no row; every tile masked
        full_start = tl.maximum(first - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        full_end = full_start
    else:
        full_start = 0
        full_end = (first + 1) // BLOCK_N * BLOCK_N  # keys before this: seen by every row
    # Each tile's block-table entries are fetched a tile ahead, so its K/V loads need not wait on them.
    offs = token_offsets(table, full_start, full_end, stride_kn, stride_kp, P, BLOCK_N)
    for start in range(full_start, full_end, BLOCK_N):
        if D_PAD == D:
            k = tl.load(head_k + offs[:, None] + d[None, :] * stride_kd)
            v = tl.load(head_v + offs[:, None] + d[None, :] * stride_kd)
        else:
            d_ok = (d < D)[None, :]
            k = tl.load(head_k + offs[:, None] + d[None, :] * stride_kd, mask=d_ok, other=0.0)
            v = tl.load(head_v + offs[:, None] + d[None, :] * stride_kd, mask=d_ok, other=0.0)
        offs = token_offsets(table, start + BLOCK_N, full_end, stride_kn, stride_kp, P, BLOCK_N)
        m, row_sum, acc = softmax_step(q, k, v, m, row_sum, acc, scale_log2, True)
    for start in range(full_end, kv_end, BLOCK_N):
        offs = token_offsets(table, start, kv_end, stride_kn, stride_kp, P, BLOCK_N)
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < kv_end
        if WINDOW:  # keys no row of the tile sees are not read (they may be another request's by now)
            ok = ok & (pos > first - WINDOW)
        kv_ok = lanes(ok, D, D_PAD)
        k = tl.load(head_k + offs[:, None] + d[None, :] * stride_kd, mask=kv_ok, other=0.0)
        v = tl.load(head_v + offs[:, None] + d[None, :] * stride_kd, mask=kv_ok, other=0.0)
        visible = ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        m, row_sum, acc = softmax_step(q, k, v, m, row_sum, acc, scale_log2, visible)

    # Every row sees its own position, so row_sum > 0 on the rows stored.
    o = acc / row_sum[:, None]
    out_rows = (q_start + rows)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(out_ptr + out_rows, o.to(out_ptr.dtype.element_ty), mask=lanes(row_ok, D, D_PAD))


def kv_tile_tokens(D_PAD: int, element_size: int) -> int:
    """Cached tokens per K/V tile for heads held in D_PAD lanes of `element_size` bytes.

    128 where such a tile fits KV_TILE_BYTES; wider rows get fewer, or the pipelined K/V tiles
    outgrow shared memory (128 tokens of float32 at D = 128 would need 256 KiB). The padded width
    counts: the padding lanes take registers and shared memory too.
    """
    return max(16, min(128, KV_TILE_BYTES // (D_PAD * element_size)))


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
    first_request: int = 0,
    window: int | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q [T_total, H_q, D] over k_cache/v_cache [N, P, H_kv, D] -> out [T_total, H_q, D].

    Request b's new tokens are q rows query_start_loc[b] .. query_start_loc[b+1]-1 (int32
    [B+1]); its context_lens[b] (int32 [B]) tokens, these included, sit in blocks
    block_tables[b] (int32 [B, max_blocks]). Only requests first_request .. B-1 are computed
    (their rows of out); with `counts` (int32 [>= 2] on the device: the step's decodes and requests, where the
    host ints are a CUDA graph's bounds) requests counts[0] .. counts[1]-1, at most B - first_request of them;
    `window`: each query sees only the `window` keys up to itself (a sliding window). Inputs are trusted (the
    backend validates them).
    """
    _, H_q, D = q.shape
    _, P, H_kv, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride()
    group = H_q // H_kv
    requests = context_lens.shape[0] - first_request
    D_PAD = padded_head_dim(D)
    block_n = kv_tile_tokens(D_PAD, q.element_size())
    sms, shared = gpu_limits(q.device)
    launch = prefill_launch(triton.cdiv(max_query_len, BLOCK_M // group) * requests * H_kv, group, sms)
    stages = pipeline_stages(launch.block_m, block_n, D_PAD, q.element_size(), shared)
    num_m_tiles = triton.cdiv(max_query_len, launch.block_m // group)
    _prefill_kernel[(num_m_tiles, requests, H_kv)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, context_lens,
        counts if counts is not None else context_lens, scale * LOG2E, first_request, num_m_tiles,
        *q.stride(), *k_cache.stride(), block_tables.stride(0), *out.stride(),
        GROUP=group, D=D, D_PAD=D_PAD, P=P, BLOCK_M=launch.block_m, BLOCK_N=block_n, WINDOW=window or 0,
        COUNTED=counts is not None, num_warps=launch.num_warps, num_stages=stages,
    )
    return out


@dataclass(frozen=True)
class PrefillLaunch:
    block_m: int  # query rows per program
    num_warps: int


def prefill_launch(programs: int, group: int, sms: int) -> PrefillLaunch:
    """The launch for a step whose grid of BLOCK_M-row programs has `programs` (KV heads of `group` query heads) on
    a GPU of `sms` SMs: SMALL_BLOCK_M rows where those would fill at most half the SMs and a program still holds a
    token's whole group; else BLOCK_M. A row's sums do not depend on its tile's rows (`_attend_tile`)."""
    if 2 * programs <= sms and group <= SMALL_BLOCK_M:
        return PrefillLaunch(SMALL_BLOCK_M, SMALL_NUM_WARPS)
    return PrefillLaunch(BLOCK_M, NUM_WARPS)


def pipeline_stages(block_m: int, block_n: int, D_PAD: int, element_size: int, shared: int) -> int:
    """How deep the K/V tiles pipeline: DEEP_STAGES for 16-bit tiles where the query tile [block_m, D_PAD] and that
    many K and V tiles [block_n, D_PAD] fit `shared` bytes, else NUM_STAGES."""
    tiles = (block_m + 2 * DEEP_STAGES * block_n) * D_PAD * element_size
    return DEEP_STAGES if element_size == 2 and tiles + SHARED_SLACK <= shared else NUM_STAGES


@functools.cache
def _cuda_limits(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.shared_memory_per_block_optin


def gpu_limits(device: torch.device) -> tuple[int, int]:
    """(SMs, shared memory bytes a block may have) of `device`; on the CPU, under Triton's interpreter, (0, 0): no
    program runs beside another, and no pipeline stage is allocated."""
    if device.type != "cuda":
        return 0, 0
    return _cuda_limits(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class GroupedRows:
    """The tokens of a step that one launch of `grouped_attention` computes: request b's starts[b+1] - starts[b] of
    them (none or more) are its last new tokens of one role, rows rows[b] on of q and out, the last at position
    ends[b] - 1. Prompt tokens and generated ones (AttentionMetadata.prompt_tokens) run programs of their own rows
    (`grouped_rows`), each role always the same."""

    starts: torch.Tensor  # [B+1] int32: prefix sums of each request's tokens in the launch
    rows: torch.Tensor  # [>= B] int32: the row of q and out of each request's first one
    ends: torch.Tensor  # [B] int32: the position after each request's last one
    tokens: int  # host int: starts[B]
    prompt: bool  # whether they are prompt tokens


def token_roles(query_start_loc: torch.Tensor, context_lens: torch.Tensor, prompt_tokens: torch.Tensor | None,
                num_prompt_tokens: int, T_total: int) -> list[GroupedRows]:
    """A step's launches (query_start_loc [B+1], context_lens [B] int32, as AttentionMetadata's): its prompt tokens
    (`prompt_tokens` [B] int32 of each request's new tokens, the first ones; their sum `num_prompt_tokens`), then
    its generated ones; one launch where the step has one role only. No host sync: it may be captured."""
    if num_prompt_tokens in (0, T_total):
        return [GroupedRows(query_start_loc, query_start_loc, context_lens, T_total, num_prompt_tokens > 0)]
    generated = query_start_loc.diff() - prompt_tokens
    zero = query_start_loc[:1]
    return [
        GroupedRows(torch.cat([zero, prompt_tokens.cumsum(0, dtype=torch.int32)]), query_start_loc,
                    context_lens - generated, num_prompt_tokens, True),
        GroupedRows(torch.cat([zero, generated.cumsum(0, dtype=torch.int32)]), query_start_loc[:-1] + prompt_tokens,
                    context_lens, T_total - num_prompt_tokens, False),
    ]


def grouped_rows(group: int, element_size: int, prompt: bool) -> int:
    """Query rows a program of `grouped_attention` holds: a KV head's `group` query heads of one or more tokens.

    Generated tokens (decodes, and their recompute after a preemption) take the fewest tl.dot takes, so a decode's
    group wastes few; 16-bit prompt tokens take PROMPT_ROWS, a warpgroup's MMA whose warps each hold whole rows, so a
    prompt's tile carries PROMPT_ROWS // group tokens. The two programs sum a row's probabilities in other orders
    (results/logs/h100_grouped_rows_c189b3a.log), so a token's role, not its step, picks its program.
    """
    rows = PROMPT_ROWS if prompt and element_size == 2 else MIN_DOT
    return max(rows, triton.next_power_of_2(group))


def grouped_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, launch: GroupedRows,
    scale: float, out: torch.Tensor, window: int | None = None,
) -> torch.Tensor:
    """`prefill_attention` (q [T_total, H_q, D] over k_cache/v_cache [N, P, H_kv, D] -> out [T_total, H_q, D]) of
    `launch`'s tokens of every request, decodes included, with a KV head's GQA group in a program's rows.

    One compiled program per role serves a token however its step holds it (a decode, a prefill, a chunk, after a
    cached prefix, beside anything), so its sums run through the same instructions in the same order: the
    batch-invariant path (EngineConfig.deterministic). The key tiles are the split decode kernel's (a K/V tile read
    once for the group).
    """
    _, H_q, D = q.shape
    _, P, H_kv, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride()
    group = H_q // H_kv
    block_m = grouped_rows(group, q.element_size(), launch.prompt)
    B, tile_tokens = launch.ends.shape[0], block_m // group
    _grouped_kernel[(H_kv * ((launch.tokens + B * (tile_tokens - 1)) // tile_tokens),)](
        q, k_cache, v_cache, out, block_tables, launch.starts, launch.rows, launch.ends,
        scale * LOG2E, B,
        *q.stride(), *k_cache.stride(), block_tables.stride(0), *out.stride(),
        GROUP=group, D=D, D_PAD=padded_head_dim(D), P=P, BLOCK_M=block_m, BLOCK_N=SHALLOW_TILES.block_n,
        WINDOW=window or 0, SEARCH=SEARCH, H_KV=H_kv, num_warps=DECODE_WARPS, num_stages=SHALLOW_TILES.num_stages,
    )
    return out
