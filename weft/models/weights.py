"""Copy a HuggingFace state dict into a weft model, fusing q/k/v and gate/up."""

from __future__ import annotations

import torch
from torch import nn

# weft's fused parameter -> the HF parameters it concatenates along dim 0, in order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@torch.no_grad()
def load_hf_weights(model: nn.Module, hf_state: dict[str, torch.Tensor]) -> None:
    """Fill every parameter of `model` from `hf_state`; a missing or misshapen weight is an error."""
    for name, param in model.named_parameters():  # a tied lm_head shares embed_tokens: listed once
        sources = _hf_names(name)
        missing = [s for s in sources if s not in hf_state]
        if missing:
            raise ValueError(f"checkpoint lacks {', '.join(missing)} (needed for weft's {name})")
        value = torch.cat([hf_state[s] for s in sources], dim=0)
        if value.shape != param.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape {tuple(param.shape)}")
        param.copy_(value)


def _hf_names(name: str) -> list[str]:
    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            return [name.replace(fused, part) for part in parts]
    return [name]
