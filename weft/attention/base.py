"""The attention-backend interface: a backend owns its KV-cache slab and its attention math.

The runner builds one `AttentionMetadata` per step (flat tensors, shared by all L layers);
each backend derives its own per-step state from it once, in `prepare` (a backend is generic in
that state's type, `StepT`), and then every layer calls `forward`, which writes this step's K/V
into the slab and attends over it (or, where the backend gives its `cache_slots`, stores K/V in
the same kernel as RoPE and calls `attend`). `check`, which
refuses metadata that would read or write out of bounds (for the triton backend at the cost of
a host-device sync), runs on every step only with `check_steps` (WEFT_CHECK_STEPS=1): the runner
builds metadata that holds by construction, and the tests prove it does. A backend whose per-step
state has fixed shapes for a given batch size (`cuda_graphs`) can have its decode steps captured
in CUDA graphs: `DecodeGraphs` then calls `plan` once per graph (and `check` as `prepare` does).
"""

from __future__ import annotations

import math
import mmap
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch

from weft.config import ModelConfig


@dataclass
class AttentionMetadata:
    """One step's attention inputs for B requests and T_total new tokens.

    Requests are laid out back to back: the new tokens of request b are rows
    `query_start_loc[b]:query_start_loc[b+1]` of q/k/v, and they sit at the end of its
    sequence, so query row i of request b is at position `context_lens[b] - T_b + i`.
    The first `num_decodes` requests bring exactly one new token each (decodes come first,
    so a backend can send them to a decode kernel and the rest to a prefill kernel).
    """

    slot_mapping: torch.Tensor  # [T_total] int64: cache slot (block * P + offset) of each new token
    query_start_loc: torch.Tensor  # [B+1] int32: prefix sums of T over requests
    context_lens: torch.Tensor  # [B] int32: tokens of request b in the cache once this step has written
    block_tables: torch.Tensor  # [B, max_blocks] int32: blocks of request b in order, then any valid block ids
    max_query_len: int  # max T over requests (host int: no device sync needed)
    max_context_len: int  # max context_lens (host int)
    num_decodes: int  # leading requests with T = 1 (host int)
    # Groups of decodes that share their leading blocks (AttentionBackend.prefix_groups), None where there are none:
    decode_groups: torch.Tensor | None = None  # [G, 3] int32: a group's first decode, its members, its shared tokens
    shared_lens: torch.Tensor | None = None  # [B] int32: each request's shared tokens (0 outside the groups)
    # int32 on the device: the step's decodes, requests and what else the backend counts (AttentionBackend.step_counts),
    # where the host ints are the bounds a CUDA graph of mixed steps was planned for; None: the host ints are the step's
    counts: torch.Tensor | None = None
    # Where the backend attends by role (AttentionBackend.attends_by_role): how many of each request's new tokens, the
    # first ones, are prompt tokens (the rest are generated ones: decodes, or their recompute after a preemption)
    prompt_tokens: torch.Tensor | None = None  # [B] int32
    num_prompt_tokens: int = 0  # their sum (host int; 0 where roles are not told)

    @property
    def num_requests(self) -> int:
        return self.context_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every request brings exactly one new token."""
        return self.num_decodes == self.num_requests


@dataclass(frozen=True)
class CacheSlots:
    """Where one layer's new K/V go, for a kernel that stores them itself (weft.layers.fused.rotary_store):
    token t's H_kv * D values at row slot_mapping[t] of k_rows / v_rows (the kernels skip slots < 0, a CUDA
    graph's padding rows; an indexed copy, off the kernels, is never given one)."""

    slot_mapping: torch.Tensor  # [T_total] int64
    k_rows: torch.Tensor  # [N * P, H_kv, D], contiguous views of the cache
    v_rows: torch.Tensor


CHECK_STEPS = os.environ.get("WEFT_CHECK_STEPS", "") == "1"

StepT = TypeVar("StepT")  # a backend's per-step state


