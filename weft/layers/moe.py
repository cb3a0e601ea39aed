"""Qwen3-MoE's sparse MLP: a router picks each token's top_k experts, each a SwiGLU, and sums their outputs weighted
by the router's probabilities, as HF's Qwen3MoeSparseMoeBlock does.

On CUDA the router's softmax, top-k and renormalising are one Triton kernel, and the experts run as two Triton
kernels over all of a layer's (token, expert) pairs at once, with or without the other fused layer kernels
(EngineConfig.enable_fused_layers), the first gate and up together with SiLU(gate) x up in its epilogue, the second
down with the router weight in its epilogue. Many pairs (a prefill, a large batch) are grouped by expert on the
device (no host sync, so CUDA graphs can hold it), each block of BLOCK_M pairs of one expert multiplying its tokens
by that expert's weights: an expert's weights are read once per block. Few pairs (a small batch's decode: at most
PAIR_ROWS) run a program per pair and slice of columns, reading its expert's weights directly, and the last of a
token's down programs to finish sums its pairs: no grouping pass and no sum after, which at batch 1 cost more than
the experts' GEMMs (results/HISTORY.md); their routing, the router's matmul included, is one launch too.
Elsewhere (and as their reference) the same arithmetic runs in PyTorch ops on each pair's gathered expert weights:
memory T * top_k * 3 * I_e * E, for tests and tiny models on the CPU.

Rounding follows HF's: each projection is rounded to the activations' dtype, SiLU(gate) before the multiply by up,
the router weight multiplied after down, a token's pairs summed in top-k order (as HF's default grouped_mm
experts do). The router's softmax and top-k are float32, its weights rounded to the activations' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from weft.config import MoEConfig
from weft.layers import fused
from weft.layers.fused import dependent_launch, follow, silu_times
from weft.layers.linear import COUNTERS, Linear, arrival_counters


class Experts(nn.Module):
    """num_experts SwiGLUs, stacked as HF stores them in memory: gate_up_proj [N, 2 I_e, E] (gate's rows, then up's),
    down_proj [N, E, I_e]."""

    def __init__(self, E: int, moe: MoEConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate, E))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, E, moe.intermediate))


class SparseMoE(nn.Module):
    def __init__(self, E: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = Linear(E, moe.num_experts, bias=False)  # the router
        self.experts = Experts(E, moe)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, E] -> (weights [T, top_k] in x's dtype, expert ids [T, top_k] int64)."""
        logits = self.gate(x)  # [T, N]
        if fused.on_kernels(x):
            return route_kernel(logits, self.moe.top_k, self.moe.norm_topk_prob)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, E] -> [T, E]"""
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        T, k = x.shape[0], self.moe.top_k
        if fused.on_kernels(x) and runs_pairs(T, k, x.shape[1]):
            weights, ids = router_kernel(x, self.gate.weight, k, self.moe.norm_topk_prob)
            return pair_experts(x, gate_up, down, weights, ids)
        weights, ids = self.route(x)
        run = fused_experts if fused.on_kernels(x) else experts_reference
        return run(x, gate_up, down, weights, ids).view(T, k, -1).sum(dim=1)


@triton.jit
def _route_row(z, col, weights_ptr, ids_ptr, t, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, BLOCK: tl.constexpr,
               NORM: tl.constexpr):
    """Token t's routing from its logits z [BLOCK] float32 (-inf past N) at ids col: its top_k experts by logit (the
    softmax's order; equal logits by the lower id) and their softmax probabilities in float32 (renormalised over
    the top_k: NORM), rounded to the weights' dtype, stored in row t of weights and ids [T, top_k]."""
    top = tl.max(z, 0)
    total = tl.sum(tl.exp(z - top), 0)
    slot = tl.arange(0, TOP_K_P2)
    picked = tl.zeros([TOP_K_P2], tl.float32)
    ids = tl.zeros([TOP_K_P2], tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(z, 0)
        at = tl.min(tl.where(z == best, col, BLOCK), 0)
        picked = tl.where(slot == j, tl.math.div_rn(tl.exp(best - top), total), picked)
        ids = tl.where(slot == j, at, ids)
        z = tl.where(col == at, float("-inf"), z)
    if NORM:
        picked = tl.math.div_rn(picked, tl.sum(picked, 0))
    mine = slot < TOP_K
    tl.store(weights_ptr + t * TOP_K + slot, picked.to(weights_ptr.dtype.element_ty), mask=mine)
    tl.store(ids_ptr + t * TOP_K + slot, ids, mask=mine)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, N, stride_t, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr,
                  BLOCK: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    """One token a program: its routing (`_route_row`) from its row of logits."""
    follow(PDL)
    t = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    z = tl.load(logits_ptr + t * stride_t + col, mask=col < N, other=float("-inf")).to(tl.float32)
    _route_row(z, col, weights_ptr, ids_ptr, t, TOP_K, TOP_K_P2, BLOCK, NORM)


def route_kernel(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`SparseMoE.route` after the router's matmul, in one launch: logits [T, N] -> (weights [T, top_k] in logits'
    dtype, ids [T, top_k] int64)."""
    T, N = logits.shape
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, weights, ids, N, logits.stride(0), TOP_K=top_k,
                            TOP_K_P2=triton.next_power_of_2(top_k), BLOCK=triton.next_power_of_2(N), NORM=norm,
                            **dependent_launch(logits.device))
    return weights, ids


def experts_reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x [T, E], gate_up [N, 2 I_e, E], down [N, E, I_e], weights and ids [T, top_k] -> each pair's weighted output
    [T * top_k, E] (pair t * top_k + j: token t's j-th expert), in PyTorch ops."""
    I_e, k = down.shape[2], ids.shape[1]
    flat = ids.flatten()
    xs = x.repeat_interleave(k, dim=0)[:, None, :]  # [P, 1, E]
    h = torch.bmm(xs, gate_up[flat].transpose(1, 2))[:, 0]  # [P, 2 I_e]
    h = F.silu(h[:, :I_e]) * h[:, I_e:]
    return torch.bmm(h[:, None, :], down[flat].transpose(1, 2))[:, 0] * weights.reshape(-1, 1)


GROUP_TILE = 128  # pairs the grouping kernels take at a time
GROUP_CHUNK = 256  # pairs a grouping program counts and places: a large batch's or a prefill's spread over programs


@triton.jit
def _chunk_counts(ids_ptr, chunk, P, EXPERTS_P2: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr):
    """Each expert's pairs among the chunk's CHUNK pairs [EXPERTS_P2] int32."""
    experts = tl.arange(0, EXPERTS_P2)
    counts = tl.zeros([EXPERTS_P2], tl.int32)
    for first in range(chunk * CHUNK, chunk * CHUNK + CHUNK, TILE):
        p = first + tl.arange(0, TILE)
        e = tl.load(ids_ptr + p, mask=p < P, other=-1)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), 0)
    return counts


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, P, EXPERTS_P2: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr):
    """Program c: each expert's pairs in chunk c -> row c of counts [chunks, EXPERTS_P2]."""
    chunk = tl.program_id(0)
    counts = _chunk_counts(ids_ptr, chunk, P, EXPERTS_P2, CHUNK, TILE)
    tl.store(counts_ptr + chunk * EXPERTS_P2 + tl.arange(0, EXPERTS_P2), counts)


