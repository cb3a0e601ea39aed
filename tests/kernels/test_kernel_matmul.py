"""The batch-invariant matmul (weft/layers/linear.py) against float64, and its promise: a row's bits do not depend
on how many rows share the launch, where among them it sits, or which grid ran it; the same of the CPU's
row-block path and of the batch-invariant attention (weft/attention/padded.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from weft.attention.padded import attend_invariant
from weft.benchmark.tune_gemm import invariant_orders, layer_shapes
from weft.layers.fused import rotary_store, silu_and_mul
from weft.layers.linear import (
    BLOCK_K,
    DECODE_ROWS,
    DECODE_TILES,
    FLOAT32_TILES,
    GROUP_M,
    INVARIANT_ROWS,
    PREFILL_TILES,
    TUNED,
    DecodeLaunch,
    Linear,
    Tiles,
    batch_invariant_linear,
    chunks,
    decode_launch,
    decode_matmul,
    decode_rope,
    launch_for,
    launch_variants,
    matmul_kernel,
    plan,
    rope_launch,
    tile_choices,
    tuned,
)

pytestmark = pytest.mark.kernels

CPU_DTYPES = [torch.float32]  # the interpreter computes bfloat16 wrongly
GPU_DTYPES = [pytest.param(d, marks=pytest.mark.gpu) for d in (torch.float32, torch.bfloat16, torch.float16)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative to each row's scale
# (N, K): K past a chunk's end, chunks of several BLOCK_K steps, one chunk, and chunks past K by a whole step (the
# last chunk's loop ends early); on the GPU Qwen3-0.6B's four
SHAPES = [(96, 1000), (130, 300), (64, 2 * BLOCK_K), (96, 5 * BLOCK_K)]
GPU_SHAPES = [pytest.param(s, marks=pytest.mark.gpu) for s in ((4096, 1024), (1024, 2048), (6144, 1024),
                                                              (1024, 3072))]
# (offset, rows) slices of the full batch: one row, a few from mid-tile, more than a tile, all of it
SLICES = [(5, 1), (3, 7), (11, 70), (0, 140)]
STEP_64 = Tiles(128, 256, 8, 3, 64)  # the widest tile, in steps of 64: steps of 128 would outgrow shared memory


def operands(N: int, K: int, dtype: torch.dtype, device, bias: bool, M: int = 140):
    g = torch.Generator().manual_seed(N * K)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype).to(device)
    b = torch.randn(N, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", CPU_DTYPES + GPU_DTYPES)
@pytest.mark.parametrize("shape", SHAPES + GPU_SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_matches_float64_and_every_row_keeps_its_bits(device, dtype, shape, bias):
    N, K = shape
    x, w, b = operands(N, K, dtype, device, bias)
    full = matmul_kernel(x, w, b, split=False)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = want.abs().amax(-1, keepdim=True).clamp_min(1e-3)
    assert ((full.double() - want) / scale).abs().max() <= TOL[dtype]
    tiles_tried = set(tile_choices(dtype))
    if device.type == "cuda" and dtype.itemsize == 2:  # the GPU's MMAs add a step's products in K order
        tiles_tried.add(STEP_64)
        # the same numbers, read by tensor descriptors where the rows are aligned (float32's: the test below)
        tiles_tried |= {replace(t, tma=True) for t in tiles_tried}
    for offset, M in SLICES:
        for split in (False, True):
            for tiles in tiles_tried:
                got = matmul_kernel(x[offset : offset + M].contiguous(), w, b, split=split, tiles=tiles)
                assert torch.equal(got, full[offset : offset + M]), (offset, M, split, tiles)


@pytest.mark.parametrize("K", [1000, 5 * BLOCK_K], ids=["K-in-a-step", "K-a-step-short"])
def test_a_loop_per_chunk_and_row_tiles_in_groups_keep_the_bits(device, monkeypatch, K):
    """A whole-K launch over chunks of NESTED_STEPS or more steps loops per chunk (here every chunk of 2 or 3, the
    last ending at K inside a step or a whole step before its chunk's end), and more row tiles than GROUP_M run in
    groups (the last one short): every tile is computed once, each row with the bits of one loop over every step,
    of a split launch and of a lone row."""
    from weft.layers import linear

    N, M = 96, 9 * FLOAT32_TILES.block_m + 5
    p = plan(N, K)
    assert p.splits > 1 and p.chunk_k // BLOCK_K in (2, 3) and p.splits * p.chunk_k > K  # the case is what it says
    assert (K % BLOCK_K == 0) == (p.splits * p.chunk_k - K >= BLOCK_K)
    assert M > GROUP_M * FLOAT32_TILES.block_m
    x, w, _ = operands(N, K, torch.float32, device, False, M=M)
    one_loop = matmul_kernel(x, w, None, split=False, tiles=FLOAT32_TILES)
    monkeypatch.setattr(linear, "NESTED_STEPS", 2)
    full = matmul_kernel(x, w, None, split=False, tiles=FLOAT32_TILES)
    want = F.linear(x.double(), w.double())
    assert ((full.double() - want) / want.abs().amax(-1, keepdim=True)).abs().max() <= TOL[torch.float32]
    assert torch.equal(full, one_loop)
    assert torch.equal(matmul_kernel(x[-3:].contiguous(), w, None, split=True, tiles=FLOAT32_TILES), full[-3:])
    assert torch.equal(matmul_kernel(x[7:8].contiguous(), w, None, split=False, tiles=FLOAT32_TILES), full[7:8])


@pytest.mark.parametrize("shape", [(96, 1000), (96, 5 * BLOCK_K), (200, 600)])
def test_tma_reads_give_the_product_whole_split_and_gated(device, shape, monkeypatch):
    """Tiles that read by tensor descriptors do read so (aligned rows), and give the product within float32's
    rounding, whole and split, and gated: SiLU x up of their own product; on the GPU, the pointer loads' bits (the
    interpreter's sums follow numpy's layout of the operands, so there only the product is compared)."""
    from weft.layers import linear

    reads = []
    ready = linear.tma_ready
    monkeypatch.setattr(linear, "tma_ready", lambda *t: reads.append(ready(*t)) or reads[-1])
    N, K = shape
    x, w, b = operands(N, K, torch.float32, device, True, M=70)
    want = F.linear(x.double(), w.double(), b.double())
    scale = want.abs().amax(-1, keepdim=True).clamp_min(1e-3)
    tiles = replace(FLOAT32_TILES, tma=True)
    for split in (False, True):
        got = matmul_kernel(x, w, b, split=split, tiles=tiles)
        assert ((got.double() - want) / scale).abs().max() <= TOL[torch.float32]
        if device.type == "cuda":
            assert torch.equal(got, matmul_kernel(x, w, b, split=split, tiles=FLOAT32_TILES))
        gated = linear._launch(x, w, b, tiles, plan(N, K), split and plan(N, K).splits > 1, gated=True)
        assert torch.equal(gated, silu_and_mul(got))
    assert reads and all(reads)


def test_tma_reads_only_aligned_rows():
    """A tensor descriptor needs each operand's start and rows 16-byte aligned: else the pointer loads run."""
    from weft.layers.linear import tma_ready

    rows = torch.zeros(8 * 64 + 1, dtype=torch.bfloat16)
    assert tma_ready(rows[: 8 * 64].view(8, 64), torch.zeros(4, 64))
    assert not tma_ready(rows[1:].view(8, 64))  # 2 bytes off
    assert not tma_ready(torch.zeros(8, 300, dtype=torch.bfloat16))  # rows of 600 bytes


