"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from weft.config import ModelConfig
from weft.distributed import TensorParallel
from weft.layers.norm import RMSNorm
from weft.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__(cfg, layer, tp)
        self.q_norm = RMSNorm(cfg.D, cfg.rms_eps)
        self.k_norm = RMSNorm(cfg.D, cfg.rms_eps)

    def head_norms(self) -> tuple[RMSNorm, RMSNorm]:
        """q_norm and k_norm: Qwen3's RMSNorm over each head of q and of k."""
        return self.q_norm, self.k_norm


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
