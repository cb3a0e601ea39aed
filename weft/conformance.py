"""The token-exact gate: weft's greedy tokens must equal HF `generate`'s, token for token.

One HF reference per prompt (batch 1, no padding), then every case — backend x scheduler,
a mid-flight admission run, a pool small enough to force preemptions — must reproduce it.
Used by main.py and tests/correctness alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from weft.attention import available_backends
from weft.benchmark.replay import Arrival, replay_ticks
from weft.inference.chat import chat_prompt
from weft.inference.llm import LLM
from weft.inference.outputs import RequestOutput
from weft.inference.params import SamplingParams
from weft.inference.scheduler import SCHEDULERS
from weft.models.loader import ModelSource
from weft.utils import cdiv

SHARED_PREFIX = 10  # tokens the random-id prompts begin with: two full blocks of run_case's 4
PROMPTS = [
    "What is the capital of France?",
    "hi",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers and say why each is prime.",
    "Summarize the plot of Romeo and Juliet in one paragraph, naming both families.",
]


def conformance_prompts(source: ModelSource, count: int = len(PROMPTS)) -> list[list[int]]:
    """Ragged prompts as token ids that begin alike (the prefix cache shares their first blocks):
    chat-templated PROMPTS (the template's system turn), or for a model without a tokenizer random ids
    after a common prefix of SHARED_PREFIX tokens."""
    if source.tokenizer is not None:
        return [chat_prompt(source.tokenizer, [{"role": "user", "content": p}], source.name) for p in PROMPTS[:count]]
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(0, source.config.V, (SHARED_PREFIX,), generator=gen).tolist()
    lengths = (1, 7, 30, 15, 3, 22)[:count]
    return [shared + torch.randint(0, source.config.V, (n,), generator=gen).tolist() for n in lengths]


@dataclass(frozen=True)
class Case:
    attention: str
    scheduler: str
    pool: str = "full"  # "full": every request fits at once; "small": forces preemptions
    midflight: bool = False  # requests arrive at staggered ticks
    budget: int | None = None  # max_num_batched_tokens: prompts prefilled in chunks of at most this many
    second_turn: bool = False  # then the same prompts again (wholly cached) and each extended by its answer
    overlap: bool = True  # enable_overlap: each step queued before the one before it lands
    fused_layers: bool = True  # enable_fused_layers: the layers' Triton kernels where they run (CUDA)
    deterministic: bool = False  # EngineConfig.deterministic: the batch-invariant kernels

    @property
    def label(self) -> str:
        flags = (("midflight", self.midflight), ("small-pool", self.pool == "small"),
                 (f"chunks-of-{self.budget}", self.budget is not None), ("second-turn", self.second_turn),
                 ("no-overlap", not self.overlap), ("no-fused-layers", not self.fused_layers),
                 ("deterministic", self.deterministic))
        return "/".join([self.attention, self.scheduler, *(name for name, on in flags if on)])


@dataclass
class PromptResult:
    index: int
    expected: list[int]
    got: list[int]
    expected_top: list[set[int]] | None = None  # HF's TOP likeliest tokens at each position (16-bit runs)
    got_top: list[set[int]] | None = None  # weft's

    @property
    def divergence(self) -> int | None:
        """First token index where the two differ, or None when equal."""
        for i, (a, b) in enumerate(zip(self.expected, self.got, strict=False)):
            if a != b:
                return i
        return None if len(self.expected) == len(self.got) else min(len(self.expected), len(self.got))

    @property
    def ok(self) -> bool:
        """Token-exact; or, with the top tokens of both sides (vLLM's check_logprobs_close, for 16-bit runs
        whose sums round differently), at the first difference each side's token is among the other's TOP
        likeliest, and nothing after it is compared."""
        at = self.divergence
        if at is None:
            return True
        tops = self.expected_top is not None and self.got_top is not None
        inside = at < len(self.expected) and at < len(self.got)
        return tops and inside and self.got[at] in self.expected_top[at] and self.expected[at] in self.got_top[at]


@dataclass
class CaseResult:
    case: Case
    prompts: list[PromptResult]
    preemptions: int
    problems: list[str] = field(default_factory=list)  # case-level failures (a pool that did not preempt)

    @property
    def ok(self) -> bool:
        return not self.problems and all(p.ok for p in self.prompts)


CHUNK = 5  # with blocks of 4 tokens (run_case's), chunks end mid-block
TOP = 5  # vLLM's check_logprobs_close: at a 16-bit run's first difference, each side's token in the other's top 5


def standard_cases(device: torch.device | str) -> list[Case]:
    """Every backend x scheduler usable on `device`, each with prompts in chunks too, and without the
    overlap (and on CUDA without the fused layer kernels); then mid-flight, small-pool (preemptions, also of
    half-prefilled requests) and one-token-chunk runs on paged layouts."""
    backends = available_backends(device)
    cases = [Case(a, s, budget=b) for a in backends for s in SCHEDULERS for b in (None, CHUNK)]
    cases += [Case(a, "continuous", overlap=False) for a in backends]
    if torch.device(device).type == "cuda":  # elsewhere the layers run PyTorch's ops anyway
        cases += [Case(a, "continuous", fused_layers=False) for a in backends]
    for a in backends:
        if a != "contiguous":
            cases += [Case(a, "continuous", midflight=True), Case(a, "continuous", pool="small"),
                      Case(a, "continuous", pool="small", budget=CHUNK), Case(a, "continuous", budget=1),
                      Case(a, "continuous", second_turn=True)]
    return cases


def deterministic_cases(device: torch.device | str) -> list[Case]:
    """standard_cases with deterministic=True, those whose kernels can keep its promise (on CUDA: triton, with the
    fused layers)."""
    cuda = torch.device(device).type == "cuda"
    return [replace(c, deterministic=True) for c in standard_cases(device)
            if not cuda or (c.attention == "triton" and c.fused_layers)]


def second_turn(prompts: list[list[int]], answers: list[list[int]]) -> list[list[int]]:
    """The prompts again (wholly cached now), then each extended by its answer and the next prompt's
    last three tokens: a conversation's next turn, whose earlier turns the cache holds."""
    n = len(prompts)
    return prompts + [p + a + prompts[(i + 1) % n][-3:] for i, (p, a) in enumerate(zip(prompts, answers, strict=True))]


@torch.inference_mode()
def hf_greedy(
    hf_model: Any, prompts: list[list[int]], max_tokens: int, ignore_eos: bool, top: int = 0
) -> tuple[list[list[int]], list[list[set[int]]] | None]:
    """HF greedy continuations, one prompt at a time (no padding to perturb the numbers), and with `top`
    the `top` likeliest tokens at each generated position (from HF's raw logits)."""
    eos = hf_model.generation_config.eos_token_id
    outs, tops = [], []
    for ids in prompts:
        x = torch.tensor([ids], device=hf_model.device)
        y = hf_model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens if ignore_eos else 0,
            do_sample=False,
            eos_token_id=None if ignore_eos else eos,
            pad_token_id=eos if eos is not None else 0,
            output_logits=bool(top),
            return_dict_in_generate=True,
        )
        outs.append(y.sequences[0, len(ids) :].tolist())
        if top:
            tops.append([set(step[0].float().topk(top).indices.tolist()) for step in y.logits])
    return outs, tops if top else None


