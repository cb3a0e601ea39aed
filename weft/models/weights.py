"""Fill a weft model from HF-named tensors, fusing q/k/v and gate/up as they stream in.

Every source of weights (safetensors files, an in-memory transformers model, seeded random
weights) is a stream of (HF name, tensor) pairs: each tensor is copied into its rows of weft's
parameter and dropped, so no second full copy of the model is ever held. A mixture of experts' parameters are
stacked [N, ...] as HF holds them in memory; a checkpoint on disk holds each expert's tensors apart, and each goes
into its expert's slice (`expert_piece`).
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from weft.config import ModelConfig
from weft.distributed import SINGLE, TensorParallel

# weft's fused parameter -> the HF parameters it stacks along dim 0, in order, with their rows
FUSED: dict[str, Callable[[ModelConfig], list[tuple[str, int]]]] = {
    "qkv_proj": lambda c: [("q_proj", c.H_q * c.D), ("k_proj", c.H_kv * c.D), ("v_proj", c.H_kv * c.D)],
    "gate_up_proj": lambda c: [("gate_proj", c.intermediate), ("up_proj", c.intermediate)],
}


# Unfused HF parameters a tensor-parallel rank holds a slice of: by vocabulary rows, or by input columns
ROW_SPLIT = ("embed_tokens", "lm_head")
COLUMN_SPLIT = ("o_proj.weight", "down_proj.weight")


@dataclass(frozen=True)
class Slot:
    """Where one HF tensor goes: its `part` (all of it if None) fills rows [start, ...) of weft's `param`."""

    param: str
    start: int
    shape: tuple[int, ...]  # the HF tensor's, whole
    part: tuple[int, int, int] | None = None  # (dim, start, length): the slice a tensor-parallel rank holds

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.part is None else tensor.narrow(*self.part)


def checkpoint_layout(model: nn.Module, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> dict[str, Slot]:
    """HF tensor name -> its slot, for every tensor `model` (`tp`'s slice of `cfg`) needs (a tied lm_head
    needs none of its own)."""
    layout, local = {}, tp.local(cfg)
    for name, param in model.named_parameters():  # a tied lm_head shares embed_tokens: listed once
        fused = next((f for f in FUSED if f".{f}." in name), None)
        if fused is None:
            layout[name] = _unfused(name, tuple(param.shape), tp)
            continue
        start = 0
        for (part, rows), (_, mine) in zip(FUSED[fused](cfg), FUSED[fused](local), strict=True):
            first = tp.kv_heads(cfg.H_kv)[0] * cfg.D if part in ("k_proj", "v_proj") else tp.rank * mine
            cut = (0, first, mine) if tp.size > 1 else None
            layout[name.replace(fused, part)] = Slot(name, start, (rows, *param.shape[1:]), cut)
            start += mine
    return layout


def _unfused(name: str, shape: tuple[int, ...], tp: TensorParallel) -> Slot:
    """The slot of a parameter of `shape` (this rank's) loaded from one HF tensor: whole, or split along a dim."""
    split = [dim for dim, names in ((0, ROW_SPLIT), (1, COLUMN_SPLIT)) if any(n in name for n in names)]
    if tp.size == 1 or not split:
        return Slot(name, 0, shape)
    dim = split[0]
    whole = tuple(n * tp.size if d == dim else n for d, n in enumerate(shape))
    return Slot(name, 0, whole, (dim, tp.rank * shape[dim], shape[dim]))


@torch.no_grad()
def load_weights(
    model: nn.Module, cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], tp: TensorParallel = SINGLE
) -> None:
    """Copy each (HF name, tensor), or `tp`'s slice of it, into `model`; a missing or misshapen weight, or a tensor
    `cfg` has no place for (q/k/v biases under a config without them, a layer or an expert past its count), is a
    ValueError naming it.

    A tied lm_head's copy of the embedding and old checkpoints' rotary tables are skipped: weft derives both.
    """
    layout = checkpoint_layout(model, cfg, tp)
    params = dict(model.named_parameters())
    filled, pieces = set(), Counter()
    for name, tensor in tensors:
        slot, expert = layout.get(name), None
        if slot is None and (found := expert_piece(name, layout)) is not None:
            slot, expert, stacked = found
            pieces[stacked] += 1
        if slot is None:
            if (name == "lm_head.weight" and cfg.tie_word_embeddings) or name.endswith(".rotary_emb.inv_freq"):
                continue
            raise ValueError(f"{name}: the checkpoint holds a tensor this {cfg.arch} config has no place for")
        if tuple(tensor.shape) != slot.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != weft's {slot.shape}")
        piece = slot.take(tensor)
        target = params[slot.param] if expert is None else params[slot.param][expert]
        target.narrow(0, slot.start, piece.shape[0]).copy_(piece)
        filled.add(name)
    # a stacked expert parameter is filled when each expert's pieces are: gate and up for gate_up_proj, down
    filled |= {name for name, n in pieces.items() if n == layout[name].shape[0] * (2 if "gate_up" in name else 1)}
    missing = [name for name in layout if name not in filled]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ValueError(f"the checkpoint lacks {shown}")


# Checkpoints on disk hold each expert's projections apart (HF saves them so); weft's parameters stack them
EXPERT_PIECE = re.compile(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def expert_piece(name: str, layout: dict[str, Slot]) -> tuple[Slot, int, str] | None:
    """A tensor `name` of one expert's gate, up or down projection -> (its slot within its expert's slice of the
    stacked parameter, the expert, the stacked parameter's HF name); None for any other name."""
    match = EXPERT_PIECE.fullmatch(name)
    if match is None:
        return None
    experts, expert, projection = match[1], int(match[2]), match[3]
    stacked = f"{experts}.{'down_proj' if projection == 'down' else 'gate_up_proj'}"
    whole = layout.get(stacked)
    if whole is None or expert >= whole.shape[0]:
        return None
    rows = whole.shape[1] if projection == "down" else whole.shape[1] // 2
    start = whole.shape[1] // 2 if projection == "up" else 0
    return Slot(whole.param, start, (rows, *whole.shape[2:])), expert, stacked


def random_weights(
    layout: dict[str, Slot], std: float, seed: int, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random HF-named tensors: norms 1 as HF initializes them, the rest N(0, std), biases too (HF's are 0:
    random ones are what a test of their use needs).

    Each tensor has a generator of its own, seeded from `seed` and its name, so a tensor's values do
    not depend on which others exist; values are drawn in float32 and cast where they are copied.
    """
    for name, slot in layout.items():
        if "norm" in name:
            yield name, torch.ones(slot.shape, device=device)
        else:
            gen = torch.Generator(device).manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
            yield name, torch.randn(slot.shape, generator=gen, device=device).mul_(std)
