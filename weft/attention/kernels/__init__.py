"""Triton kernels of the `triton` attention backend and their launchers."""

from weft.attention.kernels.decode import DecodeSplits, decode_attention
from weft.attention.kernels.prefill import grouped_attention, prefill_attention
from weft.attention.kernels.write import write_kv

__all__ = ["DecodeSplits", "decode_attention", "grouped_attention", "prefill_attention", "write_kv"]
