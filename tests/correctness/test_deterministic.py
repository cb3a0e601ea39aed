"""deterministic=True (issue 33): a request's tokens and logprobs are the same bits alone and inside every
configuration weft.determinism runs (together, arriving a step apart, in a crowd, from the prefix cache, in odd
chunks, preempted, without the overlap), and over HTTP from a server process as offline; without it they are not
(the negative controls), so the gate can fail."""

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import weft.attention.triton
from tests.serve.servers import weft_server
from weft import LLM, SamplingParams
from weft.cli import engine_flags
from weft.conformance import deterministic_cases, hf_greedy, run_case
from weft.determinism import completion, determinism_params, determinism_prompts, run_gate
from weft.models.loader import resolve_model

pytestmark = pytest.mark.correctness

CPU_PROMPTS, CPU_LENGTHS, CPU_CROWD, TOKENS = 16, (5, 200), 64, 8


def gate(model, options, count, lengths, max_tokens, crowd):
    prompts = determinism_prompts(resolve_model(model).config.V, count, lengths)
    return run_gate(model, options, prompts, max_tokens, crowd)


@pytest.mark.parametrize(("attention", "dtype"), [("paged", "bfloat16"), ("contiguous", "float32")])
def test_every_request_keeps_its_bits_on_the_cpu(attention, dtype):
    results = gate("tiny-qwen3", dict(attention=attention, dtype=dtype, device="cpu", deterministic=True),
                   CPU_PROMPTS, CPU_LENGTHS, TOKENS, CPU_CROWD)
    assert [(r.label, r.identical, r.first_difference) for r in results] == [
        (r.label, CPU_PROMPTS, None) for r in results]
    assert results[-1].preemptions > 0 or attention == "contiguous"  # the small pool preempted (a row never does)


