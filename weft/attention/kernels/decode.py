"""Split-KV flash-decoding over the paged cache: one new query token per request.

The first kernel runs one program per (request b, KV head, split of the context): it reads
each K/V token of its split once for the KV head's whole group of H_q / H_kv query heads
(padded to the 16 rows tl.dot needs) and leaves that split's normalized output and
log2-sum-exp. The second kernel merges the splits of each query head. Splitting the
context is what keeps all SMs busy when B * H_kv is small.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weft.attention.kernels.tiles import LOG2E, softmax_step, token_offsets

BLOCK_N = 64  # context tokens per tile
# 4, not 2: in this two-kernel form 2 warps measured the same in bf16 (e3 runs 0001 vs 0004), while
# e5 in float32 fell from 1197 to 494 output tok/s with them (results/logs; likely register spills:
# a float32 K or V tile is 128 registers per thread over 64 threads). 2 won the H200 sweep only in a
# fused-merge variant (results/logs/h200_kernel_sweep.txt).
NUM_WARPS = 4
NUM_STAGES = 2
WAVES = 4  # aim for this many programs per SM, so the memory system has enough loads in flight
MIN_GROUP_ROWS = 16  # tl.dot needs at least 16 rows
SPLIT_TILE = 16  # splits the merge kernel reads at a time


# The block table's width (here) and the number of splits (the merge) change from step to step:
# not specialized on, so a serving run compiles each kernel once per shape, not again mid-run.
@triton.jit(do_not_specialize=["stride_table"])
def _split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, context_lens_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qh, stride_qd,
    stride_kn, stride_kp, stride_kh, stride_kd,
    stride_table,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h_kv = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + b)
    # Each request deals its own context's tiles out to the splits, no split more than one tile
    # over another: a short request's programs finish early, and the grid need not depend on
    # this step's longest context (a CUDA graph fixes the grid at capture).
    tiles = tl.cdiv(context_len, BLOCK_N)
    lo = split * tiles // tl.num_programs(2) * BLOCK_N
    hi = tl.minimum((split + 1) * tiles // tl.num_programs(2) * BLOCK_N, context_len)

    rows = tl.arange(0, GROUP_ROWS)
    row_ok = rows < GROUP
    heads = h_kv * GROUP + rows
    d = tl.arange(0, D)
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_rows, mask=row_ok[:, None], other=0.0)

    m = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, D], tl.float32)
    table = table_ptr + b * stride_table
    head_k = k_ptr + h_kv * stride_kh
    head_v = v_ptr + h_kv * stride_kh
    for start in range(lo, hi, BLOCK_N):
        offs = token_offsets(table, start, hi, stride_kn, stride_kp, P, BLOCK_N)
        ok = start + tl.arange(0, BLOCK_N) < hi
        k = tl.load(head_k + offs[:, None] + d[None, :] * stride_kd, mask=ok[:, None], other=0.0)
        v = tl.load(head_v + offs[:, None] + d[None, :] * stride_kd, mask=ok[:, None], other=0.0)
        m, row_sum, acc = softmax_step(q, k, v, m, row_sum, acc, scale_log2, ok[None, :])

    # An empty split (past a short request's end) has acc = 0, row_sum = 0, m = -inf: it stores
    # output 0 and log-sum-exp -inf, which the merge weighs 0.
    row_sum = tl.where(row_sum > 0, row_sum, 1.0)
    o_rows = o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
    tl.store(o_rows + d[None, :] * stride_od, acc / row_sum[:, None], mask=row_ok[:, None])
    lse_rows = lse_ptr + b * stride_lb + heads * stride_lh + split * stride_ls
    tl.store(lse_rows, m + tl.log2(row_sum), mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    o_part_ptr, lse_ptr, out_ptr, num_splits,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh, stride_od,
    D: tl.constexpr, SPLIT_TILE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    lse_row = lse_ptr + b * stride_lb + h * stride_lh
    # Two passes, a few splits at a time (registers stay bounded however many there are): the
    # largest log-sum-exp, then the outputs weighed relative to it.
    m = tl.full([SPLIT_TILE], float("-inf"), tl.float32)
    for first in range(0, num_splits, SPLIT_TILE):
        t = first + tl.arange(0, SPLIT_TILE)
        m = tl.maximum(m, tl.load(lse_row + t * stride_ls, mask=t < num_splits, other=float("-inf")))
    lse_max = tl.max(m, 0)
    parts = o_part_ptr + b * stride_pb + h * stride_ph
    d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    weights = tl.zeros([SPLIT_TILE], tl.float32)
    for first in range(0, num_splits, SPLIT_TILE):
        t = first + tl.arange(0, SPLIT_TILE)
        t_ok = t < num_splits
        w = tl.exp2(tl.load(lse_row + t * stride_ls, mask=t_ok, other=float("-inf")) - lse_max)
        o = tl.load(parts + t[:, None] * stride_ps + d[None, :] * stride_pd, mask=t_ok[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        weights += w
    out = acc / tl.sum(weights, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d * stride_od, out.to(out_ptr.dtype.element_ty))


@dataclass
class DecodeSplits:
    """How many splits one decode step cuts each request's context into, and the scratch they write.

    Built once per step (or once per CUDA graph) and shared by all L layers.
    """

    o: torch.Tensor  # [B, H_q, num_splits, D] float32: each split's normalized output
    lse: torch.Tensor  # [B, H_q, num_splits] float32: log2-sum-exp of each split's scaled scores

    @classmethod
    def plan(
        cls, B: int, H_q: int, H_kv: int, D: int, max_context_len: int, device: torch.device,
        num_splits: int | None = None,
    ) -> DecodeSplits:
        """`num_splits` defaults to enough programs to fill the GPU WAVES times, but no more
        splits than the longest context has tiles."""
        if num_splits is None:
            num_splits = min(triton.cdiv(WAVES * _num_sms(device), B * H_kv), triton.cdiv(max_context_len, BLOCK_N))
        o = torch.empty(B, H_q, num_splits, D, dtype=torch.float32, device=device)
        lse = torch.empty(B, H_q, num_splits, dtype=torch.float32, device=device)
        return cls(o, lse)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # Triton's interpreter runs programs one by one
    return torch.cuda.get_device_properties(device).multi_processor_count


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
    B = splits.lse.shape[0]
    _, H_q, D = q.shape
    _, P, H_kv, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride()
    num_splits = splits.lse.shape[2]
    _split_kernel[(B, H_kv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, splits.o, splits.lse,
        scale * LOG2E,
        *q.stride(), *k_cache.stride(), block_tables.stride(0), *splits.o.stride(), *splits.lse.stride(),
        GROUP=H_q // H_kv, GROUP_ROWS=max(MIN_GROUP_ROWS, triton.next_power_of_2(H_q // H_kv)), D=D, P=P,
        BLOCK_N=BLOCK_N, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    _merge_kernel[(B, H_q)](
        splits.o, splits.lse, out, num_splits, *splits.o.stride(), *splits.lse.stride(), *out.stride(),
        D=D, SPLIT_TILE=SPLIT_TILE,
    )
    return out
