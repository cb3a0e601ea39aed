"""Linear layers, and the batch-invariant matmul that EngineConfig.deterministic runs them through.

A row's product must not depend on the other rows beside it. cuBLAS (and the CPU's BLAS) pick their
kernel from the whole shape, M included, and a split of K from it too, so a request's activations
change in the last bits with the batch it shares (issue 33: 11 of 48 requests alike alone and
batched). `batch_invariant_linear` fixes every choice that touches a row's sums from (N, K) alone:

- On CUDA, one Triton kernel. Each output element's dot product runs over K in `splits` chunks of `chunk_k`
  (both from N and K, and the GPU where the tuner chose them: `plan`), each chunk summed from 0 in steps of the
  tile's block_k (the same MMA instructions, in K order, whatever the tile: `Tiles`), then the chunks' sums added
  in order: ((0 + c_0) + c_1) + ... Only the tile and the grid depend on M: few rows (a decode) run one program
  per chunk, whose float32 partials the last one to finish adds up in that order; many rows run one program per
  tile, which adds its chunks as it goes. Both add the same numbers in the same order, so they agree bit for bit
  (tests/kernels/test_kernel_matmul.py).
- Elsewhere, PyTorch's matmul over fixed blocks of ROWS rows (padded with zeros): every block is
  the same shape, so the BLAS runs the same kernel on each.

The same kernel serves the default mode's decodes: at up to DECODE_ROWS rows a linear layer reads its whole weight
to compute little, and cuBLAS reads it well below the copy bandwidth (issue 34). There each weight shape launches
as the tuner (weft.benchmark.tune_gemm) found fastest on this GPU, where that beat cuBLAS: `DecodeLaunch`, from the
committed TUNED table.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from weft.layers.fused import dependent_launch, follow, norm_rope, silu_times

BLOCK_K = 128  # the step along K that `plan`'s chunks are made of, and the tiles' unless they say otherwise
# A tile's loop over a chunk's steps is pipelined; at a chunk's end it starts again (the pipeline fills again) where
# chunks are at least this many steps, and below it one loop runs over every chunk, ending each by selects, which
# keep the next step's MMA waiting (results/logs/h100_invariant_variants_58a91cf.log)
NESTED_STEPS = 4
GROUP_M = 8  # a whole-K grid runs GROUP_M row tiles per column tile in turn, so a weight tile is read once for them
PLAN_BLOCK_N = 64  # the tile width `rule_of_thumb` counts programs in (whatever width a launch then uses)
PROGRAMS = 256  # the programs a one-tile decode should spread over (about two per SM on an H200's 132)
COUNTERS = 4096  # arrival counters per device: the most tiles a split launch may have
ROWS = 16  # the CPU's row block
DECODE_ROWS = 16  # the most rows a tuned decode launch serves: one tile of mma.sync's 16 rows
# {gpu: {dtype: {"decode" and "gated": {"NxK": DecodeLaunch},
#                "invariant": {"NxK": {"splits": K's chunks, "rows": {rows: (Tiles, split)}}}}}},
# as weft.benchmark.tune_gemm writes it
TUNED = Path(__file__).with_name("tuned_gemms.json")
# the row counts the invariant launches are tuned at: each one's launch serves the rows above the tuned count before
# it. 192: e8's decodes shrink through 129-256 rows, where 256's tiles leave gate_up 1.4x slower than 192's own at
# 144-192 rows (results/logs/h200_rows_exp_aa2718c.log)
INVARIANT_ROWS = (16, 64, 128, 192, 256, 512, 1024, 2048, 4096, 8192)


class Linear(nn.Linear):
    """nn.Linear; with `batch_invariant` set (EngineConfig.deterministic) `batch_invariant_linear`; else with
    `kernels` set (EngineConfig.enable_tuned_gemms) a decode's few rows by the tuned launch where one beats cuBLAS."""

    batch_invariant = False
    kernels = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features]"""
        if self.batch_invariant:
            return batch_invariant_linear(x, self.weight, self.bias)
        if self.kernels and (launch := decode_launch(x.shape[0], self.weight)) is not None:
            return decode_matmul(x.contiguous(), self.weight, self.bias, launch)
        return super().forward(x)


@dataclass(frozen=True)
class Tiles:
    """A launch's tile: block_m x block_n outputs per program over steps of block_k, its warps and pipeline stages.
    On the GPU the batch-invariant tiles of 16-bit operands (rows in whole warpgroups of 64) run the same MMA
    instruction per 64 rows and a step's MMAs add into the accumulator in K order, so neither the tile nor its step
    changes a row's sums (tests/kernels/test_kernel_matmul.py checks pairs on the GPU; the tuner checks every launch
    it keeps, a decode's 16-row tiles, which run another instruction, among them). Triton's interpreter sums a
    step's products apart and then adds them: there only tiles of one block_k agree. `tma`: the operands are read
    by the GPU's tensor memory accelerator (Hopper and later) where their rows allow it (`tma_ready`), which moves
    the same numbers and leaves the registers to the sums, so wider tiles pay (results/logs/h100_tma_0825603.log)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    block_k: int = BLOCK_K
    tma: bool = False


