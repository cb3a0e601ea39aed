"""The layer kernels (weft/layers/fused.py) against float64 references, and against the PyTorch ops the
layers run off CUDA: residual add + RMSNorm, on hidden rows and on per-head rows of a strided q,
SiLU(gate) x up, and RoPE (after Qwen3's per-head RMSNorm or without it; returning k, or storing it and v
in the cache)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from weft.layers.fused import add_rms_norm, rotary, rotary_store, silu_and_mul

pytestmark = pytest.mark.kernels

CPU_DTYPES = [torch.float32]  # the interpreter computes 16-bit types wrongly
GPU_DTYPES = [pytest.param(d, marks=pytest.mark.gpu) for d in (torch.float32, torch.bfloat16, torch.float16)]
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}  # relative to each row's scale
EPS = 1e-6


def rms_reference(s: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = s.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    scale = want.abs().amax(-1, keepdim=True).clamp_min(1e-3)
    return bool(((got.double() - want) / scale).abs().max() <= TOL[dtype])


@pytest.mark.parametrize("dtype", CPU_DTYPES + GPU_DTYPES)
@pytest.mark.parametrize(("T", "DIM"), [(1, 64), (7, 48), (5, 576), (3, 1024)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add-norm"])
def test_add_rms_norm(device, dtype, T, DIM, with_residual):
    g = torch.Generator().manual_seed(T * DIM)
    x = (3 * torch.randn(T, DIM, generator=g)).to(dtype).to(device)
    residual = torch.randn(T, DIM, generator=g).to(dtype).to(device) if with_residual else None
    w = (1 + torch.randn(DIM, generator=g)).to(dtype).to(device)
    out, s = add_rms_norm(x, w, EPS, residual)
    want_s = x if residual is None else x + residual  # rounded to dtype, as the kernel's sum must be
    assert s.dtype == out.dtype == dtype and out.shape == x.shape
    assert torch.equal(s, want_s)
    assert close(out, rms_reference(want_s, w), dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES + GPU_DTYPES)
def test_rms_norm_of_the_heads_of_a_strided_q(device, dtype):
    """Qwen3's q_norm: rows of D inside qkv's rows, H_q of them per token."""
    T, H_q, H_kv, D = 5, 3, 1, 48
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, (H_q + 2 * H_kv) * D, generator=g).to(dtype).to(device)
    q = qkv[:, : H_q * D].view(T, H_q, D)
    w = (1 + torch.randn(D, generator=g)).to(dtype).to(device)
    out, _ = add_rms_norm(q, w, EPS)
    assert out.shape == (T, H_q, D) and out.is_contiguous()
    assert close(out, rms_reference(q, w), dtype)


def test_the_kernel_matches_the_layers_pytorch_ops_in_float32(device):
    """What the layers compute off CUDA is what the kernel computes on it, to float32's last bits."""
    from weft.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(1)
    x, residual = torch.randn(6, 576, generator=g), torch.randn(6, 576, generator=g)
    norm = RMSNorm(576, EPS)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(576, generator=g))
        want, want_s = norm.add(x, residual)  # the CPU's PyTorch path
        got, s = add_rms_norm(x.to(device), norm.weight.to(device), EPS, residual.to(device))
    assert torch.equal(s.cpu(), want_s)
    assert torch.allclose(got.cpu(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", CPU_DTYPES + GPU_DTYPES)
@pytest.mark.parametrize(("T", "inter"), [(1, 48), (4, 1536), (3, 2050)])
def test_silu_and_mul(device, dtype, T, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (2 * torch.randn(T, 2 * inter, generator=g)).to(dtype).to(device)
    out = silu_and_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert out.shape == (T, inter) and out.dtype == dtype
    assert close(out, F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES + GPU_DTYPES)
@pytest.mark.parametrize(("T", "H_q", "H_kv", "D"), [(1, 2, 1, 64), (6, 4, 2, 48), (3, 16, 8, 128)])
@pytest.mark.parametrize("with_norms", [False, True], ids=["rope", "norm-rope"])
def test_rotary(device, dtype, T, H_q, H_kv, D, with_norms):
    """q and k read in place from qkv (strided), (each head RMS-normalized, as Qwen3's, and) rotated in one
    launch; against float64 and, in float32, equal to the PyTorch ops the layers run off CUDA."""
    from weft.layers.norm import RMSNorm
    from weft.layers.rotary import RotaryEmbedding, apply_rotary

    g = torch.Generator().manual_seed(D)
    qkv = (3 * torch.randn(T, (H_q + 2 * H_kv) * D, generator=g)).to(dtype).to(device)
    q, k = qkv[:, : H_q * D].view(T, H_q, D), qkv[:, H_q * D : (H_q + H_kv) * D].view(T, H_kv, D)
    positions = torch.randint(0, 1000, (T,), generator=g).to(device)
    cos, sin = RotaryEmbedding(D, 1e4, 1024).to(device)(positions, dtype)
    norms = None
    if with_norms:
        norms = (RMSNorm(D, EPS).to(dtype).to(device), RMSNorm(D, EPS).to(dtype).to(device))
        with torch.no_grad():
            for norm in norms:
                norm.weight.copy_(1 + torch.randn(D, generator=g))
    weights = (norms[0].weight, norms[1].weight) if norms else None
    got_q, got_k = rotary(q, k, cos, sin, weights, EPS)
    for got, x, w in ((got_q, q, weights and weights[0]), (got_k, k, weights and weights[1])):
        x = rms_reference(x, w) if w is not None else x.double()
        x1, x2 = x.chunk(2, dim=-1)
        want = x * cos.double() + torch.cat([-x2, x1], dim=-1) * sin.double()
        assert got.shape == want.shape and got.is_contiguous() and close(got, want, dtype)
    if dtype == torch.float32:
        with torch.no_grad():
            ops_q, ops_k = apply_rotary(q.cpu(), k.cpu(), cos.cpu(), sin.cpu(),
                                        tuple(copy.deepcopy(n).cpu() for n in norms) if norms else None)
        assert torch.allclose(got_q.cpu(), ops_q, rtol=1e-6, atol=1e-6)
        assert torch.allclose(got_k.cpu(), ops_k, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", CPU_DTYPES + GPU_DTYPES)
@pytest.mark.parametrize(("T", "H_q", "H_kv", "D"), [(2, 2, 1, 64), (7, 6, 2, 48), (5, 16, 8, 128)])
@pytest.mark.parametrize("with_norms", [False, True], ids=["rope", "norm-rope"])
def test_rotary_store(device, dtype, T, H_q, H_kv, D, with_norms):
    """With the cache's slots, the kernel stores rotated k and v (strided views of qkv, as the model's) in
    rows slot_mapping[t] and nothing else (slots < 0: padding rows), and returns q as `rotary` does: the
    same bits of q and k as `rotary`'s, whose values test_rotary checks."""
    g = torch.Generator().manual_seed(T * D)
    qkv = (3 * torch.randn(T, (H_q + 2 * H_kv) * D, generator=g)).to(dtype).to(device)
    q, k, v = (x.view(T, -1, D) for x in qkv.split([H_q * D, H_kv * D, H_kv * D], dim=-1))
    angles = torch.rand(T, 1, D, generator=g) * 6
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    weights = tuple((1 + torch.randn(D, generator=g)).to(dtype).to(device) for _ in "qk") if with_norms else None
    slots = torch.randperm(4 * T, generator=g)[:T]
    slots[1::2] = -1
    # rows of a larger slab, with a guard row on each side: a store to row -1 or past the end would land there
    k_slab, v_slab = (torch.full((4 * T + 2, H_kv, D), float("nan"), dtype=dtype, device=device) for _ in "kv")
    k_rows, v_rows = k_slab[1:-1], v_slab[1:-1]

    got_q = rotary_store(q, k, v, cos, sin, slots.to(device), k_rows, v_rows, weights, EPS)

    for slab in (k_slab, v_slab):
        assert slab[0].isnan().all() and slab[-1].isnan().all()

    want_q, want_k = rotary(q, k, cos, sin, weights, EPS)
    assert torch.equal(got_q, want_q) and got_q.is_contiguous()
    real = slots >= 0
    want_k_rows, want_v_rows = (torch.full_like(k_rows, float("nan")) for _ in "kv")
    want_k_rows[slots[real]] = want_k[real.to(device)]
    want_v_rows[slots[real]] = v[real.to(device)]
    for got, want in ((k_rows, want_k_rows), (v_rows, want_v_rows)):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