@triton.jit
def _group_kernel(
    ids_ptr, counts_ptr, pairs_ptr, block_expert_ptr, P, NUM_EXPERTS, NUM_BLOCKS, NUM_CHUNKS,
    BLOCK_M: tl.constexpr, EXPERTS_P2: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
    COUNTED: tl.constexpr,
):
    """Program c: lay out each expert's padded group from every chunk's counts (`_count_kernel`'s; COUNTED=False:
    one chunk, counted here), place each pair of chunk c at its group's start plus the pairs of its expert before it
    (in earlier chunks, then earlier in its own: each group keeps pair order); program 0 names each block's
    expert."""
    chunk = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_P2)
    if COUNTED:
        totals = tl.zeros([EXPERTS_P2], tl.int32)
        before = tl.zeros([EXPERTS_P2], tl.int32)  # this chunk's group offsets: the earlier chunks' pairs
        for first in range(0, NUM_CHUNKS, TILE):
            rows = first + tl.arange(0, TILE)
            counts = tl.load(counts_ptr + rows[:, None] * EXPERTS_P2 + experts[None, :],
                             mask=(rows < NUM_CHUNKS)[:, None], other=0)
            totals += tl.sum(counts, 0)
            before += tl.sum(tl.where((rows < chunk)[:, None], counts, 0), 0)
    else:
        totals = _chunk_counts(ids_ptr, chunk, P, EXPERTS_P2, CHUNK, TILE)
        before = tl.zeros([EXPERTS_P2], tl.int32)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    placed = ends - padded + before  # each group's next free slot for this chunk's pairs
    for first in range(chunk * CHUNK, chunk * CHUNK + CHUNK, TILE):
        p = first + tl.arange(0, TILE)
        e = tl.load(ids_ptr + p, mask=p < P, other=-1)
        mine = (e[:, None] == experts[None, :]).to(tl.int32)  # [TILE, EXPERTS_P2]
        earlier = tl.cumsum(mine, 0) - mine  # the tile's earlier pairs of the same expert
        slot = tl.sum(mine * (placed[None, :] + earlier), 1)
        tl.store(pairs_ptr + slot, p.to(tl.int64), mask=p < P)
        placed += tl.sum(mine, 0)
    if chunk == 0:  # block b's expert: the groups that end at or before its first slot (NUM_EXPERTS past the last)
        real = experts < NUM_EXPERTS
        for first in range(0, NUM_BLOCKS, TILE):
            b = first + tl.arange(0, TILE)
            ended = (ends[None, :] <= (b * BLOCK_M)[:, None]) & real[None, :]
            tl.store(block_expert_ptr + b, tl.sum(ended.to(tl.int64), 1), mask=b < NUM_BLOCKS)