def test_the_plan_depends_on_n_and_k_alone_and_splits_only_where_a_tile_is_short_of_work():
    assert plan(1024, 2048).splits > plan(6144, 1024).splits > plan(151936, 1024).splits == 1
    assert all(plan(1024, 3072).chunk_k % BLOCK_K == 0 for _ in range(2))
    p = plan(1024, 3072)
    assert p.splits * p.chunk_k >= 3072 > (p.splits - 1) * p.chunk_k  # every chunk holds some of K
    assert launch_for(1, 1024, 2048) == (DECODE_TILES, True)  # a decode splits its few tiles' K
    assert launch_for(4096, 1024, 2048) == (PREFILL_TILES, False)  # a prefill's large tiles fill the GPU
    assert launch_for(64, 1024, 2048) == (DECODE_TILES, True)  # a small tile's rows, split
    assert launch_for(256, 1024, 2048) == (DECODE_TILES, False)  # large tiles would not fill it: small ones, whole
    assert launch_for(1, 151936, 1024) == (DECODE_TILES, False)  # one chunk: nothing to split
    assert launch_for(4096, 1024, 2048, torch.float32) == (FLOAT32_TILES, False)  # float32: small tiles at any M
    assert launch_for(1, 1024, 2048, torch.float32) == (FLOAT32_TILES, True)


