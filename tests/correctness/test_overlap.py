"""The overlap (enable_overlap): step k+1 is planned and queued before step k lands. Its outputs come
one step late and hold HF's tokens; a request that stops while a step is in flight runs that step, its
token dropped; a step asking for logprobs lands at once."""

from __future__ import annotations

import pytest

from weft import LLM, RequestOutputKind, SamplingParams

pytestmark = pytest.mark.correctness


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def tiny_llm(device, overlap: bool) -> LLM:
    return LLM("tiny-llama", num_blocks=64, block_size=4, device=device, enable_overlap=overlap)


def test_outputs_land_one_step_late_with_the_same_tokens(reference, device):
    ref = reference("tiny-llama")
    steps = {}
    for overlap in (False, True):
        with tiny_llm(device, overlap) as llm:
            engine = llm.llm_engine
            for i, prompt in enumerate(ref.prompts[:3]):
                engine.add_request(i, prompt, greedy(ref.max_tokens, output_kind=RequestOutputKind.DELTA))
            steps[overlap] = []
            while engine.has_unfinished_requests():
                steps[overlap].append([(o.request_id, o.outputs[0].token_ids) for o in engine.step()])
            assert engine.in_flight is None
            assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks
    assert steps[True][0] == []  # the first step is still on the device when the call returns
    assert steps[True][1:] == steps[False]
    tokens = {i: [] for i in range(3)}
    for step in steps[True]:
        for i, ids in step:
            tokens[i] += ids
    assert list(tokens.values()) == ref.expected[:3]


def test_a_stop_while_a_step_is_in_flight_drops_that_steps_token(reference, device):
    ref = reference("tiny-llama")
    answer = ref.expected[0]
    at = next(i for i in range(2, len(answer)) if answer[i] not in answer[:i])  # its first occurrence
    params = [greedy(ref.max_tokens, stop_token_ids=[answer[at]]), greedy(ref.max_tokens)]
    runs = {}
    for overlap in (False, True):
        with tiny_llm(device, overlap) as llm:
            outs = llm.generate(ref.prompts[:2], params, use_tqdm=False)
            runs[overlap] = ([(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                              for o in outs], llm.llm_engine.stats.decode_tokens)
            assert llm.llm_engine.scheduler.blocks.num_free == 64
    want = [(answer[: at + 1], "stop", answer[at]), (ref.expected[1], "length", None)]
    assert runs[True][0] == runs[False][0] == want
    assert runs[True][1] == runs[False][1] + 1  # the stopped request's step in flight, its token dropped


def test_a_step_asking_for_logprobs_lands_at_once(reference, device):
    ref = reference("tiny-llama")
    with tiny_llm(device, True) as llm:
        engine = llm.llm_engine
        engine.add_request("plain", ref.prompts[0], greedy(4))
        assert engine.step() == []  # in flight
        engine.add_request("scored", ref.prompts[1], greedy(4, logprobs=2))
        outs = engine.step()  # the step before lands, then this one (it computed its logprobs)
        assert [(o.request_id, len(o.outputs[0].token_ids)) for o in outs] == [("plain", 1), ("plain", 2),
                                                                             ("scored", 1)]
        assert len(outs[2].outputs[0].logprobs) == 1
