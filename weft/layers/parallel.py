"""The layers whose slices meet across tensor-parallel ranks (weft.distributed); plain layers at size 1."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from weft.distributed import TensorParallel
from weft.layers.linear import Linear


class RowParallelLinear(Linear):
    """A linear layer holding `in_features` of the input's columns: each rank's partial product summed by one
    all-reduce, the bias (whole on every rank) added once after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T_total, in_features] -> [T_total, out_features]"""
        if self.tp.size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding `num_embeddings` consecutive vocabulary rows: a rank looks up the ids in its rows,
    zeros for the rest, and one all-reduce assembles every id's row."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T_total] (of the whole vocabulary) -> [T_total, E]"""
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.tp.rank * self.num_embeddings
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(x)
