"""The paged slab, [2, L, N, P, H_kv, D]: blocks of P tokens handed out per request, each token's K/V at
row `slot_mapping[t]` of its layer's [N * P, H_kv, D] view (`PagedSlab`, which the triton backend shares);
and the paged backend over it: scatter via slot_mapping, gather by block_table into a padded copy, then the
same padded SDPA as the contiguous backend.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch

from weft.attention.base import AttentionBackend, AttentionMetadata, CacheSlots
from weft.attention.padded import PaddedStep, attend_padded, plan_padded
from weft.config import ModelConfig


class WithMeta(Protocol):
    meta: AttentionMetadata


SlabStepT = TypeVar("SlabStepT", bound=WithMeta)


class PagedSlab(AttentionBackend[SlabStepT]):
    """A backend over the paged slab; its step state holds the step's `meta` (the slots)."""

    @staticmethod
    def slab_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, cfg.L, num_blocks, block_size, cfg.H_kv, cfg.D)

    def cache_slots(self, layer: int, step: SlabStepT) -> CacheSlots:
        return CacheSlots(step.meta.slot_mapping, *self.cache_rows(layer))

    def cache_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the slab."""
        k_rows, v_rows = (self.kv_cache[i, layer].flatten(0, 1) for i in (0, 1))
        return k_rows, v_rows


class PagedBackend(PagedSlab[PaddedStep]):
    name = "paged"

    def plan(self, meta: AttentionMetadata) -> PaddedStep:
        return plan_padded(meta, self.cfg.sliding_window)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, step: PaddedStep) -> None:
        cache = self.cache_slots(layer, step)
        cache.k_rows[cache.slot_mapping] = k
        cache.v_rows[cache.slot_mapping] = v

    def attend(self, layer: int, q: torch.Tensor, step: PaddedStep, out: torch.Tensor | None = None) -> torch.Tensor:
        meta = step.meta
        S, P = meta.max_context_len, self.block_size
        table = meta.block_tables[:, : -(-S // P)].long()  # [B, ceil(S / P)]
        k = self.kv_cache[0, layer][table].flatten(1, 2)[:, :S].transpose(1, 2)  # [B, H_kv, S, D]
        v = self.kv_cache[1, layer][table].flatten(1, 2)[:, :S].transpose(1, 2)
        return attend_padded(q, k, v, step, self.scale, out, layer in self.cfg.window_layers, self.batch_invariant)

