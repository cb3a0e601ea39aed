"""e16: what deterministic=True costs (issue 33), in the same run on continuous×triton: e8's workload, and one
request alone (its ITL: e2's batch-1 request), each with the batch-invariant kernels and without, on the model and
the large model (Qwen3-0.6B and Qwen3-4B on the GPU)."""

import pytest

from weft.benchmark import workloads
from weft.benchmark.runner import BenchConfig

pytestmark = pytest.mark.perf

CASES = [(kind, BenchConfig(options=dict(scheduler="continuous", attention="triton", deterministic=on)))
         for kind in ("e8", "b1") for on in (False, True)]


@pytest.mark.parametrize("shape", ["model", "large_model"])
@pytest.mark.parametrize(("workload", "config"), CASES, ids=[f"{w}-{c.id}" for w, c in CASES])
def test_e16_deterministic(run_benchmark, sizes, model_for, workload, config, shape):
    model = getattr(sizes, shape)
    if shape == "large_model" and model == sizes.model:
        pytest.skip(f"these sizes' large model is the model ({model}), measured already")
    vocab = model_for(model, sizes.dtype, alone=True).config.vocab_size
    if workload == "e8":
        load = workloads.standard(vocab, sizes.e8_requests, sizes.e8_lengths)
    else:
        load = workloads.fixed(1, sizes.e2_prompt_len, sizes.e2_new_tokens, vocab)
    run_benchmark("e16", config, load, model=model, workload_kind=workload)
