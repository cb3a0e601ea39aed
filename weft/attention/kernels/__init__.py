"""Triton kernels of the `triton` attention backend and their launchers."""

from weft.attention.kernels.decode import DecodeSplits, decode_attention
from weft.attention.kernels.prefill import prefill_attention

__all__ = ["DecodeSplits", "decode_attention", "prefill_attention"]