# The H200's fastest of those measured (results/logs/h200_matmul_tiles_b36bab0.log): small tiles while rows are
# few, large ones once they fill a wave of programs. Float32 (the GPU tests' dtype) runs one small tile whatever M:
# its 4-byte operands, staged for the large tiles, would outgrow an SM's shared memory.
DECODE_TILES = Tiles(64, 64, 4, 3)
PREFILL_TILES = Tiles(128, 128, 8, 3)
FLOAT32_TILES = Tiles(32, 64, 4, 2)
WAVE = 128  # programs that keep every SM busy (an H200 has 132)


def tile_choices(dtype: torch.dtype) -> tuple[Tiles, Tiles]:
    """The tiles for few rows and for many, of operands in `dtype`."""
    return (FLOAT32_TILES, FLOAT32_TILES) if dtype.itemsize > 2 else (DECODE_TILES, PREFILL_TILES)


def launch_for(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16,
               gpu: str | None = None) -> tuple[Tiles, bool]:
    """The tiles and grid for M rows of an [N, K] weight summed in `plan`'s order: on a `gpu` the tuner measured
    (TUNED's "invariant" section), the fastest it found at the least row count it tuned that holds M; past the most
    it tuned, that count's tiles, whole (e8's prefill of every prompt at once, 145k rows: the rule of thumb's tiles
    took 1.2-1.3x their time, results/logs/h100_e16_prefill_launch_05019be.log; a split's partials grow with M). Else
    the large tiles past the small ones' rows where they fill a wave; else the small ones, which rows that fit one of
    them (a decode's few) run one program per chunk where their tiles alone leave the wave short (and there are
    chunks).
    Past one tile's rows the chunks' float32 partials, M x N each, cost more than the programs they add
    (results/logs/h200_matmul_split_rows_5a225c1.log). Whichever is chosen, the bits are the same."""
    splits = plan(N, K, dtype, gpu).splits
    if gpu is not None and (entry := tuned(gpu, dtype).invariant.get((N, K))):
        rows = min((r for r in entry.rows if M <= r), default=max(entry.rows))
        tiles, split = entry.rows[rows]
        return tiles, split and splits > 1 and M <= rows
    small, large = tile_choices(dtype)

    def programs(t: Tiles) -> int:
        return triton.cdiv(M, t.block_m) * triton.cdiv(N, t.block_n)

    if M > small.block_m:
        return (large if programs(large) >= WAVE else small), False
    tiles = programs(small)
    return small, splits > 1 and tiles < WAVE and tiles <= COUNTERS


@dataclass(frozen=True)
class MatmulPlan:
    """How the dot products of an [N, K] weight are summed: `splits` chunks of `chunk_k` (a multiple of BLOCK_K)."""

    splits: int
    chunk_k: int


def plan(N: int, K: int, dtype: torch.dtype = torch.bfloat16, gpu: str | None = None) -> MatmulPlan:
    """The chunks of K for an [N, K] weight of `dtype`: on a `gpu` the tuner measured, the count it chose (the one
    whose fastest launches were fastest over its row counts: results/logs/h100_tune_gemm_invariant_plans_a9e4f4a.log),
    else `rule_of_thumb`'s. Never depends on M: a process runs one GPU."""
    if gpu is not None and (entry := tuned(gpu, dtype).invariant.get((N, K))):
        return chunks(K, BLOCK_K, entry.splits)
    return rule_of_thumb(N, K)


