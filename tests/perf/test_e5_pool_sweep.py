"""e5: the pool shrunk to a fraction of what holds every request at once.

Throughput, preemptions and recomputed tokens per fraction, and the greedy tokens must be
those of the unpressured run: preemption may cost time, never change an answer. Float32
and a peaky head keep reordered sums from flipping near-tied greedy picks.
"""

import pytest

from weft.benchmark import workloads
from weft.benchmark.runner import BenchConfig, make_driver, release

pytestmark = pytest.mark.perf

DTYPE = "float32"
LOGIT_GAIN = 8.0


@pytest.fixture(scope="module")
def e5_workload(sizes, model_for):
    vocab = model_for(sizes.model, DTYPE, LOGIT_GAIN).config.vocab_size
    lengths = sizes.e5_prompt_range
    return workloads.uniform(sizes.e5_requests, lengths, (sizes.e5_new_tokens,) * 2, vocab, seed=0, name="e5")


@pytest.fixture(scope="module")
def unpressured_tokens(sizes, model_for, device, e5_workload):
    model = model_for(sizes.model, DTYPE, LOGIT_GAIN)
    driver = make_driver(BenchConfig(options=dict(attention=sizes.attention)), model, e5_workload, DTYPE, device)
    tokens = [o.outputs[0].token_ids for o in driver.serve(e5_workload).outputs]
    driver.close()
    del driver
    release(device)
    return tokens


def test_e5_pool_sweep(run_benchmark, sizes, e5_workload, unpressured_tokens, e5_fraction):
    config = BenchConfig(options=dict(attention=sizes.attention), pool_fraction=e5_fraction)
    served = run_benchmark(
        "e5", config, e5_workload, model=sizes.model, dtype=DTYPE, logit_gain=LOGIT_GAIN,
        full_pool_blocks=e5_workload.blocks_needed(config.setting("block_size")),
    )
    differ = [i for i, o in enumerate(served.outputs) if o.outputs[0].token_ids != unpressured_tokens[i]]
    assert not differ, f"requests {differ} got other tokens than in the unpressured run"
