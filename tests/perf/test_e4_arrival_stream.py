"""e4: a stream of mixed-length requests with Poisson arrivals (in engine ticks), per scheduler × backend."""

import pytest

from weft.benchmark import workloads
from weft.benchmark.runner import RunConfig

pytestmark = pytest.mark.perf

CONFIGS = [
    RunConfig(scheduler="static", attention="contiguous"),
    RunConfig(scheduler="continuous", attention="paged"),
    RunConfig(scheduler="continuous", attention="triton"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.id)
def test_e4_arrival_stream(run_benchmark, sizes, model_for, config):
    vocab = model_for(sizes.model, sizes.dtype).config.vocab_size
    workload = workloads.arrival_stream(
        sizes.e4_requests, sizes.e4_prompt_lens, sizes.e4_new_tokens, sizes.e4_rate, vocab
    )
    run_benchmark("e4", config, workload, model=sizes.model, arrival_rate_per_tick=sizes.e4_rate)