def hf_reference(hf_model: Any, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> list[list[int]]:
    """HF's greedy continuations alone."""
    return hf_greedy(hf_model, prompts, max_tokens, ignore_eos)[0]


def weft_top(out: RequestOutput, top: int) -> list[set[int]]:
    """The `top` likeliest tokens at each position weft generated (it was asked for `top` logprobs)."""
    return [{t for t, lp in entry.items() if lp.rank <= top} for entry in out.outputs[0].logprobs]


def run_case(
    model: Any,
    case: Case,
    prompts: list[list[int]],
    expected: list[list[int]],
    max_tokens: int,
    dtype: str,
    device: torch.device | str,
    block_size: int = 4,
    ignore_eos: bool = False,
    progress: bool = False,
    reference: Callable[[list[list[int]]], tuple[list[list[int]], list[list[set[int]]] | None]] | None = None,
    expected_top: list[list[set[int]]] | None = None,
) -> CaseResult:
    """Serve `prompts` with a weft `LLM(model)` under `case` and compare each with `expected`.

    `model` is what `LLM` takes: a name or directory (weft reads the weights itself, as a user's
    engine would), or the in-memory reference model. `progress`: a bar while generate runs.
    `reference`: HF's `hf_greedy` of other prompts, which a second turn needs. `expected_top`: HF's
    TOP likeliest tokens at each position, for the 16-bit rule (PromptResult.ok); weft then reports its own.
    """
    turns = [prompts]
    if case.second_turn:
        longest_answer = [p + [0] * max_tokens for p in prompts]
        turns.append(second_turn(prompts, longest_answer))  # sizes the pool; the real one comes from turn 1
    longest = max(len(p) for turn in turns for p in turn) + max_tokens
    needs = [cdiv(len(p) + max_tokens - 1, block_size) for turn in turns for p in turn]  # blocks each, alone
    contiguous = case.attention == "contiguous"
    if case.pool == "small":
        # exactly the prompts' blocks (and at least the largest request's): the continuous scheduler
        # admits every prompt, and the first sequence to outgrow its blocks forces a preemption; in
        # chunks, prompts are admitted piece by piece, so the pool is the largest request's alone
        prompt_blocks = sum(cdiv(len(p), block_size) for p in prompts) if case.budget is None else 0
        num_blocks = 2 if contiguous else max(*needs, prompt_blocks)
    else:
        num_blocks = len(prompts) if contiguous else sum(needs)
    top = TOP if expected_top is not None else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos, logprobs=top)
    problems = []
    with LLM(
        model,
        attention=case.attention,
        scheduler=case.scheduler,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=longest if contiguous else None,
        max_num_batched_tokens=case.budget,
        enable_overlap=case.overlap,
        enable_fused_layers=case.fused_layers,
        deterministic=case.deterministic,
        dtype=dtype,
        device=device,
    ) as llm:
        engine = llm.llm_engine
        if case.midflight:
            arrivals = [Arrival(f"midflight-{i}", p, params, 3 * i) for i, p in enumerate(prompts)]
            outs = replay_ticks(engine, arrivals)
        else:
            outs = llm.generate(prompts, params, use_tqdm=progress)
        if case.second_turn:
            follow = second_turn(prompts, [o.outputs[0].token_ids for o in outs])
            hits = engine.stats.prefix_cache_hits
            if reference is None:
                raise ValueError("a second turn needs HF's continuations of its prompts (reference)")
            more, more_top = reference(follow[len(prompts) :])
            expected = expected + expected + more
            expected_top = expected_top + expected_top + more_top if expected_top is not None else None
            outs += llm.generate(follow, params, use_tqdm=progress)
            if engine.stats.prefix_cache_hits == hits:
                problems.append("the second turn found nothing in the prefix cache")
        preemptions = engine.stats.num_preemptions
        # a model windowed in every layer gives blocks back as it goes: no pool of its requests' prompts forces one
        windowed = engine.blocks.window is not None
    results = []
    for i, (e, out) in enumerate(zip(expected, outs, strict=True)):
        tops = (expected_top[i], weft_top(out, TOP)) if expected_top is not None else (None, None)
        results.append(PromptResult(i, e, out.outputs[0].token_ids, *tops))
    result = CaseResult(case, results, preemptions, problems)
    forced = (case.pool == "small" and case.scheduler == "continuous" and not contiguous and not case.midflight
              and not windowed)
    if forced and result.preemptions == 0:
        result.problems.append(f"a pool of {num_blocks} blocks forced no preemption")
    return result


def report_lines(result: CaseResult, decode) -> Iterator[str]:
    """One line per prompt: OK, or FAIL with the divergence position and both continuations."""
    for p in result.prompts:
        head = f"[{result.case.label}] prompt {p.index}"
        at = p.divergence
        if at is None:
            yield f"{head} OK ({len(p.got)} tokens)"
        elif p.ok:
            yield f"{head} OK (token-exact for {at} tokens, then each side's pick in the other's top {TOP})"
        else:
            yield (f"{head} FAIL at token {at}: hf={decode(p.expected[at:])!r} weft={decode(p.got[at:])!r}")
    for problem in result.problems:
        yield f"[{result.case.label}] FAIL: {problem}"
