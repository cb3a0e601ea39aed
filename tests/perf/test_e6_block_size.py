"""e6: block size P of the paged pool, from 8 to 256 tokens (full pool, all requests at tick 0)."""

import pytest

from weft.benchmark import workloads
from weft.benchmark.runner import BenchConfig

pytestmark = pytest.mark.perf


@pytest.mark.parametrize("attention", ["paged", "triton"])
def test_e6_block_size(run_benchmark, sizes, model_for, e6_block_size, attention):
    vocab = model_for(sizes.model, sizes.dtype).config.vocab_size
    new = (sizes.e6_new_tokens,) * 2
    workload = workloads.uniform(sizes.e6_requests, sizes.e6_prompt_range, new, vocab, seed=0, name="e6")
    config = BenchConfig(options=dict(attention=attention, block_size=e6_block_size))
    run_benchmark("e6", config, workload, model=sizes.model)
