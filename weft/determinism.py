"""The determinism gate (EngineConfig.deterministic): every request run alone, then inside each configuration
of `scenarios`; its tokens and logprobs must be the same bits in all of them.

Half the requests are greedy and half sampled with a seed of their own (a seeded draw depends on its seed and
position only), each asking for its tokens' logprobs. The alone runs are the reference: one engine, one request
at a time, each prompt computed whole. Used by `weft check --deterministic` and tests/correctness alike.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from weft.benchmark.replay import Arrival, replay_ticks
from weft.inference.llm import LLM
from weft.inference.outputs import RequestOutput
from weft.inference.params import SamplingParams
from weft.utils import cdiv

Completion = tuple[tuple[int, ...], tuple[float, ...]]  # a request's tokens and each one's logprob
GATE_PROMPTS, GATE_LENGTHS = 48, (50, 700)  # `weft check --deterministic`'s prompts (issue 33's measurement)
CROWD = 256  # the requests a scenario runs beside each other, by default (1-256 is what deterministic promises)


def determinism_prompts(V: int, count: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    """`count` prompts of random ids below V, their lengths uniform in `lengths` (both ends included)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, V) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def determinism_params(count: int, max_tokens: int) -> list[SamplingParams]:
    """Request i's params: even i greedy, odd i sampled (temperature, top_p) with seed i; all with logprobs."""
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0, temperature=0.0) if i % 2 == 0 else
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0, temperature=0.8, top_p=0.95, seed=i)
            for i in range(count)]


@dataclass(frozen=True)
class Scenario:
    """A way to serve the prompts: `options` over the engine's, and `how` they arrive."""

    label: str
    how: str  # "together": one generate; "arrivals": two per step; "crowd": beside others, up to CROWD; "cached":
    # each alone again, its prompt read from the prefix cache the alone runs filled
    options: dict[str, Any] = field(default_factory=dict)


def scenarios(prompts: list[list[int]], max_tokens: int, block_size: int = 16, on_cuda: bool = False,
              crowd: int = CROWD, rows: bool = False) -> list[Scenario]:
    """What a request's bits must not depend on: its batch (all together; arriving two a step; among `crowd`), its
    prompt read from the cache, in chunks of an odd size, preempted from a pool of the longest request's blocks
    and a half (two rows where a request owns a row, `rows`: it waits for one instead), with the overlap off (and
    on CUDA without CUDA graphs)."""
    longest = max(cdiv(len(p) + max_tokens, block_size) for p in prompts)
    squeezed = dict(max_num_batched_tokens=37, num_blocks=2 if rows else longest * 3 // 2, block_size=block_size,
                    enable_overlap=False)
    if on_cuda:
        squeezed["enforce_eager"] = True
    return [Scenario("together", "together"), Scenario("arrivals", "arrivals"),
            Scenario(f"among {crowd}", "crowd", dict(max_num_seqs=crowd)), Scenario("cached", "cached"),
            Scenario("chunks of 37, small pool, no overlap" + (", eager" if on_cuda else ""), "together", squeezed)]


@dataclass
class ScenarioResult:
    label: str
    identical: int  # requests whose tokens and logprobs are the reference's bits
    total: int
    first_difference: str | None  # the first request that differs, and where
    preemptions: int

    @property
    def ok(self) -> bool:
        return self.identical == self.total


def completion(out: RequestOutput) -> Completion:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(next(iter(entry.values())).logprob for entry in c.logprobs)


def _difference(i: int, want: Completion, got: Completion) -> str:
    (wt, wl), (gt, gl) = want, got
    at = next((j for j, (a, b) in enumerate(zip(wt, gt, strict=False)) if a != b), None)
    if at is not None:
        return f"request {i}: token {at} is {gt[at]}, alone {wt[at]}"
    at = next(j for j, (a, b) in enumerate(zip(wl, gl, strict=True)) if a != b)
    return f"request {i}: same tokens, logprob {at} is {gl[at]!r}, alone {wl[at]!r} (differs by {gl[at] - wl[at]:.3g})"


def run_gate(model: Any, options: dict[str, Any], prompts: list[list[int]], max_tokens: int, crowd: int = CROWD,
             report: Callable[[ScenarioResult], None] = lambda r: None) -> list[ScenarioResult]:
    """Serve `prompts` alone with LLM(model, **options), then in every scenario (`crowd` requests at once in one)
    -> how many kept their bits in each (`report` is told of each as it finishes)."""
    params = determinism_params(len(prompts), max_tokens)
    results = []
    with LLM(model, **options) as llm:
        reference = [completion(llm.generate([p], sp, use_tqdm=False)[0]) for p, sp in zip(prompts, params,
                                                                                        strict=True)]
        config = llm.llm_engine.config
        cached = [completion(llm.generate([p], sp, use_tqdm=False)[0]) for p, sp in zip(prompts, params,
                                                                                     strict=True)]
    block_size = options.get("block_size", 16)
    for scenario in scenarios(prompts, max_tokens, block_size, config.device.type == "cuda", crowd,
                              config.backend.row_per_request):
        preemptions = 0
        if scenario.how == "cached":
            got = cached
        else:
            with LLM(model, **{**options, **scenario.options}) as llm:
                got = _serve(llm, scenario.how, prompts, params, max_tokens, crowd)
                preemptions = llm.llm_engine.stats.num_preemptions
        same = [i for i, (a, b) in enumerate(zip(reference, got, strict=True)) if a == b]
        first = next((_difference(i, reference[i], got[i]) for i in range(len(prompts)) if i not in same), None)
        results.append(ScenarioResult(scenario.label, len(same), len(prompts), first, preemptions))
        report(results[-1])
    return results


def _serve(llm: LLM, how: str, prompts: list[list[int]], params: list[SamplingParams], max_tokens: int,
           crowd: int) -> list[Completion]:
    """The prompts' completions, served as `how` says (see Scenario)."""
    if how == "together":
        return [completion(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    arrivals = [Arrival(i, p, sp, i // 2) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    if how == "crowd":  # others before, between and after them, greedy and seeded
        others = determinism_prompts(llm.llm_engine.model_config.V, crowd - len(prompts), (1, 300), seed=1)
        extra = determinism_params(len(others), max_tokens)
        arrivals = sorted(arrivals + [Arrival(f"other-{j}", p, sp, j % 7) for j, (p, sp) in
                                      enumerate(zip(others, extra, strict=True))], key=lambda a: a.at)
    outs = {o.request_id: o for o in replay_ticks(llm.llm_engine, arrivals)}
    return [completion(outs[i]) for i in range(len(prompts))]
