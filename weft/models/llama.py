"""The Llama decoder on weft's layers; Qwen3 (qwen3.py) differs only in normalizing q and k. Mistral and Qwen2 are
this decoder as their configs set it (ModelConfig): Qwen2 with biases on q, k and v, Mistral with a sliding window
(the engine's to honour), Llama 3.x with its RoPE scaling.

Parameter names follow HF's so weights map one to one, except the fused `qkv_proj`
(q, k, v) and `gate_up_proj` (gate, up), one matmul each (see weights.py). Under tensor
parallelism (weft.distributed) a rank builds its slice: `local` is the slice's shape, and the
o/down projections, the embedding and the logits meet the other ranks' slices in one collective each.
The model calls attention through `Attention`, which every backend (weft.attention) and the piecewise
graphs' cut (weft.inference.cuda_graphs) implement.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch
from torch import nn

from weft.attention.base import CacheSlots
from weft.config import ModelConfig
from weft.distributed import SINGLE, TensorParallel
from weft.layers import fused
from weft.layers.linear import Linear, rope_launch
from weft.layers.mlp import SwiGLU
from weft.layers.moe import SparseMoE
from weft.layers.norm import RMSNorm
from weft.layers.parallel import RowParallelLinear, VocabParallelEmbedding
from weft.layers.rotary import RotaryEmbedding, apply_rotary, project_into_cache, rotate_into_cache

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T_total, 1, D] of this step's positions
StepT = TypeVar("StepT", contravariant=True)  # the per-step state the attention it is passed to takes


class Attention(Protocol[StepT]):
    """What a layer calls on attention, with the step's state `step`: where a kernel may store the layer's K/V
    itself (`cache_slots`; then `attend` follows), or else `forward`, which stores k and v and attends."""

    def cache_slots(self, layer: int, step: StepT) -> CacheSlots | None:
        """Rows a kernel stores this step's K/V of `layer` at, or None (then `forward`)."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepT) -> torch.Tensor:
        """q [T_total, H_q, D], k/v [T_total, H_kv, D] -> o [T_total, H_q, D]: k and v stored, then attention."""

    def attend(self, layer: int, q: torch.Tensor, step: StepT) -> torch.Tensor:
        """q [T_total, H_q, D] -> o [T_total, H_q, D], over K/V already stored at `cache_slots`."""


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        """`cfg`: this rank's slice (its H_q and H_kv heads)."""
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.qkv_proj = Linear(cfg.E, (cfg.H_q + 2 * cfg.H_kv) * cfg.D, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.H_q * cfg.D, cfg.E, cfg.o_bias, tp)
        self.kernels = True  # RoPE (with the K/V store) in fused.py's kernel where it runs

    def head_norms(self) -> tuple[RMSNorm, RMSNorm] | None:
        """RMSNorms over each head of q and of k before RoPE (Qwen3's); Llama has none."""
        return None

    def forward(self, x: torch.Tensor, rope: Rope, attn: Attention[StepT], step: StepT) -> torch.Tensor:
        """x [T_total, E] -> [T_total, E]"""
        cfg = self.cfg
        kernels = self.kernels and fused.on_kernels(x)
        cache = attn.cache_slots(self.layer, step) if kernels else None
        if cache is not None and (launch := rope_launch(x.shape[0], self.qkv_proj, cfg.D)) is not None:
            # a decode's few rows: RoPE and the K/V store in the epilogue of qkv's tuned launch
            q = project_into_cache(x, self.qkv_proj, launch, cfg.H_q, cfg.H_kv, *rope, cache.slot_mapping,
                                   cache.k_rows, cache.v_rows, self.head_norms())
            return self.o_proj(attn.attend(self.layer, q, step).flatten(1))
        heads = (cfg.H_q, cfg.H_kv, cfg.H_kv)
        qkv = self.qkv_proj(x).split([h * cfg.D for h in heads], dim=-1)
        q, k, v = (t.view(-1, h, cfg.D) for t, h in zip(qkv, heads, strict=True))
        if cache is None:
            q, k = apply_rotary(q, k, *rope, self.head_norms(), kernels)
            o = attn.forward(self.layer, q, k, v, step)  # [T_total, H_q, D]
        else:  # RoPE's kernel stores k and v in the cache
            q = rotate_into_cache(q, k, v, *rope, cache.slot_mapping, cache.k_rows, cache.v_rows, self.head_norms())
            o = attn.attend(self.layer, q, step)
        return self.o_proj(o.flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, attention_cls: type[LlamaAttention], tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.E, cfg.rms_eps)
        self.self_attn = attention_cls(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.E, cfg.rms_eps)
        moe = cfg.moe is not None and layer in cfg.moe.layers
        self.mlp = SparseMoE(cfg.E, cfg.moe) if moe else SwiGLU(cfg.E, cfg.intermediate, cfg.mlp_bias, tp)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, attn: Attention[StepT], step: StepT
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last layer's output, residual: the residual stream before it (None at layer 0), both
        [T_total, E] -> (this layer's output, the stream before it): each add is the next norm's."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h, residual = self.post_attention_layernorm.add(self.self_attn(h, rope, attn, step), residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, attention_cls: type[LlamaAttention], tp: TensorParallel) -> None:
        """`cfg`: this rank's slice."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.V, cfg.E, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, attention_cls, tp) for i in range(cfg.L))
        self.norm = RMSNorm(cfg.E, cfg.rms_eps)
        self.rotary = RotaryEmbedding(cfg.D, cfg.rope_theta, cfg.max_model_len, cfg.rope_scaling)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention[StepT], step: StepT
    ) -> torch.Tensor:
        """input_ids, positions [T_total] -> hidden [T_total, E]"""
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x, residual = layer(x, residual, rope, attn, step)
        return self.norm.add(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        """`cfg`: the whole model's shape; `tp`: the slice this rank holds."""
        super().__init__()
        self.cfg, self.tp, local = cfg, tp, tp.local(cfg)
        self.model = DecoderModel(local, self.attention_cls, tp)
        self.lm_head = Linear(local.E, local.V, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention[StepT], step: StepT
    ) -> torch.Tensor:
        """input_ids, positions [T_total] -> hidden [T_total, E] (logits only where needed: `logits`)."""
        return self.model(input_ids, positions, attn, step)

    def use_kernels(self, fused: bool, tuned: bool) -> None:
        """Whether the layers run weft's Triton kernels where they can (CUDA: weft/layers/fused.py's), or PyTorch's
        ops as HF's everywhere (EngineConfig.enable_fused_layers); and with them, whether a decode's linear layers
        run their tuned launches where those beat cuBLAS (EngineConfig.enable_tuned_gemms)."""
        for module in self.modules():  # (not the experts: they have no PyTorch path fit to serve)
            if isinstance(module, RMSNorm | SwiGLU | LlamaAttention):
                module.kernels = fused
            elif isinstance(module, Linear):
                module.kernels = fused and tuned

    def use_batch_invariant(self, on: bool) -> None:
        """Whether every linear layer runs weft.layers.linear's batch-invariant matmul, and the MLP's SiLU off the
        kernels exact.py's (EngineConfig.deterministic)."""
        for module in self.modules():
            if isinstance(module, Linear | SwiGLU):
                module.batch_invariant = on

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, E] -> logits [B, V] in the activations' dtype (every rank's vocabulary rows), as HF's
        lm_head rounds them; what needs float32 (drawing a token, logprobs) converts the rows it reads."""
        return self.tp.all_gather(self.lm_head(hidden))