def group_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, top_k] -> (pairs [M] int64: the (token, expert) pairs p = t * top_k + j grouped by expert, each
    expert's in pair order, its group padded to a multiple of block_m with P = T * top_k (a pair that writes
    nowhere); each block's expert [M / block_m] int64, num_experts for blocks past the last group). M = (cdiv(P,
    block_m) + num_experts) * block_m bounds the padded groups whatever the routing, so the sizes are fixed by T
    alone. Up to GROUP_CHUNK pairs, one program after the fill; more, a program per chunk to count and one to place
    (each chunk's pairs after the earlier chunks'). No host sync: CUDA graphs hold it."""
    flat = ids.flatten()
    P = flat.numel()
    blocks = triton.cdiv(P, block_m) + num_experts
    chunks = max(1, triton.cdiv(P, GROUP_CHUNK))  # one at least: program 0 names the blocks
    experts_p2 = triton.next_power_of_2(num_experts)
    pairs = torch.full((blocks * block_m,), P, dtype=torch.int64, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int64, device=ids.device)
    counts = torch.empty(chunks, experts_p2, dtype=torch.int32, device=ids.device)
    launch = dict(EXPERTS_P2=experts_p2, CHUNK=GROUP_CHUNK, TILE=GROUP_TILE, num_warps=8)
    if chunks > 1:
        _count_kernel[(chunks,)](flat, counts, P, **launch)
    _group_kernel[(chunks,)](flat, counts, pairs, block_expert, P, num_experts, blocks, chunks, BLOCK_M=block_m,
                             COUNTED=chunks > 1, **launch)
    return pairs, block_expert


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, pairs_ptr, block_expert_ptr, h_ptr, P, TOP_K, NUM_EXPERTS, E, I_e, stride_xt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    block, col_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_EXPERTS:
        return
    pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = pair < P
    token = pair // TOP_K
    col = col_block * BLOCK_N + tl.arange(0, BLOCK_N)  # of I_e
    col_ok = col < I_e
    w = w_ptr + expert.to(tl.int64) * 2 * I_e * E
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, E, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < E
        a = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w + col[None, :] * E + k[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(w + (I_e + col[None, :]) * E + k[:, None], mask=w_mask, other=0.0)
        gate = tl.dot(a, wg, gate, input_precision=PRECISION)
        up = tl.dot(a, wu, up, input_precision=PRECISION)
    dtype = h_ptr.dtype.element_ty
    h = silu_times(gate.to(dtype), up.to(dtype), dtype)  # each projection rounded first, as HF's
    tl.store(h_ptr + pair[:, None].to(tl.int64) * I_e + col[None, :], h, mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, weights_ptr, pairs_ptr, block_expert_ptr, y_ptr, P, NUM_EXPERTS, E, I_e,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    block, col_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_EXPERTS:
        return
    pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < P
    row = pair.to(tl.int64)
    col = col_block * BLOCK_N + tl.arange(0, BLOCK_N)  # of E
    col_ok = col < E
    w = w_ptr + expert.to(tl.int64) * E * I_e
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I_e, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < I_e
        a = tl.load(h_ptr + row[:, None] * I_e + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + col[None, :] * I_e + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    dtype = y_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + row, mask=valid, other=0.0).to(tl.float32)
    y = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    tl.store(y_ptr + row[:, None] * E + col[None, :], y, mask=valid[:, None] & col_ok[None, :])


def fused_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """`experts_reference` in two Triton kernels: x [T, E], gate_up [N, 2 I_e, E], down [N, E, I_e] (contiguous),
    weights and ids [T, top_k] -> each pair's weighted output [T * top_k, E]."""
    return expert_kernels(x, gate_up, down, weights, *kernel_groups(ids, gate_up.shape[0]))


