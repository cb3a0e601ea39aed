"""SwiGLU MLP with gate and up projections fused into one matmul (and on CUDA SiLU x up in one kernel, or in a
decode's tuned matmul launch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from weft.distributed import TensorParallel
from weft.layers import exact, fused
from weft.layers.linear import Linear, decode_launch, decode_matmul
from weft.layers.parallel import RowParallelLinear


class SwiGLU(nn.Module):
    def __init__(self, E: int, intermediate: int, bias: bool, tp: TensorParallel) -> None:
        """`intermediate`: this rank's MLP columns."""
        super().__init__()
        self.gate_up_proj = Linear(E, 2 * intermediate, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, E, bias, tp)
        self.kernels = True  # fused.py's SiLU x up where it runs (False: PyTorch's ops)
        self.batch_invariant = False  # off the kernels, SiLU from exact.py (EngineConfig.deterministic)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T_total, E] -> [T_total, E]"""
        w = self.gate_up_proj.weight
        tuned = self.gate_up_proj.kernels and not self.batch_invariant
        if tuned and (launch := decode_launch(x.shape[0], w, gated=True)):
            # a decode's few rows, SiLU x up in gate_up's tuned launch's epilogue
            return self.down_proj(decode_matmul(x.contiguous(), w, self.gate_up_proj.bias, launch, gated=True))
        gate_up = self.gate_up_proj(x)
        if self.kernels and fused.on_kernels(gate_up):
            return self.down_proj(fused.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj((exact.silu(gate) if self.batch_invariant else F.silu(gate)) * up)
