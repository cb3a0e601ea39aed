"""Fill a weft model from HF-named tensors, fusing q/k/v and gate/up as they stream in.

Every source of weights (safetensors files, an in-memory transformers model, seeded random
weights) is a stream of (HF name, tensor) pairs: each tensor is copied into its rows of weft's
parameter and dropped, so no second full copy of the model is ever held.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from weft.config import ModelConfig

# weft's fused parameter -> the HF parameters it stacks along dim 0, in order, with their rows
FUSED: dict[str, Callable[[ModelConfig], list[tuple[str, int]]]] = {
    "qkv_proj": lambda c: [("q_proj", c.H_q * c.D), ("k_proj", c.H_kv * c.D), ("v_proj", c.H_kv * c.D)],
    "gate_up_proj": lambda c: [("gate_proj", c.intermediate), ("up_proj", c.intermediate)],
}


@dataclass(frozen=True)
class Slot:
    """Where one HF tensor goes: rows [start, start + shape[0]) of weft's parameter `param`."""

    param: str
    start: int
    shape: tuple[int, ...]


def checkpoint_layout(model: nn.Module, cfg: ModelConfig) -> dict[str, Slot]:
    """HF tensor name -> its slot, for every tensor `model` needs (a tied lm_head needs none of its own)."""
    layout = {}
    for name, param in model.named_parameters():  # a tied lm_head shares embed_tokens: listed once
        fused = next((f for f in FUSED if f".{f}." in name), None)
        if fused is None:
            layout[name] = Slot(name, 0, tuple(param.shape))
            continue
        start = 0
        for part, rows in FUSED[fused](cfg):
            layout[name.replace(fused, part)] = Slot(name, start, (rows, *param.shape[1:]))
            start += rows
    return layout


@torch.no_grad()
def load_weights(model: nn.Module, cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy each (HF name, tensor) into `model`; a missing or misshapen weight is a ValueError.

    Names `model` does not use (a tied lm_head's copy, rotary tables of old checkpoints) are skipped.
    """
    layout = checkpoint_layout(model, cfg)
    params = dict(model.named_parameters())
    filled = set()
    for name, tensor in tensors:
        slot = layout.get(name)
        if slot is None:
            continue
        if tuple(tensor.shape) != slot.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != weft's {slot.shape}")
        params[slot.param].narrow(0, slot.start, slot.shape[0]).copy_(tensor)
        filled.add(name)
    missing = [name for name in layout if name not in filled]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ValueError(f"the checkpoint lacks {shown}")


def random_weights(
    layout: dict[str, Slot], std: float, seed: int, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random HF-named tensors as HF initializes them: norms 1, biases 0, the rest N(0, std).

    Each tensor has a generator of its own, seeded from `seed` and its name, so a tensor's values do
    not depend on which others exist; values are drawn in float32 and cast where they are copied.
    """
    for name, slot in layout.items():
        if "norm" in name:
            yield name, torch.ones(slot.shape, device=device)
        elif name.endswith(".bias"):
            yield name, torch.zeros(slot.shape, device=device)
        else:
            gen = torch.Generator(device).manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
            yield name, torch.randn(slot.shape, generator=gen, device=device).mul_(std)
