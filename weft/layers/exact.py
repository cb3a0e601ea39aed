"""Elementwise functions built from correctly rounded operations only (+, -, x, /, round), for the CPU's
batch-invariant path (EngineConfig.deterministic).

PyTorch's CPU kernels compute exp and SiLU with vector code over most of a tensor and scalar code over the last
few elements of each thread's share of it; the two agree only to the last bit or so, and where a share ends
depends on the tensor's size and the thread count, so an element's bits follow its batch. Correctly rounded
operations give the same bits in either loop: these do.
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.4426950408889634
LN2_HI, LN2_LO = 0.693145751953125, 1.4286068203094172e-06  # ln 2 in two parts: k * LN2_HI is exact for |k| < 2**11
EXP_COEFFICIENTS = [1 / math.factorial(n) for n in range(8, -1, -1)]  # Taylor to r**8: |r| <= ln2 / 2


def exp(x: torch.Tensor) -> torch.Tensor:
    """e**x of float x (any shape), computed in float32 and returned in x's dtype; within 2 ulp in float32."""
    dtype = x.dtype
    x = x.float().clamp(-104.0, 89.0)  # beyond: 0 and inf in float32, as the scale below makes them
    k = torch.round(x * LOG2E)
    r = (x - k * LN2_HI) - k * LN2_LO  # x - k ln2, |r| <= ln2 / 2
    p = torch.full_like(r, EXP_COEFFICIENTS[0])
    for c in EXP_COEFFICIENTS[1:]:
        p = p * r + c
    half = torch.floor(k / 2)  # 2**k as two normal powers of two: each product exact until it underflows
    return (p * _pow2(half) * _pow2(k - half)).to(dtype)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k for integral float32 k in [-126, 127], from its exponent bits."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) = x / (1 + e**-x), in x's dtype (PyTorch's formula, rounded once at the end)."""
    xf = x.float()
    return (xf / (1.0 + exp(-xf))).to(x.dtype)