def kernel_groups(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_pairs` of ids [T, top_k] in the kernels' blocks: 16 pairs for up to 1,024 pairs (decode: few pairs per
    expert), else 64 (prefill: fewer weight re-reads)."""
    return group_pairs(ids, num_experts, 16 if ids.numel() <= 1024 else 64)


def expert_kernels(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, pairs: torch.Tensor,
    block_expert: torch.Tensor,
) -> torch.Tensor:
    """`fused_experts`' two kernels over pairs already grouped (`kernel_groups`: pairs [M], block_expert
    [M / block_m]): x [T, E], gate_up [N, 2 I_e, E], down [N, E, I_e], weights [T, top_k] -> [T * top_k, E]."""
    (T, E), (N, _, I_e), k = x.shape, down.shape, weights.shape[1]
    assert x.stride(1) == 1 and gate_up.is_contiguous() and down.is_contiguous()
    P, block_m = T * k, pairs.numel() // block_expert.numel()  # group_pairs' blocks are block_m pairs each
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 exactly; 16-bit inputs ignore it
    h = torch.empty(P, I_e, dtype=x.dtype, device=x.device)
    grid = (block_expert.numel(), triton.cdiv(I_e, 64))
    _gate_up_kernel[grid](x, gate_up, pairs, block_expert, h, P, k, N, E, I_e, x.stride(0),
                          BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, PRECISION=precision,
                          enable_fp_fusion=False)
    y = torch.empty(P, E, dtype=x.dtype, device=x.device)
    grid = (block_expert.numel(), triton.cdiv(E, 64))
    _down_kernel[grid](h, down, weights.reshape(-1).contiguous(), pairs, block_expert, y, P, N, E, I_e,
                       BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, PRECISION=precision, enable_fp_fusion=False)
    return y


PAIR_ROWS = 16  # the most (token, expert) pairs `pair_experts` runs; more are grouped by expert first


@dataclass(frozen=True)
class PairLaunch:
    """A pair kernel's program: block_n columns, K in steps of block_k, its products summed along K at the end
    (tl.sum, not tl.dot: one row per pair), num_warps warps."""

    block_n: int
    block_k: int
    num_warps: int


# The fastest of a sweep over (block_n, block_k, num_warps) at batch 1 on an H100, each kernel on its own
# (results/logs/h100_session8.log): gate_up 18.8 us for a 16.5 us floor, down 11.5 us for 8.3.
PAIR_GATE_UP = PairLaunch(16, 256, 8)
PAIR_DOWN = PairLaunch(16, 128, 8)


def runs_pairs(T: int, top_k: int, E: int) -> bool:
    """Whether `pair_experts` takes T tokens' top_k pairs each, of hidden size E: at most PAIR_ROWS pairs, and an
    arrival counter for each (token, column block)."""
    return T * top_k <= PAIR_ROWS and T * triton.cdiv(E, PAIR_DOWN.block_n) <= COUNTERS


@triton.jit
def _row_times(x_ptr, w_ptr, cols, col_ok, k, k_ok, stride_w, acc):
    """acc [BLOCK_N, BLOCK_K] + the row x[k] times w[cols, k], elementwise in float32 (summed along K later)."""
    w = tl.load(w_ptr + cols[:, None] * stride_w + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
    return acc + w.to(tl.float32) * tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _router_kernel(x_ptr, w_ptr, logits_ptr, counters_ptr, weights_ptr, ids_ptr, N, E, stride_xt,
                   TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program (token, block of ROWS experts): those experts' logits, rounded to x's dtype as the router's matmul
    rounds them; the last of the token's programs to finish routes it (`_route_row`) from all N, counted by an
    arrival counter per token."""
    t, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    follow(PDL)
    rows = block * ROWS + tl.arange(0, ROWS)
    rows_ok = rows < N
    acc = tl.zeros([ROWS, BLOCK_K], tl.float32)
    for k0 in range(0, E, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        acc = _row_times(x_ptr + t * stride_xt, w_ptr, rows, rows_ok, k, k < E, E, acc)
    tl.store(logits_ptr + t * N + rows, tl.sum(acc, 1).to(logits_ptr.dtype.element_ty), mask=rows_ok)
    tl.debug_barrier()  # every thread's logits are stored before the arrival counts
    if tl.atomic_add(counters_ptr + t, 1, sem="acq_rel") == tl.num_programs(1) - 1:
        col = tl.arange(0, BLOCK)
        z = tl.load(logits_ptr + t * N + col, mask=col < N, other=float("-inf"), cache_modifier=".cg")
        _route_row(z.to(tl.float32), col, weights_ptr, ids_ptr, t, TOP_K, TOP_K_P2, BLOCK, NORM)
        tl.store(counters_ptr + t, 0)  # ready for the next launch


# `router_kernel`'s program: ROUTER_ROWS experts' logits, K in steps of ROUTER_BLOCK_K (the whole of Qwen3-30B-A3B's
# 2048 at once). The fastest of those tried on an H100 (results/logs/h100_moe_router_3e4f874.log).
ROUTER_ROWS = 4
ROUTER_BLOCK_K = 2048


def router_kernel(x: torch.Tensor, w: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`SparseMoE.route` whole, the router's matmul included, in one launch for few tokens (at most COUNTERS):
    x [T, E], the router's weight w [N, E] -> (weights [T, top_k] in x's dtype, ids [T, top_k] int64)."""
    (T, E), N = x.shape, w.shape[0]
    assert x.stride(1) == 1 and w.is_contiguous() and T <= COUNTERS
    logits = torch.empty(T, N, dtype=x.dtype, device=x.device)
    weights = torch.empty(T, top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    counters = arrival_counters(x.device) if x.is_cuda else torch.zeros(T, dtype=torch.int32)
    if T:
        _router_kernel[(T, triton.cdiv(N, ROUTER_ROWS))](
            x, w, logits, counters, weights, ids, N, E, x.stride(0), TOP_K=top_k,
            TOP_K_P2=triton.next_power_of_2(top_k), BLOCK=triton.next_power_of_2(N), NORM=norm, ROWS=ROUTER_ROWS,
            BLOCK_K=min(ROUTER_BLOCK_K, triton.next_power_of_2(E)), enable_fp_fusion=False,
            **dependent_launch(x.device),
        )
    return weights, ids


@triton.jit
def _pair_gate_up_kernel(x_ptr, w_ptr, ids_ptr, h_ptr, TOP_K, E, I_e, stride_xt,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program (pair, column block): SiLU(gate) x up of the pair's token by its expert, for BLOCK_N columns of I_e."""
    pair, col_block = tl.program_id(0), tl.program_id(1)
    follow(PDL)
    x = x_ptr + pair // TOP_K * stride_xt
    w = w_ptr + tl.load(ids_ptr + pair) * 2 * I_e * E
    col = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = col < I_e
    gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, E, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < E
        gate = _row_times(x, w, col, col_ok, k, k_ok, E, gate)
        up = _row_times(x, w + I_e * E, col, col_ok, k, k_ok, E, up)
    dtype = h_ptr.dtype.element_ty
    h = silu_times(tl.sum(gate, 1).to(dtype), tl.sum(up, 1).to(dtype), dtype)  # each projection rounded
    tl.store(h_ptr + pair * I_e + col, h, mask=col_ok)


@triton.jit
def _pair_down_kernel(h_ptr, w_ptr, ids_ptr, weights_ptr, partials_ptr, counters_ptr, y_ptr, E, I_e,
                      TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program (pair, column block): the pair's down projection for BLOCK_N columns of E, rounded and weighted
    (HF's rounding); the last of a token's pairs to finish them sums the token's in top-k order, counted by an
    arrival counter per (token, column block), as weft.layers.linear's split launches count theirs."""
    pair, col_block = tl.program_id(0), tl.program_id(1)
    follow(PDL)
    col = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = col < E
    w = w_ptr + tl.load(ids_ptr + pair) * E * I_e
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, I_e, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        acc = _row_times(h_ptr + pair * I_e, w, col, col_ok, k, k < I_e, I_e, acc)
    dtype = y_ptr.dtype.element_ty
    y = (tl.sum(acc, 1).to(dtype).to(tl.float32) * tl.load(weights_ptr + pair).to(tl.float32)).to(dtype)
    tl.store(partials_ptr + pair * E + col, y, mask=col_ok)
    tl.debug_barrier()  # every thread's part is stored before the arrival counts
    token = pair // TOP_K
    counter = counters_ptr + token * tl.num_programs(1) + col_block
    if tl.atomic_add(counter, 1, sem="acq_rel") == TOP_K - 1:
        total = tl.zeros([BLOCK_N], tl.float32)
        for j in range(TOP_K):
            part = partials_ptr + (token * TOP_K + j) * E + col
            total += tl.load(part, mask=col_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(y_ptr + token * E + col, total.to(dtype), mask=col_ok)
        tl.store(counter, 0)  # ready for the next launch


def pair_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The experts' weighted outputs summed over each token's pairs, a program per pair (few pairs: `runs_pairs`):
    x [T, E], gate_up [N, 2 I_e, E], down [N, E, I_e] (contiguous), weights and ids [T, top_k] -> [T, E]."""
    (T, E), (_, _, I_e), k = x.shape, down.shape, ids.shape[1]
    assert x.stride(1) == 1 and gate_up.is_contiguous() and down.is_contiguous()
    ids, weights = ids.contiguous(), weights.contiguous()
    h = torch.empty(T * k, I_e, dtype=x.dtype, device=x.device)
    pdl = dependent_launch(x.device)
    up, dn = PAIR_GATE_UP, PAIR_DOWN
    _pair_gate_up_kernel[(T * k, triton.cdiv(I_e, up.block_n))](
        x, gate_up, ids, h, k, E, I_e, x.stride(0), BLOCK_N=up.block_n, BLOCK_K=up.block_k, num_warps=up.num_warps,
        enable_fp_fusion=False, **pdl,
    )
    partials = torch.empty(T * k, E, dtype=x.dtype, device=x.device)
    col_blocks = triton.cdiv(E, dn.block_n)
    assert runs_pairs(T, k, E), "pair_experts takes few pairs, with an arrival counter per (token, column block)"
    counters = arrival_counters(x.device) if x.is_cuda else torch.zeros(T * col_blocks, dtype=torch.int32)
    y = torch.empty(T, E, dtype=x.dtype, device=x.device)
    _pair_down_kernel[(T * k, col_blocks)](
        h, down, ids, weights, partials, counters, y, E, I_e, TOP_K=k, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k,
        num_warps=dn.num_warps, enable_fp_fusion=False, **pdl,
    )
    return y
