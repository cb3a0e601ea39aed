"""Triton kernels for the layers around attention, so that a decode step is a few kernels per layer:
the residual add with the RMSNorm after it, RoPE on q and k together (after Qwen3's RMSNorm of each
head; where the backend lets it, storing k and v in the KV cache in the same launch), and SiLU(gate) x up.
The layers (norm.py, rotary.py, mlp.py) call them on CUDA and compute the same in PyTorch ops elsewhere, as HF does.

Each rounds where PyTorch rounds: the residual sum and the normalized value are rounded to the
activations' dtype before the weight multiplies (HF: `weight * x.to(input_dtype)`), RoPE's two
products before their sum, and SiLU's result before the multiply by up; no multiply-add is fused into one
rounding (enable_fp_fusion=False). Sums of squares accumulate in float32, in another order than
PyTorch's mean, and exp is Triton's: float32 results may differ from PyTorch's in the last bits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


def on_kernels(x: torch.Tensor) -> bool:
    """Whether the layers run `x` through these kernels: on CUDA (a test turns it on for the CPU, where the
    kernels run in Triton's interpreter)."""
    return x.is_cuda


def dependent_launch(device: torch.device) -> dict[str, bool]:
    """A kernel's launch arguments for programmatic dependent launch, on where `device` has it (CUDA, Hopper and
    later): the GPU starts the kernel while the one before it still runs, and the kernel waits for it (`follow`,
    under its PDL flag) before it touches memory another kernel writes or reads, so a launch's start-up is off a
    step's critical path. Both arguments or neither: a kernel launched so that did not wait would race."""
    on = device.type == "cuda" and _capability(device.index) >= 9
    return dict(PDL=on, launch_pdl=on)


@functools.cache
def _capability(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


@triton.jit
def follow(PDL: tl.constexpr):
    """Under PDL: wait until the kernel before this one has finished and its writes are visible, then let the next
    kernel launch. A kernel calls it before it touches memory that another kernel writes or reads; since each waits
    so, a kernel finishes only after all those before it did. Letting the next one launch before waiting would
    start kernels several ahead, each holding SMs that the running one's successors then cannot spread over:
    Qwen3-4B's batch-1 step took 3.80 ms so, against 3.04 ms without PDL and 2.89 ms with this order
    (results/logs/h200_pdl_order.log)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, H, eps,
    stride_xt, stride_xh, stride_rt,
    DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):
    follow(PDL)
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
        **dependent_launch(x.device),
    )
    return out, residual_out


@triton.jit
def silu_times(gate, up, dtype: tl.constexpr):
    """SiLU(gate) * up in `dtype`, SiLU rounded to it before the multiply (PyTorch's); gate and up hold values of
    `dtype` (the experts' kernels use it too)."""
    act = tl.math.div_rn(gate.to(tl.float32), 1.0 + tl.exp(-gate.to(tl.float32))).to(dtype)  # `/` as PyTorch's
    return (act.to(tl.float32) * up.to(tl.float32)).to(dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, INTER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    follow(PDL)
    t = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < INTER
    gate = tl.load(x_ptr + t * stride_xt + col, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_xt + INTER + col, mask=mask, other=0.0)
    tl.store(out_ptr + t * INTER + col, silu_times(gate, up, out_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024  # columns per program


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * inter] (gate, then up) -> SiLU(gate) * up [T, inter], of gate_up's dtype."""
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(1) == 1, "each row must be contiguous"
    out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    _silu_and_mul_kernel[(T, triton.cdiv(inter, SILU_BLOCK))](gate_up, out, gate_up.stride(0), INTER=inter,
                                                            BLOCK=SILU_BLOCK, enable_fp_fusion=False,
                                                            **dependent_launch(gate_up.device))
    return out


@triton.jit
def norm_rope(x1, x2, cos, sin, weight, col, ok, eps, HALF: tl.constexpr, NORM: tl.constexpr, dt: tl.constexpr):
    """Rows of D = 2 * HALF values of `dt`, as their halves x1, x2 [R, C] (columns `col` [1, C], those past HALF
    read as 0) -> the halves each normalized (NORM: each row's RMSNorm, `weight` [D]) and rotated by the row's cos
    and sin (pointers to its D values: scalars, or [R, 1]; `ok` [R, C]: the rows and columns to read), rounded where
    PyTorch rounds. RoPE's kernel and qkv's decode launch (weft.layers.linear) both call it, with the same bits but
    for the norm's sum of squares, which Triton reduces in the layout the caller's values come in: on the GPU qkv's
    launch (an MMA tile) sums a head of 128 in another order than RoPE's kernel, in float32 a few units apart."""
    if NORM:  # each head's RMSNorm first, rounded where add_rms_norm rounds (its sum of squares in another order)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = tl.math.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1, w2 = tl.load(weight + col, mask=col < HALF), tl.load(weight + HALF + col, mask=col < HALF)
        x1 = (w1.to(tl.float32) * (f1 * inv).to(dt).to(tl.float32)).to(dt)
        x2 = (w2.to(tl.float32) * (f2 * inv).to(dt).to(tl.float32)).to(dt)
    c1, c2 = tl.load(cos + col, mask=ok), tl.load(cos + HALF + col, mask=ok)
    s1, s2 = tl.load(sin + col, mask=ok), tl.load(sin + HALF + col, mask=ok)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype as PyTorch rounds them
    y1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    return y1.to(dt), y2.to(dt)


@triton.jit
def _rotate_heads(src, stride_h, H, dst, stride_dst, cos, sin, weight, eps,
                  HALF: tl.constexpr, BLOCK: tl.constexpr, H_PAD: tl.constexpr, NORM: tl.constexpr):
    """One token's heads 0..H-1 (rows of D = 2 * HALF values at src + h * stride_h) -> dst + h * stride_dst:
    each normalized (NORM) and rotated (H = 0: nothing read or written)."""
    h = tl.arange(0, H_PAD)[:, None]
    col = tl.arange(0, BLOCK)[None, :]
    mask = (h < H) & (col < HALF)
    rows = src + h * stride_h + col
    x1, x2 = tl.load(rows, mask=mask, other=0.0), tl.load(rows + HALF, mask=mask, other=0.0)
    y1, y2 = norm_rope(x1, x2, cos, sin, weight, col, col < HALF, eps, HALF, NORM, dst.dtype.element_ty)
    out = dst + h * stride_dst + col
    tl.store(out, y1, mask=mask)
    tl.store(out + HALF, y2, mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr, slots_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
    H_q, H_kv, eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
    HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, NORM: tl.constexpr, STORE: tl.constexpr, PDL: tl.constexpr,
):
    follow(PDL)
    t = tl.program_id(0).to(tl.int64)  # one token, all its heads
    cos, sin = cos_ptr + t * D, sin_ptr + t * D
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, H_q, q_out_ptr + t * H_q * D, D, cos, sin, q_weight_ptr, eps,
                  HALF, BLOCK, HQ_PAD, NORM)
    if STORE:  # k and v into the cache's row of the token's slot (rows of H_kv * D values); slot < 0: nowhere
        slot = tl.load(slots_ptr + t)
        heads = tl.where(slot >= 0, H_kv, 0)
        k_row = k_out_ptr + slot * (H_kv * D)
        h = tl.arange(0, HKV_PAD)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < heads) & (d < D)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(v_out_ptr + slot * (H_kv * D) + h * D + d, v, mask=mask)
    else:
        heads = H_kv
        k_row = k_out_ptr + t * (H_kv * D)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, heads, k_row, D, cos, sin, k_weight_ptr, eps, HALF, BLOCK,
                  HKV_PAD, NORM)


def _rotary_launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor] | None, eps: float, slots: torch.Tensor | None,
    q_out: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor | None,
) -> None:
    """One program per token: q into q_out [T, H_q, D]; k into k_out [T, H_kv, D], or with `slots` (and v),
    k and v into rows slots[t] of k_out / v_out."""
    T, H_q, D = q.shape
    H_kv = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert D % 2 == 0 and cos.shape == sin.shape == (T, 1, D)
    assert norms is None or all(w.shape == (D,) and w.is_contiguous() for w in norms)
    q_weight, k_weight = norms if norms is not None else (q, k)  # unread without norms
    store = slots is not None
    _rotary_kernel[(T,)](
        q, k, v if store else k, cos, sin, q_weight, k_weight, slots if store else k, q_out, k_out,
        v_out if store else k_out, H_q, H_kv, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0) if store else 0, v.stride(1) if store else 0,
        D=D, HALF=D // 2, BLOCK=triton.next_power_of_2(D // 2), BLOCK_D=triton.next_power_of_2(D),
        HQ_PAD=triton.next_power_of_2(H_q), HKV_PAD=triton.next_power_of_2(H_kv), NORM=norms is not None,
        STORE=store, enable_fp_fusion=False, **dependent_launch(q.device),
    )


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H_q, D], k [T, H_kv, D] (rows of D contiguous), cos/sin [T, 1, D] of their dtype ->
    rotated q, k (rotate-half convention), contiguous: both in one launch. `norms`: the weights [D] of an
    RMSNorm (epsilon `eps`) over each head of q and of k, applied first in the same launch (Qwen3's)."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _rotary_launch(q, k, None, cos, sin, norms, eps, None, q_out, k_out, None)
    return q_out, k_out


def rotary_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    slot_mapping: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 0.0,
) -> torch.Tensor:
    """`rotary`, with k rotated and v [T, H_kv, D] (rows of D contiguous) stored in the cache instead of
    returned: token t's at row slot_mapping[t] (int64 [T]; < 0: nowhere) of k_rows / v_rows [slots, H_kv, D]
    (contiguous) -> rotated q. The RoPE and the K/V write in one launch."""
    T, H_kv, D = k.shape
    assert v.shape == k.shape and v.stride(2) == 1 and k_rows.dtype == v_rows.dtype == k.dtype == v.dtype
    assert slot_mapping.shape == (T,) and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    assert k_rows.is_contiguous() and v_rows.is_contiguous() and k_rows.shape == v_rows.shape
    assert k_rows.shape[1:] == (H_kv, D)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _rotary_launch(q, k, v, cos, sin, norms, eps, slot_mapping, q_out, k_rows, v_rows)
    return q_out
