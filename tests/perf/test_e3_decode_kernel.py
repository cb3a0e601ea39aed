"""E3: attention kernels. Decode: weft's Triton split-KV kernel against the paged backend's
gather + SDPA and against PyTorch's compiled flex_attention over a paged block mask, as a
fraction of the measured copy bandwidth. Prefill: the Triton kernel over the paged cache
against SDPA on the same tokens laid out contiguously.

Decode timings are GPU time alone: graph_seconds replays the calls from a CUDA graph,
each call on its own copy of the cache so that none finds its K/V in L2. Beside them, the
time as launched from Python one call at a time (do_bench, L2 flushed), which adds the host's
launch overhead. Without a GPU a single tiny case per test runs under Triton's interpreter,
timed by the host clock, only so that the code cannot rot.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from weft.attention.base import AttentionBackend, AttentionMetadata
from weft.attention.paged import PagedBackend
from weft.attention.triton import TritonBackend
from weft.benchmark.environment import graph_seconds, kernel_environment, launched_seconds
from weft.config import ModelConfig

HAS_CUDA = torch.cuda.is_available()  # without it, Triton runs in its interpreter (root conftest.py)

pytestmark = pytest.mark.perf

H_Q, H_KV, D = 16, 8, 128
SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768)
BACKENDS = ("triton", "paged", "flex")
# (B, S, P): the full sweep at B = 8, and B = 1 / 64 at a few S; backends innermost so that
# consecutive cases share one cache, and P outside S so flex recompiles once per P.
GPU_DECODE = [(8, s, p) for p in (8, 16, 64, 256) for s in SIZES]
GPU_DECODE += [(1, s, 16) for s in (512, 4096, 32768)] + [(64, s, 16) for s in (512, 2048, 8192)]
GPU_PREFILL = [(4, 4096, p) for p in (16, 256)]  # (B, T, P)
ROUNDS = 5  # turns each timed function takes in interleaved_seconds
ROTATION_BYTES = 256 << 20  # decode data cycled through per timing: several times the H200's 60 MB L2


def cases(gpu_cases: list[tuple], cpu_case: tuple, backends: tuple[str, ...] = ()) -> list:
    """The GPU sweep, then one tiny case for the CPU (each crossed with `backends`, if any)."""
    per_case = [(b,) for b in backends] or [()]
    gpu = [pytest.param(*c, *b, marks=pytest.mark.gpu) for c in gpu_cases for b in per_case]
    on_cpu_only = pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the real sizes")
    cpu = [
        pytest.param(*cpu_case, *b, id="-".join(map(str, ("cpu", *cpu_case, *b))), marks=on_cpu_only) for b in per_case
    ]
    return gpu + cpu


@dataclass
class Shapes:
    H_q: int
    H_kv: int
    D: int
    dtype: torch.dtype

    def record(self) -> dict:
        """The shape fields every e3 record carries."""
        return dict(H_q=self.H_q, H_kv=self.H_kv, D=self.D, dtype=str(self.dtype).removeprefix("torch."))


GPU_SHAPES = Shapes(H_Q, H_KV, D, torch.bfloat16)
CPU_SHAPES = Shapes(4, 2, 64, torch.float32)  # float32: the interpreter gets bf16 wrong


def shapes() -> Shapes:
    return GPU_SHAPES if HAS_CUDA else CPU_SHAPES


def interleaved_seconds(*fns: Callable[[], object]) -> list[float]:
    """Median of ROUNDS launched_seconds per fn (one on the CPU), the fns taking turns, first to last
    and back, so that a clock or thermal swing during the run, or going first, lands on all of them."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(ROUNDS if HAS_CUDA else 1):
        for i in range(len(fns))[:: 1 if r % 2 == 0 else -1]:
            times[i].append(launched_seconds(fns[i]))
    return [statistics.median(t) for t in times]


@dataclass
class DecodeInputs:
    """One decode step, in `copies` disjoint copies: B requests of S cached tokens each, in
    shuffled blocks of P. Together the copies are several times the GPU's L2."""

    cfg: ModelConfig
    kv_cache: torch.Tensor  # [2, 1, N, P, H_kv, D], random; N = copies * B * ceil(S / P)
    metas: list[AttentionMetadata]  # one per copy
    q: torch.Tensor  # [B, H_q, D]
    expected: torch.Tensor  # [B, H_q, D]: the paged backend's output on copy 0


def model_config(s: Shapes) -> ModelConfig:
    return ModelConfig(
        arch="llama",
        V=32,
        E=s.H_q * s.D,
        L=1,
        H_q=s.H_q,
        H_kv=s.H_kv,
        D=s.D,
        intermediate=32,
        rms_eps=1e-6,
        rope_theta=1e4,
        max_model_len=1 << 16,
        tie_word_embeddings=False,
    )


def backend(cls: type[AttentionBackend], inputs: DecodeInputs) -> AttentionBackend:
    """A backend of `cls` over the shared slab (its own freshly allocated one is dropped)."""
    N, P = inputs.kv_cache.shape[2:4]
    attn = cls(inputs.cfg, N, P, inputs.kv_cache.dtype, inputs.kv_cache.device)
    attn.kv_cache = inputs.kv_cache
    return attn


