"""Tensor parallelism: which slice of the model a rank holds, and the collectives between the slices.

Each of `size` ranks holds a slice of every layer (Megatron's split, as vLLM and nano-vllm do it):
q/k/v and gate/up split by output rows (heads, MLP columns), o and down by input columns, each of
those two followed by one all-reduce; the embedding and the LM head split by vocabulary rows. K/V
heads are split too, and replicated when there are fewer of them than ranks. Size 1 is the plain
model: every collective is then a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from weft.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def kv_heads(self, H_kv: int) -> tuple[int, int]:
        """This rank's (first K/V head, count): its share, or the one head its query heads read when there
        are fewer K/V heads than ranks."""
        return self.rank * H_kv // self.size, max(1, H_kv // self.size)

    def local(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes of this rank's slice (its heads, MLP columns and vocabulary rows)."""
        if self.size == 1:
            return cfg
        return replace(cfg, H_q=cfg.H_q // self.size, H_kv=self.kv_heads(cfg.H_kv)[1],
                       intermediate=cfg.intermediate // self.size, V=cfg.V // self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] of every rank -> [..., size * n], rank 0's columns first."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()


def check_tensor_parallel(size: int, cfg: ModelConfig) -> None:
    """ValueError unless `size` ranks can split `cfg` evenly (query heads, K/V heads, MLP, vocabulary)."""
    if size == 1:
        return
    if cfg.moe is not None:
        raise ValueError(f"tensor_parallel_size={size}: weft does not split a mixture of experts across ranks yet")
    counts = {"query heads": cfg.H_q, "MLP columns": cfg.intermediate, "vocabulary rows": cfg.V}
    for what, n in counts.items():
        if n % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {n} {what}")
    if cfg.H_kv % size and size % cfg.H_kv:
        raise ValueError(f"tensor_parallel_size={size} and the model's {cfg.H_kv} K/V heads: one must divide the "
                         "other (the heads are split, or replicated)")
