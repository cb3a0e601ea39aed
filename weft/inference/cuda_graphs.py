"""CUDA graphs: the model forward replayed instead of launched kernel by kernel.

A step of a small model is a few thousand tiny kernels, and launching them from Python costs far
more than running them. So, once per pool, the forward is captured and then replayed (vLLM V1's
"FULL_AND_PIECEWISE"):

- `DecodeGraphs`, whole: a decode step's forward, attention included, per batch size (1, 2, 4, 8,
  then every 16 up to the largest batch the engine schedules), reading its inputs from static
  buffers. A decode step of B requests copies its inputs there, pads them to the next captured size
  and replays one graph. Padding rows write nothing (slot -1) and read one cached token, so they cost
  next to nothing and leave every real row's result alone.
- `MixedGraphs`, whole: a step of decodes beside at most MIXED_PREFILLS other requests (prompts,
  prefill chunks), per padded token count, where the backend's kernels read how many decodes and
  requests the step has from the device (`AttentionBackend.counts_steps`): each graph is planned for
  as many decodes as its tokens (up to the largest batch) and MIXED_PREFILLS more requests, and the
  programs past the step's counts exit. So a mixed step, too, is one replay, not L + 1 of them with
  the attention launched between.
- `PiecewiseGraphs`, everything but attention: any other step (more prefills, a backend that cannot
  count, deterministic mode) per padded token count, as L + 1 graphs cut at each layer's attention,
  which runs eagerly between them on the step's real tokens and metadata, whatever their mix of
  requests. Where the backend's slots are rows of its cache, the graphs' RoPE kernel stores each
  layer's K/V there, at slots the step copies in (padding rows: -1, stored nowhere), so the eager part
  only attends. Every op in the graphs works row by row, so padding rows (stale inputs of earlier
  steps) change no real row.
  While they are captured the model's attention is `AttentionCut`, which implements the model's
  `Attention` as a backend does, with static buffers in place of the cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic

import torch

from weft.attention.base import AttentionBackend, AttentionMetadata, CacheSlots, StepT
from weft.models.llama import LlamaForCausalLM
from weft.utils import cdiv

MAX_GRAPH_BATCH = 256  # larger decode batches run piecewise (eagerly under FULL_DECODE_ONLY)
MAX_GRAPH_TOKENS = 8192  # larger steps run eagerly: their GEMMs take longer than their launches
COUNTS = 4  # room for a mixed step's counts (AttentionBackend.step_counts)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The captured batch sizes, smallest first: 1, 2, 4, 8, 16, 32, 48, ... and max_batch."""
    ladder = [1, 2, 4, 8, *range(16, max_batch, 16)]
    return sorted({b for b in ladder if b < max_batch} | {max_batch})


def graph_token_counts(max_tokens: int) -> list[int]:
    """The token counts piecewise graphs are captured for, smallest first: 8, 16, ..., 256 (doubling),
    every 256 to 4096, every 512 beyond, and max_tokens. A step of more than 8 tokens is at most half
    padding, and one of over 2,048 (where the GEMMs' time grows with the rows) under an eighth."""
    ladder = [8, 16, 32, 64, 128, *range(256, 4096, 256), *range(4096, max_tokens, 512)]
    return sorted({t for t in ladder if t < max_tokens} | {max_tokens})