@functools.cache
def rule_of_thumb(N: int, K: int) -> MatmulPlan:
    """Chunks enough that a one-tile decode's N / BLOCK_N tiles times the chunks reach PROGRAMS, each chunk at
    least two BLOCK_K steps."""
    tiles = triton.cdiv(N, PLAN_BLOCK_N)
    steps = triton.cdiv(K, BLOCK_K)
    return chunks(K, BLOCK_K, max(1, min(PROGRAMS // tiles, steps // 2)))


@functools.cache
def chunks(K: int, block_k: int, want: int) -> MatmulPlan:
    """K in about `want` chunks of whole block_k steps (fewer where the steps do not divide evenly)."""
    chunk_k = triton.cdiv(triton.cdiv(K, block_k), want) * block_k
    return MatmulPlan(triton.cdiv(K, chunk_k), chunk_k)


@triton.jit
def _operands(x_ptr, w_ptr, rows, row_ok, cols, k0, K, stride_xm, stride_wn, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, TMA: tl.constexpr):
    """x[rows, k0 : k0 + BLOCK_K] [BLOCK_M, BLOCK_K] and w[cols, same]^T [BLOCK_K, BLOCK_N], rows not `row_ok` and
    columns at or past K read as 0; EVEN_K: BLOCK_K divides K, and no column is masked. TMA: x_ptr and w_ptr are
    tensor descriptors and rows and cols the first row and column (their blocks read 0 past M, N and K)."""
    if TMA:
        a, b = x_ptr.load([rows, k0]), w_ptr.load([cols, k0]).T
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        a_at = x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :]  # M x K may pass 2^31 elements
        b_at = w_ptr + cols[None, :] * stride_wn + k[:, None]
        if EVEN_K:
            a, b = tl.load(a_at, mask=row_ok[:, None], other=0.0), tl.load(b_at)
        else:
            k_ok = k < K
            a = tl.load(a_at, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_at, mask=k_ok[:, None], other=0.0)
    return a, b


@triton.jit
def _chunk(x_ptr, w_ptr, rows, row_ok, cols, start, chunk_k, K, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr):
    """x[rows, start : start + chunk_k] @ w[cols, same]^T [BLOCK_M, BLOCK_N] in float32, summed from 0 a BLOCK_K at a
    time (rows not `row_ok` read as 0). The last chunk ends at K: steps past it would only add zeros."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(start, tl.minimum(start + chunk_k, K), BLOCK_K):
        a, b = _operands(x_ptr, w_ptr, rows, row_ok, cols, k0, K, stride_xm, stride_wn, BLOCK_K, EVEN_K, TMA)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


# M changes from step to step: not specialized on (M == 1, M % 16), or a serving run meets new variants, each a
# compile, inside its steps (results/logs/h200_e16_compiles_ff4089a.log). The plan's splits and chunk are arguments
# too, so that a compiled tile serves every weight (of its loop form, NESTED: whether the chunks are long).
@triton.jit(do_not_specialize=["M", "splits"])
def _matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, partials_ptr, counters_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    splits, chunk_k, CHUNKED: tl.constexpr, NESTED: tl.constexpr, SPLIT_GRID: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, GATED: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr,
):
    # Rows past M are masked (a decode's one row loads one row: clamped, the tile's rows each loaded it again, and
    # decodes ran slower, results/logs/h200_tune_gemm_58661a0.log); columns past the output's are clamped: they read
    # real memory, and their results are not stored (under TMA they read 0 past N, and a gate tile's past N / 2 the
    # up half's rows: not stored either). GATED: the weight is an MLP's gate, then its up, and a tile sums both
    # halves' columns for SiLU(gate) x up.
    if GATED:
        n_out = N // 2
    else:
        n_out = N
    if SPLIT_GRID:
        split, pid_n, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    else:  # GROUP_M row tiles (or the last group's fewer) take each column tile in turn
        split, pid = 0, tl.program_id(0)
        n_tiles, m_tiles = tl.cdiv(n_out, BLOCK_N), tl.cdiv(M, BLOCK_M)
        first_m = pid // (GROUP_M * n_tiles) * GROUP_M
        group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
        in_group = pid % (GROUP_M * n_tiles)
        pid_m, pid_n = first_m + in_group % group_rows, in_group // group_rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, cols_in = rows < M, tl.minimum(cols, n_out - 1)
    out_ok = row_ok[:, None] & (cols < n_out)[None, :]
    follow(PDL)  # and then the descriptors: their scratch may be the kernel before's (see `tma_scratch`)
    if TMA:
        x_src = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [BLOCK_M, BLOCK_K])
        w_src = tl.make_tensor_descriptor(w_ptr, [N, K], [stride_wn, 1], [BLOCK_N, BLOCK_K])
        a_rows, b_cols = pid_m * BLOCK_M, pid_n * BLOCK_N
    else:
        x_src, w_src, a_rows, b_cols = x_ptr, w_ptr, rows, cols_in
    if SPLIT_GRID:
        last, total, up = _split_sum(x_src, w_src, a_rows, row_ok, b_cols, rows, cols, out_ok, partials_ptr,
                                     counters_ptr, split, pid_m, pid_n, M, N, K, n_out, stride_xm, stride_wn, splits,
                                     chunk_k, GATED, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA)
        if last:
            _store(out_ptr, bias_ptr, total, up, rows, cols, cols_in, out_ok, stride_om, n_out, HAS_BIAS, GATED)
    else:
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        total = _whole(x_src, w_src, a_rows, row_ok, b_cols, K, stride_xm, stride_wn, splits, chunk_k, CHUNKED, NESTED,
                       EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, TMA)
        if GATED:
            up = _whole(x_src, w_src, a_rows, row_ok, b_cols + n_out, K, stride_xm, stride_wn, splits, chunk_k,
                        CHUNKED, NESTED, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, TMA)
        _store(out_ptr, bias_ptr, total, up, rows, cols, cols_in, out_ok, stride_om, n_out, HAS_BIAS, GATED)


@triton.jit
def _split_sum(x_src, w_src, a_rows, row_ok, b_cols, rows, cols, out_ok, partials_ptr, counters_ptr, split, pid_m,
               pid_n, M, N, K, n_out, stride_xm, stride_wn, splits, chunk_k, GATED: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               TMA: tl.constexpr):
    """A split grid's program: its chunk of the tile (GATED: and of the up half's) into the float32 partials
    [splits, M, N]; then (whether it arrived last of the tile's, the chunks' sums added in order, the up half's): the
    last to arrive adds them, the others return zeros."""
    at = partials_ptr + split * M * N + rows[:, None] * N + cols[None, :]
    acc = _chunk(x_src, w_src, a_rows, row_ok, b_cols, split * chunk_k, chunk_k, K, stride_xm, stride_wn,
                 BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA)
    tl.store(at, acc, mask=out_ok)
    if GATED:
        acc = _chunk(x_src, w_src, a_rows, row_ok, b_cols + n_out, split * chunk_k, chunk_k, K, stride_xm,
                     stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA)
        tl.store(at + n_out, acc, mask=out_ok)
    tl.debug_barrier()  # every thread's partials are issued before the arrival counts
    counter = counters_ptr + pid_m * tl.num_programs(1) + pid_n
    last = tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if last:
        for s in range(splits):  # the last to arrive adds the chunks in order
            total += tl.load(at + (s - split) * M * N, mask=out_ok, other=0.0, cache_modifier=".cg")
            if GATED:
                up += tl.load(at + (s - split) * M * N + n_out, mask=out_ok, other=0.0, cache_modifier=".cg")
        tl.store(counter, 0)  # ready for the next launch
    return last, total, up


@triton.jit
def _whole(x_ptr, w_ptr, rows, row_ok, cols, K, stride_xm, stride_wn, splits, chunk_k, CHUNKED: tl.constexpr,
           NESTED: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """x[rows] @ w[cols]^T [BLOCK_M, BLOCK_N] in float32 over all of K, its chunks' sums added in order. NESTED: a loop
    per chunk (`_chunk`); else one loop over every chunk's steps (so loads run ahead across chunk ends), where at a
    chunk's last step its sum joins the total and starts again from 0, by selects. Both add the same numbers."""
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if NESTED:
        for c in range(0, splits):
            total += _chunk(x_ptr, w_ptr, rows, row_ok, cols, c * chunk_k, chunk_k, K, stride_xm, stride_wn, BLOCK_M,
                            BLOCK_N, BLOCK_K, EVEN_K, TMA)
        return total
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    steps, last = chunk_k // BLOCK_K, tl.cdiv(K, BLOCK_K)  # the last chunk ends at K, as `_chunk`'s
    for i in range(0, last):
        a, b = _operands(x_ptr, w_ptr, rows, row_ok, cols, i * BLOCK_K, K, stride_xm, stride_wn, BLOCK_K, EVEN_K,
                         TMA)
        acc = tl.dot(a, b, acc, input_precision="ieee")
        if CHUNKED:
            end = (i % steps == steps - 1) | (i == last - 1)
            total = tl.where(end, total + acc, total)
            acc = tl.where(end, 0.0, acc)
    if not CHUNKED:  # one chunk: its sum joins the total after the loop
        total += acc
    return total


@triton.jit
def _store(out_ptr, bias_ptr, total, up, rows, cols, cols_in, out_ok, stride_om, n_out, HAS_BIAS: tl.constexpr,
           GATED: tl.constexpr):
    """The tile's float32 sums (+ the bias) rounded to the output's dtype; GATED: those of the gate and of the up
    (`up`, + its bias) rounded so, then SiLU(gate) x up as weft.layers.fused's kernel computes it from them."""
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols_in).to(tl.float32)[None, :]
        if GATED:
            up += tl.load(bias_ptr + n_out + cols_in).to(tl.float32)[None, :]
    if GATED:
        out = silu_times(total.to(dtype), up.to(dtype), dtype)
    else:
        out = total.to(dtype)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], out, mask=out_ok)  # M x N: as x


