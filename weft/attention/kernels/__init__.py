"""Triton kernels of the `triton` attention backend and their launchers."""

from weft.attention.kernels.decode import DecodeSplits, decode_attention
from weft.attention.kernels.prefill import GroupedRows, grouped_attention, prefill_attention, token_roles
from weft.attention.kernels.write import write_kv

__all__ = [
    "DecodeSplits", "GroupedRows", "decode_attention", "grouped_attention", "prefill_attention", "token_roles",
    "write_kv",
]