@dataclass
class StaticInputs:
    """The buffers every graph reads: rows [0, T) of the tokens' and [0, B) of the requests' serve a graph of T
    tokens and B requests (a decode graph's T = B)."""

    input_ids: torch.Tensor  # [T_max] int64
    positions: torch.Tensor  # [T_max] int64
    slot_mapping: torch.Tensor  # [T_max] int64; -1 on padding rows
    query_start_loc: torch.Tensor  # [B_max+1] int32: 0, 1, 2, ... (one token per request; a mixed step's copied)
    context_lens: torch.Tensor  # [B_max] int32; 1 on padding rows
    block_tables: torch.Tensor  # [B_max, max_blocks] int32: every entry a valid block
    decode_groups: torch.Tensor  # [B_max // 2, 3] int32: rows [0, B // 2) serve a graph with groups; 0 when empty
    shared_lens: torch.Tensor  # [B_max] int32; 0 outside the groups
    counts: torch.Tensor  # [COUNTS] int32: a mixed step's decodes, requests and more (AttentionMetadata.counts)
    max_context_len: int  # max_blocks * P: the longest context the table holds

    @classmethod
    def allocate(cls, B_max: int, max_blocks: int, P: int, device: torch.device, T_max: int | None = None
                 ) -> StaticInputs:
        T_max = B_max if T_max is None else T_max
        return cls(
            input_ids=torch.zeros(T_max, dtype=torch.int64, device=device),
            positions=torch.zeros(T_max, dtype=torch.int64, device=device),
            slot_mapping=torch.full((T_max,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(B_max + 1, dtype=torch.int32, device=device),
            context_lens=torch.ones(B_max, dtype=torch.int32, device=device),
            block_tables=torch.zeros(B_max, max_blocks, dtype=torch.int32, device=device),
            decode_groups=torch.zeros(B_max // 2, 3, dtype=torch.int32, device=device),
            shared_lens=torch.zeros(B_max, dtype=torch.int32, device=device),
            counts=torch.zeros(COUNTS, dtype=torch.int32, device=device),
            max_context_len=max_blocks * P,
        )

    def copy_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, size: int
                    ) -> None:
        """A step's T tokens into rows [0, T), padded to `size` with rows that store nothing."""
        T = input_ids.shape[0]
        self.input_ids[:T].copy_(input_ids)
        self.positions[:T].copy_(positions)
        self.slot_mapping[:T].copy_(slot_mapping)
        self.slot_mapping[T:size].fill_(-1)

    def mixed_meta(self, T: int, B: int) -> AttentionMetadata:
        """A mixed step of up to T tokens, B decodes and MIXED_PREFILLS more requests: what a mixed graph is planned
        for. The kernels read the step's own decodes and requests from `counts`."""
        R = B + MIXED_PREFILLS
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:T],
            query_start_loc=self.query_start_loc[: R + 1],
            context_lens=self.context_lens[:R],
            block_tables=self.block_tables[:R],
            max_query_len=T,
            max_context_len=self.max_context_len,
            num_decodes=B,
            counts=self.counts,
        )

    def meta(self, B: int, grouped: bool) -> AttentionMetadata:
        """A decode step over rows [0, B) whose contexts may be as long as the block table holds, with B // 2
        slots of groups if `grouped`: what it is planned for. The kernels read the real lengths and groups from
        `context_lens` and `decode_groups`."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:B],
            query_start_loc=self.query_start_loc[: B + 1],
            context_lens=self.context_lens[:B],
            block_tables=self.block_tables[:B],
            max_query_len=1,
            max_context_len=self.max_context_len,
            num_decodes=B,
            decode_groups=self.decode_groups[: B // 2] if grouped else None,
            shared_lens=self.shared_lens[:B] if grouped else None,
        )


@dataclass
class CapturedStep(Generic[StepT]):
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [B, E]: the graph's output
    step: StepT  # the backend's per-step state the graph reads (kept alive with it)


class DecodeGraphs(Generic[StepT]):
    """Decode forward passes of `model` over `attn`'s pool, captured per batch size."""

    def __init__(
        self, model: LlamaForCausalLM, attn: AttentionBackend[StepT], max_batch: int, max_model_len: int
    ) -> None:
        if not attn.cuda_graphs:
            raise ValueError(f"{attn.name} attention cannot be captured in CUDA graphs")
        self.model = model
        self.attn = attn
        self.sizes = graph_batch_sizes(min(max_batch, MAX_GRAPH_BATCH))
        max_blocks = cdiv(max_model_len, attn.block_size)
        self.inputs = StaticInputs.allocate(self.sizes[-1], max_blocks, attn.block_size, attn.kv_cache.device)
        self.captured: dict[tuple[int, bool], CapturedStep[StepT]] = {}  # by batch size, and whether with groups
        self.replays = 0
        self._capture()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def serves(self, meta: AttentionMetadata) -> bool:
        """Steps of decodes (no prompt token among them, where the backend attends by role)."""
        return meta.is_decode and not meta.num_prompt_tokens and meta.num_requests <= self.max_batch

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # the largest batch first, so that the smaller ones reuse its memory from the shared pool
        for B in reversed(self.sizes):
            for grouped in (False, True) if self.attn.shares_prefixes and B > 1 else (False,):
                meta = self.inputs.meta(B, grouped)
                self.captured[B, grouped] = capture(self.model, self.attn, self.inputs, B, meta, pool)
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
        x.copy_tokens(input_ids, positions, meta.slot_mapping, size)
        x.context_lens[:B].copy_(meta.context_lens)
        x.context_lens[B:size].fill_(1)
        x.block_tables[:B, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        grouped = meta.decode_groups is not None
        if grouped:
            G = meta.decode_groups.shape[0]
            x.decode_groups[:G].copy_(meta.decode_groups)
            x.decode_groups[G : size // 2].zero_()
            x.shared_lens[:B].copy_(meta.shared_lens)
            x.shared_lens[B:size].zero_()
        captured = self.captured[size, grouped]
        captured.graph.replay()
        self.replays += 1
        return captured.hidden[:B]


def capture(model: LlamaForCausalLM, attn: AttentionBackend[StepT], inputs: StaticInputs, T: int,
            meta: AttentionMetadata, pool: tuple[int, int]) -> CapturedStep[StepT]:
    """The forward of the first T tokens of `inputs` over `attn`, planned for `meta`, warmed up (its kernels compiled,
    its GEMMs picked) and captured in `pool`."""
    ids, positions, step = inputs.input_ids[:T], inputs.positions[:T], attn.plan(meta)
    model(ids, positions, attn, step)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        hidden = model(ids, positions, attn, step)
    return CapturedStep(graph, hidden, step)


MIXED_PREFILLS = 8  # the most requests besides decodes a mixed graph holds: a step with more runs piecewise


class MixedGraphs(Generic[StepT]):
    """Forward passes of `model` of up to max_tokens new tokens (MAX_GRAPH_TOKENS at most) over `attn`'s pool, whole,
    for steps of decodes and at most MIXED_PREFILLS other requests, captured per token count."""

    def __init__(self, model: LlamaForCausalLM, attn: AttentionBackend[StepT], max_tokens: int, max_batch: int,
                 max_model_len: int) -> None:
        if not attn.counts_steps:
            raise ValueError(f"{attn.name} attention cannot capture mixed steps whole")
        self.model = model
        self.attn = attn
        self.sizes = graph_token_counts(min(max_tokens, MAX_GRAPH_TOKENS))
        self.max_batch = min(max_batch, attn.max_decodes or max_batch)
        T_max, max_blocks = self.sizes[-1], cdiv(max_model_len, attn.block_size)
        self.inputs = StaticInputs.allocate(self.decodes(T_max) + MIXED_PREFILLS, max_blocks, attn.block_size,
                                            attn.kv_cache.device, T_max)
        self.captured: dict[int, CapturedStep[StepT]] = {}
        self.replays = 0
        self._capture()

    def decodes(self, T: int) -> int:
        """The decodes a graph of T tokens is planned for: as many as it has tokens, up to the largest batch."""
        return min(T, self.max_batch)

    def serves(self, meta: AttentionMetadata) -> bool:
        T = meta.slot_mapping.shape[0]
        return (T <= self.sizes[-1] and meta.num_requests - meta.num_decodes <= MIXED_PREFILLS
                and meta.num_decodes <= self.decodes(next(s for s in self.sizes if s >= T)))

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for T in reversed(self.sizes):  # the largest first, so that the smaller ones reuse its memory
            self.captured[T] = capture(self.model, self.attn, self.inputs, T,
                                       self.inputs.mixed_meta(T, self.decodes(T)), pool)
        torch.cuda.synchronize()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A step of T new tokens (`serves` it; inputs as the eager forward's) -> hidden [T, E], a view of the
        graph's output: use it before the next replay."""
        if self.attn.check_steps:
            self.attn.check(meta)
        T, R = input_ids.shape[0], meta.num_requests
        size = next(s for s in self.sizes if s >= T)
        x = self.inputs
        x.copy_tokens(input_ids, positions, meta.slot_mapping, size)
        x.query_start_loc[: R + 1].copy_(meta.query_start_loc)
        x.context_lens[:R].copy_(meta.context_lens)
        x.block_tables[:R, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        captured = self.captured[size]
        for i, count in enumerate(self.attn.step_counts(meta, captured.step)):
            x.counts[i].fill_(count)
        captured.graph.replay()
        self.replays += 1
        return captured.hidden[:T]


@dataclass
class Pieces:
    """One token count's forward, cut at attention: graphs[l] ends with layer l's q, k, v in the shared buffers
    (attention's inputs, which it writes its output beside), graphs[l + 1] begins by reading that output, and
    the last graph ends in `hidden`."""

    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # [T, E]
    stored: list[bool] = field(default_factory=list)  # per layer: its K/V stored in the cache by the graphs


@dataclass
class AttentionBuffers:
    """What eager attention reads and writes between pieces, shared by every layer and token count (their
    replays never interleave): rows [0, T) serve a step of T tokens."""

    q: torch.Tensor  # [T_max, H_q, D]
    k: torch.Tensor  # [T_max, H_kv, D]
    v: torch.Tensor  # [T_max, H_kv, D]
    out: torch.Tensor  # [T_max, H_q, D]
    rows: torch.Tensor  # [T_max] int64: 0, 1, 2, ...: token t's K/V at row t of k and v

    @classmethod
    def allocate(cls, T_max: int, H_q: int, H_kv: int, D: int, dtype: torch.dtype, device: torch.device
                 ) -> AttentionBuffers:
        def buffer(heads: int) -> torch.Tensor:
            return torch.zeros(T_max, heads, D, dtype=dtype, device=device)  # zeros: padding rows stay finite

        return cls(buffer(H_q), buffer(H_kv), buffer(H_kv), buffer(H_q), torch.arange(T_max, device=device))

    def first(self, T: int) -> AttentionBuffers:
        """Rows [0, T): a step of T tokens."""
        return AttentionBuffers(self.q[:T], self.k[:T], self.v[:T], self.out[:T], self.rows[:T])


class AttentionCut:
    """The model's `Attention` while it is captured piecewise: each layer's call leaves its q in the buffers, its
    k and v either in the cache, at the slots `store(layer)` gives (RoPE's kernel storing them, as in an eager
    step), or else in the buffers (the kernel storing them there as it would in a cache, at `cache_slots`); it ends
    the graph being captured and begins the next, and returns the output buffer, which the eager attention between
    the replays fills. With no graph pool it only runs: a warm-up. It has no step state (None)."""

    def __init__(self, buffers: AttentionBuffers, pool: tuple[int, int] | None,
                 store: Callable[[int], CacheSlots] | None = None) -> None:
        self.buffers, self.pool, self.store, self.pieces = buffers, pool, store, Pieces()
        self._begin()

    def _begin(self) -> None:
        if self.pool is not None:
            self.pieces.graphs.append(torch.cuda.CUDAGraph())
            self.pieces.graphs[-1].capture_begin(pool=self.pool)

    def end(self) -> None:
        if self.pool is not None:
            self.pieces.graphs[-1].capture_end()

    def cache_slots(self, layer: int, step: None) -> CacheSlots:
        """`store`'s slots in the cache, else the k and v buffers as the rows of a cache, token t's at row t."""
        self.pieces.stored.append(self.store is not None)
        if self.store is not None:
            return self.store(layer)
        b = self.buffers
        return CacheSlots(b.rows, b.k, b.v)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: None) -> torch.Tensor:
        self.pieces.stored.append(False)
        self.buffers.k.copy_(k)
        self.buffers.v.copy_(v)
        return self._cut(q)

    def attend(self, layer: int, q: torch.Tensor, step: None) -> torch.Tensor:
        return self._cut(q)

    def _cut(self, q: torch.Tensor) -> torch.Tensor:
        self.buffers.q.copy_(q)
        self.end()
        self._begin()
        return self.buffers.out


class PiecewiseGraphs(Generic[StepT]):
    """Forward passes of `model` of up to max_tokens new tokens (MAX_GRAPH_TOKENS at most), captured around
    `attn`'s attention per token count."""

    def __init__(self, model: LlamaForCausalLM, attn: AttentionBackend[StepT], max_tokens: int) -> None:
        self.model = model
        self.attn = attn
        self.sizes = graph_token_counts(min(max_tokens, MAX_GRAPH_TOKENS))
        T_max, cfg, cache = self.sizes[-1], attn.cfg, attn.kv_cache
        self.input_ids = torch.zeros(T_max, dtype=torch.int64, device=cache.device)
        self.positions = torch.zeros(T_max, dtype=torch.int64, device=cache.device)
        self.buffers = AttentionBuffers.allocate(T_max, cfg.H_q, cfg.H_kv, cfg.D, cache.dtype, cache.device)
        # where the graphs store K/V in the cache (backends whose slots are rows of it): -1 on padding rows
        self.slot_mapping = torch.full((T_max,), -1, dtype=torch.int64, device=cache.device)
        self.captured: dict[int, Pieces] = {}
        self.replays = 0
        self._capture()

    def serves(self, meta: AttentionMetadata) -> bool:
        return meta.slot_mapping.shape[0] <= self.sizes[-1]

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()  # captures must not run on the default stream
        for T in reversed(self.sizes):  # the largest first, so that the smaller ones reuse its memory
            ids, positions, buffers = self.input_ids[:T], self.positions[:T], self.buffers.first(T)
            store = self._store(T)
            self.model(ids, positions, AttentionCut(buffers, None, store), None)  # warm-up: compiles, picks GEMMs
            torch.cuda.synchronize()
            with torch.cuda.stream(stream):
                cut = AttentionCut(buffers, pool, store)
                try:
                    hidden = self.model(ids, positions, cut, None)
                except BaseException:  # end the capture left open, so that the stream and the process stay usable
                    with contextlib.suppress(RuntimeError):
                        cut.end()
                    raise
                cut.end()
            cut.pieces.hidden = hidden
            self.captured[T] = cut.pieces
        torch.cuda.synchronize()

    def _store(self, T: int) -> Callable[[int], CacheSlots] | None:
        """Where the graph of T tokens stores each layer's K/V: the cache's rows, at the first T of `slot_mapping`;
        None where the backend's slots are not rows of its cache."""
        if self.attn.cache_rows(0) is None:
            return None
        slots = self.slot_mapping[:T]
        return lambda layer: CacheSlots(slots, *self.attn.cache_rows(layer))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A step of T new tokens (`serves` it; inputs as the eager forward's) -> hidden [T, E], a view of the
        graphs' output: use it before the next replay."""
        T = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= T)
        pieces = self.captured[size]
        self.input_ids[:T].copy_(input_ids)
        self.positions[:T].copy_(positions)
        if any(pieces.stored):
            self.slot_mapping[:T].copy_(meta.slot_mapping)
            self.slot_mapping[T:size].fill_(-1)  # an earlier, longer step's slots
        step, b = self.attn.prepare(meta), self.buffers.first(T)
        for layer, graph in enumerate(pieces.graphs[:-1]):
            graph.replay()
            if pieces.stored[layer]:
                self.attn.attend(layer, b.q, step, b.out)
            else:
                self.attn.forward(layer, b.q, b.k, b.v, step, b.out)
        pieces.graphs[-1].replay()
        self.replays += 1
        return pieces.hidden[:T]
