"""Tensor parallelism on the CPU: two ranks over gloo, each holding its slice of the model and of the pool,
serve HF's tokens exactly; each rank's weights are its slice of the checkpoint's; bad sizes are refused."""

from __future__ import annotations

import pytest
import torch

from weft import LLM, SamplingParams
from weft.distributed import TensorParallel
from weft.models import build_model
from weft.models.loader import resolve_model
from weft.models.weights import checkpoint_layout

pytestmark = pytest.mark.correctness


# Qwen2: Llama's decoder with biases on q, k and v, which the ranks slice as their weights; Qwen3: its q/k norms
@pytest.mark.parametrize(("name", "scheduler"), [("tiny-qwen2", "continuous"), ("tiny-qwen3", "static")])
def test_two_ranks_match_hf(reference, name, scheduler):
    ref = reference(name, torch.device("cpu"))
    params = SamplingParams(max_tokens=ref.max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(name, tensor_parallel_size=2, scheduler=scheduler, attention="paged", num_blocks=64, block_size=4,
             device="cpu") as llm:
        outs = llm.generate(ref.prompts, params, use_tqdm=False)
        workers = llm.llm_engine.ranks.processes
        assert [w.is_alive() for w in workers] == [True]
    assert [o.outputs[0].token_ids for o in outs] == ref.expected
    assert not any(w.is_alive() for w in workers)  # close() let the other rank go


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "NONE"])
def test_two_gpus_match_hf(reference, mode):
    """Two ranks over NCCL, with CUDA graphs (the all-reduces captured in them, 16-token chunks beside decodes)
    and without: HF's tokens exactly."""
    ref = reference("tiny-qwen3")
    params = SamplingParams(max_tokens=ref.max_tokens, temperature=0.0, ignore_eos=True)
    with LLM("tiny-qwen3", tensor_parallel_size=2, attention="triton", num_blocks=64, block_size=4, max_num_seqs=8,
             max_num_batched_tokens=16, dtype="float32", device="cuda", cudagraph_mode=mode) as llm:
        outs = llm.generate(ref.prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref.expected


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen2"])
def test_each_rank_holds_its_slice_of_every_weight(name):
    source = resolve_model(name)
    cfg = source.config
    whole = build_model(cfg, torch.float32, torch.device("cpu"))
    source.load_into(whole)
    ranks = []
    for rank in range(2):
        ranks.append(build_model(cfg, torch.float32, torch.device("cpu"), TensorParallel(rank, 2)))
        source.load_into(ranks[-1])
    q, kv = cfg.H_q * cfg.D, cfg.H_kv * cfg.D
    for name, full in whole.named_parameters():
        a, b = (dict(r.named_parameters())[name] for r in ranks)
        if name.endswith(("o_proj.weight", "down_proj.weight")):  # by input columns
            assert torch.equal(torch.cat([a, b], dim=1), full), name
        elif "qkv_proj" in name:  # each rank: its query heads, then its K/V heads (weights and biases)
            fq, fk, fv = full.split([q, kv, kv])
            for r, mine in enumerate((a, b)):
                mq, mk, mv = mine.split([q // 2, kv // 2, kv // 2])
                half = slice(r * kv // 2, (r + 1) * kv // 2)
                assert torch.equal(mq, fq[r * q // 2 : (r + 1) * q // 2]) and torch.equal(mk, fk[half])
                assert torch.equal(mv, fv[half]), name
        elif "gate_up_proj" in name:  # its MLP columns of gate, then of up
            gate, up = full.chunk(2)
            for r, mine in enumerate((a, b)):
                assert torch.equal(mine, torch.cat([gate.chunk(2)[r], up.chunk(2)[r]])), name
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):  # by vocabulary rows
            assert torch.equal(torch.cat([a, b]), full), name
        else:  # norms: whole on every rank
            assert torch.equal(a, full) and torch.equal(b, full), name


def test_fewer_kv_heads_than_ranks_are_replicated():
    """tiny-llama has 2 K/V heads: at 4 ranks, ranks 0-1 read head 0 and ranks 2-3 head 1, as their query
    heads (one each of 4) do."""
    source = resolve_model("tiny-llama")
    cfg, D = source.config, source.config.D
    firsts = []
    for rank in range(4):
        tp = TensorParallel(rank, 4)
        model = build_model(cfg, torch.float32, torch.device("meta"), tp)
        slot = checkpoint_layout(model, cfg, tp)["model.layers.0.self_attn.k_proj.weight"]
        firsts.append(slot.part)
        assert model.model.layers[0].self_attn.cfg.H_kv == 1
    assert firsts == [(0, 0, D), (0, 0, D), (0, D, D), (0, D, D)]


@pytest.mark.parametrize(("size", "error", "match"), [
    (0, ValueError, "tensor_parallel_size must be >= 1"),
    ("2", TypeError, "tensor_parallel_size"),
    (3, ValueError, "tensor_parallel_size=3 does not divide the model's 4 query heads"),
    (8, ValueError, "tensor_parallel_size=8 does not divide the model's 4 query heads"),
])  # fmt: skip
def test_bad_sizes_are_refused_before_any_work(size, error, match):
    with pytest.raises(error, match=match):
        LLM("tiny-llama", tensor_parallel_size=size, device="cpu")


def test_an_in_memory_model_cannot_be_split(reference):
    with pytest.raises(ValueError, match="needs a model by name or directory"):
        LLM(reference("tiny-llama").hf_model, tensor_parallel_size=2, device="cpu")


@pytest.mark.gpu
def test_more_ranks_than_gpus_are_refused():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"tensor_parallel_size={2 * n}, but this machine has {n} CUDA"):
        LLM("tiny-llama", tensor_parallel_size=2 * n, device="cuda")
