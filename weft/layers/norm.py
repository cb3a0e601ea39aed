"""RMSNorm, computed in float32 as HF does, so float32 and bf16 runs match the reference; on CUDA one
Triton kernel (fused.py), with the residual add before it when there is one."""

from __future__ import annotations

import torch
from torch import nn

from weft.layers import fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = True  # fused.py's kernel where it runs (False: PyTorch's ops everywhere)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim]"""
        if self.kernels and fused.on_kernels(x):
            return fused.add_rms_norm(x, self.weight, self.eps)[0]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [T, dim] -> (RMSNorm(x + residual), x + residual): the residual stream's next sum
        and its normalized value."""
        if self.kernels and fused.on_kernels(x):
            return fused.add_rms_norm(x, self.weight, self.eps, residual)
        s = x + residual
        return self(s), s
