"""e2: throughput against batch size (all requests at tick 0), with HF generate: eager, and on its fast path
(the static cache, whose forward it compiles on a GPU)."""

import pytest

from weft.benchmark import workloads
from weft.benchmark.runner import BenchConfig

pytestmark = pytest.mark.perf

CONFIGS = [BenchConfig(options=dict(attention=a)) for a in ("paged", "triton")] + [
    BenchConfig(engine=e) for e in ("hf_generate", "hf_generate_static")
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.id)
def test_e2_batch_sweep(run_benchmark, sizes, model_for, e2_batch, config):
    vocab = model_for(sizes.large_model, sizes.dtype).config.vocab_size
    workload = workloads.fixed(e2_batch, sizes.e2_prompt_len, sizes.e2_new_tokens, vocab)
    run_benchmark("e2", config, workload, model=sizes.large_model, S=sizes.e2_prompt_len, B=e2_batch)