@functools.lru_cache(maxsize=1)
def decode_inputs(B: int, S: int, P: int, device: torch.device) -> DecodeInputs:
    s = shapes()
    cfg = model_config(s)
    blocks = -(-S // P)
    copies = -(-ROTATION_BYTES // kv_bytes(B, S, s)) if HAS_CUDA else 1
    N = copies * B * blocks
    kv_cache = torch.randn(PagedBackend.slab_shape(cfg, N, P), dtype=s.dtype, device=device)
    tables = torch.randperm(N, device=device).view(copies, B, blocks).to(torch.int32)
    last = S - 1  # each request's new token, already written
    metas = [
        AttentionMetadata(
            slot_mapping=table[:, last // P].long() * P + last % P,
            query_start_loc=torch.arange(B + 1, dtype=torch.int32, device=device),
            context_lens=torch.full((B,), S, dtype=torch.int32, device=device),
            block_tables=table,
            max_query_len=1,
            max_context_len=S,
            num_decodes=B,
        )
        for table in tables
    ]
    q = torch.randn(B, s.H_q, s.D, dtype=s.dtype, device=device)
    inputs = DecodeInputs(cfg, kv_cache, metas, q, q)
    paged = backend(PagedBackend, inputs)
    inputs.expected = paged.attend(0, q, paged.prepare(metas[0]))
    return inputs


def kv_bytes(B: int, S: int, s: Shapes) -> int:
    """The K/V bytes a decode step must read: each cached token's K and V, once."""
    return B * S * s.H_kv * s.D * 2 * s.dtype.itemsize


def flex_decode(inputs: DecodeInputs, meta: AttentionMetadata) -> Callable[[], torch.Tensor]:
    """flex_attention reading the paged slab in place: one "batch" of N * P tokens, and a block
    mask whose KV blocks are the pages of each request (BLOCK_SIZE P); the mask proper only
    cuts the last, partly filled page."""
    from torch.nn.attention.flex_attention import BlockMask

    q = inputs.q
    N, P = inputs.kv_cache.shape[2:4]
    B, H_q, D_ = q.shape
    k, v = (inputs.kv_cache[i, 0].flatten(0, 1).transpose(0, 1)[None] for i in (0, 1))  # [1, H_kv, N*P, D]
    table = meta.block_tables
    ctx = meta.context_lens
    tail = ctx % P
    rows = torch.arange(B, device=table.device)
    # page_of[b, n]: which page of request b physical block n holds (-1: not b's). Eager flex
    # applies mask_mod everywhere; compiled flex only on the partial pages, skipping full ones.
    page_of = table.new_full((B, N), -1)
    page_of[rows[:, None], table.long()] = torch.arange(table.shape[1], device=table.device).to(table.dtype)

    def in_context(b, h, q_idx, kv_idx):
        page = page_of[b, kv_idx // P]
        return (page >= 0) & (page * P + kv_idx % P < ctx[b])

    # Index tensors as wide as the physical blocks: flex turns them into dense [.., N] masks.
    full_pages = table.new_zeros(B, 1, 1, N)
    full_pages[..., : table.shape[1]] = table[:, None, None]
    partial_pages = table.new_zeros(B, 1, 1, N)
    partial_pages[:, 0, 0, 0] = table[rows, (ctx // P).clamp(max=table.shape[1] - 1).long()]
    mask = BlockMask.from_kv_blocks(
        (tail > 0).int().view(B, 1, 1),
        partial_pages,
        (ctx // P).int().view(B, 1, 1),
        full_pages,
        BLOCK_SIZE=(128, P),
        mask_mod=in_context,
        seq_lengths=(1, N * P),
    )
    q4 = q.unsqueeze(2)  # [B, H_q, 1, D]
    flex = compiled_flex(B)

    def run() -> torch.Tensor:
        return flex(q4, k, v, block_mask=mask, scale=D_**-0.5, enable_gqa=True).squeeze(2)

    return run


_flex_batch: list[int] = []


def compiled_flex(B: int) -> Callable:
    """flex_attention, compiled on the GPU (eager, unfused, on the CPU).

    Dynamo turns a changed size dynamic, and flex's decoding kernel needs a static batch:
    so compiled code is dropped whenever B changes, and within one B only S varies.
    """
    from torch.nn.attention.flex_attention import flex_attention

    if not HAS_CUDA:
        return flex_attention
    if _flex_batch != [B]:
        torch._dynamo.reset()
        _flex_batch[:] = [B]
    return _compile(flex_attention)


@functools.cache
def _compile(fn: Callable) -> Callable:
    return torch.compile(fn)


def decode_fns(name: str, inputs: DecodeInputs) -> list[Callable[[], torch.Tensor]]:
    """`name`'s decode step, one callable per copy of the data."""
    if name == "flex":
        return [flex_decode(inputs, meta) for meta in inputs.metas]
    attn = backend(TritonBackend if name == "triton" else PagedBackend, inputs)
    steps = [attn.prepare(meta) for meta in inputs.metas]
    return [functools.partial(attn.attend, 0, inputs.q, step) for step in steps]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the CPU case, on purpose
@pytest.mark.parametrize(("B", "S", "P", "attention"), cases(GPU_DECODE, (2, 37, 8), BACKENDS))
def test_e3_decode(benchmark, device, B, S, P, attention):
    inputs = decode_inputs(B, S, P, device)
    try:
        fns = decode_fns(attention, inputs)
        with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
            out = [fn() for fn in fns][0]  # every copy compiled before any timing
    except Exception as e:  # flex_attention refuses some shapes (at compile time)
        if attention != "flex":
            raise
        lines = str(e).strip().splitlines() or [""]  # compile errors: the cause is on the last line
        cause = lines[0][:150] + (f" ... {lines[-1][:200]}" if len(lines) > 1 else "")
        pytest.skip(f"flex_attention cannot run B={B} S={S} P={P}: {type(e).__name__}: {cause}")
    err = relative_error(out, inputs.expected)
    assert err < 2e-2, f"{attention} disagrees with the paged backend: relative error {err:.3g}"

    launched = launched_seconds(fns[0])
    seconds = graph_seconds(fns) if HAS_CUDA else launched
    s = shapes()
    nbytes = kv_bytes(B, S, s)
    gbps = nbytes / seconds / 1e9
    env = kernel_environment(device)
    benchmark.extra_info.update(
        experiment="e3",
        attention=attention,
        S=S,
        B=B,
        P=P,
        **s.record(),
        time_s=seconds,
        bytes=nbytes,
        gbps=gbps,
        pct_of_copy=100 * gbps / env["copy_gbps"] if env["copy_gbps"] else None,
        launched_time_s=launched,
        launched_gbps=nbytes / launched / 1e9,
        copies=len(fns),
        timer="CUDA graph replays, median" if HAS_CUDA else "host clock, one call",
        rel_err_vs_paged=err,
        **env,
    )
    benchmark.pedantic(fns[0], rounds=1, iterations=1)


@pytest.mark.parametrize(("B", "T", "P"), cases(GPU_PREFILL, (1, 40, 8)))
def test_e3_prefill(benchmark, device, B, T, P):
    """B prompts of T tokens each, nothing cached before them: Triton over the paged cache
    (K/V already written) vs SDPA (causal) on contiguous [B, H_q, T, D] tensors."""
    s = shapes()
    cfg = model_config(s)
    blocks = -(-T // P)
    N = B * blocks
    attn = TritonBackend(cfg, N, P, s.dtype, device)
    table = torch.randperm(N, device=device).view(B, blocks).to(torch.int32)
    pos = torch.arange(T, device=device)
    slots = (table[:, pos // P].long() * P + pos % P).flatten()  # [B * T]
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(0, B * T + 1, T, dtype=torch.int32, device=device),
        context_lens=torch.full((B,), T, dtype=torch.int32, device=device),
        block_tables=table,
        max_query_len=T,
        max_context_len=T,
        num_decodes=0,
    )
    q, k, v = (torch.randn(B * T, h, s.D, dtype=s.dtype, device=device) for h in (s.H_q, s.H_kv, s.H_kv))
    step = attn.prepare(meta)
    attn.write(0, k, v, step)

    def contiguous(x: torch.Tensor) -> torch.Tensor:  # [B * T, H, D] -> [B, H_q, T, D]
        x = x.view(B, T, x.shape[1], s.D).transpose(1, 2)
        return x.repeat_interleave(s.H_q // x.shape[1], 1).contiguous()  # SDPA's fastest path: no GQA

    qc, kc, vc = contiguous(q), contiguous(k), contiguous(v)
    triton_fn = functools.partial(attn.attend, 0, q, step)
    sdpa_fn = functools.partial(F.scaled_dot_product_attention, qc, kc, vc, is_causal=True)
    expected = sdpa_fn().transpose(1, 2).flatten(0, 1)  # [B * T, H_q, D]
    err = relative_error(triton_fn(), expected)
    assert err < 2e-2, f"triton prefill disagrees with SDPA: relative error {err:.3g}"

    seconds, sdpa_seconds = interleaved_seconds(triton_fn, sdpa_fn)
    flops = 4 * B * s.H_q * s.D * T * (T + 1) / 2  # QK^T and PV over the causal half
    benchmark.extra_info.update(
        experiment="e3_prefill",
        attention="triton",
        B=B,
        T=T,
        P=P,
        **s.record(),
        time_s=seconds,
        sdpa_time_s=sdpa_seconds,
        ratio_vs_sdpa=seconds / sdpa_seconds,
        tflops=flops / seconds / 1e12,
        sdpa_tflops=flops / sdpa_seconds / 1e12,
        rel_err_vs_sdpa=err,
        timer=f"median of {ROUNDS} do_bench medians, in turns with SDPA's" if HAS_CUDA else "host clock, one call",
        **kernel_environment(device),
    )
    benchmark.pedantic(triton_fn, rounds=1, iterations=1)
