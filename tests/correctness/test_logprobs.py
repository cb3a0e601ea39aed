"""Logprobs: each generated and each prompt token's log-probability and likeliest alternatives, as
HF's log_softmax of its own logits says (float32, within 1e-4), chunked, cached or preempted."""

from __future__ import annotations

import pytest
import torch

from weft import LLM, RequestOutputKind, SamplingParams
from weft.utils import cdiv

pytestmark = pytest.mark.correctness
K = 5


@torch.inference_mode()
def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is the log-distribution of the token after ids[: i + 1]."""
    return hf_model(torch.tensor([ids], device=hf_model.device)).logits[0].float().log_softmax(-1).cpu()


def check_position(entry: dict, token: int, expected: torch.Tensor, k: int) -> None:
    top = expected.topk(k)
    assert set(entry) == {token, *top.indices.tolist()}
    assert abs(entry[token].logprob - expected[token].item()) < 1e-4
    assert entry[token].rank == int((expected > expected[token]).sum()) + 1
    for rank, (lp, t) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
        assert entry[t].rank == rank and abs(entry[t].logprob - lp) < 1e-4


@pytest.mark.parametrize("options", ["whole", "chunks-of-5", "small-pool"])
def test_logprobs_match_hf(model, reference, device, options):
    ref = reference(model)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    pool = {"num_blocks": 256, "block_size": 4}
    if options == "chunks-of-5":
        pool["max_num_batched_tokens"] = 5
    if options == "small-pool":  # the prompts' blocks: growing, they preempt one another
        alone = max(cdiv(len(p) + 7, 4) for p in ref.prompts)
        pool["num_blocks"] = max(alone, sum(cdiv(len(p), 4) for p in ref.prompts))
    with LLM(model, device=device, **pool) as llm:
        outs = llm.generate(ref.prompts, params, use_tqdm=False)
        if options == "small-pool":
            assert llm.llm_engine.stats.num_preemptions > 0  # a recomputed prompt scores its tokens once
    for ids, out in zip(ref.prompts, outs, strict=True):
        generated = out.outputs[0].token_ids
        expected = hf_logprobs(ref.hf_model, ids + generated)
        assert len(out.outputs[0].logprobs) == len(generated)
        for j, (token, entry) in enumerate(zip(generated, out.outputs[0].logprobs, strict=True)):
            check_position(entry, token, expected[len(ids) + j - 1], K)
            assert entry[token].rank == 1  # greedy
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        for i in range(1, len(ids)):
            check_position(out.prompt_logprobs[i], ids[i], expected[i - 1], K)


def test_streamed_logprobs_add_up_and_zero_alternatives(device):
    with LLM("tiny-llama", num_blocks=64, block_size=4, device=device) as llm:
        final = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2),
                             use_tqdm=False)[0].outputs[0].logprobs
        engine = llm.llm_engine
        engine.add_request("d", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2,
                                                          output_kind=RequestOutputKind.DELTA))
        pieces = []
        while engine.has_unfinished_requests():
            pieces += [e for o in engine.step() for e in o.outputs[0].logprobs]
        assert [{t: round(e.logprob, 5) for t, e in d.items()} for d in pieces] == [
            {t: round(e.logprob, 5) for t, e in d.items()} for d in final]
        bare = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, logprobs=0), use_tqdm=False)[0]
        assert all(len(d) == 1 for d in bare.outputs[0].logprobs)  # the chosen token alone
        plain = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
        assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None


def test_a_prompt_asking_for_its_logprobs_is_computed_not_taken_from_the_cache(device):
    with LLM("tiny-llama", num_blocks=64, block_size=4, device=device) as llm:
        prompt = list(range(1, 14))
        llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        hits = llm.llm_engine.stats.prefix_cache_hits
        out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1),
                           use_tqdm=False)[0]
        assert llm.llm_engine.stats.prefix_cache_hits == hits and len(out.prompt_logprobs) == len(prompt)
        llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        assert llm.llm_engine.stats.prefix_cache_hits > hits  # without it, the cache serves the prompt
