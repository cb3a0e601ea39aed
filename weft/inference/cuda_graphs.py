"""CUDA graphs for decode steps: the whole model forward replayed with one launch.

A decode step of a small model is a few thousand tiny kernels, and launching them from
Python costs far more than running them. So, once per pool, the forward pass is captured
for a ladder of batch sizes (1, 2, 4, 8, then every 16 up to the largest batch the engine
schedules), reading its inputs from static buffers. A decode step of B requests copies its
inputs into those buffers, pads them to the next captured size and replays that graph.
Padding rows write nothing (slot -1) and read one cached token, so they cost next to nothing
and leave every real row's result alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from weft.attention.base import AttentionBackend, AttentionMetadata
from weft.models.llama import LlamaForCausalLM
from weft.utils import cdiv

MAX_GRAPH_BATCH = 256  # larger decode batches run eagerly (their launches are amortized anyway)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The captured batch sizes, smallest first: 1, 2, 4, 8, 16, 32, 48, ... and max_batch."""
    ladder = [1, 2, 4, 8, *range(16, max_batch, 16)]
    return sorted({b for b in ladder if b < max_batch} | {max_batch})


@dataclass
class StaticInputs:
    """The buffers every graph reads: rows [0, B) of each serve a graph of batch B."""

    input_ids: torch.Tensor  # [B_max] int64
    positions: torch.Tensor  # [B_max] int64
    slot_mapping: torch.Tensor  # [B_max] int64; -1 on padding rows
    query_start_loc: torch.Tensor  # [B_max+1] int32: 0, 1, 2, ... (one token per request)
    context_lens: torch.Tensor  # [B_max] int32; 1 on padding rows
    block_tables: torch.Tensor  # [B_max, max_blocks] int32: every entry a valid block
    max_context_len: int  # max_blocks * P: the longest context the table holds

    @classmethod
    def allocate(cls, B_max: int, max_blocks: int, P: int, device: torch.device) -> StaticInputs:
        return cls(
            input_ids=torch.zeros(B_max, dtype=torch.int64, device=device),
            positions=torch.zeros(B_max, dtype=torch.int64, device=device),
            slot_mapping=torch.full((B_max,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(B_max + 1, dtype=torch.int32, device=device),
            context_lens=torch.ones(B_max, dtype=torch.int32, device=device),
            block_tables=torch.zeros(B_max, max_blocks, dtype=torch.int32, device=device),
            max_context_len=max_blocks * P,
        )

    def meta(self, B: int) -> AttentionMetadata:
        """A decode step over rows [0, B) whose contexts may be as long as the block table holds:
        what it is planned for. The kernels read the real lengths from `context_lens`."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:B],
            query_start_loc=self.query_start_loc[: B + 1],
            context_lens=self.context_lens[:B],
            block_tables=self.block_tables[:B],
            max_query_len=1,
            max_context_len=self.max_context_len,
            num_decodes=B,
        )


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [B, E]: the graph's output
    step: Any  # the backend's per-step state the graph reads (kept alive with it)


class DecodeGraphs:
    """Decode forward passes of `model` over `attn`'s pool, captured per batch size."""

    def __init__(self, model: LlamaForCausalLM, attn: AttentionBackend, max_batch: int, max_model_len: int) -> None:
        if not attn.cuda_graphs:
            raise ValueError(f"{attn.name} attention cannot be captured in CUDA graphs")
        self.model = model
        self.attn = attn
        self.sizes = graph_batch_sizes(min(max_batch, MAX_GRAPH_BATCH))
        max_blocks = cdiv(max_model_len, attn.block_size)
        self.inputs = StaticInputs.allocate(self.sizes[-1], max_blocks, attn.block_size, attn.kv_cache.device)
        self.captured: dict[int, CapturedStep] = {}
        self.replays = 0
        self._capture()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def serves(self, meta: AttentionMetadata) -> bool:
        return meta.is_decode and meta.num_requests <= self.max_batch

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # the largest batch first, so that the smaller ones reuse its memory from the shared pool
        for B in reversed(self.sizes):
            ids, positions = self.inputs.input_ids[:B], self.inputs.positions[:B]
            step = self.attn.plan(self.inputs.meta(B))
            self.model(ids, positions, self.attn, step)  # warm-up: compiles kernels, picks GEMMs
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, positions, self.attn, step)
            self.captured[B] = CapturedStep(graph, hidden, step)
        torch.cuda.synchronize()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A decode step of B <= max_batch requests (inputs as the eager forward's) -> hidden [B, E].

        The result is a view of the graph's output: use it before the next replay.
        """
        if self.attn.check_steps:
            self.attn.check(meta)
        B = meta.num_requests
        size = next(s for s in self.sizes if s >= B)
        x = self.inputs
        x.input_ids[:B].copy_(input_ids)
        x.positions[:B].copy_(positions)
        x.slot_mapping[:B].copy_(meta.slot_mapping)
        x.slot_mapping[B:size].fill_(-1)
        x.context_lens[:B].copy_(meta.context_lens)
        x.context_lens[B:size].fill_(1)
        x.block_tables[:B, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        captured = self.captured[size]
        captured.graph.replay()
        self.replays += 1
        return captured.hidden[:B]
