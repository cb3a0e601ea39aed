"""A deliberately faulty backend, for the tests that prove a gate can fail."""

from __future__ import annotations

import torch

from weft.attention.base import CacheSlots
from weft.attention.paged import PagedBackend


class OffByOneWrite(PagedBackend):
    """Writes each token's K/V one slot too far: the bug class paged caches are prone to. Its slots are the
    one place both writes read (`write`'s indexed copy and the RoPE kernel's store)."""

    name = "off-by-one"

    def cache_slots(self, layer, step):
        cache = super().cache_slots(layer, step)
        slots = cache.slot_mapping
        # wrapped at the layer's end: a kernel's store past it would land in the next layer, or past the slab
        shifted = torch.where(slots >= 0, (slots + 1) % cache.k_rows.shape[0], slots)
        return CacheSlots(shifted, cache.k_rows, cache.v_rows)
