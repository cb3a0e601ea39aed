"""Steps replayed from CUDA graphs (decode steps whole, the others piecewise) give the tokens the eager forward
gives."""

from __future__ import annotations

import pytest
import torch

from weft import LLM, SamplingParams
from weft.attention.base import CacheSlots
from weft.attention.paged import PagedBackend
from weft.benchmark.replay import Arrival, replay_ticks
from weft.inference.cuda_graphs import (
    MIXED_PREFILLS,
    AttentionBuffers,
    AttentionCut,
    DecodeGraphs,
    graph_batch_sizes,
    graph_token_counts,
)
from weft.layers.norm import RMSNorm
from weft.layers.rotary import RotaryEmbedding, apply_rotary, rotate_into_cache

pytestmark = pytest.mark.correctness


@pytest.mark.parametrize("max_batch", [1, 5, 16, 100, 256])
def test_batch_sizes_cover_every_batch(max_batch):
    sizes = graph_batch_sizes(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_batch
    # every batch has a size within 16 rows of padding (and within 2x for the small ones)
    for B in range(1, max_batch + 1):
        size = next(s for s in sizes if s >= B)
        assert size - B < 16 and size < 2 * B


@pytest.mark.parametrize("max_tokens", [1, 8, 100, 2048, 8192])
def test_token_counts_cover_every_step(max_tokens):
    counts = graph_token_counts(max_tokens)
    assert counts == sorted(set(counts)) and counts[-1] == max_tokens
    for T in range(1, max_tokens + 1):  # padded by at most half its rows (or to 8), and by under 256 or 512
        size = next(s for s in counts if s >= T)
        assert size <= max(8, 2 * T) and size - T < (256 if T <= 4096 else 512)


def test_refuses_backend_without_graphs():
    engine = LLM("tiny-llama", attention="paged", num_blocks=8, block_size=4, device="cpu").llm_engine
    with pytest.raises(ValueError, match="paged attention cannot be captured"):
        DecodeGraphs(engine.model, PagedBackend(engine.model_config, 8, 4, torch.float32, torch.device("cpu")), 4, 32)


@pytest.mark.gpu
@pytest.mark.parametrize(("attention", "mode"), [("triton", "FULL_AND_PIECEWISE"), ("triton", "FULL_DECODE_ONLY"),
                                                 ("triton", "PIECEWISE"), ("paged", "PIECEWISE"),
                                                 ("contiguous", "PIECEWISE")])
@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_graphs_match_eager(reference, scheduler, attention, mode):
    """Batches of every size from 1 to 5 (arrivals staggered, outputs of different lengths), so
    decode graphs of sizes 1, 2, 4 and 8 replay with and without padding rows; prompts arriving beside
    decodes, in chunks of 16 tokens and less, so piecewise graphs replay with padding rows too, after
    larger steps have left their rows stale."""
    ref = reference("tiny-qwen3")
    prompts = ref.prompts[:5]
    params = [SamplingParams(max_tokens=8 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    arrivals = [0, 0, 2, 5, 9]
    outputs = {}
    for graphed in (False, True):
        with LLM("tiny-qwen3", attention=attention, scheduler=scheduler, num_blocks=64, block_size=4,
                 max_num_seqs=8, max_num_batched_tokens=16, dtype="float32", device="cuda",
                 cudagraph_mode=mode if graphed else "NONE") as llm:
            runner = llm.llm_engine.runner
            zipped = zip(prompts, params, arrivals, strict=True)
            arrived = [Arrival(i, p, sp, tick) for i, (p, sp, tick) in enumerate(zipped)]
            outputs[graphed] = [o.outputs[0].token_ids for o in replay_ticks(llm.llm_engine, arrived)]
            decode_graphs = graphed and mode.startswith("FULL") and attention == "triton"
            assert (runner.graphs is not None) == decode_graphs
            assert (runner.mixed is not None) == (decode_graphs and mode == "FULL_AND_PIECEWISE")
            assert (runner.pieces is not None) == (graphed and mode.endswith("PIECEWISE"))
            if decode_graphs:
                assert runner.graphs.sizes == [1, 2, 4, 8] and runner.graphs.replays > 0
            if runner.mixed is not None:  # every other step: at most 5 prompts, so none is left to the pieces
                assert runner.mixed.sizes == [8, 16] and runner.mixed.replays > 0 and runner.pieces.replays == 0
            elif runner.pieces is not None:
                assert runner.pieces.sizes == [8, 16] and runner.pieces.replays > 0
    assert outputs[True] == outputs[False]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_steps_of_more_prompts_than_a_mixed_graph_holds_run_piecewise(reference, name):
    """MIXED_PREFILLS + 2 short prompts and a long one at once, 6 new tokens each: the first step holds more prompts
    than a mixed graph does (the long one's first chunk among them) and replays piecewise, the next (the long one's
    last chunk beside the decodes) a mixed graph, the rest decode graphs; the tokens are the eager forward's. With
    the MoE too, whose router reads the graphs' padding rows (attention leaves them 0 there: never NaN)."""
    ref = reference(name)
    tokens = [t for p in ref.prompts for t in p]
    assert len(tokens) >= 60
    prompts = [p[:3] for p in (ref.prompts * MIXED_PREFILLS)[: MIXED_PREFILLS + 2]] + [tokens[:60]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = {}
    for mode in ("NONE", "FULL_AND_PIECEWISE"):
        with LLM(name, attention="triton", num_blocks=256, block_size=4, max_num_seqs=16,
                 max_num_batched_tokens=48, dtype="float32", device="cuda", cudagraph_mode=mode) as llm:
            outputs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            runner = llm.llm_engine.runner
            if mode != "NONE":
                assert runner.pieces.replays > 0 and runner.mixed.replays > 0 and runner.graphs.replays > 0
    assert outputs["FULL_AND_PIECEWISE"] == outputs["NONE"]


@pytest.mark.parametrize("with_norms", [False, True], ids=["rope", "norm-rope"])
def test_the_cut_leaves_attentions_inputs_in_its_buffers_by_either_path(device, with_norms):
    """The piecewise graphs' cut, in its warm-up form (no graphs): storing k and v at its cache_slots from RoPE's
    kernel and attending leaves the very bits that rotating q and k and calling its forward does (the kernels:
    Triton's interpreter on the CPU)."""
    T, H_q, H_kv, D = 5, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, h, D, generator=g).to(device) for h in (H_q, H_kv, H_kv))
    positions = torch.randint(0, 64, (T,), generator=g).to(device)
    cos, sin = RotaryEmbedding(D, 1e4, 64).to(device)(positions, torch.float32)
    norms = None
    if with_norms:  # Qwen3's q and k norms, in the same kernel
        norms = (RMSNorm(D, 1e-6).to(device), RMSNorm(D, 1e-6).to(device))
        with torch.no_grad():
            for norm in norms:
                norm.weight.copy_(1 + torch.randn(D, generator=g))
    left = []
    for path in ("cache_slots", "forward"):
        buffers = AttentionBuffers.allocate(8, H_q, H_kv, D, torch.float32, device)
        cut = AttentionCut(buffers.first(T), None)
        if path == "cache_slots":
            slots = cut.cache_slots(0, None)
            q_rotated = rotate_into_cache(q, k, v, cos, sin, slots.slot_mapping, slots.k_rows, slots.v_rows, norms)
            out = cut.attend(0, q_rotated, None)
        else:
            out = cut.forward(0, *apply_rotary(q, k, cos, sin, norms, kernels=True), v, None)
        assert out.data_ptr() == buffers.out.data_ptr()  # the eager attention between the replays fills it
        assert cut.pieces.stored == [False]  # k and v in the buffers: the eager part stores them
        left.append([buffers.q[:T].clone(), buffers.k[:T].clone(), buffers.v[:T].clone()])
    assert all(torch.equal(a, b) for a, b in zip(*left, strict=True))
    assert torch.equal(left[0][2], v)


def test_the_cut_with_a_store_leaves_k_and_v_in_the_cache_at_its_slots(device):
    """Given where to store (a backend whose slots are rows of its cache), the cut's RoPE kernel stores each token's
    K/V at its slot, a padding row's (-1) nowhere, and leaves the rotated q in the buffer: the eager part between the
    replays then only attends (the kernels: Triton's interpreter on the CPU)."""
    T, H_q, H_kv, D, rows = 5, 4, 2, 16, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(T, h, D, generator=g).to(device) for h in (H_q, H_kv, H_kv))
    cos, sin = RotaryEmbedding(D, 1e4, 64).to(device)(torch.arange(T, device=device), torch.float32)
    slots = torch.tensor([3, 9, -1, 0, 14], device=device)
    k_rows, v_rows = (torch.zeros(rows, H_kv, D, device=device) for _ in range(2))
    buffers = AttentionBuffers.allocate(8, H_q, H_kv, D, torch.float32, device)
    cut = AttentionCut(buffers.first(T), None, lambda layer: CacheSlots(slots, k_rows, v_rows))
    at = cut.cache_slots(0, None)
    cut.attend(0, rotate_into_cache(q, k, v, cos, sin, at.slot_mapping, at.k_rows, at.v_rows, None), None)
    assert cut.pieces.stored == [True]
    q_want, k_want = apply_rotary(q, k, cos, sin, None, kernels=True)
    assert torch.equal(buffers.q[:T], q_want)
    kept = slots >= 0
    assert torch.equal(k_rows[slots[kept]], k_want[kept]) and torch.equal(v_rows[slots[kept]], v[kept])
    untouched = torch.ones(rows, dtype=torch.bool, device=device)
    untouched[slots[kept]] = False
    assert not k_rows[untouched].any() and not v_rows[untouched].any()
