"""Attention backends, by the name users pass as `LLM(attention=...)`."""

from __future__ import annotations

import torch

from weft.attention.base import AttentionBackend, AttentionMetadata
from weft.attention.contiguous import ContiguousBackend
from weft.attention.paged import PagedBackend

BACKENDS: dict[str, type[AttentionBackend]] = {
    ContiguousBackend.name: ContiguousBackend,
    PagedBackend.name: PagedBackend,
}
GPU_ONLY = {"triton"}  # runs under Triton's interpreter on the CPU, far too slowly to serve


def get_backend(name: str) -> type[AttentionBackend]:
    if name == "triton":
        from weft.attention.triton import TritonBackend

        return TritonBackend
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: choose from {', '.join(available_backends())}")
    return BACKENDS[name]


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backend names; `device` given: those that can serve on it."""
    names = [*BACKENDS, *GPU_ONLY]
    if device is not None and torch.device(device).type != "cuda":
        names = [n for n in names if n not in GPU_ONLY]
    return names


__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends", "get_backend"]
