"""e11: requests that share long prefixes (SGLang's generated-shared-prefix shape: a few groups, a long
system prompt each, short questions), with the prefix cache on and off: TTFT, throughput, hit rate."""

import pytest

from weft.benchmark import workloads
from weft.benchmark.runner import BenchConfig

pytestmark = pytest.mark.perf


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
def test_e11_shared_prefix(run_benchmark, sizes, model_for, caching):
    vocab = model_for(sizes.model, sizes.dtype).config.vocab_size
    workload = workloads.shared_prefix(sizes.e11_groups, sizes.e11_per_group, sizes.e11_system_len,
                                       sizes.e11_question_len, sizes.e11_new_tokens, vocab)
    config = BenchConfig(options=dict(attention=sizes.attention, enable_prefix_caching=caching,
                                      max_num_batched_tokens=sizes.e11_budget))
    served = run_benchmark("e11", config, workload, model=sizes.model, shared_fraction=sizes.e11_system_len
                           / (sizes.e11_system_len + sizes.e11_question_len))
    rate = served.prefix_cache_hit_rate
    assert (rate > 0) if caching else rate == 0, rate
