"""e16: what deterministic=True costs (issue 33), in the same run on continuous×triton: e8's workload, and one
request alone (its ITL: e2's batch-1 request), each with the batch-invariant kernels and without."""

import pytest

from weft.benchmark import workloads
from weft.benchmark.runner import BenchConfig

pytestmark = pytest.mark.perf

CASES = [(kind, BenchConfig(options=dict(scheduler="continuous", attention="triton", deterministic=on)))
         for kind in ("e8", "b1") for on in (False, True)]


@pytest.mark.parametrize(("workload", "config"), CASES, ids=[f"{w}-{c.id}" for w, c in CASES])
def test_e16_deterministic(run_benchmark, sizes, model_for, workload, config):
    vocab = model_for(sizes.model, sizes.dtype).config.vocab_size
    if workload == "e8":
        load = workloads.standard(vocab, sizes.e8_requests, sizes.e8_lengths)
    else:
        load = workloads.fixed(1, sizes.e2_prompt_len, sizes.e2_new_tokens, vocab)
    run_benchmark("e16", config, load, model=sizes.model, workload_kind=workload)