@functools.cache
def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's arrival counters, 0 between launches (each split launch's last program puts its own back)."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


@functools.cache
def launch_variants(N: int, K: int, dtype: torch.dtype, max_rows: int,
                    gpu: str | None = None) -> frozenset[tuple[Tiles, bool]]:
    """Every (tiles, split) `launch_for` picks for 1 .. max_rows rows of an [N, K] weight."""
    return frozenset(launch_for(M, N, K, dtype, gpu) for M in range(1, max_rows + 1))


def prepare(model: nn.Module, device: torch.device, max_rows: int) -> None:
    """Allocate the device's counters, and compile now each launch `model`'s linear layers may make for up to
    `max_rows` rows (batch-invariant ones: each of `launch_variants`; the others: their tuned decode launches, plain
    and, for an MLP's gate_up, gated): outside any CUDA graph capture, and not in a step. The LM head, run eagerly
    on each step's rows, meets its few-row launches only once a run's batch has shrunk
    (results/logs/h200_9c50836_e16.log)."""
    if device.type != "cuda":
        return
    arrival_counters(device)
    compiled = set()
    for layer in model.modules():
        if not isinstance(layer, Linear):
            continue
        w, b = layer.weight, layer.bias
        N, K = w.shape
        x = torch.zeros(1, K, dtype=w.dtype, device=device)
        if layer.batch_invariant:
            for tiles, split in launch_variants(N, K, w.dtype, max_rows, _gpu_name(device.index)):
                launch = (N, K, w.dtype, b is not None, tiles, split)
                if launch not in compiled:
                    compiled.add(launch)
                    matmul_kernel(x, w, b, split=split, tiles=tiles)
        elif layer.kernels:  # one compile per launch: M is an argument
            for gated in (False, True):
                if (decode := decode_launch(1, w, gated)) is not None:
                    decode_matmul(x, w, b, decode, gated)


