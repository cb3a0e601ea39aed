"""Triton kernels for the layers around attention, so that a decode step is a few kernels per layer:
the residual add with the RMSNorm after it, RoPE on q and k together (after Qwen3's RMSNorm of each
head), and SiLU(gate) x up. The layers
(norm.py, rotary.py, mlp.py) call them on CUDA and compute the same in PyTorch ops elsewhere, as HF does.

Each rounds where PyTorch rounds: the residual sum and the normalized value are rounded to the
activations' dtype before the weight multiplies (HF: `weight * x.to(input_dtype)`), RoPE's two
products before their sum, and SiLU's result before the multiply by up; no multiply-add is fused into one
rounding (enable_fp_fusion=False). Sums of squares accumulate in float32, in another order than
PyTorch's mean, and exp is Triton's: float32 results may differ from PyTorch's in the last bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def on_kernels(x: torch.Tensor) -> bool:
    """Whether the layers run `x` through these kernels: on CUDA (a test turns it on for the CPU, where the
    kernels run in Triton's interpreter)."""
    return x.is_cuda


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, H, eps,
    stride_xt, stride_xh, stride_rt,
    DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row t * H + h of x [T, H, DIM]
    t, h = row // H, row % H
    col = tl.arange(0, BLOCK)
    mask = col < DIM
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + col, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # H == 1: the hidden state's rows
        x = (x.to(tl.float32) + tl.load(residual_ptr + t * stride_rt + col, mask=mask, other=0.0).to(tl.float32))
        x = x.to(out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * DIM + col, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / DIM + eps)
    y = (xf * inv).to(out_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + col, mask=mask, other=0.0)
    tl.store(out_ptr + row * DIM + col, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, DIM] or [T, H, DIM] (rows of DIM contiguous), weight [DIM], residual [T, DIM] or None ->
    (RMSNorm(s) * weight, s) with s = x + residual (rounded to x's dtype), or x itself when residual is
    None; the first (and s, when summed) contiguous, of x's shape and dtype."""
    view = x if x.dim() == 3 else x[:, None, :]
    T, H, DIM = view.shape
    assert view.stride(2) == 1 and weight.shape == (DIM,), "each row of DIM values must be contiguous"
    assert residual is None or (H == 1 and residual.shape == x.shape and residual.stride(-1) == 1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else x
    _add_rms_norm_kernel[(T * H,)](
        view, residual if residual is not None else view, weight, out, residual_out, H, eps,
        view.stride(0), view.stride(1), residual.stride(0) if residual is not None else 0,
        DIM=DIM, BLOCK=triton.next_power_of_2(DIM), HAS_RESIDUAL=residual is not None, enable_fp_fusion=False,
    )
    return out, residual_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, INTER: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < INTER
    gate = tl.load(x_ptr + t * stride_xt + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + INTER + col, mask=mask, other=0.0)
    act = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(out_ptr.dtype.element_ty)  # `/` rounded as PyTorch's
    tl.store(out_ptr + t * INTER + col, (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


SILU_BLOCK = 1024  # columns per program


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * inter] (gate, then up) -> SiLU(gate) * up [T, inter], of gate_up's dtype."""
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(1) == 1, "each row must be contiguous"
    out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    _silu_and_mul_kernel[(T, triton.cdiv(inter, SILU_BLOCK))](gate_up, out, gate_up.stride(0), INTER=inter,
                                                            BLOCK=SILU_BLOCK, enable_fp_fusion=False)
    return out


@triton.jit
def _rotate_row(src, dst, cos, sin, weight, eps, HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr):
    col = tl.arange(0, BLOCK)
    mask = col < HALF
    x1, x2 = tl.load(src + col, mask=mask, other=0.0), tl.load(src + HALF + col, mask=mask, other=0.0)
    dt = dst.dtype.element_ty
    if NORM:  # the head's RMSNorm first, rounded where add_rms_norm rounds (its sum of squares in another order)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = tl.math.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / (2 * HALF) + eps)
        w1, w2 = tl.load(weight + col, mask=mask), tl.load(weight + HALF + col, mask=mask)
        x1 = (w1.to(tl.float32) * (f1 * inv).to(dt).to(tl.float32)).to(dt)
        x2 = (w2.to(tl.float32) * (f2 * inv).to(dt).to(tl.float32)).to(dt)
    c1, c2 = tl.load(cos + col, mask=mask), tl.load(cos + HALF + col, mask=mask)
    s1, s2 = tl.load(sin + col, mask=mask), tl.load(sin + HALF + col, mask=mask)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype as PyTorch rounds them
    y1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(dst + col, y1.to(dt), mask=mask)
    tl.store(dst + HALF + col, y2.to(dt), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr, q_out_ptr, k_out_ptr, H_q, H_kv, eps,
    stride_qt, stride_qh, stride_kt, stride_kh,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
):
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)  # heads 0..H_q-1 of q, then the H_kv of k
    cos, sin = cos_ptr + t * D, sin_ptr + t * D
    if h < H_q:
        _rotate_row(q_ptr + t * stride_qt + h * stride_qh, q_out_ptr + (t * H_q + h) * D, cos, sin, q_weight_ptr,
                    eps, HALF, BLOCK, NORM)
    else:
        hk = h - H_q
        _rotate_row(k_ptr + t * stride_kt + hk * stride_kh, k_out_ptr + (t * H_kv + hk) * D, cos, sin, k_weight_ptr,
                    eps, HALF, BLOCK, NORM)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H_q, D], k [T, H_kv, D] (rows of D contiguous), cos/sin [T, 1, D] of their dtype ->
    rotated q, k (rotate-half convention), contiguous: both in one launch. `norms`: the weights [D] of an
    RMSNorm (epsilon `eps`) over each head of q and of k, applied first in the same launch (Qwen3's)."""
    T, H_q, D = q.shape
    H_kv = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert D % 2 == 0 and cos.shape == sin.shape == (T, 1, D)
    assert norms is None or all(w.shape == (D,) and w.is_contiguous() for w in norms)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    q_weight, k_weight = norms if norms is not None else (q, k)  # unread without norms
    _rotary_kernel[(T, H_q + H_kv)](
        q, k, cos, sin, q_weight, k_weight, q_out, k_out, H_q, H_kv, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        D=D, HALF=D // 2, BLOCK=triton.next_power_of_2(D // 2), NORM=norms is not None, enable_fp_fusion=False,
    )
    return q_out, k_out
