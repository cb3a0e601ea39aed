"""weft and both HF baselines, served one small mixed-length workload, produce the same tokens."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation import ContinuousBatchingConfig

from weft.benchmark import workloads
from weft.benchmark.metrics import Served
from weft.benchmark.runner import ENGINES, WARMUP_TOKENS, BenchConfig, make_driver, warmup


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)  # peaky logits: no greedy near-ties between engines
    return model


@pytest.mark.parametrize("config", [BenchConfig(engine="hf_generate"), BenchConfig(engine="hf_generate_batch")],
                         ids=lambda c: c.id)
def test_hf_baselines_match_weft_token_for_token(tiny, config):
    w = workloads.uniform(3, (3, 12), (2, 6), vocab_size=256, seed=1, name="tiny")
    cpu = torch.device("cpu")
    drivers = [make_driver(c, tiny, w, "float32", cpu, ContinuousBatchingConfig(num_blocks=4, max_batch_tokens=64))
               for c in (BenchConfig(), config)]
    try:
        weft_run, hf_run = (d.serve(w) for d in drivers)
    finally:
        for d in drivers:
            d.close()
    tokens = [[o.outputs[0].token_ids for o in run.outputs] for run in (hf_run, weft_run)]
    assert tokens[0] == tokens[1]
    for o, r in zip(hf_run.outputs, w.requests, strict=True):
        assert len(o.outputs[0].token_ids) == r.max_tokens == len(o.metrics.token_times)
        assert o.metrics.ttft > 0 and o.metrics.e2e >= o.metrics.ttft
    assert hf_run.window.makespan_s > 0


def most_decoding(served: Served) -> int:
    """The most requests decoding at once: from their first token to their finish."""
    times = [(o.metrics.first_token_time, 1) for o in served.outputs]
    times += [(o.metrics.finished_time, -1) for o in served.outputs]
    held, most = 0, 0
    for _, change in sorted(times):
        held += change
        most = max(most, held)
    return most


def test_weft_is_warmed_up_whole_and_builds_the_timed_runs_batches(tiny):
    """Two tokens a request build other batches than the timed run's: a ticks stream's requests each decode one step;
    offline, under a step budget, the first requests leave before the last prompts are in. So weft's warm-ups and
    HF's static cache's are whole; HF's dynamic peers' take WARMUP_TOKENS a request, but for a ticks stream."""
    stream = workloads.arrival_stream(12, (4, 16), max_tokens=12, rate=2.0, vocab_size=256)
    offline = workloads.uniform(12, (8, 16), (6, 10), vocab_size=256, seed=1, name="tiny")
    seconds = workloads.arrival_stream(3, (4, 16), max_tokens=12, rate=50.0, vocab_size=256, clock="seconds")
    for engine in ENGINES:
        for w in (stream, offline, seconds):
            short = engine in ("hf_generate", "hf_generate_batch") and w is not stream
            want = [min(r.max_tokens, WARMUP_TOKENS) if short else r.max_tokens for r in w.requests]
            assert [r.max_tokens for r in warmup(BenchConfig(engine=engine), w).requests] == want, (engine, w.name)
    for w, options in ((stream, {}), (offline, dict(max_num_batched_tokens=24))):
        driver = make_driver(BenchConfig(options=options), tiny, w, "float32", torch.device("cpu"))
        try:
            short, warm, timed = (driver.serve(x) for x in (w.warmup(WARMUP_TOKENS), warmup(BenchConfig(), w), w))
        finally:
            driver.close()
        assert most_decoding(short) < most_decoding(warm) == most_decoding(timed), w.name
