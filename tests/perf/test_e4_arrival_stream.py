"""e4: a stream of mixed-length requests with Poisson arrivals, per scheduler × backend, on two clocks.

- seconds: the arrival instants a server sees, the same for every engine: what a user compares.
- ticks: the seed's reproduction, arrivals counted in engine steps, so a slower engine also sees
  its requests arrive more slowly (its TTFT ratio mixes speed with a clock that bends to it).

Beside the three policies, continuous scheduling (on the session's backend) with a small step token
budget (sizes.e4_budget): a prompt is prefilled in chunks beside the running decodes, so no decode waits
behind a whole prompt (or several): the lever that trades TTFT for the ITL's tail.
"""

import pytest

from weft.benchmark import workloads
from weft.benchmark.runner import BenchConfig

pytestmark = pytest.mark.perf

CONFIGS = [
    BenchConfig(options=dict(scheduler="static", attention="contiguous")),
    BenchConfig(options=dict(scheduler="continuous", attention="paged")),
    BenchConfig(options=dict(scheduler="continuous", attention="triton")),
]


@pytest.mark.parametrize("clock", workloads.CLOCKS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.id)
def test_e4_arrival_stream(run_benchmark, sizes, model_for, config, clock):
    stream(run_benchmark, sizes, model_for, config, clock)


@pytest.mark.parametrize("clock", workloads.CLOCKS)
def test_e4_arrival_stream_in_chunks(run_benchmark, sizes, model_for, clock):
    options = dict(scheduler="continuous", attention=sizes.attention, max_num_batched_tokens=sizes.e4_budget)
    stream(run_benchmark, sizes, model_for, BenchConfig(options=options), clock)


def stream(run_benchmark, sizes, model_for, config: BenchConfig, clock: str) -> None:
    """e4's arrival stream on `clock`, served by `config`."""
    vocab = model_for(sizes.model, sizes.dtype).config.vocab_size
    rate = sizes.e4_rate if clock == "ticks" else sizes.e4_rate_per_s
    workload = workloads.arrival_stream(
        sizes.e4_requests, sizes.e4_prompt_lens, sizes.e4_new_tokens, rate, vocab, clock=clock
    )
    unit = "arrival_rate_per_tick" if clock == "ticks" else "arrival_rate_per_s"
    run_benchmark("e4", config, workload, model=sizes.model, clock=clock, **{unit: rate})