def test_every_order_the_tuner_tries_keeps_each_rows_bits(device):
    """Each count of chunks the tuner may choose for a GPU (`invariant_orders`: K whole, several counts, the rule of
    thumb's) gives the product, and each row the same bits whole, split and alone."""
    N, K = 96, 1000
    x, w, _ = operands(N, K, torch.float32, device, False, M=40)
    want = F.linear(x.double(), w.double())
    orders = invariant_orders(N, K)
    assert [p.splits for p in orders] == [1, 2, 3, 4] and plan(N, K) in orders
    for p in orders:
        full = matmul_kernel(x, w, None, False, FLOAT32_TILES, p)
        assert ((full.double() - want) / want.abs().amax(-1, keepdim=True)).abs().max() <= TOL[torch.float32]
        assert torch.equal(matmul_kernel(x[3:10].contiguous(), w, None, True, FLOAT32_TILES, p), full[3:10])
        assert torch.equal(matmul_kernel(x[7:8].contiguous(), w, None, False, FLOAT32_TILES, p), full[7:8])


def test_prepare_compiles_the_launches_each_row_count_makes():
    """launch_variants (what prepare compiles at start): the rule of thumb's few launches for an untuned GPU, and
    on a tuned one the table's launch for each row count it tuned that the rows reach."""
    N, K = 1024, 2048
    assert launch_variants(N, K, torch.bfloat16, 64) == {(DECODE_TILES, True)}
    assert launch_variants(N, K, torch.bfloat16, 8192) == {(DECODE_TILES, True), (DECODE_TILES, False),
                                                           (PREFILL_TILES, False)}
    assert launch_variants(N, K, torch.float32, 8192) == {(FLOAT32_TILES, True), (FLOAT32_TILES, False)}
    for gpu in json.loads(TUNED.read_text()):
        for (N, K), entry in tuned(gpu, torch.bfloat16).invariant.items():
            by_rows = entry.rows
            assert launch_variants(N, K, torch.bfloat16, 100, gpu) == {by_rows[r] for r in (16, 64, 128)}
            if max(by_rows) == INVARIANT_ROWS[-1]:  # (the LM head's stop at max_num_seqs)
                assert launch_variants(N, K, torch.bfloat16, INVARIANT_ROWS[-1], gpu) == set(by_rows.values())


