"""Random paged-attention inputs and their float64 reference, for the kernel tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from weft.attention.base import AttentionMetadata

# ||out - ref|| / ||ref|| allowed per dtype (GPU.md): float32 products are exact ("ieee" dots).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="accesses are recorded through Triton's interpreter, which runs only off a GPU"
)


@dataclass
class PagedCase:
    """One step's inputs: B requests with T_b new tokens each, at the end of their contexts."""

    q: torch.Tensor  # [T_total, H_q, D]
    k_cache: torch.Tensor  # [N, P, H_kv, D]: NaN in every slot outside the contexts
    v_cache: torch.Tensor  # [N, P, H_kv, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32: shuffled blocks, padded with 0
    query_start_loc: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32
    slot_mapping: torch.Tensor  # [T_total] int64: slots of the new tokens

    def meta(self) -> AttentionMetadata:
        q_lens = self.query_start_loc.diff()
        return AttentionMetadata(
            self.slot_mapping, self.query_start_loc, self.context_lens, self.block_tables,
            int(q_lens.max()), int(self.context_lens.max()), num_decodes=int(q_lens.eq(1).cumprod(0).sum()),
        )


def make_case(
    H_q: int, H_kv: int, D: int, P: int, q_lens: list[int], context_lens: list[int],
    dtype: torch.dtype, device: torch.device | str, seed: int,
) -> PagedCase:
    """Fresh random q and cache; each request's blocks are drawn in shuffled order from N."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = [-(-c // P) for c in context_lens]
    N = sum(num_blocks) + 3  # a few blocks no request owns
    order = torch.randperm(N, generator=g)
    table = torch.zeros(len(context_lens), max(num_blocks) + 1, dtype=torch.int64)  # one padding column
    k_cache = torch.full((N * P, H_kv, D), float("nan"), dtype=dtype)
    v_cache = torch.full((N * P, H_kv, D), float("nan"), dtype=dtype)
    slots, first = [], 0
    for b, (t, c) in enumerate(zip(q_lens, context_lens, strict=True)):
        table[b, : num_blocks[b]] = order[first : first + num_blocks[b]]
        first += num_blocks[b]
        pos = torch.arange(c)
        slot = table[b, pos // P] * P + pos % P
        k_cache[slot] = torch.randn(c, H_kv, D, generator=g).to(dtype)
        v_cache[slot] = torch.randn(c, H_kv, D, generator=g).to(dtype)
        slots.append(slot[c - t :])
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    return PagedCase(
        q=torch.randn(int(starts[-1]), H_q, D, generator=g).to(dtype).to(device),
        k_cache=k_cache.view(N, P, H_kv, D).to(device),
        v_cache=v_cache.view(N, P, H_kv, D).to(device),
        block_tables=table.to(torch.int32).to(device),
        query_start_loc=starts.to(torch.int32).to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.cat(slots).to(device),
    )


def reference(case: PagedCase, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention in float64, request by request -> [T_total, H_q, D]; `window`: each query sees the
    `window` keys up to itself."""
    H_q, H_kv = case.q.shape[1], case.k_cache.shape[2]
    starts, ctx = case.query_start_loc.tolist(), case.context_lens.tolist()
    out = []
    for b, c in enumerate(ctx):
        q = case.q[starts[b] : starts[b + 1]].double()  # [T, H_q, D]
        blocks = case.block_tables[b].long()
        # [c, H_q, D]; the keys outside a window may be poisoned (NaN), and weigh 0
        k = case.k_cache[blocks].flatten(0, 1)[:c].double().nan_to_num().repeat_interleave(H_q // H_kv, 1)
        v = case.v_cache[blocks].flatten(0, 1)[:c].double().nan_to_num().repeat_interleave(H_q // H_kv, 1)
        s = torch.einsum("thd,shd->hts", q, k) * scale
        q_pos = c - q.shape[0] + torch.arange(q.shape[0], device=q.device)
        keys = torch.arange(c, device=q.device)
        unseen = (keys > q_pos[:, None]) | (keys <= q_pos[:, None] - (window or c + 1))
        s = s.masked_fill(unseen, float("-inf"))
        out.append(torch.einsum("hts,shd->thd", s.softmax(-1), v))
    return torch.cat(out)


def poison_outside(case: PagedCase, window: int) -> None:
    """NaN into every cached key and value that no new token of its request sees within `window`: a kernel that
    reads one (instead of skipping it) writes NaN."""
    P = case.k_cache.shape[1]
    starts, ctx = case.query_start_loc.tolist(), case.context_lens.tolist()
    for b, c in enumerate(ctx):
        unseen = torch.arange(max(c - (starts[b + 1] - starts[b]) - window + 1, 0))
        blocks = case.block_tables[b].long()[unseen // P]
        case.k_cache[blocks, unseen % P] = float("nan")
        case.v_cache[blocks, unseen % P] = float("nan")


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Every element written (the output was NaN-poisoned) and within the dtype's tolerance."""
    assert out.isfinite().all(), f"{(~out.isfinite()).sum().item()} output elements unwritten or not finite"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err <= TOLERANCE[out.dtype], f"relative error {err:.3g} > {TOLERANCE[out.dtype]:g}"


def padded_view(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., D] copied into a NaN tensor [..., width] and returned as its view [..., :D]: a kernel
    that touched a lane d >= D of a head would land in that tensor's NaN gap, not in the next head."""
    wide = torch.full((*x.shape[:-1], width), float("nan"), dtype=x.dtype, device=x.device)
    wide[..., : x.shape[-1]] = x
    return wide[..., : x.shape[-1]]


@contextlib.contextmanager
def recorded_accesses() -> Iterator[list[np.ndarray]]:
    """The addresses of every element loaded or stored (masked-off lanes excluded) by kernels run
    inside, through Triton's interpreter (so on the CPU only)."""
    from triton.runtime import interpreter

    accesses: list[np.ndarray] = []
    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def recording_load(self, ptrs, mask, *args):
        accesses.append(ptrs.data[mask.data].ravel())
        return load(self, ptrs, mask, *args)

    def recording_store(self, ptrs, value, mask, *args):
        accesses.append(ptrs.data[mask.data].ravel())
        return store(self, ptrs, value, mask, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builder, "create_masked_load", recording_load)
        patch.setattr(builder, "create_masked_store", recording_store)
        yield accesses


def assert_in_bounds(accesses: list[np.ndarray], tensors: list[torch.Tensor], heads: list[torch.Tensor]) -> None:
    """Every access lies in one of `tensors` or `heads`; in `heads` (views from `padded_view`, their
    last dimension D of stride 1 inside rows of stride(-2)) only on lanes below D."""
    left = np.concatenate(accesses).astype(np.int64)
    assert left.size, "no accesses recorded"
    for i, t in enumerate([*heads, *tensors]):
        start = t.untyped_storage().data_ptr()
        inside = (left >= start) & (left < start + t.untyped_storage().nbytes())
        if i < len(heads):
            lane = (left[inside] - start) // t.element_size() % t.stride(-2)
            beyond = np.unique(lane[lane >= t.shape[-1]]).tolist()
            assert not beyond, f"touched lanes {beyond} of a head of D = {t.shape[-1]}"
        left = left[~inside]
    assert not left.size, f"{left.size} accesses outside every tensor the kernel was given"
