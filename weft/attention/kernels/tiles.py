"""Steps both attention kernels share: find a tile of a request's cached tokens in the paged
cache [N, P, H_kv, D], mask a head's lanes, and fold a K/V tile into an online softmax.

The kernels hold a head in D_PAD = `padded_head_dim(D)` lanes, a power of two (tl.arange) and at
least 16 (tl.dot); lanes D .. D_PAD-1 are masked off in memory and read as 0, so they add nothing
to a score and produce output lanes nobody stores. A power-of-two D >= 16 has D_PAD = D, and
every lane mask sits behind a compile-time `D_PAD != D`: such heads compile with no lane masks.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # scores are kept in log2 units: exp2 is the GPU's native exponential
# The widest head served: at D_PAD = 512 the prefill's pipelined K/V tiles outgrow the shared memory
# a block may have on the H200 even in 16 bits, and the decode's in float32 (results/logs/kernel_notes.md,
# "Head dimensions").
MAX_HEAD_DIM = 256
MIN_DOT = 16  # tl.dot needs at least 16 along each dimension


def padded_head_dim(D: int) -> int:
    """D_PAD: the lanes a kernel holds a head of D in (D itself for a power of two >= 16)."""
    return max(MIN_DOT, triton.next_power_of_2(D))


@triton.jit
def lanes(rows_ok, D: tl.constexpr, D_PAD: tl.constexpr):
    """The mask [M, D_PAD] of rows [M] where rows_ok holds and lanes below D; with D unpadded, just
    rows_ok[:, None] (the load or store broadcasts it), so no lane mask is compiled."""
    if D_PAD == D:
        return rows_ok[:, None]
    else:
        return rows_ok[:, None] & (tl.arange(0, D_PAD) < D)[None, :]


@triton.jit
def token_offsets(table_ptr, start, end, stride_block, stride_token, P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Element offsets [BLOCK_N] of logical tokens start .. start+BLOCK_N-1 (head 0, d 0).

    `table_ptr` points at the request's row of the block table; `start` is a multiple of
    BLOCK_N and tokens at or past `end` are never looked up in the table.
    """
    pos = start + tl.arange(0, BLOCK_N)
    if P % BLOCK_N == 0:
        # Tiles start at multiples of BLOCK_N, so the whole tile sits inside one block.
        block = tl.load(table_ptr + start // P, mask=start < end, other=0).to(tl.int64)
    else:
        block = tl.load(table_ptr + pos // P, mask=pos < end, other=0).to(tl.int64)
    # int64: a layer's cache can hold more than 2**31 elements.
    return block * stride_block + (pos % P) * stride_token


@triton.jit
def softmax_step(q, k, v, m, row_sum, acc, scale_log2, visible):
    """Fold K/V [BLOCK_N, D_PAD] into the running max m [M], row_sum [M] and acc [M, D_PAD] of q [M, D_PAD].

    m is in scaled log2 units (scale_log2 includes log2(e)), so scaling and the exponent's
    shift fuse into one multiply-add; `visible` [M, BLOCK_N] masks scores. Products accumulate
    in float32; "ieee" makes float32 inputs exact (it has no effect on 16-bit inputs), so
    float32 runs can match a reference token for token.
    """
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1) * scale_log2)
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    row_sum = row_sum * alpha + tl.sum(p, 1)
    # Accumulating inside the dot saves an add per element of acc and a register copy.
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    return m_new, row_sum, acc
