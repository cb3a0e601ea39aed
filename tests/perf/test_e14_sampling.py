"""e14: what vLLM's sampling fields cost, in the same run on continuous×triton: e8's workload greedy and with
temperature, top-k, top-p, min-p and the three penalties; n=4 against n=1 on 64 of its prompts."""

import pytest

from weft.benchmark import workloads
from weft.benchmark.runner import BenchConfig

pytestmark = pytest.mark.perf

TRITON = dict(scheduler="continuous", attention="triton")
CASES = [
    ("e8", BenchConfig(options=TRITON)),
    ("e8", BenchConfig(options=TRITON, sampling="sampled")),
    ("n", BenchConfig(options=TRITON, sampling="n1")),
    ("n", BenchConfig(options=TRITON, sampling="n4")),
]


@pytest.mark.parametrize(("workload", "config"), CASES, ids=[f"{w}-{c.id}" for w, c in CASES])
def test_e14_sampling(run_benchmark, sizes, model_for, workload, config):
    vocab = model_for(sizes.model, sizes.dtype).config.vocab_size
    count = sizes.e8_requests if workload == "e8" else min(64, sizes.e8_requests)
    run_benchmark("e14", config, workloads.standard(vocab, count, sizes.e8_lengths), model=sizes.model,
                  workload_kind=workload)
