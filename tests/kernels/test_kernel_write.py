"""The K/V write kernel against an indexed copy: every slot it is given, nothing else."""

from __future__ import annotations

import pytest
import torch

from weft.attention.kernels import write_kv

pytestmark = pytest.mark.kernels

CPU_DTYPES = [torch.float32]  # the interpreter: float32 only (it computes 16-bit types wrongly)
GPU_DTYPES = [pytest.param(d, marks=pytest.mark.gpu) for d in (torch.float32, torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("dtype", CPU_DTYPES + GPU_DTYPES)
# Rows of H_kv * D values, a power of two or not (D = 48, 80, 96: 2 * 48 = 96, 8 * 80 = 640, 3 * 96 = 288).
@pytest.mark.parametrize(
    ("T", "H_kv", "D", "P"),
    [(1, 2, 64, 16), (13, 2, 64, 8), (37, 8, 128, 1), (5, 2, 48, 8), (11, 8, 80, 4), (9, 3, 96, 16)],
)
def test_write_kv(device, dtype, T, H_kv, D, P):
    g = torch.Generator().manual_seed(T)
    N = T + 3
    H_q = 2 * H_kv
    qkv = torch.randn(T, (H_q + 2 * H_kv) * D, generator=g).to(dtype).to(device)
    k = torch.randn(T, H_kv, D, generator=g).to(dtype).to(device)  # contiguous, like rotated k
    v = qkv[:, (H_q + H_kv) * D :].view(T, H_kv, D)  # a strided view, like the model's v
    slots = torch.randperm(N * P, generator=g)[:T]
    slots[::3] = -1  # padding rows of a CUDA-graph batch: write nothing
    k_cache = torch.full((N, P, H_kv, D), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    want_k.view(N * P, H_kv, D)[slots[real]] = k[real.to(device)]
    want_v.view(N * P, H_kv, D)[slots[real]] = v[real.to(device)]

    write_kv(k, v, slots.to(device), k_cache, v_cache)

    assert torch.equal(k_cache.isnan(), want_k.isnan()) and torch.equal(v_cache.isnan(), want_v.isnan())
    assert torch.equal(k_cache.nan_to_num(), want_k.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), want_v.nan_to_num())
