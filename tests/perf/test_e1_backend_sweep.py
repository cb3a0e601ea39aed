"""e1: attention backends against prompt length (batch 4, 128 new tokens), with HF generate."""

import pytest

from weft.benchmark import workloads
from weft.benchmark.runner import BenchConfig

pytestmark = pytest.mark.perf

BACKENDS = ("contiguous", "paged", "triton")
CONFIGS = [BenchConfig(options=dict(attention=a)) for a in BACKENDS] + [BenchConfig(engine="hf_generate")]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.id)
def test_e1_backend_sweep(run_benchmark, sizes, model_for, e1_prompt_len, config):
    vocab = model_for(sizes.large_model, sizes.dtype).config.vocab_size
    workload = workloads.fixed(sizes.e1_batch, e1_prompt_len, sizes.e1_new_tokens, vocab)
    run_benchmark("e1", config, workload, model=sizes.large_model, S=e1_prompt_len, B=sizes.e1_batch)