def matmul_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  split: bool | None = None, tiles: Tiles | None = None,
                  order: MatmulPlan | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, by the Triton kernel in the batch-invariant
    order (`plan`); `split`, `tiles`, `order`: force the grid, the tiles and the chunks (None: `launch_for`'s and
    `plan`'s choice; the tuner tries others)."""
    M, K = x.shape
    N = weight.shape[0]
    gpu = _gpu_name(x.device.index) if x.is_cuda else None
    p = order or plan(N, K, x.dtype, gpu)
    chosen_tiles, chosen_split = launch_for(M, N, K, x.dtype, gpu)
    split = chosen_split if split is None else split and p.splits > 1
    return _launch(x, weight, bias, tiles or chosen_tiles, p, split)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, t: Tiles, p: MatmulPlan, split: bool,
            gated: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N]: `t`'s tiles summing p's chunks of K in t.block_k steps,
    one program per chunk (`split`) or per tile. `gated`: weight is an MLP's gate, then its up; -> SiLU(gate) x up
    [M, N / 2]."""
    M, K = x.shape
    N = weight.shape[0]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == K and not (gated and N % 2)
    n_out = N // 2 if gated else N
    out = torch.empty(M, n_out, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    m_tiles, n_tiles = triton.cdiv(M, t.block_m), triton.cdiv(n_out, t.block_n)
    assert not split or m_tiles * n_tiles <= COUNTERS, "a split launch needs an arrival counter per tile"
    partials = torch.empty(p.splits, M, N, dtype=torch.float32, device=x.device) if split else out
    counters = arrival_counters(x.device) if x.is_cuda else torch.zeros(m_tiles * n_tiles, dtype=torch.int32)
    assert p.chunk_k % t.block_k == 0
    grid = (p.splits, n_tiles, m_tiles) if split else (n_tiles * m_tiles,)
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, out, partials, counters, M, N, K,
        x.stride(0), weight.stride(0), out.stride(0),
        p.splits, p.chunk_k, CHUNKED=p.splits > 1,
        NESTED=not split and p.splits > 1 and p.chunk_k // t.block_k >= NESTED_STEPS,
        SPLIT_GRID=split, HAS_BIAS=bias is not None, EVEN_K=K % t.block_k == 0, GATED=gated, GROUP_M=GROUP_M,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, TMA=t.tma and tma_ready(x, weight),
        num_warps=t.num_warps, num_stages=t.num_stages,
        enable_fp_fusion=not gated,  # SiLU x up as weft.layers.fused's kernel computes it, unfused
        **dependent_launch(x.device),
    )
    return out


def tma_ready(*operands: torch.Tensor) -> bool:
    """Whether a tensor descriptor can address each [rows, K] operand: its start and rows 16-byte aligned (the TMA's
    rule; Triton's interpreter reads descriptors too). If so, `tma_scratch` is set as Triton's allocator, here: Triton
    keeps one per thread and context. (The engine's activations are whole tensors of their own: what `prepare`
    compiles for a weight, of the same alignment, is what its steps launch.)"""
    ready = all(t.data_ptr() % 16 == 0 and t.stride(0) * t.itemsize % 16 == 0 for t in operands)
    if ready:
        triton.set_allocator(tma_scratch)
    return ready


def tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """The global memory a launch's programs write their tensor descriptors to (128 bytes each), from PyTorch's
    allocator on the current stream (its blocks' 512-byte alignment holds the 128 asked for). A matmul writes them
    after `follow`: under programmatic dependent launch the kernel before it, whose freed scratch this may be, has
    finished by then."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias) -> [T, N], each row's bits independent of T and of the other rows."""
    if x.is_cuda:
        return matmul_kernel(x.contiguous(), weight, bias)
    T, K = x.shape
    blocks = F.pad(x, (0, 0, 0, -T % ROWS)).view(-1, ROWS, K)
    y = torch.matmul(blocks, weight.t()).flatten(0, 1)[:T]
    return y if bias is None else y + bias


@dataclass(frozen=True)
class DecodeLaunch:
    """A launch for up to `max_rows` rows (at most DECODE_ROWS) of one [N, K] weight: `tiles` summing K in `splits`
    chunks of their block_k steps, one program per chunk where there are several. A weight-bound regime: the tiles
    are narrow and the chunks many, so that enough programs stream the weight at once."""

    tiles: Tiles
    splits: int
    max_rows: int

    def record(self) -> dict:
        """The launch's entry in TUNED's "decode" or "gated" section."""
        assert not self.tiles.tma, "the decode launches read by pointers: the tuner tries no other"
        tiles = {k: v for k, v in asdict(self.tiles).items() if k not in ("block_m", "block_k", "tma")}
        return dict(tiles=tiles, block_k=self.tiles.block_k, splits=self.splits, max_rows=self.max_rows)

    @staticmethod
    def from_record(entry: dict) -> DecodeLaunch:
        return DecodeLaunch(Tiles(DECODE_ROWS, **entry["tiles"], block_k=entry["block_k"]), entry["splits"],
                            entry["max_rows"])


@dataclass(frozen=True)
class InvariantLaunches:
    """The batch-invariant kernel's tuned launches for one weight shape: K summed in `splits` chunks (`plan`), and
    by row count (of INVARIANT_ROWS) its fastest tiles and grid."""

    splits: int
    rows: dict[int, tuple[Tiles, bool]]


@dataclass(frozen=True)
class TunedLaunches:
    """The launches the tuner found fastest on one GPU for one dtype, by weight shape (N, K): for a decode's few
    rows where they beat cuBLAS (`gated`: an MLP's gate and up with SiLU x up after, where they beat cuBLAS and
    weft.layers.fused's SiLU x up), and for the batch-invariant kernel its chunks and launches."""

    decode: dict[tuple[int, int], DecodeLaunch]
    gated: dict[tuple[int, int], DecodeLaunch]
    invariant: dict[tuple[int, int], InvariantLaunches]


@functools.cache
def tuned(gpu: str, dtype: torch.dtype) -> TunedLaunches:
    """TUNED's launches for `gpu` (torch.cuda.get_device_name's) and `dtype`; none for a GPU or dtype never tuned,
    whose layers keep cuBLAS and the batch-invariant kernel its rule of thumb (`launch_for`)."""
    table = json.loads(TUNED.read_text()).get(gpu, {}).get(str(dtype).removeprefix("torch."), {})

    def shape(key: str) -> tuple[int, int]:
        N, K = key.split("x")
        return int(N), int(K)

    def launches(section: str) -> dict[tuple[int, int], DecodeLaunch]:
        return {shape(key): DecodeLaunch.from_record(entry) for key, entry in table.get(section, {}).items()}

    return TunedLaunches(
        launches("decode"),
        launches("gated"),
        {shape(key): InvariantLaunches(entry["splits"], {int(rows): invariant_launch(launch)
                                                         for rows, launch in entry["rows"].items()})
         for key, entry in table.get("invariant", {}).items()},
    )


def invariant_launch(entry: dict) -> tuple[Tiles, bool]:
    """A TUNED "invariant" entry: the tiles' fields (`tma` where the tuner tried it) and split."""
    fields = ("block_m", "block_n", "num_warps", "num_stages", "block_k")
    return Tiles(*(entry[f] for f in fields), tma=entry.get("tma", False)), entry["split"]


@functools.cache
def _gpu_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def decode_launch(M: int, weight: torch.Tensor, gated: bool = False) -> DecodeLaunch | None:
    """The tuned launch for M rows of `weight` [N, K] on its GPU (`gated`: of an MLP's gate and up, for SiLU(gate) x
    up); None off CUDA, past the launch's rows, or where cuBLAS (and weft.layers.fused's SiLU x up) was as fast."""
    if M > DECODE_ROWS or not weight.is_cuda:
        return None
    table = tuned(_gpu_name(weight.device.index), weight.dtype)
    launch = (table.gated if gated else table.decode).get(tuple(weight.shape))
    return launch if launch is not None and M <= launch.max_rows else None


def decode_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, launch: DecodeLaunch,
                  gated: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] by `launch` (M <= DECODE_ROWS); `gated`: weight is an MLP's
    gate, then its up -> SiLU(gate) x up [M, N / 2], the bits of weft.layers.fused.silu_and_mul over the product."""
    p = chunks(x.shape[1], launch.tiles.block_k, launch.splits)
    return _launch(x, weight, bias, launch.tiles, p, p.splits > 1, gated)


def rope_launch(M: int, proj: Linear, D: int) -> DecodeLaunch | None:
    """The launch for M rows of `proj`, the attention's q/k/v projection with heads of D values, that ends in RoPE
    and the K/V store (`decode_rope`): a program per head and chunk, half as many as the plain tuned launch of
    `proj`'s weight runs (at least one chunk, at most K's steps), in its warps and stages; in steps of BLOCK_K, as a
    head's D columns in steps of 256 would outgrow shared memory. Half: fewer chunks for a head's last program to add
    before its RoPE; on an H100 it beat as many and twice as many in Qwen3-0.6B's and 4B's batch-1 steps, and a
    quarter (Qwen3-0.6B's heads one chunk each) lost (results/logs/h100_rope_epilogue_b58a4c6.log). None where
    `proj` runs no tuned launch at M rows, where D is not a power of two (a tile's width), or past 128 (a head's
    tile, staged as deep as the plain launch's, could outgrow shared memory)."""
    launch = decode_launch(M, proj.weight) if proj.kernels and not proj.batch_invariant else None
    if launch is None or D & (D - 1) or D > 128:
        return None
    N, K = proj.weight.shape
    programs = launch.splits * triton.cdiv(N, launch.tiles.block_n)
    splits = max(1, min(triton.cdiv(K, BLOCK_K), programs // (2 * (N // D))))
    return DecodeLaunch(replace(launch.tiles, block_n=D, block_k=BLOCK_K), splits, launch.max_rows)


# M changes from step to step (a decode graph's batch sizes): not specialized on it, as _matmul_kernel
@triton.jit(do_not_specialize=["M", "splits"])
def _rope_kernel(
    x_ptr, w_ptr, bias_ptr, partials_ptr, counters_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr, slots_ptr,
    q_out_ptr, k_rows_ptr, v_rows_ptr, M, N, K, H_q, H_kv, eps, stride_xm, stride_wn, splits, chunk_k,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    # program (chunk, head): head < H_q a head of q, then H_kv of k, then H_kv of v; the last of a head's chunks to
    # arrive rounds its product as decode_matmul does and then does what weft.layers.fused's RoPE kernel does with it
    HALF: tl.constexpr = D // 2
    split, head = tl.program_id(0), tl.program_id(1)
    rows, cols = tl.arange(0, BLOCK_M), head * D + tl.arange(0, D)
    row_ok = rows < M
    follow(PDL)
    last, total, _ = _split_sum(x_ptr, w_ptr, rows, row_ok, cols, rows, cols, row_ok[:, None], partials_ptr,
                                counters_ptr, split, 0, head, M, N, K, N, stride_xm, stride_wn, splits, chunk_k, False,
                                BLOCK_M, D, BLOCK_K, EVEN_K, False)
    if last:
        dt = q_out_ptr.dtype.element_ty
        if HAS_BIAS:
            total += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        x1, x2 = tl.split(tl.permute(tl.reshape(total.to(dt), [BLOCK_M, 2, HALF]), (0, 2, 1)))  # [BLOCK_M, HALF]
        col = tl.arange(0, HALF)[None, :]
        ok = row_ok[:, None] & (col < HALF)
        slot = tl.load(slots_ptr + rows, mask=row_ok, other=-1)[:, None]  # < 0: stored nowhere
        if head < H_q:
            weight, dst, keep = q_weight_ptr, q_out_ptr + rows[:, None] * (H_q * D) + head * D, ok
        elif head < H_q + H_kv:
            weight, dst, keep = k_weight_ptr, k_rows_ptr + slot * (H_kv * D) + (head - H_q) * D, ok & (slot >= 0)
        else:
            weight, dst, keep = k_weight_ptr, v_rows_ptr + slot * (H_kv * D) + (head - H_q - H_kv) * D, ok & (slot >= 0)
        if head < H_q + H_kv:
            x1, x2 = norm_rope(x1, x2, cos_ptr + rows[:, None] * D, sin_ptr + rows[:, None] * D, weight, col, ok, eps,
                               HALF, NORM, dt)
        tl.store(dst + col, x1, mask=keep)
        tl.store(dst + HALF + col, x2, mask=keep)


def decode_rope(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, launch: DecodeLaunch, H_q: int, H_kv: int,
    cos: torch.Tensor, sin: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor] | None, eps: float,
    slot_mapping: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias), N = (H_q + 2 H_kv) D with D = launch's block_n, by `launch` (a split grid
    whatever its splits, M <= DECODE_ROWS); then as weft.layers.fused.rotary_store on the product's q, k and v: the
    same bits as the two launches, in one (but Qwen3's norms: see `norm_rope`) -> rotated q [M, H_q, D]; k and v at
    rows slot_mapping [M] of k_rows / v_rows [slots, H_kv, D]. cos/sin [M, 1, D]; `norms`: Qwen3's q and k RMSNorm
    weights [D] (epsilon `eps`)."""
    M, K = x.shape
    N, D = weight.shape[0], launch.tiles.block_n
    assert x.stride(1) == 1 and weight.stride(1) == 1 and M <= DECODE_ROWS and N == (H_q + 2 * H_kv) * D
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape == (M, 1, D)
    assert slot_mapping.shape == (M,) and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    assert k_rows.is_contiguous() and v_rows.is_contiguous() and k_rows.shape[1:] == v_rows.shape[1:] == (H_kv, D)
    assert k_rows.dtype == v_rows.dtype == x.dtype and N // D <= COUNTERS
    assert norms is None or all(w.shape == (D,) and w.is_contiguous() for w in norms)
    p, t = chunks(K, launch.tiles.block_k, launch.splits), launch.tiles
    q = torch.empty(M, H_q, D, dtype=x.dtype, device=x.device)
    partials = torch.empty(p.splits, M, N, dtype=torch.float32, device=x.device)
    counters = arrival_counters(x.device) if x.is_cuda else torch.zeros(N // D, dtype=torch.int32)
    q_weight, k_weight = norms if norms is not None else (q, q)  # unread without norms
    _rope_kernel[(p.splits, N // D)](
        x, weight, bias if bias is not None else weight, partials, counters, cos, sin, q_weight, k_weight,
        slot_mapping, q, k_rows, v_rows, M, N, K, H_q, H_kv, eps, x.stride(0), weight.stride(0), p.splits,
        p.chunk_k, HAS_BIAS=bias is not None, EVEN_K=K % t.block_k == 0, NORM=norms is not None, BLOCK_M=t.block_m,
        D=D, BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages,
        enable_fp_fusion=False,  # RoPE as weft.layers.fused's kernel computes it, unfused
        **dependent_launch(x.device),
    )
    return q