def test_a_row_count_the_table_lacks_takes_the_next_tuned_one_above(monkeypatch):
    """A table tuned before a row count joined INVARIANT_ROWS (or with some left out) serves those rows with the
    launch of the least tuned count that holds them, and rows past its last with that count's tiles, whole, in the
    table's chunks: every row count of the GPU sums in one order."""
    from weft.layers import linear

    wide, narrow = Tiles(128, 128, 8, 4, 64, tma=True), Tiles(64, 64, 4, 3)
    entry = linear.InvariantLaunches(2, {128: (narrow, True), 256: (wide, False)})
    table = linear.TunedLaunches({}, {}, {(1024, 2048): entry})
    monkeypatch.setattr(linear, "tuned", lambda gpu, dtype: table)
    assert plan(1024, 2048, torch.bfloat16, "a GPU") == chunks(2048, BLOCK_K, 2) != plan(1024, 2048)
    assert plan(1024, 3072, torch.bfloat16, "a GPU") == plan(1024, 3072)  # a shape the table lacks
    assert launch_for(100, 1024, 2048, torch.bfloat16, "a GPU") == (narrow, True)
    assert launch_for(150, 1024, 2048, torch.bfloat16, "a GPU") == launch_for(256, 1024, 2048, torch.bfloat16,
                                                                                "a GPU") == (wide, False)
    assert launch_for(300, 1024, 2048, torch.bfloat16, "a GPU") == (wide, False)
    entry = linear.InvariantLaunches(2, {128: (narrow, True)})  # a split launch last: past it, its tiles whole
    table = linear.TunedLaunches({}, {}, {(1024, 2048): entry})
    assert launch_for(100, 1024, 2048, torch.bfloat16, "a GPU") == (narrow, True)
    assert launch_for(200_000, 1024, 2048, torch.bfloat16, "a GPU") == (narrow, False)


# In a process of its own: the kernel compiles once per tile and loop form (the plan is an argument), so in the tests'
# process other tests may have compiled every launch prepare would.
PREPARE_SCRIPT = """
import json, torch, triton
from weft.layers.linear import Linear, decode_launch, prepare
compiled, found = [], []
triton.knobs.runtime.jit_cache_hook = lambda **kw: compiled.append(kw["fn"].name)
invariant = Linear(768, 3072, bias=True).to("cuda", torch.bfloat16)
invariant.batch_invariant = True
plain = Linear(2048, 1024, bias=False).to("cuda", torch.bfloat16)  # Qwen3-0.6B's o_proj: tuned on the H200
for layer, rows in ((invariant, (1, 7, 64, 65, 200, 300)), (plain, (1, 4, 16))):
    prepare(layer, torch.device("cuda"), 300)
    at_prepare = list(compiled)
    compiled.clear()
    for M in rows:
        layer(torch.randn(M, layer.in_features, device="cuda", dtype=torch.bfloat16))
    found.append([at_prepare, list(compiled)])
    compiled.clear()
print(json.dumps([found, decode_launch(1, plain.weight) is not None]))
"""


