"""A deliberately faulty backend, for the tests that prove a gate can fail."""

from __future__ import annotations

from weft.attention.paged import PagedBackend, write_paged


class OffByOneWrite(PagedBackend):
    """Writes each token's K/V one slot too far: the bug class paged caches are prone to."""

    name = "off-by-one"

    def write(self, layer, k, v, step):
        write_paged(self.kv_cache, layer, k, v, step.meta.slot_mapping + 1)
