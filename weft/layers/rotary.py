"""Rotary position embedding (rotate-half convention, as HF Llama/Qwen3), looked up by position."""

from __future__ import annotations

import torch
from torch import nn

from weft.layers import fused
from weft.layers.norm import RMSNorm


class RotaryEmbedding(nn.Module):
    def __init__(self, D: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D)  # [D/2]
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [S_max, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [S_max, D]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T_total] -> cos, sin [T_total, 1, D]: looked up once per step, used by every layer."""
        # like HF, the tables are cast to the activations' dtype before the multiply
        return self.cos[positions][:, None, :].to(dtype), self.sin[positions][:, None, :].to(dtype)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    norms: tuple[RMSNorm, RMSNorm] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T_total, H_q, D], k [T_total, H_kv, D], cos/sin [T_total, 1, D] -> rotated q, k; `norms`: RMSNorms
    over each head of q and of k, applied first (Qwen3). On CUDA one Triton kernel does it all, fused.rotary."""
    if fused.on_kernels(q):
        if norms is None:
            return fused.rotary(q, k, cos, sin)
        q_norm, k_norm = norms  # one epsilon for both: a model's rms_eps
        return fused.rotary(q, k, cos, sin, (q_norm.weight, k_norm.weight), q_norm.eps)
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
