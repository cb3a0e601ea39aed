"""Contiguous backend: request b owns one row of S_max slots; written at its cursor, read by slice.

Slab [2, L, B, H_kv, S_max, D]. In the block manager's terms a row is one block of
P = S_max tokens, so `slot_mapping` (row * S_max + position) says where each token goes.
"""

from __future__ import annotations

import torch

from weft.attention.base import AttentionBackend, AttentionMetadata
from weft.attention.padded import PaddedStep, attend_padded, plan_padded
from weft.config import ModelConfig


class ContiguousBackend(AttentionBackend[PaddedStep]):
    name = "contiguous"
    row_per_request = True

    @staticmethod
    def slab_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, cfg.L, num_blocks, cfg.H_kv, block_size, cfg.D)

    def plan(self, meta: AttentionMetadata) -> PaddedStep:
        return plan_padded(meta, self.cfg.sliding_window)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, step: PaddedStep) -> None:
        slots = step.meta.slot_mapping
        row, cursor = slots // self.block_size, slots % self.block_size
        self.kv_cache[0, layer][row, :, cursor] = k  # per-layer view [B, H_kv, S_max, D]
        self.kv_cache[1, layer][row, :, cursor] = v

    def attend(self, layer: int, q: torch.Tensor, step: PaddedStep, out: torch.Tensor | None = None) -> torch.Tensor:
        meta = step.meta
        rows, end = meta.block_tables[:, 0].long(), meta.max_context_len
        k = self.kv_cache[0, layer, :, :, :end][rows]  # [B, H_kv, S, D]
        v = self.kv_cache[1, layer, :, :, :end][rows]
        return attend_padded(q, k, v, step, self.scale, out, layer in self.cfg.window_layers, self.batch_invariant)
