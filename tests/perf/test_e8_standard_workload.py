"""e8: the standard serving workload (256 requests, prompt and output lengths each U[100, 1024],
seed 0, ignore_eos) for weft's configurations and both HF baselines, in the same run."""

import dataclasses

import pytest

from weft.benchmark import workloads
from weft.benchmark.runner import BenchConfig

pytestmark = pytest.mark.perf

CONFIGS = [
    BenchConfig(options=dict(scheduler="static", attention="contiguous")),
    BenchConfig(options=dict(scheduler="continuous", attention="paged")),
    BenchConfig(options=dict(scheduler="continuous", attention="triton")),
    # what the cache costs unshared
    BenchConfig(options=dict(scheduler="continuous", attention="triton", enable_prefix_caching=False)),
    BenchConfig(engine="hf_generate"),
    BenchConfig(engine="hf_generate_batch"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.id)
def test_e8_standard_workload(run_benchmark, sizes, model_for, config):
    vocab = model_for(sizes.model, sizes.dtype).config.vocab_size
    workload = workloads.standard(vocab, sizes.e8_requests, sizes.e8_lengths)
    if config.engine == "hf_generate":
        config = dataclasses.replace(config, hf_batch_size=sizes.hf_batch_size)
    run_benchmark("e8", config, workload, model=sizes.model)
