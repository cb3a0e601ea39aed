"""The paged slab, [2, L, N, P, H_kv, D]: blocks of P tokens handed out per request, each token's K/V at
row `slot_mapping[t]` of its layer's [N * P, H_kv, D] view (`PagedSlab`, which the triton backend shares);
and the paged backend over it: scatter via slot_mapping, gather by block_table into a padded copy (a sliding
window's layers: the window's keys only), then the same padded SDPA as the contiguous backend.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch

from weft.attention.base import AttentionBackend, AttentionMetadata, CacheSlots
from weft.attention.padded import KEY_TILE, PaddedStep, attend_padded, plan_padded
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
        W = self.cfg.sliding_window
        if W is None:
            return plan_padded(meta)
        # A window layer reads request b's keys from the first its first new token sees; batch-invariant, from the
        # start of the KEY_TILE that key is in, so attend_invariant's tiles fall where they would from position 0 (the
        # tiles left out would add exact zeros): the same bits. Masked positions before the window's first block
        # read that block again, so no block wholly behind the window is read.
        unit = KEY_TILE if self.batch_invariant else 1
        first = (meta.context_lens - meta.query_start_loc.diff() - W + 1).clamp(min=0).long()  # [B]
        start = first // unit * unit
        S_w = min(meta.max_context_len, meta.max_query_len + W - 1 + unit - 1)  # host ints: no sync
        keys = start[:, None] + torch.arange(S_w, device=start.device)  # [B, S_w] positions
        P, table = self.block_size, meta.block_tables.long()
        column = torch.maximum(keys // P, (first // P)[:, None]).clamp(max=table.shape[1] - 1)
        step = plan_padded(meta, W, start, S_w)
        step.window_slots = table.gather(1, column) * P + keys % P
        return step

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, step: PaddedStep) -> None:
        cache = self.cache_slots(layer, step)
        cache.k_rows[cache.slot_mapping] = k
        cache.v_rows[cache.slot_mapping] = v

    def attend(self, layer: int, q: torch.Tensor, step: PaddedStep, out: torch.Tensor | None = None) -> torch.Tensor:
        windowed = layer in self.cfg.window_layers
        if windowed:  # the window's keys only: [B, H_kv, S_w, D]
            k, v = (rows[step.window_slots].transpose(1, 2) for rows in self.cache_rows(layer))
        else:
            S, P = step.meta.max_context_len, self.block_size
            table = step.meta.block_tables[:, : -(-S // P)].long()  # [B, ceil(S / P)]
            # [B, H_kv, S, D]
            k, v = (self.kv_cache[i, layer][table].flatten(1, 2)[:, :S].transpose(1, 2) for i in (0, 1))
        return attend_padded(q, k, v, step, self.scale, out, windowed, self.batch_invariant)

