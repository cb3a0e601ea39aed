"""Rotary position embedding (rotate-half convention, as HF Llama/Qwen3), looked up by position."""

from __future__ import annotations

import math

import torch
from torch import nn

from weft.config import Llama3Rope
from weft.layers import fused
from weft.layers.linear import DecodeLaunch, Linear, decode_rope
from weft.layers.norm import RMSNorm


class RotaryEmbedding(nn.Module):
    def __init__(self, D: int, theta: float, max_positions: int, scaling: Llama3Rope | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D)  # [D/2]
        if scaling is not None:
            inv_freq = llama3_frequencies(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [S_max, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [S_max, D]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T_total] -> cos, sin [T_total, 1, D]: looked up once per step, used by every layer."""
        # like HF, the tables are cast to the activations' dtype before the multiply
        return self.cos[positions][:, None, :].to(dtype), self.sin[positions][:, None, :].to(dtype)


def llama3_frequencies(inv_freq: torch.Tensor, s: Llama3Rope) -> torch.Tensor:
    """inv_freq [D/2] float32 -> Llama 3.1's scaled frequencies [D/2] (see Llama3Rope), in float32 as HF has them."""
    wavelength = 2 * math.pi / inv_freq
    context = s.original_max_position_embeddings
    long = wavelength > context / s.low_freq_factor  # stretched
    short = wavelength < context / s.high_freq_factor  # kept
    blend = (context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    between = (1 - blend) * inv_freq / s.factor + blend * inv_freq
    return torch.where(long, inv_freq / s.factor, torch.where(short, inv_freq, between))


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    norms: tuple[RMSNorm, RMSNorm] | None = None, kernels: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T_total, H_q, D], k [T_total, H_kv, D], cos/sin [T_total, 1, D] -> rotated q, k; `norms`: RMSNorms
    over each head of q and of k, applied first (Qwen3). With `kernels` one Triton kernel does it all
    (fused.rotary), else PyTorch's ops as HF's."""
    if kernels:
        return fused.rotary(q, k, cos, sin, *_weights(norms))
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rotate_into_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    slot_mapping: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
    norms: tuple[RMSNorm, RMSNorm] | None = None,
) -> torch.Tensor:
    """`apply_rotary`'s q and k, with k (rotated) and v [T_total, H_kv, D] stored at rows slot_mapping [T_total]
    of k_rows / v_rows [slots, H_kv, D] instead of returned -> rotated q: the RoPE and the K/V write in one kernel
    (fused.rotary_store; where the kernels run)."""
    return fused.rotary_store(q, k, v, cos, sin, slot_mapping, k_rows, v_rows, *_weights(norms))


def project_into_cache(
    x: torch.Tensor, proj: Linear, launch: DecodeLaunch, H_q: int, H_kv: int, cos: torch.Tensor, sin: torch.Tensor,
    slot_mapping: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
    norms: tuple[RMSNorm, RMSNorm] | None = None,
) -> torch.Tensor:
    """x [T_total, E] through `proj` (the q/k/v projection, N = (H_q + 2 H_kv) D) by `launch` (linear.rope_launch's),
    then `rotate_into_cache` on its q, k and v, in the same launch (linear.decode_rope) -> rotated q."""
    return decode_rope(x.contiguous(), proj.weight, proj.bias, launch, H_q, H_kv, cos, sin, *_weights(norms),
                       slot_mapping, k_rows, v_rows)


def _weights(norms: tuple[RMSNorm, RMSNorm] | None) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, float]:
    """The kernels' norm arguments: both norms' weights and their one epsilon (a model's rms_eps)."""
    if norms is None:
        return None, 0.0
    q_norm, k_norm = norms
    return (q_norm.weight, k_norm.weight), q_norm.eps


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
