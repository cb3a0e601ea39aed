"""Triton backend: the paged slab [2, L, N, P, H_kv, D] (weft.attention.paged), read in place by Triton kernels.

Writes are RoPE's kernel's (`cache_slots`; in piecewise graphs too, at their own slots) or else one
kernel per layer (`write`, slots < 0 skipped). Reads follow the block table inside the kernels, so
nothing is gathered into a padded copy: a step's decodes (one new token each) run split-KV
flash-decoding, its other requests a causal flash-attention kernel over the cache; a mixed step
launches both, each on its own requests (in a mixed steps' CUDA graph, planned for more, both read the
step's counts of decodes and requests from the device, and their programs past them exit). In a
model's sliding-window layers both read only the window's keys. Decodes whose tables begin with the
same blocks (a request's n completions, a cached prompt prefix) are grouped, and a first kernel reads
each group's shared blocks once (weft.attention.kernels.decode.prefix_groups).

Batch-invariant (EngineConfig.deterministic), every request goes to `grouped_attention`, decodes as
requests of one new token: a step's prompt tokens to one launch, its generated tokens (decodes, and their
recompute after a preemption) to another, each role one compiled program (`grouped_rows`: wide for
prompts, narrow for decodes), a KV head's query heads in its rows, which folds a query's keys in tiles
of the same BLOCK_N from position 0, in order, one query row's sums never touching another's; whole-tile
and diagonal tiles differ only in a mask of what the row sees, and tiles past the row add exact zeros.
So a token's output is the same bits whether its step decodes it, prefills it whole or in a chunk of any
size, or after a cached prefix. The split decode kernel's split count follows the batch, so it is not
used there; nor are the groups, which follow the batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from weft.attention.base import AttentionMetadata
from weft.attention.kernels import (
    DecodeSplits,
    GroupedRows,
    decode_attention,
    grouped_attention,
    prefill_attention,
    token_roles,
    write_kv,
)
from weft.attention.kernels.decode import (
    TILE_TOKENS,
    SharedPrefixes,
    fills_half_a_wave,
    max_group_members,
    prefix_groups,
    resident_programs,
    tile_options,
)
from weft.attention.kernels.tiles import MAX_HEAD_DIM
from weft.attention.paged import PagedSlab
from weft.config import ModelConfig


@dataclass
class TritonStep:
    """Per-step state, built once per step (or once per CUDA graph) in `plan` and used by every layer."""

    meta: AttentionMetadata
    splits: DecodeSplits | None  # steps with decodes: the split of their contexts and its scratch
    shared: SharedPrefixes | None  # steps with groups of decodes: the groups and the shared kernel's scratch
    roles: list[GroupedRows] | None  # batch-invariant: its launches, a role's tokens each


class TritonBackend(PagedSlab[TritonStep]):
    name = "triton"
    cuda_graphs = True  # `plan` needs only host ints; the kernels read every length from device memory
    max_decodes = 65535  # the decode kernel's grid holds requests on its third axis

    @classmethod
    def check_model(cls, cfg: ModelConfig) -> None:
        """Any head dimension up to MAX_HEAD_DIM: the kernels pad it to a power of two >= 16."""
        if not 1 <= cfg.D <= MAX_HEAD_DIM:
            raise ValueError(f"triton: head dimension D must be in [1, {MAX_HEAD_DIM}], got {cfg.D}")

    @property
    def counts_steps(self) -> bool:
        """The split and prefill kernels read the counts; the batch-invariant kernel's grid is the step's own."""
        return not self.batch_invariant

    def step_counts(self, meta: AttentionMetadata, step: TritonStep) -> list[int]:
        """Decodes, requests, and the decodes' splits in the graph's (its own plan's count, under the graph's tiles)."""
        cfg = self.cfg
        splits = step.splits.step_splits(meta.num_decodes, cfg.H_q, cfg.H_kv, cfg.D, self.block_size,
                                         self.kv_cache.dtype, meta.max_context_len) if meta.num_decodes else 1
        return [meta.num_decodes, meta.num_requests, splits]

    @property
    def attends_by_role(self) -> bool:
        return self.batch_invariant

    @property
    def shares_prefixes(self) -> bool:
        return not self.batch_invariant and max_group_members(self.cfg.H_q, self.cfg.H_kv) > 1

    def prefix_groups(self, tables: list[list[int]], context_lens: list[int]) -> list[int]:
        """The decodes' groups, if there are enough of them to fill half the GPU (`fills_half_a_wave`)."""
        if not self.shares_prefixes:
            return []
        cfg = self.cfg
        groups = prefix_groups(tables, context_lens, self.block_size, max_group_members(cfg.H_q, cfg.H_kv))
        return groups if fills_half_a_wave(len(groups) // 3, cfg.H_kv, self._slots) else []

    @functools.cached_property
    def _slots(self) -> int:
        """How many programs of the split kernel, in shallow tiles, the GPU holds at once."""
        cfg, cache = self.cfg, self.kv_cache
        return resident_programs(cache.device, cache.dtype, cfg.H_q, cfg.H_kv, cfg.D, self.block_size,
                                 tile_options(cache.dtype)[-1])

    def plan(self, meta: AttentionMetadata) -> TritonStep:
        splits = shared = roles = None
        if self.batch_invariant:
            roles = token_roles(meta.query_start_loc, meta.context_lens, meta.prompt_tokens, meta.num_prompt_tokens,
                                meta.slot_mapping.shape[0])
        elif meta.num_decodes:
            cfg, cache, B = self.cfg, self.kv_cache, meta.num_decodes
            shape = (cfg.H_q, cfg.H_kv, cfg.D, self.block_size, cache.dtype)
            if meta.counts is None:
                splits = DecodeSplits.plan(B, *shape, meta.max_context_len, cache.device)
            else:  # each step's split count comes with its counts (step_counts)
                splits = DecodeSplits.plan_counted(B, *shape, cache.device)
            if meta.decode_groups is not None:
                shared = SharedPrefixes.plan(
                    meta.decode_groups, meta.shared_lens, B, *shape, meta.max_context_len, splits.tiles
                )
        return TritonStep(meta, splits, shared, roles)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, step: TritonStep) -> None:
        self._check_tokens("k", k, self.cfg.H_kv, step.meta)
        self._check_tokens("v", v, self.cfg.H_kv, step.meta)
        cache = self.cache_slots(layer, step)
        write_kv(k, v, cache.slot_mapping, cache.k_rows, cache.v_rows)

    def attend(self, layer: int, q: torch.Tensor, step: TritonStep, out: torch.Tensor | None = None) -> torch.Tensor:
        self._check_tokens("q", q, self.cfg.H_q, step.meta)
        meta = step.meta
        k_cache, v_cache = self.kv_cache[0, layer], self.kv_cache[1, layer]  # [N, P, H_kv, D]
        if out is None:  # zeros where a mixed steps' graph leaves padding rows unwritten: finite, for the MoE's router
            out = (torch.empty if meta.counts is None else torch.zeros)(q.shape, dtype=q.dtype, device=q.device)
        # Whole tensors, no slices: each kernel is told which requests are its own, so the
        # pointers (and Triton's specializations on their alignment) stay the same every step.
        table, ctx = meta.block_tables, meta.context_lens
        window = self.cfg.sliding_window if layer in self.cfg.window_layers else None
        if step.roles is not None:
            for launch in step.roles:
                grouped_attention(q, k_cache, v_cache, table, launch, self.scale, out, window)
            return out
        decodes = 0 if step.splits is None else meta.num_decodes
        if decodes:
            decode_attention(q, k_cache, v_cache, table, ctx, self.scale, step.splits, out, window, step.shared,
                             meta.counts)
        if decodes < meta.num_requests:
            prefill_attention(
                q, k_cache, v_cache, table, meta.query_start_loc, ctx, meta.max_query_len, self.scale, out,
                first_request=decodes, window=window, counts=meta.counts,
            )
        return out

    def _check_tokens(self, name: str, x: torch.Tensor, heads: int, meta: AttentionMetadata) -> None:
        """Host-side only: cheap enough for every layer."""
        want = (meta.slot_mapping.shape[0], heads, self.cfg.D)
        cache = self.kv_cache
        if tuple(x.shape) != want or x.dtype != cache.dtype or x.device != cache.device:
            raise ValueError(
                f"triton: {name} is {tuple(x.shape)} {x.dtype} on {x.device}, "
                f"the cache needs {want} {cache.dtype} on {cache.device}"
            )

    def check(self, meta: AttentionMetadata) -> None:
        """Refuses metadata that would make the kernels read outside the cache or the block table.

        One host-device sync per step, for all the device-side checks together.
        """
        B, N, P = meta.num_requests, self.num_blocks, self.block_size
        table, device = meta.block_tables, self.kv_cache.device
        tensors = (meta.slot_mapping, meta.query_start_loc, meta.context_lens, table)
        if any(t.device != device for t in tensors):
            raise ValueError(f"triton: the step's metadata must be on the cache's device {device}")
        if table.dim() != 2 or table.shape[0] != B or tuple(meta.query_start_loc.shape) != (B + 1,):
            raise ValueError(
                f"triton: block_tables {tuple(table.shape)} and query_start_loc "
                f"{tuple(meta.query_start_loc.shape)} do not match {B} requests"
            )
        blocks_needed = -(-meta.max_context_len // P)
        if blocks_needed > table.shape[1]:
            raise ValueError(
                f"triton: a context of {meta.max_context_len} tokens needs {blocks_needed} blocks of "
                f"{P} tokens, but block_tables has {table.shape[1]} columns"
            )
        if not 0 <= meta.num_decodes <= B:
            raise ValueError(f"triton: num_decodes {meta.num_decodes} is outside [0, {B}]")
        starts = meta.query_start_loc.long()
        q_lens, ctx = starts[1:] - starts[:-1], meta.context_lens.long()
        decode_q_lens = q_lens[: meta.num_decodes]
        bounds = [table.min(), table.max(), ctx.max(), (ctx - q_lens).min(), q_lens.min(), q_lens.max()]
        bounds += [meta.slot_mapping.min(), meta.slot_mapping.max(), decode_q_lens.ne(1).any()]
        prompt = meta.prompt_tokens  # None: every new token a generated one (token_roles)
        if (prompt is None and meta.num_prompt_tokens) or (prompt is not None and (
                tuple(prompt.shape) != (B,) or prompt.device != device or prompt.dtype != torch.int32)):
            raise ValueError(f"triton: {meta.num_prompt_tokens} prompt tokens need prompt_tokens [{B}] int32 on "
                             f"{device} (the roles)")
        if prompt is not None:
            prompt = prompt.long()
            bounds += [prompt.min(), (q_lens - prompt).min(), prompt.sum()]
        table_min, table_max, ctx_max, cached_min, q_min, q_max, slot_min, slot_max, decode_not_1, *roles = (
            torch.stack([x.long() for x in bounds]).tolist()
        )
        if roles and (roles[0] < 0 or roles[1] < 0 or roles[2] != meta.num_prompt_tokens):
            raise ValueError(f"triton: prompt_tokens must be each request's first new tokens, 0 to all of them, "
                             f"{meta.num_prompt_tokens} in all")
        if table_min < 0 or table_max >= N:
            bad = table_min if table_min < 0 else table_max
            raise ValueError(f"triton: block table entry {bad} is outside [0, {N})")
        if ctx_max > meta.max_context_len or q_max > meta.max_query_len:
            raise ValueError(
                f"triton: context_lens reach {ctx_max} and query lengths {q_max}, beyond "
                f"max_context_len {meta.max_context_len} / max_query_len {meta.max_query_len}"
            )
        if q_min < 1 or cached_min < 0:
            raise ValueError("triton: every request needs 1 <= new tokens <= its context length")
        if decode_not_1:
            raise ValueError(f"triton: the first num_decodes={meta.num_decodes} requests must bring one new token each")
        if slot_min < 0 or slot_max >= N * P:
            bad = slot_min if slot_min < 0 else slot_max
            raise ValueError(f"triton: slot {bad} is outside the cache's [0, {N * P})")
        if meta.decode_groups is not None:
            self._check_groups(meta)

    def _check_groups(self, meta: AttentionMetadata) -> None:
        """Each group: 2 or more of the decodes, whose tables begin with the blocks of its shared tokens, in whole tiles
        before each member's new token; shared_lens their shared tokens (0 outside the groups)."""
        ctx, tables, P = meta.context_lens.tolist(), meta.block_tables, self.block_size
        want, after = [0] * meta.num_requests, 0  # the first decode no group before holds
        for first, members, shared in meta.decode_groups.tolist():
            last = first + members - 1
            if first < after:
                raise ValueError(f"triton: group ({first}, {members}, {shared}) overlaps the one before it, or is "
                                 "out of order")
            after = last + 1
            if first < 0 or members < 2 or last >= meta.num_decodes or shared < 1 or shared % TILE_TOKENS:
                raise ValueError(f"triton: group ({first}, {members}, {shared}) is not 2 or more of the "
                                 f"{meta.num_decodes} decodes sharing whole tiles of {TILE_TOKENS} tokens")
            blocks = -(-shared // P)
            if min(ctx[first : last + 1]) <= shared or not tables[first : last + 1, :blocks].eq(
                    tables[first, :blocks]).all():
                raise ValueError(f"triton: the decodes {first}..{last} do not all share their first {shared} tokens")
            want[first : last + 1] = [shared] * members
        if meta.shared_lens is None or meta.shared_lens.tolist() != want:
            raise ValueError(f"triton: shared_lens must be each request's group's shared tokens, {want}")
