"""e7: where a tick's time goes, per backend: torch.profiler's top ops, per tick, in extra_info."""

import pytest

from weft.benchmark import workloads
from weft.benchmark.runner import BenchConfig

pytestmark = pytest.mark.perf


@pytest.mark.parametrize("attention", ["contiguous", "paged", "triton"])
def test_e7_tick_profile(run_benchmark, sizes, model_for, attention):
    vocab = model_for(sizes.model, sizes.dtype).config.vocab_size
    workload = workloads.fixed(sizes.e7_requests, sizes.e7_prompt_len, sizes.e7_new_tokens, vocab)
    run_benchmark("e7", BenchConfig(options=dict(attention=attention)), workload, model=sizes.model, profile=True)