def test_each_token_keeps_its_role_on_the_cpu(monkeypatch):
    """On CUDA a prompt token and a generated one run programs of their own (`grouped_rows`), which float32 in the
    interpreter cannot tell apart: here the prompt tokens' launches scale their scores by 1 + 2^-6, so a token
    computed in the other role's launch changes its request's bits. Alone, from the prefix cache, as a conversation's
    next turn (its first turn's output now a prompt: computed again, not read from the cache, or it would differ, as
    the control without roles in the cache's hashes shows), together, in chunks of 7."""
    launch = weft.attention.triton.grouped_attention

    def scaled(q, k_cache, v_cache, table, rows, scale, out, window=None):
        return launch(q, k_cache, v_cache, table, rows, scale * (1 + 2**-6 * rows.prompt), out, window)

    monkeypatch.setattr("weft.attention.triton.grouped_attention", scaled)
    monkeypatch.setattr("weft.inference.config.available_backends", lambda device=None: ["triton"])
    options = dict(attention="triton", dtype="float32", device="cpu", deterministic=True, block_size=16)
    # 25-31 tokens: a first turn's second block holds prompt and generated tokens, and is cached full
    prompts = determinism_prompts(resolve_model("tiny-qwen3").config.V, 2, (25, 31))
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, logprobs=0, temperature=0.0)

    def each(llm: LLM, prompts: list[list[int]]) -> list:
        return [completion(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]

    with LLM("tiny-qwen3", enable_prefix_caching=False, **options) as llm:
        alone = each(llm, prompts)
        turns = [p + list(tokens) for p, (tokens, _) in zip(prompts, alone, strict=True)]
        expected = alone + each(llm, turns)
    for roles in (True, False):
        with LLM("tiny-qwen3", **options) as llm:
            llm.llm_engine.blocks.roles = roles
            got = each(llm, prompts + prompts + turns)
        same = [a == b for a, b in zip(expected + expected[:2], got[2:] + got[:2], strict=True)]
        assert all(same) == roles, (roles, same)
    with LLM("tiny-qwen3", max_num_batched_tokens=7, **options) as llm:
        together = [completion(o) for o in llm.generate(prompts + turns, params, use_tqdm=False)]
    assert together == expected


def alike_alone_and_together(model, options, count, lengths, max_tokens) -> int:
    """The negative control: of `count` requests, how many have the same completion alone and all together."""
    prompts = determinism_prompts(resolve_model(model).config.V, count, lengths)
    params = determinism_params(count, max_tokens)
    with LLM(model, enable_prefix_caching=False, **options) as llm:
        alone = [completion(llm.generate([p], sp, use_tqdm=False)[0]) for p, sp in zip(prompts, params, strict=True)]
        together = [completion(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    return sum(a == b for a, b in zip(alone, together, strict=True))


@pytest.mark.serve
def test_over_http_a_request_keeps_its_bits_process_to_process(device):
    """`weft serve --deterministic` (its own process) answers each request, sent alone and then all at once, with
    the tokens and logprobs the engine gives it offline here."""
    options = dict(attention="triton" if device.type == "cuda" else "paged", dtype="bfloat16", device=device.type,
                   deterministic=True, num_blocks=128, block_size=16, max_num_seqs=16, max_model_len=512)
    prompts = determinism_prompts(resolve_model("tiny-qwen3").config.V, 8, CPU_LENGTHS)
    params = determinism_params(len(prompts), TOKENS)
    with LLM("tiny-qwen3", **options) as llm:
        offline = [completion(llm.generate([p], sp, use_tqdm=False)[0]) for p, sp in zip(prompts, params, strict=True)]
    with weft_server("tiny-qwen3", *engine_flags(options)) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)

        def ask(i: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
            sp = params[i]
            sampled = dict(top_p=sp.top_p, seed=sp.seed) if sp.seed is not None else {}
            choice = client.completions.create(
                model="tiny-qwen3", prompt=prompts[i], max_tokens=sp.max_tokens, temperature=sp.temperature,
                logprobs=0, extra_body={"ignore_eos": True, "return_token_ids": True}, **sampled,
            ).choices[0]
            return tuple(choice.token_ids), tuple(choice.logprobs.token_logprobs)

        alone = [ask(i) for i in range(len(prompts))]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(ask, range(len(prompts))))
    assert len({tokens for tokens, _ in offline}) == len(prompts)  # eight different completions compared
    assert alone == offline
    assert together == offline


def test_without_it_requests_differ_on_the_cpu():
    alike = alike_alone_and_together("tiny-qwen3", dict(attention="paged", dtype="bfloat16", device="cpu"),
                                     CPU_PROMPTS, CPU_LENGTHS, TOKENS)
    assert alike < CPU_PROMPTS


GPU_OPTIONS = dict(attention="triton", dtype="bfloat16", max_model_len=4096)


@pytest.mark.gpu
def test_the_gate_on_the_gpu():
    """Issue 33's measurement: 48 prompts of 50-700 tokens, Qwen3-0.6B's shape in bf16, continuous x triton."""
    results = gate("qwen3-0.6b", dict(GPU_OPTIONS, deterministic=True), 48, (50, 700), 32, 256)
    for r in results:
        print(r)
    assert all(r.ok for r in results), [r for r in results if not r.ok]


@pytest.mark.gpu
def test_without_it_requests_differ_on_the_gpu():
    alike = alike_alone_and_together("qwen3-0.6b", GPU_OPTIONS, 48, (50, 700), 32)
    print(f"default engine: {alike} of 48 alike alone and together")
    assert alike < 48


def test_float32_deterministic_still_matches_hf(reference, device):
    """The HF token-exact gate's cases with deterministic=True (`weft check --deterministic` runs them all): in
    chunks, from a small pool, a second turn from the cache."""
    ref = reference("tiny-qwen3")
    cases = [c for c in deterministic_cases(device) if c.attention != "contiguous" and c.scheduler == "continuous"
             and (c.budget or c.second_turn or c.pool == "small")]
    assert cases
    for case in cases:
        result = run_case("tiny-qwen3", case, ref.prompts, ref.expected, ref.max_tokens, "float32", device,
                          ignore_eos=ref.ignore_eos,
                          reference=lambda ps: hf_greedy(ref.hf_model, ps, ref.max_tokens, ref.ignore_eos))
        assert result.ok, (case.label, [p for p in result.prompts if not p.ok], result.problems)


def test_what_cannot_keep_the_promise_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        LLM("tiny-qwen3", deterministic=True, tensor_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM("tiny-qwen3-moe", deterministic=True, device="cpu")
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        LLM("tiny-qwen3", deterministic="yes", device="cpu")


@pytest.mark.gpu
def test_on_cuda_only_the_triton_kernels_with_fused_layers_qualify():
    with pytest.raises(ValueError, match="attention='triton'"):
        LLM("tiny-qwen3", deterministic=True, attention="paged", device="cuda")
    with pytest.raises(ValueError, match="enable_fused_layers=True"):
        LLM("tiny-qwen3", deterministic=True, attention="triton", enable_fused_layers=False, device="cuda")
