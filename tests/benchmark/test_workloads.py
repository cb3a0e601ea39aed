"""Workloads are seeded, in range, and sized as documented."""

import random
import statistics

import pytest

from weft.benchmark import workloads


def test_same_seed_same_workload_other_seed_other_tokens():
    a = workloads.uniform(8, (5, 9), (2, 4), 100, seed=1, name="a")
    assert a == workloads.uniform(8, (5, 9), (2, 4), 100, seed=1, name="a")
    assert a.prompts != workloads.uniform(8, (5, 9), (2, 4), 100, seed=2, name="a").prompts


def test_standard_workload_is_256_requests_in_100_to_1024():
    w = workloads.standard(vocab_size=1000)
    assert len(w) == 256 and w.offline
    assert all(100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.max_tokens <= 1024 for r in w.requests)
    assert all(0 <= t < 1000 for r in w.requests for t in r.prompt_token_ids)
    assert w == workloads.standard(vocab_size=1000)  # seed 0, always


def test_fixed_workload_sizes():
    w = workloads.fixed(batch=3, prompt_len=7, max_tokens=5, vocab_size=50)
    assert w.prompts and all(len(p) == 7 for p in w.prompts) and len(w) == 3
    assert (w.input_tokens, w.output_tokens, w.max_len) == (21, 15, 12)


def test_poisson_times_start_at_zero_never_go_back_and_keep_the_rate():
    times = workloads.poisson_times(4000, rate=0.5, rng=random.Random(0))
    assert times[0] == 0 and times == sorted(times)
    assert statistics.mean(b - a for a, b in zip(times, times[1:], strict=False)) == pytest.approx(2.0, rel=0.1)
    with pytest.raises(ValueError, match="rate"):
        workloads.poisson_times(3, rate=0, rng=random.Random(0))


def arrivals(w: workloads.Workload) -> list[float]:
    return [r.arrival_tick if w.clock == "ticks" else r.arrival_s for r in w.requests]


def test_arrival_stream_draws_lengths_from_the_mix_on_either_clock():
    ticks = workloads.arrival_stream(50, prompt_lengths=(4, 16), max_tokens=3, rate=1.0, vocab_size=20)
    seconds = workloads.arrival_stream(50, (4, 16), 3, 1.0, 20, clock="seconds")
    assert {len(p) for p in ticks.prompts} == {4, 16} and not ticks.offline and not seconds.offline
    assert arrivals(ticks) == sorted(arrivals(ticks)) and all(isinstance(t, int) for t in arrivals(ticks))
    # the same seed: the same prompts, and the same instants in another unit (ticks are their floors)
    assert seconds.prompts == ticks.prompts
    assert [int(t) for t in arrivals(seconds)] == arrivals(ticks) and len(set(arrivals(seconds))) == 50
    with pytest.raises(ValueError, match="unknown clock 'minutes'"):
        workloads.arrival_stream(3, (4,), 3, 1.0, 20, clock="minutes")


def test_blocks_count_every_token_but_the_last():
    w = workloads.Workload("w", (workloads.Request((1,) * 10, 7), workloads.Request((1,) * 3, 2)))
    # 16 and 4 cached tokens: 2 + 1 blocks of 8; 4 + 1 blocks of 4
    assert (w.blocks_needed(8), w.largest_request_blocks(8)) == (3, 2)
    assert (w.blocks_needed(4), w.largest_request_blocks(4)) == (5, 4)


def test_warmup_keeps_shapes_and_arrivals_and_shortens_outputs():
    w = workloads.arrival_stream(5, (3, 9), max_tokens=9, rate=1.0, vocab_size=1000)
    short = w.warmup(2)
    assert [len(p) for p in short.prompts] == [len(p) for p in w.prompts]
    assert (arrivals(short), short.clock) == (arrivals(w), w.clock)
    assert {r.max_tokens for r in short.requests} == {2}
    # each id moved to the next the workload uses: nothing the warm-up leaves in a prefix cache begins like a
    # timed prompt
    assert all(a[0] != b[0] for a, b in zip(short.prompts, w.prompts, strict=True))
    assert {t for p in short.prompts for t in p} == {t for p in w.prompts for t in p}


def test_warmup_shares_the_prefixes_the_timed_run_shares():
    """So that the warm-up runs (and compiles) the paths of the timed run's prefix-cache hits."""
    w = workloads.shared_prefix(groups=2, per_group=3, system_len=8, question_len=2, max_tokens=4, vocab_size=1000)
    short = w.warmup(2)

    def shared(prompts: list) -> list[list[bool]]:
        return [[a[:8] == b[:8] for b in prompts] for a in prompts]

    assert shared(short.prompts) == shared(w.prompts)
    assert not {tuple(p[:8]) for p in short.prompts} & {tuple(p[:8]) for p in w.prompts}


def test_shared_prefix_groups_take_turns():
    w = workloads.shared_prefix(groups=2, per_group=3, system_len=8, question_len=2, max_tokens=4, vocab_size=1000)
    assert len(w) == 6 and all(len(p) == 10 for p in w.prompts)
    systems = [tuple(p[:8]) for p in w.prompts]
    assert systems[0] == systems[2] == systems[4] != systems[1] == systems[3] == systems[5]
    assert len({tuple(p) for p in w.prompts}) == 6