class AttentionBackend(ABC, Generic[StepT]):
    """A KV-cache slab of N blocks of P tokens for all L layers, and attention over it."""

    name: ClassVar[str]
    cuda_graphs: ClassVar[bool] = False  # decode steps can be captured (weft.inference.cuda_graphs)
    max_decodes: ClassVar[int | None] = None  # most decodes one step can hold, if bounded
    row_per_request: ClassVar[bool] = False  # a block is a request's whole row of max_model_len slots
    batch_invariant: bool = False  # EngineConfig.deterministic: a query's sums must not follow its batch

    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"{self.name}: need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.check_model(cfg)
        self.check_steps = CHECK_STEPS
        self.cfg = cfg
        self.num_blocks = num_blocks  # N
        self.block_size = block_size  # P
        self.scale = cfg.D**-0.5
        # zeros, not empty: padded reads multiply masked slots by 0, and 0 * NaN garbage is NaN
        self.kv_cache = zeros(self.slab_shape(cfg, num_blocks, block_size), dtype, device)

    @classmethod  # noqa: B027 (a backend that runs every model shape keeps this)
    def check_model(cls, cfg: ModelConfig) -> None:
        """Raises ValueError for a model shape this backend cannot run."""

    @staticmethod
    @abstractmethod
    def slab_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of the whole cache, K and V for every layer."""

    @classmethod
    def block_bytes(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block costs across K, V and all layers: what pool sizing divides by."""
        return 2 * cfg.L * block_size * cfg.H_kv * cfg.D * torch.empty((), dtype=dtype).element_size()

    @property
    def counts_steps(self) -> bool:
        """Whether it reads `AttentionMetadata.counts`, so that a CUDA graph planned for a mixed step's bounds serves
        any step within them (weft.inference.cuda_graphs.MixedGraphs)."""
        return False

    def step_counts(self, meta: AttentionMetadata, step: StepT) -> list[int]:
        """`meta`'s step's counts (AttentionMetadata.counts) for `step`, a mixed steps' CUDA graph's plan
        (`counts_steps`): its decodes, its requests, and what else the backend reads there."""
        return [meta.num_decodes, meta.num_requests]

    @property
    def attends_by_role(self) -> bool:
        """Whether prompt tokens and generated ones run kernels of their own, so the step tells them apart
        (AttentionMetadata.prompt_tokens)."""
        return False

    @property
    def shares_prefixes(self) -> bool:
        """Whether `prefix_groups` ever finds groups."""
        return False

    def prefix_groups(self, tables: list[list[int]], context_lens: list[int]) -> list[int]:
        """Groups of a step's decodes (their block tables and context lengths) whose attention reads the blocks
        they share once: [first, members, shared tokens] of each, flat (AttentionMetadata.decode_groups); none
        unless `shares_prefixes`."""
        return []

    def prepare(self, meta: AttentionMetadata) -> StepT:
        """Per-step state derived from `meta` once, before the L layers run; passed to `forward`."""
        if self.check_steps:
            self.check(meta)
        return self.plan(meta)

    def check(self, meta: AttentionMetadata) -> None:  # noqa: B027 (a backend with nothing to check keeps this)
        """Raises ValueError for metadata that would make this backend read or write out of bounds."""

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> StepT:
        """The per-step state of checked metadata (no device sync: it may be captured)."""

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepT,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T_total, H_q, D], k/v [T_total, H_kv, D] -> o [T_total, H_q, D], written into `out` when given (a
        piecewise graph's buffer); stores k/v first."""
        self.write(layer, k, v, step)
        return self.attend(layer, q, step, out)

    def cache_slots(self, layer: int, step: StepT) -> CacheSlots | None:
        """Where a kernel may store this step's K/V of `layer` itself, `attend` then following without `write`;
        None (the default) where slots are not rows of the cache."""
        return None

    def cache_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `layer`'s K and V as rows [N * P, H_kv, D], one per slot, where `cache_slots` gives slots (a
        piecewise graph's kernels store at slots of their own); None (the default) where it gives none."""
        return None

    @abstractmethod
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, step: StepT) -> None:
        """Store this step's k/v [T_total, H_kv, D] in layer `layer`'s cache."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, step: StepT, out: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of q [T_total, H_q, D] over each request's cached tokens -> o, in `out` if given."""


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On the CPU it views an anonymous memory map, which the kernel hands out
    zeroed and backs page by page as it is written: a pool of gigabytes costs nothing until used."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=dtype, count=numel).view(shape)