@pytest.mark.gpu
def test_after_prepare_no_row_count_compiles_a_kernel():
    """A serving run compiles nothing in its steps: prepare compiled every launch up to its rows, of a
    batch-invariant layer and (where this GPU has a tuned decode launch for it) of a default one."""
    done = subprocess.run([sys.executable, "-c", PREPARE_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ((at_prepare, in_steps), (plain_at_prepare, plain_in_steps)), tuned_here = json.loads(
        done.stdout.strip().splitlines()[-1])
    assert at_prepare, "prepare compiled nothing"
    assert in_steps == []
    assert bool(plain_at_prepare) == tuned_here
    assert plain_in_steps == []


# decode launches: one chunk, chunks that divide K, a last chunk past K's end; narrow and wide tiles
DECODE_LAUNCHES = [DecodeLaunch(Tiles(DECODE_ROWS, n, 4, 3, k), s, DECODE_ROWS)
                   for n, k, s in ((16, 64, 1), (32, 128, 4), (64, 64, 3))]


@pytest.mark.parametrize("dtype", CPU_DTYPES + GPU_DTYPES)
@pytest.mark.parametrize("launch", DECODE_LAUNCHES, ids=lambda d: f"{d.tiles.block_n}x{d.tiles.block_k}s{d.splits}")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("K", [1000, 1536], ids=["K-ragged", "K-even"])  # chunks past K's end, or ending at it
def test_decode_launches_match_float64_and_a_rows_bits_do_not_follow_m(device, dtype, launch, bias, K):
    """The default mode's decode GEMM: any tuned launch is a correct product, and its order is fixed by the launch
    (for a weight, by (N, K)), so a row gets the same bits beside 0 or 15 others."""
    N = 200
    x, w, b = operands(N, K, dtype, device, bias, M=DECODE_ROWS)
    full = decode_matmul(x, w, b, launch)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = want.abs().amax(-1, keepdim=True).clamp_min(1e-3)
    assert ((full.double() - want) / scale).abs().max() <= TOL[dtype]
    p = chunks(K, launch.tiles.block_k, launch.splits)
    assert p.splits == launch.splits and (p.splits * p.chunk_k == K) == (K == 1536)  # the cases are what they say
    for offset, M in ((0, 1), (7, 1), (3, 5)):
        assert torch.equal(decode_matmul(x[offset : offset + M].contiguous(), w, b, launch), full[offset : offset + M])


@pytest.mark.parametrize("dtype", CPU_DTYPES + GPU_DTYPES)
@pytest.mark.parametrize("launch", DECODE_LAUNCHES, ids=lambda d: f"{d.tiles.block_n}x{d.tiles.block_k}s{d.splits}")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("K", [1000, 1536], ids=["K-ragged", "K-even"])
def test_a_gated_decode_launch_is_silu_and_mul_of_its_product(device, dtype, launch, bias, K):
    """SiLU x up in the launch's epilogue: the bits of the product followed by weft.layers.fused's SiLU x up kernel,
    and SiLU(gate) x up in float64 within the dtype's rounding."""
    N = 2 * 100
    x, w, b = operands(N, K, dtype, device, bias, M=DECODE_ROWS)
    got = decode_matmul(x, w, b, launch, gated=True)
    assert got.shape == (DECODE_ROWS, N // 2)
    assert torch.equal(got, silu_and_mul(decode_matmul(x, w, b, launch)))
    gate, up = F.linear(x.double(), w.double(), None if b is None else b.double()).chunk(2, dim=-1)
    want = F.silu(gate) * up
    scale = want.abs().amax(-1, keepdim=True).clamp_min(1e-3)
    assert ((got.double() - want) / scale).abs().max() <= 4 * TOL[dtype]


@pytest.mark.parametrize("dtype", CPU_DTYPES + GPU_DTYPES)
# (H_q, H_kv, D, K, splits, bias, norms): chunks past K's end or ending at it, one chunk; each of bias and norms
# with and without the other; on the GPU Qwen3-0.6B's heads (the norm's sum over a head of 128 in the MMA's layout)
@pytest.mark.parametrize(("H_q", "H_kv", "D", "K", "splits", "bias", "with_norms"), [
    (4, 2, 32, 200, 3, False, True), (2, 1, 64, 256, 1, True, False), (8, 2, 16, 300, 2, True, True),
    (4, 2, 32, 256, 2, False, False), pytest.param(16, 8, 128, 1024, 2, False, True, marks=pytest.mark.gpu)])
def test_a_rope_decode_launch_is_its_product_then_rotary_store(device, dtype, H_q, H_kv, D, K, splits, bias,
                                                                 with_norms):
    """qkv's decode launch with RoPE and the K/V store in its epilogue: the bits of the same launch's product and then
    weft.layers.fused.rotary_store (whose values test_kernel_layers checks), and nothing stored elsewhere (slots < 0,
    a graph's padding rows, nowhere); a row's bits whatever rows run beside it."""
    N = (H_q + 2 * H_kv) * D
    x, w, b = operands(N, K, dtype, device, bias, M=DECODE_ROWS)
    g = torch.Generator().manual_seed(K)
    angles = torch.rand(DECODE_ROWS, 1, D, generator=g) * 6
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    norms = tuple((1 + torch.randn(D, generator=g)).to(dtype).to(device) for _ in "qk") if with_norms else None
    slots = torch.randperm(4 * DECODE_ROWS, generator=g)[:DECODE_ROWS]
    slots[1::3] = -1
    slots = slots.to(device)
    launch = DecodeLaunch(Tiles(DECODE_ROWS, D, 4, 3, 64), splits, DECODE_ROWS)

    def slabs():  # the cache's rows, with a guard row on each side: a store to row -1 or past the end lands there
        return [torch.full((4 * DECODE_ROWS + 2, H_kv, D), float("nan"), dtype=dtype, device=device) for _ in "kv"]

    def same(got: torch.Tensor, want: torch.Tensor) -> bool:
        """Bit for bit; but float32 under the norms on the GPU, where a head's sum of squares is reduced in the MMA
        tile's layout, in another order than RoPE's kernel: there within a few of float32's units (bfloat16 and
        float16 round both to the same bits here)."""
        if with_norms and dtype == torch.float32 and device.type == "cuda":
            scale = want.abs().max().item() if want.numel() else 0.0
            return torch.allclose(got, want, rtol=0, atol=8 * torch.finfo(dtype).eps * scale)
        return torch.equal(got, want)

    want_slabs = slabs()
    qkv = decode_matmul(x, w, b, launch).split([H_q * D, H_kv * D, H_kv * D], dim=-1)
    q, k, v = (t.view(DECODE_ROWS, -1, D) for t in qkv)
    want_q = rotary_store(q, k, v, cos, sin, slots, *(s[1:-1] for s in want_slabs), norms, 1e-6)
    for offset, M in ((0, DECODE_ROWS), (7, 1), (3, 5)):
        rows = slice(offset, offset + M)
        got_slabs = slabs()
        got_q = decode_rope(x[rows].contiguous(), w, b, launch, H_q, H_kv, cos[rows].contiguous(),
                            sin[rows].contiguous(), norms, 1e-6, slots[rows].contiguous(),
                            *(s[1:-1] for s in got_slabs))
        assert same(got_q, want_q[rows]) and got_q.shape == (M, H_q, D)
        for got, want in zip(got_slabs, want_slabs, strict=True):
            stored = torch.zeros(len(got), dtype=torch.bool)
            stored[1 + slots[rows][slots[rows] >= 0].cpu()] = True
            assert got[~stored.to(device)].isnan().all()
            assert same(got[stored.to(device)], want[stored.to(device)])


def test_the_rope_launch_runs_half_the_plain_launchs_programs_in_whole_heads(monkeypatch):
    """rope_launch: a head's D columns per program, in steps of BLOCK_K, half as many programs as the plain tuned launch
    of qkv's weight (its chunks at least one, at most K's steps); none without a plain launch, for D not a power of
    two or past 128, with the layer's kernels off or batch-invariant. The plain launches of Qwen3-0.6B's and 4B's qkv
    on the H200 stand in."""
    from weft.layers import linear

    table = {(4096, 1024): DecodeLaunch(Tiles(DECODE_ROWS, 32, 4, 4, 128), 1, 16),
             (6144, 2560): DecodeLaunch(Tiles(DECODE_ROWS, 64, 4, 4, 256), 1, 16),
             (768, 512): DecodeLaunch(Tiles(DECODE_ROWS, 16, 4, 4, 256), 4, 8)}
    monkeypatch.setattr(linear, "decode_launch", lambda M, w, gated=False: table.get(tuple(w.shape)))
    for (N, K), D, splits in (((4096, 1024), 128, 2), ((6144, 2560), 128, 1), ((768, 512), 64, 4)):
        proj = Linear(K, N, bias=False)
        got = rope_launch(1, proj, D)
        assert got == DecodeLaunch(Tiles(DECODE_ROWS, D, 4, 4, BLOCK_K), splits, table[N, K].max_rows)
        assert rope_launch(1, proj, 96) is None and rope_launch(1, proj, 256) is None
        proj.batch_invariant = True
        assert rope_launch(1, proj, D) is None
        proj.batch_invariant, proj.kernels = False, False
        assert rope_launch(1, proj, D) is None
    assert rope_launch(1, Linear(64, 4096, bias=False), 128) is None


def test_a_decode_runs_the_mlp_and_its_linear_layers_through_their_launches(monkeypatch):
    """Where decode_launch finds a launch, SwiGLU runs gate_up gated (SiLU x up in the launch) and down_proj plain;
    with the kernels off, PyTorch's ops. A fixed launch stands in for the table, which holds GPUs' entries only."""
    from weft.distributed import SINGLE
    from weft.layers import linear, mlp

    launch = DECODE_LAUNCHES[1]
    asked = []

    def lookup(M, weight, gated=False):
        asked.append((tuple(weight.shape), gated))
        return launch

    monkeypatch.setattr(linear, "decode_launch", lookup)
    monkeypatch.setattr(mlp, "decode_launch", lookup)
    layer = mlp.SwiGLU(64, 96, False, SINGLE)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    got = layer(x)
    assert asked == [((192, 64), True), ((64, 96), False)]
    inner = decode_matmul(x, layer.gate_up_proj.weight, None, launch, gated=True)
    assert torch.equal(got, decode_matmul(inner, layer.down_proj.weight, None, launch))
    for module in (layer, layer.gate_up_proj, layer.down_proj):
        module.kernels = False
    assert torch.allclose(layer(x), got, atol=1e-5) and len(asked) == 2


def test_the_tuned_table_names_real_layers_and_reads_back_what_the_tuner_writes():
    """Every tuned entry's (N, K) is a layer of a tuned model (layer_shapes as the models build them), a decode
    launch survives the table's round trip, and the invariant launches are of whole warpgroups' rows (or, for a
    decode's rows, of its launches' DECODE_ROWS); off CUDA, and
    on a GPU never tuned, the layers keep cuBLAS and the rule of thumb."""
    from weft.models.llama import LlamaForCausalLM
    from weft.models.loader import resolve_model

    for name in ("tiny-qwen3", "tiny-qwen3-moe"):  # the MoE's router is a Linear, its experts are not
        cfg = resolve_model(name).config
        built = {tuple(m.weight.shape) for m in LlamaForCausalLM(cfg).modules() if isinstance(m, Linear)}
        assert set(layer_shapes(cfg).values()) == built
    launch = DECODE_LAUNCHES[1]
    assert DecodeLaunch.from_record(launch.record()) == launch
    nothing = tuned("no such GPU", torch.bfloat16)
    assert nothing.decode == nothing.gated == nothing.invariant == {}
    assert decode_launch(1, torch.zeros(4096, 1024)) is None  # on the CPU
    assert launch_for(256, 1024, 2048, torch.bfloat16, "no such GPU") == launch_for(256, 1024, 2048)
    shapes = {s for name in ("qwen3-0.6b", "qwen3-4b", "qwen3-8b", "llama-3.1-8b", "qwen3-30b-a3b")
              for s in layer_shapes(resolve_model(name).config).values()}
    for gpu, dtypes in json.loads(TUNED.read_text()).items():
        for dtype in dtypes:
            table = tuned(gpu, getattr(torch, dtype))
            assert table.decode.keys() | table.gated.keys() | table.invariant.keys() <= shapes
            for launch in [*table.decode.values(), *table.gated.values()]:
                assert 1 <= launch.max_rows <= DECODE_ROWS and launch.tiles.block_m == DECODE_ROWS
            for (N, K), entry in table.invariant.items():
                assert set(entry.rows) <= set(INVARIANT_ROWS)
                assert plan(N, K, getattr(torch, dtype), gpu) in invariant_orders(N, K)
                for rows, (tiles, split) in entry.rows.items():
                    assert tiles.block_m % 64 == 0 or tiles.block_m == DECODE_ROWS == rows
                    assert launch_for(rows, N, K, getattr(torch, dtype), gpu) == (tiles, split)


@pytest.mark.gpu
def test_every_tuned_invariant_launch_keeps_the_bits(device):
    """The batch-invariant table's launches on this GPU give the bits of the small tiles' whole launch in the table's
    chunks (random operands, each tuned row count), so that deterministic=True's promise holds with them."""
    from weft.layers.linear import _gpu_name

    table = tuned(_gpu_name(device.index), torch.bfloat16).invariant
    if not table:
        pytest.skip(f"no tuned launches for {_gpu_name(device.index)}")
    for (N, K), entry in table.items():
        w = (torch.randn(N, K, device=device) / K**0.5).to(torch.bfloat16)
        for rows, (tiles, split) in entry.rows.items():
            x = torch.randn(rows, K, device=device).to(torch.bfloat16)
            want = matmul_kernel(x, w, None, False, DECODE_TILES)
            assert torch.equal(matmul_kernel(x, w, None, split, tiles), want), (N, K, rows, tiles, split)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [PREFILL_TILES, Tiles(128, 256, 8, 3, 64, tma=True)], ids=["pointers", "tma"])
def test_rows_past_two_to_the_31_elements_are_read_and_stored_where_they_are(device, tiles):
    """A prefill of every prompt at once (e8's ~145k rows of Qwen3-4B's gate_up, 19,456 wide) holds more than 2^31
    elements in its output (and its input may): the last rows are stored, and read, where they are, with the bits
    they get alone."""
    N = K = 16384
    M = 2**31 // K + 200  # x and the output both past 2^31 elements
    x = torch.randn(M, K, device=device).to(torch.bfloat16)
    w = (torch.randn(N, K, device=device) / K**0.5).to(torch.bfloat16)
    full = matmul_kernel(x, w, None, False, tiles)
    assert torch.equal(full[-300:], matmul_kernel(x[-300:].contiguous(), w, None, False, tiles))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_row_blocks_keep_every_rows_bits(dtype):
    x, w, b = operands(200, 576, dtype, "cpu", True, M=300)
    full = batch_invariant_linear(x, w, b)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(full.double(), F.linear(x.double(), w.double(), b.double()), atol=tol)
    for offset, M in SLICES + [(1, 299)]:
        assert torch.equal(batch_invariant_linear(x[offset : offset + M], w, b), full[offset : offset + M])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_attention_matches_sdpa_and_keeps_each_querys_bits(dtype):
    """One request's 40 queries over its 40 keys, and then its 25th query alone (a decode, 25 keys) beside another
    request of 150: the query's output is the same bits, and matches SDPA's."""
    g = torch.Generator().manual_seed(0)
    H_q, H_kv, D, S = 4, 2, 32, 40
    q = torch.randn(1, H_q, 48, D, generator=g).to(dtype)  # 48: three blocks of 16 rows, the last 8 padding
    k, v = (torch.randn(1, H_kv, S, D, generator=g).to(dtype) for _ in range(2))
    causal = torch.ones(48, S, dtype=torch.bool).tril()[None, None]
    whole = attend_invariant(q, k, v, causal, 0.2)
    want = F.scaled_dot_product_attention(q[:, :, :S].double(), k.double(), v.double(), is_causal=True, scale=0.2,
                                          enable_gqa=True)
    assert torch.allclose(whole[:, :, :S].double(), want, atol=1e-5 if dtype == torch.float32 else 2e-2)
    # the decode: request 0 is another of 150 keys; request 1's query 24 sees its first 25 keys, in row 0 of 16
    other_k, other_v = (torch.randn(1, H_kv, 150, D, generator=g).to(dtype) for _ in range(2))
    ks = torch.cat([other_k, F.pad(k[:, :, :25], (0, 0, 0, 125))])
    vs = torch.cat([other_v, F.pad(v[:, :, :25], (0, 0, 0, 125))])
    qs = torch.cat([torch.randn(1, H_q, 16, D, generator=g).to(dtype), F.pad(q[:, :, 24:25], (0, 0, 0, 15))])
    mask = torch.zeros(2, 1, 16, 150, dtype=torch.bool)
    mask[0, :, :, :] = True
    mask[1, :, 0, :25] = True
    decode = attend_invariant(qs, ks, vs, mask, 0.2)
    assert torch.equal(decode[1, :, 0], whole[0, :, 24])
