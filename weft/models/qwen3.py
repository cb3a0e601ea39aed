"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

import torch

from weft.config import ModelConfig
from weft.distributed import TensorParallel
from weft.layers.norm import RMSNorm
from weft.layers.rotary import apply_rotary
from weft.models.llama import LlamaAttention, LlamaForCausalLM, Rope


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__(cfg, layer, tp)
        self.q_norm = RMSNorm(cfg.D, cfg.rms_eps)
        self.k_norm = RMSNorm(cfg.D, cfg.rms_eps)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T_total, H_q, D], k [T_total, H_kv, D]: each head normalized, then rotated (one kernel on CUDA)."""
        return apply_rotary(q, k, *rope, norms=(self.q_norm, self.k_norm))


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
