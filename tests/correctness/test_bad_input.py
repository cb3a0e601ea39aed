"""Bad input raises ValueError naming the problem before any work, and the LLM keeps serving."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from weft import LLM, SamplingParams

pytestmark = pytest.mark.correctness

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(device):
    return LLM("tiny-llama", num_blocks=8, block_size=4, max_model_len=64, device=device)


@pytest.mark.parametrize(
    ("prompts", "params", "arrivals", "message"),
    [
        ([[]], GREEDY, None, "prompt 0 is empty"),
        ([[1, 2], [1, 512]], GREEDY, None, "prompt 1 has token ids outside the vocabulary"),
        ([[1, -3]], GREEDY, None, "outside the vocabulary"),
        ([list(range(1, 65))], GREEDY, None, "the model's context"),
        ([[1, 2]], SamplingParams(max_tokens=100, temperature=0.0), None, "could never run"),
        (["some text"], GREEDY, None, "has no tokenizer"),
        ([[1, 2]], [GREEDY, GREEDY], None, "2 SamplingParams for 1 prompts"),
        ([[1, 2]], GREEDY, [0, 1], "2 arrivals for 1 prompts"),
        ([[1, 2]], GREEDY, [-1], "arrivals[0]"),
    ],
)
def test_bad_request_is_refused_and_llm_keeps_serving(llm, prompts, params, arrivals, message):
    before = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(prompts, params, arrivals=arrivals)
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids == before


def test_bad_request_in_a_batch_stops_the_whole_call_before_work(llm):
    steps = llm.stats.steps
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate([[1, 2, 3], []], GREEDY)
    assert llm.stats.steps == steps  # nothing ran


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(attention="flash"), "unknown attention backend 'flash'"),
        (dict(scheduler="lottery"), "unknown scheduler 'lottery'"),
        (dict(dtype="int8"), "unknown dtype"),
        (dict(block_size=0), "block_size must be >= 1"),
        (dict(num_blocks=0), "num_blocks must be >= 1"),
        (dict(attention="triton", max_num_seqs=65536), "the triton backend decodes at most 65535 per step"),
        (dict(model="no-such-model"), "unknown model 'no-such-model'"),
    ],
)
def test_bad_engine_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(**{"model": "tiny-llama", **kwargs})


def test_unsupported_architecture_names_the_supported_ones():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(gpt2)


def test_pool_too_small_for_any_request(device):
    llm = LLM("tiny-llama", num_blocks=2, block_size=4, device=device)
    with pytest.raises(ValueError, match=r"request 0 needs 11 cache slots \(3 blocks of 4\); the pool has 2 blocks"):
        llm.generate([[1] * 7], SamplingParams(max_tokens=5))
    assert len(llm.generate([[1] * 3], SamplingParams(max_tokens=5)).pop().token_ids) >= 1


def test_cuda_without_cuda_is_an_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="CUDA is not available"):
        LLM("tiny-llama", device="cuda")
