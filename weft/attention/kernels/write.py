"""The K/V write: this step's new tokens into their cache slots, one kernel for K and V.

A slot below 0 is skipped: the padding rows of a CUDA-graph batch carry one, so they write
nothing (an indexed copy would wrap -1 around to the cache's last slot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 8  # tokens per program


@triton.jit(do_not_specialize=["T"])
def _write_kernel(
    k_ptr, v_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, T,
    stride_kt, stride_vt,
    ROW: tl.constexpr, BLOCK_ROW: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = t.to(tl.int64)  # a large prefill's qkv rows reach past 2**31 elements
    slot = tl.load(slots_ptr + t, mask=t < T, other=-1)
    col = tl.arange(0, BLOCK_ROW)
    ok = (slot >= 0)[:, None] & (col < ROW)[None, :]
    dst = slot[:, None] * ROW + col[None, :]  # a slot's H_kv * D values are contiguous in the cache
    k = tl.load(k_ptr + rows[:, None] * stride_kt + col[None, :], mask=ok)
    tl.store(k_cache_ptr + dst, k, mask=ok)
    v = tl.load(v_ptr + rows[:, None] * stride_vt + col[None, :], mask=ok)
    tl.store(v_cache_ptr + dst, v, mask=ok)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """Store k/v [T_total, H_kv, D] at slot_mapping [T_total] (int64, < 0: skip) of k_cache/v_cache
    [N, P, H_kv, D] or their rows [N * P, H_kv, D] (contiguous). Each token's H_kv * D values must be
    contiguous in k and v."""
    T, H_kv, D = k.shape
    for x in (k, v):
        assert x.stride(2) == 1 and x.stride(1) == D, "each token's K/V row must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.shape == (T,) and slot_mapping.is_contiguous()
    row = H_kv * D
    _write_kernel[(triton.cdiv(T, BLOCK_T),)](
        k, v, slot_mapping, k_cache, v_cache, T, k.stride(0), v.stride(0),
        ROW=row, BLOCK_ROW=triton.next_power_of_2(row), BLOCK_T=BLOCK_T,
    )
